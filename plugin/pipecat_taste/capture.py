"""TasteTurnCapture: VAD-gated capture of each user turn, its transcript, and its TASTE tokens.

Input audio passes through untouched (recorders and other processors downstream still see it).
Alongside, the processor keeps a short ring of recent audio; when the VAD confirms speech the turn
starts with that ring as pre-roll (the VAD needs ``start_secs`` of speech before it is sure, and
word onsets are quiet), and when the VAD confirms silence the turn ends (keeping ``post_roll_secs``
after the speech). Then, on a worker thread: the transcript (an upstream ``TranscriptionFrame``
from any Pipecat STT, or the engine's built-in ASR), ``taste_tokenize``, and a
``TasteUserTurnFrame`` downstream plus the ``TranscriptionFrame`` upstream. Which turn an
upstream transcript belongs to, and when a turn has all of its parts, is decided in
``pipecat_taste.upstream_transcripts``.

Incremental ASR (``incremental_asr``, on by default): when the built-in ASR gives the transcript,
the audio captured so far is transcribed on the call's listening thread every
``incremental_asr_every_secs`` of new audio while the user speaks (at most one such job at a time,
none while an earlier turn is still being finished; skipped, not queued, when busy). The end of
the turn then only verifies the latest partial and decodes what it had not heard
(``pipecat_taste.asr.TurnTranscript``). A failing partial is logged and changes nothing else.
Each turn's record gets ``asr_after_end_ms``: the built-in ASR's compute on the listening
thread after the turn was handed on - when the VAD confirmed its end, or earlier with an early
reply (below) - the rest of an in-flight partial plus the final transcription.

Early replies (``early_reply_secs``, with the capture's own VAD): the VAD confirms the end of a
turn only after ``stop_secs`` of silence (0.5 s by default), most of the time the caller waits
for an answer. After ``early_reply_secs`` of that silence the turn is already transcribed,
tokenized and handed on as a tentative ``TasteUserTurnFrame``, so the reply is generated and
synthesized while the VAD is still making sure; its announcement and audio are held until the
VAD confirms (``TasteTurnStatusFrame`` 'confirmed'). If the caller goes on speaking instead, the
turn is retracted ('retracted': the reply is dropped unheard and the conversation forgets both)
and the speech continues as a new turn. The transcript goes upstream, and a decision not to
answer goes downstream, only once the turn is confirmed. The turn's record says when it was
handed on (``early_end_at``); retracted ones are kept apart (``CallLog.retracted``). The reply's
audio is held by the ``TastePlayout``: a call with a ``TasteSynthesizer`` but no playout gets no
early replies.

A turn longer than the audio tower's window (``max_turn_seconds``) is split: the part so far is
closed and the speech goes on as a new turn. The closed part is handed on once the new one has
``min_speech_secs`` of speech (it then gets no reply: the caller is still talking, and the new
part answers for both), or when the new one ends shorter (the split fell on the last syllable or
the closing silence: the closed part is answered).

VAD: give ``vad_analyzer`` (e.g. :class:`~pipecat_taste.vad.WebRTCVADAnalyzer`) and the capture
runs it and broadcasts ``VADUserStarted/StoppedSpeakingFrame`` and ``UserStarted/Stopped
SpeakingFrame``; or leave it None and put a ``VADProcessor`` upstream - the capture then follows
its VAD frames.

Barge-in: when the caller has spoken ``min_speech_secs`` while the agent is answering (generating
or playing), the reply stops. With ``barge_in='pause'`` (the default, with a ``TastePlayout``) the
capture sends a ``TasteReplyPauseFrame``: the playout fades the reply out and holds it until the
speech has words (a partial transcript, an STT's words, or the turn's transcript), then the
capture broadcasts an ``InterruptionFrame`` (the generator, synthesizer and playout stop at once);
speech that proves to have no words (a door, a rustle) resumes the reply where it stopped, with a
fade-in. Speech whose words came before it had ``min_speech_secs`` barges in at once. With
``barge_in='immediate'`` (and without a playout, which is what could hold the
audio) the ``InterruptionFrame`` goes at once. Earlier turns whose reply has not begun yet get none from then on
(``TasteCall.mutes``): it would talk over the caller. Such a mute stands once the new turn is
handed on with words; one that proves to be no turn (the transcript has no words) or fails lifts
it, and the earlier turn is answered after all. A shorter sound (a cough, an 'mm') is ignored as a
turn, so it must neither interrupt nor mute. With an upstream VAD, whose state the capture does
not see, that is ``min_speech_secs`` plus the VAD's ``stop_secs``.

``EndFrame``: the turns already ended are finished (transcribed with the words that came before
it, tokenized, handed on; a turn handed on early is confirmed) and the EndFrame follows them; the
speech still going on is dropped (decision 'ignored'; a reply it paused is cut off, as its words
would have cut it: the caller was still talking over it). ``CancelFrame`` stops everything at once.
"""

from __future__ import annotations

