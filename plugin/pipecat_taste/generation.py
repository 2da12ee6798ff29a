"""TasteGenerator: decide whether to answer each user turn, and stream the answer word by word.

For every ``TasteUserTurnFrame`` (in order, one at a time) the call's engine session runs
``streaming_generate`` on the "think" worker thread, one item at a time, so the event loop stays
free and an ``InterruptionFrame`` stops generation within one model step. The model's first choice
is the turn decision: 'no_speech' (nothing to say: keep listening) or 'reply'. A reply goes
downstream as ``TasteReplySegmentFrame``s (for the synthesizer), then ``TasteReplyEndFrame``. With
a ``TastePlayout`` in the call, the playout tells the pipeline about the reply as it is heard
(``LLMFullResponseStart/End``, the text); without one, the generator does:
``LLMFullResponseStartFrame``, an ``LLMTextFrame`` per segment (the bot's transcript),
``LLMFullResponseEndFrame`` (which a barge-in's ``InterruptionFrame`` drops when it still waits in the
transport behind the reply's audio, as with Pipecat's LLM services).

A tentative turn (handed on early, before the VAD confirmed its end) is answered at once, but
what the reply tells the rest of the pipeline (the decision; without a playout also
``LLMFullResponseStart/End`` and ``LLMTextFrame``) waits for its ``TasteTurnStatusFrame``:
'confirmed' sends it on, 'retracted' stops the reply, drops it and makes the conversation forget
the turn and the reply begun to it.

What the conversation keeps: with a ``TastePlayout`` in the call, the reply is committed once the
playout reports what was actually played (all of it, or, after a barge-in, only the words the
caller heard); without one, everything generated is kept. Either way the commit happens before
the next user turn is answered, so history always matches what was heard, in order.

``EndFrame`` waits its turn: the turns that came before it are answered (and, with a playout,
heard) before it goes on. ``CancelFrame`` stops everything at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

from loguru import logger
from pipecat.frames.frames import (
    CancelFrame,
    EndFrame,
    Frame,
    InterruptionFrame,
    LLMContextFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMMessagesAppendFrame,
    LLMMessagesUpdateFrame,
    LLMRunFrame,
    LLMTextFrame,
    StartFrame,
    TTSSpeakFrame,
)
from pipecat.metrics.metrics import LLMTokenUsage
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor, FrameProcessorSetup
from pipecat.utils.errors import ErrorCategory

from pipecat_taste.call import TasteCall
from pipecat_taste.frames import (
    TastePlaybackFrame,
    TasteReplyEndFrame,
    TasteReplySegmentFrame,
    TasteTurnDecisionFrame,
    TasteTurnStatusFrame,
    TasteUserTurnFrame,
)

# What a text-LLM pipeline sends to make the bot say or answer something: TASTE answers audio only
TEXT_REQUESTS = (TTSSpeakFrame, LLMRunFrame, LLMMessagesAppendFrame, LLMMessagesUpdateFrame, LLMContextFrame)


class _EndOfCall:
    """A queued job: pass the EndFrame on, after the turns ahead of it."""

    def __init__(self, frame: EndFrame, direction: FrameDirection):
        self.frame, self.direction = frame, direction


class _Forget:
    """A queued job: make the conversation forget a retracted turn (after its reply, if any, ended)."""

    def __init__(self, frame: TasteUserTurnFrame):
        self.frame = frame


class TasteGenerator(FrameProcessor):
    def __init__(self, call: TasteCall, *, playback_report_timeout_secs: float = 120.0, **kwargs):
        super().__init__(**kwargs)
        self._call = call
        self._unspoken_kinds: set[str] = set()  # text requests already warned about (``_not_spoken``)
        self._report_timeout = playback_report_timeout_secs
        call.join(self)
        call.has_generator = True
        self._turns: asyncio.Queue | None = None
        self._worker: asyncio.Task | None = None
        self._stop: threading.Event | None = None
        self._active_turn: int | None = None
        self._reports: dict[int, asyncio.Future] = {}
        # Tentative turns: their frames held until confirmed, and the turns that were retracted.
        self._held: dict[int, list[tuple[Frame, FrameDirection]]] = {}
        self._tentative: dict[int, TasteUserTurnFrame] = {}
        self._retracted: set[int] = set()

    def can_generate_metrics(self) -> bool:
        return True

    async def setup(self, setup: FrameProcessorSetup):
        await super().setup(setup)
        await self._call.ensure_session()

    async def cleanup(self):
        await super().cleanup()
        await self._stop_worker()
        await self._call.leave(self)

    async def _stop_worker(self):
        if self._stop is not None:
            self._stop.set()
        if self._worker is not None:
            await self.cancel_task(self._worker)
            self._worker = None

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)

        if isinstance(frame, StartFrame):
            await self.push_frame(frame, direction)
            self._turns = asyncio.Queue()
            self._worker = self.create_task(self._answer_turns())
        elif isinstance(frame, EndFrame) and self._turns is not None:
            self._turns.put_nowait(_EndOfCall(frame, direction))
        elif isinstance(frame, (EndFrame, CancelFrame)):
            await self._stop_worker()
            await self.push_frame(frame, direction)
        elif isinstance(frame, TasteUserTurnFrame):
            if frame.tentative:
                self._held[frame.turn_id] = []
                self._tentative[frame.turn_id] = frame
                await self.push_frame(TasteTurnStatusFrame(frame.turn_id, "tentative"))  # before any of its audio
            self._turns.put_nowait(frame)
        elif isinstance(frame, TasteTurnStatusFrame):
            await self._turn_status(frame)
            await self.push_frame(frame, direction)
        elif isinstance(frame, InterruptionFrame):
            self._interrupt()
            await self.push_frame(frame, direction)
        elif isinstance(frame, TEXT_REQUESTS):
            self._not_spoken(frame)
            await self.push_frame(frame, direction)
        elif isinstance(frame, TastePlaybackFrame):
            future = self._reports.get(frame.turn_id)
            if future is not None and not future.done():
                future.set_result(frame)
            await self.push_frame(frame, direction)
        else:
            await self.push_frame(frame, direction)

    def _not_spoken(self, frame: Frame) -> None:
        """A text-LLM pipeline's request (a greeting's TTSSpeakFrame, an RTVI client's send-text, a
        context update) that TASTE cannot carry out: said once per kind, not silently passed on."""
        kind = type(frame).__name__
        if kind in self._unspoken_kinds:
            return
        self._unspoken_kinds.add(kind)
        logger.warning(f"{self}: {kind} is passed on but not spoken: the TASTE model speaks only in answer to the "
                       "caller's audio (no text input, no greeting, no system-prompt updates from a context); "
                       "a user-mute strategy that waits for the bot to speak first would mute the caller for good")
        self._call.log.event("text_request_not_spoken", frame=kind)

    async def _announce(self, turn_id: int, frame: Frame, direction: FrameDirection = FrameDirection.DOWNSTREAM):
        """Push a frame that tells the pipeline about a reply, or hold it while its turn is tentative."""
        held = self._held.get(turn_id)
        if held is not None:
            held.append((frame, direction))
        elif turn_id not in self._retracted:
            await self.push_frame(frame, direction)

    async def _turn_status(self, frame: TasteTurnStatusFrame):
        turn_id = frame.turn_id
        if frame.status == "tentative":
            return
        user_turn = self._tentative.pop(turn_id, None)
        held = self._held.get(turn_id, [])
        if frame.status == "confirmed":
            while held:  # in order, including any held meanwhile
                await self.push_frame(*held.pop(0))
            self._held.pop(turn_id, None)
            return
        self._held.pop(turn_id, None)
        self._retracted.add(turn_id)
        self._call.log.event("reply_retracted", turn_id)
        if self._active_turn == turn_id and self._stop is not None:
            self._stop.set()  # the worker sees it within one model step
        report = self._reports.get(turn_id)
        if report is not None and not report.done():
            report.set_result(None)  # nothing of it will be played
        if user_turn is not None:
            self._turns.put_nowait(_Forget(user_turn))  # after the reply (queued or running) ends

    def _interrupt(self):
        """Stop the reply being generated (the worker sees it within one model step)."""
        cutting = self._stop is not None and self._active_turn is not None
        # named now for the stages after it: by the time the frame reaches them, the next turn may be active
        self._call.interrupted_turn = self._active_turn if cutting else None
        if cutting:
            self._stop.set()
            self._call.replies_cut_upto = max(self._call.replies_cut_upto, self._active_turn)
            self._call.reset_segment_slots()
            record = self._call.log.turn(self._active_turn)
            if record.decision in (None, "reply"):  # a reply cut off (or one about to be decided)
                record.interrupted = True
            self._call.log.event("generation_cancelled", self._active_turn)

    # -- the worker: one turn at a time -------------------------------------------------------------
    async def _answer_turns(self):
        while True:
            frame = await self._turns.get()
            if isinstance(frame, _EndOfCall):
                await self.push_frame(frame.frame, frame.direction)
                return
            if isinstance(frame, _Forget):
                await self._forget(frame.frame)
                continue
            if frame.turn_id in self._retracted:
                continue  # taken back before it was answered
            try:
                await self._answer(frame)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # never let one turn end the call
                logger.exception(f"{self}: turn {frame.turn_id} failed")
                await self.push_error(f"turn {frame.turn_id}: reply failed: {e}", e, category=ErrorCategory.UNKNOWN)
            finally:
                if self._call.active_reply_turn == frame.turn_id:
                    self._call.active_reply_turn = None
                self._active_turn = None

    async def _answer(self, frame: TasteUserTurnFrame):
        call, turn_id = self._call, frame.turn_id
        record = call.log.turn(turn_id)
        session = await call.ensure_session()
        stop = threading.Event()
        muted = await call.mutes.muted(turn_id)  # the caller spoke again before this reply began
        if turn_id in self._retracted:
            return  # taken back while it waited (the retraction found no reply of it to stop)
        if muted:
            stop.set()  # the turn joins the conversation; no word of a reply is made
        self._stop, self._active_turn = stop, turn_id
        call.active_reply_turn = turn_id  # the agent is busy: speech from now on is a barge-in
        self._reports[turn_id] = asyncio.get_running_loop().create_future()
        events = session.reply(frame.turn, stop)
        await self.start_ttfb_metrics()
        await self.start_processing_metrics()
        n_segments, total_words, texts, reason = 0, 0, [], "finished"
        started_reply = False
        try:
            first = await call.run("think", next, events, None)
            decision = first.decision if first is not None and first.kind == "decision" else "reply"
            reason = ""
            if muted and decision == "reply":  # keep listening: the caller is speaking
                decision, reason = "no_speech", "the caller spoke again before the reply began"
                record.reason = reason
            record.decision, record.decided_at = decision, time.monotonic()
            if decision != "reply":  # a barge-in while it was decided cut no reply
                record.interrupted, record.barge_in_at = False, None
            call.log.event("decision", turn_id, decision=decision, **({"reason": reason} if reason else {}))
            await self._announce(turn_id, TasteTurnDecisionFrame(turn_id, decision, reason))
            if decision != "reply":
                await self.stop_ttfb_metrics()
                await self.stop_processing_metrics()
                call.active_reply_turn = None
                self._reports.pop(turn_id, None)  # no reply: no playout report to wait for
                await call.run("think", _drain, events)
                return
            # With a playout, it announces the reply in order with its audio, as heard (its End
            # after the last word heard, for an assistant aggregator after the transport).
            announce_text = not call.has_playout
            if announce_text:
                await self._announce(turn_id, LLMFullResponseStartFrame())
            started_reply = True
            while True:
                # Back-pressure: wait for room before asking for the next segment (when stopped,
                # no room is needed: the iterator ends within one step).
                slot = await self._wait_for_slot(stop) if call.has_synthesizer else None
                try:
                    event = await call.run("think", next, events, None)
                except BaseException:
                    if slot is not None:
                        slot.release()  # (a failed reply must not keep a slot: the call's next replies need it)
                    raise
                if slot is not None and (event is None or event.kind != "segment" or stop.is_set()):
                    slot.release()  # the slot is only used by a segment sent on
                if event is None:
                    break
                if event.kind == "segment":
                    if stop.is_set():
                        continue  # generated after the barge-in: never spoken, never kept
                    if n_segments == 0:
                        record.first_segment_at = time.monotonic()
                        await self.stop_ttfb_metrics()
                    if announce_text:
                        await self._announce(turn_id, LLMTextFrame(event.text))
                    await self.push_frame(TasteReplySegmentFrame(turn_id, n_segments, event.text, event.n_words,
                                                                 event.segment, slot))
                    n_segments += 1
                    total_words += event.n_words
                    texts.append(event.text)
                elif event.kind == "end":
                    reason = "cancelled" if stop.is_set() else event.reason or "finished"
                    await self.start_llm_usage_metrics(LLMTokenUsage(
                        prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                        total_tokens=event.prompt_tokens + event.completion_tokens))
                    break
        except Exception as e:
            reason = "error"
            record.errors.append(f"generation failed: {e}")
            logger.exception(f"{self}: generation failed on turn {turn_id}")
            await self.push_error(f"turn {turn_id}: generation failed: {e}", e, category=ErrorCategory.UNKNOWN)
            if record.decision is None:
                record.decision = "error"
        finally:
            await self.stop_processing_metrics()
            # the reply's generator ends now, not at its collection: it is the session's open job
            # (a hang-up while the playout's report is awaited then frees the call's batch slots).
            # On its own thread after the step running there, outside the compute gate (no model
            # work), and not awaited: nothing - a cancel included - waits for it.
            with contextlib.suppress(RuntimeError):  # (the call has ended: its threads are gone)
                call.executor("think").submit(events.close)
        record.generation_done_at = time.monotonic()
        record.reply_text = "".join(texts).strip()
        record.total_words = total_words
        call.log.event("generation_done", turn_id, reason=reason, segments=n_segments)
        if started_reply:
            await self.push_frame(TasteReplyEndFrame(turn_id, reason, n_segments))
            if announce_text:
                await self._announce(turn_id, LLMFullResponseEndFrame())
        await self._commit(turn_id, n_segments, total_words, stop)

    async def _wait_for_slot(self, stop: threading.Event) -> asyncio.Semaphore | None:
        """Back-pressure: at most ``max_pending_segments`` segments wait for the speech decoder.
        Returns the semaphore holding the slot (None when stopped first)."""
        while not stop.is_set():
            slots = self._call.segment_slots
            try:
                await asyncio.wait_for(slots.acquire(), timeout=0.05)
                return slots
            except asyncio.TimeoutError:
                continue
        return None

    async def _commit(self, turn_id: int, n_segments: int, total_words: int, stop: threading.Event):
        """Keep what the caller heard (the playout's report), before the next turn is answered."""
        call, record = self._call, self._call.log.turn(turn_id)
        if turn_id in self._retracted:  # the queued _Forget takes the turn and this reply back
            self._reports.pop(turn_id, None)
            return
        played = None
        if call.has_playout and n_segments:
            try:
                report = await asyncio.wait_for(self._reports[turn_id], self._report_timeout)
                played = None if report is None else report.played_words
                if report is not None:  # its audio is over: speech from now on cuts nothing
                    self._active_turn = None
                    if call.active_reply_turn == turn_id:
                        call.active_reply_turn = None
            except asyncio.TimeoutError:
                logger.warning(f"{self}: no playback report for turn {turn_id}; keeping the whole reply")
            if turn_id in self._retracted:  # retracted while we waited for the report
                self._reports.pop(turn_id, None)
                return
        elif stop.is_set():  # with no playout to say what was heard: the words sent on, not those after the stop
            played = 0 if call.has_playout else total_words
        self._reports.pop(turn_id, None)
        try:
            kept = await call.run("think", call.session.commit_reply, played)
        except Exception as e:  # the cut is all or nothing: the history holds the words heard all the same
            kept = total_words if played is None else min(played, total_words)
            record.errors.append(f"keeping the words heard failed: {e}")
            logger.exception(f"{self}: committing the reply of turn {turn_id} failed")
            await self.push_error(f"turn {turn_id}: keeping the words heard failed: {e}", e,
                                  category=ErrorCategory.UNKNOWN)
        record.kept_words = kept
        call.log.event("reply_committed", turn_id, kept_words=kept, total_words=total_words)

    async def _forget(self, frame: TasteUserTurnFrame):
        call = self._call
        try:
            forgotten = await call.run("think", call.session.forget_turn, frame.turn)
        except Exception as e:  # the call goes on; the history keeps the early turn
            logger.exception(f"{self}: could not forget retracted turn {frame.turn_id}")
            await self.push_error(f"turn {frame.turn_id}: could not forget it: {e}", e, category=ErrorCategory.UNKNOWN)
            return
        call.log.event("turn_forgotten", frame.turn_id, turns=forgotten)


def _drain(iterator) -> None:
    for _ in iterator:
        pass
