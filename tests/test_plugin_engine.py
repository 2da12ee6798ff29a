"""TasteEngine, the plugin's only door into taste_speech, on the embedded tiny checkpoint.

The adapter splits synthesis into two stages (speech tokens, then vocoding) so they can run on
different threads; these tests pin it to the library's own ``taste_detokenize_stream`` (same
tokens, same audio, bit for bit), so a change in the library shows up here first."""

import threading
import time

import numpy as np
import pytest
import torch

from concurrency_helpers import run_in_threads
from session_helpers import speak_segments
from pipecat_taste.engine import TasteEngine
from pipecat_taste.session import GenerationSettings
from taste_agents.caller import load_utterances


@pytest.fixture(scope="module")
def engine():
    return TasteEngine.from_pretrained(None)  # the embedded tiny checkpoint


@pytest.fixture(scope="module")
def hello():
    return load_utterances()["hello"]


def reply_segments(session, turn, n_words=3):
    events = list(session.reply(turn, threading.Event()))
    assert events[0].kind == "decision" and events[-1].kind == "end"
    return [e for e in events if e.kind == "segment"][:n_words], events


def test_user_turn_is_tokenized_against_its_transcript(engine, hello):
    session = engine.new_session(GenerationSettings(max_reply_tokens=4))
    turn = session.user_turn(hello.audio, hello.text)
    seg = turn.segment
    assert seg.role == "user" and seg.modality == "audio"
    assert seg.taste_ids.shape[:2] == seg.text_ids.shape and seg.taste_ids.dtype == torch.long
    assert int(seg.word_starts().sum()) == len(hello.text.split())
    with pytest.raises(ValueError, match="silent"):
        session.user_turn(np.zeros(16000, np.float32), "hello there")
    with pytest.raises(ValueError, match="empty"):
        session.user_turn(hello.audio, "   ")


def test_reply_streams_words_and_commit_keeps_what_was_heard(engine, hello):
    session = engine.new_session(GenerationSettings(max_reply_tokens=6, prompt_format="instruct"))
    turn = session.user_turn(hello.audio, hello.text)
    segments, events = reply_segments(session, turn, n_words=99)
    assert events[0].decision == "reply" and len(segments) >= 2
    assert all(s.n_words == 1 and s.segment.role == "assistant" for s in segments)
    total = sum(s.n_words for s in segments)
    conversation = session.conversation
    assert [t.role for t in conversation.turns] == ["user", "assistant"]
    assert session.commit_reply(1) == 1  # barge-in after the first word
    assert int(conversation.turns[-1].word_starts().sum()) == 1
    assert torch.equal(conversation.turns[-1].text_ids, segments[0].segment.text_ids)
    # the next turn continues from the truncated history
    segments2, _ = reply_segments(session, session.user_turn(hello.audio, hello.text))
    assert segments2 and session.commit_reply(None) >= 1 and total >= 2


def test_the_history_s_window_moves_when_a_reply_is_committed_between_turns(engine, hello):
    """A reply that takes the history past its window leaves the move to the commit (after the
    reply was heard), not to the next turn's first audio; a barge-in is cut first, then moved."""
    session = engine.new_session(GenerationSettings(max_reply_tokens=6, prompt_format="instruct", history_max_turns=3))
    conversation = session.conversation
    reply_segments(session, session.user_turn(hello.audio, hello.text))
    assert session.commit_reply(None) >= 1 and len(conversation.turns) == 2
    second = session.user_turn(hello.audio, hello.text)
    reply_segments(session, second)
    assert len(conversation.turns) == 4 and conversation.window_due  # the reply was handed on unmoved
    assert session.commit_reply(1) == 1
    assert not conversation.window_due and [t.role for t in conversation.turns] == ["user", "assistant"]
    assert conversation.turns[0] is second.segment and int(conversation.turns[1].word_starts().sum()) == 1


def test_a_barge_in_count_after_a_turn_was_taken_back_cuts_no_earlier_reply(engine, hello):
    """A turn answered too early is taken back with the reply begun to it (``forget_turn``); a
    commit that comes after (the playout's report of that reply: nothing heard) has nothing to
    cut - it must not cut the reply before it, which the caller heard whole."""
    session = engine.new_session(GenerationSettings(max_reply_tokens=6, prompt_format="instruct"))
    reply_segments(session, session.user_turn(hello.audio, hello.text), n_words=99)
    assert session.commit_reply(None) >= 2  # the first reply, heard whole
    heard = session.conversation.turns[-1]
    early = session.user_turn(hello.audio, hello.text)
    reply_segments(session, early, n_words=99)
    assert session.forget_turn(early) == 2  # the caller went on speaking: taken back
    assert session.commit_reply(0) == 0
    assert session.conversation.turns[-1] is heard


