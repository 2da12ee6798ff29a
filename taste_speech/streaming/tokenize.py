"""taste_tokenize: a user's spoken turn -> TASTE codes aligned to its Llama text ids."""

from __future__ import annotations

import numpy as np
import torch

from taste_speech.word_alignment import llm_indices_from_asr

SILENCE_PEAK = 1e-4  # a turn whose loudest sample is below this holds no speech


@torch.no_grad()
def taste_tokenize(model, processor, audio, text_ids, sampling_rate: int = 16000) -> torch.Tensor:
    """(1, S, K) long TASTE ids for ``text_ids`` (1, S): each word's 4 codes on its first token,
    -1 on its other tokens (the original ``extract_vq`` mapping). ``audio`` (1, T) or (T,) at any
    rate; turns longer than the audio tower's window (30 s for the published model) must be
    split by the caller (an error says so)."""
    text_ids = torch.as_tensor(text_ids)
    if text_ids.dim() != 2 or text_ids.shape[0] != 1:
        raise ValueError(f"text_ids must have shape (1, S), got {tuple(text_ids.shape)}")
    wav = processor.prepare_audio(audio, sampling_rate)
    if float(np.abs(wav).max()) < SILENCE_PEAK:
        raise ValueError("the audio is silent (peak below -80 dBFS): there is nothing to tokenize")
    text = processor.align_llm_ids(text_ids)
    device = next(model.parameters()).device
    features = processor.audio_features(wav, 16000).to(device)
    tower = model.audio_tower
    asr_indices = tower(features, text.asr_token_ids.to(device), text.asr_word_ids.to(device)).asr_indices
    return llm_indices_from_asr(asr_indices.cpu(), text.asr_word_ids, text.llm_word_ids).long()
