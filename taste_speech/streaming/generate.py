"""streaming_generate: decide whether to answer, then stream the answer word by word.

Each step feeds one row to the KV-cached spoken LM (the history was prefilled once, by the
Conversation) and lets the TasteSampler pick the next text token and - one word behind - the
TASTE code of the word just finished. A word is complete when its code is known: at the first
token of the next word, or at the end. Complete words accumulate until ``should_emit_segment``
releases them as an assistant audio segment whose TASTE rows align with its text; the segments of
one reply concatenate to exactly the whole reply.
"""

from __future__ import annotations

import numbers
import operator
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from taste_speech.sampler import Action, SamplingParams, TasteSampler, VocabularyTables, check_generator, draw
from taste_speech.streaming.conversation import Conversation
from taste_speech.streaming.prompt import CONTINUATION
from taste_speech.streaming.segment import TASTESegment
from taste_speech.streaming.tokenize import check_llm_ids

PUNCTUATION = ".,;:!?"


@dataclass
class PendingWord:
    """A finished word waiting to be emitted."""

    token_ids: list[int]
    code: torch.Tensor  # (K,) long
    text: str = ""


# -- emission policies (should_emit_segment) ----------------------------------------------------------
def every_word(pending: list[PendingWord]) -> bool:
    """Default: release each word as soon as its TASTE code is known."""
    return len(pending) >= 1


