"""Speech decoder of TASTE (``speech_decoder.``): words + TASTE codes + speaker -> speech tokens.

A CosyVoice-v1-style autoregressive transformer (spec §6). The transcript's Whisper tokens and the
per-token TASTE embeddings are encoded by two small causal encoders and mixed; the AR decoder
``llm`` reads the prefix ``[SOS, speaker, fused rows F_0..F_{L-1}, TASK]`` (P = L + 3 rows) and
then emits 50 Hz S3 speech tokens (vocabulary ``speech_token_size``, EOS = ``speech_token_size``)
one at a time.

Decoding keeps an explicit per-layer KV cache in a ``SpeechDecodeState``: the prefix is fed once,
then every step feeds only the newest token (work per step: one position per layer, attending to
the cache). The original's rules are kept: min_len = 2P and max_len = 20P tokens, EOS is not
accepted before min_len (re-drawn when sampling, best non-EOS when greedy). Token choice is
pluggable: ``TopKSampler`` (the original's top-25 multinomial, with an optional torch.Generator)
or ``GreedySampler`` (arg-max; what the golden reference data used).

The RVQ that turns TASTE codes into embeddings belongs to the audio tower; it is passed in as an
argument and never registered here (its weights live under ``audio_tower.vq.rvq``).

Typical use (batch 1)::

    audio = decoder.audio_embeds_from_taste(rvq, taste_rows, asr_word_ids)      # (1, L, dim)
    prefix = decoder.prefix_embeds(speaker_embeds, audio, asr_token_ids)         # (1, L+3, d)
    out = decoder.generate(prefix, sampler=TopKSampler(generator=g))             # SpeechGeneration

Token by token (for streaming)::

    state = decoder.start(prefix)
    while (token := decoder.step(state, sampler)) is not None:
        ...

Cache: ``start`` takes a cache from ``new_cache`` (default ``new_cache('auto')``): 'dynamic' is the
growing ``KVCache`` (the CPU default and the reference), 'static' the preallocated
``StaticSpeechCache`` whose one-token step is replayed as a CUDA graph (the default on CUDA; see
``speech_decoder_cache``). A caller may keep one cache for many utterances (a call): ``start``
empties it, and a static cache keeps its captured step.

``state.clone()`` forks a decode; ``decoder.force_tokens(state, ids)`` appends known tokens (e.g.
to continue an utterance from tokens already played). Because the encoders and the AR decoder
are causal, the rows ``[SOS, speaker, F_0..F_{L-1}]`` do not change when words are appended; but
TASK and every speech token come after the whole text (spec §8), so new words mean a new prefix:
``state.cache.truncate(P - 1)`` keeps the shared rows, then feed the new fused rows and TASK
with ``decoder.feed`` (the model was never trained to hear speech tokens before the full text).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from taste_speech.condition_graph import ConditionGraph
from taste_speech.configuration_taste import TasteConfig
from taste_speech.device_copies import to_device
from taste_speech.espnet_transformer import MAX_CACHED_POSITIONS, KVCache, RelPositionTransformer
from taste_speech.modeling_rvq import ResidualVQ
from taste_speech.sampler import draw
from taste_speech.speech_decoder_batch import SlotSpeechCache
from taste_speech.speech_decoder_cache import CACHE_KINDS, DEFAULT_CAPACITY, TOP_K, StaticSpeechCache
from taste_speech.step_graph import MODES as GRAPH_MODES

IGNORE = -1
# The TASTE ("audio token") encoder's block settings are fixed in the original code, not in the
# config: 2 blocks, 8 heads, 2048 FFN units, otherwise like the text encoder.
AUDIO_ENCODER_BLOCKS, AUDIO_ENCODER_HEADS, AUDIO_ENCODER_UNITS = 2, 8, 2048
MIN_LEN_RATIO, MAX_LEN_RATIO = 2, 20  # times the prefix length P = L + 3 (spec §6.5, §11.19)


# -- token choice ---------------------------------------------------------------------------------
class SpeechTokenSampler(Protocol):
    def __call__(self, logp: torch.Tensor, eos_id: int, allow_eos: bool) -> int:
        """Choose the next token from log-probs (V+1,) whose last class is EOS (= eos_id). The
        tensor is the sampler's own (it may keep it)."""


class GreedySampler:
    """Arg-max; before min_len (EOS not allowed) the best non-EOS token."""

    def __call__(self, logp: torch.Tensor, eos_id: int, allow_eos: bool) -> int:
        token = int(logp.argmax())
        if token == eos_id and not allow_eos:
            token = int(logp[:eos_id].argmax())  # EOS is the last class
        return token


