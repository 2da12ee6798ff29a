"""taste_speech.streaming, listening and thinking: TASTESegment, taste_tokenize, streaming_generate
and Conversation - on the golden set tiny_a (greedy parity with the original) and on the tiny
checkpoint with real tokenizers (all three prompt formats, cache reuse, barge-in, window,
snapshots, bad input)."""

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from taste_speech.lm_batch import LMStepBatch, SlotLMCache
from taste_speech.modeling_spoken_lm import InitialContext
from taste_speech.sampler import SamplingParams, TasteSampler
from taste_speech.streaming import (
    CONTINUATION,
    DIALOGUE,
    INSTRUCT,
    Conversation,
    TASTESegment,
    at_punctuation,
    every_n_words,
    streaming_generate,
    taste_tokenize,
    vocabulary_tables,
)
from taste_speech.verify.points_spoken_lm import PieceTokenizer, load_golden_spoken_lm
from audio_helpers import voiced

FORMATS = [CONTINUATION, INSTRUCT, DIALOGUE]
# The growing LM cache (CPU default), the preallocated one, and a slot of an LMStepBatch (decode
# steps batched across conversations; 'rehearse' puts its steps through the CUDA-graph protocol).
CACHE_KINDS = ["dynamic", "static", "batched"]


def new_conversation(model, processor, cache_kind="dynamic", **kwargs):
    if cache_kind == "batched":
        batch = LMStepBatch(model.spoken_lm, slots=2, capacity=512, graph_mode="rehearse")
        return Conversation(model, processor, lm_batch=batch, **kwargs)
    return Conversation(model, processor, cache_kind=cache_kind, **kwargs)


def reply_of(items):
    return items[-1]["reply"]


def run(model, processor, segments, **kw):
    kw.setdefault("generator", torch.Generator().manual_seed(0))
    kw.setdefault("extra_words", 3)
    return list(streaming_generate(model, processor, segments, **kw))


# -- fixtures ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def golden_model(golden):
    return load_golden_spoken_lm(golden.dir)


@pytest.fixture(scope="module")
def golden_processor(golden):
    return SimpleNamespace(llm_tokenizer=PieceTokenizer.from_golden(golden.dir))


@pytest.fixture(scope="module")
def golden_turn(golden):
    return TASTESegment("user", "audio", golden["in.llm_token_ids"], golden["a.out.llm_indices"])


@pytest.fixture(scope="module")
def user_turn(model, processor):
    text = processor.process_text("hello there how are you doing today")
    taste = taste_tokenize(model, processor, voiced()[None], text.llm_token_ids, 16000)
    return TASTESegment("user", "audio", text.llm_token_ids, taste)


@pytest.fixture(scope="module")
def second_turn(model, processor):
    text = processor.process_text("tell me about the garden")
    taste = taste_tokenize(model, processor, voiced(1.2, seed=1)[None], text.llm_token_ids, 16000)
    return TASTESegment("user", "audio", text.llm_token_ids, taste)


def text_segment(processor, role, text):
    return TASTESegment(role, "text", torch.tensor([processor.llm_tokenizer.encode(text, add_special_tokens=False)]))


# -- TASTESegment ------------------------------------------------------------------------------------------
IDS = torch.ones(1, 2, dtype=torch.long)


@pytest.mark.parametrize("kwargs, match", [
    (dict(role="bot", modality="text", text_ids=IDS), "role"),
    (dict(role="user", modality="video", text_ids=IDS), "modality"),
    (dict(role="user", modality="text", text_ids=[[1, 2]]), "torch.Tensor"),
    (dict(role="user", modality="text", text_ids=torch.ones(2, dtype=torch.long)), r"\(1, S\)"),
    (dict(role="user", modality="text", text_ids=torch.ones(2, 3, dtype=torch.long)), r"\(1, S\)"),
    (dict(role="user", modality="text", text_ids=torch.ones(1, 2)), "integer"),
    (dict(role="user", modality="text", text_ids=torch.ones(1, 0, dtype=torch.long)), "empty"),
    (dict(role="user", modality="text", text_ids=-IDS), "negative"),
    (dict(role="user", modality="text", text_ids=IDS, taste_ids=torch.zeros(1, 2, 4, dtype=torch.long)),
     "must not carry"),
    (dict(role="user", modality="audio", text_ids=IDS), "needs taste_ids"),
    (dict(role="user", modality="audio", text_ids=IDS, taste_ids=[[[0, 0, 0, 0]]]), "torch.Tensor"),
    (dict(role="user", modality="audio", text_ids=IDS, taste_ids=torch.zeros(2, 4, dtype=torch.long)), r"\(1, S, K\)"),
    (dict(role="user", modality="audio", text_ids=IDS, taste_ids=torch.zeros(1, 2, 4)), "integer"),
    (dict(role="user", modality="audio", text_ids=IDS, taste_ids=torch.zeros(1, 3, 4, dtype=torch.long)), "one row per"),
    (dict(role="user", modality="audio", text_ids=IDS, taste_ids=torch.full((1, 2, 4), -2)), "below -1"),
    (dict(role="user", modality="audio", text_ids=IDS, taste_ids=torch.tensor([[[0, 1, 2, 3], [0, -1, 2, 3]]])),
     "mix codes"),
    (dict(role="user", modality="audio", text_ids=IDS, taste_ids=torch.tensor([[[-1] * 4, [0, 1, 2, 3]]])),
     "first token"),
])
def test_segment_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TASTESegment(**kwargs)


