"""Soak: the full form of the load and long-call tests (tests/test_load.py runs them reduced).

    python -m benchmarks.soak                      # 8 calls x 5 min in process, 8 x 5 min over WebRTC, 100-turn call
    python -m benchmarks.soak --parts in-process --minutes 1

* load: N calls at once on one tiny engine for M minutes, each slot starting a new call when its
  call ends; in process (taste_agents.load.concurrent_calls) and over loopback WebRTC with one
  aiortc caller process per call (concurrent_webrtc_calls). Reported: crashes, calls finished,
  audio intact (synthesized == released == written, per call), peak RSS and its slope over time,
  first-audio latency.
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
        "latency_per_turn_ms": latencies, "rss_mb": rss,
    }


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
            ax.plot(t / 60, mb, label=f"{row['transport']}, {row['calls_at_once']} calls")
        ax.set_xlabel("minutes"), ax.set_ylabel("RSS (MB)"), ax.legend(), ax.grid(alpha=0.3)
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
        b.plot(t / 60, mb), b.set_xlabel("minutes"), b.set_ylabel("RSS (MB)"), b.grid(alpha=0.3)
        fig.tight_layout(), fig.savefig(out / "soak_long_call.png", dpi=110), plt.close(fig)
        paths["long_call"] = "soak_long_call.png"
    return paths


SECTION = "## 6. Soak: load for minutes, a 100-turn call"


def benchmarks_section(results_dir: Path = RESULTS) -> list[str]:
    """The soak report as a section of BENCHMARKS.md (images linked from the repository root)."""
    soak_md = Path(results_dir) / "soak.md"
    if not soak_md.exists():
        return []
    body = soak_md.read_text().split("\n", 1)[1]  # without its own title
    rel = Path(results_dir).resolve().relative_to(ROOT).as_posix() if Path(results_dir).resolve().is_relative_to(ROOT) \
        else str(results_dir)
    body = body.replace("](soak_", f"]({rel}/soak_")
    return [SECTION, "", "Run separately (about 25 minutes): `python -m benchmarks.soak`; the tables below are "
            f"`{rel}/soak.md`.", body.rstrip()]


def update_benchmarks_md(path: Path = ROOT / "BENCHMARKS.md", results_dir: Path = RESULTS) -> None:
    """Put the current soak report into BENCHMARKS.md in place of its soak section (or at its end)."""
    if not path.exists():
        return
    text = path.read_text()
    head = text.split(SECTION, 1)[0].rstrip()
    path.write_text(head + "\n\n" + "\n".join(benchmarks_section(results_dir)) + "\n")


def markdown(results: dict, paths: dict) -> str:
    lines = ["# Soak: load and long call", "",
             "Crashes: exceptions in a call or the server. Timed out: calls past their time limit. Connections "
             "lost: WebRTC calls whose peer connection failed before the caller's script ended (dropped calls). "
             "Audio intact: in every finished call the agent audio released and written is exactly the "
             "synthesized audio.", ""]
    loads = [v for k, v in results.items() if k.startswith("load")]
    if loads:
        lines += ["| transport | calls at once | minutes | calls finished | crashes | timed out | connections lost | "
                  "audio intact | idle RSS MB | peak RSS MB | RSS slope MB/min | first audio median ms | p90 ms | command, date |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in loads:
            lines.append(f"| {r['transport']} | {r['calls_at_once']} | {r['minutes']} | {r['calls_finished']} | {r['crashes']} | "
                         f"{r['timed_out']} | {r.get('connections_lost', 0)} | {r['audio_intact']} | {r['baseline_rss_mb']} | "
                         f"{r['peak_rss_mb']} | {r['memory_slope_mb_per_min']} | {r['first_audio_ms_median']} | "
                         f"{r['first_audio_ms_p90']} | `{r['command']}`, {r['date']} |")
        if "rss" in paths:
            lines += ["", f"![RSS over time]({paths['rss']})"]
    if "long_call" in results:
        r = results["long_call"]
        lines += ["", f"Long call (`{r['command']}`, {r['date']}): {r['turns']} caller turns, {r['answered']} answered, window {r['window_tokens']} LM rows, "
                  f"{r['duration_s']} s, timed out {r['timed_out']}, every turn decided {r['every_turn_decided']}, "
                  f"audio intact {r['audio_intact']}, errors {r['errors']}.", "",
                  "| | first third | last third |", "|---|---|---|",
                  f"| first audio, median ms | {r['latency_ms_first_third_median']} | {r['latency_ms_last_third_median']} |",
                  f"| RSS, mean MB | {r['rss_mb_first_third_mean']:.1f} | {r['rss_mb_last_third_mean']:.1f} |"]
        if "long_call" in paths:
            lines += ["", f"![long call]({paths['long_call']})"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="in-process,webrtc,long-call")
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument("--window-tokens", type=int, default=256, help="rolling history window of the long call")
    parser.add_argument("--decoding", default="auto", choices=["auto", "graphed", "eager"],
                        help="the engine's hot loops (TasteEngine decoding; on a CPU 'auto' is 'eager')")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)

    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    from pipecat_taste.engine import TasteEngine
    from taste_agents.memory import limit_malloc_arenas

    limit_malloc_arenas()  # as taste-agent does

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engine = TasteEngine.from_pretrained(None, decoding=args.decoding)
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
            results[f"load_{transport}_{args.calls}"] = {**row, "command": command, "date": time.strftime("%Y-%m-%d %H:%M")}
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
    ok = all(r["crashes"] == 0 and r["audio_intact"] for k, r in results.items() if k.startswith("load"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
