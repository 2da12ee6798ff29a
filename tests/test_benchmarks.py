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
    section_2 = text.split("## 2. ", 1)[1].split("\n## ", 1)[0]  # (later sections have tiny rows too)
    rows = [line for line in section_2.splitlines() if line.startswith("| tiny |")]
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


def test_soak_markdown_rows():
    """Per-minute peaks, the compute gate and the event-loop lag per row; rows measured before the
    gate and the lag monitor existed say so; the memory-rounds and trim-cost tables."""
    from benchmarks import soak

    row = {"transport": "webrtc", "calls_at_once": 8, "minutes": 2, "calls_finished": 9, "crashes": 0, "timed_out": 0,
           "connections_lost": 0, "audio_intact": True, "baseline_rss_mb": 400.0, "peak_rss_mb": 700.0,
           "memory_slope_mb_per_min": 1.5, "first_audio_ms_median": 1234.4, "first_audio_ms_p90": 2000.26,
           "rss_mb": [[0, 400.0], [30, 650.0], [61, 700.0], [119, 690.0]], "command": "c", "date": "d",
           "compute_gate": {"slots": 2}, "loop_lag_ms_p99": 33.9, "loop_lag_ms_max": 399.7}
    old = {k: v for k, v in row.items() if k not in ("compute_gate", "loop_lag_ms_p99", "loop_lag_ms_max")}
    rounds = {"calls_at_once": 8, "command": "c", "date": "d", "rounds": [
        {"round": 0, "calls": 0, "crashes": 0, "peak_rss_mb": None, "rss_mb": 430.0, "heap_in_use_mb": 140.0,
         "free_in_heap_mb": 3.0, "python_objects": 1000, "tensors": 10, "tensor_mb": 27.0},
        {"round": 1, "calls": 8, "crashes": 0, "peak_rss_mb": 620.0, "rss_mb": 470.0, "heap_in_use_mb": 140.5,
         "free_in_heap_mb": 45.0, "python_objects": 1001, "tensors": 10, "tensor_mb": 27.0}]}
    trim = {"calls_at_once": 8, "rounds": 3, "trims": 24, "trim_ms_median": 3.8, "trim_ms_max": 20.5, "command": "c",
            "date": "d", "trim_loop_lag_ms_p50": 1.7, "trim_loop_lag_ms_p99": 23.4, "trim_loop_lag_ms_max": 351.9,
            "trim_crashes": 0, "trim_audio_intact": True, "no_trim_loop_lag_ms_p50": 2.1, "no_trim_loop_lag_ms_p99": 30.7,
            "no_trim_loop_lag_ms_max": 355.3, "no_trim_crashes": 1, "no_trim_audio_intact": False}
    text = soak.markdown({"load_webrtc_8": row, "load_webrtc_8_jobs_none": old, "memory_rounds": rounds,
                          "trim_cost": trim}, {})
    lines = [line for line in text.splitlines() if line.startswith("| webrtc")]
    assert "| 2 | 400.0 | 700.0 | 650 / 700 | 1.5 | 1234 | 2000 | 34 / 400 |" in lines[0]
    assert "| none | " in lines[1] and "| not measured |" in lines[1]
    assert "| before | 0 | 0 | - | 430.0 | 140.0 | 3.0 | 1000 | 10 (27.0) |" in text
    assert "| 1 | 8 | 0 | 620.0 | 470.0 | 140.5 | 45.0 | 1001 | 10 (27.0) |" in text
    assert "24 trims took 3.8 ms (median), 20.5 ms at most" in text
    assert "| a trim after each call | 1.7 | 23.4 | 351.9 | 0 | True |" in text
    assert "| no trim (baseline) | 2.1 | 30.7 | 355.3 | 1 | False |" in text


