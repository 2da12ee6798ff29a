"""``taste-agent serve``: live calls with the TASTE agent.

* ``GET /`` - a page: microphone in, agent audio out, live transcript, per-turn latency;
* ``POST /api/offer`` (``PATCH`` for trickled ICE candidates) - WebRTC offer/answer for Pipecat's
  ``SmallWebRTCTransport`` (aiortc); one pipeline per connection, torn down when the peer leaves;
* ``WS /ws/phone`` - a telephony media stream in Twilio's protocol (8 kHz mu-law; ``clear`` on
  barge-in; no provider REST calls);
* ``GET /api/status`` - active calls (and calls being set up), and the engine's compute gate (jobs
  queued, waits); no transcripts (what callers said is not for whoever can reach the port);
* ``GET /api/ice-servers`` - the STUN/TURN servers the page should use (the server's own).

Binds 127.0.0.1 unless told otherwise. Signalling is hardened: malformed JSON or SDP get a 4xx
with a message, request bodies are size-limited, and past ``max_calls`` concurrent calls new ones
get 503 (websocket: close code 1013) - counting the calls still being set up. Web pages of other
sites cannot use it: ``/api/offer`` takes ``Content-Type: application/json`` only (so a browser
must ask first, and is not allowed), a request or websocket with an ``Origin`` header other than
the server's own (or one in ``allowed_origins``) gets 403 (websocket: close code 1008), and bound
to loopback the server answers only to loopback ``Host`` names (DNS rebinding); bound elsewhere
it takes any ``Host``: put it behind your own proxy. Every call ends:
when its peer leaves, when a WebRTC peer has not connected ``connect_seconds`` after its answer,
after ``idle_seconds`` with nobody speaking, and at ``max_call_seconds`` at the latest. No
STUN/TURN server is used unless ``--ice-server`` is given (deployments behind NAT need one, see
the README).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import json
import socket
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from fastapi import Request, WebSocket  # module level: FastAPI resolves the handlers' annotations here
from fastapi.responses import JSONResponse
from loguru import logger
from pipecat.frames.frames import (
    Frame,
    OutputTransportMessageUrgentFrame,
    TranscriptionFrame,
    TTSTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker, ProcessorUnusablePolicy
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.serializers.twilio import TwilioFrameSerializer
from pipecat.transports.base_transport import TransportParams
from pipecat.utils.time import time_now_iso8601
from pipecat.workers.runner import WorkerRunner
from starlette.datastructures import Headers

from pipecat_taste.call import CallLog, TasteCall
from pipecat_taste.frames import TasteTurnDecisionFrame, TasteTurnMetricsFrame
from pipecat_taste.playout import PlayoutParams

from taste_agents.memory import release_free_memory
from taste_agents.phone_agent import PhoneAgentConfig, build_phone_agent, load_voice

STATIC = Path(__file__).parent / "static"
PHONE_SAMPLE_RATE = 8000


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 7860
    max_calls: int = 4
    max_body_bytes: int = 64 * 1024  # an SDP offer is a few kB
    max_call_seconds: float = 30 * 60  # a call ends after this long, whatever happens in it
    idle_seconds: float = 5 * 60  # ... or after this long with nobody speaking (a muted or vanished peer)
    connect_seconds: float = 15.0  # a WebRTC peer must connect this soon after its offer is answered
    # STUN/TURN servers: URLs, or IceServer (aiortc's RTCIceServer) with a TURN username/credential
    ice_servers: list = field(default_factory=list)
    keep_ended_calls: int = 16  # ended calls whose logs are kept (TasteServer.ended); 0: none
    # web origins besides the server's own whose pages may call it, e.g. "https://app.example.com"
    # (a page behind a proxy that rewrites the Host header, or served from elsewhere)
    allowed_origins: tuple[str, ...] = ()
    webrtc_in_rate: int = 16000
    webrtc_out_rate: int = 48000  # Opus runs at 48 kHz: no resampling on the way out
    # aiortc's output track plays 10 ms at a time and inserts silence when its queue is empty:
    # hand it 10 ms chunks, and keep a little more audio ahead than on a sound card.
    webrtc_out_10ms_chunks: int = 1
    webrtc_playout: PlayoutParams = field(default_factory=lambda: PlayoutParams(lead_ms=50.0))
    accept_client_transcripts: bool = True  # a client may send {"type": "transcript", "text": ...}
    keep_call_audio: bool = False  # keep each call's synthesized/released PCM in its CallLog (load tests)
    agent: PhoneAgentConfig = field(default_factory=PhoneAgentConfig)


class ClientEvents(FrameProcessor):
    """Tells the page what to show: the caller's transcript per turn, the agent's words as they
    are spoken, and per-turn latency. Sits before the output transport; passes everything on."""

    def __init__(self, call: TasteCall, **kwargs):
        super().__init__(**kwargs)
        self._call = call

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        await self.push_frame(frame, direction)
        message = None
        if isinstance(frame, TasteTurnDecisionFrame):
            record = self._call.log.turns.get(frame.turn_id)
            message = {"type": "turn", "turn_id": frame.turn_id, "decision": frame.decision, "reason": frame.reason,
                       "transcript": record.transcript if record else ""}
        elif isinstance(frame, TTSTextFrame):
            message = {"type": "bot_text", "text": frame.text}
        elif isinstance(frame, TasteTurnMetricsFrame):
            message = {"type": "metrics", "turn_id": frame.turn_id,
                       "latency_ms": None if frame.user_to_bot_s is None else round(1000 * frame.user_to_bot_s),
                       "reply_ms": round(1000 * frame.reply_s), "interrupted": frame.interrupted,
                       "barge_in_stop_ms": None if frame.barge_in_stop_s is None else round(1000 * frame.barge_in_stop_s)}
        if message is not None:
            await self.push_frame(OutputTransportMessageUrgentFrame(message=message))


# Twilio's media messages are ~400 bytes (20 ms of 8 kHz mu-law in base64): a larger one is no
# phone audio, and a huge one (524 s of audio in one message) stalled every call for seconds.
MAX_PHONE_MESSAGE_BYTES = 16 * 1024
MAX_WEBSOCKET_MESSAGE_BYTES = 64 * 1024  # the server's limit for any websocket message (uvicorn's: 16 MiB)
# A phone provider sends no malformed messages: the first few a stream sends are logged, the rest
# counted (a peer sending junk as fast as it can wrote some 11 MB/s of warnings), and a stream that
# keeps sending them is no phone call: it is ended.
LOGGED_PHONE_DROPS = 5
MAX_PHONE_DROPS = 100
# A phone stream sends 50 media messages a second (20 ms each) and little else; a peer sending valid
# but useless events as fast as it can (``mark``, unknown events) held up every other call on the
# server (another call took 1.86 s to connect instead of 0.03 s). A stream's messages are metered:
# a bucket of ``PHONE_MESSAGE_BURST`` (20 s of audio: a network stall's backlog arrives at once)
# refilled at ``PHONE_MESSAGES_PER_S`` (twice a phone's rate); a message past it is dropped unread
# and counts as malformed, so a flood ends the call after ``MAX_PHONE_DROPS`` of them.
PHONE_MESSAGES_PER_S = 100.0
PHONE_MESSAGE_BURST = 1000


class SafeTwilioSerializer(TwilioFrameSerializer):
    """Twilio's serializer, made safe for a public endpoint: malformed or oversized messages are
    dropped (the stock one raises, which ends the call), so are messages sent faster than a phone
    sends them - the first ``LOGGED_PHONE_DROPS`` logged, the call ended at ``MAX_PHONE_DROPS`` - and
    ``stop`` ends the call. ``on_stop(reason, hung_up)`` ends it (``hung_up``: the caller's ``stop``,
    else the server's decision). ``clock``: seconds, for the message meter."""

    def __init__(self, *args, on_stop=None, clock=time.monotonic, **kwargs):
        super().__init__(*args, **kwargs)
        self._on_stop = on_stop
        self._clock = clock
        self.dropped = 0  # malformed (or too fast) messages of this stream
        self._allowance = float(PHONE_MESSAGE_BURST)  # the message meter's bucket
        self._metered_at: float | None = None

    def _metered(self) -> bool:
        """Whether a message fits the meter (and takes its place in it)."""
        now = self._clock()
        if self._metered_at is not None:
            refill = (now - self._metered_at) * PHONE_MESSAGES_PER_S
            self._allowance = min(float(PHONE_MESSAGE_BURST), self._allowance + refill)
        self._metered_at = now
        if self._allowance < 1.0:
            return False
        self._allowance -= 1.0
        return True

    async def _drop(self, why: str) -> None:
        self.dropped += 1
        if self.dropped <= LOGGED_PHONE_DROPS:
            more = " (more from this stream are counted, not logged)" if self.dropped == LOGGED_PHONE_DROPS else ""
            logger.warning(f"phone stream: dropping {why}{more}")
        if self.dropped == MAX_PHONE_DROPS:
            logger.warning(f"phone stream: {MAX_PHONE_DROPS} malformed (or too fast) messages: ending the call")
            if self._on_stop is not None:
                await self._on_stop(f"the phone stream sent {MAX_PHONE_DROPS} malformed (or too fast) messages",
                                    hung_up=False)

    async def deserialize(self, data):
        if not self._metered():
            await self._drop(f"a message past {PHONE_MESSAGES_PER_S:g} a second (a phone sends 50)")
            return None
        if len(data) > MAX_PHONE_MESSAGE_BYTES:
            await self._drop(f"a {len(data)}-byte message (a phone's are under {MAX_PHONE_MESSAGE_BYTES} bytes)")
            return None
        try:
            message = json.loads(data)
        except (TypeError, ValueError):
            await self._drop(f"a message that is not JSON ({str(data)[:60]!r})")
            return None
        if not isinstance(message, dict):
            await self._drop("a JSON message that is not an object")
            return None
        event = message.get("event")
        if event == "stop":
            logger.info("phone stream: stop event, ending the call")
            if self._on_stop is not None:
                await self._on_stop("stop event", hung_up=True)
            return None
        if event not in ("media", "dtmf"):
            logger.debug(f"phone stream: ignoring event {event!r}")
            return None
        try:
            return await super().deserialize(data)
        except Exception as e:  # bad base64, bad payload: never fatal
            await self._drop(f"a bad {event!r} message: {e}")
            return None


@dataclass
class ActiveCall:
    call_id: str
    kind: str  # webrtc | phone
    worker: PipelineWorker
    started: float = field(default_factory=time.monotonic)
    task: asyncio.Task | None = None
    connection: object = None  # WebRTC: the peer connection
    websocket: object = None  # phone: the media stream's websocket
    connected: asyncio.Event | None = None  # WebRTC: set once the peer has connected
    agent: object = None
    end_reason: str | None = None  # why the server ended it (None: the peer left)


def ice_servers_from(urls, username: str | None = None, credential: str | None = None) -> list:
    """STUN/TURN URLs as aiortc's ``RTCIceServer``s, checked now rather than at every call's offer;
    TURN servers get the username and credential (aiortc's URL syntax has no place for them)."""
    from aiortc import RTCIceServer
    from aiortc.rtcicetransport import parse_stun_turn_uri

    servers = []
    for url in urls:
        if isinstance(url, RTCIceServer):
            servers.append(url)
            continue
        try:
            parsed = parse_stun_turn_uri(url)
        except (TypeError, ValueError) as e:
            raise ValueError(f"ICE server {url!r}: {e}; expected stun:HOST[:PORT] or "
                             "turn:HOST[:PORT][?transport=udp|tcp] (turns: for TLS)") from None
        scheme, transport = parsed["scheme"], parsed.get("transport")
        # what aiortc (the server's side) can use; the page is given the same list
        if scheme == "stuns" or (scheme == "turn" and transport not in ("udp", "tcp")) or (
                scheme == "turns" and transport != "tcp"):
            raise ValueError(f"ICE server {url!r}: the server's WebRTC stack (aiortc) uses stun:, turn: over udp or "
                             "tcp and turns: over tcp only")
        if scheme.startswith("turn"):
            if not (username and credential):
                raise ValueError(f"ICE server {url!r} is a TURN server: give its username and credential "
                                 "(taste-agent serve --turn-username U, and the credential in $TASTE_TURN_CREDENTIAL: "
                                 "--turn-credential C would show it in the process list)")
            servers.append(RTCIceServer(urls=url, username=username, credential=credential))
        else:
            servers.append(RTCIceServer(urls=url))
    return servers


@dataclass
class EndedCall:
    """What the server keeps of an ended call: its id and log, not its pipeline (the pipeline holds
    the conversation's KV cache and the transport's codecs: kept, they would pile up call by call)."""

    call_id: str
    kind: str
    seconds: float
    log: CallLog | None


def _is_loopback(name: str) -> bool:
    """Whether a host name or address (``[::1]`` brackets allowed) names this machine's loopback."""
    name = name.strip().lower().removeprefix("[").removesuffix("]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _host_name(host: str) -> str:
    """A Host header without its port: ``localhost:7860`` -> ``localhost``, ``[::1]:7860`` -> ``[::1]``."""
    if host.startswith("["):
        return host.partition("]")[0] + "]"
    return host.partition(":")[0]


class BrowserGuard:
    """ASGI middleware: every request and websocket passes ``refusal`` (TasteServer._refusal) first."""

    def __init__(self, app, refusal):
        self.app, self.refusal = app, refusal

    async def __call__(self, scope, receive, send):
        reason = self.refusal(Headers(scope=scope)) if scope["type"] in ("http", "websocket") else None
        if reason is None:
            await self.app(scope, receive, send)
            return
        logger.warning(f"refused {scope['type']} {scope.get('path')}: {reason}")
        if scope["type"] == "http":
            await JSONResponse({"error": reason}, status_code=403)(scope, receive, send)
        else:  # accepted only to be closed: the client sees the code and the reason
            websocket = WebSocket(scope, receive, send)
            await websocket.accept()
            await websocket.close(code=1008, reason=reason.encode()[:120].decode(errors="ignore"))  # 123 bytes at most


class SignallingError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class TasteServer:
    def __init__(self, engine, config: ServerConfig | None = None, voice=None):
        """``voice``: the agent's speaker embedding if made already (``taste-agent`` makes it before
        the warm-up), else made here from ``config.agent.voice``."""
        from pipecat.transports.smallwebrtc.request_handler import ConnectionMode, SmallWebRTCRequestHandler

        self.engine = engine
        self.config = config or ServerConfig()
        if self.config.max_calls < 1:
            raise ValueError(f"max_calls must be at least 1, got {self.config.max_calls}")
        if self.config.keep_ended_calls < 0:
            raise ValueError(f"keep_ended_calls must be 0 or more, got {self.config.keep_ended_calls}")
        self._allowed_origins = {origin.rstrip("/").lower() for origin in self.config.allowed_origins}
        bad = sorted(o for o in self._allowed_origins if not o.partition("://")[2])
        if bad:
            raise ValueError(f"allowed_origins: {', '.join(bad)}: expected scheme://host[:port], "
                             "e.g. https://app.example.com")
        self.ice_servers = ice_servers_from(self.config.ice_servers)
        # the agent's voice, once: a bad reference recording is a start-up error, not every call's
        self.voice = voice if voice is not None else load_voice(engine, self.config.agent.voice)
        self.calls: dict[str, ActiveCall] = {}
        self._opening = 0  # calls past the limit check whose pipelines are not running yet
        self.finished: list[dict] = []  # summaries of ended calls (newest last, bounded)
        self.ended: list[EndedCall] = []  # the last ended calls, with their call logs
        self.ended_count = 0
        self._closed = False
        self._endings: set[asyncio.Task] = set()  # (the loop keeps only weak references to tasks)
        self._handler = SmallWebRTCRequestHandler(ice_servers=self.ice_servers or None,
                                                  connection_mode=ConnectionMode.MULTIPLE)
        self.app = self._build_app()

    @property
    def calls_in_use(self) -> int:
        """Calls counted against ``max_calls``: running, and being set up."""
        return len(self.calls) + self._opening

    def _refusal(self, headers) -> str | None:
        """Why a request or websocket must be refused, or None. Bound to loopback, the server answers
        only to loopback Host names: a DNS-rebinding page reaches it under its own name. A request
        made by a web page carries an Origin: only the server's own page and the allowed origins
        may use it (no Origin: curl, Twilio, another server; they are not a victim's browser)."""
        host = headers.get("host", "")
        if _is_loopback(self.config.host) and not _is_loopback(_host_name(host)):
            return (f"Host {host!r} refused: a server bound to {self.config.host} answers only to "
                    "localhost, 127.0.0.1 or [::1]")
        origin = headers.get("origin")
        if origin is not None:
            origin = origin.rstrip("/").lower()
            if origin.partition("://")[2] != host.lower() and origin not in self._allowed_origins:
                return f"Origin {origin!r} refused: not this server's own page nor an allowed origin"
        return None

    # -- HTTP -------------------------------------------------------------------------------------
    def _build_app(self):
        from fastapi import FastAPI
        from fastapi.responses import FileResponse

        @contextlib.asynccontextmanager
        async def lifespan(_app):
            yield
            await self.close()  # Ctrl-C: end the calls (their tasks would hang the loop's shutdown)

        app = FastAPI(title="taste-agent", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
        app.add_middleware(BrowserGuard, refusal=self._refusal)  # every route: the page, the API, the websocket

        @app.get("/")
        async def page():
            return FileResponse(STATIC / "index.html", media_type="text/html")

        @app.get("/api/status")
        async def status():
            gate = getattr(self.engine, "compute_gate", None)
            lm_batch = getattr(self.engine, "lm_batch", None)
            speech_batch = getattr(self.engine, "speech_batch", None)
            synthesis = getattr(self.engine, "synthesis_graphs", None)
            # opening: calls being set up; they count against max_calls, with the active ones
            return {"active_calls": len(self.calls), "opening": self._opening, "max_calls": self.config.max_calls,
                    "compute_gate": gate.stats() if gate is not None else None,
                    "lm_batch": lm_batch.stats() if lm_batch is not None else None,
                    "speech_batch": speech_batch.stats() if speech_batch is not None else None,
                    "synthesis_batch": synthesis.stats() if synthesis is not None else None,
                    "calls": [{"call_id": c.call_id, "kind": c.kind, "seconds": round(time.monotonic() - c.started, 1)}
                              for c in self.calls.values()],
                    "finished": self.finished[-20:]}

        @app.get("/api/ice-servers")
        async def ice_servers():
            return {"iceServers": [{k: v for k, v in (("urls", s.urls), ("username", s.username),
                                                      ("credential", s.credential)) if v}
                                   for s in self.ice_servers]}

        @app.post("/api/offer")
        async def offer(request: Request):
            try:
                data = await self._read_json(request)
                return JSONResponse(await self._offer(data))
            except SignallingError as e:
                headers = {"Retry-After": "5"} if e.status == 503 else None
                return JSONResponse({"error": e.message}, status_code=e.status, headers=headers)

        @app.patch("/api/offer")
        async def candidates(request: Request):
            try:
                data = await self._read_json(request)
                await self._candidates(data)
                return JSONResponse({"ok": True})
            except SignallingError as e:
                return JSONResponse({"error": e.message}, status_code=e.status)

        @app.websocket("/ws/phone")
        async def phone(websocket: WebSocket):
            await self._phone_call(websocket)

        return app

    async def _read_json(self, request) -> dict:
        # JSON only: a browser sends another site's page's text/plain POST without asking the server
        # first (a 'simple' request); application/json needs a CORS preflight, which is not granted
        content_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if content_type != "application/json":
            raise SignallingError(415, f"the body must be JSON sent with Content-Type: application/json, "
                                       f"not {content_type or 'no Content-Type'!r}")
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.config.max_body_bytes):
            raise SignallingError(413, f"request body larger than {self.config.max_body_bytes} bytes")
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.config.max_body_bytes:
                raise SignallingError(413, f"request body larger than {self.config.max_body_bytes} bytes")
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:  # (RecursionError: nested too deep)
            raise SignallingError(400, f"malformed JSON: {e}") from None
        if not isinstance(data, dict):
            raise SignallingError(400, "the body must be a JSON object")
        return data

    async def _offer(self, data: dict) -> dict:
        from pipecat.transports.smallwebrtc.request_handler import SmallWebRTCRequest

        sdp, kind, pc_id = data.get("sdp"), data.get("type"), data.get("pc_id")
        if not isinstance(sdp, str) or not sdp.startswith("v=0"):
            raise SignallingError(400, "'sdp' must be an SDP offer (a string starting with 'v=0')")
        if kind != "offer":
            raise SignallingError(400, f"'type' must be 'offer', got {kind!r}")
        media = [line.split()[0] for line in sdp.splitlines() if line.startswith("m=")]
        if "m=audio" not in media:
            # aiortc answers even an offer without media; such a call could never carry audio.
            raise SignallingError(400, "the SDP offer has no audio section ('m=audio'): offer a microphone track")
        if media[0] != "m=audio":
            # Pipecat reads the caller's audio from the first transceiver only: the call would hear nothing
            raise SignallingError(400, f"the SDP offer's first media section is {media[0]!r}: add the microphone "
                                       "track first (addTrack / addTransceiver('audio') before any video)")
        if pc_id is not None and not isinstance(pc_id, str):
            raise SignallingError(400, "'pc_id' must be a string")
        if pc_id is not None and pc_id not in self._handler._pcs_map:
            raise SignallingError(404, "unknown pc_id (renegotiation of a call that is not active)")
        missing = [name for name in ("fingerprint", "ice-ufrag", "ice-pwd") if f"a={name}:" not in sdp]
        if missing:  # aiortc would answer, then fail in the background: the call could never connect
            raise SignallingError(400, f"the SDP offer has no {', '.join('a=' + m for m in missing)}: "
                                       "send the offer the browser's createOffer() made, unedited")
        new_call = pc_id is None
        if new_call:
            if self._closed:
                raise SignallingError(503, "the server is shutting down")
            if self.calls_in_use >= self.config.max_calls:
                raise SignallingError(503, f"the server is at its limit of {self.config.max_calls} concurrent calls")
            self._opening += 1  # counted before the first wait: offers arriving together cannot all pass
        failed = []

        async def start_call(connection):
            try:
                await self._start_webrtc_call(connection)
            except Exception as e:  # Pipecat would log it and answer anyway: a peer with no pipeline
                logger.exception("a WebRTC call could not be set up")
                failed.append((connection, e))

        request = SmallWebRTCRequest(sdp=sdp, type="offer", pc_id=pc_id)
        try:
            answer = await self._handler.handle_web_request(request, start_call)
        except ValueError as e:
            raise SignallingError(400, f"the SDP offer could not be used ({type(e).__name__}: {e}): send the offer "
                                       "an RTCPeerConnection made (createOffer), with the microphone's audio track") \
                from None
        except Exception as e:
            raise SignallingError(400, f"the offer could not be answered: {type(e).__name__}: {e}") from None
        finally:
            if new_call:
                self._opening -= 1
        if failed:
            connection, error = failed[0]
            await self._drop_connection(connection)
            raise SignallingError(500, f"the call could not be set up: {type(error).__name__}: {error}")
        if answer is None:
            raise SignallingError(500, "no answer was produced")
        return answer

    async def _candidates(self, data: dict) -> None:
        from pipecat.transports.smallwebrtc.request_handler import IceCandidate, SmallWebRTCPatchRequest

        pc_id, items = data.get("pc_id"), data.get("candidates")
        if not isinstance(pc_id, str) or not isinstance(items, list):
            raise SignallingError(400, "expected {'pc_id': str, 'candidates': [...]}")
        if pc_id not in self._handler._pcs_map:
            raise SignallingError(404, "unknown pc_id")
        if not all(isinstance(c, dict) and isinstance(c.get("candidate"), str) for c in items):
            raise SignallingError(400, "each candidate must be an object with a 'candidate' string")
        # (aiortc drops a candidate whose media section it cannot place, silently)
        placed = [(c["candidate"], c.get("sdp_mid", c.get("sdpMid")), c.get("sdp_mline_index", c.get("sdpMLineIndex")))
                  for c in items]
        for _, mid, index in placed:
            if mid is not None and not isinstance(mid, str):
                raise SignallingError(400, f"a candidate's sdpMid must be a string (the media section's a=mid), "
                                           f"got {mid!r}")
            if index is not None and (isinstance(index, bool) or not isinstance(index, int) or index < 0):
                raise SignallingError(400, f"a candidate's sdpMLineIndex must be an integer >= 0, got {index!r}")
        try:
            candidates = [IceCandidate(candidate, mid, index) for candidate, mid, index in placed]
            await self._handler.handle_patch_request(SmallWebRTCPatchRequest(pc_id, candidates))
        except Exception as e:  # aiortc's parser asserts: a malformed candidate is the client's error
            raise SignallingError(400, f"bad ICE candidate: {type(e).__name__}: {e}") from None

    # -- calls ------------------------------------------------------------------------------------
    def _worker(self, pipeline, in_rate: int, out_rate: int) -> PipelineWorker:
        # A processor that can no longer do its job (its session could not be made: out of GPU
        # memory) ends the call at once: the caller would hear nothing while it held its slot.
        return PipelineWorker(pipeline, params=PipelineParams(audio_in_sample_rate=in_rate, audio_out_sample_rate=out_rate,
                                                               enable_metrics=True, enable_usage_metrics=True),
                              idle_timeout_secs=self.config.idle_seconds, cancel_on_idle_timeout=False,  # _run ends it
                              processor_unusable_policy=ProcessorUnusablePolicy.CANCEL, enable_rtvi=False)

    async def _start_webrtc_call(self, connection) -> None:
        from pipecat.transports.smallwebrtc.transport import SmallWebRTCTransport

        cfg = self.config
        transport = SmallWebRTCTransport(connection, TransportParams(
            audio_in_enabled=True, audio_out_enabled=True, audio_out_10ms_chunks=cfg.webrtc_out_10ms_chunks,
            audio_in_sample_rate=cfg.webrtc_in_rate, audio_out_sample_rate=cfg.webrtc_out_rate))
        agent = build_phone_agent(self.engine, replace(cfg.agent, playout=cfg.webrtc_playout),
                                  log=CallLog(keep_audio=cfg.keep_call_audio), voice=self.voice)
        pipeline = Pipeline([transport.input(), agent, ClientEvents(agent.call), transport.output()])
        worker = self._worker(pipeline, cfg.webrtc_in_rate, cfg.webrtc_out_rate)
        active = ActiveCall(agent.call.call_id, "webrtc", worker, connection=connection, connected=asyncio.Event(),
                            agent=agent)

        @transport.event_handler("on_client_connected")
        async def _connected(_transport, _client):
            active.connected.set()

        @transport.event_handler("on_client_disconnected")
        async def _left(_transport, _client):
            logger.info(f"call {active.call_id}: peer left")
            await worker.cancel(reason="peer left")

        @transport.event_handler("on_app_message")
        async def _message(_transport, message, _sender=None):
            if cfg.accept_client_transcripts and isinstance(message, dict) and message.get("type") == "transcript":
                text = message.get("text")
                if isinstance(text, str) and text.strip():
                    await worker.queue_frame(TranscriptionFrame(text[:2000], "caller", time_now_iso8601(), finalized=True))

        self._launch(active)

    def _launch(self, active: ActiveCall) -> None:
        self.calls[active.call_id] = active
        active.task = asyncio.create_task(self._run(active), name=f"call-{active.call_id}")
        if self._closed:  # set up while the server was closing: end it at once
            ending = asyncio.create_task(self._end(active, "the server is shutting down", code=1001))
            self._endings.add(ending)
            ending.add_done_callback(self._endings.discard)

    async def _run(self, active: ActiveCall) -> None:
        runner = WorkerRunner(handle_sigint=False, handle_sigterm=False)
        limits = asyncio.create_task(self._limits(active), name=f"call-limits-{active.call_id}")

        @active.worker.event_handler("on_idle_timeout")
        async def _idle(_worker):
            # ended as the server ends any call (the client told why, then cancelled): cancelled by
            # the worker itself, a WebRTC client's message was lost
            await self._end(active, f"nobody spoke for {self.config.idle_seconds:g} s")

        @active.worker.event_handler("on_pipeline_error")
        async def _error(_worker, frame):
            processor = getattr(frame, "processor", None)
            if processor is not None and not getattr(processor, "is_usable", True):
                active.end_reason = active.end_reason or f"the call could not go on: {frame.error}"
                await _tell_client(active, active.end_reason, code=1011)

        try:
            await runner.add_workers(active.worker)
            await runner.run()
        except Exception as e:
            logger.exception(f"call {active.call_id} failed")
            active.end_reason = active.end_reason or f"the call failed: {type(e).__name__}: {e}"
        finally:
            limits.cancel()
            if active.connection is not None:
                # a peer that never connected (or a call the server ended) still holds its connection
                await self._drop_connection(active.connection)
            self.calls.pop(active.call_id, None)
            record = {"call_id": active.call_id, "kind": active.kind, "seconds": round(time.monotonic() - active.started, 1),
                      "ended_because": active.end_reason or "the peer left"}
            if active.agent is not None:
                # no transcripts: /api/status shows this to anyone who can reach the port
                turns = active.agent.call.log.turns.values()
                record["turns"] = [{"turn_id": t.turn_id, "decision": t.decision,
                                    "latency_ms": None if t.user_to_bot_s is None else round(1000 * t.user_to_bot_s),
                                    "interrupted": t.interrupted} for t in turns]
            self.finished = (self.finished + [record])[-100:]
            log = active.agent.call.log if active.agent is not None else None
            self.ended.append(EndedCall(active.call_id, active.kind, record["seconds"], log))
            keep = self.config.keep_ended_calls
            self.ended = self.ended[-keep:] if keep else []  # keep 0: none ([-0:] is the whole list)
            self.ended_count += 1
            logger.info(f"call {active.call_id} ended")
            # once this coroutine (and its reference to the call) is gone: give the freed memory back,
            # on a thread (trimming a large heap takes a while; the other calls' audio must not wait)
            loop = asyncio.get_running_loop()
            loop.call_soon(loop.run_in_executor, None, release_free_memory)

    async def _drop_connection(self, connection) -> None:
        """Forget a WebRTC peer connection and close it (closing twice is harmless)."""
        self._handler._pcs_map.pop(connection.pc_id, None)
        with contextlib.suppress(Exception):
            await connection.disconnect()

    async def _limits(self, active: ActiveCall) -> None:
        """Ends a call whose WebRTC peer does not connect in time, and any call at its time limit
        (the pipeline's idle timeout ends calls in which nobody speaks)."""
        cfg = self.config
        if active.connected is not None:
            wait = min(cfg.connect_seconds, cfg.max_call_seconds)
            try:
                await asyncio.wait_for(active.connected.wait(), wait)
            except (TimeoutError, asyncio.TimeoutError):
                await self._end(active, f"the peer did not connect within {cfg.connect_seconds:g} s"
                                if wait == cfg.connect_seconds else f"the call reached its limit of {cfg.max_call_seconds:g} s")
                return
        await asyncio.sleep(max(0.0, cfg.max_call_seconds - (time.monotonic() - active.started)))
        await self._end(active, f"the call reached its limit of {cfg.max_call_seconds:g} s")

    async def _end(self, active: ActiveCall, reason: str, code: int = 1000) -> None:
        """End a call the server ends (``code``: the phone websocket's close code; 1001 when the
        server goes away)."""
        logger.info(f"call {active.call_id}: ending it, {reason}")
        active.end_reason = active.end_reason or reason
        await _tell_client(active, reason, code)
        await active.worker.cancel(reason=reason)

    async def _phone_call(self, websocket) -> None:
        await websocket.accept()
        if self._closed:
            await _close_quietly(websocket, 1001, "the server is shutting down")
            return
        if self.calls_in_use >= self.config.max_calls:
            await _close_quietly(websocket, 1013, "at the concurrent call limit")
            return
        self._opening += 1  # counted while Twilio's opening messages are awaited
        active = None
        try:
            active = await self._open_phone_call(websocket)
            if active is not None:
                self._launch(active)
        finally:
            self._opening -= 1
        if active is not None:
            await active.task  # the websocket lives as long as this handler

    async def _open_phone_call(self, websocket) -> ActiveCall | None:
        from pipecat.transports.websocket.fastapi import FastAPIWebsocketParams, FastAPIWebsocketTransport

        start = await _twilio_start(websocket)
        if start is None:
            await _close_quietly(websocket, 1008, "expected Twilio 'connected'/'start' messages")
            return None
        stream_sid, call_sid = start
        holder: dict = {}

        async def on_stop(reason: str, hung_up: bool):
            active = holder.get("active")
            if active is None:
                return
            if hung_up:
                await active.worker.cancel(reason=reason)
            else:
                await self._end(active, reason)

        serializer = SafeTwilioSerializer(stream_sid, call_sid, on_stop=on_stop,
                                          params=TwilioFrameSerializer.InputParams(auto_hang_up=False))
        transport = FastAPIWebsocketTransport(websocket, FastAPIWebsocketParams(
            audio_in_enabled=True, audio_out_enabled=True, add_wav_header=False, serializer=serializer,
            audio_out_10ms_chunks=2, audio_in_sample_rate=PHONE_SAMPLE_RATE, audio_out_sample_rate=PHONE_SAMPLE_RATE))
        try:
            agent = build_phone_agent(self.engine, self.config.agent, log=CallLog(keep_audio=self.config.keep_call_audio),
                                      voice=self.voice)
        except Exception as e:
            logger.exception("a phone call could not be set up")
            await _close_quietly(websocket, 1011, f"the call could not be set up: {type(e).__name__}"[:120])
            return None
        pipeline = Pipeline([transport.input(), agent, transport.output()])
        worker = self._worker(pipeline, PHONE_SAMPLE_RATE, PHONE_SAMPLE_RATE)
        active = holder["active"] = ActiveCall(agent.call.call_id, "phone", worker, agent=agent, websocket=websocket)

        @transport.event_handler("on_client_disconnected")
        async def _left(_transport, _client):
            await worker.cancel(reason="phone stream closed")

        return active

    async def close(self, timeout_s: float = 5.0) -> None:
        """End every call; one whose pipeline has not ended ``timeout_s`` after it was asked is cancelled."""
        if self._closed:
            return
        self._closed = True
        for active in list(self.calls.values()):
            await self._end(active, "the server is shutting down", code=1001)
        tasks = [a.task for a in self.calls.values() if a.task is not None]
        if tasks:
            _, running = await asyncio.wait(tasks, timeout=timeout_s)
            for task in running:  # a pipeline that does not end when asked: its task is cancelled
                logger.warning(f"{task.get_name()}: still running {timeout_s:g} s after it was ended; cancelling it")
                task.cancel()
            if running:
                await asyncio.wait(running, timeout=timeout_s)
        await self._handler.close()


async def _tell_client(active: ActiveCall, reason: str, code: int = 1000) -> None:
    """A call the server ends is told why before its transport closes it bare: a phone call's
    websocket is closed with the reason (a proxy or the provider sees why); a WebRTC call gets an
    ``{"type": "ended", "reason": ...}`` message (the page shows it: an idle timeout or a server
    going down would otherwise look like a hang-up)."""
    if active.websocket is not None:
        await _close_quietly(active.websocket, code, reason[:120])
    elif active.kind == "webrtc":
        await active.worker.queue_frame(OutputTransportMessageUrgentFrame(message={"type": "ended", "reason": reason}))


async def _close_quietly(websocket, code: int, reason: str) -> None:
    """Close a phone websocket whose client may already have hung up (closing it again would raise)."""
    with contextlib.suppress(Exception):
        await websocket.close(code=code, reason=reason)


async def _twilio_start(websocket, timeout: float = 5.0) -> tuple[str, str | None] | None:
    """Read Twilio's opening messages ('connected', then 'start'); returns (streamSid, callSid)."""
    try:
        async with asyncio.timeout(timeout):
            for _ in range(3):
                raw = await websocket.receive_text()
                try:
                    message = json.loads(raw)
                except ValueError:
                    return None
                if not isinstance(message, dict):
                    return None
                if message.get("event") == "start":
                    start = message.get("start") or {}
                    sid = start.get("streamSid") or message.get("streamSid")
                    if not isinstance(sid, str) or not sid:
                        return None
                    return sid, start.get("callSid")
    except (TimeoutError, asyncio.TimeoutError, Exception):
        return None
    return None


def serve(args) -> int:
    """Entry point of ``taste-agent serve``."""
    import uvicorn

    from taste_agents.cli import _quiet_logs, agent_config, load_engine

    _quiet_logs()
    sock = _listening_socket(args.host, args.port)  # a port in use is said now, not after the model loaded
    try:
        engine, _, voice = load_engine(args, print)
    except BaseException:
        sock.close()
        raise
    config = ServerConfig(host=args.host, port=args.port, max_calls=args.max_calls, ice_servers=args.ice_servers,
                          max_call_seconds=args.max_call_seconds, idle_seconds=args.idle_seconds,
                          allowed_origins=tuple(getattr(args, "allowed_origins", None) or ()), agent=agent_config(args))
    server = TasteServer(engine, config, voice=voice)
    scheme = "https" if args.ssl_certfile else "http"
    host = f"[{config.host}]" if ":" in config.host and not config.host.startswith("[") else config.host  # IPv6
    print(f"taste-agent: open {scheme}://{host}:{config.port}/ (max {config.max_calls} calls)", flush=True)
    if scheme == "http" and not _is_loopback(config.host):
        print("taste-agent: browsers allow the microphone only on HTTPS or localhost; for other machines pass "
              "--ssl-certfile/--ssl-keyfile or put a TLS proxy in front", flush=True)
    if not _is_loopback(config.host):
        print(f"taste-agent: bound to {config.host}, the server takes any Host header: to expose it, put it behind "
              "your own proxy", flush=True)
    uvicorn.Server(uvicorn.Config(server.app, host=config.host, port=config.port, log_level="warning",
                                  ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
                                  ws_max_size=MAX_WEBSOCKET_MESSAGE_BYTES)).run(sockets=[sock])
    return 0


def _listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound (uvicorn listens on it)."""
    from taste_agents.cli import StartupError

    address = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)  # (as uvicorn)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn does: a restart is not refused)
        sock.bind((address, port))
    except OSError as e:
        sock.close()
        if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:  # (no such host here)
            hint = "give --host an address of this machine (0.0.0.0: all of them)"
        else:
            hint = "give another --port, or stop what holds it"
        raise StartupError(f"cannot listen on {host}:{port}: {e.strerror or e}; {hint}") from e
    return sock

