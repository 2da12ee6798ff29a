"""Parity points of the audio tower (``a.*``) and of the word-alignment helpers (``e.words_index``,
``e.word_start_map``, ``e.convert_embeds``) against a taste_lm golden directory.

``model`` is anything with an ``audio_tower`` attribute (TasteForCausalLM) or a TasteAudioTower.
"""

from __future__ import annotations

import torch

from taste_speech.pooler_graph import PoolerGraph
from taste_speech.verify import FLOAT_TOL, Golden, PointResult, compare
from taste_speech.word_alignment import (
    convert_embeds_by_word_end,
    llm_indices_from_asr,
    multi_token_word_spans,
    word_start_mapping,
)


def run(golden: Golden, model) -> list[PointResult]:
    tower = getattr(model, "audio_tower", model)
    results: list[PointResult] = []

    def check(name: str, actual, tol: float = FLOAT_TOL) -> None:
        if name not in golden:
            results.append(PointResult(name, float("inf"), tol, False, "missing from the golden set"))
            return
        results.append(compare(name, actual, golden[name], tol))

    asr_ids, asr_word_ids = golden["in.asr_token_ids"], golden["in.asr_word_ids"]
    llm_word_ids = golden["in.llm_word_ids"]
    asr_lengths, llm_lengths = golden["in.asr_token_lengths"], golden["in.llm_token_lengths"]
    device = next(tower.parameters()).device

    with torch.inference_mode():
        out = tower(golden["in.audio_features"].to(device), asr_ids.to(device), asr_word_ids.to(device))
        check("a.encoder.target_hidden", out.encoder_target_hidden.float())
        check("a.encoder.last_hidden", out.encoder_last_hidden.float())
        check("a.whisper_text_token", out.decoder_input_ids)
        check("a.decoder.last_hidden", out.decoder_last_hidden.float())
        for layer, probs in enumerate(out.cross_attn_probs):
            check(f"a.decoder.cross_attn_probs.layer{layer}", probs.float())
        check("a.segmented_feats_with_eos", out.segmented_feats_with_eos)
        # Spans of the multi-token words the pooling averaged (the original's words_index).
        check("a.segmenter.words_index", multi_token_word_spans(asr_word_ids, asr_lengths))
        check("a.vq.input", out.pooled_embeds)
        check("a.vq.mask", torch.ones_like(asr_ids, dtype=torch.bool))  # batch 1: every token is valid

        rvq = tower.vq.rvq
        # Sub-steps of the RVQ, each fed the golden input of that step so a mismatch is localised.
        vq_input = golden["a.vq.input"].to(device)
        check("a.vq.project_in", rvq.project_in(vq_input.to(rvq.project_in.weight.dtype)).float())
        check("a.vq.codes_per_layer", rvq.codes_from_indices(golden["a.out.asr_indices"].to(device)))
        check("a.vq.nn_distance_gap", nearest_code_gaps(rvq, vq_input), tol=1e-4)
        check("a.out.asr_indices", out.asr_indices)
        check("a.vq.quantized_feats", out.audio_unit_embeds)

        check("a.word_start_map", word_start_mapping(llm_word_ids, asr_word_ids, llm_lengths, asr_lengths))
        check("a.out.llm_indices", llm_indices_from_asr(out.asr_indices.cpu(), asr_word_ids, llm_word_ids,
                                                        asr_lengths, llm_lengths))
        # The public entry point (audio -> both index tensors) must agree with the step-wise path.
        _, llm_indices = tower.extract_vq(golden["in.audio_features"].to(device), asr_ids.to(device),
                                          asr_word_ids.to(device), llm_word_ids.to(device))
        results.append(
            compare("a.out.llm_indices (TasteAudioTower.extract_vq)", llm_indices, golden["a.out.llm_indices"])
        )
        # The fast path's text side (padded to a length bucket; a CUDA graph on CUDA, the capture
        # protocol elsewhere) must give the same codes from host ids.
        pooler = PoolerGraph(tower, "auto" if device.type == "cuda" else "rehearse")
        _, llm_indices = tower.extract_vq(golden["in.audio_features"].to(device), asr_ids.cpu(), asr_word_ids.cpu(),
                                          llm_word_ids.cpu(), pooler=pooler)
        results.append(compare("a.out.llm_indices (PoolerGraph)", llm_indices, golden["a.out.llm_indices"]))

    # Pure helpers on the batch-of-2 padded examples.
    p = "in.e.word_start_map."
    target_ids, source_ids = golden[p + "target_word_ids"], golden[p + "source_word_ids"]
    target_lengths, source_lengths = golden[p + "target_lengths"], golden[p + "source_lengths"]
    check("e.word_start_map.out", word_start_mapping(target_ids, source_ids, target_lengths, source_lengths))
    check("e.convert_embeds.out", convert_embeds_by_word_end(
        golden["in.e.convert_embeds.embeds"], target_ids, source_ids, target_lengths, source_lengths))
    # The original's token_lengths count the appended eos; the helper takes word-id lengths.
    check("e.words_index.out", multi_token_word_spans(
        golden["in.e.words_index.word_ids"], golden["in.e.words_index.token_lengths"] - 1))
    return results


def nearest_code_gaps(rvq, features: torch.Tensor) -> torch.Tensor:
    """(..., K) float64 decision margins of the residual search on ``features`` (..., dim): distance to
    the second-nearest code minus distance to the nearest one, per level (small = fragile)."""
    residual = rvq.project_in(features.to(rvq.project_in.weight.dtype)).double()
    gaps = []
    for book in rvq.codebooks():
        codes = book.embed[0].double()
        dist = torch.cdist(residual.reshape(-1, codes.shape[-1]), codes).reshape(*residual.shape[:-1], -1)
        two = dist.topk(2, dim=-1, largest=False)
        gaps.append(two.values[..., 1] - two.values[..., 0])
        residual = residual - codes[two.indices[..., 0]]
    return torch.stack(gaps, dim=-1)
