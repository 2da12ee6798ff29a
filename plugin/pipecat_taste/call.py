"""TasteCall: the state one call's processors share, and CallLog: what happened, turn by turn.

A call owns its engine session (Conversation, voice), one worker thread per stage (listening,
thinking, speech tokens, vocoding: stages of different turns or of one reply run concurrently,
stages of the same kind run in order), the back-pressure between generation and synthesis, and
the record of every turn. Nothing here is global: two calls in one process share only the
engine (its weights, batched steps and ``StartNeeds``).
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from pipecat_taste.reply_mutes import ReplyMutes
from pipecat_taste.session import GenerationSettings
from pipecat_taste.start_hold import StartNeeds
from pipecat_taste.streams import prepare_stage_thread

STAGES = ("listen", "think", "speech_tokens", "vocode")
# Reply segments the generator may have ready before the speech decoder takes them (back-pressure:
# the spoken LM needs a fraction of the speech decoder's time per word, and running further ahead
# would only compete with it for the device, and be thrown away on a barge-in).
MAX_PENDING_SEGMENTS = 4


@dataclass
class TurnRecord:
    """One user turn and the agent's answer to it. Times are ``time.monotonic()`` seconds."""

    turn_id: int
    vad_start_at: float | None = None  # VAD confirmed speech
    vad_stop_at: float | None = None  # VAD confirmed silence
    speech_start: float | None = None  # estimated start of speech (vad_start_at - start_secs)
    speech_end: float | None = None  # estimated end of speech (vad_stop_at - stop_secs)
    speech_seconds: float = 0.0  # speech length measured in the audio (VAD start to stop)
    audio_seconds: float = 0.0  # captured audio, with pre- and post-roll
    transcript: str = ""
    # Built-in ASR (None/0 when the transcript came from upstream): its compute after the VAD
    # confirmed the end of the turn, partial transcripts made while the user spoke, and the
    # tokens of the last partial that the final transcription kept.
    asr_after_end_ms: float | None = None
    asr_partials: int = 0
    asr_kept_tokens: int = 0
    decision: str | None = None  # reply | no_speech | error | ignored
    reason: str = ""
    tokenized_at: float | None = None
    decided_at: float | None = None
    first_segment_at: float | None = None
    generation_done_at: float | None = None
    first_audio_at: float | None = None  # first reply sample handed to the transport
    audio_end_at: float | None = None  # when the last reply sample finishes playing
    interrupted: bool = False
    ended_by_hangup: bool = False  # the call ended while this reply was still being played
    barge_in_at: float | None = None  # the caller's speech (VAD) that cut this reply off
    reply_text: str = ""
    played_text: str = ""
    total_words: int = 0
    played_words: int = 0  # words whose audio the caller heard (at least heard_fraction of it)
    kept_words: int = 0  # words of the reply the conversation kept
    synthesized_samples: int = 0  # reply audio the synthesizer produced (output rate)
    played_samples: int = 0  # reply audio handed to the transport (incl. the fade-out)
    dropped_samples: int = 0  # synthesized but never played (barge-in)
    underruns: int = 0
    # (reply samples released before it, samples of the faded bridge the playout sent into it) per gap
    audio_gaps: list[tuple[int, int]] = field(default_factory=list)
    # each pause of the reply for the caller's sound that proved to have no words (barge_in='pause'), s
    pauses_s: list[float] = field(default_factory=list)
    start_hold_s: float = 0.0  # how long the playout's learned start hold delayed this reply's first audio
    early_end_at: float | None = None  # handed on early, after a short silence (the VAD confirmed later)
    early_retracted: int = 0  # earlier early hand-overs of this speech that the caller's speech took back
    errors: list[str] = field(default_factory=list)

    @property
    def user_to_bot_s(self) -> float | None:
        if self.first_audio_at is None or self.speech_end is None:
            return None
        return self.first_audio_at - self.speech_end

    @property
    def barge_in_stop_s(self) -> float | None:
        if self.barge_in_at is None or self.audio_end_at is None:
            return None
        return max(0.0, self.audio_end_at - self.barge_in_at)


