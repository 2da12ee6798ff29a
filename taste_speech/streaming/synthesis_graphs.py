"""Fixed-shape (bucketed) flow and vocoder steps of streaming synthesis, captured as CUDA graphs.

Eager, a streaming step is launch-bound on a GPU: the flow's 10 Euler steps are 10 estimator calls
of hundreds of small kernels each (our H100 notes, docs/GPU.md: ~19 ms per call eager, ~2 ms replayed). A CUDA
graph needs fixed shapes, but the windows of :mod:`synthesis` vary: the first chunk, steady chunks
(two or three sizes, as 441/256 frames per token rounds), the chunk before the left context is full,
and the final flush. Measured with ``benchmarks/bench_synthesis_graphs.py --sizes`` (flow window
frames / HiFT window frames, over grid phases and utterance lengths):

    low_latency  first 17-18 / 13-14   steady 82-83 (60-61 second chunk) / 56-58   final 22-80 / 18-58
    quality      first 37-38 / 20-21   steady 139-140 (106-107) / 88-89            final 22-125 / 22-103

Each window is therefore padded to the smallest *bucket* that holds it (the defaults below cover
both named policies with little padding), and each bucket's step is captured once. Padding is
exact, not approximate: the flow runs with ``padded=True`` (GroupNorm statistics and attention
keys over the valid frames only; convolutions see zeros past the end, as at a true sequence end)
and HiFT's decode with a frame mask (masked activations at every rate, STFT reflection at the
true end, iSTFT normalised over the valid frames) - see ``voice_generator/estimator.py`` and
``hift.py``. The valid frames equal the unpadded computation up to float rounding. A window larger
than every bucket runs the unpadded eager path (the reference).

Padding costs kernels, though: the masked statistics make a padded ODE step about 1.6x the
kernels of an unpadded one (``benchmarks/bench_flow_kernels.py``). So by default a window on this
path is first *widened* leftwards, with more of the already final speech as context, to one of
the sizes with an unpadded ("full") step of its own (``FULL_FLOW_WINDOWS``,
``EmissionPolicy.window_frames``): every window then runs a full step, except where the utterance
does not reach back far enough (a reply's second chunk; with 'quality', whose windows are longer,
the fourth too). Windows of concurrent calls in one bucket still share one step: the unpadded one
when they all have a first chunk's size (``FIRST_WINDOW_FRAMES``: calls that start speaking
together), else the bucket's padded one (two 88-frame windows, or 87 and 88 frames, say) - later
windows of several calls rarely line up (``BENCHMARKS.md`` section 5), and an unpadded step per
size and row count would be a capture each at start-up for little.

What is captured per bucket:
    flow:    the length regulator's convolutions on the window's stretched token features (in a
             padded step with its GroupNorm statistics over the valid frames, as the ODE's), then
             the whole ODE (all Euler steps, both CFG halves as one batch-2 estimator call each).
             The token encoder before it (six transformer blocks at the real size, some hundreds
             of launches a window eagerly) has steps of its own, padded to a token bucket
             (``TOKEN_BUCKETS``) with the padding keys masked - it attends to the whole window, so
             the mask, not causality, keeps the padding out - run by the window's own thread, one
             at a time (``encode_tokens``).
    vocoder: HiFT's decode (source STFT, conv stack, iSTFT). The F0 predictor before it (five
             convolutions on the window's mel) has steps of its own, padded to a vocoder bucket
             with a frame mask, run by the window's own thread like the token encoder's
             (``predict_f0``); the harmonic source between the two stays eager (it carries the
             utterance's phase from window to window and starts at the window's context offset).
Random noise is never drawn inside: the noise tapes' values are copied into the static inputs.

Calls share one :class:`SynthesisGraphs` (threads: each call speaks in its own). Every window
waits in one queue, and the first thread that finds no step running runs the next one for the
others too: the oldest window and, up to ``rows``, the windows waiting for the same stage and
bucket - one batched step (a padded row per window; CFG doubles the flow's rows) instead of a
replay per call. A chunk's vocoder window follows its flow window after a little eager work (the
F0 predictor, the harmonic source), so a vocoder step first waits briefly for the vocoder windows
of the utterances that were in the last flow step (``gather``); without it, the utterances of one
flow step split over several vocoder steps. Likewise a flow step waits for the utterances of the
last vocoder step that said their next flow window follows at once (``more``: its speech tokens
are already there); the others come when their tokens do. On a GPU a step costs its launches,
not its rows (our H100 notes, docs/GPU.md: the flow estimator 1.9 ms for one window, 2.9 ms for sixteen),
so calls that speak at the same time stop queueing behind each other. Each bucket holds ``rows``
rows of static buffers and a step (a graph) per row count n = 1, 2, 4 ... rows; idle rows inside
a step hold a harmless window. ``rows=1`` runs every window alone, in order of arrival.

First windows are gathered on purpose. On a GPU a step's host part is only its launches, so
windows that the calls make a few milliseconds apart never find each other in the queue: eight
calls whose callers stopped speaking together ran eight first-window steps one after another
(BENCHMARKS.md section 5: a flow step of 50-65 ms each, the largest part of their first audio). So
``start_speaking`` announces each new utterance (``expect_first_window``), and a step whose
oldest window is an utterance's first waits for the first windows of the other announced
utterances - at most ``first_gather`` times a first-window step's time (measured on the device:
waiting longer would cost the early ones more than a step of its own costs the late one). An
utterance that does not come in time (its reply was cut, or its speech decoding is slow) is not
waited for again, and one garbage collected is not waited for at all. A call alone never waits.

Lifecycle: a :class:`SynthesisGraphs` belongs to one voice generator on one device and holds the
static buffers and graphs of the buckets used so far. ``start_speaking`` takes one explicitly,
or uses :func:`shared_graphs` (one per voice generator, ``rows=1``, created on first use). On
CUDA all its graphs share one memory pool (their steps never overlap, and each step's outputs
are copied out before the next). Capturing costs eager runs per bucket and row count - two
warm-up runs and the recording the first time a bucket captures a computation (padded or
unpadded: lazy library set-up happens there), one warm-up run at its other row counts (the same
kernels on more rows) - call :meth:`SynthesisGraphs.warm_up` at start-up to keep it off the first
reply (at full size on the H200 it took about a minute with eight rows). Moving or casting the
voice generator is detected and the buckets are rebuilt.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import Counter
from typing import Iterable, Optional

import torch

from taste_speech.announcements import Announcements, StepTimer
from taste_speech.batched_steps import step_sizes
from taste_speech.step_graph import StepGraph, resolve_mode, smallest_bucket

# Window sizes in mel frames (ascending). See the module docstring for the measured windows.
# 17 and 37 are the first chunks' flow windows of 'low_latency' (10 tokens) and 'quality' (12 +
# 10 lookahead tokens): they fill their bucket, so the first chunk - the one the caller waits
# for - runs the unpadded ODE (no masked statistics: a third fewer kernels). Later windows are
# widened to fill theirs (``EmissionPolicy.window_frames``).
FIRST_WINDOW_FRAMES = (17, 37)
# 384-640: the windows of steady chunks that grow to 300 tokens (``EmissionPolicy.max_chunk_tokens``;
# 20 context + 300 tokens is 551 frames). A step costs mostly its launches: on the H100 a flow step
# took 85 ms at 256 frames and 112 ms at 640 (BENCHMARKS.md section 5), so fewer, longer windows
# cost less per second of audio.
FLOW_BUCKETS = (17, 24, 37, 48, 88, 144, 256, 384, 512, 640)
# Window sizes with an unpadded ("full") step of their own: the first chunks', and pairs of adjacent
# sizes for the widened windows - a window starts on the flow's 2-frame grid, so whether it can
# fill a size depends on the parity of its end (``synthesis._window_start``).
FULL_FLOW_WINDOWS = (17, 37, 87, 88, 143, 144, 255, 256, 383, 384, 511, 512, 639, 640)
# Warm-up runs before a capture (``StepGraph``): the first capture of each of a bucket's
# computations gets StepGraph's two; later row counts of it one (lazy set-up is done by then).
REPEAT_WARMUP_RUNS = 1
# Speech tokens of a flow window (left context, chunk, lookahead) whose token encoder runs a padded step
TOKEN_BUCKETS = (16, 32, 64, 128, 256)
VOCODER_BUCKETS = (16, 24, 60, 92, 128, 256, 384, 512, 640)
# The least a vocoder step waits for the windows of its flow step's utterances: on CUDA a step's
# host time is its launches only (the GPU still works through it), the eager work between the
# two windows about a millisecond.
MIN_GATHER_S = 0.003
SYNTHESIS_KINDS = ("auto", "static", "dynamic")


def resolve_kind(kind: str, device: torch.device | str) -> str:
    """'static' (bucketed fixed-shape steps) or 'dynamic' (the eager reference); 'auto' is static on CUDA."""
    if kind not in SYNTHESIS_KINDS:
        raise ValueError(f"synthesis kind must be one of {SYNTHESIS_KINDS}, got {kind!r}")
    if kind == "auto":
        return "static" if torch.device(device).type == "cuda" else "dynamic"
    return kind


def _put(buffer: torch.Tensor, value: torch.Tensor) -> None:
    """Copy value into the first frames of a static buffer and zero the padding after it."""
    n = value.shape[-1]
    buffer[..., :n].copy_(value)
    buffer[..., n:].zero_()


def _valid_mask(mask: torch.Tensor, n: int) -> None:
    mask.zero_()
    mask[..., :n] = 1


class _Bucket:
    """Static inputs of up to ``rows`` windows of ``frames`` frames, and a step per row count and
    fill: ``padded`` (masks keep each window's valid frames exact) or, for steps of at most
    ``full_rows`` windows, ``full`` (every window fills the bucket: the unpadded computation, a
    third fewer kernels in the flow - no masked statistics). Only steps warmed up for it are full:
    a window that happens to fill another bucket must not stall a reply with a capture."""

    def __init__(self, name: str, frames: int, device, mode: str, pool, full_rows: int = 0,
                 repeat_warmup_runs: int = REPEAT_WARMUP_RUNS):
        self.name, self.frames, self.full_rows = name, frames, full_rows
        self._device, self._mode, self._pool = device, mode, pool
        self._repeat_warmup_runs = repeat_warmup_runs
        self.steps: dict[tuple[int, bool], StepGraph] = {}

    def step(self, n: int, full: bool = False) -> StepGraph:
        if (n, full) not in self.steps:
            fill = "full" if full else "padded"
            first = not any(is_full == full for _, is_full in self.steps)  # this computation's first capture
            runs = {} if first else {"warmup_runs": self._repeat_warmup_runs}
            self.steps[n, full] = StepGraph(lambda: self._compute(n, full), self._device, self._mode, pool=self._pool,
                                            name=f"{self.name} ({self.frames} frames x{n}, {fill})", **runs)
        return self.steps[n, full]

    def run(self, windows: list[tuple], n: int) -> list[torch.Tensor]:
        """The step over the first ``n`` rows (n >= len(windows)) for these windows, one output each."""
        for row, window in enumerate(windows):
            self._put_row(row, *window)
        self.mask[len(windows):n].fill_(1)  # idle rows: any finite window (an empty mask would divide by 0)
        full = n <= self.full_rows and all(self._valid(window) == self.frames for window in windows)  # idle rows: full
        out = self.step(n, full).run()
        # the outputs are overwritten by the next step: clone each window's valid part
        return [out[row:row + 1, ..., :self._valid(window)].clone() for row, window in enumerate(windows)]

    def _put_row(self, row: int, *window: torch.Tensor) -> None:
        raise NotImplementedError

    def _valid(self, window: tuple) -> int:
        raise NotImplementedError

    def _compute(self, n: int, full: bool) -> torch.Tensor:
        raise NotImplementedError


class _FlowBucket(_Bucket):
    """The flow's length regulator and ODE on ``frames``-frame windows: the stretched token features
    (``stretched``), cond, noise (rows, 80, frames), spks (rows, 80)."""

    def __init__(self, flow, frames: int, rows: int, device, dtype, mode: str, pool=None, full_rows: int = 0,
                 repeat_warmup_runs: int = REPEAT_WARMUP_RUNS, estimator=None):
        super().__init__("flow ODE", frames, device, mode, pool, full_rows, repeat_warmup_runs)
        self.flow = flow
        self.estimator = estimator  # None: the flow's own; else e.g. the compiled one
        c = flow.output_size
        self.stretched = torch.zeros(rows, flow.length_regulator.model[0].in_channels, frames, device=device,
                                     dtype=dtype)
        self.cond = torch.zeros(rows, c, frames, device=device, dtype=dtype)
        self.noise = torch.zeros_like(self.cond)
        self.mask = torch.zeros(rows, 1, frames, device=device, dtype=dtype)
        self.spks = torch.zeros(rows, c, device=device, dtype=dtype)

    def _compute(self, n: int, full: bool) -> torch.Tensor:
        # a full step has no padding: no mask (its multiplications by ones are left out)
        mask = None if full else self.mask[:n]
        mu = self.flow.length_regulator.regulate(self.stretched[:n], mask)
        return self.flow.decoder(mu, mask, self.spks[:n], self.cond[:n], self.noise[:n], padded=not full,
                                 estimator=self.estimator)

    def _put_row(self, row: int, stretched, spks, cond, noise) -> None:
        r = slice(row, row + 1)
        _put(self.stretched[r], stretched)
        _put(self.cond[r], cond)
        _put(self.noise[r], noise)
        _valid_mask(self.mask[r], stretched.shape[-1])
        self.spks[r].copy_(spks)

    def _valid(self, window: tuple) -> int:
        return window[0].shape[-1]


class _VocoderBucket(_Bucket):
    """HiFT's decode on ``frames``-frame windows: mel (rows, 80, frames), source (rows, 1, 256 frames)."""

    def __init__(self, hift, frames: int, rows: int, device, dtype, mode: str, pool=None,
                 repeat_warmup_runs: int = REPEAT_WARMUP_RUNS):
        super().__init__("HiFT decode", frames, device, mode, pool, repeat_warmup_runs=repeat_warmup_runs)
        self.hift = hift
        self.mel = torch.zeros(rows, hift.conv_pre.in_channels, frames, device=device, dtype=dtype)
        self.source = torch.zeros(rows, 1, frames * hift.samples_per_frame, device=device, dtype=dtype)
        self.mask = torch.zeros(rows, 1, frames, device=device, dtype=dtype)

    def _compute(self, n: int, full: bool) -> torch.Tensor:  # (vocoder buckets take padded steps only)
        return self.hift.decode(self.mel[:n], self.source[:n], frame_mask=self.mask[:n])

    def _put_row(self, row: int, mel, source) -> None:
        r = slice(row, row + 1)
        _put(self.mel[r], mel)
        _put(self.source[r], source)
        _valid_mask(self.mask[r], mel.shape[-1])

    def _valid(self, window: tuple) -> int:
        return window[1].shape[-1]


class _Window:
    """One call's window waiting for a step: its stage, bucket (None: too large, eager) and inputs."""

    __slots__ = ("stage", "bucket", "inputs", "owner", "more", "first", "output")

    def __init__(self, stage: str, bucket: Optional[int], inputs: tuple, owner=None, more: bool = False):
        self.stage, self.bucket, self.inputs = stage, bucket, inputs
        self.owner = owner  # the utterance (its SynthesisState), or None
        self.more = more  # (vocoder) the owner's next flow window follows at once
        self.first = False  # (flow) the first window of an announced utterance
        self.output = None  # the result, or the exception the step raised


class _TokenEncoderBucket:
    """The flow's token encoder for windows of up to ``tokens`` tokens: static ids and a key mask, padded."""

    def __init__(self, flow, tokens: int, device, mode: str, pool):
        self.flow = flow
        with torch.inference_mode(False):
            self.ids = torch.zeros(1, tokens, dtype=torch.long, device=device)
            self.valid = torch.zeros(1, tokens, dtype=torch.bool, device=device)
        self.step = StepGraph(self._encode, device, mode, pool=pool, name=f"flow token encoder ({tokens} tokens)")

    def run(self, tokens: torch.Tensor) -> torch.Tensor:
        """(1, n) ids -> (1, n, 80), as ``flow.encode_tokens``; a copy (the outputs are overwritten next run)."""
        n = tokens.shape[1]
        self.ids[:, :n].copy_(tokens)
        self.ids[:, n:].zero_()
        self.valid[:, :n].fill_(True)
        self.valid[:, n:].fill_(False)
        return self.step.run()[:, :n].clone()

    def _encode(self) -> torch.Tensor:
        emb = self.flow.input_embedding(self.ids.clamp(min=0))
        return self.flow.encoder_proj(self.flow.encoder(emb, self.valid))


class _F0Bucket:
    """HiFT's F0 predictor for mel windows of up to ``frames`` frames: a static mel and frame mask, padded."""

    def __init__(self, hift, frames: int, device, dtype, mode: str, pool):
        self.hift = hift
        with torch.inference_mode(False):  # (made during warm_up, written by callers in or out of inference mode)
            self.mel = torch.zeros(1, hift.conv_pre.in_channels, frames, device=device, dtype=dtype)
            self.mask = torch.zeros(1, 1, frames, device=device, dtype=dtype)
        self.step = StepGraph(lambda: hift.f0_predictor(self.mel, self.mask), device, mode, pool=pool,
                              name=f"HiFT F0 predictor ({frames} frames)")

    def run(self, mel: torch.Tensor) -> torch.Tensor:
        """(1, 80, n) -> (1, n), as ``hift.f0_predictor`` gives it; a copy (the output is overwritten next run)."""
        n = mel.shape[-1]
        _put(self.mel, mel)
        _valid_mask(self.mask, n)
        return self.step.run()[:, :n].clone()


class SynthesisGraphs:
    def __init__(self, vg, graph_mode: str = "auto", flow_buckets: Iterable[int] = FLOW_BUCKETS,
                 vocoder_buckets: Iterable[int] = VOCODER_BUCKETS, rows: int = 1, gather: float = 0.5,
                 full_flow_frames: Optional[Iterable[int]] = None,
                 batched_full_frames: Optional[Iterable[int]] = FIRST_WINDOW_FRAMES,
                 repeat_warmup_runs: int = REPEAT_WARMUP_RUNS, compile_flow: bool | str = False,
                 first_gather: float = 1.0, token_buckets: Iterable[int] = TOKEN_BUCKETS):
        """Bucketed steps for ``vg`` on its current device. ``graph_mode`` (see ``step_graph``):
        'auto' captures CUDA graphs on CUDA and runs the padded steps eagerly elsewhere; 'eager' and
        'rehearse' (the capture protocol without a graph) work on any device. ``rows``: the most
        windows (of concurrent calls) one step runs. ``gather``: how long a vocoder step waits for
        the windows of the last flow step's other utterances, as a fraction of that step's time
        (at least ``MIN_GATHER_S``; 0: no waiting), and a flow step for the next windows of the
        last vocoder step's utterances that have more to say. ``full_flow_frames``: the flow
        window sizes that run an unpadded step of their own (default: ``FULL_FLOW_WINDOWS`` up to
        the largest flow bucket); on the bucketed path later windows are widened to one of them.
        A window of another size runs the padded step of the smallest ``flow_buckets`` size that
        holds it. ``batched_full_frames``: the ``full_flow_frames`` sizes whose unpadded step also
        runs several windows at once (None: all of them); windows of the others share their
        bucket's padded step when they come together. ``repeat_warmup_runs``: warm-up runs before
        capturing a computation a bucket already captured at another row count. ``compile_flow``:
        run the flow's estimator inside the steps through ``torch.compile`` (True: inductor; a
        string: that backend), shapes dynamic so that one compilation serves every bucket and row
        count (two: padded and unpadded steps). On the H100 a compiled estimator took an unpadded
        ODE step from 52 to 41 ms (17 frames) and from 84 to 58 ms (256 frames), compiled for
        static shapes (BENCHMARKS.md section 5); compiling costs about a minute per compilation at
        start-up (inductor keeps its results on disk for the next start) and needs Triton on CUDA.
        Off by default. ``first_gather``: how long an utterance's first flow window waits for the
        first windows of the other utterances announced by ``start_speaking``, as a multiple of a
        first-window step's time (``warm_up`` measures it on the device, later first steps update
        it; 0: no waiting). ``token_buckets``: the window token counts the flow's token encoder
        pads to (empty: it runs eagerly, as the reference does)."""
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows must be an integer >= 1, got {rows!r}")
        if not 0 <= gather <= 1:
            raise ValueError(f"gather must be a fraction of a step between 0 and 1, got {gather!r}")
        self.gather = float(gather)
        self.vg = vg
        self.graph_mode = graph_mode
        self.rows = rows
        self.row_counts = step_sizes(rows)  # a step runs the first n rows of a bucket, n one of these
        self.flow_buckets = tuple(sorted(int(b) for b in flow_buckets))
        self.vocoder_buckets = tuple(sorted(int(b) for b in vocoder_buckets))
        if not self.flow_buckets or not self.vocoder_buckets or min(self.flow_buckets + self.vocoder_buckets) < 1:
            raise ValueError("bucket sizes must be positive frame counts, at least one per stage")
        if full_flow_frames is None:
            full_flow_frames = [f for f in FULL_FLOW_WINDOWS if f <= self.flow_buckets[-1]]
        self.full_flow_frames = tuple(sorted({int(f) for f in full_flow_frames}))
        if self.full_flow_frames and self.full_flow_frames[0] < 1:
            raise ValueError("full_flow_frames must be positive frame counts")
        batched = self.full_flow_frames if batched_full_frames is None else batched_full_frames
        self.batched_full_frames = tuple(sorted({int(f) for f in batched} & set(self.full_flow_frames)))
        if isinstance(repeat_warmup_runs, bool) or not isinstance(repeat_warmup_runs, int) or repeat_warmup_runs < 0:
            raise ValueError(f"repeat_warmup_runs must be an integer >= 0, got {repeat_warmup_runs!r}")
        self.repeat_warmup_runs = repeat_warmup_runs
        if not isinstance(compile_flow, (bool, str)) or compile_flow == "":
            raise ValueError(f"compile_flow must be True, False or a torch.compile backend name, got {compile_flow!r}")
        if compile_flow and repeat_warmup_runs < 1:  # compiling launches work a capture must not record
            raise ValueError("compile_flow needs repeat_warmup_runs >= 1: a step compiles in its warm-up runs")
        self.compile_flow = compile_flow
        if isinstance(first_gather, bool) or not isinstance(first_gather, (int, float)) or \
                not math.isfinite(first_gather) or first_gather < 0:
            raise ValueError(f"first_gather must be a number of first-window steps >= 0, got {first_gather!r}")
        self.first_gather = float(first_gather)
        self.token_buckets = tuple(sorted(int(b) for b in token_buckets))
        if self.token_buckets and self.token_buckets[0] < 1:
            raise ValueError("token_buckets must be positive token counts")
        self.counts: Counter = Counter()  # windows per ('flow' | 'vocoder', bucket frames or None = eager fallback)
        self.padded_frames: Counter = Counter()  # padding frames computed per stage (how much padding occurred)
        self.padded_windows: Counter = Counter()  # windows per stage that ran a padded (masked) step
        self.batches: Counter = Counter()  # steps per ('flow' | 'vocoder', windows in the step)
        self.first_batches: Counter = Counter()  # first-window flow steps per first windows in the step
        self._queue: list[_Window] = []
        self._lock = threading.Condition()
        self._side_lock = threading.Lock()  # one token-encoder or F0 step at a time (shared static inputs)
        self._stepping = False  # a thread is running a step (or capturing)
        # id(owner) of the utterances whose next window of each stage is due at once
        self._awaited: dict[str, set[int]] = {"flow": set(), "vocoder": set()}
        self._flow_step_s = 0.0  # the last flow step's time
        self._starting = Announcements()  # new utterances whose first flow window has not come yet
        self._first_step = StepTimer()  # a first-window step's time on the device (how long first windows wait)
        self._fingerprint = None
        self._reset()

    # -- public ---------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def mode(self) -> str:
        """The concrete step mode: 'graph', 'eager' or 'rehearse'."""
        return self._mode

    def bucket_for(self, stage: str, frames: int) -> Optional[int]:
        """The bucket a ``frames``-frame window of ``stage`` ('flow' or 'vocoder') is padded to
        (None: eager). Windows of one bucket are stepped together; a flow step whose windows all
        have one ``full_flow_frames`` size runs that size's unpadded step instead."""
        sizes = self.flow_buckets if stage == "flow" else self.vocoder_buckets
        return smallest_bucket(sizes, frames)

    def prepared(self) -> dict[str, list[int]]:
        """The bucket sizes with static buffers (and a graph once run) per stage."""
        return {"flow": sorted(self._flow), "vocoder": sorted(self._vocoder)}

    def fallback_reasons(self) -> dict[str, str]:
        """Steps whose capture failed (they run eagerly), with the reason."""
        steps = [step for b in (*self._flow.values(), *self._vocoder.values()) for step in b.steps.values()]
        with self._side_lock:
            steps += [side.step for side in (*self._encoders.values(), *self._f0.values())]
        return {step.name: step.fallback_reason for step in steps if step.fallback_reason}

    def stats(self) -> dict:
        """Windows and steps per stage, and the mean windows per step (how much batching occurred)."""
        with self._lock:
            out = {"rows": self.rows, "mode": self._mode}
            for stage in ("flow", "vocoder"):
                steps = sum(c for (s, _), c in self.batches.items() if s == stage)
                windows = sum(n * c for (s, n), c in self.batches.items() if s == stage)
                out[stage] = {"windows": windows, "steps": steps,
                              "mean_batch": round(windows / steps, 3) if steps else None}
            steps = sum(self.first_batches.values())
            windows = sum(n * c for n, c in self.first_batches.items())
            out["first_windows"] = {"windows": windows, "steps": steps,
                                    "mean_batch": round(windows / steps, 3) if steps else None,
                                    **self._starting.stats()}
            return out

    def encode_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """A flow window's speech tokens (1, n) through the flow's token encoder: (1, n, 80), as
        ``flow.encode_tokens`` gives them - the padded step of the smallest ``token_buckets`` size
        that holds them, or eagerly (more tokens, or eager mode). Windows of several calls take
        turns (a step's inputs are shared buffers: all synthesis work runs on one stream)."""
        bucket = smallest_bucket(self.token_buckets, tokens.shape[1])
        if bucket is None or self._mode == "eager" or self._weights() != self._fingerprint:
            return self.vg.flow.encode_tokens(tokens)  # (moved weights: the next step rebuilds the buckets)
        with self._side_lock:
            encoders = self._encoders
            if bucket not in encoders:
                encoders[bucket] = _TokenEncoderBucket(self.vg.flow, bucket, self._device, self._mode,
                                                       self._side_pool)
            return encoders[bucket].run(tokens)

    def predict_f0(self, mel: torch.Tensor) -> torch.Tensor:
        """A vocoder window's mel (1, 80, n) through HiFT's F0 predictor: (1, n), as
        ``hift.f0_predictor`` gives it - the padded step of the smallest vocoder bucket that holds
        it, or eagerly (a longer window, or eager mode). Windows of several calls take turns, as
        with ``encode_tokens``."""
        bucket = self.bucket_for("vocoder", mel.shape[-1])
        if bucket is None or self._mode == "eager" or self._weights() != self._fingerprint:
            return self.vg.hift.f0_predictor(mel)  # (moved weights: the next step rebuilds the buckets)
        with self._side_lock:
            if bucket not in self._f0:
                self._f0[bucket] = _F0Bucket(self.vg.hift, bucket, self._device, self._dtype, self._mode,
                                             self._side_pool)
            return self._f0[bucket].run(mel)

    def expect_first_window(self, owner) -> None:
        """Announce a new utterance (``start_speaking`` does): the first flow window of another
        utterance then waits a little for this one's (module docstring). Held weakly."""
        if self.rows == 1 or not self.first_gather:  # nothing to gather for
            return
        with self._lock:
            self._starting.add(owner)

    def forget_first_window(self, owner) -> None:
        """An announced utterance given up before its first window (``stop_speaking``: a reply
        dropped): no first window waits for it any more."""
        with self._lock:
            self._starting.withdraw(owner)
            self._lock.notify_all()  # (a step waiting for it goes on)

    def flow(self, stretched: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, noise: torch.Tensor,
             owner=None) -> torch.Tensor:
        """The flow on one window from its token features stretched to its frames (the length
        regulator's convolutions, then the ODE): stretched, cond, noise (1, 80, n), spks (1, 80) ->
        mel (1, 80, n). ``owner``: the utterance (its state), whose vocoder window is then awaited
        by the next vocoder step (None: no waiting for it)."""
        window = _Window("flow", self.bucket_for("flow", stretched.shape[-1]), (stretched, spks, cond, noise), owner)
        return self._submit(window)

    def vocoder(self, mel: torch.Tensor, source: torch.Tensor, owner=None, more: bool = False) -> torch.Tensor:
        """HiFT's decode on one window: mel (1, 80, n), source (1, 1, 256 n) -> waveform (1, 256 n), unclamped.
        ``more``: the owner's next flow window follows at once (the next flow step waits for it)."""
        window = _Window("vocoder", self.bucket_for("vocoder", mel.shape[-1]), (mel, source), owner, more)
        return self._submit(window)

    @torch.inference_mode()
    def warm_up(self, flow_frames: Optional[Iterable[int]] = None,
                vocoder_frames: Optional[Iterable[int]] = None) -> None:
        """Capture the steps windows of these sizes take now (default: every bucket and every
        full size), each row count, so that no live step pays for a capture: the padded step of
        the bucket holding each, and the unpadded step of each that is one of ``full_flow_frames``
        (at every row count for ``batched_full_frames``, else alone). Not counted in ``counts``."""
        flow_frames = self.flow_buckets + self.full_flow_frames if flow_frames is None else flow_frames
        vocoder_frames = self.vocoder_buckets if vocoder_frames is None else vocoder_frames
        with self._exclusive():
            zeros = lambda *shape: torch.zeros(*shape, device=self._device, dtype=self._dtype)  # noqa: E731
            c = self.vg.flow.output_size
            n_mel = self.vg.hift.conv_pre.in_channels
            spf = self.vg.hift.samples_per_frame

            def flow_window(frames: int) -> tuple:
                return zeros(1, c, frames), zeros(1, c), zeros(1, c, frames), zeros(1, c, frames)

            # largest first: later captures reuse the shared pool's memory instead of growing it
            for n in reversed(self.row_counts):
                padded = {self.bucket_for("flow", f) for f in flow_frames} - {None}
                full = {f for f in flow_frames if f in self._full_sizes(n)}
                for size in sorted(padded | full, reverse=True):
                    bucket = self._flow_bucket(size)
                    if size in padded:  # a window one frame short (a 1-frame bucket: its only step)
                        bucket.run([flow_window(max(1, size - 1))] * n, n)
                    if size in full:
                        bucket.run([flow_window(size)] * n, n)
                for size in sorted({self.bucket_for("vocoder", f) for f in vocoder_frames} - {None}, reverse=True):
                    short = max(1, size - 1)
                    self._vocoder_bucket(size).run([(zeros(1, n_mel, short), zeros(1, 1, short * spf))] * n, n)
            self._time_first_step(flow_window)
        for bucket in self.token_buckets:  # the token encoder's steps (a window one token short)
            self.encode_tokens(torch.zeros(1, bucket - 1, dtype=torch.long, device=self._device))
        n_mel = self.vg.hift.conv_pre.in_channels
        for bucket in sorted({self.bucket_for("vocoder", f) for f in vocoder_frames} - {None}):  # the F0 predictor's
            self.predict_f0(torch.zeros(1, n_mel, max(1, bucket - 1), device=self._device, dtype=self._dtype))

    def _time_first_step(self, flow_window) -> None:
        """(Warm-up.) A first window's step alone, timed on the device: how long first windows wait
        for other utterances' (``first_gather``) until live first steps are measured."""
        sizes = [f for f in FIRST_WINDOW_FRAMES if f in self._flow and (1, True) in self._flow[f].steps]
        if not sizes or self.rows == 1:
            return
        cuda = self._device.type == "cuda"
        if cuda:
            torch.cuda.current_stream(self._device).synchronize()
        started = time.perf_counter()
        self._flow[sizes[0]].run([flow_window(sizes[0])], 1)
        if cuda:
            torch.cuda.current_stream(self._device).synchronize()
        self._first_step.measured(time.perf_counter() - started)

    def __deepcopy__(self, memo):
        return self  # scratch buffers and graphs, no per-utterance state: a copied state shares them

    # -- steps ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def _submit(self, window: _Window) -> torch.Tensor:
        """Queue the window; the first thread to find no step running runs steps until its own
        window is done (serving the windows it batches with), the others wait for theirs."""
        with self._lock:
            if window.stage == "flow" and self._starting.arrive(window.owner):
                window.first = True
            self._queue.append(window)
            self._lock.notify_all()  # a step may be gathering its windows
            while window.output is None:
                if self._stepping:
                    self._lock.wait()
                    continue
                self._stepping = True
                try:
                    self._check_weights()
                    self._gather_windows()
                    batch = self._next_batch()
                    self._lock.release()
                    started = time.perf_counter()
                    try:
                        timer = self._first_step.start(self._device) if batch[0].first else None
                        self._run(batch)
                        if batch[0].first:
                            self._first_step.stop(timer, time.perf_counter() - started)
                    except BaseException as error:  # (the timer's events): the windows taken must not wait for ever
                        for w in batch:
                            w.output = error if w.output is None else w.output
                    finally:
                        self._lock.acquire()
                    self._after_step(batch, time.perf_counter() - started)
                finally:
                    self._stepping = False
                    self._lock.notify_all()
        if isinstance(window.output, BaseException):
            raise window.output
        return window.output

    def _gather_windows(self) -> None:
        """(Lock held.) Wait until every utterance awaited by the oldest window's stage has its
        window queued, or ``gather`` x the last flow step's time has passed (at least
        ``MIN_GATHER_S``). Once per step: an utterance that did not come is not waited for again.
        An utterance's first window waits for the other new utterances' instead."""
        oldest = self._queue[0]
        stage = oldest.stage
        if oldest.first:
            self._gather_first_windows(oldest)
            self._awaited[stage].clear()  # (as below: once per step)
            return
        awaited = self._awaited[stage]
        # Wait only within a round: when the oldest window is one of the awaited utterances'. A
        # window from elsewhere (a new reply's first chunk) waits for nobody - an awaited
        # utterance may have been dropped (a barge-in) and would never come.
        if not awaited or not self.gather or self.rows == 1 or id(oldest.owner) not in awaited:
            awaited.clear()
            return
        deadline = time.perf_counter() + max(self.gather * self._flow_step_s, MIN_GATHER_S)
        while True:
            queued = {id(w.owner) for w in self._queue if w.stage == stage}
            if awaited <= queued or (left := deadline - time.perf_counter()) <= 0:
                break
            self._lock.wait(left)
        awaited.clear()

    def _gather_first_windows(self, oldest: _Window) -> None:
        """(Lock held.) Wait until the announced utterances have queued their first windows (or
        the bucket's rows are full), at most ``first_gather`` first-window steps."""
        if oldest.bucket is None or not self.first_gather:
            self._starting.gather(self._lock, 0.0)
            return
        full = lambda: sum(w.first and w.bucket == oldest.bucket for w in self._queue) >= self.rows  # noqa: E731
        self._starting.gather(self._lock, self.first_gather * self._first_step.last(), full)

    def _after_step(self, batch: list[_Window], seconds: float) -> None:
        """(Lock held.) Statistics; the utterances whose next window (of the other stage) is due at
        once are awaited by the next step of that stage."""
        stage = batch[0].stage
        self.batches[stage, len(batch)] += 1
        if batch[0].first:
            self.first_batches[sum(w.first for w in batch)] += 1
        for w in batch:
            if w.owner is None or isinstance(w.output, BaseException):
                continue
            if stage == "flow":
                self._awaited["vocoder"].add(id(w.owner))
            elif w.more:
                self._awaited["flow"].add(id(w.owner))
        if stage == "flow":
            self._flow_step_s = seconds

    def _next_batch(self) -> list[_Window]:
        """(Lock held.) The oldest window and the windows waiting for the same stage and bucket,
        up to ``rows``, taken off the queue; a window larger than every bucket runs alone. Flow
        windows that all have one ``full_flow_frames`` size run that size's unpadded step; mixed
        sizes (87 and 88 frames, say) share their bucket's padded step: one step for all of them
        costs fewer kernels than a step per size."""
        first = self._queue[0]
        if first.bucket is None:
            batch = [first]
        else:
            same = [w for w in self._queue if (w.stage, w.bucket) == (first.stage, first.bucket)]
            batch = same[:self.rows]
            sizes = {w.inputs[0].shape[-1] for w in batch}
            if first.stage == "flow" and len(sizes) == 1 and (size := sizes.pop()) in self._full_sizes(len(batch)):
                for w in batch:
                    w.bucket = size
        taken = set(map(id, batch))
        self._queue = [w for w in self._queue if id(w) not in taken]
        full = first.stage == "flow" and first.bucket in self._full_sizes(len(batch)) and \
            all(w.inputs[0].shape[-1] == first.bucket for w in batch)
        for w in batch:
            self.counts[w.stage, w.bucket] += 1
            self.padded_frames[w.stage] += 0 if w.bucket is None else w.bucket - w.inputs[0].shape[-1]
            self.padded_windows[w.stage] += w.bucket is not None and not full  # ran a masked step
        return batch

    def _run(self, batch: list[_Window]) -> None:
        """One step for ``batch`` (one stage, one bucket); each window gets its output or the error."""
        first = batch[0]
        try:
            if first.bucket is None:  # the unpadded reference path, at the window's own size
                outputs = [self._eager(first)]
            else:
                bucket = (self._flow_bucket if first.stage == "flow" else self._vocoder_bucket)(first.bucket)
                n = next(n for n in self.row_counts if n >= len(batch))
                outputs = bucket.run([w.inputs for w in batch], n)
        except BaseException as error:  # every window of this step fails; the next steps may not
            outputs = [error] * len(batch)
        for w, output in zip(batch, outputs):
            w.output = output

    def _eager(self, window: _Window) -> torch.Tensor:
        if window.stage == "vocoder":
            return self.vg.hift.decode(*window.inputs)
        stretched, spks, cond, noise = window.inputs  # one whole window: every frame valid
        return self.vg.flow.decoder(self.vg.flow.length_regulator.regulate(stretched), None, spks, cond, noise)

    @contextlib.contextmanager
    def _exclusive(self):
        """No step runs inside (captures, rebuilding after the weights moved)."""
        with self._lock:
            while self._stepping:
                self._lock.wait()
            self._stepping = True
            self._check_weights()
        try:
            yield
        finally:
            with self._lock:
                self._stepping = False
                self._lock.notify_all()

    # -- internals ------------------------------------------------------------------------------
    def _full_sizes(self, windows: int) -> tuple[int, ...]:
        """The window sizes whose unpadded step runs ``windows`` windows at once."""
        return self.full_flow_frames if windows == 1 else self.batched_full_frames

    def _flow_bucket(self, size: int) -> _FlowBucket:
        if size not in self._flow:
            full_rows = self.rows if size in self.batched_full_frames else int(size in self.full_flow_frames)
            self._flow[size] = _FlowBucket(self.vg.flow, size, self.rows, self._device, self._dtype, self._mode,
                                           self._pool, full_rows, self.repeat_warmup_runs, self._estimator)
        return self._flow[size]

    def _vocoder_bucket(self, size: int) -> _VocoderBucket:
        if size not in self._vocoder:
            self._vocoder[size] = _VocoderBucket(self.vg.hift, size, self.rows, self._device, self._dtype,
                                                 self._mode, self._pool, self.repeat_warmup_runs)
        return self._vocoder[size]

    def _weights(self):
        estimator = next(self.vg.flow.decoder.estimator.parameters())
        vocoder = next(self.vg.hift.parameters())
        encoder = next(self.vg.flow.encoder.parameters())
        regulator = next(self.vg.flow.length_regulator.parameters())
        return (estimator.device, estimator.dtype, estimator.data_ptr(), vocoder.data_ptr(), encoder.data_ptr(),
                regulator.data_ptr())

    def _reset(self) -> None:
        fingerprint = self._weights()
        self._device, self._dtype = fingerprint[0], fingerprint[1]
        self._mode = resolve_mode(self.graph_mode, self._device)
        # one pool for every graph: their steps never overlap and their outputs are copied out at once
        self._pool = torch.cuda.graph_pool_handle() if self._mode == "graph" else None
        self._estimator = None
        if self.compile_flow:
            backend = "inductor" if self.compile_flow is True else self.compile_flow
            self._estimator = torch.compile(self.vg.flow.decoder.estimator, backend=backend, dynamic=True,
                                            fullgraph=True)
        self._flow: dict[int, _FlowBucket] = {}
        self._vocoder: dict[int, _VocoderBucket] = {}
        # the token encoder's and the F0 predictor's steps, run by the windows' threads outside the
        # queue, one at a time: a pool of their own
        with self._side_lock:
            self._side_pool = torch.cuda.graph_pool_handle() if self._mode == "graph" else None
            self._encoders: dict[int, _TokenEncoderBucket] = {}
            self._f0: dict[int, _F0Bucket] = {}
        self._fingerprint = fingerprint  # last: encode_tokens trusts the steps it finds once this matches

    def _check_weights(self) -> None:
        """A graph replays the weights at the addresses it was captured with: rebuild after a move or cast."""
        if self._weights() != self._fingerprint:
            self._reset()


# (only the creation: two calls starting their first utterance at once would each make their own)
_SHARED_GRAPHS_MADE = threading.Lock()


def shared_graphs(vg) -> SynthesisGraphs:
    """The voice generator's own :class:`SynthesisGraphs` (graph mode 'auto'), created on first use and
    kept on the voice generator, so that every utterance and call reuses its captured buckets."""
    with _SHARED_GRAPHS_MADE:
        graphs = vg.__dict__.get("_synthesis_graphs")
        if graphs is None or graphs.vg is not vg:  # absent, or inherited by a copy of the voice generator
            graphs = SynthesisGraphs(vg)
            vg.__dict__["_synthesis_graphs"] = graphs
        return graphs
