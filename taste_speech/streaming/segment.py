"""TASTESegment: one turn (or a piece of a turn) of a spoken conversation.

A segment is Llama text ids plus, for spoken content, the TASTE codes aligned to them: each word's
K codes on its first token and IGNORE (-1) rows on its other tokens (the original ``extract_vq``
layout). Text segments carry no codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROLES = ("system", "user", "assistant")
MODALITIES = ("text", "audio")
IGNORE = -1


def _is_integer_tensor(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


@dataclass(eq=False)  # one turn is one object: == and hash by identity (as Conversation finds its turns)
class TASTESegment:
    role: str  # 'system' | 'user' | 'assistant'
    modality: str  # 'text' | 'audio'
    text_ids: torch.Tensor  # (1, S) integer Llama ids
    taste_ids: torch.Tensor | None = None  # (1, S, K) integer codes for audio, None for text

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"TASTESegment.role must be one of {ROLES}, got {self.role!r}")
        if self.modality not in MODALITIES:
            raise ValueError(f"TASTESegment.modality must be one of {MODALITIES}, got {self.modality!r}")
        if not isinstance(self.text_ids, torch.Tensor):
            raise ValueError(f"TASTESegment.text_ids must be a torch.Tensor of shape (1, S), got "
                             f"{type(self.text_ids).__name__}; wrap ids with torch.tensor([ids])")
        if self.text_ids.dim() != 2 or self.text_ids.shape[0] != 1:
            raise ValueError(f"TASTESegment.text_ids must have shape (1, S), got {tuple(self.text_ids.shape)}; "
                             "add the batch dimension with .unsqueeze(0)")
        if not _is_integer_tensor(self.text_ids):
            raise ValueError(f"TASTESegment.text_ids must be an integer tensor, got {self.text_ids.dtype}; use .long()")
        if self.text_ids.shape[1] == 0:
            raise ValueError("TASTESegment.text_ids is empty: a segment needs at least one token")
        if bool((self.text_ids < 0).any()):
            raise ValueError("TASTESegment.text_ids holds negative ids: pass Llama token ids (>= 0)")
        if self.modality == "text":
            if self.taste_ids is not None:
                raise ValueError("a text TASTESegment must not carry taste_ids: drop them, or use modality='audio' "
                                 "for spoken content")
            return
        if self.taste_ids is None:
            raise ValueError("an audio TASTESegment needs taste_ids (1, S, K): get them from taste_tokenize()")
        if not isinstance(self.taste_ids, torch.Tensor):
            raise ValueError(f"TASTESegment.taste_ids must be a torch.Tensor of shape (1, S, K), got "
                             f"{type(self.taste_ids).__name__}")
        if self.taste_ids.dim() != 3 or self.taste_ids.shape[0] != 1:
            raise ValueError(f"TASTESegment.taste_ids must have shape (1, S, K), got {tuple(self.taste_ids.shape)}")
        if not _is_integer_tensor(self.taste_ids) or not self.taste_ids.dtype.is_signed:  # -1 marks 'no code'
            raise ValueError(f"TASTESegment.taste_ids must be a signed integer tensor (-1 marks rows without a "
                             f"code), got {self.taste_ids.dtype}; use .long()")
        if self.taste_ids.shape[1] != self.text_ids.shape[1]:
            raise ValueError(
                f"TASTESegment.taste_ids covers {self.taste_ids.shape[1]} tokens but text_ids has "
                f"{self.text_ids.shape[1]}: give one row per text token (codes on word starts, -1 elsewhere)"
            )
        if bool((self.taste_ids < IGNORE).any()):
            raise ValueError("TASTESegment.taste_ids holds values below -1: use -1 for 'no code' rows")
        rows = self.taste_ids[0]
        partial = (rows >= 0).any(-1) & ~(rows >= 0).all(-1)
        if bool(partial.any()):
            raise ValueError(f"TASTESegment.taste_ids rows {partial.nonzero().flatten().tolist()} mix codes and -1: "
                             "a row is either a word's full code or all -1")
        if not bool((rows[0] >= 0).all()):
            raise ValueError("TASTESegment.taste_ids: the first token must start a word and carry its codes (row 0 is -1)")

    # -- views -------------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return self.text_ids.shape[1]

    def word_starts(self) -> torch.Tensor:
        """(S,) bool: tokens that carry a word's codes (audio segments)."""
        if self.taste_ids is None:
            raise ValueError("a text segment has no word codes")
        return (self.taste_ids[0] >= 0).all(-1)

    @property
    def num_words(self) -> int:
        return int(self.word_starts().sum()) if self.taste_ids is not None else 0

    def word_codes(self) -> torch.Tensor:
        """(W, K) the code of every word, in order (audio segments)."""
        return self.taste_ids[0][self.word_starts()]

    def word_ids(self) -> torch.Tensor:
        """(S,) 0-based word index of every token (audio segments)."""
        return torch.cumsum(self.word_starts().long(), 0) - 1

    def first_words(self, n_words: int) -> "TASTESegment | None":
        """The segment cut after its first ``n_words`` words (None for 0 words)."""
        if n_words <= 0:
            return None
        starts = self.word_starts().nonzero().flatten()
        if n_words >= starts.numel():
            return self
        end = int(starts[n_words])
        return TASTESegment(self.role, self.modality, self.text_ids[:, :end], self.taste_ids[:, :end])

    @staticmethod
    def concat(segments: list["TASTESegment"]) -> "TASTESegment":
        """Join consecutive pieces of one turn (same role and modality) into one segment."""
        segments = [s for s in segments if s is not None]
        if not segments:
            raise ValueError("nothing to concatenate: give at least one segment")
        role, modality = segments[0].role, segments[0].modality
        if any(s.role != role or s.modality != modality for s in segments):
            raise ValueError("only segments of one role and one modality can be concatenated")
        text = torch.cat([s.text_ids.cpu() for s in segments], dim=1)
        taste = torch.cat([s.taste_ids.cpu() for s in segments], dim=1) if modality == "audio" else None
        return TASTESegment(role, modality, text, taste)
