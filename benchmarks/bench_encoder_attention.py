"""The audio tower's Whisper encoder: its self-attention fused (one kernel) vs the scores written out.

Every encoder pass of a turn (the audio tower's, and on the fast path the built-in ASR's partial
transcripts, which share it) runs 32 layers of self-attention over the 1500 frames of the padded
30 s window. Written out, as the original computes it, each layer makes a (rows, 20, 1500, 1500)
score tensor, normalises it and reads it back; fused (``scaled_dot_product_attention``, the
default since ``TasteAudioTower.fused_encoder_attention``) it never exists. Both ways in one run,
at the published dimensions with random weights: ms per pass (median), the largest difference of
the outputs, and on CUDA the peak memory a pass adds.

    python benchmarks/bench_encoder_attention.py [--device cuda] [--dtype bfloat16] [--rows 8] [--layers 4]

(``--layers`` keeps the first n encoder layers: a quick figure on a CPU, where a full 32-layer pass
takes about half a minute per row.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_first_chunk_flow import median_ms  # noqa: E402
from benchmarks.engines import FULL_CONFIG  # noqa: E402
from taste_speech.configuration_taste import TasteConfig  # noqa: E402
from taste_speech.modeling_audio_tower import TasteAudioTower  # noqa: E402


def build_tower(device: str, dtype: torch.dtype, layers: int | None, seed: int = 0) -> TasteAudioTower:
    config = TasteConfig.from_json_file(str(FULL_CONFIG))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tower = TasteAudioTower(config).eval()
    if layers is not None:
        encoder = tower.encoder
        encoder.layers = encoder.layers[:layers]
        tower.target_hidden_layer = min(tower.target_hidden_layer, layers)
    return tower.to(device=device, dtype=dtype)


@torch.inference_mode()
def measure(tower: TasteAudioTower, rows: int, repeats: int) -> dict:
    """Both ways on one random padded window per row: ms per pass, outputs' largest difference,
    and the peak memory above the resident weights (CUDA)."""
    weight = tower.encoder.conv1.weight
    device = weight.device
    window = torch.randn(rows, weight.shape[1], tower.num_frames, generator=torch.Generator().manual_seed(1))
    window = window.to(device=device, dtype=weight.dtype)
    result, outputs = {"rows": rows, "layers": len(tower.encoder.layers)}, {}
    for name, fused in (("scores_written", False), ("fused", True)):
        tower.fused_encoder_attention = fused
        outputs[name] = tower.encoder_stack(window)  # warm-up (kernel choice, allocations)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        result[name + "_ms"] = median_ms(lambda: tower.encoder_stack(window), device, repeats)
        if device.type == "cuda":
            result[name + "_peak_mib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    tower.fused_encoder_attention = True
    result["max_diff"] = max((a.float() - b.float()).abs().max().item()
                             for a, b in zip(outputs["fused"], outputs["scores_written"]))
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16 (the tower's dtype on CUDA)")
    parser.add_argument("--rows", type=int, default=1, help="turns in one pass (calls ending together)")
    parser.add_argument("--layers", type=int, default=None, help="the first n encoder layers only (default all 32)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    tower = build_tower(args.device, getattr(torch, args.dtype), args.layers)
    r = measure(tower, args.rows, args.repeats)
    print(f"audio tower's Whisper encoder, {r['layers']} layers, {r['rows']} row(s), {args.dtype} on {args.device}:")
    print(f"  scores written out: {r['scores_written_ms']:.1f} ms per pass")
    print(f"  fused attention:    {r['fused_ms']:.1f} ms per pass ({r['fused_ms'] / r['scores_written_ms']:.2f}x)")
    if "fused_peak_mib" in r:
        print(f"  peak memory a pass adds: {r['scores_written_peak_mib']:.0f} MiB written out, "
              f"{r['fused_peak_mib']:.0f} MiB fused")
    print(f"  largest output difference: {r['max_diff']:.3g}")


if __name__ == "__main__":
    main()
