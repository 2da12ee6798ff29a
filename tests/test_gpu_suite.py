"""The real-time suite's harness (benchmarks/gpu_suite.py) at tiny size on CPU: every stage is
timed, the first audio is the sum of its stages, the reply is forced to its 12 words, both paths
agree with float32, concurrent calls run on every path (with the LM steps batched across calls
too), and the markdown holds the tables. (Its figures matter on a GPU only.)"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_suite  # noqa: E402


def test_quick_tiny_run_on_cpu(tmp_path):
    out = tmp_path / "gpu_suite.md"
    assert gpu_suite.main(["--device", "cpu", "--size", "tiny", "--quick", "--dtype", "float32",
                           "--calls", "1,2", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    for name in ("eager", "graphed"):
        path = data["paths"][name]
        first = path["first_audio"]
        assert set(first["stages"]) == set(gpu_suite.STAGES)
        assert all(ms > 0 for ms in first["stages"].values())
        assert abs(first["first_audio_ms"] - sum(first["stages"].values())) < 1e-6
        assert first["reply_words"] == 12 and first["audio_s"] > 1.0 and first["rtf"] > 0
        assert all(ms > 0 for ms in path["lm_ms_per_token"].values())
        assert all(ms > 0 for ms in path["speech_decoder_ms_per_token"].values())
        assert path["synthesis"]["chunks"] > 2 and 0 < path["synthesis"]["flow_first_ms"] < path["synthesis"]["first_ms"]
        parity = data["lm_parity"][name]
        assert parity["same_argmax"] == data["lm_parity"]["steps"] and parity["max_logit_diff"] < 1e-4
    graphed = data["paths"]["graphed"]
    for rows in (data["paths"]["eager"]["concurrency"], graphed["concurrency"], graphed["concurrency_batched"]):
        assert [r["calls"] for r in rows] == [1, 2]
        assert all(0 < r["first_audio_median_ms"] <= r["first_audio_max_ms"] for r in rows)
    for key in ("lm_batch", "speech_batch"):
        stats = graphed[key]
        assert stats["steps"] > 0 and stats["rows_stepped"] >= stats["steps"] and stats["slots_in_use"] == 0
    synthesis = graphed["synthesis_batch"]
    assert synthesis["rows"] == 16 and all(synthesis[s]["windows"] >= synthesis[s]["steps"] > 0 for s in ("flow", "vocoder"))
    text = out.read_text()
    assert "| **first audio** |" in text and "| spoken LM, context 1024 |" in text
    assert "| graphed | 32/32 |" in text
    assert "batched median" in text and "Batched speech-decoder steps over the whole table" in text
    assert "Batched synthesis over the whole table: flow " in text
