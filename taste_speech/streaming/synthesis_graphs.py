"""Fixed-shape (bucketed) flow and vocoder steps of streaming synthesis, captured as CUDA graphs.

Eager, a streaming step is launch-bound on a GPU: the flow's 10 Euler steps are 10 estimator calls
of hundreds of small kernels each (``GPU_NOTES.md``: ~19 ms per call eager, ~2 ms replayed). A CUDA
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

What is captured per bucket:
    flow:    the whole ODE (all Euler steps, both CFG halves as one batch-2 estimator call each);
             the token encoder and length regulator stay eager (they vary with the token count).
    vocoder: HiFT's decode (source STFT, conv stack, iSTFT); the F0 predictor and the harmonic
             source stay eager (small, and they depend on the window's context offset).
Random noise is never drawn inside: the noise tapes' values are copied into the static inputs.

Lifecycle: a :class:`SynthesisGraphs` belongs to one voice generator on one device and holds the
static buffers and graphs of the buckets used so far. Steps of several calls (threads) may share
it: each copy-in / replay / copy-out runs under its lock (all on the calling thread's current
stream, the default stream unless a caller changes it). ``start_speaking`` takes one explicitly,
or uses :func:`shared_graphs` (one per voice generator, created on first use). Capturing costs a
few eager runs per bucket: call :meth:`SynthesisGraphs.warm_up` at start-up to keep it off the
first reply. Moving or casting the voice generator is detected and the buckets are rebuilt.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Iterable, Optional

import torch

from taste_speech.step_graph import StepGraph, resolve_mode

# Window sizes in mel frames (ascending). See the module docstring for the measured windows.
FLOW_BUCKETS = (24, 48, 88, 144, 256)
VOCODER_BUCKETS = (16, 24, 60, 92, 128, 256)
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


class _FlowBucket:
    """Static inputs of a ``frames``-frame flow window and its captured ODE."""

    def __init__(self, flow, frames: int, device, dtype, mode: str):
        c = flow.output_size
        self.frames = frames
        self.mu = torch.zeros(1, c, frames, device=device, dtype=dtype)
        self.cond = torch.zeros_like(self.mu)
        self.noise = torch.zeros_like(self.mu)
        self.mask = torch.zeros(1, 1, frames, device=device, dtype=dtype)
        self.spks = torch.zeros(1, c, device=device, dtype=dtype)
        self.step = StepGraph(lambda: flow.decoder(self.mu, self.mask, self.spks, self.cond, self.noise, padded=True),
                              device, mode, name=f"flow ODE ({frames} frames)")

    def run(self, mu, spks, cond, noise) -> torch.Tensor:
        n = mu.shape[-1]
        _put(self.mu, mu)
        _put(self.cond, cond)
        _put(self.noise, noise)
        _valid_mask(self.mask, n)
        self.spks.copy_(spks)
        return self.step.run()[..., :n].clone()  # the output buffer is overwritten by the next replay


class _VocoderBucket:
    """Static inputs of a ``frames``-frame HiFT window and its captured decode."""

    def __init__(self, hift, frames: int, device, dtype, mode: str):
        self.frames = frames
        self.mel = torch.zeros(1, hift.conv_pre.in_channels, frames, device=device, dtype=dtype)
        self.source = torch.zeros(1, 1, frames * hift.samples_per_frame, device=device, dtype=dtype)
        self.mask = torch.zeros(1, 1, frames, device=device, dtype=dtype)
        self.step = StepGraph(lambda: hift.decode(self.mel, self.source, frame_mask=self.mask),
                              device, mode, name=f"HiFT decode ({frames} frames)")

    def run(self, mel, source) -> torch.Tensor:
        n = mel.shape[-1]
        _put(self.mel, mel)
        _put(self.source, source)
        _valid_mask(self.mask, n)
        return self.step.run()[..., :source.shape[-1]].clone()


class SynthesisGraphs:
    def __init__(self, vg, graph_mode: str = "auto", flow_buckets: Iterable[int] = FLOW_BUCKETS,
                 vocoder_buckets: Iterable[int] = VOCODER_BUCKETS):
        """Bucketed steps for ``vg`` on its current device. ``graph_mode`` (see ``step_graph``):
        'auto' captures CUDA graphs on CUDA and runs the padded steps eagerly elsewhere; 'eager' and
        'rehearse' (the capture protocol without a graph) work on any device."""
        self.vg = vg
        self.graph_mode = graph_mode
        self.flow_buckets = tuple(sorted(int(b) for b in flow_buckets))
        self.vocoder_buckets = tuple(sorted(int(b) for b in vocoder_buckets))
        if not self.flow_buckets or not self.vocoder_buckets or min(self.flow_buckets + self.vocoder_buckets) < 1:
            raise ValueError("bucket sizes must be positive frame counts, at least one per stage")
        self.counts: Counter = Counter()  # steps per ('flow' | 'vocoder', bucket frames or None = eager fallback)
        self.padded_frames: Counter = Counter()  # padding frames computed per stage (how much padding occurred)
        self._lock = threading.Lock()
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
        """The bucket a ``frames``-frame window of ``stage`` ('flow' or 'vocoder') is padded to (None: eager)."""
        sizes = self.flow_buckets if stage == "flow" else self.vocoder_buckets
        return next((b for b in sizes if b >= frames), None)

    def prepared(self) -> dict[str, list[int]]:
        """The bucket sizes with static buffers (and a graph once run) per stage."""
        return {"flow": sorted(self._flow), "vocoder": sorted(self._vocoder)}

    def fallback_reasons(self) -> dict[str, str]:
        """Buckets whose capture failed (they run eagerly), with the reason."""
        steps = [*self._flow.values(), *self._vocoder.values()]
        return {b.step.name: b.step.fallback_reason for b in steps if b.step.fallback_reason}

    @torch.inference_mode()
    def flow(self, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """The flow's ODE on one window: mu, cond, noise (1, 80, n), spks (1, 80) -> mel (1, 80, n)."""
        n = mu.shape[-1]
        with self._lock:
            self._check_weights()
            size = self.bucket_for("flow", n)
            self.counts["flow", size] += 1
            self.padded_frames["flow"] += 0 if size is None else size - n
            if size is None:
                mask = torch.ones(1, 1, n, device=mu.device, dtype=mu.dtype)
                return self.vg.flow.decoder(mu, mask, spks, cond, noise)
            return self._flow_bucket(size).run(mu, spks, cond, noise)

    @torch.inference_mode()
    def vocoder(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """HiFT's decode on one window: mel (1, 80, n), source (1, 1, 256 n) -> waveform (1, 256 n), unclamped."""
        n = mel.shape[-1]
        with self._lock:
            self._check_weights()
            size = self.bucket_for("vocoder", n)
            self.counts["vocoder", size] += 1
            self.padded_frames["vocoder"] += 0 if size is None else size - n
            if size is None:
                return self.vg.hift.decode(mel, source)
            return self._vocoder_bucket(size).run(mel, source)

    @torch.inference_mode()
    def warm_up(self, flow_frames: Optional[Iterable[int]] = None,
                vocoder_frames: Optional[Iterable[int]] = None) -> None:
        """Capture the buckets holding these window sizes now (default: every bucket), so that no
        live step pays for a capture. Not counted in ``counts``."""
        flow_frames = self.flow_buckets if flow_frames is None else flow_frames
        vocoder_frames = self.vocoder_buckets if vocoder_frames is None else vocoder_frames
        with self._lock:
            self._check_weights()
            zeros = lambda *shape: torch.zeros(*shape, device=self._device, dtype=self._dtype)  # noqa: E731
            c = self.vg.flow.output_size
            for size in {self.bucket_for("flow", n) for n in flow_frames} - {None}:
                self._flow_bucket(size).run(zeros(1, c, size), zeros(1, c), zeros(1, c, size), zeros(1, c, size))
            for size in {self.bucket_for("vocoder", n) for n in vocoder_frames} - {None}:
                bucket = self._vocoder_bucket(size)
                bucket.run(zeros(*bucket.mel.shape), zeros(*bucket.source.shape))

    def __deepcopy__(self, memo):
        return self  # scratch buffers and graphs, no per-utterance state: a copied state shares them

    # -- internals ------------------------------------------------------------------------------
    def _flow_bucket(self, size: int) -> _FlowBucket:
        if size not in self._flow:
            self._flow[size] = _FlowBucket(self.vg.flow, size, self._device, self._dtype, self._mode)
        return self._flow[size]

    def _vocoder_bucket(self, size: int) -> _VocoderBucket:
        if size not in self._vocoder:
            self._vocoder[size] = _VocoderBucket(self.vg.hift, size, self._device, self._dtype, self._mode)
        return self._vocoder[size]

    def _weights(self):
        estimator = next(self.vg.flow.decoder.estimator.parameters())
        vocoder = next(self.vg.hift.parameters())
        return (estimator.device, estimator.dtype, estimator.data_ptr(), vocoder.data_ptr())

    def _reset(self) -> None:
        self._fingerprint = self._weights()
        self._device, self._dtype = self._fingerprint[0], self._fingerprint[1]
        self._mode = resolve_mode(self.graph_mode, self._device)
        self._flow: dict[int, _FlowBucket] = {}
        self._vocoder: dict[int, _VocoderBucket] = {}

    def _check_weights(self) -> None:
        """A graph replays the weights at the addresses it was captured with: rebuild after a move or cast."""
        if self._weights() != self._fingerprint:
            self._reset()


def shared_graphs(vg) -> SynthesisGraphs:
    """The voice generator's own :class:`SynthesisGraphs` (graph mode 'auto'), created on first use and
    kept on the voice generator, so that every utterance and call reuses its captured buckets."""
    graphs = vg.__dict__.get("_synthesis_graphs")
    if graphs is None or graphs.vg is not vg:  # absent, or inherited by a copy of the voice generator
        graphs = SynthesisGraphs(vg)
        vg.__dict__["_synthesis_graphs"] = graphs
    return graphs
