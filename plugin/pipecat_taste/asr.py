"""The built-in ASR: a Whisper model (transformers) that gives each user turn its transcript when no
Pipecat STT service sits upstream (a phone stream or a browser carries audio only).

TASTE aligns the user's audio to the words of its transcript, so every turn needs one. The
published model was built around ``openai/whisper-large-v3`` (the checkpoint's ``asr_config``):

    asr = WhisperTranscriber.from_pretrained("openai/whisper-large-v3", device="cuda")   # or a local folder
    engine = TasteEngine.from_pretrained(..., asr=asr)

``random_tiny`` builds a random tiny Whisper over the tiny checkpoint's ASR tokenizer: like the
rest of the tiny checkpoint it only exercises the code path (its transcripts are gibberish).
"""

from __future__ import annotations

import os

import numpy as np


class WhisperTranscriber:
    def __init__(self, model, feature_extractor, tokenizer, *, device="cpu", language: str | None = "en",
                 max_new_tokens: int | None = 128):
        self.model, self.feature_extractor, self.tokenizer = model.eval(), feature_extractor, tokenizer
        self.device, self.language, self.max_new_tokens = device, language, max_new_tokens

    @classmethod
    def from_pretrained(cls, name_or_path: str, device: str = "cpu", dtype=None, language: str = "en"):
        import torch
        from transformers import AutoProcessor, WhisperForConditionalGeneration

        processor = AutoProcessor.from_pretrained(name_or_path)
        torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else None
        model = WhisperForConditionalGeneration.from_pretrained(name_or_path, torch_dtype=torch_dtype).to(device)
        return cls(model, processor.feature_extractor, processor.tokenizer, device=device, language=language)

    @classmethod
    def random_tiny(cls, checkpoint_dir: str, seed: int = 0):
        """A random 2-layer Whisper over ``checkpoint_dir/asr_tokenizer`` (tiny checkpoints only)."""
        import torch
        from transformers import AutoTokenizer, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

        tokenizer = AutoTokenizer.from_pretrained(os.path.join(checkpoint_dir, "asr_tokenizer"))
        vocab = len(tokenizer)
        config = WhisperConfig(vocab_size=vocab, num_mel_bins=80, d_model=32, encoder_layers=1, decoder_layers=1,
                               encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                               decoder_ffn_dim=64, max_source_positions=1500, max_target_positions=32,
                               decoder_start_token_id=0, eos_token_id=vocab - 1, pad_token_id=vocab - 1,
                               bos_token_id=0, suppress_tokens=[], begin_suppress_tokens=[])
        # Only pieces that read as (parts of) words, so the gibberish is at least made of words.
        import re

        wordish = re.compile(r"^ ?[a-z]{2,}$")
        config.suppress_tokens = [i for i in range(vocab) if not wordish.match(tokenizer.decode([i]))]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = WhisperForConditionalGeneration(config)
        model.generation_config.forced_decoder_ids = None
        model.generation_config.suppress_tokens = config.suppress_tokens
        model.generation_config.max_length = 7
        return cls(model, WhisperFeatureExtractor(feature_size=80), tokenizer, language=None, max_new_tokens=None)

    def __call__(self, audio16k: np.ndarray) -> str:
        import torch

        features = self.feature_extractor(np.asarray(audio16k, np.float32), sampling_rate=16000,
                                          return_tensors="pt").input_features
        features = features.to(self.device, next(self.model.parameters()).dtype)
        kwargs = {} if self.max_new_tokens is None else {"max_new_tokens": self.max_new_tokens}
        if self.language is not None:
            kwargs.update(language=self.language, task="transcribe")
        with torch.inference_mode():
            ids = self.model.generate(features, **kwargs)
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)[0].strip()