def test_a_reply_s_speech_given_up_withdraws_it_from_the_shared_synthesis_steps(engine, monkeypatch):
    """``drop_speech`` (a reply cut off or taken back) tells the library the utterance is given up
    (``stop_speaking``): on the static path the calls' shared first flow windows would otherwise
    keep waiting for it, adding to every other call's first audio."""
    import taste_speech.streaming.synthesis as synthesis

    given_up = []
    monkeypatch.setattr(synthesis, "stop_speaking", lambda state: given_up.append(state))
    session = engine.new_session(GenerationSettings(max_reply_tokens=6))
    state = session.start_speech(24000)
    session.drop_speech(state)
    assert given_up == [state.synthesis]


@pytest.mark.parametrize("winner, decision", [("user", "no_speech"), ("assistant", "reply")])
def test_dialogue_format_decides_first(engine, hello, winner, decision):
    """The session's conversation is in the dialogue format, whose first choice (the user's role
    or the assistant's, forced here) is the reply's decision: no_speech ends it at once."""
    session = engine.new_session(GenerationSettings(max_reply_tokens=4, prompt_format="dialogue"))
    assert session.conversation.format.decides_turns
    choice = torch.tensor([50.0, -50.0] if winner == "user" else [-50.0, 50.0])
    session.conversation.format.turn_logits = lambda text_logits: choice.to(text_logits.device)
    events = list(session.reply(session.user_turn(hello.audio, hello.text), threading.Event()))
    assert events[0].kind == "decision" and events[0].decision == decision
    if decision == "no_speech":
        assert len(events) == 1 and [t.role for t in session.conversation.turns] == ["user"]
    else:
        assert events[-1].kind == "end" and session.conversation.turns[-1].role == "assistant"


def test_cancelled_reply_ends_within_a_step(engine, hello):
    session = engine.new_session(GenerationSettings(max_reply_tokens=40))
    stop = threading.Event()
    events = session.reply(session.user_turn(hello.audio, hello.text), stop)
    assert next(events).decision == "reply"
    stop.set()
    rest = list(events)
    assert rest[-1].kind == "end" and rest[-1].reason == "cancelled" and len(rest) <= 2


class FailingStop:
    """A reply's stop check that fails after ``after_steps`` steps, as a model error would."""

    def __init__(self, after_steps: int):
        self.after_steps, self.asks = after_steps, 0

    def is_set(self):
        self.asks += 1
        if self.asks > self.after_steps:
            raise RuntimeError("injected failure mid-reply")
        return False


def test_a_failed_reply_keeps_the_callers_turn_and_an_abandoned_one_frees_the_conversation(engine, hello):
    """The library takes a failed reply's input turns back (for a retry); the call does not retry,
    so what the caller said stays in the history. A reply left unfinished frees the conversation."""

    session = engine.new_session(GenerationSettings(max_reply_tokens=40))
    turn = session.user_turn(hello.audio, hello.text)
    with pytest.raises(RuntimeError, match="injected failure"):
        list(session.reply(turn, FailingStop(after_steps=3)))
    turns = session.conversation.state.turns
    assert turns[0] is turn.segment and [t.role for t in turns[1:]] in ([], ["assistant"])  # + any words handed on
    session.commit_reply(None)
    events = session.reply(session.user_turn(hello.audio, hello.text), threading.Event())
    next(events)
    events.close()  # abandoned after its decision
    assert not session.conversation.reply_in_progress
    assert [e.kind for e in session.reply(session.user_turn(hello.audio, hello.text), threading.Event())][-1] == "end"


