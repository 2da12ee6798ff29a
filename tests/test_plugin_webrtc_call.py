"""The simulated-call scenario over real WebRTC: the server in this process, the scripted caller
as a separate aiortc peer process, loopback only. Measured where the caller is, and compared with
the same call in process (the latency WebRTC adds)."""

import asyncio
import time

import numpy as np
import pytest

from pipecat_taste.testing import FakeEngine
from taste_agents.caller import default_script
from taste_agents.phone_agent import PhoneAgentConfig
from taste_agents.server import ServerConfig
from taste_agents.simulate import simulate_call
from taste_agents.webrtc_sim import compare_with_in_process, webrtc_call

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # a caller process encoding Opus in real time


def engine():
    # 12 words = a 2.4 s reply: long enough to be barged into across the network's delay
    return FakeEngine(reply_words=tuple(f"w{i}" for i in range(12)))


async def test_scripted_call_over_webrtc_and_what_webrtc_adds(tmp_path):
    # the two calls at once (each mostly waits on its real-time script; the fake engine costs nothing)
    remote, local = await asyncio.gather(
        webrtc_call(engine(), tmp_path / "webrtc", config=ServerConfig(agent=PhoneAgentConfig()),
                    reply_timeout_s=8, max_call_s=90, timeout_s=150),
        simulate_call(engine(), default_script(reply_timeout_s=8), config=PhoneAgentConfig(),
                      out_dir=tmp_path / "in_process"))
    report = remote.report
    assert not remote.timed_out and remote.connect_s < 5
    assert [t["decision"] for t in report["turns"]] == ["reply"] * 4
    assert report["checks"]["every_turn_decided"]
    assert report["checks"]["talk_over_ms_outside_barge_in"] == 0
    assert report["checks"]["server_call_ended"] and report["server_teardown_s"] < 2.0
    barge = next(t for t in report["turns"] if t["barge_in"])
    assert barge.get("cut_off_turn") is not None, barge  # the agent noticed the barge-in
    assert barge["agent_side_barge_in_stop_ms"] <= 100  # the agent stopped sending within 100 ms
    # at the caller the audio already on its way (network, jitter buffer) still plays out
    assert barge["barge_in_stop_ms"] < 600
    for turn in report["turns"]:
        assert turn["first_audio_latency_ms"] is not None and turn["reply_duration_ms"] > 300

    comparison = compare_with_in_process(report, local.report)
    added = comparison["webrtc_added_latency_ms"]
    assert added is not None and 0 < added < 1000, comparison
    print("WebRTC vs in process:", comparison)


async def test_a_peer_that_never_connects_is_a_lost_call_not_a_crash(tmp_path):
    """The server answers the offer and then goes away: the scripted caller gives up after its
    connect timeout and reports the call as lost (the load test counts it as a dropped call); it
    raised TimeoutError before, which the load test counted as a crash."""
    import time

    from aiohttp import web
    from aiortc import RTCPeerConnection, RTCSessionDescription

    from taste_agents.webrtc_caller import run_call

    async def answer_then_vanish(request):
        offer = await request.json()
        pc = RTCPeerConnection()
        await pc.setRemoteDescription(RTCSessionDescription(offer["sdp"], offer["type"]))
        await pc.setLocalDescription(await pc.createAnswer())
        answer = {"sdp": pc.localDescription.sdp, "type": pc.localDescription.type, "pc_id": "gone"}
        await pc.close()
        return web.json_response(answer)

    app = web.Application()
    app.router.add_post("/api/offer", answer_then_vanish)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        started = time.monotonic()
        result = await run_call(f"http://127.0.0.1:{port}", default_script(), tmp_path / "caller",
                                tail_s=0.1, connect_timeout_s=3)
        assert time.monotonic() - started < 10
    finally:
        await runner.cleanup()
    assert result["connection_lost"] and result["connect_s"] is None and not result["timed_out"]
    assert (tmp_path / "caller" / "caller.json").is_file()


async def test_the_webrtc_caller_sends_each_frame_once_it_is_spoken():
    """As the in-process line does: the frame holding the end of an utterance leaves when the caller's
    recording says the utterance ended (it left a frame, 20 ms, earlier: WebRTC latencies read short)."""
    from taste_agents.caller import Say, ScriptedCaller, Utterance
    from taste_agents.webrtc_caller import FRAME, SR, CallerLine, _caller_track

    caller = ScriptedCaller([Say(Utterance("u", "", np.full(3 * FRAME, 0.3, np.float32)))])
    line = CallerLine(caller, 2.0)
    track = _caller_track(line, lambda event: None)
    sent_at = []
    for _ in range(5):
        await track.recv()
        sent_at.append(time.monotonic() - line.t0)
    stop = next(e.sample for e in caller.events if e.kind == "utterance_end")
    last = stop // FRAME - 1  # the frame holding the last samples of the utterance
    assert sent_at[last] >= stop / SR - 0.002, (sent_at, stop)
