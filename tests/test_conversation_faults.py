"""A spoken LM that fails in the middle of a forward pass (out of GPU memory, an interrupt) leaves
some layers fed and others not. The conversation must drop that cache, not go on from it: the
same call retried gives what a conversation that never failed gives, and a batched conversation's
failure never touches another call's slot."""

import pytest
import torch

from taste_speech.lm_batch import LMStepBatch
from taste_speech.streaming import Conversation, TASTESegment, streaming_generate, taste_tokenize
from audio_helpers import voiced

TEXTS = ["hello there how are you doing today", "tell me about the garden", "what time does the store open",
         "i would like a pizza please", "can you say that again", "thank you very much"]


@pytest.fixture(scope="module")
def turns(model, processor):
    out = []
    for seed, text in enumerate(TEXTS):
        ids = processor.process_text(text).llm_token_ids
        out.append(TASTESegment("user", "audio", ids, taste_tokenize(model, processor, voiced(1.5, seed=seed)[None], ids, 16000)))
    return out


def new_conversation(model, processor, kind, batch=None, **kwargs):
    if kind == "batched":
        batch = batch or LMStepBatch(model.spoken_lm, slots=2, capacity=512, graph_mode="eager")
        return Conversation(model, processor, lm_batch=batch, **kwargs)
    return Conversation(model, processor, cache_kind=kind, **kwargs)


def reply_ids(model, processor, conversation, segments) -> list[int]:
    items = list(streaming_generate(model, processor, segments, conversation=conversation, text_top_p=0.0,
                                    extra_words=3, generator=torch.Generator().manual_seed(0)))
    return items[-1]["reply"].text_ids[0].tolist()


class FailOnce:
    """Raises inside the second decoder layer (the first one has stored its keys by then) at the
    ``after``-th forward of ``rows`` rows that matches: ``'one'`` (a decode step) or ``'many'``."""

    def __init__(self, model, rows: str, after: int = 0):
        self.rows, self.left, self.fired = rows, after, False
        self.handle = model.spoken_lm.backbone.layers[1].register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if self.fired or (hidden.shape[1] == 1) != (self.rows == "one"):
            return
        if self.left:
            self.left -= 1
            return
        self.fired = True
        raise MemoryError("CUDA out of memory (injected)")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


@pytest.mark.parametrize("kind", ["dynamic", "static", "batched"])
@pytest.mark.parametrize("where", ["turn prefill", "reply step", "reply step, turn added before"])
def test_a_reply_retried_after_the_lm_failed_midway_is_the_reply_of_a_conversation_that_never_failed(
        model, processor, turns, kind, where):
    given = [turns[1]]
    reference = new_conversation(model, processor, "dynamic")
    conversation = new_conversation(model, processor, kind)
    for each in (reference, conversation):
        reply_ids(model, processor, each, [turns[0]])
        if where == "reply step, turn added before":  # (the call then gives no turn: nothing to take back)
            each.add_turn(turns[1])
    if where == "reply step, turn added before":
        given = None
    expected = reply_ids(model, processor, reference, given)
    before = len(conversation.turns)
    with FailOnce(model, "many" if where == "turn prefill" else "one", after=0 if where == "turn prefill" else 3) as fault:
        with pytest.raises(MemoryError):
            reply_ids(model, processor, conversation, given)
    assert fault.fired and len(conversation.turns) == before  # the history as before the call
    assert reply_ids(model, processor, conversation, given) == expected