def test_a_reply_failing_midway_keeps_the_words_already_handed_on(engine, hello):
    """The caller may have heard them: the history keeps them, and commit_reply cuts them to what
    was played, as after a barge-in."""

    session = engine.new_session(GenerationSettings(max_reply_tokens=40, words_per_segment=1))
    turn = session.user_turn(hello.audio, hello.text)
    segments = []
    with pytest.raises(RuntimeError, match="injected failure"):
        for event in session.reply(turn, FailingStop(after_steps=12)):  # after some segments went out
            if event.kind == "segment":
                segments.append(event)
    handed_on = sum(e.n_words for e in segments)
    assert handed_on >= 2
    turns = session.conversation.state.turns
    assert [t.role for t in turns] == ["user", "assistant"] and turns[0] is turn.segment
    assert turns[1].num_words == handed_on
    assert session.commit_reply(1) == 1  # one word was played before the failure
    assert session.conversation.state.turns[1].num_words == 1


def test_split_synthesis_equals_taste_detokenize_stream(engine, hello):
    """Speech tokens on one thread and vocoding on another give exactly the library's audio."""
    from taste_speech.modeling_speech_decoder import TopKSampler
    from taste_speech.streaming import taste_detokenize

    session = engine.new_session(GenerationSettings(max_reply_tokens=6, seed=3))
    segments, _ = reply_segments(session, session.user_turn(hello.audio, hello.text), n_words=3)
    assert len(segments) == 3

    tokens, ours = speak_segments(session, segments)

    # The library's one-call path with the same random streams (sampler and synthesis seeded as
    # the session seeds them).
    sampler = TopKSampler(generator=torch.Generator().manual_seed(3 + 1))
    synth_gen = torch.Generator().manual_seed(3 + 2)
    lib_state, prev_text, prev_taste, prev_speech, played_ms, theirs = None, None, None, None, 0.0, []
    for i, seg in enumerate(segments):
        out = taste_detokenize(engine.model, engine.processor, session.voice, prev_text, prev_taste, prev_speech,
                               played_ms, seg.segment.text_ids, seg.segment.taste_ids, 16000,
                               voice_generator=engine.voice_generator, state=lib_state,
                               final=i == len(segments) - 1, sampler=sampler, generator=synth_gen,
                               policy=engine.speech_policy)
        theirs.append(out["audio_waveform"].reshape(-1).numpy())
        lib_state, prev_speech = out["state"], out["speech_ids"]
        prev_text, prev_taste = seg.segment.text_ids, seg.segment.taste_ids
        # (summing chunk_duration_ms falls short by the output resampler's delay: ask the state)
        played_ms = lib_state.audio_ms_before + lib_state.emitted_ms
    theirs = np.concatenate(theirs)
    assert prev_speech[0].tolist() == tokens
    assert ours.shape == theirs.shape and np.array_equal(ours, theirs)
    assert session.speech_samples(len(tokens), 16000) == pytest.approx(ours.size, abs=16000 * 0.03)


@pytest.mark.parametrize("decoding", ["auto", "graphed"])
def test_speaking_reads_back_only_the_speech_token_draws(engine, hello, monkeypatch, decoding):
    """Starting each segment's speech decoder (its words' codes, the voice, the previous segment's
    tokens) and vocoding read no tensor back: on a GPU a read waits for every call's queued work.
    The speech-token draws are the one read per token. Counted as operators on this CPU (the
    copies from host memory, waits on a GPU too, are the CUDA test's)."""
    from benchmarks.bench_lora_merge import OperatorCount

    path = TasteEngine(engine.model, engine.processor, engine.voice_generator, checkpoint_dir=engine.checkpoint_dir,
                       asr=None, decoding=decoding)
    session = path.new_session(GenerationSettings(max_reply_tokens=8, seed=3))
    segments, _ = reply_segments(session, session.user_turn(hello.audio, hello.text), n_words=3)
    decoder, draws = path.model.speech_decoder, []
    step = decoder.step

    def counted_step(*args, **kwargs):
        with OperatorCount() as count:
            token = step(*args, **kwargs)
        draws.append(count.reads)
        return token

    monkeypatch.setattr(decoder, "step", counted_step)
    state = session.start_speech(16000)  # (its seeds are drawn from a CPU generator, read once a reply)
    tokens, audio = [], []
    with OperatorCount() as everything:
        for seg in segments:
            for piece in session.speech_tokens(state, seg.segment):
                tokens += piece
                audio += session.vocode(state, piece)
        audio += session.vocode(state, [], final=True)
    assert len(segments) == 3 and len(tokens) > 10 and sum(chunk.size for chunk in audio)
    assert len(draws) == len(tokens) + 3 and sum(draws) >= len(tokens)  # (+ one ending step a segment)
    assert everything.reads == sum(draws), everything.ops


