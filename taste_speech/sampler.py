"""TasteSampler: how the spoken LM picks its next text token and TASTE code (spec §5.3).

The sampler has static vocabulary tables (word starts, sentence ends, banned ids), built once per
tokenizer, and a small per-sequence ``SamplerState``. It implements TASTE's word-level one-word
delay: the TASTE code of word k is read at the first token of word k+1. A reply ends only through
the sampler's heuristics (at least ``extra_words`` words and then a token containing '.', or
3 x ``extra_words`` words, or a stop id), because the LM never learned an end-of-utterance token.

Differences from Hugging Face sampling are deliberate (they are what the checkpoint was used with):
top-p also removes the token that crosses p, the order is top-p -> repetition penalty ->
temperature, and greedy decoding (``text_top_p == 0``) ignores penalty and temperature.
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass, field, replace
from enum import IntEnum

import torch

from taste_speech.device_copies import read_back, to_device


def check_generator(generator) -> None:
    """A wrong ``generator`` would only fail deep in a sampling call."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator (e.g. torch.Generator().manual_seed(0)) or None, "
                         f"got {type(generator).__name__}")


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One index drawn from the 1-D ``probs`` with ``generator``, on the generator's device: the
    callers' generators are CPU ones (the same draws whatever the device), the probabilities may
    be on CUDA, and ``multinomial`` wants both in one place. A draw on a GPU reads it once
    (``pick_on_device``)."""
    if generator is not None and probs.device != generator.device:
        probs = probs.to(generator.device)
    if probs.device.type == "cpu":
        return int(torch.multinomial(probs, 1, generator=generator))
    return checked_pick(read_back(pick_on_device(probs, generator)))


def pick_on_device(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``torch.multinomial(probs, 1)``'s own algorithm (argmax of p / q, q ~ Exp(1): the same pick
    for the same generator state) without its input checks, which read the GPU twice before the
    draw; the check comes along instead. Returns [pick, 1 if ``probs`` is a distribution else 0],
    on the device, unread: read it with what else the step reads and give it to ``checked_pick``."""
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    pick = (probs / q).argmax().view(1)
    valid = (probs.isfinite().all() & (probs.min() >= 0) & (probs.sum() > 0)).view(1)
    return torch.cat([pick, valid.long()])


def checked_pick(values: list[int]) -> int:
    """The pick of ``pick_on_device``'s two values, read back (as multinomial would, refuses a
    broken distribution: NaN logits from a broken model must not become a token)."""
    if not values[1]:
        raise RuntimeError("probability tensor contains either inf, nan or element < 0, or sums to 0")
    return values[0]


BAN_VALUE = -100000.0  # the original's "minus infinity" (representable in bf16 logits)
LLAMA3_SPECIAL_START = 128000  # every Llama-3 special token counts as a word start
LLAMA3_END_OF_TEXT = 128001  # <|end_of_text|>: banned (streaming_generate lifts the ban for an eos_id it is given)
END_OF_TEXT_TOKEN = "<|end_of_text|>"
_ALLOWED_CHARS = frozenset(".,'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")


class Action(IntEnum):
    """What the generation loop does with the sampled text token (values as in the goldens)."""

    CONTINUE_AT_WORD_START = 0
    CONTINUE_NOT_AT_WORD_START = 1
    WAIT_FOR_TASTE = 2  # the token is dropped (never happens with delay 1 except when terminating)
    TERMINATE = 3  # the token is dropped and the loop ends


class TasteAction(IntEnum):
    """Which audio vector is fused with the sampled token in the next input row."""

    SAMPLE = 0  # the TASTE code sampled at this step (fill forward when none was sampled)
    USE_PREFIX = 1  # the prompt's withheld last-word code ('audio' mode, first generated word)
    USE_PREFIX_IGNORE = 2  # keep the current code (inner tokens of the first generated word)
    WAIT = 3  # the pad audio vector (first generated word without an audio prompt)


# -- static tables ---------------------------------------------------------------------------------
def _decode_each(tokenizer, size: int) -> list[str]:
    """decode(i) of every id, batched when the tokenizer can (seconds for Llama-3's 128 256 ids)."""
    batch_decode = getattr(tokenizer, "batch_decode", None)
    if callable(batch_decode):
        return list(batch_decode([[i] for i in range(size)]))
    return [tokenizer.decode(i) for i in range(size)]


