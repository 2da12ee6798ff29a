"""TastePlayout: hands reply audio to the output transport in real time, and cuts it off cleanly.

Put it right before ``transport.output()``. It cuts the synthesizer's chunks into frames of the
transport's output chunk (``PlayoutParams.frame_ms``) and releases each one only when it is due
(at most ``lead_ms`` ahead of the audio being heard), so the transport never holds more than a
few tens of milliseconds of the reply.
What it has released is exactly what the caller hears; that makes three things possible:

* barge-in stops the audio within ``lead_ms`` + ``fade_out_ms``: the audio not yet released is
  dropped and replaced by a ``fade_out_ms`` fade of its first samples, which continues the
  waveform where the released audio ends (no click; when nothing unreleased has arrived yet, the
  released audio mirrored about its last sample is faded instead). Released frames are marked
  uninterruptible so that the transport plays them out instead of cutting them mid-waveform;
* the conversation keeps exactly the words that were played: a segment counts as heard when at
  least half of its audio was released (``TastePlaybackFrame`` upstream to the generator);
* per-turn metrics: end of user speech -> first bot audio, barge-in -> last bot audio.

A reply's first chunk is short (it is made as soon as the first speech tokens exist) while the
next one takes as long to make as any steady chunk, so on slower hardware the first chunk can
end before the second arrives: a gap right after the first syllable of every reply. The playout
measures, for each reply, how late each chunk of its first ``start_window_ms`` arrived against
when it was heard, and holds the first audio of the next replies for as long as the last few
replies needed (at most ``start_hold_max_ms``; less again when chunks arrive with time to spare).
The needs are remembered by the engine (``StartNeeds``), so a new call's first reply is held as
the engine's recent replies needed. On a GPU fast enough for the first chunks the hold stays at
0. The hold is part of the reported first-audio latency, and each turn's record says how much it
delayed the first audio (``start_hold_s``: none when it ran out while the reply waited for the VAD
to confirm its turn's end).

The reply to a tentative turn (handed on before the VAD confirmed the end of the caller's turn)
is synthesized while the VAD makes sure, and held here: it starts when the turn is confirmed
(``TasteTurnStatusFrame``), and is dropped unheard when the turn is retracted.

It is the one TASTE processor that tells the rest of the pipeline about a reply, in order with
its audio, as a speech-to-speech service does (so an assistant aggregator after
``transport.output()`` keeps exactly the words heard): ``LLMFullResponseStartFrame`` and
``TTSStartedFrame`` with the first audio; per segment, once it counts as heard, an ``LLMTextFrame``
(``append_to_context=False``, for RTVI's bot-llm-text) and a ``TTSTextFrame`` (``SENTENCE``, spaces
included: it is what the context keeps, and RTVI reports it as bot-output); at the end
``TTSStoppedFrame`` then ``LLMFullResponseEndFrame`` (one of each per reply, also when it is cut
off: the transport reports one BotStarted/BotStopped pair). It counts underruns (the synthesizer
not keeping up with real time) instead of hiding them, and keeps them from clicking: when a reply's
next audio has not come by the time half of ``lead_ms`` is left in the transport, one frame of the
heard audio mirrored and faded to silence goes out in its place, and the audio that comes next
fades in (the turn's record lists these gaps: ``audio_gaps``).

A barge-in that waits for words (``TurnCaptureParams.barge_in='pause'``) first pauses the reply
(``TasteReplyPauseFrame``): it fades out as at a gap (one faded frame of the heard audio, mirrored)
and the rest of it, and any reply after it, waits; resumed (the caller's sound had no words), it
fades back in where it stopped (the turn's record lists the pause in ``audio_gaps`` and its length
in ``pauses_s``); cut off, it ends as below, with nothing more to fade. The transport reports the
bot stopped during a pause longer than its own silence limit, and started again when it resumes.
A reply whose audio is all out when the pause comes has nothing left to pause; one still paused
when the call ends plays out before the ``EndFrame``.

On barge-in the fade and the ``TTSStoppedFrame`` go out first and the ``InterruptionFrame`` is
passed on (then the reply's ``LLMFullResponseEndFrame``: an aggregator keeps the words heard,
marked interrupted) once the transport reports the bot stopped (at most ``interruption_hold_secs`` later).
Passed on at once, it would find the transport's queue empty half of the time (it holds about
``lead_ms`` of audio), make it report the bot stopped, and the fade would then start a second
BotStarted/BotStopped pair for the same reply. All the reply's audio is uninterruptible, so the
transport has nothing of it to drop; what the late interruption still drops is other audio.

``EndFrame`` is queued behind the audio: it goes on once the replies before it have been heard,
so ending a call after the agent's last words is ``queue_frame(EndFrame())`` (the capture, the
generator and the synthesizer pass it on only after the turns and replies ahead of it, too).
``CancelFrame`` is a hang-up: the audio not yet released is dropped and the reply's record says
``ended_by_hangup``.
"""

