"""``taste-agent serve`` on loopback: signalling hardening and limits, WebRTC calls that let go of
their resources, and the Twilio-style phone websocket (8 kHz mu-law, ``clear`` on barge-in,
``stop`` ends the call). Every network wait has a timeout; ICE is restricted to 127.0.0.1 and no
STUN server is configured."""

import asyncio
import base64
import gc
import json
import os
import threading
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from pipecat_taste.call import TasteCall
from pipecat_taste.testing import FakeEngine
from taste_agents.caller import load_utterances
from taste_agents.phone_agent import PhoneAgentConfig
from taste_agents.server import ActiveCall, ServerConfig, TasteServer
from taste_agents.webrtc_sim import running_server

pytestmark = pytest.mark.slow

TIMEOUT = aiohttp.ClientTimeout(total=20)


def config(**kw):
    agent = kw.pop("agent", PhoneAgentConfig())
    return ServerConfig(agent=agent, **kw)


async def post(url, body, method="POST", headers=None):
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
        async with http.request(method, url, data=body, headers=headers or {"Content-Type": "application/json"}) as res:
            text = await res.text()
            return res.status, (json.loads(text) if text.startswith("{") else text), res.headers


async def make_offer():
    """An aiortc peer with a microphone-like track and its offer, not yet sent."""
    from aiortc import RTCConfiguration, RTCPeerConnection
    from aiortc.mediastreams import AudioStreamTrack

    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    channel, pc.messages = pc.createDataChannel("messages"), []  # (what the server sent the page)
    channel.on("message", lambda message: pc.messages.append(json.loads(message)))
    pc.addTrack(AudioStreamTrack())
    await pc.setLocalDescription(await pc.createOffer())
    return pc, {"sdp": pc.localDescription.sdp, "type": "offer"}


async def open_peer(url):
    """An aiortc peer sending silence; returns (pc, answer) once connected."""
    from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
    from aiortc.mediastreams import AudioStreamTrack

    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    channel, pc.messages = pc.createDataChannel("messages"), []  # (what the server sent the page)
    channel.on("message", lambda message: pc.messages.append(json.loads(message)))
    pc.addTrack(AudioStreamTrack())
    connected = asyncio.Event()

    @pc.on("connectionstatechange")
    async def _state():
        if pc.connectionState == "connected":
            connected.set()

    await pc.setLocalDescription(await pc.createOffer())
    status, answer, _ = await post(url + "/api/offer", json.dumps({"sdp": pc.localDescription.sdp, "type": "offer"}))
    if status != 200:
        await pc.close()
        return None, (status, answer)
    await pc.setRemoteDescription(RTCSessionDescription(answer["sdp"], answer["type"]))
    await asyncio.wait_for(connected.wait(), 15)
    return pc, answer


async def test_signalling_rejects_bad_requests_with_a_message():
    async with running_server(FakeEngine(), config(max_body_bytes=4096)) as (server, url):
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            async with http.get(url + "/") as res:
                assert res.status == 200 and "TASTE voice agent" in await res.text()
        cases = [
            (b"{not json", 400, "malformed JSON"),
            (b"[" * 4000, 400, "malformed JSON"),  # nested too deep for the parser (was a 500)
            (b"[1, 2]", 400, "JSON object"),
            (json.dumps({"type": "offer"}).encode(), 400, "'sdp'"),
            (json.dumps({"sdp": "v=0\r\n", "type": "answer"}).encode(), 400, "'type'"),
            (json.dumps({"sdp": "v=0\r\nthis is not sdp\r\n", "type": "offer"}).encode(), 400, "m=audio"),
            (json.dumps({"sdp": "v=0\r\nm=audio x y z\r\n", "type": "offer"}).encode(), 400, "offer"),
            (json.dumps({"sdp": "v=0\r\nm=audio 9 UDP 0\r\na=fingerprint:x\r\na=ice-ufrag:x\r\na=ice-pwd:x\r\n",
                         "type": "offer"}).encode(), 400, "the SDP offer could not be used (ValueError: "),
            (json.dumps({"sdp": "v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\n", "type": "offer", "pc_id": "nope"}).encode(),
             404, "pc_id"),
            # video before the microphone: Pipecat reads the caller's audio from the first transceiver
            (json.dumps({"sdp": "v=0\r\nm=video 9 UDP/TLS/RTP/SAVPF 96\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\n",
                         "type": "offer"}).encode(), 400, "first media section is 'm=video'"),
            (json.dumps({"sdp": "v=0" + "x" * 5000, "type": "offer"}).encode(), 413, "larger than"),
        ]
        for body, status, words in cases:
            got, answer, _ = await post(url + "/api/offer", body)
            assert got == status and words in answer["error"], (body[:40], got, answer)
        got, answer, _ = await post(url + "/api/offer", b'{"pc_id": 1}', method="PATCH")
        assert got == 400
        got, answer, _ = await post(url + "/api/offer", json.dumps({"pc_id": "x", "candidates": []}), method="PATCH")
        assert got == 404
        assert not server.calls


