"""Real time on a GPU: the reply pipeline's fast path (static caches, CUDA-graph decode steps) against
the eager path, stage by stage, at real dimensions with random weights and fixed lengths.

    python -m benchmarks.gpu_suite --device cuda --dtype bfloat16            # full size, on the GPU machine
    python -m benchmarks.gpu_suite --device cpu --size tiny --quick          # the harness itself (CI)

Fixed work, so random weights do not change it: a 3 s user turn with a 10-word transcript, a reply
forced to 12 words (``ForcedReply`` biases the text head towards a script; the head still does its
work), speech-decoder lengths from the decoder's own limits, the 'low_latency' emission policy.

Tables (one run each, all figures from the same process):
1. first audio after the end of the user's turn, eager vs graphed, per stage: the ASR work left
   after the turn (eager: the whole turn with ``generate``; graphed: incremental partials while the
   user spoke, then only the check of the last one and the rest), audio tower, LM prefill of the
   turn, LM up to the first word, speech decoder up to the first chunk's tokens, synthesis (flow
   and vocoder) of the first chunk;
2. ms per token of the spoken LM and of the speech decoder at 64 and 1024 rows of context; flow
   and vocoder ms per chunk (first, steady); whole-reply real-time factor;
3. peak GPU memory per call, and first audio with 1, 2, 4, 8, 16 concurrent calls whose callers
   stop speaking at the same moment (one thread each, own states; each call started and made its
   partial transcripts before, untimed; on CUDA, or with ``--calls``): eager, graphed with each call replaying its own
   steps, the same with every call's flow and vocoder work on a CUDA stream beside the decoding
   (``TasteEngine(streams='synthesis')``), and with each call's other work on a stream of its own too
   (``streams='calls'``; CUDA only; the synthesis stream is the engine's default there), and graphed
   with the spoken-LM and speech-decoder steps of all calls batched, and their flow and vocoder
   windows too (``taste_speech.lm_batch``, ``speech_decoder_batch``, ``SynthesisGraphs(rows=16)``:
   ``TasteEngine(batch_slots=16)``, opt-in; on CUDA with the synthesis stream).

4. the levers on the graphed path, each against its baseline in the same run: the spoken LM with
   its LoRA merged (the engine's default) vs the adapters' kernels run on the side (same weights),
   the audio tower's Whisper encoder captured as one step vs eager, a turn's prefill through a
   captured bucket vs eager, the first chunk's flow step in a bucket it fills (unpadded) vs padded into the next one, the
   flow's ODE with q/k/v as one product and no all-ones mask vs three products and the mask, the
   ODE with its steps' time conditioning in one pass vs in every estimator call, and a reply's
   synthesis with growing chunks (the default) vs fixed 25-token chunks, and with widened windows
   vs windows as their context makes them; (``flow_precision``) one unpadded flow ODE in float32,
   with TF32 matrix products (CUDA), and as a bfloat16 and a float16 copy; and (``chunk_limits``)
   a 24 s reply's synthesis with steady chunks growing to 100, 200 and 300 tokens (300: the default since these figures) on
   buckets up to 640 frames, with one flow and one vocoder step's ms per window size;
5. the whole reply as the agent runs it (``pipelined_reply``: the spoken LM, the speech decoder and
   the vocoder on three threads, as the plugin's processors run them): wall seconds per second of
   audio, graphed, with and without the synthesis stream (CUDA), and (``compiled_flow_reply``,
   CUDA) with the flow's estimator compiled (``TasteEngine(compile_flow=True)``, its start-up
   timed); and (``gpu_busy``, CUDA) one such
   reply per path under the profiler: how much of its span the GPU was busy (near all of it: the
   GPU's work bounds the reply; well below: waits between the threads and the GPU);
6. (``compiled_flow``) the flow's estimator through ``torch.compile`` vs as it is, one unpadded ODE
   captured as one step each, compiled for that one static shape (the engine's opt-in
   ``compile_flow`` compiles with dynamic shapes: ``compiled_flow_reply``); about a minute per shape.

The parts run in this order (``--parts`` picks some): ``parity``, ``first_audio``, ``per_token``,
``levers``, ``flow_precision``, ``chunk_limits``, ``pipelined_reply``, then the calls tables ``graphed_calls``,
``batched_calls``, ``synthesis_stream_calls``, ``call_streams_calls``, ``eager_calls``, and last
what compiles or profiles: ``gpu_busy_calls`` (CUDA: eight calls ending at once under the profiler,
on the synthesis stream and batched: how busy the GPU and the host were, and where their time went
by operator and by kernel), ``compiled_flow_reply``, ``gpu_busy``,
``compiled_flow``. Each part's figures are written
(markdown and JSON) as soon as it ends, and ``--budget-s`` skips what would start past the budget,
so a run on a lent GPU with minutes to spare keeps every table it finished
(``benchmarks/device_check.sh``). A part that fails is reported and the next one runs.

On CPU the 'graphed' path runs the same static caches eagerly (there are no CUDA graphs on a
CPU), so its figures there only show the harness works - the CPU default stays the eager path.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "plugin", ROOT / "agents"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may download

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.report import fmt, table  # noqa: E402

OUT_RATE = 16000
USER_SECONDS = 3.0
USER_TEXT = "hello there could you tell me what time it is"
REPLY_TEXT = "it is almost noon and the weather outside is very warm today."  # 12 words


@dataclass(frozen=True)
class DecodePath:
    """Which implementation the hot loops use: one of the engine's ``decoding`` settings."""

    name: str  # 'eager' or 'graphed' (TasteEngine(decoding=...))
    batch_slots: int | None = None  # TasteEngine(batch_slots=...): None = each call steps alone
    streams: str = "default"  # TasteEngine(streams=...): which CUDA streams the work goes to
    compile_flow: bool = False  # TasteEngine(compile_flow=...): the flow's estimator through torch.compile

    @property
    def cache_kind(self) -> str:
        """The kind every hot loop is given (LM and speech-decoder caches, synthesis)."""
        from pipecat_taste.engine import DECODING

        return DECODING[self.name]


EAGER = DecodePath("eager")
GRAPHED = DecodePath("graphed")
# (with the synthesis stream on CUDA, as ``--batch-slots 16`` runs since streams='auto' became the default)
BATCHED = DecodePath("graphed", batch_slots=16, streams="auto")  # the concurrency table only
SYNTHESIS_STREAM = DecodePath("graphed", streams="synthesis")  # CUDA only
CALL_STREAMS = DecodePath("graphed", streams="calls")  # CUDA only, the concurrency table only
COMPILED_FLOW = DecodePath("graphed", streams="synthesis", compile_flow=True)  # CUDA only (Triton)
COMPILE_S = 150  # the least time left for a part that compiles the flow (about a minute per compilation)
ENGINE_S = 75  # the least time left to build a path's engine and run a row (its warm-up: 55-65 s on the H200)


def sync(device) -> None:
    """Wait for this thread's GPU work: its stream, not the device (a device-wide wait fails while
    another call's thread captures a CUDA graph)."""
    if torch.device(device).type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class Clock:
    """Wall-clock stage timer that waits for the GPU at every mark."""

    def __init__(self, device):
        self.device, self.stages = device, {}
        sync(device)
        self.last = time.perf_counter()

    def restart(self) -> None:
        sync(self.device)
        self.last = time.perf_counter()

    def mark(self, stage: str) -> None:
        sync(self.device)
        now = time.perf_counter()
        self.stages[stage] = self.stages.get(stage, 0.0) + 1000 * (now - self.last)
        self.last = now


class ForcedReply:
    """Makes the spoken LM say ``script`` (token ids, then ``stop_id``) whatever its random weights
    prefer: a large bias on the scripted id of each step. Scripts are per thread (concurrent calls)."""

    def __init__(self, lm):
        self.lm, self.local = lm, threading.local()
        self.original = lm.heads

    def __enter__(self):
        self.lm.heads = self._heads  # instance attribute: shadows the method for this run only
        return self

    def __exit__(self, *exc):
        del self.lm.heads

    def script(self, ids: list[int]) -> None:
        self.local.ids, self.local.step = list(ids), 0

    def _heads(self, hidden, rvq, step=None):
        heads = self.original(hidden, rvq, step=step)
        ids = getattr(self.local, "ids", None)
        if ids:
            i = min(self.local.step, len(ids) - 1)
            self.local.step += 1
            heads.text_logits = heads.text_logits.clone()
            heads.text_logits[ids[i]] += 1e4
        return heads


def user_audio(seconds: float = USER_SECONDS, seed: int = 0) -> np.ndarray:
    t = np.arange(int(seconds * 16000)) / 16000
    rng = np.random.RandomState(seed)
    voiced = 0.2 * np.sin(2 * np.pi * 140 * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 2.5 * t))
    return (voiced + 0.01 * rng.randn(t.size)).astype(np.float32)


# -- the engines ------------------------------------------------------------------------------------------
def build_engine(size: str, device: str, dtype: str | None):
    from benchmarks import engines

    if size == "tiny":
        return engines.tiny_engine(device, dtype)
    return engines.full_engine(device, dtype)


def build_asr(size: str, engine, device: str, dtype: str | None, calls: int = 1) -> dict:
    """The built-in ASR at the published size (whisper-large-v3 dimensions, random weights) or tiny,
    one transcriber per path over the same weights: eager = ``generate``, graphed = our static
    loop (captured step on CUDA) with incremental partials, warmed up for ``calls`` calls at once.
    Its encoder has the audio tower's weights, as the published ASR's has the published tower's
    (Whisper-large-v3's encoder, frozen): the fast path's engines share one pass a turn
    (``TasteEngine.share_tower_encoder``)."""
    from pipecat_taste.asr import WhisperTranscriber
    from transformers import WhisperFeatureExtractor

    tower = engine.model.audio_tower
    tiny = WhisperTranscriber.random_tiny(engine.checkpoint_dir, tower=tower)
    model, features, max_new = tiny.model, tiny.feature_extractor, None
    if size == "full":
        from transformers import WhisperConfig, WhisperForConditionalGeneration

        config = WhisperConfig(vocab_size=51866, num_mel_bins=128, d_model=1280, encoder_layers=32, decoder_layers=32,
                               encoder_attention_heads=20, decoder_attention_heads=20, encoder_ffn_dim=5120,
                               decoder_ffn_dim=5120, max_source_positions=1500, max_target_positions=448)
        with torch.device(device):
            model = WhisperForConditionalGeneration(config)
        model.generation_config.forced_decoder_ids = None
        features, max_new = WhisperFeatureExtractor(feature_size=128), 20  # a fixed 20-token transcript
        model.model.encoder.load_state_dict(tower.encoder.state_dict())
    model.to(device=device, dtype=getattr(torch, dtype) if dtype else torch.float32)
    asr = {path.name: WhisperTranscriber(model, features, tiny.tokenizer, device=device, language=None,
                                         max_new_tokens=max_new, decode="dynamic" if path is EAGER else "static")
           for path in (EAGER, GRAPHED)}
    # as the engine's warm-up does at start-up: the shared encoder's passes and the decoding batches
    # of every row count, so that no timed turn (several calls' turns in one batch) pays for a capture
    asr[GRAPHED.name].warm_up(workspaces=calls)
    return asr


def asr_while_speaking(asr, audio: np.ndarray):
    """The ASR work done while the user spoke, not timed: partial transcripts every 0.8 s when the
    transcriber is incremental. Returns the turn to finish (None: it transcribes at the end only)."""
    turn = asr.new_turn()
    if turn is not None:
        step = int(0.8 * 16000)
        for end in range(step, len(audio), step):
            turn.partial(audio[:end])
    return turn


def asr_after_turn(asr, turn, audio: np.ndarray, clock: "Clock") -> None:
    """The ASR work left after the end of the turn (timed): the whole turn with the last partial as
    a draft (incremental), or the whole turn (not)."""
    clock.restart()
    if turn is not None:
        turn.finish(audio)
    else:
        asr(audio)
    clock.mark("asr_after_turn")


# -- one reply, stage by stage ----------------------------------------------------------------------------
def path_engine(engine, path: DecodePath, calls: int = 1):
    """The same weights behind an engine whose hot loops take ``path``, warmed up as taste-agent
    does at start-up (the shared synthesis graphs, the batched LM steps) for ``calls`` calls at once
    (``taste-agent --max-calls``: on CUDA its rehearsal is that many calls ending together). Make
    one per path and share it between calls, as a server does."""
    from pipecat_taste.engine import TasteEngine

    cuda = torch.device(engine.device).type == "cuda"
    before = torch.cuda.memory_allocated() if cuda else 0
    engine = TasteEngine(engine.model, engine.processor, engine.voice_generator, checkpoint_dir=engine.checkpoint_dir,
                         device=engine.device, asr=None, decoding=path.name, batch_slots=path.batch_slots,
                         streams=path.streams, compile_flow=path.compile_flow)
    started = time.perf_counter()
    engine.warm_up(calls=calls)
    # captures (with compile_flow, the compilations too), then the rehearsal turn taste-agent runs; the
    # shared steps' counters (mean batch) include that turn's steps
    engine.warm_up_s = time.perf_counter() - started
    # what the path sets aside before any call (batch slots, synthesis graphs): part of its calls' memory
    engine.upfront_bytes = torch.cuda.memory_allocated() - before if cuda else 0
    return engine