from __future__ import annotations

import asyncio
import collections
import math
import numbers
import time
from dataclasses import dataclass, field

import numpy as np
from loguru import logger
from pipecat.frames.frames import (
    BotStartedSpeakingFrame,
    BotStoppedSpeakingFrame,
    CancelFrame,
    EndFrame,
    Frame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    MetricsFrame,
    StartFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.metrics.metrics import TTFBMetricsData
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor, FrameProcessorSetup
from pipecat.utils.text.base_text_aggregator import TextType

from pipecat_taste.audio import FrameSlicer, fade_in, fade_out, float_to_pcm16, pcm16_to_float, samples_for_ms
from pipecat_taste.call import TasteCall
from pipecat_taste.frames import (
    TasteAudioStartedFrame,
    TasteAudioStoppedFrame,
    TastePlaybackFrame,
    TasteReplyPauseFrame,
    TasteSegmentAudioFrame,
    TasteTurnMetricsFrame,
    TasteTurnStatusFrame,
)
from pipecat_taste.links import output_transport_after
from pipecat_taste.synthesis import context_id_for, turn_of_context


FALLBACK_FRAME_MS = 40.0  # Pipecat's default output chunk (audio_out_10ms_chunks=4)


@dataclass
class PlayoutParams:
    # Size of the frames handed to the transport. None: the chunk (audio_out_10ms_chunks x 10 ms) of
    # the output transport after the playout in its pipeline, else 40 ms (Pipecat's default chunk;
    # a whole number of 10 and 20 ms chunks too). Set it, keep
    # it a whole number of the transport's chunks: a partial chunk waits inside the transport (the
    # audio the playout counts as heard is not yet playing, eating its lead), and the transport
    # drops it if the reply stalls long enough for it to decide the bot stopped speaking.
    frame_ms: float | None = None
    lead_ms: float = 30.0  # how far ahead of the heard audio frames are released
    fade_out_ms: float = 10.0  # fade on barge-in
    prebuffer_ms: float = 0.0  # audio to collect before a reply starts (0: play the first chunk at once)
    start_hold_max_ms: float = 400.0  # the longest the learned start hold may be (0: never hold)
    start_window_ms: float = 1000.0  # the start of a reply whose gaps the hold is learned from
    heard_fraction: float = 0.5  # a segment counts as heard when this much of its audio played
    interruption_hold_secs: float = 0.5  # longest wait for the transport's BotStopped on barge-in

    def __post_init__(self):
        for name in ("frame_ms", "lead_ms", "fade_out_ms", "prebuffer_ms", "start_hold_max_ms", "start_window_ms",
                     "heard_fraction", "interruption_hold_secs"):
            value = getattr(self, name)
            if name == "frame_ms" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"PlayoutParams.{name} must be a finite number, got {value!r}")
            if value < 0 or (name == "frame_ms" and value == 0):
                raise ValueError(f"PlayoutParams.{name} must be {'> 0' if name == 'frame_ms' else '>= 0'}, "
                                 f"got {value!r}")
        if not 0.0 < self.heard_fraction <= 1.0:
            raise ValueError("PlayoutParams.heard_fraction must be in (0, 1]")


