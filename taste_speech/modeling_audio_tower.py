"""TASTE tokenizer (``audio_tower.``): audio + transcript -> one 4-code TASTE token per word (spec §3).

A Whisper encoder reads the (padded) 30 s log-mel window. A 2-layer Whisper decoder, fed the
transcript's Whisper tokens, acts as a text-queried attention pooler: its cross-attention takes
keys from the final encoder output (where Whisper's text/audio alignment lives) and values from
the shallow hidden state entering encoder layer 6 (which still carries prosody and speaker
detail). The decoder states are mean-pooled per word and residually quantised.

Weights live in transformers' ``WhisperEncoder`` / ``WhisperDecoder`` modules (their parameter
names equal the published ones); the forward passes are written out here because the split
key/value source is not something transformers' Whisper offers. Attention is plain eager math,
as in the original.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.whisper.modeling_whisper import WhisperDecoder, WhisperEncoder

from taste_speech.configuration_taste import TasteConfig
from taste_speech.modeling_rvq import ResidualVQ
from taste_speech.word_alignment import llm_indices_from_asr, mean_pool_words

# <|startoftranscript|> <|en|> <|transcribe|> <|notimestamps|>, and <|endoftext|> of Whisper
# (hard-coded by the original, so the Whisper vocabulary must stay 51866).
WHISPER_PROMPT_IDS = (50258, 50259, 50360, 50364)
WHISPER_EOT_ID = 50257


def whisper_attention(attn, hidden, key_source=None, value_source=None, causal=False, probabilities=True):
    """Whisper multi-head attention (``attn`` is a transformers WhisperAttention, used for its
    weights) whose keys and values may come from different tensors.

    Returns (output (B, T, d), attention probabilities (B, heads, T, S)); with ``probabilities``
    False, (output, None) from one fused attention kernel: the encoder's self-attention over its
    1500 frames would otherwise write, normalise and read back a (B, heads, 1500, 1500) score
    tensor in every layer (the same math; equal up to float rounding)."""
    key_source = hidden if key_source is None else key_source
    value_source = key_source if value_source is None else value_source
    b, t, d = hidden.shape
    s = key_source.shape[1]
    heads, head_dim = attn.num_heads, attn.head_dim
    q = (attn.q_proj(hidden) * attn.scaling).view(b, t, heads, head_dim).transpose(1, 2)
    k = attn.k_proj(key_source).view(b, s, heads, head_dim).transpose(1, 2)
    v = attn.v_proj(value_source).view(b, s, heads, head_dim).transpose(1, 2)
    if not probabilities:  # (q is scaled already, as Whisper scales it: scale 1 here)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=1.0)
        return attn.out_proj(out.transpose(1, 2).reshape(b, t, d)), None
    scores = q @ k.transpose(-1, -2)
    if causal:
        future = torch.ones(t, s, dtype=torch.bool, device=hidden.device).triu(1)
        scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
    probs = scores.softmax(dim=-1)
    out = (probs @ v).transpose(1, 2).reshape(b, t, d)
    return attn.out_proj(out), probs


def whisper_feed_forward(layer, hidden):
    """Pre-LN feed-forward block of a Whisper encoder/decoder layer (without the residual)."""
    return layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(hidden))))


@dataclass
class AudioTowerOutput:
    """Result of one audio-tower pass (batch 1). L = transcript Whisper tokens."""

    asr_indices: torch.Tensor  # (1, L, K) int64: TASTE codes per Whisper token (all tokens of a word equal)
    audio_unit_embeds: torch.Tensor  # (1, L, dim) fp32: RVQ decode of asr_indices (quantised features)
    segmented_feats_with_eos: torch.Tensor  # (1, L+1, d) fp32: decoder states after prefix skip + word pooling
    encoder_target_hidden: torch.Tensor  # (1, S, d): residual stream entering encoder layer 6 (the values)
    encoder_last_hidden: torch.Tensor  # (1, S, d): final encoder output (the keys)
    decoder_input_ids: torch.Tensor  # (1, L+5): prompt + transcript + <|endoftext|>
    decoder_last_hidden: torch.Tensor  # (1, L+5, d): decoder output after its final LayerNorm
    cross_attn_probs: tuple[torch.Tensor, ...]  # per decoder layer (1, heads, L+5, S)

    @property
    def pooled_embeds(self) -> torch.Tensor:
        """(1, L, d): the word-pooled features fed to the quantiser (eos row dropped)."""
        return self.segmented_feats_with_eos[:, :-1]


class _Container(nn.Module):
    """A bare module that only holds named children (reproduces the published key paths)."""


class JointEncoderSegmenter(nn.Module):
    """``audio_joint_encoder_segmenter.{audio_encoder.encoder, audio_segmenter.decoder}``."""

    def __init__(self, whisper_config):
        super().__init__()
        self.audio_encoder = _Container()
        self.audio_encoder.encoder = WhisperEncoder(whisper_config)
        self.audio_segmenter = _Container()
        self.audio_segmenter.decoder = WhisperDecoder(whisper_config)


class TasteVQ(nn.Module):
    """``vq.rvq``: the residual quantiser."""

    def __init__(self, tower_config):
        super().__init__()
        self.rvq = ResidualVQ(
            dim=tower_config.vq_dim,
            num_quantizers=tower_config.num_quantizers,
            codebook_size=tower_config.codebook_size,
            codebook_dim=tower_config.codebook_dim,
        )


class TasteAudioTower(nn.Module):
    def __init__(self, config: TasteConfig):
        super().__init__()
        tower = config.audio_tower_config
        joint = tower.kwargs_for_joint_encoder_segmenter
        forward_type = joint.get("forward_type", "asr_attn_pooling")
        if not tower.is_joint_encoder_segmenter or forward_type != "asr_attn_pooling":
            raise ValueError(
                "only the joint encoder/segmenter audio tower with forward_type 'asr_attn_pooling' (the "
                "published configuration) is supported"
            )
        if not joint.get("is_word_level", True):
            raise ValueError("only word-level pooling (is_word_level true, the published setting) is supported")
        self.whisper_config = config.joint_whisper_config
        self.target_hidden_layer = tower.target_hidden_layer
        self.skip_prefix_idx = tower.skip_prefix_idx
        if not 0 <= self.target_hidden_layer <= self.whisper_config.encoder_layers:
            raise ValueError(
                f"target_hidden_layer {self.target_hidden_layer} is outside the encoder's "
                f"0..{self.whisper_config.encoder_layers} hidden states"
            )
        if self.skip_prefix_idx != len(WHISPER_PROMPT_IDS):
            raise ValueError(f"skip_prefix_idx must be {len(WHISPER_PROMPT_IDS)} (the Whisper prompt length)")
        self.audio_joint_encoder_segmenter = JointEncoderSegmenter(self.whisper_config)
        self.vq = TasteVQ(tower)
        # The encoder's self-attention as one fused kernel (no probabilities are kept from it); False:
        # the scores written out, as the original computes them (the benchmarks' baseline).
        self.fused_encoder_attention = True

    @property
    def encoder(self) -> WhisperEncoder:
        return self.audio_joint_encoder_segmenter.audio_encoder.encoder

    @property
    def decoder(self) -> WhisperDecoder:
        return self.audio_joint_encoder_segmenter.audio_segmenter.decoder

    @property
    def rvq(self) -> ResidualVQ:
        return self.vq.rvq

    @property
    def num_frames(self) -> int:
        """Mel frames of the encoder window (3000 = 30 s for the published model)."""
        return 2 * self.whisper_config.max_source_positions

    @property
    def max_text_tokens(self) -> int:
        """Whisper tokens a transcript may have (448 decoder positions minus 5 specials = 443)."""
        return self.whisper_config.max_target_positions - len(WHISPER_PROMPT_IDS) - 1

    # -- encoder ------------------------------------------------------------------------------
    def encode_audio(self, audio_features: torch.Tensor, encoder=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(1, frames, n_mels) log-mel -> (target_hidden, last_hidden), each (1, S, d).

        Shorter inputs are right-padded with 0.0 to the full window, as the original does; nothing
        is masked (the encoder and the cross-attention see the padding). ``encoder``: an
        ``EncoderGraph`` of this tower to run the fixed-shape stack with (None: eagerly).
        ``audio_features`` None: ``encoder()`` gives the outputs made already (``taste_tokenize``
        with an ``EncodedTurn``: the built-in ASR's pass over the same window)."""
        if audio_features is None:
            if encoder is None:
                raise ValueError("audio_features are needed to encode a turn (only an encoder that gives the outputs "
                                 "made already goes without them)")
            return encoder(None)
        window = self.encoder_window(audio_features)
        return self.encoder_stack(window) if encoder is None else encoder(window)

    def encoder_window(self, audio_features: torch.Tensor) -> torch.Tensor:
        """(1, frames, n_mels) log-mel -> (1, n_mels, num_frames): checked, right-padded, in the encoder's dtype."""
        n_mels = self.whisper_config.num_mel_bins
        if audio_features.dim() != 3 or audio_features.shape[0] != 1 or audio_features.shape[-1] != n_mels:
            raise ValueError(
                f"audio_features must be (1, frames, {n_mels}) log-mel features, got "
                f"{tuple(audio_features.shape)}; compute them with TasteProcessor"
            )
        frames = audio_features.shape[1]
        if frames > self.num_frames:
            raise ValueError(
                f"audio_features has {frames} frames but the audio tower takes at most {self.num_frames} "
                f"({self.num_frames / 100:g} s); split the audio into shorter turns"
            )
        weight = self.encoder.conv1.weight
        x = audio_features.to(device=weight.device, dtype=weight.dtype)
        return F.pad(x, (0, 0, 0, self.num_frames - frames)).transpose(1, 2)  # (1, n_mels, frames)

    def encoder_stack(self, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The Whisper encoder on a padded window (1, n_mels, num_frames): one shape for every turn."""
        enc = self.encoder
        x = F.gelu(enc.conv1(window))
        x = F.gelu(enc.conv2(x)).transpose(1, 2)  # stride 2 -> (1, S, d)
        h = x + enc.embed_positions.weight[: x.shape[1]]
        target = None
        for i, layer in enumerate(enc.layers):
            if i == self.target_hidden_layer:
                target = h
            h = h + whisper_attention(layer.self_attn, layer.self_attn_layer_norm(h),
                                      probabilities=not self.fused_encoder_attention)[0]
            h = h + whisper_feed_forward(layer, h)
        if target is None:  # target_hidden_layer == encoder_layers: the stream before the final LN
            target = h
        return target, enc.layer_norm(h)

    # -- decoder as attention pooler ------------------------------------------------------------
    def decoder_input_ids(self, asr_token_ids: torch.Tensor) -> torch.Tensor:
        """(1, L) transcript ids -> (1, L+5) decoder ids: Whisper prompt + transcript + <|endoftext|>."""
        device = asr_token_ids.device
        prompt = torch.tensor([WHISPER_PROMPT_IDS], dtype=torch.long, device=device)
        eot = torch.tensor([[WHISPER_EOT_ID]], dtype=torch.long, device=device)
        return torch.cat([prompt, asr_token_ids.long(), eot], dim=1)

    def attention_pool(self, decoder_input_ids, keys_from, values_from):
        """Run the decoder with cross-attention keys from ``keys_from`` and values from
        ``values_from`` (``asr_attn_pooling``). Returns (states after the final LayerNorm
        (1, T, d), cross-attention probabilities per layer)."""
        dec = self.decoder
        ids = decoder_input_ids.to(dec.embed_tokens.weight.device)
        positions = torch.arange(ids.shape[1], device=ids.device)
        g = dec.embed_tokens(ids) + dec.embed_positions.weight[positions]  # no embedding scale
        probs = []
        for layer in dec.layers:
            g = g + whisper_attention(layer.self_attn, layer.self_attn_layer_norm(g), causal=True)[0]
            out, p = whisper_attention(
                layer.encoder_attn, layer.encoder_attn_layer_norm(g), key_source=keys_from, value_source=values_from
            )
            g = g + out
            probs.append(p)
            g = g + whisper_feed_forward(layer, g)
        return dec.layer_norm(g), tuple(probs)

    # -- full pass ------------------------------------------------------------------------------
    def forward(self, audio_features, asr_token_ids, asr_word_ids, encoder=None) -> AudioTowerOutput:
        """audio_features (1, frames<=num_frames, n_mels), asr_token_ids / asr_word_ids (1, L)
        (transcript Whisper tokens without specials and their 0-based word ids); ``encoder``: see
        :meth:`encode_audio`."""
        self._check_text(asr_token_ids, asr_word_ids)
        n_tokens = asr_token_ids.shape[1]
        target, last = self.encode_audio(audio_features, encoder)
        decoder_input_ids = self.decoder_input_ids(asr_token_ids)
        decoder_states, probs = self.attention_pool(decoder_input_ids, keys_from=last, values_from=target)
        # Drop the 4 prompt rows: L transcript rows + the <|endoftext|> row remain. fp32 from here
        # on (the original's final LayerNorm runs in fp32 under autocast; the RVQ is fp32).
        states = decoder_states[:, self.skip_prefix_idx :].float()
        segmented = mean_pool_words(states, asr_word_ids)
        self.rvq.check_initialised()  # never quantise with untrained (k-means pending) codebooks
        asr_indices = self.rvq.quantize(segmented[:, :n_tokens])
        return AudioTowerOutput(
            asr_indices=asr_indices,
            audio_unit_embeds=self.rvq.decode(asr_indices).float(),
            segmented_feats_with_eos=segmented,
            encoder_target_hidden=target,
            encoder_last_hidden=last,
            decoder_input_ids=decoder_input_ids,
            decoder_last_hidden=decoder_states,
            cross_attn_probs=probs,
        )

    def extract_vq(self, audio_features, asr_token_ids, asr_word_ids, llm_word_ids, encoder=None, pooler=None):
        """TASTE codes of a turn in both token spaces (the original's ``extract_vq``, batch 1):
        returns (asr_indices (1, L, K), llm_indices (1, N, K)); llm_indices holds the word's codes
        on the first Llama token of each word and -1 elsewhere. ``encoder``: see :meth:`encode_audio`.
        ``pooler``: a ``PoolerGraph`` of this tower to run the text side with (None: eagerly); with
        it the codes are made on the tower's device and mapped where the ids are (give host ids, and
        nothing waits for the GPU before the codes are read)."""
        if llm_word_ids.dim() != 2 or llm_word_ids.shape[0] != 1:
            raise ValueError(f"llm_word_ids must be (1, N), got {tuple(llm_word_ids.shape)}")
        if pooler is None:
            asr_indices = self(audio_features, asr_token_ids, asr_word_ids, encoder).asr_indices
        else:
            self._check_text(asr_token_ids, asr_word_ids)
            target, last = self.encode_audio(audio_features, encoder)
            asr_indices = pooler(self.decoder_input_ids(asr_token_ids), last, target, asr_word_ids)
            asr_indices = asr_indices.to(asr_word_ids.device)
        if llm_word_ids.device.type == "cpu" and asr_word_ids.device.type == "cpu":
            # (lists, not tensor reads: the benchmarks count those as the reads that wait for a GPU)
            llm_words, asr_words = {w for w in llm_word_ids[0].tolist() if w >= 0}, asr_word_ids[0].tolist()[-1] + 1
            if llm_words != set(range(asr_words)):
                raise ValueError(f"llm_word_ids number {len(llm_words)} word(s) for the {asr_words} of asr_word_ids: "
                                 "give both from one processor.process_text call of the same text")
        llm_indices = llm_indices_from_asr(asr_indices, asr_word_ids.to(asr_indices.device),
                                           llm_word_ids.to(asr_indices.device))
        return asr_indices, llm_indices

    def _check_text(self, asr_token_ids, asr_word_ids) -> None:
        if asr_token_ids.dim() != 2 or asr_token_ids.shape[0] != 1 or asr_token_ids.is_floating_point():
            raise ValueError(
                f"asr_token_ids must be an integer tensor (1, L), got {asr_token_ids.dtype} {tuple(asr_token_ids.shape)}"
            )
        if tuple(asr_word_ids.shape) != tuple(asr_token_ids.shape):
            raise ValueError(
                f"asr_word_ids {tuple(asr_word_ids.shape)} must have the shape of asr_token_ids "
                f"{tuple(asr_token_ids.shape)}: one word id per Whisper token"
            )
        n_tokens = asr_token_ids.shape[1]
        if n_tokens == 0:
            raise ValueError("the transcript has no Whisper tokens: give at least one word")
        if n_tokens > self.max_text_tokens:
            raise ValueError(
                f"the transcript has {n_tokens} Whisper tokens; the audio tower takes at most "
                f"{self.max_text_tokens}: split the turn"
            )
        if asr_token_ids.device.type == "cpu" and asr_word_ids.device.type == "cpu":
            # (values of host ids only: reading device ids would wait for the GPU - the caller's
            # processor makes host ids, and the device path is given them)
            ids, words = asr_token_ids[0].tolist(), asr_word_ids[0].tolist()
            vocab = self.whisper_config.vocab_size
            if min(ids) < 0 or max(ids) >= vocab:
                raise ValueError(f"asr_token_ids must lie in [0, {vocab}) (Whisper transcript tokens, as "
                                 f"processor.process_text makes them), got ids from {min(ids)} to {max(ids)}")
            if words[0] != 0 or any(b - a not in (0, 1) for a, b in zip(words, words[1:])):
                raise ValueError("asr_word_ids must start at 0 and grow by at most 1 per token (0, 0, 1, 2, 2, ...): "
                                 "use the word ids processor.process_text makes with the ids")
