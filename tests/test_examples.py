"""The runnable examples run as a user runs them: a fresh Python process from a clean folder, on
the embedded tiny checkpoint, and they do what their docstrings say."""

import ast
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
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
    assert stops and all(ms is not None and ms <= 100.0 for ms in stops), stops  # the barge-in stopped the agent
    with wave.open(str(folder / "recording.wav")) as recording:
        assert recording.getnchannels() == 2 and recording.getnframes() > 0
    assert (folder / "timeline.png").stat().st_size > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_bot_file_answers_a_webrtc_caller_under_pipecat_s_runner(tmp_path):
    """examples/bot.py run by Pipecat's development runner (``-t webrtc``): a scripted aiortc caller
    sends its offer to the runner's /api/offer, hears the agent answer its turn and cuts in after
    half a second of it (the call is short; the barge-in itself is the other tests' subject)."""
    from taste_agents.caller import BargeIn, Pause, Say, load_utterances
    from taste_agents.report import first_active, last_active
    from taste_agents.webrtc_caller import run_call, use_loopback_only
    from taste_agents.webrtc_sim import caller_side_result

    port, bot = _free_port(), str(ROOT / "examples" / "bot.py")
    # the bot file as `python examples/bot.py -t webrtc ...`, with ICE kept on loopback as in every WebRTC test
    launcher = ("import runpy, sys; from taste_agents.webrtc_caller import use_loopback_only; use_loopback_only(); "
                f"sys.argv = [{bot!r}, '-t', 'webrtc', '--host', '127.0.0.1', '--port', '{port}']; "
                f"runpy.run_path({bot!r}, run_name='__main__')")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "bot.log"  # a file, not a pipe: Pipecat logs every frame link at DEBUG
    server = subprocess.Popen([sys.executable, "-c", launcher], cwd=tmp_path, env=env,
                              stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120  # the model loads before the runner listens
        while True:
            assert server.poll() is None, f"the bot exited {server.returncode}:\n{log.read_text()[-4000:]}"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the runner did not listen within 120 s"
                time.sleep(0.5)
        use_loopback_only()
        u = load_utterances()
        script = [Pause(0.5), Say(u["time"]), BargeIn(u["goodbye"], after_agent_ms=500, timeout_s=20.0)]
        result = asyncio.run(run_call(f"http://127.0.0.1:{port}", script, tmp_path / "caller", max_call_s=60))
        assert not result["connection_lost"] and not result["timed_out"], (result, log.read_text()[-4000:])
        assert "barge_in" in [e["kind"] for e in result["events"]], result["events"]  # the agent talked 0.5 s
        # and on the caller's recording: the agent's voice after the end of the caller's turn
        line = caller_side_result(tmp_path / "caller").line
        said_until = result["speech_intervals"][0][1]
        answer_from = first_active(line.agent, said_until, line.agent.size)
        assert answer_from is not None, "the caller heard no answer"
        assert last_active(line.agent, answer_from, line.agent.size) - answer_from > 0.3 * result["sample_rate"]
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
