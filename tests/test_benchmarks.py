"""Smoke test of the benchmark runner: its cheapest section (tiny spoken-LM ms/token, cached vs no
cache) through ``benchmarks/run_all.py`` into a temporary folder; the markdown must hold the
table with measured figures, the plot and the machine facts."""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import run_all  # noqa: E402


def test_quick_lm_section_writes_tables_with_figures(tmp_path):
    out = tmp_path / "BENCH.md"
    assert run_all.main(["--quick", "--sections", "lm", "--threads", "1", "--out", str(out),
                         "--results", str(tmp_path / "results")]) == 0
    text = out.read_text()
    assert "## 2. Spoken-LM ms per generated token" in text
    assert "- CPU:" in text and "- torch " in text and "- date:" in text
    rows = [line for line in text.splitlines() if line.startswith("| tiny |")]
    assert [int(line.split("|")[2]) for line in rows] == list(run_all.QUICK.lm_contexts)
    for line in rows:
        prefill, cached, no_cache, speedup = (float(c) for c in line.split("|")[3:7])
        assert prefill > 0 and cached > 0 and no_cache > 0
        assert abs(speedup - no_cache / cached) < 0.05 * speedup + 0.01  # the ratio of the two columns shown
    link = re.search(r"!\[[^]]*\]\(([^)]+\.png)\)", text).group(1)
    assert (out.parent / link).is_file()
    assert (tmp_path / "results" / "bench.json").is_file()


def test_soak_report_goes_into_benchmarks_md_once(tmp_path):
    from benchmarks import soak

    results = tmp_path / "results"
    results.mkdir()
    (results / "soak.md").write_text("# Soak: load and long call\n\n| a |\n|---|\n| 1 |\n\n![RSS over time](soak_rss.png)\n")
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\n## 5. GPU\n\ntext\n")
    soak.update_benchmarks_md(doc, results)
    soak.update_benchmarks_md(doc, results)  # replaces its section, never appends a second one
    text = doc.read_text()
    assert text.count(soak.SECTION) == 1 and text.startswith("# Benchmarks\n\n## 5. GPU\n\ntext\n\n" + soak.SECTION)
    assert f"]({results}/soak_rss.png)" in text and "| 1 |" in text