import asyncio
import collections
import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from loguru import logger
from pipecat.audio.vad.vad_analyzer import VADAnalyzer, VADState
from pipecat.frames.frames import (
    BotStartedSpeakingFrame,
    BotStoppedSpeakingFrame,
    CancelFrame,
    EndFrame,
    Frame,
    InputAudioRawFrame,
    InterimTranscriptionFrame,
    InterruptionFrame,
    LLMServiceMetadataFrame,
    ServiceSwitcherRequestMetadataFrame,
    StartFrame,
    STTMetadataFrame,
    TranscriptionFrame,
    UserSpeakingFrame,
    UserStartedSpeakingFrame,
    UserStoppedSpeakingFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor, FrameProcessorSetup
from pipecat.turns.user_turn_strategies import ExternalUserTurnStrategies
from pipecat.utils.errors import ErrorCategory
from pipecat.utils.time import time_now_iso8601

from pipecat_taste.audio import StreamResampler, float_to_pcm16, pcm16_to_float, resample
from pipecat_taste.call import TasteCall
from pipecat_taste.frames import (
    TasteReplyPauseFrame,
    TasteTurnDecisionFrame,
    TasteTurnStatusFrame,
    TasteUserTurnFrame,
)
from pipecat_taste.links import aggregator_taking_transcripts, stt_before, switcher_after_aggregator
from pipecat_taste.upstream_transcripts import TurnWords, UpstreamTranscripts


@dataclass
class TurnCaptureParams:
    """pre_roll_secs: audio kept before the estimated speech onset. post_roll_secs: audio kept
    after the estimated speech end. min_turn_secs: shorter speech is dropped as a click, without a
    transcript. min_speech_secs: shorter speech neither barges in nor mutes earlier replies (a cough,
    an 'mm'), and is ignored when it began while the agent was answering or speaking (a backchannel);
    otherwise it is transcribed, and answered when it has words (the VAD measures a spoken 'yes' at
    about 0.2 s). transcript_timeout_secs: how long to wait after
    the turn for an upstream transcript before falling back to the built-in ASR; in 'auto' with a
    built-in ASR, until the call's first upstream transcript (or interim words) arrives, only
    first_transcript_grace_secs, while the built-in ASR already transcribes the turn: the first of
    the two is the transcript (a call that relies on the built-in ASR would otherwise lose the
    wait on every turn, and its early replies their head start). transcript_quiet_secs: an STT
    may send a turn's transcript in parts; after the turn they are collected until one marked
    ``finalized`` arrives after the speech ended, or none has come for this long (or the timeout
    is over). interrupt_on_speech: barge-in. barge_in: 'pause' (the reply pauses at once and is
    cut off only once the speech has words; a sound without any resumes it) or 'immediate' (cut
    off at once; module docstring). transcripts: 'auto' (upstream if one arrives, else built-in
    ASR), 'upstream' or 'asr'. incremental_asr: transcribe with the built-in ASR while the user speaks, every
    incremental_asr_every_secs of new audio (in 'auto' only until the call's first upstream
    transcript arrives). early_reply_secs: hand the turn on after this much silence, before the
    VAD confirms its end (module docstring; None: wait for the VAD; needs the capture's own VAD
    and less than its stop_secs)."""

    pre_roll_secs: float = 0.3
    post_roll_secs: float = 0.2
    min_turn_secs: float = 0.1
    min_speech_secs: float = 0.25
    transcript_timeout_secs: float = 1.5
    first_transcript_grace_secs: float = 0.3
    transcript_quiet_secs: float = 0.4
    interrupt_on_speech: bool = True
    barge_in: str = "pause"
    transcripts: str = "auto"
    user_id: str = "user"
    incremental_asr: bool = True
    incremental_asr_every_secs: float = 0.8
    early_reply_secs: float | None = 0.2

    def __post_init__(self):
        if self.transcripts not in ("auto", "upstream", "asr"):
            raise ValueError(f"transcripts must be 'auto', 'upstream' or 'asr', got {self.transcripts!r}")
        if self.barge_in not in ("pause", "immediate"):
            raise ValueError(f"TurnCaptureParams.barge_in must be 'pause' or 'immediate', got {self.barge_in!r}")
        for name in ("pre_roll_secs", "post_roll_secs", "min_turn_secs", "min_speech_secs", "transcript_timeout_secs",
                     "first_transcript_grace_secs", "transcript_quiet_secs", "early_reply_secs",
                     "incremental_asr_every_secs"):
            value = getattr(self, name)
            if name == "early_reply_secs" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"TurnCaptureParams.{name} must be a finite number of seconds, got {value!r}")
            if value < 0:
                raise ValueError(f"TurnCaptureParams.{name} must be >= 0, got {value!r}")
        if self.min_turn_secs > self.min_speech_secs:  # else speech that mutes a reply could go unanswered
            raise ValueError(f"TurnCaptureParams.min_turn_secs ({self.min_turn_secs:g}) must not be above "
                             f"min_speech_secs ({self.min_speech_secs:g})")
        if self.early_reply_secs is not None and self.early_reply_secs <= 0:
            raise ValueError("TurnCaptureParams.early_reply_secs must be > 0 (or None: wait for the VAD)")
        if self.incremental_asr_every_secs <= 0:
            raise ValueError("TurnCaptureParams.incremental_asr_every_secs must be > 0 (or set incremental_asr=False)")


@dataclass
class _TurnASR:
    """The built-in ASR's work on one turn: its incremental state and the (start, end) times of
    every job run for it on the listening thread."""

    transcript: Any  # pipecat_taste.asr.TurnTranscript, or None: one transcription at the end
    jobs: list[tuple[float, float]] = field(default_factory=list)
    requested_samples: int = 0  # turn audio (input rate) when the last partial was requested

    def run(self, fn, *args):
        """``fn(*args)`` on the worker thread, timed."""
        started = time.monotonic()
        try:
            return fn(*args)
        finally:
            self.jobs.append((started, time.monotonic()))

    def work_after(self, t: float) -> float:
        """Seconds of ASR compute after ``t``."""
        return sum(max(0.0, end - max(start, t)) for start, end in self.jobs)


@dataclass
class _CapturedTurn:
    turn_id: int
    audio: np.ndarray  # float32 at the input rate
    sample_rate: int
    vad_start_at: float
    vad_stop_at: float
    speech_start: float
    speech_end: float
    speech_seconds: float
    words: TurnWords
    asr: _TurnASR | None = None
    # Early hand-over: until the VAD confirms, frames meant for others wait in ``deferred``.
    tentative: bool = False
    confirmed: bool = False
    retracted: asyncio.Event = field(default_factory=asyncio.Event)
    pushed: bool = False  # its TasteUserTurnFrame went downstream
    deferred: list = field(default_factory=list)  # coroutine functions to run on confirmation
    dropped: str | None = None  # why it is no turn to answer (decided by the finisher, in order)
    over_agent: bool = False  # it began while the agent was answering or speaking
    after_split: bool = False  # it goes on from a turn closed at the length limit
    long_enough: bool = False  # it had min_speech_secs of speech: it muted earlier replies (or barged in)


_NO_AUDIO = np.zeros(0, np.float32)
FOLLOW_SECS = 0.02  # input is followed (VAD, pauses, pre-roll) in slices of at most this length
NO_UPSTREAM_VAD_WARNING_SECS = 20.0  # audio without an upstream VAD frame before a capture that follows one says so
TRANSCRIPT_LATENCY_SECS = 0.1  # from a reply's start to its turn's transcript at the user aggregator, at most
USER_SPEAKING_PERIOD_SECS = 0.2  # UserSpeakingFrame while the caller speaks, as often as Pipecat's VADProcessor


@dataclass
class _EndOfCall:
    """The EndFrame, queued behind the turns still being finished."""
    frame: EndFrame
    direction: FrameDirection


