"""Streaming synthesis with steady chunks that grow (``EmissionPolicy.max_chunk_tokens``) vs fixed.

Streams one utterance of random speech tokens, five at a time (as the speech decoder produces
them), with each named regime as shipped (chunks growing to 300 tokens since 2026-11-27, 100 before) and with growth off, in
one run, and prints per variant: chunks, synthesis steps per second of audio (on a GPU a step
costs its kernel launches, whatever its size: our H100 notes, docs/GPU.md), operators dispatched per second of
audio (each at least one kernel on CUDA), compute seconds per audio second on this CPU, the first
chunk's tokens and compute time, and the seam figures against offline synthesis.

    python benchmarks/bench_chunk_growth.py --size tiny --seconds 10
    python benchmarks/bench_chunk_growth.py --size full --seconds 10
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_lora_merge import OperatorCount  # noqa: E402
from benchmarks.engines import full_voice_generator  # noqa: E402
from taste_speech.streaming.seams import measure_seams  # noqa: E402
from taste_speech.streaming.synthesis import speak, start_speaking  # noqa: E402
from taste_speech.streaming.synthesis_state import SOURCE_RATE, EmissionPolicy  # noqa: E402
from taste_speech.voice_generator import VoiceGenerator  # noqa: E402
from taste_speech.voice_generator.tiny import make_tiny_voice_generator  # noqa: E402

TOKENS_PER_SECOND = 50


def load(size: str) -> VoiceGenerator:
    return full_voice_generator() if size == "full" else make_tiny_voice_generator(0)


@torch.inference_mode()
def stream(vg, tokens, speaker, policy: EmissionPolicy, count_ops: bool) -> dict:
    state = start_speaking(vg, speaker, policy, out_sampling_rate=16000, generator=torch.Generator().manual_seed(0))
    chunks, ops = [], 0
    for i in range(0, tokens.shape[1], 5):
        last = i + 5 >= tokens.shape[1]
        with OperatorCount() if count_ops else contextlib.nullcontext() as counter:
            chunks += speak(vg, state, tokens[:, i:i + 5])
            if last:
                chunks += speak(vg, state, final=True)
        ops += counter.total if count_ops else 0
    audio_s = state.samples_emitted / SOURCE_RATE
    compute_s = sum(c.compute_s for c in chunks)
    committed = [0] + [c.tokens_committed for c in chunks]
    return {"chunks": len(chunks), "audio_s": audio_s, "steps_per_audio_s": len(chunks) / audio_s,
            "ops_per_audio_s": ops / audio_s if count_ops else None, "rtf": compute_s / audio_s,
            "first_tokens": chunks[0].tokens_committed, "first_ms": 1000 * chunks[0].compute_s,
            "sizes": [b - a for a, b in zip(committed, committed[1:])]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("tiny", "full"), default="tiny")
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args(argv)
    vg = load(args.size)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vg.flow.vocab_size, (1, int(args.seconds * TOKENS_PER_SECOND)), generator=g)
    speaker = torch.randn(1, vg.flow.spk_embed_affine_layer.in_features, generator=g)
    print(f"streaming synthesis of {tokens.shape[1]} speech tokens, fed 5 at a time; {args.size} voice generator, "
          f"CPU ({torch.get_num_threads()} threads)")
    print("| regime | steady chunks | chunks | steps per audio s | operators per audio s | CPU compute s per audio s "
          "| first chunk tokens / ms | chunk sizes (tokens) | seam: mel distance at junctions / elsewhere |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in ("low_latency", "quality"):
        grown = EmissionPolicy.resolve(name)
        fixed = dataclasses.replace(grown, max_chunk_tokens=0)
        for label, policy in (("fixed", fixed), (f"growing to {grown.max_chunk_tokens}", grown)):
            stream(vg, tokens[:, :40], speaker, policy, count_ops=False)  # warm-up
            timed = stream(vg, tokens, speaker, policy, count_ops=False)
            counted = stream(vg, tokens, speaker, policy, count_ops=True)
            seams, _ = measure_seams(vg, tokens, speaker, policy, seed=1)
            sizes = timed["sizes"]
            shown = ", ".join(map(str, sizes[:8])) + (", ..." if len(sizes) > 8 else "")
            print(f"| {name} | {label} | {timed['chunks']} | {timed['steps_per_audio_s']:.2f} | "
                  f"{counted['ops_per_audio_s']:.0f} | {timed['rtf']:.3f} | {timed['first_tokens']} / "
                  f"{timed['first_ms']:.0f} | {shown} | {seams.mel_dist_junction:.3f} / {seams.mel_dist_elsewhere:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
