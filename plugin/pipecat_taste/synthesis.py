"""TasteSynthesizer: reply segments -> speech tokens -> audio, as two concurrent stages.

    TasteReplySegmentFrame --> [speech tokens: speech decoder, "speech_tokens" thread]
                           --(bounded queue of token groups)-->
                           [vocoder: flow + HiFT, "vocode" thread] --> TTSAudioRawFrame ...

The speech decoder works on segment k+1 while the vocoder turns segment k's tokens into audio,
and the generator (another thread) is already producing later words; the first audio is pushed
as soon as the vocoder's first chunk exists. The queue between the stages is bounded, and the
generator holds a slot per segment until the speech decoder takes it, so no stage runs far
ahead of the next.

Each reply is one utterance for the engine (one continuity state: speech tokens continue across
segments, the vocoder's caches carry over between chunks). Output: ``TasteAudioStartedFrame``, audio
at the pipeline's output rate with a fade-in at the start of the reply and a fade-out at its end
(the last ``fade_out_ms`` are held back until the end is known), ``TasteSegmentAudioFrame``
markers saying which output samples carry which words, and ``TasteAudioStoppedFrame``. The
start and stop are private to the playout, which sends ``TTSStartedFrame``/``TTSStoppedFrame`` when
the reply is heard: observers (RTVI) report a frame where it is first pushed, so these would be a
second, early pair (before the turn is even confirmed, for a reply that may be taken back).
Without a playout in the call they are ``TTSStartedFrame``/``TTSStoppedFrame`` (a barge-in's
``InterruptionFrame`` drops a stop still queued in the transport, as with Pipecat's TTS services). The voice is the
call's (one speaker embedding for the whole call).

On an ``InterruptionFrame`` both stages stop at once; anything still queued for the interrupted
reply is dropped (a computation already running on a worker thread finishes and is discarded).
A retracted tentative turn (``TasteTurnStatusFrame`` 'retracted') drops only that reply: nothing of
it was heard, and an earlier reply still being synthesized goes on.

``EndFrame`` goes through both stages behind the segments ahead of it, so it follows the last
reply's audio out; ``CancelFrame`` stops both stages at once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np
from loguru import logger
from pipecat.frames.frames import (
    CancelFrame,
    EndFrame,
    Frame,
    InterruptionFrame,
    StartFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
)
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor, FrameProcessorSetup
from pipecat.utils.errors import ErrorCategory

from pipecat_taste.audio import continue_fade_in, fade_out, float_to_pcm16, samples_for_ms
from pipecat_taste.call import TasteCall
from pipecat_taste.frames import (
    TasteAudioStartedFrame,
    TasteAudioStoppedFrame,
    TasteReplyEndFrame,
    TasteReplySegmentFrame,
    TasteSegmentAudioFrame,
    TasteTurnStatusFrame,
)
from pipecat_taste.links import taste_output_rate
from pipecat_taste.session import VocodingFailed


def context_id_for(turn_id: int) -> str:
    return f"taste-turn-{turn_id}"


def turn_of_context(context_id: str | None) -> int | None:
    if context_id and context_id.startswith("taste-turn-"):
        try:
            return int(context_id.rsplit("-", 1)[1])
        except ValueError:
            return None
    return None


@dataclass
class _Reply:
    turn_id: int
    state: object  # engine SpeechState
    tokens: int = 0  # speech tokens decoded so far
    decode_failed: bool = False  # speech-token stage only: decode no more segments of this reply
    failed: bool = False  # vocoder stage only: vocode no more of this reply
    closed: bool = False  # vocoder stage only: its audio ended (finished or failed); later groups are dropped


# Groups of speech tokens (five each) decoded ahead of the vocoder.
MAX_PENDING_TOKEN_GROUPS = 8


class TasteSynthesizer(FrameProcessor):
    def __init__(self, call: TasteCall, *, fade_in_ms: float = 5.0, fade_out_ms: float = 10.0,
                 max_pending_token_groups: int = MAX_PENDING_TOKEN_GROUPS, **kwargs):
        super().__init__(**kwargs)
        if max_pending_token_groups < 1:
            raise ValueError("max_pending_token_groups must be >= 1")
        self._call = call
        self._fade_in_ms, self._fade_out_ms = fade_in_ms, fade_out_ms
        self._max_groups = max_pending_token_groups
        self._out_rate = 24000
        self._segments: asyncio.Queue | None = None
        self._groups: asyncio.Queue | None = None
        self._decode_task: asyncio.Task | None = None
        self._vocode_task: asyncio.Task | None = None
        self._cancelled_upto = 0  # turns up to this id were interrupted
        self._retracted: set[int] = set()  # tentative turns taken back
        self._current_turn: int | None = None
        self._speaking: _Reply | None = None  # the latest reply given a speech state
        self._end: EndFrame | None = None  # the call's EndFrame, on its way through the stages
        self._end_passed = False
        call.has_synthesizer = True
        call.join(self)

    def can_generate_metrics(self) -> bool:
        return True

    async def setup(self, setup: FrameProcessorSetup):
        await super().setup(setup)
        from taste_speech.streaming.synthesis_state import SUPPORTED_OUTPUT_RATES

        self._out_rate = setup.audio_out_sample_rate
        if self._out_rate not in SUPPORTED_OUTPUT_RATES:  # else every reply would fail, one by one
            raise ValueError(f"{self}: the pipeline's audio_out_sample_rate is {self._out_rate} Hz, and the TASTE "
                             f"synthesis resamples to {SUPPORTED_OUTPUT_RATES} Hz only: set "
                             "PipelineParams(audio_out_sample_rate=...) to one of them")
        await self._call.ensure_session()

    async def cleanup(self):
        await super().cleanup()
        await self._stop_stages()
        await self._call.leave(self)

    # -- stages -------------------------------------------------------------------------------------
    def _start_stages(self):
        self._segments = asyncio.Queue()  # bounded by the generator's segment slots
        self._groups = asyncio.Queue(maxsize=self._max_groups)
        self._decode_task = self.create_task(self._decode_stage())
        self._vocode_task = self.create_task(self._vocode_stage())

    async def _stop_stages(self):
        for task in (self._decode_task, self._vocode_task):
            if task is not None:
                await self.cancel_task(task)
        self._decode_task = self._vocode_task = None

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)

        if isinstance(frame, StartFrame):
            # at the output transport's rate: a transport that resamples releases the audio in bursts
            self._out_rate = self._call.output_rate = taste_output_rate(self, self._out_rate)
            await self.push_frame(frame, direction)
            self._start_stages()
        elif isinstance(frame, EndFrame) and self._segments is not None:
            self._end = frame
            self._segments.put_nowait(frame)
        elif isinstance(frame, (EndFrame, CancelFrame)):
            await self._stop_stages()
            self._give_up_speaking()
            await self.push_frame(frame, direction)
        elif isinstance(frame, (TasteReplySegmentFrame, TasteReplyEndFrame)):
            if frame.turn_id > self._cancelled_upto:
                self._segments.put_nowait(frame)
            elif isinstance(frame, TasteReplySegmentFrame):
                _give_back(frame)  # every segment dropped unspoken gives its back-pressure slot back
        elif isinstance(frame, InterruptionFrame):
            await self._interrupt()
            await self.push_frame(frame, direction)
        elif isinstance(frame, TasteTurnStatusFrame):
            if frame.status == "retracted":
                self._retracted.add(frame.turn_id)
                self._call.log.event("synthesis_retracted", frame.turn_id)
            await self.push_frame(frame, direction)
        else:
            await self.push_frame(frame, direction)

    def _dropped(self, turn_id: int) -> bool:
        return turn_id <= self._cancelled_upto or turn_id in self._retracted

    async def _interrupt(self):
        turn = self._current_turn
        # the reply being cut off, also when none of it reached this stage yet (the generator is on
        # its first word): its segments and its end, still to come, are dropped when they arrive
        self._cancelled_upto = max(self._cancelled_upto, turn or 0, self._call.replies_cut_upto)
        if turn is None and self._segments is not None and self._segments.empty() and self._groups.empty():
            return
        await self._stop_stages()
        self._give_up_speaking()
        while not self._segments.empty():  # dropped: their slots go back (the generator may be idle,
            queued = self._segments.get_nowait()  # its semaphore not renewed by this interruption)
            if isinstance(queued, TasteReplySegmentFrame):
                _give_back(queued)
        self._current_turn = None
        await self.stop_all_metrics()
        self._start_stages()
        if self._end is not None and not self._end_passed:  # it was in the queues just dropped
            self._segments.put_nowait(self._end)
        self._call.log.event("synthesis_cancelled", turn)

    def _give_up_speaking(self) -> None:
        """The reply being spoken was cut off or taken back: the calls' shared synthesis steps stop
        waiting for its first window (``drop_speech``; its speech state is lost with the stages)."""
        reply, self._speaking = self._speaking, None
        if reply is not None and reply.state is not None and not reply.closed:
            self._drop_speech(self._call.session, reply.turn_id, reply.state)

    def _drop_speech(self, session, turn_id: int, state) -> None:
        if session is None:
            return
        try:
            session.drop_speech(state)
        except Exception as e:  # (the call goes on: at worst other calls' first windows wait for it once)
            logger.warning(f"{self}: turn {turn_id}: could not give up its speech: {e}")

    # Speech-token stage ----------------------------------------------------------------------------
    async def _decode_stage(self):
        reply: _Reply | None = None
        while True:
            frame = await self._segments.get()
            if isinstance(frame, EndFrame):
                await self._groups.put(("end_of_call", None, frame))
                continue
            if isinstance(frame, TasteReplySegmentFrame):
                # Taken off the queue, whatever becomes of it: its back-pressure slot goes back now
                # (an interruption while its reply starts would otherwise cancel this stage holding it).
                _give_back(frame)
            if self._dropped(frame.turn_id):
                continue
            if reply is None or reply.turn_id != frame.turn_id:
                if self._speaking is not None and self._dropped(self._speaking.turn_id):
                    self._give_up_speaking()  # (a reply taken back: its first window is awaited by no one now)
                reply = await self._start_reply(frame.turn_id)
            if isinstance(frame, TasteReplyEndFrame):
                await self._groups.put(("end", reply, frame.reason))
                reply = None
                continue
            if reply.decode_failed:
                continue
            try:
                await self._decode_segment(reply, frame)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                # Tell the vocoder through the queue, behind the tokens already decoded: what was
                # decoded before the failure is still spoken, and the reply ends there.
                reply.decode_failed = True
                await self._groups.put(("decode_failed", reply, None))
                await self._fail(reply.turn_id, f"speech decoding failed on {frame.text!r}: {e}", e)

    async def _start_reply(self, turn_id: int) -> _Reply:
        """The reply's speech state, announced to the vocoder stage. If it cannot be made, the reply
        still starts and ends (silent, with an ErrorFrame), so that the playout reports it and the
        call goes on with the next turn."""
        self._current_turn = turn_id
        try:
            session = await self._call.ensure_session()
            making = asyncio.ensure_future(self._call.run("speech_tokens", session.start_speech, self._out_rate))
            try:
                reply = _Reply(turn_id, await asyncio.shield(making))
            except asyncio.CancelledError:  # cut off while its state is made: give the state up once made
                def give_up(made: asyncio.Future) -> None:
                    if not made.cancelled() and made.exception() is None:
                        self._drop_speech(session, turn_id, made.result())

                making.add_done_callback(give_up)
                raise
        except asyncio.CancelledError:
            raise
        except Exception as e:
            reply = _Reply(turn_id, None, decode_failed=True, failed=True)
            await self._fail(turn_id, f"could not start speaking: {e}", e)
        self._speaking = reply
        await self._groups.put(("start", reply, None))
        return reply

    async def _decode_segment(self, reply: _Reply, frame: TasteReplySegmentFrame):
        session = self._call.session
        start_tokens = reply.tokens
        pieces = session.speech_tokens(reply.state, frame.segment)
        while True:
            piece = await self._call.run("speech_tokens", next, pieces, None)
            if piece is None or self._dropped(reply.turn_id):
                break
            reply.tokens += len(piece)
            await self._groups.put(("tokens", reply, list(piece)))
        marker = TasteSegmentAudioFrame(
            reply.turn_id, frame.index, frame.text, frame.n_words,
            start_sample=session.speech_samples(start_tokens, self._out_rate),
            end_sample=session.speech_samples(reply.tokens, self._out_rate),
        )
        await self._groups.put(("segment", reply, marker))
        if not self._dropped(reply.turn_id):  # (Pipecat's TTS usage: the characters of the words voiced)
            await self.start_tts_usage_metrics(frame.text.strip())

    # Vocoder stage ------------------------------------------------------------------------------------
    async def _vocode_stage(self):
        hold = np.zeros(0, dtype=np.float32)  # the last fade_out_ms of audio, until the end is known
        produced = 0
        faded_in = 0  # samples of the reply's fade-in applied so far (its first chunks can be shorter)
        first_audio = False
        while True:
            kind, reply, payload = await self._groups.get()
            if kind == "end_of_call":  # all audio before it is out
                self._end_passed = True
                await self.push_frame(payload)
                continue
            if self._dropped(reply.turn_id) or reply.closed:
                continue
            turn_id = reply.turn_id
            record = self._call.log.turn(turn_id)
            if kind == "start":
                hold, produced, faded_in, first_audio = np.zeros(0, dtype=np.float32), 0, 0, False
                await self.start_ttfb_metrics()
                await self.start_processing_metrics()
                await self.push_frame(TasteAudioStartedFrame(turn_id) if self._call.has_playout
                                      else TTSStartedFrame(context_id=context_id_for(turn_id)))
                continue
            if kind == "segment":
                await self.push_frame(payload)
                continue
            final = kind == "end"
            chunks = []
            if kind == "decode_failed" and not reply.failed:  # flush the synthesis, then nothing more
                try:
                    chunks = await self._call.run("vocode", self._call.session.vocode, reply.state, [], True)
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    chunks = e.audio if isinstance(e, VocodingFailed) else []
                    await self._fail(turn_id, f"vocoding failed: {e}", e)
                reply.failed = True
            elif not reply.failed:
                try:
                    tokens = payload if kind == "tokens" else []
                    chunks = await self._call.run("vocode", self._call.session.vocode, reply.state, tokens, final)
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    chunks = e.audio if isinstance(e, VocodingFailed) else []  # (made before the failure: played)
                    reply.failed = True
                    await self._fail(turn_id, f"vocoding failed: {e}", e)
            new = np.concatenate([np.asarray(c, np.float32).reshape(-1) for c in chunks] or [np.zeros(0, np.float32)])
            new, faded_in = continue_fade_in(new, faded_in, samples_for_ms(self._fade_in_ms, self._out_rate))
            audio = np.concatenate([hold, new])
            n_fade = samples_for_ms(self._fade_out_ms, self._out_rate)
            # A failed reply ends here, not when its generation does: the audio before the failure
            # plays straight through and fades out (a playout held its last partial frame until then).
            closing = final or reply.failed
            if closing:
                audio, hold = fade_out(audio, n_fade), np.zeros(0, dtype=np.float32)
            else:
                keep = max(0, audio.size - n_fade)
                audio, hold = audio[:keep], audio[keep:]
            if audio.size:
                if not first_audio:
                    first_audio = True
                    await self.stop_ttfb_metrics()
                    if not self._call.has_playout:  # handed to the transport from here (else the playout says when)
                        record.first_audio_at = time.monotonic()
                        self._call.log.event("bot_audio_started", turn_id)
                await self._push_audio(turn_id, audio, produced)
                produced += audio.size
                record.synthesized_samples = produced
            if closing:
                reply.closed = True
                await self.stop_processing_metrics()
                await self.push_frame(TasteAudioStoppedFrame(turn_id) if self._call.has_playout
                                      else TTSStoppedFrame(context_id=context_id_for(turn_id)))
                self._call.log.event("synthesis_done", turn_id, samples=produced,
                                     reason=payload if final else "failed")
                if final and self._current_turn == turn_id:  # (a failed one is still being generated)
                    self._current_turn = None

    async def _push_audio(self, turn_id: int, audio: np.ndarray, offset: int):
        pcm = float_to_pcm16(audio)
        frame = TTSAudioRawFrame(pcm, self._out_rate, 1, context_id=context_id_for(turn_id))
        frame.metadata["taste_offset"] = offset
        if self._call.log.keep_audio:
            self._call.log.synthesized_audio.setdefault(turn_id, []).append(pcm)
        await self.push_frame(frame)

    async def _fail(self, turn_id: int, message: str, exception: Exception):
        logger.warning(f"{self}: turn {turn_id}: {message}")
        self._call.log.turn(turn_id).errors.append(message)
        await self.push_error(f"turn {turn_id}: {message}", exception, category=ErrorCategory.UNKNOWN)


def _give_back(segment: TasteReplySegmentFrame) -> None:
    """Release the segment's back-pressure slot in the semaphore it was taken from (an old one after
    a barge-in: releasing into the generator's new one would loosen its limit for good)."""
    if segment.slot is not None:
        segment.slot.release()
