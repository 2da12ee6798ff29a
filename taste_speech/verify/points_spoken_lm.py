"""Parity points of the spoken LM: teacher forcing (``b.*``), the sampler tables (``sampler.*``),
greedy generation in 'audio' and 'text' mode with full per-step traces (``c.*``, checked for the
KV-cached loop and for the original no-cache loop) and the input-layout helpers (``e.*``)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch

from taste_speech.sampler import SamplingParams, TasteSampler, VocabularyTables
from taste_speech.verify import FLOAT_TOL, Golden, PointResult, compare

LOGIT_TOL = 1e-4  # observed <= 3e-5 (the README suggests 1e-3 on logits)
TRACE_FIELDS = ("text_id", "action", "taste_action", "seq_len", "word_counter_after")


class PieceTokenizer:
    """The golden sets' stand-in Llama tokenizer (``llm_tokenizer_stub.json``): ``pieces[i]`` is
    decode(i) and decoding a list concatenates the pieces. It offers only ``len()`` and
    ``decode``, like the original sampler needs (so the ban list falls back to the original's
    literal 128001, which a 1024-id vocabulary does not have)."""

    def __init__(self, pieces: list[str]):
        self.pieces = list(pieces)

    @classmethod
    def from_golden(cls, directory: str) -> "PieceTokenizer":
        with open(os.path.join(directory, "llm_tokenizer_stub.json")) as f:
            return cls(json.load(f)["pieces"])

    def __len__(self) -> int:
        return len(self.pieces)

    def decode(self, ids) -> str:
        if isinstance(ids, int):
            return self.pieces[ids]
        return "".join(self.pieces[int(i)] for i in ids)


def golden_sampler(golden: Golden, extra_words: int | None = None) -> TasteSampler:
    """The sampler of parity point c: greedy text and TASTE, extra_words from the golden spec."""
    tables = VocabularyTables.from_tokenizer(PieceTokenizer.from_golden(golden.dir))
    words = extra_words or golden.meta.get("spec", {}).get("extra_words", 4)
    return TasteSampler(tables, SamplingParams(text_top_p=0.0, taste_top_p=0.0, text_temperature=1.0,
                                               repetition_penalty=1.0, extra_words=words))


def load_golden_spoken_lm(directory: str):
    """The spoken LM and the RVQ of a golden checkpoint, loaded directly from model.safetensors
    (``spoken_lm.`` and ``audio_tower.vq.rvq.`` tensors, lm_head tied to embed_tokens), without
    the rest of the model. Returns an object with ``.spoken_lm`` and ``.audio_tower.vq.rvq``."""
    from safetensors.torch import load_file

    from taste_speech.configuration_taste import TasteConfig
    from taste_speech.modeling_rvq import ResidualVQ
    from taste_speech.modeling_spoken_lm import TasteSpokenLM

    config = TasteConfig.from_pretrained(directory)
    quant = config.audio_tower_config.kwargs_for_quantizer
    state = load_file(os.path.join(directory, "model.safetensors"))
    lm = TasteSpokenLM(config)
    lm_state = {k[len("spoken_lm."):]: v for k, v in state.items() if k.startswith("spoken_lm.")}
    missing, unexpected = lm.load_state_dict(lm_state, strict=False)
    head = "language_model.base_model.model.lm_head.weight"
    if unexpected or set(missing) - {head}:
        raise ValueError(f"spoken_lm tensors do not match: missing {missing}, unexpected {unexpected}")
    lm.tie_lm_head()
    lm.round_rope_frequencies()
    rvq = ResidualVQ(int(quant["dim"]), int(quant["num_quantizers"]), int(quant["codebook_size"]),
                     int(quant["codebook_dim"]))
    prefix = "audio_tower.vq.rvq."
    rvq.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
    return SimpleNamespace(spoken_lm=lm.float().eval(), audio_tower=SimpleNamespace(vq=SimpleNamespace(rvq=rvq.eval())))


def _top2_gap(banned_logits: torch.Tensor) -> float:
    top = banned_logits.topk(2).values
    return float(top[0] - top[1])


def run(golden: Golden, model) -> list[PointResult]:
    lm, rvq = model.spoken_lm, model.audio_tower.vq.rvq
    g = golden
    results: list[PointResult] = []

    def check(name, actual, tol=FLOAT_TOL, tag=""):
        results.append(compare(name + tag, actual, g[name], tol))

    # b: the §4.4 layout and the teacher-forced forward.
    prompt = lm.prepare_inputs(g["a.out.llm_indices"], g["in.llm_token_ids"], g["in.llm_word_ids"], rvq)
    check("b.prepare_single.inputs_embeds", prompt.inputs_embeds[0].float())
    check("b.prepare_single.audio_embeds", prompt.audio_embeds)
    out = lm(rvq=rvq, llm_indices=g["a.out.llm_indices"], llm_token_ids=g["in.llm_token_ids"],
             llm_word_ids=g["in.llm_word_ids"])
    n_rows = out.inputs_embeds.shape[1]
    check("b.inputs_embeds", out.inputs_embeds.float())
    check("b.attention_mask", torch.ones(1, n_rows, dtype=torch.bool))
    check("b.output_lengths", torch.tensor([n_rows], dtype=torch.int32))
    check("b.taste_labels", out.taste_labels)
    check("b.text_labels", out.text_labels)
    check("b.llm_last_hidden", out.last_hidden_state.float())
    check("b.text_logits", out.text_logits, LOGIT_TOL)
    check("b.taste_mu", out.taste_mu)
    check("b.taste_logvar", lm.extract_for_bridge_out_llm.b_logvar.float())
    check("b.taste_z", out.taste_z)
    check("b.taste_pred_indices", out.taste_indices)
    check("b.taste_logits", out.taste_logits)

    # sampler tables.
    sampler = golden_sampler(g)
    check("sampler.ban_mask", sampler.ban_mask)
    check("sampler.sentence_end_mask", sampler.sentence_end_mask)
    check("sampler.word_start_mask", sampler.word_start_mask)

    # c: greedy generation, with the KV cache and with the original no-cache loop.
    runs = {
        "audio": dict(mode="audio", llm_token_ids=g["in.llm_token_ids"], llm_indices=g["a.out.llm_indices"],
                      llm_word_ids=g["in.llm_word_ids"]),
        "text": dict(mode="text", llm_token_ids=g["in.text_prompt_ids"]),
    }
    for name, kwargs in runs.items():
        for use_cache in (True, False):
            gen = lm.generate(rvq, sampler, use_cache=use_cache, max_steps=1000, **kwargs)
            tag = "" if use_cache else " (no cache)"
            p = f"c.{name}."
            trace = gen.trace
            check(p + "generated_llm_token_ids", gen.token_ids, tag=tag)
            check(p + "generated_llm_word_ids", gen.word_ids, tag=tag)
            check(p + "generated_llm_indices", gen.taste_rows, tag=tag)
            check(p + "generated_llm_token_lengths", torch.tensor([[gen.token_ids.shape[1]]], dtype=torch.int32), tag=tag)
            check(p + "first_inputs_embeds", gen.first_inputs_embeds.float(), tag=tag)
            check(p + "final_inputs_embeds", gen.final_inputs_embeds.float(), tag=tag)
            for field in TRACE_FIELDS:
                check(p + "trace." + field, torch.tensor(getattr(trace, field)), tag=tag)
            check(p + "trace.taste_ids", torch.stack(trace.taste_ids), tag=tag)
            check(p + "trace.taste_argmax_last", torch.stack(trace.taste_argmax_last), tag=tag)
            check(p + "trace.text_logits_last_raw", torch.stack(trace.text_logits_last_raw), LOGIT_TOL, tag=tag)
            check(p + "trace.taste_z_last", torch.stack(trace.taste_z_last), tag=tag)
            gaps = [_top2_gap(sampler.sample_text(logits, [])[1]) for logits in trace.text_logits_last_raw]
            check(p + "trace.text_top2_gap", torch.tensor(gaps), LOGIT_TOL, tag=tag)

    # e: helpers on hand-made inputs.
    check("e.fill_forward.out", lm.fill_forward(g["in.e.fill_forward.in"]))
    check("e.encode_audio_fill_forward.out", lm.encode_audio_fill_forward(g["in.e.fill_forward.in"], rvq))
    one = lm.prepare_inputs(g["in.e.prepare_single_oneword.indices"][None],
                            g["in.e.prepare_single_oneword.token_ids"][None],
                            g["in.e.prepare_single_oneword.word_ids"][None], rvq)
    check("e.prepare_single_oneword.inputs_embeds", one.inputs_embeds[0].float())
    check("e.prepare_single_oneword.audio_embeds", one.audio_embeds)
    check("e.prepare_single_oneword.taste_labels", one.taste_labels)
    return results
