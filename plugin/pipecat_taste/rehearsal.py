"""A rehearsal turn: one whole turn of a throwaway call, run when the agent starts.

Capturing the graphs (``TasteEngine.warm_up``) is not all a first turn pays: the first run of
every eager operator around them chooses its kernels, grows the allocator's pools, makes the
library handles of the thread and stream, fills tokenizer caches. Without a rehearsal the first
caller after a start pays it: on a lent H200 the first call of a cold engine got its first audio
in 462.5 ms against about 165 ms for the next ones (BENCHMARKS.md section 5); on this 2-core
CPU the tiny model's first turn takes about 1.3 times the next ones
(``benchmarks/bench_first_turn.py``).

The rehearsal goes through the session methods a live call uses, in their order, each stage on a
worker thread of its own as a call's are: partial transcripts while the "caller" speaks, the end
of the turn, the rest of the transcript, the audio tower, the reply (prefill, first words, a
second segment), the speech decoder and the synthesis to the end of that audio. Its call is
closed afterwards: nothing of it stays but warm kernels, pools and handles (shared counters, such
as a step's mean batch, count it like any call). What it cannot warm: what is the first call's
own (its stream's cached memory with ``streams='calls'``, its session's captures, made by
``TasteSession.warm_up`` when the call starts).

Several calls at once (``calls`` > 1): that many throwaway calls whose callers stop speaking at
the same moment, each with its own stage threads. A first burst of concurrent calls pays for
what one call alone never needs: on a GPU the pinned host blocks of copies in flight together
(each made by a ``cudaHostAlloc`` of milliseconds that holds the driver's lock, so every other
call's kernel launches wait behind it; torch keeps the blocks once made), the shared steps' larger
row counts and the allocator's blocks for several calls' buffers at once. The H100's profile of
eight calls ending together counted 37 such allocations, 200 ms of them, in the span of their
first audio (BENCHMARKS.md section 5).
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

# What the rehearsal's "caller" says when the ASR hears no words in its audio (random weights do
# not transcribe): the tower needs words to align the audio to.
REHEARSAL_TRANSCRIPT = "hello, can you hear me"
REHEARSAL_SECONDS = 2.0
# how long concurrent rehearsal calls wait for each other's turn ends, per call (their start-ups
# capture their steps one call at a time)
TURN_END_TIMEOUT_S = 120.0


@dataclass
class Rehearsal:
    """What the rehearsal turn did (for the start-up log and the tests); of several calls at once,
    the slowest call's first audio and the sums of their work."""

    seconds: float  # the whole rehearsal
    # from the end of its turn (the ASR's rest included) to the first audio, None if none came; its
    # stages one after another (a live call overlaps the reply, the speech decoder and the vocoder)
    first_audio_s: float | None
    transcript: str  # what the ASR heard, or REHEARSAL_TRANSCRIPT
    reply_segments: int  # segments of the reply spoken (at most 2; 0: the caller's turn stood in)
    speech_tokens: int
    audio_samples: int
    calls: int = 1  # throwaway calls whose turns ended together


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


def rehearse_turn(engine, out_sample_rate: int = 16000, calls: int = 1) -> Rehearsal:
    """One whole turn of a throwaway call on ``engine`` (a ``TasteEngine``), or of ``calls``
    throwaway calls whose turns end together; see the module. A call that fails raises its fault
    once every call has stopped (the others at their turn's end if it had not come, else when
    they finish)."""
    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
        raise ValueError(f"calls must be an integer >= 1, got {calls!r}")
    started = time.perf_counter()
    if calls == 1:
        one = _rehearse_one(engine, out_sample_rate, lambda: None)
        return Rehearsal(time.perf_counter() - started, *one)
    # (a call that fails before its turn ends breaks the barrier: the others do not wait for it)
    turns_end = threading.Barrier(calls, timeout=TURN_END_TIMEOUT_S * calls)
    with ThreadPoolExecutor(max_workers=calls, thread_name_prefix="taste-rehearsal-call") as pool:
        futures = [pool.submit(_rehearse_one, engine, out_sample_rate, turns_end.wait, turns_end.abort)
                   for _ in range(calls)]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:  # the fault itself, not the broken barrier it left the other calls
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    done = [future.result() for future in futures]
    firsts = [d[0] for d in done]
    return Rehearsal(time.perf_counter() - started, None if None in firsts else max(firsts), done[0][1],
                     sum(d[2] for d in done), sum(d[3] for d in done), sum(d[4] for d in done), calls)


