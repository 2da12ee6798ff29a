"""The first caller after a start: first audio of an engine's first turns, with and without the
rehearsal turn at start-up (``TasteEngine.warm_up(rehearse=...)``, ``pipecat_taste.rehearsal``).

    python benchmarks/bench_first_turn.py                        # tiny, this CPU
    python benchmarks/bench_first_turn.py --size full --processes 1
    python benchmarks/bench_first_turn.py --device cuda --dtype bfloat16 --size full

A first turn is only first in a fresh process (the kernels' first runs, the allocator's pools,
the library handles are the process's), so every engine starts in a process of its own: the
processes alternate between the two start-ups, ``--processes`` of each (the first of each pair
alternating too: with one process each, the one without the rehearsal runs first). In each, the engine is
built and warmed up as taste-agent does (captures, then the rehearsal or not), and then answers
``--turns`` turns of new calls in a row, each on a thread of its own as a call's stages are
(``gpu_suite.first_audio``: a 3 s turn, partial
transcripts made while it is spoken, a forced 12-word reply; first audio from the end of the
turn, the GPU waited for at each stage). Printed: the median first audio of the first turn and
of the later ones, per start-up, and the ratios against each other, all from this one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "plugin"), str(ROOT / "agents")]

START_UPS = {"captures only": False, "captures + rehearsal": True}


def one_process(size: str, device: str, dtype: str | None, rehearse: bool, turns: int, threads="auto") -> dict:
    """In this (fresh) process: build, warm up, answer ``turns`` turns; their first audio in ms."""
    import torch

    from benchmarks import gpu_suite
    from pipecat_taste.engine import TasteEngine

    built = gpu_suite.build_engine(size, device, dtype)
    asr = gpu_suite.build_asr(size, built, device, dtype)
    path = gpu_suite.GRAPHED if torch.device(device).type == "cuda" else gpu_suite.EAGER  # (decoding 'auto')
    engine = TasteEngine(built.model, built.processor, built.voice_generator, checkpoint_dir=built.checkpoint_dir,
                         device=device, asr=asr[path.name], decoding=path.name, threads_per_job=threads)
    started = time.perf_counter()
    rehearsal = engine.warm_up(rehearse=rehearse)
    warm_up_s = time.perf_counter() - started
    with gpu_suite.ForcedReply(built.model.spoken_lm) as forced:
        firsts = [on_new_thread(engine, gpu_suite.first_audio, engine, asr, path, forced, gpu_suite.user_audio(),
                                seed=i)["first_audio_ms"] for i in range(turns)]
    return {"first_audio_ms": firsts, "warm_up_s": warm_up_s,
            "rehearsal_first_audio_ms": None if rehearsal is None or rehearsal.first_audio_s is None
            else 1000 * rehearsal.first_audio_s}


def on_new_thread(engine, fn, *args, **kwargs):
    """``fn`` on a thread of its own, set up as each new call's stage threads are
    (``TasteCall.executor``: ``prepare_stage_thread``): what a thread makes for itself is not
    carried from turn to turn."""
    import threading

    from pipecat_taste.streams import prepare_stage_thread

    result: list = []

    def call():
        prepare_stage_thread(None, engine.threads_per_job)
        result.append(fn(*args, **kwargs))

    thread = threading.Thread(target=call, name="bench-call")
    thread.start()
    thread.join()
    if not result:
        raise RuntimeError("the turn failed (its traceback is above)")
    return result[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["tiny", "full"], default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="e.g. bfloat16 (default: float32)")
    parser.add_argument("--processes", type=int, default=3, help="fresh processes per start-up")
    parser.add_argument("--turns", type=int, default=3, help="turns each engine answers (the first, then the later)")
    parser.add_argument("--threads-per-job", default="auto", help="the engine's threads_per_job: auto, none or a number")
    parser.add_argument("--child", choices=sorted(START_UPS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.turns < 2 or args.processes < 1:
        parser.error("--turns must be at least 2 (a first turn and a later one) and --processes at least 1")
    if args.child:
        named = {"auto": "auto", "none": None}
        threads = named[args.threads_per_job] if args.threads_per_job in named else int(args.threads_per_job)
        print(json.dumps(one_process(args.size, args.device, args.dtype, START_UPS[args.child], args.turns, threads)))
        return 0

    runs: dict[str, list[dict]] = {name: [] for name in START_UPS}
    for i in range(args.processes):
        # alternating, and the first of each pair alternating too: a drift of the machine, or a cache
        # a process leaves on disk for the next one, touches both start-ups alike
        for name in (list(START_UPS) if i % 2 == 0 else list(START_UPS)[::-1]):
            command = [sys.executable, __file__, "--size", args.size, "--device", args.device, "--turns",
                       str(args.turns), "--threads-per-job", args.threads_per_job, "--child", name] + \
                (["--dtype", args.dtype] if args.dtype else [])
            out = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                return out.returncode
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"process {i + 1}, {name}: first audio {[round(ms, 1) for ms in runs[name][-1]['first_audio_ms']]} ms",
                  file=sys.stderr)

    print(f"\nFirst audio of an engine's first turns ({args.size}, {args.device}, {args.dtype or 'float32'}, "
          f"threads_per_job {args.threads_per_job}; "
          f"{args.processes} fresh processes per start-up, {args.turns} turns each; medians, ms):\n")
    print("| start-up | warm-up s | first turn | later turns | first / later |")
    print("| --- | --- | --- | --- | --- |")
    first = {}
    for name, results in runs.items():
        first[name] = statistics.median(r["first_audio_ms"][0] for r in results)
        later = statistics.median(ms for r in results for ms in r["first_audio_ms"][1:])
        warm = statistics.median(r["warm_up_s"] for r in results)
        print(f"| {name} | {warm:.2f} | {first[name]:.1f} | {later:.1f} | {first[name] / later:.2f} |")
    print(f"\nFirst turn with the rehearsal / without: {first['captures + rehearsal'] / first['captures only']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
