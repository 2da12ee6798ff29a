"""Memory per call and first-audio latency with 1, 2, 4, 8 calls at once on one tiny engine.

Each N runs in a fresh Python process (``python -m benchmarks.concurrency --calls N``): the
allocator keeps freed memory, so after a run with many calls the next run's peak would partly be
the previous run's. In that process: load the engine, warm it up with one short reply (kernels,
thread pools and lazy imports are one-off costs, not per-call ones), record the idle RSS, then run
N in-process simulated calls at once (``taste_agents.load.concurrent_calls``: the real Pipecat
pipeline, real-time audio both ways, the scripted caller with its barge-in).

    memory per call = (peak RSS during the N calls - idle RSS with the engine loaded) / N
    first audio     = per caller turn, agent audio heard after the end of the caller's speech,
                      measured on the call's recording (it includes the wait for the VAD to
                      confirm the end of the turn and the oracle STT delay, like a real call;
                      the reply is made early, while the VAD makes sure)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def run_in_this_process(n_calls: int, max_reply_tokens: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from benchmarks.engines import tiny_engine
    from benchmarks.first_audio import run_sequential, tokenize_turn
    from pipecat_taste.session import GenerationSettings
    from taste_agents.caller import load_utterances
    from taste_agents.load import concurrent_calls, rss_mb
    from taste_agents.phone_agent import PhoneAgentConfig

    engine = tiny_engine()
    turn, _ = tokenize_turn(engine, load_utterances()["hello"])
    run_sequential(engine, GenerationSettings(max_reply_tokens=2), turn)  # warm-up
    idle = rss_mb()
    result = asyncio.run(concurrent_calls(engine, n_calls, config=PhoneAgentConfig(max_reply_tokens=max_reply_tokens),
                                          rounds=1, sample_interval_s=0.25))
    latencies = result.first_audio_ms
    turns = sum(len(c["turns"]) for c in result.calls)
    return {
        "calls": n_calls, "finished": len(result.calls), "crashes": result.crashes, "timed_out": result.timed_out,
        "audio_intact": result.audio_intact, "idle_rss_mb": idle, "peak_rss_mb": result.peak_rss_mb,
        "memory_per_call_mb": (result.peak_rss_mb - idle) / n_calls,
        "first_audio_ms": latencies, "turns": turns, "answered_turns": len(latencies),
        "first_audio_ms_median": float(np.median(latencies)) if latencies else None,
        "first_audio_ms_p90": float(np.percentile(latencies, 90)) if latencies else None,
        "first_audio_ms_max": float(max(latencies)) if latencies else None,
        "early_replies": sum(c["summary"].get("early_replies", 0) for c in result.calls),
        "early_turns_retracted": sum(c["summary"].get("early_turns_retracted", 0) for c in result.calls),
        "wall_s": result.wall_s, "rss_mb": result.rss_mb, "max_reply_tokens": max_reply_tokens,
    }


def measure(call_counts: list[int], out_dir: Path, *, max_reply_tokens: int = 8, threads: int = 2,
            log=print) -> list[dict]:
    """One subprocess per entry of ``call_counts``; returns their results in order."""
    rows = []
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugin"), str(ROOT / "agents"),
                                          os.environ.get("PYTHONPATH", "")])}
    for n in call_counts:
        out = Path(out_dir) / f"concurrency_{n}.json"
        cmd = [sys.executable, "-m", "benchmarks.concurrency", "--calls", str(n), "--json", str(out),
               "--max-reply-tokens", str(max_reply_tokens), "--threads", str(threads)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
        row = json.loads(out.read_text())
        rows.append(row)
        if log:
            log(f"{n} call(s): peak {row['peak_rss_mb']:.0f} MiB, idle {row['idle_rss_mb']:.0f} MiB, "
                f"{row['memory_per_call_mb']:.1f} MiB/call, first audio median {row['first_audio_ms_median']} ms, "
                f"crashes {len(row['crashes'])}, audio intact {row['audio_intact']}")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, required=True)
    parser.add_argument("--json", required=True, help="where to write the result")
    parser.add_argument("--max-reply-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    result = run_in_this_process(args.calls, args.max_reply_tokens, args.threads)
    Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