def new_session(engine, seed: int = 0):
    from pipecat_taste.session import GenerationSettings

    settings = GenerationSettings(seed=seed, text_top_p=0.0, max_reply_tokens=64, words_per_segment=1)
    session = engine.new_session(settings)
    session.warm_up()  # as a call does when it starts: captures happen here, not in the timed reply
    return session


def reply_script(engine) -> tuple[list[int], int]:
    tokenizer = engine.processor.llm_tokenizer
    ids = tokenizer.encode(" " + REPLY_TEXT, add_special_tokens=False)
    stop = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else ids[-1]
    return ids + [stop], stop


def first_audio(engine, asr, path: DecodePath, forced: ForcedReply, audio: np.ndarray, seed: int = 0,
                whole_reply: bool = False, turn_ends: Callable[[], None] | None = None,
                span=contextlib.nullcontext) -> dict:
    """One user turn -> first audio (and, with ``whole_reply``, the rest), timed per stage;
    ``engine``: the path's engine (``path_engine``). Untimed before the end of the turn: the call's
    start (its session's warm-up) and the partial transcripts made while the user spoke; then
    ``turn_ends()`` (concurrent calls: a barrier, so that every caller stops speaking at once).
    ``span()``: a context around the timed part (``timed_span``: marks it for the profiler)."""
    session = new_session(engine, seed)
    script, stop = reply_script(engine)
    forced.script(script)
    turn = asr_while_speaking(asr[path.name], audio) if asr is not None else None
    if turn_ends is not None:
        turn_ends()
    with span():
        return _after_the_turn(engine, asr, path, session, turn, audio, stop, whole_reply)


def _after_the_turn(engine, asr, path: DecodePath, session, turn, audio: np.ndarray, stop: int,
                    whole_reply: bool) -> dict:
    """``first_audio`` from the end of the user's turn on (the timed part)."""
    from taste_speech.streaming import every_n_words, streaming_generate

    device = engine.device
    session.turn_ended(turn)  # (as the agent's turn capture does: an ASR or tower pass of several calls waits for it)
    clock = Clock(device)
    if asr is not None:
        asr_after_turn(asr[path.name], turn, audio, clock)
    turn = session.user_turn(audio, USER_TEXT, turn)  # (an ASR sharing the tower's encoder encoded the turn)
    clock.mark("audio_tower")
    session.conversation.add_turn(turn.segment)
    clock.mark("lm_prefill")
    items = streaming_generate(engine.model, engine.processor, [], text_top_p=0.0, max_length=64, eos_id=stop,
                               should_emit_segment=every_n_words(1), conversation=session.conversation,
                               prompt_format=session.conversation.prompt_format)
    state = session.start_speech(OUT_RATE)
    first_ms = None
    words = samples = 0
    stages_at_first = None
    for item in items:
        clock.mark("lm_first_word" if first_ms is None else "lm_rest")
        segment = item["segment"]
        if segment is None:
            continue
        words += int(segment.word_starts().sum())
        pending: list[int] = []
        for group in session.speech_tokens(state, segment):
            pending += group
            clock.mark("speech_decoder" if first_ms is None else "speech_decoder_rest")
            chunks = session.vocode(state, pending)  # as the agent does (on its synthesis stream, if any)
            pending = []
            got = sum(c.size for c in chunks)
            clock.mark("synthesis" if first_ms is None else "synthesis_rest")
            samples += got
            if got and first_ms is None:
                first_ms = sum(clock.stages.values())
                stages_at_first = dict(clock.stages)
                if not whole_reply:
                    items.close()
                    session.close()
                    return {"first_audio_ms": first_ms, "stages": stages_at_first}
    tail = session.vocode(state, [], final=True)
    samples += sum(c.size for c in tail)
    clock.mark("synthesis_rest")
    total = sum(clock.stages.values())
    session.close()
    audio_s = samples / OUT_RATE
    return {"first_audio_ms": first_ms, "stages": stages_at_first, "total_ms": total, "reply_words": words,
            "audio_s": audio_s, "rtf": (total / 1000) / audio_s if audio_s else None,
            "reply_stages": dict(clock.stages)}