def every_n_words(n: int) -> Callable[[list[PendingWord]], bool]:
    """Release words in groups of ``n``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"every_n_words needs an integer n >= 1, got {n!r}")
    return lambda pending: len(pending) >= n


def at_punctuation(max_words: int = 8) -> Callable[[list[PendingWord]], bool]:
    """Release at a word that carries punctuation, or after ``max_words`` words."""
    if isinstance(max_words, bool) or not isinstance(max_words, int) or max_words < 1:
        raise ValueError(f"at_punctuation needs an integer max_words >= 1, got {max_words!r}")
    return lambda pending: bool(pending) and (any(c in pending[-1].text for c in PUNCTUATION)
                                              or len(pending) >= max_words)


def vocabulary_tables(processor, vocab_size: int) -> VocabularyTables:
    """The sampler tables of ``processor.llm_tokenizer`` for an LM of ``vocab_size`` ids, built
    once (decoding every id takes seconds for Llama-3) and kept on the processor."""
    tables = getattr(processor, "_taste_sampler_tables", None)
    if tables is None or tables.vocab_size != vocab_size:
        tables = VocabularyTables.from_tokenizer(processor.llm_tokenizer, vocab_size)
        try:
            processor._taste_sampler_tables = tables
        except AttributeError:  # an object that takes no attributes: rebuild next time
            pass
    return tables


def _segment(words: list[PendingWord], k: int) -> TASTESegment:
    ids, rows = [], []
    for word in words:
        ids.extend(word.token_ids)
        rows.append(word.code.view(1, k).cpu())
        rows.extend([torch.full((1, k), -1, dtype=torch.long)] * (len(word.token_ids) - 1))
    return TASTESegment("assistant", "audio", torch.tensor([ids], dtype=torch.long), torch.cat(rows).long().unsqueeze(0))


def _check_stop(stop) -> None:
    if stop is not None and not isinstance(stop, threading.Event) and not callable(stop):
        raise ValueError(f"stop must be a threading.Event or a callable returning bool, got {type(stop).__name__}")


def _stop_requested(stop) -> bool:
    if stop is None:
        return False
    if isinstance(stop, threading.Event):
        return stop.is_set()
    return bool(stop())


def _item(complete: bool, reason: str | None, segment: TASTESegment | None, **extra) -> dict:
    return {"is_complete": complete, "completion_reason": reason, "segment": segment, **extra}


def streaming_generate(model, processor, input_segments, text_top_p: float = 0.3, taste_top_p: float = 0.0,
                       text_temperature: float = 0.5, repetition_penalty: float = 1.1, max_length: int = 512,
                       eos_id: int | None = None, should_emit_segment=None, *,
                       conversation: Conversation | None = None, prompt_format: str | None = None,
                       extra_words: int = 8, stop=None, generator: torch.Generator | None = None,
                       sampler_tables: VocabularyTables | None = None) -> "ReplyIterator":
    """An iterator of ``{'is_complete', 'completion_reason', 'segment'}`` items for one reply.

    ``input_segments``: new turns (TASTESegments; None for none, to reply to the history as it
    is) - appended to ``conversation`` when one is given
    (its KV cache already holds the earlier turns), else the whole history of a fresh
    Conversation in ``prompt_format`` ('continuation', 'instruct' or 'dialogue', see prompt.py;
    'continuation' when not given; with a conversation it must be the conversation's format).
    The arguments are checked and the conversation is taken at the call: from then until the
    iterator ends or is closed, any other use of the conversation raises. The turns are added
    and the model runs only once the first item is asked for.

    Items: ``is_complete=False`` items carry a segment of finished words; the last item has
    ``is_complete=True`` and ``completion_reason``:

    * ``'no_speech'`` (dialogue format only): the model chose the user role - nothing to say,
      keep listening; ``segment`` is None, no reply is added, and ``input_segments`` stay in the
      conversation (the next call continues after them);
    * ``'finished'``: the reply ended, by the sampler's end rules (``end_reason`` 'sentence_end'
      or 'max_words'), a stop token (segment_end in the dialogue format, ``eos_id``, or any other
      special token the model picks - a special token is no word: 'stop_id'; ``eos_id`` is never
      banned, even when it is ``<|end_of_text|>``), ``max_length``
      generated tokens ('max_length', ``truncated=True``) or ``stop``
      ('cancelled', ``cancelled=True``); ``segment`` holds the words not yet emitted (or None)
      and ``reply`` the whole reply. The reply is committed to the conversation; after a
      barge-in call ``conversation.truncate_last_assistant(played_words)`` - only when ``reply``
      is not None (a reply cancelled before its first word adds nothing, and the last assistant
      turn is then an earlier reply, which the caller heard whole).

    Sampling is the original TasteSampler's (``text_top_p == 0`` is greedy); ``generator`` makes
    sampling reproducible. ``stop`` (a threading.Event or a callable) is checked before every
    step, so a cancelled reply ends within one step. Abandoning the iterator early (``close()``,
    or dropping it) discards the reply (the next call starts from the committed history;
    ``input_segments`` stay if the first item was asked for, else they were never added). An
    error during the reply leaves the conversation as it was before the call (``input_segments``
    out again, a system segment among them too, and turns the rolling window dropped meanwhile
    back in) before it propagates, so the same turns can be given again.
    """
    if isinstance(max_length, bool) or not isinstance(max_length, numbers.Integral) or max_length < 1:
        raise ValueError(f"max_length must be an integer >= 1 (generated tokens), got {max_length!r}")
    max_length = int(max_length)
    if should_emit_segment is not None and not callable(should_emit_segment):
        raise ValueError("should_emit_segment must be a callable taking the list of pending words")
    if should_emit_segment in (every_n_words, at_punctuation):  # the factory, not the policy it makes
        raise ValueError(f"should_emit_segment={should_emit_segment.__name__} makes a policy: call it, e.g. "
                         f"should_emit_segment={should_emit_segment.__name__}(3)")
    check_generator(generator)
    if input_segments is None:
        input_segments = []  # nothing new: the reply follows the conversation's history
    if isinstance(input_segments, TASTESegment):
        input_segments = [input_segments]
    segments = list(input_segments)
    for i, segment in enumerate(segments):
        _check_segment(model, processor, segment, f"input_segments[{i}]")
    params = SamplingParams(text_top_p, taste_top_p, text_temperature, repetition_penalty, extra_words)
    _check_stop(stop)  # before any work (without asking it: a callable may answer only once)
    emit = should_emit_segment or every_word
    if conversation is None:
        conversation = Conversation(model, processor, prompt_format=prompt_format or CONTINUATION)
    else:
        if not isinstance(conversation, Conversation):
            raise ValueError(f"conversation must be a Conversation, got {type(conversation).__name__}")
        if conversation.model is not model:
            raise ValueError("the conversation was made for another model: its cache holds that model's rows; "
                             "make one with Conversation(model, processor) for this model")
        if prompt_format is not None and prompt_format != conversation.prompt_format:
            raise ValueError(f"prompt_format {prompt_format!r} differs from the conversation's "
                             f"{conversation.prompt_format!r}: the format is fixed per conversation")
    if conversation.closed:
        raise RuntimeError("this conversation was closed: start a new Conversation")
    if sampler_tables is not None and not isinstance(sampler_tables, VocabularyTables):
        raise ValueError(f"sampler_tables must be VocabularyTables (vocabulary_tables(processor, vocab_size)), "
                         f"got {type(sampler_tables).__name__}")
    if not segments and not conversation.state.turns and conversation.state.system is None:
        raise ValueError("input_segments is empty and the conversation has no history: give at least one turn")

    lm = model.spoken_lm
    tables = sampler_tables or vocabulary_tables(processor, lm.vocab_size)
    if eos_id is not None:
        eos_id = _check_eos_id(eos_id, tables.vocab_size)
        tables = tables.allowing([eos_id])  # the tables ban <|end_of_text|>: a named stop id must stay possible
    sampler = TasteSampler(tables, params)
    # The conversation is this reply's from now until the reply is committed (or the iterator closed).
    token = conversation._claim("reply")
    items = _generate(model, processor, conversation, token, segments, sampler, params, eos_id, emit, stop,
                      generator, max_length)
    return ReplyIterator(conversation, token, items)


class ReplyIterator:
    """What ``streaming_generate`` returns: the reply's items. It holds the conversation from the
    call on; ``close()`` - or dropping the iterator - frees it, even before the first item (a
    generator that never started runs no ``finally``, so the claim is released here)."""

    def __init__(self, conversation: Conversation, token: object, items: Iterator[dict]):
        self._items = items
        self._release = weakref.finalize(self, conversation._release, token)
        self._release.atexit = False

    def __iter__(self) -> "ReplyIterator":
        return self

    def __next__(self) -> dict:
        return next(self._items)

    def close(self) -> None:
        self._items.close()  # raises while it runs in another thread: the claim then stays
        self._release()


def _check_segment(model, processor, segment, name: str) -> None:
    """A turn's ids and codes, at the call (they would fail at the first item, deep in the model,
    naming no segment)."""
    if not isinstance(segment, TASTESegment):
        raise ValueError(f"input_segments must be TASTESegment objects, got {type(segment).__name__} at {name}")
    name = f"{name} ({segment.role}, {segment.modality})"
    check_llm_ids(processor, segment.text_ids, f"{name}: text_ids")
    rvq = model.audio_tower.vq.rvq
    codes = segment.taste_ids
    if codes is None:  # (a text turn)
        return
    if codes.shape[-1] != rvq.num_quantizers:
        raise ValueError(f"{name}: the taste_ids have {codes.shape[-1]} codes per word but the model's RVQ has "
                         f"{rvq.num_quantizers} levels: taste_tokenize makes them for this model")
    if codes.numel() and (int(codes.min()) < -1 or int(codes.max()) >= rvq.codebook_size):
        raise ValueError(f"{name}: taste_ids must lie in [0, {rvq.codebook_size}) or be -1 (no code), got values in "
                         f"[{int(codes.min())}, {int(codes.max())}]: taste_tokenize makes them for this model")


def _check_eos_id(eos_id, vocab_size: int) -> int:
    try:
        value = operator.index(eos_id)
    except TypeError:
        value = None
    if isinstance(eos_id, bool) or value is None or not 0 <= value < vocab_size:
        raise ValueError(f"eos_id must be a token id in [0, {vocab_size}) (e.g. tokenizer.eos_token_id), got {eos_id!r}")
    return value


@torch.no_grad()
def _generate(model, processor, conversation: Conversation, token: object, segments: list[TASTESegment],
              sampler: TasteSampler, params: SamplingParams, eos_id, emit, stop, generator,
              max_length: int) -> Iterator[dict]:
    """The reply, run lazily: adds the input turns, then yields the items of ``_reply``."""
    mark, committed = conversation._history_mark(), False
    try:
        for segment in segments:
            conversation._add_turn(segment)
        for item in _reply(model, processor, conversation, sampler, params, eos_id, emit, stop, generator, max_length):
            if item["is_complete"]:  # committed (or nothing to say): the conversation is free again
                committed = True
                conversation._release(token)
            yield item
        # asked for more after the last item, which the consumer has handled: between turns, a
        # window move this reply made due costs no one a wait
        conversation._move_window_if_free()
    except GeneratorExit:  # closed early: the turns stay, the uncommitted reply rows are cropped on next use
        raise
    except BaseException:
        if not committed:  # all or nothing: a retry must not find the turns twice
            _take_back(conversation, mark)
        raise
    finally:
        conversation._release(token)


def _take_back(conversation: Conversation, mark: tuple) -> None:
    """Forget the turns this call added: the history is that of ``mark`` again."""
    try:
        conversation._back_to(mark)
    except Exception:  # the cache itself failed: drop it, the next use prefills what is left
        conversation._drop_cache()
        conversation._back_to(mark)


def _reply(model, processor, conversation: Conversation, sampler: TasteSampler, params: SamplingParams, eos_id,
           emit, stop, generator, max_length: int) -> Iterator[dict]:
    """The turn decision and the reply, after the input turns were added; commits the reply
    before its last item."""
    lm, rvq = model.spoken_lm, model.audio_tower.vq.rvq
    decode = conversation._ready()
    fmt = conversation.format

    if fmt.decides_turns:
        # The model's own next token decides: user role = hand the turn back, assistant = answer.
        text_logits = lm.heads(decode.last_hidden, rvq, step=lm.heads_step(decode, rvq)).text_logits
        choice = fmt.turn_logits(text_logits)
        if params.text_top_p > 0:
            probs = (choice / params.text_temperature).softmax(-1)
            assistant = draw(probs, generator) == 1
        else:
            assistant = bool(choice[1] >= choice[0])
        if not assistant:
            yield _item(True, "no_speech", None, end_reason="user_turn", reply=None, truncated=False,
                        cancelled=False, steps=0)
            return

    opening = conversation._begin_reply(eos_id)
    # A special token is not a word (the speech side refuses it): sampling one - a reserved token,
    # a role header - means the model left the reply's text, so it ends the reply like a stop id.
    stop_ids = frozenset(opening.stop_ids) | sampler.tables.special
    sstate = sampler.reset(has_prefix=opening.pending_audio is not None, stop_id=stop_ids or None)
    decode.audio_vec = lm.pad_audio()
    decode.pending_audio = opening.pending_audio
    tokenizer = processor.llm_tokenizer
    k = rvq.num_quantizers

    words: list[PendingWord] = []  # finished, not yet emitted
    reply_words: list[PendingWord] = []  # every finished word of the reply
    current: list[int] = []  # tokens of the word in progress
    generated = 0
    end_reason, flags = None, {}
    while True:
        heads = lm.heads(decode.last_hidden, rvq, step=lm.heads_step(decode, rvq))
        stopped = _stop_requested(stop)
        if stopped or generated >= max_length:
            # End now: the head at this position gives the code of the word in progress, exactly
            # as the terminating step of the sampler reads it.
            end_reason = "cancelled" if stopped else "max_length"
            flags = {"cancelled": True} if end_reason == "cancelled" else {"truncated": True}
            if current:
                word = PendingWord(current, sampler.sample_taste(heads.taste_logits, generator), tokenizer.decode(current))
                words.append(word)
                reply_words.append(word)
            break
        decision = sampler.update(sstate, heads.text_logits, heads.taste_logits, decode.input_ids, generator)
        if current and (decision.action == Action.TERMINATE or decision.action == Action.CONTINUE_AT_WORD_START):
            code = sampler.word_code(decision, heads.taste_logits, generator)
            word = PendingWord(current, code, tokenizer.decode(current))
            words.append(word)
            reply_words.append(word)
            current = []
        lm.advance_audio(decode, decision, rvq)
        if decision.action == Action.TERMINATE:
            end_reason = sstate.end_reason
            break
        decode.input_ids.append(decision.text_id)
        current.append(decision.text_id)
        generated += 1
        if words and emit(list(words)):
            yield _item(False, None, _segment(words, k), steps=generated)
            words = []
        conversation._feed(decode, lm.next_row(decode, decision.text_id))

    reply = _segment(reply_words, k) if reply_words else None
    conversation._commit_reply(reply)
    yield _item(True, "finished", _segment(words, k) if words else None, end_reason=end_reason, reply=reply,
                truncated=flags.get("truncated", False), cancelled=flags.get("cancelled", False), steps=generated)