def test_generation_settings_default_to_the_samplers_defaults():
    """The plugin repeats the model library's sampling defaults (importing them would make
    ``import pipecat_taste`` import torch): this keeps the two from drifting apart."""
    import dataclasses

    from taste_speech.sampler import SamplingParams

    plugin, library = GenerationSettings(), SamplingParams()
    shared = {f.name for f in dataclasses.fields(SamplingParams)} & {f.name for f in dataclasses.fields(GenerationSettings)}
    assert shared == {"text_top_p", "taste_top_p", "text_temperature", "repetition_penalty"}
    for name in sorted(shared):
        assert getattr(plugin, name) == getattr(library, name), name


def speak_reply(session, turn):
    """Text, speech tokens and audio of one whole reply through the session's three stages."""
    segments, _ = reply_segments(session, turn, n_words=99)
    return [s.text for s in segments], *speak_segments(session, segments)


def test_calls_that_start_speaking_together_share_their_first_flow_step(engine, hello):
    """Two calls' replies start speaking at once (``start_speech`` announces each to the engine's
    shared synthesis steps); their first chunks' flow windows come 40 ms apart, yet run as one
    step, and each call gets the audio it gets alone."""
    batched = TasteEngine(engine.model, engine.processor, engine.voice_generator,
                          checkpoint_dir=engine.checkpoint_dir, batch_slots=2, decoding="graphed")
    batched.warm_up()
    calls = []
    for seed in (0, 1):
        session = batched.new_session(GenerationSettings(max_reply_tokens=8, seed=seed, text_top_p=0.0))
        segments, _ = reply_segments(session, session.user_turn(hello.audio, hello.text), n_words=99)
        calls.append((session, segments))
    alone = []
    for session, segments in calls:
        state = session.start_speech(16000)
        tokens = [t for e in segments for group in session.speech_tokens(state, e.segment) for t in group]
        alone.append((tokens, np.concatenate(session.vocode(state, tokens, final=True))))
    # the same calls again (their voices' random streams anew), both announced before either speaks
    again = [batched.new_session(GenerationSettings(max_reply_tokens=8, seed=seed, text_top_p=0.0)) for seed in (0, 1)]
    states = [session.start_speech(16000) for session in again]
    audio = [None, None]

    def speak(i):
        time.sleep(0.04 * i)
        audio[i] = np.concatenate(again[i].vocode(states[i], alone[i][0], final=True))

    graphs = batched.synthesis_graphs
    graphs._first_step.measured(10.0)  # (a long limit, capped at MAX_WAIT_S: the wait must end because the other came)
    before, ran_out = dict(graphs.first_batches), graphs._starting.ran_out
    run_in_threads(speak, [(0,), (1,)])
    assert graphs.first_batches[2] == before.get(2, 0) + 1, graphs.first_batches
    assert graphs._starting.ran_out == ran_out  # the first window's wait ended when the other came
    for got, (_, expected) in zip(audio, alone):
        assert got.shape == expected.shape and np.abs(got - expected).max() < 2e-4
    for session in [c[0] for c in calls] + again:
        session.close()


def test_graphed_decoding_gives_the_eager_reply_and_warm_up_changes_nothing(engine, hello):
    """decoding='graphed' puts every hot loop on its static path (on a CPU the fixed shapes run
    eagerly): same words, same speech tokens, the same audio to float rounding as the eager
    engine; a session warmed up (its steps run once, as a capture would) answers the same."""
    from taste_speech.lm_cache import StaticLMCache
    from taste_speech.speech_decoder_cache import StaticSpeechCache

    graphed = TasteEngine(engine.model, engine.processor, engine.voice_generator, checkpoint_dir=engine.checkpoint_dir,
                          decoding="graphed")
    eager = TasteEngine(engine.model, engine.processor, engine.voice_generator, checkpoint_dir=engine.checkpoint_dir,
                        decoding="eager")
    settings = GenerationSettings(max_reply_tokens=6)
    results = {}
    for name, eng, warm in (("eager", eager, False), ("graphed", graphed, False), ("warmed", graphed, True)):
        session = eng.new_session(settings)
        if warm:
            rvq = eng.model.audio_tower.vq.rvq
            rvq._joined = None  # (made again:) the session's warm-up makes the RVQ's joined code table,
            session.warm_up()  # whose making waits for a GPU once - not inside the first turn
            assert rvq._joined is not None
            assert session.conversation.state.decode.cache._step is not None  # the LM step ran once
            assert session.speech_cache()._step is not None  # and the speech decoder's
            assert session.speech_cache()._prefill_steps == {}  # (on a CPU multi-row feeds stay eager)
        turn = session.user_turn(hello.audio, hello.text)
        results[name] = speak_reply(session, turn)
        static = name != "eager"
        assert isinstance(session.conversation.state.decode.cache, StaticLMCache) == static
        assert isinstance(session.speech_cache(), StaticSpeechCache) == static
    for name in ("graphed", "warmed"):
        words, tokens, audio = results[name]
        assert words == results["eager"][0] and tokens == results["eager"][1]
        assert audio.shape == results["eager"][2].shape and np.abs(audio - results["eager"][2]).max() < 2e-4
    with pytest.raises(ValueError, match="decoding must be one of"):
        TasteEngine(engine.model, engine.processor, engine.voice_generator, decoding="fast")