def test_batched_steps_benchmark_measures_both_ways_and_keeps_its_section(tmp_path):
    from benchmarks import bench_batched_steps, report

    rows = bench_batched_steps.measure(["tiny"], [1, 2], steps=4, log=lambda line: None)
    assert [(r["decoder"], r["calls"]) for r in rows] == [("spoken LM", 1), ("spoken LM", 2),
                                                          ("speech decoder", 1), ("speech decoder", 2),
                                                          ("flow + vocoder", 1), ("flow + vocoder", 2)]
    for r in rows:
        assert r["alone_ms_per_step"] > 0 and r["batched_ms_per_step"] > 0 and r["mean_batch"] >= 1
        assert abs(r["throughput_ratio"] - r["batched_steps_per_s"] / r["alone_steps_per_s"]) < 1e-9
        assert abs(r["batched_steps_per_s"] - r["calls"] * 1000 / r["batched_ms_per_step"]) < 1e-6
    assert rows[0]["mean_batch"] == rows[2]["mean_batch"] == rows[4]["mean_batch"] == 1.0  # one call: alone
    results = tmp_path / "results"
    bench_batched_steps.write_results(rows, "python benchmarks/bench_batched_steps.py", report.machine_facts(), results)
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\n## 4. Concurrency\n\nfour\n\n## 4b. An older title\n\nstale figures\n\n## 5. GPU\n\nfive\n")
    for _ in range(2):  # in place of the older section 4b, before section 5, once
        bench_batched_steps.update_benchmarks_md(doc, results)
    text = doc.read_text()
    assert text.count(bench_batched_steps.SECTION) == 1 and text.count("| tiny | speech decoder | 2 |") == 1
    assert text.index("four") < text.index(bench_batched_steps.SECTION) < text.index("## 5. GPU") < text.index("five")
    assert "stale figures" not in text and text.count("## 4b. ") == 1


