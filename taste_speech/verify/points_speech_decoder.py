"""Parity points of the speech decoder (``speech_decoder.``).

* ``d.*``: TASTE codes -> per-token embeddings, the conditioning pieces, teacher forcing, and greedy
  KV-cached decoding (the goldens used greedy choice, patch P7), plus the cache-free reference.
* ``f.*``: the SpokenLLM speech path: the spoken LM (teacher-forced on ``a.out.llm_indices``)
  predicts codes; where a TASTE label exists the prediction becomes the word's code; the speech
  decoder is teacher-forced on the resulting embeddings.
* ``g.*``: the speech auto-encoder path: the audio tower's quantised embeddings go straight into
  the speech decoder.
* ``h.*``: the end-to-end completion. Its new words were re-tokenised by a stand-in ASR tokenizer
  whose algorithm the golden set does not document, so the speech ids cannot be reproduced; only
  the length rule is checked (see ``_h_length_rule``).

Each stage is fed the golden inputs of that stage, so a mismatch points at one stage.
"""

from __future__ import annotations

import torch

from taste_speech.modeling_speech_decoder import GreedySampler, TasteSpeechDecoder
from taste_speech.verify import FLOAT_TOL, Golden, PointResult, compare

# Logits are compared at the same 1e-4 as everything else (observed differences are ~1e-6).
LOGIT_TOL = FLOAT_TOL


def run(golden: Golden, model) -> list[PointResult]:
    g = golden
    decoder: TasteSpeechDecoder = model.speech_decoder
    rvq = model.audio_tower.vq.rvq
    results: list[PointResult] = []

    def check(name, actual, tol=FLOAT_TOL, label=None, note=""):
        result = compare(label or name, actual, g[name], tol)
        result.note = note
        results.append(result)

    speaker, asr_ids, asr_word_ids = g["in.speaker_embeds"], g["in.asr_token_ids"], g["in.asr_word_ids"]
    speech_ids = g["in.speech_token_ids"]

    # d: codes -> embeddings (from the prompt's extracted codes), then the decoder on golden inputs.
    check("d.asr_taste_indices", decoder.asr_taste_indices(g["a.out.llm_indices"], asr_word_ids))
    check("d.audio_unit_embeds", decoder.audio_embeds_from_taste(rvq, g["a.out.llm_indices"], asr_word_ids))
    out = decoder(speaker, g["d.audio_unit_embeds"], asr_ids, speech_ids)
    cond = out.conditioning
    check("d.text_encoded", cond.text_encoded)
    check("d.audio_encoded", cond.audio_encoded)
    check("d.fused_audio_text", cond.fused)
    check("d.speaker_proj", cond.speaker)
    check("d.sos_eos_emb", cond.sos)
    check("d.task_id_emb", cond.task)
    check("d.lm_input", out.lm_input)
    check("d.labels", out.labels)
    check("d.logits", out.logits, LOGIT_TOL)

    prefix = cond.prefix
    gen = decoder.generate(prefix, GreedySampler(), return_logprobs=True)
    min_len, max_len = decoder.length_limits(prefix.shape[1])
    limits = f"P={prefix.shape[1]}, min_len={min_len}, max_len={max_len}, stop: {gen.stop_reason}"
    check("d.gen.speech_token_ids", gen.speech_token_ids, note=limits)
    check("d.gen.speech_token_lengths", gen.speech_token_lengths)
    check("d.gen.step_logprobs", gen.step_logprobs, LOGIT_TOL)
    expected_stop = g.meta.get("meta", {}).get("d.gen.stop_reason")
    results.append(PointResult("d.gen.stop_reason", 0.0 if gen.stop_reason == expected_stop else 1.0, 0.0,
                               gen.stop_reason == expected_stop, f"{gen.stop_reason} (golden: {expected_stop})"))
    decisions = gen.step_logprobs.shape[0]
    check("d.gen.ignore_eos", torch.arange(decisions) < min_len)
    reference = decoder.generate_without_cache(prefix, GreedySampler(), return_logprobs=True)
    check("d.gen.speech_token_ids", reference.speech_token_ids, label="d.gen.speech_token_ids (no cache)")
    check("d.gen.step_logprobs", reference.step_logprobs, LOGIT_TOL, label="d.gen.step_logprobs (no cache)")

    _f_points(g, model, decoder, rvq, check)
    _g_points(g, model, decoder, check)
    results.append(_h_length_rule(g, decoder))
    return results