def test_a_failed_window_prefill_leaves_other_calls_slots_alone(model, processor, turns):
    """The window rolls: the kept history is prefilled into a new slot, and the LM fails there.
    The call's next turn must not crop whichever call holds its old slot by then."""
    batch = LMStepBatch(model.spoken_lm, slots=2, capacity=512, graph_mode="eager")
    a = new_conversation(model, processor, "batched", batch, max_turns=4)
    for turn in turns[:4]:
        a.add_turn(turn)
    with FailOnce(model, "many") as fault:
        with pytest.raises(MemoryError):
            a.add_turn(turns[4])  # past max_turns: the window drops the oldest turns and prefills the rest
    assert fault.fired and batch.slots_in_use == 0  # neither the old slot nor the new one is held

    b = new_conversation(model, processor, "batched", batch)
    for turn in turns:
        b.add_turn(turn)
    a.add_turn(turns[5])
    alone_b, alone_a = new_conversation(model, processor, "dynamic"), new_conversation(model, processor, "dynamic")
    for turn in turns:
        alone_b.add_turn(turn)
    for turn in a.turns:
        alone_a.add_turn(turn)
    assert reply_ids(model, processor, b, None) == reply_ids(model, processor, alone_b, None)
    assert reply_ids(model, processor, a, None) == reply_ids(model, processor, alone_a, None)


@pytest.mark.parametrize("kind", ["dynamic", "static", "batched"])
@pytest.mark.parametrize("where", ["making the rows", "feeding them"])
def test_a_window_prefill_that_fails_leaves_a_conversation_that_replies_to_its_history(
        model, processor, turns, kind, where):
    """The window rolls on a turn added from outside (as the plugin adds a turn after a failed
    reply) and the prefill of the kept history fails - while its rows are made, or in the LM. The
    conversation's next reply is the reply to the history it says it holds (the cache then held
    the dropped turns, or none at all and every later reply failed)."""
    conversation = new_conversation(model, processor, kind, max_turns=3)
    for turn in turns[:3]:
        conversation.add_turn(turn)
    made, real = [0], conversation.format.segment_rows

    def fails_on_the_second_turn(segment, carry):
        made[0] += 1
        if made[0] == 3:  # (the added turn's rows, then the kept history's first turn, then this)
            raise MemoryError("CUDA out of memory (injected)")
        return real(segment, carry)

    if where == "making the rows":
        conversation.format.segment_rows = fails_on_the_second_turn
        fault = None
    else:
        fault = FailOnce(model, "many", after=1)  # (the added turn's prefill, then the window's)
    try:
        with pytest.raises(MemoryError):
            conversation.add_turn(turns[3])  # past max_turns: the window drops the oldest turns
    finally:
        conversation.format.segment_rows = real
        if fault is not None:
            fault.__exit__()
    assert fault is None or fault.fired
    alone = new_conversation(model, processor, "dynamic", max_turns=3)
    for turn in conversation.turns:
        alone.add_turn(turn)
    for segments in (None, [turns[4]]):  # and the call goes on
        assert reply_ids(model, processor, conversation, segments) == reply_ids(model, processor, alone, segments)


def test_a_closed_slot_cache_cannot_be_cropped(model):
    batch = LMStepBatch(model.spoken_lm, slots=1, capacity=64, graph_mode="eager")
    cache = batch.open()
    cache.close()
    with pytest.raises(RuntimeError, match="was closed"):
        cache.crop(0)  # its slot may be another call's by now


@pytest.mark.parametrize("kind", ["dynamic", "static", "batched"])
@pytest.mark.parametrize("played_words", [0, 2])
def test_a_barge_in_cut_that_fails_keeps_the_words_heard(model, processor, turns, kind, played_words):
    """The reply is cut to the words the caller heard and the LM fails while the cache is cut (the
    last kept row is fed again): the history keeps exactly those words (the assistant turn was
    gone), and the next reply is that of a conversation whose cut did not fail."""
    reference, conversation = new_conversation(model, processor, "dynamic"), new_conversation(model, processor, kind)
    for each in (reference, conversation):
        reply_ids(model, processor, each, [turns[0]])
    assert int(conversation.turns[-1].word_starts().sum()) > 2
    reference.truncate_last_assistant(played_words)
    with FailOnce(model, "one") as fault:
        with pytest.raises(MemoryError):
            conversation.truncate_last_assistant(played_words)
    assert fault.fired
    assert [(t.role, t.text_ids.tolist()) for t in conversation.turns] == \
        [(t.role, t.text_ids.tolist()) for t in reference.turns]
    assert reply_ids(model, processor, conversation, [turns[1]]) == reply_ids(model, processor, reference, [turns[1]])
