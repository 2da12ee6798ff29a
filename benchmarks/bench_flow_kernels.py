"""Kernels per flow ODE: q/k/v as one matrix product, no mask multiplications in whole windows,
the time conditioning of all Euler steps in one pass.

At batch 1 the flow's ODE (10 Euler steps, CFG as one batch-2 estimator call each) costs its
kernels on a GPU, not its arithmetic (our H100 notes, docs/GPU.md; on the H100 about 1000 kernels and 6.5 ms per
Euler step, BENCHMARKS.md section 5). Three changes cut kernels:

- the attention's q, k and v projections are one matrix product (``SelfAttention.to_qkv``; the
  state dict keeps the published three weights);
- a window without padding is passed with ``mask=None`` and the multiplications by its all-ones
  mask are left out (bit for bit the same output);
- each resnet block's projection of the time embedding depends on t alone: the ODE makes those of
  its ten steps in one batched pass before the loop (``ConditionalCFM.batch_time``), instead of
  every estimator call making its own (the same numbers up to float rounding).

Each baseline is measured in the same run: the same weights computing q, k and v as three products
(as the published module does; ``three_projections``) and the whole window multiplied by an
all-ones mask; the time conditioning made in every call (``time_conditioning_per_call``). The figure that transfers from a CPU is the operators dispatched per ODE (views not
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


def _windows(vg):
    """Per window of ``WINDOWS``: (frames, bucket, padded, mask, ode(mask=...) -> mel), fixed random inputs."""
    flow = vg.flow
    device, dtype = flow.input_embedding.weight.device, next(vg.parameters()).dtype
    g = torch.Generator().manual_seed(0)
    c = flow.output_size
    for frames, bucket in WINDOWS:
        mu, cond, noise = (torch.randn(1, c, bucket, generator=g).to(device, dtype) for _ in range(3))
        spks = torch.randn(1, c, generator=g).to(device, dtype)
        mask = torch.zeros(1, 1, bucket, device=device, dtype=dtype)
        mask[..., :frames] = 1
        padded = frames < bucket

        def ode(mask=mask, mu=mu, cond=cond, noise=noise, spks=spks, padded=padded):
            return flow.decoder(mu, mask, spks, cond, noise, padded=padded)

        yield frames, bucket, padded, mask, ode


def _ode_figures(ode, device, graph_mode: str, repeats: int, name: str) -> tuple[int, float, torch.Tensor]:
    """(operators, median ms, mel) of one ODE, captured as a graph where ``graph_mode`` says so."""
    step = StepGraph(ode, device, graph_mode, name=f"flow ODE ({name})")
    figures = step_figures(step.run, device, repeats, count=ode)  # operators of the ODE itself
    return figures["ops"], figures["ms"], figures["out"].clone()  # (the next replay overwrites a graph's output)


@torch.inference_mode()
def flow_kernel_figures(vg, graph_mode: str = "auto", repeats: int = 5) -> list[dict]:
    """Per window of ``WINDOWS``: operators and median ms of its ODE, baseline vs now, and the
    largest mel difference between the two. ``graph_mode`` 'auto' captures CUDA graphs on CUDA."""
    device = vg.flow.input_embedding.weight.device
    rows = []
    for frames, bucket, padded, mask, ode in _windows(vg):
        row = {"frames": frames, "bucket": bucket, "padded": padded}
        mels = {}
        for name, unfused, whole_mask in (("baseline", True, mask), ("now", False, mask if padded else None)):
            with three_projections() if unfused else contextlib.nullcontext():
                row[name + "_ops"], row[name + "_ms"], mels[name] = _ode_figures(
                    lambda: ode(mask=whole_mask), device, graph_mode, repeats, name)
        row["max_mel_diff"] = float((mels["baseline"] - mels["now"])[..., :frames].abs().max())
        rows.append(row)
    return rows


@contextlib.contextmanager
def time_conditioning_per_call(flow):
    """Every estimator call makes its own time conditioning (the published way): the baseline of
    the batched pass (``ConditionalCFM.batch_time``)."""
    cfm = flow.decoder
    batched, cfm.batch_time = cfm.batch_time, False
    try:
        yield
    finally:
        cfm.batch_time = batched


@torch.inference_mode()
def time_conditioning_figures(vg, graph_mode: str = "auto", repeats: int = 5) -> list[dict]:
    """Per window of ``WINDOWS`` (as the streaming path passes it: no mask where unpadded):
    operators and median ms of its ODE with the time conditioning made in every estimator call
    (baseline) vs all steps' in one batched pass (now), and the largest mel difference."""
    device = vg.flow.input_embedding.weight.device
    rows = []
    for frames, bucket, padded, mask, ode in _windows(vg):
        row = {"frames": frames, "bucket": bucket, "padded": padded}
        mels = {}
        whole_mask = mask if padded else None
        for name, per_call in (("baseline", True), ("now", False)):
            with time_conditioning_per_call(vg.flow) if per_call else contextlib.nullcontext():
                row[name + "_ops"], row[name + "_ms"], mels[name] = _ode_figures(
                    lambda: ode(mask=whole_mask), device, graph_mode, repeats, name)
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
    vg = load(args.size)
    for row in flow_kernel_figures(vg, "eager", args.repeats):
        print(_row_line(row))
    print()
    print("| window (bucket) | baseline: time conditioning in every estimator call: operators / CPU ms "
          "| now: all Euler steps' in one batched pass: operators / CPU ms | now / baseline operators "
          "| largest mel difference |")
    print("| --- | --- | --- | --- | --- |")
    for row in time_conditioning_figures(vg, "eager", args.repeats):
        print(_row_line(row))
    return 0


def _row_line(row: dict) -> str:
    kind = "padded" if row["padded"] else "unpadded"
    return (f"| {row['frames']} ({row['bucket']}, {kind}) | {row['baseline_ops']} / {row['baseline_ms']:.1f} | "
            f"{row['now_ops']} / {row['now_ms']:.1f} | {row['now_ops'] / row['baseline_ops']:.2f} | "
            f"{row['max_mel_diff']:.2g} |")


if __name__ == "__main__":
    sys.exit(main())
