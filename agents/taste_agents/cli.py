"""``taste-agent``: run the TASTE voice agent.

    taste-agent call --simulate                      # scripted call on the embedded tiny checkpoint
    taste-agent call --simulate --model DIR_OR_HUB_ID --device cuda --dtype bfloat16
    taste-agent serve                                # live calls in the browser (see --help)

``call --simulate`` prints the call as it happens and writes ``recording.wav`` (stereo: caller |
agent), ``report.json`` and ``timeline.png`` into ``--out`` (default ``out/call-<id>``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time

from taste_agents.memory import configure_malloc


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint folder or hub id (default: the embedded tiny checkpoint, built on first use)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:0 or auto (default: cpu)")
    parser.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights of the Whisper tower and the Llama base, and of the built-in Whisper ASR "
                             "(default, or auto: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--decoding", default="auto", choices=["auto", "graphed", "eager"],
                        help="hot loops: auto (static caches and CUDA graphs on CUDA, eager on CPU), graphed, or "
                             "eager (the reference; for debugging on CUDA) - docs/GPU.md")
    parser.add_argument("--parallel-jobs", default="auto", type=auto_none_or_count,
                        help="model jobs of all calls running at once: a number, 'none' (no limit) or auto (the "
                             "CPU cores on a CPU, no limit on CUDA); the others queue, so the event loop stays "
                             "responsive under load")
    parser.add_argument("--threads-per-job", default="auto", type=auto_none_or_count,
                        help="torch's intra-op threads in each call's stage threads: a number, 'none' (torch's "
                             "setting) or auto (1 for a tiny checkpoint on a CPU: the simulated call's first audio "
                             "0.73x of torch's setting on 2 cores; torch's for the full size and on CUDA) - "
                             "BENCHMARKS.md section 12")
    parser.add_argument("--batch-slots", default="auto", type=auto_none_or_count,
                        help="calls whose spoken-LM and speech-decoder steps (and, on the static synthesis "
                             "path, flow and vocoder windows) run as batched steps: a number, "
                             "'none' (each call steps alone) or auto (none: on a GPU batching paid nothing "
                             "at 2-8 calls) - docs/GPU.md")
    parser.add_argument("--streams", default="auto", choices=["auto", "default", "synthesis", "calls"],
                        help="CUDA streams: auto (the default: synthesis on the CUDA fast path, default elsewhere; on "
                             "the H100 a whole reply took 0.096 s per audio second with synthesis against 0.106 with "
                             "default), default (one), synthesis (every call's flow and vocoder work on a stream of "
                             "its own beside the decoding, so that calls' token steps stop waiting for flow steps), "
                             "or calls (that, and each call's other work on a stream of the call's own) - "
                             "BENCHMARKS.md section 5, docs/GPU.md")
    parser.add_argument("--compile-flow", action="store_true",
                        help="run the flow's estimator through torch.compile inside the static synthesis path's steps "
                             "(CUDA, Triton needed, a minute or two more at start-up; compiled for one static shape "
                             "it took a flow step to 0.70-0.78 of its time on the H100, the engine's dynamic shapes "
                             "are not yet measured) - docs/GPU.md")
    parser.add_argument("--prompt-format", default="instruct", choices=["instruct", "continuation", "dialogue"],
                        help="how turns reach the LM (instruct: role labels, works with V0; dialogue needs a "
                             "fine-tuned checkpoint)")
    parser.add_argument("--max-reply-tokens", type=positive_int, default=None,
                        help="longest reply in LLM tokens (default: 6 on the embedded tiny checkpoint, 48 with --model)")
    parser.add_argument("--voice", default=None,
                        help="a recording of the agent's voice (WAV, FLAC, OGG or MP3), a few seconds of clean "
                             "speech (default: the checkpoint's default voice, or a synthetic placeholder: "
                             "docs/CHECKPOINTS.md)")
    parser.add_argument("--asr-model", default="auto",
                        help="Whisper folder or hub id for the built-in ASR (live calls need transcripts); 'none' to "
                             "rely on transcripts sent by the client or an upstream STT (default: auto - the Whisper "
                             "model the checkpoint names, openai/whisper-large-v3 for the published one; the random "
                             "tiny ASR for the embedded tiny checkpoint; none with --transcripts upstream, and "
                             "none for call --simulate --model ...: its scripted caller sends transcripts)")
    parser.add_argument("--transcripts", default="auto", choices=["auto", "asr", "upstream"],
                        help="where each turn's transcript comes from: auto (an upstream/client STT if one sends "
                             "it, else the built-in ASR), asr (always the built-in ASR) or upstream")
    parser.add_argument("--no-incremental-asr", action="store_true",
                        help="built-in ASR only at the end of each turn (default: also while the caller speaks)")
    parser.add_argument("--early-reply-ms", default=200, type=ms_or_none,
                        help="start answering after this much silence, before the VAD confirms the end of the "
                             "turn (its stop_secs, 500 ms); the reply is heard only once it does, and taken back "
                             "unheard if the caller goes on; 'none' waits for the VAD (default: 200)")
    parser.add_argument("--barge-in", default="pause", choices=["pause", "immediate"],
                        help="the caller speaking over a reply: pause (it stops at once and is cut off once the "
                             "speech has words; a noise without any lets it go on) or immediate (cut off at "
                             "once, noise or not) (default: pause)")
    parser.add_argument("--seed", type=seed_value, default=0)


def seed_value(text: str) -> int:
    """--seed: an integer that seeds torch's generators (GenerationSettings checks the same range)."""
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if not -2 ** 63 <= seed <= 2 ** 64 - 3:
        raise argparse.ArgumentTypeError(f"{seed} is outside [-2**63, 2**64 - 3] (torch seeds are 64-bit)")
    return seed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="taste-agent", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    call = commands.add_parser("call", help="run a call")
    call.set_defaults(command_parser=call)  # (argument errors found later print this command's usage)
    call.add_argument("--simulate", action="store_true",
                      help="a scripted caller talks to the agent in this process (no network)")
    call.add_argument("--out", default=None, help="output folder (default: out/call-{call_id}; {call_id} in it "
                                                  "stands for the first 8 characters of the call's id in its report, "
                                                  "the in-process call's with --webrtc)")
    call.add_argument("--max-call-seconds", type=simulated_call_seconds, default=300.0,
                      help=f"the simulated call's time limit (default: 300, at most {MAX_SIMULATED_CALL_S:.0f})")
    call.add_argument("--quiet", action="store_true", help="no progress lines")
    call.add_argument("--webrtc", action="store_true",
                      help="also run the call over real WebRTC (server here, caller in another process, loopback "
                           "only) and compare its latency with the in-process call")
    _add_model_args(call)
    serve = commands.add_parser("serve", help="serve live calls: a WebRTC page and a phone websocket")
    serve.set_defaults(command_parser=serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=port_number, default=7860, help="TCP port (default: 7860)")
    serve.add_argument("--max-calls", type=positive_int, default=4, help="concurrent calls; more get HTTP 503 (default: 4)")
    serve.add_argument("--max-call-seconds", type=positive_seconds, default=1800.0,
                       help="a call ends after this long (default: 1800)")
    serve.add_argument("--idle-seconds", type=positive_seconds, default=300.0,
                       help="a call ends after this long with nobody speaking (default: 300)")
    serve.add_argument("--ice-server", action="append", default=[], dest="ice_servers",
                       help="STUN/TURN URL for deployments behind NAT, e.g. stun:HOST:3478 or "
                            "turn:HOST:3478?transport=udp (repeatable; the page is given the same); none by default")
    serve.add_argument("--allowed-origin", action="append", default=[], dest="allowed_origins",
                       help="a web origin besides the server's own whose pages may use it, e.g. "
                            "https://app.example.com (repeatable; e.g. behind a proxy that rewrites Host)")
    serve.add_argument("--turn-username", default=None, help="the TURN servers' username")
    serve.add_argument("--turn-credential", default=os.environ.get("TASTE_TURN_CREDENTIAL"),
                       help="the TURN servers' credential (default: $TASTE_TURN_CREDENTIAL); the page is given "
                            "it too, so use short-lived credentials")
    serve.add_argument("--ssl-certfile", default=None,
                       help="serve HTTPS with this certificate (browsers allow the microphone only on HTTPS or "
                            "localhost: needed with --host other than 127.0.0.1)")
    serve.add_argument("--ssl-keyfile", default=None, help="the certificate's private key")
    _add_model_args(serve)
    return parser