class TopKSampler:
    """The original's sampling: multinomial over the renormalised top-k probabilities (temperature
    1); while EOS is not allowed, a drawn EOS is re-drawn. The calls (softmax, top-k, one
    ``multinomial`` per draw) follow the original, so a generator seeded like the original's
    global RNG reproduces its draws. Without a generator, float32 probabilities on a GPU are
    drawn on the host with torch's global CPU generator (one copy, one wait per token): seeded
    by ``torch.manual_seed`` too, but not the draws of a run that drew on the GPU."""

    def __init__(self, k: int = TOP_K, generator: torch.Generator | None = None):
        if k < 1:
            raise ValueError(f"top-k needs k >= 1, got {k}")
        self.k = k
        self.generator = generator

    MAX_REDRAWS = 100

    def __call__(self, logp: torch.Tensor, eos_id: int, allow_eos: bool) -> int:
        probs, ids = logp.softmax(dim=-1).topk(min(self.k, logp.shape[-1]))
        if self._draws_on_host(probs):
            return self.from_top(torch.cat([probs, ids.to(probs.dtype)]), logp, eos_id, allow_eos)
        return self._choose(probs, ids, logp, eos_id, allow_eos)

    def from_top(self, top: torch.Tensor, logp: torch.Tensor, eos_id: int, allow_eos: bool) -> int:
        """``self(logp, ...)`` given ``top``, the top-k of ``logp`` computed already (a static
        cache's decode step does: ``StaticSpeechCache.last_top``; ``TasteSpeechDecoder.step`` then
        calls this, not ``__call__``): one (2k,) tensor, the k probabilities then their ids as
        floats (ids < 2^24 are exact)."""
        k = top.shape[0] // 2
        if k != min(self.k, logp.shape[-1]) or top.shape[0] != 2 * k:
            raise ValueError(f"this top-k holds {top.shape[0] // 2} tokens, the sampler draws among {self.k}")
        if self._draws_on_host(top):
            # bring the k probabilities and ids over in one copy (on CUDA one wait for the GPU per
            # token, not one per read of a pick and an id)
            top = top.to("cpu")
        return self._choose(top[:k], top[k:].long(), logp, eos_id, allow_eos)

    def _draws_on_host(self, probs: torch.Tensor) -> bool:
        """The draws happen on the host (a CPU generator, or torch's global one) for probabilities
        elsewhere."""
        host = self.generator.device if self.generator is not None else torch.device("cpu")
        return probs.device != host and host.type == "cpu" and probs.dtype == torch.float32

    def _choose(self, probs: torch.Tensor, ids: torch.Tensor, logp: torch.Tensor, eos_id: int,
                allow_eos: bool) -> int:
        for _ in range(self.MAX_REDRAWS):
            token = int(ids[draw(probs, self.generator)])
            if allow_eos or token != eos_id:
                return token
        # EOS holds nearly all the mass, so re-drawing could take forever (the original would
        # hang). An accepted re-draw is a draw from the top k without EOS, renormalised: take one
        # directly - same distribution.
        others = probs.masked_fill(ids == eos_id, 0.0)
        if float(others.sum()) <= 0.0:
            return GreedySampler()(logp, eos_id, allow_eos)
        return int(ids[draw(others, self.generator)])


def _preallocated(cache) -> bool:
    """A cache with preallocated slots and a one-token step of its own (static or batched)."""
    return isinstance(cache, (StaticSpeechCache, SlotSpeechCache))


# -- explicit results / state ---------------------------------------------------------------------

@dataclass
class SpeechConditioning:
    """The pieces of the AR prefix (spec §6.2-§6.3), each (1, n, d)."""

    text_encoded: torch.Tensor  # (1, L, d): text encoder + affine
    audio_encoded: torch.Tensor | None  # (1, L, d): TASTE encoder + affine (None when skipped)
    fused: torch.Tensor  # (1, L, d): weighted sum of the two
    speaker: torch.Tensor  # (1, 1, d): spk_embed_affine_layer(l2norm(speaker))
    sos: torch.Tensor  # (1, 1, d): llm_embedding row 0
    task: torch.Tensor  # (1, 1, d): llm_embedding row 1

    @property
    def prefix(self) -> torch.Tensor:
        """[SOS, speaker, F_0..F_{L-1}, TASK]: (1, L+3, d)."""
        return torch.cat([self.sos, self.speaker, self.fused, self.task], dim=1)


@dataclass
class SpeechDecoderOutput:
    """Teacher-forced pass over [prefix, speech tokens]."""

    logits: torch.Tensor  # (1, P+S, V+1); row P-1 (TASK) predicts the first speech token
    labels: torch.Tensor  # (1, P+S): IGNORE x (L+2), the speech tokens, EOS
    lm_input: torch.Tensor  # (1, P+S, d)
    conditioning: SpeechConditioning


