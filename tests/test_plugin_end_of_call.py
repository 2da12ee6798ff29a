"""How a call ends. ``EndFrame`` is Pipecat's graceful end: each processor passes it on after the
work ahead of it, so the turns the caller ended are still answered and the replies are heard to the
end before the pipeline stops. ``CancelFrame`` is a hang-up: the reply is cut where it is."""

import asyncio

import numpy as np
import pytest
from pipecat.frames.frames import (
    CancelFrame,
    EndFrame,
    Frame,
    InputAudioRawFrame,
    InterruptionFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
    UserStoppedSpeakingFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.tests.utils import SleepFrame, run_test

from pipecat_taste import TasteSpeechToSpeech, TurnCaptureParams
from pipecat_taste.audio import float_to_pcm16, pcm16_to_float
from pipecat_taste.call import TasteCall
from pipecat_taste.frames import TasteReplyEndFrame, TasteReplySegmentFrame, TasteTurnDecisionFrame, TasteTurnMetricsFrame
from pipecat_taste.playout import TastePlayout
from pipecat_taste.synthesis import TasteSynthesizer
from pipecat_taste.testing import FakeEngine, FakeSegment
from taste_agents.caller import load_utterances

IN_RATE, OUT_RATE = 16000, 24000
PARAMS = PipelineParams(audio_in_sample_rate=IN_RATE, audio_out_sample_rate=OUT_RATE)


def caller_audio(seconds_of_speech: float | None = None, silence_secs: float = 0.0) -> list[Frame]:
    """The 'time' utterance (cut after ``seconds_of_speech``), then silence, as 20 ms frames."""
    audio = load_utterances()["time"].audio
    if seconds_of_speech is not None:
        audio = audio[: int(seconds_of_speech * IN_RATE)]
    audio = np.concatenate([audio, np.zeros(int(silence_secs * IN_RATE), np.float32)])
    n = IN_RATE // 50
    audio = np.concatenate([audio, np.zeros((-audio.size) % n, np.float32)])
    return [InputAudioRawFrame(float_to_pcm16(audio[i:i + n]), IN_RATE, 1) for i in range(0, audio.size, n)]


def played(frames) -> np.ndarray:
    audio = [pcm16_to_float(f.audio) for f in frames if isinstance(f, TTSAudioRawFrame)]
    return np.concatenate(audio) if audio else np.zeros(0, np.float32)


async def run_call(frames, engine, capture_params=None, **kw):
    agent, watch = TasteSpeechToSpeech(engine, capture_params=capture_params), EndWatch()
    down, _ = await run_test(Pipeline([watch, agent]), frames_to_send=frames, pipeline_params=PARAMS, **kw)
    assert not watch.gave_up, "the EndFrame never came out of the pipeline"
    return agent.log, down


async def test_end_frame_right_after_a_turn_lets_the_reply_be_heard():
    """The EndFrame comes as soon as the VAD has closed the turn: the turn is still transcribed and
    answered, and the whole reply is played before the pipeline stops (before, it was cut unheard)."""
    engine = FakeEngine(asr_text="what time is it")
    log, down = await run_call(caller_audio(silence_secs=0.7), engine)  # run_test then queues the EndFrame
    [record] = log.turns.values()
    assert record.decision == "reply" and not record.ended_by_hangup
    assert record.played_words == 6 and record.kept_words == 6  # every word of the fake reply
    assert record.played_samples == record.synthesized_samples > 0
    assert played(down).size >= record.synthesized_samples  # all of it reached the transport
    assert [type(f) for f in down if isinstance(f, (TTSStartedFrame, TTSStoppedFrame))] == [TTSStartedFrame,
                                                                                            TTSStoppedFrame]
    assert engine.sessions[0].history == [("user", "what time is it"), ("assistant", "sure I can help with that")]


async def test_a_turn_handed_on_early_is_confirmed_by_the_end_of_the_call():
    """0.3 s of silence: the turn was handed on early (0.2 s) but the VAD never confirmed it (0.5 s).
    No more speech can retract it, so the EndFrame confirms it and its reply is heard."""
    engine = FakeEngine(asr_text="what time is it")
    log, down = await run_call(caller_audio(silence_secs=0.3), engine)
    [record] = log.turns.values()
    assert record.early_end_at is not None and record.decision == "reply"
    assert record.played_words == 6 and not record.ended_by_hangup
    assert played(down).size >= record.synthesized_samples > 0


@pytest.mark.parametrize("silence_secs, early_reply_secs", [(0.16, 0.2), (0.4, None)])
async def test_speech_the_caller_paused_after_is_a_turn_at_the_end_of_the_call(silence_secs, early_reply_secs):
    """The call ends while the VAD makes sure of the caller's pause (before any early hand-over):
    no more speech can follow, so the speech before the pause is a turn and is answered (it was
    dropped as speech still going on)."""
    engine = FakeEngine(asr_text="what time is it")
    log, down = await run_call(caller_audio(silence_secs=silence_secs), engine,
                               capture_params=TurnCaptureParams(early_reply_secs=early_reply_secs))
    [record] = log.turns.values()
    assert record.early_end_at is None and record.decision == "reply", record.reason
    assert record.played_words == 6 and played(down).size >= record.synthesized_samples > 0
    assert engine.sessions[0].history[0] == ("user", "what time is it")
    speech = load_utterances()["time"].seconds
    assert speech - 0.3 < record.audio_seconds < speech + silence_secs  # the pause trimmed, the words kept


async def test_speech_still_going_on_at_the_end_is_dropped_as_a_turn():
    engine = FakeEngine(asr_text="what time is")
    log, down = await run_call(caller_audio(seconds_of_speech=1.0), engine)
    [record] = log.turns.values()
    decisions = [f for f in down if isinstance(f, TasteTurnDecisionFrame)]
    assert [(d.decision, d.reason) for d in decisions] == [("ignored", "the call ended while the caller was speaking")]
    assert record.decision == "ignored" and not record.transcript
    assert any(isinstance(f, UserStoppedSpeakingFrame) for f in down)  # the started/stopped pair stays whole
    assert not any(isinstance(f, TTSStartedFrame) for f in down) and engine.sessions[0].history == []


async def test_speech_over_a_reply_that_the_call_ends_during_cuts_the_reply_off():
    """The caller speaks over the reply (it pauses: no words known yet) and the call ends while they
    still speak: the speech stands, as its mute does, and the reply is cut off where it paused -
    not resumed over the caller and played to its end before the call could end."""
    engine = FakeEngine(asr_text="what time is it", reply_words=tuple(f"word{i}" for i in range(20)))  # 4 s
    frames = caller_audio(silence_secs=0.7) + [SleepFrame(1.5)] + caller_audio(seconds_of_speech=1.0)
    log, down = await run_call(frames, engine)
    reply, speech = log.turns[1], log.turns[2]
    assert speech.decision == "ignored"
    kinds = [e["kind"] for e in log.events]
    assert "reply_paused" in kinds and "barge_in" in kinds and "reply_resumed" not in kinds
    assert reply.interrupted and 0 < reply.played_words < 20 and not reply.ended_by_hangup
    assert played(down).size < 3 * OUT_RATE


async def test_cancel_frame_hangs_up_in_the_middle_of_the_reply():
    engine = FakeEngine(asr_text="what time is it", reply_words=tuple(f"word{i}" for i in range(20)))  # 4 s
    frames = caller_audio(silence_secs=0.7) + [SleepFrame(1.5), CancelFrame()]
    log, down = await run_call(frames, engine, send_end_frame=False)
    [record] = log.turns.values()
    assert record.ended_by_hangup
    assert 0 < played(down).size < 4 * OUT_RATE and record.played_samples < 4 * OUT_RATE
    # the record says which words were heard, as the transport was told them (it said none before)
    heard = "".join(f.text for f in down if isinstance(f, TTSTextFrame)).split()
    assert heard and record.played_text.split() == heard and record.played_words == len(heard)
    assert record.audio_end_at is not None


async def test_an_interruption_from_elsewhere_is_recorded_like_a_barge_in():
    """An InterruptionFrame that is not the capture's barge-in (an RTVI client's, or the app's
    ``task.queue_frame(InterruptionFrame())``) cuts the reply: its record says so (it said
    interrupted=False while the metrics frame and the history said otherwise)."""
    engine = FakeEngine(asr_text="what time is it", reply_words=tuple(f"word{i}" for i in range(12)))  # 2.4 s
    frames = caller_audio(silence_secs=0.7) + [SleepFrame(1.5), InterruptionFrame(), SleepFrame(1.0)]
    log, down = await run_call(frames, engine)
    [record] = log.turns.values()
    assert record.interrupted and record.barge_in_at is None  # not the caller's speech
    assert 0 < record.played_words < 12 and record.dropped_samples > 0
    assert [m.interrupted for m in down if isinstance(m, TasteTurnMetricsFrame)] == [True]
    assert engine.sessions[0].history[-1] == ("assistant", record.played_text)


async def test_speech_dropped_at_the_end_is_decided_after_the_turns_before_it():
    """Turn 1 is still being tokenized when the call ends during turn 2: turn 1 goes out first,
    then turn 2's 'ignored', then the EndFrame (the decision jumped the queue before)."""
    from pipecat_taste import TasteTurnCapture, TurnCaptureParams, WebRTCVADAnalyzer
    from pipecat_taste.frames import TasteUserTurnFrame

    utterances = load_utterances()
    call = TasteCall(FakeEngine(asr_text="around seven thirty", turn_delay=0.6))
    capture = TasteTurnCapture(call, vad_analyzer=WebRTCVADAnalyzer(),
                               params=TurnCaptureParams(transcripts="asr", early_reply_secs=None))
    audio = np.concatenate([np.zeros(IN_RATE // 2, np.float32), utterances["time"].audio,
                            np.zeros(IN_RATE, np.float32), utterances["hello"].audio[:IN_RATE]])
    n = IN_RATE // 50
    frames = [InputAudioRawFrame(float_to_pcm16(audio[i:i + n]), IN_RATE, 1) for i in range(0, audio.size - n + 1, n)]
    down, _ = await run_test(capture, frames_to_send=frames + [EndFrame(), SleepFrame(1.5)], send_end_frame=False,
                             pipeline_params=PARAMS)
    order = [(type(f).__name__, getattr(f, "turn_id", None)) for f in down
             if isinstance(f, (TasteUserTurnFrame, TasteTurnDecisionFrame, EndFrame))]
    assert order == [("TasteUserTurnFrame", 1), ("TasteTurnDecisionFrame", 2), ("EndFrame", None)]


class EndWatch(FrameProcessor):
    """First in a test pipeline. After the EndFrame went by: a barge-in ``interrupt_after`` s later
    (an InterruptionFrame, as the capture sends), and a CancelFrame ``give_up_after`` s later, so
    that an EndFrame lost inside the pipeline fails the test (``gave_up``) instead of hanging it."""

    def __init__(self, interrupt_after: float | None = None, give_up_after: float = 15.0):
        super().__init__()
        self._interrupt_after, self._give_up_after = interrupt_after, give_up_after
        self._task = None
        self.gave_up = False

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        await self.push_frame(frame, direction)
        if isinstance(frame, EndFrame):
            self._task = self.create_task(self._watch())

    async def _watch(self):
        waited = 0.0
        if self._interrupt_after is not None:
            await asyncio.sleep(self._interrupt_after)
            waited = self._interrupt_after
            await self.push_frame(InterruptionFrame())
        await asyncio.sleep(self._give_up_after - waited)
        self.gave_up = True
        await self.push_frame(CancelFrame())

    async def cleanup(self):
        await super().cleanup()
        if self._task is not None:
            await self.cancel_task(self._task)


@pytest.mark.parametrize("vocode_delay, barge_in_after", [
    (0.1, 0.4),  # the EndFrame waits in the synthesizer (still vocoding)
    (0.0, 1.0),  # the EndFrame waits in the playout (all synthesized, 3 s to play)
])
async def test_a_barge_in_while_the_end_waits_still_ends_the_call(vocode_delay, barge_in_after):
    """The synthesizer and the playout drop their queues on a barge-in; the EndFrame waiting in them
    must survive that, or the pipeline never stops."""
    engine = FakeEngine(vocode_delay=vocode_delay)
    call = TasteCall(engine)
    call.active_reply_turn = 1
    segments = [TasteReplySegmentFrame(1, i, f" w{i}", 1, FakeSegment([f"w{i}"], 2), None) for i in range(15)]
    watch = EndWatch(interrupt_after=barge_in_after)
    pipeline = Pipeline([watch, TasteSynthesizer(call), TastePlayout(call)])
    down, _ = await run_test(pipeline, frames_to_send=segments + [TasteReplyEndFrame(1, "finished", 15)],
                             pipeline_params=PARAMS)
    assert not watch.gave_up, "the EndFrame was lost in the barge-in"
    record = call.log.turns[1]
    assert not record.ended_by_hangup  # the barge-in cut it, not the end of the call
    audio = played(down)
    assert 0 < audio.size < 15 * 0.2 * OUT_RATE and abs(audio[-1]) < 1e-3  # cut short, with a fade
    assert [type(f) for f in down if isinstance(f, (TTSStartedFrame, TTSStoppedFrame))] == [TTSStartedFrame,
                                                                                            TTSStoppedFrame]


def capture_and_generator(call) -> Pipeline:
    """The built-in ASR's turns, answered; no synthesizer, no playout."""
    from pipecat_taste import TasteGenerator, TasteTurnCapture, TurnCaptureParams, WebRTCVADAnalyzer

    return Pipeline([TasteTurnCapture(call, vad_analyzer=WebRTCVADAnalyzer(),
                                      params=TurnCaptureParams(transcripts="asr", early_reply_secs=None)),
                     TasteGenerator(call)])


async def test_without_a_playout_an_interrupted_reply_keeps_only_the_words_sent_on():
    """No playout to say what was heard: the conversation keeps the words the generator sent on
    before the interruption, not the one the model was making when it came (it was never spoken)."""
    engine = FakeEngine(asr_text="what time is it", word_delay=0.3, reply_words=tuple(f"w{i}" for i in range(20)))
    call = TasteCall(engine)
    frames = caller_audio(silence_secs=0.8) + [SleepFrame(1.0), InterruptionFrame(), SleepFrame(1.0)]
    down, _ = await run_test(capture_and_generator(call), frames_to_send=frames, pipeline_params=PARAMS)
    record = call.log.turns[1]
    sent = "".join(f.text for f in down if isinstance(f, TasteReplySegmentFrame)).strip()
    assert record.interrupted and 0 < record.total_words < 20
    assert record.kept_words == record.total_words == len(sent.split())
    assert engine.sessions[0].history[-1] == ("assistant", sent)


@pytest.mark.parametrize("decision", ["no_speech", "reply"])
async def test_a_barge_in_while_the_turn_is_decided_marks_only_a_reply_interrupted(decision):
    """An interruption that lands while the model decides: a reply it stops was interrupted, a
    no_speech turn had no reply to interrupt (the call's status said it had)."""
    import time

    call = TasteCall(FakeEngine(asr_text="mm hm", decide=lambda text: time.sleep(1.5) or decision))
    frames = caller_audio(silence_secs=0.8) + [SleepFrame(0.5), InterruptionFrame(), SleepFrame(2.0)]
    down, _ = await run_test(capture_and_generator(call), frames_to_send=frames, pipeline_params=PARAMS)
    record = call.log.turns[1]
    assert record.decision == decision and record.interrupted == (decision == "reply")
    assert not [f for f in down if isinstance(f, TasteReplySegmentFrame)]  # stopped before its first word


async def test_a_session_whose_warm_up_fails_is_closed_and_the_next_try_makes_a_fresh_one(monkeypatch):
    """A session that cannot warm up (e.g. out of GPU memory while capturing) holds the engine's
    shared batch slots and caches: it is closed before the error goes on, every time."""
    from pipecat_taste.testing import FakeSession

    def out_of_memory(session):
        raise RuntimeError("CUDA out of memory (while capturing)")

    monkeypatch.setattr(FakeSession, "warm_up", out_of_memory)
    engine = FakeEngine()
    call = TasteCall(engine)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="out of memory"):
            await call.ensure_session()
    assert len(engine.sessions) == 3 and all(session.closed for session in engine.sessions)
    assert call.session is None
    monkeypatch.undo()
    session = await call.ensure_session()  # the next try works
    assert session is engine.sessions[-1] and not session.closed
    await call.close()


async def test_a_call_cancelled_while_its_session_warms_up_closes_it_once_the_warm_up_is_done(monkeypatch):
    """The caller hangs up while the session captures its steps: the session is closed, but only
    when the warm-up's thread is done with it (its caches are in use until then)."""
    import threading

    from pipecat_taste.testing import FakeSession

    started, finish = threading.Event(), threading.Event()

    def slow_warm_up(session):
        started.set()
        finish.wait(5)
        assert not session.closed  # nothing was freed under the running warm-up

    monkeypatch.setattr(FakeSession, "warm_up", slow_warm_up)
    engine = FakeEngine()
    call = TasteCall(engine)
    task = asyncio.create_task(call.ensure_session())
    await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    (session,) = engine.sessions
    assert not session.closed and call.session is None
    finish.set()
    for _ in range(100):
        if session.closed:
            break
        await asyncio.sleep(0.01)
    assert session.closed
    await call.close()