def test_engine_merges_lora_unless_told_not_to(engine, hello):
    """An engine runs the spoken LM with its LoRA adapters merged (fewer kernels per token); a
    model handed over with merge_lora=False keeps them on the side, and both give the same reply."""
    from taste_speech.modeling_taste import TasteForCausalLM

    assert engine.model.spoken_lm.lora_merged
    side = TasteForCausalLM.from_pretrained(engine.checkpoint_dir).eval()
    kept = TasteEngine(side, engine.processor, engine.voice_generator, checkpoint_dir=engine.checkpoint_dir,
                       merge_lora=False)
    assert not kept.model.spoken_lm.lora_merged
    settings = GenerationSettings(max_reply_tokens=6)
    replies = []
    for eng in (engine, kept):
        session = eng.new_session(settings)
        replies.append(speak_reply(session, session.user_turn(hello.audio, hello.text))[:2])
    assert replies[0] == replies[1]  # the same words and speech tokens


def test_batched_steps_give_each_call_its_own_reply(engine, hello):
    """batch_slots: two calls' spoken-LM and speech-decoder steps run in batches (from their own
    threads, as the processors run them), their flow and vocoder windows share the engine's
    synthesis steps (the static path: 'graphed'), and each call gets the words and speech of a
    call alone on the eager engine; ending a call gives its slots back; on a CPU 'auto' batches
    nothing."""
    from taste_speech.lm_batch import SlotLMCache
    from taste_speech.speech_decoder_batch import SlotSpeechCache

    def engine_with(**kwargs):
        return TasteEngine(engine.model, engine.processor, engine.voice_generator,
                           checkpoint_dir=engine.checkpoint_dir, **kwargs)

    assert engine.lm_batch is None and engine.speech_batch is None and engine.synthesis_graphs is None  # CPU 'auto'
    assert engine_with(decoding="graphed").synthesis_graphs is None  # a CPU's static path: one window per step
    assert engine_with(batch_slots=2).synthesis_graphs is None  # the dynamic synthesis path has no steps to share
    batched = engine_with(batch_slots=2, decoding="graphed")
    assert batched.synthesis_graphs.rows == 2
    batched.warm_up()
    settings = [GenerationSettings(max_reply_tokens=8, seed=seed, text_top_p=0.0) for seed in (0, 1)]
    alone = []
    for s in settings:
        session = engine.new_session(s)
        alone.append(speak_reply(session, session.user_turn(hello.audio, hello.text)))
    sessions = [batched.new_session(s) for s in settings]
    turns = [session.user_turn(hello.audio, hello.text) for session in sessions]
    assert all(isinstance(s.conversation.ready().cache, SlotLMCache) for s in sessions)
    assert all(isinstance(s.speech_cache(), SlotSpeechCache) for s in sessions)
    results = [None, None]

    def call(i):
        results[i] = speak_reply(sessions[i], turns[i])

    run_in_threads(call, [(0,), (1,)])
    for got, expected in zip(results, alone):
        assert got[0] == expected[0] and got[1] == expected[1]
        assert np.abs(got[2] - expected[2]).max() < 2e-4
    for batch in (batched.lm_batch, batched.speech_batch):
        assert batch.stats()["rows_stepped"] >= 2 and batch.slots_in_use == 2
    synthesis = batched.synthesis_graphs.stats()
    assert synthesis["flow"]["windows"] >= 2 and synthesis["vocoder"]["windows"] >= 2
    for session in sessions:
        session.close()
    assert batched.lm_batch.slots_in_use == 0 and batched.speech_batch.slots_in_use == 0
    with pytest.raises(RuntimeError, match="closed"):
        next(sessions[0].reply(turns[0], threading.Event()))
    with pytest.raises(ValueError, match="batch_slots"):
        engine_with(batch_slots=0)