def auto_none_or_count(value: str) -> int | str | None:
    """--parallel-jobs, --batch-slots, --threads-per-job: 'auto', 'none' or a number >= 1 (TasteEngine's settings)."""
    if value in ("auto", "none"):
        return None if value == "none" else "auto"
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be a number >= 1, 'none' or 'auto', got {value!r}")
    return int(value)


def positive_int(value: str) -> int:
    if not value.strip().isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {value!r}")
    return int(value)


def port_number(value: str) -> int:
    if not value.strip().isdigit() or not 1 <= int(value) <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port from 1 to 65535, got {value!r}")
    return int(value)


def positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:  # (NaN too)
        raise argparse.ArgumentTypeError(f"must be seconds > 0, got {value!r}")
    if not math.isfinite(seconds):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, got {value!r}")
    return seconds


# The simulated call's STT sends interim words this long into each utterance, as a streaming STT does
# (they also tell the agent from the first turn on that an STT is there).
SIMULATED_STT_INTERIM_S = 0.8
MAX_SIMULATED_CALL_S = 3600.0  # the simulated line records both ways for the whole limit, set aside at the start


def simulated_call_seconds(value: str) -> float:
    seconds = positive_seconds(value)
    if seconds > MAX_SIMULATED_CALL_S:
        raise argparse.ArgumentTypeError(f"at most {MAX_SIMULATED_CALL_S:.0f} s (the scripted call lasts some 30 s), "
                                         f"got {value!r}")
    return seconds


