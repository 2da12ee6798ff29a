"""Kernels per flow ODE: q/k/v as one matrix product, and no mask multiplications in whole windows.

At batch 1 the flow's ODE (10 Euler steps, CFG as one batch-2 estimator call each) costs its
kernels on a GPU, not its arithmetic (GPU_NOTES.md; on the H100 about 1000 kernels and 6.5 ms per
Euler step, BENCHMARKS.md section 5). Two changes cut kernels without changing a number:

- the attention's q, k and v projections are one matrix product (``SelfAttention.to_qkv``; the
  state dict keeps the published three weights);
- a window without padding is passed with ``mask=None`` and the multiplications by its all-ones
  mask are left out (bit for bit the same output).

The baseline is measured in the same run: the same weights computing q, k and v as three products
(as the published module does; ``three_projections``) and the whole window multiplied by an
all-ones mask. The figure that transfers from a CPU is the operators dispatched per ODE (views not
counted); on CUDA the steps are captured and replayed as graphs (``benchmarks.gpu_suite`` levers).

    python benchmarks/bench_flow_kernels.py --size full
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_chunk_growth import load  # noqa: E402
from benchmarks.bench_first_chunk_flow import step_figures  # noqa: E402
from taste_speech.step_graph import StepGraph  # noqa: E402
from taste_speech.voice_generator.estimator import SelfAttention  # noqa: E402

# (window frames, bucket frames): the first chunk of 'low_latency' fills its bucket (unpadded step);
# a steady-sized window one frame short of its bucket (padded step: the mask stays, only q/k/v fuse)
WINDOWS = ((17, 17), (87, 88))


@contextlib.contextmanager
def three_projections():
    """Every SelfAttention computes q, k and v as three matrix products of the same weights (the
    published module's way): the baseline of the fused product. Process-wide while inside."""

    def forward(self, x, key_mask=None):
        b, t, _ = x.shape

        def heads(y):
            return y.view(b, t, self.heads, self.head_dim).transpose(1, 2)

        inner = self.heads * self.head_dim  # (row slices are views: no operator, as three weights had none)
        q, k, v = (heads(F.linear(x, self.to_qkv[i * inner:(i + 1) * inner])) for i in range(3))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        return self.to_out[0](out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))

    fused = SelfAttention.forward
    SelfAttention.forward = forward
    try:
        yield
    finally:
        SelfAttention.forward = fused


@torch.inference_mode()
def flow_kernel_figures(vg, graph_mode: str = "auto", repeats: int = 5) -> list[dict]:
    """Per window of ``WINDOWS``: operators and median ms of its ODE, baseline vs now, and the
    largest mel difference between the two. ``graph_mode`` 'auto' captures CUDA graphs on CUDA."""
    flow = vg.flow
    device, dtype = flow.input_embedding.weight.device, next(vg.parameters()).dtype
    g = torch.Generator().manual_seed(0)
    c = flow.output_size
    rows = []
    for frames, bucket in WINDOWS:
        mu, cond, noise = (torch.randn(1, c, bucket, generator=g).to(device, dtype) for _ in range(3))
        spks = torch.randn(1, c, generator=g).to(device, dtype)
        mask = torch.zeros(1, 1, bucket, device=device, dtype=dtype)
        mask[..., :frames] = 1
        padded = frames < bucket
        row = {"frames": frames, "bucket": bucket, "padded": padded}
        mels = {}
        for name, unfused, whole_mask in (("baseline", True, mask), ("now", False, mask if padded else None)):
            with three_projections() if unfused else contextlib.nullcontext():
                def ode():
                    return flow.decoder(mu, whole_mask, spks, cond, noise, padded=padded)

                step = StepGraph(ode, device, graph_mode, name=f"flow ODE ({name})")
                figures = step_figures(step.run, device, repeats, count=ode)  # operators of the ODE itself
                mels[name] = figures["out"].clone()  # (the next replay overwrites a graph's output)
            row[name + "_ops"], row[name + "_ms"] = figures["ops"], figures["ms"]
        row["max_mel_diff"] = float((mels["baseline"] - mels["now"])[..., :frames].abs().max())
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("tiny", "full"), default="full")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"one flow ODE (10 Euler steps, CFG batch 2), {args.size} voice generator, "
          f"CPU ({torch.get_num_threads()} threads), median of {args.repeats}")
    print("| window (bucket) | baseline: three q/k/v products, ones mask: operators / CPU ms "
          "| now: one q/k/v product, no mask where unpadded: operators / CPU ms | now / baseline operators "
          "| largest mel difference |")
    print("| --- | --- | --- | --- | --- |")
    for row in flow_kernel_figures(load(args.size), "eager", args.repeats):
        kind = "padded" if row["padded"] else "unpadded"
        print(f"| {row['frames']} ({row['bucket']}, {kind}) | {row['baseline_ops']} / {row['baseline_ms']:.1f} | "
              f"{row['now_ops']} / {row['now_ms']:.1f} | {row['now_ops'] / row['baseline_ops']:.2f} | "
              f"{row['max_mel_diff']:.2g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
