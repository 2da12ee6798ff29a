"""Concurrent calls' spoken-LM decode steps: each call stepping alone vs one batched step for all.

N calls (one thread each, as the plugin runs them) each prefill their own history and then
decode ``--steps`` rows. Two ways, same rows, same process, one after the other:

* alone: every call feeds its own cache (the growing cache on a CPU, the static one on CUDA:
  the path each device uses when calls step alone);
* batched: every call holds a slot of one ``LMStepBatch``; whatever steps are waiting run as one
  forward (``taste_speech.lm_batch``; on CUDA one captured graph per batch size).

Printed per N: wall time per decode step as one call sees it, all calls' steps per second, the
ratio batched / alone, and the mean number of calls a batched step served.

    python benchmarks/bench_lm_batch.py                                  # tiny, CPU, 1/2/4/8 calls
    python benchmarks/bench_lm_batch.py --models tiny,full --steps 20    # + published dimensions
    python benchmarks/bench_lm_batch.py --models full --device cuda --dtype bfloat16 --calls 1,2,4,8,16

With ``--write`` the table goes to ``benchmarks/results/lm_batch.md`` (+ .json) and into
BENCHMARKS.md as its section 4b, which ``run_all.py`` keeps when it regenerates the rest.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import report  # noqa: E402
from benchmarks.bench_lm_cache import full_model, sync, tiny_model  # noqa: E402
from taste_speech.lm_batch import LMStepBatch  # noqa: E402

CONTEXT = 64  # rows of history each call prefills (different rows per call)
RESULTS = ROOT / "benchmarks" / "results"
SECTION = "## 4b. Spoken-LM steps of concurrent calls: each alone vs batched"


def call_rows(lm, calls: int, steps: int, device) -> list[torch.Tensor]:
    hidden = lm.causal_lm.config.hidden_size
    return [(torch.randn(1, CONTEXT + steps, hidden, generator=torch.Generator().manual_seed(i)) * 0.5)
            .to(device=device, dtype=lm.lm_dtype) for i in range(calls)]


def run_calls(lm, rows: list[torch.Tensor], steps: int, new_cache, device) -> float:
    """Seconds from the common start to the last call's last step (prefills before the start)."""
    states = [lm.new_decode_state(cache=new_cache()) for _ in rows]
    for state, r in zip(states, rows):
        lm.feed(state, r[:, :CONTEXT])
    start, errors = threading.Barrier(len(rows) + 1), []

    def decode(state, r):
        try:
            with torch.no_grad():
                start.wait()
                for i in range(CONTEXT, CONTEXT + steps):
                    lm.feed(state, r[:, i:i + 1])
        except Exception as error:  # re-raised below: a failing call must not look fast
            errors.append(error)

    threads = [threading.Thread(target=decode, args=(s, r)) for s, r in zip(states, rows)]
    for thread in threads:
        thread.start()
    sync(device)
    start.wait()
    t0 = time.perf_counter()
    for thread in threads:
        thread.join()
    sync(device)
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    for state in states:
        close = getattr(state.cache, "close", None)
        if close is not None:
            close()
    return elapsed


@torch.no_grad()
def measure(models: list[str], calls: list[int], *, steps: int = 40, device: str = "cpu", dtype: str = "float32",
            log=print) -> list[dict]:
    dev, torch_dtype = torch.device(device), getattr(torch, dtype)
    alone_kind = "static" if dev.type == "cuda" else "dynamic"
    results = []
    for name in models:
        lm, _ = (tiny_model if name == "tiny" else full_model)(dev, torch_dtype)
        lm.eval()
        batch = LMStepBatch(lm, slots=max(calls), capacity=CONTEXT + steps + 64)
        batch.warm_up()
        for n in calls:
            rows = call_rows(lm, n, steps, dev)
            run_calls(lm, rows, 2, lambda: lm.new_cache(alone_kind, capacity=CONTEXT + steps + 8), dev)  # warm-up
            run_calls(lm, rows, 2, batch.open, dev)
            alone = run_calls(lm, rows, steps, lambda: lm.new_cache(alone_kind, capacity=CONTEXT + steps + 8), dev)
            before = batch.stats()
            batched = run_calls(lm, rows, steps, batch.open, dev)
            after = batch.stats()
            served = (after["rows_stepped"] - before["rows_stepped"]) / max(1, after["steps"] - before["steps"])
            row = {"model": name, "calls": n, "steps": steps,
                   "alone_ms_per_step": 1000 * alone / steps, "batched_ms_per_step": 1000 * batched / steps,
                   "alone_steps_per_s": n * steps / alone, "batched_steps_per_s": n * steps / batched,
                   "mean_batch": served}
            row["throughput_ratio"] = row["batched_steps_per_s"] / row["alone_steps_per_s"]
            results.append(row)
            log(f"{name} {n} calls: alone {row['alone_ms_per_step']:.2f} ms/step ({row['alone_steps_per_s']:.0f} steps/s), "
                f"batched {row['batched_ms_per_step']:.2f} ms/step ({row['batched_steps_per_s']:.0f} steps/s), "
                f"x{row['throughput_ratio']:.2f}, mean batch {served:.2f}")
        del lm, batch
    return results


