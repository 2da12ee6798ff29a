"""StepGraph: one fixed-shape decode step, replayed as a CUDA graph on CUDA, run eagerly elsewhere.

At batch 1 a decode step is hundreds of small kernels, and launching them costs more than running
them (our H100 notes, docs/GPU.md: ~10 us per launch, a Llama-1B step 20 ms eager vs 3.4 ms replayed). A CUDA
graph records the launches once and replays them with one call. What makes a step replayable:

- every tensor it reads or writes lives at a fixed address: the owner keeps static input buffers,
  copies new values into them before ``run()``, and reads the returned (static) outputs, cloning
  what it keeps beyond the next step;
- no host synchronisation (``.item()``, Python branches on tensor values) and no new shapes inside;
- positions come from device tensors updated in place (e.g. a static KV cache's length counter).

Capturing needs a few warm-up runs first (lazy allocations, library autotuning). A step usually has
side effects (it writes its keys/values and advances a length counter), so the owner passes
``rewind``: it undoes one run's side effects, and is called after each warm-up run, before the
captured graph is replayed for real.

Modes: ``'graph'`` (CUDA only) captures at the first ``run()``; ``'eager'`` calls the step
directly; ``'rehearse'`` goes through the same warm-up/rewind cycle as a capture and then runs
eagerly, returning the same output tensors every run, overwritten, as a replay does - it lets CPU
tests prove that a step and its owner survive the capture protocol. ``'auto'`` is
``'graph'`` on CUDA and ``'eager'`` elsewhere. If capturing fails, the step falls back to eager and
keeps the reason in ``fallback_reason`` (a live call must not die because a graph could not be made).
"""

from __future__ import annotations

import gc
import logging
import threading
from contextlib import contextmanager
from typing import Callable, Generic, TypeVar

import torch

logger = logging.getLogger(__name__)

MODES = ("auto", "graph", "eager", "rehearse")
# While the profiler runs, every step's run is a range of this prefix and the step's name: the profiler
# files the kernels launched inside a range under it, so a profile tells each step's GPU time
# (``benchmarks/gpu_suite.device_time_by_step``). Outside profiling no range is made.
PROFILER_RANGE = "step: "
Outputs = TypeVar("Outputs")

# One capture (with its warm-up runs) at a time in the process: calls warm up from their own
# threads, and torch's capture bookkeeping (the allocator's capture pools) is not made for
# overlapping captures. Replays never wait for this.
_CAPTURE_LOCK = threading.Lock()
# One capture stream per device, used under the lock: graphs that share a memory pool (the
# synthesis buckets) reuse its blocks only when captured on the same stream. It is a high-priority
# stream: torch hands streams out round-robin from a small pool per priority, and the streams the
# plugin runs calls on come from the default priority's - one that turned out to be the capture
# stream would have its kernels recorded into another call's graph instead of run.
_CAPTURE_STREAMS: dict = {}
CAPTURE_PRIORITY = -1


def resolve_mode(mode: str, device: torch.device | str) -> str:
    """The concrete mode for ``device`` ('auto' -> 'graph' on CUDA, 'eager' elsewhere)."""
    if mode not in MODES:
        raise ValueError(f"step graph mode must be one of {MODES}, got {mode!r}")
    is_cuda = torch.device(device).type == "cuda"
    if mode == "auto":
        return "graph" if is_cuda else "eager"
    if mode == "graph" and not is_cuda:
        raise ValueError(f"CUDA graphs need a CUDA device, got {device}: use mode 'eager' or 'rehearse'")
    return mode


