"""The standalone library used the wrong way: a stop id the sampler bans, a conversation closed
under its reply or dropped without close(), an iterator that checks nothing until it runs,
audio without (or with an absurd) sampling rate, too short or silent audio, ids from
``tokenizer(text)`` and snapshots restored into another conversation. Each either works as the
caller meant or fails at once with an error that names the fix."""

from __future__ import annotations

import copy
import gc
import threading
import time

import numpy as np
import pytest
import torch

from taste_speech.lm_batch import LMStepBatch
from taste_speech.streaming import INSTRUCT, Conversation, TASTESegment, streaming_generate, taste_tokenize
from taste_speech.streaming.generate import vocabulary_tables
from audio_helpers import voiced

BUSY = "a reply is being generated on this conversation"


@pytest.fixture(scope="module")
def hello_ids(processor):
    return processor.process_text("hello there how are you doing today").llm_token_ids


@pytest.fixture(scope="module")
def user_turn(model, processor, hello_ids):
    return TASTESegment("user", "audio", hello_ids, taste_tokenize(model, processor, voiced()[None], hello_ids, 16000))


def generate(model, processor, segments, **kw):
    kw.setdefault("generator", torch.Generator().manual_seed(0))
    kw.setdefault("extra_words", 3)
    return streaming_generate(model, processor, segments, **kw)


# -- 1. a stop id the caller names ends the reply ---------------------------------------------------------
def test_the_tokenizers_eos_id_ends_the_reply(model, processor, user_turn, monkeypatch):
    eos = processor.llm_tokenizer.eos_token_id
    tables = vocabulary_tables(processor, model.spoken_lm.vocab_size)
    assert bool(tables.banned[eos])  # <|end_of_text|> is banned, as in the original
    heads = model.spoken_lm.heads

    def eos_preferred(hidden, rvq, **kwargs):  # a model that wants to end at once
        out = heads(hidden, rvq, **kwargs)
        out.text_logits[eos] += 50.0
        return out

    monkeypatch.setattr(model.spoken_lm, "heads", eos_preferred)
    last = list(generate(model, processor, [user_turn], eos_id=eos, extra_words=8))[-1]
    assert last["end_reason"] == "stop_id" and last["reply"] is None
    # without eos_id the ban stands (the original behaviour) and the shared tables are unchanged
    last = list(generate(model, processor, [user_turn], extra_words=2))[-1]
    assert last["end_reason"] != "stop_id" and eos not in last["reply"].text_ids[0].tolist()
    assert bool(tables.banned[eos])
    for bad in (-1, model.spoken_lm.vocab_size, "eos", True, 2.0):
        with pytest.raises(ValueError, match="eos_id must be a token id"):
            generate(model, processor, [user_turn], eos_id=bad)


