"""Spoken LM of TASTE (``spoken_lm.``): a Llama that reads and writes text and TASTE codes jointly.

Every input row fuses a text embedding with a TASTE embedding (weighted sum after a projection,
spec §4.3); every output row predicts the next text token (LM head tied to the input embedding)
and, through a latent regression head, the TASTE code of the word just finished (§4.5). TASTE runs
one word behind the text (§4.4).

The Llama is transformers' ``LlamaForCausalLM`` wrapped by peft LoRA, so the state-dict names are
the published ``language_model.base_model.model.…`` ones. The residual VQ is owned by the audio
tower and passed to every method that needs it (never registered here: that would duplicate its
state-dict keys).

Generation (§5) is KV-cached: the prompt is prefilled once, each step feeds one row and only the
last position's heads are computed. ``generate(..., use_cache=False)`` keeps the original
algorithm - the whole sequence re-run at every step, both heads on every position - as the
reference for tests and benchmarks. Both give the same greedy results.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn
from transformers import LlamaForCausalLM
from transformers.utils import ModelOutput

from taste_speech.configuration_taste import TasteConfig
from taste_speech.device_copies import to_device
from taste_speech.lm_cache import CACHE_KINDS, DynamicLMCache, StaticLMCache
from taste_speech.modeling_rvq import ResidualVQ
from taste_speech.sampler import Action, Decision, TasteAction, TasteSampler
from taste_speech.step_graph import StepGraph

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IGNORE = -1
TASTE_LOGIT_SCALE = 1000.0  # the head's "logits" are one-hot x 1000
MODES = ("audio", "text", "zero", "instruct")
DEFAULT_STATIC_ROWS = 1024  # a static cache's first capacity (it grows when a decode needs more)


class WeightedSumFusion(nn.Module):
    """``fuse_for_bridge_in_llm``: softmax(weights)[0] * linear(audio) + softmax(weights)[1] * text,
    computed in fp32 (the caller casts the row to the LM dtype)."""

    def __init__(self, audio_dim: int, text_dim: int):
        super().__init__()
        self.linear = nn.Linear(audio_dim, text_dim)
        self.weights = nn.Parameter(torch.tensor([-2.0, 2.0]))  # (audio, text); trained values in the checkpoint

    def forward(self, text_vec: torch.Tensor, audio_vec: torch.Tensor) -> torch.Tensor:
        s_audio, s_text = self.weights.float().softmax(-1)
        audio = self.linear(audio_vec.to(self.linear.weight.dtype)).float()
        return s_audio * audio + s_text * text_vec.float()


class LatentTasteHead(nn.Module):
    """``extract_for_bridge_out_llm`` (``continue_latent_linear_last``): regress a latent in the RVQ's
    code space and quantise it with the residual nearest-neighbour search."""

    def __init__(self, hidden: int, codebook_dim: int):
        super().__init__()
        self.fc_mu = nn.Linear(hidden, codebook_dim)
        self.b_logvar = nn.Parameter(torch.zeros(codebook_dim))

    def latent(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # float32 in the published run-dtype layout; whatever the head holds after a plain .to(dtype)
        mu = self.fc_mu(hidden_states.to(self.fc_mu.weight.dtype)).float()
        return mu + torch.exp(0.5 * self.b_logvar.float())  # inference adds sigma to the mean (spec §11.2)

    @staticmethod
    def quantize(z: torch.Tensor, rvq: ResidualVQ):
        """(indices (…, K) long, logits (…, K, C) = one_hot(indices) x 1000) of latents z (…, d):
        the residual search directly in code space (no project_in)."""
        indices = rvq.indices_from_code(z)
        # one_hot(indices) x 1000, scattered: F.one_hot checks the indices' range by reading them back
        logits = torch.zeros(*indices.shape, rvq.codebook_size, device=indices.device)
        return indices, logits.scatter_(-1, indices.unsqueeze(-1), TASTE_LOGIT_SCALE)

    def forward(self, hidden_states: torch.Tensor, rvq: ResidualVQ):
        return self.quantize(self.latent(hidden_states), rvq)


# -- data carried between the steps -------------------------------------------------------------------
@dataclass
class PromptLayout:
    """A prompt of N tokens and W words in the §4.4 layout."""

    inputs_embeds: torch.Tensor  # (1, N+2, H): SOS, N fused rows, fuse(pad_text, last word's code)
    audio_embeds: torch.Tensor  # (N+1, dim) audio side of rows 1..N+1 (delayed by one word)
    taste_labels: torch.Tensor  # (N+2, K) training targets: word k's code at the row predicting word k+1
    word_codes: torch.Tensor  # (W, K) one code row per word


@dataclass
class SpokenLMOutput(ModelOutput):
    """Teacher-forced outputs over every position (batch 1). As a tuple (``out[i]``) it reads
    ``(last_hidden_state, text_logits, taste_indices, taste_logits, ...)``."""

    last_hidden_state: torch.Tensor | None = None  # (1, T, H) after the final RMSNorm
    text_logits: torch.Tensor | None = None  # (1, T, V) fp32
    taste_indices: torch.Tensor | None = None  # (1, T, K)
    taste_logits: torch.Tensor | None = None  # (1, T, K, C) one-hot x 1000
    taste_mu: torch.Tensor | None = None  # (1, T, d)
    taste_z: torch.Tensor | None = None  # (1, T, d) mu + sigma
    inputs_embeds: torch.Tensor | None = None  # (1, T, H)
    taste_labels: torch.Tensor | None = None  # (1, T, K) when built from a prompt
    text_labels: torch.Tensor | None = None  # (1, T) token ids then delay+1 IGNORE, when built from a prompt


@dataclass
class StepHeads:
    """Both heads at the last position."""

    text_logits: torch.Tensor  # (V,) fp32, before any banning
    taste_logits: torch.Tensor  # (K, C)
    taste_indices: torch.Tensor  # (K,)
    taste_z: torch.Tensor  # (d,)


class HeadsStep:
    """Both heads of one decode step (the latent, the residual search of every RVQ level, the one-hot
    codes, the text head) as one captured step: eagerly they are about a hundred kernel launches a
    token, as many as the rest of the step outside the backbone's graph. It owns its input buffer,
    so it serves one decode at a time (``TasteSpokenLM.heads_step`` keeps one per static cache; a
    copy of the cache starts without)."""

    def __init__(self, lm: "TasteSpokenLM", rvq: ResidualVQ, graph_mode: str):
        self.lm, self.rvq, self.graph_mode = lm, rvq, graph_mode
        self.hidden: torch.Tensor | None = None  # (1, H), made at the first step (its shape and dtype)
        self.step: StepGraph | None = None

    def __call__(self, hidden_last: torch.Tensor) -> StepHeads:
        if self.hidden is None:
            with torch.inference_mode(False):  # (writable whatever mode later steps run in)
                self.hidden = torch.zeros(hidden_last.shape, dtype=hidden_last.dtype, device=hidden_last.device)
            self.step = StepGraph(self._heads, self.hidden.device, self.graph_mode, name="spoken LM heads")
        self.hidden.copy_(hidden_last)
        # copies: the step's outputs are overwritten by its next run
        return StepHeads(*(out.clone() for out in self.step.run()))

    def _heads(self) -> tuple:
        heads = self.lm.compute_heads(self.hidden, self.rvq)  # (not ``heads``: a patched one must not be captured)
        return heads.text_logits, heads.taste_logits, heads.taste_indices, heads.taste_z


@dataclass
class LMDecodeState:
    """Explicit state of one KV-cached decode."""

    cache: DynamicLMCache | StaticLMCache
    input_ids: list[int]  # every id so far, for the repetition penalty
    audio_vec: torch.Tensor  # (dim,) audio side of the next fused row
    pending_audio: torch.Tensor | None = None  # 'audio' mode: the prompt's withheld last-word code
    last_hidden: torch.Tensor | None = None  # (1, H) hidden state of the last fed row
    rows: list[torch.Tensor] = field(default_factory=list)  # every fed row block (1, t, H), in order

    @property
    def length(self) -> int:
        return self.cache.length

    def inputs_embeds(self) -> torch.Tensor:
        return torch.cat(self.rows, dim=1)

    def crop(self, length: int) -> None:
        """Forget every row after the first ``length`` (cache and row record)."""
        self.cache.crop(length)
        kept, total = [], 0
        for block in self.rows:
            if total + block.shape[1] <= length:
                kept.append(block)
            elif total < length:
                kept.append(block[:, : length - total])
            total += block.shape[1]
        self.rows = kept
        self.last_hidden = None  # unknown until the next feed


@dataclass
class InitialContext:
    """What a conditional mode starts generation from (spec §5.1)."""

    rows: torch.Tensor  # (1, T, H) rows fed before the first step
    input_ids: list[int]  # ids for the repetition penalty
    pending_audio: torch.Tensor | None  # the withheld last-word code ('audio' mode)
    has_prefix: bool


@dataclass
class GenerationTrace:
    """Per-step record (names as in the goldens' ``c.*.trace``)."""

    text_id: list[int] = field(default_factory=list)
    taste_ids: list[torch.Tensor] = field(default_factory=list)
    taste_argmax_last: list[torch.Tensor] = field(default_factory=list)
    action: list[int] = field(default_factory=list)
    taste_action: list[int] = field(default_factory=list)
    seq_len: list[int] = field(default_factory=list)
    word_counter_after: list[int] = field(default_factory=list)
    text_logits_last_raw: list[torch.Tensor] = field(default_factory=list)
    taste_z_last: list[torch.Tensor] = field(default_factory=list)


@dataclass
class GenerationOutput:
    token_ids: torch.Tensor  # (1, G) generated text ids
    word_ids: torch.Tensor  # (1, G) int32 word index of every generated token
    taste_rows: torch.Tensor  # (1, R, K) one row per 'sample' step (-1 rows when no code was sampled)
    first_inputs_embeds: torch.Tensor  # (1, T0, H) rows of the first backbone call
    final_inputs_embeds: torch.Tensor  # (1, T, H) every row fed
    trace: GenerationTrace
    end_reason: str  # 'sentence_end' | 'max_words' | 'stop_id' | 'max_steps' (guard hit)

    def word_codes(self) -> torch.Tensor:
        """(W, K): the valid TASTE rows, one per generated word."""
        rows = self.taste_rows[0]
        return rows[(rows >= 0).all(-1)]


def _check_batch1(name: str, tensor: torch.Tensor, dims: int) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != dims or tensor.shape[0] != 1:
        raise ValueError(f"{name} must have {dims} dims with batch size 1, got shape {tuple(tensor.shape)}")
    if tensor.is_floating_point():
        raise ValueError(f"{name} must be an integer tensor, got {tensor.dtype}")


class TasteSpokenLM(nn.Module):
    def __init__(self, config: TasteConfig):
        super().__init__()
        lm_cfg = config.spoken_lm_config
        quant = config.audio_tower_config.kwargs_for_quantizer
        self.sos_id = int(lm_cfg.sos_id)
        self.delay = int(lm_cfg.delay)
        if self.delay != 1 or getattr(lm_cfg, "delay_level", "word") != "word":
            raise ValueError("only the word-level delay of 1 (the published model) is supported")
        text_config = config.text_config
        hidden = text_config.hidden_size
        llama = LlamaForCausalLM(text_config)
        if lm_cfg.use_lora:
            lora = lm_cfg.kwargs_for_lora
            with warnings.catch_warnings():  # peft probes transformers' deprecated is_gradient_checkpointing
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
                llama = get_peft_model(
                    llama,
                    LoraConfig(
                        r=int(lora["lora_r"]),
                        lora_alpha=int(lora["lora_alpha"]),
                        lora_dropout=float(lora.get("lora_dropout") or 0.0),  # inactive in eval mode
                        target_modules=LORA_TARGETS,
                        bias="none",
                        task_type="CAUSAL_LM",
                    ),
                )
        self.language_model = llama
        audio_dim = int(quant["dim"])  # TASTE embedding width (1280 published; the original hard-codes it)
        self.fuse_for_bridge_in_llm = WeightedSumFusion(audio_dim, hidden)
        self.extract_for_bridge_out_llm = LatentTasteHead(hidden, int(quant["codebook_dim"]))
        self.pad_text_unit_embed = nn.Parameter(torch.zeros(hidden))
        self.pad_audio_unit_embed = nn.Parameter(torch.zeros(audio_dim))
        self.tie_lm_head()
        self.round_rope_frequencies()

    @torch.no_grad()
    def round_rope_frequencies(self) -> None:
        """Round RoPE's inverse frequencies to bfloat16 precision, as the original model has them.

        The original casts its Llama to bfloat16 right after construction, which also rounds the
        (non-persistent) ``inv_freq`` buffer; the checkpoint was trained and is run with those
        rounded frequencies, so fp32 runs must use them too (the goldens agree only this way).
        Call again after materialising a model built on the meta device."""
        rotary = self.backbone.rotary_emb
        if rotary.inv_freq.device.type == "meta":
            return
        rounded = rotary.inv_freq.to(torch.bfloat16).to(rotary.inv_freq.dtype)
        rotary.inv_freq.copy_(rounded)
        if hasattr(rotary, "original_inv_freq"):
            rotary.original_inv_freq = rounded.clone()

    # -- LoRA: adapters on the side (training, the checkpoint's layout) or merged (inference) ---------
    def lora_layers(self) -> list[tuple[str, LoraLayer]]:
        """(module path under ``spoken_lm.``, layer) of every LoRA-wrapped projection."""
        return [(f"language_model.{name}", module) for name, module in self.language_model.named_modules()
                if isinstance(module, LoraLayer)]

    @property
    def lora_merged(self) -> bool:
        return any(layer.merged for _, layer in self.lora_layers())

    @torch.no_grad()
    def merge_lora(self) -> bool:
        """Fold every adapter into its base weight for inference (W + scale * B A, then B = 0); False
        without LoRA.

        A merged projection is one matmul; on the side it is three plus the casts between the bf16
        base and the float32 adapters: at full size ~560 fewer kernels per decode step, which on a GPU
        (launch-bound at batch 1) is time per token. peft sums in float32 and rounds once into the
        base dtype. The adapters are then zeroed, so the model is always what its state dict says
        (merged base, zero adapters: a checkpoint of the published layout computing the same
        function) - saving, copying and loading it elsewhere stay right. One way: the adapters'
        own values are gone. Merge before the first decode step: a CUDA graph captured earlier
        replays the adapters' kernels."""
        layers = self.lora_layers()
        for _, layer in layers:
            if not layer.merged:
                layer.merge()
            for adapter in layer.merged_adapters:
                layer.lora_B[adapter].weight.zero_()
        return bool(layers)

    # -- pieces of the Llama ----------------------------------------------------------------------
    @property
    def causal_lm(self) -> LlamaForCausalLM:
        lm = self.language_model
        return lm.base_model.model if hasattr(lm, "peft_config") else lm

    @property
    def backbone(self):
        return self.causal_lm.model

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.backbone.embed_tokens

    @property
    def lm_dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.weight.shape[0]

    def tie_lm_head(self) -> None:
        """The text head shares the input embedding (the checkpoint stores it once)."""
        self.causal_lm.lm_head.weight = self.embed_tokens.weight

    def token_embeds(self, ids) -> torch.Tensor:
        """Raw ``embed_tokens`` rows (n, H) of a list / 1-D tensor of ids."""
        device = self.embed_tokens.weight.device
        host = not isinstance(ids, torch.Tensor) or ids.device.type == "cpu"
        ids = torch.as_tensor(ids).long().reshape(-1)
        values = ids.tolist()  # (device ids: one read; host ids: none of the GPU)
        if values and (min(values) < 0 or max(values) >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got [{min(values)}, {max(values)}]")
        # host ids (a sampled token's, every step) are checked and copied without waiting for the GPU
        return self.embed_tokens(to_device(ids, device) if host else ids)

    def fuse(self, text_vec: torch.Tensor, audio_vec: torch.Tensor) -> torch.Tensor:
        """Fused rows (…, H) in the LM dtype."""
        return self.fuse_for_bridge_in_llm(text_vec, audio_vec).to(self.lm_dtype)

    def text_head(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.causal_lm.lm_head(hidden_states).float()

    def taste_head(self, hidden_states: torch.Tensor, rvq: ResidualVQ):
        """(indices (…, K), one-hot x 1000 logits (…, K, C))."""
        return self.extract_for_bridge_out_llm(hidden_states, rvq)

    def pad_audio(self) -> torch.Tensor:
        return self.pad_audio_unit_embed.float()

    # -- inputs (§4.2 - §4.4) ---------------------------------------------------------------------
    @staticmethod
    def fill_forward(indices: torch.Tensor) -> torch.Tensor:
        """Replace every invalid row (any index < 0) of (B, T, K) by the closest earlier valid row."""
        valid = (indices >= 0).all(-1)  # (B, T)
        if indices.shape[1] and not bool(valid[:, 0].all()):
            raise ValueError("the first TASTE row must be valid to fill forward (there is no earlier code to carry)")
        positions = torch.arange(indices.shape[1], device=indices.device).expand_as(valid)
        source = torch.where(valid, positions, torch.zeros_like(positions)).cummax(dim=1).values
        return indices.gather(1, source.unsqueeze(-1).expand_as(indices))

    def encode_audio_fill_forward(self, indices: torch.Tensor, rvq: ResidualVQ) -> torch.Tensor:
        """TASTE embeddings (B, T, dim) of fill-forwarded indices (B, T, K)."""
        return rvq.decode(self.fill_forward(indices)).float()

    def word_codes(self, llm_indices: torch.Tensor, llm_word_ids: torch.Tensor):
        """(codes (W, K) - the row at every word's first token -, first-token positions (W,),
        word ids (N,)) of a batch-1 prompt; ValueError when the layout is not extract_vq's."""
        _check_batch1("llm_indices", llm_indices, 3)
        _check_batch1("llm_word_ids", llm_word_ids, 2)
        if llm_indices.shape[1] != llm_word_ids.shape[1]:
            raise ValueError(f"llm_indices covers {llm_indices.shape[1]} tokens but llm_word_ids {llm_word_ids.shape[1]}")
        word_ids = llm_word_ids[0].long()
        n = word_ids.numel()
        if n == 0:
            raise ValueError("the prompt is empty: it needs at least one word")
        steps = word_ids[1:] - word_ids[:-1]
        if int(word_ids[0]) != 0 or bool(((steps != 0) & (steps != 1)).any()):
            raise ValueError("llm_word_ids must start at 0 and grow by 0 or 1 per token (one id per word, in order)")
        starts = torch.nonzero(torch.cat([word_ids.new_ones(1), steps]) > 0).squeeze(-1)
        codes = llm_indices[0, starts].long()
        if not bool((codes >= 0).all()):
            bad = starts[~(codes >= 0).all(-1)].tolist()
            raise ValueError(f"llm_indices has no TASTE code at the first token of some words (positions {bad}); "
                             "build it with extract_vq / taste_tokenize")
        return codes, starts, word_ids

    def prepare_inputs(self, llm_indices, llm_token_ids, llm_word_ids, rvq: ResidualVQ) -> PromptLayout:
        """The §4.4 layout of a prompt of N tokens: N + 2 rows."""
        _check_batch1("llm_token_ids", llm_token_ids, 2)
        if llm_token_ids.shape[1] != llm_word_ids.shape[1]:
            raise ValueError(f"llm_token_ids has {llm_token_ids.shape[1]} tokens but llm_word_ids {llm_word_ids.shape[1]}")
        codes, starts, word_ids = self.word_codes(llm_indices, llm_word_ids)
        n = word_ids.numel()
        code_embeds = rvq.decode(codes.unsqueeze(0))[0].float()  # (W, dim)
        # Row 1+j carries the previous word's code (pad during word 0); row N+1 the last word's.
        prev_word = word_ids - 1
        per_token = torch.where((prev_word >= 0).unsqueeze(-1), code_embeds[prev_word.clamp(min=0)],
                                self.pad_audio().expand(n, -1))
        audio = torch.cat([per_token, code_embeds[-1:]], dim=0)
        text = torch.cat([self.token_embeds(llm_token_ids[0]).float(), self.pad_text_unit_embed.float()[None]], dim=0)
        sos = self.token_embeds([self.sos_id]).to(self.lm_dtype)
        inputs = torch.cat([sos, self.fuse(text, audio)], dim=0).unsqueeze(0)
        # Targets: word k's code at the row that predicts word k+1's first token; the last at row N.
        labels = torch.full((n + 2, codes.shape[-1]), IGNORE, dtype=torch.long, device=codes.device)
        labels[starts[1:]] = codes[:-1]
        labels[n] = codes[-1]
        return PromptLayout(inputs, audio, labels, codes)

    # -- teacher-forced forward (parity b.*, scoring) ---------------------------------------------
    def forward(self, inputs_embeds: torch.Tensor | None = None, rvq: ResidualVQ | None = None, *,
                llm_indices=None, llm_token_ids=None, llm_word_ids=None) -> SpokenLMOutput:
        """Run the LM on given ``inputs_embeds`` (1, T, H) or on a whole prompt (the §4.4 layout
        built from llm_indices / llm_token_ids / llm_word_ids); both heads on every position."""
        if rvq is None:
            raise ValueError("TasteSpokenLM.forward needs rvq (the audio tower's ResidualVQ, model.audio_tower.vq.rvq)")
        text_labels = taste_labels = None
        if inputs_embeds is None:
            if llm_indices is None or llm_token_ids is None or llm_word_ids is None:
                raise ValueError("pass either inputs_embeds or all of llm_indices, llm_token_ids, llm_word_ids")
            prompt = self.prepare_inputs(llm_indices, llm_token_ids, llm_word_ids, rvq)
            inputs_embeds, taste_labels = prompt.inputs_embeds, prompt.taste_labels.unsqueeze(0)
            pad = llm_token_ids.new_full((1, self.delay + 1), IGNORE)
            text_labels = torch.cat([llm_token_ids.long(), pad.long()], dim=1)
        hidden = self.backbone(inputs_embeds=inputs_embeds.to(self.lm_dtype), use_cache=False).last_hidden_state
        head = self.extract_for_bridge_out_llm
        z = head.latent(hidden)
        indices, taste_logits = head.quantize(z, rvq)
        return SpokenLMOutput(
            inputs_embeds=inputs_embeds,
            last_hidden_state=hidden,
            text_logits=self.text_head(hidden),
            taste_mu=head.fc_mu(hidden.float()),
            taste_z=z,
            taste_indices=indices,
            taste_logits=taste_logits,
            taste_labels=taste_labels,
            text_labels=text_labels,
        )

    # -- KV-cached decoding -----------------------------------------------------------------------
    def new_cache(self, kind: str = "auto", capacity: int | None = None, graph_mode: str = "auto"):
        """A KV cache for one decode: 'static' (preallocated ``capacity`` rows, decode steps replayed
        as CUDA graphs on CUDA - see ``lm_cache``), 'dynamic' (grows by concatenation), or 'auto':
        static on CUDA, dynamic elsewhere (on CPU the growing cache is faster: it attends to the
        rows fed so far only)."""
        if kind == "auto":
            kind = "static" if self.embed_tokens.weight.device.type == "cuda" else "dynamic"
        if kind == "dynamic":
            return DynamicLMCache()
        if kind == "static":
            return StaticLMCache(self.causal_lm.config, capacity or DEFAULT_STATIC_ROWS,
                                 device=self.embed_tokens.weight.device, dtype=self.lm_dtype, graph_mode=graph_mode)
        raise ValueError(f"cache kind must be one of {CACHE_KINDS}, got {kind!r}")

    def new_decode_state(self, input_ids=None, pending_audio: torch.Tensor | None = None,
                         cache=None) -> LMDecodeState:
        """``cache``: from ``new_cache`` (default: ``new_cache('auto')``)."""
        return LMDecodeState(cache=self.new_cache() if cache is None else cache, input_ids=list(input_ids or []),
                             audio_vec=self.pad_audio(), pending_audio=pending_audio)

    def feed(self, state: LMDecodeState, rows: torch.Tensor) -> torch.Tensor:
        """Append rows (1, T, H) to the cache (positions continue after the cached ones); returns
        the hidden state of the last row (1, H)."""
        if rows.dim() != 3 or rows.shape[0] != 1 or rows.shape[1] == 0:
            raise ValueError(f"rows must have shape (1, T>0, H), got {tuple(rows.shape)}")
        rows = rows.to(self.lm_dtype)
        state.last_hidden = state.cache.feed(self.backbone, rows)
        state.rows.append(rows)
        return state.last_hidden

    def heads(self, hidden_last: torch.Tensor, rvq: ResidualVQ, step: HeadsStep | None = None) -> StepHeads:
        """Both heads for one hidden state (1, H). ``step``: the decode's captured heads
        (``heads_step``), run instead of the eager ones (the same values)."""
        return self.compute_heads(hidden_last, rvq) if step is None else step(hidden_last)

    def heads_step(self, state: LMDecodeState, rvq: ResidualVQ) -> HeadsStep | None:
        """The captured heads of a decode on a static cache whose steps are captured (or rehearsed),
        kept by its cache; None elsewhere (the heads run eagerly)."""
        cache = state.cache
        if not isinstance(cache, StaticLMCache) or cache.graph_mode == "eager":
            return None
        if cache.heads_step is None or cache.heads_step.lm is not self or cache.heads_step.rvq is not rvq:
            cache.heads_step = HeadsStep(self, rvq, cache.graph_mode)
        return cache.heads_step

    def compute_heads(self, hidden_last: torch.Tensor, rvq: ResidualVQ) -> StepHeads:
        """``heads``, eagerly."""
        z = self.extract_for_bridge_out_llm.latent(hidden_last)
        indices, taste_logits = LatentTasteHead.quantize(z, rvq)
        return StepHeads(self.text_head(hidden_last)[0], taste_logits[0], indices[0], z[0])

    def reference_heads(self, rows: torch.Tensor, rvq: ResidualVQ) -> StepHeads:
        """The original step: the whole sequence (1, T, H) through the backbone without a cache and
        both heads on every position; returns the last position's."""
        hidden = self.backbone(inputs_embeds=rows.to(self.lm_dtype), use_cache=False).last_hidden_state
        text_logits = self.text_head(hidden)
        z = self.extract_for_bridge_out_llm.latent(hidden)
        indices, taste_logits = LatentTasteHead.quantize(z, rvq)
        return StepHeads(text_logits[0, -1], taste_logits[0, -1], indices[0, -1], z[0, -1])

    def advance_audio(self, state: LMDecodeState, decision: Decision, rvq: ResidualVQ) -> None:
        """Choose the audio side of the next row from the sampler's TASTE decision (§5.2)."""
        action = decision.taste_action
        if action == TasteAction.SAMPLE:
            if decision.has_taste:  # otherwise keep the current code (fill forward)
                # (the sampler's codes come from this RVQ's own search: no range check to wait for)
                state.audio_vec = rvq.decode(decision.taste_ids.view(1, 1, -1), check=False)[0, 0].float()
        elif action == TasteAction.USE_PREFIX:
            if state.pending_audio is None:
                raise ValueError("the sampler asked for the prompt's last code but the decode state holds none")
            state.audio_vec, state.pending_audio = state.pending_audio, None
        elif action == TasteAction.WAIT:
            state.audio_vec = self.pad_audio()
        # USE_PREFIX_IGNORE keeps the current code.

    def next_row(self, state: LMDecodeState, text_id: int) -> torch.Tensor:
        """The fused row (1, 1, H) of a sampled token with the current audio vector."""
        return self.fuse(self.token_embeds([text_id]).float(), state.audio_vec).unsqueeze(0)

    def initial_context(self, mode: str, rvq: ResidualVQ, llm_token_ids=None, llm_indices=None, llm_word_ids=None,
                        instruct_prefix_ids=None, instruct_suffix_ids=None) -> InitialContext:
        """Rows and penalty ids each conditional mode starts from (spec §5.1)."""
        if mode not in MODES:
            raise ValueError(f"unknown conditional mode {mode!r}: use one of {MODES}")
        if mode == "zero":
            return InitialContext(self.token_embeds([self.sos_id]).unsqueeze(0).to(self.lm_dtype), [self.sos_id],
                                  None, False)
        if llm_token_ids is None:
            raise ValueError(f"conditional mode {mode!r} needs llm_token_ids (1, N)")
        _check_batch1("llm_token_ids", llm_token_ids, 2)
        if llm_token_ids.shape[1] == 0:
            raise ValueError("llm_token_ids is empty: give at least one prompt token (or use mode 'zero')")
        if mode == "text":  # raw embeddings, no SOS, no fusion (as the original)
            return InitialContext(self.token_embeds(llm_token_ids[0]).unsqueeze(0).to(self.lm_dtype),
                                  llm_token_ids[0].tolist(), None, False)
        if llm_indices is None or llm_word_ids is None:
            raise ValueError(f"conditional mode {mode!r} needs llm_indices (1, N, K) and llm_word_ids (1, N)")
        prompt = self.prepare_inputs(llm_indices, llm_token_ids, llm_word_ids, rvq)
        n = llm_token_ids.shape[1]
        if mode == "audio":  # SOS + N fused rows; the last word's code waits for the first new token
            return InitialContext(prompt.inputs_embeds[:, : n + 1], llm_token_ids[0].tolist(),
                                  prompt.audio_embeds[-1], True)
        if instruct_prefix_ids is None or instruct_suffix_ids is None:
            raise ValueError("conditional mode 'instruct' needs instruct_prefix_ids and instruct_suffix_ids (lists of ids)")
        prefix = list(instruct_prefix_ids)
        suffix = list(instruct_suffix_ids)
        parts = [prompt.inputs_embeds[:, 1 : n + 1]]
        if prefix:
            parts.insert(0, self.token_embeds(prefix).unsqueeze(0).to(self.lm_dtype))
        if suffix:
            parts.append(self.token_embeds(suffix).unsqueeze(0).to(self.lm_dtype))
        # The original drops llm_token_ids[0] from the penalty ids (it assumed a BOS there).
        return InitialContext(torch.cat(parts, dim=1), prefix + llm_token_ids[0, 1:].tolist() + suffix, None, False)

    @torch.no_grad()
    def generate(self, rvq: ResidualVQ, sampler: TasteSampler, mode: str = "audio", llm_token_ids=None,
                 llm_indices=None, llm_word_ids=None, instruct_prefix_ids=None, instruct_suffix_ids=None,
                 stop_id=None, extra_words: int | None = None, max_steps: int | None = 4096,
                 use_cache: bool = True, generator: torch.Generator | None = None,
                 context: InitialContext | None = None, cache_kind: str = "auto") -> GenerationOutput:
        """The original generate loop (§5.2) with a KV cache, or (``use_cache=False``) recomputing
        the whole sequence and both heads on every position at each step like the original.
        ``context`` replaces the mode's initial rows (any prompt layout); ``stop_id`` may be one id
        or several. ``max_steps`` guards models that never reach the end rules (the original has
        no limit). ``cache_kind``: see ``new_cache``."""
        if context is None:
            context = self.initial_context(mode, rvq, llm_token_ids, llm_indices, llm_word_ids,
                                           instruct_prefix_ids, instruct_suffix_ids)
        cache = self.new_cache(cache_kind, capacity=context.rows.shape[1] + 256) if use_cache else None
        state = self.new_decode_state(context.input_ids, context.pending_audio, cache=cache)
        sstate = sampler.reset(has_prefix=context.has_prefix, stop_id=stop_id, extra_words=extra_words)
        trace = GenerationTrace()
        gen_ids: list[int] = []
        gen_word_ids: list[int] = []
        gen_taste: list[torch.Tensor] = []
        if use_cache:
            self.feed(state, context.rows)
        else:
            state.rows.append(context.rows)
        end_reason = "max_steps"
        step = 0
        while max_steps is None or step < max_steps:
            step += 1
            if use_cache:
                heads = self.heads(state.last_hidden, rvq)
                seq_len = state.length
            else:
                rows = state.inputs_embeds()
                heads = self.reference_heads(rows, rvq)
                seq_len = rows.shape[1]
            decision = sampler.update(sstate, heads.text_logits, heads.taste_logits, state.input_ids, generator)
            state.input_ids.append(decision.text_id)  # always, even at the terminating step
            trace.seq_len.append(seq_len)
            trace.text_logits_last_raw.append(heads.text_logits)
            trace.taste_z_last.append(heads.taste_z)
            trace.taste_argmax_last.append(heads.taste_logits.argmax(-1))
            trace.text_id.append(decision.text_id)
            trace.taste_ids.append(decision.taste_ids)
            trace.action.append(int(decision.action))
            trace.taste_action.append(int(decision.taste_action))
            trace.word_counter_after.append(sstate.word_counter)
            if decision.emits_text:
                gen_ids.append(decision.text_id)
                last = gen_word_ids[-1] if gen_word_ids else -1
                gen_word_ids.append(last + 1 if decision.action == Action.CONTINUE_AT_WORD_START else max(last, 0))
            if decision.taste_action == TasteAction.SAMPLE:
                gen_taste.append(decision.taste_ids)
            self.advance_audio(state, decision, rvq)
            if decision.action == Action.TERMINATE:
                end_reason = sstate.end_reason
                break
            row = self.next_row(state, decision.text_id)
            if use_cache:
                self.feed(state, row)
            else:
                state.rows.append(row)
        device = context.rows.device
        k = rvq.num_quantizers
        return GenerationOutput(
            token_ids=torch.tensor([gen_ids], dtype=torch.long, device=device),
            word_ids=torch.tensor([gen_word_ids], dtype=torch.int32, device=device),
            taste_rows=(to_device(torch.stack(gen_taste), device).unsqueeze(0) if gen_taste
                        else torch.zeros(1, 0, k, dtype=torch.long, device=device)),
            first_inputs_embeds=context.rows,
            final_inputs_embeds=state.inputs_embeds(),
            trace=trace,
            end_reason=end_reason,
        )
