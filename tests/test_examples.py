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

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # real-time calls in processes of their own

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    """Both examples at once (each a real-time call, mostly waiting): name -> (stdout, its folder)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    running = {}
    for name in ("pipeline.py", "simulated_call.py"):
        cwd = tmp_path_factory.mktemp(name.replace(".", "_"))
        running[name] = (subprocess.Popen([sys.executable, str(ROOT / "examples" / name)], cwd=cwd, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), cwd)
    done = {}
    for name, (proc, cwd) in running.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{out[-2000:]}\n{err[-4000:]}"
        done[name] = (out, cwd)
    return done


def test_pipeline_example_answers_the_caller(examples):
    """examples/pipeline.py: the processors laid out one by one behind Pipecat's VADProcessor."""
    out, _ = examples["pipeline.py"]
    turn = ast.literal_eval(out.strip().splitlines()[-1])  # it ends by printing the caller turn's report
    assert turn["utterance"] == "hello" and turn["decision"] == "reply", turn
    assert turn["first_audio_latency_ms"] is not None and turn["first_audio_latency_ms"] > 0, turn
    assert turn["played_text"] == turn["reply_text"] and turn["reply_text"], turn  # heard to the end


def test_simulated_call_example_writes_the_call(examples):
    """examples/simulated_call.py: two caller turns, a barge-in, the call saved to out/example-call."""
    _, cwd = examples["simulated_call.py"]
    folder = cwd / "out" / "example-call"
    report = json.loads((folder / "report.json").read_text())
    assert not report["timed_out"] and report["errors"] == [], report["errors"]
    assert report["checks"]["every_turn_decided"], report["turns"]
    assert report["checks"]["released_equals_synthesized"] and report["checks"]["written_equals_released"]
    stops = report["summary"]["barge_in_stop_ms"]
    assert stops and all(ms <= 100.0 for ms in stops), stops  # the barge-in stopped the agent
    with wave.open(str(folder / "recording.wav")) as recording:
        assert recording.getnchannels() == 2 and recording.getnframes() > 0
    assert (folder / "timeline.png").stat().st_size > 0
