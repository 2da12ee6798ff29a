"""How a conversation of TASTESegments becomes spoken-LM input rows (one format per Conversation).

Every format starts with the raw SOS row (``<|begin_of_text|>``) and writes rows turn by turn, so
a conversation's KV cache only ever grows at its end. Fused rows follow spec §4.3; "pad" is the
learned ``pad_audio_unit_embed``; an audio word's code reaches the LM one word late (§4.4).

* ``continuation`` (default; what the published V0 checkpoint was trained on: speech
  continuation): all turns form ONE spoken stream. Every content row is fuse(token, audio) where
  audio is the code of the stream's previous word (pad when that word was text or there is none),
  and the reply continues the stream. With a single audio turn this is exactly the original
  ``generate(conditional_mode='audio')`` (greedy parity with the goldens). The model cannot hand
  the turn back, so it always answers.
* ``instruct`` (after the original's ``instruct`` mode): plain-text role labels (" User:",
  " Assistant:", " System:") as raw text embeddings before each turn; audio turns in the §4.4
  layout inside the turn (the last word's code is not fed, as in the original), text turns as raw
  embeddings; the reply follows " Assistant:". Always answers.
* ``dialogue`` (the third-party streaming proposal, spec §9.5; needs a fine-tuned checkpoint - V0
  never saw these tokens): each segment is ``[role][segment_start] content [segment_end]`` with
  Llama-3's ``<|reserved_special_token_50..54|>`` (segment_start, segment_end, system, user,
  assistant). Markers and text content are fused with pad, audio content with the per-segment
  one-word delay, and the segment_end row of an audio segment carries its last word's code. After
  the history the model's own next token decides the turn: the user role means "nothing to say,
  keep listening"; the assistant role opens the reply with ``[assistant][segment_start]`` and the
  reply ends at segment_end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from taste_speech.device_copies import to_device
from taste_speech.streaming.segment import TASTESegment

CONTINUATION, INSTRUCT, DIALOGUE = "continuation", "instruct", "dialogue"
FORMATS = (CONTINUATION, INSTRUCT, DIALOGUE)
DIALOGUE_TOKENS = {
    "segment_start": "<|reserved_special_token_50|>",
    "segment_end": "<|reserved_special_token_51|>",
    "system": "<|reserved_special_token_52|>",
    "user": "<|reserved_special_token_53|>",
    "assistant": "<|reserved_special_token_54|>",
}
INSTRUCT_LABELS = {"system": " System:", "user": " User:", "assistant": " Assistant:"}


@dataclass(frozen=True)
class DialogueIds:
    """The dialogue markers' ids, resolved through the checkpoint's own Llama tokenizer (their
    numbers differ between Llama-3.0 and 3.1/3.2 tokenizers)."""

    segment_start: int
    segment_end: int
    system: int
    user: int
    assistant: int

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "DialogueIds":
        convert = getattr(tokenizer, "convert_tokens_to_ids", None)
        if not callable(convert):
            raise ValueError("the dialogue format needs a tokenizer with convert_tokens_to_ids (a transformers tokenizer)")
        ids = {}
        for name, token in DIALOGUE_TOKENS.items():
            tid = convert(token)
            if not isinstance(tid, int) or tid < 0 or tid == getattr(tokenizer, "unk_token_id", None):
                raise ValueError(f"the LLM tokenizer has no {token}: the dialogue format needs Llama-3's reserved "
                                 "special tokens; use prompt_format='continuation' or 'instruct'")
            ids[name] = tid
        return cls(**ids)

    def role(self, role: str) -> int:
        return getattr(self, role)


@dataclass
class ReplyOpening:
    """How a reply starts in a format."""

    rows: torch.Tensor | None  # (1, t, H) rows fed before the first step, or None
    opening_ids: list[int]  # their token ids (for the repetition penalty)
    pending_audio: torch.Tensor | None  # code the first reply word is fused with ('continuation')
    stop_ids: tuple[int, ...]  # tokens that end the reply (not emitted)


class PromptFormat:
    """Builds the rows of segments for one spoken LM; ``carry`` is the TASTE embedding the next
    stream row inherits (continuation format) or None."""

    def __init__(self, spoken_lm, rvq, tokenizer, name: str = CONTINUATION):
        if name not in FORMATS:
            raise ValueError(f"prompt_format must be one of {FORMATS}, got {name!r}")
        self.lm, self.rvq, self.tokenizer, self.name = spoken_lm, rvq, tokenizer, name
        self.ids = DialogueIds.from_tokenizer(tokenizer) if name == DIALOGUE else None
        self.labels = {}
        if name == INSTRUCT:
            # split_special_tokens as every encode of the tokenizer here: the flag is the shared
            # tokenizer's, and an encode without it turned it off under another call's words
            self.labels = {role: list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
                           for role, text in INSTRUCT_LABELS.items()}

    @property
    def decides_turns(self) -> bool:
        """Whether the model itself chooses between answering and listening."""
        return self.name == DIALOGUE

    # -- row helpers ----------------------------------------------------------------------------
    def _fused(self, token_ids, audio: torch.Tensor) -> torch.Tensor:
        return self.lm.fuse(self.lm.token_embeds(token_ids).float(), audio).unsqueeze(0)

    def _raw(self, token_ids) -> torch.Tensor:
        return self.lm.token_embeds(token_ids).to(self.lm.lm_dtype).unsqueeze(0)

    def _pad(self, n: int) -> torch.Tensor:
        return self.lm.pad_audio().unsqueeze(0).expand(n, -1)

    def word_embeds(self, segment: TASTESegment) -> torch.Tensor:
        """(W, dim) TASTE embedding of every word of an audio segment."""
        codes = segment.word_codes()
        if codes.shape[-1] != self.rvq.num_quantizers:
            raise ValueError(f"the segment's taste_ids have {codes.shape[-1]} codes per word but the model's RVQ has "
                             f"{self.rvq.num_quantizers} levels")
        return self.rvq.decode(codes.unsqueeze(0))[0].float()  # (host codes: no wait for the GPU)

    def delayed_audio(self, segment: TASTESegment, first: torch.Tensor | None) -> torch.Tensor:
        """(S, dim) audio side of an audio segment's rows: ``first`` (or pad) on word 0, then the
        previous word's code carried over each word."""
        embeds = self.word_embeds(segment)
        word_ids = to_device(segment.word_ids(), embeds.device)
        head = self._pad(1) if first is None else first.float().unsqueeze(0)
        table = torch.cat([head, embeds], dim=0)  # row w holds what word w is fused with
        return table[word_ids]

    def sos_rows(self) -> torch.Tensor:
        return self._raw([self.lm.sos_id])

    # -- segments ---------------------------------------------------------------------------------
    def segment_rows(self, segment: TASTESegment, carry: torch.Tensor | None):
        """(rows (1, t, H), ids fed, new carry) of a committed segment."""
        ids = segment.text_ids[0].tolist()
        audio = segment.modality == "audio"
        if self.name == CONTINUATION:
            if audio:
                rows = self._fused(ids, self.delayed_audio(segment, carry))
                return rows, ids, self.word_embeds(segment)[-1]
            side = self._pad(len(ids)).clone()
            if carry is not None:  # the first word of a text turn inherits the previous spoken word
                n_first = int((self._text_word_ids(ids) == 0).sum())
                side[:n_first] = carry.float()
            return self._fused(ids, side), ids, None
        if self.name == INSTRUCT:
            label = self.labels[segment.role]
            body = self._fused(ids, self.delayed_audio(segment, None)) if audio else self._raw(ids)
            return torch.cat([self._raw(label), body], dim=1), label + ids, None
        marks = [self.ids.role(segment.role), self.ids.segment_start]
        head = self._fused(marks, self._pad(2))
        if audio:
            body = self._fused(ids, self.delayed_audio(segment, None))
            tail = self._fused([self.ids.segment_end], self.word_embeds(segment)[-1:])
        else:
            body = self._fused(ids, self._pad(len(ids)))
            tail = self._fused([self.ids.segment_end], self._pad(1))
        return torch.cat([head, body, tail], dim=1), marks + ids + [self.ids.segment_end], None

    def _text_word_ids(self, ids: list[int]) -> torch.Tensor:
        """Word index per token of a text turn (a word starts at a piece with a leading space)."""
        starts = [k == 0 or self.tokenizer.decode([t]).startswith(" ") for k, t in enumerate(ids)]
        return torch.cumsum(torch.tensor(starts, dtype=torch.long), 0) - 1

    # -- replies ------------------------------------------------------------------------------------
    def reply_opening(self, carry: torch.Tensor | None, eos_id: int | None) -> ReplyOpening:
        extra = () if eos_id is None else (int(eos_id),)
        if self.name == CONTINUATION:
            return ReplyOpening(None, [], carry, extra)
        if self.name == INSTRUCT:
            label = self.labels["assistant"]
            return ReplyOpening(self._raw(label), list(label), None, extra)
        marks = [self.ids.assistant, self.ids.segment_start]
        return ReplyOpening(self._fused(marks, self._pad(2)), marks, None, (self.ids.segment_end,) + extra)

    def reply_closing(self, reply: TASTESegment):
        """(rows or None, ids, new carry) that close a reply whose content rows are in the cache."""
        if self.name == CONTINUATION:
            return None, [], self.word_embeds(reply)[-1]
        if self.name == INSTRUCT:
            return None, [], None
        return self._fused([self.ids.segment_end], self.word_embeds(reply)[-1:]), [self.ids.segment_end], None

    def turn_logits(self, text_logits: torch.Tensor) -> torch.Tensor:
        """(2,) logits of (user, assistant) as the next token (dialogue format)."""
        return text_logits[[self.ids.user, self.ids.assistant]].float()