class TasteTurnCapture(FrameProcessor):
    def __init__(self, call: TasteCall, *, vad_analyzer: VADAnalyzer | None = None,
                 params: TurnCaptureParams | None = None, **kwargs):
        super().__init__(**kwargs)
        self._call = call
        self._vad = vad_analyzer
        call.join(self)
        self._params = params or TurnCaptureParams()
        self._sample_rate = 16000
        self._ring: collections.deque[np.ndarray] = collections.deque()
        self._ring_samples = 0
        self._vad_state = VADState.QUIET
        self._capturing = False
        self._turn_chunks: list[np.ndarray] = []
        self._turn_samples = 0
        self._turn_id: int | None = None
        self._vad_start_at = 0.0
        self._long_enough = False  # the current turn has min_speech_secs of speech: it mutes and barges in
        self._over_agent = False  # the current turn began while the agent was answering or speaking
        self._after_split = False  # the current turn goes on from one closed at the length limit
        self._resumed_sample: int | None = None  # where the caller spoke again after an early hand-over
        self._words: TurnWords | None = None  # the current turn's upstream transcript
        self._transcripts = UpstreamTranscripts(self._params.transcript_quiet_secs, call.log, owner=str(self))
        self._finish_queue: asyncio.Queue | None = None
        self._finisher: asyncio.Task | None = None
        # Sample clock of the input: turn lengths are measured in audio, not in wall-clock time.
        self._samples_seen = 0
        self._stt_before = False  # an STT service sits before the capture (found at the StartFrame)
        # Set-up mistakes, said once per call: an upstream VAD beside our own (its frames are
        # dropped: they would go downstream twice), no upstream VAD to follow (no turn ever ends).
        self._upstream_vad_seen = False
        self._vad_warned = False
        self._start_sample = 0
        self._kept_until = 0  # input sample after the last closed turn's audio: the next pre-roll starts there at most
        # Incremental ASR: the current turn's state, the partial in flight, turns being finished.
        self._turn_asr: _TurnASR | None = None
        self._partial_task: asyncio.Task | None = None
        self._turns_finishing = 0
        # Early replies: where the current pause began (input samples), the turn handed on early,
        # and a lock that keeps a turn's frame before what is said about it.
        self._silence_from: int | None = None
        self._early: _CapturedTurn | None = None
        self._split_turn: _CapturedTurn | None = None  # closed at the length limit, held (``_enqueue``)
        # barge_in='pause': the speech that paused the reply, not yet known to have words -> when
        self._pauses: dict[int, float] = {}
        self._words_came = False  # words of the speech being captured came (an STT's, a partial's)
        self._turn_frames_lock = asyncio.Lock()
        self._ending = False  # an EndFrame came: no new turns; the ones already ended are finished
        self._resampler: StreamResampler | None = None  # input frames at another rate than the capture's
        self._speaking_frame_at = -(2 ** 62)  # input sample of the last UserSpeakingFrame (own VAD only)

    def can_generate_metrics(self) -> bool:
        return True

    # -- lifecycle --------------------------------------------------------------------------------
    async def setup(self, setup: FrameProcessorSetup):
        await super().setup(setup)
        await self._call.ensure_session()
        self._sample_rate = self._working_rate(setup.audio_in_sample_rate)
        early = self._params.early_reply_secs
        if self._vad is not None and early is not None and early >= self._stop_secs():
            logger.warning(f"{self}: early_reply_secs={early:g} is not below the VAD's stop_secs={self._stop_secs():g}, "
                           "so there are no early replies: set it lower, or None to wait for the VAD")
        elif early is not None and not self._call.holds_tentative_replies:
            logger.info(f"{self}: no early replies: a TasteSynthesizer without a TastePlayout would play a reply "
                        "before its turn is confirmed (add a TastePlayout to hand turns on early)")

    def _working_rate(self, input_rate: int) -> int:
        """The rate the capture keeps turns at: the pipeline's input rate, or, when the VAD cannot
        work at that rate (webrtcvad: 8/16/32/48 kHz only), the model's 16 kHz."""
        if self._vad is None:
            return input_rate
        try:
            self._vad.set_sample_rate(input_rate)
        except ValueError as e:
            # (supported: an INFO line, not the VAD's advice to change the pipeline's rate)
            logger.info(f"{self}: {type(self._vad).__name__} does not work at the pipeline's {input_rate} Hz input "
                        f"({type(e).__name__}); the capture resamples the input to 16000 Hz for the VAD and the model")
            self._vad.set_sample_rate(16000)
        # A VAD made with a rate of its own keeps it: feed it audio at that rate.
        return self._vad.sample_rate

    async def cleanup(self):
        await super().cleanup()
        await self._stop_finisher()
        if self._vad is not None:
            await self._vad.cleanup()
        await self._call.leave(self)

    async def _stop_finisher(self):
        if self._partial_task is not None:
            await self.cancel_task(self._partial_task)
            self._partial_task = None
        if self._finisher is not None:
            await self.cancel_task(self._finisher)
            self._finisher = None

    @property
    def _vad_params(self):
        return self._vad.params if self._vad is not None else None

    def _start_secs(self) -> float:
        return self._vad.params.start_secs if self._vad is not None else self._upstream_start_secs

    def _stop_secs(self) -> float:
        return self._vad.params.stop_secs if self._vad is not None else self._upstream_stop_secs

    _upstream_start_secs = 0.2
    _upstream_stop_secs = 0.2

    # -- frames -----------------------------------------------------------------------------------
    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)

        if isinstance(frame, StartFrame):
            await self.push_frame(frame, direction)
            await self._announce_service()
            self._stt_before = stt_before(self)  # (a turn without words is then a noise, not a missing STT)
            misplaced = aggregator_taking_transcripts(self)
            if misplaced is not None:
                stt, aggregator = misplaced
                logger.warning(f"{self}: the user context aggregator {aggregator} comes after {stt} and before this "
                               "capture: it takes the STT's TranscriptionFrames, which the capture needs for each "
                               "turn; put the user aggregator before the STT (the capture sends each turn's "
                               "transcript upstream to it)")
            self._finish_queue = asyncio.Queue()
            self._finisher = self.create_task(self._finish_turns())
        elif isinstance(frame, ServiceSwitcherRequestMetadataFrame):
            await self._announce_service()
        elif isinstance(frame, STTMetadataFrame) and frame.service_name != self.name:
            # an STT before the capture announced itself (at the start, or a switcher's new one): its
            # transcript latency is not the aggregator's to wait for - the capture's transcripts are
            await self.push_frame(frame, direction)
            await self._announce_service()
        elif isinstance(frame, EndFrame):
            await self._end_of_call(frame, direction)
        elif isinstance(frame, CancelFrame):
            await self._stop_finisher()
            await self.push_frame(frame, direction)
        elif isinstance(frame, InputAudioRawFrame):
            await self.push_frame(frame, direction)
            if not self._ending:
                await self._handle_audio(frame)
        elif isinstance(frame, (VADUserStartedSpeakingFrame, VADUserStoppedSpeakingFrame)) and self._vad is not None \
                and direction == FrameDirection.DOWNSTREAM:
            if not self._vad_warned:
                self._vad_warned = True
                logger.warning(f"{self}: an upstream VAD's {type(frame).__name__} reached a capture that runs its "
                               "own VAD: its frames are dropped (they would announce every turn twice); to follow "
                               "it instead, use TasteSpeechToSpeech(..., use_own_vad=False) or "
                               "TasteTurnCapture(call, vad_analyzer=None)")
        elif isinstance(frame, VADUserStartedSpeakingFrame) and self._vad is None:
            self._upstream_vad_seen = True
            self._upstream_start_secs = frame.start_secs or self._upstream_start_secs
            await self.push_frame(frame, direction)
            await self._speech_started(time.monotonic())
        elif isinstance(frame, VADUserStoppedSpeakingFrame) and self._vad is None:
            self._upstream_stop_secs = frame.stop_secs or self._upstream_stop_secs
            await self.push_frame(frame, direction)
            await self._speech_stopped(time.monotonic())
        elif isinstance(frame, (BotStartedSpeakingFrame, BotStoppedSpeakingFrame)) and not self._call.has_playout:
            # The transport's word on playback (it reaches us upstream): the playout keeps this when
            # the pipeline has one; without it, a reply still playing must stay interruptible.
            self._call.bot_speaking = isinstance(frame, BotStartedSpeakingFrame)
            await self.push_frame(frame, direction)
        elif isinstance(frame, TranscriptionFrame) and direction == FrameDirection.DOWNSTREAM:
            # consumed: the turn's transcript goes upstream once the turn is handed on
            if (frame.text or "").strip():  # (an STT heard words: a VAD should have heard speech)
                self._warn_without_vad("before the first transcript")
            current = self._capturing and self._transcripts.for_current()  # (not an earlier turn's late words)
            self._transcripts.add(frame.text, frame.finalized, frame, self._samples_seen,
                                  current=self._words if self._capturing else None)
            if current and _has_words(frame.text):
                await self._words_heard(self._turn_id)
        elif isinstance(frame, InterimTranscriptionFrame) and direction == FrameDirection.DOWNSTREAM:
            # consumed by a paused reply only; but an STT's interim words say it is there as its
            # final words would: 'auto' waits for them from now on (the first turn too, instead of
            # racing the built-in ASR for first_transcript_grace_secs)
            if _has_words(frame.text):
                self._transcripts.seen = True
            if self._capturing and _has_words(frame.text) and self._transcripts.for_current():
                await self._words_heard(self._turn_id)
            await self.push_frame(frame, direction)
        elif isinstance(frame, InterruptionFrame):  # another's (an RTVI client's): no reply is paused any more
            self._pauses.clear()
            await self.push_frame(frame, direction)
        else:
            await self.push_frame(frame, direction)

    async def _announce_service(self):
        """Tell Pipecat's context aggregators that a speech-to-speech service decides the turns (as
        Pipecat's realtime services do): they then follow our UserStarted/StoppedSpeaking frames
        instead of running turn strategies of their own on the VAD frames, which would re-announce
        every turn and interrupt the bot for a cough."""
        # A realtime service's user aggregator writes the caller's words a transcript latency after the
        # reply starts (1 s by default): a barge-in sooner had the cut reply written before the turn it
        # answers. The capture sends a turn's transcript before its reply can start, so little is needed.
        metadata = ((LLMServiceMetadataFrame, dict(is_realtime_service=True,
                                                   user_turn_strategies=ExternalUserTurnStrategies())),
                    (STTMetadataFrame, dict(ttfs_p99_latency=TRANSCRIPT_LATENCY_SECS)))
        for frame_type, fields in metadata:
            await self.broadcast_frame(frame_type, service_name=self.name, **fields)
        around = switcher_after_aggregator(self)
        if around is not None:  # (Pipecat's switcher passes its active service's metadata only)
            aggregator, switcher = around
            for frame_type, fields in metadata:
                await aggregator.queue_frame(frame_type(service_name=self.name, **fields), FrameDirection.UPSTREAM)
            logger.debug(f"{self}: service metadata handed to {aggregator} directly: {switcher} would drop it")

    async def _end_of_call(self, frame: EndFrame, direction: FrameDirection):
        """EndFrame: the turns the caller has ended are still transcribed and handed on (a turn
        handed on early is confirmed: no more speech can retract it); speech still going on is
        not a turn yet and is dropped; speech the caller paused after (the VAD was making sure of
        its end) is a turn: nothing can follow it now. The EndFrame follows the last turn out."""
        self._ending = True
        if self._capturing:
            pause = None
            if self._vad is not None and self._vad_state == VADState.STOPPING and self._silence_from is not None:
                pause = (self._samples_seen - self._silence_from) / self._sample_rate
            if self._vad is not None and self._vad_state != VADState.QUIET:
                await self.broadcast_frame(VADUserStoppedSpeakingFrame, stop_secs=0.0)
            await self._speech_stopped(time.monotonic(), keep=self._early is not None or pause is not None,
                                       silence_secs=pause)
        self._transcripts.end_of_call()
        if self._finish_queue is None:
            await self.push_frame(frame, direction)
        else:
            self._finish_queue.put_nowait(_EndOfCall(frame, direction))

    def _warn_without_vad(self, when: str) -> None:
        """Once, for a capture that follows an upstream VAD which has sent nothing yet."""
        if self._vad is not None or self._upstream_vad_seen or self._vad_warned:
            return
        self._vad_warned = True
        logger.warning(f"{self}: no VADUserStartedSpeakingFrame {when}: this capture has no VAD of its own "
                       "(vad_analyzer=None, or TasteSpeechToSpeech(use_own_vad=False)) and follows an upstream one; "
                       "without a VADProcessor before it no turn is ever heard: put one there, or give the capture "
                       "its own (TasteTurnCapture(call, vad_analyzer=WebRTCVADAnalyzer()); TasteSpeechToSpeech has "
                       "one by default)")

    async def _handle_audio(self, frame: InputAudioRawFrame):
        now = time.monotonic()
        if frame.num_channels < 1 or len(frame.audio) % (2 * frame.num_channels):  # skipped, the call goes on
            logger.warning(f"{self}: an InputAudioRawFrame of {len(frame.audio)} bytes is not whole 16-bit samples "
                           f"of {frame.num_channels} channel(s), skipped: the transport or resampler before the "
                           "capture sends broken audio")
            return
        if self._samples_seen > NO_UPSTREAM_VAD_WARNING_SECS * self._sample_rate:
            self._warn_without_vad(f"in the call's first {NO_UPSTREAM_VAD_WARNING_SECS:.0f} s of audio")
        if frame.num_channels != 1:
            samples = pcm16_to_float(frame.audio).reshape(-1, frame.num_channels).mean(axis=1)
        else:
            samples = pcm16_to_float(frame.audio)
        if frame.sample_rate != self._sample_rate or self._resampler is not None:
            samples = self._to_working_rate(samples, frame.sample_rate)
        pcm = None
        if self._vad is not None:
            as_is = frame.sample_rate == self._sample_rate and frame.num_channels == 1 and len(frame.audio) == 2 * samples.size
            pcm = frame.audio if as_is else float_to_pcm16(samples)
        # A long frame (a phone stream's media messages last up to 1.5 s) is followed in slices:
        # the VAD's state after a whole frame would place a pause that began at its end at its
        # start (an early hand-over then trimmed the caller's last words as silence), and the
        # pre-roll would keep the whole frame.
        step = max(1, int(FOLLOW_SECS * self._sample_rate))
        for at in range(0, max(samples.size, 1), step):
            if self._ending:  # (the EndFrame came while a slice waited on the VAD: the call's audio ends there)
                return
            await self._follow_audio(samples[at:at + step], None if pcm is None else pcm[2 * at:2 * (at + step)], now)

    async def _follow_audio(self, samples: np.ndarray, pcm: bytes | None, now: float):
        """One slice of input (``pcm``: the same samples as 16-bit PCM for the VAD)."""
        self._remember(samples)
        rest, split = samples, False
        if self._capturing:
            limit = int(self._max_turn_seconds() * self._sample_rate)
            while self._capturing and self._turn_samples + rest.size >= limit:
                # The audio tower has a fixed window: close this turn at it and go on in a new one
                # (with the rest of the slice). The closed turn waits until the new one proves to be
                # speech (then it gets no reply: the caller is still talking) or ends without (then
                # it does: the split only cut the last syllable or the closing silence off).
                head, rest = rest[:limit - self._turn_samples], rest[limit - self._turn_samples:]
                self._turn_chunks.append(head)
                self._turn_samples += head.size
                self._samples_seen += head.size  # (the closed turn ends here, the new one starts here)
                logger.info(f"{self}: turn {self._turn_id} reached {self._max_turn_seconds():.0f} s, splitting it")
                if self._early is not None:  # in the pause after an early hand-over: the split decides,
                    await self._retract(now)  # not a confirmation the VAD never gave
                await self._speech_stopped(now, forced=True)
                await self._speech_started(now, forced=True)
                split = True
        self._samples_seen += rest.size
        if self._capturing and rest.size:
            self._turn_chunks.append(rest)
            self._turn_samples += rest.size
        if self._capturing and not split:
            self._maybe_partial()
        if self._vad is None:
            await self._speech_heard(now)
            return
        state = await self._vad.analyze_audio(pcm)
        if self._ending:  # the EndFrame came while the VAD judged this slice: no turn starts or ends in it
            return
        previous, self._vad_state = self._vad_state, state
        if state == VADState.SPEAKING and previous in (VADState.QUIET, VADState.STARTING):
            await self.broadcast_frame(VADUserStartedSpeakingFrame, start_secs=self._vad.params.start_secs)
            await self._speech_started(now)
        elif state == VADState.QUIET and previous in (VADState.SPEAKING, VADState.STOPPING):
            await self.broadcast_frame(VADUserStoppedSpeakingFrame, stop_secs=self._vad.params.stop_secs)
            await self._speech_stopped(now)
        else:
            await self._follow_pause(state, samples.size, now)
        if state == VADState.SPEAKING and \
                self._samples_seen - self._speaking_frame_at >= USER_SPEAKING_PERIOD_SECS * self._sample_rate:
            # as Pipecat's VADProcessor does: keeps the pipeline's idle timeout from ending a long turn
            self._speaking_frame_at = self._samples_seen
            await self.broadcast_frame(UserSpeakingFrame)
        await self._speech_heard(now, speaking=state == VADState.SPEAKING)

    async def _follow_pause(self, state: VADState, new_samples: int, now: float):
        """Early replies: hand the turn on after ``early_reply_secs`` of a pause; take it back if
        the caller speaks again before the VAD confirms the end."""
        if state == VADState.STOPPING:
            if self._silence_from is None:
                self._silence_from = self._samples_seen - new_samples
            early = self._params.early_reply_secs
            silence = (self._samples_seen - self._silence_from) / self._sample_rate
            if (self._capturing and self._early is None and early is not None and early < self._stop_secs()
                    and silence >= early and self._call.holds_tentative_replies):
                await self._end_early(now, silence)
        elif state == VADState.SPEAKING:
            self._silence_from = None
            if self._early is not None:
                await self._retract(now)

    def _to_working_rate(self, samples: np.ndarray, input_rate: int) -> np.ndarray:
        """Input at another rate goes through one resampling stream (its filter runs across frames:
        converting frame by frame would put a click at every frame boundary). When the input rate
        changes (a transport switching codecs) the old stream's tail is flushed first: no audio is
        lost or reordered."""
        pieces = []
        if self._resampler is not None and self._resampler.from_rate != input_rate:
            pieces.append(self._resampler.flush())
            self._resampler = None
        if input_rate != self._sample_rate and self._resampler is None:
            self._resampler = StreamResampler(input_rate, self._sample_rate)
        pieces.append(self._resampler(samples) if self._resampler is not None else samples)
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def _max_turn_seconds(self) -> float:
        session = self._call.session
        limit = getattr(session, "max_turn_seconds", 30.0) if session is not None else 30.0
        return max(1.0, limit - 0.5)

    def _remember(self, samples: np.ndarray) -> None:
        """Keep the last start_secs + pre_roll_secs of audio (the turn's pre-roll)."""
        self._ring.append(samples)
        self._ring_samples += samples.size
        keep = int((self._start_secs() + self._params.pre_roll_secs) * self._sample_rate) + samples.size
        while self._ring and self._ring_samples - self._ring[0].size >= keep:
            self._ring_samples -= self._ring.popleft().size

    # -- turn boundaries --------------------------------------------------------------------------------
    async def _speech_started(self, now: float, forced: bool = False):
        if self._capturing:
            return
        self._capturing = True
        self._silence_from = None
        self._turn_id = self._call.new_turn_id()
        self._long_enough = False
        self._words_came = False
        self._over_agent = self._call.agent_busy
        self._after_split = forced
        self._resumed_sample = None
        self._vad_start_at = now
        self._start_sample = self._samples_seen - (0 if forced else int(self._start_secs() * self._sample_rate))
        self._words = self._transcripts.new_turn(now, self._start_secs())
        self._turn_asr = self._new_turn_asr()
        if forced:
            self._turn_chunks, self._turn_samples = [], 0
        else:
            self._turn_chunks = list(self._ring)
            # (not the last turn's audio: with a stop shorter than the pre-roll the ring still holds its end)
            overlap = self._kept_until - (self._samples_seen - self._ring_samples)
            if overlap > 0:
                self._turn_chunks = [np.concatenate(self._turn_chunks)[overlap:]]
            self._turn_samples = sum(c.size for c in self._turn_chunks)
        record = self._call.log.turn(self._turn_id)
        record.vad_start_at = now
        record.speech_start = now - (0.0 if forced else self._start_secs())
        self._call.log.event("user_speech_started", self._turn_id)
        if not forced:
            await self.broadcast_frame(UserStartedSpeakingFrame)
        await self._speech_heard(now)

    async def _speech_heard(self, now: float, speaking: bool = True):
        """Mute earlier replies and barge in only once the turn has min_speech_secs of speech: a
        shorter one is ignored as noise (a cough, an 'mm') and must not silence the agent."""
        if not self._capturing or self._long_enough:
            return
        heard = (self._samples_seen - self._start_sample) / self._sample_rate
        need = self._params.min_speech_secs
        if self._vad is None:  # no VAD state here: long enough once its stop could no longer make it short
            need += self._stop_secs()
        if not speaking or heard < need:
            return
        self._long_enough = True
        self._call.mutes.mute(self._turn_id)  # earlier turns not yet answered: not any more (if this is a turn)
        if self._split_turn is not None:  # the speech went on: this part answers for the one before
            self._split_turn.words.goes_on_in(self._words)
        self._release_split()  # (muted now, before its reply could begin)
        if self._params.interrupt_on_speech and self._call.agent_busy:
            if self._params.barge_in == "pause" and self._call.has_playout and not self._words_came:
                await self._pause_reply(now)
            else:
                await self._barge_in(now, self._turn_id)

    async def _pause_reply(self, now: float):
        """The caller's speech may be a sound, not a turn: the playout holds the reply until its
        words (``_words_heard``: cut it off) or their absence (``_settle_pause``: resume it) say."""
        self._pauses[self._turn_id] = now
        self._call.log.event("reply_paused", self._call.active_reply_turn, by_turn=self._turn_id)
        await self.push_frame(TasteReplyPauseFrame(self._turn_id, paused=True))

    async def _words_heard(self, turn_id: int | None):
        """``turn_id``'s speech has words: if it paused the reply, the pause was a barge-in (if it
        has not yet, it will barge in without one)."""
        if self._capturing and turn_id == self._turn_id:
            self._words_came = True
        await self._cut_paused_reply(turn_id)

    async def _cut_paused_reply(self, turn_id: int):
        """The speech of ``turn_id`` paused the reply and stands: the pause was a barge-in."""
        paused_at = self._pauses.pop(turn_id, None)
        if paused_at is None:
            return
        if self._call.agent_busy:
            await self._barge_in(paused_at, turn_id)
        else:  # the reply ended meanwhile (it had been fully heard): nothing to cut, the playout forgets the pause
            await self.push_frame(TasteReplyPauseFrame(turn_id, paused=False))

    async def _settle_pause(self, turn: _CapturedTurn):
        """A finished turn that paused the reply and brought no words (a noise, a failure) resumes
        it; one handed on early, once the VAD confirms it (a retraction moves the pause to the
        speech that goes on, as it does its mute). Speech the call ended during stands, as its mute
        does: the caller was still talking over the reply, which is cut off, not resumed over them."""
        if turn.retracted.is_set() or turn.turn_id not in self._pauses:
            return
        if turn.dropped is not None:
            await self._cut_paused_reply(turn.turn_id)
            return
        if turn.tentative and not turn.confirmed:
            async def resume_when_confirmed():
                await self._resume_reply(turn.turn_id)
            turn.deferred.append(resume_when_confirmed)
            return
        await self._resume_reply(turn.turn_id)

    async def _resume_reply(self, turn_id: int):
        if self._pauses.pop(turn_id, None) is None:  # (its words came meanwhile: a barge-in)
            return
        self._call.log.event("reply_resumed", self._call.active_reply_turn, by_turn=turn_id)
        await self.push_frame(TasteReplyPauseFrame(turn_id, paused=False))

    async def _barge_in(self, now: float, by_turn: int):
        self._pauses.clear()  # the interruption ends every pause (an earlier sound's verdict no longer matters)
        active = self._call.active_reply_turn
        if active is None and self._call.bot_speaking and not self._call.has_playout:
            # generated already and playing in the transport: the latest reply is the one playing
            replies = [t.turn_id for t in self._call.log.turns.values() if t.decision == "reply"]
            active = max(replies, default=None)
        if active is not None:
            record = self._call.log.turn(active)
            if record.barge_in_at is None:
                record.barge_in_at = now
                record.interrupted = True
        self._call.log.event("barge_in", active, by_turn=by_turn)
        logger.debug(f"{self}: barge-in on turn {active} by turn {by_turn}")
        # Not broadcast_interruption(): it also empties this processor's own queue, where the frames
        # waiting are the caller's (an STT's words right behind the ones that made the barge-in)
        await self.stop_all_metrics()
        await self.broadcast_frame(InterruptionFrame)

    async def _speech_stopped(self, now: float, forced: bool = False, keep: bool = True,
                              silence_secs: float | None = None):
        """The turn being captured ends (``keep=False``: dropped, the call is ending) after
        ``silence_secs`` of silence (by default the VAD's stop_secs; none when ``forced``)."""
        if not self._capturing:
            return
        self._capturing = False
        self._silence_from = None
        stop_secs = silence_secs if silence_secs is not None else 0.0 if forced else self._stop_secs()
        early, self._early = self._early, None
        if early is None:
            turn = self._close_turn(now, stop_secs)
        else:  # handed on early: the VAD now confirms it
            record = self._call.log.turn(early.turn_id)
            record.vad_stop_at, record.speech_end = now, now - stop_secs
        self._turn_chunks, self._turn_samples = [], 0
        self._turn_asr = None
        self._call.log.event("user_speech_stopped", self._turn_id)
        if not forced:
            await self.broadcast_frame(UserStoppedSpeakingFrame)
        self._release_split()  # (not muted: this turn never had min_speech_secs of speech)
        if early is not None:
            await self._confirm(early)
        else:
            if not keep:
                turn.dropped = "the call ended while the caller was speaking"
            self._enqueue(turn, held=forced)

    def _close_turn(self, now: float, silence_secs: float) -> _CapturedTurn:
        """The current turn's audio up to ``post_roll_secs`` after its estimated end (``silence_secs``
        before ``now``), and its record."""
        audio = np.concatenate(self._turn_chunks) if self._turn_chunks else np.zeros(0, np.float32)
        trim = int(max(0.0, silence_secs - self._params.post_roll_secs) * self._sample_rate)
        if trim and audio.size > trim:
            audio = audio[: audio.size - trim]
        else:
            trim = 0
        self._kept_until = self._samples_seen - trim
        record = self._call.log.turn(self._turn_id)
        record.vad_stop_at = now
        record.speech_end = now - silence_secs
        record.audio_seconds = audio.size / self._sample_rate
        end_sample = self._samples_seen - int(silence_secs * self._sample_rate)
        record.speech_seconds = max(0.0, (end_sample - self._start_sample) / self._sample_rate)
        if self._after_split and record.speech_seconds < self._params.min_turn_secs:
            self._words.stands_alone()  # (the closing silence, not speech, made it long enough to mute)
        resumed = self._resumed_sample  # a click that took an early hand-over back brings no new words
        words_follow = resumed is None or (end_sample - resumed) / self._sample_rate >= self._params.min_speech_secs
        self._words.close(now, record.speech_end, end_sample, words_follow)
        return _CapturedTurn(self._turn_id, audio, self._sample_rate, self._vad_start_at, now,
                             record.speech_start, record.speech_end, record.speech_seconds, self._words, self._turn_asr,
                             over_agent=self._over_agent, after_split=self._after_split,
                             long_enough=self._long_enough)

    def _enqueue(self, turn: _CapturedTurn, held: bool = False) -> None:
        """Hand the closed turn to the finisher; a turn closed at the length limit is ``held`` until
        the next one shows whether the caller went on speaking (``_release_split``). Either way it
        takes its upstream words from now on."""
        if self._finish_queue is None:
            return
        self._turns_finishing += 1
        if turn.dropped is None and turn.speech_seconds >= self._params.min_turn_secs \
                and self._params.transcripts != "asr":
            self._transcripts.expect(turn.words)
        if held:
            self._split_turn = turn
        else:
            self._release_split()  # turns are finished in order
            self._finish_queue.put_nowait(turn)

    def _release_split(self) -> None:
        turn, self._split_turn = self._split_turn, None
        if turn is not None:
            self._finish_queue.put_nowait(turn)

    # -- early replies ------------------------------------------------------------------------------------
    async def _end_early(self, now: float, silence_secs: float):
        """Hand the turn on before the VAD confirms its end (it goes on capturing meanwhile)."""
        speech = (self._silence_from - self._start_sample) / self._sample_rate
        if speech < self._params.min_speech_secs:
            return  # the VAD's end decides what to do with it
        turn = self._close_turn(now, silence_secs)
        turn.tentative = True
        turn.words.handed_on_early()
        self._call.log.turn(turn.turn_id).early_end_at = now
        self._call.log.event("user_turn_early", turn.turn_id, silence_ms=round(1000 * silence_secs))
        if self._turn_asr is not None:
            self._turn_asr.requested_samples = self._turn_samples  # no partial of the pause
        self._early = turn
        self._enqueue(turn)

    async def _retract(self, now: float):
        """The caller speaks again: take the early turn back; the speech goes on as a new turn."""
        early, self._early = self._early, None
        self._resumed_sample = self._samples_seen
        early.retracted.set()
        self._transcripts.withdraw(early.words)
        old = self._call.log.retract(early.turn_id)
        self._call.log.event("user_turn_retracted", early.turn_id)
        self._turn_id = self._call.new_turn_id()
        self._call.mutes.move(early.turn_id, self._turn_id)
        paused_at = self._pauses.pop(early.turn_id, None)
        if paused_at is not None:  # its verdict is the speech's that goes on: the playout's pause too
            self._pauses[self._turn_id] = paused_at
            await self.push_frame(TasteReplyPauseFrame(self._turn_id, paused=True))
            await self.push_frame(TasteReplyPauseFrame(early.turn_id, paused=False))
        record = self._call.log.turn(self._turn_id)
        record.vad_start_at, record.speech_start = old.vad_start_at, old.speech_start
        record.early_retracted = old.early_retracted + 1
        self._words = self._words.continuation()  # and waits for the transcript of what follows
        async with self._turn_frames_lock:
            if early.pushed:
                await self.push_frame(TasteTurnStatusFrame(early.turn_id, "retracted"))

    async def _confirm(self, turn: _CapturedTurn):
        turn.words.confirmed(time.monotonic())  # (an STT's last words come after the VAD's end)
        async with self._turn_frames_lock:
            while turn.deferred:  # in order, including any added meanwhile
                await turn.deferred.pop(0)()
            turn.confirmed = True
            if turn.pushed:
                await self.push_frame(TasteTurnStatusFrame(turn.turn_id, "confirmed"))

    async def _announce(self, turn: _CapturedTurn, announce) -> None:
        """Run ``announce`` (pushes frames about the turn) now, or for a tentative turn once it is
        confirmed; never for a retracted one."""
        if turn.retracted.is_set():
            return
        if turn.tentative and not turn.confirmed:
            turn.deferred.append(announce)
            return
        await announce()

    # -- finishing turns (in order, off the input path) ---------------------------------------------
    async def _finish_turns(self):
        while True:
            turn = await self._finish_queue.get()
            if isinstance(turn, _EndOfCall):  # every turn before it is out
                await self.push_frame(turn.frame, turn.direction)
                return
            try:
                await self._finish(turn)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a failing turn must not end the call
                await self._fail(turn, f"could not process the user's turn: {e}", e)
            finally:
                self._turns_finishing -= 1
                self._transcripts.stop(turn.words)
                self._settle_mute(turn)
                await self._settle_pause(turn)
                turn.audio = _NO_AUDIO  # not needed any more (a tentative turn lives on until confirmed)

    def _settle_mute(self, turn: _CapturedTurn) -> None:
        """A turn that muted earlier replies keeps the mute if it was handed on (it answers for them)
        or the call is ending; one that is not answered (no words, or it failed) lifts it: they are
        answered after all. A turn handed on early is settled once the VAD confirms it (a retraction
        moves its mute to the speech that goes on)."""
        if turn.tentative and not turn.confirmed:
            if not turn.retracted.is_set():
                async def settle_when_confirmed():
                    self._call.mutes.settle(turn.turn_id, keep=turn.pushed)
                turn.deferred.append(settle_when_confirmed)
            return
        self._call.mutes.settle(turn.turn_id, keep=turn.pushed or turn.dropped is not None)

    async def _finish(self, turn: _CapturedTurn):
        record = self._call.log.turn(turn.turn_id)
        if turn.dropped is not None:
            await self._decide(turn, "ignored", turn.dropped)
            return
        if turn.speech_seconds < self._params.min_turn_secs:
            await self._decide(turn, "ignored", f"speech too short ({turn.speech_seconds:.2f} s)")
            return
        if turn.speech_seconds < self._params.min_speech_secs and (turn.over_agent or turn.after_split) \
                and not turn.long_enough:  # (one that muted or barged in is a turn)
            # an 'mm-hm' while the agent talks (a backchannel; a 'yes' after it is a turn), or the last
            # syllable of a turn split at the length limit (the part before it is answered)
            where = "after the split" if turn.after_split else "over the agent's reply"
            await self._decide(turn, "ignored", f"short speech ({turn.speech_seconds:.2f} s) {where}")
            return
        # its ASR and tower passes come next: another call's turn ending now waits a little for them
        session = await self._call.ensure_session()
        asr_turn = turn.asr.transcript if turn.asr else None
        session.turn_ended(asr_turn)
        try:
            await self._tokenize(turn, record, session, asr_turn)
        finally:  # what it announced and did not bring (no words, a failure) is not waited for any more
            session.turn_withdrawn(asr_turn)

    async def _tokenize(self, turn: _CapturedTurn, record, session, asr_turn) -> None:
        """The turn's transcript, then its TASTE tokens, handed on as a ``TasteUserTurnFrame``."""
        transcript = await self._transcript(turn)
        # the built-in ASR's final pass ran, or will not (an STT's words are the transcript)
        session.turn_withdrawn(asr_turn, tower=False)
        if transcript is None or turn.retracted.is_set():
            return
        if not _has_words(transcript):  # e.g. an ASR's "." for a noise: nothing to answer
            await self._decide(turn, "ignored", f"no words in the transcript {transcript!r}")
            return
        await self._words_heard(turn.turn_id)  # a barge-in now, if its speech paused the reply
        record.transcript = transcript
        audio16k = resample(turn.audio, turn.sample_rate, session.input_sample_rate)
        await self.start_processing_metrics()
        try:
            # (the built-in ASR's final pass may have encoded the turn for the tower too: ``heard``)
            heard = () if turn.asr is None or turn.asr.transcript is None else (turn.asr.transcript,)
            user_turn = await self._call.run("listen", session.user_turn, audio16k, transcript, *heard)
        except Exception as e:
            await self.stop_processing_metrics()
            await self._fail(turn, f"could not tokenize the user's speech ({transcript!r}): {e}", e)
            return
        await self.stop_processing_metrics()
        record.tokenized_at = time.monotonic()
        self._call.log.event("user_turn_tokenized", turn.turn_id, tokens=user_turn.n_tokens)
        await self._announce(turn, lambda: self._transcript_upstream(turn, transcript))
        async with self._turn_frames_lock:
            if turn.retracted.is_set():
                return
            turn.pushed = True
            await self.push_frame(TasteUserTurnFrame(turn.turn_id, transcript, user_turn, turn.speech_start,
                                                     turn.speech_end, tentative=turn.tentative and not turn.confirmed))

    async def _transcript_upstream(self, turn: _CapturedTurn, transcript: str) -> None:
        """The turn's transcript goes upstream (to a user context aggregator before the STT). Words
        from an upstream STT go as copies of its frames, each marked as the upstream sibling of its
        original (as ``broadcast_frame`` pairs them): observers (RTVI) then report the caller's words
        once, and a ParallelPipeline (a ServiceSwitcher of STTs), which drops a frame id it has seen,
        lets the copies through."""
        words = turn.words
        if words.frames and len(words.frames) == len(words.parts) and transcript == words.text():
            for original in words.frames:
                frame = TranscriptionFrame(original.text, original.user_id, original.timestamp,
                                           language=original.language, result=original.result,
                                           finalized=original.finalized)
                frame.broadcast_sibling_id = original.id
                await self.push_frame(frame, FrameDirection.UPSTREAM)
        else:
            await self.push_frame(TranscriptionFrame(transcript, self._params.user_id, time_now_iso8601(), finalized=True),
                                  FrameDirection.UPSTREAM)

    def _upstream_wait_secs(self) -> float:
        params = self._params
        if params.transcripts == "auto" and not self._transcripts.seen and self._call.engine.has_asr:
            return min(params.first_transcript_grace_secs, params.transcript_timeout_secs)
        return params.transcript_timeout_secs

    async def _transcript(self, turn: _CapturedTurn) -> str | None:
        mode = self._params.transcripts
        before = turn.words.previous_part
        if mode == "auto" and before is not None and before.by_asr:
            # a split speech takes its words from one source: an STT's one transcript for the whole
            # speech would say again the words the built-in ASR heard in the part before
            mode = "asr"
            self._transcripts.absorb(turn.words, self._params.transcript_timeout_secs)
            for _, text in turn.words.parts:
                self._transcripts.drop(text, "the built-in ASR transcribes the speech it is about")
        asr = turn.asr or _TurnASR(None)
        built_in = None  # the built-in ASR's transcription, when it races an STT that may not be there
        try:
            if mode in ("auto", "upstream"):
                # a split turn's STT words may all come when the speech ends (when an STT is known to be there)
                split_waits = mode == "upstream" or self._transcripts.seen or not self._call.engine.has_asr
                if mode == "auto" and not split_waits:
                    # No STT has spoken in this call (yet): the built-in ASR starts now, beside the
                    # grace wait for an STT's words. Without one (the bundled page, a phone stream)
                    # the wait would delay every turn; if words come first, they are the transcript.
                    built_in = asyncio.ensure_future(self._built_in_transcript(turn, asr))
                    built_in.add_done_callback(_retrieve_exception)  # (its result unused when the STT wins)
                await self._wait_for_words(turn, split_waits, built_in)
                self._transcripts.stop(turn.words)  # taken: later words belong to the next turn
                if turn.retracted.is_set():
                    return None
                if turn.words.parts:
                    return turn.words.text()
                if split_waits and turn.words.spent:  # the part after it is answered for both, with their words
                    await self._decide(turn, "ignored", "no words of its own: the STT's words for the speech split "
                                                        "here came after it ended, with the last part")
                    return None
                stt_there = self._transcripts.seen or self._stt_before
                if stt_there and (mode == "upstream" or not self._call.engine.has_asr):
                    # the STT is there (it spoke this call, or sits before the capture) and had nothing to
                    # say of this one: a noise
                    await self._decide(turn, "ignored", "the STT sent no words for it")
                    return None
                if mode == "upstream":
                    await self._fail(turn, f"no transcript arrived within {self._params.transcript_timeout_secs} s "
                                                    "(is an STT service upstream of TasteTurnCapture?)")
                    return None
                # the built-in ASR steps in; an STT's words for this turn may still be on their way (the
                # first turns wait only a grace period): they must not become the next turn's
                self._transcripts.absorb(turn.words, self._params.transcript_timeout_secs)
            try:
                text = await (built_in if built_in is not None else self._built_in_transcript(turn, asr))
            except NotImplementedError as e:
                await self._fail(turn, f"no transcript for this turn: {e}", e)
                return None
            finally:
                self._record_asr(turn, asr)
        finally:
            if built_in is not None and not built_in.done():
                built_in.cancel()  # its transcript is not used (a job not started yet never runs)
        if not text.strip():
            await self._decide(turn, "ignored", "the ASR heard no words")
            return None
        return text.strip()

    async def _wait_for_words(self, turn: _CapturedTurn, split_waits: bool, built_in: asyncio.Future | None) -> None:
        """Until an upstream STT's words for the turn are in (``UpstreamTranscripts.wait``) - or,
        racing the built-in ASR, until that is done first with no word come."""
        waiting = asyncio.ensure_future(
            self._transcripts.wait(turn.words, self._upstream_wait_secs, turn.retracted, split_waits))
        try:
            if built_in is not None:
                await asyncio.wait({waiting, built_in}, return_when=asyncio.FIRST_COMPLETED)
                if not waiting.done() and not turn.words.parts:
                    return  # the ASR was first, and no STT spoke (an STT that began speaking is waited for)
            await waiting
        finally:
            waiting.cancel()

    async def _built_in_transcript(self, turn: _CapturedTurn, asr: _TurnASR) -> str:
        """The turn's transcript from the built-in ASR (its partials' work finished)."""
        session = await self._call.ensure_session()
        audio16k = resample(turn.audio, turn.sample_rate, session.input_sample_rate)
        return await self._call.run("listen", asr.run, asr.transcript.finish if asr.transcript else session.transcribe,
                                    audio16k)

    def _record_asr(self, turn: _CapturedTurn, asr: _TurnASR) -> None:
        """A turn the built-in ASR transcribed: its figures go into the turn's record."""
        record = self._call.log.turn(turn.turn_id)
        if asr.jobs:
            record.asr_after_end_ms = round(1000 * asr.work_after(turn.vad_stop_at), 1)
        record.asr_partials = getattr(asr.transcript, "partials", 0)
        record.asr_kept_tokens = getattr(asr.transcript, "kept", 0)

    # -- incremental ASR ----------------------------------------------------------------------------
    def _new_turn_asr(self) -> _TurnASR | None:
        p = self._params
        if not p.incremental_asr or p.transcripts == "upstream" or (p.transcripts == "auto" and self._transcripts.seen):
            return None
        start = getattr(self._call.session, "start_transcript", None)
        transcript = start() if start is not None else None
        return _TurnASR(transcript) if transcript is not None else None

    def _maybe_partial(self) -> None:
        """Start a partial transcription of the turn so far when enough new audio has come in and
        the listening thread is free (one partial at a time; none while a turn is finishing)."""
        asr = self._turn_asr
        if asr is None or self._turns_finishing or (self._partial_task is not None and not self._partial_task.done()):
            return
        if self._turn_samples - asr.requested_samples < self._params.incremental_asr_every_secs * self._sample_rate:
            return
        if self._params.transcripts == "auto" and self._transcripts.seen:
            return
        asr.requested_samples = self._turn_samples
        audio = np.concatenate(self._turn_chunks)
        self._partial_task = self.create_task(self._partial(asr, audio, self._turn_id), name="partial_transcript")

    async def _partial(self, asr: _TurnASR, audio: np.ndarray, turn_id: int):
        rate, target = self._sample_rate, self._call.session.input_sample_rate

        def job():
            return asr.run(lambda: asr.transcript.partial(resample(audio, rate, target)))

        try:
            text = await self._call.run("listen", job)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a partial is an optimisation: the end of the turn does not need it
            logger.warning(f"{self}: partial transcript of turn {turn_id} failed (the whole turn is transcribed at "
                           f"its end): {type(e).__name__}: {e}")
            self._call.log.event("asr_partial_failed", turn_id, error=f"{type(e).__name__}: {e}")
            return
        self._call.log.event("asr_partial", turn_id, text=text, audio_seconds=round(audio.size / rate, 2))
        if _has_words(text):
            await self._words_heard(turn_id)

    async def _decide(self, turn: _CapturedTurn, decision: str, reason: str):
        record = self._call.log.turn(turn.turn_id)
        record.decision, record.reason = decision, reason
        record.decided_at = time.monotonic()
        self._call.log.event("decision", turn.turn_id, decision=decision, reason=reason)
        await self._announce(turn, lambda: self.push_frame(TasteTurnDecisionFrame(turn.turn_id, decision, reason)))

    async def _fail(self, turn: _CapturedTurn, message: str, exception: Exception | None = None):
        self._call.log.turn(turn.turn_id).errors.append(message)
        # UNKNOWN, not a permanent category: one bad turn must not take the processor out of the call
        await self._announce(turn, lambda: self.push_error(f"turn {turn.turn_id}: {message}", exception,
                                                           category=ErrorCategory.UNKNOWN))
        await self._decide(turn, "error", message)


def _has_words(text: str | None) -> bool:
    return any(ch.isalnum() for ch in text or "")


def _retrieve_exception(task: asyncio.Future) -> None:
    """Done callback of a task that may be left unawaited: its exception is taken, not logged as lost."""
    if not task.cancelled():
        task.exception()
