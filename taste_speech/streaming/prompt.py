"""How a conversation of TASTESegments becomes spoken-LM input rows.

Two formats:

* ``dialogue`` — each segment is ``[role][segment_start] content [segment_end]`` with Llama's
  ``<|reserved_special_token_50..54|>`` as segment_start, segment_end, system, user, assistant.
  Marker rows and text content carry the pad audio vector; audio content carries its TASTE codes
  with the one-word delay applied inside the segment (pad on the first word, then the previous
  word's code); the segment_end row of an audio segment carries its last word's code, so the LM
  sees every word's code. The reply's role is the model's own first choice (user = keep
  listening). The published V0 checkpoint never saw these tokens: this format is for fine-tuned
  checkpoints.
* ``continuation`` — what V0 (trained for speech continuation) can use, after the original's
  ``instruct`` mode: plain-text role labels (" User:", " Assistant:") as raw text embeddings around
  each turn's fused rows; the reply is the continuation after " Assistant:" and always happens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from taste_speech.streaming.segment import TASTESegment

DIALOGUE, CONTINUATION = "dialogue", "continuation"
FORMATS = (DIALOGUE, CONTINUATION)
DIALOGUE_TOKENS = {
    "segment_start": "<|reserved_special_token_50|>",
    "segment_end": "<|reserved_special_token_51|>",
    "system": "<|reserved_special_token_52|>",
    "user": "<|reserved_special_token_53|>",
    "assistant": "<|reserved_special_token_54|>",
}
CONTINUATION_LABELS = {"system": " System:", "user": " User:", "assistant": " Assistant:"}


@dataclass(frozen=True)
class DialogueIds:
    segment_start: int
    segment_end: int
    system: int
    user: int
    assistant: int

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "DialogueIds":
        ids = {}
        for name, token in DIALOGUE_TOKENS.items():
            tid = tokenizer.convert_tokens_to_ids(token)
            if tid is None or tid == getattr(tokenizer, "unk_token_id", None):
                raise ValueError(f"the LLM tokenizer has no {token}; the dialogue format needs Llama-3 reserved tokens")
            ids[name] = int(tid)
        return cls(**ids)

    def role(self, role: str) -> int:
        return getattr(self, role)


class PromptBuilder:
    """Turns segments into rows (1, T, H) for the spoken LM, in one of the two formats."""

    def __init__(self, spoken_lm, rvq, tokenizer, prompt_format: str = CONTINUATION):
        if prompt_format not in FORMATS:
            raise ValueError(f"prompt_format must be one of {FORMATS}, got {prompt_format!r}")
        self.lm, self.rvq, self.tokenizer, self.format = spoken_lm, rvq, tokenizer, prompt_format
        self.ids = DialogueIds.from_tokenizer(tokenizer) if prompt_format == DIALOGUE else None
        self.labels = {
            role: tokenizer.encode(text, add_special_tokens=False) for role, text in CONTINUATION_LABELS.items()
        }

    # -- rows -------------------------------------------------------------------------------
    def _fused(self, token_ids, audio: torch.Tensor) -> torch.Tensor:
        text = self.lm.token_embeds(token_ids).float()
        return self.lm.fuse(text, audio).unsqueeze(0)

    def _pad(self, n: int) -> torch.Tensor:
        return self.lm.pad_audio_unit_embed.float().unsqueeze(0).expand(n, -1)

    def _raw(self, token_ids) -> torch.Tensor:
        return self.lm.token_embeds(token_ids).to(self.lm.lm_dtype).unsqueeze(0)

    def content_audio(self, segment: TASTESegment) -> tuple[torch.Tensor, torch.Tensor]:
        """Audio side per content token (pad, then previous word's code) and the last word's code."""
        taste = segment.taste_ids[0]
        starts = segment.word_starts()
        word_ids = torch.cumsum(starts.long(), 0) - 1
        codes = self.rvq.decode(taste[starts].unsqueeze(0))[0].float()
        prev = word_ids - 1
        audio = torch.where((prev >= 0).unsqueeze(-1), codes[prev.clamp(min=0)], self._pad(len(word_ids)))
        return audio, codes[-1]

    def sos_rows(self) -> torch.Tensor:
        return self._raw([self.lm.sos_id])

    def segment_rows(self, segment: TASTESegment) -> torch.Tensor:
        ids = segment.text_ids[0].tolist()
        if self.format == DIALOGUE:
            head = self._fused([self.ids.role(segment.role), self.ids.segment_start], self._pad(2))
            if segment.modality == "audio":
                audio, last = self.content_audio(segment)
                body = self._fused(ids, audio)
                tail = self._fused([self.ids.segment_end], last.unsqueeze(0))
            else:
                body = self._fused(ids, self._pad(len(ids)))
                tail = self._fused([self.ids.segment_end], self._pad(1))
            return torch.cat([head, body, tail], dim=1)
        label = self._raw(self.labels[segment.role])
        if segment.modality == "audio":
            audio, _ = self.content_audio(segment)
            body = self._fused(ids, audio)
        else:
            body = self._raw(ids)
        return torch.cat([label, body], dim=1)

    def reply_opening_rows(self, role: str = "assistant") -> torch.Tensor:
        """Rows that open the reply once its role is known."""
        if self.format == DIALOGUE:
            return self._fused([self.ids.role(role), self.ids.segment_start], self._pad(2))
        return self._raw(self.labels[role])

    def reply_closing_rows(self, reply: TASTESegment) -> torch.Tensor:
        """Rows that close a reply whose content rows are already in the cache."""
        if self.format == DIALOGUE:
            _, last = self.content_audio(reply)
            return self._fused([self.ids.segment_end], last.unsqueeze(0))
        return self._raw([])[:, :0]