@dataclass
class SpeechDecodeState:
    """Everything one batch-1 decode needs between steps."""

    cache: KVCache | StaticSpeechCache  # the AR decoder's per-layer keys/values of every fed position
    prefix: torch.Tensor  # (1, P, d) the conditioning rows fed first
    min_len: int  # EOS is not accepted while fewer tokens were generated
    max_len: int  # at most this many tokens
    tokens: list[int] = field(default_factory=list)  # generated speech tokens (no EOS)
    next_logp: torch.Tensor | None = None  # (V+1,) log-probs of the next decision, once computed
    pending_token: int | None = None  # chosen but not yet fed to the decoder
    step_logprobs: list[torch.Tensor] | None = None  # per decision, when recording
    finished: bool = False
    stop_reason: str | None = None  # 'eos' | 'max_len'
    cache_epoch: int = 0  # the cache's epoch at start (a later start on the same cache bumps it)

    @property
    def prefix_length(self) -> int:
        return self.prefix.shape[1]

    @property
    def step_index(self) -> int:
        """Number of decisions taken (tokens, plus the EOS decision if it ended that way)."""
        return len(self.tokens) + (self.stop_reason == "eos")

    def clone(self) -> "SpeechDecodeState":
        """An independent copy (e.g. to try several continuations from one point)."""
        return SpeechDecodeState(
            cache=self.cache.clone(), prefix=self.prefix, min_len=self.min_len,
            max_len=self.max_len, tokens=list(self.tokens),
            # (a copy: on a preallocated cache they may be its step's buffer, which the next step overwrites)
            next_logp=None if self.next_logp is None else self.next_logp.clone(),
            pending_token=self.pending_token,
            step_logprobs=None if self.step_logprobs is None else list(self.step_logprobs),
            finished=self.finished, stop_reason=self.stop_reason, cache_epoch=self.cache_epoch,
        )


@dataclass
class SpeechGeneration:
    speech_token_ids: torch.Tensor  # (1, S) int32, 0 <= id < speech_token_size
    speech_token_lengths: torch.Tensor  # (1,) int32
    stop_reason: str  # 'eos' | 'max_len'
    step_logprobs: torch.Tensor | None = None  # (decisions, V+1) when requested