async def test_answers_offer_loopback_only_and_limits_concurrent_calls():
    from pipecat_taste.compute import ComputeGate

    engine = FakeEngine()
    engine.compute_gate = ComputeGate(2)
    async with running_server(engine, config(max_calls=1)) as (server, url):
        pc, answer = await open_peer(url)
        try:
            assert pc is not None, answer
            candidates = [l for l in answer["sdp"].splitlines() if l.startswith("a=candidate")]
            assert candidates and all(" 127.0.0.1 " in c for c in candidates)  # no other interface, no STUN
            assert server._handler._ice_servers is None
            status, body, headers = await post(url + "/api/offer", json.dumps({"sdp": pc.localDescription.sdp,
                                                                              "type": "offer"}))
            assert status == 503 and "limit" in body["error"] and headers.get("Retry-After")
            async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
                async with http.get(url + "/api/status") as res:
                    status = await res.json()
                    assert status["active_calls"] == 1
                    assert status["compute_gate"]["slots"] == 2 and status["compute_gate"]["queued"] == 0
                    assert status["lm_batch"] is status["speech_batch"] is status["synthesis_batch"] is None  # a CPU: no batching
        finally:
            if pc is not None:
                await pc.close()


def _resources():
    import gc

    gc.collect()
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count(),
            "tasks": len(asyncio.all_tasks())}


async def test_calls_end_when_the_peer_leaves_and_resources_come_back():
    async with running_server(FakeEngine(), config()) as (server, url):
        baseline, ends = None, []
        for cycle in range(5):
            pc, answer = await open_peer(url)
            assert pc is not None, answer
            await asyncio.sleep(0.5)
            assert len(server.calls) == 1
            await pc.close()
            closed = time.monotonic()
            while server.calls and time.monotonic() - closed < 10:
                await asyncio.sleep(0.02)
            ends.append(time.monotonic() - closed)
            await asyncio.sleep(0.5)  # let aiortc's transports and the stage threads wind down
            if cycle == 0:
                baseline = _resources()  # after one call: lazily created pools exist from here on
        # (a leak stays; a busy machine only winds the last call's threads down later)
        deadline = time.monotonic() + 5.0
        while True:
            after = _resources()
            settled = after["fds"] <= baseline["fds"] + 2 and after["threads"] <= baseline["threads"] + 1 \
                and after["tasks"] <= baseline["tasks"] + 2
            if settled or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert max(ends) < 10, ends  # every pipeline ended once its peer closed ...
        assert [f["ended_because"] for f in server.finished] == ["the peer left"] * 5  # ... because it did
        assert after["fds"] <= baseline["fds"] + 2, (baseline, after)
        assert after["threads"] <= baseline["threads"] + 1, (baseline, after)
        assert after["tasks"] <= baseline["tasks"] + 2, (baseline, after)
        assert len(server.ended) == 5 and len({c.call_id for c in server.ended}) == 5


async def wait_until(condition, timeout_s):
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return condition()


async def test_offers_arriving_together_cannot_pass_the_call_limit_together():
    async with running_server(FakeEngine(), config(max_calls=2)) as (server, url):
        peers = [await make_offer() for _ in range(5)]
        try:
            results = await asyncio.gather(*(post(url + "/api/offer", json.dumps(offer)) for _, offer in peers))
            statuses = sorted(status for status, _, _ in results)
            assert statuses == [200, 200, 503, 503, 503], [(s, b) for s, b, _ in results]
            assert len(server.calls) == 2 and server.calls_in_use == 2
        finally:
            for pc, _ in peers:
                await pc.close()


async def test_a_peer_that_never_connects_gives_its_slot_back():
    """An answered offer whose peer never completes ICE (no candidates ever sent): the call ends
    at connect_seconds, not at the idle timeout, and its peer connection is let go."""
    async with running_server(FakeEngine(), config(max_calls=1, connect_seconds=1.5)) as (server, url):
        pc, offer = await make_offer()
        try:
            status, _, _ = await post(url + "/api/offer", json.dumps(offer))  # answer never applied
            assert status == 200 and len(server.calls) == 1
            status, body, _ = await post(url + "/api/offer", json.dumps((await make_offer())[1]))
            assert status == 503, body
            assert await wait_until(lambda: not server.calls, 6), "the slot was not given back"
            assert "did not connect within 1.5 s" in server.finished[-1]["ended_because"]
            assert not server._handler._pcs_map
        finally:
            await pc.close()
        pc, answer = await open_peer(url)  # the slot is free again
        assert pc is not None, answer
        await pc.close()


async def test_a_peer_that_never_connects_ends_at_the_call_limit_when_that_comes_first():
    async with running_server(FakeEngine(), config(connect_seconds=6.0, max_call_seconds=1.5)) as (server, url):
        pc, offer = await make_offer()
        try:
            status, _, _ = await post(url + "/api/offer", json.dumps(offer))  # answer never applied
            assert status == 200 and len(server.calls) == 1
            assert await wait_until(lambda: not server.calls, 4), "the call outlived its limit"
            assert "limit of 1.5 s" in server.finished[-1]["ended_because"]
        finally:
            await pc.close()


