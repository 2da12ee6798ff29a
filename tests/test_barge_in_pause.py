"""Barge-in that waits for words (TurnCaptureParams.barge_in='pause', the default with a playout):
the caller's sound over a reply pauses it at once; words cut it off, a sound without any (a door,
a rustle) lets it go on where it stopped."""

import asyncio

import numpy as np
import pytest
from pipecat.frames.frames import (
    InputAudioRawFrame,
    InterimTranscriptionFrame,
    InterruptionFrame,
    TranscriptionFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.tests.utils import SleepFrame, run_test
from pipecat.utils.time import time_now_iso8601

from pipecat_taste import TasteCall, TasteTurnCapture, TurnCaptureParams
from pipecat_taste.audio import float_to_pcm16
from pipecat_taste.frames import TasteReplyPauseFrame, TasteUserTurnFrame
from pipecat_taste.testing import FakeEngine
from taste_agents.caller import BargeIn, Pause, Say, Utterance, WaitForReply, load_utterances
from taste_agents.report import reply_audio_intact
from taste_agents.simulate import simulate_call

SR = 16000
TEN_WORDS = tuple("one two three four five six seven eight nine ten".split())


def words_unless_short(audio: np.ndarray) -> str:
    """The built-in ASR of these calls: no words in a turn shorter than 2 s (the noise: 0.9 s of
    sound with pre- and post-roll), words in anything longer (the caller's sentences)."""
    return "" if audio.size < 2.0 * SR else "what the caller said"


def loudest(audio: np.ndarray, seconds: float) -> np.ndarray:
    n = int(seconds * SR)
    energy = np.convolve(audio ** 2, np.ones(n), "valid")
    start = int(np.argmax(energy))
    return audio[start:start + n].copy()


def pcm(chunks) -> np.ndarray:
    return np.frombuffer(b"".join(chunks), dtype="<i2")


def kinds(log) -> list[str]:
    return [e["kind"] for e in log.events]


@pytest.mark.serial  # it counts the reply's underruns (none): a second worker beside it made one (CI, 2 cores)
async def test_a_noise_over_the_reply_pauses_it_and_the_reply_goes_on_where_it_stopped():
    u = load_utterances()
    engine = FakeEngine(asr_text=words_unless_short, reply_words=TEN_WORDS)  # 2 s of reply
    door = Utterance("door", "", loudest(u["time"].audio, 0.9))  # speech-like to the VAD, no words to the ASR
    script = [Pause(0.3), Say(u["hello"]), BargeIn(door, after_agent_ms=600), WaitForReply(timeout_s=6, end_silence_s=1.0)]
    said = []
    result = await simulate_call(engine, script, tail_s=1.0, progress=said.append)
    assert result.errors == []
    reply, noise = result.log.turns[1], result.log.turns[2]
    assert noise.decision == "ignored"
    # the reply was paused, not cut off: the caller heard all of it
    assert not reply.interrupted and reply.barge_in_at is None
    assert reply.played_words == reply.total_words == 10 and reply.kept_words == 10
    assert "reply_paused" in kinds(result.log) and "reply_resumed" in kinds(result.log)
    assert "barge_in" not in kinds(result.log)
    assert len(reply.pauses_s) == 1 and reply.pauses_s[0] > 0.3  # (the noise, and the VAD's stop after it)
    assert reply.underruns == 0  # a pause is no underrun
    # the audio released is the synthesized audio, faded out into the pause and back in after it
    synthesized, released = pcm(result.log.synthesized_audio[1]), pcm(result.log.released_audio[1])
    intact, _ = reply_audio_intact(synthesized, released, reply, result.line.frame_samples, int(0.02 * SR))
    assert intact and len(reply.audio_gaps) == 1
    # and the agent was silent while the caller's sound went on (after the VAD and the fade)
    barge = next(e for e in result.caller.events if e.kind == "barge_in")
    agent_on = np.abs(result.line.agent.astype(np.int32)) > 300
    # (paused ~0.35 s after its onset: min_speech_secs, the frame, the lead and the fade; room for a busy machine)
    quiet_from, quiet_to = barge.sample + int(0.5 * SR), barge.sample + door.audio.size
    assert not agent_on[quiet_from:quiet_to].any()
    assert agent_on[quiet_to:].any()  # and spoke again after it
    summary = result.report["summary"]
    assert summary["replies_resumed_after_no_turn"] == 1 and summary["replies_cut_by_no_turn"] == 0
    live = "\n".join(said)  # the live lines say what happened
    assert "agent turn 1: paused, the caller speaks over it" in live
    assert "agent turn 1: goes on, the caller's sound had no words" in live and "barge-in" not in live
    from taste_agents.cli import _summary

    assert "replies paused by a sound that was no turn, then resumed: 1" in _summary(result.report, {})


async def test_words_over_the_reply_cut_it_off_from_when_it_paused_while_the_caller_still_speaks():
    u = load_utterances()
    engine = FakeEngine(asr_text=words_unless_short, reply_words=TEN_WORDS)  # 2 s of reply
    script = [Pause(0.3), Say(u["hello"]), BargeIn(u["bargein"], after_agent_ms=600),
              WaitForReply(timeout_s=6, end_silence_s=0.8)]
    result = await simulate_call(engine, script, tail_s=1.0)
    assert result.errors == []
    reply = result.log.turns[1]
    assert reply.interrupted and reply.pauses_s == [] and reply.played_words < reply.total_words
    paused = next(e for e in result.log.events if e["kind"] == "reply_paused")
    cut = next(e for e in result.log.events if e["kind"] == "barge_in")
    assert paused["by_turn"] == cut["by_turn"] == 2
    # the barge-in is dated from the pause (the audio stopped then), and it went out as soon as the
    # words came (the STT's), before the caller's turn was handed on to be answered
    assert reply.barge_in_at == pytest.approx(result.log.t0 + paused["t"], abs=0.02)
    assert reply.barge_in_stop_s < 0.2  # (the 100 ms bound: the serial simulated-call tests)
    tokenized = next(e for e in result.log.events if e["kind"] == "user_turn_tokenized" and e["turn_id"] == 2)
    assert paused["t"] < cut["t"] < tokenized["t"]
    assert result.log.turns[2].decision == "reply"  # the barge-in is answered


@pytest.mark.parametrize("words", [True, False])
async def test_a_sound_that_pauses_goes_on_after_a_breath_and_is_judged_as_a_whole(words):
    """The caller's first sound is handed on early (a 0.42 s breath) and taken back when they go on:
    the pause goes on with the sound. Words in it cut the reply off (the pause was lost with the
    retracted turn: the reply stood paused and the call stalled); a double knock, no words, lets
    the reply go on (the playout still held the pause under the retracted turn's id: it never
    resumed)."""
    u = load_utterances()
    # (the knock, with pre- and post-roll, is 1.9 s: no words in it)
    engine = FakeEngine(asr_text=lambda audio: "" if audio.size < 2.6 * SR else "what the caller said",
                        reply_words=TEN_WORDS)
    door = loudest(u["time"].audio, 0.5)
    breath = np.zeros(int(0.42 * SR), np.float32)
    sound = Utterance("bargein", u["bargein"].text, np.concatenate([door, breath, u["bargein"].audio])) if words \
        else Utterance("knock", "", np.concatenate([door, breath, door]))
    script = [Pause(0.3), Say(u["hello"]), BargeIn(sound, after_agent_ms=600), WaitForReply(timeout_s=6, end_silence_s=0.8)]
    result = await simulate_call(engine, script, tail_s=1.0)
    assert result.errors == []
    assert result.log.retracted  # the breath made an early hand-over, taken back
    reply, last = result.log.turns[1], max(result.log.turns)
    assert kinds(result.log).count("reply_paused") == 1
    if words:
        assert reply.interrupted and reply.pauses_s == [] and "reply_resumed" not in kinds(result.log)
        assert next(e for e in result.log.events if e["kind"] == "barge_in")["by_turn"] == last
        assert result.log.turns[last].decision == "reply" and result.log.turns[last].first_audio_at is not None
    else:
        assert not reply.interrupted and len(reply.pauses_s) == 1 and reply.played_words == reply.total_words == 10
        assert result.log.turns[last].decision == "ignored" and "barge_in" not in kinds(result.log)


async def test_an_stt_s_late_words_for_an_earlier_turn_do_not_make_a_noise_a_barge_in():
    """'auto': the built-in ASR took the first turn; the STT's words for it come late, while a noise
    over the reply is being captured. They are dropped as that turn's late words, so they must not
    count as the noise's: it cut the reply off, and was then ignored as no turn."""
    call = TasteCall(FakeEngine(asr_text=words_unless_short))
    call.has_playout = True

    async def agent_answers_the_first_turn():
        while not any(e["kind"] == "user_turn_tokenized" for e in call.log.events):
            await asyncio.sleep(0.01)
        call.active_reply_turn = 1

    answering = asyncio.ensure_future(agent_answers_the_first_turn())
    late = TranscriptionFrame("Hello, I would like a table.", "caller", time_now_iso8601(), finalized=True)
    frames = vad_turn(2.5) + [SleepFrame(0.8)] + vad_turn(1.0, [late]) + [SleepFrame(1.5)]
    down, _ = await run_test(TasteTurnCapture(call), frames_to_send=frames)
    await answering
    assert [e["text"] for e in call.log.events if e["kind"] == "transcript_dropped"] == [late.text]
    assert [(f.by_turn, f.paused) for f in down if isinstance(f, TasteReplyPauseFrame)] == [(2, True), (2, False)]
    assert not any(isinstance(f, InterruptionFrame) for f in down) and not call.log.turn(1).interrupted
    assert call.log.turn(2).decision == "ignored"


def vad_turn(seconds: float, middle=(), at: float = 0.5):
    """A turn as an upstream VAD reports it, its audio in real time, with ``middle`` frames ``at``
    that fraction of it (halfway)."""
    noise = 0.1 * np.random.default_rng(0).standard_normal(int(seconds * SR)).astype(np.float32)
    n = SR // 50
    audio = []
    for i in range(0, noise.size, n):
        audio += [InputAudioRawFrame(float_to_pcm16(noise[i:i + n]), SR, 1), SleepFrame(0.02)]
    half = 2 * round(at * len(audio) / 2)
    return [VADUserStartedSpeakingFrame(start_secs=0.2)] + audio[:half] + list(middle) + audio[half:] + \
        [VADUserStoppedSpeakingFrame(stop_secs=0.2)]


@pytest.mark.parametrize("words", ["stt_interim", "asr_partial", "none"])
async def test_the_capture_pauses_and_words_heard_while_the_caller_speaks_make_it_a_barge_in(words):
    """An upstream STT's interim words, or a partial transcript of the built-in ASR, while the
    caller speaks confirm the barge-in; a turn with no words resumes the reply (no barge-in)."""
    asr_text = {"stt_interim": None, "asr_partial": "wait a moment", "none": ""}[words]
    call = TasteCall(FakeEngine(asr_text=asr_text, incremental_asr=True))
    call.has_playout = True  # (what would hold the audio)
    call.active_reply_turn = call.new_turn_id()  # the agent is answering
    middle = [InterimTranscriptionFrame("wait a", "caller", time_now_iso8601())] if words == "stt_interim" else []
    params = TurnCaptureParams(transcripts="upstream" if words == "stt_interim" else "asr")
    down, up = await run_test(TasteTurnCapture(call, params=params),
                              frames_to_send=vad_turn(2.0, middle) + [SleepFrame(1.0)])
    pauses = [f for f in down if isinstance(f, TasteReplyPauseFrame)]
    if words != "none":
        assert [(p.by_turn, p.paused) for p in pauses] == [(2, True)]
        assert any(isinstance(f, InterruptionFrame) for f in down)
        cut = next(e for e in call.log.events if e["kind"] == "barge_in")
        stopped = next(e for e in call.log.events if e["kind"] == "user_speech_stopped")
        assert cut["by_turn"] == 2 and cut["t"] < stopped["t"] - 0.5  # at the words, not at the end
        assert call.log.turn(1).interrupted
    else:
        assert [(p.by_turn, p.paused) for p in pauses] == [(2, True), (2, False)]
        assert not any(isinstance(f, InterruptionFrame) for f in down)
        assert "barge_in" not in kinds(call.log) and not call.log.turn(1).interrupted
        assert call.log.turn(2).decision == "ignored"


async def test_without_a_playout_or_with_immediate_barge_in_the_interruption_goes_at_once():
    for has_playout, mode in ((False, "pause"), (True, "immediate")):
        call = TasteCall(FakeEngine())
        call.has_playout = has_playout
        call.active_reply_turn = call.new_turn_id()
        capture = TasteTurnCapture(call, params=TurnCaptureParams(transcripts="upstream", barge_in=mode,
                                                                  transcript_timeout_secs=0.3))
        down, _ = await run_test(capture, frames_to_send=vad_turn(1.0) + [SleepFrame(1.0)])
        assert not any(isinstance(f, TasteReplyPauseFrame) for f in down), mode
        assert "barge_in" in kinds(call.log) and call.log.turn(1).interrupted  # (the turn had no words)


def test_barge_in_mode_is_checked():
    with pytest.raises(ValueError, match="barge_in must be 'pause' or 'immediate'"):
        TurnCaptureParams(barge_in="later")


def test_the_agent_command_chooses_the_barge_in():
    from taste_agents.cli import agent_config, build_parser

    parser = build_parser()
    assert agent_config(parser.parse_args(["call", "--simulate"])).capture.barge_in == "pause"
    chosen = agent_config(parser.parse_args(["serve", "--barge-in", "immediate"]))
    assert chosen.capture.barge_in == "immediate"


async def test_the_stt_s_words_right_behind_those_that_make_the_barge_in_are_kept():
    """The barge-in goes out while the capture handles an STT frame; frames queued behind it (the
    final words right after the interim ones) are the caller's words, not to be dropped with the
    interrupted reply (Pipecat's broadcast_interruption empties the processor's own queue)."""
    call = TasteCall(FakeEngine())
    call.has_playout = True
    call.active_reply_turn = call.new_turn_id()
    middle = [InterimTranscriptionFrame("wait", "caller", time_now_iso8601()),
              TranscriptionFrame("wait, make it eight", "caller", time_now_iso8601(), finalized=True)]
    params = TurnCaptureParams(transcripts="upstream", transcript_timeout_secs=0.5)
    down, _ = await run_test(TasteTurnCapture(call, params=params), frames_to_send=vad_turn(1.0, middle) + [SleepFrame(1.0)])
    assert "barge_in" in kinds(call.log)
    assert [f.transcript for f in down if isinstance(f, TasteUserTurnFrame)] == ["wait, make it eight"]


async def test_an_interruption_from_elsewhere_ends_the_pause():
    """An RTVI client's InterruptionFrame while the caller's sound holds the reply: the reply is cut
    off by it, so the sound's verdict (no words) resumes nothing and is no barge-in."""
    call = TasteCall(FakeEngine(asr_text=""))
    call.has_playout = True
    call.active_reply_turn = call.new_turn_id()
    capture = TasteTurnCapture(call, params=TurnCaptureParams(transcripts="asr"))
    down, _ = await run_test(capture, frames_to_send=vad_turn(1.0, [InterruptionFrame()]) + [SleepFrame(1.0)])
    assert [(f.by_turn, f.paused) for f in down if isinstance(f, TasteReplyPauseFrame)] == [(2, True)]
    assert call.log.turn(2).decision == "ignored"
    assert "reply_resumed" not in kinds(call.log) and "barge_in" not in kinds(call.log)


async def test_speech_whose_words_came_before_it_was_long_enough_barges_in_without_a_pause():
    """An STT's words for the turn came before it had min_speech_secs: its words are known, no
    pause (they were not counted: the reply stood paused until the turn's end)."""
    call = TasteCall(FakeEngine())
    call.has_playout = True
    call.active_reply_turn = call.new_turn_id()
    early_words = [InterimTranscriptionFrame("wait", "caller", time_now_iso8601()), SleepFrame(0.05)]
    capture = TasteTurnCapture(call, params=TurnCaptureParams(transcripts="upstream", transcript_timeout_secs=0.3))
    down, _ = await run_test(capture, frames_to_send=vad_turn(1.5, early_words, at=0.1) + [SleepFrame(1.0)])
    assert not any(isinstance(f, TasteReplyPauseFrame) for f in down)
    cut = next(e for e in call.log.events if e["kind"] == "barge_in")
    stopped = next(e for e in call.log.events if e["kind"] == "user_speech_stopped")
    assert cut["by_turn"] == 2 and cut["t"] < stopped["t"] - 0.5 and call.log.turn(1).interrupted