def test_segment_words_and_concat():
    taste = torch.tensor([[[1, 2, 3, 4], [-1] * 4, [5, 6, 7, 0], [8, 8, 8, 8], [-1] * 4]])
    seg = TASTESegment("assistant", "audio", torch.arange(5)[None], taste)
    assert seg.num_words == 3 and seg.word_ids().tolist() == [0, 0, 1, 2, 2]
    assert seg.first_words(2).text_ids.tolist() == [[0, 1, 2]] and seg.first_words(0) is None
    assert seg.first_words(9) is seg
    joined = TASTESegment.concat([seg.first_words(1), TASTESegment("assistant", "audio", seg.text_ids[:, 2:],
                                                                   seg.taste_ids[:, 2:])])
    assert torch.equal(joined.taste_ids, seg.taste_ids)
    with pytest.raises(ValueError, match="one role"):
        TASTESegment.concat([seg, TASTESegment("user", "audio", seg.text_ids, seg.taste_ids)])
    with pytest.raises(ValueError, match="nothing"):
        TASTESegment.concat([])
    # a segment is one turn: compared and hashed by identity (a value comparison of tensors is ambiguous)
    twin = TASTESegment("assistant", "audio", seg.text_ids.clone(), seg.taste_ids.clone())
    assert seg == seg and seg != twin and [twin, seg].index(seg) == 1 and len({seg, twin, seg}) == 2


# -- taste_tokenize ------------------------------------------------------------------------------------
def test_taste_tokenize_equals_extract_vq(model, processor, user_turn):
    inputs = processor(voiced()[None], 16000, text="hello there how are you doing today")
    assert torch.equal(inputs["llm_token_ids"], user_turn.text_ids)
    _, llm_indices = model.extract_vq(**inputs)
    assert torch.equal(user_turn.taste_ids, llm_indices)
    starts = [i for i, wid in enumerate(inputs["llm_word_ids"][0].tolist())
              if i == 0 or wid != inputs["llm_word_ids"][0, i - 1]]
    assert (user_turn.taste_ids[0] >= 0).all(-1).nonzero().flatten().tolist() == starts
    assert user_turn.taste_ids.dtype == torch.long and user_turn.taste_ids.shape[-1] == 4


def test_taste_tokenize_any_rate_and_channels(model, processor, user_turn):
    import soxr

    up = soxr.resample(voiced(), 16000, 48000)
    taste = taste_tokenize(model, processor, np.stack([up, up]), user_turn.text_ids, sampling_rate=48000)
    assert taste.shape == user_turn.taste_ids.shape
    assert torch.equal(taste >= 0, user_turn.taste_ids >= 0)
    mono = taste_tokenize(model, processor, torch.from_numpy(voiced()), user_turn.text_ids, 16000)  # (T,) tensor
    assert torch.equal(mono, user_turn.taste_ids)


@pytest.mark.parametrize("audio, match", [
    (np.zeros((1, 0), np.float32), "empty"),
    (np.zeros((1, 16000), np.float32), "silent"),
    (np.full((1, 16000), np.nan, np.float32), "NaN"),
    (np.full((1, 16000), np.inf, np.float32), "infinite"),
    ("hello.wav", "numpy array or torch tensor"),
])
def test_taste_tokenize_bad_audio(model, processor, user_turn, audio, match):
    with pytest.raises(ValueError, match=match):
        taste_tokenize(model, processor, audio, user_turn.text_ids, 16000)


def test_taste_tokenize_too_long_bad_rate_and_bad_text(model, processor, user_turn):
    too_long = np.tile(voiced(), int(processor.max_seconds / 1.5) + 2)[None]
    with pytest.raises(ValueError, match="split"):
        taste_tokenize(model, processor, too_long, user_turn.text_ids, 16000)
    with pytest.raises(ValueError, match="sampling_rate"):
        taste_tokenize(model, processor, voiced()[None], user_turn.text_ids, sampling_rate=0)
    blank = torch.tensor([processor.llm_tokenizer.encode("   ", add_special_tokens=False)])
    with pytest.raises(ValueError, match="no words"):
        taste_tokenize(model, processor, voiced()[None], blank, 16000)
    for bad, match in [(user_turn.text_ids[0], r"\(1, S\)"), (user_turn.text_ids.float(), "integer"),
                       (torch.zeros(1, 0, dtype=torch.long), "empty"), (user_turn.text_ids.tolist(), "torch.Tensor")]:
        with pytest.raises(ValueError, match=match):
            taste_tokenize(model, processor, voiced()[None], bad, 16000)


