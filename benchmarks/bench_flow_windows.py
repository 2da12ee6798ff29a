"""Where flow windows start and how large they are: the U-Net's 2-frame grid, and widened windows.

Two changes to the flow windows of streaming synthesis (``synthesis._window_start``), each
measured against its baseline in the same run:

- grid: the flow's U-Net computes most of its layers at half the frame rate, on the utterance's
  even frames when it synthesises offline. A window that starts on an odd frame computes them
  between those. Baseline: windows start where their left context does (``FLOW_GRID = 1``).
  Figure: the seam report against offline synthesis of the same tokens and noise
  (``taste_speech.streaming.seams``), the dynamic path.
- widening: on the bucketed path a window takes more left context until it has a size with an
  unpadded step of its own (``FULL_FLOW_WINDOWS``); a padded step costs about 1.6x the kernels.
  Baseline: ``window_frames=()`` (each window padded into its bucket). Figures: operators
  dispatched per second of audio by a reply's synthesis on the bucketed path (eager steps on a
  CPU: the operators a captured step replays as kernels on a GPU), padded windows, CPU seconds;
  and the CPU seconds of the same reply on the dynamic path (where a wider window costs time).

Random weights: the seam figures describe the architecture's context dependence, not a voice.

    python benchmarks/bench_flow_windows.py --size tiny
    python benchmarks/bench_flow_windows.py --size full --seconds 8
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import taste_speech.streaming.synthesis as synthesis  # noqa: E402
from benchmarks.bench_chunk_growth import load  # noqa: E402
from benchmarks.bench_lora_merge import OperatorCount  # noqa: E402
from taste_speech.streaming.seams import measure_seams  # noqa: E402
from taste_speech.streaming.synthesis import speak, start_speaking  # noqa: E402
from taste_speech.streaming.synthesis_graphs import FULL_FLOW_WINDOWS, SynthesisGraphs  # noqa: E402
from taste_speech.streaming.synthesis_state import SOURCE_RATE, EmissionPolicy  # noqa: E402

SEAM_FIGURES = ("mel_dist_junction", "mel_dist_elsewhere", "wave_err_junction", "wave_err_elsewhere")


@contextlib.contextmanager
def off_grid():
    """The baseline: windows start wherever their left context starts."""
    grid = synthesis.FLOW_GRID
    synthesis.FLOW_GRID = 1
    try:
        yield
    finally:
        synthesis.FLOW_GRID = grid


def utterance(vg, seconds: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vg.flow.vocab_size, (1, int(seconds * 50)), generator=g)
    return tokens, torch.randn(1, vg.flow.spk_embed_affine_layer.in_features, generator=g)


def grid_rows(vg, seconds: float, policies=("low_latency", "quality")) -> list[dict]:
    """Per policy: the seam figures off the grid (baseline) and on it, dynamic path, fed 5 tokens at a time."""
    tokens, speaker = utterance(vg, seconds)
    rows = []
    for name in policies:
        row = {"policy": name}
        for label, context in (("off_grid", off_grid()), ("on_grid", contextlib.nullcontext())):
            with context:
                report, _ = measure_seams(vg, tokens, speaker, name, feed_sizes=[5] * tokens.shape[1])
            row[label] = {figure: getattr(report, figure) for figure in SEAM_FIGURES}
        rows.append(row)
    return rows


@torch.inference_mode()
def reply_figures(vg, seconds: float, window_frames, bucketed: bool = True) -> dict:
    """A reply's synthesis, ``low_latency`` with growing chunks, on the bucketed path (eager
    steps) or the dynamic one (every window at its own size)."""
    tokens, speaker = utterance(vg, seconds)
    graphs = SynthesisGraphs(vg, "eager") if bucketed else None
    policy = EmissionPolicy.low_latency(window_frames=window_frames)
    state = start_speaking(vg, speaker, policy, 16000, torch.Generator().manual_seed(0), graphs=graphs,
                           kind="static" if bucketed else "dynamic")
    if not bucketed:  # every window at its own size: count none as padded
        graphs = SynthesisGraphs(vg, "eager")
    chunks = []
    t0 = time.perf_counter()
    with OperatorCount() as count:
        for i in range(0, tokens.shape[1], 5):
            chunks += speak(vg, state, tokens[:, i:i + 5])
        chunks += speak(vg, state, final=True)
    audio_s = state.samples_emitted / SOURCE_RATE
    return {"chunks": len(chunks), "padded_flow_windows": graphs.padded_windows["flow"],
            "flow_windows": sum(n for (stage, _), n in graphs.counts.items() if stage == "flow"),
            "ops_per_audio_s": count.total / audio_s, "cpu_s_per_audio_s": (time.perf_counter() - t0) / audio_s,
            "buckets": sorted(graphs.prepared()["flow"])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("tiny", "full"), default="tiny")
    parser.add_argument("--seconds", type=float, default=8.0, help="the reply's length (random speech tokens)")
    parser.add_argument("--seam-seconds", type=float, default=6.0)
    args = parser.parse_args(argv)
    vg = load(args.size)
    print(f"{args.size} voice generator, random weights; CPU ({torch.get_num_threads()} threads), float32")
    print(f"\ngrid: seams against offline synthesis, {args.seam_seconds:g} s, fed 5 tokens at a time, dynamic path")
    print("| policy | figure | off the grid (baseline) | on the grid | on / off |")
    print("| --- | --- | --- | --- | --- |")
    for row in grid_rows(vg, args.seam_seconds):
        for figure in SEAM_FIGURES:
            off, on = row["off_grid"][figure], row["on_grid"][figure]
            print(f"| {row['policy']} | {figure} | {off:.4f} | {on:.4f} | {on / off:.2f} |")
    print(f"\nwidening: a {args.seconds:g} s reply, low_latency with growing chunks, bucketed path (eager steps)")
    narrow = reply_figures(vg, args.seconds, ())
    wide = reply_figures(vg, args.seconds, None)
    print("| figure | windows as their context makes them (baseline) | widened to unpadded sizes | widened / baseline |")
    print("| --- | --- | --- | --- |")
    for figure in ("ops_per_audio_s", "cpu_s_per_audio_s"):
        print(f"| {figure} | {narrow[figure]:.4g} | {wide[figure]:.4g} | {wide[figure] / narrow[figure]:.2f} |")
    print(f"| padded flow windows | {narrow['padded_flow_windows']} of {narrow['flow_windows']} | "
          f"{wide['padded_flow_windows']} of {wide['flow_windows']} | |")
    print(f"| flow buckets used | {narrow['buckets']} | {wide['buckets']} | |")
    print("\nthe dynamic path (a CPU's default: every window at its own size), the same reply:")
    print("| figure | windows as their context makes them (the dynamic default) | widened | widened / default |")
    print("| --- | --- | --- | --- |")
    narrow = reply_figures(vg, args.seconds, (), bucketed=False)
    wide = reply_figures(vg, args.seconds, FULL_FLOW_WINDOWS, bucketed=False)
    for figure in ("ops_per_audio_s", "cpu_s_per_audio_s"):
        print(f"| {figure} | {narrow[figure]:.4g} | {wide[figure]:.4g} | {wide[figure] / narrow[figure]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