class CallLog:
    """Turn records and a flat event list, written by the processors (event-loop thread only)."""

    def __init__(self, keep_audio: bool = False):
        self.t0 = time.monotonic()
        self.turns: dict[int, TurnRecord] = {}
        self.retracted: dict[int, TurnRecord] = {}  # turns handed on early and taken back (the caller went on)
        self.events: list[dict[str, Any]] = []
        # With keep_audio, the exact PCM the synthesizer produced and the playout released per
        # turn (for checks that nothing is lost or duplicated on the way to the caller).
        self.keep_audio = keep_audio
        self.synthesized_audio: dict[int, list[bytes]] = {}
        self.released_audio: dict[int, list[bytes]] = {}
        # The playout's output rate and its frame and fade lengths in samples (set when it starts),
        # for checks of the audio it released.
        self.audio_rate: int | None = None
        self.frame_samples: int | None = None
        self.fade_samples: int | None = None

    def turn(self, turn_id: int) -> TurnRecord:
        if turn_id in self.retracted:
            return self.retracted[turn_id]
        if turn_id not in self.turns:
            self.turns[turn_id] = TurnRecord(turn_id)
        return self.turns[turn_id]

    def retract(self, turn_id: int) -> TurnRecord:
        """Move a turn that was handed on early and taken back out of ``turns`` (later writes to it
        still find it)."""
        record = self.turn(turn_id)
        self.retracted[turn_id] = self.turns.pop(turn_id, record)
        return record

    def event(self, kind: str, turn_id: int | None = None, **data) -> None:
        self.events.append({"t": time.monotonic() - self.t0, "kind": kind, "turn_id": turn_id, **data})

    def rel(self, t: float | None) -> float | None:
        return None if t is None else round(t - self.t0, 4)

    def to_dict(self) -> dict:
        return {"turns": [self._record_dict(r) for r in sorted(self.turns.values(), key=lambda r: r.turn_id)],
                "retracted_turns": [self._record_dict(r) for r in sorted(self.retracted.values(),
                                                                         key=lambda r: r.turn_id)],
                "events": self.events}

    def _record_dict(self, record: TurnRecord) -> dict:
        d = asdict(record)
        for key, value in list(d.items()):
            if key.endswith("_at") or key in ("speech_start", "speech_end"):
                d[key] = self.rel(value)
        d["user_to_bot_s"] = record.user_to_bot_s
        d["barge_in_stop_s"] = record.barge_in_stop_s
        return d