def pipelined_reply(engine, asr, path: DecodePath, forced: ForcedReply, audio: np.ndarray, seed: int = 0,
                    pending_segments: int | None = None, span=contextlib.nullcontext) -> dict:
    """A whole reply as the agent runs it: the spoken LM, the speech decoder and the vocoder each on
    a thread of its own, handing segments and groups of speech tokens on through queues (the
    plugin's processors do the same, with the same back-pressure: the LM waits for room before it
    makes the next segment, at most ``pending_segments`` (default: the agent's) not yet taken by
    the speech decoder; at most ``MAX_PENDING_TOKEN_GROUPS`` groups wait for the vocoder), so that
    one segment's speech tokens are decoded while the last one's are vocoded. Wall seconds from the
    end of the turn to the reply's last audio, per second of audio; on CUDA the decoding and the
    synthesis overlap only on separate streams (``streams='synthesis'``). ``span()``: a context
    around the timed part (``timed_span``: marks it for the profiler)."""
    import queue

    from pipecat_taste.call import MAX_PENDING_SEGMENTS
    from pipecat_taste.synthesis import MAX_PENDING_TOKEN_GROUPS
    from taste_speech.streaming import every_n_words, streaming_generate

    session = new_session(engine, seed)
    script, stop = reply_script(engine)
    turn = asr_while_speaking(asr[path.name], audio) if asr is not None else None
    pending_segments = MAX_PENDING_SEGMENTS if pending_segments is None else pending_segments
    segments, groups = queue.Queue(), queue.Queue(maxsize=MAX_PENDING_TOKEN_GROUPS)
    room = threading.Semaphore(pending_segments)  # segment slots, given back as the speech decoder takes each
    state = session.start_speech(OUT_RATE)
    out = {"samples": 0, "first_s": None, "errors": []}

    def stage(body, then: queue.Queue | None = None):
        """A thread's work: its error is kept for the caller, and its end always told downstream
        (a failing stage must not leave the next one waiting)."""
        def run():
            try:
                body()
            except BaseException as exc:
                out["errors"].append(exc)
            finally:
                if then is not None:
                    then.put(None)
        run.__name__ = body.__name__
        return run

    def think():
        forced.script(script)  # (scripts are per thread)
        room.acquire()
        for item in streaming_generate(engine.model, engine.processor, [], text_top_p=0.0, max_length=64,
                                       eos_id=stop, should_emit_segment=every_n_words(1),
                                       conversation=session.conversation,
                                       prompt_format=session.conversation.prompt_format):
            if item["segment"] is not None:
                segments.put(item["segment"])
                room.acquire()  # room for the next segment before the LM goes on

    def speech_tokens():
        try:
            while (segment := segments.get()) is not None:
                room.release()
                for group in session.speech_tokens(state, segment):
                    groups.put(group)
        finally:  # (a failed stage must not leave the LM waiting for room)
            room.release(pending_segments + 1)

    def vocode():
        while (group := groups.get()) is not None:
            got = sum(c.size for c in session.vocode(state, group))
            if got and out["first_s"] is None:
                out["first_s"] = time.perf_counter() - t0
            out["samples"] += got
        out["samples"] += sum(c.size for c in session.vocode(state, [], final=True))

    sync(engine.device)
    if engine.synthesis_stream is not None:  # (start_speech's work on it, too)
        engine.synthesis_stream.synchronize()
    with span():
        t0 = time.perf_counter()  # the caller stopped speaking
        if turn is not None:
            turn.finish(audio)
        elif asr is not None:
            asr[path.name](audio)
        session.conversation.add_turn(session.user_turn(audio, USER_TEXT).segment)
        threads = [threading.Thread(target=stage(body, then), name=f"gpu-suite-{body.__name__}")
                   for body, then in ((think, segments), (speech_tokens, groups), (vocode, None))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        sync(engine.device)
        wall_s = time.perf_counter() - t0
    session.close()
    if out["errors"]:
        raise out["errors"][0]
    if not out["samples"]:
        raise RuntimeError("the pipelined reply produced no audio")
    audio_s = out["samples"] / OUT_RATE
    return {"wall_s": wall_s, "audio_s": audio_s, "rtf": wall_s / audio_s, "first_audio_ms": 1000 * out["first_s"]}


# -- how busy the GPU was: is the reply bound by the GPU's work, or by waits between it? --------------
TIMED_SPAN = "gpu-suite timed span"


def timed_span():
    """Marks the timed part of a run for the profiler (a CPU range, on the kernels' clock)."""
    return torch.profiler.record_function(TIMED_SPAN)


def busy_us(intervals) -> float:
    """The length of the union of ``(start, end)`` intervals: the time at least one of them ran."""
    total, reached = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reached:
            total += end - max(start, reached)
            reached = end
    return total


# CPU-side profiler events in which a thread waits for the GPU (CUDA runtime calls)
HOST_WAITS = ("Synchronize", "cudaMemcpy")
HOST_OPERATORS = 12  # the operators listed by the host's time in a profiled span


def without(intervals, holes) -> list[tuple[float, float]]:
    """The parts of the union of ``intervals`` outside the union of ``holes``."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        elif end > start:
            merged.append([start, end])
    out = []
    for start, end in merged:
        for hole_start, hole_end in sorted(holes):
            if hole_end <= start or hole_start >= end:
                continue
            if hole_start > start:
                out.append((start, hole_start))
            start = max(start, hole_end)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


def in_span(events, start: float, end: float, host: bool):
    """(event, its time clipped to the span) for the events of the host's threads (``host``: the
    operators, the timed span's own range left out) or of the GPU (kernels and copies) that ran
    in the span. A ``record_function`` range shows on the GPU's side too, as a user annotation
    spanning the kernels launched inside it: not work of its own, left out on both sides."""
    from torch.autograd import DeviceType

    kind = DeviceType.CPU if host else DeviceType.CUDA
    for e in events:
        if (e.device_type == kind and not getattr(e, "is_user_annotation", False) and not (host and e.name == TIMED_SPAN)
                and e.time_range.end > start and e.time_range.start < end):
            yield e, (max(e.time_range.start, start), min(e.time_range.end, end))


def gpu_activity(events) -> dict:
    """From profiler events: the timed span (``timed_span``) and the GPU's activity inside it -
    ``busy_ms`` the time any kernel or copy ran, ``kernel_ms`` their summed durations (above
    ``busy_ms`` when streams ran side by side), ``busy_share`` busy / span: near 1, the GPU's own
    work bounds the run (only fewer or faster kernels help); well below, the GPU waited for the host
    or for a synchronisation between the threads."""
    from torch.autograd import DeviceType

    spans = [e for e in events if e.name == TIMED_SPAN and e.device_type == DeviceType.CPU]
    if not spans:
        raise ValueError(f"no {TIMED_SPAN!r} range among the profiler's events: wrap the timed part in timed_span()")
    start = min(e.time_range.start for e in spans)
    end = max(e.time_range.end for e in spans)
    device = [clipped for _, clipped in in_span(events, start, end, host=False)]
    busy, summed = busy_us(device), sum(b - a for a, b in device)
    span = end - start
    # the host: per thread, the time it ran operators in the span, less the time it waited for the GPU
    # inside them (synchronisations, copies back: the interpreter lock is free meanwhile); summed over
    # the threads against the time any of them did - near 1 with several threads at work, they took
    # turns (one interpreter lock). The Python between operators is not seen: a lower bound.
    ran: dict = {}
    waited: dict = {}
    for e, clipped in in_span(events, start, end, host=True):
        kind = waited if any(word in e.name for word in HOST_WAITS) else ran
        kind.setdefault(e.thread, []).append(clipped)
    working = {thread: without(intervals, waited.get(thread, [])) for thread, intervals in ran.items()}
    host = busy_us([interval for intervals in working.values() for interval in intervals])
    host_summed = sum(busy_us(intervals) for intervals in working.values())
    return {"span_ms": span / 1000, "busy_ms": busy / 1000, "kernel_ms": summed / 1000, "device_events": len(device),
            "busy_share": busy / span if span else 0.0, "side_by_side": summed / busy if busy else 0.0,
            "host_busy_share": host / span if span else 0.0, "host_threads": len(working),
            "host_side_by_side": host_summed / host if host else 0.0,
            "host_operators": host_operators(events, start, end), "device_kernels": device_kernels(events, start, end),
            "device_steps": device_time_by_step(events, start, end)}


def device_time_by_step(events, start: float, end: float) -> list[dict]:
    """The GPU's time by step: while profiling, each step's run is a host range named
    ``step_graph.PROFILER_RANGE`` + the step's name, and the profiler marks on the GPU's side, per
    stream, the stretch from the first to the last kernel launched inside it (a user annotation of
    the same name: a graph replay is no operator, so its kernels are filed under no host event - the
    GPU's marks are what ties them to the step). A kernel of the span counts for the step whose mark
    on its stream holds its start. Per step name: the runs that started in the span (the host's
    ranges) and the kernels' durations, clipped to the span, summed; largest first. The span's
    other kernels ran outside the steps."""
    import bisect

    from torch.autograd import DeviceType

    from taste_speech.step_graph import PROFILER_RANGE

    runs: dict = {}
    marks: dict = {}  # stream -> sorted [(start, end, step name)]
    for e in events:
        if not e.name.startswith(PROFILER_RANGE):
            continue
        name = e.name[len(PROFILER_RANGE):]
        if e.device_type == DeviceType.CPU and start <= e.time_range.start < end:
            runs[name] = runs.get(name, 0) + 1
        elif e.device_type == DeviceType.CUDA and e.time_range.end > start and e.time_range.start < end:
            marks.setdefault(getattr(e, "device_resource_id", None), []).append(
                (e.time_range.start, e.time_range.end, name))
    starts = {stream: [m[0] for m in sorted(ms)] for stream, ms in marks.items()}
    marks = {stream: sorted(ms) for stream, ms in marks.items()}
    took = dict.fromkeys(runs, 0.0)
    for e, (a, b) in in_span(events, start, end, host=False):
        resource = getattr(e, "device_resource_id", None)
        stream = marks.get(resource)
        if not stream:
            continue
        i = bisect.bisect_right(starts[resource], e.time_range.start) - 1
        if i >= 0 and e.time_range.start < stream[i][1]:
            name = stream[i][2]
            took[name] = took.get(name, 0.0) + b - a
    ranked = sorted(took, key=lambda name: (-took[name], name))
    return [{"name": name, "runs": runs.get(name, 0), "ms": took[name] / 1000} for name in ranked]


def device_kernels(events, start: float, end: float, top: int = HOST_OPERATORS) -> list[dict]:
    """The GPU's time in the span by kernel (and copy): durations clipped to the span and summed per
    name (kernels inside replayed graphs are seen one by one); the ``top`` names by that time, with
    how often each ran. Names are cut to 90 characters (templated kernels' names run to hundreds)."""
    took: dict = {}
    count: dict = {}
    for e, (a, b) in in_span(events, start, end, host=False):
        name = e.name[:90]
        took[name] = took.get(name, 0.0) + b - a
        count[name] = count.get(name, 0) + 1
    ranked = sorted(took, key=took.get, reverse=True)[:top]
    return [{"name": name, "count": count[name], "ms": took[name] / 1000} for name in ranked]


def host_operators(events, start: float, end: float, top: int = HOST_OPERATORS) -> list[dict]:
    """The host's time in the span by operator: each CPU event's own time (its time less that of
    the events nested in it, on its thread - an ``aten::copy_`` apart from the ``cudaMemcpyAsync``
    inside it), clipped to the span and summed over the threads per name; the ``top`` names by
    that time, with how often each ran. Waits for the GPU are among them (``cudaStreamSynchronize``)."""
    per_thread: dict = {}
    for e, clipped in in_span(events, start, end, host=True):
        per_thread.setdefault(e.thread, []).append((clipped, e.name))
    own: dict = {}
    count: dict = {}
    for ranges in per_thread.values():
        open_ranges: list = []  # [end, name, time of its own so far]: the events enclosing the current one
        for (a, b), name in sorted(ranges, key=lambda r: (r[0][0], -r[0][1])):
            while open_ranges and open_ranges[-1][0] <= a:
                closed = open_ranges.pop()
                own[closed[1]] = own.get(closed[1], 0.0) + closed[2]
            if open_ranges:
                open_ranges[-1][2] -= b - a  # the enclosing event's time, not its own
            open_ranges.append([b, name, b - a])
            count[name] = count.get(name, 0) + 1
        for closed in open_ranges:
            own[closed[1]] = own.get(closed[1], 0.0) + closed[2]
    ranked = sorted(own, key=own.get, reverse=True)[:top]
    return [{"name": name, "count": count[name], "own_ms": own[name] / 1000} for name in ranked]


def profiled_pipelined_reply(engine, asr, path: DecodePath, forced: ForcedReply, audio: np.ndarray) -> dict:
    """One pipelined reply under the profiler (CPU operators and CUDA kernels; graph replays' kernels
    included): its figures and the GPU's activity in its timed span. The profiler slows the host,
    so the span is longer than an unprofiled reply's: the busy share is a lower bound."""
    from torch.profiler import ProfilerActivity, profile

    pipelined_reply(engine, asr, path, forced, audio)  # (warm-up: captures, allocations)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        reply = pipelined_reply(engine, asr, path, forced, audio, span=timed_span)
    return {**reply, **gpu_activity(prof.events())}


def all_threads():
    """The profiler's setting to record the operators of every thread (the calls' threads too), not
    only of the one that started it."""
    from torch._C._profiler import _ExperimentalConfig

    try:
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # an older torch: the calling thread only
        return None


def profiled_calls(engine, asr, path: DecodePath, forced: ForcedReply, calls: int) -> dict:
    """``calls`` calls ending at once under the profiler, after one unprofiled row (warm-up): their
    first audio (slowed by the profiler) and the GPU's and the host's activity from the first end of
    a turn to the last first audio. GPU busy near all of the span: the GPU's work bounds the row
    (batch it); well below, with the host busy all along and its threads seldom side by side: the
    calls' host work does, one thread at a time (capture it)."""
    from torch.profiler import ProfilerActivity, profile

    config = all_threads()  # (checked before the rows: a torch without it wastes no time on them)
    if config is None:
        raise RuntimeError("this torch's profiler records the calling thread only (no profile_all_threads): the "
                           "calls' threads cannot be profiled")
    plain = concurrent_first_audio(engine, asr, path, forced, calls)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], experimental_config=config) as prof:
        row = concurrent_first_audio(engine, asr, path, forced, calls, span=timed_span)
    return {"calls": calls, "unprofiled_first_audio_median_ms": plain["first_audio_median_ms"],
            "unprofiled_first_audio_max_ms": plain["first_audio_max_ms"],
            "first_audio_median_ms": row["first_audio_median_ms"],
            "first_audio_max_ms": row["first_audio_max_ms"], **gpu_activity(prof.events())}


# -- per-token and per-chunk figures --------------------------------------------------------------------
def lm_ms_per_token(engine, path: DecodePath, context: int, steps: int) -> float:
    lm = engine.model.spoken_lm
    hidden = lm.causal_lm.config.hidden_size
    rows = torch.randn(1, context + steps, hidden, generator=torch.Generator().manual_seed(0)).to(engine.device)
    state = lm.new_decode_state(cache=lm.new_cache(path.cache_kind, capacity=context + steps + 1))
    lm.feed(state, rows[:, :context])
    for i in range(2):  # warm-up (and capture)
        lm.feed(state, rows[:, context + i:context + i + 1])
    state.crop(context)
    sync(engine.device)
    t0 = time.perf_counter()
    for i in range(steps):
        lm.feed(state, rows[:, context + i:context + i + 1])
        lm.heads(state.last_hidden, engine.model.rvq)
    sync(engine.device)
    return 1000 * (time.perf_counter() - t0) / steps


def speech_decoder_ms_per_token(engine, path: DecodePath, context: int, steps: int) -> float:
    decoder = engine.model.speech_decoder
    width = decoder.llm.input_size
    prefix = torch.randn(1, context, width, generator=torch.Generator().manual_seed(0)).to(engine.device, decoder.dtype)
    state = decoder.start(prefix, min_len=steps + 3, max_len=steps + 3,
                          cache=decoder.new_cache(path.cache_kind, capacity=context + steps + 8))
    for _ in range(2):
        decoder.step(state)
    sync(engine.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        decoder.step(state)
    sync(engine.device)
    return 1000 * (time.perf_counter() - t0) / steps


def synthesis_ms_per_chunk(engine, path: DecodePath, seconds: float = 4.0) -> dict:
    """Flow and vocoder ms per chunk: the first chunk and the steady ones, at ``low_latency``'s fixed
    steady size (25 tokens; growing chunks are the levers' table), on the engine's own synthesis
    steps. A first pass captures the buckets the utterance needs (as warm-up does for a call): a
    capture timed as a chunk would be the capture's cost, not the chunk's."""
    from taste_speech.streaming.synthesis import speak, start_speaking
    from taste_speech.streaming.synthesis_state import EmissionPolicy

    vg = engine.voice_generator
    voice = torch.as_tensor(engine.speaker_embedding()).float().reshape(1, -1)
    policy = EmissionPolicy.low_latency(max_chunk_tokens=0)
    n = int(seconds * 50)
    tokens = torch.randint(0, vg.flow.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    graphs = engine.synthesis_graphs if path.cache_kind != "dynamic" else None
    before_timed = {}
    for timed in (False, True):
        state = start_speaking(vg, voice, policy, OUT_RATE, torch.Generator().manual_seed(0),
                               kind=path.cache_kind, graphs=graphs)
        state.time_stages = True
        if timed and state.graphs is not None:
            before_timed = state.graphs.prepared()
        chunks = []
        for i in range(0, n, 5):
            sync(engine.device)
            chunks += speak(vg, state, tokens[:, i:i + 5])
        chunks += speak(vg, state, None, final=True)
    after = state.graphs.prepared() if state.graphs is not None else {}
    ms = [1000 * c.compute_s for c in chunks]
    flow = [1000 * c.flow_s for c in chunks]
    vocoder = [1000 * (c.compute_s - c.flow_s) for c in chunks]  # the vocoder, fades and resampling
    steady = slice(1, -1) if len(chunks) > 2 else slice(0, len(chunks))
    return {"first_ms": ms[0], "steady_ms": statistics.median(ms[steady]),
            "flow_first_ms": flow[0], "flow_steady_ms": statistics.median(flow[steady]),
            "vocoder_first_ms": vocoder[0], "vocoder_steady_ms": statistics.median(vocoder[steady]),
            "chunks": len(chunks), "steady_tokens": policy.chunk_tokens,
            # buckets first made during the timed pass (their capture timed as a chunk): none expected
            "buckets_made_while_timed": {stage: sorted(set(sizes) - set(before_timed.get(stage, ())))
                                         for stage, sizes in after.items()}}


# -- the levers, each against its baseline --------------------------------------------------------------
@contextlib.contextmanager
def adapters_on_the_side(lm):
    """The merged spoken LM with its adapters' kernels run again in every projection: the same
    weights and function (merged adapters are zero), the cost of unmerged LoRA."""
    layers = [layer for _, layer in lm.lora_layers()]
    kept = [list(layer.merged_adapters) for layer in layers]
    for layer in layers:
        layer.merged_adapters.clear()
    try:
        yield
    finally:
        for layer, names in zip(layers, kept):
            layer.merged_adapters[:] = names


def synthesis_rtf(engine, path: DecodePath, policy, seconds: float = 8.0, graphs=None) -> dict:
    """A reply's synthesis alone, its speech tokens all at hand (fed 5 at a time): compute s per audio
    s. ``graphs``: the bucketed steps to run (default: the voice generator's shared ones)."""
    from taste_speech.streaming.synthesis import speak, start_speaking

    vg = engine.voice_generator
    n = int(seconds * 50)
    tokens = torch.randint(0, vg.flow.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    voice = torch.as_tensor(engine.speaker_embedding()).float().reshape(1, -1)
    for timed in (False, True):  # the first pass captures the buckets it needs
        state = start_speaking(vg, voice, policy, OUT_RATE, torch.Generator().manual_seed(0), kind=path.cache_kind,
                               graphs=graphs)
        padded_before = state.graphs.padded_windows["flow"] if state.graphs is not None else 0
        chunks = []
        sync(engine.device)
        t0 = time.perf_counter()
        for i in range(0, n, 5):
            chunks += speak(vg, state, tokens[:, i:i + 5])
        chunks += speak(vg, state, None, final=True)
        sync(engine.device)
        seconds_taken = time.perf_counter() - t0
    audio_s = sum(c.audio.shape[-1] for c in chunks) / OUT_RATE
    padded = state.graphs.padded_windows["flow"] - padded_before if state.graphs is not None else None
    return {"rtf": seconds_taken / audio_s, "chunks": len(chunks), "padded_flow_windows": padded}


@torch.inference_mode()
def tower_encoder_ms(engine, repeats: int) -> dict:
    """The audio tower's Whisper encoder on a 3 s turn: eager vs the engine's captured step, and a
    step captured with the self-attention's scores written out (``fused_encoder_attention`` off: a
    (heads, 1500, 1500) tensor per layer, as the original computes it) vs the fused kernel."""
    from taste_speech.encoder_graph import EncoderGraph

    tower = engine.model.audio_tower
    features = engine.processor.audio_features(user_audio(), 16000).to(tower.encoder.conv1.weight.device)
    graph = engine.tower_encoder or EncoderGraph(tower)  # (on a CPU: eager, the harness only)
    materialized = EncoderGraph(tower)

    def median_ms(encoder) -> float:
        tower.encode_audio(features, encoder)  # warm-up (and capture)
        times = []
        for _ in range(repeats):
            sync(engine.device)
            t0 = time.perf_counter()
            tower.encode_audio(features, encoder)
            sync(engine.device)
            times.append(1000 * (time.perf_counter() - t0))
        return statistics.median(times)

    figures = {"eager": median_ms(None), "graph": median_ms(graph), "mode": graph.mode}
    tower.fused_encoder_attention = False
    try:  # (captured with the flag off: its graph keeps the written-out scores)
        figures["graph_scores_written"] = median_ms(materialized)
    finally:
        tower.fused_encoder_attention = True
    return figures


@torch.inference_mode()
def tower_text_ms(engine, repeats: int) -> dict:
    """The whole audio tower on a 3 s turn, its encoder captured both ways (the engine's step): the
    text side (pooler, word means, RVQ, the codes read back) eager vs the engine's ``PoolerGraph``."""
    from taste_speech.pooler_graph import PoolerGraph

    tower = engine.model.audio_tower
    device = tower.encoder.conv1.weight.device
    features = engine.processor.audio_features(user_audio(), 16000).to(device)
    aligned = engine.processor.align_llm_ids(engine.processor.process_text(USER_TEXT).llm_token_ids)
    host_ids = (aligned.asr_token_ids, aligned.asr_word_ids, aligned.llm_word_ids)
    device_ids = tuple(ids.to(device) for ids in host_ids)
    encoder = engine.tower_encoder  # (None on a CPU: eager, the harness only)
    pooler = engine.tower_pooler or PoolerGraph(tower, "eager")

    def median_ms(run) -> float:
        run()  # warm-up (and capture)
        times = []
        for _ in range(repeats):
            sync(engine.device)
            t0 = time.perf_counter()
            run()  # (the codes on the host at the end: a sync either way)
            times.append(1000 * (time.perf_counter() - t0))
        return statistics.median(times)

    return {"eager": median_ms(lambda: tower.extract_vq(features, *device_ids, encoder=encoder)[1].cpu()),
            "graph": median_ms(lambda: tower.extract_vq(features, *host_ids, encoder=encoder, pooler=pooler)[1]),
            "mode": pooler.mode if pooler.fallback_reason is None else "eager: capture failed"}


@torch.inference_mode()
def prefill_ms(engine, repeats: int, rows: int = 48) -> dict:
    """A prefill of ``rows`` rows into an empty static cache: eager vs 'auto' (a turn's 48 rows:
    the 64-row bucket's graph; the 3072 rows a 4096-row history keeps after a window move: past
    the buckets)."""
    lm = engine.model.spoken_lm
    block = torch.randn(1, rows, lm.causal_lm.config.hidden_size, generator=torch.Generator().manual_seed(0))
    block = block.to(engine.device, lm.lm_dtype)
    out = {"rows": rows}
    for name, mode in (("eager", "eager"), ("graph", "auto")):
        state = lm.new_decode_state(cache=lm.new_cache("static", capacity=max(1024, rows + 256), graph_mode=mode))
        times = []
        for i in range(repeats + 1):  # the first run captures
            state.crop(0)
            sync(engine.device)
            t0 = time.perf_counter()
            lm.feed(state, block)
            sync(engine.device)
            times.append(1000 * (time.perf_counter() - t0))
        out[name] = statistics.median(times[1:])
        out[name + "_mode"] = state.cache.graph_mode
    return out


def levers(engine, steps: int, context: int = 1024, seconds: float = 8.0) -> dict:
    from benchmarks.bench_first_chunk_flow import first_chunk_steps
    from benchmarks.bench_flow_kernels import flow_kernel_figures, time_conditioning_figures
    from taste_speech.streaming.synthesis_state import EmissionPolicy

    lm, out = engine.model.spoken_lm, {}
    if lm.lora_merged:
        merged = lm_ms_per_token(engine, GRAPHED, context, steps)
        with adapters_on_the_side(lm):
            side = lm_ms_per_token(engine, GRAPHED, context, steps)
        out["lm_ms_per_token"] = {"context": context, "side": side, "merged": merged}
    out["tower_encoder_ms"] = tower_encoder_ms(engine, repeats=steps // 5 or 1)
    out["tower_text_ms"] = tower_text_ms(engine, repeats=steps // 5 or 1)
    out["prefill_ms"] = prefill_ms(engine, repeats=steps // 5 or 1)
    # what a long call's window move costs between turns (the agent's history_max_tokens 4096, kept to 75%)
    out["window_prefill_ms"] = prefill_ms(engine, repeats=steps // 5 or 1, rows=3072)
    out["first_chunk_flow"] = first_chunk_steps(engine.voice_generator, "auto", repeats=steps // 5 or 1)
    out["flow_kernels"] = flow_kernel_figures(engine.voice_generator, "auto", repeats=steps // 5 or 1)
    out["time_conditioning"] = time_conditioning_figures(engine.voice_generator, "auto", repeats=steps // 5 or 1)
    grown = EmissionPolicy.low_latency()
    out["synthesis"] = {"fixed": synthesis_rtf(engine, GRAPHED, EmissionPolicy.low_latency(max_chunk_tokens=0), seconds),
                        "growing": synthesis_rtf(engine, GRAPHED, grown, seconds),
                        "max_chunk_tokens": grown.max_chunk_tokens, "seconds": seconds,
                        # growing chunks, each window at its context's size (padded steps)
                        "narrow": synthesis_rtf(engine, GRAPHED, EmissionPolicy.low_latency(window_frames=()), seconds)}
    return out


# Steady chunks longer than 100 tokens (the default before these figures) need flow and vocoder windows
# beyond 256 frames: a 200-token chunk's flow window is about 380 frames, a 300-token one's 550.
CHUNK_LIMITS = (100, 200, 300)
WIDE_BUCKETS = (384, 512, 640)


@torch.inference_mode()
def window_step_ms(graphs, sizes, repeats: int) -> list[dict]:
    """Median ms of one flow step (the length regulator and the whole ODE, unpadded: a window of
    exactly a full size) and one vocoder step (a window one frame shorter than that size, in the
    smallest vocoder bucket holding it) per window size: the cost per window as it grows."""
    from benchmarks.bench_first_chunk_flow import median_ms

    vg, device = graphs.vg, graphs.device
    c, n_mel, spf = vg.flow.output_size, vg.hift.conv_pre.in_channels, vg.hift.samples_per_frame
    rows = []
    for frames in sizes:
        stretched = torch.randn(1, c, frames, device=device)  # the window's token features, stretched to its frames
        spks = torch.randn(1, c, device=device)
        cond, noise = torch.zeros_like(stretched), torch.randn_like(stretched)
        mel = torch.randn(1, n_mel, frames - 1, device=device)
        source = torch.zeros(1, 1, (frames - 1) * spf, device=device)
        row = {"frames": frames, "vocoder_bucket": graphs.bucket_for("vocoder", frames - 1)}
        for stage, run in (("flow_ms", lambda: graphs.flow(stretched, spks, cond, noise)),
                           ("vocoder_ms", lambda: graphs.vocoder(mel, source))):
            run()  # capture
            row[stage] = median_ms(run, torch.device(device), repeats)
        rows.append(row)
    return rows


def chunk_limits(engine, repeats: int, seconds: float = 24.0) -> dict:
    """The lever of longer steady chunks, on the graphed path: a ``seconds`` reply's synthesis (its
    speech tokens at hand) with 'low_latency' chunks growing to 100 tokens (the default before these
    figures), 200 and 300 (the default now), on bucketed steps with flow and vocoder buckets up to
    640 frames; and what one flow and one
    vocoder step cost per window size. On a GPU a step costs mostly its launches, so fewer, longer
    windows should cost less per second of audio - if the step's cost grows slower than its frames."""
    from taste_speech.streaming.synthesis_graphs import (FLOW_BUCKETS, FULL_FLOW_WINDOWS, VOCODER_BUCKETS,
                                                         SynthesisGraphs)
    from taste_speech.streaming.synthesis_state import EmissionPolicy

    def with_wide(sizes, wide):  # (the defaults hold the wide buckets since these figures)
        return tuple(sorted(set(sizes) | set(wide)))

    graphs = SynthesisGraphs(engine.voice_generator, flow_buckets=with_wide(FLOW_BUCKETS, WIDE_BUCKETS),
                             vocoder_buckets=with_wide(VOCODER_BUCKETS, WIDE_BUCKETS),
                             full_flow_frames=with_wide(FULL_FLOW_WINDOWS, [f for b in WIDE_BUCKETS for f in (b - 1, b)]))
    replies = [{"max_chunk_tokens": limit, **synthesis_rtf(engine, GRAPHED, EmissionPolicy.low_latency(
        max_chunk_tokens=limit), seconds, graphs=graphs)} for limit in CHUNK_LIMITS]
    steps = window_step_ms(graphs, (17, 88, 144, 256) + WIDE_BUCKETS, repeats)
    return {"seconds": seconds, "replies": replies, "steps": steps, "mode": graphs.mode}


def ode_inputs(channels: int, frames: int, device) -> tuple:
    """(mu, spks, cond, noise) of one unpadded flow ODE over ``frames`` (random, seeded by the size;
    no prompt), for timing the ODE alone."""
    gen = torch.Generator().manual_seed(frames)
    mu, noise = (torch.randn(1, channels, frames, generator=gen).to(device) for _ in range(2))
    spks, cond = torch.randn(1, channels, generator=gen).to(device), torch.zeros(1, channels, frames, device=device)
    return mu, spks, cond, noise


@contextlib.contextmanager
def compiled_estimator(cfm, backend: str = "inductor"):
    """The flow's estimator through ``torch.compile`` (inductor: elementwise and normalisation
    kernels fused around the matrix products) while inside; the plain module again after.
    (``backend='eager'``: traced whole, not compiled - the harness's check on a machine without a
    C compiler.)"""
    plain = cfm.estimator
    cfm.estimator = torch.compile(plain, backend=backend, dynamic=False, fullgraph=True)
    try:
        yield
    finally:
        cfm.estimator = plain


@torch.inference_mode()
def compiled_flow(engine, repeats: int, frames=(17, 256), left_s: Callable[[], float] = lambda: float("inf"),
                  backend: str = "inductor") -> dict:
    """The lever of ``compile_flow`` with static shapes (the engine's are dynamic): one unpadded
    flow ODE (a window of ``frames``) captured as one step, with the estimator as it is vs compiled
    by ``torch.compile`` (the compiled kernels captured in the same kind of step). Compiling costs
    time (``compile_s``: the first run) and needs Triton on CUDA. A size starts only with a minute left."""
    from benchmarks.bench_first_chunk_flow import median_ms
    from taste_speech.step_graph import StepGraph

    vg, device = engine.voice_generator, engine.device
    cfm, c = vg.flow.decoder, vg.flow.output_size
    rows = []
    for n in frames:
        if left_s() < 60:
            break
        mu, spks, cond, noise = ode_inputs(c, n, device)
        row = {"frames": n}
        outputs = {}
        for name in ("plain", "compiled"):
            with compiled_estimator(cfm, backend) if name == "compiled" else contextlib.nullcontext():
                t0 = time.perf_counter()
                cfm(mu, None, spks, cond, noise)  # (compiling, for the compiled one)
                sync(device)
                if name == "compiled":
                    row["compile_s"] = time.perf_counter() - t0
                step = StepGraph(lambda: cfm(mu, None, spks, cond, noise), device, "auto", name=f"flow ODE {name}")
                outputs[name] = step.run().clone()  # (warm-up runs and the capture)
                row[name + "_ms"] = median_ms(step.run, torch.device(device), repeats)
                row[name + "_mode"] = step.mode
        row["max_mel_diff"] = (outputs["compiled"] - outputs["plain"]).abs().max().item()
        rows.append(row)
    return {"rows": rows, "backend": backend}


# The flow ODE's precisions measured against each other: float32 as the engine runs it (torch's
# defaults: cuDNN's convolutions in TF32, matrix products not), TF32 matrix products too (CUDA), and
# a copy of the ODE cast to bfloat16 and to float16 (upstream CosyVoice's fp16 option casts its flow
# so). At batch 1 a flow step costs its kernels: the question is whether the half-precision
# products (tensor cores, one kernel where float32's small products took a split-K pair) shorten
# them, and by how much the mel moves.
FLOW_PRECISIONS = ("float32", "tf32", "bfloat16", "float16")


@contextlib.contextmanager
def tf32_matmuls(on: bool):
    """cuBLAS's float32 matrix products in TF32 (``on``) or not while inside; as before after."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@torch.inference_mode()
def flow_precision(engine, repeats: int, frames=(17, 256), left_s: Callable[[], float] = lambda: float("inf")) -> dict:
    """One unpadded flow ODE (a window of ``frames``) captured as one step per precision of
    ``FLOW_PRECISIONS`` ('tf32' on CUDA only: elsewhere it is float32), timed, and its mel's largest
    difference from float32's. The half-precision rows run a cast copy of the ODE (its state too,
    as upstream's fp16 flow), their mel cast back to float32; the engine's flow is left as it was.
    A size starts only with half a minute left."""
    from benchmarks.bench_first_chunk_flow import median_ms
    from taste_speech.step_graph import StepGraph

    vg, device = engine.voice_generator, engine.device
    cfm, c = vg.flow.decoder, vg.flow.output_size
    cuda = torch.device(device).type == "cuda"
    precisions = [p for p in FLOW_PRECISIONS if cuda or p != "tf32"]
    copies = {p: copy.deepcopy(cfm).to(getattr(torch, p)) for p in precisions if p in ("bfloat16", "float16")}
    rows = []
    for n in frames:
        if left_s() < 30:
            break
        mu, spks, cond, noise = ode_inputs(c, n, device)
        row, mels = {"frames": n}, {}
        for name in precisions:
            ode, dtype = copies.get(name, cfm), getattr(torch, name) if name in copies else None

            def solve(ode=ode, dtype=dtype):
                if dtype is None:
                    return ode(mu, None, spks, cond, noise)
                return ode(mu.to(dtype), None, spks.to(dtype), cond.to(dtype), noise.to(dtype)).float()

            with tf32_matmuls(name == "tf32"):  # (a captured step keeps the kernels chosen at its capture)
                step = StepGraph(solve, device, "auto", name=f"flow ODE {name}")
                mels[name] = step.run().clone()  # (warm-up runs and the capture)
            row[name + "_ms"] = median_ms(step.run, torch.device(device), repeats)
            row[name + "_mel_diff"] = (mels[name] - mels["float32"]).abs().max().item()
        row["mel_max"] = mels["float32"].abs().max().item()
        rows.append(row)
    return {"rows": rows, "precisions": precisions}


# -- parity of the two paths at this size and dtype ------------------------------------------------------
def lm_decode_logits(lm, rvq, path: DecodePath, rows: torch.Tensor, ids: list[int] | None, steps: int):
    """Text logits of ``steps`` decode steps after prefilling ``rows``: greedy when ``ids`` is None,
    else teacher-forced with ``ids`` (so two paths can be compared step by step after a near-tie)."""
    state = lm.new_decode_state(cache=lm.new_cache(path.cache_kind, capacity=rows.shape[1] + steps + 1))
    lm.feed(state, rows)
    chosen, logits = [], []
    for i in range(steps):
        heads = lm.heads(state.last_hidden, rvq)
        logits.append(heads.text_logits.float().cpu())
        chosen.append(int(heads.text_logits.argmax()))
        lm.feed(state, lm.next_row(state, chosen[-1] if ids is None else ids[i]))
    return chosen, logits


def float32_copy(config, lm):
    """The spoken LM again, in float32, from the same weights (a deep copy cannot be made of one
    whose captured steps hold thread-local state)."""
    from taste_speech.modeling_spoken_lm import TasteSpokenLM

    lm32 = TasteSpokenLM(config)
    lm32.load_state_dict({name: value.float() for name, value in lm.state_dict().items()})
    lm32.tie_lm_head()
    return lm32.to(lm.embed_tokens.weight.device).eval()


def lm_parity(engine, steps: int = 32) -> dict:
    """Both paths teacher-forced with the greedy ids of a float32 copy of the LM, from one 64-row
    prefill: for each, the steps whose own greedy choice agrees with float32 and the largest
    text-logit difference from float32. The graphed path passes when it is as close to float32 as
    the eager path (random weights have near-flat logits, so a bf16 near-tie can flip an argmax
    on either path)."""
    lm, rvq = engine.model.spoken_lm, engine.model.rvq
    rows = torch.randn(1, 64, lm.causal_lm.config.hidden_size, generator=torch.Generator().manual_seed(1))
    rows = rows.to(engine.device)
    reference_lm = lm if lm.lm_dtype == torch.float32 else float32_copy(engine.model.config, lm)
    ids, reference = lm_decode_logits(reference_lm, rvq, EAGER, rows, None, steps)
    del reference_lm
    out = {"steps": steps, "dtype": str(lm.lm_dtype).replace("torch.", "")}
    for path in (EAGER, GRAPHED):
        chosen, logits = lm_decode_logits(lm, rvq, path, rows, ids, steps)
        out[path.name] = {"same_argmax": sum(a == b for a, b in zip(ids, chosen)),
                          "max_logit_diff": max(float((a - b).abs().max()) for a, b in zip(reference, logits))}
    out["max_logit"] = max(float(a.abs().max()) for a in reference)
    return out


# -- concurrency ---------------------------------------------------------------------------------------
def concurrent_first_audio(engine, asr, path: DecodePath, forced: ForcedReply, calls: int,
                           span=contextlib.nullcontext) -> dict:
    """``calls`` calls in progress whose callers stop speaking at the same moment (each call started
    and transcribed its caller's partials before; one thread each): first audio of each. ``span()``:
    around each call's timed part (``timed_span``: the profiler's span is from the first to the last)."""
    audio = user_audio()
    results: list[dict] = [None] * calls
    errors: list[BaseException] = []
    barrier = threading.Barrier(calls)
    if torch.device(engine.device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()

    def one(i):
        from pipecat_taste.streams import on_stream

        try:
            with on_stream(engine.new_call_stream()):  # (streams='calls': the call's own; else None: its thread's)
                results[i] = first_audio(engine, asr, path, forced, audio, seed=i, turn_ends=barrier.wait, span=span)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,), name=f"gpu-suite-call-{i}") for i in range(calls)]
    transcriber = asr[path.name] if asr is not None else None
    shared_before = shared_counts(engine, transcriber)
    pinned_before = pinned_host_blocks()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    firsts = sorted(r["first_audio_ms"] for r in results)
    # each stage's median over the calls, as each call's clock saw it (its waits for the GPU and for
    # shared steps included): which stages grow with the calls
    stages = {stage: statistics.median(r["stages"].get(stage, 0.0) for r in results) for stage in STAGES}
    out = {"calls": calls, "first_audio_median_ms": statistics.median(firsts), "first_audio_max_ms": firsts[-1],
           "stages_median_ms": stages,
           "shared": {key: value - shared_before.get(key, 0)  # (the ASR's encoder may be made by this row)
                      for key, value in shared_counts(engine, transcriber).items()}}
    if torch.device(engine.device).type == "cuda":
        upfront = getattr(engine, "upfront_bytes", 0)
        out["peak_mib_per_call"] = (torch.cuda.max_memory_allocated() - before + upfront) / calls / 2**20
        pinned_after = pinned_host_blocks()
        if pinned_before is not None and pinned_after is not None:
            out["pinned_blocks_made"] = pinned_after[0] - pinned_before[0]
            out["pinned_alloc_ms"] = round((pinned_after[1] - pinned_before[1]) / 1000, 1)
    return out


def pinned_host_blocks() -> tuple[int, float] | None:
    """(pinned host blocks torch's caching host allocator has made so far, microseconds spent making
    them), or None where torch does not count them (no CUDA, or an older torch). Each block made is
    a ``cudaHostAlloc``: milliseconds that hold the driver's lock, every thread's launches waiting."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return None
    try:
        figures = stats()
        return int(figures["num_host_alloc"]), float(figures["host_alloc_time.total"])
    except (KeyError, RuntimeError):
        return None


def shared_counts(engine, asr=None) -> dict:
    """How the calls' first-audio work was shared so far: first flow windows and the steps they
    took (``SynthesisGraphs``), ended turns and the tower passes they took (``EncoderGraph``), and
    the passes of ``asr``'s shared encoder (a ``WhisperTranscriber``, partials included)."""
    out = {}
    if engine.synthesis_graphs is not None:
        first = engine.synthesis_graphs.stats()["first_windows"]
        out.update(first_windows=first["windows"], first_window_steps=first["steps"])
    if engine.tower_encoder is not None:
        tower = engine.tower_encoder.stats()
        out.update(tower_turns=tower["turns"], tower_passes=tower["passes"])
    if asr is not None and (encoder := asr.encoder_stats()) is not None:
        out["asr_turns"] = encoder["turns"]
        if asr.encoder is not engine.tower_encoder:  # (sharing the tower's: its passes are the tower passes)
            out["asr_passes"] = encoder["passes"]
    if asr is not None and (batches := asr.batch_stats()) is not None:
        out.update(asr_batches=batches["batches"])
    return out


# where each path's rows of concurrent calls are kept in ``data["paths"]["graphed"]``, and its label
CALL_ROWS = {"concurrency": "graphed", "concurrency_synthesis_stream": "synthesis stream",
             "concurrency_call_streams": "call streams", "concurrency_batched": "batched"}


def sharing_lines(graphed: dict) -> list[str]:
    rows = []
    for key, label in CALL_ROWS.items():
        for row in graphed.get(key, []):
            shared = row.get("shared") or {}
            if shared:
                rows.append([str(row["calls"]), label, fmt(shared.get("asr_turns")), fmt(shared.get("asr_batches")),
                             fmt(shared.get("asr_passes")), fmt(shared.get("tower_turns")), fmt(shared.get("tower_passes")),
                             fmt(shared.get("first_windows")), fmt(shared.get("first_window_steps"))])
    if not rows:
        return []
    return ["How the calls' first-audio work was shared (per row of the table above: the transcriptions - the "
            "partials included - the decoding batches they took (UtteranceBatcher: a batch waits for the turns announced "
            "as ended) and the passes of the ASR's shared Whisper encoder (— where the ASR shares the tower's "
            "encoder: its passes, partials included, are the tower's turns and passes); the turns and the audio "
            "tower's encoder passes (EncoderGraph: a pass waits for the turns announced as ended); the calls' first "
            "flow windows and the steps they ran in (SynthesisGraphs: a first window waits for the other calls' "
            "announced ones); — none):",
            ""] + table_lines(["calls", "path", "transcriptions", "ASR batches", "ASR encoder passes", "turns", "tower passes",
                               "first windows", "flow steps"], rows) + [""]


def pinned_lines(graphed: dict) -> list[str]:
    rows = [[str(row["calls"]), label, fmt(row["pinned_blocks_made"]), fmt(row["pinned_alloc_ms"])]
            for key, label in CALL_ROWS.items() for row in graphed.get(key, []) if "pinned_blocks_made" in row]
    if not rows:
        return []
    return ["Pinned host blocks made during each row (torch's caching host allocator grows by a cudaHostAlloc "
            "whenever no cached block of the size is free: copies in flight together, or blocks held behind "
            "an unfinished copy's event; each holds the driver's lock, so the other calls' launches wait):", ""] + \
        table_lines(["calls", "path", "blocks made", "ms making them"], rows) + [""]


def stage_growth_lines(graphed: dict) -> list[str]:
    rows = []
    for key, label in CALL_ROWS.items():
        for row in graphed.get(key, []):
            if row.get("stages_median_ms"):
                rows.append([str(row["calls"]), label] + [fmt(row["stages_median_ms"].get(stage)) for stage in STAGES]
                            + [fmt(row["first_audio_median_ms"])])
    if not rows:
        return []
    return ["Where the first audio of concurrent calls went (per row of the table above: each stage's median over "
            "the calls in ms, as each call's clock saw it - its waits for the GPU and for the shared steps included):",
            ""] + table_lines(["calls", "path", *STAGES, "first audio median"], rows) + [""]


def table_lines(header, rows) -> list[str]:
    return table(header, rows).splitlines()


# -- the run -------------------------------------------------------------------------------------------
STAGES = ("asr_after_turn", "audio_tower", "lm_prefill", "lm_first_word", "speech_decoder", "synthesis")
# The parts in the order they run: what the targets need most comes first, so that a run stopped by
# its time budget (a lent GPU has minutes, not hours) still holds the headline tables.
# (The batched calls right after the graphed ones: eight calls ending at once decode in lockstep, one
# token each in turn, which is the case batched steps are for - the lever measured next.)
PARTS = ("parity", "first_audio", "per_token", "levers", "flow_precision", "chunk_limits", "pipelined_reply", "graphed_calls",
         "batched_calls", "synthesis_stream_calls", "call_streams_calls", "eager_calls", "gpu_busy_calls",
         "compiled_flow_reply", "gpu_busy", "compiled_flow")
CALL_PARTS = {"batched_calls": BATCHED, "graphed_calls": GRAPHED, "synthesis_stream_calls": SYNTHESIS_STREAM,
              "call_streams_calls": CALL_STREAMS, "eager_calls": EAGER}
# where each path's concurrency rows go in ``data["paths"][path.name]``
CALL_KEYS = {BATCHED: "concurrency_batched", SYNTHESIS_STREAM: "concurrency_synthesis_stream",
             CALL_STREAMS: "concurrency_call_streams"}


def progress(message: str) -> None:
    """A line on stderr as each part ends (a run cut off by a time limit still shows how far it got)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def rounded(value):
    """``value`` with every float rounded to 0.1 (for progress lines)."""
    if isinstance(value, float):
        return round(value, 1)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v) for v in value]
    return value


class Suite:
    """One run: the model, the ASR and the warmed engine of each path, built once and shared by the
    parts; ``data`` collects the figures (``save`` is called after every part). ``budget_s``: a part,
    or a row of calls, that would start past the budget is skipped and listed as such."""

    def __init__(self, args, save=lambda data: None, freeze_gc: bool = False):
        self.args, self.save, self.freeze_gc = args, save, freeze_gc
        self.started = time.perf_counter()
        if {"gpu_busy", "gpu_busy_calls"} & set(args.parts) and torch.device(args.device).type == "cuda":
            # the profiler must have been set up before the first CUDA graph is captured, or profiling
            # replays of graphs captured earlier can fault (PyTorch issue 75504)
            torch.profiler._utils._init_for_cuda_graphs()
        dtype = None if args.dtype == "float32" else args.dtype
        self.engine = build_engine(args.size, args.device, dtype)
        concurrent = set(args.parts) & (set(CALL_PARTS) | {"gpu_busy_calls"})
        # the most calls at once: the ASR's workspaces and the engines' warm-up (a server's --max-calls)
        self.max_calls = max(args.calls or (1,)) if concurrent else 1
        self.asr = build_asr(args.size, self.engine, args.device, dtype, calls=self.max_calls)
        progress(f"built the {args.size} model and ASR on {args.device} in {time.perf_counter() - self.started:.0f} s")
        self.forced = ForcedReply(self.engine.model.spoken_lm)
        self.audio = user_audio()
        self.engines: dict[DecodePath, object] = {}
        self.data = {"size": args.size, "device": device_name(args.device), "dtype": args.dtype,
                     "paths": {"eager": {}, "graphed": {}}, "not_measured": [], "needs_cuda": [],
                     "failed": {}}

    def left_s(self) -> float:
        budget = self.args.budget_s
        return float("inf") if budget is None else budget - (time.perf_counter() - self.started)

    def _no_time_for_engine(self, path: DecodePath, what: str) -> bool:
        """True (and ``what`` listed as not measured) when ``path``'s engine is still to be built and
        warmed up, and the budget left would not hold that and a row."""
        if path in self.engines or self.left_s() >= ENGINE_S:
            return False
        self.data["not_measured"].append(what)
        progress(f"{what}: not measured (its engine's warm-up and a row need about {ENGINE_S} s, "
                 f"{self.left_s():.0f} s left)")
        return True

    def engine_for(self, path: DecodePath):
        if path not in self.engines:
            self.engines[path] = path_engine(self.engine, path, calls=self.max_calls)
            if self.freeze_gc:  # as taste-agent does once ready: no full collection walks start-up's objects
                from pipecat_taste.gc_pauses import freeze_startup_objects

                freeze_startup_objects()
        engine, asr = self.engines[path], self.asr[path.name]
        # one encoder pass a turn for the path's ASR and this engine's tower (the fast path's, on
        # CUDA; the engines share one transcriber, so each part re-points it at its engine's tower);
        # the ASR's workspaces are then made again: warmed up again, as at start-up
        if engine.tower_encoder is not None and asr.encoder is not engine.tower_encoder \
                and engine.share_tower_encoder(asr):
            asr.warm_up(workspaces=self.max_calls)
        return engine

    def run(self, parts) -> dict:
        with self.forced:
            for name in parts:
                if self.left_s() <= 0:
                    self.data["not_measured"].append(name)
                    progress(f"{name}: not measured (the {self.args.budget_s:.0f} s budget is spent)")
                    continue
                try:
                    (self.part_calls if name in CALL_PARTS else getattr(self, "part_" + name))(name)
                except Exception as exc:  # one failing part must not cost the tables of the others
                    import traceback

                    traceback.print_exc()
                    self.data["failed"][name] = f"{type(exc).__name__}: {exc}"
                    progress(f"{name}: FAILED ({self.data['failed'][name]})")
                self.save(self.data)
        return self.data

    # -- the parts, each filling its share of ``data`` --
    def part_parity(self, _name) -> None:
        self.data["lm_parity"] = lm_parity(self.engine)
        progress(f"bf16 parity: {rounded(self.data['lm_parity'])}")

    def part_first_audio(self, _name) -> None:
        for path in (EAGER, GRAPHED):
            engine = self.engine_for(path)
            first_audio(engine, self.asr, path, self.forced, self.audio)  # warm-up: allocations, kernel choice
            runs = [first_audio(engine, self.asr, path, self.forced, self.audio, whole_reply=True)
                    for _ in range(self.args.repeats)]
            entry = self.data["paths"][path.name]
            entry["first_audio"] = sorted(runs, key=lambda r: r["first_audio_ms"])[(len(runs) - 1) // 2]
            entry["first_audio_runs_ms"] = [r["first_audio_ms"] for r in runs]
            progress(f"{path.name}: first audio {rounded(entry['first_audio_runs_ms'])} ms, "
                     f"stages {rounded(entry['first_audio']['stages'])}")

    def part_per_token(self, _name) -> None:
        for path in (EAGER, GRAPHED):
            engine, entry, steps = self.engine_for(path), self.data["paths"][path.name], self.args.steps
            entry["lm_ms_per_token"] = {c: lm_ms_per_token(engine, path, c, steps) for c in self.args.contexts}
            entry["speech_decoder_ms_per_token"] = {c: speech_decoder_ms_per_token(engine, path, c, steps)
                                                    for c in self.args.contexts}
            entry["synthesis"] = synthesis_ms_per_chunk(engine, path)
            progress(f"{path.name}: LM ms/token {rounded(entry['lm_ms_per_token'])}, speech decoder "
                     f"{rounded(entry['speech_decoder_ms_per_token'])}, synthesis {rounded(entry['synthesis'])}")

    def part_levers(self, _name) -> None:
        self.data["levers"] = levers(self.engine_for(GRAPHED), self.args.steps, seconds=4.0 if self.args.quick else 8.0)
        progress(f"levers: {rounded(self.data['levers'])}")

    def part_flow_precision(self, _name) -> None:
        self.data["flow_precision"] = flow_precision(self.engine, self.args.repeats, left_s=self.left_s)
        progress(f"flow precision: {rounded(self.data['flow_precision'])}")

    def part_chunk_limits(self, _name) -> None:
        # (the engine's own steps are not used: no need to warm up a graphed engine for this part)
        self.data["chunk_limits"] = chunk_limits(self.engine, self.args.repeats,
                                                 seconds=12.0 if self.args.quick else 24.0)
        progress(f"chunk limits: {rounded(self.data['chunk_limits'])}")

    def part_compiled_flow_reply(self, name) -> None:
        """The pipelined reply with the flow's estimator compiled (``TasteEngine(compile_flow=True)``,
        with the synthesis stream: compare with that row), and the engine's start-up with it."""
        if torch.device(self.args.device).type != "cuda":
            self.data["needs_cuda"].append(name)
            progress(f"{name}: not measured (torch.compile's kernels here need Triton on a CUDA device)")
            return
        if self.left_s() < COMPILE_S:  # (its engine compiles at start-up: a part past the budget)
            self.data["not_measured"].append(name)
            progress(f"{name}: not measured (compiling needs about {COMPILE_S} s, {self.left_s():.0f} s left)")
            return
        engine = self.engine_for(COMPILED_FLOW)
        pipelined_reply(engine, self.asr, COMPILED_FLOW, self.forced, self.audio)  # (warm-up)
        runs = sorted((pipelined_reply(engine, self.asr, COMPILED_FLOW, self.forced, self.audio)
                       for _ in range(self.args.repeats)), key=lambda r: r["rtf"])
        entry = self.data["paths"]["graphed"]["pipelined_compiled_flow"] = runs[(len(runs) - 1) // 2]
        entry["warm_up_s"] = engine.warm_up_s
        progress(f"pipelined_compiled_flow: {rounded(entry)}")

    def part_gpu_busy(self, name) -> None:
        """How busy the GPU was during a pipelined reply, on one stream and with the synthesis stream."""
        if torch.device(self.args.device).type != "cuda":
            self.data["needs_cuda"].append(name)
            progress(f"{name}: not measured (GPU activity needs a CUDA device)")
            return
        busy = self.data["gpu_busy"] = {}
        for path, key in ((GRAPHED, "one_stream"), (SYNTHESIS_STREAM, "synthesis_stream")):
            busy[key] = profiled_pipelined_reply(self.engine_for(path), self.asr, path, self.forced, self.audio)
            progress(f"gpu busy, {key}: {rounded(busy[key])}")
            self.save(self.data)

    def part_gpu_busy_calls(self, name) -> None:
        """How busy the GPU and the host were while the most calls of ``--calls`` ended at once, on the
        default path on CUDA (the synthesis stream) and the batched one."""
        if torch.device(self.args.device).type != "cuda":
            self.data["needs_cuda"].append(name)
            progress(f"{name}: not measured (GPU activity needs a CUDA device)")
            return
        calls = self.args.calls or (8,)
        calls = 8 if 8 in calls else max(calls)  # (issue 9's target: eight calls)
        busy = self.data["gpu_busy_calls"] = {}
        for path, key in ((SYNTHESIS_STREAM, "synthesis stream"), (BATCHED, "batched")):
            if self._no_time_for_engine(path, f"{name} {key}"):
                continue
            busy[key] = profiled_calls(self.engine_for(path), self.asr, path, self.forced, calls)
            progress(f"gpu busy, {key} calls: {rounded(busy[key])}")
            self.save(self.data)

    def part_compiled_flow(self, _name) -> None:
        self.data["compiled_flow"] = compiled_flow(self.engine, self.args.repeats, left_s=self.left_s)
        progress(f"compiled flow: {rounded(self.data['compiled_flow'])}")

    def part_pipelined_reply(self, _name) -> None:
        """The whole reply as the agent runs it, graphed: on one stream with the agent's back-pressure
        and with the LM one segment ahead, and with the synthesis stream (CUDA), in one run: an
        untimed reply first (captures, allocations), then the median of ``repeats``."""
        cuda = torch.device(self.args.device).type == "cuda"
        for path, key, pending in ((GRAPHED, "pipelined", None), (GRAPHED, "pipelined_one_segment_ahead", 1),
                                   (SYNTHESIS_STREAM, "pipelined_synthesis_stream", None)):
            if path.streams != "default" and not cuda:
                self.data["needs_cuda"].append("pipelined_reply with the synthesis stream")
                continue
            engine = self.engine_for(path)
            pipelined_reply(engine, self.asr, path, self.forced, self.audio, pending_segments=pending)
            runs = sorted((pipelined_reply(engine, self.asr, path, self.forced, self.audio, pending_segments=pending)
                           for _ in range(self.args.repeats)), key=lambda r: r["rtf"])
            self.data["paths"]["graphed"][key] = runs[(len(runs) - 1) // 2]
            progress(f"{key}: {rounded(self.data['paths']['graphed'][key])}")

    def part_calls(self, name: str) -> None:
        """First audio with 1, 2, 4 ... calls at once on one path; a row is skipped when twice the
        previous row's time (the calls double) would run past the budget."""
        path = CALL_PARTS[name]
        if path.streams not in ("default", "auto") and torch.device(self.args.device).type != "cuda":
            self.data["needs_cuda"].append(name)
            progress(f"{name}: not measured (CUDA streams need a CUDA device)")
            return
        if self._no_time_for_engine(path, name):
            return
        engine = self.engine_for(path)
        rows = self.data["paths"][path.name][CALL_KEYS.get(path, "concurrency")] = []
        last_s = 0.0
        for n in self.args.calls:
            if 2 * last_s > self.left_s():
                self.data["not_measured"].append(f"{name} {n}")
                progress(f"{name}: {n} calls not measured (about {2 * last_s:.0f} s, {self.left_s():.0f} s left)")
                continue
            t0 = time.perf_counter()
            rows.append(concurrent_first_audio(engine, self.asr, path, self.forced, n))
            last_s = time.perf_counter() - t0
            progress(f"{name}: {rounded(rows[-1])}")
            self.save(self.data)
        if path is BATCHED:
            graphed = self.data["paths"]["graphed"]
            graphed["lm_batch"], graphed["speech_batch"] = engine.lm_batch.stats(), engine.speech_batch.stats()
            graphed["synthesis_batch"] = engine.synthesis_graphs.stats()
        elif path is GRAPHED and engine.synthesis_graphs is not None:  # (on CUDA: shared synthesis steps)
            self.data["paths"]["graphed"]["synthesis_shared"] = engine.synthesis_graphs.stats()


def device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def markdown(data: dict, command: str) -> list[str]:
    """The tables of the parts that ran; a part that did not says so."""
    eager, graphed = data["paths"]["eager"], data["paths"]["graphed"]
    lines = [f"Device: {data['device']}, {data['size']} size, {data['dtype']}, torch {torch.__version__}; "
             f"date {time.strftime('%Y-%m-%d')}; command `{command}`.", ""]
    if data.get("not_measured"):
        lines += [f"Not measured in this run (its time budget was spent): {', '.join(data['not_measured'])}.", ""]
    if data.get("needs_cuda"):
        lines += [f"Not measured on this device (CUDA only): {', '.join(data['needs_cuda'])}.", ""]
    for part, error in data.get("failed", {}).items():
        lines += [f"**{part} failed**: `{error}` (traceback in the run's output).", ""]
    if "first_audio" in eager and "first_audio" in graphed:
        lines += first_audio_lines(data)
    if "lm_ms_per_token" in eager and "lm_ms_per_token" in graphed:
        lines += per_token_lines(eager, graphed)
    if "reply_stages" in eager.get("first_audio", {}) and "reply_stages" in graphed.get("first_audio", {}):
        lines += reply_stage_lines(eager["first_audio"], graphed["first_audio"])
    if "pipelined" in graphed:
        lines += pipelined_lines(graphed)
    if "lm_parity" in data:
        par = data["lm_parity"]
        lines += [f"Parity of the spoken LM in {par['dtype']} against a float32 copy ({par['steps']} steps "
                  f"teacher-forced with the float32 greedy ids, logits up to {par['max_logit']:.3g}):", ""]
        lines += table_lines(["path", "same argmax as float32", "largest text-logit difference"],
                             [[name, f"{par[name]['same_argmax']}/{par['steps']}", f"{par[name]['max_logit_diff']:.3g}"]
                              for name in ("eager", "graphed")]) + [""]
    if "levers" in data:
        lines += lever_lines(data["levers"])
    if "chunk_limits" in data:
        lines += chunk_limit_lines(data["chunk_limits"])
    if data.get("gpu_busy"):
        lines += ["The GPU's activity during one pipelined reply (profiled: CUDA kernels and copies in the timed "
                  "span; busy: the time any ran; summed: their durations added, above busy where streams ran side "
                  "by side; the profiler slows the host, so the busy share is a lower bound):", ""]
        lines += table_lines(["path", "span ms", "GPU busy ms", "busy share", "summed kernel ms", "side by side",
                              "device events", "wall s per audio s (profiled)"],
                             [[key.replace("_", " "), fmt(b["span_ms"]), fmt(b["busy_ms"]), f"{b['busy_share']:.2f}",
                               fmt(b["kernel_ms"]), f"{b['side_by_side']:.2f}", str(b["device_events"]),
                               f"{b['rtf']:.3f}"] for key, b in data["gpu_busy"].items()]) + [""]
    if data.get("gpu_busy_calls"):
        lines += ["The GPU's and the host's activity while calls ended at once (profiled, from the first end of a "
                  "turn to the last first audio; GPU busy share near 1: the GPU's work bounds the row; host busy: "
                  "the time the calls' threads ran operators, less their waits for the GPU - the Python between "
                  "operators is not seen, so a lower bound - near 1 with its threads seldom side by side: the "
                  "calls' host work, one thread at a time, does; the profiler slows the host):", ""]
        lines += table_lines(["path", "calls", "first audio median / max ms (unprofiled row before)",
                              "first audio median / max ms (profiled)", "span ms", "GPU busy share",
                              "host busy share", "host threads side by side", "host threads"],
                             [[key, str(b["calls"]),
                               f"{fmt(b.get('unprofiled_first_audio_median_ms'))} / {fmt(b.get('unprofiled_first_audio_max_ms'))}",
                               f"{fmt(b['first_audio_median_ms'])} / {fmt(b['first_audio_max_ms'])}",
                               fmt(b["span_ms"]), f"{b['busy_share']:.2f}", f"{b['host_busy_share']:.2f}",
                               f"{b['host_side_by_side']:.2f}", str(b["host_threads"])]
                              for key, b in data["gpu_busy_calls"].items()]) + [""]
        for key, b in data["gpu_busy_calls"].items():
            if b.get("host_operators"):
                lines += [f"Where the host's time went in that row ({key}, {b['calls']} calls; each operator's or "
                          "CUDA runtime call's own time - less what ran nested in it - summed over the calls' "
                          f"threads, the {HOST_OPERATORS} largest; profiled, so slowed):", ""]
                lines += table_lines(["operator", "count", "own ms", "ms per call of it"],
                                     [[f"`{o['name']}`", str(o["count"]), fmt(o["own_ms"]),
                                       f"{o['own_ms'] / o['count']:.3f}"] for o in b["host_operators"]]) + [""]
            if b.get("device_kernels"):
                lines += [f"Where the GPU's time went in that row ({key}, {b['calls']} calls; kernels and copies "
                          f"by their summed durations in the span, the {HOST_OPERATORS} largest):", ""]
                lines += table_lines(["kernel", "count", "ms", "ms each"],
                                     [[f"`{k['name']}`", str(k["count"]), fmt(k["ms"]), f"{k['ms'] / k['count']:.3f}"]
                                      for k in b["device_kernels"]]) + [""]
            if any(step["ms"] > 0 for step in b.get("device_steps", ())):
                under_steps = sum(step["ms"] for step in b["device_steps"])
                lines += [f"The GPU's time by step in that row ({key}, {b['calls']} calls; each step's runs that "
                          "started in the span and the summed durations of the kernels they launched, in the span, "
                          f"the {HOST_OPERATORS} largest; all steps' {fmt(under_steps)} ms of the span's "
                          f"{fmt(b['kernel_ms'])} summed kernel ms, the rest ran outside the steps):", ""]
                lines += table_lines(["step", "runs", "GPU ms", "ms per run"],
                                     [[step["name"], str(step["runs"]), fmt(step["ms"]),
                                       f"{step['ms'] / step['runs']:.3f}" if step["runs"] else "-"]
                                      for step in b["device_steps"][:HOST_OPERATORS]]) + [""]
    if data.get("flow_precision", {}).get("rows"):
        precision = data["flow_precision"]
        names = [p for p in precision["precisions"] if p != "float32"]
        label = {"tf32": "TF32 products", "bfloat16": "bfloat16 copy", "float16": "float16 copy"}
        lines += ["The flow's ODE in lower precisions (`flow_precision`: one unpadded ODE captured as one step "
                  "each; float32 as the engine runs it; TF32: float32 with TF32 matrix products too; the copies: "
                  "the ODE cast, state included, its mel cast back; ms, median of the replays, and each mel's "
                  "largest difference from float32's):", ""]
        lines += table_lines(["window frames", "float32 ms", *(f"{label[p]} ms (/ float32)" for p in names),
                              *(f"{label[p]} mel difference" for p in names), "float32 mel's largest value"],
                             [[str(r["frames"]), fmt(r["float32_ms"]),
                               *(f"{fmt(r[p + '_ms'])} ({r[p + '_ms'] / r['float32_ms']:.2f})" for p in names),
                               *(f"{r[p + '_mel_diff']:.2g}" for p in names), f"{r['mel_max']:.2g}"]
                              for r in precision["rows"]]) + [""]
    if data.get("compiled_flow", {}).get("rows"):
        lines += ["The flow's estimator compiled (`torch.compile`, inductor, static shapes; the engine's opt-in "
                  "`compile_flow` compiles with dynamic shapes): one unpadded ODE captured as one step:", ""]
        lines += table_lines(["window frames", "as it is ms", "compiled ms", "compiled / as it is", "compile s",
                              "largest mel difference"],
                             [[str(r["frames"]), fmt(r["plain_ms"]), fmt(r["compiled_ms"]),
                               f"{r['compiled_ms'] / r['plain_ms']:.2f}", f"{r['compile_s']:.0f}",
                               f"{r['max_mel_diff']:.2g}"] for r in data["compiled_flow"]["rows"]]) + [""]
    if any(key in entry for entry in (eager, graphed) for key in ("concurrency", *CALL_KEYS.values())):
        lines += (concurrency_lines(eager, graphed) + sharing_lines(graphed) + pinned_lines(graphed)
                  + stage_growth_lines(graphed))
    return lines


def lever_lines(lever: dict) -> list[str]:
    rows = []
    if "lm_ms_per_token" in lever:
        lm = lever["lm_ms_per_token"]
        rows.append([f"spoken LM ms per token, context {lm['context']}", "LoRA adapters on the side", fmt(lm["side"]),
                     "merged", fmt(lm["merged"]), f"{lm['merged'] / lm['side']:.2f}"])
    tower = lever["tower_encoder_ms"]
    rows.append(["audio tower's Whisper encoder ms (3 s turn, padded window)", "eager", fmt(tower["eager"]),
                 f"one captured step ({tower['mode']})", fmt(tower["graph"]), f"{tower['graph'] / tower['eager']:.2f}"])
    if "graph_scores_written" in tower:
        rows.append(["audio tower's Whisper encoder ms, one captured step", "self-attention scores written out",
                     fmt(tower["graph_scores_written"]), "fused attention", fmt(tower["graph"]),
                     f"{tower['graph'] / tower['graph_scores_written']:.2f}"])
    if "tower_text_ms" in lever:
        text = lever["tower_text_ms"]
        rows.append(["audio tower ms (3 s turn, encoder captured; codes read back)", "text side eager",
                     fmt(text["eager"]), f"text side one captured step per length bucket ({text['mode']})",
                     fmt(text["graph"]), f"{text['graph'] / text['eager']:.2f}"])
    prefill = lever["prefill_ms"]
    rows.append(["spoken LM prefill ms (a 48-row turn)", "eager", fmt(prefill["eager"]),
                 f"64-row bucket step ({prefill['graph_mode']})", fmt(prefill["graph"]),
                 f"{prefill['graph'] / prefill['eager']:.2f}"])
    if "window_prefill_ms" in lever:
        window = lever["window_prefill_ms"]
        rows.append([f"spoken LM prefill ms (the {window['rows']} rows kept after a window move, between turns)",
                     "eager", fmt(window["eager"]), f"static cache ({window['graph_mode']})", fmt(window["graph"]),
                     f"{window['graph'] / window['eager']:.2f}"])
    for row in lever["first_chunk_flow"]:
        rows.append([f"first chunk's flow step ms ({row['frames']} frames, {row['policy']})",
                     f"padded into {row['padded_bucket']}", fmt(row["padded_ms"]), f"full bucket {row['frames']}",
                     fmt(row["full_ms"]), f"{row['full_ms'] / row['padded_ms']:.2f}"])
    for row in lever.get("flow_kernels", ()):
        kind = f"{row['frames']} frames in bucket {row['bucket']}, " + ("padded" if row["padded"] else "unpadded")
        rows.append([f"flow ODE ms ({kind})", "three q/k/v products" + ("" if row["padded"] else ", ones mask"),
                     fmt(row["baseline_ms"]), "one q/k/v product" + ("" if row["padded"] else ", no mask"),
                     fmt(row["now_ms"]), f"{row['now_ms'] / row['baseline_ms']:.2f}"])
    for row in lever.get("time_conditioning", ()):
        kind = f"{row['frames']} frames in bucket {row['bucket']}, " + ("padded" if row["padded"] else "unpadded")
        rows.append([f"flow ODE ms ({kind})", "time conditioning in every estimator call", fmt(row["baseline_ms"]),
                     "all steps' in one pass", fmt(row["now_ms"]), f"{row['now_ms'] / row['baseline_ms']:.2f}"])
    syn = lever["synthesis"]
    fixed, growing = syn["fixed"], syn["growing"]
    rows.append(["a reply's synthesis, compute s per audio s (low_latency)",
                 f"fixed 25-token chunks ({fixed['chunks']})", f"{fixed['rtf']:.3f}",
                 f"growing to {syn['max_chunk_tokens']} ({growing['chunks']} chunks)", f"{growing['rtf']:.3f}",
                 f"{growing['rtf'] / fixed['rtf']:.2f}"])
    if "narrow" in syn:
        narrow = syn["narrow"]
        rows.append(["a reply's synthesis, compute s per audio s (low_latency, growing chunks)",
                     f"windows as their context makes them ({narrow['padded_flow_windows']} of {narrow['chunks']} "
                     "padded)", f"{narrow['rtf']:.3f}",
                     f"widened to unpadded sizes ({growing['padded_flow_windows']} of {growing['chunks']} padded)",
                     f"{growing['rtf']:.3f}", f"{growing['rtf'] / narrow['rtf']:.2f}"])
    return (["Levers on the graphed path, each against its baseline in this run:", ""]
            + table_lines(["figure", "baseline", "ms / RTF", "lever", "ms / RTF", "lever / baseline"], rows) + [""])


def chunk_limit_lines(limits: dict) -> list[str]:
    replies = limits["replies"]
    base = replies[0]
    rows = [[f"growing to {r['max_chunk_tokens']} tokens", str(r["chunks"]), str(r["padded_flow_windows"]),
             f"{r['rtf']:.3f}", f"{r['rtf'] / base['rtf']:.2f}"] for r in replies]
    lines = [f"Longer steady chunks: a {limits['seconds']:.0f} s reply's synthesis, its speech tokens at hand "
             f"('low_latency', flow and vocoder buckets up to {limits['steps'][-1]['frames']} frames; "
             f"steps: {limits['mode']}):", ""]
    lines += table_lines(["steady chunks", "chunks", "padded flow windows", "compute s per audio s",
                          f"/ growing to {base['max_chunk_tokens']}"], rows)
    lines += ["", "One step per window size (ms; flow: the whole ODE on a window of exactly that size, unpadded; "
              "vocoder: a window one frame shorter, in the vocoder bucket shown):", ""]
    lines += table_lines(["window frames", "flow ms", "flow ms per frame", "vocoder bucket", "vocoder ms"],
                         [[str(s["frames"]), fmt(s["flow_ms"]), f"{s['flow_ms'] / s['frames']:.2f}",
                           str(s["vocoder_bucket"]), fmt(s["vocoder_ms"])] for s in limits["steps"]])
    return lines + [""]


def first_audio_lines(data: dict) -> list[str]:
    fe, fg = data["paths"]["eager"]["first_audio"], data["paths"]["graphed"]["first_audio"]
    rows = [[stage, fmt(fe["stages"].get(stage, 0.0)), fmt(fg["stages"].get(stage, 0.0))] for stage in STAGES]
    rows.append(["**first audio**", fmt(fe["first_audio_ms"]), fmt(fg["first_audio_ms"])])
    lines = ["First audio after the end of the user's turn (ms), per stage:", ""]
    lines += table_lines(["stage", "eager", "graphed"], rows)
    speedup = fe["first_audio_ms"] / fg["first_audio_ms"]
    asr_e, asr_g = fe["stages"].get("asr_after_turn", 0.0), fg["stages"].get("asr_after_turn", 0.0)
    model_speedup = (fe["first_audio_ms"] - asr_e) / max(1e-9, fg["first_audio_ms"] - asr_g)
    return lines + ["", f"Speed-up of the graphed path (eager ms / graphed ms): {speedup:.2f}x; without the ASR "
                    f"stage {model_speedup:.2f}x (the eager path transcribes the whole turn after it ends, the graphed "
                    "path only checks the partial transcript it made while the caller spoke: part of its gain is "
                    "that change, not the graphs)"
                    + (" (on a CPU there are no CUDA graphs: the 'graphed' path only runs the static shapes eagerly)."
                       if "CPU" in data["device"] else "."), ""]


def per_token_lines(eager: dict, graphed: dict) -> list[str]:
    rows = [[f"spoken LM, context {c}", fmt(eager["lm_ms_per_token"][c]), fmt(graphed["lm_ms_per_token"][c])]
            for c in sorted(eager["lm_ms_per_token"])]
    rows += [[f"speech decoder, context {c}", fmt(eager["speech_decoder_ms_per_token"][c]),
              fmt(graphed["speech_decoder_ms_per_token"][c])] for c in sorted(eager["speech_decoder_ms_per_token"])]
    for key, label in (("first_ms", "synthesis, first chunk"), ("steady_ms", "synthesis, steady chunk (25 tokens)"),
                       ("flow_first_ms", "flow, first chunk"), ("flow_steady_ms", "flow, steady chunk (25 tokens)"),
                       ("vocoder_first_ms", "vocoder, first chunk"), ("vocoder_steady_ms", "vocoder, steady chunk (25 tokens)")):
        rows.append([label, fmt(eager["synthesis"][key]), fmt(graphed["synthesis"][key])])
    if "first_audio" in eager and "first_audio" in graphed:
        rows.append(["whole reply: compute s per audio s (ASR tail, tower and prefill included)",
                     f"{eager['first_audio']['rtf']:.3f}", f"{graphed['first_audio']['rtf']:.3f}"])
    return ["Per token / per chunk (ms) and real-time factor:", ""] + table_lines(["figure", "eager", "graphed"], rows) + [""]


# The whole reply's stages: each first-audio stage with the rest of the reply's work of its kind.
REPLY_STAGES = (("ASR work after the end of the turn", ("asr_after_turn",)), ("audio tower", ("audio_tower",)),
                ("LM prefill", ("lm_prefill",)), ("spoken LM (every word)", ("lm_first_word", "lm_rest")),
                ("speech decoder (every segment)", ("speech_decoder", "speech_decoder_rest")),
                ("synthesis (flow + vocoder, every chunk)", ("synthesis", "synthesis_rest")))


def reply_stage_lines(eager: dict, graphed: dict) -> list[str]:
    """Where the whole reply's compute goes (the first-audio part's timed reply): ms per stage and
    its share of the real-time factor (ms per audio second / 1000)."""
    rows = []
    for label, keys in REPLY_STAGES + (("**whole reply**", None),):
        row = [label]
        for reply in (eager, graphed):
            ms = reply["total_ms"] if keys is None else sum(reply["reply_stages"].get(k, 0.0) for k in keys)
            row += [fmt(ms), f"{ms / 1000 / reply['audio_s']:.3f}"]
        rows.append(row)
    return ([f"The whole reply's compute per stage ({graphed['reply_words']} words, {graphed['audio_s']:.1f} s of "
             "audio; every stage in turn on one thread, the GPU waited for at each):", ""]
            + table_lines(["stage", "eager ms", "eager s per audio s", "graphed ms", "graphed s per audio s"], rows)
            + [""])


def pipelined_lines(graphed: dict) -> list[str]:
    from pipecat_taste.call import MAX_PENDING_SEGMENTS

    rows = [[label, f"{graphed[key]['rtf']:.3f}", f"{graphed[key]['audio_s']:.1f}", fmt(graphed[key]["first_audio_ms"])]
            for key, label in (("pipelined", "graphed, one stream"),
                               ("pipelined_one_segment_ahead", "graphed, one stream, the LM one segment ahead"),
                               ("pipelined_synthesis_stream", "graphed, synthesis stream (streams='synthesis')"),
                               ("pipelined_compiled_flow", "graphed, synthesis stream, the flow's estimator compiled "
                                "(compile_flow=True)"))
            if key in graphed]
    if graphed.get("first_audio", {}).get("rtf") is not None:  # the same reply, every stage in turn on one thread
        first = graphed["first_audio"]
        rows.insert(0, ["graphed, one thread: each stage in turn (first-audio part)", f"{first['rtf']:.3f}",
                        f"{first['audio_s']:.1f}", fmt(first["first_audio_ms"])])
    return (["The whole reply as the agent runs it (spoken LM, speech decoder and vocoder on three threads, "
             f"the ASR tail, tower and prefill first; the LM at most the agent's {MAX_PENDING_SEGMENTS} segments "
             "ahead of the speech decoder unless said; median run):", ""]
            + table_lines(["path", "wall s per audio s", "audio s", "first audio ms"], rows) + [""])


def concurrency_lines(eager: dict, graphed: dict) -> list[str]:
    columns = ((eager, "concurrency", "first_audio_median_ms"), (graphed, "concurrency", "first_audio_median_ms"),
               (graphed, "concurrency", "first_audio_max_ms"),
               (graphed, "concurrency_synthesis_stream", "first_audio_median_ms"),
               (graphed, "concurrency_synthesis_stream", "first_audio_max_ms"),
               (graphed, "concurrency_call_streams", "first_audio_median_ms"),
               (graphed, "concurrency_call_streams", "first_audio_max_ms"), (graphed, "concurrency_batched", "first_audio_median_ms"),
               (graphed, "concurrency_batched", "first_audio_max_ms"), (graphed, "concurrency", "peak_mib_per_call"),
               (graphed, "concurrency_batched", "peak_mib_per_call"))
    by_calls = {(id(entry), key): {row["calls"]: row for row in entry.get(key, [])} for entry, key, _ in columns}
    calls = sorted({n for rows in by_calls.values() for n in rows})
    rows = [[str(n)] + [fmt(by_calls[(id(entry), key)].get(n, {}).get(figure)) for entry, key, figure in columns]
            for n in calls]
    lines = ["Concurrent calls whose callers stop speaking at the same moment (one thread each, every call "
             "started and its partial transcripts made before; first audio in ms; 'graphed': each call replaying its own "
             "steps, on one CUDA stream (streams='default'); 'synthesis stream': graphed, with every "
             "call's flow and vocoder work on one CUDA stream beside the decoding (TasteEngine(streams='synthesis')); "
             "'call streams': that, and each call's other work on a stream of its own (streams='calls'); "
             "'batched': the spoken-LM and the "
             "speech-decoder steps of all calls in batched steps, 16 slots, and their flow and vocoder "
             "windows in shared steps of up to 16 rows, with the synthesis stream on CUDA; peak MiB per call: the calls' peak GPU memory "
             "above the weights, with what the path set aside up front (batch slots, synthesis graphs), "
             "divided by the calls; — not measured):", ""]
    lines += table_lines(["calls", "eager median", "graphed median", "graphed max", "synthesis stream median",
                          "synthesis stream max", "call streams median", "call streams max",
                          "batched median",
                          "batched max", "graphed peak MiB per call", "batched peak MiB per call"], rows)
    for key, label in (("lm_batch", "spoken-LM"), ("speech_batch", "speech-decoder")):
        stats = graphed.get(key) or {}
        if stats.get("steps"):
            lines += ["", f"Batched {label} steps over the whole table: {stats['steps']} steps served "
                      f"{stats['rows_stepped']} call steps (mean batch {stats['mean_batch']}); captured sizes "
                      f"{stats['graphs'] or 'none (no CUDA)'}."]
    shared = graphed.get("synthesis_shared") or {}
    if shared.get("flow", {}).get("steps"):
        served = "; ".join(f"{stage} {shared[stage]['steps']} steps served {shared[stage]['windows']} windows "
                           f"(mean batch {shared[stage]['mean_batch']})" for stage in ("flow", "vocoder"))
        lines += ["", f"Graphed path, synthesis steps shared by the calls (up to {shared['rows']} windows a step): "
                  f"{served}."]
    synthesis = graphed.get("synthesis_batch") or {}
    if synthesis.get("flow", {}).get("steps"):
        lines += ["", "Batched synthesis over the whole table: " + "; ".join(
            f"{stage} {synthesis[stage]['steps']} steps served {synthesis[stage]['windows']} windows "
            f"(mean batch {synthesis[stage]['mean_batch']})" for stage in ("flow", "vocoder")) + "."]
    return lines + [""]


def parse_parts(text: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown parts {unknown}: choose from {', '.join(PARTS)}")
    return tuple(p for p in PARTS if p in parts)  # always in the suite's order


def main(argv=None, freeze_gc: bool = False) -> int:
    """``freeze_gc``: freeze the garbage collector's view of each engine once built, as taste-agent
    does (the command line; process-wide, so not for a caller's process such as the tests')."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--size", default="full", choices=["tiny", "full"])
    parser.add_argument("--quick", action="store_true", help="fewer steps and runs (the CPU check of the harness)")
    parser.add_argument("--calls", type=lambda text: tuple(int(n) for n in text.split(",")), default=None,
                        help="concurrent calls per row, e.g. 1,2 (default: 1,2,4,8,16 on CUDA, none on a CPU)")
    parser.add_argument("--parts", type=parse_parts, default=PARTS,
                        help=f"comma list of {', '.join(PARTS)} (default: all; they run in that order)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds from the start: parts (and rows of calls) that would start later are skipped "
                             "and listed as not measured; every part's figures are written as soon as it ends")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_suite.md"))
    args = parser.parse_args(argv)
    args.repeats, args.steps = (1, 8) if args.quick else (5, 50)
    args.contexts = (64, 1024)
    if args.calls is None:
        args.calls = (1, 2, 4, 8, 16) if torch.device(args.device).type == "cuda" else ()
    parts = [p for p in args.parts if p not in CALL_PARTS or args.calls]
    command = "python -m benchmarks.gpu_suite " + " ".join(argv if argv is not None else sys.argv[1:])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(data: dict) -> None:
        lines = ["# Real time on a GPU: eager vs graphed", ""] + markdown(data, command.strip())
        out.write_text("\n".join(lines).rstrip() + "\n")
        out.with_suffix(".json").write_text(json.dumps(data, indent=2, default=str))

    torch.set_grad_enabled(False)
    data = Suite(args, save, freeze_gc).run(parts)
    save(data)
    print(out.read_text())
    return 1 if data["failed"] else 0


if __name__ == "__main__":
    sys.exit(main(freeze_gc=True))