def _f_points(g: Golden, model, decoder: TasteSpeechDecoder, rvq, check) -> None:
    lm = model.spoken_lm
    out = lm(rvq=rvq, llm_indices=g["a.out.llm_indices"], llm_token_ids=g["in.llm_token_ids"],
             llm_word_ids=g["in.llm_word_ids"])
    check("f.text_logits", out.text_logits, LOGIT_TOL)
    check("f.taste_logits_argmax", out.taste_logits.argmax(dim=-1))
    taste_rows = decoder.taste_rows_from_predictions(out.taste_logits.argmax(dim=-1), out.taste_labels)
    audio = decoder.audio_embeds_from_taste(rvq, taste_rows, g["in.asr_word_ids"])
    check("f.audio_unit_embeds_from_predicted_taste", audio)
    out = decoder(g["in.speaker_embeds"], g["f.audio_unit_embeds_from_predicted_taste"], g["in.asr_token_ids"],
                  g["in.speech_token_ids"])
    check("f.speech_logits", out.logits, LOGIT_TOL)
    check("f.speech_labels", out.labels)


def _g_points(g: Golden, model, decoder: TasteSpeechDecoder, check) -> None:
    speaker, asr_ids, speech_ids = g["in.speaker_embeds"], g["in.asr_token_ids"], g["in.speech_token_ids"]
    tower = model.audio_tower(g["in.audio_features"], asr_ids, g["in.asr_word_ids"])
    out = decoder(speaker, tower.audio_unit_embeds, asr_ids, speech_ids)
    check("g.speech_logits", out.logits, LOGIT_TOL, note="audio tower -> speech decoder")
    check("g.speech_labels", out.labels)
    isolated = decoder(speaker, g["a.vq.quantized_feats"], asr_ids, speech_ids)
    check("g.speech_logits", isolated.logits, LOGIT_TOL, label="g.speech_logits (golden a.vq.quantized_feats)")


def _h_length_rule(g: Golden, decoder: TasteSpeechDecoder) -> PointResult:
    """What is checkable of ``inference_completion`` without the stub ASR tokenizer.

    The speech ids need the Whisper-token ids of the generated words, made by a stand-in tokenizer
    the golden set documents only by a seed - they are NOT checked. The golden decode ran to
    max_len, so its length must be 20 * (L_total + 3) for a whole number of ASR tokens L_total that
    covers at least one token per word of prompt + continuation (one code row per word)."""
    length = int(g["h.speech_token_lengths"][0])
    stop = g.meta.get("meta", {}).get("h.stop_reason")
    n_words = int((g["a.out.llm_indices"][0, :, 0] >= 0).sum()) + int(
        (g["c.audio.generated_llm_indices"][0, :, 0] >= 0).sum())
    l_total = length // 20 - 3
    _, max_len = decoder.length_limits(l_total + 3)
    ok = (stop == "max_len" and max_len == length and l_total >= n_words
          and tuple(g["h.speech_token_ids"].shape) == (1, length))
    note = (f"ids NOT checked (undocumented stub ASR tokenizer); stop={stop}, {length} = max_len(P = L_total + 3) "
            f"with inferred L_total={l_total} >= {n_words} words")
    return PointResult("h.speech_token_lengths (length rule only)", 0.0 if ok else float(abs(max_len - length)),
                       0.0, ok, note)
