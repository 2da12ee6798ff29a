"""Random tiny voice generators (for tests, CI and the tiny-checkpoint builder).

Default random init gives an F0 far below the 10 Hz voicing threshold (the harmonic source would
stay silent) and an arbitrary output level. :func:`make_tiny_voice_generator` calibrates two
heads on a mel that the random flow itself produces, so a tiny checkpoint "speaks" noisy,
voiced, speech-level audio: F0 mean ~140 Hz (std ~50) and waveform RMS ~0.1.
"""

from __future__ import annotations

import copy
import math
from typing import Optional

import torch

from taste_speech.voice_generator.config import TINY

F0_MEAN_HZ, F0_STD_HZ = 140.0, 50.0
TARGET_RMS = 0.1


def tiny_config(vocab_size: int = 4096, spk_embed_dim: int = 192, overrides: Optional[dict] = None) -> dict:
    config = copy.deepcopy(TINY)
    config["flow"].update(vocab_size=vocab_size, spk_embed_dim=spk_embed_dim)
    for section, args in (overrides or {}).items():
        config.setdefault(section, {}).update(args.get("args", args))
    return config


@torch.no_grad()
def _upstream_estimator_init(estimator: torch.nn.Module) -> None:
    """The estimator's own init upstream (Kaiming-normal convs and linears, zero biases, unit
    GroupNorms): its random output then depends on context as strongly as the reference's."""
    for module in estimator.modules():
        if isinstance(module, (torch.nn.Conv1d, torch.nn.Linear)):
            torch.nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, torch.nn.GroupNorm):
            torch.nn.init.ones_(module.weight)
            torch.nn.init.zeros_(module.bias)


@torch.no_grad()
def make_tiny_voice_generator(seed: int = 0, config: Optional[dict] = None, *, vocab_size: int = 4096,
                              spk_embed_dim: int = 192):
    """A calibrated random VoiceGenerator (tiny sizes unless ``config`` says otherwise), in eval mode."""
    from taste_speech.voice_generator import VoiceGenerator

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = VoiceGenerator(tiny_config(vocab_size, spk_embed_dim, config)).eval()
        _upstream_estimator_init(model.flow.decoder.estimator)
        generator = torch.Generator().manual_seed(seed + 1)
        tokens = torch.randint(0, model.flow.vocab_size, (1, 100), generator=generator)
        speaker = torch.randn(1, model.flow.spk_embed_affine_layer.in_features, generator=generator)
        mel = model.flow.inference(tokens, speaker, generator=generator)

        # F0 head: an affine map of the condnet features with the wanted mean and spread.
        hift = model.hift
        features = hift.f0_predictor.condnet(mel).transpose(1, 2)[0]  # (T, C)
        head = hift.f0_predictor.classifier
        raw = features @ head.weight[0]
        # (each calibrated value rounded: the float sums that measure it differ in their last bits
        # with torch's thread count, and the same seed must give the same bytes)
        scale = float(f"{F0_STD_HZ / float(raw.std().clamp_min(1e-6)):.3g}")
        head.weight.mul_(scale)
        head.bias.fill_(round(F0_MEAN_HZ - float(raw.mean()) * scale, 1))

        # Output level: the iSTFT is linear in the magnitude exp(x + b), so a bias shift scales the wave.
        wav = hift.inference(mel, generator=generator)
        rms = float(wav.pow(2).mean().sqrt().clamp_min(1e-8))
        half = hift.n_fft // 2 + 1
        hift.conv_post.bias[:half] += round(math.log(TARGET_RMS / rms), 3)
    return model
