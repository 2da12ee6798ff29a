"""VoiceGenerator: speech tokens + speaker x-vector -> 22.05 kHz waveform (spec §7).

Weight-compatible with TASTE's ``cosyvoice/voice_generator.pth`` (CosyVoice-300M v1 flow + HiFT):
``VoiceGenerator.from_pretrained(checkpoint_dir)`` reads it safely and checks every key and shape.

    vg = VoiceGenerator.from_pretrained("Llama-1B-TASTE-V0")         # or a path to the .pth
    wav, sr = vg.inference(speech_ids, speaker_embeds)               # (1, 256*T) float, 22050

Randomness: the flow's ODE start noise and HiFT's source draws. Pass a ``torch.Generator`` for
reproducible output, or inject the draws (``flow_noise``, ``source_draws``) for exact parity.

Unlike upstream, which leaves the module in training mode (encoder dropout 0.1 active at
inference, spec "train-mode quirk"), our modules are put in eval mode on load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from taste_speech.voice_generator.config import FULL_SIZE, TINY, resolve_config, to_golden_layout
from taste_speech.voice_generator.flow import MelFlow, mel_frames_for_tokens
from taste_speech.voice_generator.hift import HiFTGenerator, SourceDraws
from taste_speech.voice_generator.loading import (
    CONFIG_NAME,
    PUBLISHED_WEIGHTS,
    check_state_dict,
    read_state_dict,
    resolve_weights_path,
)

__all__ = [
    "VoiceGenerator",
    "SourceDraws",
    "mel_frames_for_tokens",
    "write_tiny_voice_generator",
    "FULL_SIZE",
    "TINY",
]

OUTPUT_SAMPLING_RATE = 22050


class VoiceGenerator(nn.Module):
    """``flow`` (speech tokens -> mel) and ``hift`` (mel -> waveform); keys ``flow.*`` / ``hift.*``."""

    output_sampling_rate = OUTPUT_SAMPLING_RATE

    def __init__(self, config: Optional[dict] = None):
        super().__init__()
        cfg = resolve_config(config)
        self.config = cfg
        cfm = cfg["flow.decoder"]["cfm_params"]
        self.flow = MelFlow(
            flow_args=cfg["flow"],
            encoder_args=cfg["flow.encoder"],
            regulator_args=cfg["flow.length_regulator"],
            cfm_args=dict(
                inference_cfg_rate=cfm["inference_cfg_rate"],
                solver=cfm["solver"],
                t_scheduler=cfm["t_scheduler"],
                n_timesteps=cfg["inference"]["flow_inference_n_timesteps"],
                temperature=cfg["inference"]["temperature"],
            ),
            estimator_args=cfg["flow.decoder.estimator"],
        )
        self.hift = HiFTGenerator(**cfg["hift"], f0_predictor=cfg["hift.f0_predictor"])
        if self.hift.sampling_rate != OUTPUT_SAMPLING_RATE:
            raise ValueError("the flow's frame formula assumes 22050 Hz HiFT output; hift.sampling_rate must be 22050")

    @property
    def samples_per_token(self) -> float:
        return OUTPUT_SAMPLING_RATE / 50

    # -- loading ------------------------------------------------------------------------------
    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], config: Optional[dict] = None,
                        source: str = "state dict") -> "VoiceGenerator":
        model = cls(config)
        check_state_dict(model, state, source)
        model.load_state_dict(state, strict=True)
        return model.eval()

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, config: Optional[dict] = None,
                        device: Optional[torch.device | str] = None) -> "VoiceGenerator":
        """Load ``cosyvoice/voice_generator.pth`` from a TASTE checkpoint folder (or a weight file).

        The architecture is the published full size unless ``config`` is given or a
        ``voice_generator_config.json`` sits next to the weights (tiny test checkpoints).
        """
        from taste_speech.modeling_taste import resolve_device

        device = resolve_device(device) if device is not None else None  # fails before reading weights
        weights = resolve_weights_path(path)
        if config is None and (weights.parent / CONFIG_NAME).is_file():
            config = json.loads((weights.parent / CONFIG_NAME).read_text())
        model = cls.from_state_dict(read_state_dict(weights), config, source=str(weights))
        return model.to(device) if device is not None else model

    @classmethod
    def from_golden_dir(cls, directory: str | os.PathLike) -> "VoiceGenerator":
        """A golden reference folder: ``config.json`` (constructor arguments) + ``weights.safetensors``."""
        directory = Path(directory)
        config = json.loads((directory / "config.json").read_text())
        weights = directory / "weights.safetensors"
        return cls.from_state_dict(read_state_dict(weights), config, source=str(weights))

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write ``cosyvoice/voice_generator.pth`` (published layout) + our config file next to it."""
        target = Path(directory) / PUBLISHED_WEIGHTS
        target.parent.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}, target)
        (target.parent / CONFIG_NAME).write_text(json.dumps(to_golden_layout(self.config), indent=1))
        return target

    # -- inference ----------------------------------------------------------------------------
    @torch.inference_mode()
    def inference(
        self,
        speech_token_ids: torch.Tensor,
        speaker_embeds: torch.Tensor,
        *,
        generator: Optional[torch.Generator] = None,
        flow_noise: Optional[torch.Tensor] = None,
        source_draws: Optional[SourceDraws] = None,
    ) -> tuple[torch.Tensor, int]:
        """Whole-utterance synthesis like upstream ``VoiceGenerator.inference`` (empty prompt).

        speech_token_ids (1, N) in [0, vocab); speaker_embeds (1, 192) x-vector.
        Returns (waveform (1, 256 * T) float32 on CPU, 22050) with T = int(N / 50 * 22050 / 256).
        """
        speech_token_ids = self.flow.check_tokens(torch.as_tensor(speech_token_ids))
        if speech_token_ids.shape[1] == 0:
            raise ValueError("no speech tokens to synthesise (got an empty (1, 0) tensor)")
        mel = self.flow.inference(speech_token_ids, speaker_embeds, noise=flow_noise, generator=generator)
        wav = self.hift.inference(mel, draws=source_draws, generator=generator)
        return wav.float().cpu(), OUTPUT_SAMPLING_RATE


def write_tiny_voice_generator(directory: str | os.PathLike, seed: int = 0, *, vocab_size: int = 4096,
                               spk_embed_dim: int = 192, config: Optional[dict] = None) -> Path:
    """Random tiny voice generator in the published layout: ``<directory>/cosyvoice/voice_generator.pth``
    plus ``cosyvoice/voice_generator_config.json`` (which ``from_pretrained`` picks up). Returns the
    weight path.

    ``vocab_size`` must cover the speech decoder's speech-token ids and ``spk_embed_dim`` must equal
    the speaker x-vector size the pipeline passes (the same vector feeds the speech decoder).
    Weights come from default init under ``seed``, then the F0 head and output level are calibrated
    so the output is voiced, speech-level noise rather than silence (see ``tiny.py``).
    """
    from taste_speech.voice_generator.tiny import make_tiny_voice_generator

    model = make_tiny_voice_generator(seed, config, vocab_size=vocab_size, spk_embed_dim=spk_embed_dim)
    return model.save_pretrained(directory)