async def test_a_call_ends_at_its_time_limit_even_while_talking():
    async with running_server(FakeEngine(), config(max_call_seconds=2.0)) as (server, url):
        pc, answer = await open_peer(url)
        assert pc is not None, answer
        try:
            assert await wait_until(lambda: not server.calls, 20)
            # ended by the limit, which counts from the offer (connecting included: the caller's own
            # clock, started before its ICE gathering, is not the server's)
            assert "limit of 2 s" in server.finished[-1]["ended_because"]
            assert server.finished[-1]["seconds"] >= 1.9
            assert await wait_until(lambda: pc.connectionState == "closed", 5), pc.connectionState  # the peer is told
        finally:
            await pc.close()


async def test_a_call_that_cannot_be_set_up_is_a_500_with_the_reason_and_leaks_nothing():
    bad = config(agent=PhoneAgentConfig(vad_aggressiveness=9))
    async with running_server(FakeEngine(), bad) as (server, url):
        for _ in range(3):
            pc, offer = await make_offer()
            status, body, _ = await post(url + "/api/offer", json.dumps(offer))
            await pc.close()
            assert status == 500 and "could not be set up" in body["error"] and "aggressiveness" in body["error"], body
        assert not server.calls and server.calls_in_use == 0 and not server._handler._pcs_map


async def test_offer_and_candidate_checks_status_privacy_and_shutdown():
    async with running_server(FakeEngine(), config()) as (server, url):
        _, offer = await make_offer()
        unfingerprinted = "\r\n".join(l for l in offer["sdp"].split("\r\n") if not l.startswith("a=fingerprint"))
        status, body, _ = await post(url + "/api/offer", json.dumps({**offer, "sdp": unfingerprinted}))
        assert status == 400 and "a=fingerprint" in body["error"], body

        pc, answer = await open_peer(url)
        assert pc is not None, answer
        for candidate in ("candidate:1 1 udp", 5, None):
            status, body, _ = await post(url + "/api/offer", json.dumps(
                {"pc_id": answer["pc_id"], "candidates": [{"candidate": candidate, "sdpMid": "0"}]}), method="PATCH")
            assert status == 400 and "candidate" in body["error"], (candidate, status, body)
        good = "candidate:1 1 udp 2122260223 192.0.2.1 40000 typ host"
        for placement, words in (({"sdpMid": 0}, "sdpMid must be a string"),
                                 ({"sdpMLineIndex": "x"}, "sdpMLineIndex must be an integer"),
                                 ({"sdpMLineIndex": -1}, "sdpMLineIndex must be an integer")):
            status, body, _ = await post(url + "/api/offer", json.dumps(
                {"pc_id": answer["pc_id"], "candidates": [{"candidate": good, **placement}]}), method="PATCH")
            assert status == 400 and words in body["error"], (placement, status, body)

        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            async with http.get(url + "/api/ice-servers") as res:
                assert await res.json() == {"iceServers": []}
        # the app's shutdown (Ctrl-C under uvicorn) ends the calls still running, and tells them why
        async with server.app.router.lifespan_context(server.app):
            pass
        assert await wait_until(lambda: not server.calls, 5)
        assert "shutting down" in server.finished[-1]["ended_because"]
        assert {"type": "ended", "reason": "the server is shutting down"} in pc.messages, pc.messages
        assert await wait_until(lambda: pc.connectionState == "closed", 5), pc.connectionState
        await pc.close()
        late, offer = await make_offer()  # a closed server takes no new calls
        status, body, _ = await post(url + "/api/offer", json.dumps(offer))
        await late.close()
        assert status == 503 and "shutting down" in body["error"], body


async def test_a_call_in_which_nobody_speaks_ends_at_the_idle_timeout_and_says_so():
    async with running_server(FakeEngine(), config(idle_seconds=1.5)) as (server, url):
        pc, answer = await open_peer(url)  # sends silence
        assert pc is not None, answer
        try:
            assert await wait_until(lambda: not server.calls, 8)
            assert "nobody spoke for 1.5 s" in server.finished[-1]["ended_because"], server.finished[-1]
            # the page is told why (else an idle timeout looks like the caller's own hang-up)
            assert await wait_until(lambda: any(m.get("type") == "ended" for m in pc.messages), 3), pc.messages
            assert [m["reason"] for m in pc.messages if m.get("type") == "ended"] == ["nobody spoke for 1.5 s"]
        finally:
            await pc.close()


async def get(url, headers=None):
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
        async with http.get(url, headers=headers) as res:
            text = await res.text()
            return res.status, (json.loads(text) if text.startswith("{") else text)


async def ws_close(url, headers):
    """Open /ws/phone with these headers (aiohttp: it sends a given Host instead of its own); returns
    (close code, reason) of the server's first message, which should close it."""
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
        async with http.ws_connect(url + "/ws/phone", headers=headers) as ws:
            message = await ws.receive(timeout=3)
            return (message.data, message.extra) if message.type == aiohttp.WSMsgType.CLOSE else (None, message)