@dataclass
class _Reply:
    turn_id: int
    slicer: FrameSlicer
    origin: float | None = None  # monotonic time at which sample 0 is heard
    released: int = 0  # samples handed to the transport
    started: bool = False  # TTSStartedFrame pushed
    ended: bool = False  # the synthesizer's stop has arrived
    segments: dict[int, TasteSegmentAudioFrame] = field(default_factory=dict)
    queued_samples: int = 0
    texts: collections.deque = field(default_factory=collections.deque)  # segment markers whose text is not out yet
    received: int = 0  # samples that arrived from the synthesizer
    arrivals: list[tuple[int, float]] = field(default_factory=list)  # (first sample, time) of each chunk at the start
    first_release: float | None = None  # when its first audio was released (the origin before any underrun)
    last_released: np.ndarray | None = None  # the last frame handed over (a barge-in fade continues it)
    bridged: bool = False  # its audio ran out: a faded bridge went out in its place, the next audio fades in
    held_from: float | None = None  # when only the start hold kept its first audio back
    paused_at: float | None = None  # when a barge-in paused it (faded out), until it resumes


class TastePlayout(FrameProcessor):
    def __init__(self, call: TasteCall, *, params: PlayoutParams | None = None, **kwargs):
        super().__init__(**kwargs)
        self._call = call
        call.join(self)
        self._params = params or PlayoutParams()
        self._rate = 24000
        self._frame_ms = self._params.frame_ms or FALLBACK_FRAME_MS  # (the transport's chunk, once started)
        self._queue: collections.deque = collections.deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._replies: dict[int, _Reply] = {}
        self._playing: _Reply | None = None
        self._cancelled_upto = 0
        self._reported: set[int] = set()  # turns whose reply was reported upstream (TastePlaybackFrame)
        self._unconfirmed: set[int] = set()  # tentative turns: their replies wait
        self._retracted: set[int] = set()
        self._paused_by: set[int] = set()  # the caller's speech (turns) pausing the replies before it
        # A barge-in's InterruptionFrame, its direction and whether a reply's End follows it
        self._held_interruption: tuple[InterruptionFrame, FrameDirection, bool] | None = None
        self._hold_task: asyncio.Task | None = None
        self._end: tuple[EndFrame, FrameDirection] | None = None  # queued behind the audio
        self._end_passed = False
        self._started = False
        call.has_playout = True

    @property
    def start_hold_s(self) -> float:
        """How long a reply starting now is held (module docstring): the largest recent need plus
        ``lead_ms``, capped; 0 while the recent replies had time to spare."""
        need = self._call.start_needs.largest()
        if need <= 0:
            return 0.0
        return min(self._params.start_hold_max_ms, 1000.0 * need + self._params.lead_ms) / 1000.0

    def can_generate_metrics(self) -> bool:
        return True

    async def setup(self, setup: FrameProcessorSetup):
        await super().setup(setup)
        self._use_rate(setup.audio_out_sample_rate)

    def _use_rate(self, rate: int):
        self._rate = rate
        log = self._call.log
        log.audio_rate, log.fade_samples = self._rate, samples_for_ms(self._params.fade_out_ms, self._rate)

    async def cleanup(self):
        await super().cleanup()
        await self._stop_task()
        await self._pass_held_interruption()
        await self._call.leave(self)

    @property
    def _frame_samples(self) -> int:
        return samples_for_ms(self._frame_ms, self._rate)

    def _choose_frame_ms(self) -> float:
        """``frame_ms``, or unset the output transport's chunk (at the StartFrame: every processor
        is set up by then, the transport's chunk size with it)."""
        transport = output_transport_after(self)
        chunk_ms = None
        if transport is not None and transport.sample_rate and transport.audio_chunk_size:
            # (the playout's frames are mono 16-bit PCM, and so is the chunk they must fill)
            chunk_ms = 1000.0 * transport.audio_chunk_size / (2 * transport.sample_rate)
        chosen = self._params.frame_ms
        if chosen is None:
            return chunk_ms or FALLBACK_FRAME_MS
        chunks = chosen / chunk_ms if chunk_ms else 1.0
        if chunks < 1 - 1e-6 or abs(chunks - round(chunks)) > 1e-6:
            logger.warning(f"PlayoutParams.frame_ms={chosen:g} is not a whole number of the output transport's "
                           f"{chunk_ms:g} ms chunks (audio_out_10ms_chunks): partial chunks wait inside the "
                           f"transport; leave frame_ms unset to follow the transport")
        return chosen

    async def _stop_task(self):
        if self._task is not None:
            await self.cancel_task(self._task)
            self._task = None

    def _start_task(self):
        self._wake = asyncio.Event()
        self._task = self.create_task(self._release_loop())

    # -- frames in ----------------------------------------------------------------------------------
    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)

        if isinstance(frame, StartFrame):
            if self._call.output_rate:  # the synthesizer's, decided at its StartFrame (another TTS: its own)
                self._use_rate(self._call.output_rate)
            self._frame_ms = self._choose_frame_ms()
            self._call.log.frame_samples = self._frame_samples
            await self.push_frame(frame, direction)
            self._start_task()
            self._started = True
        elif isinstance(frame, EndFrame) and self._started:
            # the call ends: what is queued plays out first, and nothing will lift a pause any more
            # (the capture lifts its own before its EndFrame; one left is another sender's)
            if self._paused_by:
                logger.warning(f"{self}: the call ends with replies paused by turns {sorted(self._paused_by)}: "
                               "they play out")
                self._paused_by.clear()
            self._end = (frame, direction)
            self._queue.append(("end_of_call", None, self._end))
            self._wake.set()
        elif isinstance(frame, (EndFrame, CancelFrame)):
            await self._stop_task()
            await self._end_of_call(frame, direction)
        elif isinstance(frame, InterruptionFrame):
            await self._interrupt(frame, direction)
        elif isinstance(frame, BotStartedSpeakingFrame):
            self._call.bot_speaking = True
            await self.push_frame(frame, direction)
        elif isinstance(frame, BotStoppedSpeakingFrame):
            self._call.bot_speaking = False
            await self.push_frame(frame, direction)
            await self._pass_held_interruption()
        elif isinstance(frame, (TTSStartedFrame, TTSAudioRawFrame, TTSStoppedFrame)) and \
                turn_of_context(frame.context_id) is not None and direction == FrameDirection.DOWNSTREAM:
            self._enqueue(frame, turn_of_context(frame.context_id))
        elif isinstance(frame, (TasteSegmentAudioFrame, TasteAudioStartedFrame, TasteAudioStoppedFrame)):
            self._enqueue(frame, frame.turn_id)
        elif isinstance(frame, TasteTurnStatusFrame):
            self._turn_status(frame)
            await self.push_frame(frame, direction)
        elif isinstance(frame, TasteReplyPauseFrame):
            if frame.paused:
                self._paused_by.add(frame.by_turn)
            else:
                self._paused_by.discard(frame.by_turn)
            self._wake.set()  # the release loop fades the reply out, or lets it go on
            await self.push_frame(frame, direction)
        else:
            await self.push_frame(frame, direction)

    async def _end_of_call(self, frame: Frame, direction: FrameDirection):
        await self._pass_held_interruption()
        now = time.monotonic()
        for reply in self._replies.values():  # the call ends before these were played to the end
            self._call.log.turn(reply.turn_id).ended_by_hangup = True
            played = reply.released
            if isinstance(frame, CancelFrame) and reply.origin is not None:
                # a hang-up: the transport drops what it still held, the caller heard what had played
                # (a bridge moved the clock on by its frame: the audio before it is on the old one)
                heard = int((now - reply.origin) * self._rate) + (self._frame_samples if reply.bridged else 0)
                played = max(0, min(played, heard))
            self._record_played(reply, played, interrupted=False)
        self._end_passed = True
        await self.push_frame(frame, direction)

    def _turn_status(self, frame: TasteTurnStatusFrame):
        if frame.status == "tentative":
            self._unconfirmed.add(frame.turn_id)
            return
        self._unconfirmed.discard(frame.turn_id)
        if frame.status == "retracted":
            self._retracted.add(frame.turn_id)
            self._queue = collections.deque(item for item in self._queue
                                            if item[1] is None or item[1].turn_id != frame.turn_id)
            self._replies.pop(frame.turn_id, None)
        self._wake.set()

    def _enqueue(self, frame: Frame, turn_id: int):
        if turn_id <= self._cancelled_upto or turn_id in self._retracted:
            return  # left over from a reply that was cut off or taken back
        reply = self._replies.get(turn_id)
        if reply is None:
            reply = self._replies[turn_id] = _Reply(turn_id, FrameSlicer(self._frame_samples))
        if isinstance(frame, (TTSStartedFrame, TasteAudioStartedFrame)):
            self._queue.append(("start", reply, frame))
        elif isinstance(frame, TTSAudioRawFrame):
            samples = pcm16_to_float(frame.audio)
            if reply.received < samples_for_ms(self._params.start_window_ms, self._rate) and samples.size:
                reply.arrivals.append((reply.received, time.monotonic()))
            reply.received += samples.size
            for piece in reply.slicer.push(samples):
                self._queue.append(("audio", reply, piece))
                reply.queued_samples += piece.size
        elif isinstance(frame, TasteSegmentAudioFrame):
            # Not queued with the audio: a segment's marker can come before the end of the audio
            # that precedes it (the synthesizer holds back a lookahead), and would stall it.
            reply.segments[frame.index] = frame
            reply.texts.append(frame)
        elif isinstance(frame, (TTSStoppedFrame, TasteAudioStoppedFrame)):
            tail = reply.slicer.flush()  # the last partial frame, padded with zeros
            if tail is not None:
                self._queue.append(("audio", reply, tail))
                reply.queued_samples += tail.size
            reply.ended = True
            self._queue.append(("end", reply, frame))
        self._wake.set()

    # -- frames out, in real time ---------------------------------------------------------------------
    def _paused(self, reply: _Reply | None) -> bool:
        """Whether the caller's speech holds ``reply`` (speech after it, not the turn it answers)."""
        return reply is not None and any(by > reply.turn_id for by in self._paused_by)

    def _all_released(self, reply: _Reply) -> bool:
        """Whether all of ``reply``'s audio is out (only its end is left to report)."""
        return reply.ended and not any(kind == "audio" and r is reply for kind, r, _ in self._queue)

    async def _release_loop(self):
        lead = self._params.lead_ms / 1000.0
        while True:
            playing = self._playing
            if playing is not None and playing.paused_at is None and self._paused(playing) \
                    and not self._all_released(playing):  # (all of it out: it ends faded, nothing to pause)
                playing.paused_at = time.monotonic()
                if playing.origin is not None and not playing.bridged:
                    await self._bridge(playing, underrun=False)  # faded out as at a gap
            elif playing is not None and playing.paused_at is not None and not self._paused(playing):
                paused_s = time.monotonic() - playing.paused_at
                if playing.origin is not None:
                    self._call.log.turn(playing.turn_id).pauses_s.append(round(paused_s, 3))
                elif playing.held_from is not None:  # held before its first audio: the caller's sound is no start hold
                    playing.held_from += paused_s
                playing.paused_at = None
            head = self._queue[0] if self._queue else None
            if head is not None and head[0] in ("start", "audio") and self._paused(head[1]):
                self._wake.clear()
                await self._wake.wait()
                continue
            if not self._queue:
                playing = self._playing
                if playing is not None and playing.origin is not None and not playing.ended and not playing.bridged:
                    # More of this reply is due. Late audio still plays seamlessly while the transport
                    # has some of the lead left; past half of it, bridge the gap
                    due = playing.origin + playing.released / self._rate - lead / 2
                    if due > time.monotonic():
                        await self._sleep_or_wake(due - time.monotonic())
                    else:
                        await self._bridge(playing)
                    continue
                self._wake.clear()
                await self._wake.wait()
                continue
            kind, reply, payload = self._queue[0]
            now = time.monotonic()
            if kind == "end_of_call":  # every reply before it has been heard
                self._queue.popleft()
                await self._end_of_call(*payload)
                return
            if kind == "start":
                if reply.turn_id in self._unconfirmed:  # its turn may still be retracted
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                self._queue.popleft()
                # a barge-in still held for the last reply's fade goes first: the next reply must not
                # start before the last one has ended (an aggregator would close the wrong reply)
                await self._pass_held_interruption()
                self._playing = reply
                reply.started = True
                await self.push_frame(_kept(LLMFullResponseStartFrame()))
                await self.push_frame(_kept(TTSStartedFrame(context_id=context_id_for(reply.turn_id))))
            elif kind == "audio":
                if reply.origin is None:
                    if not self._prebuffered(reply):
                        self._wake.clear()
                        await self._sleep_or_wake(0.02)
                        continue
                    hold = self.start_hold_s
                    held_until = reply.arrivals[0][1] + hold if reply.arrivals else now
                    if held_until > now and not reply.ended:
                        reply.held_from = reply.held_from or now
                        await self._sleep_or_wake(held_until - now)
                        continue
                    reply.origin = reply.first_release = now
                    # what the hold added: none when it ran out while the reply waited for its turn's end
                    self._call.log.turn(reply.turn_id).start_hold_s = now - reply.held_from if reply.held_from else 0.0
                    self._first_audio(reply, now)
                heard_at = reply.origin + reply.released / self._rate
                if heard_at - lead > now:
                    await self._sleep_or_wake(heard_at - lead - now)  # (a pause must not wait for it)
                    continue
                if heard_at < now - 0.005 and reply.released:
                    # The synthesizer fell behind real time: the transport ran dry; restart the clock.
                    reply.origin = now - reply.released / self._rate
                    if not reply.bridged:  # (a bridge counted it already)
                        self._call.log.turn(reply.turn_id).underruns += 1
                self._queue.popleft()
                if reply.bridged:  # the audio comes back after a gap that was faded out: fade it in
                    payload = fade_in(payload, samples_for_ms(self._params.fade_out_ms, self._rate))
                    reply.bridged = False
                await self._release(reply, payload)
            elif kind == "end":
                # Wait until the released audio has been heard before reporting the reply done.
                heard_until = (reply.origin or now) + reply.released / self._rate
                if heard_until - lead > now:
                    await asyncio.sleep(heard_until - lead - now)
                    continue
                self._queue.popleft()
                await self._push_texts(reply)  # markers that came after their audio
                await self.push_frame(_kept(TTSStoppedFrame(context_id=context_id_for(reply.turn_id))))
                await self.push_frame(_kept(LLMFullResponseEndFrame()))  # after the last word: the aggregator commits
                await self._finish(reply, interrupted=False, extra_samples=0)

    def _prebuffered(self, reply: _Reply) -> bool:
        need = samples_for_ms(self._params.prebuffer_ms, self._rate)
        return reply.ended or reply.queued_samples >= need

    async def _sleep_or_wake(self, seconds: float):
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=max(0.0, seconds))
        except asyncio.TimeoutError:
            pass
        self._wake.clear()

    def _heard_from(self, segment: TasteSegmentAudioFrame) -> float:
        """The sample from which a segment counts as heard (``heard_fraction`` of its audio)."""
        return segment.start_sample + self._params.heard_fraction * (segment.end_sample - segment.start_sample)

    async def _push_texts(self, reply: _Reply, extra_samples: int = 0):
        """The text of each segment that counts as heard once ``extra_samples`` more are released
        (the rule ``_finish`` keeps words by), so the words a context aggregator keeps are the
        words the conversation keeps. Uninterruptible, like the audio they go with."""
        while reply.texts and self._heard_from(reply.texts[0]) <= reply.released + extra_samples:
            segment = reply.texts.popleft()
            context_id = context_id_for(reply.turn_id)
            llm_text = LLMTextFrame(segment.text)
            llm_text.append_to_context = False  # the TTSTextFrame is the one the context keeps
            # SENTENCE, not WORD: RTVI reports no bot-output for words (as OpenAI Realtime does)
            tts_text = TTSTextFrame(segment.text, text_type=TextType.SENTENCE, context_id=context_id)
            tts_text.includes_inter_frame_spaces = True  # segments carry their leading space
            for frame in (llm_text, tts_text):
                frame.interruptible = False
                await self.push_frame(frame)

    async def _release(self, reply: _Reply, samples: np.ndarray):
        await self._push_texts(reply, samples.size)
        reply.released += samples.size
        reply.queued_samples -= samples.size
        reply.last_released = samples
        await self._send(reply, samples)

    async def _send(self, reply: _Reply, samples: np.ndarray):
        pcm = float_to_pcm16(samples)
        frame = TTSAudioRawFrame(pcm, self._rate, 1, context_id=context_id_for(reply.turn_id))
        frame.interruptible = False  # the playout decides what gets dropped, not the transport
        if self._call.log.keep_audio:
            self._call.log.released_audio.setdefault(reply.turn_id, []).append(pcm)
        await self.push_frame(frame)

    async def _bridge(self, reply: _Reply, underrun: bool = True):
        """The reply's next audio is due and has not come (the synthesizer fell behind real time; or
        not ``underrun``: a barge-in paused it): the transport would stop dead on the last sample, a
        click. One frame goes out in its place, the heard audio mirrored about its last sample (so
        its value goes on) faded to silence; the reply's clock moves on by that frame, and its next
        audio fades in."""
        n, fade = self._frame_samples, samples_for_ms(self._params.fade_out_ms, self._rate)
        bridge = np.zeros(n, np.float32)
        if reply.last_released is not None and fade:
            mirrored = reply.last_released[::-1][: min(fade, n)]
            bridge[: mirrored.size] = fade_out(mirrored, mirrored.size)
        reply.bridged = True
        reply.origin += n / self._rate
        record = self._call.log.turn(reply.turn_id)
        record.underruns += underrun
        record.audio_gaps.append((reply.released, n))
        await self._send(reply, bridge)

    def _first_audio(self, reply: _Reply, now: float):
        record = self._call.log.turn(reply.turn_id)
        record.first_audio_at = now
        self._call.log.event("bot_audio_started", reply.turn_id)

    # -- barge-in ---------------------------------------------------------------------------------------
    async def _interrupt(self, frame: InterruptionFrame, direction: FrameDirection):
        reply = self._playing
        # The reply this interruption cut: the generator names it as it stops it (by the time the
        # frame is here its worker may be on the next turn, which it did not cut); without a
        # generator in the call, the one active.
        call = self._call
        cut_turn = call.interrupted_turn if call.has_generator else call.active_reply_turn
        await self._stop_task()
        fade = self._fade_tail(reply) if reply is not None and reply.origin is not None else np.zeros(0, np.float32)
        cut = max([self._cancelled_upto, cut_turn or 0] + list(self._replies))
        self._cancelled_upto = cut
        self._queue.clear()
        self._paused_by.clear()  # the speech that paused the reply is the barge-in
        if self._end is not None and not self._end_passed:
            self._queue.append(("end_of_call", None, self._end))
        await self._pass_held_interruption()  # an earlier barge-in's
        transport_speaking = reply is not None and reply.released > 0 and self._call.bot_speaking
        started = reply is not None and reply.started
        if started:
            if fade.size:
                await self._release(reply, fade)
            await self.push_frame(_kept(TTSStoppedFrame(context_id=context_id_for(reply.turn_id))))
        if transport_speaking:
            self._held_interruption = (frame, direction, started)
            self._hold_task = self.create_task(self._pass_held_interruption_later())
        else:
            await self._pass_interruption(frame, direction, started)
        if started:
            await self._finish(reply, interrupted=True, extra_samples=0)
        elif cut_turn and cut_turn not in self._reported:
            # Nothing of this reply was heard yet: tell the generator so it keeps none of it.
            self._reported.add(cut_turn)
            self._call.log.turn(cut_turn).interrupted = True
            await self.push_frame(TastePlaybackFrame(cut_turn, 0, 0, 0, True), FrameDirection.UPSTREAM)
        self._replies = {k: v for k, v in self._replies.items() if k > cut}
        self._playing = None
        self._start_task()

    def _fade_tail(self, reply: _Reply) -> np.ndarray:
        """``fade_out_ms`` that continue the waveform from the last released sample, faded to 0: the
        samples about to be released (queued frames, then the slicer's partial frame). When fewer
        have arrived (synthesis just in time: everything received is out), the released audio
        mirrored about its last sample makes up the rest - its value goes on, so there is no step."""
        if reply.bridged:  # its audio already faded out into a gap: nothing is playing to fade
            return np.zeros(0, np.float32)
        need = samples_for_ms(self._params.fade_out_ms, self._rate)
        pieces, have = [], 0
        for kind, item_reply, payload in self._queue:
            if kind == "audio" and item_reply is reply and have < need:
                pieces.append(payload[: need - have])
                have += pieces[-1].size
        if have < need:
            pieces.append(reply.slicer.clear()[: need - have])
            have += pieces[-1].size
        if have < need and reply.last_released is not None:
            heard = np.concatenate([reply.last_released] + pieces)
            pieces.append(heard[::-1][: need - have])
            have += pieces[-1].size
        if not have:
            return np.zeros(0, np.float32)
        return fade_out(np.concatenate(pieces), have)

    async def _pass_held_interruption_later(self):
        await asyncio.sleep(self._params.interruption_hold_secs)
        self._hold_task = None  # this task is the caller: not to be cancelled by itself
        await self._pass_held_interruption()

    async def _pass_held_interruption(self):
        held, self._held_interruption = self._held_interruption, None
        if self._hold_task is not None:
            await self.cancel_task(self._hold_task)
            self._hold_task = None
        if held is not None:
            await self._pass_interruption(*held)

    async def _pass_interruption(self, frame: InterruptionFrame, direction: FrameDirection, reply_started: bool):
        await self.push_frame(frame, direction)
        if reply_started:  # after the interruption: an aggregator keeps the words heard, as interrupted
            await self.push_frame(_kept(LLMFullResponseEndFrame()))

    # -- end of a reply ----------------------------------------------------------------------------------
    def _learn_start_hold(self, reply: _Reply) -> None:
        """The hold this reply needed: how much later than its first chunk each chunk at its start
        arrived, beyond the audio ahead of it (negative: time to spare)."""
        if reply.first_release is None or len(reply.arrivals) < 2:
            return  # never played, or one chunk only: nothing to learn
        first = reply.arrivals[0][1]
        self._call.start_needs.record(max(arrived - first - sample / self._rate
                                          for sample, arrived in reply.arrivals[1:]))

    def _record_played(self, reply: _Reply, played: int, interrupted: bool) -> tuple[int, int]:
        """What the caller heard of the reply, in its record: (words heard, words in the reply)."""
        record = self._call.log.turn(reply.turn_id)
        words, texts = 0, []
        for index in sorted(reply.segments):
            segment = reply.segments[index]
            if index != len(texts) or played < self._heard_from(segment):
                break  # only a prefix of the reply can have been heard
            words += segment.n_words
            texts.append(segment.text)
        record.played_samples = played
        record.played_words = words
        record.played_text = "".join(texts).strip()
        record.audio_end_at = (reply.origin + played / self._rate) if reply.origin is not None else time.monotonic()
        record.dropped_samples = max(0, record.synthesized_samples - played) if interrupted else 0
        if interrupted:  # the caller's barge-in, or any other InterruptionFrame (an RTVI client's)
            record.interrupted = True
        return words, sum(s.n_words for s in reply.segments.values())

    async def _finish(self, reply: _Reply, interrupted: bool, extra_samples: int):
        call, record = self._call, self._call.log.turn(reply.turn_id)
        played = reply.released + extra_samples
        self._learn_start_hold(reply)
        words, total = self._record_played(reply, played, interrupted)
        call.log.event("bot_audio_stopped", reply.turn_id, interrupted=interrupted, played_samples=played)
        self._replies.pop(reply.turn_id, None)
        if self._playing is reply:
            self._playing = None
        self._reported.add(reply.turn_id)
        await self.push_frame(TastePlaybackFrame(reply.turn_id, words, total, played, interrupted),
                              FrameDirection.UPSTREAM)
        latency = record.user_to_bot_s
        if latency is not None and self.metrics_enabled:
            await self.push_frame(MetricsFrame(data=[TTFBMetricsData(processor=self.name, model="user_to_bot",
                                                                     value=latency)]))
        await self.push_frame(TasteTurnMetricsFrame(reply.turn_id, record.decision or "reply", latency,
                                                    played / self._rate, interrupted, record.barge_in_stop_s))


def _kept(frame: Frame) -> Frame:
    """A reply's bracket (TTS/LLM start and stop), uninterruptible like its audio: an interruption
    that reaches the transport while the reply's last audio is still queued there must not drop
    the close of a reply it keeps the audio of (its aggregator and RTVI would wait for it)."""
    frame.interruptible = False
    return frame
