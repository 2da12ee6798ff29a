"""Many calls at once on one engine: the load test, the long call and the concurrency benchmark.

    result = await concurrent_calls(engine, 8, duration_s=300)       # in process, 5 minutes
    result = await concurrent_webrtc_calls(engine, 8, out_dir, rounds=2)   # caller processes, loopback
    result.crashes, result.audio_intact, result.peak_rss_mb, result.rss_mb, result.first_audio_ms

Every call is a full simulated call (``taste_agents.simulate``): real-time audio both ways, the
scripted caller with its barge-in, a report per call. Calls start a little apart so that their
turns do not all end in the same 20 ms. The process's resident memory is sampled throughout, so
a leak shows as a slope, not only as a peak.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from taste_agents.caller import default_script
from taste_agents.memory import release_free_memory
from taste_agents.report import replies_with_audio, reply_audio_intact
from taste_agents.webrtc_caller import EXIT_CONNECTION_LOST, EXIT_TIMED_OUT


def rss_mb() -> float:
    """Resident memory of this process (Linux /proc; 0.0 where it is not available)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


class MemorySampler:
    """Samples this process's RSS every ``interval_s`` on its own thread (the event loop may be busy)."""

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []  # (seconds since start, MiB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._t0 = time.monotonic()

    def _run(self):
        while not self._stop.is_set():
            self.samples.append((round(time.monotonic() - self._t0, 2), round(rss_mb(), 1)))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.samples.append((round(time.monotonic() - self._t0, 2), round(rss_mb(), 1)))


class LoopLagMonitor:
    """How late the event loop runs its callbacks: a task asks to wake every ``interval_s`` and
    records by how much it oversleeps. Every call's audio, signalling and WebRTC traffic (ICE
    consent checks must be answered within 0.5 s) go through this loop, so its lag is what a
    loaded server does to its calls."""

    def __init__(self, interval_s: float = 0.05):
        self.interval_s = interval_s
        self.lags_ms: list[float] = []
        self._task: asyncio.Task | None = None

    async def _run(self):
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(self.interval_s)
            self.lags_ms.append(round(1000 * (loop.time() - asked - self.interval_s), 1))

    async def __aenter__(self) -> "LoopLagMonitor":
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc):
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass

    def summary(self) -> dict:
        lags = np.array(self.lags_ms or [0.0])
        return {"loop_lag_ms_p50": round(float(np.median(lags)), 1), "loop_lag_ms_p99": round(float(np.percentile(lags, 99)), 1),
                "loop_lag_ms_max": round(float(lags.max()), 1), "loop_lag_over_500ms": int((lags > 500).sum())}


