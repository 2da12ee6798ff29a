"""Word-level alignment between the two token spaces of TASTE.

A transcript is tokenised twice, word by word: Whisper ("ASR") tokens for the audio tower and the
speech decoder, Llama ("LLM") tokens for the spoken LM. Word ids (0-based, contiguous) tie the two
together; these pure functions move per-word information between them (spec §3.4, §3.6, §6.1).

Shapes: word ids are (B, T) integer tensors. Batched inputs are right-padded and ``*_lengths``
(B,) give the valid lengths (None = every position is valid); padded positions may hold any id.
"""

from __future__ import annotations

import torch

IGNORE = -1


def valid_mask(word_ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) bool: position t of row b is inside the valid length."""
    if lengths is None:
        return torch.ones_like(word_ids, dtype=torch.bool)
    positions = torch.arange(word_ids.shape[1], device=word_ids.device)
    return positions.unsqueeze(0) < lengths.to(word_ids.device).reshape(-1, 1)


def _is_extreme_occurrence(word_ids: torch.Tensor, lengths: torch.Tensor | None, last: bool) -> torch.Tensor:
    """(B, T) bool: the valid position is the first (or last) valid occurrence of its word id."""
    valid = valid_mask(word_ids, lengths)
    same = (word_ids.unsqueeze(2) == word_ids.unsqueeze(1)) & valid.unsqueeze(1) & valid.unsqueeze(2)
    t = word_ids.shape[1]
    pairs = torch.ones(t, t, dtype=torch.bool, device=word_ids.device)
    other_side = pairs.triu(1) if last else pairs.tril(-1)  # [i, j]: j after (or before) i
    return valid & ~(same & other_side).any(dim=2)


def first_of_word(word_ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) bool: the position is the first token of its word."""
    return _is_extreme_occurrence(word_ids, lengths, last=False)


def last_of_word(word_ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) bool: the position is the last token of its word."""
    return _is_extreme_occurrence(word_ids, lengths, last=True)


def word_start_mapping(target_word_ids, source_word_ids, target_lengths=None, source_lengths=None):
    """(B, T_target, T_source) 0/1 float: a single 1 at (first target token of word w, first source
    token of word w) for every word w present in both (parity points a.word_start_map and
    e.word_start_map)."""
    same_word = target_word_ids.unsqueeze(2) == source_word_ids.unsqueeze(1)
    starts = first_of_word(target_word_ids, target_lengths).unsqueeze(2) & first_of_word(
        source_word_ids, source_lengths
    ).unsqueeze(1)
    return (same_word & starts).float()


def word_end_mapping(target_word_ids, source_word_ids, target_lengths=None, source_lengths=None):
    """(B, T_target, T_source) 0/1 float: every valid target token of word w points at the last
    source token of word w."""
    same_word = target_word_ids.unsqueeze(2) == source_word_ids.unsqueeze(1)
    ends = valid_mask(target_word_ids, target_lengths).unsqueeze(2) & last_of_word(
        source_word_ids, source_lengths
    ).unsqueeze(1)
    return (same_word & ends).float()


def convert_embeds_by_word_end(embeds, target_word_ids, source_word_ids, target_lengths=None, source_lengths=None):
    """Move per-token embeddings (B, T_source, D) to the target token space (B, T_target, D): every
    target token gets the embedding of its word's last source token; padded rows are zero
    (parity point e.convert_embeds)."""
    mapping = word_end_mapping(target_word_ids, source_word_ids, target_lengths, source_lengths)
    return torch.bmm(mapping.to(embeds.dtype), embeds)


def llm_indices_from_asr(asr_indices, asr_word_ids, llm_word_ids, asr_lengths=None, llm_lengths=None):
    """``extract_vq``'s mapping (spec §3.6): TASTE codes per Whisper token (B, L, K) -> per Llama
    token (B, N, K) int64. The first Llama token of every word gets the codes of that word's first
    Whisper token; every other Llama token gets IGNORE (-1) in all K columns."""
    mapping = word_start_mapping(llm_word_ids, asr_word_ids, llm_lengths, asr_lengths)
    # Exactly one 1 per matched row, so a float64 product is exact for any code index.
    gathered = torch.bmm(mapping.double(), asr_indices.double()).long()
    has_code = mapping.sum(-1, keepdim=True) > 0
    return torch.where(has_code, gathered, torch.full_like(gathered, IGNORE))


def mean_pool_words(states: torch.Tensor, word_ids: torch.Tensor) -> torch.Tensor:
    """Word-level mean pooling of the audio tower (spec §3.4), batch 1.

    states (1, T, D) with T >= L = word_ids.shape[1]: each run of consecutive equal word ids among
    the first L rows is replaced (all its rows) by the run's mean; single-token words keep their
    exact row and rows after L (the ``<|endoftext|>`` state) are returned unchanged."""
    n = word_ids.shape[1]
    if n == 0:
        return states
    run, sizes = word_runs(word_ids[0].to(states.device))
    return torch.cat([mean_pool_runs(states[0, :n], run, sizes), states[0, n:]], dim=0).unsqueeze(0)


def word_runs(word_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T,) word ids -> (run number of every token (T,), size of that token's run (T,)), a run being
    consecutive equal ids: what ``mean_pool_runs`` takes."""
    starts = torch.ones(word_ids.shape[0], dtype=torch.bool, device=word_ids.device)
    starts[1:] = word_ids[1:] != word_ids[:-1]
    run = starts.long().cumsum(0) - 1
    return run, torch.bincount(run, minlength=word_ids.shape[0])[run]


def mean_pool_runs(rows: torch.Tensor, run: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """rows (T, D); run (T,) each row's run number (< T); sizes (T,) the size of each row's run ->
    every row of a run of two or more replaced by the run's mean, the others exactly as they are.
    One shape in, one out, no host reads: a captured step runs it too (``pooler_graph``)."""
    sums = torch.zeros_like(rows).index_add_(0, run, rows)
    size = sizes.unsqueeze(-1)
    return torch.where(size > 1, sums[run] / size.to(rows.dtype), rows)


def multi_token_word_spans(word_ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """(rows, 3) int64 ``(batch, start, end_exclusive)`` of every word (run of consecutive equal ids
    within the valid length) that has two or more tokens - the spans ``mean_pool_words`` averages
    (the original's ``words_index``; parity points a.segmenter.words_index and e.words_index).

    The original passes lengths that count the appended ``<|endoftext|>`` (L + 1); pass L here."""
    rows = []
    for b in range(word_ids.shape[0]):
        n = word_ids.shape[1] if lengths is None else min(int(lengths[b]), word_ids.shape[1])
        ids = word_ids[b, :n].tolist()
        start = 0
        for i in range(1, n + 1):
            if i == n or ids[i] != ids[start]:
                if i - start > 1:
                    rows.append((b, start, i))
                start = i
    return torch.tensor(rows, dtype=torch.long).reshape(-1, 3)


def word_rows(indices: torch.Tensor) -> torch.Tensor:
    """The valid (word-start) rows of (1, T, K) indices, in order: (W, K)."""
    return indices[0][indices[0, :, 0] != IGNORE]


def per_token_codes_from_word_codes(word_codes: torch.Tensor, word_ids: torch.Tensor) -> torch.Tensor:
    """Spread one code row per word (W, K) onto the tokens of each word (spec §6.1): (1, L, K)."""
    return word_codes[word_ids[0].long()].unsqueeze(0)
