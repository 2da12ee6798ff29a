"""First audio after the end of the user's turn: the streaming engine pipeline vs batch.

The clock starts when the user's turn is tokenized (``session.user_turn``: the audio tower, the
same work in every mode, timed once on its own) and stops at the first audio sample:

* streaming, threaded - the plugin's arrangement: the LM, the speech decoder and the vocoder run
  in three threads joined by bounded queues (``TasteEngine`` session API, words_per_segment=1,
  the 'low_latency' emission policy); first audio = the vocoder's first non-empty chunk;
* streaming, sequential - the same calls in one thread, pulled depth-first (each new word goes
  straight through the speech decoder and the vocoder before the LM takes its next step): the
  same first-audio path without the other stages competing for the CPU, and clean per-stage
  compute times for the real-time factors;
* batch - the non-streaming baseline: the whole reply, then all of its speech tokens, then
  whole-utterance flow + HiFT (``VoiceGenerator.inference``); the first audio exists only when
  all of it is done.

All three use fresh sessions with the same seed, so the LM produces the same reply, and the batch
mode asks the speech decoder for the reply's tokens segment by segment exactly as the streaming
modes do, so all three decode the same speech tokens (both checked): the same model work, in another
order - except synthesis, which streaming does window by window, recomputing each window's left
context and lookahead (its flow + HiFT busy time is the higher one). (One decoder pass over the whole reply would give a different number of tokens
with random weights - the decoder's length limit is per segment - and so a different amount of
work.) The reply's length is whatever the sampler's end rules give within ``max_reply_tokens``.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

OUT_RATE = 16000  # the plugin's usual pipeline output rate
STAGES = ("lm", "speech_decoder", "vocoder")


@dataclass
class ModeResult:
    mode: str
    first_audio_ms: float | None = None  # after the turn was tokenized
    total_ms: float = 0.0  # until the last audio sample
    busy_s: dict = field(default_factory=lambda: {s: 0.0 for s in STAGES})
    audio_s: float = 0.0
    reply_ids: list[int] = field(default_factory=list)
    reply_words: int = 0
    speech_ids: list[int] = field(default_factory=list)

    def rtf(self, stage: str) -> float | None:
        return self.busy_s[stage] / self.audio_s if self.audio_s > 0 else None

    def as_dict(self) -> dict:
        return {"mode": self.mode, "first_audio_ms": self.first_audio_ms, "total_ms": self.total_ms,
                "busy_s": dict(self.busy_s), "audio_s": self.audio_s, "reply_tokens": len(self.reply_ids),
                "reply_words": self.reply_words, "speech_tokens": len(self.speech_ids),
                "rtf": {s: self.rtf(s) for s in STAGES}}


def _timed(iterator, result: ModeResult, stage: str):
    """Yield from ``iterator``, adding the time spent inside it to ``result.busy_s[stage]``."""
    while True:
        t0 = time.perf_counter()
        try:
            item = next(iterator)
        except StopIteration:
            result.busy_s[stage] += time.perf_counter() - t0
            return
        result.busy_s[stage] += time.perf_counter() - t0
        yield item


def _sync(engine) -> None:
    if str(engine.device).startswith("cuda"):
        torch.cuda.synchronize()


def _reply_segments(session, turn, result: ModeResult):
    """The reply's segments, in order, recording the reply's ids."""
    for event in _timed(session.reply(turn, threading.Event()), result, "lm"):
        if event.kind == "segment":
            result.reply_ids += event.segment.text_ids[0].tolist()
            result.reply_words += event.n_words
            yield event.segment


class _Vocoder:
    """The last stage, shared by both streaming modes: vocode token groups, note the first audio."""

    def __init__(self, engine, session, state, result: ModeResult, t0: float):
        self.engine, self.session, self.state, self.result, self.t0 = engine, session, state, result, t0

    def __call__(self, tokens: list[int], final: bool = False) -> None:
        started = time.perf_counter()
        chunks = self.session.vocode(self.state, tokens, final=final)
        _sync(self.engine)
        now = time.perf_counter()
        self.result.busy_s["vocoder"] += now - started
        self.result.speech_ids += tokens
        samples = sum(c.size for c in chunks)
        self.result.audio_s += samples / OUT_RATE
        if samples and self.result.first_audio_ms is None:
            self.result.first_audio_ms = 1000 * (now - self.t0)


def run_sequential(engine, settings, turn) -> ModeResult:
    result = ModeResult("streaming, sequential")
    session = engine.new_session(settings)
    t0 = time.perf_counter()
    state = session.start_speech(OUT_RATE)
    vocode = _Vocoder(engine, session, state, result, t0)
    for segment in _reply_segments(session, turn, result):
        for group in _timed(session.speech_tokens(state, segment), result, "speech_decoder"):
            vocode(group)
    vocode([], final=True)
    result.total_ms = 1000 * (time.perf_counter() - t0)
    return result


def run_threaded(engine, settings, turn, queue_size: int = 4) -> ModeResult:
    """The plugin's three stages in three threads with bounded queues (the plugin holds at most
    ``max_pending_segments`` = 4 segments between the LM and the speech decoder)."""
    result = ModeResult("streaming, threaded")
    session = engine.new_session(settings)
    done = object()
    segments: queue.Queue = queue.Queue(maxsize=queue_size)
    groups: queue.Queue = queue.Queue(maxsize=queue_size)
    errors: list[BaseException] = []
    t0 = time.perf_counter()
    state = session.start_speech(OUT_RATE)

    def lm_stage():
        try:
            for segment in _reply_segments(session, turn, result):
                segments.put(segment)
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)
        finally:
            segments.put(done)

    def speech_stage():
        try:
            while (segment := segments.get()) is not done:
                for group in _timed(session.speech_tokens(state, segment), result, "speech_decoder"):
                    groups.put(group)
        except BaseException as exc:
            errors.append(exc)
        finally:
            groups.put(done)

    threads = [threading.Thread(target=lm_stage, name="bench-lm"),
               threading.Thread(target=speech_stage, name="bench-speech-tokens")]
    for thread in threads:
        thread.start()
    vocode = _Vocoder(engine, session, state, result, t0)
    while (group := groups.get()) is not done:
        vocode(group)
    vocode([], final=True)
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    result.total_ms = 1000 * (time.perf_counter() - t0)
    return result


def run_batch(engine, settings, turn) -> ModeResult:
    result = ModeResult("batch")
    session = engine.new_session(settings)
    t0 = time.perf_counter()
    segments = list(_reply_segments(session, turn, result))
    state = session.start_speech(OUT_RATE)
    tokens = [t for segment in segments
              for group in _timed(session.speech_tokens(state, segment), result, "speech_decoder") for t in group]
    _sync(engine)
    started = time.perf_counter()
    device = next(engine.voice_generator.parameters()).device
    wav, rate = engine.voice_generator.inference(torch.tensor([tokens], device=device), session.voice.to(device),
                                                 generator=torch.Generator().manual_seed(settings.seed + 2))
    _sync(engine)
    result.busy_s["vocoder"] = time.perf_counter() - started
    result.speech_ids = tokens
    result.audio_s = wav.shape[-1] / rate
    result.total_ms = 1000 * (time.perf_counter() - t0)
    result.first_audio_ms = result.total_ms  # nothing can be played before the whole utterance exists
    return result


def tokenize_turn(engine, utterance) -> tuple[object, float]:
    """(UserTurn, ms): the user's turn through the audio tower - the same in every mode."""
    session = engine.new_session()
    _sync(engine)
    t0 = time.perf_counter()
    turn = session.user_turn(utterance.audio.astype(np.float32), utterance.text)
    _sync(engine)
    return turn, 1000 * (time.perf_counter() - t0)


