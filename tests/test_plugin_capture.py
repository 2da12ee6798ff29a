"""TasteTurnCapture with a model-free engine: VAD-gated turns with pre-roll, transcripts from
upstream STT or the built-in ASR, failing turns -> ErrorFrame while the call goes on."""

import asyncio
import time

import numpy as np
import pytest
from pipecat.frames.frames import (
    ErrorFrame,
    InputAudioRawFrame,
    TTSAudioRawFrame,
    TranscriptionFrame,
    UserStartedSpeakingFrame,
    UserStoppedSpeakingFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.audio.vad.vad_analyzer import VADState
from pipecat.pipeline.worker import PipelineParams
from pipecat.tests.utils import SleepFrame, run_test
from pipecat.utils.time import time_now_iso8601

from pipecat_taste import TasteCall, TasteTurnCapture, TurnCaptureParams, WebRTCVADAnalyzer
from pipecat_taste.audio import float_to_pcm16, resample
from pipecat_taste.frames import TasteTurnDecisionFrame, TasteTurnStatusFrame, TasteUserTurnFrame
from pipecat_taste.testing import FakeEngine
from taste_agents.caller import load_utterances

SR = 16000


@pytest.fixture(scope="module")
def utterances():
    return load_utterances()


def audio_frames(audio, rate=SR, ms=20, from_rate=SR):
    audio = resample(audio, from_rate, rate)
    n = rate * ms // 1000
    audio = np.concatenate([audio, np.zeros((-audio.size) % n, np.float32)])
    return [InputAudioRawFrame(float_to_pcm16(audio[i:i + n]), rate, 1) for i in range(0, audio.size, n)]


def silence(seconds):
    return np.zeros(int(seconds * SR), np.float32)


def transcript(text):
    # Audio frames are system frames and overtake queued data frames: let the transcript land
    # before more audio is pushed (in a live call audio arrives in real time).
    return [SleepFrame(0.2), TranscriptionFrame(text, "caller", time_now_iso8601(), finalized=True), SleepFrame(0.2)]


async def run_capture(frames, engine=None, params=None, rate=SR, vad=True, tail_secs=0.8):
    """Runs the frames through a capture; ``tail_secs`` is the time left for the turn to finish
    after the last frame (transcript timeout + worker threads; a busy CI machine needs more)."""
    call = TasteCall(engine or FakeEngine())
    capture = TasteTurnCapture(call, vad_analyzer=WebRTCVADAnalyzer() if vad else None,
                               params=params or TurnCaptureParams(transcript_timeout_secs=0.3))
    down, up = await run_test(capture, frames_to_send=frames + [SleepFrame(tail_secs)],
                              pipeline_params=PipelineParams(audio_in_sample_rate=rate))
    return call, down, up


def of(frames, cls):
    return [f for f in frames if isinstance(f, cls)]


class DropLog:
    """A call log that keeps only the upstream words dropped (``UpstreamTranscripts.drop``)."""

    def __init__(self):
        self.dropped = []

    def event(self, kind, **fields):
        if kind == "transcript_dropped":
            self.dropped.append(fields["text"])


@pytest.mark.parametrize("rate", [16000, 8000])
async def test_turn_with_upstream_transcript(utterances, rate):
    hello = utterances["hello"]
    frames = audio_frames(np.concatenate([silence(0.6), hello.audio]), rate) + transcript(hello.text) + \
        audio_frames(silence(1.0), rate)
    call, down, up = await run_capture(frames, rate=rate)
    turns = of(down, TasteUserTurnFrame)
    assert len(turns) == 1
    turn = turns[0]
    assert turn.transcript == hello.text and turn.turn.transcript == hello.text
    # Pre-roll and post-roll: the captured audio covers the whole utterance plus a little.
    assert hello.seconds + 0.1 <= turn.turn.audio_seconds <= hello.seconds + 0.3 + 0.2 + 0.25
    assert [t.text for t in of(up, TranscriptionFrame)] == [hello.text]  # the transcript goes upstream
    for cls in (VADUserStartedSpeakingFrame, VADUserStoppedSpeakingFrame, UserStartedSpeakingFrame,
                UserStoppedSpeakingFrame):
        assert len(of(down, cls)) == 1 and len(of(up, cls)) == 1, cls
    assert len(of(down, InputAudioRawFrame)) == len([f for f in frames if isinstance(f, InputAudioRawFrame)])
    record = call.log.turns[turn.turn_id]
    assert record.speech_seconds == pytest.approx(hello.seconds, abs=0.35)
    # the STT's words are the transcript: the built-in ASR's announced pass is taken back before the
    # tower's pass (user_turn) runs
    assert call.session.listening == ["ended", "withdrawn transcription", "user_turn", "withdrawn transcription tower"]


async def test_an_stt_s_transcript_goes_upstream_as_siblings_of_its_frames(utterances):
    """Observers (RTVI's user-transcription) report a broadcast pair once: the STT's frames go
    upstream to a user aggregator as their upstream siblings, not as a second transcript (and with
    ids of their own: a ParallelPipeline drops an id it has seen)."""
    hello = utterances["hello"]
    words = hello.text.split()
    first, rest = " ".join(words[:2]), " ".join(words[2:])
    stt_frames = [TranscriptionFrame(first, "caller", time_now_iso8601()),
                  TranscriptionFrame(rest, "caller", time_now_iso8601(), finalized=True)]
    frames = audio_frames(np.concatenate([silence(0.6), hello.audio])) + \
        [SleepFrame(0.2), stt_frames[0], SleepFrame(0.1), stt_frames[1], SleepFrame(0.2)] + audio_frames(silence(1.0))
    _, down, up = await run_capture(frames)
    assert [t.transcript for t in of(down, TasteUserTurnFrame)] == [f"{first} {rest}"]
    upstream = of(up, TranscriptionFrame)
    assert [f.broadcast_sibling_id for f in upstream] == [f.id for f in stt_frames]
    assert [(f.text, f.user_id, f.finalized) for f in upstream] == [(f.text, f.user_id, f.finalized) for f in stt_frames]
    assert not {f.id for f in upstream} & {f.id for f in stt_frames}


async def test_failing_turn_gives_error_frame_and_the_next_turn_still_works(utterances):
    hello, time_u = utterances["hello"], utterances["time"]
    # the STT answers a little after the speech ended, so its finalized transcript ends turn 1's
    # wait at once: else the next turn's words, pushed at once here, would still find it collecting
    frames = audio_frames(np.concatenate([silence(0.5), hello.audio, silence(0.2)])) + \
        transcript("please explode now") + audio_frames(silence(0.8)) + audio_frames(time_u.audio) + \
        transcript(time_u.text) + audio_frames(silence(1.0))
    call, down, up = await run_capture(frames)
    errors = of(up, ErrorFrame)
    assert len(errors) == 1 and "explode" in errors[0].error
    decisions = of(down, TasteTurnDecisionFrame)
    assert [d.decision for d in decisions] == ["error"]
    turns = of(down, TasteUserTurnFrame)
    assert [t.transcript for t in turns] == [time_u.text]
    assert call.log.turns[decisions[0].turn_id].errors


async def test_transcript_from_built_in_asr(utterances):
    frames = audio_frames(np.concatenate([silence(0.5), utterances["time"].audio, silence(1.0)]))
    call, down, _ = await run_capture(frames, engine=FakeEngine(asr_text="around seven"),
                                      params=TurnCaptureParams(transcripts="asr"))
    assert [t.transcript for t in of(down, TasteUserTurnFrame)] == ["around seven"]


async def test_auto_transcripts_with_only_the_built_in_asr_do_not_wait_for_the_timeout(utterances):
    """Until an upstream transcript has arrived in the call, 'auto' waits only a short grace for
    one: a call that relies on the built-in ASR must not lose the whole timeout on every turn (a
    10 s timeout here would leave the turn unfinished when the test ends)."""
    frames = audio_frames(np.concatenate([silence(0.5), utterances["time"].audio, silence(1.0)]))
    call, down, _ = await run_capture(frames, engine=FakeEngine(asr_text="around seven"),
                                      params=TurnCaptureParams(transcript_timeout_secs=10.0), tail_secs=2.0)
    assert [t.transcript for t in of(down, TasteUserTurnFrame)] == ["around seven"]


async def test_auto_transcripts_start_the_built_in_asr_at_once_beside_the_wait_for_an_stt(utterances):
    """No STT has spoken in the call: the built-in ASR transcribes the turn at once, beside the
    grace wait for an STT's words - it does not wait the grace out first (5 s here: the turn is
    looked at 1 s after the VAD's end, long before the call ends, which would also end the wait)."""
    frames = audio_frames(np.concatenate([silence(0.5), utterances["time"].audio, silence(1.0)]))
    params = TurnCaptureParams(first_transcript_grace_secs=5.0, transcript_timeout_secs=10.0)
    call = TasteCall(FakeEngine(asr_text="around seven"))
    capture = TasteTurnCapture(call, vad_analyzer=WebRTCVADAnalyzer(), params=params)
    seen = {}

    async def look_after_the_end_of_the_turn():
        while not call.log.turns or next(iter(call.log.turns.values())).vad_stop_at is None:
            await asyncio.sleep(0.01)
        await asyncio.sleep(1.0)
        seen["transcript"] = next(iter(call.log.turns.values())).transcript

    looking = asyncio.ensure_future(look_after_the_end_of_the_turn())
    down, _ = await run_test(capture, frames_to_send=frames + [SleepFrame(3.0)],
                             pipeline_params=PipelineParams(audio_in_sample_rate=SR))
    await asyncio.wait_for(looking, 5)
    assert seen == {"transcript": "around seven"}
    assert [t.transcript for t in of(down, TasteUserTurnFrame)] == ["around seven"]


async def test_an_stt_s_words_that_come_before_the_built_in_asr_s_are_the_transcript(utterances, monkeypatch):
    """The race the other way: the STT's words come while the built-in ASR still works; they are
    the turn's transcript, and the ASR's text, when it comes, is dropped."""
    from pipecat_taste.testing import FakeSession

    transcribe = FakeSession.transcribe

    def slow(self, audio):
        time.sleep(1.5)
        return transcribe(self, audio)

    monkeypatch.setattr(FakeSession, "transcribe", slow)
    hello = utterances["hello"]
    frames = (audio_frames(np.concatenate([silence(0.5), hello.audio, silence(0.6)])) + transcript(hello.text)
              + audio_frames(silence(0.6)))
    params = TurnCaptureParams(first_transcript_grace_secs=3.0, transcript_timeout_secs=3.0)
    call, down, _ = await run_capture(frames, engine=FakeEngine(asr_text="built in words"), params=params,
                                      tail_secs=2.0)
    assert [t.transcript for t in of(down, TasteUserTurnFrame)] == [hello.text]


async def test_an_stt_s_interim_words_make_the_first_turn_wait_for_its_final_words(utterances):
    """An STT that sends interim words while the caller speaks is there: the call's first turn
    waits for its final words as later turns do (transcript_timeout_secs), instead of racing the
    built-in ASR for first_transcript_grace_secs - its final words 1.0 s after the speech are the
    transcript, not the ASR's, and nothing is dropped."""
    from pipecat.frames.frames import InterimTranscriptionFrame
    from loguru import logger

    hello = utterances["hello"]
    half = hello.audio.size // 2
    frames = (audio_frames(np.concatenate([silence(0.5), hello.audio[:half]]))
              + [InterimTranscriptionFrame("hello I would", "caller", time_now_iso8601()), SleepFrame(0.2)]
              + audio_frames(np.concatenate([hello.audio[half:], silence(0.5)])) + [SleepFrame(0.5)]
              + transcript(hello.text) + audio_frames(silence(0.5)))
    warnings = []
    sink = logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING")
    try:
        call, down, _ = await run_capture(frames, engine=FakeEngine(asr_text="built in words"),
                                          params=TurnCaptureParams(transcript_timeout_secs=3.0), tail_secs=2.0)
    finally:
        logger.remove(sink)
    assert [t.transcript for t in of(down, TasteUserTurnFrame)] == [hello.text]
    assert not [w for w in warnings if "dropped" in w], warnings


async def test_an_stt_s_late_words_for_a_turn_the_built_in_asr_took_are_not_the_next_turn_s(utterances):
    """'auto' waits only a grace for the call's first upstream transcript, then the built-in ASR
    takes the turn; the STT's words for it, coming while the caller already says the next thing,
    are dropped (they were given to that next turn)."""
    hello, time_u = utterances["hello"], utterances["time"]
    half = time_u.audio.size // 2
    frames = (audio_frames(np.concatenate([silence(0.5), hello.audio, silence(0.8), time_u.audio[:half]]))
              # late: turn 1 went to the built-in ASR after the 0.3 s grace, and words for it are absorbed
              # for transcript_timeout_secs after that (1.2 s and 3 s: a busy CI machine's event loop
              # can fire the grace's timer a few hundred milliseconds late)
              + [SleepFrame(1.2)] + transcript(hello.text)
              + audio_frames(np.concatenate([time_u.audio[half:], silence(0.8)])) + transcript(time_u.text)
              + audio_frames(silence(0.5)))
    from loguru import logger

    warnings = []
    sink = logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING")
    try:
        call, down, _ = await run_capture(frames, engine=FakeEngine(asr_text="hello there"),
                                          params=TurnCaptureParams(transcripts="auto", transcript_timeout_secs=3.0),
                                          tail_secs=2.0)
    finally:
        logger.remove(sink)
    assert [t.transcript for t in of(down, TasteUserTurnFrame)] == ["hello there", time_u.text]
    # a warning, not an INFO line: the turn was answered on other words than the STT's
    said = [w for w in warnings if f"dropped upstream transcript {hello.text!r}" in w]
    assert len(said) == 1 and "late words of a turn the built-in ASR transcribed" in said[0], warnings


async def test_no_transcript_and_no_asr_is_an_error_not_a_crash(utterances):
    frames = audio_frames(np.concatenate([silence(0.5), utterances["time"].audio, silence(1.0)]))
    _, down, up = await run_capture(frames, params=TurnCaptureParams(transcript_timeout_secs=0.2), tail_secs=2.0)
    assert not of(down, TasteUserTurnFrame)
    assert [d.decision for d in of(down, TasteTurnDecisionFrame)] == ["error"]
    assert "no built-in ASR" in of(up, ErrorFrame)[0].error


async def test_no_words_from_an_stt_before_the_capture_is_a_noise_not_an_error(utterances):
    """Without a built-in ASR, a noise before the STT's first words of the call was an ErrorFrame
    ('no built-in ASR'): with an STT service before the capture, a turn it has no words for is ignored."""
    from pipecat.pipeline.pipeline import Pipeline

    frames = audio_frames(np.concatenate([silence(0.5), utterances["time"].audio, silence(1.0)]))
    capture = TasteTurnCapture(TasteCall(FakeEngine()), vad_analyzer=WebRTCVADAnalyzer(),
                               params=TurnCaptureParams(transcript_timeout_secs=0.2))
    down, up = await run_test(Pipeline([silent_stt(), capture]), frames_to_send=frames + [SleepFrame(2.0)])
    assert [(d.decision, d.reason) for d in of(down, TasteTurnDecisionFrame)] == [("ignored", "the STT sent no words for it")]
    assert of(up, ErrorFrame) == [] and of(down, ErrorFrame) == []


async def test_short_speech_is_ignored(utterances):
    blip = utterances["hello"].audio[: int(0.45 * SR)]
    frames = audio_frames(np.concatenate([silence(0.5), blip])) + transcript("hel") + audio_frames(silence(1.0))
    _, down, _ = await run_capture(frames, params=TurnCaptureParams(min_turn_secs=0.8, min_speech_secs=0.8,
                                                                    transcript_timeout_secs=0.2))
    assert not of(down, TasteUserTurnFrame)
    assert [d.decision for d in of(down, TasteTurnDecisionFrame)] == ["ignored"]


@pytest.mark.parametrize("mode", ["asr", "upstream"])
async def test_a_short_yes_is_answered_but_not_while_the_agent_talks(utterances, mode):
    """The VAD measures a spoken 'yes' at about 0.2 s, under min_speech_secs: the caller's answer
    (it was ignored as too short), unless it came while the agent was answering (a backchannel)."""
    yes = utterances["yes"]
    frames = audio_frames(np.concatenate([silence(0.5), yes.audio]))
    frames += (transcript(yes.text) if mode == "upstream" else []) + audio_frames(silence(1.0))
    params = TurnCaptureParams(transcripts=mode, transcript_timeout_secs=0.5)
    call, down, _ = await run_capture(frames, engine=FakeEngine(asr_text=yes.text), params=params, tail_secs=1.0)
    (record,) = call.log.turns.values()
    assert record.speech_seconds < params.min_speech_secs  # (what makes it a short one)
    assert [t.transcript for t in of(down, TasteUserTurnFrame)] == [yes.text]

    busy = TasteCall(FakeEngine(asr_text=yes.text))
    busy.active_reply_turn = busy.new_turn_id()  # the agent is answering
    capture = TasteTurnCapture(busy, vad_analyzer=WebRTCVADAnalyzer(), params=params)
    down, _ = await run_test(capture, frames_to_send=frames + [SleepFrame(1.0)],
                             pipeline_params=PipelineParams(audio_in_sample_rate=SR))
    assert not of(down, TasteUserTurnFrame) and not [e for e in busy.log.events if e["kind"] == "barge_in"]
    assert busy.log.turn(busy.active_reply_turn + 1).reason.endswith("over the agent's reply")


def test_min_turn_secs_cannot_be_above_min_speech_secs():
    with pytest.raises(ValueError, match="min_turn_secs .0.5. must not be above min_speech_secs .0.25."):
        TurnCaptureParams(min_turn_secs=0.5)


@pytest.mark.parametrize("mode, text", [("asr", "."), ("upstream", "... ?")])
async def test_a_transcript_without_words_is_not_answered(mode, text):
    """Whisper writes "." for a cough or a door: no turn to answer, and no error."""
    call = TasteCall(FakeEngine(asr_text=text))
    capture = TasteTurnCapture(call, params=TurnCaptureParams(transcripts=mode, transcript_timeout_secs=0.3))
    frames = vad_turn(1.0) + ([SleepFrame(0.1), stt(text)] if mode == "upstream" else [])
    down, up = await run_with(capture, frames, tail_secs=1.0)
    assert not of(down, TasteUserTurnFrame) and not of(up, ErrorFrame)
    decisions = of(down, TasteTurnDecisionFrame)
    assert [(d.decision, d.reason) for d in decisions] == [("ignored", f"no words in the transcript {text!r}")]
    # what its end announced to the shared steps is taken back: the ASR's pass once the transcript is
    # in, the tower's as the turn is given up
    assert call.session.listening == ["ended", "withdrawn transcription", "withdrawn transcription tower"]


async def test_early_replies_that_cannot_happen_are_named():
    """early_reply_secs not below the VAD's stop_secs turns early replies off: say so at the start."""
    from loguru import logger

    said = []
    sink = logger.add(lambda message: said.append(str(message)), level="WARNING")
    try:
        for early in (0.2, 0.6):
            capture = TasteTurnCapture(TasteCall(FakeEngine()), vad_analyzer=WebRTCVADAnalyzer(),
                                       params=TurnCaptureParams(early_reply_secs=early))
            await run_with(capture, audio_frames(silence(0.1)), tail_secs=0.1)
    finally:
        logger.remove(sink)
    named = [line for line in said if "early_reply_secs" in line]
    assert len(named) == 1 and "early_reply_secs=0.6 is not below the VAD's stop_secs=0.5" in named[0]


async def test_follows_an_upstream_vad(utterances):
    """Without its own analyzer the capture uses the VAD frames of a VADProcessor upstream."""
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.processors.audio.vad_processor import VADProcessor

    hello = utterances["hello"]
    call = TasteCall(FakeEngine())
    capture = TasteTurnCapture(call, vad_analyzer=None, params=TurnCaptureParams(transcript_timeout_secs=0.3))
    pipeline = Pipeline([VADProcessor(vad_analyzer=WebRTCVADAnalyzer()), capture])
    frames = audio_frames(np.concatenate([silence(0.5), hello.audio])) + transcript(hello.text) + \
        audio_frames(silence(1.0))
    down, _ = await run_test(pipeline, frames_to_send=frames + [SleepFrame(0.8)])
    assert [t.transcript for t in of(down, TasteUserTurnFrame)] == [hello.text]
    assert len(of(down, VADUserStartedSpeakingFrame)) == 1  # the VADProcessor's, not duplicated


async def test_set_up_mistakes_around_the_vad_are_said_once_and_do_not_double_the_vad_frames(utterances):
    """A VADProcessor before a capture that runs its own VAD sent every VAD frame downstream twice;
    a capture that follows an upstream VAD with none there heard no turn and said nothing."""
    from loguru import logger
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.processors.audio.vad_processor import VADProcessor

    hello = utterances["hello"]
    warnings = []
    sink = logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING")
    try:
        call = TasteCall(FakeEngine())
        capture = TasteTurnCapture(call, vad_analyzer=WebRTCVADAnalyzer(),
                                   params=TurnCaptureParams(transcript_timeout_secs=0.3))
        pipeline = Pipeline([VADProcessor(vad_analyzer=WebRTCVADAnalyzer()), capture])
        frames = audio_frames(np.concatenate([silence(0.5), hello.audio])) + transcript(hello.text) + \
            audio_frames(silence(1.0))
        down, _ = await run_test(pipeline, frames_to_send=frames + [SleepFrame(0.8)])
        assert [t.transcript for t in of(down, TasteUserTurnFrame)] == [hello.text]
        assert len(of(down, VADUserStartedSpeakingFrame)) == len(of(down, VADUserStoppedSpeakingFrame)) == 1
        assert len([w for w in warnings if "runs its own VAD" in w]) == 1, warnings

        warnings.clear()  # following an upstream VAD that is not there: said after 20 s of audio, once
        _, down, _ = await run_capture(audio_frames(silence(19.0)), vad=False, tail_secs=0.1)
        assert not [w for w in warnings if "no VADUserStartedSpeakingFrame" in w]
        _, down, _ = await run_capture(audio_frames(silence(45.0)), vad=False, tail_secs=0.1)
        assert len([w for w in warnings if "no VADUserStartedSpeakingFrame in the call's first 20 s" in w]) == 1
        warnings.clear()  # ... and at once when an STT before it hears words, naming both fixes
        await run_capture(audio_frames(silence(1.0)) + transcript(hello.text) + audio_frames(silence(0.5)), vad=False,
                          tail_secs=0.1)
        said = [w for w in warnings if "no VADUserStartedSpeakingFrame before the first transcript" in w]
        assert len(said) == 1 and "vad_analyzer=WebRTCVADAnalyzer()" in said[0] and "VADProcessor" in said[0], warnings
    finally:
        logger.remove(sink)


async def test_a_transcript_no_turn_claimed_is_logged_as_such_when_the_call_ends():
    """It was dropped silently at the end of the call, and as 'late words of a turn already taken'
    when a turn came later (no turn had been taken)."""
    from loguru import logger

    said = []
    sink = logger.add(lambda m: said.append(m.record["message"]), level="INFO")
    try:
        await run_capture(audio_frames(silence(0.6)) + transcript("hello there") + audio_frames(silence(0.4)),
                          tail_secs=0.1)
    finally:
        logger.remove(sink)
    dropped = [m for m in said if "dropped upstream transcript 'hello there'" in m]
    assert len(dropped) == 1 and "no turn claimed it" in dropped[0], said


def silent_stt():
    from pipecat.services.settings import STTSettings
    from pipecat.services.stt_service import STTService

    class SilentSTT(STTService):
        async def run_stt(self, audio):
            return
            yield

    return SilentSTT(ttfs_p99_latency=1.0, settings=STTSettings(model=None, language=None))


@pytest.mark.parametrize("layout, named", [
    ("stt, user, capture", True),
    ("user, stt, capture", False),
    ("switcher of stts, user, capture", True),
    ("parallel(stt, user | capture)", False),  # the capture's branch is fed by neither
    ("parallel(stt | user), capture", False),  # siblings: the aggregator never sees that STT's frames
])
async def test_a_user_aggregator_between_the_stt_and_the_capture_is_named_at_start(layout, named):
    """Pipecat's cascade order (STT, then the user aggregator) leaves the capture no transcripts:
    the aggregator takes them, and each turn failed with "put a Pipecat STT service before
    TasteTurnCapture" - where there was one."""
    from loguru import logger
    from pipecat.pipeline.parallel_pipeline import ParallelPipeline
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.service_switcher import ServiceSwitcher
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair

    user = LLMContextAggregatorPair(LLMContext()).user()
    capture = TasteTurnCapture(TasteCall(FakeEngine()), vad_analyzer=WebRTCVADAnalyzer())
    processors = {
        "stt, user, capture": lambda: [silent_stt(), user, capture],
        "user, stt, capture": lambda: [user, silent_stt(), capture],
        "switcher of stts, user, capture": lambda: [ServiceSwitcher([silent_stt(), silent_stt()]), user, capture],
        "parallel(stt, user | capture)": lambda: [ParallelPipeline([silent_stt(), user], [capture])],
        "parallel(stt | user), capture": lambda: [ParallelPipeline([silent_stt()], [user]), capture],
    }[layout]()
    warnings = []
    sink = logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING")
    try:
        await run_test(Pipeline(processors), frames_to_send=[SleepFrame(0.1)])
    finally:
        logger.remove(sink)
    said = [w for w in warnings if "put the user aggregator before the STT" in w]
    assert len(said) == (1 if named else 0), warnings


@pytest.mark.parametrize("switcher", [False, True])
async def test_the_user_aggregator_follows_the_capture_s_turns_and_transcripts(switcher):
    """The capture tells the user aggregator it is a realtime service whose transcripts come before
    a reply starts (0.1 s, not the STT's own latency, else a quick barge-in wrote the cut reply
    before its turn). A ServiceSwitcher of STTs between them passes its active service's metadata
    only: the capture's reached the aggregator neither at the start nor after a switch."""
    from pipecat.frames.frames import ManuallySwitchServiceFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.service_switcher import ServiceSwitcher
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair

    from pipecat_taste.capture import TRANSCRIPT_LATENCY_SECS

    user = LLMContextAggregatorPair(LLMContext()).user()
    first, second = silent_stt(), silent_stt()
    stt = ServiceSwitcher([first, second]) if switcher else first
    capture = TasteTurnCapture(TasteCall(FakeEngine()), vad_analyzer=WebRTCVADAnalyzer())
    frames = [SleepFrame(0.3)] + ([ManuallySwitchServiceFrame(service=second), SleepFrame(0.3)] if switcher else [])
    await run_test(Pipeline([user, stt, capture]), frames_to_send=frames)
    assert user._ttfs_p99_latency == TRANSCRIPT_LATENCY_SECS  # (Pipecat keeps it private; no other way to read it)
    assert user._realtime_service_mode


async def test_a_broken_audio_frame_is_skipped_with_a_warning_and_the_call_goes_on(utterances):
    """Six bytes of 'stereo' audio (not whole samples) failed in a numpy reshape."""
    from loguru import logger

    hello = utterances["hello"]
    warnings = []
    sink = logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING")
    try:
        broken = InputAudioRawFrame(b"\x00" * 6, SR, 2)
        frames = [broken] + audio_frames(np.concatenate([silence(0.5), hello.audio])) + transcript(hello.text) + \
            audio_frames(silence(1.0))
        _, down, up = await run_capture(frames)
    finally:
        logger.remove(sink)
    assert [t.transcript for t in of(down, TasteUserTurnFrame)] == [hello.text]
    assert any("InputAudioRawFrame of 6 bytes is not whole 16-bit samples of 2 channel(s), skipped" in w
               for w in warnings), warnings
    assert not of(up, ErrorFrame)


async def test_quiet_telephone_speech_is_still_a_turn(utterances):
    """-26 dB below a normal level at 8 kHz is quiet but clear speech (pipecat issue #2893)."""
    hello = utterances["hello"]
    frames = audio_frames(np.concatenate([silence(0.5), 0.05 * hello.audio]), 8000) + transcript(hello.text) + \
        audio_frames(silence(1.0), 8000)
    _, down, _ = await run_capture(frames, rate=8000)
    assert len(of(down, TasteUserTurnFrame)) == 1


# -- early replies ------------------------------------------------------------------------------------------
def paced(frames):
    """Audio in real time (20 ms per frame): the early hand-over races the VAD's confirmation."""
    out = []
    for frame in frames:
        out += [frame, SleepFrame(0.02)] if isinstance(frame, InputAudioRawFrame) else [frame]
    return out


def statuses(down):
    return [(f.turn_id, f.status) for f in of(down, TasteTurnStatusFrame)]


async def test_a_turn_is_handed_on_early_and_confirmed_by_the_vad(utterances):
    """After early_reply_secs of silence the turn goes on as tentative; the VAD's end (stop_secs
    later) confirms it, and only then does its transcript go upstream."""
    hello = utterances["hello"]
    frames = paced(audio_frames(np.concatenate([silence(0.5), hello.audio, silence(1.2)])))
    call, down, up = await run_capture(frames, engine=FakeEngine(asr_text="hello there"),
                                       params=TurnCaptureParams(transcripts="asr"))
    turns = of(down, TasteUserTurnFrame)
    assert [(t.turn_id, t.tentative) for t in turns] == [(1, True)]
    assert statuses(down) == [(1, "confirmed")]
    record = call.log.turns[1]
    vad_params = WebRTCVADAnalyzer().params
    # handed on after about early_reply_secs of silence, stop_secs - early_reply_secs before the VAD's end
    assert 0.15 < record.vad_stop_at - record.early_end_at < vad_params.stop_secs
    assert record.tokenized_at < record.vad_stop_at  # the reply can start while the VAD makes sure
    assert [t.text for t in of(up, TranscriptionFrame)] == ["hello there"]
    assert not call.log.retracted


async def test_the_caller_going_on_retracts_the_early_turn(utterances):
    """A pause longer than early_reply_secs but shorter than the VAD's stop_secs: the early turn is
    taken back and the whole speech becomes one turn; nothing about the retracted one goes out."""
    hello, time_u = utterances["hello"], utterances["time"]
    frames = paced(audio_frames(np.concatenate([silence(0.5), hello.audio, silence(0.35), time_u.audio,
                                                silence(1.2)])))
    call, down, up = await run_capture(frames, engine=FakeEngine(asr_text="hello there"),
                                       params=TurnCaptureParams(transcripts="asr"))
    turns = of(down, TasteUserTurnFrame)
    assert [(t.turn_id, t.tentative) for t in turns] == [(1, True), (2, True)]
    assert statuses(down) == [(1, "retracted"), (2, "confirmed")]
    assert list(call.log.retracted) == [1] and list(call.log.turns) == [2]
    whole = call.log.turns[2]
    assert whole.early_retracted == 1
    assert whole.audio_seconds >= hello.seconds + 0.35 + time_u.seconds  # one turn: both utterances
    assert whole.speech_start == call.log.retracted[1].speech_start
    assert turns[1].turn.audio_seconds > turns[0].turn.audio_seconds + time_u.seconds
    assert len(of(up, TranscriptionFrame)) == 1  # only the confirmed turn's


async def test_no_early_replies_when_nothing_holds_their_audio(utterances):
    """A synthesizer without a playout sends audio to the transport as it is made: a tentative
    turn's reply would be heard before the VAD confirms the turn, or after it was retracted."""
    from pipecat.pipeline.pipeline import Pipeline

    from pipecat_taste import TasteGenerator, TasteSynthesizer

    hello, time_u = utterances["hello"], utterances["time"]
    audio = np.concatenate([silence(0.5), hello.audio, silence(0.35), time_u.audio, silence(1.2)])  # a short pause
    call = TasteCall(FakeEngine(asr_text="hello there"))
    capture = TasteTurnCapture(call, vad_analyzer=WebRTCVADAnalyzer(), params=TurnCaptureParams(transcripts="asr"))
    down, _ = await run_test(Pipeline([capture, TasteGenerator(call), TasteSynthesizer(call)]),
                             frames_to_send=paced(audio_frames(audio)) + [SleepFrame(1.5)],
                             pipeline_params=PipelineParams(audio_in_sample_rate=SR))
    assert list(call.log.turns) == [1] and call.log.turns[1].early_end_at is None  # one turn, at the VAD's end
    assert not statuses(down) and not call.log.retracted
    assert of(down, TTSAudioRawFrame) and {f.context_id for f in of(down, TTSAudioRawFrame)} == {"taste-turn-1"}


@pytest.mark.parametrize("limit, answered", [(3.0, [1]), (3.4, [1]), (1.5, [3]), (2.0, [2])])
async def test_a_turn_split_at_the_window_is_answered_once(utterances, limit, answered):
    """A turn longer than the audio tower's window is split at max_turn_seconds - 0.5 s. When the
    split falls on the last syllable or the closing silence (3.0, 3.4 for this 2.3 s utterance) the
    rest is no turn and the part before is answered; when the caller goes on speaking (1.5, 2.0)
    the earlier parts get no reply and the last one answers."""
    time_u = utterances["time"]
    call = TasteCall(FakeEngine(asr_text="around seven thirty", max_turn_seconds=limit))
    capture = TasteTurnCapture(call, vad_analyzer=WebRTCVADAnalyzer(),
                               params=TurnCaptureParams(transcripts="asr", early_reply_secs=None))
    frames = audio_frames(np.concatenate([silence(0.5), time_u.audio, silence(1.5)]))
    down, _ = await run_with(capture, frames, tail_secs=1.0)
    turns = of(down, TasteUserTurnFrame)
    assert [t.turn_id for t in turns if t.turn_id > call.replies_muted_upto] == answered
    assert [t.turn_id for t in turns] == sorted(t.turn_id for t in turns)  # handed on in order
    assert all(t.audio_seconds <= limit for t in call.log.turns.values())


@pytest.mark.parametrize("mode", ["upstream", "auto"])
@pytest.mark.parametrize("sent", ["one_transcript_at_the_end", "as_the_caller_speaks"])
async def test_a_split_turn_is_answered_with_the_stt_s_words(mode, sent):
    """An STT may send one transcript for the whole speech once it ends (a segmented STT), or its
    words as the caller speaks. Either way the words that come after the speech ended go to the last
    part of a turn split at the length limit, the part that is answered, as soon as they come (they
    went to the first part, answered only once the last part had waited out the transcript timeout
    for words of its own)."""
    call = TasteCall(FakeEngine(max_turn_seconds=2.0))  # split after 1.5 s
    noise = 0.1 * np.random.default_rng(1).standard_normal(int(2.5 * SR)).astype(np.float32)
    start, stop = VADUserStartedSpeakingFrame(start_secs=0.2), VADUserStoppedSpeakingFrame(stop_secs=0.2)
    if sent == "one_transcript_at_the_end":
        frames = [start] + audio_frames(noise) + [stop, SleepFrame(0.2), stt("all of it at once")]
        heard = ["all of it at once"]
    else:
        cut = int(1.8 * SR)
        frames = [start] + audio_frames(noise[:cut]) + [SleepFrame(0.1), stt("the first part"), SleepFrame(0.1)] + \
            audio_frames(noise[cut:]) + [stop, SleepFrame(0.2), stt("and the rest")]
        heard = ["the first part", "and the rest"]
    capture = TasteTurnCapture(call, params=TurnCaptureParams(transcripts=mode))
    down, up = await run_with(capture, frames, tail_secs=2.0)
    turns = of(down, TasteUserTurnFrame)
    assert [t.transcript for t in turns] == heard
    assert [t.transcript for t in turns if t.turn_id > call.replies_muted_upto] == [heard[-1]]  # the answered part
    assert not of(up, ErrorFrame), [e.error for e in of(up, ErrorFrame)]
    if len(heard) == 1:
        assert call.log.turns[1].decision == "ignored" and "last part" in call.log.turns[1].reason


async def test_a_turn_is_split_at_the_window_inside_a_long_frame():
    """A client may send long frames (a phone stream's media messages of a second and more): the
    turn is cut at the limit inside the frame, and the rest of the frame starts the next part. The
    whole frame used to go to the closed turn, past the audio tower's window, and every turn of
    such a call failed in the tokenizer."""
    call = TasteCall(FakeEngine(max_turn_seconds=2.0))  # split after 1.5 s
    noise = 0.1 * np.random.default_rng(2).standard_normal(int(2.8 * SR)).astype(np.float32)
    frames = [VADUserStartedSpeakingFrame(start_secs=0.2)] + audio_frames(noise, ms=700) + \
        [VADUserStoppedSpeakingFrame(stop_secs=0.2), SleepFrame(0.2), stt("all of it at once")]
    capture = TasteTurnCapture(call, params=TurnCaptureParams(transcripts="upstream"))
    down, up = await run_with(capture, frames)
    seconds = [t.audio_seconds for t in call.log.turns.values()]
    assert len(seconds) == 2 and seconds[0] == pytest.approx(1.5)  # cut inside the third frame
    assert seconds[1] == pytest.approx(1.3, abs=0.21)  # the rest, less the stop's trimmed silence
    assert [t.transcript for t in of(down, TasteUserTurnFrame)] == ["all of it at once"]
    assert not of(up, ErrorFrame), [e.error for e in of(up, ErrorFrame)]


async def test_long_frames_place_a_turn_s_ends_as_short_ones_do(utterances):
    """The VAD follows a long frame in short slices: a pause that begins late in a frame is not
    measured from the frame's start (an early hand-over then trimmed up to a frame of the caller's
    last words as silence), and the pre-roll is not a whole frame long."""
    hello = utterances["hello"]
    audio = np.concatenate([silence(1.5), hello.audio, silence(1.6)])
    heard = {}
    for size in (20, 700):
        call, down, _ = await run_capture(audio_frames(audio, ms=size), engine=FakeEngine(asr_text="hello there"),
                                          params=TurnCaptureParams(transcripts="asr"))
        (turn,) = of(down, TasteUserTurnFrame)
        heard[size] = call.log.turns[turn.turn_id]
        assert heard[size].early_end_at is not None  # (handed on early in both)
    short, long = heard[20], heard[700]
    assert long.audio_seconds == pytest.approx(short.audio_seconds, abs=0.045)
    assert long.speech_seconds == pytest.approx(short.speech_seconds, abs=0.045)


async def test_a_split_speech_takes_its_words_from_one_source():
    """'auto', before any STT has spoken: the built-in ASR transcribes the first part of a speech
    split at the length limit (it wins the race with the grace wait); a segmented STT then sends
    one transcript for the whole speech. The last part is transcribed by the built-in ASR too: the
    STT's words for the whole speech would have said the first part's words again."""
    from pipecat.pipeline.pipeline import Pipeline

    from pipecat_taste import TasteGenerator

    engine = FakeEngine(asr_text=lambda audio: f"{audio.size / SR:.1f} seconds", asr_delay=0.8, max_turn_seconds=2.0)
    call = TasteCall(engine)
    noise = 0.1 * np.random.default_rng(3).standard_normal(int(2.6 * SR)).astype(np.float32)
    frames = [VADUserStartedSpeakingFrame(start_secs=0.2)] + audio_frames(noise) + \
        [VADUserStoppedSpeakingFrame(stop_secs=0.2), SleepFrame(0.2), stt("the whole thing I said")]
    capture = TasteTurnCapture(call, params=TurnCaptureParams(transcripts="auto", incremental_asr=False))
    await run_test(Pipeline([capture, TasteGenerator(call)]), frames_to_send=frames + [SleepFrame(3.0)],
                   pipeline_params=PipelineParams(audio_in_sample_rate=SR))
    heard = [text for role, text in engine.sessions[0].history if role == "user"]
    assert heard == ["1.5 seconds", "1.1 seconds"]  # each part's own words, once
    assert [e["text"] for e in call.log.events if e["kind"] == "transcript_dropped"] == ["the whole thing I said"]


@pytest.mark.parametrize("after_split", [0.2, 0.05])
async def test_a_split_turn_s_last_part_that_muted_is_not_ignored_as_short(after_split):
    """An upstream VAD whose stop_secs (0.5) the capture has not learned yet (it assumes 0.2): the
    part after the split had enough speech to mute the first one, but its measured speech is short.
    It was ignored as the last syllable after the split, the first part as spent, and the STT's
    transcript of the whole speech was never answered. With 0.2 s of speech after the split the
    last part is a turn and takes the words; with 50 ms it is too short to be one, and the first
    part answers for the speech with them."""
    call = TasteCall(FakeEngine(max_turn_seconds=2.0))  # split after 1.5 s
    speech = 0.1 * np.random.default_rng(0).standard_normal(int((1.5 + after_split) * SR)).astype(np.float32)
    frames = [VADUserStartedSpeakingFrame(start_secs=0.2)] + audio_frames(speech) + audio_frames(silence(0.5)) + \
        [VADUserStoppedSpeakingFrame(stop_secs=0.5), SleepFrame(0.3), stt("all of what I said")]
    capture = TasteTurnCapture(call, params=TurnCaptureParams(transcripts="upstream"))
    down, _ = await run_with(capture, frames, tail_secs=2.0)
    assert [t.transcript for t in of(down, TasteUserTurnFrame)] == ["all of what I said"]
    if after_split < 0.1:  # (min_turn_secs)
        assert [t.turn_id for t in of(down, TasteUserTurnFrame)] == [1]
        assert [d.turn_id for d in of(down, TasteTurnDecisionFrame) if d.decision == "ignored"] == [2]


@pytest.mark.serial  # paced audio: the click must fall in the pause after the early hand-over
async def test_a_click_after_an_early_hand_over_does_not_wait_for_words(utterances):
    """A 40 ms lip smack in the pause takes the early turn back (the VAD calls it speech); the STT's
    transcript is already in, and nothing more will come for a click: the turn goes on with it
    (it waited for words after the click until the transcript timeout)."""
    hello = utterances["hello"]
    energy = np.convolve(hello.audio ** 2, np.ones(int(0.04 * SR)), "valid")
    loudest = int(np.argmax(energy))
    click = hello.audio[loudest:loudest + int(0.04 * SR)]
    frames = (paced(audio_frames(np.concatenate([silence(0.5), hello.audio, silence(0.26)])))
              + [TranscriptionFrame(hello.text, "caller", time_now_iso8601(), finalized=True)]
              + paced(audio_frames(np.concatenate([silence(0.06), click, silence(2.5)]))))
    call, down, _ = await run_capture(frames, params=TurnCaptureParams(transcripts="upstream", transcript_timeout_secs=3.0))
    assert call.log.retracted, "the click did not take the early turn back: nothing was tested"
    (turn,) = [t for t in of(down, TasteUserTurnFrame) if t.turn_id not in call.log.retracted]
    record = call.log.turns[turn.turn_id]
    assert turn.transcript == hello.text and record.tokenized_at - record.vad_stop_at < 1.0  # not the 3 s timeout


@pytest.mark.serial  # paced audio: the limit must fall in a 0.35 s pause
async def test_a_split_in_the_pause_after_an_early_hand_over_does_not_confirm_it(utterances):
    """The length limit falls in a short pause after the turn was handed on early, and the caller
    goes on: the early turn is taken back, not confirmed (that gave one sentence two replies)."""
    from pipecat.pipeline.pipeline import Pipeline

    from pipecat_taste import TasteGenerator

    audio = np.concatenate([silence(0.5), utterances["hello"].audio, silence(0.35), utterances["time"].audio, silence(1.0)])
    call = TasteCall(FakeEngine(asr_text="hello there", max_turn_seconds=4.0))
    capture = TasteTurnCapture(call, vad_analyzer=WebRTCVADAnalyzer(), params=TurnCaptureParams(transcripts="asr"))
    down, _ = await run_test(Pipeline([capture, TasteGenerator(call)]),
                             frames_to_send=paced(audio_frames(audio)) + [SleepFrame(1.0)],
                             pipeline_params=PipelineParams(audio_in_sample_rate=SR))
    assert "tentative" in [status for _, status in statuses(down)], "no early hand-over: nothing was tested"
    assert len([r for r in call.log.turns.values() if r.decision == "reply"]) == 1  # one sentence, one reply
    assert call.log.retracted  # the early turn, taken back at the split


async def test_early_replies_can_be_turned_off(utterances):
    hello = utterances["hello"]
    frames = paced(audio_frames(np.concatenate([silence(0.5), hello.audio, silence(1.2)])))
    call, down, _ = await run_capture(frames, engine=FakeEngine(asr_text="hello there"),
                                      params=TurnCaptureParams(transcripts="asr", early_reply_secs=None))
    assert [(t.turn_id, t.tentative) for t in of(down, TasteUserTurnFrame)] == [(1, False)]
    assert not statuses(down) and call.log.turns[1].early_end_at is None
    assert call.log.turns[1].tokenized_at > call.log.turns[1].vad_stop_at


async def test_after_a_retraction_the_turn_waits_for_the_transcript_of_the_rest(utterances):
    """An upstream STT that transcribes the speech before the pause: the early turn takes that
    transcript and is retracted when the caller goes on; the whole turn then waits for the
    transcript of the rest instead of going on with the first part's alone."""
    hello, time_u = utterances["hello"], utterances["time"]
    stt_frames = [TranscriptionFrame(u.text, "caller", time_now_iso8601(), finalized=True) for u in (hello, time_u)]
    frames = (paced(audio_frames(np.concatenate([silence(0.5), hello.audio, silence(0.26)])))
              + [stt_frames[0]]
              + paced(audio_frames(np.concatenate([silence(0.1), time_u.audio, silence(0.7)])))  # the VAD's end too
              + [stt_frames[1]]
              + paced(audio_frames(silence(0.5))))
    call, down, up = await run_capture(frames, params=TurnCaptureParams(transcripts="upstream",
                                                                        transcript_timeout_secs=1.0))
    turns = of(down, TasteUserTurnFrame)
    assert [(t.turn_id, t.tentative, t.transcript) for t in turns] == \
        [(1, True, hello.text), (2, False, f"{hello.text} {time_u.text}")]  # 2: confirmed before its transcript came
    assert statuses(down) == [(1, "retracted")]
    # upstream once, as siblings of the STT's own frames (observers report each of them once)
    upstream = of(up, TranscriptionFrame)
    assert [(t.text, t.broadcast_sibling_id) for t in upstream] == [(f.text, f.id) for f in stt_frames]


async def test_the_transcript_of_the_speech_before_the_pause_may_come_after_the_retraction(utterances):
    """As above, but the STT sends its transcript of the speech before the pause (as it usually
    does) a little after the caller went on: the whole turn still waits for the rest."""
    hello, time_u = utterances["hello"], utterances["time"]
    cut = int(0.4 * SR)
    frames = (paced(audio_frames(np.concatenate([silence(0.5), hello.audio, silence(0.3), time_u.audio[:cut]])))
              + [TranscriptionFrame(hello.text, "caller", time_now_iso8601(), finalized=True)]
              + paced(audio_frames(np.concatenate([time_u.audio[cut:], silence(0.7)])))
              + [TranscriptionFrame(time_u.text, "caller", time_now_iso8601(), finalized=True)]
              + paced(audio_frames(silence(0.5))))
    call, down, up = await run_capture(frames, params=TurnCaptureParams(transcripts="upstream",
                                                                        transcript_timeout_secs=1.0))
    assert [t.transcript for t in of(down, TasteUserTurnFrame)] == [f"{hello.text} {time_u.text}"]
    assert list(call.log.retracted) == [1] and of(down, ErrorFrame) == []


async def test_a_slow_stt_s_transcript_goes_to_its_own_turn_not_the_next(utterances):
    """The STT's transcript of turn 1 comes after the caller has begun turn 2 (within the wait):
    it is turn 1's, and turn 2 gets its own."""
    hello, time_u = utterances["hello"], utterances["time"]
    frames = (paced(audio_frames(np.concatenate([silence(0.5), hello.audio, silence(0.8), time_u.audio[:SR // 2]])))
              + [TranscriptionFrame(hello.text, "caller", time_now_iso8601(), finalized=True)]
              + paced(audio_frames(np.concatenate([time_u.audio[SR // 2:], silence(0.7)])))
              + [TranscriptionFrame(time_u.text, "caller", time_now_iso8601(), finalized=True)]
              + paced(audio_frames(silence(0.5))))
    call, down, up = await run_capture(frames, params=TurnCaptureParams(transcripts="upstream",
                                                                        transcript_timeout_secs=2.0))
    assert [(t.turn_id, t.transcript) for t in of(down, TasteUserTurnFrame)] == [(1, hello.text), (2, time_u.text)]
    assert of(down, ErrorFrame) == []


async def test_a_call_without_a_playout_ends_when_its_processors_clean_up():
    """The processors are usable on their own: whichever of them a pipeline holds, the call (its
    session and worker threads) ends with the last one's cleanup, not only the playout's."""
    from pipecat.pipeline.pipeline import Pipeline

    from pipecat_taste import TasteGenerator, TasteSynthesizer

    u = load_utterances()
    engine = FakeEngine()
    call = TasteCall(engine)
    capture = TasteTurnCapture(call, vad_analyzer=WebRTCVADAnalyzer(), params=TurnCaptureParams(transcript_timeout_secs=0.3))
    pipeline = Pipeline([capture, TasteGenerator(call), TasteSynthesizer(call)])
    frames = audio_frames(np.concatenate([silence(0.5), u["hello"].audio])) + transcript(u["hello"].text)
    await run_test(pipeline, frames_to_send=frames + audio_frames(silence(1.0)) + [SleepFrame(1.0)],
                   pipeline_params=PipelineParams(audio_in_sample_rate=SR))
    assert call.log.turns[1].decision == "reply"  # the call worked
    assert call.closed and engine.sessions[0].closed
    for _ in range(50):  # the executors were shut down; their threads end on their own
        if not call.worker_threads():
            break
        await asyncio.sleep(0.02)
    assert call.worker_threads() == []


@pytest.mark.serial  # the barge-in stop is measured against real-time playout
async def test_without_a_playout_the_caller_still_interrupts_a_reply_the_transport_is_playing():
    """Generation ends long before its audio has played: the transport's BotStarted/Stopped frames
    keep the reply interruptible when no TastePlayout tracks it."""
    from pipecat.pipeline.pipeline import Pipeline

    from pipecat_taste import TasteGenerator, TasteSynthesizer
    from taste_agents.caller import BargeIn, Pause, Say, WaitForReply
    from taste_agents.simulate import simulate_call

    u = load_utterances()
    engine = FakeEngine(reply_words=tuple(f"w{i}" for i in range(15)))  # 3 s of reply, generated at once

    def without_playout(log):
        call = TasteCall(engine, log=log)
        return Pipeline([TasteTurnCapture(call, vad_analyzer=WebRTCVADAnalyzer()), TasteGenerator(call),
                         TasteSynthesizer(call)])

    script = [Pause(0.3), Say(u["time"]), BargeIn(u["bargein"], after_agent_ms=800), WaitForReply(timeout_s=5, end_silence_s=0.8)]
    result = await simulate_call(engine, script, service_factory=without_playout, tail_s=1.0)
    assert result.errors == []
    assert result.log.turns[1].interrupted and result.log.turns[1].barge_in_at is not None
    checks = result.report["checks"]
    assert checks["talk_over_ms_outside_barge_in"] == 0.0 and checks["barge_in_within_100ms"]
    # the synthesizer hands the audio to the transport: it says when (the report's latency needs it)
    assert result.log.turns[1].first_audio_at is not None and result.report["turns"][0]["first_audio_latency_ms"] > 0


async def test_pipecat_s_user_aggregator_follows_our_turns_and_a_cough_does_not_cut_the_reply():
    """Announced as a realtime service (LLMServiceMetadataFrame), the capture decides the turns:
    an LLMContextAggregatorPair's user side in front of it runs no turn strategies of its own on
    the VAD frames (which interrupted the bot for a 0.16 s sound the capture ignores)."""
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair

    from pipecat_taste import TasteSpeechToSpeech
    from taste_agents.caller import BargeIn, Pause, Say, Utterance, WaitForReply
    from taste_agents.simulate import simulate_call

    u = load_utterances()
    engine = FakeEngine(asr_text="what the caller said", reply_words=tuple("one two three four five six seven eight nine ten".split()))
    context = LLMContext()

    def with_user_aggregator(log):
        return Pipeline([LLMContextAggregatorPair(context).user(), TasteSpeechToSpeech(engine, log=log)])

    cough = Utterance("cough", "", u["time"].audio[1600:1600 + int(0.16 * SR)].copy())
    script = [Pause(0.3), Say(u["hello"]), BargeIn(cough, after_agent_ms=600), WaitForReply(timeout_s=6, end_silence_s=0.8)]
    result = await simulate_call(engine, script, service_factory=with_user_aggregator, tail_s=1.0)
    reply = result.log.turns[1]
    assert reply.decision == "reply" and not reply.interrupted and reply.played_words == reply.total_words == 10
    assert [t.decision for t in result.log.turns.values()][1:] == ["ignored"]


async def test_user_speaking_frames_come_while_the_caller_speaks(utterances):
    """Every 0.2 s of speech, as Pipecat's VADProcessor does: the pipeline's idle timeout counts
    them as activity and must not end the call in the middle of a long turn."""
    from pipecat.frames.frames import UserSpeakingFrame

    hello = utterances["hello"]
    frames = audio_frames(np.concatenate([silence(0.4), hello.audio])) + transcript(hello.text) + \
        audio_frames(silence(0.8))
    call, down, up = await run_capture(frames)
    speaking = len(of(down, UserSpeakingFrame))
    assert len(of(up, UserSpeakingFrame)) == speaking  # broadcast, like the VAD frames
    seconds = call.log.turns[1].speech_seconds  # the VAD's speaking state, measured in the audio
    assert seconds / 0.2 - 2 <= speaking <= seconds / 0.2 + 1, (speaking, seconds)


# -- transcripts in parts, late words, short noises, what the capture holds on to ---------------------------
def vad_turn(seconds):
    """A turn as an upstream VAD reports it (the capture follows its frames): noise between them."""
    noise = 0.1 * np.random.default_rng(0).standard_normal(int(seconds * SR)).astype(np.float32)
    return [VADUserStartedSpeakingFrame(start_secs=0.2)] + audio_frames(noise) + [VADUserStoppedSpeakingFrame(stop_secs=0.2)]


def stt(text, finalized=True):
    return TranscriptionFrame(text, "caller", time_now_iso8601(), finalized=finalized)


async def run_with(capture, frames, tail_secs=2.0):
    return await run_test(capture, frames_to_send=frames + [SleepFrame(tail_secs)],
                          pipeline_params=PipelineParams(audio_in_sample_rate=SR))


@pytest.mark.parametrize("mode", ["auto", "upstream"])
@pytest.mark.parametrize("parts", ["last_finalized", "none_finalized", "one_finalized_while_speaking"])
async def test_a_transcript_in_parts_is_one_turn_s_and_the_next_turn_gets_its_own(mode, parts):
    """An STT may send a turn's transcript in parts: the turn takes them all (until one finalized
    after the turn, or transcript_quiet_secs without one), none goes to the next turn."""
    first, second = "I would like to book a table", "for two people tonight."
    if parts == "one_finalized_while_speaking":  # said of the speech before a pause, not of all of it
        turn = vad_turn(1.0)[:-1] + [SleepFrame(0.1), stt(first), SleepFrame(0.1)] + vad_turn(1.0)[1:]
        frames = turn + [SleepFrame(0.2), stt(second), SleepFrame(0.6)]
    else:
        frames = vad_turn(2.0) + [SleepFrame(0.2), stt(first, finalized=False), SleepFrame(0.15),
                                  stt(second, finalized=parts == "last_finalized"), SleepFrame(0.6)]
    frames += vad_turn(1.0) + [SleepFrame(0.2), stt("Yes.")]
    capture = TasteTurnCapture(TasteCall(FakeEngine()), params=TurnCaptureParams(transcripts=mode))
    down, _ = await run_with(capture, frames)
    assert [t.transcript for t in of(down, TasteUserTurnFrame)] == [f"{first} {second}", "Yes."]


async def test_late_words_of_a_turn_already_taken_are_dropped_not_given_to_the_next_turn():
    """'auto': the first turn falls back to the built-in ASR before the STT answers; the STT's late
    words for it are logged and dropped, and the next turn gets its own transcript."""
    frames = vad_turn(1.0) + [SleepFrame(0.5), stt("book a table for two"), SleepFrame(0.3)] + \
        vad_turn(1.0) + [SleepFrame(0.5), stt("at seven")]
    call = TasteCall(FakeEngine(asr_text="around seven"))
    down, _ = await run_with(TasteTurnCapture(call), frames)
    assert [t.transcript for t in of(down, TasteUserTurnFrame)] == ["around seven", "at seven"]
    assert [e["text"] for e in call.log.events if e["kind"] == "transcript_dropped"] == ["book a table for two"]


async def test_words_said_early_in_a_turn_after_an_ignored_backchannel_stay_that_turn_s():
    """An 'mm-hm' over the agent's reply is ignored at once. An STT's final words that arrive while
    the caller's next turn is being spoken are that turn's: by their arrival alone they cannot be
    told from words the STT might still send for the 'mm-hm', and losing a phrase the turn's audio
    holds would misalign its words (a late 'Mm-hmm.' glued on is the lesser evil)."""
    backchannel, first_half, second_half = vad_turn(0.2), vad_turn(0.6), vad_turn(0.6)
    next_turn = first_half[:-1] + [SleepFrame(0.1), stt("Actually wait,"), SleepFrame(0.1)] + second_half[1:]
    frames = backchannel + [SleepFrame(0.3)] + next_turn + [SleepFrame(0.05), stt("what about tomorrow?")]
    call = TasteCall(FakeEngine())
    call.active_reply_turn = call.new_turn_id()  # the agent is answering
    down, _ = await run_with(TasteTurnCapture(call, params=TurnCaptureParams(transcripts="upstream")), frames)
    assert [d.decision for d in of(down, TasteTurnDecisionFrame)][:1] == ["ignored"]
    assert [t.transcript for t in of(down, TasteUserTurnFrame)] == ["Actually wait, what about tomorrow?"]
    assert [e for e in call.log.events if e["kind"] == "transcript_dropped"] == []


async def test_words_that_come_just_before_the_vad_confirms_the_speech_are_that_turn_s():
    frames = [stt("hello there"), SleepFrame(0.05)] + vad_turn(1.0)
    capture = TasteTurnCapture(TasteCall(FakeEngine()), params=TurnCaptureParams(transcripts="upstream"))
    down, _ = await run_with(capture, frames)
    assert [t.transcript for t in of(down, TasteUserTurnFrame)] == ["hello there"]


@pytest.mark.parametrize("own_vad", [True, False])
async def test_a_short_noise_neither_barges_in_nor_mutes_the_pending_reply(utterances, own_vad):
    """A noise long enough for the VAD but shorter than min_speech_secs is ignored as a turn, so it
    must not cut off or mute the agent's reply (pipecat #4308); real speech still barges in."""
    hello = utterances["hello"].audio
    energy = np.convolve(hello ** 2, np.ones(int(0.3 * SR)), "valid")
    loudest = int(np.argmax(energy))
    noise, speech = hello[loudest:loudest + int(0.3 * SR)], hello
    if not own_vad:  # the upstream VAD's frames around the same lengths of audio
        def around(audio):
            return [VADUserStartedSpeakingFrame(start_secs=0.2)] + audio_frames(audio) + \
                [VADUserStoppedSpeakingFrame(stop_secs=0.2)]
        noise_frames, speech_frames = around(noise), around(speech)
    else:
        noise_frames = audio_frames(np.concatenate([silence(0.5), noise, silence(1.0)]))
        speech_frames = audio_frames(np.concatenate([speech, silence(1.0)]))
    results = []
    for frames in (noise_frames, noise_frames + [SleepFrame(0.3)] + speech_frames):
        call = TasteCall(FakeEngine(asr_text="hello there"))
        answering = call.new_turn_id()  # the turn whose reply is being generated or played
        call.active_reply_turn = answering
        capture = TasteTurnCapture(call, vad_analyzer=WebRTCVADAnalyzer() if own_vad else None,
                                   params=TurnCaptureParams(transcripts="asr", min_speech_secs=0.5))
        await run_with(capture, frames, tail_secs=1.0)
        results.append((call, answering))
    (call, answering), (call2, answering2) = results
    assert call.log.turns[answering + 1].decision == "ignored"  # the noise
    assert [e for e in call.log.events if e["kind"] == "barge_in"] == []
    assert call.replies_muted_upto == 0 and not call.log.turn(answering).interrupted
    # the same noise and then speech: one barge-in, by the speech
    assert [e["by_turn"] for e in call2.log.events if e["kind"] == "barge_in"] == [answering2 + 2]
    assert call2.replies_muted_upto == answering2 + 1 and call2.log.turn(answering2).interrupted


@pytest.mark.parametrize("early", [True, False])
@pytest.mark.parametrize("words", ["", "hello there"])
async def test_a_long_sound_without_words_before_a_reply_begins_does_not_leave_the_turn_unanswered(utterances, words,
                                                                                                  early):
    """The caller's turn waits for its reply; a sound long enough to mute it comes first. With words
    it is the turn that answers for both (the mute stands); without (a door, a TV: no words) it is
    no turn, and the mute is lifted - kept, the earlier turn would never be answered and the call
    would fall silent. (Handed on early or not: the mute is settled on either path.)"""
    call = TasteCall(FakeEngine(asr_text=words))
    waiting = call.new_turn_id()  # a turn whose reply has not begun
    params = TurnCaptureParams(transcripts="asr", min_speech_secs=0.5)
    if not early:
        params = TurnCaptureParams(transcripts="asr", min_speech_secs=0.5, early_reply_secs=None)
    capture = TasteTurnCapture(call, vad_analyzer=WebRTCVADAnalyzer(), params=params)
    await run_with(capture, audio_frames(np.concatenate([silence(0.3), utterances["hello"].audio, silence(1.0)])),
                   tail_secs=1.0)
    sound = call.log.turns[waiting + 1]
    assert (sound.decision, sound.transcript) == ((None, words) if words else ("ignored", "")), sound
    assert await asyncio.wait_for(call.mutes.muted(waiting), 2) is bool(words)
    assert call.replies_muted_upto == (waiting if words else 0)


@pytest.mark.parametrize("mode", ["asr", "auto"])
async def test_finished_turns_are_not_held_for_the_rest_of_the_call(mode):
    """With the built-in ASR, no turn waits for upstream words once its finisher is done with it
    (they held their audio for the whole call: ~0.2 MiB per second of speech at 48 kHz)."""
    frames = []
    for _ in range(3):
        frames += vad_turn(1.0) + [SleepFrame(0.05)]
    call = TasteCall(FakeEngine(asr_text="hello there"))
    capture = TasteTurnCapture(call, params=TurnCaptureParams(transcripts=mode))
    down, _ = await run_with(capture, frames)
    assert len(of(down, TasteUserTurnFrame)) == 3
    # none waits: those left only drop their late words until the transcript timeout (no audio in them)
    assert all(w.absorb_until is not None for w in capture._transcripts.collecting)


def test_an_stt_known_to_mark_no_part_final_is_taken_at_its_first_words():
    """The quiet wait is for STTs that mark their last part finalized (and for the first turn, until
    that is known); one known to mark none costs no wait: its turn is done at its first words."""
    from pipecat_taste.upstream_transcripts import TurnWords

    words = TurnWords()
    words.add("book a table", at=10.05)
    words.end_sample, words.closed_at = 16000, 10.0
    assert not words.done(10.1, 0.4, None) and not words.done(10.1, 0.4, True)
    assert words.done(10.1, 0.4, False) and words.done(10.5, 0.4, None)
    words.add("for two", at=10.2, finalized=True, sample=17000)  # finalized after the speech ended
    assert words.done(10.2, 0.4, True)
    # a part that came while the caller spoke: a streaming STT, whose next parts are waited for
    streaming = TurnWords()
    streaming.add("book a table", at=9.5)
    streaming.end_sample, streaming.closed_at = 16000, 10.0
    assert not streaming.done(10.1, 0.4, False) and streaming.done(10.4, 0.4, False)
    # handed on early: not done until the VAD confirms its end (unless finalized after the speech)
    early = TurnWords()
    early.add("book a table", at=10.05)
    early.end_sample, early.closed_at = 16000, 10.0
    early.handed_on_early()
    assert not early.done(11.0, 0.4, False) and not early.done(11.0, 0.4, None)
    early.confirmed(11.0)  # (its part came before that: the quiet wait, from the confirmation)
    assert not early.done(11.2, 0.4, False) and early.done(11.4, 0.4, False) and early.done(11.4, 0.4, None)


async def test_a_streaming_stt_that_marks_no_part_final_keeps_every_turn_s_parts():
    """An STT that never marks a part finalized and sends parts while the caller speaks (a
    streaming one): once that is known (after the first turn), later turns still wait for the parts
    after their speech, instead of being taken at their first words (their tails were lost)."""
    def two_part_turn(first, second):
        return vad_turn(0.6)[:-1] + [SleepFrame(0.1), stt(first, finalized=False), SleepFrame(0.1)] \
            + vad_turn(0.6)[1:] + [SleepFrame(0.15), stt(second, finalized=False), SleepFrame(1.0)]

    frames = two_part_turn("I would like", "a table for two.") + two_part_turn("and we will", "pay by card.") \
        + vad_turn(0.6) + [SleepFrame(0.2), stt("Thanks.", finalized=False), SleepFrame(1.0)]
    call = TasteCall(FakeEngine())
    capture = TasteTurnCapture(call, params=TurnCaptureParams(transcripts="upstream"))
    down, _ = await run_with(capture, frames)
    assert capture._transcripts.finals_flagged is False
    assert [t.transcript for t in of(down, TasteUserTurnFrame)] == [
        "I would like a table for two.", "and we will pay by card.", "Thanks."]
    assert [e for e in call.log.events if e["kind"] == "transcript_dropped"] == []


async def test_a_turn_handed_on_early_waits_for_the_stt_s_words_after_the_vad_s_end(utterances):
    """The STT's last part comes after the VAD's end (Pipecat's STTs finalize on the VAD's stop):
    a turn handed on early gets it too - the early hand-over changes when the turn is handed on,
    not which words it has."""
    audio = utterances["time"].audio
    half = audio.size // 2

    def paced(frames):  # (in real time: the early hand-over and the VAD's end happen as in a call)
        return [x for f in frames for x in ((f, SleepFrame(0.02)) if isinstance(f, InputAudioRawFrame) else (f,))]

    frames = (paced(audio_frames(np.concatenate([silence(0.3), audio[:half]]))) + [stt("What time", finalized=False)]
              + paced(audio_frames(np.concatenate([audio[half:], silence(0.7)]))) + [stt("is it?")]
              + paced(audio_frames(silence(1.0))))
    transcripts = {}
    for early in (0.2, None):
        call = TasteCall(FakeEngine())
        capture = TasteTurnCapture(call, vad_analyzer=WebRTCVADAnalyzer(),
                                   params=TurnCaptureParams(transcripts="upstream", early_reply_secs=early))
        down, _ = await run_with(capture, frames, tail_secs=1.5)
        transcripts[early] = [t.transcript for t in of(down, TasteUserTurnFrame)]
        assert early is None or call.log.turns[1].early_end_at is not None  # (it was handed on early)
    assert transcripts[0.2] == transcripts[None] == ["What time is it?"]


@pytest.mark.parametrize("finalized, flagged", [(False, False), (True, True)])
async def test_the_capture_learns_whether_the_stt_marks_final_parts(finalized, flagged):
    frames = vad_turn(1.0) + [SleepFrame(0.2), stt("book a table", finalized=finalized), SleepFrame(0.6)]
    capture = TasteTurnCapture(TasteCall(FakeEngine()), params=TurnCaptureParams(transcripts="upstream"))
    down, _ = await run_with(capture, frames, tail_secs=0.5)
    assert [t.transcript for t in of(down, TasteUserTurnFrame)] == ["book a table"]
    assert capture._transcripts.finals_flagged is flagged


# -- input rates ---------------------------------------------------------------------------------------------
class AudioKeepingEngine(FakeEngine):
    """Keeps the audio of every turn handed to the engine."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.turn_audio = []

    def new_session(self, settings=None, voice=None):
        session = super().new_session(settings, voice)
        user_turn = session.user_turn
        session.user_turn = lambda audio, transcript, *heard: (self.turn_audio.append(audio.copy()),
                                                               user_turn(audio, transcript, *heard))[1]
        return session


async def test_an_input_rate_webrtcvad_cannot_work_at_is_resampled_for_it(utterances):
    """webrtcvad works at 8/16/32/48 kHz only: at 24 kHz the capture runs at 16 kHz, not deaf."""
    hello = utterances["hello"]
    frames = audio_frames(np.concatenate([silence(0.6), hello.audio]), 24000) + transcript(hello.text) + \
        audio_frames(silence(1.0), 24000)
    engine = AudioKeepingEngine()
    from loguru import logger

    warnings = []
    sink = logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING")
    try:
        call, down, up = await run_capture(frames, engine=engine, rate=24000)
    finally:
        logger.remove(sink)
    assert warnings == []  # (supported: it warned and told the user to change the pipeline's rate)
    assert of(up, ErrorFrame) == [] and of(down, ErrorFrame) == []
    assert [t.transcript for t in of(down, TasteUserTurnFrame)] == [hello.text]
    assert call.log.turns[1].speech_seconds == pytest.approx(hello.seconds, abs=0.35)


async def test_frames_at_another_rate_than_the_pipeline_s_are_resampled_as_one_stream(utterances):
    """A transport at 8 kHz in a pipeline left at 16 kHz: converting each 20 ms frame on its own
    would put a click at every frame boundary (measured: 30 dB SNR); one stream gives the audio a
    whole-buffer conversion gives."""
    hello = utterances["hello"]
    speech8k = resample(np.concatenate([silence(0.5), hello.audio, silence(1.0)]), SR, 8000)
    frames = audio_frames(speech8k[:-8000], 8000, from_rate=8000) + transcript(hello.text) + \
        audio_frames(speech8k[-8000:], 8000, from_rate=8000)
    engine = AudioKeepingEngine()
    await run_capture(frames, engine=engine, rate=SR)
    (got,) = engine.turn_audio
    reference = resample(speech8k, 8000, SR)
    # where the turn begins in the reference: the offset of best agreement (cross-correlation)
    n = 1 << int(np.ceil(np.log2(reference.size + got.size)))
    correlation = np.fft.irfft(np.fft.rfft(reference, n) * np.conj(np.fft.rfft(got, n)), n)
    offset = int(np.argmax(correlation[:reference.size - got.size + 1]))
    error = got - reference[offset:offset + got.size]
    snr_db = 10 * np.log10(np.sum(got ** 2) / np.sum(error ** 2))
    assert snr_db > 60, snr_db


async def test_a_turn_s_pre_roll_does_not_repeat_the_end_of_the_turn_before(monkeypatch):
    """Pipecat's own VAD defaults stop after 0.2 s, less than the pre-roll (0.3 s): a caller who
    pauses 0.24 s gets two turns, and the second one's pre-roll must start where the first turn's
    audio ended, not 0.5 s back in the ring (it began with the first turn's last syllable, which
    was transcribed and tokenized twice)."""
    from pipecat_taste.testing import FakeSession

    turns = []
    user_turn = FakeSession.user_turn

    def recording(self, audio, *args, **kwargs):
        turns.append(np.asarray(audio, np.float32).copy())
        return user_turn(self, audio, *args, **kwargs)

    monkeypatch.setattr(FakeSession, "user_turn", recording)

    def tone(hz, seconds):
        return (0.5 * np.sin(2 * np.pi * hz * np.arange(int(SR * seconds)) / SR)).astype(np.float32)

    def with_vad_event(frames, event):  # the upstream VAD's frame 0.2 s (ten 20 ms frames) into the audio
        return frames[:10] + [event] + frames[10:]

    frames = (audio_frames(silence(0.6))
              + with_vad_event(audio_frames(tone(300, 1.0)), VADUserStartedSpeakingFrame(start_secs=0.2))
              + with_vad_event(audio_frames(silence(0.24)), VADUserStoppedSpeakingFrame(stop_secs=0.2))
              + with_vad_event(audio_frames(tone(700, 1.0)), VADUserStartedSpeakingFrame(start_secs=0.2))
              + with_vad_event(audio_frames(silence(0.5)), VADUserStoppedSpeakingFrame(stop_secs=0.2)))
    params = TurnCaptureParams(transcripts="asr", incremental_asr=False, early_reply_secs=None)
    await run_capture(frames, engine=FakeEngine(asr_text="hello there"), params=params, vad=False, tail_secs=1.0)

    def level(audio, hz):
        t = np.arange(audio.size) / SR
        return abs(np.dot(audio, np.exp(-2j * np.pi * hz * t))) / max(1, audio.size)

    assert len(turns) == 2
    first, second = turns
    assert level(first, 300) > 0.1 and level(first, 700) < 0.01
    assert level(second, 700) > 0.1 and level(second, 300) < 0.01, level(second, 300)
    onset = np.flatnonzero(np.abs(second) > 1e-3)[0] / SR  # its pre-roll: the pause after the first turn
    assert 0.0 < onset <= 0.05, onset


def test_a_retracted_turn_that_was_absorbing_its_late_words_gives_the_stt_s_words_to_the_turn_that_goes_on():
    """Early in a call the built-in ASR finished an early turn first (its STT words from then on are
    late ones, dropped); the caller went on speaking, so the turn was taken back: the STT's words
    for the speech before the pause belong to the turn that goes on, not to the bin."""
    from pipecat_taste.upstream_transcripts import UpstreamTranscripts

    class Log:
        dropped = []

        def event(self, kind, *args, **kwargs):
            if kind == "transcript_dropped":
                self.dropped.append(args)

    transcripts = UpstreamTranscripts(0.4, Log())
    now = time.monotonic()
    early = transcripts.new_turn(now, 0.2)
    early.close(now, now - 0.3, 16000, True)
    transcripts.expect(early)
    transcripts.absorb(early, 1.5)  # the built-in ASR's transcript came first
    transcripts.withdraw(early)  # retracted: the caller speaks again
    goes_on = early.continuation()
    transcripts.add("what I said before the pause", True, None, 20000, current=goes_on)
    assert [text for _, text in goes_on.parts] == ["what I said before the pause"] and not Log.dropped


def test_a_turn_takes_no_more_transcript_than_two_minutes_of_speech_hold():
    """A client or STT gone wrong (a transcript message after another, each at the server's size
    limit) cannot grow a turn without bound: words past MAX_TURN_TRANSCRIPT_CHARS are dropped,
    with a preview in the call log; the words before stay the turn's."""
    from pipecat_taste.upstream_transcripts import MAX_TURN_TRANSCRIPT_CHARS, UpstreamTranscripts

    log = DropLog()
    transcripts = UpstreamTranscripts(0.4, log)
    turn = transcripts.new_turn(time.monotonic(), 0.2)
    part = "word " * 399 + "last."  # 2000 characters, as the server's per-message limit
    for _ in range(3):
        transcripts.add(part, False, None, 16000, current=turn)
    assert [text for _, text in turn.parts] == [part, part]
    assert sum(len(text) for _, text in turn.parts) <= MAX_TURN_TRANSCRIPT_CHARS
    assert log.dropped == [f"{part[:200]}... (2000 characters)"]
    transcripts.add("and one more", True, None, 16000, current=turn)  # (4012 characters: dropped too)
    assert len(turn.parts) == 2 and len(log.dropped) == 2


def test_words_no_turn_took_go_to_the_next_turn_only_if_they_came_after_its_speech_began():
    """An STT's words that arrived while no turn was captured wait for the next turn: it keeps
    them if they came after its speech began (a fast STT, a VAD slow to confirm), else they are a
    turn-less sound's or an earlier turn's late words, and are logged and dropped."""
    from pipecat_taste.upstream_transcripts import UpstreamTranscripts

    log = DropLog()
    transcripts = UpstreamTranscripts(0.4, log)
    transcripts.add("hello there", True, None, 16000, current=None)  # no turn yet: kept aside
    arrived = time.monotonic()
    turn = transcripts.new_turn(arrived + 0.3, 0.5)  # its speech began 0.5 s before: after the words came
    assert [text for _, text in turn.parts] == ["hello there"] and log.dropped == []
    transcripts.add("old words", True, None, 16000, current=None)
    arrived = time.monotonic()
    turn = transcripts.new_turn(arrived + 2.0, 0.5)  # began 1.5 s after the words came: not its own
    assert turn.parts == [] and log.dropped == ["old words"]
    transcripts.add("said at the end", True, None, 16000, current=None)
    transcripts.end_of_call()
    assert log.dropped == ["old words", "said at the end"]


async def test_the_end_of_the_call_ends_a_turn_s_wait_for_its_words_at_once():
    """A turn waiting for its STT's words (up to the transcript timeout) stops waiting when the
    call ends: what the STT had to say came before; the call's end does not wait 30 s."""
    from pipecat_taste.upstream_transcripts import UpstreamTranscripts

    class Log:
        def event(self, kind, **fields):
            pass

    transcripts = UpstreamTranscripts(0.4, Log())
    now = time.monotonic()
    turn = transcripts.new_turn(now, 0.2)
    turn.close(now, now - 0.3, 16000, True)
    transcripts.expect(turn)
    waiting = asyncio.ensure_future(transcripts.wait(turn, lambda: 30.0, asyncio.Event()))
    await asyncio.sleep(0.1)
    assert not waiting.done()  # no words yet: it waits
    transcripts.end_of_call()
    await asyncio.wait_for(waiting, 2.0)


async def test_a_slice_the_vad_judged_while_the_call_ended_starts_no_turn(utterances):
    """The VAD runs off the event loop: an EndFrame handled while it judged a slice ends the call's
    audio there - the slice starts no turn (a UserStartedSpeakingFrame that no stop would follow)."""
    from pipecat.frames.frames import UserStartedSpeakingFrame

    class EndsWhileJudging(WebRTCVADAnalyzer):
        capture = None

        async def analyze_audio(self, buffer):
            state = await super().analyze_audio(buffer)
            if state == VADState.SPEAKING:
                self.capture._ending = True  # (what _end_of_call sets when the EndFrame comes meanwhile)
            return state

    vad = EndsWhileJudging()
    call = TasteCall(FakeEngine())
    vad.capture = TasteTurnCapture(call, vad_analyzer=vad, params=TurnCaptureParams(transcript_timeout_secs=0.3))
    down, up = await run_test(vad.capture, frames_to_send=audio_frames(utterances["hello"].audio) + [SleepFrame(0.5)],
                              pipeline_params=PipelineParams(audio_in_sample_rate=SR))
    assert vad.capture._ending and not of(down + up, UserStartedSpeakingFrame) and not call.log.turns


def test_an_stt_s_words_go_to_the_oldest_turn_still_waiting_for_words():
    """Two turns closed and waiting for their words (an STT behind by a turn): the next
    transcript is the older turn's, the one after it the newer's."""
    from pipecat_taste.upstream_transcripts import UpstreamTranscripts

    class Log:
        def event(self, kind, **fields):
            pass

    transcripts = UpstreamTranscripts(5.0, Log())
    now = time.monotonic()
    older, newer = transcripts.new_turn(now - 2.0, 0.2), transcripts.new_turn(now - 1.0, 0.2)
    for turn, ended in ((older, now - 1.5), (newer, now - 0.2)):
        turn.close(now, ended, 16000, True)
        transcripts.expect(turn)
    transcripts.add("the first turn's words", True, None, 16000, current=None)
    transcripts.add("the second turn's words", True, None, 32000, current=None)
    assert older.text() == "the first turn's words" and newer.text() == "the second turn's words"
