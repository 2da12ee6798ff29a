"""The runnable examples run as a user runs them: a fresh Python process from a clean folder, on
the embedded tiny checkpoint, and they do what their docstrings say."""

import ast
import json
import os
import subprocess
import sys
import wave
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # real-time calls

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, cwd: Path) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_pipeline_example_answers_the_caller(tmp_path):
    """examples/pipeline.py: the processors laid out one by one behind Pipecat's VADProcessor."""
    out = run_example("pipeline.py", tmp_path)
    turn = ast.literal_eval(out.strip().splitlines()[-1])  # it ends by printing the caller turn's report
    assert turn["utterance"] == "hello" and turn["decision"] == "reply", turn
    assert turn["first_audio_latency_ms"] is not None and turn["first_audio_latency_ms"] > 0, turn
    assert turn["played_text"] == turn["reply_text"] and turn["reply_text"], turn  # heard to the end


def test_simulated_call_example_writes_the_call(tmp_path):
    """examples/simulated_call.py: two caller turns, a barge-in, the call saved to out/example-call."""
    run_example("simulated_call.py", tmp_path)
    folder = tmp_path / "out" / "example-call"
    report = json.loads((folder / "report.json").read_text())
    assert not report["timed_out"] and report["errors"] == [], report["errors"]
    assert report["checks"]["every_turn_decided"], report["turns"]
    assert report["checks"]["released_equals_synthesized"] and report["checks"]["written_equals_released"]
    stops = report["summary"]["barge_in_stop_ms"]
    assert stops and all(ms <= 100.0 for ms in stops), stops  # the barge-in stopped the agent
    with wave.open(str(folder / "recording.wav")) as recording:
        assert recording.getnchannels() == 2 and recording.getnframes() > 0
    assert (folder / "timeline.png").stat().st_size > 0