def tokenize_warm(engine, utterance, repeats: int) -> tuple[object, float, float]:
    """(UserTurn, first ms, median ms of the next ``repeats``): the first call includes one-off set-up."""
    turn, first = tokenize_turn(engine, utterance)
    times = [tokenize_turn(engine, utterance)[1] for _ in range(repeats)]
    return turn, first, float(np.median(times)) if times else first


def measure(engine, utterance, settings, *, warmup: bool = True, tokenize_repeats: int = 2,
            repeats: int = 1) -> dict:
    """All three modes on one engine, the same user turn and the same settings. With ``repeats``
    > 1 the modes run interleaved that many times and each mode reports its median run (by first
    audio): on a shared machine one run can be caught by another process's burst."""
    turn, tokenize_first_ms, tokenize_ms = tokenize_warm(engine, utterance, tokenize_repeats)
    if warmup:  # first calls allocate caches, pick kernels and capture graphs: keep that out of the figures
        from dataclasses import replace

        engine.warm_up()
        for run in (run_threaded, run_sequential, run_batch):
            run(engine, replace(settings, max_reply_tokens=2), turn)
    runs: dict[str, list[ModeResult]] = {}
    for _ in range(repeats):
        for run in (run_threaded, run_sequential, run_batch):
            result = run(engine, settings, turn)
            runs.setdefault(result.mode, []).append(result)
    modes = []
    for mode_runs in runs.values():
        ordered = sorted(mode_runs, key=lambda m: m.first_audio_ms)
        median = ordered[(len(ordered) - 1) // 2].as_dict()
        median["first_audio_ms_runs"] = [m.first_audio_ms for m in mode_runs]
        modes.append(median)
    every = [m for mode_runs in runs.values() for m in mode_runs]
    return {"tokenize_ms": tokenize_ms, "tokenize_first_ms": tokenize_first_ms, "tokenize_repeats": tokenize_repeats,
            "user_turn_tokens": turn.n_tokens, "user_audio_s": turn.audio_seconds,
            "max_reply_tokens": settings.max_reply_tokens, "repeats": repeats,
            "same_reply": all(m.reply_ids == every[0].reply_ids for m in every),
            "same_speech_tokens": all(m.speech_ids == every[0].speech_ids for m in every),
            "modes": modes}
