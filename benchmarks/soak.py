"""Soak: the full form of the load and long-call tests (tests/test_load.py runs them reduced).

    python -m benchmarks.soak                      # 8 calls x 5 min in process and over WebRTC, memory rounds, 100-turn call
    python -m benchmarks.soak --parts in-process --minutes 1

* load: N calls at once on one tiny engine for M minutes, each slot starting a new call when its
  call ends; in process (taste_agents.load.concurrent_calls) and over loopback WebRTC with one
  aiortc caller process per call (concurrent_webrtc_calls). Reported: crashes, calls finished,
  audio intact (synthesized == released == written, per call), peak RSS and its slope over time,
  first-audio latency.
* memory rounds: R rounds of N calls at once; after each round (every call ended, garbage
  collected, malloc_trim) the memory at rest: RSS, glibc's heap in use and free inside the heap,
  Python objects, live tensors. A leak raises what is in use round after round; fragmentation
  raises only the free part.
* trim cost: what the ``malloc_trim`` the server runs when a call ends costs the other calls.
  N calls at once, R rounds, twice in the same run: each call's end followed by a timed trim
  (on a thread, as the server does), then with no trim as the baseline. Reported: how long each
  trim took, and the event-loop lag of both runs (a trim that stalled the loop would raise it).
* long call: one real-time simulated call of 100 caller turns with a rolling history window;
  per-turn first-audio latency and RSS over the call, first third vs last third.

Writes benchmarks/results/soak.md (+ soak.json, soak_rss.png, soak_long_call.png) and its section
of BENCHMARKS.md. A run replaces only the rows it measured (one per transport and call count), so
``--parts webrtc --calls 4`` adds a 4-call row next to the 8-call ones. A WebRTC call whose peer
connection fails before the caller's script ends counts as a lost connection (a dropped call).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def long_call_script(turns: int) -> list:
    from taste_agents.caller import Say, WaitForReply, Pause, load_utterances

    utterances = [u for name, u in sorted(load_utterances().items()) if name != "bargein"]
    script: list = [Pause(0.5)]
    for i in range(turns):
        script += [Say(utterances[i % len(utterances)]), WaitForReply(20.0)]
    return script


def audio_kept_mb(call) -> float:
    """Audio the simulated call keeps to the end for its recording and its checks (not the
    agent's: the harness's): both channels of the line up to the call's end, the agent audio as
    played, the audio frames seen on both sides, and the call log's per-reply PCM."""
    line = call.line
    nbytes = 2 * min(line.agent.size, int(call.duration_s * line.sample_rate)) * line.agent.itemsize
    nbytes += sum(samples.nbytes for _, samples in line.writes)
    nbytes += sum(len(getattr(frame, "audio", b"") or b"") for _, frame in call.frames + call.upstream_frames)
    for chunks in (*call.log.synthesized_audio.values(), *call.log.released_audio.values()):
        nbytes += sum(len(chunk) for chunk in chunks)
    return round(nbytes / 2**20, 1)