async def test_an_ended_call_gives_its_batch_slots_back(engine):
    from pipecat_taste.call import TasteCall

    batched = TasteEngine(engine.model, engine.processor, engine.voice_generator,
                          checkpoint_dir=engine.checkpoint_dir, batch_slots=1)
    call = TasteCall(batched, GenerationSettings(max_reply_tokens=4))
    session = await call.ensure_session()
    session.conversation.ready(), session.speech_cache()
    assert batched.lm_batch.slots_in_use == 1 and batched.speech_batch.slots_in_use == 1
    await call.close()
    assert batched.lm_batch.slots_in_use == 0 and batched.speech_batch.slots_in_use == 0
    assert session.conversation.closed


def test_a_call_ending_mid_reply_frees_its_slots_when_the_reply_stops(engine, hello):
    batched = TasteEngine(engine.model, engine.processor, engine.voice_generator,
                          checkpoint_dir=engine.checkpoint_dir, batch_slots=1)
    session = batched.new_session(GenerationSettings(max_reply_tokens=40))
    events = session.reply(session.user_turn(hello.audio, hello.text), threading.Event())
    assert next(events).decision == "reply" and next(events).kind == "segment"  # the LM holds its slot
    session.close()  # the reply's thread may still write to its slot: the slot stays reserved
    assert batched.lm_batch.slots_in_use == 1
    rest = list(events)
    assert rest[-1].kind == "end" and rest[-1].reason == "cancelled"
    assert batched.lm_batch.slots_in_use == 0


def test_a_call_ending_while_a_barge_in_is_committed_closes_once_the_commit_is_done(engine, hello):
    """commit_reply runs on the call's thread; the call may end (hang-up) meanwhile: close() must not
    fail on the busy conversation, and the history change finishes before the cache is dropped."""
    session = engine.new_session(GenerationSettings(max_reply_tokens=16))
    list(session.reply(session.user_turn(hello.audio, hello.text), threading.Event()))
    conversation = session.conversation
    truncating, go_on = threading.Event(), threading.Event()
    truncate = conversation._truncate_last_assistant

    def slow_truncate(n):
        truncating.set()
        go_on.wait(10)
        return truncate(n)

    conversation._truncate_last_assistant = slow_truncate
    kept = []
    committer = threading.Thread(target=lambda: kept.append(session.commit_reply(1)))
    committer.start()
    assert truncating.wait(10)
    session.close()  # the hang-up, while the commit holds the conversation
    assert not conversation.closed
    go_on.set()
    committer.join(10)
    assert kept == [1] and conversation.closed and conversation.state.decode is None
    assert session.commit_reply(0) == 0 and session.forget_turn(session.user_turn(hello.audio, hello.text)) == 0


def test_auto_asr_is_the_checkpoints_own_whisper_and_a_missing_one_says_what_to_do(tmp_path):
    """asr='auto' on a real-size checkpoint loads the Whisper model the checkpoint names (live calls
    need transcripts); one that cannot be loaded is an error naming both ways out."""
    from types import SimpleNamespace

    from pipecat_taste.asr import WhisperTranscriber
    from pipecat_taste.engine import default_asr
    from taste_speech.tiny import default_tiny_checkpoint

    checkpoint = default_tiny_checkpoint()
    whisper = WhisperTranscriber.random_tiny(checkpoint, seed=3)
    folder = tmp_path / "whisper"
    for part in (whisper.model, whisper.feature_extractor, whisper.tokenizer):
        part.save_pretrained(folder)

    def model(hidden_size):
        return SimpleNamespace(config=SimpleNamespace(text_config=SimpleNamespace(hidden_size=hidden_size)))

    asr = default_asr(model(2048), SimpleNamespace(asr_model=str(folder)), checkpoint)
    assert isinstance(asr, WhisperTranscriber)
    loaded, saved = asr.model.state_dict(), whisper.model.state_dict()
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)

    # the tiny checkpoint gets its random tiny ASR, whatever its processor names, on the device and in
    # the dtype asked for (it ran on the CPU in float32 whatever the engine's were)
    tiny = default_asr(model(64), SimpleNamespace(asr_model=None), checkpoint, dtype="bfloat16")
    assert tiny.model.config.d_model == 32 and tiny.model.dtype == torch.bfloat16 and tiny.device == "cpu"

    with pytest.raises(RuntimeError, match=r"whisper-missing.*--asr-model DIR.*--asr-model none"):
        default_asr(model(2048), SimpleNamespace(asr_model=str(tmp_path / "whisper-missing")), checkpoint)
    with pytest.raises(ValueError, match="names no Whisper model"):
        default_asr(model(2048), SimpleNamespace(asr_model=None), checkpoint)


