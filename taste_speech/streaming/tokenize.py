"""taste_tokenize: a spoken turn -> TASTE codes aligned to its Llama text ids."""

from __future__ import annotations

import numpy as np
import torch

from taste_speech.device_copies import to_device
from taste_speech.processing_taste import SILENCE_PEAK
from taste_speech.sampler import special_token_ids


@torch.no_grad()
def taste_tokenize(model, processor, audio, text_ids, sampling_rate: int, *, encoder=None,
                   pooler=None, encoded=None) -> torch.Tensor:
    """(1, S, K) int64 TASTE ids for ``text_ids`` (1, S): each word's K codes on its first token,
    -1 on its other tokens - the original ``extract_vq`` mapping.

    ``audio``: the turn's waveform, (1, T), (T,) or (C, T), at ``sampling_rate`` Hz (required, any
    rate: resampled to 16 kHz, channels averaged). ``text_ids``: the Llama ids of its transcript,
    without special tokens - ``processor.process_text(text).llm_token_ids``; words are the groups
    that start at a piece with a leading space (how the processor encodes every word). The audio
    tower sees one window (30 s for the published model): longer turns raise and must be split by
    the caller, e.g. at pauses, each piece with its own part of the transcript. ``encoder``: an
    ``EncoderGraph`` of the model's audio tower (its Whisper encoder as a CUDA graph), or None.
    ``pooler``: a ``PoolerGraph`` of it (its text side - attention pooler, word means, RVQ - as
    CUDA graphs, one per length bucket), or None. ``encoded``: an ``EncodedTurn``, the tower
    encoder's outputs made already for this turn (the built-in ASR's final pass when it shares the
    tower's encoder): used instead of encoding again when its audio is this turn's, else ignored.
    """
    text_ids = _check_text_ids(text_ids)
    check_llm_ids(processor, text_ids, "text_ids")
    check_no_special_ids(processor, text_ids)
    wav = processor.prepare_audio(audio, sampling_rate)  # mono 16 kHz; empty / NaN / too short / too long raise
    peak = float(np.abs(wav).max()) if wav.size else 0.0
    if peak < SILENCE_PEAK:
        raise ValueError(f"the audio is silent (peak {peak:.1e}, below -80 dBFS): there is no speech to tokenize")
    text = processor.align_llm_ids(text_ids)  # raises when the ids decode to no words
    if not any(ch.isalnum() for word in text.words for ch in word):  # e.g. Whisper's "." on a noise
        raise ValueError(f"the transcript {''.join(text.words).strip()!r} has no spoken words (only punctuation): "
                         "give the words said in the audio")
    limit = getattr(processor, "max_asr_tokens", None)
    if limit is not None and text.asr_token_ids.shape[1] > limit:
        raise ValueError(f"the transcript has {text.asr_token_ids.shape[1]} ASR tokens; the audio tower takes at most "
                         f"{limit}: split the turn into shorter pieces")
    device = model.audio_tower.vq.rvq.project_out.weight.device
    if encoded is not None and encoded.matches(wav):
        outputs = encoded.use_here()
        features, encoder = None, lambda window: outputs  # (no window: the outputs are made)
    else:
        # (pinned on CUDA: the copy does not wait for the kernels queued before it, other calls')
        features = to_device(processor.audio_features(wav, 16000), device)
    # with a pooler the ids stay on the host (it reads them there), so the codes' read is the one wait
    ids_device = device if pooler is None else torch.device("cpu")
    _, llm_indices = model.extract_vq(features, text.asr_token_ids.to(ids_device), text.asr_word_ids.to(ids_device),
                                      text.llm_word_ids.to(ids_device), encoder=encoder, pooler=pooler)
    if llm_indices.shape[1] != text_ids.shape[1]:  # the processor keeps the given ids; guard the contract
        raise ValueError(f"internal alignment error: {llm_indices.shape[1]} code rows for {text_ids.shape[1]} text ids")
    return llm_indices.long().cpu()


def _check_text_ids(text_ids) -> torch.Tensor:
    if not isinstance(text_ids, torch.Tensor):
        raise ValueError(f"text_ids must be a torch.Tensor of shape (1, S), got {type(text_ids).__name__}")
    if text_ids.dim() != 2 or text_ids.shape[0] != 1:
        raise ValueError(f"text_ids must have shape (1, S) (batch 1), got {tuple(text_ids.shape)}")
    if text_ids.dtype.is_floating_point or text_ids.dtype == torch.bool:
        raise ValueError(f"text_ids must be an integer tensor, got {text_ids.dtype}")
    if text_ids.shape[1] == 0:
        raise ValueError("text_ids is empty: give the Llama ids of the turn's transcript")
    return text_ids.long().cpu()


def check_no_special_ids(processor, text_ids: torch.Tensor, name: str = "text_ids") -> None:
    """Words have no special tokens; ``tokenizer(text)`` adds <|begin_of_text|>, which would be
    glued to the first word and shift the word alignment (in a turn fed to the LM: a second start
    of text inside the history; in speech: spoken as a word)."""
    specials = special_token_ids(processor.llm_tokenizer)
    found = sorted({int(i) for i in text_ids.reshape(-1).tolist() if int(i) in specials})
    if found:
        names = [processor.llm_tokenizer.decode([i]) for i in found]
        raise ValueError(f"{name} contain special token ids {found} {names}: words have none - encode the text with "
                         "processor.process_text(text).llm_token_ids (not tokenizer(text), which adds "
                         "<|begin_of_text|>)")


def check_llm_ids(processor, ids: torch.Tensor, name: str) -> None:
    """Ids outside the tokenizer's vocabulary would fail deep in decoding (or decode to nothing)."""
    if ids.numel() == 0:
        return
    vocab = len(processor.llm_tokenizer)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"{name} must be Llama token ids in [0, {vocab}), got values in [{low}, {high}]: "
                         "encode the text with processor.process_text(text).llm_token_ids")