# -- greedy parity with the original --------------------------------------------------------------------
def test_greedy_streaming_equals_the_original_on_golden(golden, golden_model, golden_processor, golden_turn):
    conv = Conversation(golden_model, golden_processor)
    items = run(golden_model, golden_processor, [golden_turn], conversation=conv, text_top_p=0.0, extra_words=4)
    reply = reply_of(items)
    assert torch.equal(reply.text_ids, golden["c.audio.generated_llm_token_ids"])
    rows = golden["c.audio.generated_llm_indices"][0]
    assert torch.equal(reply.word_codes(), rows[(rows >= 0).all(-1)])
    streamed = TASTESegment.concat([i["segment"] for i in items])
    assert torch.equal(streamed.text_ids, reply.text_ids) and torch.equal(streamed.taste_ids, reply.taste_ids)
    assert items[-1]["end_reason"] == "sentence_end"
    # the cache holds exactly the rows the original fed (prompt + one row per generated token)
    final = golden["c.audio.final_inputs_embeds"]
    assert conv.state.committed_rows == final.shape[1]
    assert (conv.state.decode.inputs_embeds() - final).abs().max() < 1e-5


@pytest.mark.parametrize("name", ["pairs", "punctuation"])
def test_emission_policies_concatenate_to_the_same_reply(golden, golden_model, golden_processor, golden_turn, name):
    policy = every_n_words(2) if name == "pairs" else at_punctuation(3)
    items = run(golden_model, golden_processor, [golden_turn], text_top_p=0.0, extra_words=4,
                should_emit_segment=policy)
    joined = TASTESegment.concat([i["segment"] for i in items])
    assert torch.equal(joined.text_ids, golden["c.audio.generated_llm_token_ids"])
    decode = golden_processor.llm_tokenizer.decode
    for item in items[:-1]:
        seg = item["segment"]
        assert seg.role == "assistant" and seg.modality == "audio" and seg.taste_ids.shape[1] == seg.length
        if name == "pairs":
            assert seg.num_words == 2
        else:  # ' the' | ' wihe.' ...: released at the word carrying '.', or after 3 words
            assert seg.num_words == 3 or "." in decode(seg.text_ids[0].tolist()).split(" ")[-1]
    assert len(items) >= 2


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
def test_greedy_streaming_equals_the_no_cache_loop(model, processor, user_turn, fmt, cache_kind):
    if fmt == DIALOGUE:  # make sure the model answers (the random tiny model may hand the turn back)
        model, conv = forced_choice(model, processor, user_turn, "assistant")
        items = run(model, processor, [], conversation=conv, text_top_p=0.0, extra_words=3)
    else:
        conv = new_conversation(model, processor, cache_kind, prompt_format=fmt)
        items = run(model, processor, [user_turn], conversation=conv, text_top_p=0.0, extra_words=3)
    reply = reply_of(items)
    lm, rvq = model.spoken_lm, model.audio_tower.vq.rvq
    tables = vocabulary_tables(processor, lm.vocab_size)
    sampler = TasteSampler(tables, SamplingParams(text_top_p=0.0, extra_words=3))
    history = conv.state.decode.inputs_embeds()[:, : conv.state.committed_rows - conv.state.turn_rows[-1]]
    opening = conv.format.reply_opening(None, None)
    rows = history if opening.rows is None else torch.cat([history, opening.rows], dim=1)
    pending = conv.format.word_embeds(user_turn)[-1] if fmt == CONTINUATION else None
    ctx = InitialContext(rows, [], pending, pending is not None)
    with torch.no_grad():
        ref = lm.generate(rvq, sampler, context=ctx, stop_id=set(opening.stop_ids) | tables.special, use_cache=False,
                          max_steps=200)
    assert reply.text_ids[0].tolist() == ref.token_ids[0].tolist()
    assert torch.equal(reply.word_codes(), ref.word_codes())
    assert items[-1]["end_reason"] == ref.end_reason


# -- streaming_generate behaviour -------------------------------------------------------------------------
def test_word_segments_concatenate_to_the_reply(model, processor, user_turn):
    items = run(model, processor, [user_turn])
    assert items[-1]["is_complete"] and items[-1]["completion_reason"] == "finished"
    assert all(not i["is_complete"] and i["completion_reason"] is None for i in items[:-1])
    pieces = [i["segment"] for i in items if i["segment"] is not None]
    assert all(p.num_words == 1 for p in pieces)  # default: one word per segment
    whole = TASTESegment.concat(pieces)
    assert torch.equal(whole.text_ids, reply_of(items).text_ids)
    assert torch.equal(whole.taste_ids, reply_of(items).taste_ids)


def test_top_p_sampling_is_reproducible_with_a_generator(model, processor, user_turn):
    a = reply_of(run(model, processor, [user_turn], generator=torch.Generator().manual_seed(5), text_top_p=0.9))
    b = reply_of(run(model, processor, [user_turn], generator=torch.Generator().manual_seed(5), text_top_p=0.9))
    assert torch.equal(a.text_ids, b.text_ids) and torch.equal(a.taste_ids, b.taste_ids)


def test_max_length_truncates_and_says_so(model, processor, user_turn):
    items = run(model, processor, [user_turn], max_length=3, extra_words=8)
    last = items[-1]
    assert last["completion_reason"] == "finished" and last["truncated"] and last["end_reason"] == "max_length"
    assert reply_of(items).length == 3 and sum(i["segment"].length for i in items if i["segment"]) == 3


def test_eos_id_ends_the_reply_without_emitting_it(model, processor, user_turn):
    free = reply_of(run(model, processor, [user_turn], text_top_p=0.0, extra_words=8))
    eos = int(free.text_ids[0, 3])
    first = free.text_ids[0].tolist().index(eos)
    items = run(model, processor, [user_turn], text_top_p=0.0, extra_words=8, eos_id=eos)
    assert items[-1]["end_reason"] == "stop_id" and not items[-1]["truncated"]
    assert reply_of(items).text_ids[0].tolist() == free.text_ids[0, :first].tolist()