def special_token_ids(tokenizer) -> set[int]:
    """Ids of a tokenizer's special tokens (transformers' ``all_special_ids`` plus added tokens
    marked special); empty for a plain tokenizer-like object."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids |= {int(i) for i, tok in added.items() if getattr(tok, "special", False)}
    return ids


def end_of_text_ids(tokenizer=None, eos_token_id=None) -> list[int]:
    """The ids the sampler bans as "end of text" (Llama-3's 128001 in the published model).

    Resolved from the tokenizer's ``<|end_of_text|>`` token when it has one, else from
    ``eos_token_id`` (e.g. ``config.text_config.eos_token_id``, an int or a list), else the
    original's hard-coded 128001. Ids outside a small vocabulary are dropped by the caller."""
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    if callable(convert):
        tid = convert(END_OF_TEXT_TOKEN)
        unk = getattr(tokenizer, "unk_token_id", None)
        if isinstance(tid, int) and tid >= 0 and tid != unk:
            return [tid]
    if eos_token_id is not None:
        return [int(i) for i in (eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id])]
    return [LLAMA3_END_OF_TEXT]


@dataclass
class VocabularyTables:
    """Per-id boolean tables, shape (V,), and the ids of the vocabulary's special tokens."""

    word_start: torch.Tensor
    sentence_end: torch.Tensor
    banned: torch.Tensor
    special: frozenset[int] = frozenset()  # reserved tokens, headers, ...: never a word of a reply

    @property
    def vocab_size(self) -> int:
        return self.word_start.numel()

    def starts_word(self, token_id: int) -> bool:
        return self._lists[0][token_id]

    def ends_sentence(self, token_id: int) -> bool:
        return self._lists[1][token_id]

    @functools.cached_property
    def _lists(self) -> tuple[list[bool], list[bool]]:
        """The per-step lookups as Python lists, made once per tables (they are kept on the
        processor): a read of a tensor element costs more than the lookup."""
        return self.word_start.tolist(), self.sentence_end.tolist()

    @classmethod
    def from_pieces(cls, pieces: list[str], special_ids=(), banned_extra=()) -> "VocabularyTables":
        """Tables from decode(i) of every id (spec §5.3):

        * word start: the piece starts with a space, or the id is >= 128000 or a special token;
        * sentence end: the piece contains '.';
        * banned: the piece contains none of ``. , ' a-z A-Z 0-9`` or contains a newline (the
          exact piece '.' is kept), plus ``banned_extra`` (end of text) when inside the vocabulary.
        """
        size = len(pieces)
        specials = {int(i) for i in special_ids}
        word_start = torch.tensor(
            [p.startswith(" ") or i >= LLAMA3_SPECIAL_START or i in specials for i, p in enumerate(pieces)],
            dtype=torch.bool,
        )
        sentence_end = torch.tensor(["." in p for p in pieces], dtype=torch.bool)
        banned = torch.tensor(
            [p != "." and (not (_ALLOWED_CHARS & set(p)) or "\n" in p) for p in pieces], dtype=torch.bool
        )
        for i in banned_extra:
            if 0 <= int(i) < size:  # the original's 128001 does not exist in a small vocabulary
                banned[int(i)] = True
        return cls(word_start, sentence_end, banned, frozenset(i for i in specials if 0 <= i < size))

    def allowing(self, ids) -> "VocabularyTables":
        """These tables with ``ids`` no longer banned: a stop id the caller names (e.g. the
        tokenizer's ``<|end_of_text|>``) must be possible to sample, or it could never end a reply."""
        ids = [int(i) for i in ids if 0 <= int(i) < self.vocab_size and bool(self.banned[int(i)])]
        if not ids:
            return self  # the shared tables stay untouched
        banned = self.banned.clone()
        banned[ids] = False
        return replace(self, banned=banned)

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int | None = None, eos_token_id=None) -> "VocabularyTables":
        """Decode every id once. ``tokenizer`` needs ``len()`` and ``decode(i)`` (a transformers
        tokenizer, or any object offering these two). ``vocab_size`` (the LM's embedding rows,
        which may exceed ``len(tokenizer)``) sets the table size; ids the tokenizer does not know
        decode to '' and are therefore banned. ``eos_token_id``: see ``end_of_text_ids``."""
        known = len(tokenizer)
        size = known if vocab_size is None else int(vocab_size)
        pieces = _decode_each(tokenizer, min(size, known)) + [""] * max(0, size - known)
        return cls.from_pieces(pieces, special_token_ids(tokenizer), end_of_text_ids(tokenizer, eos_token_id))


