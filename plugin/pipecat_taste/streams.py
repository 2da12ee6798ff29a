"""Which CUDA streams the engine's work goes to, and the calls' stage threads that run on them."""

from __future__ import annotations

import contextlib

# On one stream a call's host syncs - every token's
# sampling reads its logits - wait for all the kernels queued before them, other calls' flow steps
# included (70-90 ms each on the H100, BENCHMARKS.md section 5: the slowest of 8 calls waited 639 ms).
#   default    every thread's work on its current stream: the device's default stream
#   synthesis  every call's flow and vocoder work on one stream of its own, beside the decoding (one
#              for all calls, not one per call: their shared synthesis steps - ``SynthesisGraphs``,
#              one graph memory pool - must stay in order); a decoding sync waits for decoding only
#   calls      that, and each call's other work (ASR, audio tower, spoken LM, speech decoder) on a
#              stream of the call's own: one call's syncs wait for its own work only, and the GPU
#              runs the calls' small kernels side by side
#   auto       synthesis on the CUDA fast path (static caches, graphs), default elsewhere
# Measured on the H100 (``python -m benchmarks.gpu_suite``; BENCHMARKS.md section 5): a whole reply as
# the agent runs it took 0.096 s per audio second with the synthesis stream against 0.106 on one
# stream, its first audio 197 against 214 ms (the H200: 0.094 / 0.106, 207 / 218 ms); eight calls
# ending at once got their first audio in at most 1348 ms (default), 1127 ms (synthesis), 1077 ms
# (calls), one call alone in that table 159, 244 and 183 ms (an earlier run, before the calls shared
# their first-audio work).
STREAMS = ("auto", "default", "synthesis", "calls")


def resolve_streams(streams: str, device, cache_kind: str) -> str:
    """'auto' made one of the others for the engine's device and decoding."""
    from taste_speech.streaming.synthesis_graphs import resolve_kind

    if streams != "auto":
        return streams
    cuda = str(device).startswith("cuda")
    return "synthesis" if cuda and resolve_kind(cache_kind, device) == "static" else "default"


def new_stream(device, other_than=None):
    """A stream of torch's pool (non-blocking: no implicit waits on the legacy default stream).
    The pool is small and handed out round-robin, so streams repeat: ``other_than`` is skipped
    (a call sharing the synthesis stream would be correct, only slower). The capture stream is
    never among them (``step_graph``: another priority)."""
    import torch

    while True:
        stream = torch.cuda.Stream(torch.device(device), priority=0)
        if other_than is None or stream.cuda_stream != other_than.cuda_stream:
            return stream


def on_stream(stream):
    """A context with ``stream`` current in this thread (the current stream is per thread), or
    nothing changed for None."""
    if stream is None:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(stream)


def prepare_stage_thread(stream=None, threads: int | None = None) -> None:
    """A call's stage worker thread, before its first job (``TasteCall.executor``): ``stream`` its
    current CUDA stream for good (``use_stream``), and ``threads`` torch's intra-op threads
    (the engine's ``threads_per_job``; None: as they are)."""
    if threads is not None:
        import torch

        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
    use_stream(stream)


def use_stream(stream) -> None:
    """Make ``stream`` this thread's current stream for good (a call's own worker threads); None:
    nothing changes."""
    if stream is not None:
        import torch

        torch.cuda.set_stream(stream)
