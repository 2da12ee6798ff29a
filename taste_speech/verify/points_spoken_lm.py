"""Parity points of the spoken LM: teacher forcing (``b.*``), greedy generation in 'audio' and
'text' mode with full per-step traces (``c.*``) and the input-layout helpers (``e.*``)."""

from __future__ import annotations

import json
import os

import torch

from taste_speech.sampler import SamplingParams, TasteSampler, VocabularyTables
from taste_speech.verify import FLOAT_TOL, Golden, PointResult, compare

LOGIT_TOL = 1e-4  # the issue asks <= 1e-4 on logits too (observed <= 3e-5)


class PieceTokenizer:
    """The golden sets' stand-in Llama tokenizer: ``pieces[i]`` is decode([i])."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    @classmethod
    def from_golden(cls, directory: str) -> "PieceTokenizer":
        with open(os.path.join(directory, "llm_tokenizer_stub.json")) as f:
            return cls(json.load(f)["pieces"])

    def __len__(self) -> int:
        return len(self.pieces)

    def decode(self, ids) -> str:
        return "".join(self.pieces[i] for i in ids)


def golden_sampler(golden: Golden, extra_words: int | None = None) -> TasteSampler:
    tables = VocabularyTables.from_tokenizer(PieceTokenizer.from_golden(golden.dir))
    words = extra_words or golden.meta.get("spec", {}).get("extra_words", 4)
    return TasteSampler(tables, SamplingParams(text_top_p=0.0, text_temperature=1.0,
                                               repetition_penalty=1.0, extra_words=words))


def run(golden: Golden, model) -> list[PointResult]:
    lm, rvq = model.spoken_lm, model.rvq
    results: list[PointResult] = []
    g = golden

    def check(name, actual, tol=FLOAT_TOL, label=None):
        results.append(compare(label or name, actual, g[name], tol))

    prompt = lm.prepare_inputs(g["a.out.llm_indices"], g["in.llm_token_ids"], g["in.llm_word_ids"], rvq)
    check("b.prepare_single.inputs_embeds", prompt.inputs_embeds[0].float())
    check("b.prepare_single.audio_embeds", prompt.audio_embeds)
    check("b.taste_labels", prompt.taste_labels.unsqueeze(0))
    check("b.inputs_embeds", prompt.inputs_embeds.float())
    hidden, text_logits, indices, taste_logits = lm(g["b.inputs_embeds"], rvq)
    check("b.llm_last_hidden", hidden.float())
    check("b.text_logits", text_logits, LOGIT_TOL)
    check("b.taste_mu", lm.extract_for_bridge_out_llm.fc_mu(hidden.float()))
    check("b.taste_logvar", lm.extract_for_bridge_out_llm.b_logvar.float())
    check("b.taste_z", lm.extract_for_bridge_out_llm.latent(hidden))
    check("b.taste_pred_indices", indices)
    check("b.taste_logits", taste_logits)

    sampler = golden_sampler(g)
    tables = sampler.tables
    check("sampler.ban_mask", tables.banned)
    check("sampler.sentence_end_mask", tables.sentence_end)
    check("sampler.word_start_mask", tables.word_start)

    runs = {
        "audio": dict(mode="audio", llm_token_ids=g["in.llm_token_ids"], llm_indices=g["a.out.llm_indices"],
                      llm_word_ids=g["in.llm_word_ids"]),
        "text": dict(mode="text", llm_token_ids=g["in.text_prompt_ids"]),
    }
    for name, kwargs in runs.items():
        for use_cache in (True, False):
            out = lm.generate(rvq, sampler, use_cache=use_cache, **kwargs)
            tag = "" if use_cache else " (no cache)"
            p = f"c.{name}."
            tr = out.trace
            check(p + "generated_llm_token_ids", out.token_ids, label=p + "generated_llm_token_ids" + tag)
            check(p + "generated_llm_word_ids", out.word_ids, label=p + "generated_llm_word_ids" + tag)
            check(p + "generated_llm_indices", out.taste_rows, label=p + "generated_llm_indices" + tag)
            check(p + "generated_llm_token_lengths", torch.tensor([[out.token_ids.shape[1]]], dtype=torch.int32),
                  label=p + "generated_llm_token_lengths" + tag)
            check(p + "first_inputs_embeds", out.first_inputs_embeds.float(), label=p + "first_inputs_embeds" + tag)
            check(p + "final_inputs_embeds", out.final_inputs_embeds.float(), label=p + "final_inputs_embeds" + tag)
            for field in ("text_id", "action", "taste_action", "seq_len", "word_counter_after"):
                check(p + "trace." + field, torch.tensor(getattr(tr, field)), label=p + "trace." + field + tag)
            check(p + "trace.taste_ids", torch.stack(tr.taste_ids), label=p + "trace.taste_ids" + tag)
            check(p + "trace.taste_argmax_last", torch.stack(tr.taste_argmax_last), label=p + "trace.taste_argmax_last" + tag)
            check(p + "trace.text_logits_last_raw", torch.stack(tr.text_logits_last_raw), LOGIT_TOL,
                  label=p + "trace.text_logits_last_raw" + tag)
            check(p + "trace.taste_z_last", torch.stack(tr.taste_z_last), label=p + "trace.taste_z_last" + tag)

    check("e.fill_forward.out", lm.fill_forward(g["in.e.fill_forward.in"]))
    check("e.encode_audio_fill_forward.out", lm.encode_audio_fill_forward(g["in.e.fill_forward.in"], rvq))
    one = lm.prepare_inputs(g["in.e.prepare_single_oneword.indices"][None], g["in.e.prepare_single_oneword.token_ids"][None],
                            g["in.e.prepare_single_oneword.word_ids"][None], rvq)
    check("e.prepare_single_oneword.inputs_embeds", one.inputs_embeds[0].float())
    check("e.prepare_single_oneword.audio_embeds", one.audio_embeds)
    check("e.prepare_single_oneword.taste_labels", one.taste_labels)
    return results
