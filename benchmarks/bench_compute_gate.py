"""The compute gate's order of admission: a call speaking a long reply beside calls that need a slot
now and then, in strict arrival order (the gate before) and with each call in its turn (now).

    python benchmarks/bench_compute_gate.py [--seconds 4] [--slots 2]
    python benchmarks/bench_compute_gate.py --calls 8 [--runs 2]

The first form is the gate alone. The jobs hold their slot for a fixed time (a sleep, not compute): what is measured is the gate's
order alone, the same on any machine. A 2-core CPU's gate has 2 slots. The calls:

* a long reply, behind real time: its three stages (think, speech tokens, vocode) each queue their
  next job as soon as the last one is done (120, 80 and 60 ms) - it would fill every slot;
* a reply being played: one 20 ms vocoder chunk every 100 ms;
* turns ending: a call's 150 ms first segment (its prefill) every 500 ms.

Printed: how long the played reply's chunks and the turns' first segments waited for a slot, and
how many jobs the long reply got through - the price of the others' turns.

The second form is the real thing: ``--calls`` in-process simulated calls at once on one engine (the
embedded tiny checkpoint, the short script, real-time audio; ``taste_agents.load.concurrent_calls``),
the engine's gate in each order in turn, ``--runs`` times alternating. Printed: the callers' first
audio over every turn, the underruns and the gate's waits.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for folder in (ROOT, ROOT / "plugin", ROOT / "agents"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from pipecat_taste.compute import ComputeGate  # noqa: E402

LONG_REPLY_JOBS_S = {"think": 0.12, "speech_tokens": 0.08, "vocode": 0.06}
PLAYED_CHUNK_S, PLAYED_EVERY_S = 0.02, 0.1
TURN_S, TURN_EVERY_S = 0.15, 0.5
ORDERS = {"arrival order (before)": False, "each call in its turn (now)": True}  # name: ComputeGate(fair=)


def run(gate: ComputeGate, seconds: float) -> dict:
    """The three calls against ``gate`` for ``seconds``: {'played chunk' / 'turn': [waits in ms],
    'long reply jobs': n}."""
    stop = threading.Event()
    waits: dict[str, list[float]] = {"played chunk": [], "turn": []}
    long_jobs = [0]
    lock = threading.Lock()

    def busy_stage(job_s: float) -> None:  # the long reply: one of its stages, never idle
        while not stop.is_set():
            gate.run(time.sleep, job_s, owner="long reply")
            with lock:
                long_jobs[0] += 1

    def now_and_then(name: str, job_s: float, every_s: float, offset_s: float) -> None:
        next_at = time.monotonic() + offset_s
        while not stop.wait(max(0.0, next_at - time.monotonic())):
            asked = time.monotonic()
            with gate.slot(owner=name):
                waits[name].append(1000 * (time.monotonic() - asked))
                time.sleep(job_s)
            next_at += every_s

    threads = [threading.Thread(target=busy_stage, args=(s,)) for s in LONG_REPLY_JOBS_S.values()]
    threads += [threading.Thread(target=now_and_then, args=("played chunk", PLAYED_CHUNK_S, PLAYED_EVERY_S, 0.05)),
                threading.Thread(target=now_and_then, args=("turn", TURN_S, TURN_EVERY_S, 0.23))]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return {**waits, "long reply jobs": long_jobs[0]}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(seconds: float = 4.0, slots: int = 2) -> dict:
    """{order: run(...)} for strict arrival order and for each call in its turn."""
    return {name: run(ComputeGate(slots, fair=fair), seconds) for name, fair in ORDERS.items()}


def table(result: dict) -> list[str]:
    lines = ["| admission | played reply's chunk: median wait | p95 | max | turn's first segment: median wait | "
             "max | long reply: jobs done |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in result.items():
        chunk, turn = r["played chunk"], r["turn"]
        lines.append(f"| {name} | {statistics.median(chunk):.1f} ms | {percentile(chunk, 0.95):.1f} ms | "
                     f"{max(chunk):.1f} ms | {statistics.median(turn):.1f} ms | {max(turn):.1f} ms | "
                     f"{r['long reply jobs']} |")
    before, now = result.values()
    lines.append(f"\nplayed reply's chunk, max wait now / before: {max(now['played chunk']) / max(before['played chunk']):.2f}; "
                 f"turn's first segment, max wait now / before: {max(now['turn']) / max(before['turn']):.2f}; "
                 f"long reply's jobs now / before: {now['long reply jobs'] / before['long reply jobs']:.2f}")
    return lines


def measure_calls(n_calls: int, runs: int) -> dict:
    """{order: {'first_audio_ms': [...], 'underruns': n, 'gate': [stats per run]}}: ``n_calls``
    simulated calls at once per run, the orders alternating."""
    import asyncio

    from pipecat_taste.engine import TasteEngine
    from taste_agents.caller import short_script
    from taste_agents.load import concurrent_calls
    from taste_agents.phone_agent import PhoneAgentConfig

    engine = TasteEngine.from_pretrained(None)
    engine.warm_up()
    slots = engine.compute_gate.slots
    result = {name: {"first_audio_ms": [], "underruns": 0, "gate": []} for name in ORDERS}
    for i in range(runs):
        for name in (list(ORDERS) if i % 2 == 0 else list(ORDERS)[::-1]):
            engine.compute_gate = ComputeGate(slots, fair=ORDERS[name])
            run = asyncio.run(concurrent_calls(engine, n_calls, config=PhoneAgentConfig(max_reply_tokens=6),
                                               rounds=1, script_factory=short_script))
            if run.crashes:
                raise RuntimeError(f"{name}: calls crashed: {run.crashes}")
            entry = result[name]
            entry["first_audio_ms"] += run.first_audio_ms
            entry["underruns"] += sum(c["summary"]["underruns"] for c in run.calls)
            entry["gate"].append(run.compute_gate)
            print(f"run {i + 1}, {name}: first audio {[round(ms) for ms in run.first_audio_ms]} ms, "
                  f"gate {run.compute_gate}", file=sys.stderr)
    return result


def calls_table(result: dict) -> list[str]:
    lines = ["| admission | first audio: median | p90 | max | turns | underruns | gate: mean wait | max wait |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in result.items():
        ms = r["first_audio_ms"]
        mean_wait = statistics.mean(g["mean_wait_ms"] for g in r["gate"])
        lines.append(f"| {name} | {statistics.median(ms):.0f} ms | {percentile(ms, 0.9):.0f} ms | {max(ms):.0f} ms | "
                     f"{len(ms)} | {r['underruns']} | {mean_wait:.1f} ms | "
                     f"{max(g['max_wait_ms'] for g in r['gate']):.0f} ms |")
    before, now = result.values()
    lines.append(f"\nfirst audio, median now / before: "
                 f"{statistics.median(now['first_audio_ms']) / statistics.median(before['first_audio_ms']):.2f}; "
                 f"max now / before: {max(now['first_audio_ms']) / max(before['first_audio_ms']):.2f}")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="how long each admission order runs")
    parser.add_argument("--slots", type=int, default=2, help="the gate's slots (a CPU's: its cores)")
    parser.add_argument("--calls", type=int, default=0, help="run this many simulated calls at once instead")
    parser.add_argument("--runs", type=int, default=2, help="with --calls: runs per admission order")
    args = parser.parse_args(argv)
    if args.calls:
        result = measure_calls(args.calls, args.runs)
        print(f"# {args.calls} simulated calls at once on the tiny engine, {args.runs} runs per admission order")
        print("\n".join(calls_table(result)))
        return
    print(f"# the compute gate's admission, {args.slots} slots, {args.seconds} s each (jobs are sleeps)")
    print("\n".join(table(measure(args.seconds, args.slots))))


if __name__ == "__main__":
    main()