def test_a_special_token_the_model_picks_ends_the_reply_and_the_reply_stays_speakable(model, processor, user_turn,
                                                                                     monkeypatch):
    """A reserved token or a role header is not banned by the original's tables (it holds letters),
    but it is no word: the speech side refuses it. The model picking one ends its reply there."""
    tables = vocabulary_tables(processor, model.spoken_lm.vocab_size)
    reserved = [i for i in sorted(tables.special) if not bool(tables.banned[i])]
    assert reserved, "the tiny vocabulary has sampleable special tokens"
    special, heads, steps = reserved[len(reserved) // 2], model.spoken_lm.heads, []

    def special_after_some_words(hidden, rvq, **kwargs):  # a model that leaves the text after a few tokens
        out = heads(hidden, rvq, **kwargs)
        steps.append(1)
        if len(steps) > 4:
            out.text_logits[special] += 50.0
        return out

    monkeypatch.setattr(model.spoken_lm, "heads", special_after_some_words)
    conversation = Conversation(model, processor)
    last = list(generate(model, processor, [user_turn], conversation=conversation, extra_words=8))[-1]
    assert last["end_reason"] == "stop_id" and last["reply"] is not None
    reply_ids = last["reply"].text_ids[0].tolist()
    assert special not in reply_ids and not set(reply_ids) & tables.special and len(reply_ids) >= 3
    monkeypatch.undo()
    Conversation(model, processor).add_turn(last["reply"])  # the reply is a valid turn (it was refused)
    assert conversation.turns[-1] is last["reply"]


# -- 2. close() under a reply; Conversation as a context manager -----------------------------------------
def test_close_during_a_reply_raises_and_the_reply_goes_on(model, processor, user_turn):
    conv = Conversation(model, processor)
    items = generate(model, processor, [user_turn], conversation=conv)
    next(items)
    with pytest.raises(RuntimeError, match=BUSY):
        conv.close()
    assert not conv.closed
    assert list(items)[-1]["completion_reason"] == "finished"
    assert [t.role for t in conv.turns] == ["user", "assistant"]
    conv.close()
    assert conv.closed and [t.role for t in conv.turns] == ["user", "assistant"]  # history stays readable
    with Conversation(model, processor) as conv:
        conv.add_turn(user_turn)
    assert conv.closed and conv.state.decode is None
    with pytest.raises(RuntimeError, match="closed"):
        conv.add_turn(user_turn)


# -- 3. a batched conversation dropped without close() ------------------------------------------------------
def test_a_dropped_batched_conversation_gives_its_slot_back(model, processor, user_turn):
    batch = LMStepBatch(model.spoken_lm, slots=1, capacity=256, graph_mode="eager")
    for _ in range(3):
        conv = Conversation(model, processor, lm_batch=batch)
        list(generate(model, processor, [user_turn], conversation=conv, max_length=3))
        assert batch.slots_in_use == 1 and conv.state.decode.cache.batched  # not a private cache
        del conv
        gc.collect()
        assert batch.slots_in_use == 0
    # a slot given back and handed on is not freed again when its first owner goes
    first = Conversation(model, processor, lm_batch=batch)
    first.add_turn(user_turn)
    first.close()
    with Conversation(model, processor, lm_batch=batch) as second:
        second.add_turn(user_turn)
        del first
        gc.collect()
        assert batch.slots_in_use == 1 and second.state.decode.cache.batched
        list(generate(model, processor, [], conversation=second, max_length=2))
    assert batch.slots_in_use == 0


def test_a_batched_conversation_left_on_an_error_mid_reply_gives_its_slot_back_with_the_reply(model, processor,
                                                                                               user_turn):
    """Leaving the ``with`` block on the caller's error while a reply's iterator is open closes the
    conversation but cannot drop its cache under the reply; the slot goes back when the reply ends."""
    batch = LMStepBatch(model.spoken_lm, slots=1, capacity=256, graph_mode="eager")
    with pytest.raises(OSError, match="the transport failed"):
        with Conversation(model, processor, lm_batch=batch) as conv:
            items = generate(model, processor, [user_turn], conversation=conv)
            next(items)
            raise OSError("the transport failed")
    assert conv.closed and batch.slots_in_use == 1  # (the reply still runs on it)
    items.close()
    assert batch.slots_in_use == 0 and conv.state.decode is None


# -- 4. streaming_generate checks and claims at the call -----------------------------------------------------
def test_streaming_generate_checks_and_claims_at_the_call(model, processor, user_turn):
    with pytest.raises(ValueError, match="max_length"):
        generate(model, processor, [user_turn], max_length=-3)
    with pytest.raises(ValueError, match="TASTESegment"):
        generate(model, processor, ["not a segment"])
    conv = Conversation(model, processor)
    items = generate(model, processor, [user_turn], conversation=conv)
    assert conv.reply_in_progress
    with pytest.raises(RuntimeError, match=BUSY):
        conv.add_turn(user_turn)
    items.close()  # never started: nothing was added, the conversation is free
    assert not conv.reply_in_progress and conv.turns == []
    items = generate(model, processor, [user_turn], conversation=conv)
    del items  # dropped unstarted
    gc.collect()
    assert not conv.reply_in_progress
    items = generate(model, processor, [user_turn], conversation=conv)
    assert list(items)[-1]["is_complete"] and [t.role for t in conv.turns] == ["user", "assistant"]
    items.close()  # closing a finished iterator is harmless
    assert not conv.reply_in_progress
    with pytest.raises(ValueError, match="sampler_tables"):
        generate(model, processor, [user_turn], sampler_tables="tables")
    assert list(generate(model, processor, [user_turn], max_length=np.int64(2)))[-1]["steps"] <= 2
    conv.close()
    with pytest.raises(RuntimeError, match="closed"):  # at the call, not at the first item
        generate(model, processor, [user_turn], conversation=conv)


# -- 5, 6. the sampling rate is required; too short audio and absurd rates ------------------------------------
def test_the_sampling_rate_is_required(model, processor, hello_ids):
    with pytest.raises(TypeError, match="sampling_rate"):
        taste_tokenize(model, processor, voiced()[None], hello_ids)
    with pytest.raises(TypeError, match="sampling_rate"):
        processor.speaker_embedding([voiced()])


@pytest.mark.parametrize("samples, rate", [(1, 48000), (2, 48000), (10, 16000), (1599, 16000), (4500, 48000)])
def test_too_short_audio_is_refused(model, processor, hello_ids, samples, rate):
    audio = np.full(samples, 0.5, np.float32)
    with pytest.raises(ValueError, match="too short.*minimum is 100 ms"):
        taste_tokenize(model, processor, audio, hello_ids, rate)
    with pytest.raises(ValueError, match="too short"):
        processor.prepare_audio(audio, rate)


def test_the_shortest_accepted_audio(processor):
    assert processor.prepare_audio(voiced(0.1), 16000).size == 1600


@pytest.mark.parametrize("rate", [1, 100, 3999])
def test_an_absurd_sampling_rate_is_refused(model, processor, hello_ids, rate):
    with pytest.raises(ValueError, match="below 4000 Hz.*in Hz"):
        taste_tokenize(model, processor, voiced()[None], hello_ids, rate)
    with pytest.raises(ValueError, match="below 4000 Hz"):
        processor.speaker_embedding([voiced()], rate)


def test_a_silent_reference_clip_is_refused(processor):
    with pytest.raises(ValueError, match="reference clip 1 is silent"):
        processor.speaker_embedding([voiced(), np.zeros(16000, np.float32)], 16000)
    assert processor.speaker_embedding([voiced()], 16000).shape[0] == 1


# -- 7. special tokens in the transcript ids ---------------------------------------------------------------------
def test_ids_with_special_tokens_are_refused(model, processor, hello_ids):
    tokenizer = processor.llm_tokenizer
    with_bos = tokenizer("hello there how are you doing today", return_tensors="pt").input_ids
    assert with_bos[0, 0] == tokenizer.bos_token_id
    with pytest.raises(ValueError, match=r"special token ids \[\d+\].*processor.process_text\(text\).llm_token_ids"):
        taste_tokenize(model, processor, voiced()[None], with_bos, 16000)
    inside = hello_ids.clone()
    inside[0, 2] = tokenizer.eos_token_id
    with pytest.raises(ValueError, match="special token ids"):
        taste_tokenize(model, processor, voiced()[None], inside, 16000)


# -- 8. a snapshot goes back only where it came from ---------------------------------------------------------------
def test_restore_checks_the_format_and_the_model(model, processor, user_turn):
    conv = Conversation(model, processor)
    conv.add_turn(user_turn)
    snap = conv.snapshot()
    with pytest.raises(ValueError, match="'continuation' conversation, this one is 'instruct'"):
        Conversation(model, processor, prompt_format=INSTRUCT).restore(snap)
    other = copy.deepcopy(model)
    other.config._name_or_path = "another/checkpoint"
    with pytest.raises(ValueError, match="made with another model"):
        Conversation(other, processor).restore(snap)
    from taste_speech.streaming import ConversationState

    with pytest.raises(ValueError, match="not made by snapshot"):
        conv.restore(ConversationState())
    fresh = Conversation(model, processor)
    fresh.restore(snap)  # same format, same model: fine
    assert fresh.turns == [user_turn] and fresh.ready().length == conv.ready().length


def test_special_token_text_in_a_transcript_is_text(model, processor):
    """An STT may write "<|eot_id|>": it is what the caller said, encoded as plain pieces."""
    from taste_speech.sampler import special_token_ids

    ids = processor.encode_words([" hello", " <|eot_id|>", " there"]).llm_token_ids
    assert not set(ids[0].tolist()) & special_token_ids(processor.llm_tokenizer)
    for text in (" say <|endoftext|> now", " say <|eot_id|> now"):  # Whisper's side too, both ways in
        for inputs in (processor.process_text(text), processor.align_llm_ids(processor.process_text(text).llm_token_ids)):
            asr = set(inputs.asr_token_ids[0].tolist())
            assert not asr & set(processor.asr_tokenizer.all_special_ids), (text, sorted(asr))
    codes = taste_tokenize(model, processor, voiced(), ids, sampling_rate=16000)
    assert codes.shape[:2] == ids.shape


def test_leaving_a_with_block_on_an_error_keeps_the_error_and_closes(model, processor, user_turn):
    """A reply iterator still open when the block is left by an exception: the caller sees its own
    exception (not "a reply is being generated"), and the conversation takes no more use."""
    with pytest.raises(KeyError, match="the caller's own error"):
        with Conversation(model, processor) as conversation:
            items = generate(model, processor, [user_turn], conversation=conversation, max_length=8)
            next(items)
            raise KeyError("the caller's own error")
    assert conversation.closed
    items.close()
    assert not conversation.reply_in_progress


def test_the_conversation_lock_is_reentrant(model, processor):
    """An abandoned reply's finalizer releases its claim on whatever thread collects it, possibly one
    inside _claim: the lock must let that thread in again rather than deadlock."""
    conversation = Conversation(model, processor)
    done = threading.Event()

    def claim_and_release_inside():
        with conversation._lock:
            conversation._release(object())
        done.set()

    threading.Thread(target=claim_and_release_inside, daemon=True).start()
    assert done.wait(5)


def test_a_special_token_s_text_in_a_transcript_stays_text_while_other_calls_start(model, processor):
    """Words are encoded with ``split_special_tokens`` (a caller saying "<|begin_of_text|>" said
    text, not a control token); that flag is the shared tokenizer's own. A conversation starting
    in another thread encoded its prompt labels without it, switching it off under the words:
    the special token's text came out as the control token."""
    from taste_speech.streaming.prompt import PromptFormat

    tokenizer = processor.llm_tokenizer
    special = tokenizer.all_special_tokens[0]
    words = [" hello", " " + special] + [f" word{i}" for i in range(200)]
    reference = processor.encode_words(words).llm_token_ids[0].tolist()
    assert tokenizer.convert_tokens_to_ids(special) not in reference
    stop, differing, encodings = threading.Event(), [], [0]

    def start_calls():
        while not stop.is_set():
            PromptFormat(model.spoken_lm, model.audio_tower.vq.rvq, tokenizer, INSTRUCT)

    starter = threading.Thread(target=start_calls)
    starter.start()
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            if processor.encode_words(words).llm_token_ids[0].tolist() != reference:
                differing.append(1)
            encodings[0] += 1
    finally:
        stop.set()
        starter.join()
    assert encodings[0] > 20 and not differing, (len(differing), encodings[0])
