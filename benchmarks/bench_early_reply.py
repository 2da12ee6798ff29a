"""Early replies vs waiting for the VAD: first audio of the scripted call, both ways in one run.

    python benchmarks/bench_early_reply.py                     # tiny checkpoint, 2 calls per way (~5 min)
    python benchmarks/bench_early_reply.py --repeats 3 --write  # also BENCHMARKS.md section 7

The VAD confirms the end of a caller's turn after ``stop_secs`` of silence (500 ms). *VAD end*
(``early_reply_secs=None``) starts the reply then; *early* (the default, 200 ms) hands the turn on
after 200 ms of silence, generates and synthesizes while the VAD makes sure, and plays once it
confirms; a pause shorter than the VAD's end takes the early turn back (counted below).

Each call is ``taste-agent call --simulate``'s: the scripted caller (4 utterances, one barge-in)
against the phone agent, real time, in process; the two ways alternate call by call on one engine,
each call starting with a fresh start-hold memory. Transcripts come from the simulated STT (the
caller's text, 300 ms after each utterance, as in the main job) or from the built-in ASR while the
caller speaks (``--transcripts asr``). First audio is measured on the recording, from the end of
the caller's speech to the agent's first sample.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "plugin", ROOT / "agents"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from benchmarks import report  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SECTION_NUMBER = "## 7. "
SECTION = SECTION_NUMBER + "Early replies: answering while the VAD makes sure the turn ended"
WAYS = {"VAD end": None, "early": 0.2}


def run_call(engine, early_reply_secs: float | None, transcripts: str, max_reply_tokens: int) -> dict:
    from pipecat_taste.capture import TurnCaptureParams
    from pipecat_taste.start_hold import StartNeeds
    from taste_agents.caller import default_script
    from taste_agents.phone_agent import PhoneAgentConfig
    from taste_agents.simulate import simulate_call

    engine.start_needs = StartNeeds()  # each call learns its own start hold: the ways do not share one
    config = PhoneAgentConfig(max_reply_tokens=max_reply_tokens,
                              capture=TurnCaptureParams(transcripts=transcripts, early_reply_secs=early_reply_secs))
    result = asyncio.run(simulate_call(engine, default_script(), config=config))
    s, checks = result.report["summary"], result.report["checks"]
    return {"first_audio_ms": s["first_audio_latency_ms"]["per_turn"], "utterances": s["utterances"],
            "replies": s["replies"], "underruns": s["underruns"], "errors": s["errors"],
            "early_replies": s["early_replies"], "early_turns_retracted": s["early_turns_retracted"],
            "audio_intact": bool(checks.get("released_equals_synthesized") and checks.get("written_equals_released")),
            "every_turn_decided": checks["every_turn_decided"], "timed_out": result.timed_out}


def measure(engine, *, repeats: int, transcripts: list[str], max_reply_tokens: int, say=print) -> list[dict]:
    rows = []
    run_call(engine, None, transcripts[0], max_reply_tokens)  # warm-up, not counted: first-call allocations
    for source in transcripts:
        calls = {way: [] for way in WAYS}
        for i in range(repeats):
            # alternating, in ABBA order: a slow spell of the machine, or a drift, hits both ways alike
            order = list(WAYS.items()) if i % 2 == 0 else list(reversed(WAYS.items()))
            for way, secs in order:
                call = run_call(engine, secs, source, max_reply_tokens)
                calls[way].append(call)
                say(f"{source} / {way} call {i + 1}: first audio {call['first_audio_ms']} ms, "
                    f"early turns taken back {call['early_turns_retracted']}, errors {call['errors']}")
        for way in WAYS:
            latencies = [ms for call in calls[way] for ms in call["first_audio_ms"]]
            rows.append({
                "transcripts": source, "way": way, "calls": len(calls[way]),
                "replies_heard": len(latencies), "utterances": sum(c["utterances"] for c in calls[way]),
                "first_audio_ms": latencies,
                "median_ms": statistics.median(latencies) if latencies else None,
                "min_ms": min(latencies, default=None), "max_ms": max(latencies, default=None),
                "underruns": sum(c["underruns"] for c in calls[way]),
                "early_replies": sum(c["early_replies"] for c in calls[way]),
                "early_turns_retracted": sum(c["early_turns_retracted"] for c in calls[way]),
                "errors": sum(c["errors"] for c in calls[way]),
                "intact": all(c["audio_intact"] and c["every_turn_decided"] and not c["timed_out"] for c in calls[way]),
            })
        base, early = rows[-2]["median_ms"], rows[-1]["median_ms"]
        rows[-1]["saved_ms"] = None if base is None or early is None else base - early
        rows[-1]["ratio"] = report.ratio(base, early)  # > 1: early is sooner
    return rows


SOURCES = {"auto": "simulated STT (+300 ms)", "asr": "built-in ASR (incremental)"}


def markdown(rows: list[dict]) -> list[str]:
    headers = ["transcripts", "way", "calls", "replies heard / utterances", "first audio median ms", "min ms",
               "max ms", "median saved ms", "VAD end / early", "underruns", "early replies",
               "early turns taken back", "errors", "audio intact, every turn decided"]
    body = [[SOURCES.get(r["transcripts"], r["transcripts"]), r["way"], r["calls"],
             f"{r['replies_heard']}/{r['utterances']}", r["median_ms"], r["min_ms"], r["max_ms"],
             r.get("saved_ms", "-"), f"{r['ratio']:.2f}x" if r.get("ratio") else "-", r["underruns"],
             r["early_replies"], r["early_turns_retracted"], r["errors"], "yes" if r["intact"] else "**no**"]
            for r in rows]
    return report.table(headers, body).split("\n")


def write_results(rows: list[dict], command: str, facts: dict, results_dir: Path = RESULTS) -> None:
    intro = ["# Early replies", "", __doc__.split("\n\n", 2)[2].strip().replace("``", "`"), "",
             "Each utterance's figure is one reply heard; the early turns taken back are the pauses inside an "
             "utterance (\"Great, thank you. Goodbye.\") that were longer than 200 ms and shorter than the VAD's "
             "end: the reply begun to them was dropped unheard and the whole utterance answered once.", ""]
    report.save_results(Path(results_dir), "early_reply", intro, markdown(rows), rows, command, facts)


def benchmarks_section(results_dir: Path = RESULTS) -> list[str]:
    """The last ``--write`` run as a section of BENCHMARKS.md ([] before the first)."""
    return report.saved_section(SECTION, Path(results_dir) / "early_reply.md")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint folder or hub id (default: the embedded tiny one)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=2, help="calls per way and transcript source")
    parser.add_argument("--transcripts", default="auto,asr",
                        help="comma list: auto (the simulated STT) and/or asr (the built-in ASR)")
    parser.add_argument("--write", action="store_true",
                        help="save to benchmarks/results/early_reply.md and update BENCHMARKS.md section 7")
    args = parser.parse_args(argv)
    from pipecat_taste.engine import TasteEngine
    from taste_agents.cli import _quiet_logs
    from taste_speech.tiny import default_tiny_checkpoint

    _quiet_logs()
    engine = TasteEngine.from_pretrained(args.model or default_tiny_checkpoint(), device=args.device)
    engine.warm_up()
    rows = measure(engine, repeats=args.repeats, transcripts=args.transcripts.split(","),
                   max_reply_tokens=6 if args.model is None else 48)
    print("\n".join(markdown(rows)))
    if args.write:
        command = "python benchmarks/bench_early_reply.py " + shlex.join(argv if argv is not None else sys.argv[1:])
        write_results(rows, command.strip(), report.machine_facts(args.device))
        report.replace_section(ROOT / "BENCHMARKS.md", SECTION_NUMBER, benchmarks_section())
    return 0


if __name__ == "__main__":
    sys.exit(main())