async def test_pages_of_other_sites_and_dns_rebinding_are_refused():
    """A page on another site must not start calls (a text/plain POST needs no CORS preflight) nor
    open the phone websocket; a DNS-rebinding page (foreign Host) must not read a loopback server."""
    app_origin = "https://app.example.com"
    async with running_server(FakeEngine(), config(max_calls=1, allowed_origins=(app_origin + "/",))) as (server, url):
        own_origin, port = url, url.rsplit(":", 1)[1]
        pc, offer = await make_offer()
        try:
            for content_type in ("text/plain", "application/x-www-form-urlencoded"):
                status, body, _ = await post(url + "/api/offer", json.dumps(offer), headers={"Content-Type": content_type})
                assert status == 415 and "Content-Type: application/json" in body["error"], (content_type, status, body)
            status, body, _ = await post(url + "/api/offer", json.dumps({"pc_id": "x", "candidates": []}),
                                         method="PATCH", headers={"Content-Type": "text/plain"})
            assert status == 415, body
            for origin in ("http://evil.example", "null", f"http://localhost:{port}"):  # another host: another origin
                status, body, _ = await post(url + "/api/offer", json.dumps(offer),
                                             headers={"Content-Type": "application/json", "Origin": origin})
                assert status == 403 and "Origin" in body["error"] and "refused" in body["error"], (origin, body)
            for host in (f"attacker.example:{port}", "attacker.example", f"127.0.0.1.evil.example:{port}"):
                for path in ("/api/ice-servers", "/api/status", "/"):
                    status, body = await get(url + path, headers={"Host": host})
                    assert status == 403 and "Host" in body["error"] and "localhost" in body["error"], (host, path, body)
            assert not server.calls and server.calls_in_use == 0

            # websockets: refused with close code 1008 and the reason
            code, reason = await ws_close(url, {"Origin": "http://evil.example"})
            assert code == 1008 and "Origin" in reason, (code, reason)
            code, reason = await ws_close(url, {"Host": f"attacker.example:{port}"})
            assert code == 1008 and "Host" in reason, (code, reason)
            assert not server.calls and server.calls_in_use == 0

            # allowed: no Origin (curl, Twilio), the server's own page under any loopback name, an allowed origin
            for headers in ({}, {"Origin": own_origin}, {"Host": f"localhost:{port}", "Origin": f"http://localhost:{port}"},
                            {"Host": f"[::1]:{port}"}, {"Origin": app_origin}):
                status, body = await get(url + "/api/ice-servers", headers=headers)
                assert status == 200 and body == {"iceServers": []}, (headers, body)
            status, body, _ = await post(url + "/api/offer", json.dumps(offer),
                                         headers={"Content-Type": "application/json; charset=utf-8", "Origin": own_origin})
            assert status == 200 and body["type"] == "answer" and len(server.calls) == 1, body
        finally:
            await pc.close()

    # bound elsewhere: any Host (the operator's proxy is in front), but still no other site's pages
    async with running_server(FakeEngine(), config(host="0.0.0.0")) as (server, url):
        status, _ = await get(url + "/api/status", headers={"Host": "agent.example"})
        assert status == 200
        status, _ = await get(url + "/api/status", headers={"Host": "agent.example", "Origin": "https://agent.example"})
        assert status == 200
        status, body = await get(url + "/api/status", headers={"Host": "agent.example", "Origin": "https://evil.example"})
        assert status == 403 and "Origin" in body["error"], body
    with pytest.raises(ValueError, match="expected scheme://host"):
        TasteServer(FakeEngine(), config(allowed_origins=("app.example.com",)))


async def test_keep_ended_calls_zero_keeps_no_call_logs():
    with pytest.raises(ValueError, match="keep_ended_calls must be 0 or more"):
        TasteServer(FakeEngine(), config(keep_ended_calls=-1))
    async with running_server(FakeEngine(), config(keep_ended_calls=0)) as (server, url):
        for _ in range(2):
            pc, answer = await open_peer(url)
            assert pc is not None, answer
            await pc.close()
            assert await wait_until(lambda: not server.calls, 10)
        assert server.ended == [] and server.ended_count == 2 and len(server.finished) == 2


def test_ice_servers_are_checked_when_the_server_is_made():
    from taste_agents.server import ice_servers_from

    stun, turn = ice_servers_from(["stun:stun.example.org:3478", "turn:turn.example.org:3478?transport=tcp"],
                                  "user", "secret")
    assert stun.urls == "stun:stun.example.org:3478" and stun.username is None
    assert (turn.username, turn.credential) == ("user", "secret")
    with pytest.raises(ValueError, match="expected stun:HOST"):
        ice_servers_from(["stun.example.org:3478"])
    with pytest.raises(ValueError, match="--turn-username"):
        ice_servers_from(["turn:turn.example.org"])
    for unusable in ("stuns:stun.example.org", "turns:turn.example.org?transport=udp"):
        with pytest.raises(ValueError, match="aiortc"):
            ice_servers_from([unusable], "user", "secret")
    with pytest.raises(ValueError, match="expected stun:HOST"):
        TasteServer(FakeEngine(), config(ice_servers=["http://example.org"]))


# -- phone (Twilio media streams) --------------------------------------------------------------------
def ulaw_frames(audio16k):
    """20 ms mu-law frames at 8 kHz, as Twilio sends them."""
    import audioop

    from pipecat_taste.audio import float_to_pcm16, resample

    pcm = float_to_pcm16(resample(audio16k, 16000, 8000))
    pcm += bytes((-len(pcm)) % 320)
    return [audioop.lin2ulaw(pcm[i:i + 320], 2) for i in range(0, len(pcm), 320)]


