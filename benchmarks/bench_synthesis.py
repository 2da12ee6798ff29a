"""Streaming speech synthesis benchmark: chunk latency and seam quality.

For each emission regime it streams a long utterance of random speech tokens one token at a time
(as the speech decoder produces them) and prints, per chunk k = 1..N, the compute time of that
chunk next to the "re-run everything" approach (whole-utterance flow + HiFT on all tokens so far,
keeping only the new audio: what a stateless re-synthesis costs at the same point). Then it
prints the seam figures (taste_speech.streaming.seams) per regime and chunk size.

    python benchmarks/bench_synthesis.py                       # tiny random model, 30 s, CPU
    python benchmarks/bench_synthesis.py --checkpoint DIR      # a TASTE checkpoint's voice_generator.pth
    python benchmarks/bench_synthesis.py --size full --device cuda

Random weights give noise-like audio: latencies are representative, seam figures describe the
architecture's context dependence (the streamed output is compared with offline synthesis of the
same tokens and noise), not a trained voice.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from taste_speech.streaming.seams import measure_seams  # noqa: E402
from taste_speech.streaming.synthesis import speak, start_speaking  # noqa: E402
from taste_speech.streaming.synthesis_state import EmissionPolicy  # noqa: E402
from taste_speech.voice_generator import VoiceGenerator  # noqa: E402
from taste_speech.voice_generator.tiny import make_tiny_voice_generator  # noqa: E402


def load_model(args) -> VoiceGenerator:
    if args.checkpoint:
        return VoiceGenerator.from_pretrained(args.checkpoint, device=args.device)
    if args.golden:
        return VoiceGenerator.from_golden_dir(args.golden).to(args.device)
    if args.size == "full":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return VoiceGenerator().eval().to(args.device)
    return make_tiny_voice_generator(0).to(args.device)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def latency_rows(vg: VoiceGenerator, tokens: torch.Tensor, speaker: torch.Tensor, policy: EmissionPolicy,
                 rerun_every: int, device: str) -> dict:
    """Stream ``tokens`` one at a time; per chunk k: tokens fed, committed, audio ms, streaming
    compute ms and (every ``rerun_every``-th chunk, the first and the last) the re-run-all ms."""
    state = start_speaking(vg, speaker, policy, out_sampling_rate=16000, generator=torch.Generator().manual_seed(0))
    chunks = []
    for i in range(tokens.shape[1]):
        sync(device)
        for chunk in speak(vg, state, tokens[:, i:i + 1]):
            chunks.append((chunk, i + 1))
    for chunk in speak(vg, state, final=True):
        chunks.append((chunk, tokens.shape[1]))
    rows = []
    for k, (chunk, fed) in enumerate(chunks, start=1):
        rerun = None
        if rerun_every and (k % rerun_every == 0 or k == 1 or k == len(chunks)):
            sync(device)
            started = time.perf_counter()
            vg.inference(tokens[:, :chunk.tokens_committed], speaker, generator=torch.Generator().manual_seed(0))
            sync(device)
            rerun = 1000 * (time.perf_counter() - started)
        rows.append({"k": k, "tokens_fed": fed, "tokens_committed": chunk.tokens_committed,
                     "audio_ms": chunk.duration_ms, "stream_ms": 1000 * chunk.compute_s, "rerun_ms": rerun})
    return {"policy": policy, "rows": rows, "audio_s": state.samples_emitted / 22050}


def latency_table(vg: VoiceGenerator, tokens: torch.Tensor, speaker: torch.Tensor, policy: EmissionPolicy,
                  rerun_every: int, device: str) -> dict:
    result = latency_rows(vg, tokens, speaker, policy, rerun_every, device)
    rows, audio_s = result["rows"], result["audio_s"]
    print(f"\n== {policy.name}: first chunk {policy.first_chunk_tokens} tokens (+{policy.lookahead_tokens} lookahead), "
          f"then {policy.chunk_tokens} per chunk; context {policy.context_tokens} tokens")
    print(f"{'k':>3} {'tokens fed':>10} {'committed':>9} {'audio ms':>8} {'stream ms':>9} {'re-run-all ms':>13}")
    for r in rows:
        rerun = "" if r["rerun_ms"] is None else f"{r['rerun_ms']:13.0f}"
        print(f"{r['k']:3d} {r['tokens_fed']:10d} {r['tokens_committed']:9d} {r['audio_ms']:8.0f} "
              f"{r['stream_ms']:9.0f} {rerun:>13}")
    stream_ms = [r["stream_ms"] for r in rows]
    rerun_ms = [r["rerun_ms"] for r in rows if r["rerun_ms"] is not None]
    print(f"stream: median {statistics.median(stream_ms):.0f} ms, max {max(stream_ms):.0f} ms per chunk; "
          f"total {sum(stream_ms) / 1000:.1f} s for {audio_s:.1f} s of audio (RTF {sum(stream_ms) / 1000 / audio_s:.2f})")
    if rerun_ms:
        print(f"re-run-all: first {rerun_ms[0]:.0f} ms, last {rerun_ms[-1]:.0f} ms per chunk (grows with the utterance)")
    return result


def seam_rows(vg, speaker, seconds: float, chunk_sizes: list[int], vocab: int) -> list[dict]:
    """Seam figures per (regime, chunk size): streamed vs offline synthesis of the same tokens and noise."""
    tokens = torch.randint(0, vocab, (1, int(seconds * 50)), generator=torch.Generator().manual_seed(1))
    rows = []
    for make in (EmissionPolicy.low_latency, EmissionPolicy.quality):
        for size in chunk_sizes:
            r, _ = measure_seams(vg, tokens, speaker, make(chunk_tokens=size), seed=2)
            rows.append(r)
    return rows


def seam_table(vg, speaker, seconds: float, chunk_sizes: list[int], vocab: int) -> list:
    print(f"\n== seams over {seconds:.0f} s (streamed vs offline synthesis of the same tokens and noise; 22.05 kHz)")
    header = ("regime", "chunk", "first@tok", "first ms", "mel d junct", "mel d else", "mel step j", "mel step e",
              "jump j max", "jump p99.9", "src jump j", "src p99.9", "wav err j", "wav err e", "len diff")
    print(" ".join(f"{h:>11}" for h in header))
    rows = seam_rows(vg, speaker, seconds, chunk_sizes, vocab)
    for r in rows:
        values = (r.policy, r.chunk_tokens, r.first_audio_after_tokens, f"{r.first_chunk_ms:.0f}",
                  f"{r.mel_dist_junction:.3f}", f"{r.mel_dist_elsewhere:.3f}", f"{r.mel_step_junction:.3f}",
                  f"{r.mel_step_elsewhere:.3f}", f"{r.wave_jump_junction_max:.4f}", f"{r.wave_jump_p999:.4f}",
                  f"{r.source_jump_junction_max:.4f}", f"{r.source_jump_p999:.4f}",
                  f"{r.wave_err_junction:.4f}", f"{r.wave_err_elsewhere:.4f}", r.length_diff_samples)
        print(" ".join(f"{v:>11}" for v in values))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="TASTE checkpoint folder (cosyvoice/voice_generator.pth) or the .pth")
    parser.add_argument("--golden", help="a voice_generator golden folder (config.json + weights.safetensors)")
    parser.add_argument("--size", choices=["tiny", "full"], default="tiny", help="random model size (no checkpoint)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=30.0, help="utterance length for the latency table")
    parser.add_argument("--rerun-every", type=int, default=1,
                        help="time the re-run-everything approach every k-th chunk (0: never)")
    parser.add_argument("--seam-seconds", type=float, default=10.0)
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[15, 25, 40])
    parser.add_argument("--regimes", nargs="+", default=["low_latency", "quality"])
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--skip-seams", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    vg = load_model(args)
    vocab, spk_dim = vg.flow.vocab_size, vg.flow.spk_embed_affine_layer.in_features
    speaker = torch.randn(1, spk_dim, generator=torch.Generator().manual_seed(3)).to(args.device)
    print(f"voice generator: {sum(p.numel() for p in vg.parameters()) / 1e6:.1f} M parameters on {args.device}, "
          f"{args.threads} thread(s)")
    if not args.skip_latency:
        tokens = torch.randint(0, vocab, (1, int(args.seconds * 50)), generator=torch.Generator().manual_seed(0))
        for regime in args.regimes:
            latency_table(vg, tokens.to(args.device), speaker, EmissionPolicy.resolve(regime), args.rerun_every,
                          args.device)
    if not args.skip_seams:
        seam_table(vg, speaker, args.seam_seconds, args.chunk_sizes, vocab)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
