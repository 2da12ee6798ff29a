"""The phone agent's voice reference: any recording libsndfile reads, and a clear error otherwise."""

import shutil

import numpy as np
import pytest
import soundfile

from pipecat_taste.testing import FakeEngine
from taste_agents.caller import read_audio
from taste_agents.phone_agent import load_voice


@pytest.fixture
def tone():
    t = np.arange(16000) / 16000
    return (0.4 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


@pytest.mark.parametrize("name, subtype", [("v16.wav", "PCM_16"), ("v24.wav", "PCM_24"), ("vf.wav", "FLOAT"),
                                           ("v.flac", "PCM_16")])
def test_a_voice_reference_may_be_any_common_recording(tmp_path, tone, name, subtype):
    """Editors export 24-bit and float WAV or FLAC as often as 16-bit WAV (those failed before)."""
    path = tmp_path / name
    soundfile.write(path, np.stack([tone, tone], axis=1), 16000, subtype=subtype)  # stereo: mixed to mono
    audio, rate = read_audio(path)
    assert rate == 16000 and audio.shape == tone.shape
    assert np.abs(audio - tone).max() < 1e-4
    assert load_voice(FakeEngine(), str(path)).shape == (1, 192)


def test_a_file_that_is_no_recording_says_what_to_give(tmp_path):
    path = tmp_path / "voice.mp3"
    path.write_bytes(b"ID3\x03\x00" + b"\x00" * 200)
    with pytest.raises(ValueError, match=r"voice reference .*voice\.mp3.* could not be read.*give a recording"):
        load_voice(FakeEngine(), str(path))
    with pytest.raises(ValueError, match="could not be read"):
        load_voice(FakeEngine(), str(tmp_path / "missing.wav"))


def test_the_command_line_refuses_contradicting_flags_before_loading_anything(tmp_path, capsys):
    from taste_agents.cli import main

    junk = tmp_path / "voice.wav"
    junk.write_bytes(b"RIFF" + b"\x00" * 40)
    blip = tmp_path / "blip.wav"
    soundfile.write(str(blip), 0.1 * np.ones(4800, np.float32), 48000)  # 0.1 s
    silent = tmp_path / "silent.wav"
    soundfile.write(str(silent), np.zeros(3 * 16000, np.float32), 16000)
    low = tmp_path / "low.wav"  # (the speaker model refuses it after the model has loaded)
    soundfile.write(str(low), 0.3 * np.ones(3 * 2000, np.float32), 2000)
    cases = [
        (["call", "--simulate", "--transcripts", "asr", "--asr-model", "none"], "--transcripts asr needs the built-in ASR"),
        (["call", "--simulate", "--early-reply-ms", "500"], "would never come before the VAD's end of the turn"),
        (["serve", "--turn-username", "me"], "--turn-username without a turn: --ice-server"),
        (["serve", "--voice", str(junk)], "--voice: "),
        (["serve", "--voice", str(blip)], "0.10 s of audio; give a few seconds of the voice"),
        (["serve", "--allowed-origin", "app.example.com"], "expected scheme://host[:port]"),
        (["serve", "--voice", str(silent)], "the recording is silent"),
        (["serve", "--voice", str(low)], "recorded at 2000 Hz, below 4000 Hz, too low for speech"),
        (["call", "--simulate", "--seed", str(2 ** 64)], "outside [-2**63, 2**64 - 3]"),
    ]
    for argv, words in cases:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and words in capsys.readouterr().err, argv


def test_what_keeps_the_agent_from_starting_is_one_line_not_a_traceback(tmp_path, capsys, monkeypatch):
    """A checkpoint that cannot load, a port in use and a plain install without the agent's
    packages: exit 2 with a line that names the problem (the engine's own message), no traceback."""
    import socket

    from taste_agents import cli
    from taste_agents.server import _listening_socket

    assert cli.main(["call", "--simulate", "--quiet", "--model", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("taste-agent: error: cannot load ") and "nowhere" in err and "Traceback" not in err
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    try:
        port = held.getsockname()[1]
        with pytest.raises(cli.StartupError, match=f"cannot listen on 127.0.0.1:{port}: .*give another --port"):
            _listening_socket("127.0.0.1", port)
    finally:
        held.close()
    _listening_socket("127.0.0.1", port).close()  # free again: bound
    with pytest.raises(cli.StartupError, match=r"cannot listen on 203\.0\.113\.7:0: .*give --host an address of this"):
        _listening_socket("203.0.113.7", 0)  # (a documentation address: not this machine's)
    from pipecat_taste.engine import TasteEngine

    def out_of_memory(self, calls=1):
        raise RuntimeError("CUDA out of memory. Tried to allocate 270.00 MiB")

    with monkeypatch.context() as patched:  # the warm-up's workspaces for --max-calls do not fit
        patched.setattr(TasteEngine, "warm_up", out_of_memory)
        with pytest.raises(cli.StartupError, match=r"cannot warm up .* for 4 call\(s\) at once on cpu: CUDA out of "
                                                   r"memory.*; give fewer --max-calls"):
            cli.load_engine(cli.build_parser().parse_args(["serve", "--max-calls", "4"]), lambda line: None)
    # a checkpoint without a speaker model and a --voice: refused before the warm-up, in one line
    from taste_speech.tiny import default_tiny_checkpoint

    without_speaker_model = tmp_path / "no-speaker-model"
    shutil.copytree(default_tiny_checkpoint(), without_speaker_model)
    (without_speaker_model / "cosyvoice" / "speaker_embed.onnx").unlink()
    voice = tmp_path / "voice.wav"
    soundfile.write(str(voice), 0.3 * np.sin(np.arange(3 * 16000) / 16000 * 2 * np.pi * 220).astype(np.float32), 16000)
    assert cli.main(["call", "--simulate", "--quiet", "--model", str(without_speaker_model), "--voice", str(voice)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"taste-agent: error: --voice '{voice}': no cosyvoice/speaker_embed.onnx in this checkpoint")
    assert "without --voice the agent speaks in the checkpoint's default voice" in err and "Traceback" not in err
    monkeypatch.setattr(cli, "AGENT_MODULES", cli.AGENT_MODULES + ("no_such_agent_module",))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["call", "--simulate"])
    assert exit_.value.code == 2
    assert "needs no_such_agent_module: pip install 'pipecat-taste[pipecat]'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, expected", [
    (["call", "--simulate", "--model", "ckpt"], None),  # the scripted caller sends transcripts
    (["call", "--simulate", "--model", "ckpt", "--transcripts", "asr"], "auto"),  # was None: every turn failed
    (["call", "--simulate"], "auto"),  # the tiny checkpoint's own small ASR
    (["serve", "--model", "ckpt"], "auto"),
    (["serve", "--model", "ckpt", "--transcripts", "upstream"], None),
    (["serve", "--asr-model", "none"], None),
    (["serve", "--asr-model", "openai/whisper-small"], "openai/whisper-small"),
])
def test_which_built_in_asr_is_loaded(argv, expected):
    from taste_agents.cli import asr_choice, build_parser

    assert asr_choice(build_parser().parse_args(argv)) == expected


def test_the_agent_s_console_keeps_warnings_but_not_pipecat_s_video_track_lookups(capsys):
    """Pipecat's WebRTC transport warns at every connection that an audio-only caller sends no video:
    two lines per call of no use; other warnings stay."""
    from loguru import logger

    from taste_agents.cli import _quiet_logs

    _quiet_logs()
    logger.warning("No video transceiver is available")
    logger.warning("No screen video transceiver is available")
    logger.info("a frame went by")
    logger.warning("Media stream error while reading the audio")
    err = capsys.readouterr().err
    assert "transceiver" not in err and "a frame went by" not in err
    assert "Media stream error while reading the audio" in err