@pytest.mark.parametrize("kind", ["event", "callable"])
def test_cancellation_ends_within_one_step(model, processor, user_turn, kind):
    event = threading.Event()
    stop = event if kind == "event" else event.is_set
    seen = []
    for item in streaming_generate(model, processor, [user_turn], extra_words=8, stop=stop,
                                   generator=torch.Generator().manual_seed(0)):
        seen.append(item)
        if not item["is_complete"] and not event.is_set():
            event.set()
    assert len(seen) == 2 and seen[-1]["cancelled"] and seen[-1]["end_reason"] == "cancelled"
    assert seen[-1]["steps"] == seen[0]["steps"]  # not one more token after the stop request
    reply = reply_of(seen)
    assert reply.length == seen[0]["steps"] and reply.word_starts()[0]


# -- dialogue format -------------------------------------------------------------------------------------
def test_dialogue_rows_use_reserved_tokens(model, processor, user_turn):
    conv = Conversation(model, processor, prompt_format=DIALOGUE)
    tok = processor.llm_tokenizer
    ids = conv.format.ids
    assert ids.segment_start == tok.convert_tokens_to_ids("<|reserved_special_token_50|>")
    assert ids.segment_end == tok.convert_tokens_to_ids("<|reserved_special_token_51|>")
    assert ids.assistant == tok.convert_tokens_to_ids("<|reserved_special_token_54|>")
    rows, fed, _ = conv.format.segment_rows(user_turn, None)
    assert rows.shape[1] == user_turn.length + 3
    assert fed == [ids.user, ids.segment_start] + user_turn.text_ids[0].tolist() + [ids.segment_end]
    lm = model.spoken_lm
    pad_row = lm.fuse(lm.token_embeds([ids.user]).float(), lm.pad_audio()[None])
    assert torch.allclose(rows[0, :1], pad_row)
    last_code = conv.format.word_embeds(user_turn)[-1:]
    assert torch.allclose(rows[0, -1:], lm.fuse(lm.token_embeds([ids.segment_end]).float(), last_code))


def forced_choice(model, processor, turn, winner):
    """A dialogue conversation whose turn decision ``winner`` wins: its format's (user, assistant)
    logits are set, the model is left as it is (a head made to favour a role token would also make
    the reply pick it, a special token, which ends a reply)."""
    conv = Conversation(model, processor, prompt_format=DIALOGUE)
    conv.add_turn(turn)
    choice = torch.tensor([50.0, -50.0] if winner == "user" else [-50.0, 50.0])
    conv.format.turn_logits = lambda text_logits: choice.to(text_logits.device)
    return model, conv


def test_dialogue_turn_decision(model, processor, user_turn):
    forced, conv = forced_choice(model, processor, user_turn, "user")
    rows_before = conv.state.decode.length
    items = run(forced, processor, [], conversation=conv)
    assert len(items) == 1 and items[0]["completion_reason"] == "no_speech" and items[0]["segment"] is None
    assert items[0]["is_complete"] and len(conv.turns) == 1 and conv.state.decode.length == rows_before
    forced, conv = forced_choice(model, processor, user_turn, "assistant")
    items = run(forced, processor, [], conversation=conv, extra_words=2)
    assert items[-1]["completion_reason"] == "finished" and reply_of(items) is not None
    assert conv.turns[-1].role == "assistant"


def test_dialogue_format_needs_reserved_tokens(golden_model, golden_processor, golden_turn):
    with pytest.raises(ValueError, match="convert_tokens_to_ids|reserved"):
        run(golden_model, golden_processor, [golden_turn], prompt_format=DIALOGUE)


# -- Conversation ------------------------------------------------------------------------------------------
def assert_cache_equals_fresh_build(model, processor, conv):
    fresh = Conversation(model, processor, system=conv.system, prompt_format=conv.prompt_format)
    fresh.state.turns = list(conv.state.turns)
    fresh.ready()
    assert fresh.state.committed_rows == conv.state.committed_rows == conv.state.decode.length
    assert fresh.state.decode.input_ids == conv.state.decode.input_ids
    assert (fresh.state.decode.inputs_embeds() - conv.state.decode.inputs_embeds()).abs().max() < 1e-6
    for (ka, va), (kb, vb) in zip(fresh.state.decode.cache.keys_values(), conv.state.decode.cache.keys_values()):
        assert torch.allclose(ka, kb, atol=1e-5) and torch.allclose(va, vb, atol=1e-5)
    assert (fresh.state.committed_hidden - conv.state.committed_hidden).abs().max() < 1e-5
    if conv.state.carry is None:
        assert fresh.state.carry is None
    else:
        assert torch.allclose(fresh.state.carry, conv.state.carry)


