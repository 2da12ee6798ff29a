"""Spoken LM of TASTE (``spoken_lm.``): a Llama that reads and writes text and TASTE codes jointly.

Every input row fuses a text embedding with a TASTE embedding (weighted sum after a projection);
every output row predicts the next text token (tied LM head) and, through a latent regression
head, the TASTE code of the word just finished. TASTE runs one word behind the text (spec §4).

The Llama is transformers' ``LlamaForCausalLM`` wrapped by peft LoRA, so the state-dict names are
the published ``language_model.base_model.model.…`` ones. Generation here is KV-cached: the prompt
is prefilled once and each step feeds one row (the original re-ran the whole sequence per step;
``generate(..., use_cache=False)`` keeps that algorithm as a reference).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import DynamicCache, LlamaForCausalLM

from taste_speech.configuration_taste import TasteConfig
from taste_speech.modeling_rvq import ResidualVQ
from taste_speech.sampler import Action, TasteAction, TasteSampler

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IGNORE = -1


class WeightedSumFusion(nn.Module):
    """fuse(text, audio) = softmax(weights)[0] * linear(audio) + softmax(weights)[1] * text."""

    def __init__(self, audio_dim: int, text_dim: int):
        super().__init__()
        self.linear = nn.Linear(audio_dim, text_dim)
        self.weights = nn.Parameter(torch.tensor([-2.0, 2.0]))

    def forward(self, text_vec: torch.Tensor, audio_vec: torch.Tensor) -> torch.Tensor:
        s_audio, s_text = self.weights.float().softmax(-1)
        audio = self.linear(audio_vec.to(self.linear.weight.dtype)).float()
        return s_audio * audio + s_text * text_vec.float()


class LatentTasteHead(nn.Module):
    """`continue_latent_linear_last`: regress a code-space latent, quantise it with the RVQ."""

    def __init__(self, hidden: int, codebook_dim: int):
        super().__init__()
        self.fc_mu = nn.Linear(hidden, codebook_dim)
        self.b_logvar = nn.Parameter(torch.zeros(codebook_dim))

    def latent(self, hidden_states: torch.Tensor) -> torch.Tensor:
        mu = self.fc_mu(hidden_states.float())
        return mu + torch.exp(0.5 * self.b_logvar.float())  # inference uses mean + sigma

    def forward(self, hidden_states, rvq: ResidualVQ, codebook_size: int):
        indices = rvq.indices_from_code(self.latent(hidden_states))
        return indices, F.one_hot(indices, codebook_size).float() * 1000.0


@dataclass
class LMInputs:
    """Rows of a prompt in the §4.4 layout."""

    inputs_embeds: torch.Tensor  # (1, N+2, H): SOS, N fused rows, (pad_text, last code)
    audio_embeds: torch.Tensor  # (N+1, dim) audio side of the fusion (delayed, filled forward)
    taste_labels: torch.Tensor  # (N+2, K) training targets, IGNORE elsewhere


@dataclass
class GenerationTrace:
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
    word_ids: torch.Tensor  # (1, G) int32 word index of each generated token
    taste_rows: torch.Tensor  # (1, R, K) one row per 'sample' step (-1 rows when no code)
    first_inputs_embeds: torch.Tensor
    final_inputs_embeds: torch.Tensor
    trace: GenerationTrace
    end_reason: str  # 'sentence_end' | 'max_words' | 'stop_id' | 'max_steps'


@dataclass
class LMDecodeState:
    """Explicit state of one KV-cached decode: what the next row is made of."""

    cache: DynamicCache
    rows: list[torch.Tensor]  # every row fed so far (1, 1, H) - kept for traces/reference
    input_ids: list[int]  # ids for the repetition penalty
    audio_vec: torch.Tensor  # current audio side of the fusion
    pending_audio: torch.Tensor | None  # the prompt's withheld last-word code
    last_hidden: torch.Tensor | None = None  # (1, H) hidden state of the last fed row

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()


class TasteSpokenLM(nn.Module):
    def __init__(self, config: TasteConfig):
        super().__init__()
        lm_cfg = config.spoken_lm_config
        quant = config.audio_tower_config.kwargs_for_quantizer
        self.sos_id = int(lm_cfg.sos_id)
        self.delay = int(lm_cfg.delay)
        self.codebook_size = int(quant["codebook_size"])
        text_config = config.text_config
        hidden = text_config.hidden_size
        llama = LlamaForCausalLM(text_config)
        if lm_cfg.use_lora:
            lora = lm_cfg.kwargs_for_lora
            llama = get_peft_model(
                llama,
                LoraConfig(
                    r=int(lora["lora_r"]),
                    lora_alpha=int(lora["lora_alpha"]),
                    lora_dropout=float(lora.get("lora_dropout", 0.0)),
                    target_modules=LORA_TARGETS,
                    bias="none",
                    task_type="CAUSAL_LM",
                ),
            )
        self.language_model = llama
        audio_dim = int(quant["dim"])  # 1280 in the published model (the original hard-codes it)
        self.fuse_for_bridge_in_llm = WeightedSumFusion(audio_dim, hidden)
        self.extract_for_bridge_out_llm = LatentTasteHead(hidden, int(quant["codebook_dim"]))
        self.pad_text_unit_embed = nn.Parameter(torch.zeros(hidden))
        self.pad_audio_unit_embed = nn.Parameter(torch.zeros(audio_dim))
        self.round_rope_frequencies()

    @torch.no_grad()
    def round_rope_frequencies(self) -> None:
        """Round RoPE's inverse frequencies to bfloat16 precision, as the original model has them.

        The original casts its Llama to bfloat16 right after construction, which also rounds the
        (non-persistent) ``inv_freq`` buffer; the checkpoint was trained and is run with those
        rounded frequencies, so fp32 runs must use them too (the goldens agree only this way).
        Call again after materialising a model built on the meta device."""
        rotary = self.causal_lm.model.rotary_emb
        if rotary.inv_freq.device.type == "meta":
            return
        rounded = rotary.inv_freq.to(torch.bfloat16).to(rotary.inv_freq.dtype)
        rotary.inv_freq.copy_(rounded)
        if hasattr(rotary, "original_inv_freq"):
            rotary.original_inv_freq = rounded.clone()

    # -- pieces of the Llama ----------------------------------------------------------------
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

    def tie_lm_head(self) -> None:
        self.causal_lm.lm_head.weight = self.embed_tokens.weight

    def text_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.causal_lm.lm_head(hidden_states).float()

    def taste_head(self, hidden_states: torch.Tensor, rvq: ResidualVQ):
        """(indices (…,K), one-hot×1000 logits (…,K,C))."""
        return self.extract_for_bridge_out_llm(hidden_states, rvq, self.codebook_size)

    def fuse(self, text_vec: torch.Tensor, audio_vec: torch.Tensor) -> torch.Tensor:
        return self.fuse_for_bridge_in_llm(text_vec, audio_vec).to(self.lm_dtype)

    def token_embeds(self, ids) -> torch.Tensor:
        ids = torch.as_tensor(ids, device=self.embed_tokens.weight.device).long()
        return self.embed_tokens(ids)

    # -- inputs (§4.2 - §4.4) ---------------------------------------------------------------
    @staticmethod
    def fill_forward(indices: torch.Tensor) -> torch.Tensor:
        """Replace every invalid row (any index < 0) by the closest earlier valid row. (1,T,K)."""
        valid = (indices >= 0).all(-1)  # (B, T)
        if not bool(valid[:, 0].all()):
            raise ValueError("the first TASTE row must be valid to fill forward (no earlier code to carry)")
        positions = torch.arange(indices.shape[1], device=indices.device).expand_as(valid)
        source = torch.where(valid, positions, torch.zeros_like(positions)).cummax(dim=1).values
        return indices.gather(1, source.unsqueeze(-1).expand_as(indices))

    def encode_audio_fill_forward(self, indices: torch.Tensor, rvq: ResidualVQ) -> torch.Tensor:
        return rvq.decode(self.fill_forward(indices)).float()

    def delayed_audio_embeds(self, llm_indices: torch.Tensor, llm_word_ids: torch.Tensor, rvq: ResidualVQ):
        """Audio side for a prompt (N+1, dim): pad before word 1, then the previous word's code
        carried over the whole current word, then the last word's code once more."""
        indices, word_ids = llm_indices[0], llm_word_ids[0].long()
        rows = indices[(indices >= 0).all(-1)]  # one code row per word, in order
        n_words = int(word_ids.max()) + 1
        if rows.shape[0] != n_words:
            raise ValueError(f"llm_indices carry {rows.shape[0]} codes but the text has {n_words} words")
        pad = self.pad_audio_unit_embed.float().unsqueeze(0)
        codes = rvq.decode(rows.unsqueeze(0))[0].float()  # (W, dim)
        prev_word = word_ids - 1
        per_token = torch.where(
            (prev_word >= 0).unsqueeze(-1), codes[prev_word.clamp(min=0)], pad.expand(len(word_ids), -1)
        )
        return torch.cat([per_token, codes[-1:]], dim=0), rows

    def prepare_inputs(self, llm_indices, llm_token_ids, llm_word_ids, rvq: ResidualVQ) -> LMInputs:
        """The §4.4 layout of a prompt of N tokens: N+2 rows."""
        audio, rows = self.delayed_audio_embeds(llm_indices, llm_word_ids, rvq)
        text = self.token_embeds(llm_token_ids[0]).float()
        text = torch.cat([text, self.pad_text_unit_embed.float().unsqueeze(0)], dim=0)
        fused = self.fuse(text, audio)
        sos = self.token_embeds([self.sos_id]).to(self.lm_dtype)
        inputs = torch.cat([sos, fused], dim=0).unsqueeze(0)
        # TASTE labels: code of word k at the row predicting word k+1's first token, last code at row N.
        n = llm_token_ids.shape[1]
        labels = torch.full((n + 2, rows.shape[-1]), IGNORE, dtype=torch.long, device=rows.device)
        word_ids = llm_word_ids[0].long()
        starts = [int(i) for i in range(n) if i == 0 or word_ids[i] != word_ids[i - 1]]
        for k, s in enumerate(starts[1:]):
            labels[s] = rows[k]
        labels[n] = rows[-1]
        return LMInputs(inputs, audio, labels)

    # -- teacher-forced forward (parity / scoring) -------------------------------------------
    def forward(self, inputs_embeds: torch.Tensor, rvq: ResidualVQ):
        hidden = self.backbone(inputs_embeds=inputs_embeds.to(self.lm_dtype), use_cache=False).last_hidden_state
        indices, taste_logits = self.taste_head(hidden, rvq)
        return hidden, self.text_logits(hidden), indices, taste_logits

    # -- KV-cached decoding -------------------------------------------------------------------
    def feed(self, state: LMDecodeState, rows: torch.Tensor) -> torch.Tensor:
        """Append rows (1, T, H) to the cache; returns the hidden state of the last row (1, H)."""
        out = self.backbone(inputs_embeds=rows.to(self.lm_dtype), past_key_values=state.cache, use_cache=True)
        state.last_hidden = out.last_hidden_state[:, -1]
        state.rows.extend(rows.split(1, dim=1))
        return state.last_hidden

    def new_decode_state(self, audio_vec=None, pending_audio=None, input_ids=None) -> LMDecodeState:
        return LMDecodeState(
            cache=DynamicCache(),
            rows=[],
            input_ids=list(input_ids or []),
            audio_vec=self.pad_audio_unit_embed.float() if audio_vec is None else audio_vec,
            pending_audio=pending_audio,
        )

    def initial_context(self, mode, rvq, llm_token_ids=None, llm_indices=None, llm_word_ids=None,
                        instruct_prefix_ids=None, instruct_suffix_ids=None):
        """(rows (1,T,H), input ids for the penalty, pending audio, has_prefix) per §5.1."""
        if mode == "zero":
            return self.token_embeds([self.sos_id]).unsqueeze(0), [self.sos_id], None, False
        if mode == "text":
            return self.token_embeds(llm_token_ids[0]).unsqueeze(0), llm_token_ids[0].tolist(), None, False
        prompt = self.prepare_inputs(llm_indices, llm_token_ids, llm_word_ids, rvq)
        n = llm_token_ids.shape[1]
        if mode == "audio":
            pending = prompt.audio_embeds[-1]
            return prompt.inputs_embeds[:, : n + 1], llm_token_ids[0].tolist(), pending, True
        if mode == "instruct":
            pre = self.token_embeds(instruct_prefix_ids).unsqueeze(0)
            suf = self.token_embeds(instruct_suffix_ids).unsqueeze(0)
            rows = torch.cat([pre.to(self.lm_dtype), prompt.inputs_embeds[:, 1 : n + 1], suf.to(self.lm_dtype)], 1)
            ids = list(instruct_prefix_ids) + llm_token_ids[0, 1:].tolist() + list(instruct_suffix_ids)
            return rows, ids, None, False
        raise ValueError(f"unknown conditional mode {mode!r}: use 'audio', 'text', 'zero' or 'instruct'")

    def heads_at(self, hidden_last: torch.Tensor, rvq: ResidualVQ):
        text_logits = self.text_logits(hidden_last)[0]
        z = self.extract_for_bridge_out_llm.latent(hidden_last)
        indices, taste_logits = self.taste_head(hidden_last, rvq)
        return text_logits, taste_logits[0], z[0]

    @torch.no_grad()
    def generate(self, rvq: ResidualVQ, sampler: TasteSampler, mode: str = "audio", llm_token_ids=None,
                 llm_indices=None, llm_word_ids=None, instruct_prefix_ids=None, instruct_suffix_ids=None,
                 stop_id=None, extra_words=None, max_steps: int = 2048, use_cache: bool = True,
                 generator=None) -> GenerationOutput:
        """The original generate loop (§5.2) - with a KV cache, or recomputing everything."""
        rows, input_ids, pending, has_prefix = self.initial_context(
            mode, rvq, llm_token_ids, llm_indices, llm_word_ids, instruct_prefix_ids, instruct_suffix_ids
        )
        state = self.new_decode_state(pending_audio=pending, input_ids=input_ids)
        sstate = sampler.new_state(has_prefix=has_prefix, stop_id=stop_id, extra_words=extra_words)
        trace = GenerationTrace()
        gen_ids, gen_word_ids, gen_taste = [], [], []
        first = rows.clone()
        all_rows = rows
        hidden = self.feed(state, rows) if use_cache else None
        end_reason = "max_steps"
        for _ in range(max_steps):
            if not use_cache:
                hidden = self.backbone(inputs_embeds=all_rows.to(self.lm_dtype), use_cache=False).last_hidden_state[:, -1]
            text_logits, taste_logits, z = self.heads_at(hidden, rvq)
            trace.seq_len.append(all_rows.shape[1])
            trace.text_logits_last_raw.append(text_logits.clone())
            trace.taste_z_last.append(z)
            trace.taste_argmax_last.append(taste_logits.argmax(-1))
            d = sampler.update(sstate, text_logits, taste_logits, state.input_ids, generator)
            state.input_ids.append(d.text_id)
            trace.text_id.append(d.text_id)
            trace.taste_ids.append(d.taste_ids)
            trace.action.append(int(d.action))
            trace.taste_action.append(int(d.taste_action))
            trace.word_counter_after.append(sstate.word_counter)
            if d.action not in (Action.WAIT_FOR_TASTE, Action.TERMINATE):
                gen_ids.append(d.text_id)
                if d.action == Action.CONTINUE_AT_WORD_START:
                    gen_word_ids.append(gen_word_ids[-1] + 1 if gen_word_ids else 0)
                else:
                    gen_word_ids.append(gen_word_ids[-1] if gen_word_ids else 0)
            self._advance_audio(state, d, gen_taste, rvq)
            if d.action == Action.TERMINATE:
                if sstate.stop_id is not None and d.text_id == sstate.stop_id:
                    end_reason = "stop_id"
                else:
                    end_reason = "max_words" if sstate.word_counter > sstate.max_words else "sentence_end"
                break
            row = self.fuse(self.token_embeds([d.text_id]).float(), state.audio_vec).unsqueeze(0)
            all_rows = torch.cat([all_rows, row.to(all_rows.dtype)], dim=1)
            if use_cache:
                hidden = self.feed(state, row)
        device = first.device
        k = rvq.num_quantizers
        return GenerationOutput(
            token_ids=torch.tensor([gen_ids], dtype=torch.long, device=device),
            word_ids=torch.tensor([gen_word_ids], dtype=torch.int32, device=device),
            taste_rows=(torch.stack(gen_taste).unsqueeze(0) if gen_taste
                        else torch.zeros(1, 0, k, dtype=torch.long, device=device)),
            first_inputs_embeds=first,
            final_inputs_embeds=all_rows,
            trace=trace,
            end_reason=end_reason,
        )

    def _advance_audio(self, state: LMDecodeState, d, gen_taste: list, rvq: ResidualVQ) -> None:
        """Choose the audio side of the next row from the sampler's TASTE decision."""
        if d.taste_action == TasteAction.SAMPLE:
            gen_taste.append(d.taste_ids)
            if bool((d.taste_ids >= 0).all()):
                state.audio_vec = rvq.decode(d.taste_ids.view(1, 1, -1))[0, 0].float()
        elif d.taste_action == TasteAction.USE_PREFIX:
            state.audio_vec, state.pending_audio = state.pending_audio, None
        elif d.taste_action == TasteAction.WAIT:
            state.audio_vec = self.pad_audio_unit_embed.float()