@dataclass
class LoadResult:
    n_calls: int
    transport: str
    calls: list[dict] = field(default_factory=list)  # the report of every finished call
    crashes: list[str] = field(default_factory=list)  # calls that raised instead of finishing
    # replies whose audio the server lost or duplicated (WebRTC: checked on the server's call log,
    # which the callers' reports do not see)
    audio_problems: list[str] = field(default_factory=list)
    rss_mb: list[tuple[float, float]] = field(default_factory=list)
    baseline_rss_mb: float = 0.0  # before the calls (engine loaded, idle)
    wall_s: float = 0.0
    threads_before: int = 0
    threads_after: int = 0
    new_threads: list[str] = field(default_factory=list)  # names of threads alive after that were not before
    loop_lag: dict = field(default_factory=dict)  # LoopLagMonitor.summary() over the run
    compute_gate: dict | None = None  # the engine's ComputeGate.stats() after the run (None: no gate)

    @property
    def peak_rss_mb(self) -> float:
        return max((mb for _, mb in self.rss_mb), default=0.0)

    @property
    def first_audio_ms(self) -> list[float]:
        return [t["first_audio_latency_ms"] for c in self.calls for t in c["turns"]
                if t.get("first_audio_latency_ms") is not None]

    @property
    def audio_intact(self) -> bool:
        """No agent audio lost or duplicated in any call (synthesized == released == written)."""
        return not self.audio_problems and all(audio_intact(c) for c in self.calls)

    @property
    def timed_out(self) -> int:
        return sum(1 for c in self.calls if c.get("timed_out"))

    @property
    def connections_lost(self) -> int:
        """WebRTC calls whose peer connection failed before the script ended (e.g. a server too
        busy to answer ICE consent checks): dropped calls, not crashes."""
        return sum(1 for c in self.calls if c.get("connection_lost"))

    def memory_slope_mb_per_min(self, skip_s: float = 30.0) -> float:
        """Least-squares slope of RSS over time after a warm-up (a leak is a positive slope)."""
        points = [(t, mb) for t, mb in self.rss_mb if t >= skip_s] or self.rss_mb
        if len(points) < 3:
            return 0.0
        t, mb = np.array(points).T
        return float(np.polyfit(t / 60.0, mb, 1)[0])

    def summary(self) -> dict:
        latencies = self.first_audio_ms
        return {
            "transport": self.transport, "calls_at_once": self.n_calls, "calls_finished": len(self.calls),
            "crashes": len(self.crashes), "timed_out": self.timed_out,
            "connections_lost": self.connections_lost, "audio_intact": self.audio_intact,
            "wall_s": round(self.wall_s, 1), "baseline_rss_mb": round(self.baseline_rss_mb, 1),
            "peak_rss_mb": round(self.peak_rss_mb, 1),
            "memory_per_call_mb": round((self.peak_rss_mb - self.baseline_rss_mb) / max(1, self.n_calls), 1),
            "memory_slope_mb_per_min": round(self.memory_slope_mb_per_min(), 2),
            "first_audio_ms_median": float(np.median(latencies)) if latencies else None,
            "first_audio_ms_p90": float(np.percentile(latencies, 90)) if latencies else None,
            # WebRTC turns whose end the agent was still talking over (an earlier reply): not measured
            "turns_agent_busy_at_end": sum(1 for c in self.calls for t in c["turns"] if t.get("agent_busy_at_end")),
            **self.loop_lag, "compute_gate": self.compute_gate,
            "threads_before": self.threads_before, "threads_after": self.threads_after, "new_threads": self.new_threads,
        }


def audio_intact(report: dict) -> bool:
    checks = report["checks"]
    return bool(checks.get("released_equals_synthesized", True) and checks.get("written_equals_released", True)
                and checks.get("writes_never_overlap", True))


async def concurrent_calls(engine, n_calls: int, *, config=None, duration_s: float | None = None, rounds: int = 1,
                           script_factory: Callable[[], list] = default_script, stagger_s: float = 0.37,
                           max_call_s: float = 300.0, sample_interval_s: float = 1.0,
                           on_call: Callable[[int, dict], None] | None = None,
                           release_memory: Callable[[], object] | None = release_free_memory) -> LoadResult:
    """``n_calls`` in-process simulated calls at once. Each of the ``n_calls`` slots runs calls back
    to back: ``rounds`` of them, or until ``duration_s`` has passed (then the running call
    finishes). ``on_call(slot, report)`` is told of every finished call. ``release_memory`` runs
    on a thread after each call, as the server runs ``release_free_memory`` (None: nothing)."""
    from taste_agents.simulate import simulate_call

    result = LoadResult(n_calls, "in-process", baseline_rss_mb=rss_mb(), threads_before=threading.active_count())
    known_threads = {t.ident for t in threading.enumerate()}
    started = time.monotonic()

    async def slot(index: int):
        await asyncio.sleep(index * stagger_s)
        done = 0
        while True:
            if duration_s is not None:
                if time.monotonic() - started >= duration_s:
                    return
            elif done >= rounds:
                return
            try:
                call = await simulate_call(engine, script_factory(), config=config, max_call_s=max_call_s)
                result.calls.append(call.report)
                if on_call is not None:
                    on_call(index, call.report)
            except Exception as exc:  # a crash is what this run is looking for: count it, keep going
                result.crashes.append(f"slot {index}: {type(exc).__name__}: {exc}")
            call = None
            if release_memory is not None:
                await asyncio.to_thread(release_memory)  # as the server does when a call ends
            done += 1

    with MemorySampler(sample_interval_s) as memory:
        async with LoopLagMonitor() as lag:
            await asyncio.gather(*(slot(i) for i in range(n_calls)))
        await _threads_settle(result.threads_before)
    result.rss_mb, result.wall_s = memory.samples, time.monotonic() - started
    result.loop_lag, result.compute_gate = lag.summary(), _gate_stats(engine)
    result.threads_after = threading.active_count()
    result.new_threads = sorted(t.name for t in threading.enumerate() if t.ident not in known_threads)
    return result