@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_turns_reuse_the_prefix_cache(model, processor, user_turn, second_turn, fmt, cache_kind):
    system = text_segment(processor, "system", " be kind")
    conv = new_conversation(model, processor, cache_kind, system=system, prompt_format=fmt)
    run(model, processor, [user_turn], conversation=conv, text_top_p=0.0)
    assert_cache_equals_fresh_build(model, processor, conv)
    fed = []
    lm = model.spoken_lm
    original = lm.feed
    lm.feed = lambda state, rows: (fed.append(rows.shape[1]), original(state, rows))[1]
    try:
        before = conv.state.committed_rows
        items = run(model, processor, [second_turn], conversation=conv, text_top_p=0.0)
    finally:
        del lm.feed
    # only the new turn and the reply were fed: no row of the history again
    assert sum(fed) == conv.state.committed_rows - before
    index = max(i for i, t in enumerate(conv.state.turns) if t is second_turn)
    assert fed[0] == conv.state.turn_rows[index]  # the new user turn in one block
    if items[-1]["completion_reason"] == "finished":
        assert conv.turns[-1].role == "assistant"
    assert_cache_equals_fresh_build(model, processor, conv)


@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_truncate_to_played_words(model, processor, user_turn, second_turn, fmt, cache_kind):
    conv = new_conversation(model, processor, cache_kind, prompt_format=fmt)
    items = run(model, processor, [user_turn], conversation=conv, text_top_p=0.0, extra_words=4)
    if items[-1]["completion_reason"] != "finished":
        conv.add_turn(TASTESegment("assistant", "audio", user_turn.text_ids, user_turn.taste_ids))
    full = conv.turns[-1]
    kept = conv.truncate_last_assistant(2)
    assert kept.num_words == 2 and conv.turns[-1] is kept
    assert torch.equal(kept.text_ids, full.first_words(2).text_ids)
    assert_cache_equals_fresh_build(model, processor, conv)
    assert conv.truncate_last_assistant(5) is kept  # more than it has: unchanged
    assert conv.truncate_last_assistant(0) is None and conv.turns[-1].role == "user"
    assert_cache_equals_fresh_build(model, processor, conv)
    # in the middle of the history: rebuilt lazily
    run(model, processor, [second_turn], conversation=conv, text_top_p=0.0, extra_words=2)
    conv.add_turn(user_turn)
    if any(t.role == "assistant" for t in conv.turns):
        conv.truncate_last_assistant(1)
        conv.ready()
        assert_cache_equals_fresh_build(model, processor, conv)


@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_forget_a_turn_answered_too_early(model, processor, user_turn, second_turn, fmt, cache_kind):
    """The caller went on speaking: the early user turn and the reply begun to it go, and the
    conversation answers the whole turn exactly as if the early one had never been there."""
    conv = new_conversation(model, processor, cache_kind, prompt_format=fmt)
    run(model, processor, [user_turn], conversation=conv, text_top_p=0.0)
    before = (list(conv.turns), conv.state.committed_rows, list(conv.state.decode.input_ids))
    early = TASTESegment("user", "audio", second_turn.text_ids[:, :2], second_turn.taste_ids[:, :2])
    stop = threading.Event()
    items = streaming_generate(model, processor, [early], conversation=conv, text_top_p=0.0, extra_words=4,
                               stop=stop)
    next(items)  # the reply has begun (or the model kept listening)
    stop.set()
    for _ in items:
        pass
    assert conv.turns[len(before[0])] is early
    added = len(conv.turns) - len(before[0])
    assert conv.forget_from(early) == added >= 1
    assert conv.turns == before[0] and conv.state.committed_rows == before[1]
    assert conv.state.decode.input_ids == before[2]
    assert_cache_equals_fresh_build(model, processor, conv)
    assert conv.forget_from(early) == 0  # no longer there: nothing to do
    answered = reply_of(run(model, processor, [second_turn], conversation=conv, text_top_p=0.0))
    fresh = new_conversation(model, processor, cache_kind, prompt_format=fmt)
    run(model, processor, [user_turn], conversation=fresh, text_top_p=0.0)
    expected = reply_of(run(model, processor, [second_turn], conversation=fresh, text_top_p=0.0))
    if expected is None:
        assert answered is None
    else:
        assert torch.equal(answered.text_ids, expected.text_ids) and torch.equal(answered.taste_ids, expected.taste_ids)


@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
def test_rolling_window_keeps_the_system_segment(model, processor, user_turn, second_turn, cache_kind):
    system = text_segment(processor, "system", " be kind")
    conv = new_conversation(model, processor, cache_kind, system=system, max_turns=3)
    for turn in [user_turn, second_turn, user_turn, second_turn, user_turn]:
        conv.add_turn(turn)
    assert len(conv.turns) == 3 and conv.system is system
    assert [t.length for t in conv.turns] == [user_turn.length, second_turn.length, user_turn.length]
    assert_cache_equals_fresh_build(model, processor, conv)
    small = new_conversation(model, processor, cache_kind, system=system, max_tokens=2 * user_turn.length + 2)
    for turn in [user_turn, user_turn, user_turn]:
        small.add_turn(turn)
    assert small.state.committed_rows <= small.max_tokens and len(small.turns) == 1
    assert_cache_equals_fresh_build(model, processor, small)
    if cache_kind == "batched":  # every rebuild gave the old slot back: one slot per conversation
        assert isinstance(small.state.decode.cache, SlotLMCache) and small.state.decode.cache.batched
        assert small.lm_batch.slots_in_use == 1
        small.close()
        assert small.lm_batch.slots_in_use == 0
        with pytest.raises(RuntimeError, match="closed"):
            small.add_turn(user_turn)