class StepGraph(Generic[Outputs]):
    def __init__(self, step: Callable[[], Outputs], device: torch.device | str, mode: str = "auto",
                 rewind: Callable[[], None] | None = None, warmup_runs: int = 2,
                 pool=None, name: str = "step"):
        """``step()`` reads the owner's static inputs and returns its outputs (tensors, or a tuple
        or dict of them). ``pool``: a graph memory pool to share with other graphs of the same
        owner (``torch.cuda.graph_pool_handle()``)."""
        self.step, self.rewind, self.name = step, rewind, name
        self.mode = resolve_mode(mode, device)
        self.device = torch.device(device)
        self.warmup_runs, self.pool = int(warmup_runs), pool
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: Outputs | None = None
        self.fallback_reason: str | None = None
        self._prepared = self.mode == "eager"

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def run(self) -> Outputs:
        """One step. The first call of a 'graph' or 'rehearse' step warms up (and captures) first."""
        if getattr(torch.autograd.profiler, "_is_profiler_enabled", False):  # (torch's own quick check)
            with torch.profiler.record_function(PROFILER_RANGE + self.name):
                return self._run()
        return self._run()

    def _run(self) -> Outputs:
        if not self._prepared:
            self._prepare()
        if self.graph is not None:
            self.graph.replay()
            return self.outputs
        if self.mode == "rehearse":
            # like a replay, every run returns the same output tensors, overwritten: an owner that
            # keeps an output past the next run without copying it fails its CPU tests too
            self.outputs = _overwrite(self.outputs, self.step())
            return self.outputs
        return self.step()

    def _warm_up(self) -> None:
        for _ in range(self.warmup_runs):
            self.step()
            if self.rewind is not None:
                self.rewind()

    def _prepare(self) -> None:
        self._prepared = True
        if self.mode == "rehearse":
            self._warm_up()
            return
        caller_stream = torch.cuda.current_stream(self.device)
        try:
            with _CAPTURE_LOCK:
                side = _CAPTURE_STREAMS.get(self.device)
                if side is None:
                    side = _CAPTURE_STREAMS[self.device] = torch.cuda.Stream(self.device, priority=CAPTURE_PRIORITY)
                side.wait_stream(caller_stream)
                with torch.cuda.stream(side):
                    self._warm_up()
                caller_stream.wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # thread_local: other calls keep using the GPU from their own threads during a capture
                with _no_garbage_collection(), torch.cuda.graph(graph, pool=self.pool, stream=side,
                                                                capture_error_mode="thread_local"):
                    self.outputs = self.step()
            self.graph = graph
        except Exception as error:  # a step that cannot be captured still runs, eagerly
            # a capture that failed half-way can leave its stream current: later work must not land on it
            torch.cuda.set_stream(caller_stream)
            try:
                torch.cuda.synchronize(self.device)
            except Exception:
                pass
            if self.rewind is not None:
                self.rewind()
            self.graph, self.outputs = None, None
            self.fallback_reason = f"{type(error).__name__}: {error}"
            logger.warning("CUDA graph capture of %s failed, running it eagerly: %s", self.name, self.fallback_reason)


def smallest_bucket(sizes, n: int) -> int | None:
    """The smallest of ``sizes`` (ascending) that holds ``n``: the padded step ``n`` rows (tokens,
    frames) take; None when none does (they run eagerly)."""
    return next((size for size in sizes if size >= n), None)


def fitting_bucket(sizes, rows: int, room: int) -> int | None:
    """The padded step a multi-row feed of ``rows`` rows takes into a cache with ``room`` free slots:
    the smallest of ``sizes`` that holds it, if its padding fits too; None: the feed runs eagerly
    (a single row takes the cache's one-row step)."""
    bucket = smallest_bucket(sizes, rows) if rows >= 2 else None
    return bucket if bucket is not None and bucket <= room else None


def all_captured(steps) -> bool:
    """Every one of ``steps`` (the ``StepGraph`` s an owner made so far) is a captured graph, and
    there is one."""
    steps = [step for step in steps if step is not None]
    return bool(steps) and all(step.captured for step in steps)


def first_fallback_reason(steps) -> str | None:
    """Why one of ``steps`` runs eagerly where a graph was asked for, if one does."""
    return next((step.fallback_reason for step in steps if step is not None and step.fallback_reason), None)


@contextmanager
def _no_garbage_collection():
    """No automatic garbage collection while a graph is captured. A collection runs in the thread
    that happens to allocate, here the capturing one; if it frees a CUDA graph (an ended call's
    cyclic garbage), destroying it is an operation a capturing thread may not do, and the capture
    fails (seen on the GPU as "operation not permitted when stream is capturing (function reset)").
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _overwrite(kept, new):
    """``new``'s values written into ``kept`` (same structure: tensors, or tuples/lists/dicts of
    them), which is returned; a copy of ``new`` the first time (``kept`` None), made outside
    inference mode so that later runs in any mode can write it (as a graph's replay does)."""
    if kept is None:
        with torch.inference_mode(False):
            return _overwrite_first(new)
    if isinstance(new, torch.Tensor):
        if kept.shape != new.shape:
            raise RuntimeError(f"a step's output changed shape ({tuple(kept.shape)} -> {tuple(new.shape)}): "
                               "captured steps must keep fixed shapes")
        return kept.copy_(new)
    if isinstance(new, dict):
        return {key: _overwrite(kept[key], value) for key, value in new.items()}
    if isinstance(new, (tuple, list)):
        return type(new)(_overwrite(k, v) for k, v in zip(kept, new))
    return new


def _overwrite_first(new):
    if isinstance(new, torch.Tensor):
        return new.clone()
    if isinstance(new, dict):
        return {key: _overwrite_first(value) for key, value in new.items()}
    if isinstance(new, (tuple, list)):
        return type(new)(_overwrite_first(v) for v in new)
    return new