def ms_or_none(value) -> float | None:
    """--early-reply-ms: milliseconds > 0, or 'none'."""
    if value in (None, "none"):
        return None
    try:
        ms = float(value)
    except ValueError:
        ms = 0.0
    if not (math.isfinite(ms) and ms > 0):
        raise argparse.ArgumentTypeError(f"must be milliseconds > 0 or 'none', got {value!r}")
    return ms


def asr_choice(args) -> str | None:
    """The built-in ASR to load: --asr-model, where 'auto' means none when transcripts come from
    elsewhere - upstream only, or a simulated call with --model, whose scripted caller sends its own
    (its Whisper would only be downloaded and compete with the call; the embedded tiny checkpoint's
    random ASR is small: kept) - unless --transcripts asr asks for it."""
    transcripts = getattr(args, "transcripts", "auto")
    simulated = args.command == "call" and args.model is not None and transcripts != "asr"
    if args.asr_model == "none" or (args.asr_model == "auto" and (transcripts == "upstream" or simulated)):
        return None
    return args.asr_model


class StartupError(Exception):
    """What keeps the agent from starting (a checkpoint that cannot load, a port in use): ``main``
    prints it as one line, not a traceback."""


# The agent's packages beyond the model library: pipecat-taste[pipecat] installs them.
AGENT_MODULES = ("pipecat", "webrtcvad", "soundfile", "aiortc")


def _missing_agent_modules() -> list[str]:
    import importlib.util

    return [name for name in AGENT_MODULES if importlib.util.find_spec(name) is None]


def load_engine(args, say):
    from pipecat_taste.engine import TasteEngine
    from pipecat_taste.gc_pauses import freeze_startup_objects

    started = time.monotonic()
    label = args.model or "the embedded tiny checkpoint"
    if args.model is None:
        from taste_speech.tiny import default_tiny_checkpoint

        say("preparing the embedded tiny checkpoint (built once, then cached) ...")
        path = default_tiny_checkpoint()
    else:
        path = args.model
    say(f"loading {label} on {args.device} ...")
    try:
        engine = TasteEngine.from_pretrained(path, device=args.device, dtype=args.dtype, asr=asr_choice(args),
                                             decoding=getattr(args, "decoding", "auto"),
                                             parallel_jobs=getattr(args, "parallel_jobs", "auto"),
                                             threads_per_job=getattr(args, "threads_per_job", "auto"),
                                             batch_slots=getattr(args, "batch_slots", "auto"),
                                             streams=getattr(args, "streams", "auto"),
                                             compile_flow=getattr(args, "compile_flow", False))
    except (ValueError, OSError, RuntimeError) as e:  # (the messages name the problem and the fix)
        asr = "" if args.asr_model in ("auto", "none") else f" with --asr-model {args.asr_model!r}"
        raise StartupError(f"cannot load {label}{asr}: {e}") from e
    voice = None
    if getattr(args, "voice", None) is not None:  # before the warm-up: a voice this checkpoint refuses ends here
        from taste_agents.phone_agent import load_voice

        try:
            voice = load_voice(engine, args.voice)
        except ValueError as e:
            raise StartupError(f"--voice {args.voice!r}: {e} (without --voice the agent speaks in the "
                               "checkpoint's default voice)") from e
    # the fast path captures its shared synthesis graphs here, not in the first call, and an ASR
    # workspace for each call a server may hold at once; then one rehearsal turn runs every stage
    # once, so that the first caller does not pay for the first runs of their kernels
    calls = getattr(args, "max_calls", 1)
    try:
        rehearsal = engine.warm_up(calls=calls)
    except RuntimeError as e:  # (torch's OutOfMemoryError is one) the workspaces set aside for the calls
        if "out of memory" not in str(e).lower():
            raise
        raise StartupError(f"cannot warm up {label} for {calls} call(s) at once on {args.device}: {e}"
                           + ("; give fewer --max-calls" if calls > 1 else "")) from e
    freeze_startup_objects()  # a full garbage collection would otherwise stall every call (gc_pauses)
    rehearsed = "" if rehearsal is None or rehearsal.first_audio_s is None else \
        f" (a rehearsal turn: first audio {1000 * rehearsal.first_audio_s:.0f} ms)"
    say(f"model ready in {time.monotonic() - started:.1f} s{rehearsed}")
    return engine, path, voice