@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
def test_the_window_keeps_the_newest_exchange_and_drops_whole_exchanges(model, processor, user_turn, second_turn,
                                                                         cache_kind):
    system = text_segment(processor, "system", " be kind")
    # a window the system segment plus one user turn already overflows
    conv = new_conversation(model, processor, cache_kind, system=system, max_tokens=user_turn.length)
    conv.add_turn(user_turn)
    assert conv.turns == [user_turn]  # the turn about to be answered stays, over the limit
    items = run(model, processor, [], conversation=conv, text_top_p=0.0)
    reply = reply_of(items)
    assert reply is not None and conv.turns == [user_turn, reply]  # and so does its answer
    assert_cache_equals_fresh_build(model, processor, conv)
    assert conv.forget_from(user_turn) == 2 and conv.turns == []  # an early turn can still be taken back
    conv.add_turn(user_turn)
    run(model, processor, [], conversation=conv, text_top_p=0.0)
    cache = conv.state.decode.cache
    conv.add_turn(second_turn)  # the old exchange goes as a whole: no answer without its question
    assert conv.turns == [second_turn] and conv.system is system
    if cache_kind == "static":  # prefilled again in place: buffers and captured step kept
        assert conv.state.decode.cache is cache
    assert_cache_equals_fresh_build(model, processor, conv)
    with pytest.raises(ValueError, match="system segment takes .* more than half of max_tokens"):
        new_conversation(model, processor, cache_kind, system=system, max_tokens=4)


def test_several_replies_in_a_row_keep_their_question_while_they_fit(model, processor, user_turn, second_turn):
    """Replies given with no new turn in between (``input_segments=None``) answer the same question:
    the window keeps them with it (it kept only the newest reply, opening with an answer), unless
    they alone are over the limit."""
    conv = Conversation(model, processor, max_turns=5)
    run(model, processor, [user_turn], conversation=conv, text_top_p=0.0)
    run(model, processor, [second_turn], conversation=conv, text_top_p=0.0)
    for _ in range(2):
        run(model, processor, None, conversation=conv, text_top_p=0.0)
    assert [t.role for t in conv.turns] == ["user"] + ["assistant"] * 3 and conv.turns[0] is second_turn
    assert_cache_equals_fresh_build(model, processor, conv)
    for _ in range(3):  # past the limit with replies alone: only the newest stays (still bounded)
        run(model, processor, None, conversation=conv, text_top_p=0.0)
    assert len(conv.turns) <= 5
    assert_cache_equals_fresh_build(model, processor, conv)


def test_the_window_never_opens_with_an_answer_whose_question_it_dropped(model, processor, user_turn, second_turn):
    """Three exchanges over ``max_turns=5``: going down to its low water (3 turns), the window drops
    a question together with its answer - never the question alone."""
    conv = Conversation(model, processor, max_turns=5)
    for turn in (user_turn, second_turn, user_turn):
        run(model, processor, [turn], conversation=conv, text_top_p=0.0)
        assert conv.turns[0].role == "user", [t.role for t in conv.turns]
    assert [t.role for t in conv.turns] == ["user", "assistant"] and conv.turns[0] is user_turn
    assert_cache_equals_fresh_build(model, processor, conv)


def test_the_window_drops_below_its_limit_so_a_long_call_rarely_prefills_again(model, processor, user_turn):
    conv = Conversation(model, processor, max_turns=8)
    rebuilds, decode = 0, None
    for _ in range(16):
        conv.add_turn(user_turn)
        rebuilds += decode is not None and conv.state.decode is not decode
        decode = conv.state.decode
        assert len(conv.turns) <= 8
    assert rebuilds == 3  # down to 6 turns each time: at turns 9, 12 and 15, not at each of the 8 past the limit


def _reply_left_open(model, processor, conv, turn):
    """A reply to ``turn`` whose iterator has handed on its last item and is not asked for more."""
    items = streaming_generate(model, processor, [turn], conversation=conv, text_top_p=0.0, extra_words=3,
                               generator=torch.Generator().manual_seed(0))
    last = next(item for item in items if item["is_complete"])
    return items, last["reply"]


@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
def test_a_reply_past_the_window_moves_it_after_its_last_item_not_before(model, processor, user_turn, second_turn,
                                                                          cache_kind):
    """The window's prefill waits for the reply's last words to be handed on: the iterator makes
    the move when asked for more after its last item (a for loop's next turn round)."""
    conv = new_conversation(model, processor, cache_kind, max_turns=3)
    run(model, processor, [user_turn], conversation=conv, text_top_p=0.0)
    items, reply = _reply_left_open(model, processor, conv, second_turn)
    assert reply is not None and len(conv.turns) == 4 and conv.window_due  # nothing prefilled before the last item
    assert next(items, None) is None  # asked for more: the window moves now
    assert not conv.window_due and conv.turns == [second_turn, reply]
    assert_cache_equals_fresh_build(model, processor, conv)


