"""TASTE tokenizer (``audio_tower.``): audio -> one 4-code TASTE token per word (spec §3).

A Whisper encoder reads the (padded) 30 s log-mel window. A 2-layer Whisper decoder, fed the
transcript's Whisper tokens, acts as a text-queried attention pooler: its cross-attention takes
keys from the final encoder output (where Whisper's text/audio alignment lives) and values from
the shallow layer-6 hidden state (which still carries prosody and speaker detail). The decoder
states are mean-pooled per word and residually quantised.

Weights live in transformers' ``WhisperEncoder`` / ``WhisperDecoder`` modules (their names equal
the published ones); the forward passes are written out here because the split key/value source
is not something transformers' Whisper offers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.whisper.modeling_whisper import WhisperDecoder, WhisperEncoder

from taste_speech.configuration_taste import TasteConfig
from taste_speech.modeling_rvq import ResidualVQ

# <|startoftranscript|> <|en|> <|transcribe|> <|notimestamps|> and <|endoftext|> of Whisper.
WHISPER_PROMPT_IDS = (50258, 50259, 50360, 50364)
WHISPER_EOT_ID = 50257


def whisper_attention(attn, hidden, key_source=None, value_source=None, causal=False, return_probs=False):
    """Whisper multi-head attention with keys and values from (possibly different) sources."""
    key_source = hidden if key_source is None else key_source
    value_source = key_source if value_source is None else value_source
    b, t, d = hidden.shape
    h = attn.num_heads
    hd = d // h
    q = (attn.q_proj(hidden) * attn.scaling).view(b, t, h, hd).transpose(1, 2)
    k = attn.k_proj(key_source).view(b, key_source.shape[1], h, hd).transpose(1, 2)
    v = attn.v_proj(value_source).view(b, value_source.shape[1], h, hd).transpose(1, 2)
    scores = q @ k.transpose(-1, -2)
    if causal:
        mask = torch.ones(t, k.shape[2], dtype=torch.bool, device=hidden.device).tril()
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = scores.softmax(dim=-1)
    out = (probs @ v).transpose(1, 2).reshape(b, t, d)
    out = attn.out_proj(out)
    return (out, probs) if return_probs else out


def _feed_forward(layer, x):
    return layer.fc2(F.gelu(layer.fc1(layer.final_layer_norm(x))))


@dataclass
class AudioTowerOutput:
    asr_indices: torch.Tensor  # (1, L, K) TASTE codes per Whisper token
    quantized_embeds: torch.Tensor  # (1, L, dim) decoded codes ("audio_unit_embeds")
    pooled_embeds: torch.Tensor  # (1, L, dim) word-pooled decoder states before the VQ
    encoder_target_hidden: torch.Tensor  # (1, frames/2, d) residual stream entering layer 6 (values)
    encoder_last_hidden: torch.Tensor  # (1, frames/2, d) final encoder output (keys)
    decoder_last_hidden: torch.Tensor  # (1, L+5, d)
    cross_attn_probs: list[torch.Tensor]  # per decoder layer (1, heads, L+5, frames/2)
    decoder_input_ids: torch.Tensor  # (1, L+5)


class JointEncoderSegmenter(nn.Module):
    """Container that reproduces the published module path
    ``audio_joint_encoder_segmenter.{audio_encoder.encoder, audio_segmenter.decoder}``."""

    def __init__(self, whisper_config):
        super().__init__()
        self.audio_encoder = nn.Module()
        self.audio_encoder.encoder = WhisperEncoder(whisper_config)
        self.audio_segmenter = nn.Module()
        self.audio_segmenter.decoder = WhisperDecoder(whisper_config)


class TasteVQ(nn.Module):
    def __init__(self, quantizer_kwargs: dict):
        super().__init__()
        self.rvq = ResidualVQ(
            dim=int(quantizer_kwargs["dim"]),
            num_quantizers=int(quantizer_kwargs["num_quantizers"]),
            codebook_size=int(quantizer_kwargs["codebook_size"]),
            codebook_dim=int(quantizer_kwargs["codebook_dim"]),
        )


class TasteAudioTower(nn.Module):
    def __init__(self, config: TasteConfig):
        super().__init__()
        tower = config.audio_tower_config
        if not tower.is_joint_encoder_segmenter:
            raise ValueError("only the joint encoder/segmenter audio tower (the published one) is supported")
        self.whisper_config = config.joint_whisper_config
        self.target_hidden_layer = tower.target_hidden_layer
        self.skip_prefix_idx = tower.skip_prefix_idx
        self.audio_joint_encoder_segmenter = JointEncoderSegmenter(self.whisper_config)
        self.vq = TasteVQ(tower.kwargs_for_quantizer)

    @property
    def encoder(self) -> WhisperEncoder:
        return self.audio_joint_encoder_segmenter.audio_encoder.encoder

    @property
    def decoder(self) -> WhisperDecoder:
        return self.audio_joint_encoder_segmenter.audio_segmenter.decoder

    @property
    def num_frames(self) -> int:
        """Mel frames the encoder window expects (3000 = 30 s for the published model)."""
        return 2 * self.whisper_config.max_source_positions

    @property
    def max_text_tokens(self) -> int:
        """Whisper tokens a transcript may have (448 decoder positions minus 5 specials)."""
        return self.whisper_config.max_target_positions - len(WHISPER_PROMPT_IDS) - 1

    def encode_audio(self, audio_features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(1, frames, n_mels) log-mel -> (target_hidden, last_hidden). Shorter inputs are
        right-padded with 0.0 (as the original does; nothing is masked)."""
        if audio_features.dim() != 3 or audio_features.shape[-1] != self.whisper_config.num_mel_bins:
            raise ValueError(
                f"audio_features must be (1, frames, {self.whisper_config.num_mel_bins}), got "
                f"{tuple(audio_features.shape)}; compute them with TasteProcessor"
            )
        frames = audio_features.shape[1]
        if frames > self.num_frames:
            raise ValueError(
                f"audio_features has {frames} frames but the audio tower takes at most {self.num_frames} "
                f"({self.num_frames // 100} s); split the audio into shorter turns"
            )
        enc = self.encoder
        dtype = enc.conv1.weight.dtype
        x = F.pad(audio_features.to(dtype), (0, 0, 0, self.num_frames - frames)).transpose(1, 2)
        x = F.gelu(enc.conv1(x))
        x = F.gelu(enc.conv2(x)).transpose(1, 2)
        h = x + enc.embed_positions.weight[: x.shape[1]]
        target = h
        for i, layer in enumerate(enc.layers):
            if i == self.target_hidden_layer:
                target = h
            h = h + whisper_attention(layer.self_attn, layer.self_attn_layer_norm(h))
            h = h + _feed_forward(layer, h)
        return target, enc.layer_norm(h)

    def pool_text(self, decoder_input_ids, keys_from, values_from):
        """The decoder as an attention pooler: returns final states and cross-attention probs."""
        dec = self.decoder
        positions = torch.arange(decoder_input_ids.shape[1], device=decoder_input_ids.device)
        g = dec.embed_tokens(decoder_input_ids) + dec.embed_positions.weight[positions]
        probs = []
        for layer in dec.layers:
            g = g + whisper_attention(layer.self_attn, layer.self_attn_layer_norm(g), causal=True)
            out, p = whisper_attention(
                layer.encoder_attn, layer.encoder_attn_layer_norm(g),
                key_source=keys_from, value_source=values_from, return_probs=True,
            )
            g = g + out
            probs.append(p)
            g = g + _feed_forward(layer, g)
        return dec.layer_norm(g), probs

    def forward(self, audio_features, asr_token_ids, asr_word_ids) -> AudioTowerOutput:
        if asr_token_ids.dim() != 2 or asr_token_ids.shape[0] != 1:
            raise ValueError(f"asr_token_ids must be (1, L), got {tuple(asr_token_ids.shape)}")
        if asr_word_ids.shape != asr_token_ids.shape:
            raise ValueError("asr_word_ids must have the same shape as asr_token_ids")
        n_tokens = asr_token_ids.shape[1]
        if n_tokens == 0:
            raise ValueError("the transcript has no Whisper tokens: give at least one word")
        if n_tokens > self.max_text_tokens:
            raise ValueError(
                f"the transcript has {n_tokens} Whisper tokens; the audio tower takes at most "
                f"{self.max_text_tokens}: split the turn"
            )
        target, last = self.encode_audio(audio_features)
        device = asr_token_ids.device
        prompt = torch.tensor([WHISPER_PROMPT_IDS], device=device)
        eot = torch.tensor([[WHISPER_EOT_ID]], device=device)
        decoder_input_ids = torch.cat([prompt, asr_token_ids.long(), eot], dim=1)
        decoder_states, probs = self.pool_text(decoder_input_ids, keys_from=last, values_from=target)
        states = decoder_states[:, self.skip_prefix_idx :].float()  # L transcript rows + the eot row
        pooled = word_mean_pool(states[:, :n_tokens], asr_word_ids)
        rvq = self.vq.rvq
        indices = rvq.quantize(pooled)
        return AudioTowerOutput(
            asr_indices=indices,
            quantized_embeds=rvq.decode(indices).float(),
            pooled_embeds=pooled,
            encoder_target_hidden=target,
            encoder_last_hidden=last,
            decoder_last_hidden=decoder_states,
            cross_attn_probs=probs,
            decoder_input_ids=decoder_input_ids,
        )


def word_mean_pool(states: torch.Tensor, word_ids: torch.Tensor) -> torch.Tensor:
    """Replace every row of a multi-token word by the mean of that word's rows (1, L, d)."""
    ids = word_ids[0].long()
    n_words = int(ids.max()) + 1
    sums = states.new_zeros(n_words, states.shape[-1]).index_add_(0, ids, states[0])
    counts = torch.bincount(ids, minlength=n_words).to(states.dtype).unsqueeze(-1)
    means = sums / counts
    single = (counts[ids] == 1)  # single-token words keep their exact row
    return torch.where(single, states[0], means[ids]).unsqueeze(0)