def agent_config(args):
    from pipecat_taste.capture import TurnCaptureParams
    from taste_agents.phone_agent import PhoneAgentConfig

    max_tokens = args.max_reply_tokens or (6 if args.model is None else 48)
    capture = TurnCaptureParams(transcripts=getattr(args, "transcripts", "auto"),
                                incremental_asr=not getattr(args, "no_incremental_asr", False),
                                early_reply_secs=_secs(getattr(args, "early_reply_ms", 200)),
                                barge_in=getattr(args, "barge_in", "pause"))
    return PhoneAgentConfig(prompt_format=args.prompt_format, max_reply_tokens=max_tokens, seed=args.seed,
                            voice=args.voice, capture=capture)


def _secs(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000.0


def simulated_call(args, engine=None, voice=None):
    """What ``taste-agent call --simulate`` does; returns the SimulatedCall (tests use this).
    ``engine`` and ``voice``: as ``load_engine`` made them (loaded here when not given)."""
    from taste_agents.caller import default_script
    from taste_agents.simulate import simulate_call

    if args.model is None and engine is None:  # the embedded tiny checkpoint needs no hub
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    say = (lambda m: None) if args.quiet else (lambda m: print(m, flush=True))
    if engine is None:
        engine, path, voice = load_engine(args, say)
    else:
        path = getattr(engine, "checkpoint_dir", "given engine")
    out = args.out or os.path.join("out", "call-{call_id}")  # (named once the call has its id)
    config = agent_config(args)
    meta = {"checkpoint": str(path), "device": str(getattr(engine, "device", args.device)),
            "dtype": _weights_dtype(engine, args.dtype),
            "prompt_format": config.prompt_format, "max_reply_tokens": config.max_reply_tokens}
    result = asyncio.run(simulate_call(engine, default_script(), config=config, progress=say, out_dir=out,
                                       stt_interim_after_s=SIMULATED_STT_INTERIM_S, max_call_s=args.max_call_seconds,
                                       meta=meta, voice=voice))
    if not args.quiet:
        print(_summary(result.report, result.paths), flush=True)
    return result


def _weights_dtype(engine, asked: str | None) -> str:
    """The spoken LM's weights' dtype as loaded (--dtype auto resolved), for the report."""
    llama = getattr(getattr(getattr(engine, "model", None), "spoken_lm", None), "language_model", None)
    dtype = getattr(llama, "dtype", None)
    return str(dtype).removeprefix("torch.") if dtype is not None else (asked or "auto")


def run_simulated_call(args) -> int:
    _quiet_logs()
    if args.webrtc:
        return run_webrtc_comparison(args)
    return _exit_status(_in_process_problems(simulated_call(args).report))


def _exit_status(problems: list[str]) -> int:
    """1 with the reasons on stderr (``--quiet`` too: an exit status alone says nothing), else 0."""
    if problems:
        print("the call failed its checks: " + "; ".join(problems), file=sys.stderr, flush=True)
    return 1 if problems else 0


def run_webrtc_comparison(args) -> int:
    """The same scripted call in process and over WebRTC, side by side (comparison.json)."""
    from taste_agents.server import ServerConfig
    from taste_agents.webrtc_sim import compare_with_in_process, webrtc_call

    say = (lambda m: None) if args.quiet else (lambda m: print(m, flush=True))
    engine, path, voice = load_engine(args, say)
    out = args.out or os.path.join("out", "call-{call_id}")
    args.out = os.path.join(out, "in_process")
    say("-- in-process call --")
    local = simulated_call(args, engine=engine, voice=voice)
    out = out.replace("{call_id}", (local.report.get("call_id") or "")[:8])  # (named after the in-process call)
    say("-- the same call over WebRTC (caller in another process, loopback) --")
    remote = asyncio.run(webrtc_call(engine, os.path.join(out, "webrtc"), config=ServerConfig(agent=agent_config(args)),
                                     max_call_s=args.max_call_seconds, meta={"checkpoint": str(path)},
                                     voice=voice))
    comparison = compare_with_in_process(remote.report, local.report)
    comparison["webrtc_connect_s"] = remote.connect_s
    comparison["webrtc_server_teardown_s"] = remote.report.get("server_teardown_s")
    with open(os.path.join(out, "comparison.json"), "w") as f:
        json.dump(comparison, f, indent=1)
    say(_summary(remote.report, remote.paths))
    say(f"\nfirst-audio latency, median: in process {comparison['median_in_process_ms']} ms, over WebRTC "
        f"{comparison['median_webrtc_ms']} ms -> WebRTC adds {comparison['webrtc_added_latency_ms']} ms "
        f"({os.path.join(out, 'comparison.json')})")
    problems = [f"in process: {p}" for p in _in_process_problems(local.report)]
    if not remote.report["checks"]["every_turn_decided"]:
        problems.append("over WebRTC: a turn of the caller got no decision")
    if remote.timed_out:
        problems.append("over WebRTC: the call ran past --max-call-seconds and was cut short")
    if remote.report["connection_lost"]:
        problems.append("over WebRTC: the connection was lost")
    return _exit_status(problems)


def _in_process_problems(report: dict) -> list[str]:
    """Every turn decided, the reply audio intact all the way to the line, in time: what failed."""
    checks, problems = report["checks"], []
    if report["timed_out"]:
        problems.append("the call ran past --max-call-seconds and was cut short")
    if not checks["every_turn_decided"]:
        problems.append("a turn of the caller got no decision")
    if not checks["released_equals_synthesized"]:
        problems.append("the playout released less audio than was synthesized")
    if not checks["written_equals_released"]:
        problems.append("the line got less audio than the playout released")
    return problems


def _summary(report: dict, paths: dict) -> str:
    from taste_agents.report import BARGE_IN_DETECT_BOUND_MS

    lines = ["", f"call {report.get('call_id')}: {report['duration_s']} s, {report['summary']['replies']} replies"
             + (" - cut short at --max-call-seconds" if report.get("timed_out") else "")
             + (" - stopped early" if report.get("stopped_early") else ""),
             "  (first audio: from the end of the caller's speech to the agent's first sound on the line; the live "
             "lines count from the end of the speech as the agent's VAD placed it, a little later)"]
    for turn in report["turns"]:
        line = f"  {turn['utterance']:8s} decision={turn['decision']}"
        if turn.get("first_audio_latency_ms") is not None:
            line += f"  first audio {turn['first_audio_latency_ms']:.0f} ms"
            if turn.get("start_hold_ms"):
                line += f" (held {turn['start_hold_ms']:.0f} ms)"
            if turn.get("early_by_ms"):
                line += f" (begun {turn['early_by_ms']:.0f} ms before the VAD's end)"
            line += f"  reply {turn.get('reply_duration_ms', 0):.0f} ms" + (" (cut off)" if turn.get("interrupted") else "")
        if turn.get("asr_after_end_ms") is not None:
            line += f"  ASR after end {turn['asr_after_end_ms']:.0f} ms ({turn['asr_partials']} partials)"
        if turn.get("barge_in") and turn.get("barge_in_stop_ms") is None:
            line += "  barge-in NOT detected"
        elif "barge_in_stop_ms" in turn:
            line += f"  barge-in stop {turn['barge_in_stop_ms']:.0f} ms"
            if turn.get("agent_side_barge_in_stop_ms") is not None:
                line += f" (agent side {turn['agent_side_barge_in_stop_ms']:.0f} ms)"
        lines.append(line)
    c = report["checks"]
    lines.append(f"  checks (the command fails if one is False): every turn decided={c['every_turn_decided']}, "
                 f"audio synthesized==released=={c.get('released_equals_synthesized', 'n/a')}, "
                 f"released==written=={c.get('written_equals_released', 'n/a')}")
    lines.append(f"  figures: talk-over outside barge-in={c['talk_over_ms_outside_barge_in']:.0f} ms"
                 + (", no barge-in to check" if c["barge_in_within_100ms"] is None else
                    f", barge-in<=100ms={c['barge_in_within_100ms']}"
                    f" (detected<={BARGE_IN_DETECT_BOUND_MS}ms={c[f'barge_in_detected_within_{BARGE_IN_DETECT_BOUND_MS}ms']})")
                 + (", barge-in as the caller heard it: the transport's buffering included" if "transport" in report
                    else ""))
    s = report["summary"]
    lines.append(f"  underruns: {s['underruns']}, errors: {s['errors']}, early replies: {s.get('early_replies', 0)}, "
                 f"early turns taken back (the caller went on): {s.get('early_turns_retracted', 0)}"
                 + (f", replies paused by a sound that was no turn, then resumed: {s['replies_resumed_after_no_turn']}"
                    if s.get("replies_resumed_after_no_turn") else "")
                 + (f", replies cut off by a sound that was no turn: {s['replies_cut_by_no_turn']}"
                    if s.get("replies_cut_by_no_turn") else "")
                 + (f", times the caller waited for a reply in vain: {s['caller_heard_no_reply']}"
                    if s.get("caller_heard_no_reply") else "")
                 + (f", hard cuts on the line (the event loop handed a frame over late: a loaded machine): "
                    f"{s['line_cuts']}" if s.get("line_cuts") else ""))
    for name, path in paths.items():
        lines.append(f"  {name}: {path}")
    return "\n".join(lines)


def _check_args(parser: argparse.ArgumentParser, args) -> None:
    """Files named on the command line and combinations of flags, checked before minutes of model
    loading."""
    for flag in ("voice", "ssl_certfile", "ssl_keyfile"):
        path = getattr(args, flag, None)
        if path is not None and not os.path.isfile(path):
            parser.error(f"--{flag.replace('_', '-')} {path!r}: no such file")
    if args.voice is not None:
        from taste_agents.caller import read_audio

        try:
            audio, rate = read_audio(args.voice)
        except ValueError as e:
            parser.error(f"--voice: {e}; give a recording of the voice (WAV, FLAC, OGG or MP3)")
        if audio.size / rate < 0.5:  # checked before the model loads; the speaker encoder refuses it too
            parser.error(f"--voice {args.voice!r}: {audio.size / rate:.2f} s of audio; give a few seconds of the voice")
        from taste_speech.processing_taste import MIN_SAMPLE_RATE, SILENCE_PEAK

        if rate < MIN_SAMPLE_RATE:
            parser.error(f"--voice {args.voice!r}: recorded at {rate} Hz, below {MIN_SAMPLE_RATE} Hz, too low for "
                         "speech; give a recording at 16000 Hz or more")
        peak = float(abs(audio).max())
        if not peak < float("inf"):  # (NaN too)
            parser.error(f"--voice {args.voice!r}: the recording has NaN or infinite samples")
        if peak < SILENCE_PEAK:
            parser.error(f"--voice {args.voice!r}: the recording is silent (peak {peak:.1e}); "
                         "give a few seconds of the voice speaking")
    if args.transcripts == "asr" and args.asr_model == "none":
        parser.error("--transcripts asr needs the built-in ASR: drop --asr-model none")
    if args.asr_model not in ("auto", "none"):
        from taste_speech.loading import looks_like_hub_id

        if not os.path.isdir(os.path.expanduser(args.asr_model)) and not looks_like_hub_id(args.asr_model):
            parser.error(f"--asr-model {args.asr_model!r}: no Whisper model there, neither a folder nor a hub id "
                         "(owner/name, e.g. openai/whisper-large-v3); --asr-model none for no built-in ASR "
                         "(transcripts from an upstream STT)")
    from taste_agents.phone_agent import PhoneAgentConfig

    stop_ms = 1000 * PhoneAgentConfig.vad_stop_secs
    if args.early_reply_ms is not None and args.early_reply_ms >= stop_ms:
        parser.error(f"--early-reply-ms {args.early_reply_ms:g} would never come before the VAD's end of the turn "
                     f"({stop_ms:g} ms of silence): give less, or 'none'")
    for origin in getattr(args, "allowed_origins", None) or ():
        if not origin.partition("://")[2]:
            parser.error(f"--allowed-origin {origin!r}: expected scheme://host[:port], e.g. https://app.example.com")
    turn_servers = [url for url in getattr(args, "ice_servers", None) or () if url.startswith(("turn:", "turns:"))]
    if getattr(args, "turn_username", None) and not turn_servers:
        parser.error("--turn-username without a turn: --ice-server does nothing; add the TURN server")
    if getattr(args, "ssl_keyfile", None) and not getattr(args, "ssl_certfile", None):
        parser.error("--ssl-keyfile needs its --ssl-certfile (a certfile may also hold the key)")
    if getattr(args, "ssl_certfile", None):
        import ssl

        try:  # as the server will load them, so that a mismatch shows now, not after the model loaded
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        except (ssl.SSLError, OSError) as e:
            parser.error(f"--ssl-certfile/--ssl-keyfile cannot be used: {e} (a PEM certificate and its own private "
                         "key; an encrypted key is not supported)")
    if getattr(args, "ice_servers", None):
        from taste_agents.server import ice_servers_from

        try:
            args.ice_servers = ice_servers_from(args.ice_servers, args.turn_username, args.turn_credential)
        except ValueError as e:
            parser.error(str(e))
    if args.command == "call" and not args.simulate:
        parser.error("call needs --simulate (live calls: taste-agent serve)")
    _check_out(parser, getattr(args, "out", None))


def _check_out(parser: argparse.ArgumentParser, out: str | None) -> None:
    """--out, made now (the last check: a refused command leaves no folder behind), not after the
    call: a folder that cannot be would lose its outputs. Of a name with {call_id}, the folder it
    goes in (the call's own is made once the call has its id)."""
    if out is None:
        return
    folder = (os.path.dirname(out.split("{call_id}")[0]) or ".") if "{call_id}" in out else out
    if os.path.exists(folder) and not os.path.isdir(folder):
        parser.error(f"--out {out!r}: {folder!r} is a file; give a folder (it is created if missing)")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        parser.error(f"--out {out!r}: cannot create the folder {folder!r} ({e.strerror})")
    if not os.access(folder, os.W_OK | os.X_OK):
        parser.error(f"--out {out!r}: the folder {folder!r} is not writable")


def _quiet_logs():
    """Pipecat logs every frame link at DEBUG; keep the console for the call itself."""
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level=os.environ.get("TASTE_AGENT_LOG_LEVEL", "WARNING"),
               filter=lambda record: record["message"] not in AUDIO_ONLY_NOISE | HANG_UP_NOISE)


