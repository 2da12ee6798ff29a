"""The scripted caller as a real WebRTC peer (aiortc), talking to ``taste-agent serve``.

    python -m taste_agents.webrtc_caller --url http://127.0.0.1:7860 --out out/webrtc-call [--loopback]

It runs the same :class:`~taste_agents.caller.ScriptedCaller` as the in-process simulation, but
its audio goes out as an Opus track and the agent's comes back over the network. Everything is
measured where the caller is: ``caller_recording.wav`` (stereo: what the caller sent | what it
received, on the caller's sample clock) and ``caller.json`` (its events and speech intervals).
Transcripts of its own utterances go to the agent as data-channel messages (an oracle STT).

``--loopback`` restricts ICE to 127.0.0.1 (tests: aioice otherwise offers every other interface,
and without STUN nothing else is needed). Exit status: 0 the script ran to its end,
``EXIT_TIMED_OUT`` it ran past ``--max-call-seconds``, ``EXIT_CONNECTION_LOST`` the peer
connection failed or closed before the script ended, anything else: an error.
"""

from __future__ import annotations

import argparse
import asyncio
import fractions
import json
import time
from pathlib import Path

import numpy as np

SR = 16000
FRAME = SR // 50  # 20 ms
EXIT_TIMED_OUT, EXIT_CONNECTION_LOST = 3, 4


def use_loopback_only() -> None:
    """Make aioice offer only 127.0.0.1 (it skips loopback by default)."""
    import aioice.ice

    aioice.ice.get_host_addresses = lambda use_ipv4=True, use_ipv6=False: ["127.0.0.1"]


class CallerLine:
    """The caller's side of the call on its own sample clock (sample 0 = first frame sent)."""

    def __init__(self, caller, max_seconds: float):
        n = int(max_seconds * SR) + 3 * SR  # the tracks run on a little after the time limit
        self.caller = caller
        self.sent = np.zeros(n, np.int16)
        self.received = np.zeros(n, np.int16)
        self.rx_pos = 0  # where the next received agent sample goes
        self.t0: float | None = None
        self.transcripts: list[tuple[int, str]] = []

    def now_sample(self) -> int:
        return 0 if self.t0 is None else int((time.monotonic() - self.t0) * SR)

    def add_received(self, samples: np.ndarray) -> None:
        """Agent audio, placed where it arrived on the caller's clock (never overlapping)."""
        pos = max(self.rx_pos, self.now_sample())
        end = min(pos + samples.size, self.received.size)
        self.received[pos:end] = samples[: end - pos]
        self.rx_pos = pos + samples.size