async def phone_call(url, audio, *, extra_messages=(), stop=True, listen_s=6.0):
    """Stream a call in real time; returns the server's messages (with arrival times)."""
    import websockets

    ws_url = url.replace("http://", "ws://") + "/ws/phone"
    got = []
    async with websockets.connect(ws_url, open_timeout=10) as ws:
        await ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        await ws.send(json.dumps({"event": "start", "streamSid": "MZtest", "start": {
            "streamSid": "MZtest", "callSid": "CAtest", "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000}}}))

        async def reader():
            try:
                async for message in ws:
                    got.append((time.monotonic(), json.loads(message)))
            except Exception:
                pass

        task = asyncio.create_task(reader())
        for message in extra_messages:
            await ws.send(message)
        t0 = time.monotonic()
        frames = ulaw_frames(audio)
        for i, frame in enumerate(frames):
            await asyncio.sleep(max(0.0, t0 + i * 0.02 - time.monotonic()))
            await ws.send(json.dumps({"event": "media", "streamSid": "MZtest",
                                      "media": {"payload": base64.b64encode(frame).decode()}}))
        silence = ulaw_frames(np.zeros(int(listen_s * 16000), np.float32))
        t1 = time.monotonic()
        for i, frame in enumerate(silence):
            await asyncio.sleep(max(0.0, t1 + i * 0.02 - time.monotonic()))
            await ws.send(json.dumps({"event": "media", "streamSid": "MZtest",
                                      "media": {"payload": base64.b64encode(frame).decode()}}))
        stop_at = time.monotonic()
        if stop:
            await ws.send(json.dumps({"event": "stop", "streamSid": "MZtest"}))
        try:
            await asyncio.wait_for(task, 5)
        except asyncio.TimeoutError:
            task.cancel()
    return got, stop_at


async def test_phone_stream_is_answered_in_whole_20ms_mulaw_frames_and_stop_ends_it():
    u = load_utterances()
    engine = FakeEngine(asr_text="hello there")  # a phone stream carries no transcript: built-in ASR
    async with running_server(engine, config()) as (server, url):
        audio = np.concatenate([np.zeros(8000, np.float32), u["hello"].audio])
        junk = ["not json", json.dumps([1]), json.dumps({"event": "dtmf", "dtmf": {"digit": "7"}}),
                json.dumps({"event": "dtmf", "dtmf": {"digit": "x"}}), json.dumps({"event": "mark", "mark": {}}),
                json.dumps({"event": "media", "media": {"payload": "%%%"}})]
        got, stop_at = await phone_call(url, audio, extra_messages=junk)
        ended = time.monotonic()
        while server.calls and time.monotonic() - ended < 5:
            await asyncio.sleep(0.02)
        assert not server.calls  # 'stop' ended the call (the server's own timeouts are minutes away)
        assert server.finished[-1]["ended_because"] == "the peer left"
        media = [m for _, m in got if m.get("event") == "media"]
        assert media, [m.get("event") for _, m in got][:10]
        sizes = {len(base64.b64decode(m["media"]["payload"])) for m in media}
        assert sizes == {160}  # whole 20 ms frames of 8 kHz mu-law
        assert all(m["streamSid"] == "MZtest" for m in media)
        call = server.ended[-1]
        assert [t.decision for t in call.log.turns.values()] == ["reply"]
        assert call.log.turns[1].transcript == "hello there"
        # what a finished call shows to anyone who can reach the port: its turns, not what was said
        async with aiohttp.ClientSession(timeout=TIMEOUT) as http:
            async with http.get(url + "/api/status") as res:
                finished = (await res.json())["finished"]
        assert finished[-1]["turns"][0]["decision"] == "reply" and "hello there" not in json.dumps(finished)
        # an ended call keeps its log only: its pipeline, agent and conversation are freed
        gc.collect()
        assert not [o for o in gc.get_objects() if type(o) is TasteCall and o.call_id == call.call_id]


@pytest.mark.serial  # the caller cuts in on a reply playing in real time
async def test_phone_barge_in_sends_clear_before_new_media():
    u = load_utterances()
    # a 5 s reply: the caller's goodbye, 3.2 s after its first turn, lands well inside it
    engine = FakeEngine(asr_text="hello there", reply_words=tuple(f"w{i}" for i in range(25)))
    async with running_server(engine, config()) as (server, url):
        # speak, wait for the reply to start, then talk over it
        first = np.concatenate([np.zeros(8000, np.float32), u["time"].audio, np.zeros(int(3.2 * 16000), np.float32)])
        audio = np.concatenate([first, u["goodbye"].audio])
        got, _ = await phone_call(url, audio, listen_s=5.0)
        events = [m.get("event") for _, m in got]
        assert "clear" in events
        i = events.index("clear")
        assert "media" in events[:i] and "media" in events[i + 1:]  # cut off, then answered again
        deadline = time.monotonic() + 5
        while not server.ended and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        log = server.ended[-1].log
        assert any(r.interrupted for r in log.turns.values())


async def test_a_phone_stream_waiting_for_its_start_message_counts_against_the_limit():
    import websockets

    async with running_server(FakeEngine(), config(max_calls=1)) as (server, url):
        ws_url = url.replace("http://", "ws://") + "/ws/phone"
        first = await websockets.connect(ws_url, open_timeout=10)
        others = []
        try:
            await first.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
            assert await wait_until(lambda: server.calls_in_use == 1, 5)
            # /api/status says why the server is full: no call is active, one is being set up
            status, body = await get(url + "/api/status")
            assert status == 200 and (body["active_calls"], body["opening"], body["max_calls"]) == (0, 1, 1), body
            others = [await websockets.connect(ws_url, open_timeout=10) for _ in range(2)]
            for ws in others:  # the first stream holds the one slot while its 'start' is awaited
                await asyncio.wait_for(ws.wait_closed(), 5)
                assert ws.close_code == 1013
            await first.send(json.dumps({"event": "start", "streamSid": "MZ", "start": {"streamSid": "MZ"}}))
            assert await wait_until(lambda: len(server.calls) == 1, 5)
        finally:
            for ws in [first, *others]:
                await ws.close()


def test_the_command_line_refuses_bad_values_before_loading_anything(tmp_path, capsys):
    from taste_agents.cli import main

    a_file = tmp_path / "taken"
    a_file.write_text("x")
    cases = [
        (["serve", "--max-calls", "0"], "--max-calls: must be a whole number >= 1"),
        (["serve", "--idle-seconds", "inf"], "--idle-seconds: must be a finite number of seconds"),
        (["serve", "--idle-seconds", "-1"], "--idle-seconds: must be seconds > 0"),
        (["call", "--simulate", "--seed", "x"], "--seed: must be a whole number, got 'x'"),
        (["call"], "call needs --simulate (live calls: taste-agent serve)"),
        (["call", "--simulate", "--asr-model", "/nonexistent"], "--asr-model '/nonexistent': no Whisper model there"),
        (["serve", "--ice-server", "stun.example.org:3478"], "expected stun:HOST"),
        (["serve", "--ice-server", "turn:turn.example.org"], "--turn-username"),
        (["serve", "--ssl-keyfile", str(a_file)], "--ssl-keyfile needs its --ssl-certfile"),
        (["serve", "--ssl-certfile", str(a_file)], "--ssl-certfile/--ssl-keyfile cannot be used"),  # not a PEM
        (["serve", "--port", "70000"], "--port: must be a TCP port from 1 to 65535"),  # (uvicorn bound 4464)
        (["serve", "--ice-server", "stun:stun.example.org:3478", "--turn-username", "me"], "--turn-username without a turn"),
        (["serve", "--voice", str(tmp_path / "missing.wav")], "--voice"),
        (["call", "--simulate", "--out", str(a_file)], "is a file; give a folder"),
        (["call", "--simulate", "--out", str(a_file / "under")], "cannot create the folder"),  # (under a file)
        (["call", "--simulate", "--max-call-seconds", "1e9"], "--max-call-seconds: at most 3600 s"),
        (["call", "--simulate", "--max-reply-tokens", "0"], "--max-reply-tokens: must be a whole number >= 1"),
        (["call", "--simulate", "--early-reply-ms", "inf"], "--early-reply-ms: must be milliseconds > 0"),
    ]
    for argv, words in cases:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and words in err, argv
        assert err.startswith(f"usage: taste-agent {argv[0]} "), err  # the command's usage, not the top level's

    # a refused command leaves no output folder behind, and {call_id} is no folder's name
    for argv in (["--simulate", "--early-reply-ms", "600"], ["--simulate", "--voice", str(tmp_path / "missing.wav")],
                 []):  # (the last: a call without --simulate)
        with pytest.raises(SystemExit):
            main(["call", "--out", str(tmp_path / "refused" / "{call_id}"), *argv])
    assert not (tmp_path / "refused").exists()
    from taste_agents.cli import _check_out, build_parser

    _check_out(build_parser(), str(tmp_path / "calls" / "{call_id}"))  # (as a command that passed its checks)
    assert (tmp_path / "calls").is_dir() and not any((tmp_path / "calls").iterdir())


def test_a_simulated_call_cut_short_says_so_even_when_quiet(tmp_path, capsys):
    """A call past --max-call-seconds fails (exit 1) and says why on stderr, --quiet too; without
    --quiet its summary says it was cut short (only the exit status told before)."""
    from taste_agents.cli import main

    for quiet in (["--quiet"], []):
        rc = main(["call", "--simulate", "--max-call-seconds", "1.5", "--out", str(tmp_path / f"out{len(quiet)}"),
                   *quiet])
        out, err = capsys.readouterr()
        assert rc == 1 and "the call failed its checks: the call ran past --max-call-seconds" in err
        assert ("cut short at --max-call-seconds" in out) == (not quiet)


async def test_a_call_whose_session_cannot_be_made_ends_at_once_and_says_why():
    """The TASTE processors cannot work (the engine could not make the call's session: out of GPU
    memory): the call ends at once and frees its slot (it held it, silent, until the idle timeout,
    logging an error per audio frame)."""
    import websockets

    class NoSessions(FakeEngine):
        def new_session(self, settings=None, voice=None):
            raise RuntimeError("CUDA out of memory (injected)")

    async with running_server(NoSessions(), config(max_calls=1, idle_seconds=60.0)) as (server, url):
        async with websockets.connect(url.replace("http", "ws") + "/ws/phone", open_timeout=10) as ws:
            await ws.send(json.dumps({"event": "connected"}))
            await ws.send(json.dumps({"event": "start", "streamSid": "MZ", "start": {"streamSid": "MZ"}}))
            frame = json.dumps({"event": "media", "media": {"payload": base64.b64encode(b"\xff" * 160).decode()}})
            started = time.monotonic()
            try:
                while server.calls_in_use or time.monotonic() - started < 0.5:
                    assert time.monotonic() - started < 10, "the call still holds its slot"
                    await ws.send(frame)
                    await asyncio.sleep(0.02)
            except websockets.ConnectionClosed:
                pass
        deadline = time.monotonic() + 5
        while server.calls_in_use and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert server.calls_in_use == 0
        assert "could not go on" in server.finished[-1]["ended_because"] and "out of memory" in \
            server.finished[-1]["ended_because"], server.finished[-1]


async def test_an_oversized_phone_message_is_dropped_unread():
    """Twilio's media messages are ~400 bytes; one of megabytes (524 s of audio) stalled every call
    on the server for seconds while the VAD chewed through it."""
    from pipecat.frames.frames import InputAudioRawFrame, StartFrame

    from taste_agents.server import MAX_PHONE_MESSAGE_BYTES, SafeTwilioSerializer

    serializer = SafeTwilioSerializer("MZ", params=SafeTwilioSerializer.InputParams(auto_hang_up=False))
    await serializer.setup(StartFrame(audio_in_sample_rate=16000, audio_out_sample_rate=16000))

    def media(n):
        return json.dumps({"event": "media", "media": {"payload": base64.b64encode(b"\x10" * n).decode()}})

    frames = [await serializer.deserialize(media(160)) for _ in range(10)]  # (the resampler holds some back)
    assert any(isinstance(f, InputAudioRawFrame) for f in frames)
    huge = media(4 << 20)
    assert len(huge) > MAX_PHONE_MESSAGE_BYTES and await serializer.deserialize(huge) is None


async def flooded_phone_call(message: str, count: int) -> tuple[str, str]:
    """A phone call that sends ``message`` ``count`` times as fast as it can after its start: the
    reason its websocket was closed with, and why the server says the call ended."""
    import websockets

    async with running_server(FakeEngine(), config(max_calls=1, idle_seconds=60.0)) as (server, url):
        async with websockets.connect(url.replace("http", "ws") + "/ws/phone", open_timeout=10) as ws:
            await ws.send(json.dumps({"event": "connected"}))
            await ws.send(json.dumps({"event": "start", "streamSid": "MZ", "start": {"streamSid": "MZ"}}))
            try:
                for _ in range(count):
                    await ws.send(message)
                await asyncio.wait_for(ws.wait_closed(), 10)
            except websockets.ConnectionClosed:
                pass
        deadline = time.monotonic() + 5
        while (server.calls_in_use or not server.finished) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return ws.close_reason or "", server.finished[-1]["ended_because"] if server.finished else ""


async def test_a_phone_stream_sending_junk_is_logged_a_few_times_then_ended():
    """A peer sending malformed messages as fast as it can wrote a warning for each (some 11 MB/s of
    log): the first few are logged, the rest counted, and a stream that keeps at it is ended, its
    call saying why."""
    from loguru import logger

    from taste_agents.server import LOGGED_PHONE_DROPS, MAX_PHONE_DROPS

    warnings = []
    sink = logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING")
    try:
        closed, ended = await flooded_phone_call("x" * 100, 2 * MAX_PHONE_DROPS)
        assert "malformed (or too fast) messages" in closed and "malformed (or too fast)" in ended, (closed, ended)
    finally:
        logger.remove(sink)
    dropped = [w for w in warnings if w.startswith("phone stream: dropping")]
    assert len(dropped) == LOGGED_PHONE_DROPS and "counted, not logged" in dropped[-1]


async def test_a_phone_stream_is_metered_at_twice_a_phone_s_rate_with_room_for_a_stall():
    """A phone sends 50 messages a second: that pace never loses one, nor does the backlog of a
    15 s network stall arriving at once; a peer sending faster than twice that has the excess
    dropped unread."""
    from taste_agents.server import PHONE_MESSAGE_BURST, PHONE_MESSAGES_PER_S, SafeTwilioSerializer

    now = [0.0]
    serializer = SafeTwilioSerializer("MZ", params=SafeTwilioSerializer.InputParams(auto_hang_up=False),
                                      clock=lambda: now[0])
    mark = json.dumps({"event": "mark", "mark": {"name": "x"}})
    for _ in range(50 * 60):  # a minute of a phone's pace
        await serializer.deserialize(mark)
        now[0] += 0.02
    assert serializer.dropped == 0
    now[0] += 15.0  # a stall, then its backlog at once
    for _ in range(50 * 15):
        await serializer.deserialize(mark)
    assert serializer.dropped == 0
    now[0] += PHONE_MESSAGE_BURST / PHONE_MESSAGES_PER_S  # the bucket full again
    for _ in range(PHONE_MESSAGE_BURST + 30):  # a flood: the bucket's worth passes, the rest does not
        await serializer.deserialize(mark)
    assert serializer.dropped == 30
    for _ in range(100):  # flooding on at three times a phone's pace: a third of it passes
        now[0] += 1 / 150
        await serializer.deserialize(mark)
    assert 30 + 100 - 100 * PHONE_MESSAGES_PER_S / 150 - 2 <= serializer.dropped <= 30 + 100 - 100 * PHONE_MESSAGES_PER_S / 150 + 2


async def test_a_phone_stream_flooding_valid_events_is_ended():
    """Valid but useless events (``mark``) as fast as a peer can send them held up every other call
    on the server: past the meter they count as malformed, and the stream is ended."""
    mark = json.dumps({"event": "mark", "streamSid": "MZ", "mark": {"name": "m"}})
    closed, ended = await flooded_phone_call(mark, 5000)
    assert "too fast" in closed and "too fast" in ended, (closed, ended)


async def test_a_phone_call_the_server_ends_tells_its_client_why():
    """The idle timeout (or the call's time limit) ends a phone call: its websocket closed with code
    1000 and no reason, and a proxy or the provider could not tell it from a normal end."""
    import websockets

    async with running_server(FakeEngine(), config(max_calls=1, idle_seconds=1.0)) as (server, url):
        async with websockets.connect(url.replace("http", "ws") + "/ws/phone", open_timeout=10) as ws:
            await ws.send(json.dumps({"event": "connected"}))
            await ws.send(json.dumps({"event": "start", "streamSid": "MZ", "start": {"streamSid": "MZ"}}))
            await asyncio.wait_for(ws.wait_closed(), 10)
        assert (ws.close_code, ws.close_reason) == (1000, "nobody spoke for 1 s")


async def test_closing_a_phone_websocket_whose_client_already_hung_up_raises_nothing():
    """A phone client gone before its 'start' (or refused at the call limit) is closed quietly, not
    with an unhandled exception in the server's log."""
    from starlette.websockets import WebSocketDisconnect

    from taste_agents.server import _close_quietly

    closed = []

    class Gone:
        async def close(self, code, reason):
            closed.append((code, reason))
            raise WebSocketDisconnect(code=1006)

    await _close_quietly(Gone(), 1008, "expected Twilio 'connected'/'start' messages")
    assert closed == [(1008, "expected Twilio 'connected'/'start' messages")]


async def test_closing_the_server_cancels_a_call_that_does_not_end_when_asked():
    """``close()`` asks every call to end; one whose pipeline does not end within 5 s is cancelled,
    so that no call outlives the server (before, close returned with it still running)."""
    server = TasteServer(FakeEngine(), config())

    class Deaf:  # a worker that ignores the request to end
        async def cancel(self, reason=None):
            self.reason = reason

        async def queue_frame(self, frame):  # (the client is told why)
            pass

    stuck = ActiveCall("stuck", "webrtc", Deaf())
    stuck.task = asyncio.create_task(asyncio.sleep(3600), name="call-stuck")
    server.calls[stuck.call_id] = stuck
    await server.close(timeout_s=0.2)
    assert stuck.task.cancelled() and stuck.worker.reason == "the server is shutting down"


async def test_a_call_set_up_while_the_server_closes_is_ended_by_a_task_the_server_keeps():
    """A call whose set-up finished after ``close()`` began is ended at once, by a task the server
    holds until it is done (the event loop keeps only weak references: an unheld task can be
    collected before it runs, and the call would outlive the server)."""
    import gc

    server = TasteServer(FakeEngine(), config())
    await server.close()

    class Ended:
        reason = None

        async def cancel(self, reason=None):
            self.reason = reason

        async def queue_frame(self, frame):  # (the client is told why)
            pass

    late = ActiveCall("late", "webrtc", Ended())
    server._run = lambda active: asyncio.sleep(0)  # (no pipeline to run here)
    server._launch(late)
    gc.collect()
    assert len(server._endings) == 1
    await asyncio.wait_for(asyncio.gather(late.task, *server._endings), 5)
    assert late.worker.reason == "the server is shutting down" and not server._endings


def test_a_voice_made_at_start_up_is_the_server_s_and_not_made_again():
    """taste-agent makes the --voice embedding before the warm-up (a refused recording ends the
    start-up there): the server takes it, not a second one made from the file."""
    class CountingEngine(FakeEngine):
        made = 0

        def speaker_embedding(self, reference_audio=None, sample_rate=16000):
            CountingEngine.made += 1
            return super().speaker_embedding(reference_audio, sample_rate)

    voice_file = Path(__file__).resolve().parents[1] / "agents" / "taste_agents" / "caller_audio" / "hello.wav"
    made_at_start = np.zeros((1, 192), np.float32)
    server = TasteServer(CountingEngine(), config(agent=PhoneAgentConfig(voice=str(voice_file))), voice=made_at_start)
    assert server.voice is made_at_start and CountingEngine.made == 0
    server = TasteServer(CountingEngine(), config(agent=PhoneAgentConfig(voice=str(voice_file))))  # (made here)
    assert CountingEngine.made == 1