# Pipecat's WebRTC transport looks for the caller's video at every connection and warns when an
# audio-only caller (every caller here) has none: not worth a line per call.
AUDIO_ONLY_NOISE = frozenset({"No video transceiver is available", "No screen video transceiver is available"})
# ... and warns when the caller's audio track ends, which is what every hang-up does (the call then
# ends on the peer's leaving, which the server logs).
HANG_UP_NOISE = frozenset({"Media stream error while reading the audio; clearing track."})


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if missing := _missing_agent_modules():
        parser.exit(2, f"taste-agent: the agent needs {', '.join(missing)}: pip install 'pipecat-taste[pipecat]' "
                       "(the model library alone, taste_speech, runs without them)\n")
    _quiet_logs()  # (before the checks: they import Pipecat, whose import logs a banner)
    _check_args(args.command_parser, args)
    configure_malloc()  # calls allocate and free all day from many threads: keep the resident size flat
    try:
        return _run(args)
    except StartupError as e:
        print(f"taste-agent: error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the server has ended its calls (uvicorn re-raises the signal)
        print("taste-agent: stopped", file=sys.stderr, flush=True)
        return 130


def _run(args) -> int:
    if args.command == "call":  # (with --simulate: _check_args said so)
        return run_simulated_call(args)
    if args.command == "serve":
        from taste_agents.server import serve

        if args.asr_model == "none" or args.transcripts == "upstream":
            print("taste-agent: no built-in ASR: a call is answered only when its client sends transcripts "
                  "({\"type\": \"transcript\", \"text\": ...} app messages); the bundled page and phone streams "
                  "send none", file=sys.stderr, flush=True)

        return serve(args)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