def _caller_track(line: CallerLine, on_event):
    """An aiortc audio track that runs the caller's clock: one 20 ms frame per recv()."""
    from aiortc import MediaStreamTrack
    from av import AudioFrame

    from pipecat_taste.audio import float_to_int16

    class CallerTrack(MediaStreamTrack):
        kind = "audio"

        def __init__(self):
            super().__init__()
            self.k = 0
            self.seen = 0

        async def recv(self):
            if line.t0 is None:
                line.t0 = time.monotonic()
            due = line.t0 + (self.k + 1) * FRAME / SR  # sent once spoken, as the in-process line does
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            start = self.k * FRAME
            heard = line.received[max(0, start - FRAME):start].astype(np.float32) / 32768.0
            out = float_to_int16(line.caller.tick(heard))
            line.sent[start:start + FRAME] = out[: max(0, min(FRAME, line.sent.size - start))]
            for event in line.caller.events[self.seen:]:
                on_event(event)
            self.seen = len(line.caller.events)
            frame = AudioFrame.from_ndarray(out.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate = SR
            frame.pts = start
            frame.time_base = fractions.Fraction(1, SR)
            self.k += 1
            return frame

    return CallerTrack()


async def run_call(url: str, script: list, out_dir: str | Path, *, stt_delay_s: float = 0.3, tail_s: float = 1.5,
                   max_call_s: float = 240.0, connect_timeout_s: float = 20.0) -> dict:
    import aiohttp
    import soxr
    from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

    from taste_agents.caller import ScriptedCaller

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    caller = ScriptedCaller(script, sample_rate=SR)
    line = CallerLine(caller, max_call_s)
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))  # [] - never the default public STUN
    channel = pc.createDataChannel("messages")
    loop = asyncio.get_running_loop()
    received = {"frames": 0}
    tasks: list[asyncio.Task] = []

    def send_transcript(text: str):
        async def later():
            await asyncio.sleep(stt_delay_s)
            if channel.readyState == "open":
                channel.send(json.dumps({"type": "transcript", "text": text}))
        tasks.append(loop.create_task(later()))

    def on_event(event):
        if event.kind == "utterance_end":
            line.transcripts.append((event.sample, event.text))
            send_transcript(event.text)

    pc.addTrack(_caller_track(line, on_event))
    connected = asyncio.Event()

    lost = asyncio.Event()

    @pc.on("connectionstatechange")
    async def _state():
        if pc.connectionState == "connected":
            connected.set()
        elif pc.connectionState in ("failed", "closed"):
            lost.set()  # e.g. ICE consent checks unanswered: the call is over, say so at once

    @pc.on("track")
    def _track(track):
        async def pull():
            resampler = soxr.ResampleStream(48000, SR, 1, dtype="float32", quality="HQ")
            rate = None
            while True:
                try:
                    frame = await track.recv()
                except Exception:
                    return
                data = frame.to_ndarray().astype(np.float32) / 32768.0
                channels = len(frame.layout.channels)
                mono = data.reshape(-1, channels).mean(axis=1) if channels > 1 else data.reshape(-1)
                if rate != frame.sample_rate:
                    rate = frame.sample_rate
                    resampler = soxr.ResampleStream(rate, SR, 1, dtype="float32", quality="HQ")
                pcm = resampler.resample_chunk(mono)
                line.add_received(np.clip(np.rint(pcm * 32768), -32768, 32767).astype(np.int16))
                received["frames"] += 1
        tasks.append(loop.create_task(pull()))

    @channel.on("open")
    def _open():
        async def ping():
            while channel.readyState == "open":
                channel.send("ping")
                await asyncio.sleep(1.0)
        tasks.append(loop.create_task(ping()))

    await pc.setLocalDescription(await pc.createOffer())
    async with aiohttp.ClientSession() as http:
        async with http.post(url.rstrip("/") + "/api/offer",
                             json={"sdp": pc.localDescription.sdp, "type": pc.localDescription.type}) as res:
            answer = await res.json()
            if res.status != 200:
                raise RuntimeError(f"offer rejected: {res.status} {answer}")
    await pc.setRemoteDescription(RTCSessionDescription(answer["sdp"], answer["type"]))
    started = time.monotonic()
    # Connected, or failed (no need to wait out the timeout), or neither in time: a lost call
    # (EXIT_CONNECTION_LOST), not a crash.
    waits = [asyncio.ensure_future(connected.wait()), asyncio.ensure_future(lost.wait())]
    await asyncio.wait(waits, timeout=connect_timeout_s, return_when=asyncio.FIRST_COMPLETED)
    for waiting in waits:
        waiting.cancel()
    connect_s = time.monotonic() - started if connected.is_set() else None
    timed_out, connection_lost = False, not connected.is_set()
    while not caller.done and not connection_lost:
        await asyncio.sleep(0.05)
        if lost.is_set():
            connection_lost = True
            break
        if line.now_sample() / SR > max_call_s:
            timed_out = True
            break
    await asyncio.sleep(tail_s)
    end = line.now_sample()
    await pc.close()
    for task in tasks:
        task.cancel()
    result = {
        "sample_rate": SR, "duration_s": end / SR, "connect_s": None if connect_s is None else round(connect_s, 3),
        "timed_out": timed_out,
        "connection_lost": connection_lost,
        "pc_id": answer.get("pc_id"), "received_frames": received["frames"], "t0": line.t0,
        "speech_intervals": caller.speech_intervals,
        "events": [{"sample": e.sample, "kind": e.kind, "name": e.name, "text": e.text} for e in caller.events],
    }
    (out / "caller.json").write_text(json.dumps(result, indent=1))
    from taste_agents.report import write_wav

    write_wav(out / "caller_recording.wav", np.stack([line.sent[:end], line.received[:end]], axis=1), SR)
    return result


def main(argv=None) -> int:
    from taste_agents.caller import SCRIPTS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--loopback", action="store_true", help="ICE on 127.0.0.1 only")
    parser.add_argument("--reply-timeout", type=float, default=20.0)
    parser.add_argument("--max-call-seconds", type=float, default=240.0)
    parser.add_argument("--script", choices=sorted(SCRIPTS), default="default",
                        help="what the caller says: the default script, or its short core (a turn and a barge-in)")
    args = parser.parse_args(argv)
    if args.loopback:
        use_loopback_only()
    result = asyncio.run(run_call(args.url, SCRIPTS[args.script](reply_timeout_s=args.reply_timeout), args.out,
                                  max_call_s=args.max_call_seconds))
    print(json.dumps({k: result[k] for k in ("duration_s", "connect_s", "timed_out", "connection_lost", "received_frames")}))
    if result["connection_lost"]:
        return EXIT_CONNECTION_LOST
    return EXIT_TIMED_OUT if result["timed_out"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
