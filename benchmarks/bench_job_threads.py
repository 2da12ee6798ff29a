"""torch's intra-op threads in a call's stage threads on a CPU: the simulated call (the main job)
with one thread per job (the engine's default on a CPU) against torch's own setting.

    python benchmarks/bench_job_threads.py [--runs 3]

A live call runs its stages (listen, think, speech tokens, vocode) on worker threads of their own,
side by side on the cores (``TasteCall.executor``). torch's default is one intra-op thread per core
for every thread that runs an operator, so the stages' thread teams compete for the cores. Each
setting runs ``taste-agent call --simulate`` (the embedded tiny checkpoint, the scripted caller,
real-time audio) in a fresh process, the two settings alternating; printed: the median first
audio after the caller stopped speaking and the playout's start hold (how late the replies'
second chunks came, which the playout waits for before it starts), over every turn of every run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"torch's setting (--threads-per-job none)": "none", "one thread per job (the default on a CPU)": "1"}


def one_call(threads: str) -> dict:
    agent = Path(sys.executable).with_name("taste-agent")
    out = subprocess.run([str(agent), "call", "--simulate", "--threads-per-job", threads], capture_output=True,
                         text=True, cwd=ROOT, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    found = re.search(r"report: (\S+report\.json)", out.stdout)
    if out.returncode != 0 or found is None:
        raise RuntimeError(f"the simulated call failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    report = json.loads((ROOT / found.group(1)).read_text())
    turns = [t for t in report["turns"] if t.get("first_audio_latency_ms") is not None]
    return {"first_audio_ms": [t["first_audio_latency_ms"] for t in turns],
            "start_hold_ms": [t.get("start_hold_ms") or 0.0 for t in turns],
            "underruns": sum(t.get("underruns") or 0 for t in turns)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="simulated calls per setting")
    args = parser.parse_args(argv)
    results: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for i in range(args.runs):
        for name in (list(SETTINGS) if i % 2 == 0 else list(SETTINGS)[::-1]):  # alternating
            results[name].append(one_call(SETTINGS[name]))
            print(f"run {i + 1}, {name}: first audio {results[name][-1]['first_audio_ms']} ms", file=sys.stderr)
    print(f"\nThe simulated call on this CPU ({os.cpu_count()} cores; {args.runs} calls per setting, every turn; "
          "medians, ms):\n")
    print("| intra-op threads per job | first audio | start hold | underruns (all calls) | first audio / torch's |")
    print("| --- | --- | --- | --- | --- |")
    base = None
    for name, runs in results.items():
        first = statistics.median(ms for r in runs for ms in r["first_audio_ms"])
        hold = statistics.median(ms for r in runs for ms in r["start_hold_ms"])
        base = base or first
        print(f"| {name} | {first:.0f} | {hold:.0f} | {sum(r['underruns'] for r in runs)} | {first / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
