"""Simulated calls over real WebRTC: ``taste-agent serve`` in this process, the scripted caller in
another (``python -m taste_agents.webrtc_caller``), both on loopback.

The report is measured on the caller's own recording (what it sent | what it received), on the
same monotonic clock as the server's call log, and is directly comparable with the in-process
simulated call of the same script: ``compare_with_in_process`` puts the two side by side and gives
the latency WebRTC adds (Opus, jitter buffer, transport chunking).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import wave
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from taste_agents.caller import CallerEvent
from taste_agents.report import build_report, plot_timeline
from taste_agents.server import MAX_WEBSOCKET_MESSAGE_BYTES, ServerConfig, TasteServer
from taste_agents.webrtc_caller import EXIT_CONNECTION_LOST, EXIT_TIMED_OUT

SR = 16000


@asynccontextmanager
async def running_server(engine, config: ServerConfig | None = None, loopback: bool = True, voice=None):
    """A TasteServer on 127.0.0.1 and a free port (yields (server, base_url)); ICE on loopback only."""
    import aioice.ice
    import uvicorn

    original = aioice.ice.get_host_addresses
    if loopback:
        aioice.ice.get_host_addresses = lambda use_ipv4=True, use_ipv6=False: ["127.0.0.1"]
    config = config or ServerConfig()
    server = TasteServer(engine, config, voice=voice)
    uv = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                                       ws_max_size=MAX_WEBSOCKET_MESSAGE_BYTES))
    task = asyncio.create_task(uv.serve())
    try:
        for _ in range(200):
            if uv.started:
                break
            await asyncio.sleep(0.05)
        if not uv.started:
            raise RuntimeError("the server did not start")
        port = uv.servers[0].sockets[0].getsockname()[1]
        yield server, f"http://127.0.0.1:{port}"
    finally:
        await server.close()
        uv.should_exit = True
        try:
            await asyncio.wait_for(task, 10)
        except asyncio.TimeoutError:
            task.cancel()
        aioice.ice.get_host_addresses = original


@dataclass
class _CallerSide:
    speech_intervals: list
    events: list
    clock: int


@dataclass
class _Line:
    """The caller's recording, shaped like SimulatedLine for the report."""

    caller: np.ndarray
    agent: np.ndarray
    t0: float
    sample_rate: int = SR
    frame_samples: int = SR // 50
    writes: None = None

    @property
    def play_sample(self) -> int:
        return self.agent.size

    def sample_of(self, t):
        return None if t is None else int(round((t - self.t0) * self.sample_rate))


@dataclass
class WebRTCCall:
    line: _Line
    caller: _CallerSide
    log: object
    errors: list
    metrics: list
    duration_s: float
    timed_out: bool
    connect_s: float
    report: dict = field(default_factory=dict)
    paths: dict = field(default_factory=dict)

    @property
    def recording(self) -> np.ndarray:
        return np.stack([self.line.caller, self.line.agent], axis=1)


async def webrtc_call(engine, out_dir, *, config: ServerConfig | None = None, reply_timeout_s: float = 20.0,
                      max_call_s: float = 240.0, timeout_s: float = 400.0, meta: dict | None = None,
                      voice=None) -> WebRTCCall:
    """Serve, run the caller process against the server, and build the caller-side report
    (``voice``: the agent's speaker embedding if made already, as for ``TasteServer``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    async with running_server(engine, config, voice=voice) as (server, url):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "taste_agents.webrtc_caller", "--url", url, "--out", str(out), "--loopback",
            "--reply-timeout", str(reply_timeout_s), "--max-call-seconds", str(max_call_s),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env)
        try:
            output, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            raise RuntimeError("the WebRTC caller did not finish in time")
        except asyncio.CancelledError:  # stopped (Ctrl-C): the caller process goes with us
            await _end_process(proc)
            raise
        if proc.returncode not in (0, EXIT_TIMED_OUT, EXIT_CONNECTION_LOST):  # (those two are reported)
            raise RuntimeError(f"the WebRTC caller failed ({proc.returncode}):\n{output.decode()[-3000:]}")
        # The peer closed: the server's pipeline must end on its own within a couple of seconds.
        closed_at = time.monotonic()
        while server.calls and time.monotonic() - closed_at < 10:
            await asyncio.sleep(0.05)
        teardown_s = time.monotonic() - closed_at
        ended = server.ended[-1] if server.ended else None
        if ended is None:  # (a caller that never connected: no call of the server's to report on)
            raise RuntimeError(f"the WebRTC call never ended on the server (caller exit {proc.returncode}):\n"
                               f"{output.decode()[-3000:]}")
    result = caller_side_result(out)
    result.log = ended.log
    result.report = build_report(result, {"transport": "webrtc (aiortc caller process, loopback)",
                                          "call_id": ended.call_id,
                                          "connect_s": result.connect_s, "server_teardown_s": round(teardown_s, 2),
                                          "connection_lost": proc.returncode == EXIT_CONNECTION_LOST,
                                          **(meta or {})})
    result.report["checks"]["server_call_ended"] = not server.calls
    paths = {"recording": out / "caller_recording.wav", "report": out / "report.json", "timeline": out / "timeline.png"}
    paths["report"].write_text(json.dumps(result.report, indent=1, default=str))
    plot_timeline(result.report, result.recording, SR, paths["timeline"])
    result.paths = {k: str(v) for k, v in paths.items()}
    return result


async def _end_process(proc, grace_s: float = 5.0):
    if proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()


def caller_side_result(out: Path) -> WebRTCCall:
    """What a caller process left in ``out`` (caller.json, caller_recording.wav), shaped for
    ``report.build_report`` (no server call log: the report is the caller's view)."""
    info = json.loads((Path(out) / "caller.json").read_text())
    with wave.open(str(Path(out) / "caller_recording.wav"), "rb") as f:
        stereo = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2").reshape(-1, 2)
    caller = _CallerSide([tuple(x) for x in info["speech_intervals"]],
                         [CallerEvent(e["sample"], e["kind"], e["name"], e["text"]) for e in info["events"]],
                         stereo.shape[0])
    line = _Line(stereo[:, 0].copy(), stereo[:, 1].copy(), info["t0"])
    return WebRTCCall(line, caller, None, [], [], info["duration_s"], info["timed_out"], info["connect_s"])


def compare_with_in_process(webrtc_report: dict, in_process_report: dict) -> dict:
    """Per-utterance first-audio latency over WebRTC vs in process, and the median difference."""
    rows = []
    for a, b in zip(webrtc_report["turns"], in_process_report["turns"]):
        rows.append({"utterance": a["utterance"], "webrtc_ms": a.get("first_audio_latency_ms"),
                     "in_process_ms": b.get("first_audio_latency_ms"),
                     "webrtc_barge_in_stop_ms": a.get("barge_in_stop_ms"),
                     "in_process_barge_in_stop_ms": b.get("barge_in_stop_ms")})
    w = [r["webrtc_ms"] for r in rows if r["webrtc_ms"] is not None]
    i = [r["in_process_ms"] for r in rows if r["in_process_ms"] is not None]
    median = lambda values: round(float(np.median(values)), 1) if values else None  # noqa: E731
    added = round(median(w) - median(i), 1) if w and i else None
    return {"per_utterance": rows, "median_webrtc_ms": median(w), "median_in_process_ms": median(i),
            "webrtc_added_latency_ms": added}
