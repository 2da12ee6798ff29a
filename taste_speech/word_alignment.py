"""Word-level alignment between the two token spaces of TASTE.

A transcript is tokenised twice, word by word: Whisper ("ASR") tokens for the audio tower and the
speech decoder, Llama ("LLM") tokens for the spoken LM. Word ids (0-based, contiguous) tie the two
together; these helpers move per-word information between them. Batched inputs are right-padded;
``*_lengths`` give the valid lengths.
"""

from __future__ import annotations

import torch

IGNORE = -1


def _valid(word_ids: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    positions = torch.arange(word_ids.shape[1], device=word_ids.device)
    if lengths is None:
        return torch.ones_like(word_ids, dtype=torch.bool)
    return positions.unsqueeze(0) < lengths.to(word_ids.device).unsqueeze(1)


def _occurrence(word_ids: torch.Tensor, lengths: torch.Tensor | None, last: bool) -> torch.Tensor:
    """(B, T) bool: the valid position is the first (or last) occurrence of its word id."""
    valid = _valid(word_ids, lengths)
    same = (word_ids.unsqueeze(2) == word_ids.unsqueeze(1)) & valid.unsqueeze(1) & valid.unsqueeze(2)
    t = word_ids.shape[1]
    order = torch.ones(t, t, dtype=torch.bool, device=word_ids.device)
    order = order.triu(1) if last else order.tril(-1)  # later (or earlier) positions
    return valid & ~(same & order).any(dim=2)


def first_of_word(word_ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) bool: the position is the first token of its word."""
    return _occurrence(word_ids, lengths, last=False)


def last_of_word(word_ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) bool: the position is the last token of its word."""
    return _occurrence(word_ids, lengths, last=True)


def word_start_mapping(target_word_ids, source_word_ids, target_lengths=None, source_lengths=None):
    """(B, T_target, T_source) 0/1 float: one 1 at (first target token of word w, first source
    token of word w) for every word w present in both."""
    same_word = target_word_ids.unsqueeze(2) == source_word_ids.unsqueeze(1)
    starts = first_of_word(target_word_ids, target_lengths).unsqueeze(2) & first_of_word(
        source_word_ids, source_lengths
    ).unsqueeze(1)
    return (same_word & starts).float()


def word_end_mapping(target_word_ids, source_word_ids, target_lengths=None, source_lengths=None):
    """(B, T_target, T_source) 0/1 float: every valid target token of word w points at the last
    source token of word w."""
    same_word = target_word_ids.unsqueeze(2) == source_word_ids.unsqueeze(1)
    ends = _valid(target_word_ids, target_lengths).unsqueeze(2) & last_of_word(
        source_word_ids, source_lengths
    ).unsqueeze(1)
    return (same_word & ends).float()


def convert_embeds_by_word_end(embeds, target_word_ids, source_word_ids, target_lengths=None, source_lengths=None):
    """Give every target token the source-space embedding of its word's last source token."""
    mapping = word_end_mapping(target_word_ids, source_word_ids, target_lengths, source_lengths)
    return torch.bmm(mapping.to(embeds.dtype), embeds)


def llm_indices_from_asr(asr_indices, asr_word_ids, llm_word_ids, asr_lengths=None, llm_lengths=None):
    """TASTE codes per Whisper token (B, L, K) -> per Llama token (B, N, K): the word's codes on
    the first Llama token of every word, IGNORE (-1) on every other token (spec §3.6)."""
    mapping = word_start_mapping(llm_word_ids, asr_word_ids, llm_lengths, asr_lengths).long()
    has_code = mapping.sum(-1, keepdim=True) > 0
    gathered = torch.bmm(mapping.double(), asr_indices.double()).long()
    return torch.where(has_code, gathered, torch.full_like(gathered, IGNORE))


def multi_token_word_spans(word_ids: torch.Tensor, token_lengths: torch.Tensor) -> torch.Tensor:
    """(rows, 3) long (batch, start, end-exclusive) of every word with two or more tokens.

    ``token_lengths`` count an appended end-of-text token, which belongs to no word."""
    rows = []
    for b in range(word_ids.shape[0]):
        n = min(int(token_lengths[b]) - 1, word_ids.shape[1])
        ids = word_ids[b, :n].tolist()
        start = 0
        for i in range(1, n + 1):
            if i == n or ids[i] != ids[start]:
                if i - start > 1:
                    rows.append((b, start, i))
                start = i
    return torch.tensor(rows, dtype=torch.long).reshape(-1, 3)


def per_token_codes_from_word_codes(word_rows: torch.Tensor, word_ids: torch.Tensor) -> torch.Tensor:
    """Spread one code row per word (W, K) onto the tokens of each word: (1, L, K)."""
    return word_rows[word_ids[0].long()].unsqueeze(0)


def word_rows(indices: torch.Tensor) -> torch.Tensor:
    """The valid (word-start) rows of (1, T, K) indices, in order: (W, K)."""
    return indices[0][indices[0, :, 0] != IGNORE]