def _rehearse_one(engine, out_sample_rate: int, turn_ends, failed=lambda: None) -> tuple:
    """One throwaway call's turn: (first_audio_s, transcript, reply segments, speech tokens, audio
    samples). ``turn_ends()``: called when its caller stops speaking (the calls' barrier);
    ``failed()``: called when it fails."""
    from pipecat_taste.session import GenerationSettings

    audio = rehearsal_audio(engine.input_sample_rate)
    # an answer of a few words is enough to run every stage; 'instruct' always answers
    settings = GenerationSettings(prompt_format="instruct", max_reply_tokens=12, words_per_segment=1)
    try:
        with _StageThreads(engine.new_call_stream(), engine.threads_per_job) as stages:
            session = stages.run("think", engine.new_session, settings)
            try:
                stages.run("think", session.warm_up)
                # (turn_end: when the caller stops speaking - after the partial a live call makes while
                # they speak - so that what is left of the ASR is timed)
                transcript, heard, turn_end = stages.run("listen", _listen, session, engine, audio, turn_ends)
                turn = stages.run("listen", session.user_turn, audio, transcript, heard)
                segments = stages.run("think", _reply_segments, session, turn)
                first_audio_s, tokens, samples = _speak(stages, session, segments or [turn.segment],
                                                        out_sample_rate, turn_end)
            finally:
                session.close()
    except BaseException:
        failed()
        raise
    return first_audio_s, transcript, len(segments), tokens, samples


class _StageThreads:
    """A worker thread per stage, as a live call has (``TasteCall.executor``: listen, think,
    speech tokens, vocode), on the call's stream (``streams='calls'``), all alive together: each
    takes its own library handles from torch's pools, and gives them back when it ends at the
    close, so that the first call's threads find them made."""

    def __init__(self, stream, threads: int | None):
        self.stream, self.threads = stream, threads
        self._executors: dict[str, ThreadPoolExecutor] = {}

    def run(self, stage: str, fn, *args):
        if stage not in self._executors:
            from pipecat_taste.streams import prepare_stage_thread

            self._executors[stage] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"taste-rehearsal-{stage}",
                                                        initializer=prepare_stage_thread,
                                                        initargs=(self.stream, self.threads))
        return self._executors[stage].submit(fn, *args).result()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for executor in self._executors.values():
            executor.shutdown(wait=True)


def _listen(session, engine, audio: np.ndarray, turn_ends=lambda: None) -> tuple[str, object, float]:
    """The turn's transcript as a live call makes it: partials while the caller speaks, then the
    rest when the turn ends (or the whole turn at its end: an ASR without partials). No ASR
    (transcripts from an upstream STT): the fixed one. With the incremental ASR's state (or None)
    and the moment the turn ended (after the partials and ``turn_ends()``)."""
    text = ""
    transcript = session.start_transcript()
    if transcript is not None:
        transcript.partial(audio[: audio.size // 2])
    turn_ends()
    turn_end = time.perf_counter()
    session.turn_ended(transcript)
    if transcript is not None:
        text = transcript.finish(audio)
    elif engine.has_asr:
        text = session.transcribe(audio)
    if not session.processor.split_words(text):  # (random weights: the stand-in words, not the audio's)
        return REHEARSAL_TRANSCRIPT, transcript, turn_end
    return text, transcript, turn_end


def _reply_segments(session, turn) -> list:
    """The reply's first two segments (the second: its continuing steps ran too); the reply is
    stopped there."""
    stop, segments = threading.Event(), []
    for event in session.reply(turn, stop):
        if event.kind == "segment":
            segments.append(event.segment)
            if len(segments) >= 2:
                stop.set()
    return segments[:2]


def _speak(stages: _StageThreads, session, segments: list, out_sample_rate: int, turn_end: float):
    """The segments through the speech decoder and the synthesis, group by group as the plugin
    hands them on (a reply that gave no segment - it ended at once - is stood in for by the
    caller's own turn, so that the speaking stages run all the same)."""
    state = stages.run("speech_tokens", session.start_speech, out_sample_rate)
    tokens, samples, first_audio_s = 0, 0, None
    for segment in segments:
        with contextlib.closing(session.speech_tokens(state, segment)) as groups:
            while (group := stages.run("speech_tokens", next, groups, None)) is not None:
                tokens += len(group)
                got = sum(chunk.size for chunk in stages.run("vocode", session.vocode, state, group))
                if got and first_audio_s is None:
                    first_audio_s = time.perf_counter() - turn_end
                samples += got
    samples += sum(chunk.size for chunk in stages.run("vocode", session.vocode, state, [], True))
    if first_audio_s is None and samples:
        first_audio_s = time.perf_counter() - turn_end
    return first_audio_s, tokens, samples
