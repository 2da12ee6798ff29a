"""streaming_generate: decide whether to answer a turn, then stream the answer word by word.

Each step feeds one row to the KV-cached spoken LM and lets the TasteSampler choose the next text
token and (one word behind) the TASTE code of the word just finished. Completed words accumulate
until ``should_emit_segment`` releases them as an assistant audio segment whose TASTE rows align
with its text; concatenating the yielded segments gives exactly the whole reply.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from taste_speech.sampler import Action, SamplingParams, TasteSampler, VocabularyTables
from taste_speech.streaming.conversation import Conversation
from taste_speech.streaming.prompt import CONTINUATION, DIALOGUE
from taste_speech.streaming.segment import TASTESegment


@dataclass
class PendingWord:
    token_ids: list[int]
    codes: torch.Tensor  # (K,)
    text: str = ""


# -- emission policies ------------------------------------------------------------------------
def every_word(pending: list[PendingWord]) -> bool:
    """Default: release every word as soon as its TASTE code is known."""
    return len(pending) >= 1


def every_n_words(n: int) -> Callable[[list[PendingWord]], bool]:
    if n < 1:
        raise ValueError("n must be >= 1")
    return lambda pending: len(pending) >= n


def at_punctuation(max_words: int = 8) -> Callable[[list[PendingWord]], bool]:
    """Release at a word that carries punctuation (or after max_words words)."""
    return lambda pending: bool(pending) and (any(c in pending[-1].text for c in ".,;:!?") or len(pending) >= max_words)


def vocabulary_tables(processor, vocab_size: int) -> VocabularyTables:
    """Sampler tables of the processor's LLM tokenizer, computed once and kept on the processor."""
    tables = getattr(processor, "_taste_vocabulary_tables", None)
    if tables is None or tables.word_start.numel() != vocab_size:
        tokenizer = processor.llm_tokenizer
        end = tokenizer.convert_tokens_to_ids("<|end_of_text|>")
        tables = VocabularyTables.from_tokenizer(tokenizer, vocab_size, end_of_text_id=end)
        processor._taste_vocabulary_tables = tables
    return tables


def _segment(pending: list[PendingWord], k: int) -> TASTESegment:
    ids, rows = [], []
    for word in pending:
        ids.extend(word.token_ids)
        rows.append(word.codes.view(1, k))
        rows.extend([torch.full((1, k), -1, dtype=torch.long)] * (len(word.token_ids) - 1))
    return TASTESegment("assistant", "audio", torch.tensor([ids], dtype=torch.long),
                        torch.cat(rows, 0).unsqueeze(0).long())


def _stopped(stop) -> bool:
    if stop is None:
        return False
    if isinstance(stop, threading.Event):
        return stop.is_set()
    return bool(stop())


@torch.no_grad()
def streaming_generate(model, processor, input_segments, text_top_p=0.3, taste_top_p=0.0, text_temperature=0.5,
                       repetition_penalty=1.1, max_length=512, eos_id=None, should_emit_segment=None, *,
                       conversation: Conversation | None = None, prompt_format: str = CONTINUATION,
                       extra_words: int = 8, stop=None, generator: torch.Generator | None = None,
                       ) -> Iterator[dict]:
    """Yield ``{'is_complete', 'completion_reason', 'segment', ...}`` items for one reply.

    ``input_segments`` are new turns (appended to ``conversation`` when one is given, else they are
    the whole history). ``completion_reason`` is 'no_speech' (the model hands the turn back: keep
    listening) or 'finished' (the reply ended by the sampler's end rules, ``eos_id``, ``max_length``
    - then ``truncated`` is True - or ``stop``, a threading.Event or callable checked every step -
    then ``cancelled`` is True). ``conversation.commit_reply`` keeps the reply afterwards."""
    if max_length < 1:
        raise ValueError("max_length must be >= 1")
    emit = should_emit_segment or every_word
    if conversation is None:
        conversation = Conversation(model, processor, prompt_format=prompt_format)
    for segment in input_segments:
        if not isinstance(segment, TASTESegment):
            raise ValueError(f"input_segments must be TASTESegment objects, got {type(segment).__name__}")
        if segment.role == "system" and conversation.system is None and not conversation.turns:
            conversation.system, conversation.state = segment, None
        else:
            conversation.add_turn(segment)
    lm, rvq = model.spoken_lm, model.rvq
    state = conversation.ensure_ready()
    conversation.crop(conversation.committed_rows)
    builder = conversation.builder
    params = SamplingParams(text_top_p, taste_top_p, text_temperature, repetition_penalty, extra_words)
    sampler = TasteSampler(vocabulary_tables(processor, model.config.text_config.vocab_size), params)
    k = rvq.num_quantizers
    ids = builder.ids

    stop_id = eos_id
    if conversation.prompt_format == DIALOGUE:
        # Turn decision: the model's own choice between handing the turn back and answering.
        text_logits, _, _ = lm.heads_at(state.last_hidden, rvq)
        if float(text_logits[ids.user]) > float(text_logits[ids.assistant]):
            yield {"is_complete": True, "completion_reason": "no_speech", "segment": None}
            return
        stop_id = ids.segment_end if eos_id is None else eos_id
    opening = builder.reply_opening_rows("assistant")
    hidden = lm.feed(state, opening)
    sstate = sampler.new_state(has_prefix=False, stop_id=stop_id)
    state.audio_vec = lm.pad_audio_unit_embed.float()
    tokenizer = processor.llm_tokenizer

    pending: list[PendingWord] = []
    current: list[int] = []
    generated = 0
    reason_flags = {}
    while True:
        text_logits, taste_logits, _ = lm.heads_at(hidden, rvq)
        cancelled = _stopped(stop)
        truncated = generated >= max_length
        if cancelled or truncated:
            # Close the word in progress with the code the head gives for it now (as the terminate step does).
            if current:
                pending.append(PendingWord(current, sampler.sample_taste(taste_logits, generator), tokenizer.decode(current)))
            reason_flags = {"cancelled": True} if cancelled else {"truncated": True}
            break
        d = sampler.update(sstate, text_logits, taste_logits, state.input_ids, generator)
        state.input_ids.append(d.text_id)
        if d.action in (Action.TERMINATE, Action.CONTINUE_AT_WORD_START) and current:
            codes = d.taste_ids if bool((d.taste_ids >= 0).all()) else sampler.sample_taste(taste_logits, generator)
            pending.append(PendingWord(current, codes, tokenizer.decode(current)))
            current = []
        lm._advance_audio(state, d, [], rvq)
        if d.action == Action.TERMINATE:
            break
        current.append(d.text_id)
        generated += 1
        if pending and emit(pending):
            yield {"is_complete": False, "completion_reason": None, "segment": _segment(pending, k)}
            pending = []
        row = lm.fuse(lm.token_embeds([d.text_id]).float(), state.audio_vec).unsqueeze(0)
        hidden = lm.feed(state, row)
    segment = _segment(pending, k) if pending else None
    yield {"is_complete": True, "completion_reason": "finished", "segment": segment,
           "opening_rows": opening.shape[1], **reason_flags}
