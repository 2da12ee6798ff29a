"""The first chunk's flow step: its window padded into a larger bucket vs filling a bucket of its own.

The first chunk is the one the caller waits for. Its flow window is fixed by the emission policy
(17 frames for 'low_latency', 37 for 'quality'); in a bucket of exactly that size the step runs
the unpadded ODE, without the masked GroupNorm statistics and attention masks that keep padded
windows exact. On a GPU a step costs its kernels (our H100 notes, docs/GPU.md), so the figure that transfers is
the operators dispatched per step (each at least one CUDA kernel; views not counted); the CPU ms
are this machine's. Both steps run through ``SynthesisGraphs`` buckets, eagerly on a CPU.

    python benchmarks/bench_first_chunk_flow.py --size full
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_chunk_growth import load  # noqa: E402
from benchmarks.bench_lora_merge import OperatorCount  # noqa: E402
from taste_speech.streaming.synthesis_graphs import FIRST_WINDOW_FRAMES, SynthesisGraphs  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def median_ms(run, device: torch.device, repeats: int) -> float:
    """Median wall ms of ``run()`` over ``repeats`` runs, waiting for this thread's GPU work."""
    seconds = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        seconds.append(time.perf_counter() - t0)
    return 1000 * statistics.median(seconds)


def step_figures(run, device: torch.device, repeats: int, count=None) -> dict:
    """A step's figures: its output (the first run: warm-up, and capture on CUDA), the operators
    ``count()`` dispatches (None: not counted) and the median ms of ``run()``."""
    out = run()
    ops = None
    if count is not None:
        with OperatorCount() as counter:
            count()
        ops = counter.total
    return {"out": out, "ops": ops, "ms": median_ms(run, device, repeats)}


@torch.inference_mode()
def measure(graphs: SynthesisGraphs, bucket: int, window: tuple, repeats: int) -> dict:
    """One window's step in ``bucket``: operators dispatched (eager steps only; a replayed graph
    dispatches none), median ms, and its mel."""
    step = graphs._flow_bucket(bucket)

    def run():
        return step.run([window], 1)[0]

    figures = step_figures(run, graphs.device, repeats, count=run if graphs.mode == "eager" else None)
    return {"ops": figures["ops"], "ms": figures["ms"], "mel": figures["out"]}


def first_chunk_steps(vg, graph_mode: str = "eager", repeats: int = 5) -> list[dict]:
    """Per named policy: its first chunk's flow window padded into the next bucket vs filling its own."""
    graphs = SynthesisGraphs(vg, graph_mode, flow_buckets=(17, 24, 37, 48))
    device, dtype = graphs.device, next(vg.parameters()).dtype
    g = torch.Generator().manual_seed(0)
    c = vg.flow.output_size
    rows = []
    for frames, policy, padded_bucket in ((FIRST_WINDOW_FRAMES[0], "low_latency", 24),
                                          (FIRST_WINDOW_FRAMES[1], "quality", 48)):
        window = tuple(t.to(device, dtype) for t in (
            torch.randn(1, c, frames, generator=g), torch.randn(1, c, generator=g), torch.zeros(1, c, frames),
            torch.randn(1, c, frames, generator=g)))
        padded = measure(graphs, padded_bucket, window, repeats)
        full = measure(graphs, frames, window, repeats)
        rows.append({"frames": frames, "policy": policy, "padded_bucket": padded_bucket,
                     "padded_ops": padded["ops"], "padded_ms": padded["ms"], "full_ops": full["ops"],
                     "full_ms": full["ms"], "max_mel_diff": float((padded["mel"] - full["mel"]).abs().max())})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("tiny", "full"), default="full")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"the first chunk's flow step (10 Euler steps, CFG batch 2), {args.size} voice generator, "
          f"CPU ({torch.get_num_threads()} threads), median of {args.repeats}")
    print("| window frames (policy) | bucket | padded step: operators / CPU ms | full step: operators / CPU ms "
          "| full / padded operators | largest mel difference |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in first_chunk_steps(load(args.size), "eager", args.repeats):
        print(f"| {row['frames']} ({row['policy']}) | {row['padded_bucket']} -> {row['frames']} | "
              f"{row['padded_ops']} / {row['padded_ms']:.1f} | {row['full_ops']} / {row['full_ms']:.1f} | "
              f"{row['full_ops'] / row['padded_ops']:.2f} | {row['max_mel_diff']:.2g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
