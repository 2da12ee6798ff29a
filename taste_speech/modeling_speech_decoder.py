"""Speech decoder of TASTE (``speech_decoder.``): words + TASTE codes + speaker -> speech tokens.

A CosyVoice-v1-style autoregressive transformer (spec §6). The transcript's Whisper tokens and the
per-token TASTE embeddings are encoded by two small causal encoders and mixed; the AR decoder reads
``[SOS, speaker, fused text/TASTE rows…, TASK]`` and then emits 50 Hz speech tokens (vocab 4096,
EOS = 4096) one at a time. Decoding here keeps an explicit KV cache (``SpeechDecodeState``), so
each new token costs one position per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from taste_speech.configuration_taste import TasteConfig
from taste_speech.espnet_transformer import KVCache, RelPositionTransformer
from taste_speech.modeling_rvq import ResidualVQ
from taste_speech.word_alignment import IGNORE

# The audio-token encoder's block settings are fixed in the original code, not in the config.
AUDIO_ENCODER_BLOCKS, AUDIO_ENCODER_HEADS, AUDIO_ENCODER_UNITS = 2, 8, 2048
TOP_K = 25
MIN_LEN_RATIO, MAX_LEN_RATIO = 2, 20  # of the prefix length L + 3


class WeightedSumFusion(nn.Module):
    """F = softmax(weights)[0] * audio + softmax(weights)[1] * text (no normalisation)."""

    def __init__(self):
        super().__init__()
        self.weights = nn.Parameter(torch.zeros(2))  # 'balance' init

    def forward(self, audio, text):
        s_audio, s_text = self.weights.softmax(-1)
        return s_audio * audio + s_text * text


@dataclass
class SpeechDecodeState:
    """Explicit state of one speech-token decode (batch 1)."""

    cache: KVCache
    prefix_length: int
    min_len: int
    max_len: int
    tokens: list[int] = field(default_factory=list)
    last_logp: torch.Tensor | None = None  # log-probs for the next token (V+1,)
    finished: bool = False
    stop_reason: str | None = None  # 'eos' | 'max_len'


class TasteSpeechDecoder(nn.Module):
    def __init__(self, config: TasteConfig):
        super().__init__()
        c = config.speech_decoder_config
        self.speech_token_size = int(c.speech_token_size)
        self.eos_id = self.speech_token_size
        d_llm = int(c.llm_input_size)
        self.text_embedding = nn.Embedding(int(c.text_token_size), int(c.encoder_input_size))
        self.text_encoder = RelPositionTransformer(
            int(c.encoder_input_size), d_llm, int(c.encoder__attention_heads), int(c.encoder__linear_units),
            int(c.encoder__num_blocks), input_layer=c.encoder__input_layer, ffn_activation="silu",
            norm_names=("norm_mha", "norm_ff"), causal=int(c.encoder__static_chunk_size) > 0,
        )
        self.text_encoder_affine_layer = nn.Linear(d_llm, d_llm)
        self.audio_embed_affine_layer = nn.Linear(int(c.audio_encoder_input_size), int(c.encoder_input_size))
        self.audio_token_encoder = RelPositionTransformer(
            int(c.encoder_input_size), d_llm, AUDIO_ENCODER_HEADS, AUDIO_ENCODER_UNITS, AUDIO_ENCODER_BLOCKS,
            input_layer=c.encoder__input_layer, ffn_activation="silu",
            norm_names=("norm_mha", "norm_ff"), causal=int(c.encoder__static_chunk_size) > 0,
        )
        self.audio_token_encoder_affine_layer = nn.Linear(d_llm, d_llm)
        self.fuse_encoded_audio_text_module = WeightedSumFusion()
        self.llm_embedding = nn.Embedding(2, d_llm)  # row 0: SOS/EOS, row 1: task id
        self.llm = RelPositionTransformer(
            d_llm, int(c.llm_output_size), int(c.llm__attention_heads), int(c.llm__linear_units),
            int(c.llm__num_blocks), input_layer=c.llm__input_layer, ffn_activation="relu",
            norm_names=("norm1", "norm2"), causal=True,
        )
        self.llm_decoder = nn.Linear(int(c.llm_output_size), self.speech_token_size + 1)
        self.speech_embedding = nn.Embedding(self.speech_token_size, d_llm)
        self.spk_embed_affine_layer = nn.Linear(int(c.spk_embed_dim), d_llm)

    @property
    def dtype(self) -> torch.dtype:
        return self.llm_decoder.weight.dtype

    # -- conditioning (§6.1 - §6.3) ---------------------------------------------------------
    @staticmethod
    def audio_embeds_from_taste(rvq: ResidualVQ, taste_rows: torch.Tensor, asr_word_ids: torch.Tensor) -> torch.Tensor:
        """Per-word codes -> per-Whisper-token TASTE embeddings (1, L, dim).

        ``taste_rows`` (1, T, K) may carry IGNORE rows: the valid rows, in order, are one per word."""
        rows = taste_rows[0][(taste_rows[0] >= 0).all(-1)]
        n_words = int(asr_word_ids.max()) + 1
        if rows.shape[0] != n_words:
            raise ValueError(f"got {rows.shape[0]} TASTE codes for {n_words} words: they must match one to one")
        per_token = rows[asr_word_ids[0].long()].unsqueeze(0)
        return rvq.decode(per_token).float()

    def encode_text(self, asr_token_ids):
        return self.text_encoder_affine_layer(self.text_encoder(self.text_embedding(asr_token_ids.long())))

    def encode_audio(self, audio_unit_embeds):
        x = self.audio_embed_affine_layer(audio_unit_embeds.to(self.dtype))
        return self.audio_token_encoder_affine_layer(self.audio_token_encoder(x))

    def speaker_projection(self, speaker_embeds):
        return self.spk_embed_affine_layer(F.normalize(speaker_embeds.to(self.dtype), dim=-1)).unsqueeze(1)

    def prefix(self, speaker_embeds, audio_unit_embeds, asr_token_ids) -> torch.Tensor:
        """[SOS, speaker, fused rows (L), TASK] -> (1, L+3, d)."""
        if audio_unit_embeds.shape[1] != asr_token_ids.shape[1]:
            raise ValueError(
                f"audio_unit_embeds has {audio_unit_embeds.shape[1]} rows but there are "
                f"{asr_token_ids.shape[1]} ASR tokens: give one TASTE embedding per ASR token"
            )
        fused = self.fuse_encoded_audio_text_module(self.encode_audio(audio_unit_embeds), self.encode_text(asr_token_ids))
        sos, task = self.llm_embedding.weight[0], self.llm_embedding.weight[1]
        spk = self.speaker_projection(speaker_embeds)
        return torch.cat([sos.view(1, 1, -1), spk, fused, task.view(1, 1, -1)], dim=1)

    # -- teacher forcing ----------------------------------------------------------------------
    def forward(self, speaker_embeds, audio_unit_embeds, asr_token_ids, speech_token_ids):
        """Logits (1, P+S, V+1) of the AR decoder over [prefix, speech tokens]."""
        prefix = self.prefix(speaker_embeds, audio_unit_embeds, asr_token_ids)
        lm_input = torch.cat([prefix, self.speech_embedding(speech_token_ids.long())], dim=1)
        return self.llm_decoder(self.llm(lm_input)), lm_input

    # -- KV-cached decoding -------------------------------------------------------------------
    def start(self, prefix: torch.Tensor, min_len: int | None = None, max_len: int | None = None) -> SpeechDecodeState:
        """Prefill the prefix; the returned state holds log-probs for the first token."""
        p = prefix.shape[1]
        state = SpeechDecodeState(
            cache=self.llm.new_cache(), prefix_length=p,
            min_len=int(MIN_LEN_RATIO * p) if min_len is None else min_len,
            max_len=int(MAX_LEN_RATIO * p) if max_len is None else max_len,
        )
        self._feed(state, prefix)
        return state

    def _feed(self, state: SpeechDecodeState, rows: torch.Tensor) -> None:
        y = self.llm.forward_incremental(rows, state.cache)
        state.last_logp = F.log_softmax(self.llm_decoder(y[:, -1]).float(), dim=-1)[0]

    def choose(self, state: SpeechDecodeState, greedy: bool = False, generator=None) -> int:
        """Pick the next token from state.last_logp (EOS forbidden before min_len)."""
        logp = state.last_logp
        ignore_eos = len(state.tokens) < state.min_len
        if greedy:
            if ignore_eos:
                return int(logp[: self.eos_id].argmax())
            return int(logp.argmax())
        values, ids = logp.topk(TOP_K)
        probs = values.softmax(-1)
        while True:  # the original re-draws while EOS is not yet allowed
            token = int(ids[torch.multinomial(probs, 1, generator=generator)])
            if not (ignore_eos and token == self.eos_id):
                return token
            if bool((ids == self.eos_id).all()):
                return int(logp[: self.eos_id].argmax())

    def step(self, state: SpeechDecodeState, greedy: bool = False, generator=None) -> int | None:
        """Decode one token; returns it, or None when the utterance ended (EOS or max_len)."""
        if state.finished:
            return None
        if len(state.tokens) >= state.max_len:
            state.finished, state.stop_reason = True, "max_len"
            return None
        token = self.choose(state, greedy, generator)
        if token == self.eos_id:
            state.finished, state.stop_reason = True, "eos"
            return None
        state.tokens.append(token)
        self._feed(state, self.speech_embedding(torch.tensor([[token]], device=state.last_logp.device)))
        return token

    @torch.no_grad()
    def generate(self, prefix: torch.Tensor, greedy: bool = False, generator=None, return_logprobs: bool = False):
        state = self.start(prefix)
        logps = []
        while not state.finished:
            logps.append(state.last_logp)
            self.step(state, greedy, generator)
        tokens = torch.tensor([state.tokens], dtype=torch.int32, device=prefix.device)
        if return_logprobs:
            return tokens, torch.stack(logps), state
        return tokens

    @torch.no_grad()
    def generate_without_cache(self, prefix: torch.Tensor, greedy: bool = True, max_len=None):
        """Reference: recompute the whole sequence at every step (for tests)."""
        p = prefix.shape[1]
        min_len, max_len = MIN_LEN_RATIO * p, (MAX_LEN_RATIO * p if max_len is None else max_len)
        tokens: list[int] = []
        x = prefix
        while len(tokens) < max_len:
            logp = F.log_softmax(self.llm_decoder(self.llm(x)[:, -1]).float(), dim=-1)[0]
            token = int(logp[: self.eos_id].argmax()) if len(tokens) < min_len else int(logp.argmax())
            if token == self.eos_id:
                break
            tokens.append(token)
            x = torch.cat([x, self.speech_embedding(torch.tensor([[token]], device=x.device))], dim=1)
        return torch.tensor([tokens], dtype=torch.int32, device=prefix.device)
