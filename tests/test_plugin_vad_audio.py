"""WebRTCVADAnalyzer on real speech, and the audio helpers (fades, framing, PCM)."""


import numpy as np
import pytest
from pipecat.audio.vad.vad_analyzer import VADParams, VADState
from pipecat.frames.frames import InputAudioRawFrame, VADUserStartedSpeakingFrame, VADUserStoppedSpeakingFrame
from pipecat.processors.audio.vad_processor import VADProcessor
from pipecat.tests.utils import run_test

from pipecat_taste.audio import (FrameSlicer, StreamResampler, fade_in, fade_out, float_to_pcm16, pcm16_to_float,
                                 ramp, resample)
from pipecat_taste.vad import WebRTCVADAnalyzer
from taste_agents.caller import load_utterances

SR = 16000


@pytest.fixture(scope="module")
def hello():
    return load_utterances()["hello"].audio


def frames_of(audio, ms=20):
    n = SR * ms // 1000
    audio = np.concatenate([audio, np.zeros((-audio.size) % n, np.float32)])
    return [float_to_pcm16(audio[i:i + n]) for i in range(0, audio.size, n)]


def test_vad_rejects_bad_settings():
    with pytest.raises(ValueError, match="aggressiveness"):
        WebRTCVADAnalyzer(aggressiveness=5)
    with pytest.raises(ValueError, match="frame_ms"):
        WebRTCVADAnalyzer(frame_ms=25)
    with pytest.raises(ValueError, match="audio_in_sample_rate"):
        WebRTCVADAnalyzer(sample_rate=22050)
    vad = WebRTCVADAnalyzer()
    with pytest.raises(ValueError, match="16000"):
        vad.set_sample_rate(44100)


@pytest.mark.parametrize("rate,frame_ms", [(16000, 20), (8000, 10), (48000, 30)])
def test_vad_finds_real_speech_and_its_end(hello, rate, frame_ms):
    audio = resample(np.concatenate([np.zeros(SR // 2, np.float32), hello, np.zeros(SR, np.float32)]), SR, rate)
    vad = WebRTCVADAnalyzer(frame_ms=frame_ms, params=VADParams(confidence=0.5, start_secs=0.2, stop_secs=0.5,
                                                                 min_volume=0.2))
    vad.set_sample_rate(rate)
    assert vad.num_frames_required() == rate * frame_ms // 1000
    states, step = [], rate // 50  # 20 ms of input at a time, whatever the VAD frame is
    for i in range(0, audio.size, step):
        states.append(vad._run_analyzer(float_to_pcm16(audio[i:i + step])))
    t = np.arange(len(states)) * 0.02
    speaking = np.array([s in (VADState.SPEAKING, VADState.STOPPING) for s in states])
    first, last = t[speaking][0], t[speaking][-1]
    speech_start, speech_end = 0.5, 0.5 + hello.size / SR
    assert speech_start + 0.1 <= first <= speech_start + 0.5  # confirmed after start_secs of speech
    assert speech_end <= last + 0.02 <= speech_end + 0.5 + 0.3  # released stop_secs after the end
    assert states[-1] == VADState.QUIET
    # One start and one stop for one utterance (pauses between words are bridged by stop_secs).
    assert np.sum(np.diff(speaking.astype(int)) == 1) == 1


def test_vad_stays_quiet_on_silence_and_noise():
    vad = WebRTCVADAnalyzer()
    vad.set_sample_rate(SR)
    rng = np.random.default_rng(0)
    for chunk in frames_of(np.concatenate([np.zeros(SR, np.float32), 0.001 * rng.standard_normal(SR).astype(np.float32)])):
        assert vad._run_analyzer(chunk) == VADState.QUIET


async def test_vad_analyzer_drives_pipecats_vad_processor(hello):
    audio = np.concatenate([np.zeros(SR // 2, np.float32), hello, np.zeros(SR, np.float32)])
    frames = [InputAudioRawFrame(pcm, SR, 1) for pcm in frames_of(audio)]
    down, _ = await run_test(VADProcessor(vad_analyzer=WebRTCVADAnalyzer()), frames_to_send=frames)
    kinds = [type(f) for f in down if isinstance(f, (VADUserStartedSpeakingFrame, VADUserStoppedSpeakingFrame))]
    assert kinds == [VADUserStartedSpeakingFrame, VADUserStoppedSpeakingFrame]


def test_pcm_round_trip_and_odd_bytes():
    x = np.linspace(-1, 1, 1001, dtype=np.float32)
    y = pcm16_to_float(float_to_pcm16(x))
    assert np.max(np.abs(x - y)) <= 1 / 32768 + 1e-7
    with pytest.raises(ValueError, match="even number of bytes"):
        pcm16_to_float(b"\x00\x01\x02")


def test_fades_are_smooth_and_end_at_zero():
    r = ramp(160)
    assert r[0] == 0 and np.all(np.diff(r) > 0) and r[-1] < 1
    tone = np.sin(2 * np.pi * 440 * np.arange(1600) / SR).astype(np.float32)
    out = fade_out(fade_in(tone, 80), 160)
    assert out[0] == 0 and out[-1] == 0
    # No step larger than the tone's own sample-to-sample change: fades add no click.
    assert np.max(np.abs(np.diff(out))) <= np.max(np.abs(np.diff(tone))) + 1e-6
    assert np.array_equal(out[80:-160], tone[80:-160])


def test_frame_slicer_keeps_every_sample_in_order():
    rng = np.random.default_rng(1)
    chunks = [rng.standard_normal(n).astype(np.float32) for n in (7, 500, 160, 1, 333, 0, 999)]
    slicer, frames = FrameSlicer(160), []
    for c in chunks:
        frames += slicer.push(c)
    tail = slicer.flush()
    out = np.concatenate(frames + [tail])
    total = sum(c.size for c in chunks)
    assert all(f.size == 160 for f in frames) and tail.size == 160
    assert np.array_equal(out[:total], np.concatenate(chunks)) and not out[total:].any()
    assert slicer.flush() is None


def test_stream_resampler_matches_whole_buffer_length():
    x = np.sin(np.arange(22050) / 10).astype(np.float32)
    stream = StreamResampler(22050, 16000)
    out = np.concatenate([stream(x[i:i + 1000]) for i in range(0, x.size, 1000)] + [stream.flush()])
    assert abs(out.size - 16000) <= 1
