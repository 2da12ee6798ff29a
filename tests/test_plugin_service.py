"""TasteSpeechToSpeech mechanics in short simulated calls with the model-free engine: turn
decisions, failing replies, stage parallelism, back-pressure, metrics, barge-in bookkeeping and
clean teardown. (The same harness with the real tiny checkpoint is test_simulated_call.py.)"""

import asyncio
import threading

import pytest
from pipecat.frames.frames import (
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    MetricsFrame,
    TranscriptionFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.metrics.metrics import ProcessingMetricsData, TTFBMetricsData

from pipecat_taste import TasteSpeechToSpeech
from pipecat_taste.capture import TurnCaptureParams
from pipecat_taste.frames import TasteTurnDecisionFrame, TasteTurnMetricsFrame
from pipecat_taste.playout import PlayoutParams
from pipecat_taste.start_hold import StartNeeds
from pipecat_taste.testing import FakeEngine
from taste_agents.caller import BargeIn, Pause, Say, Utterance, WaitForReply, load_utterances
from taste_agents.phone_agent import PhoneAgentConfig
from taste_agents.simulate import simulate_call


pytestmark = pytest.mark.slow  # real-time calls


@pytest.fixture(scope="module")
def u():
    return load_utterances()


def config(**kw):
    return PhoneAgentConfig(**kw)


def frames_of(result, cls):
    return [f for _, f in result.frames if isinstance(f, cls)]


async def run(engine, script, **kw):
    return await simulate_call(engine, script, config=config(), tail_s=1.0, **kw)


# The start-hold tests look at the hold alone: an early reply (made while the VAD makes sure the
# turn ended) would already have its second chunk when it starts.
WAIT_FOR_VAD = TurnCaptureParams(early_reply_secs=None)


async def test_no_speech_decision_keeps_listening(u):
    engine = FakeEngine(decide=lambda text: "no_speech" if text.startswith("Hello") else "reply")
    script = [Pause(0.3), Say(u["hello"]), WaitForReply(timeout_s=2.5, end_silence_s=0.8),
              Say(u["time"]), WaitForReply(timeout_s=4, end_silence_s=0.8)]
    result = await run(engine, script)
    decisions = [(f.turn_id, f.decision) for f in frames_of(result, TasteTurnDecisionFrame)]
    assert decisions == [(1, "no_speech"), (2, "reply")]
    assert [e.kind for e in result.caller.events if e.kind in ("no_reply", "reply_heard")] == ["no_reply", "reply_heard"]
    assert len(frames_of(result, LLMFullResponseStartFrame)) == 1 and len(frames_of(result, TTSStartedFrame)) == 1
    assert result.log.turns[1].first_audio_at is None
    # no_speech adds only the user turn; the next turn is answered with both in the history
    assert [role for role, _ in engine.sessions[0].history] == ["user", "user", "assistant"]


async def test_failing_synthesis_gives_an_error_and_the_call_goes_on(u):
    engine = FakeEngine(fail_vocode_on=("can",))
    script = [Pause(0.3), Say(u["time"]), WaitForReply(timeout_s=4, end_silence_s=0.8),
              Say(u["goodbye"]), WaitForReply(timeout_s=4, end_silence_s=0.8)]
    result = await run(engine, script)
    assert len(result.errors) == 2 and all("can" in e for e in result.errors)
    assert [r.decision for r in result.log.turns.values()] == ["reply", "reply"]
    # each reply was bracketed and stopped after the words before the failure
    assert len(frames_of(result, TTSStartedFrame)) == len(frames_of(result, TTSStoppedFrame)) == 2
    for record in result.log.turns.values():
        assert record.played_text == "sure I" and record.kept_words == 2
    assert engine.sessions[0].history[-1] == ("assistant", "sure I")
    assert result.report["checks"]["released_equals_synthesized"]


async def test_the_audio_a_failing_vocode_call_made_before_its_failure_is_played(u):
    """A synthesis step failing part-way hands back the chunks made before it (VocodingFailed): they
    are played (then the reply fades out and ends), not dropped with the error."""
    engine = FakeEngine(fail_vocode_call=3)
    script = [Pause(0.3), Say(u["time"]), WaitForReply(timeout_s=4, end_silence_s=0.8)]
    result = await run(engine, script)
    assert len(result.errors) == 1 and "injected vocoder failure" in result.errors[0], result.errors
    (record,) = [r for r in result.log.turns.values() if r.decision == "reply"]
    session = engine.sessions[0]
    assert session.vocode_calls == 3 and record.synthesized_samples == session.vocoded_samples > 0
    assert len(frames_of(result, TTSStartedFrame)) == len(frames_of(result, TTSStoppedFrame)) == 1
    assert result.report["checks"]["released_equals_synthesized"]


async def test_a_reply_that_cannot_start_speaking_gives_an_error_and_the_next_one_is_heard(u):
    engine = FakeEngine(fail_start_speech=1)
    script = [Pause(0.3), Say(u["time"]), WaitForReply(timeout_s=3, end_silence_s=0.8),
              Say(u["goodbye"]), WaitForReply(timeout_s=3, end_silence_s=0.8)]
    result = await run(engine, script)
    assert len(result.errors) == 1 and "could not start speaking" in result.errors[0], result.errors
    first, second = (result.log.turns[t] for t in sorted(result.log.turns) if result.log.turns[t].decision)
    assert first.played_words == 0 and first.kept_words == 0  # silent: nothing heard, nothing remembered as said
    assert second.played_words > 0 and second.first_audio_at is not None  # the synthesizer lives on
    assert len(frames_of(result, TTSStartedFrame)) == len(frames_of(result, TTSStoppedFrame)) == 2
    assert result.report["checks"]["released_equals_synthesized"]


@pytest.mark.parametrize("early_reply_secs", [None, 0.2])
async def test_a_turn_not_yet_answered_when_the_caller_speaks_again_is_not_answered_over_the_caller(
        u, early_reply_secs):
    """The caller goes on after a pause the VAD took for the end of the turn, while that turn is
    still being tokenized: its reply would begin over the caller's new speech. It gets none (it
    stays in the conversation), and the whole is answered after the caller's last words."""
    engine = FakeEngine(turn_delay=0.9)
    script = [Pause(0.3), Say(u["hello"]), Pause(0.7), Say(u["time"]), WaitForReply(timeout_s=5, end_silence_s=0.8)]
    result = await simulate_call(engine, script, config=config(capture=TurnCaptureParams(early_reply_secs=early_reply_secs)),
                                 tail_s=1.0)
    first, second = (result.log.turns[t] for t in sorted(result.log.turns) if result.log.turns[t].decision)
    assert first.decision == "no_speech" and "spoke again" in first.reason and first.first_audio_at is None
    assert second.decision == "reply" and second.played_words == second.total_words > 0
    assert result.report["checks"]["talk_over_ms_outside_barge_in"] == 0.0
    assert [role for role, _ in engine.sessions[0].history] == ["user", "user", "assistant"]


@pytest.mark.parametrize("early_reply_secs", [None, 0.2])
async def test_a_noise_after_a_turn_not_yet_answered_does_not_leave_it_unanswered(u, early_reply_secs):
    """The same timing, but what follows the turn is a noise long enough to mute its reply (0.6 s)
    in which the STT finds no words: it is no turn, so the mute is lifted and the turn is answered."""
    hello = u["hello"].audio
    noise = Utterance("noise", "", hello[len(hello) // 4: len(hello) // 4 + int(0.6 * 16000)])
    engine = FakeEngine(turn_delay=0.9)
    script = [Pause(0.3), Say(u["hello"]), Pause(0.7), Say(noise), WaitForReply(timeout_s=5, end_silence_s=0.8)]
    result = await simulate_call(engine, script, config=config(capture=TurnCaptureParams(early_reply_secs=early_reply_secs)),
                                 tail_s=1.0)
    first, second = (result.log.turns[t] for t in sorted(result.log.turns) if result.log.turns[t].decision)
    assert second.decision == "ignored" and "no words" in second.reason, second.reason
    assert first.decision == "reply" and first.played_words == first.total_words > 0
    assert first.first_audio_at > second.decided_at  # it waited for the verdict on the noise
    assert not result.errors
    assert [role for role, _ in engine.sessions[0].history] == ["user", "assistant"]


async def test_a_muting_turn_that_fails_does_not_leave_the_turn_before_it_unanswered(u):
    """The caller's next words fail to tokenize (an error for that turn): they will not be answered,
    so the turn before them is (it got no reply either, and the call fell silent)."""
    failing = Utterance("failing", "please explode now", u["time"].audio)  # FakeEngine fails on 'explode'
    engine = FakeEngine(turn_delay=0.9)
    script = [Pause(0.3), Say(u["hello"]), Pause(0.7), Say(failing), WaitForReply(timeout_s=5, end_silence_s=0.8)]
    result = await simulate_call(engine, script, config=config(capture=WAIT_FOR_VAD), tail_s=1.0)
    first, second = result.log.turns[1], result.log.turns[2]
    assert second.decision == "error" and len(result.errors) == 1
    assert first.decision == "reply" and first.played_words == first.total_words > 0


async def test_a_noise_handed_on_early_then_taken_back_keeps_the_turn_before_it_muted(u):
    """A noise ('uh', no words) mutes the turn before it, is handed on early and ignored; then the
    caller goes on and it is taken back: the speech that goes on still mutes that turn (the mute was
    lifted as the noise was ignored, and the turn was answered over the caller)."""
    hello = u["hello"].audio
    uh = Utterance("uh", "", hello[len(hello) // 4: len(hello) // 4 + int(0.6 * 16000)])
    engine = FakeEngine(asr_text="x", turn_delay=0.9)  # turn 1 is still being tokenized when the caller goes on

    def new_session(settings=None, voice=None):  # the built-in ASR hears no words in a short piece of audio
        session = FakeEngine.new_session(engine, settings, voice)
        session.transcribe = lambda audio: "" if len(audio) / session.input_sample_rate < 1.5 else "some words here"
        return session

    engine.new_session = new_session
    script = [Pause(0.3), Say(u["hello"]), Pause(0.7), Say(uh), Pause(0.35), Say(u["time"]),
              WaitForReply(timeout_s=6, end_silence_s=0.8)]
    result = await simulate_call(engine, script, config=config(capture=TurnCaptureParams(transcripts="asr")),
                                 tail_s=1.0)
    assert result.log.retracted  # the scenario: the noise was handed on early and taken back
    first = result.log.turns[1]
    assert first.decision == "no_speech" and "spoke again" in first.reason and first.played_words == 0
    assert result.report["checks"]["talk_over_ms_outside_barge_in"] == 0.0
    assert [r.decision for r in result.log.turns.values()][-1] == "reply"


async def test_a_failure_while_keeping_the_words_heard_is_reported_and_the_call_goes_on(u):
    engine = FakeEngine()

    def new_session(settings=None, voice=None):
        session = FakeEngine.new_session(engine, settings, voice)

        def commit_reply(played_words):
            raise MemoryError("out of memory (injected)")

        session.commit_reply = commit_reply
        return session

    engine.new_session = new_session
    script = [Pause(0.3), Say(u["time"]), WaitForReply(timeout_s=4, end_silence_s=0.8),
              Say(u["goodbye"]), WaitForReply(timeout_s=4, end_silence_s=0.8)]
    result = await run(engine, script)
    assert len(result.errors) == 2 and all("keeping the words heard failed" in e for e in result.errors)
    for record in result.log.turns.values():
        assert record.decision == "reply" and record.kept_words == record.total_words == record.played_words > 0


async def test_stages_run_concurrently_and_first_audio_comes_before_the_reply_is_done(u):
    engine = FakeEngine(word_delay=0.15, decode_delay=0.03, vocode_delay=0.01)
    script = [Pause(0.3), Say(u["time"]), WaitForReply(timeout_s=5, end_silence_s=0.8)]
    result = await run(engine, script)
    record = result.log.turns[1]
    assert record.first_audio_at < record.generation_done_at - 0.3  # playing while still generating
    names = {n.split("-")[1] for n in engine.sessions[0].threads}
    assert {"listen", "think", "speech_tokens", "vocode"} <= names  # one worker thread per stage


async def test_generation_waits_for_the_speech_decoder(u):
    """Bounded hand-over: with a slow speech decoder, generation runs at most
    max_pending_segments ahead of it instead of racing to the end."""
    script = [Pause(0.3), Say(u["time"]), WaitForReply(timeout_s=6, end_silence_s=1.0)]
    slow = await simulate_call(FakeEngine(decode_delay=0.25), script, config=config(max_pending_segments=1), tail_s=0.5)
    record = slow.log.turns[1]
    # 6 words, one segment each, 0.25 s of decoding each: with one slot the 6th word is asked for
    # only after the decoder took the 5th.
    assert record.generation_done_at - record.decided_at >= 4 * 0.25 * 0.9
    fast = await simulate_call(FakeEngine(decode_delay=0.25), script, config=config(max_pending_segments=8), tail_s=0.5)
    record = fast.log.turns[1]
    assert record.generation_done_at - record.decided_at < 0.5


async def test_metrics_transcripts_and_brackets(u):
    engine = FakeEngine()
    script = [Pause(0.3), Say(u["time"]), WaitForReply(timeout_s=4, end_silence_s=0.8)]
    result = await run(engine, script)
    data = [d for f in frames_of(result, MetricsFrame) for d in f.data]
    ttfb = {d.processor.split("#")[0] for d in data if isinstance(d, TTFBMetricsData)}
    processing = {d.processor.split("#")[0] for d in data if isinstance(d, ProcessingMetricsData)}
    assert {"TasteGenerator", "TasteSynthesizer", "TastePlayout"} <= ttfb
    assert {"TasteTurnCapture", "TasteGenerator", "TasteSynthesizer"} <= processing
    user_to_bot = [d.value for d in data if isinstance(d, TTFBMetricsData) and d.model == "user_to_bot"]
    assert len(user_to_bot) == 1 and 0.0 < user_to_bot[0] < 3.0
    turn_metrics = frames_of(result, TasteTurnMetricsFrame)
    assert len(turn_metrics) == 1 and not turn_metrics[0].interrupted
    assert len(frames_of(result, LLMFullResponseStartFrame)) == len(frames_of(result, LLMFullResponseEndFrame)) == 1
    words = [f.text for f in frames_of(result, TTSTextFrame)]
    assert "".join(words).split() == list(engine.reply_words)
    # the user's transcript goes upstream, before the reply that answers it
    transcripts = [(t, f) for t, f in result.upstream_frames if isinstance(f, TranscriptionFrame)]
    assert [f.text for _, f in transcripts] == [u["time"].text]
    assert transcripts[0][0] < result.log.turns[1].first_audio_at


@pytest.mark.serial  # barge-in and underrun figures: real-time playout, measured
async def test_barge_in_keeps_only_the_words_that_were_heard(u):
    engine = FakeEngine(reply_words=tuple(f"w{i}" for i in range(12)))  # 2.4 s reply
    script = [Pause(0.3), Say(u["time"]), BargeIn(u["goodbye"], after_agent_ms=1000, timeout_s=5),
              WaitForReply(timeout_s=5, end_silence_s=0.8)]
    result = await run(engine, script)
    cut = result.log.turns[1]
    assert cut.interrupted and 0 < cut.played_words < 12
    heard = cut.played_samples / 16000
    # a word is kept when at least half of it (200 ms per word) was heard
    assert cut.played_words == int((heard + 0.1) / 0.2) or cut.played_words == int(heard / 0.2)
    history = engine.sessions[0].history
    assert history[1] == ("assistant", " ".join(f"w{i}" for i in range(cut.played_words)))
    assert history[2][0] == "user" and history[3][0] == "assistant"  # committed before the next reply
    assert result.report["checks"]["barge_in_within_100ms"]
    assert result.report["checks"]["talk_over_ms_outside_barge_in"] == 0


@pytest.mark.serial  # barge-in and underrun figures: real-time playout, measured
async def test_segment_markers_never_stall_the_audio(u):
    # The vocoder holds back 500 ms, more than a word (like the real synthesis, whose lookahead and
    # chunks are longer than a word), so each word's marker arrives well before the end of the
    # audio ahead of it; the audio must still flow without a gap.
    engine = FakeEngine(reply_words=tuple(f"w{i}" for i in range(8)), lookahead_tokens=25)
    script = [Pause(0.3), Say(u["time"]), WaitForReply(timeout_s=6, end_silence_s=0.8)]
    result = await run(engine, script)
    record = result.log.turns[1]
    assert record.underruns <= 1  # a stall at every word boundary gave 6; 1 leaves room for a busy machine
    assert record.played_samples == record.synthesized_samples == 8 * 0.2 * 16000  # 200 ms per word
    texts = [(t, f.text) for t, f in result.frames if isinstance(f, TTSTextFrame)]
    assert "".join(text for _, text in texts).split() == list(engine.reply_words)
    # each word's text goes out with its audio (200 ms per word), not before
    for i, (t, _) in enumerate(texts):
        assert t >= record.first_audio_at + 0.2 * i - 0.1, (i, t - record.first_audio_at)


@pytest.mark.serial  # barge-in and underrun figures: real-time playout, measured
async def test_the_playout_learns_to_hold_replies_whose_second_chunk_comes_late(u):
    # The second word's audio comes 450 ms after the first word's 200 ms: a gap after the first
    # syllable, as on slow hardware. The first reply has it; the next is held instead.
    script = [Pause(0.3), Say(u["time"]), WaitForReply(timeout_s=6, end_silence_s=0.8),
              Say(u["hello"]), WaitForReply(timeout_s=6, end_silence_s=0.8)]
    result = await simulate_call(FakeEngine(first_gap=0.45), script, tail_s=1.0, config=config(capture=WAIT_FOR_VAD))
    first, second = result.log.turns[1], result.log.turns[2]
    assert first.underruns >= 1 and first.start_hold_s == 0.0
    assert second.underruns == 0 and 0.2 < second.start_hold_s <= 0.4
    assert second.played_samples == second.synthesized_samples  # nothing lost by holding
    # without the hold the gap comes back
    plain = await simulate_call(FakeEngine(first_gap=0.45), script, tail_s=1.0,
                                config=config(playout=PlayoutParams(start_hold_max_ms=0), capture=WAIT_FOR_VAD))
    assert plain.log.turns[2].underruns >= 1 and plain.log.turns[2].start_hold_s == 0.0


@pytest.mark.serial  # barge-in and underrun figures: real-time playout, measured
async def test_a_new_call_starts_with_what_the_engine_learned_from_earlier_calls(u):
    # The start hold is the engine's, not the call's: the hardware decides it. The second call's
    # first reply is held as the first call's reply needed, so it has no gap.
    engine = FakeEngine(first_gap=0.45)
    script = [Pause(0.3), Say(u["time"]), WaitForReply(timeout_s=6, end_silence_s=0.8)]

    async def run(engine, script):  # (a 60 ms lead: the hold's margin over the need is the lead, and this
        # 2-core CI machine's scheduling jitter passed 30 ms once in a serial run)
        return await simulate_call(engine, script, tail_s=1.0,
                                   config=config(capture=WAIT_FOR_VAD, playout=PlayoutParams(lead_ms=60.0)))

    first = await run(engine, script)
    assert first.log.turns[1].underruns >= 1 and first.log.turns[1].start_hold_s == 0.0
    assert 0.2 < engine.start_needs.largest() < 0.4
    second = await run(engine, script)
    record = second.log.turns[1]
    assert record.underruns == 0 and 0.2 < record.start_hold_s <= 0.4
    assert record.played_samples == record.synthesized_samples


@pytest.mark.serial  # barge-in and underrun figures: real-time playout, measured
async def test_an_early_reply_is_made_while_the_vad_makes_sure_and_heard_after(u):
    engine = FakeEngine(lookahead_tokens=25)
    script = [Pause(0.3), Say(u["time"]), WaitForReply(timeout_s=4, end_silence_s=0.8)]
    result = await run(engine, script)
    record = result.log.turns[1]
    assert record.early_end_at < record.vad_stop_at
    assert record.first_segment_at < record.vad_stop_at  # generated while the VAD made sure
    assert record.first_audio_at >= record.vad_stop_at  # heard only once the turn was confirmed
    starts = [t for t, f in result.frames if isinstance(f, LLMFullResponseStartFrame)]
    assert len(starts) == 1 and starts[0] >= record.vad_stop_at  # announced once confirmed too
    assert record.played_samples == record.synthesized_samples and record.underruns == 0


@pytest.mark.serial  # start-hold figures: real-time playout, measured
async def test_a_start_hold_that_runs_out_while_an_early_reply_waits_for_the_vad_delays_nothing(u):
    """The engine has learned to hold replies' starts (their second chunk comes late); an early
    reply waits for the VAD to confirm its turn's end for longer than that: its first audio is not
    held after the confirmation, and its record says the hold added nothing (it said the hold)."""
    engine = FakeEngine(first_gap=0.3)
    engine.start_needs.record(0.15)
    assert 0.1 < engine.start_needs.largest()
    script = [Pause(0.3), Say(u["time"]), WaitForReply(timeout_s=4, end_silence_s=0.8)]
    result = await run(engine, script)
    record = result.log.turns[1]
    assert record.first_segment_at < record.vad_stop_at <= record.first_audio_at  # an early reply, heard when confirmed
    assert record.start_hold_s < 0.05 and record.first_audio_at - record.vad_stop_at < 0.1


async def test_a_pause_shorter_than_the_vads_end_takes_the_early_reply_back(u):
    """The caller pauses (longer than early_reply_secs, shorter than stop_secs) and goes on: the
    reply begun to the first part is never heard, the conversation forgets it, and the whole
    speech is answered once."""
    engine = FakeEngine(asr_text="hello there", word_delay=0.1)
    script = [Pause(0.3), Say(u["hello"]), Pause(0.42), Say(u["time"]), WaitForReply(timeout_s=5, end_silence_s=0.8)]
    result = await simulate_call(engine, script, tail_s=1.0, config=config(capture=TurnCaptureParams(transcripts="asr")))
    assert list(result.log.retracted) == [1] and list(result.log.turns) == [2]
    session = engine.sessions[0]
    assert session.forgotten == ["hello there"]  # the early turn had been answered: taken back
    assert session.history == [("user", "hello there"), ("assistant", " ".join(engine.reply_words))]
    assert [(f.turn_id, f.decision) for f in frames_of(result, TasteTurnDecisionFrame)] == [(2, "reply")]
    assert len(frames_of(result, LLMFullResponseStartFrame)) == len(frames_of(result, TTSStartedFrame)) == 1
    assert [e.kind for e in result.caller.events if e.kind in ("no_reply", "reply_heard")] == ["reply_heard"]
    record = result.log.turns[2]
    assert record.early_retracted == 1 and record.first_audio_at >= record.vad_stop_at
    assert result.report["checks"]["talk_over_ms_outside_barge_in"] == 0


def test_start_needs_follow_the_largest_of_the_recent_replies():
    needs = StartNeeds(memory=2)
    assert needs.largest() == 0.0
    for need, largest in [(0.3, 0.3), (-0.1, 0.3), (-0.2, -0.1), (0.1, 0.1)]:
        needs.record(need)
        assert needs.largest() == pytest.approx(largest)
    with pytest.raises(ValueError, match="memory must be >= 1"):
        StartNeeds(memory=0)


async def test_calls_release_their_worker_threads(u):
    script = [Pause(0.2), Say(u["goodbye"]), WaitForReply(timeout_s=4, end_silence_s=0.6)]
    before = {t.ident for t in threading.enumerate()}
    for _ in range(2):
        await run(FakeEngine(), script)
    for _ in range(50):
        left = [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("taste-")]
        if not left:
            break
        await asyncio.sleep(0.1)
    assert not left, [t.name for t in left]


def test_service_is_a_pipeline_of_the_four_processors():
    service = TasteSpeechToSpeech(FakeEngine())
    names = [type(p).__name__ for p in service.processors[1:-1]]
    assert names == ["TasteTurnCapture", "TasteGenerator", "TasteSynthesizer", "TastePlayout"]
    assert service.call.call_id != TasteSpeechToSpeech(FakeEngine()).call.call_id


def test_options_the_service_would_ignore_are_refused():
    """With a call made already, the service's own settings, voice, log and segment limit would be
    dropped silently; so would an analyzer when the capture follows an upstream VAD."""
    from pipecat_taste import GenerationSettings, TasteCall, WebRTCVADAnalyzer

    engine = FakeEngine()
    call = TasteCall(engine)
    assert TasteSpeechToSpeech(engine, call=call).call is call and TasteSpeechToSpeech(None, call=TasteCall(engine))
    for kwargs, words in ((dict(settings=GenerationSettings()), "settings"), (dict(max_pending_segments=1),
                          "max_pending_segments"), (dict(voice=[0.0] * 192), "voice")):
        with pytest.raises(ValueError, match=f"{words} given with call=.*TasteCall"):
            TasteSpeechToSpeech(engine, call=TasteCall(engine), **kwargs)
    with pytest.raises(ValueError, match="another engine given with call="):
        TasteSpeechToSpeech(FakeEngine(), call=TasteCall(engine))
    with pytest.raises(ValueError, match="use_own_vad=False.*VADProcessor"):
        TasteSpeechToSpeech(engine, vad_analyzer=WebRTCVADAnalyzer(), use_own_vad=False)


async def test_a_service_whose_call_has_ended_refuses_to_run_again():
    """Its call (session, threads, log) ended with the first pipeline: a second run is an error
    that says what to do, not an agent that silently ignores the caller."""
    from pipecat.frames.frames import ErrorFrame
    from pipecat.tests.utils import SleepFrame, run_test

    service = TasteSpeechToSpeech(FakeEngine())
    await run_test(service, frames_to_send=[SleepFrame(0.1)])
    assert service.call.closed
    down, up = await run_test(service, frames_to_send=[SleepFrame(0.1)])
    errors = [f.error for f in up if isinstance(f, ErrorFrame)]
    assert errors and all("cannot run again" in e and "new TasteSpeechToSpeech" in e for e in errors)


def test_a_call_is_one_conversation_and_needs_a_loaded_engine():
    """Two services on one TasteCall would run two callers' turns through one conversation (the
    first caller got no audio at all); None or a hub id for the engine failed only at the
    pipeline's start, deep in three processors."""
    from pipecat_taste import TasteCall

    call = TasteCall(FakeEngine())
    TasteSpeechToSpeech(None, call=call)
    with pytest.raises(ValueError, match="has a TasteTurnCapture already .*make a new TasteSpeechToSpeech"):
        TasteSpeechToSpeech(None, call=call)
    for engine in (None, "MediaTek-Research/Llama-1B-TASTE-V0"):
        with pytest.raises(ValueError, match=r"engine must be a loaded TasteEngine, got .*TasteEngine\.from_pretrained"):
            TasteSpeechToSpeech(engine)
    # a recording's path for the voice (as taste-agent --voice takes one) is refused here too
    with pytest.raises(ValueError, match=r"voice must be a speaker embedding, got str.*engine\.speaker_embedding"):
        TasteSpeechToSpeech(FakeEngine(), voice="ref.wav")
    TasteCall(FakeEngine(), voice=[0.1] * 192)  # (a list the library takes as a voice vector stays accepted)


async def test_a_text_llm_pipeline_s_requests_are_passed_on_and_said_not_spoken_once_each():
    """A greeting's TTSSpeakFrame or an RTVI client's send-text (LLMMessagesAppendFrame) cannot
    be spoken by TASTE: they go on down the pipeline, and the call's log and a warning say so,
    once per kind (they were passed on in silence: a silent bot and no clue why)."""
    from loguru import logger
    from pipecat.frames.frames import LLMMessagesAppendFrame, LLMRunFrame, TTSSpeakFrame
    from pipecat.tests.utils import SleepFrame, run_test

    warnings = []
    sink = logger.add(lambda message: warnings.append(str(message)), level="WARNING")
    service = TasteSpeechToSpeech(FakeEngine())
    try:
        sent = [TTSSpeakFrame("Hello, how can I help?"), TTSSpeakFrame("Anyone there?"), LLMRunFrame(),
                LLMMessagesAppendFrame([{"role": "user", "content": "hi"}], run_llm=True)]
        down, _ = await run_test(service, frames_to_send=[*sent, SleepFrame(0.2)], start_timeout=5.0)
    finally:
        logger.remove(sink)
    assert [f for f in down if f in sent] == sent  # passed on, in order
    logged = [e["frame"] for e in service.call.log.events if e["kind"] == "text_request_not_spoken"]
    assert logged == ["TTSSpeakFrame", "LLMRunFrame", "LLMMessagesAppendFrame"]
    said = [w for w in warnings if "is passed on but not spoken" in w]
    assert len(said) == 3 and any("TTSSpeakFrame" in w for w in said) and any("LLMRunFrame" in w for w in said)


async def test_usage_metrics_count_each_reply_s_lm_tokens_and_the_characters_voiced(u):
    """With Pipecat's usage metrics on, the generator reports each reply's spoken-LM tokens (the
    caller's turn's rows, the tokens generated) and the synthesizer the characters it voiced."""
    from pipecat.metrics.metrics import LLMUsageMetricsData, TTSUsageMetricsData

    engine = FakeEngine(reply_words=("fine", "thanks", "and", "you"), tokens_per_word=2)
    result = await run(engine, [Pause(0.3), Say(u["time"]), WaitForReply(timeout_s=4, end_silence_s=0.8)])
    data = [d for f in frames_of(result, MetricsFrame) for d in f.data]
    llm = [d.value for d in data if isinstance(d, LLMUsageMetricsData)]
    tts = [d.value for d in data if isinstance(d, TTSUsageMetricsData)]
    assert len(llm) == 1 and llm[0].completion_tokens == 8 and llm[0].prompt_tokens > 0
    assert llm[0].total_tokens == llm[0].prompt_tokens + llm[0].completion_tokens
    assert tts == [len(word) for word in ("fine", "thanks", "and", "you")]