async def concurrent_webrtc_calls(engine, n_calls: int, out_dir, *, config=None, rounds: int = 1,
                                  duration_s: float | None = None, reply_timeout_s: float = 20.0,
                                  max_call_s: float = 240.0, sample_interval_s: float = 1.0,
                                  on_call: Callable[[int, dict], None] | None = None,
                                  script: str = "default") -> LoadResult:
    """``n_calls`` scripted callers at once, each its own aiortc process, against one server on
    loopback; ``rounds`` rounds (or rounds until ``duration_s``); ``script``: what each caller says
    (``taste_agents.caller.SCRIPTS``). Each call is checked on both
    ends: the caller's recording (every turn answered) and the server's call log (the audio the
    agent released is exactly what it synthesized)."""
    from taste_agents.server import ServerConfig
    from taste_agents.webrtc_sim import running_server

    config = config or ServerConfig()
    # every call of a round is checked: the server must keep them all
    config = replace(config, max_calls=max(n_calls, config.max_calls), keep_call_audio=True,
                     keep_ended_calls=max(n_calls, config.keep_ended_calls))
    out = Path(out_dir)
    result = LoadResult(n_calls, "webrtc", baseline_rss_mb=rss_mb(), threads_before=threading.active_count())
    known_threads = {t.ident for t in threading.enumerate()}
    started = time.monotonic()
    with MemorySampler(sample_interval_s) as memory:
        async with LoopLagMonitor() as lag, running_server(engine, config) as (server, url):
            done = 0
            while (done < rounds) if duration_s is None else (time.monotonic() - started < duration_s):
                before = server.ended_count
                outs = [out / f"round{done}" / f"call{i}" for i in range(n_calls)]
                finished = await asyncio.gather(*(_run_caller(url, o, reply_timeout_s, max_call_s, i * 0.37, script)
                                                  for i, o in enumerate(outs)), return_exceptions=True)
                deadline = time.monotonic() + 15
                while server.calls and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                ended = server.ended[len(server.ended) - min(len(server.ended), server.ended_count - before):]
                for i, item in enumerate(finished):
                    if isinstance(item, BaseException):
                        result.crashes.append(f"round {done} caller {i}: {type(item).__name__}: {item}")
                        continue
                    result.calls.append(item)
                    if on_call is not None:
                        on_call(i, item)
                for call in ended:
                    for problem in server_call_audio_problems(call.log) if call.log is not None else []:
                        result.audio_problems.append(f"round {done}: call {call.call_id} lost or duplicated audio: "
                                                     f"{problem}")
                if server.calls:
                    result.crashes.append(f"round {done}: {len(server.calls)} calls still open after their peers left")
                done += 1
        await _threads_settle(result.threads_before)
    result.rss_mb, result.wall_s = memory.samples, time.monotonic() - started
    result.loop_lag, result.compute_gate = lag.summary(), _gate_stats(engine)
    result.threads_after = threading.active_count()
    result.new_threads = sorted(t.name for t in threading.enumerate() if t.ident not in known_threads)
    return result


def _gate_stats(engine) -> dict | None:
    gate = getattr(engine, "compute_gate", None)
    return gate.stats() if gate is not None else None


