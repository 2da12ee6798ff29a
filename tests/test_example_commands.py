"""The runnable examples' command lines, each in a fresh Python process: the help and a wrong
model say so and run nothing (quick; the examples' real-time calls are in test_examples.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["pipeline.py", "simulated_call.py", "bot.py"])
def test_example_help_runs_nothing(name):
    """--help prints the usage and exits (simulated_call.py took it for a model path, pipeline.py
    ignored it and ran a whole call)."""
    done = subprocess.run([sys.executable, str(ROOT / "examples" / name), "--help"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stderr[-2000:]


@pytest.mark.parametrize("name, args", [("simulated_call.py", ["/no/such/checkpoint"]), ("bot.py", ["--model", "/no/such/checkpoint"])])
def test_an_example_given_a_wrong_model_says_so_without_a_traceback(name, args):
    done = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 1
    assert "cannot load the model: '/no/such/checkpoint' is neither a local directory nor a hub id" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-2000:]


def test_the_bot_file_refuses_a_transport_it_has_no_parameters_for_before_loading_the_model():
    """The runner offers -t daily, websocket, livekit, ...; the bot file has parameters for some: the
    others are said at once (before, the model loaded and every call failed in create_transport)."""
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "bot.py"), "-t", "daily", "--model",
                           "/no/such/checkpoint"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 1
    assert "examples/bot.py has no transport parameters for -t daily: add them to TRANSPORT_PARAMS (it has webrtc" \
        in done.stderr and "cannot load the model" not in done.stderr, done.stderr[-2000:]