async def long_call(engine, turns: int, window_tokens: int) -> dict:
    from taste_agents.load import MemorySampler
    from taste_agents.phone_agent import PhoneAgentConfig
    from taste_agents.simulate import simulate_call

    config = PhoneAgentConfig(max_reply_tokens=6, history_max_tokens=window_tokens)
    with MemorySampler(2.0) as memory:
        call = await simulate_call(engine, long_call_script(turns), config=config, max_call_s=turns * 20.0 + 60)
    report = call.report
    latencies = [t.get("first_audio_latency_ms") for t in report["turns"]]
    answered = [x for x in latencies if x is not None]
    third = max(1, len(latencies) // 3)
    first, last = [x for x in latencies[:third] if x is not None], [x for x in latencies[-third:] if x is not None]
    rss = memory.samples
    rss_third = max(1, len(rss) // 3)
    return {
        "turns": len(latencies), "answered": len(answered), "timed_out": report["timed_out"],
        "every_turn_decided": report["checks"]["every_turn_decided"], "errors": report["summary"]["errors"],
        "audio_intact": bool(report["checks"].get("released_equals_synthesized") and report["checks"].get("written_equals_released")),
        "window_tokens": window_tokens, "duration_s": report["duration_s"],
        "latency_ms_first_third_median": float(np.median(first)) if first else None,
        "latency_ms_last_third_median": float(np.median(last)) if last else None,
        "rss_mb_first_third_mean": float(np.mean([mb for _, mb in rss[:rss_third]])),
        "rss_mb_last_third_mean": float(np.mean([mb for _, mb in rss[-rss_third:]])),
        "audio_kept_mb": audio_kept_mb(call),
        "latency_per_turn_ms": latencies, "rss_mb": rss,
    }


def memory_at_rest() -> dict:
    """What the process holds when no call runs (after a collection and a trim)."""
    import gc
    import warnings

    import torch

    from taste_agents.load import rss_mb
    from taste_agents.memory import heap_stats, release_free_memory

    gc.collect()
    release_free_memory()
    objects = gc.get_objects()
    with warnings.catch_warnings():  # isinstance() touches deprecated torch module attributes
        warnings.simplefilter("ignore")
        tensors = [o for o in objects if isinstance(o, torch.Tensor)]
    heap = heap_stats() or {}
    return {"rss_mb": round(rss_mb(), 1), "heap_in_use_mb": heap.get("in_use"), "free_in_heap_mb": heap.get("free_in_heap"),
            "python_objects": len(objects), "tensors": len(tensors),
            "tensor_mb": round(sum(t.untyped_storage().nbytes() for t in tensors) / 2**20, 1)}


async def memory_rounds(engine, n_calls: int, rounds: int) -> dict:
    from taste_agents.load import concurrent_calls
    from taste_agents.phone_agent import PhoneAgentConfig

    rows = [{"round": 0, "calls": 0, "crashes": 0, "peak_rss_mb": None, **memory_at_rest()}]
    intact = True
    for index in range(1, rounds + 1):
        result = await concurrent_calls(engine, n_calls, config=PhoneAgentConfig(max_reply_tokens=6), rounds=1)
        rows.append({"round": index, "calls": len(result.calls), "crashes": len(result.crashes),
                     "peak_rss_mb": result.peak_rss_mb, **memory_at_rest()})
        intact = intact and result.audio_intact
        print(f"  [memory rounds] round {index}: {rows[-1]}", flush=True)
    return {"calls_at_once": n_calls, "rounds": rows, "crashes": sum(r["crashes"] for r in rows), "audio_intact": intact}


async def trim_cost(engine, n_calls: int, rounds: int) -> dict:
    from taste_agents.load import concurrent_calls
    from taste_agents.memory import release_free_memory
    from taste_agents.phone_agent import PhoneAgentConfig

    trims_ms: list[float] = []

    def timed_trim():
        started = time.perf_counter()
        release_free_memory()
        trims_ms.append(1000 * (time.perf_counter() - started))

    config = PhoneAgentConfig(max_reply_tokens=6)
    runs = {}
    for name, release in (("trim", timed_trim), ("no_trim", None)):
        # staggered starts: calls end while others still talk, which is when a stall would hurt
        result = await concurrent_calls(engine, n_calls, config=config, rounds=rounds, stagger_s=1.5, release_memory=release)
        runs[name] = {**result.loop_lag, "crashes": len(result.crashes), "audio_intact": result.audio_intact}
        print(f"  [trim cost] {name}: {runs[name]}", flush=True)
    return {"calls_at_once": n_calls, "rounds": rounds, "trims": len(trims_ms),
            "trim_ms_median": round(float(np.median(trims_ms)), 1), "trim_ms_max": round(max(trims_ms), 1),
            **{f"{name}_{key}": value for name, run in runs.items() for key, value in run.items()},
            "crashes": sum(run["crashes"] for run in runs.values()),
            "audio_intact": all(run["audio_intact"] for run in runs.values())}


async def load(engine, transport: str, n_calls: int, minutes: float, out_dir: Path) -> dict:
    from taste_agents.load import concurrent_calls, concurrent_webrtc_calls
    from taste_agents.phone_agent import PhoneAgentConfig
    from taste_agents.server import ServerConfig

    config = PhoneAgentConfig(max_reply_tokens=6)
    seen = []

    def progress(slot, report):
        seen.append(report)
        print(f"  [{transport}] call finished (slot {slot}), {len(seen)} so far", flush=True)

    if transport == "in-process":
        result = await concurrent_calls(engine, n_calls, config=config, duration_s=minutes * 60, on_call=progress)
    else:
        result = await concurrent_webrtc_calls(engine, n_calls, out_dir / "webrtc", config=ServerConfig(agent=config),
                                               duration_s=minutes * 60, on_call=progress)
    return {**result.summary(), "minutes": minutes, "rss_mb": result.rss_mb, "crash_messages": result.crashes[:10]}


def plot(results: dict, out: Path) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {}
    loads = {k: v for k, v in results.items() if k.startswith("load")}
    if loads:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        for name, row in loads.items():
            t, mb = np.array(row["rss_mb"]).T
            ax.plot(t / 60, mb, label=f"{row['transport']}, {row['calls_at_once']} calls, gate {_gate(row)}")
        ax.set_xlabel("minutes"), ax.set_ylabel("RSS (MiB)"), ax.legend(), ax.grid(alpha=0.3)
        ax.set_title("resident memory under load")
        fig.tight_layout(), fig.savefig(out / "soak_rss.png", dpi=110), plt.close(fig)
        paths["rss"] = "soak_rss.png"
    if "long_call" in results:
        row = results["long_call"]
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
        lat = [np.nan if x is None else x for x in row["latency_per_turn_ms"]]
        a.plot(range(1, len(lat) + 1), lat, ".-"), a.set_xlabel("caller turn"), a.set_ylabel("first audio (ms)")
        a.set_title(f"{row['turns']}-turn call, window {row['window_tokens']} rows"), a.grid(alpha=0.3)
        t, mb = np.array(row["rss_mb"]).T
        b.plot(t / 60, mb), b.set_xlabel("minutes"), b.set_ylabel("RSS (MiB)"), b.grid(alpha=0.3)
        fig.tight_layout(), fig.savefig(out / "soak_long_call.png", dpi=110), plt.close(fig)
        paths["long_call"] = "soak_long_call.png"
    return paths


SECTION_NUMBER = "## 6. "
SECTION = SECTION_NUMBER + "Soak: load for minutes, a 100-turn call"


def benchmarks_section(results_dir: Path = RESULTS) -> list[str]:
    """The soak report as a section of BENCHMARKS.md (images linked from the repository root)."""
    soak_md = Path(results_dir) / "soak.md"
    if not soak_md.exists():
        return []
    body = soak_md.read_text().split("\n", 1)[1]  # without its own title
    rel = Path(results_dir).resolve().relative_to(ROOT).as_posix() if Path(results_dir).resolve().is_relative_to(ROOT) \
        else str(results_dir)
    body = body.replace("](soak_", f"]({rel}/soak_")
    return [SECTION, "", "Run separately (about 40 minutes): `python -m benchmarks.soak`; the tables below are "
            f"`{rel}/soak.md`.", body.rstrip()]


def update_benchmarks_md(path: Path = ROOT / "BENCHMARKS.md", results_dir: Path = RESULTS) -> None:
    """Put the current soak report into BENCHMARKS.md in place of its soak section (before section
    7, or at its end)."""
    from benchmarks import report

    if path.exists():
        report.replace_section(path, SECTION_NUMBER, benchmarks_section(results_dir), before="## 7. ")


def _ms(value) -> str:
    return "-" if value is None else f"{value:.0f}"


def _peaks_per_minute(samples: list) -> str:
    peaks: dict[int, float] = {}
    for t, mb in samples:
        peaks[int(t // 60)] = max(peaks.get(int(t // 60), 0.0), mb)
    return " / ".join(f"{peaks[m]:.0f}" for m in sorted(peaks))


def _gate(row: dict) -> str:
    """Rows measured before the compute gate existed ran without one."""
    gate = row.get("compute_gate")
    return "none" if gate is None else str(gate["slots"])


def _lag(row: dict) -> str:
    """Rows measured before the event-loop monitor existed have no lag figures."""
    return f"{_ms(row['loop_lag_ms_p99'])} / {_ms(row['loop_lag_ms_max'])}" if "loop_lag_ms_p99" in row else "not measured"


def markdown(results: dict, paths: dict) -> str:
    lines = ["# Soak: load and long call", "",
             "Crashes: exceptions in a call or the server. Timed out: calls past their time limit. Connections "
             "lost: WebRTC calls whose peer connection failed before the caller's script ended (dropped calls). "
             "Audio intact: in every finished call the agent audio released and written is exactly the "
             "synthesized audio. Peak RSS per minute: the largest resident size in each minute of the run (a "
             "leak keeps raising it; an allocator reaching its working set levels off). Event-loop lag: how "
             "late the server's event loop ran a callback that asked to wake every 50 ms (WebRTC drops a "
             "call whose ICE consent checks go unanswered for 0.5 s, six times in a row). First audio over "
             "WebRTC is measured on the callers' recordings; a call that lost its connection ended its script "
             "there, so its later turns are not in the figures. Compute gate slots: model jobs of all calls "
             "running at once (`TasteEngine(parallel_jobs=...)`; none: no gate, each call's threads run freely).", ""]
    loads = [v for k, v in results.items() if k.startswith("load")]
    if loads:
        lines += ["| transport | calls at once | minutes | calls finished | crashes | timed out | connections lost | "
                  "audio intact | compute gate slots | idle RSS MiB | peak RSS MiB | peak RSS MiB per minute | RSS slope MiB/min | "
                  "first audio median ms | p90 ms | event-loop lag p99 / max ms | command, date |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in loads:
            lines.append(f"| {r['transport']} | {r['calls_at_once']} | {r['minutes']} | {r['calls_finished']} | {r['crashes']} | "
                         f"{r['timed_out']} | {r.get('connections_lost', 0)} | {r['audio_intact']} | {_gate(r)} | {r['baseline_rss_mb']} | "
                         f"{r['peak_rss_mb']} | {_peaks_per_minute(r['rss_mb'])} | {r['memory_slope_mb_per_min']} | "
                         f"{_ms(r['first_audio_ms_median'])} | "
                         f"{_ms(r['first_audio_ms_p90'])} | {_lag(r)} | `{r['command']}`, {r['date']} |")
        if any(r["date"] < "2026-11-24" for r in loads):
            lines += ["", "First audio in these rows is the caller side's rule of that date: the first agent sample after "
                      "the end of the caller's utterance. In an overloaded run that sample can be an earlier reply's tail "
                      "still playing: the 184 ms median of the 8-call WebRTC run without the gate (15 connections lost) is "
                      "below the 500 ms the VAD waits before any reply, so it is not a reply latency. The rule now leaves "
                      "such turns unmeasured and counts them (`turns_agent_busy_at_end`; in process, a reply's audio is "
                      "taken from the moment it was handed over); these rows were not re-measured."]
        if "rss" in paths:
            lines += ["", f"![RSS over time]({paths['rss']})"]
    if "memory_rounds" in results:
        r = results["memory_rounds"]
        lines += ["", f"Memory at rest (`{r['command']}`, {r['date']}): {len(r['rounds']) - 1} rounds of "
                  f"{r['calls_at_once']} in-process calls at once; after each round every call has ended, then a "
                  "garbage collection and a malloc_trim. Heap in use: glibc's count of the blocks the process "
                  "holds (a leak raises it); free in heap: blocks freed but kept by glibc (fragmentation).", "",
                  "| round | calls | crashes | peak RSS MiB during the round | RSS MiB at rest | heap in use MiB | "
                  "free in heap MiB | Python objects | tensors (MiB) |", "|---|---|---|---|---|---|---|---|---|"]
        for row in r["rounds"]:
            lines.append(f"| {row['round'] or 'before'} | {row['calls']} | {row['crashes']} | {row['peak_rss_mb'] or '-'} | "
                         f"{row['rss_mb']} | {row['heap_in_use_mb']} | {row['free_in_heap_mb']} | {row['python_objects']} | "
                         f"{row['tensors']} ({row['tensor_mb']}) |")
    if "trim_cost" in results:
        r = results["trim_cost"]
        lines += ["", f"Trim cost (`{r['command']}`, {r['date']}): {r['rounds']} rounds of {r['calls_at_once']} in-process "
                  "calls at once with staggered starts, so calls end while others talk; each call's end is followed by "
                  "the server's `malloc_trim` on a thread, then the same calls again without it as the baseline. "
                  f"{r['trims']} trims took {r['trim_ms_median']} ms (median), {r['trim_ms_max']} ms at most.", "",
                  "| | event-loop lag p50 ms | p99 ms | max ms | crashes | audio intact |", "|---|---|---|---|---|---|"]
        for name, label in (("trim", "a trim after each call"), ("no_trim", "no trim (baseline)")):
            lags = " | ".join(f"{r[f'{name}_loop_lag_ms_{q}']:.1f}" for q in ("p50", "p99", "max"))
            lines.append(f"| {label} | {lags} | {r[f'{name}_crashes']} | {r[f'{name}_audio_intact']} |")
    if "long_call" in results:
        r = results["long_call"]
        lines += ["", f"Long call (`{r['command']}`, {r['date']}): {r['turns']} caller turns, {r['answered']} answered, window {r['window_tokens']} LM rows, "
                  f"{r['duration_s']} s, timed out {r['timed_out']}, every turn decided {r['every_turn_decided']}, "
                  f"audio intact {r['audio_intact']}, errors {r['errors']}.", "",
                  "| | first third | last third |", "|---|---|---|",
                  f"| first audio, median ms | {r['latency_ms_first_third_median']} | {r['latency_ms_last_third_median']} |",
                  f"| RSS, mean MiB | {r['rss_mb_first_third_mean']:.1f} | {r['rss_mb_last_third_mean']:.1f} |"]
        if "audio_kept_mb" in r:
            lines += ["", f"The simulated call keeps its audio to the end, for the recording and the checks (both channels "
                      f"of the line, the agent audio as played, the frames seen on both sides, the call log's PCM): "
                      f"{r['audio_kept_mb']} MiB at its end; RSS grew by {r['rss_mb'][-1][1] - r['rss_mb'][0][1]:.1f} MiB from the "
                      f"call's start to its end."]
        if "long_call" in paths:
            lines += ["", f"![long call]({paths['long_call']})"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from taste_agents.cli import auto_none_or_count

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="in-process,webrtc,memory-rounds,trim-cost,long-call")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the memory-rounds and trim-cost parts")
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument("--window-tokens", type=int, default=256, help="rolling history window of the long call")
    parser.add_argument("--decoding", default="auto", choices=["auto", "graphed", "eager"],
                        help="the engine's hot loops (TasteEngine decoding; on a CPU 'auto' is 'eager')")
    parser.add_argument("--parallel-jobs", default="auto", type=auto_none_or_count,
                        help="the engine's compute gate (TasteEngine parallel_jobs): a number, 'none' or 'auto'")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)

    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    from pipecat_taste.engine import TasteEngine
    from taste_agents.memory import configure_malloc

    configure_malloc()  # as taste-agent does

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engine = TasteEngine.from_pretrained(None, decoding=args.decoding, parallel_jobs=args.parallel_jobs)
    engine.warm_up()
    # Rows of earlier runs in the same --out stay (a part re-run replaces its own row): the
    # report can hold runs at several call counts. Each row names the command that made it.
    previous = json.loads((out / "soak.json").read_text()) if (out / "soak.json").exists() else {}
    results: dict = {}
    parts = args.parts.split(",")
    command = ("python -m benchmarks.soak " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    for transport in ("in-process", "webrtc"):
        if transport in parts:
            print(f"load: {args.calls} calls at once {transport} for {args.minutes} min", flush=True)
            row = asyncio.run(load(engine, transport, args.calls, args.minutes, out))
            gate = "" if args.parallel_jobs == "auto" else f"_jobs_{args.parallel_jobs or 'none'}"  # an A/B row of its own
            results[f"load_{transport}_{args.calls}{gate}"] = {**row, "command": command, "date": time.strftime("%Y-%m-%d %H:%M")}
    if "memory-rounds" in parts:
        print(f"memory rounds: {args.rounds} rounds of {args.calls} calls", flush=True)
        row = asyncio.run(memory_rounds(engine, args.calls, args.rounds))
        results["memory_rounds"] = {**row, "command": command, "date": time.strftime("%Y-%m-%d %H:%M")}
    if "trim-cost" in parts:
        print(f"trim cost: {args.rounds} rounds of {args.calls} calls, with and without malloc_trim", flush=True)
        row = asyncio.run(trim_cost(engine, args.calls, args.rounds))
        results["trim_cost"] = {**row, "command": command, "date": time.strftime("%Y-%m-%d %H:%M")}
    if "long-call" in parts:
        print(f"long call: {args.turns} turns", flush=True)
        row = asyncio.run(long_call(engine, args.turns, args.window_tokens))
        results["long_call"] = {**row, "command": command, "date": time.strftime("%Y-%m-%d %H:%M")}
    merged = {**{k: v for k, v in previous.items() if "command" in v}, **results}
    (out / "soak.json").write_text(json.dumps(merged, indent=1))
    paths = plot(merged, out)
    (out / "soak.md").write_text(markdown(merged, paths))
    print((out / "soak.md").read_text())
    if out.resolve() == RESULTS.resolve():
        update_benchmarks_md()
    ok = all(r["crashes"] == 0 and r["audio_intact"] for k, r in results.items() if k.startswith(("load", "memory", "trim")))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
