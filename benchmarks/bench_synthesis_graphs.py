"""Streaming synthesis per-chunk time: dynamic (eager, every window at its own size) vs static
(windows padded to fixed buckets; CUDA graphs on CUDA, the same padded steps run eagerly on CPU).

    python benchmarks/bench_synthesis_graphs.py                         # tiny random model, CPU
    python benchmarks/bench_synthesis_graphs.py --size full --device cuda
    python benchmarks/bench_synthesis_graphs.py --sizes                 # the window sizes per step kind
    python benchmarks/bench_synthesis_graphs.py --warm-up --rows 8      # what start-up captures

On CPU the static path can only cost more (padding frames, masking ops): what it shows there is
the price of the padding. The point of it is the CUDA graph replay on a GPU.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from taste_speech.streaming import synthesis  # noqa: E402
from taste_speech.streaming.synthesis import speak, start_speaking  # noqa: E402
from taste_speech.streaming.synthesis_graphs import SynthesisGraphs  # noqa: E402
from taste_speech.streaming.synthesis_state import EmissionPolicy  # noqa: E402
from taste_speech.voice_generator import VoiceGenerator  # noqa: E402
from taste_speech.voice_generator.tiny import make_tiny_voice_generator  # noqa: E402

POLICIES = {"low_latency": EmissionPolicy.low_latency(), "quality": EmissionPolicy.quality()}


def load(size: str, device: str) -> VoiceGenerator:
    if size == "full":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return VoiceGenerator().eval().to(device)
    return make_tiny_voice_generator(0).to(device)


def stream(vg, tokens, speaker, policy, **kind) -> list:
    state = start_speaking(vg, speaker, policy, 22050, torch.Generator().manual_seed(0), **kind)
    chunks = []
    for i in range(tokens.shape[1]):
        chunks += speak(vg, state, tokens[:, i:i + 1])
    return chunks + speak(vg, state, final=True)


def timings(vg, seconds: float, device: str) -> None:
    g = torch.Generator().manual_seed(1)
    spk_dim = vg.flow.spk_embed_affine_layer.in_features
    tokens = torch.randint(0, vg.flow.vocab_size, (1, int(seconds * 50)), generator=g)
    speaker = torch.randn(1, spk_dim, generator=g).to(device)
    mode = "auto" if device.startswith("cuda") else "eager"
    graphs = SynthesisGraphs(vg, mode)
    started = time.perf_counter()
    graphs.warm_up()
    print(f"static buckets prepared ({graphs.mode}) in {time.perf_counter() - started:.2f} s; "
          f"capture failures: {graphs.fallback_reasons() or 'none'}")
    print("policy       path     first ms  steady ms (median)  final ms  chunks")
    for name, policy in POLICIES.items():
        stream(vg, tokens[:, :60], speaker, policy, kind="dynamic")  # warm the allocator and kernels
        for label, kind in (("dynamic", {"kind": "dynamic"}), ("static", {"graphs": graphs})):
            chunks = stream(vg, tokens, speaker, policy, **kind)
            ms = [1000 * c.compute_s for c in chunks]
            steady = statistics.median(ms[1:-1])
            print(f"{name:12s} {label:8s} {ms[0]:8.1f}  {steady:18.1f}  {ms[-1]:8.1f}  {len(ms):6d}")


def window_sizes(vg) -> None:
    """Flow / HiFT window frames per step kind, over grid phases (tokens_before) and lengths. The
    flow and HiFT are replaced by stand-ins: only the window arithmetic runs."""
    log = []
    kind = ["first"]
    step = synthesis._step

    def flow_stand_in(mu, mask, spks, cond, noise, *args, **kwargs):
        log.append(("flow", kind[0], mu.shape[-1]))
        return noise

    def hift_stand_in(mel, source, *args, **kwargs):
        log.append(("hift", kind[0], mel.shape[-1]))
        return source[:, 0] * 0

    vg.flow.decoder.forward, vg.hift.decode = flow_stand_in, hift_stand_in

    def tagged_step(vg_, state, target, last):
        kind[0] = "final" if last else "first" if state.committed_tokens == 0 else "steady"
        return step(vg_, state, target, last)

    synthesis._step = tagged_step
    try:
        for name, policy in POLICIES.items():
            sizes = collections.defaultdict(set)
            for before in range(0, 256, 5):
                for n in (13, 30, 47, 60, 90, 133, 171):
                    log.clear()
                    state = start_speaking(vg, torch.randn(1, vg.flow.spk_embed_affine_layer.in_features), policy,
                                           22050, kind="dynamic")
                    state.tokens_before = before  # a continuation on a shifted frame grid
                    tokens = torch.randint(0, vg.flow.vocab_size, (1, n))
                    for i in range(n):
                        speak(vg, state, tokens[:, i:i + 1])
                    speak(vg, state, final=True)
                    for stage, k, frames in log:
                        sizes[stage, k].add(frames)
            print(name)
            for (stage, k), frames in sorted(sizes.items()):
                print(f"  {stage:5s} {k:7s} {sorted(frames)}")
    finally:
        del vg.flow.decoder.forward, vg.hift.decode  # back to the class methods
        synthesis._step = step


def warm_up_cost(vg, rows: int, device: str) -> None:
    """What ``SynthesisGraphs.warm_up`` prepares with ``rows`` rows (the engine's 8 on CUDA): steps
    (CUDA graphs) and the runs that make them (warm-up runs, and the run that records), now and
    with every unpadded size batched and two warm-up runs per capture (the baseline), each timed
    in this run. On a CPU the steps are rehearsed (run eagerly through the capture protocol); on a
    GPU, where a run's host time is its launches, the runs are what a capture costs."""
    mode = "auto" if device.startswith("cuda") else "rehearse"
    print(f"warm-up of every bucket, {rows} rows ({'graph' if mode == 'auto' else mode} mode)")
    print("setting                                   steps  runs  seconds")
    results = {}
    for label, options in (("baseline: all full sizes batched, 2 runs", {"batched_full_frames": None,
                                                                          "repeat_warmup_runs": 2}),
                           ("now: first chunks batched, 1 run repeated", {})):
        graphs = SynthesisGraphs(vg, mode, rows=rows, **options)
        started = time.perf_counter()
        graphs.warm_up()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        steps = [step for bucket in (*graphs._flow.values(), *graphs._vocoder.values()) for step in bucket.steps.values()]
        runs = sum(step.warmup_runs + 1 for step in steps)
        results[label] = (len(steps), runs, seconds)
        print(f"{label:41s} {len(steps):5d} {runs:5d} {seconds:8.2f}")
    (s0, r0, t0), (s1, r1, t1) = results.values()
    print(f"now / baseline: steps {s1 / s0:.2f}, runs {r1 / r0:.2f}, seconds {t1 / t0:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["tiny", "full"], default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--sizes", action="store_true", help="print the window sizes per step kind and exit")
    parser.add_argument("--warm-up", action="store_true", help="print what warming up every bucket costs and exit")
    parser.add_argument("--rows", type=int, default=8, help="(--warm-up) windows a step runs at most")
    args = parser.parse_args()
    torch.set_num_threads(1)
    vg = load(args.size, args.device)
    with torch.inference_mode():
        if args.sizes:
            window_sizes(vg)
        elif args.warm_up:
            warm_up_cost(vg, args.rows, args.device)
        else:
            timings(vg, args.seconds, args.device)


if __name__ == "__main__":
    main()