@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
def test_a_due_window_moves_at_move_window_or_else_before_the_next_turn(model, processor, user_turn, second_turn,
                                                                        cache_kind):
    moved = new_conversation(model, processor, cache_kind, max_turns=3)
    late = new_conversation(model, processor, cache_kind, max_turns=3)
    replies = {}
    for conv in (moved, late):
        run(model, processor, [user_turn], conversation=conv, text_top_p=0.0)
        items, replies[conv] = _reply_left_open(model, processor, conv, second_turn)
        items.close()  # (a consumer that stops at the last item: the plugin's)
        assert conv.window_due and len(conv.turns) == 4
    assert moved.move_window() is True and moved.turns == [second_turn, replies[moved]] and not moved.window_due
    assert moved.move_window() is False  # nothing due
    assert_cache_equals_fresh_build(model, processor, moved)
    late.add_turn(user_turn)  # never moved between turns: moved before the turn is fed
    assert late.turns == [second_turn, replies[late], user_turn] and not late.window_due
    assert_cache_equals_fresh_build(model, processor, late)


@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
def test_a_due_window_leaves_a_barge_in_s_cut_and_a_forgotten_turn_where_they_were(model, processor, user_turn,
                                                                                   second_turn, cache_kind):
    """Cutting the reply to the words heard, or taking back the turn it answered, works on the
    history as the reply left it: the window moves after (the plugin's commit), not under the cut."""
    cut, forgot = (new_conversation(model, processor, cache_kind, max_turns=3) for _ in range(2))
    for conv in (cut, forgot):
        run(model, processor, [user_turn], conversation=conv, text_top_p=0.0)
        items, _ = _reply_left_open(model, processor, conv, second_turn)
        items.close()
    kept = cut.truncate_last_assistant(1)
    assert kept is not None and kept.num_words == 1 and cut.turns[-1] is kept and len(cut.turns) == 4
    assert_cache_equals_fresh_build(model, processor, cut)
    assert cut.move_window() and cut.turns == [second_turn, kept]
    assert_cache_equals_fresh_build(model, processor, cut)
    assert forgot.forget_from(second_turn) == 2 and len(forgot.turns) == 2 and not forgot.window_due
    assert_cache_equals_fresh_build(model, processor, forgot)


def test_a_rejected_turn_leaves_the_conversation_as_it_was(model, processor, user_turn):
    conv = Conversation(model, processor)
    bad = TASTESegment("user", "audio", user_turn.text_ids, user_turn.taste_ids[..., :-1])  # one RVQ level short
    with pytest.raises(ValueError, match=r"input_segments\[1\] \(user, audio\): the taste_ids have 3 codes per word"):
        streaming_generate(model, processor, [user_turn, bad], conversation=conv)  # (at the call, naming it)
    assert conv.turns == [] and not conv.reply_in_progress
    run(model, processor, [user_turn], conversation=conv)  # (the conversation was left free and empty)
    assert conv.turns[0] is user_turn


def test_a_stop_callable_is_asked_once_per_step(model, processor, user_turn):
    asked = []

    def stop_once_asked_twice():  # True the second time it is asked, then never again
        asked.append(1)
        return len(asked) == 2

    items = run(model, processor, [user_turn], stop=stop_once_asked_twice, text_top_p=0.0, max_length=50)
    assert items[-1]["end_reason"] == "cancelled" and items[-1].get("cancelled"), items[-1]


@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
def test_snapshot_and_restore(model, processor, user_turn, second_turn, cache_kind):
    conv = new_conversation(model, processor, cache_kind)
    run(model, processor, [user_turn], conversation=conv, text_top_p=0.0)
    live = conv.state.decode.cache
    snap = conv.snapshot()
    if cache_kind != "dynamic":  # it holds the rows in use, not the live cache's whole capacity
        capacity = live.batch.capacity if cache_kind == "batched" else live.capacity
        assert snap.decode.length < snap.decode.cache.capacity <= snap.decode.length + 256 < capacity
    first = reply_of(run(model, processor, [second_turn], conversation=conv, text_top_p=0.0))
    assert len(conv.turns) == 4
    conv.restore(snap)
    assert len(conv.turns) == 2 and conv.state.decode.length == snap.decode.length
    if cache_kind == "static":  # restored, it has a live cache's room again (no growing mid-reply)
        assert conv.state.decode.cache.capacity >= conv.max_tokens
    again = reply_of(run(model, processor, [second_turn], conversation=conv, text_top_p=0.0))
    assert torch.equal(first.text_ids, again.text_ids) and torch.equal(first.taste_ids, again.taste_ids)
    assert snap.decode.length < conv.state.decode.length  # the snapshot was not touched
    conv.restore(snap)  # the restored history holds the caller's own segments: forget_from finds them
    assert conv.turns[0] is user_turn and conv.forget_from(user_turn) == 2 and conv.turns == []
    if cache_kind == "batched":  # a snapshot holds no slot; the restored cache is a private one
        assert not isinstance(snap.decode.cache, SlotLMCache)
        assert conv.lm_batch.slots_in_use == 0
    with pytest.raises(ValueError, match="snapshot"):
        conv.restore({"turns": []})
    conv.close()
    with pytest.raises(RuntimeError, match="closed: restore the snapshot into a new Conversation"):
        conv.restore(snap)  # (it came back to life, then failed at its next window roll)


