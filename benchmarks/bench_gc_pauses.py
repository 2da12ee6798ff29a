"""The garbage collector's pauses during a call: start-up's objects as they are, and frozen.

    python benchmarks/bench_gc_pauses.py [--runs 2] [--model DIR] [--device cpu]

A full collection walks every tracked object with the interpreter lock held, so every call's
threads stand still meanwhile. One process builds the engine and warms it up, then runs the
scripted call (``taste-agent call --simulate``: real-time audio, the embedded tiny checkpoint
unless --model) with start-up's objects as they are and with them frozen
(``pipecat_taste.freeze_startup_objects``, what taste-agent does once the model is ready), the two
alternating (``gc.unfreeze`` between). Printed: one full collection's time before each call, and
the collections during the calls - how many, their total and their longest pause - per generation,
with the calls' first audio.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for folder in (ROOT, ROOT / "plugin", ROOT / "agents"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

SETTINGS = ("start-up's objects as they are", "start-up's objects frozen (taste-agent's default)")


class Pauses:
    """The collector's pauses inside the ``with`` block, per generation (``gc.callbacks``)."""

    def __init__(self):
        self.pauses: dict[int, list[float]] = {}
        self._started: dict[int, float] = {}

    def _callback(self, phase: str, info: dict) -> None:
        thread = threading.get_ident()
        if phase == "start":
            self._started[thread] = time.perf_counter()
        elif thread in self._started:
            seconds = time.perf_counter() - self._started.pop(thread)
            self.pauses.setdefault(info["generation"], []).append(1000 * seconds)

    def __enter__(self) -> "Pauses":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[int, dict]:
        """Per generation: collections, their total and their longest pause (ms)."""
        return {gen: {"count": len(ms), "total_ms": sum(ms), "max_ms": max(ms)}
                for gen, ms in sorted(self.pauses.items())}


def full_collection_ms() -> float:
    started = time.perf_counter()
    gc.collect()
    return 1000 * (time.perf_counter() - started)


def one_call(engine, frozen: bool, out_dir: str) -> dict:
    from pipecat_taste.gc_pauses import freeze_startup_objects
    from taste_agents.cli import build_parser, simulated_call

    gc.unfreeze()
    if frozen:
        freeze_startup_objects()
    full_ms = full_collection_ms()
    args = build_parser().parse_args(["call", "--simulate", "--quiet", "--out", out_dir])
    with Pauses() as pauses:
        report = simulated_call(args, engine=engine).report
    turns = [t for t in report["turns"] if t.get("first_audio_latency_ms") is not None]
    return {"full_collection_ms": full_ms, "tracked": len(gc.get_objects()), "pauses": pauses.summary(),
            "first_audio_ms": [t["first_audio_latency_ms"] for t in turns],
            "underruns": sum(t.get("underruns") or 0 for t in turns)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="simulated calls per setting")
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the embedded tiny one)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from pipecat_taste.engine import TasteEngine

    engine = TasteEngine.from_pretrained(args.model, device=args.device)
    engine.warm_up()
    results: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as out:
        for i in range(args.runs):
            for name in (SETTINGS if i % 2 == 0 else SETTINGS[::-1]):  # alternating
                run = one_call(engine, name == SETTINGS[1], os.path.join(out, f"{i}-{len(results[name])}"))
                results[name].append(run)
                print(f"run {i + 1}, {name}: {run['pauses']}", file=sys.stderr)
    print(f"\nThe garbage collector during the scripted call ({args.model or 'embedded tiny checkpoint'}, "
          f"{args.device}, {os.cpu_count()} cores; {args.runs} calls per setting; ms):\n")
    print("| start-up's objects | objects tracked | one full collection (median) | full collections in the calls "
          "| their total | longest | all collections' total | first audio median | underruns |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, runs in results.items():
        full = [r["pauses"].get(2, {"count": 0, "total_ms": 0.0, "max_ms": 0.0}) for r in runs]
        every = sum(g["total_ms"] for r in runs for g in r["pauses"].values())
        print(f"| {name} | {statistics.median(r['tracked'] for r in runs):.0f} "
              f"| {statistics.median(r['full_collection_ms'] for r in runs):.1f} | {sum(f['count'] for f in full)} "
              f"| {sum(f['total_ms'] for f in full):.0f} | {max(f['max_ms'] for f in full):.1f} | {every:.0f} "
              f"| {statistics.median(ms for r in runs for ms in r['first_audio_ms']):.0f} "
              f"| {sum(r['underruns'] for r in runs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