class TasteCall:
    """Shared by the processors of one call (``TasteSpeechToSpeech`` makes one for you).

    ``voice``: the call's speaker embedding, ``engine.speaker_embedding(audio, sample_rate)`` of a
    few seconds of the voice (None: the engine's default voice)."""

    def __init__(self, engine, settings: GenerationSettings | None = None, *, voice=None,
                 max_pending_segments: int = MAX_PENDING_SEGMENTS, log: CallLog | None = None):
        if max_pending_segments < 1:
            raise ValueError("max_pending_segments must be >= 1")
        if not callable(getattr(engine, "new_session", None)):  # (None or a hub id: an easy slip)
            raise ValueError(f"engine must be a loaded TasteEngine, got {engine!r}: load it once with "
                             "TasteEngine.from_pretrained(path_or_hub_id) (None there: the embedded tiny "
                             "checkpoint) and pass it to every call")
        if isinstance(voice, (str, bytes, os.PathLike)):  # (a recording's path: refused here, not at the start)
            raise ValueError(f"voice must be a speaker embedding, got {type(voice).__name__} {voice!r}: read the "
                             "recording (e.g. soundfile.read) and pass engine.speaker_embedding(audio, sample_rate)")
        self.engine = engine
        self.settings = settings or GenerationSettings()
        self.voice = voice
        self.call_id = uuid.uuid4().hex  # random: ids never collide across processes
        self.log = log or CallLog()
        self.session = None
        # What the starts of recent replies needed (the playout's start hold): kept by the engine,
        # whose hardware and load decide it; a call of an engine without one learns on its own.
        shared = getattr(engine, "start_needs", None)
        self.start_needs = shared if shared is not None else StartNeeds()
        self.max_pending_segments = max_pending_segments
        self._session_lock: asyncio.Lock | None = None
        self._executors: dict[str, ThreadPoolExecutor] = {}
        # With the engine's streams='calls', a CUDA stream of the call's own: its worker threads
        # start on it, so all of its jobs - from making its session on - run there (None: theirs).
        new_call_stream = getattr(engine, "new_call_stream", None)
        self.stream = new_call_stream() if new_call_stream is not None else None
        self._next_turn_id = 0
        self._segment_slots: asyncio.Semaphore | None = None
        # Who is in the call: the generator waits for the playout's report only if there is one.
        self.has_playout = False
        self.has_synthesizer = False
        self.has_generator = False
        # The rate the synthesizer makes the call's audio at (set at its StartFrame, which reaches
        # it before the playout: the playout paces at that rate, decided once).
        self.output_rate: int | None = None
        self._members: set = set()  # the processors of the call that have not cleaned up yet
        # Agent activity, for barge-in: the turn whose reply is being generated or played.
        self.active_reply_turn: int | None = None
        # The latest turn whose reply an interruption cut off (set by the generator as it stops it):
        # that reply's segments still on their way are dropped, not spoken.
        self.replies_cut_upto = 0
        # The turn whose reply the latest interruption cut in the generator (None: it was idle)
        self.interrupted_turn: int | None = None
        # Turns whose reply has not begun when the caller speaks again get none: it would talk over
        # the caller (the turns stay in the conversation; ``pipecat_taste.reply_mutes``).
        self.mutes = ReplyMutes()
        self.bot_speaking = False
        self.closed = False

    @property
    def replies_muted_upto(self) -> int:
        """The latest turn muted so far (its mute may still be lifted: ``mutes``)."""
        return self.mutes.upto

    # -- session and workers ----------------------------------------------------------------------
    async def ensure_session(self):
        """Create the engine session once (it may load a voice: done off the event loop)."""
        if self.closed:
            # Its pipeline stopped and the processors cleaned up: state, threads and session are gone.
            raise RuntimeError(f"call {self.call_id} has ended (its pipeline stopped): a call's TASTE processors "
                               "cannot run again; make a new TasteSpeechToSpeech (or a new TasteCall and "
                               "processors) for each call")
        if self.session is not None:
            return self.session
        if self._session_lock is None:
            self._session_lock = asyncio.Lock()
        async with self._session_lock:
            if self.session is None:
                session = await self.run("think", self.engine.new_session, self.settings, self.voice)
                warm_up = self._submit("think", session.warm_up)  # fast path: capture this call's steps now
                try:
                    await asyncio.wrap_future(warm_up)
                except BaseException:
                    # It failed (e.g. out of GPU memory while capturing) or the call was cancelled
                    # meanwhile: the session's batch slots and caches go back to the engine, shared by
                    # every call, once the warm-up's thread is done with them (at once if it is).
                    warm_up.add_done_callback(lambda _: session.close())
                    raise
                self.session = session
                if self.closed:  # the call ended while the session was being made
                    session.close()
        return self.session

    def executor(self, stage: str) -> ThreadPoolExecutor:
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; one of {STAGES}")
        if self.closed:
            raise RuntimeError("this call has ended")
        if stage not in self._executors:
            self._executors[stage] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"taste-{stage}-{self.call_id[:6]}",
                                                        initializer=prepare_stage_thread,
                                                        initargs=(self.stream, getattr(self.engine, "threads_per_job", None)))
        return self._executors[stage]

    async def run(self, stage: str, fn, *args):
        """Run a blocking engine call on the stage's worker thread, inside the engine's compute
        gate when it has one (jobs of all calls queue there, each call in its turn)."""
        return await asyncio.wrap_future(self._submit(stage, fn, *args))

    def _submit(self, stage: str, fn, *args) -> Future:
        gate = getattr(self.engine, "compute_gate", None)
        job = fn if gate is None else functools.partial(gate.run, fn, owner=self)
        return self.executor(stage).submit(job, *args)

    def new_turn_id(self) -> int:
        self._next_turn_id += 1
        return self._next_turn_id

    # -- back-pressure between generation and synthesis ---------------------------------------------
    @property
    def segment_slots(self) -> asyncio.Semaphore:
        if self._segment_slots is None:
            self._segment_slots = asyncio.Semaphore(self.max_pending_segments)
        return self._segment_slots

    def reset_segment_slots(self) -> None:
        """After a barge-in nothing is pending any more."""
        self._segment_slots = asyncio.Semaphore(self.max_pending_segments)

    @property
    def holds_tentative_replies(self) -> bool:
        """Whether the reply to a turn handed on early can wait for the turn to be confirmed: the
        playout holds its audio; a synthesizer without one would send it to the transport at once."""
        return self.has_playout or not self.has_synthesizer

    @property
    def agent_busy(self) -> bool:
        return self.active_reply_turn is not None or self.bot_speaking

    def join(self, processor) -> None:
        """``processor`` works for this call (each TASTE processor joins when it is made). One of
        each kind: two captures or generators of one call would feed two callers' turns into one
        conversation."""
        twin = next((m for m in self._members if type(m) is type(processor)), None)
        if twin is not None:
            raise ValueError(f"call {self.call_id} has a {type(processor).__name__} already ({twin}): a TasteCall "
                             "is one conversation; make a new TasteSpeechToSpeech (or TasteCall and processors) "
                             "for each call")
        self._members.add(processor)

    async def leave(self, processor) -> None:
        """``processor`` has cleaned up; when the last one has, the call ends (``close``), whichever
        of the processors the pipeline holds."""
        self._members.discard(processor)
        if not self._members and not self.closed:
            await self.close()

    async def close(self) -> None:
        """Stop the worker threads (running jobs finish in the background; nothing waits for them)
        and end the session (a job still running stops at its next model step)."""
        self.closed = True
        executors, self._executors = self._executors, {}
        for executor in executors.values():
            executor.shutdown(wait=False, cancel_futures=True)
        if self.session is not None:
            self.session.close()

    def worker_threads(self) -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("taste-") and self.call_id[:6] in t.name]