def test_a_restored_batched_conversation_goes_back_to_the_batch(model, processor, user_turn, second_turn):
    """restore() gives a batched conversation a private cache; the next prefill of its history (a
    window roll) puts it back into a slot, where its decode steps join the other calls'."""
    conv = new_conversation(model, processor, "batched", max_turns=4)
    run(model, processor, [user_turn], conversation=conv, text_top_p=0.0)
    conv.restore(conv.snapshot())
    assert not isinstance(conv.state.decode.cache, SlotLMCache) and conv.lm_batch.slots_in_use == 0
    for _ in range(2):  # past max_turns: the window rolls and the kept history is prefilled again
        run(model, processor, [second_turn], conversation=conv, text_top_p=0.0)
    assert isinstance(conv.state.decode.cache, SlotLMCache) and conv.lm_batch.slots_in_use == 1


def test_abandoned_reply_is_discarded(model, processor, user_turn):
    conv = Conversation(model, processor)
    conv.add_turn(user_turn)
    rows = conv.state.committed_rows
    iterator = streaming_generate(model, processor, [], conversation=conv, extra_words=8)
    next(iterator)
    iterator.close()
    assert conv.state.decode.length > rows and len(conv.turns) == 1
    assert conv.ready().length == rows
    assert_cache_equals_fresh_build(model, processor, conv)


# -- bad input ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(max_length=0), "max_length"), (dict(max_length=2.5), "max_length"),
    (dict(text_top_p=2.0), "text_top_p"), (dict(text_temperature=0.0), "text_temperature"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"), (dict(taste_top_p=-0.5), "taste_top_p"),
    (dict(extra_words=0), "extra_words"), (dict(stop="now"), "stop"),
    (dict(should_emit_segment=3), "should_emit_segment"), (dict(prompt_format="chat"), "prompt_format"),
])
def test_bad_generation_arguments(model, processor, user_turn, kwargs, match):
    with pytest.raises(ValueError, match=match):
        run(model, processor, [user_turn], **kwargs)


def test_bad_segments_and_conversations(model, processor, user_turn):
    with pytest.raises(ValueError, match="TASTESegment"):
        run(model, processor, ["hello"])
    with pytest.raises(ValueError, match="no history"):
        run(model, processor, [])
    conv = Conversation(model, processor, prompt_format=INSTRUCT)
    with pytest.raises(ValueError, match="fixed per conversation"):
        run(model, processor, [user_turn], conversation=conv, prompt_format=DIALOGUE)
    with pytest.raises(ValueError, match="system"):
        Conversation(model, processor, system=user_turn)
    with pytest.raises(ValueError, match="no assistant turn"):
        conv.truncate_last_assistant(1)
    conv.add_turn(user_turn)
    with pytest.raises(ValueError, match="only open"):
        conv.add_turn(text_segment(processor, "system", " late"))
    with pytest.raises(ValueError, match="played_words"):
        conv.truncate_last_assistant(-1)
    with pytest.raises(ValueError, match="max_tokens"):
        Conversation(model, processor, max_tokens=0)
    for bad in ("4096", None, float("nan")):
        with pytest.raises(ValueError, match="max_turns must be an integer"):
            Conversation(model, processor, max_turns=bad)
    wrong_k = TASTESegment("user", "audio", user_turn.text_ids, user_turn.taste_ids[..., :3])
    with pytest.raises(ValueError, match="levels"):
        run(model, processor, [wrong_k])
    with pytest.raises(ValueError, match="n >= 1"):
        every_n_words(0)
    for factory in (every_n_words, at_punctuation):  # passed without calling it: named before generating
        with pytest.raises(ValueError, match=rf"call it, e.g. should_emit_segment={factory.__name__}\(3\)"):
            run(model, processor, [user_turn], should_emit_segment=factory)


@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
def test_a_conversation_whose_model_was_cast_makes_its_rows_again(model, processor, user_turn, second_turn,
                                                                  cache_kind):
    """A model cast (or moved) after a conversation made its cache rows: they were of the old dtype,
    and the next reply failed deep in the attention ('expected scalar type Float but found
    BFloat16'). The conversation makes its rows again from its turns, as a new one would; a
    batched one, whose LMStepBatch holds rows of the old dtype, says so."""
    import copy

    cast = copy.deepcopy(model)
    conv = new_conversation(cast, processor, cache_kind)
    run(cast, processor, [user_turn], conversation=conv, text_top_p=0.0)
    cast.spoken_lm.to(torch.bfloat16)
    if cache_kind == "batched":
        with pytest.raises(ValueError, match=r"LMStepBatch holds torch.float32 rows on cpu, the model is now "
                                             r"torch.bfloat16 on cpu .*make a new LMStepBatch"):
            run(cast, processor, [second_turn], conversation=conv, text_top_p=0.0)
        return
    snapshot = conv.snapshot()  # (its rows are the old model's: the restored state makes them again)
    after = reply_of(run(cast, processor, [second_turn], conversation=conv, text_top_p=0.0))
    restored = new_conversation(cast, processor, cache_kind)
    restored.restore(snapshot)
    from_snapshot = reply_of(run(cast, processor, [second_turn], conversation=restored, text_top_p=0.0))
    assert torch.equal(after.text_ids, from_snapshot.text_ids)
    fresh = new_conversation(cast, processor, cache_kind)
    for turn in conv.turns[:2]:
        fresh.add_turn(turn)
    again = reply_of(run(cast, processor, [second_turn], conversation=fresh, text_top_p=0.0))
    assert torch.equal(after.text_ids, again.text_ids) and torch.equal(after.taste_ids, again.taste_ids)