def test_device_auto_is_resolved_once_for_every_part():
    """'auto' (CUDA when there is one) reaches the LM, the voice generator and the ASR as a real
    device: torch itself does not know 'auto' (the voice generator failed on it)."""
    import torch

    engine = TasteEngine.from_pretrained(None, device="auto")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert engine.device == expected
    assert next(engine.model.parameters()).device.type == expected
    assert next(engine.voice_generator.parameters()).device.type == expected


def test_cuda_streams_are_refused_off_cuda_and_with_batch_slots_before_the_weights_load(engine, monkeypatch):
    """streams='synthesis' / 'calls' put work on CUDA streams of its own: there are none on a CPU,
    and a batched step cannot serve calls on streams of their own - clear errors, raised before
    the (minutes long) weights load."""
    from pipecat_taste.call import TasteCall
    from taste_speech.modeling_taste import TasteForCausalLM

    parts = (engine.model, engine.processor, engine.voice_generator)
    for streams in ("synthesis", "calls"):
        with pytest.raises(ValueError, match=f"streams='{streams}' needs a CUDA device"):
            TasteEngine(*parts, streams=streams)
    with pytest.raises(ValueError, match="streams must be one of"):
        TasteEngine(*parts, streams=True)

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the option was checked")

    monkeypatch.setattr(TasteForCausalLM, "from_pretrained", no_load)
    with pytest.raises(ValueError, match="streams='calls' needs a CUDA device"):
        TasteEngine.from_pretrained(None, device="cpu", streams="calls")
    with pytest.raises(ValueError, match="streams='calls' cannot be combined with batch_slots"):
        TasteEngine.from_pretrained(None, device="cuda", streams="calls", batch_slots=4)
    # the default ('auto') on a CPU: no stream anywhere, and a call's threads keep their own
    assert engine.streams == "default" and engine.synthesis_stream is None and engine.new_call_stream() is None
    assert TasteCall(engine).stream is None


def test_auto_streams_are_the_synthesis_stream_on_the_cuda_fast_path_only():
    """streams='auto' (the default): the synthesis stream where the synthesis takes the static path
    on CUDA - a whole reply 0.096 against 0.106 s per audio second on the H100 -, one stream on a
    CPU and with eager decoding (the reference, for debugging); a choice made is kept."""
    from pipecat_taste.streams import resolve_streams

    assert resolve_streams("auto", "cuda", "auto") == "synthesis"
    assert resolve_streams("auto", torch.device("cuda", 0), "static") == "synthesis"
    assert resolve_streams("auto", "cuda:0", "dynamic") == "default"
    assert resolve_streams("auto", "cpu", "static") == "default"
    assert resolve_streams("auto", torch.device("cpu"), "auto") == "default"
    for chosen in ("default", "synthesis", "calls"):
        assert resolve_streams(chosen, "cuda", "auto") == chosen


def test_compile_flow_is_refused_off_cuda_and_with_eager_decoding_before_the_weights_load(engine, monkeypatch):
    """compile_flow=True compiles the captured flow steps of the static synthesis path: a CPU
    engine has none (its synthesis is the eager path), nor has decoding='eager' - clear errors,
    raised before the weights load; the default compiles nothing."""
    from taste_speech.modeling_taste import TasteForCausalLM

    parts = (engine.model, engine.processor, engine.voice_generator)
    with pytest.raises(ValueError, match="compile_flow=True needs a CUDA device"):
        TasteEngine(*parts, decoding="graphed", compile_flow=True)
    assert engine.synthesis_graphs is None  # (the default engine on a CPU: the eager path)

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the option was checked")

    monkeypatch.setattr(TasteForCausalLM, "from_pretrained", no_load)
    with pytest.raises(ValueError, match="compile_flow=True needs a CUDA device"):
        TasteEngine.from_pretrained(None, device="cpu", compile_flow=True)
    with pytest.raises(ValueError, match="decoding='eager' does not take"):
        TasteEngine.from_pretrained(None, device="cuda", decoding="eager", compile_flow=True)
    with pytest.raises(ValueError, match="compile_flow must be True or False"):
        TasteEngine.from_pretrained(None, device="cpu", compile_flow="yes")