def markdown(results: list[dict]) -> list[str]:
    lines = ["| model | calls | alone ms/step | batched ms/step | alone steps/s | batched steps/s | batched / alone | "
             "mean batch |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['model']} | {r['calls']} | {r['alone_ms_per_step']:.2f} | {r['batched_ms_per_step']:.2f} | "
                     f"{r['alone_steps_per_s']:.0f} | {r['batched_steps_per_s']:.0f} | {r['throughput_ratio']:.2f}x | "
                     f"{r['mean_batch']:.2f} |")
    return lines


def benchmarks_section(results_dir: Path = RESULTS) -> list[str]:
    """The last ``--write`` run as a section of BENCHMARKS.md ([] before the first)."""
    saved = Path(results_dir) / "lm_batch.md"
    if not saved.exists():
        return []
    return [SECTION, "", saved.read_text().split("\n", 1)[1].strip()]


def update_benchmarks_md(path: Path = ROOT / "BENCHMARKS.md", results_dir: Path = RESULTS) -> None:
    """Put the section in place of its old text, or before section 5 (GPU)."""
    text = path.read_text()
    section = "\n".join(benchmarks_section(results_dir))
    if SECTION in text:
        head, rest = text.split(SECTION, 1)
        tail = rest[rest.find("\n## "):] if "\n## " in rest else "\n"
        path.write_text(head + section + "\n" + tail)
    elif "\n## 5. " in text:
        head, tail = text.split("\n## 5. ", 1)
        path.write_text(head.rstrip() + "\n\n" + section + "\n\n## 5. " + tail)
    else:
        path.write_text(text.rstrip() + "\n\n" + section + "\n")


def write_results(results: list[dict], command: str, facts: dict, results_dir: Path = RESULTS) -> None:
    results_dir.mkdir(parents=True, exist_ok=True)
    lines = ["# Spoken-LM steps of concurrent calls", "",
             "N calls (one thread each, as the plugin runs them) prefill 64 rows of their own history, then decode "
             "one row per step. *Alone*: each call feeds its own cache (the growing cache on a CPU, the static one "
             "on CUDA). *Batched*: each call holds a slot of one `LMStepBatch` (`taste_speech/lm_batch.py`) and the "
             "steps waiting at the same moment run as one forward. ms/step = wall time per step as one call sees "
             "it; steps/s = all calls together; mean batch = call steps per batched forward. Both ways run back to "
             "back in one process; the ratio is the figure to read. On a CPU batching pays only past the core "
             "count: calls stepping alone already run in parallel on the cores, and each call's heads (the text "
             "head over 128 256 ids at full size) run in its own thread between steps, so the engine batches by "
             "default only on the CUDA fast path, where a step costs its kernel launches, not its rows "
             "(GPU_NOTES: 2.9 ms for one call, 4.4 ms for eight batched). No GPU figures yet.", "",
             f"Command: `{command}`; " + "; ".join(report.facts_lines(facts)).replace("- ", ""), ""]
    lines += markdown(results)
    (results_dir / "lm_batch.md").write_text("\n".join(lines) + "\n")
    (results_dir / "lm_batch.json").write_text(json.dumps({"command": command, "facts": facts, "rows": results},
                                                          indent=1, default=str))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny", help="comma-separated: tiny, full")
    parser.add_argument("--calls", default="1,2,4,8", help="comma-separated numbers of concurrent calls")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--write", action="store_true",
                        help="save to benchmarks/results/lm_batch.md and update BENCHMARKS.md section 4b")
    args = parser.parse_args(argv)
    calls = [int(n) for n in args.calls.split(",")]
    results = measure(args.models.split(","), calls, steps=args.steps, device=args.device, dtype=args.dtype)
    print("\n".join(markdown(results)))
    if args.write:
        command = "python benchmarks/bench_lm_batch.py " + shlex.join(argv if argv is not None else sys.argv[1:])
        write_results(results, command.strip(), report.machine_facts(args.device, args.dtype))
        update_benchmarks_md()
    return 0


if __name__ == "__main__":
    sys.exit(main())
