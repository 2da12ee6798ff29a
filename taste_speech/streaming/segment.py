"""TASTESegment: one turn (or piece of a turn) of a spoken conversation.

A segment is text ids (Llama tokens) plus, for spoken content, the TASTE codes aligned to them:
the word's 4 codes on its first token, IGNORE (-1) rows on its other tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROLES = ("system", "user", "assistant")
MODALITIES = ("text", "audio")


@dataclass
class TASTESegment:
    role: str
    modality: str
    text_ids: torch.Tensor  # (1, S) int64
    taste_ids: torch.Tensor | None = None  # (1, S, K) int64 for audio, None for text

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"TASTESegment.role must be one of {ROLES}, got {self.role!r}")
        if self.modality not in MODALITIES:
            raise ValueError(f"TASTESegment.modality must be one of {MODALITIES}, got {self.modality!r}")
        if not isinstance(self.text_ids, torch.Tensor):
            raise ValueError("TASTESegment.text_ids must be a torch.Tensor of shape (1, S); wrap ids with torch.tensor([ids])")
        if self.text_ids.dim() != 2 or self.text_ids.shape[0] != 1:
            raise ValueError(f"TASTESegment.text_ids must have shape (1, S), got {tuple(self.text_ids.shape)}; add a batch dim with .unsqueeze(0)")
        if self.text_ids.dtype.is_floating_point or self.text_ids.dtype == torch.bool:
            raise ValueError(f"TASTESegment.text_ids must be an integer tensor, got {self.text_ids.dtype}; use .long()")
        if self.text_ids.shape[1] == 0:
            raise ValueError("TASTESegment.text_ids is empty: a segment needs at least one token")
        if self.modality == "text":
            if self.taste_ids is not None:
                raise ValueError("a text TASTESegment must not carry taste_ids; use modality='audio' for spoken content")
            return
        if self.taste_ids is None:
            raise ValueError("an audio TASTESegment needs taste_ids (1, S, K); get them from taste_tokenize()")
        if not isinstance(self.taste_ids, torch.Tensor) or self.taste_ids.dim() != 3 or self.taste_ids.shape[0] != 1:
            shape = tuple(self.taste_ids.shape) if isinstance(self.taste_ids, torch.Tensor) else type(self.taste_ids)
            raise ValueError(f"TASTESegment.taste_ids must have shape (1, S, K), got {shape}")
        if self.taste_ids.dtype.is_floating_point or self.taste_ids.dtype == torch.bool:
            raise ValueError(f"TASTESegment.taste_ids must be an integer tensor, got {self.taste_ids.dtype}; use .long()")
        if self.taste_ids.shape[1] != self.text_ids.shape[1]:
            raise ValueError(
                f"TASTESegment.taste_ids covers {self.taste_ids.shape[1]} tokens but text_ids has "
                f"{self.text_ids.shape[1]}: they must be aligned one row per text token"
            )
        if not bool((self.taste_ids[0, 0] >= 0).all()):
            raise ValueError("TASTESegment.taste_ids: the first token must start a word and carry its codes (row 0 is -1)")

    @property
    def length(self) -> int:
        return self.text_ids.shape[1]

    def word_starts(self) -> torch.Tensor:
        """(S,) bool: positions that carry a word's codes (audio segments only)."""
        return (self.taste_ids[0] >= 0).all(-1)

    @staticmethod
    def concat(segments: list["TASTESegment"]) -> "TASTESegment":
        """Join consecutive pieces of one turn (same role and modality) into one segment."""
        if not segments:
            raise ValueError("nothing to concatenate")
        role, modality = segments[0].role, segments[0].modality
        if any(s.role != role or s.modality != modality for s in segments):
            raise ValueError("only segments of one role and modality can be concatenated")
        text = torch.cat([s.text_ids for s in segments], dim=1)
        taste = torch.cat([s.taste_ids for s in segments], dim=1) if modality == "audio" else None
        return TASTESegment(role, modality, text, taste)