def test_a_checkpoint_without_an_asr_tokenizer_takes_the_local_whisper_given_for_the_asr(tiny_checkpoint, tmp_path,
                                                                                          monkeypatch):
    """The published layout ships no asr_tokenizer/ (its asr_config names openai/whisper-large-v3):
    offline, a local Whisper of the tower's vocabulary given as the ASR (taste-agent --asr-model
    DIR) is where the processor's ASR tokenizer comes from too; without it the error says so."""
    import json
    import shutil

    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    from taste_speech.configuration_taste import TasteConfig

    published = tmp_path / "published"
    shutil.copytree(tiny_checkpoint, published)
    shutil.rmtree(published / "asr_tokenizer")
    config = json.loads((published / "config.json").read_text())
    config["asr_config"]["_name_or_path"] = "openai/whisper-large-v3"
    (published / "config.json").write_text(json.dumps(config))
    whisper = tmp_path / "whisper-large-v3"
    vocab = TasteConfig.from_pretrained(published).joint_whisper_config.vocab_size  # the tower's vocabulary
    tiny = WhisperConfig(vocab_size=vocab, num_mel_bins=80, d_model=16, encoder_layers=1, decoder_layers=1,
                         encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                         max_source_positions=1500, max_target_positions=32)
    WhisperForConditionalGeneration(tiny).save_pretrained(whisper)
    WhisperFeatureExtractor(feature_size=80).save_pretrained(whisper)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_checkpoint / "asr_tokenizer" / name, whisper / name)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    engine = TasteEngine.from_pretrained(str(published), asr=str(whisper))
    assert engine.processor.asr_tokenizer.name_or_path == str(whisper)
    words = engine.processor.process_text("hello there")
    assert words.asr_token_ids.shape[1] >= 2 and int(words.asr_word_ids.max()) == 1
    with pytest.raises((OSError, ValueError), match="whisper-large-v3"):  # nothing local to take it from
        TasteEngine.from_pretrained(str(published), asr=None)


def test_an_engine_made_directly_refuses_an_asr_name_and_a_closed_call_keeps_no_speech_cache(engine, hello):
    """A Whisper name is loaded by from_pretrained; given to the constructor it was kept as the
    ASR and every transcription failed with "'str' object is not callable". A call's speech cache
    goes when the call ends, as its LM cache does."""
    with pytest.raises(ValueError, match=r"TasteEngine.from_pretrained\(\.\.\., asr='auto'\)"):
        TasteEngine(engine.model, engine.processor, engine.voice_generator, asr="auto")
    session = engine.new_session(GenerationSettings())
    turn = session.user_turn(hello.audio, hello.text)
    segments, _ = reply_segments(session, turn, n_words=1)
    state = session.start_speech(24000)
    list(session.speech_tokens(state, segments[0].segment))
    assert session._speech_cache is not None
    session.close()
    assert session._speech_cache is None and session.conversation.state.decode is None


def test_a_session_names_arguments_of_the_wrong_kind(engine, hello):
    session = engine.new_session(GenerationSettings())
    try:
        turn = session.user_turn(hello.audio, hello.text)
        with pytest.raises(ValueError, match="reply's stop must be a threading.Event"):
            next(session.reply(turn, None))
        with pytest.raises(ValueError, match="reply takes the UserTurn that user_turn"):
            next(session.reply(turn.segment, threading.Event()))
        segments, _ = reply_segments(session, turn, n_words=1)
        with pytest.raises(ValueError, match=r"speech_tokens takes a reply segment \(ReplyEvent.segment\)"):
            next(session.speech_tokens(session.start_speech(24000), segments[0]))
        with pytest.raises(ValueError, match="played_words must be None"):
            session.commit_reply("2")
        assert session.commit_reply(1) == 1  # (the refused call changed nothing)
    finally:
        session.close()