async def _run_caller(url: str, out: Path, reply_timeout_s: float, max_call_s: float, delay_s: float,
                      script: str = "default") -> dict:
    """One caller process; returns what the caller heard: per utterance, the first-audio latency
    (agent audio after the utterance's end, before the caller's next utterance)."""
    from taste_agents.report import first_active, last_active
    from taste_agents.webrtc_sim import caller_side_result

    await asyncio.sleep(delay_s)
    out.mkdir(parents=True, exist_ok=True)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "taste_agents.webrtc_caller", "--url", url, "--out", str(out), "--loopback",
        "--reply-timeout", str(reply_timeout_s), "--max-call-seconds", str(max_call_s), "--script", script,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), max_call_s + 120)
    finally:
        if proc.returncode is None:  # timed out or cancelled: no orphaned caller process
            proc.kill()
            await proc.wait()
    if proc.returncode not in (0, EXIT_TIMED_OUT, EXIT_CONNECTION_LOST):
        raise RuntimeError(f"caller exited with {proc.returncode}: {output.decode()[-1500:]}")
    call = caller_side_result(out)
    agent, sr = call.line.agent, call.line.sample_rate
    intervals = call.caller.speech_intervals
    bounds = [start for start, _, _ in intervals[1:]] + [agent.size]
    turns = []
    for (start, stop, name), next_start in zip(intervals, bounds):
        # The caller hears audio, not turns: audio going on as the utterance ends is an earlier
        # reply's tail (an overloaded agent), and what follows it cannot be told apart from this
        # turn's reply, so such a turn is not measured.
        busy = last_active(agent, max(start, stop - sr // 5), stop) is not None
        first = None if busy else first_active(agent, stop, next_start)
        turns.append({"utterance": name, "agent_busy_at_end": busy,
                      "first_audio_latency_ms": None if first is None else round(1000 * (first - stop) / sr, 1)})
    return {"transport": "webrtc", "connect_s": call.connect_s, "timed_out": call.timed_out,
            "connection_lost": proc.returncode == EXIT_CONNECTION_LOST, "turns": turns,
            # every turn the caller could measure was answered; the others are counted, not passed over
            "checks": {"every_turn_answered": all(t["first_audio_latency_ms"] is not None for t in turns
                                                  if not t["agent_busy_at_end"]),
                       "turns_not_measured": sum(1 for t in turns if t["agent_busy_at_end"])}}


def server_call_audio_problems(log) -> list[str]:
    """On the server: every reply's released audio is its synthesized audio, by the rule of
    ``report.reply_audio_intact``, with the playout's frame and fade lengths (``CallLog``). Returns
    what is wrong, per reply (empty: intact)."""
    problems = []
    if log.frame_samples is None:  # no playout ran: nothing was released
        return [f"turn {t}: synthesized, but no playout ran" for t in log.synthesized_audio if t in log.turns]
    for turn_id, record in replies_with_audio(log):
        synth = np.frombuffer(b"".join(log.synthesized_audio.get(turn_id, [])), dtype="<i2")
        released = np.frombuffer(b"".join(log.released_audio.get(turn_id, [])), dtype="<i2")
        ok, common = reply_audio_intact(synth, released, record, log.frame_samples, log.fade_samples)
        if not ok:
            problems.append(f"turn {turn_id}: synthesized {synth.size}, released {released.size}, identical prefix "
                            f"{common}, interrupted {record.interrupted}, hang-up {record.ended_by_hangup}")
    return problems


async def _threads_settle(threads_before: int, timeout_s: float = 10.0) -> None:
    """Worker threads of ended calls finish their last job in the background: give them a moment."""
    deadline = time.monotonic() + timeout_s
    while _call_threads() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


def _call_threads() -> list[str]:
    """Worker threads of calls (pipecat_taste.TasteCall names them taste-<stage>-<call id>)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("taste-")]


def write_load_report(result: LoadResult, path: str | Path) -> dict:
    summary = {**result.summary(), "rss_mb_over_time": result.rss_mb, "crash_messages": result.crashes,
               "audio_problems": result.audio_problems}
    Path(path).write_text(json.dumps(summary, indent=1))
    return summary
