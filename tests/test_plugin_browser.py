"""A real browser calls the agent: headless Debian Chromium loads the served page with a WAV file
as its microphone, connects over loopback WebRTC, and the page measures the agent audio it
receives. The test reads the page's figures over the DevTools protocol and saves a screenshot
(artifacts/browser_call.png, or $TASTE_ARTIFACTS)."""

import asyncio
import base64
import contextlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from pipecat_taste.engine import TasteEngine
from taste_agents.caller import load_utterances
from taste_agents.phone_agent import PhoneAgentConfig
from taste_agents.report import write_wav
from taste_agents.server import ServerConfig
from taste_agents.webrtc_sim import running_server

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.serial]  # chromium in real time

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(os.environ.get("TASTE_ARTIFACTS", Path(__file__).resolve().parents[1] / "artifacts"))


def chromium_args(user_dir: Path, mic_wav: Path, url: str) -> list[str]:
    return [
        CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
        "--disable-default-apps", "--disable-extensions", "--mute-audio", f"--user-data-dir={user_dir}",
        "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={mic_wav}%noloop", "--autoplay-policy=no-user-gesture-required",
        # plain IP host candidates (no mDNS multicast), loopback allowed, no proxy lookups
        "--disable-features=WebRtcHideLocalIpsWithMdns", "--allow-loopback-in-peer-connection",
        "--no-proxy-server", "--remote-debugging-port=0", "--window-size=900,700", url,
    ]