def test_early_reply_benchmark_table_and_sections_keep_their_order(tmp_path):
    """The early-reply table compares the two ways of one transcript source, and the sections
    measured by their own commands (4b, 6, 7) each replace their old text, in order."""
    from benchmarks import bench_batched_steps, bench_early_reply, report, soak

    rows = [{"transcripts": "auto", "way": way, "calls": 2, "replies_heard": 8, "utterances": 8,
             "first_audio_ms": [], "median_ms": median, "min_ms": median - 50.0, "max_ms": median + 50.0,
             "underruns": 1, "early_replies": early, "early_turns_retracted": early // 4, "errors": 0, "intact": True}
            for way, median, early in (("VAD end", 1000.0, 0), ("early", 800.0, 8))]
    rows[1].update(saved_ms=200.0, ratio=report.ratio(1000.0, 800.0))
    lines = bench_early_reply.markdown(rows)
    assert "| simulated STT (+300 ms) | early | 2 | 8/8 | 800.0 | 750.0 | 850.0 | 200.0 | 1.25x | 1 | 8 | 2 | 0 | yes |" \
        in lines
    results = tmp_path / "results"
    bench_early_reply.write_results(rows, "python benchmarks/bench_early_reply.py", report.machine_facts(), results)
    (results / "soak.md").write_text("# Soak\n\nsoak figures\n")
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\n## 5. GPU\n\nfive\n\n## 6. Soak: old\n\nold soak\n\n## 7. Early: old\n\nold early\n")
    for _ in range(2):
        report.replace_section(doc, bench_early_reply.SECTION_NUMBER, bench_early_reply.benchmarks_section(results))
        soak.update_benchmarks_md(doc, results)
        bench_batched_steps.update_benchmarks_md(doc, results)  # no results: only removes an old 4b
    text = doc.read_text()
    assert "old soak" not in text and "old early" not in text and "## 4b. " not in text
    assert text.index("five") < text.index(soak.SECTION) < text.index("soak figures") < text.index(
        bench_early_reply.SECTION) < text.index("| early |")
    assert text.count(bench_early_reply.SECTION) == 1 and text.count(soak.SECTION) == 1


def test_flow_windows_benchmark_measures_both_changes_against_their_baselines():
    """bench_flow_windows at tiny size: on the grid the streamed mel is closer to offline than off
    it, and widened windows dispatch fewer operators per second of audio with one padded window."""
    from benchmarks import bench_flow_windows
    from benchmarks.bench_chunk_growth import load

    vg = load("tiny")
    (row,) = bench_flow_windows.grid_rows(vg, seconds=3.0, policies=("low_latency",))
    assert row["on_grid"]["mel_dist_elsewhere"] < row["off_grid"]["mel_dist_elsewhere"]
    narrow = bench_flow_windows.reply_figures(vg, 5.0, ())
    wide = bench_flow_windows.reply_figures(vg, 5.0, None)
    assert narrow["chunks"] == wide["chunks"] == wide["flow_windows"]
    assert wide["padded_flow_windows"] == 1 < narrow["padded_flow_windows"]
    assert wide["ops_per_audio_s"] < 0.8 * narrow["ops_per_audio_s"]


def test_segment_operator_benchmark_splits_each_segment_into_its_start_and_its_steps(capsys):
    """bench_segment_ops at tiny size: a row per segment, one decode step per speech token (and
    one for the end), the same operators in every step, some operators outside them (the
    segment's prefix and feeds) and no reads outside them (the draws are the steps')."""
    from benchmarks import bench_segment_ops

    assert bench_segment_ops.main(["--size", "tiny", "--segments", "2"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()
            if re.match(r"\| \d+ \|", line)]
    assert [int(r[0]) for r in rows] == [0, 1]
    for _, tokens, steps, per_step, outside, reads in rows:
        assert int(tokens) > 0 and int(steps) in (int(tokens), int(tokens) + 1)
        assert int(per_step) > 10 and int(outside) > 0 and int(reads) == 0


def test_tower_text_benchmark_counts_what_one_replay_takes_over(model, processor):
    """bench_tower_text at tiny size: the same codes both ways (it asserts so), the eager text side's
    host reads gone with the pooler, and most of its operators inside the pooler's one step."""
    from benchmarks import bench_tower_text

    f = bench_tower_text.figures(model, processor, 3.0, "hello there could you tell me what time it is", repeats=1)
    eager, pooler = f["eager"], f["pooler"]
    assert eager["host_reads"] >= 3 and pooler["host_reads"] == 0
    assert 0.4 * eager["ops"] < pooler["in_step"] < eager["ops"] and f["bucket"] >= f["whisper_tokens"] + 5
    assert eager["cpu_ms"] > 0 and pooler["cpu_ms"] > 0


def test_encoder_attention_benchmark_times_both_ways_and_leaves_the_tower_fused(model):
    """bench_encoder_attention on the tiny tower, two rows: both computations timed, their outputs
    near each other but not one computation run twice, and the tower fused again after."""
    from benchmarks import bench_encoder_attention

    tower = model.audio_tower
    r = bench_encoder_attention.measure(tower, rows=2, repeats=1)
    assert r["rows"] == 2 and r["layers"] == len(tower.encoder.layers)
    assert r["scores_written_ms"] > 0 and r["fused_ms"] > 0 and 0 < r["max_diff"] < 1e-4
    assert tower.fused_encoder_attention


def test_step_reads_benchmark_counts_one_read_per_decode_step(taste_lm_tiny_a, capsys):
    """bench_step_reads on this checkout: the chosen token is the only value a step reads back."""
    from benchmarks import bench_step_reads

    assert bench_step_reads.main(["--golden", str(taste_lm_tiny_a)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| greedy", "| top-p"))]
    assert len(rows) == 2 and all(row.split(" | ")[2] == "1.00" for row in rows), rows


def test_regenerating_keeps_the_sections_it_did_not_measure(tmp_path):
    """run_all rewrites the sections it measures; a GPU section measured elsewhere, the sections
    other commands wrote (8 onwards) and the sections left out of --sections stay, in order."""
    out = tmp_path / "BENCH.md"
    out.write_text("# Benchmarks\n\nold intro\n\n## 1. First audio\n\nold one\n\n## 2. Spoken-LM\n\nold two\n\n"
                   "## 5. GPU\n\n### H100\n\n| measured | 183.0 |\n\n## 10. Flow windows\n\n| ten | 0.71 |\n\n"
                   "```\n## not a title\n```\n\nafter the code\n")
    assert run_all.main(["--quick", "--sections", "lm", "--threads", "1", "--out", str(out),
                         "--results", str(tmp_path / "results")]) == 0
    text = out.read_text()
    assert "old two" not in text and "old intro" not in text  # measured again / written again
    assert "old one" in text and "| measured | 183.0 |" in text and "| ten | 0.71 |" in text
    assert "Sections 1 were not measured by this run" in text or "Sections 1, " in text
    assert text.rstrip().endswith("```\n## not a title\n```\n\nafter the code")  # a code block is not a title
    titles = [line for line in text.splitlines() if run_all.SECTION_TITLE.match(line)]
    numbers = [run_all.section_number([title]) for title in titles]
    assert numbers[:2] == ["1", "2"] and "5" in numbers and numbers[-1] == "10", numbers
    assert numbers == sorted(numbers, key=run_all.section_order)  # (4b, 6, 7: from their saved results)
    assert all(text.count(title + "\n") == 1 for title in titles)


def test_a_cpu_run_replaces_a_gpu_line_written_by_a_cuda_run_but_keeps_hand_written_gpu_tables(tmp_path):
    from types import SimpleNamespace

    cpu = SimpleNamespace(device="cpu", dtype="float32")
    line = run_all.GPU_MEASURED_HERE.format(device="NVIDIA H100 80GB HBM3", dtype="bfloat16")
    generated = {"5": ["## 5. GPU", "", line]}
    assert run_all.gpu_markdown(cpu, generated) == ["## 5. GPU", ""] + run_all.GPU_HOWTO
    howto = {"5": ["## 5. GPU", ""] + run_all.GPU_HOWTO}
    assert run_all.gpu_markdown(cpu, howto) == howto["5"]
    measured = {"5": ["## 5. GPU", "", "Measured on the lent GPU machines ...", "", "| 183.0 |"]}
    assert run_all.gpu_markdown(cpu, measured) == measured["5"]


def test_gc_pauses_benchmark_records_the_collector_s_pauses_per_generation():
    import gc

    from benchmarks.bench_gc_pauses import Pauses

    class Node:
        pass

    with Pauses() as pauses:
        for _ in range(1000):  # cycles: only the collector frees them
            a, b = Node(), Node()
            a.other, b.other = b, a
        gc.collect()  # one full collection, at least
    summary = pauses.summary()
    assert summary[2]["count"] >= 1 and summary[2]["max_ms"] > 0
    assert summary[2]["total_ms"] >= summary[2]["max_ms"]
    assert pauses._callback not in gc.callbacks  # (the block's end removes it)


def test_eager_ops_benchmark_counts_fewer_operators_outside_the_fast_path_s_steps():
    """The fast path, its steps rehearsed on this CPU, leaves a fraction of the eager path's
    operators outside its steps at every stage of a turn's first audio, and the speech decoder's
    stage runs its conditioning, its prefix and its first decisions as steps."""
    from benchmarks.bench_eager_ops import STAGES, measure, table

    result = measure("tiny", host=True)
    eager, fast = result["eager"], result["fast path, rehearsed"]
    assert set(eager) == set(fast) == set(STAGES)
    assert all(eager[stage][1] == 0 for stage in STAGES)  # the eager path has no steps
    for stage in STAGES:
        assert 0 < fast[stage][0] < eager[stage][0], (stage, fast[stage], eager[stage])
    assert fast["speech_decoder"][1] >= 3 and fast["lm_first_word"][1] >= 2
    total = sum(v[0] for v in fast.values()) / sum(v[0] for v in eager.values())
    assert total < 0.2, total
    assert table(result)[-1].startswith("| first audio |")
    # the host's work between the steps, the steps skipped: every stage has some
    host = result["host ms"]
    assert set(host) == {*STAGES, "first audio"} and all(host[stage] > 0 for stage in STAGES)
    assert table(result)[0].endswith("fast path: host ms, steps skipped |")


def test_compute_gate_benchmark_measures_both_admission_orders():
    """Each order runs the same three calls against its own gate: every played chunk and turn waited
    (and was timed), the long reply got jobs through, and the table compares now with before."""
    from benchmarks.bench_compute_gate import measure, table

    result = measure(seconds=0.6, slots=2)
    assert list(result) == ["arrival order (before)", "each call in its turn (now)"]
    for r in result.values():
        assert len(r["played chunk"]) >= 3 and len(r["turn"]) >= 1 and r["long reply jobs"] > 3
        assert all(ms >= 0 for ms in r["played chunk"] + r["turn"])
    lines = table(result)
    assert lines[0].startswith("| admission |") and len(lines) == 5
    assert "max wait now / before" in lines[-1]