# -- parameters and state ----------------------------------------------------------------------------
@dataclass
class SamplingParams:
    """Decoding settings. Defaults are the README's; ``text_top_p == 0`` is greedy."""

    text_top_p: float = 0.3
    taste_top_p: float = 0.0
    text_temperature: float = 0.5
    repetition_penalty: float = 1.1
    extra_words: int = 8
    delay: int = 1

    def __post_init__(self):
        for name in ("text_top_p", "taste_top_p", "text_temperature", "repetition_penalty", "extra_words"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.extra_words != int(self.extra_words):
            raise ValueError(f"extra_words must be a whole number of words, got {self.extra_words!r}")
        if not 0.0 <= self.text_top_p <= 1.0:
            raise ValueError(f"text_top_p must be in [0, 1] (0 = greedy), got {self.text_top_p}")
        if not 0.0 <= self.taste_top_p <= 1.0:
            raise ValueError(f"taste_top_p must be in [0, 1] (0 = argmax), got {self.taste_top_p}")
        if not self.text_temperature > 0:
            raise ValueError(f"text_temperature must be > 0, got {self.text_temperature}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1.0 = off), got {self.repetition_penalty}")
        if int(self.extra_words) < 1:
            raise ValueError(f"extra_words must be >= 1, got {self.extra_words}")
        if self.delay != 1:
            raise ValueError(f"only the word-level delay of 1 (the published model) is supported, got {self.delay}")


@dataclass
class SamplerState:
    """Everything the sampler remembers about one sequence. Make one per generation with
    ``TasteSampler.reset``; ``reset`` on the state itself re-arms it in place."""

    extra_words: int
    has_prefix: bool
    stop_id: int | frozenset[int] | None = None  # one stop id or several
    delay: int = 1
    word_start_history: list[bool] = field(default_factory=list)
    end_countdown: int | None = None
    end_text: bool = False
    word_counter: int = 0
    end_reason: str | None = None  # 'sentence_end' | 'max_words' | 'stop_id' once the end is decided

    @property
    def max_words(self) -> int:
        return 3 * self.extra_words

    def is_stop(self, text_id: int) -> bool:
        if self.stop_id is None:
            return False
        if isinstance(self.stop_id, int):
            return text_id == self.stop_id
        return text_id in self.stop_id

    def reset(self, extra_words: int | None = None, has_prefix: bool | None = None, stop_id=...) -> "SamplerState":
        if extra_words is not None:
            self.extra_words = int(extra_words)
        if has_prefix is not None:
            self.has_prefix = bool(has_prefix)
        if stop_id is not ...:
            self.stop_id = stop_id
        self.word_start_history = []
        self.end_countdown = None
        self.end_text = False
        self.word_counter = 0
        self.end_reason = None
        return self


@dataclass
class Decision:
    """The sampler's choice at one step."""

    text_id: int
    taste_ids: torch.Tensor  # (K,) long, on the host; all -1 when no code was sampled at this step
    action: Action
    taste_action: TasteAction
    text_logits: torch.Tensor  # (V,) the banned (and filtered) logits the choice was made from
    taste_sampled: bool | None = None  # whether taste_ids is a sampled code, as the sampler knows it (None: read them)
    head_codes: list[int] | None = None  # the TASTE head's own code at this step, where it was read with the choice

    @property
    def has_taste(self) -> bool:
        if self.taste_sampled is not None:  # (no read of taste_ids, which may wait for the GPU)
            return self.taste_sampled
        return bool((self.taste_ids >= 0).all())

    @property
    def emits_text(self) -> bool:
        return self.action in (Action.CONTINUE_AT_WORD_START, Action.CONTINUE_NOT_AT_WORD_START)


# -- the sampler ---------------------------------------------------------------------------------------
class TasteSampler:
    def __init__(self, tables: VocabularyTables, params: SamplingParams | None = None):
        self.tables = tables
        self.params = params or SamplingParams()
        self._banned_here = tables.banned  # the ban mask on the device of the last logits seen

    def _banned_on(self, device: torch.device) -> torch.Tensor:
        if self._banned_here.device != device:  # (pinned: a sampler's first step does not wait for the GPU)
            self._banned_here = to_device(self.tables.banned, device)
        return self._banned_here

    @classmethod
    def from_tokenizer(cls, tokenizer, params: SamplingParams | None = None, vocab_size: int | None = None,
                       eos_token_id=None) -> "TasteSampler":
        return cls(VocabularyTables.from_tokenizer(tokenizer, vocab_size, eos_token_id), params)

    # Mask names used by the golden sets.
    @property
    def ban_mask(self) -> torch.Tensor:
        return self.tables.banned

    @property
    def sentence_end_mask(self) -> torch.Tensor:
        return self.tables.sentence_end

    @property
    def word_start_mask(self) -> torch.Tensor:
        return self.tables.word_start

    def reset(self, has_prefix: bool, stop_id=None, extra_words: int | None = None) -> SamplerState:
        """A fresh per-sequence state (the original's ``reset``). ``stop_id``: an id, several ids
        (any collection) or None; sampling one ends the sequence at once (spec §5.3)."""
        if stop_id is not None and not isinstance(stop_id, int):
            stop_id = frozenset(int(i) for i in stop_id)
        words = self.params.extra_words if extra_words is None else int(extra_words)
        if words < 1:
            raise ValueError(f"extra_words must be >= 1, got {words}")
        return SamplerState(extra_words=words, has_prefix=bool(has_prefix), stop_id=stop_id, delay=self.params.delay)

    new_state = reset

    # -- text --------------------------------------------------------------------------------------
    def _check_vocab(self, logits: torch.Tensor) -> None:
        if logits.shape[-1] != self.tables.vocab_size:
            raise ValueError(
                f"text logits have {logits.shape[-1]} entries but the sampler tables cover {self.tables.vocab_size} "
                "ids: build the tables with vocab_size=config.text_config.vocab_size"
            )

    def sample_text(self, logits: torch.Tensor, input_ids, generator: torch.Generator | None = None):
        """Pick a text id from the last position's logits (V,). Returns (id, logits used).

        ban -> if p == 0: argmax; else top-p (remove cumulative prob > p, keep the best) ->
        repetition penalty over ``input_ids`` (CTRL style) -> temperature -> one multinomial draw."""
        text_id, used, _ = self._choose_text(logits, input_ids, generator)
        return text_id, used

    def _choose_text(self, logits: torch.Tensor, input_ids, generator: torch.Generator | None = None,
                     rider: torch.Tensor | None = None):
        """``sample_text``, and ``rider`` - a few integers on the logits' device (the TASTE head's
        codes) - read back in the same copy as the choice: one wait for the GPU, not two.
        Returns (id, logits used, the rider's values, or None where it did not ride)."""
        self._check_vocab(logits)
        p = self.params
        # On CUDA nothing here reads the GPU before the choice itself (masks as masked_fill, the
        # penalised ids made on the host): a read waits for every kernel queued before it.
        logits = logits.float().masked_fill(self._banned_on(logits.device), BAN_VALUE)
        if p.text_top_p == 0:
            if rider is None:
                return int(logits.argmax()), logits, None
            values = read_back(torch.cat([logits.argmax().view(1), rider.view(-1)]))
            return values[0], logits, values[1:]
        logits = self._top_p(logits, p.text_top_p)
        if p.repetition_penalty != 1.0 and len(input_ids):
            ids = sorted({int(i) for i in input_ids if 0 <= int(i) < logits.numel()})
            if ids:
                ids = to_device(torch.tensor(ids, dtype=torch.long), logits.device)
                chosen = logits.gather(0, ids)  # (gather and scatter_: kernels alone, nothing read back)
                logits.scatter_(0, ids, torch.where(chosen < 0, chosen * p.repetition_penalty,
                                                    chosen / p.repetition_penalty))
        logits = logits / p.text_temperature
        probs = logits.softmax(-1)
        if rider is None:
            return draw(probs, generator), logits, None
        n = rider.numel()
        if generator is not None and (generator.device.type == "cpu" or generator.device != probs.device):
            # the probabilities go to the generator's device for the draw (from a GPU to a CPU
            # generator: the one copy back, the wait): the rider goes with them (integers below
            # 2**24, exact in float32)
            both = torch.cat([probs, rider.view(-1).to(probs.dtype)]).to(generator.device)
            return draw(both[:-n], generator), logits, both[-n:].long().tolist()
        # drawn where the probabilities are (the global generator, or one on their device): the
        # pick (and its check) read back with the rider
        values = read_back(torch.cat([pick_on_device(probs, generator), rider.view(-1)]))
        return checked_pick(values[:2]), logits, values[2:]

    @staticmethod
    def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
        """Set every token whose cumulative probability (sorted descending) exceeds ``top_p`` to
        BAN_VALUE - including the one that crosses ``top_p`` - but always keep the best."""
        sorted_logits, order = logits.sort(descending=True)
        remove = sorted_logits.softmax(-1).cumsum(-1) > top_p
        remove[..., 0].fill_(False)  # (not "= False": that copies a host scalar in, a wait on CUDA)
        # back to vocabulary order by scattering (a mask as indices would read the GPU)
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits.masked_fill(remove, BAN_VALUE))

    # -- TASTE -------------------------------------------------------------------------------------
    def sample_taste(self, taste_logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """(K, C) logits of the last position -> (K,) codes, on the host. The published head's
        logits are one-hot x 1000, so this is the head's own code whatever ``taste_top_p`` is."""
        if self.params.taste_top_p == 0:
            return torch.tensor(read_back(taste_logits.argmax(-1)), dtype=torch.long)
        codes = [
            draw(self._top_p(level.float(), self.params.taste_top_p).softmax(-1), generator)
            for level in taste_logits
        ]
        return torch.tensor(codes, dtype=torch.long)

    # -- one step ----------------------------------------------------------------------------------
    def update(self, state: SamplerState, text_logits: torch.Tensor, taste_logits: torch.Tensor, input_ids,
               generator: torch.Generator | None = None) -> Decision:
        """One generation step from the last position's text logits (V,) and TASTE logits (K, C).
        ``input_ids``: every id so far (prompt + generated), for the repetition penalty."""
        delay = state.delay
        # the head's code (greedy) rides with the text choice's read: a word's code costs no wait of its own
        rider = taste_logits.argmax(-1) if self.params.taste_top_p == 0 else None
        text_id, used_logits, codes = self._choose_text(text_logits, input_ids, generator, rider)
        waiting = state.end_text  # decided at an earlier step
        if state.word_counter == 0:
            is_word_start = True  # the first generated token always starts a word
        elif waiting:
            state.end_countdown = (delay if state.end_countdown is None else state.end_countdown) - 1
            is_word_start = True  # forced, so the last word's code is read now
        else:
            is_word_start = self.tables.starts_word(text_id)
        state.word_start_history.append(is_word_start)

        # max_words is checked before this word is counted: up to 3E + 1 words.
        if state.word_counter >= state.extra_words and self.tables.ends_sentence(text_id):
            state.end_reason = state.end_reason or "sentence_end"
            state.end_text = True
        elif state.word_counter >= state.max_words:
            state.end_reason = state.end_reason or "max_words"
            state.end_text = True
        if state.is_stop(text_id):
            state.end_reason = "stop_id"
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

        started = sum(state.word_start_history) > delay  # a finished word's code is due
        if started and is_word_start:
            taste_ids = (torch.tensor(codes, dtype=torch.long) if codes is not None
                         else self.sample_taste(taste_logits, generator))
        else:
            taste_ids = torch.full((taste_logits.shape[-2],), -1, dtype=torch.long)
        if started:
            taste_action = TasteAction.SAMPLE
        elif state.has_prefix and is_word_start:
            taste_action = TasteAction.USE_PREFIX
        elif state.has_prefix:
            taste_action = TasteAction.USE_PREFIX_IGNORE
        else:
            taste_action = TasteAction.WAIT
        return Decision(text_id, taste_ids, action, taste_action, used_logits, taste_sampled=started and is_word_start,
                        head_codes=codes)

    def word_code(self, decision: Decision, taste_logits: torch.Tensor,
                  generator: torch.Generator | None = None) -> torch.Tensor:
        """(K,) host code of a word ending at this step: the one the sampler sampled, else the
        head's own (``sample_taste``; read with the text choice where it rode along)."""
        if decision.has_taste:
            return decision.taste_ids
        if decision.head_codes is not None:
            return torch.tensor(decision.head_codes, dtype=torch.long)
        return self.sample_taste(taste_logits, generator)
