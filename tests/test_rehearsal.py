"""The rehearsal turn an engine runs at start-up (``TasteEngine.warm_up``), on the embedded tiny
checkpoint: every stage runs once, and nothing of the throwaway call stays behind."""

import logging
import threading
import time

import numpy as np
import pytest

from pipecat_taste.engine import TasteEngine
from pipecat_taste.rehearsal import REHEARSAL_TRANSCRIPT, rehearsal_audio
from pipecat_taste.session import GenerationSettings
from session_helpers import speak_segments
from taste_agents.caller import load_utterances


@pytest.fixture(scope="module")
def engine():
    return TasteEngine.from_pretrained(None)  # the embedded tiny checkpoint and its random tiny Whisper


@pytest.fixture(scope="module")
def hello():
    return load_utterances()["hello"]


def like(engine, **options):
    return TasteEngine(engine.model, engine.processor, engine.voice_generator, checkpoint_dir=engine.checkpoint_dir,
                       **options)


def answer(engine, hello):
    """A call's first turn on ``engine``: what its ASR heard, the reply's words, speech tokens and audio."""
    session = engine.new_session(GenerationSettings(max_reply_tokens=6, seed=3))
    try:
        transcript = session.start_transcript()
        transcript.partial(hello.audio[: hello.audio.size // 2])
        session.turn_ended(transcript)
        heard = transcript.finish(hello.audio)
        turn = session.user_turn(hello.audio, hello.text)  # (the random tiny Whisper's words are not these)
        segments = [e for e in session.reply(turn, threading.Event()) if e.kind == "segment"]
        tokens, audio = speak_segments(session, segments)
        return heard, [e.text for e in segments], tokens, audio
    finally:
        session.close()


@pytest.mark.parametrize("decoding", ["eager", "graphed"])
def test_warm_up_rehearses_a_whole_turn_and_the_first_call_answers_as_without_it(engine, hello, decoding):
    # the answer of an engine that never rehearsed first, then the same weights, ASR and shared
    # synthesis steps rehearsed: whatever the rehearsal left in them would change the answer
    plain = like(engine, asr=engine.asr, decoding=decoding)
    assert plain.warm_up(rehearse=False) is None
    expected = answer(plain, hello)
    rehearsed = like(engine, asr=engine.asr, decoding=decoding)
    rehearsal = rehearsed.warm_up()
    assert rehearsal.first_audio_s > 0 and rehearsal.seconds > rehearsal.first_audio_s
    assert rehearsal.reply_segments >= 1 and rehearsal.speech_tokens > 0 and rehearsal.audio_samples > 0
    assert engine.processor.split_words(rehearsal.transcript)
    heard, words, tokens, audio = answer(rehearsed, hello)
    assert (heard, words, tokens) == expected[:3]
    assert audio.shape == expected[3].shape and np.abs(audio - expected[3]).max() < 2e-4


def test_the_rehearsal_runs_each_stage_on_a_worker_thread_that_ends(engine, monkeypatch):
    """As a live call's stages do (TasteCall.executor): the threads' library handles go back to
    torch's pools when they end, for the first call's threads."""
    import pipecat_taste.rehearsal as rehearsal
    from pipecat_taste.session import TasteSession

    threads = {}

    def recorded(stage, fn):
        def run(*args, **kwargs):
            threads.setdefault(stage, set()).add(threading.current_thread())
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(rehearsal, "_listen", recorded("listen", rehearsal._listen))
    monkeypatch.setattr(rehearsal, "_reply_segments", recorded("think", rehearsal._reply_segments))
    monkeypatch.setattr(TasteSession, "start_speech", recorded("speech_tokens", TasteSession.start_speech))
    monkeypatch.setattr(TasteSession, "vocode", recorded("vocode", TasteSession.vocode))
    like(engine, asr=engine.asr).warm_up()
    assert set(threads) == {"listen", "think", "speech_tokens", "vocode"}
    for stage, ran_on in threads.items():
        (thread,) = ran_on  # one thread per stage
        assert thread.name.startswith(f"taste-rehearsal-{stage}") and not thread.is_alive(), stage


def test_a_rehearsal_with_batch_slots_gives_its_slots_back(engine):
    batched = like(engine, decoding="graphed", batch_slots=2)
    assert batched.warm_up().audio_samples > 0
    for batch in (batched.lm_batch, batched.speech_batch):  # its steps ran in the slots, and it left them
        assert batch.stats()["steps"] > 0 and batch.slots_in_use == 0


def test_without_an_asr_the_rehearsal_caller_says_the_fixed_words(engine):
    rehearsal = like(engine, asr=None).warm_up()
    assert rehearsal.transcript == REHEARSAL_TRANSCRIPT and rehearsal.audio_samples > 0


def test_a_failing_rehearsal_is_logged_the_engine_still_starts_and_its_call_is_closed(engine, monkeypatch, caplog):
    import pipecat_taste.rehearsal as rehearsal

    def broken(*args):
        raise RuntimeError("the vocoder is broken")

    batched = like(engine, asr=None, decoding="graphed", batch_slots=2)
    monkeypatch.setattr(rehearsal, "_speak", broken)  # (after the reply took its slots)
    with caplog.at_level(logging.WARNING, logger="pipecat_taste.engine"):
        assert batched.warm_up() is None
    assert "rehearsal turn at start-up failed (RuntimeError: the vocoder is broken)" in caplog.text
    assert batched.lm_batch.stats()["steps"] > 0 and batched.lm_batch.slots_in_use == 0


def test_the_rehearsal_audio_is_voice_like_and_the_same_every_time():
    audio = rehearsal_audio(16000)
    assert audio.dtype == np.float32 and audio.shape == (32000,)
    assert 0.05 < np.abs(audio).max() <= 1.0 and np.sqrt(np.mean(audio ** 2)) > 0.01  # not silence
    assert np.array_equal(audio, rehearsal_audio(16000))


def test_calls_rehearsed_together_end_their_turns_together_and_leave_the_answer_unchanged(engine, hello):
    """The first burst of concurrent calls, rehearsed at start-up (TasteEngine.warm_up does it on
    CUDA for its ``calls``): each throwaway call runs every stage, their turns end at one moment,
    and nothing of them changes a later call's answer."""
    import pipecat_taste.rehearsal as rehearsal

    plain = like(engine, asr=engine.asr, decoding="graphed")
    plain.warm_up(rehearse=False)
    expected = answer(plain, hello)
    rehearsed = like(engine, asr=engine.asr, decoding="graphed")
    rehearsed.warm_up(rehearse=False)
    arrivals, ends, listen = [], [], rehearsal._listen

    def timed(session, engine, audio, turn_ends):
        def arrive():
            if len(arrivals) == 2:  # the last caller is a little late: the others wait for it
                time.sleep(0.3)
            arrivals.append(time.perf_counter())
            turn_ends()

        text, heard, turn_end = listen(session, engine, audio, arrive)
        ends.append(turn_end)
        return text, heard, turn_end

    import unittest.mock

    with unittest.mock.patch.object(rehearsal, "_listen", timed):
        together = rehearsal.rehearse_turn(rehearsed, calls=3)
    assert together.calls == 3 and together.first_audio_s > 0 and together.seconds > together.first_audio_s
    assert together.reply_segments >= 3 and together.speech_tokens > 0 and together.audio_samples > 0
    assert len(ends) == 3 and min(ends) >= max(arrivals)  # no turn ended before every caller stopped speaking
    heard, words, tokens, audio = answer(rehearsed, hello)
    assert (heard, words, tokens) == expected[:3]
    assert audio.shape == expected[3].shape and np.abs(audio - expected[3]).max() < 2e-4


def test_a_call_failing_in_a_rehearsal_of_several_raises_its_own_fault_and_no_call_waits_for_it(engine,
                                                                                             monkeypatch):
    import pipecat_taste.rehearsal as rehearsal

    listen, calls = rehearsal._listen, []

    def first_one_breaks(session, engine, audio, turn_ends):
        calls.append(session)
        if len(calls) == 1:
            raise RuntimeError("this caller's microphone is broken")
        return listen(session, engine, audio, turn_ends)

    monkeypatch.setattr(rehearsal, "TURN_END_TIMEOUT_S", 30.0)  # (per call: 60 s for these two)
    monkeypatch.setattr(rehearsal, "_listen", first_one_breaks)
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match="microphone is broken"):
        rehearsal.rehearse_turn(like(engine, asr=None), calls=2)
    assert time.perf_counter() - started < 30  # the other call did not wait out the barrier's 60 s
    assert len(calls) == 2
    for session in calls:  # both calls were closed
        with pytest.raises(RuntimeError, match="session was closed"):
            next(session.reply(None, threading.Event()))


def test_warm_up_rehearses_one_call_on_a_cpu_whatever_its_calls(engine):
    rehearsal = like(engine, asr=None).warm_up(calls=3)
    assert rehearsal.calls == 1 and rehearsal.audio_samples > 0


@pytest.mark.parametrize("calls", [0, -1, 1.5, True])
def test_rehearsal_calls_must_be_a_positive_integer(engine, calls):
    from pipecat_taste.rehearsal import rehearse_turn

    with pytest.raises(ValueError, match="calls must be an integer >= 1"):
        rehearse_turn(engine, calls=calls)
