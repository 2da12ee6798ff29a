"""A rehearsal turn: one whole turn of a throwaway call, run when the agent starts.

Capturing the graphs (``TasteEngine.warm_up``) is not all a first turn pays: the first run of
every eager operator around them chooses its kernels, grows the allocator's pools, makes the
library handles of the thread and stream, fills tokenizer caches. Without a rehearsal the first
caller after a start pays it: on a lent H200 the first call of a cold engine got its first audio
in 462.5 ms against about 165 ms for the next ones (BENCHMARKS.md section 5); on this 2-core
CPU the tiny model's first turn takes about 1.3 times the next ones
(``benchmarks/bench_first_turn.py``).

The rehearsal goes through the session methods a live call uses, in their order: partial
transcripts while the "caller" speaks, the end of the turn, the rest of the transcript, the
audio tower, the reply (prefill, first words), the speech decoder and the synthesis up to the
reply's first audio and its end. Its call is closed afterwards: nothing of it stays but warm
kernels and pools (shared counters, such as a step's mean batch, count it like any call).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

# What the rehearsal's "caller" says when the ASR hears no words in its audio (random weights do
# not transcribe): the tower needs words to align the audio to.
REHEARSAL_TRANSCRIPT = "hello, can you hear me"
REHEARSAL_SECONDS = 2.0


@dataclass
class Rehearsal:
    """What the rehearsal turn did (for the start-up log and the tests)."""

    seconds: float  # the whole rehearsal
    first_audio_s: float | None  # from the end of its turn to the first audio, None if no audio came
    transcript: str  # what the ASR heard, or REHEARSAL_TRANSCRIPT
    reply_segments: int  # segments the reply gave before the rehearsal stopped listening to it
    speech_tokens: int
    audio_samples: int


def rehearsal_audio(sample_rate: int, seconds: float = REHEARSAL_SECONDS) -> np.ndarray:
    """Deterministic voice-like audio: a gliding harmonic tone in syllable-long bursts, with a little
    noise (float32 mono in [-1, 1])."""
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    pitch = 140.0 + 30.0 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / sample_rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 6))
    syllables = np.clip(np.sin(2 * np.pi * 3.0 * t), 0.0, None)
    noise = np.random.default_rng(0).standard_normal(t.size)
    return (0.2 * voice * syllables + 0.005 * noise).astype(np.float32)


def rehearse_turn(engine, out_sample_rate: int = 16000) -> Rehearsal:
    """One whole turn of a throwaway call on ``engine`` (a ``TasteEngine``); see the module."""
    from pipecat_taste.engine import GenerationSettings, on_stream

    started = time.perf_counter()
    audio = rehearsal_audio(engine.input_sample_rate)
    # an answer of a few words is enough to run every stage; 'instruct' always answers
    settings = GenerationSettings(prompt_format="instruct", max_reply_tokens=12, words_per_segment=1)
    with on_stream(engine.new_call_stream()):  # (streams='calls': the call's own stream, as a call has)
        session = engine.new_session(settings)
        try:
            session.warm_up()
            transcript = _listen(session, engine, audio)
            turn_end = time.perf_counter()
            turn = session.user_turn(audio, transcript)
            first_audio_s, segments, tokens, samples = _answer(session, turn, out_sample_rate, turn_end)
        finally:
            session.close()
    return Rehearsal(time.perf_counter() - started, first_audio_s, transcript, segments, tokens, samples)


def _listen(session, engine, audio: np.ndarray) -> str:
    """The turn's transcript as a live call makes it: partials while the caller speaks, then the
    rest when the turn ends (or the whole turn at its end: an ASR without partials). No ASR
    (transcripts from an upstream STT): the fixed one."""
    text = ""
    transcript = session.start_transcript()
    if transcript is not None:
        transcript.partial(audio[: audio.size // 2])
        session.turn_ended(transcript)
        text = transcript.finish(audio)
    else:
        session.turn_ended(None)
        if engine.has_asr:
            text = session.transcribe(audio)
    return text if session.processor.split_words(text) else REHEARSAL_TRANSCRIPT


def _answer(session, turn, out_sample_rate: int, turn_end: float):
    """The reply's segments through the speech decoder and the synthesis, to the end of its first
    segment's audio; a reply that gives no segment (it ended at once) is stood in for by the
    caller's own turn, so that the speaking stages run all the same."""
    stop = threading.Event()
    state = session.start_speech(out_sample_rate)
    segments, tokens, samples, first_audio_s = 0, 0, 0, None
    spoken = None
    for event in session.reply(turn, stop):
        if event.kind == "segment":
            segments += 1
            spoken = spoken or event.segment
            if segments >= 2:  # a second segment: the reply's continuing steps ran too
                stop.set()
    for group in session.speech_tokens(state, spoken or turn.segment):
        tokens += len(group)
        got = sum(chunk.size for chunk in session.vocode(state, group))
        if got and first_audio_s is None:
            first_audio_s = time.perf_counter() - turn_end
        samples += got
    samples += sum(chunk.size for chunk in session.vocode(state, [], final=True))
    if first_audio_s is None and samples:
        first_audio_s = time.perf_counter() - turn_end
    return first_audio_s, segments, tokens, samples