class DevTools:
    """The few DevTools-protocol calls the test needs, on the page's websocket."""

    def __init__(self, ws):
        self.ws, self.next_id = ws, 0

    async def call(self, method: str, **params):
        self.next_id += 1
        await self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(await asyncio.wait_for(self.ws.recv(), 20))
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(message["error"])
                return message["result"]

    async def evaluate(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")


async def devtools_page(user_dir: Path, timeout: float = 30.0) -> str:
    port_file = user_dir / "DevToolsActivePort"
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("chromium did not open its DevTools port")
        await asyncio.sleep(0.1)
    port = port_file.read_text().split()[0]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        while True:
            async with http.get(f"http://127.0.0.1:{port}/json/list") as res:
                pages = [p for p in await res.json() if p.get("type") == "page"]
            if pages:
                return pages[0]["webSocketDebuggerUrl"]
            if time.monotonic() > deadline:
                raise TimeoutError("no page in chromium")
            await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def browser_page(tmp_path: Path, mic_wav: Path, url: str):
    """Chromium on ``url`` with ``mic_wav`` as its microphone; yields the page's DevTools."""
    import websockets

    user_dir = tmp_path / "chromium"
    user_dir.mkdir()
    browser = subprocess.Popen(chromium_args(user_dir, mic_wav, url), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        async with websockets.connect(await devtools_page(user_dir), max_size=2**24, open_timeout=10) as ws:
            yield DevTools(ws)
    finally:
        browser.terminate()
        try:
            browser.wait(10)
        except subprocess.TimeoutExpired:
            browser.kill()


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian chromium (scripts/setup.sh --test installs it)")
async def test_browser_calls_the_agent_and_hears_it(tmp_path):
    u = load_utterances()
    mic = tmp_path / "mic.wav"
    audio = np.concatenate([np.zeros(16000, np.float32), u["hello"].audio, np.zeros(16000, np.float32)])
    write_wav(mic, np.clip(np.rint(audio * 32767), -32768, 32767).astype(np.int16).reshape(-1, 1), 16000)
    engine = TasteEngine.from_pretrained(None)  # the embedded tiny checkpoint, with its (random) built-in ASR
    config = ServerConfig(agent=PhoneAgentConfig(max_reply_tokens=6))
    async with running_server(engine, config) as (server, url):
        async with browser_page(tmp_path, mic, url + "/?autostart") as page:
            stats, deadline = {}, time.monotonic() + 150
            while time.monotonic() < deadline:
                stats = json.loads(await page.evaluate("JSON.stringify(window.tasteStats || {})") or "{}")
                if stats.get("audibleMs", 0) >= 1000 and any(t.get("latency_ms") for t in stats.get("turns", [])):
                    break
                if stats.get("error"):
                    break
                await asyncio.sleep(0.5)
            shot = await page.call("Page.captureScreenshot", format="png")
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            (ARTIFACTS / "browser_call.png").write_bytes(base64.b64decode(shot["data"]))
            (ARTIFACTS / "browser_call.json").write_text(json.dumps(stats, indent=1))
            await page.evaluate("document.getElementById('stop').click()")
        closed = time.monotonic()
        while server.calls and time.monotonic() - closed < 10:
            await asyncio.sleep(0.1)
        assert not server.calls  # the call ended when the browser hung up
    print("page figures:", json.dumps({k: stats.get(k) for k in ("state", "receivedMs", "audibleMs", "maxRms", "turns",
                                                                "trickled", "connectMs")}))
    assert stats.get("error") is None, stats
    # the offer went at once; the candidates found after it were trickled (PATCH, accepted by the server)
    assert stats["trickled"] >= 1 and stats["connectMs"] > 0, stats
    assert stats["audibleMs"] >= 1000 and stats["maxRms"] > 0.01  # the page heard the agent speak
    assert stats["turns"] and stats["turns"][0]["decision"] == "reply"
    assert stats["turns"][0]["latency_ms"] is not None
    assert (ARTIFACTS / "browser_call.png").stat().st_size > 1000


# The page's microphone streams, recorded as getUserMedia hands them out, and the page's state.
RECORD_STREAMS = """(() => { const get = navigator.mediaDevices.getUserMedia.bind(navigator.mediaDevices);
  navigator.mediaDevices.getUserMedia = async (c) => { const s = await get(c); (window._streams ||= []).push(s); return s; };
})()"""
PAGE = """JSON.stringify({state: tasteStats.state, start: $("start").disabled, stop: $("stop").disabled,
  tracks: (window._streams || []).flatMap((s) => s.getTracks().map((t) => t.readyState))})"""


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian chromium (scripts/setup.sh --test installs it)")
async def test_the_page_lets_go_of_the_microphone_however_the_call_ends(tmp_path):
    """Hang-up, the server ending the call (its time limit) and a refused call (503 at the limit):
    each time every microphone track is stopped (the browser stops recording) and the page is
    ready for a new call. Before, the microphone stayed on and the page stuck after the server's end."""
    from pipecat_taste.testing import FakeEngine
    from test_plugin_server import open_peer

    mic = tmp_path / "mic.wav"
    write_wav(mic, np.zeros((16000 * 30, 1), np.int16), 16000)

    async def page_when(page, done, timeout=30.0):
        deadline = time.monotonic() + timeout
        while True:
            raw = await page.evaluate(PAGE)  # None until the page's script has run
            state = json.loads(raw) if raw else {"state": None, "start": None, "stop": None, "tracks": []}
            if (raw and done(state)) or time.monotonic() > deadline:
                return state
            await asyncio.sleep(0.2)

    def ready_again(state):
        return not state["start"] and state["stop"] and state["tracks"] and set(state["tracks"]) == {"ended"}

    async with running_server(FakeEngine(), ServerConfig(max_calls=1, max_call_seconds=4)) as (server, url):
        async with browser_page(tmp_path, mic, url + "/") as page:
            await page_when(page, lambda s: True)  # the page's script has run
            await page.evaluate(RECORD_STREAMS)

            await page.evaluate("$('start').click()")
            assert (await page_when(page, lambda s: s["state"] == "connected"))["state"] == "connected"
            await page.evaluate("$('stop').click()")
            state = await page_when(page, ready_again, 5)
            assert state["state"] == "ended" and ready_again(state), state  # hung up

            # hung up while it was starting (Hang up works from the click on Call): it stops there,
            # the microphone let go, and no call reaches the server
            while server.calls:  # (the hung-up call's end reaches the server's records)
                await asyncio.sleep(0.1)
            before = len(server.finished)
            assert await page.evaluate("$('start').click(), $('stop').disabled") is False
            await page.evaluate("$('stop').click()")
            state = await page_when(page, lambda s: ready_again(s) and len(s["tracks"]) == 2, 5)
            assert state["state"] == "ended" and ready_again(state) and len(state["tracks"]) == 2, state
            await asyncio.sleep(1.0)
            assert not server.calls and len(server.finished) == before

            while server.calls:
                await asyncio.sleep(0.1)
            await page.evaluate("$('start').click()")
            assert (await page_when(page, lambda s: s["state"] == "connected"))["state"] == "connected"
            state = await page_when(page, lambda s: (s["state"] or "").startswith("ended") and ready_again(s), 30)
            # the server ended it at 4 s, and the page says so (not a bare "ended", as if hung up)
            assert state["state"] == "ended: the call reached its limit of 4 s" and ready_again(state), state

            while server.calls:
                await asyncio.sleep(0.1)
            peer, _ = await open_peer(url)  # takes the only place
            try:
                await page.evaluate("$('start').click()")
                state = await page_when(page, lambda s: (s["state"] or "").startswith("error") and ready_again(s), 20)
                assert state["state"].startswith("error") and "limit of 1" in state["state"], state
                assert ready_again(state), state
            finally:
                await peer.close()


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian chromium (scripts/setup.sh --test installs it)")
async def test_the_page_shows_the_status_of_an_error_that_is_not_ours(tmp_path):
    """A proxy in front (the README suggests one for TLS) answers the offer with an HTML 502 page:
    the page says '502 Bad Gateway' (it said it could not parse JSON) and lets go of the microphone."""
    from aiohttp import web

    from taste_agents.server import STATIC

    async def page(request):
        return web.FileResponse(STATIC / "index.html")

    async def ice_servers(request):
        return web.json_response({"iceServers": []})

    async def bad_gateway(request):
        return web.Response(status=502, content_type="text/html",
                            text="<html><head><title>502 Bad Gateway</title></head></html>")

    app = web.Application()
    app.router.add_get("/", page)
    app.router.add_get("/api/ice-servers", ice_servers)
    app.router.add_post("/api/offer", bad_gateway)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    mic = tmp_path / "mic.wav"
    write_wav(mic, np.zeros((16000 * 5, 1), np.int16), 16000)
    state = None
    try:
        async with browser_page(tmp_path, mic, f"http://127.0.0.1:{port}/?autostart") as page:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not (state and state.get("error")):
                raw = await page.evaluate("JSON.stringify(window.tasteStats || null)")
                state = json.loads(raw) if raw else None
                await asyncio.sleep(0.3)
    finally:
        await runner.cleanup()
    assert state and state["state"] == "error: 502 Bad Gateway", state
