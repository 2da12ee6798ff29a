"""TasteSampler: how the spoken LM picks its next text token and TASTE code (spec §5.3).

The sampler owns static vocabulary tables (word starts, sentence ends, banned ids) and a small
per-sequence state. It implements TASTE's word-level one-word delay: the TASTE code of word k is
read at the first token of word k+1, and a reply ends only through its heuristics (at least
``extra_words`` words and then a token containing '.', or 3x ``extra_words`` words, or a stop id),
because the LM never learned an end-of-utterance token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import torch

BAN_VALUE = -100000.0
LLAMA3_SPECIAL_START = 128000
LLAMA3_END_OF_TEXT = 128001
_ALLOWED_CHARS = set(".,'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")


class Action(IntEnum):
    CONTINUE_AT_WORD_START = 0
    CONTINUE_NOT_AT_WORD_START = 1
    WAIT_FOR_TASTE = 2
    TERMINATE = 3


class TasteAction(IntEnum):
    SAMPLE = 0
    USE_PREFIX = 1  # feed the prompt's withheld last-word code
    USE_PREFIX_IGNORE = 2  # keep the current code (inner tokens of the first word)
    WAIT = 3  # feed the pad audio vector


@dataclass
class VocabularyTables:
    word_start: torch.Tensor  # (V,) bool
    sentence_end: torch.Tensor  # (V,) bool
    banned: torch.Tensor  # (V,) bool

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int | None = None, end_of_text_id: int | None = None):
        """Decode every id once. ``tokenizer`` needs ``decode([id])``; special tokens of a
        transformers tokenizer also count as word starts (like Llama-3's ids >= 128000)."""
        size = vocab_size if vocab_size is not None else len(tokenizer)
        specials = set(getattr(tokenizer, "all_special_ids", []) or [])
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        specials |= {i for i, tok in added.items() if getattr(tok, "special", False)}
        word_start = torch.zeros(size, dtype=torch.bool)
        sentence_end = torch.zeros(size, dtype=torch.bool)
        banned = torch.zeros(size, dtype=torch.bool)
        for i in range(size):
            piece = tokenizer.decode([i])
            word_start[i] = piece.startswith(" ") or i >= LLAMA3_SPECIAL_START or i in specials
            sentence_end[i] = "." in piece
            banned[i] = piece != "." and (not (set(piece) & _ALLOWED_CHARS) or "\n" in piece)
        if end_of_text_id is None:
            end_of_text_id = LLAMA3_END_OF_TEXT
        if 0 <= end_of_text_id < size:
            banned[end_of_text_id] = True
        return cls(word_start, sentence_end, banned)


@dataclass
class SamplingParams:
    text_top_p: float = 0.3
    taste_top_p: float = 0.0
    text_temperature: float = 0.5
    repetition_penalty: float = 1.1
    extra_words: int = 8
    delay: int = 1

    def __post_init__(self):
        if not 0.0 <= self.text_top_p <= 1.0 or not 0.0 <= self.taste_top_p <= 1.0:
            raise ValueError("text_top_p and taste_top_p must be in [0, 1] (0 = greedy)")
        if self.text_temperature <= 0:
            raise ValueError("text_temperature must be > 0")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0 (1.0 = off)")
        if self.extra_words < 1:
            raise ValueError("extra_words must be >= 1")
        if self.delay != 1:
            raise ValueError("only the word-level delay of 1 (the published model) is supported")


@dataclass
class SamplerState:
    """Per-sequence state; create with ``TasteSampler.new_state`` for every generation."""

    extra_words: int
    has_prefix: bool
    stop_id: int | None
    word_start_history: list[bool] = field(default_factory=list)
    end_countdown: int | None = None
    end_text: bool = False
    word_counter: int = 0

    @property
    def max_words(self) -> int:
        return 3 * self.extra_words


@dataclass
class Decision:
    text_id: int
    taste_ids: torch.Tensor  # (K,) long; -1 when no code was sampled at this step
    action: Action
    taste_action: TasteAction
    text_logits: torch.Tensor  # the banned (and filtered) logits the choice was made from


class TasteSampler:
    def __init__(self, tables: VocabularyTables, params: SamplingParams):
        self.tables = tables
        self.params = params

    def new_state(self, has_prefix: bool, stop_id: int | None = None, extra_words: int | None = None) -> SamplerState:
        return SamplerState(
            extra_words=self.params.extra_words if extra_words is None else extra_words,
            has_prefix=has_prefix,
            stop_id=stop_id,
        )

    # -- text ------------------------------------------------------------------------------
    def sample_text(self, logits: torch.Tensor, input_ids: list[int], generator=None) -> tuple[int, torch.Tensor]:
        """Pick a text id from the last position's logits (V,). Order as the original:
        ban -> top-p (remove cumulative prob > p, keep the best) -> repetition penalty ->
        temperature -> one multinomial draw. p == 0 is plain argmax (no penalty/temperature)."""
        p = self.params
        logits = logits.float().clone()
        logits[self.tables.banned.to(logits.device)] = BAN_VALUE
        if p.text_top_p == 0:
            return int(logits.argmax()), logits
        sorted_logits, order = logits.sort(descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove = cumulative > p.text_top_p
        remove[0] = False
        logits[order[remove]] = BAN_VALUE
        if p.repetition_penalty != 1.0 and input_ids:
            ids = torch.tensor(sorted(set(input_ids)), device=logits.device)
            ids = ids[ids < logits.numel()]
            chosen = logits[ids]
            logits[ids] = torch.where(chosen < 0, chosen * p.repetition_penalty, chosen / p.repetition_penalty)
        logits = logits / p.text_temperature
        probs = logits.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=generator)), logits

    # -- TASTE -----------------------------------------------------------------------------
    def sample_taste(self, taste_logits: torch.Tensor, generator=None) -> torch.Tensor:
        """(K, C) logits of the last position -> (K,) codes. With the published head the logits
        are one-hot x 1000, so this is deterministic in practice."""
        if self.params.taste_top_p == 0:
            return taste_logits.argmax(-1)
        codes = []
        for level in taste_logits.float():
            sorted_logits, order = level.sort(descending=True)
            remove = sorted_logits.softmax(-1).cumsum(-1) > self.params.taste_top_p
            remove[0] = False
            level = level.clone()
            level[order[remove]] = BAN_VALUE
            codes.append(torch.multinomial(level.softmax(-1), 1, generator=generator)[0])
        return torch.stack(codes)

    # -- one step --------------------------------------------------------------------------
    def update(self, state: SamplerState, text_logits, taste_logits, input_ids: list[int], generator=None) -> Decision:
        delay = self.params.delay
        text_id, used_logits = self.sample_text(text_logits, input_ids, generator)
        waiting = state.end_text
        if state.word_counter == 0:
            is_word_start = True  # the first generated token always starts a word
        elif waiting:
            state.end_countdown = (delay if state.end_countdown is None else state.end_countdown) - 1
            is_word_start = True
        else:
            is_word_start = bool(self.tables.word_start[text_id])
        state.word_start_history.append(is_word_start)

        if (state.word_counter >= state.extra_words and bool(self.tables.sentence_end[text_id])) or (
            state.word_counter >= state.max_words
        ):
            state.end_text = True
        if state.stop_id is not None and text_id == state.stop_id:
            state.end_text = True
            state.end_countdown = delay - 1
            waiting = True
        if is_word_start:
            state.word_counter += 1

        if state.end_countdown == 0:
            action = Action.TERMINATE
        elif waiting:
            action = Action.WAIT_FOR_TASTE
        elif is_word_start:
            action = Action.CONTINUE_AT_WORD_START
        else:
            action = Action.CONTINUE_NOT_AT_WORD_START

        started = sum(state.word_start_history) > delay
        k = taste_logits.shape[-2]
        if started and is_word_start:
            taste_ids = self.sample_taste(taste_logits, generator)
        else:
            taste_ids = torch.full((k,), -1, dtype=torch.long, device=taste_logits.device)
        if started:
            taste_action = TasteAction.SAMPLE
        elif state.has_prefix and is_word_start:
            taste_action = TasteAction.USE_PREFIX
        elif state.has_prefix:
            taste_action = TasteAction.USE_PREFIX_IGNORE
        else:
            taste_action = TasteAction.WAIT
        return Decision(text_id, taste_ids, action, taste_action, used_logits)