# -- modules --------------------------------------------------------------------------------------
class EncodedAudioTextFusion(nn.Module):
    """``fuse_encoded_audio_text_module`` ('weighted_sum'): softmax(weights) = (s_audio, s_text),
    F = s_audio * audio + s_text * text, optionally after a plain layer norm of both."""

    def __init__(self, normalize: bool = False, use_layer_norm: bool = False, weight_init_type: str = "balance",
                 **_unused):
        super().__init__()
        if use_layer_norm:
            raise ValueError("fuse_encoded_audio_text_kwargs.use_layer_norm=True is not supported (the original "
                             "never implemented it); set it to false")
        inits = {"balance": [1.0, 1.0], "zero_audio": [-2.0, 2.0]}
        if weight_init_type not in inits:
            raise ValueError(f"weight_init_type must be one of {sorted(inits)}, got {weight_init_type!r}")
        self.normalize = normalize
        self.weights = nn.Parameter(torch.tensor(inits[weight_init_type]))  # order (audio, text)

    def forward(self, audio: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        if self.normalize:
            audio = F.layer_norm(audio, audio.shape[-1:])
            text = F.layer_norm(text, text.shape[-1:])
        s_audio, s_text = self.weights.softmax(dim=0)
        return s_audio * audio + s_text * text


def _block_setting(c, name: str, default):
    return getattr(c, name, default)


def _check_cosyvoice_blocks(c, prefix: str, allow_cnn_and_macaron_keys: bool) -> None:
    """Refuse configurations this implementation does not build (they would load wrong weights)."""
    expected = {
        f"{prefix}pos_enc_layer_type": "rel_pos_espnet",
        f"{prefix}selfattention_layer_type": "rel_selfattn",
        f"{prefix}normalize_before": True,
    }
    if allow_cnn_and_macaron_keys:
        expected.update({f"{prefix}use_cnn_module": False, f"{prefix}macaron_style": False,
                         f"{prefix}use_dynamic_chunk": False})
    for key, value in expected.items():
        actual = _block_setting(c, key, value)
        if actual != value:
            raise ValueError(f"speech_decoder_config.{key} = {actual!r} is not supported (only {value!r}, as in "
                             "the published model)")


class TasteSpeechDecoder(nn.Module):
    def __init__(self, config: TasteConfig):
        super().__init__()
        c = config.speech_decoder_config
        _check_cosyvoice_blocks(c, "encoder__", allow_cnn_and_macaron_keys=True)
        _check_cosyvoice_blocks(c, "llm__", allow_cnn_and_macaron_keys=False)
        if c.fuse_encoded_audio_text_type != "weighted_sum":
            raise ValueError(f"fuse_encoded_audio_text_type {c.fuse_encoded_audio_text_type!r} is not supported "
                             "(the published model uses 'weighted_sum')")
        text_chunk = int(c.encoder__static_chunk_size)
        if text_chunk not in (0, 1) or int(c.llm__static_chunk_size) != 1:
            raise ValueError("static chunk sizes other than 1 (causal) are not supported; the published model "
                             "uses encoder__static_chunk_size = llm__static_chunk_size = 1")

        self.speech_token_size = int(c.speech_token_size)
        self.eos_id = self.speech_token_size  # the last class of llm_decoder
        self.text_token_size = int(c.text_token_size)
        self.spk_embed_dim = int(c.spk_embed_dim)
        d_enc_in, d_llm = int(c.encoder_input_size), int(c.llm_input_size)
        encoder_activation = _block_setting(c, "encoder__activation_type", "swish")  # Conformer default
        llm_activation = _block_setting(c, "llm__activation_type", "relu")  # Transformer default

        # 1. transcript side (Whisper token ids -> causal encoder)
        self.text_embedding = nn.Embedding(self.text_token_size, d_enc_in)
        self.text_encoder = RelPositionTransformer(
            d_enc_in, d_llm, int(c.encoder__attention_heads), int(c.encoder__linear_units),
            int(c.encoder__num_blocks), input_layer=c.encoder__input_layer, ffn_activation=encoder_activation,
            norm_names=("norm_mha", "norm_ff"), causal=text_chunk == 1,
        )
        self.text_encoder_affine_layer = nn.Linear(d_llm, d_llm)

        # 2. AR decoder and its special rows
        self.llm_embedding = nn.Embedding(2, d_llm)  # row 0: SOS/EOS, row 1: task id
        self.llm = RelPositionTransformer(
            d_llm, int(c.llm_output_size), int(c.llm__attention_heads), int(c.llm__linear_units),
            int(c.llm__num_blocks), input_layer=c.llm__input_layer, ffn_activation=llm_activation,
            norm_names=("norm1", "norm2"), causal=True,
        )
        self.llm_decoder = nn.Linear(int(c.llm_output_size), self.speech_token_size + 1)

        # 3. speech tokens and speaker
        self.speech_embedding = nn.Embedding(self.speech_token_size, d_llm)
        self.spk_embed_affine_layer = nn.Linear(self.spk_embed_dim, d_llm)

        # 4. TASTE side (per-token TASTE embeddings -> causal encoder); hard-coded block sizes
        self.audio_input_size = int(c.audio_encoder_input_size)
        if self.audio_input_size == -1:  # the original's "same width as the text embedding"
            self.audio_input_size = d_enc_in
            self.audio_embed_affine_layer = None
        else:
            self.audio_embed_affine_layer = nn.Linear(self.audio_input_size, d_enc_in)
        self.audio_token_encoder = RelPositionTransformer(
            d_enc_in, d_llm, AUDIO_ENCODER_HEADS, AUDIO_ENCODER_UNITS, AUDIO_ENCODER_BLOCKS,
            input_layer="linear", ffn_activation="silu", norm_names=("norm_mha", "norm_ff"), causal=True,
        )
        self.audio_token_encoder_affine_layer = nn.Linear(d_llm, d_llm)

        # 5. fusion
        self.fuse_encoded_audio_text_module = EncodedAudioTextFusion(**dict(c.fuse_encoded_audio_text_kwargs))

    @property
    def dtype(self) -> torch.dtype:
        return self.llm_decoder.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.llm_decoder.weight.device

    # -- TASTE codes -> per-token embeddings (§6.1) ---------------------------------------------
    @staticmethod
    def taste_rows_from_predictions(pred_indices: torch.Tensor, taste_labels: torch.Tensor) -> torch.Tensor:
        """The LM's predicted codes where a label exists, IGNORE elsewhere (1, T, K) - the input of
        the SpokenLLM speech path (labels only mark which rows carry a word's code)."""
        if pred_indices.shape != taste_labels.shape:
            raise ValueError(f"pred_indices {tuple(pred_indices.shape)} and taste_labels "
                             f"{tuple(taste_labels.shape)} must have the same shape")
        return torch.where(taste_labels != IGNORE, pred_indices, torch.full_like(pred_indices, IGNORE))

    @staticmethod
    def asr_taste_indices(taste_rows: torch.Tensor, asr_word_ids: torch.Tensor) -> torch.Tensor:
        """Spread per-word codes onto the Whisper tokens (1, L, K), on the host.

        ``taste_rows`` (1, T, K) holds one valid row per word, in order (rows whose first index is
        IGNORE are skipped, e.g. the -1 rows of ``llm_indices``); ``asr_word_ids`` (1, L) are the
        0-based word ids of the Whisper tokens. Both are small and read as lists: host inputs are
        checked without waiting for a GPU."""
        if taste_rows.dim() != 3 or taste_rows.shape[0] != 1 or taste_rows.is_floating_point():
            raise ValueError(f"taste_rows must be integer codes (1, T, K), got {taste_rows.dtype} "
                             f"{tuple(taste_rows.shape)}")
        if asr_word_ids.dim() != 2 or asr_word_ids.shape[0] != 1 or asr_word_ids.shape[1] == 0:
            raise ValueError(f"asr_word_ids must be (1, L) with L >= 1, got {tuple(asr_word_ids.shape)}")
        rows = [row for row in taste_rows[0].tolist() if row[0] != IGNORE]
        if any(code < 0 for row in rows for code in row):
            raise ValueError("a TASTE row mixes valid and IGNORE (-1) indices: every word needs all its codes")
        word_ids = asr_word_ids[0].tolist()
        if word_ids[0] != 0 or any(b - a not in (0, 1) for a, b in zip(word_ids, word_ids[1:])):
            raise ValueError("asr_word_ids must start at 0 and grow by at most 1 per token (0, 0, 1, 2, 2, ...)")
        n_words = word_ids[-1] + 1
        if len(rows) != n_words:
            raise ValueError(f"got {len(rows)} TASTE code rows for {n_words} words: give exactly one row "
                             "per word (prompt rows followed by generated rows)")
        return torch.tensor([[rows[w] for w in word_ids]], dtype=torch.long).view(1, len(word_ids), -1)

    def audio_embeds_from_taste(self, rvq: ResidualVQ, taste_rows: torch.Tensor,
                                asr_word_ids: torch.Tensor) -> torch.Tensor:
        """Per-word codes -> per-Whisper-token TASTE embeddings (1, L, dim) via ``rvq.decode``
        (the original's ``get_audio_embeds_from_taste``, batch 1). The codes are spread and checked
        on the host, then copied without waiting for the GPU."""
        return rvq.decode(self.asr_taste_indices(taste_rows, asr_word_ids)).float()

    # -- conditioning (§6.2 - §6.3) -------------------------------------------------------------
    def _check_conditioning_inputs(self, speaker_embeds, audio_unit_embeds, asr_token_ids) -> None:
        if asr_token_ids.dim() != 2 or asr_token_ids.shape[0] != 1 or asr_token_ids.is_floating_point():
            raise ValueError(f"asr_token_ids must be integer ids (1, L), got {asr_token_ids.dtype} "
                             f"{tuple(asr_token_ids.shape)}")
        if asr_token_ids.shape[1] == 0:
            raise ValueError("asr_token_ids is empty: the speech decoder needs at least one Whisper token")
        ids = asr_token_ids[0].tolist()  # (host ids: checked without waiting for the GPU)
        if min(ids) < 0 or max(ids) >= self.text_token_size:
            raise ValueError(f"asr_token_ids must lie in [0, {self.text_token_size}) (transcript tokens without "
                             "Whisper special tokens)")
        if speaker_embeds.shape != (1, self.spk_embed_dim):
            raise ValueError(f"speaker_embeds must be (1, {self.spk_embed_dim}), got {tuple(speaker_embeds.shape)}")
        if audio_unit_embeds is not None and tuple(audio_unit_embeds.shape) != (
                1, asr_token_ids.shape[1], self.audio_input_size):
            raise ValueError(
                f"audio_unit_embeds must be (1, L={asr_token_ids.shape[1]}, {self.audio_input_size}): one TASTE "
                f"embedding per Whisper token; got {tuple(audio_unit_embeds.shape)}"
            )

    def encode_text(self, asr_token_ids: torch.Tensor) -> torch.Tensor:
        """(1, L) Whisper ids -> (1, L, d)."""
        return self.text_encoder_affine_layer(self.text_encoder(self.text_embedding(asr_token_ids.long())))

    def encode_audio(self, audio_unit_embeds: torch.Tensor) -> torch.Tensor:
        """(1, L, dim) TASTE embeddings -> (1, L, d)."""
        x = audio_unit_embeds.to(self.dtype)
        if self.audio_embed_affine_layer is not None:
            x = self.audio_embed_affine_layer(x)
        return self.audio_token_encoder_affine_layer(self.audio_token_encoder(x))

    def project_speaker(self, speaker_embeds: torch.Tensor) -> torch.Tensor:
        """(1, spk_dim) -> (1, 1, d), after L2 normalisation."""
        return self.spk_embed_affine_layer(F.normalize(speaker_embeds.to(self.dtype), dim=1)).unsqueeze(1)

    def condition(self, speaker_embeds: torch.Tensor, audio_unit_embeds: torch.Tensor | None,
                  asr_token_ids: torch.Tensor, graph: ConditionGraph | None = None) -> SpeechConditioning:
        """All prefix pieces. ``audio_unit_embeds=None`` skips the TASTE side (the original's
        ``skip_audio_in_audio_decoder``: the fused rows are the text encoding alone). ``graph``: the
        call's captured conditioning steps (``condition_graph``), run instead of the eager encoders
        where a bucket holds the tokens (the same values)."""
        self._check_conditioning_inputs(speaker_embeds, audio_unit_embeds, asr_token_ids)
        # inputs made on the host (ids, a speaker vector) are copied in without waiting for the GPU
        asr_token_ids, speaker_embeds = to_device(asr_token_ids, self.device), to_device(speaker_embeds, self.device)
        if audio_unit_embeds is not None:
            audio_unit_embeds = to_device(audio_unit_embeds, self.device)
        encoded = None
        if graph is not None and audio_unit_embeds is not None:
            encoded = graph.encode(audio_unit_embeds, asr_token_ids)
        if encoded is not None:
            text, audio, fused = encoded
        else:
            text = self.encode_text(asr_token_ids)
            audio = None if audio_unit_embeds is None else self.encode_audio(audio_unit_embeds)
            fused = text if audio is None else self.fuse_encoded_audio_text_module(audio, text)
        rows = self.llm_embedding.weight
        return SpeechConditioning(
            text_encoded=text, audio_encoded=audio, fused=fused, speaker=self.project_speaker(speaker_embeds),
            sos=rows[0].view(1, 1, -1), task=rows[1].view(1, 1, -1),
        )

    def prefix_embeds(self, speaker_embeds, audio_unit_embeds, asr_token_ids,
                      graph: ConditionGraph | None = None) -> torch.Tensor:
        """[SOS, speaker, fused rows, TASK]: (1, L+3, d). ``graph``: see ``condition``."""
        return self.condition(speaker_embeds, audio_unit_embeds, asr_token_ids, graph).prefix

    def condition_graph(self, cache) -> ConditionGraph | None:
        """The captured conditioning steps of the call that owns ``cache``, kept by it: on a static
        cache whose steps are captured (or rehearsed), with causal encoders; None elsewhere (eager)."""
        if not isinstance(cache, StaticSpeechCache) or cache.graph_mode == "eager" or not ConditionGraph.serves(self):
            return None
        if cache.condition_graph is None or cache.condition_graph.decoder is not self:
            cache.condition_graph = ConditionGraph(self, cache.graph_mode)
        return cache.condition_graph

    # -- teacher forcing ------------------------------------------------------------------------
    def forward(self, speaker_embeds: torch.Tensor, audio_unit_embeds: torch.Tensor | None,
                asr_token_ids: torch.Tensor, speech_token_ids: torch.Tensor) -> SpeechDecoderOutput:
        """Logits of the AR decoder over [prefix, speech tokens] (causal, one pass)."""
        if speech_token_ids.dim() != 2 or speech_token_ids.shape[0] != 1 or speech_token_ids.is_floating_point():
            raise ValueError(f"speech_token_ids must be integer ids (1, S), got {tuple(speech_token_ids.shape)}")
        if bool(((speech_token_ids < 0) | (speech_token_ids >= self.speech_token_size)).any()):
            raise ValueError(f"speech_token_ids must lie in [0, {self.speech_token_size}) (EOS is not an input)")
        cond = self.condition(speaker_embeds, audio_unit_embeds, asr_token_ids)
        lm_input = torch.cat([cond.prefix, self.speech_embedding(speech_token_ids.long())], dim=1)
        logits = self.llm_decoder(self.llm(lm_input))
        n_ignored = cond.fused.shape[1] + 2
        labels = torch.cat([
            torch.full((1, n_ignored), IGNORE, dtype=torch.long, device=lm_input.device),
            speech_token_ids.long(),
            torch.full((1, 1), self.eos_id, dtype=torch.long, device=lm_input.device),
        ], dim=1)
        return SpeechDecoderOutput(logits=logits, labels=labels, lm_input=lm_input, conditioning=cond)

    # -- KV-cached decoding (§6.5) --------------------------------------------------------------
    @staticmethod
    def length_limits(prefix_length: int) -> tuple[int, int]:
        """(min_len, max_len) in speech tokens for a prefix of P = L + 3 rows: (2P, 20P)."""
        return int(MIN_LEN_RATIO * prefix_length), int(MAX_LEN_RATIO * prefix_length)

    def _check_prefix(self, prefix: torch.Tensor) -> None:
        if prefix.dim() != 3 or prefix.shape[0] != 1 or prefix.shape[-1] != self.llm.input_size:
            raise ValueError(f"prefix must be (1, P, {self.llm.input_size}) - see prefix_embeds(); "
                             f"got {tuple(prefix.shape)}")

    def new_cache(self, kind: str = "auto", capacity: int | None = None,
                  graph_mode: str = "auto") -> KVCache | StaticSpeechCache:
        """A cache for ``start``: 'static' (``capacity`` positions preallocated, default 1024, grown
        when needed; one-token steps run by a ``StepGraph`` in ``graph_mode``: 'auto' = a CUDA graph
        on CUDA), 'dynamic' (the growing ``KVCache``), or 'auto': static when the weights are on
        CUDA, dynamic elsewhere (on CPU the growing cache is faster: it attends to the positions fed
        so far only)."""
        if kind not in CACHE_KINDS:
            raise ValueError(f"cache kind must be one of {CACHE_KINDS}, got {kind!r}")
        if graph_mode not in GRAPH_MODES:
            raise ValueError(f"graph_mode must be one of {GRAPH_MODES}, got {graph_mode!r}")
        if kind == "auto":
            kind = "static" if self.device.type == "cuda" else "dynamic"
        if kind == "dynamic":
            return self.llm.new_cache()
        return StaticSpeechCache(self, DEFAULT_CAPACITY if capacity is None else int(capacity), graph_mode=graph_mode)

    @torch.no_grad()
    def start(self, prefix: torch.Tensor, min_len: int | None = None, max_len: int | None = None,
              record_logprobs: bool = False, cache: KVCache | StaticSpeechCache | None = None) -> SpeechDecodeState:
        """Feed the whole prefix once (causally); the state then holds the log-probs of the first
        decision. Limits default to the original's (2P, 20P). ``cache``: from ``new_cache``
        (default: a new ``new_cache('auto')``); a given cache is emptied and reused, which ends
        the decode that used it before."""
        self._check_prefix(prefix)
        if cache is None:
            cache = self.new_cache()
        elif _preallocated(cache):
            if cache.llm is not self.llm:
                raise ValueError("this static cache was made by another speech decoder: use this decoder's "
                                 "new_cache()")
            cache.reset()
        elif isinstance(cache, KVCache):
            if len(cache.layers) != len(self.llm.encoders):
                raise ValueError("this KVCache belongs to a transformer with a different number of blocks")
            cache.truncate(0)
            cache.epoch += 1
        else:
            raise TypeError(f"cache must come from new_cache() or a SpeechStepBatch (KVCache, StaticSpeechCache or "
                            f"SlotSpeechCache), got {type(cache).__name__}")
        default_min, default_max = self.length_limits(prefix.shape[1])
        state = SpeechDecodeState(
            cache=cache, prefix=prefix,
            min_len=default_min if min_len is None else int(min_len),
            max_len=default_max if max_len is None else int(max_len),
            step_logprobs=[] if record_logprobs else None,
            cache_epoch=getattr(cache, "epoch", 0),
        )
        if state.max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {state.max_len}")
        state.next_logp = self.feed(state, prefix)
        return state

    @staticmethod
    def _check_cache_owner(state: SpeechDecodeState) -> None:
        if getattr(state.cache, "epoch", 0) != state.cache_epoch:
            raise ValueError("this decode's cache was taken over by a later start(..., cache=...): a shared cache "
                             "serves one decode at a time (clone() the state first to keep decoding it)")

    @torch.no_grad()
    def feed(self, state: SpeechDecodeState, rows: torch.Tensor) -> torch.Tensor:
        """Append rows (1, t, d) to the decoder cache; returns the log-probs (V+1,) after the last."""
        self._check_cache_owner(state)
        rows = rows.to(self.dtype)
        if _preallocated(state.cache):
            hidden = state.cache.forward(rows)  # eager, on the preallocated slots
        else:
            hidden = self.llm.forward_incremental(rows, state.cache)
        return self.llm_decoder(hidden[:, -1]).float().log_softmax(dim=-1)[0]

    @torch.no_grad()
    def step(self, state: SpeechDecodeState, sampler: SpeechTokenSampler | None = None) -> int | None:
        """Take one decision: returns the new speech token, or None once the utterance has ended
        (EOS chosen, or max_len tokens reached). At most one decoder position is computed."""
        if state.finished:
            return None
        sampler = GreedySampler() if sampler is None else sampler
        top = None  # the log-probs' top-k, where the step computed it
        if _preallocated(state.cache):  # (its log-probs may be the step's buffer, which a later start reuses)
            self._check_cache_owner(state)
        if state.next_logp is None:  # feed the previous token only now: no wasted final forward
            if _preallocated(state.cache):
                # the captured step; its outputs are read (or copied) before the next step
                state.next_logp = state.cache.decode_step(state.pending_token)
                top = getattr(state.cache, "last_top", None)
            else:
                token_row = self.speech_embedding.weight[state.pending_token].view(1, 1, -1)
                state.next_logp = self.feed(state, token_row)
            state.pending_token = None
        logp = state.next_logp
        if state.step_logprobs is not None:
            state.step_logprobs.append(logp.clone())
        allow_eos = len(state.tokens) >= state.min_len
        draw = type(sampler).__call__
        if (top is not None and draw is TopKSampler.__call__  # (not a subclass's own draw)
                and min(sampler.k, logp.shape[-1]) == top.shape[0] // 2):
            token = sampler.from_top(top, logp, self.eos_id, allow_eos)
        else:
            if _preallocated(state.cache) and draw not in (GreedySampler.__call__, TopKSampler.__call__):
                logp = logp.clone()  # a sampler of the caller's may keep it; the step's buffer is overwritten
            token = int(sampler(logp, self.eos_id, allow_eos=allow_eos))
        if token == self.eos_id:
            state.finished, state.stop_reason, state.next_logp = True, "eos", None
            return None
        if not 0 <= token < self.speech_token_size:
            raise ValueError(f"the sampler returned {token}, outside [0, {self.speech_token_size}]")
        state.tokens.append(token)
        state.next_logp, state.pending_token = None, token
        if len(state.tokens) >= state.max_len:
            state.finished, state.stop_reason = True, "max_len"
        return token

    @torch.no_grad()
    def force_tokens(self, state: SpeechDecodeState, tokens) -> None:
        """Append given speech tokens as if they had been chosen (e.g. to continue an utterance from
        tokens already played out); one decoder pass for all of them. No log-probs are recorded
        for them, and the min_len/max_len counters include them."""
        tokens = [int(t) for t in torch.as_tensor(tokens).flatten().tolist()]
        if state.finished:
            raise ValueError(f"this decode has ended ({state.stop_reason}); start a new one")
        if any(not 0 <= t < self.speech_token_size for t in tokens):
            raise ValueError(f"forced speech tokens must lie in [0, {self.speech_token_size}) (EOS cannot be forced)")
        if len(state.tokens) + len(tokens) > state.max_len:
            raise ValueError(f"forcing {len(tokens)} tokens would exceed max_len = {state.max_len}")
        if not tokens:
            return
        to_feed = ([] if state.pending_token is None else [state.pending_token]) + tokens
        rows = self.speech_embedding.weight[to_device(torch.tensor(to_feed), self.device)].unsqueeze(0)
        state.next_logp, state.pending_token = self.feed(state, rows), None
        state.tokens.extend(tokens)
        if len(state.tokens) >= state.max_len:
            state.finished, state.stop_reason = True, "max_len"

    @staticmethod
    def _result(tokens: list[int], stop_reason: str, logprobs, device) -> SpeechGeneration:
        return SpeechGeneration(
            speech_token_ids=torch.tensor([tokens], dtype=torch.int32, device=device).view(1, len(tokens)),
            speech_token_lengths=torch.tensor([len(tokens)], dtype=torch.int32, device=device),
            stop_reason=stop_reason,
            step_logprobs=None if logprobs is None else torch.stack(logprobs),
        )

    @torch.no_grad()
    def generate(self, prefix: torch.Tensor, sampler: SpeechTokenSampler | None = None,
                 min_len: int | None = None, max_len: int | None = None,
                 return_logprobs: bool = False, cache_kind: str = "auto",
                 graph_mode: str = "auto") -> SpeechGeneration:
        """Decode a whole utterance with the KV cache. ``sampler`` defaults to the original's
        ``TopKSampler()`` (unseeded); pass ``GreedySampler()`` for deterministic output.
        ``cache_kind`` / ``graph_mode``: see ``new_cache`` (a static cache is sized for the whole
        utterance)."""
        sampler = TopKSampler() if sampler is None else sampler
        self._check_prefix(prefix)
        needed = prefix.shape[1] + (self.length_limits(prefix.shape[1])[1] if max_len is None else int(max_len))
        cache = self.new_cache(cache_kind, capacity=max(1, min(needed, MAX_CACHED_POSITIONS)), graph_mode=graph_mode)
        state = self.start(prefix, min_len, max_len, record_logprobs=return_logprobs, cache=cache)
        while self.step(state, sampler) is not None:
            pass
        return self._result(state.tokens, state.stop_reason, state.step_logprobs, prefix.device)

    @torch.no_grad()
    def generate_without_cache(self, prefix: torch.Tensor, sampler: SpeechTokenSampler | None = None,
                               min_len: int | None = None, max_len: int | None = None,
                               return_logprobs: bool = False) -> SpeechGeneration:
        """Reference path: recompute the whole causal sequence at every step (quadratic; tests)."""
        self._check_prefix(prefix)
        sampler = GreedySampler() if sampler is None else sampler
        default_min, default_max = self.length_limits(prefix.shape[1])
        min_len = default_min if min_len is None else min_len
        max_len = default_max if max_len is None else max_len
        sequence, tokens, logprobs, stop_reason = prefix.to(self.dtype), [], [], "max_len"
        while len(tokens) < max_len:
            logp = self.llm_decoder(self.llm(sequence)[:, -1]).float().log_softmax(dim=-1)[0]
            logprobs.append(logp)
            token = int(sampler(logp, self.eos_id, allow_eos=len(tokens) >= min_len))
            if token == self.eos_id:
                stop_reason = "eos"
                break
            tokens.append(token)
            sequence = torch.cat([sequence, self.speech_embedding.weight[token].view(1, 1, -1)], dim=1)
        return self._result(tokens, stop_reason, logprobs if return_logprobs else None, prefix.device)

    @torch.no_grad()
    def generate_from_taste(self, rvq: ResidualVQ, speaker_embeds: torch.Tensor, taste_rows: torch.Tensor,
                            asr_token_ids: torch.Tensor, asr_word_ids: torch.Tensor,
                            sampler: SpeechTokenSampler | None = None,
                            return_logprobs: bool = False) -> SpeechGeneration:
        """Codes of every word + the words' Whisper tokens + speaker -> speech tokens (the
        original's ``get_audio_embeds_from_taste`` followed by ``_voice_decoder_generate``)."""
        audio = self.audio_embeds_from_taste(rvq, taste_rows, asr_word_ids)
        prefix = self.prefix_embeds(speaker_embeds, audio, asr_token_ids)
        return self.generate(prefix, sampler, return_logprobs=return_logprobs)
