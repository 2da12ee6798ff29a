"""TasteSpeechDecoder: parity with the golden set (d/f/g), cached vs cache-free decoding, sampling
rules, the step API, published parameter names and input validation."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from taste_speech.configuration_taste import TasteConfig
from taste_speech.modeling_rvq import ResidualVQ
from taste_speech.modeling_speech_decoder import (
    GreedySampler,
    TasteSpeechDecoder,
    TopKSampler,
)
from taste_speech.verify import points_speech_decoder


def _strip(state, prefix):
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


@pytest.fixture(scope="module")
def parts(taste_lm_tiny_a):
    """The speech decoder and the RVQ, loaded strictly from the tiny checkpoint on their own."""
    config = TasteConfig.from_pretrained(str(taste_lm_tiny_a))
    weights = load_file(str(taste_lm_tiny_a / "model.safetensors"))
    decoder = TasteSpeechDecoder(config).eval()
    decoder.load_state_dict(_strip(weights, "speech_decoder."), strict=True)
    q = config.audio_tower_config.kwargs_for_quantizer
    rvq = ResidualVQ(q["dim"], q["num_quantizers"], q["codebook_size"], q["codebook_dim"])
    rvq.load_state_dict(_strip(weights, "audio_tower.vq.rvq."), strict=True)
    return config, decoder, rvq


@pytest.fixture(scope="module")
def golden_prefix(parts, golden):
    _, decoder, _ = parts
    with torch.no_grad():
        return decoder.prefix_embeds(golden["in.speaker_embeds"], golden["d.audio_unit_embeds"],
                                     golden["in.asr_token_ids"])


def max_diff(a, b):
    return float((a.detach().double() - b.double()).abs().max())


# -- parity ---------------------------------------------------------------------------------------
def test_taste_codes_to_token_embeddings(parts, golden):
    _, decoder, rvq = parts
    indices = decoder.asr_taste_indices(golden["a.out.llm_indices"], golden["in.asr_word_ids"])
    assert torch.equal(indices, golden["d.asr_taste_indices"])
    with torch.no_grad():
        embeds = decoder.audio_embeds_from_taste(rvq, golden["a.out.llm_indices"], golden["in.asr_word_ids"])
    assert max_diff(embeds, golden["d.audio_unit_embeds"]) <= 1e-5


def test_teacher_forcing_matches_golden(parts, golden):
    _, decoder, _ = parts
    with torch.no_grad():
        out = decoder(golden["in.speaker_embeds"], golden["d.audio_unit_embeds"], golden["in.asr_token_ids"],
                      golden["in.speech_token_ids"])
    cond = out.conditioning
    for name, actual in [("d.text_encoded", cond.text_encoded), ("d.audio_encoded", cond.audio_encoded),
                         ("d.fused_audio_text", cond.fused), ("d.speaker_proj", cond.speaker),
                         ("d.sos_eos_emb", cond.sos), ("d.task_id_emb", cond.task), ("d.lm_input", out.lm_input),
                         ("d.logits", out.logits)]:
        assert actual.shape == golden[name].shape, name
        assert max_diff(actual, golden[name]) <= 1e-4, name
    assert torch.equal(out.labels, golden["d.labels"])
    assert out.lm_input.shape[1] == int(golden["d.lm_input_lengths"][0])


def test_greedy_kv_cached_decoding_matches_golden(parts, golden, golden_prefix):
    _, decoder, _ = parts
    meta = golden.meta["meta"]
    gen = decoder.generate(golden_prefix, GreedySampler(), return_logprobs=True)
    assert decoder.length_limits(golden_prefix.shape[1]) == (meta["d.gen.min_len"], meta["d.gen.max_len"])
    assert gen.speech_token_ids.dtype == torch.int32
    assert torch.equal(gen.speech_token_ids, golden["d.gen.speech_token_ids"])
    assert torch.equal(gen.speech_token_lengths, golden["d.gen.speech_token_lengths"])
    assert gen.stop_reason == meta["d.gen.stop_reason"] == "eos"
    assert gen.step_logprobs.shape == golden["d.gen.step_logprobs"].shape
    assert max_diff(gen.step_logprobs, golden["d.gen.step_logprobs"]) <= 1e-4
    # EOS really was the arg-max at the suppressed steps: the min_len rule is what kept it out.
    eos = decoder.eos_id
    suppressed = [i for i in range(gen.step_logprobs.shape[0] - 1) if int(gen.step_logprobs[i].argmax()) == eos]
    assert suppressed == meta["d.gen.steps_where_eos_was_argmax_but_suppressed"]


def test_parity_points_through_the_assembled_model(taste_lm_tiny_a, golden):
    from taste_speech.modeling_taste import TasteForCausalLM

    model = TasteForCausalLM.from_pretrained(str(taste_lm_tiny_a), torch_dtype=torch.float32).eval()
    with torch.inference_mode():
        results = points_speech_decoder.run(golden, model)
    names = {r.name.split(" ")[0] for r in results}
    for expected in ["d.logits", "d.gen.speech_token_ids", "d.gen.step_logprobs", "f.speech_logits",
                     "f.audio_unit_embeds_from_predicted_taste", "g.speech_logits", "h.speech_token_lengths"]:
        assert expected in names
    failed = [r.line() for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    assert all(r.max_abs_diff <= 1e-4 for r in results)


# -- cached vs cache-free decoding --------------------------------------------------------------------
def test_cache_equals_no_cache_greedy(parts, golden, golden_prefix):
    _, decoder, _ = parts
    cached = decoder.generate(golden_prefix, GreedySampler(), return_logprobs=True)
    plain = decoder.generate_without_cache(golden_prefix, GreedySampler(), return_logprobs=True)
    assert torch.equal(cached.speech_token_ids, plain.speech_token_ids)
    assert cached.stop_reason == plain.stop_reason
    assert max_diff(cached.step_logprobs, plain.step_logprobs) <= 1e-5
    # Another prefix (other speaker, text-only conditioning) that runs into max_len.
    with torch.no_grad():
        prefix = decoder.prefix_embeds(-golden["in.speaker_embeds"], None, golden["in.asr_token_ids"][:, :4])
    cached = decoder.generate(prefix, GreedySampler(), min_len=3, max_len=12, return_logprobs=True)
    plain = decoder.generate_without_cache(prefix, GreedySampler(), min_len=3, max_len=12, return_logprobs=True)
    assert torch.equal(cached.speech_token_ids, plain.speech_token_ids)
    assert max_diff(cached.step_logprobs, plain.step_logprobs) <= 1e-5


def test_cache_equals_no_cache_with_seeded_top_k(parts, golden_prefix):
    _, decoder, _ = parts
    runs = []
    for use_cache in (True, False):
        sampler = TopKSampler(generator=torch.Generator().manual_seed(7))
        run = decoder.generate if use_cache else decoder.generate_without_cache
        runs.append(run(golden_prefix, sampler, max_len=40))
    assert torch.equal(runs[0].speech_token_ids, runs[1].speech_token_ids)
    other = decoder.generate(golden_prefix, TopKSampler(generator=torch.Generator().manual_seed(8)), max_len=40)
    assert not torch.equal(other.speech_token_ids, runs[0].speech_token_ids)  # the seed matters


# -- sampling rules ---------------------------------------------------------------------------------
def test_top_k_draws_only_from_the_top_k():
    logp = torch.randn(101).log_softmax(-1)
    allowed = set(logp.topk(25).indices.tolist())
    sampler = TopKSampler(generator=torch.Generator().manual_seed(0))
    draws = [sampler(logp, eos_id=100, allow_eos=False) for _ in range(500)]
    assert set(draws) <= allowed - {100}
    assert len(set(draws)) > 10
    # EOS with all the mass: allowed -> EOS; forbidden -> the best other token (no endless re-draw)
    peaked = torch.full((101,), -1e9)
    peaked[100] = 0.0
    peaked[3] = -200.0
    assert sampler(peaked.log_softmax(-1), 100, allow_eos=True) == 100
    assert sampler(peaked.log_softmax(-1), 100, allow_eos=False) == 3


def test_greedy_forbids_eos_until_allowed():
    logp = torch.tensor([0.1, 0.5, 0.2, 0.9]).log()
    assert GreedySampler()(logp, eos_id=3, allow_eos=True) == 3
    assert GreedySampler()(logp, eos_id=3, allow_eos=False) == 1


@pytest.mark.parametrize("sampler", [GreedySampler(), TopKSampler(generator=torch.Generator().manual_seed(3))])
def test_min_len_and_max_len(parts, golden_prefix, sampler):
    _, decoder, _ = parts
    eager = copy.deepcopy(decoder)
    with torch.no_grad():
        eager.llm_decoder.bias[eager.eos_id] += 100.0  # EOS would win every step
    min_len, _ = decoder.length_limits(golden_prefix.shape[1])
    gen = eager.generate(golden_prefix, sampler, return_logprobs=True)
    assert gen.speech_token_ids.shape == (1, min_len) and gen.stop_reason == "eos"
    assert gen.step_logprobs.shape[0] == min_len + 1
    reluctant = copy.deepcopy(decoder)
    with torch.no_grad():
        reluctant.llm_decoder.bias[reluctant.eos_id] -= 100.0  # EOS never wins
    gen = reluctant.generate(golden_prefix, sampler, max_len=7, return_logprobs=True)
    assert gen.speech_token_ids.shape == (1, 7) and gen.stop_reason == "max_len"
    assert gen.step_logprobs.shape[0] == 7  # no forward pass after the last allowed token


# -- step API ---------------------------------------------------------------------------------------
def test_step_api_and_state(parts, golden, golden_prefix):
    _, decoder, _ = parts
    expected = golden["d.gen.speech_token_ids"][0].tolist()
    with torch.no_grad():
        state = decoder.start(golden_prefix)
        assert state.prefix_length == golden_prefix.shape[1] and state.cache.length == golden_prefix.shape[1]
        first = [decoder.step(state) for _ in range(10)]
        fork = state.clone()
        rest = []
        while (token := decoder.step(state)) is not None:
            rest.append(token)
        fork_rest = []
        while (token := decoder.step(fork, GreedySampler())) is not None:
            fork_rest.append(token)
    assert first + rest == expected and fork_rest == rest
    assert state.finished and state.stop_reason == "eos" and state.step_index == len(expected) + 1
    # every token was fed (the EOS decision needed the last one's log-probs)
    assert state.cache.length == golden_prefix.shape[1] + len(expected)
    assert decoder.step(state) is None and state.tokens == expected


# -- names / shapes -------------------------------------------------------------------------------
def test_full_size_parameter_names_and_shapes_match_the_manifest():
    data = "tests/data/"
    config = TasteConfig.from_dict(json.load(open(data + "taste_lm_config_full.json")))
    with torch.device("meta"):
        decoder = TasteSpeechDecoder(config)
    ours = {"speech_decoder." + k: (list(v.shape), str(v.dtype).removeprefix("torch."))
            for k, v in decoder.state_dict().items()}
    manifest = json.load(open(data + "taste_lm_manifest_full.json"))["keys"]
    published = {e["key"]: (e["shape"], e["dtype"]) for e in manifest if e["top"] == "speech_decoder"}
    assert len(published) == 260
    assert ours == published


# -- validation -------------------------------------------------------------------------------------
def test_bad_inputs_raise_value_errors(parts, golden, golden_prefix):
    config, decoder, rvq = parts
    speaker, asr_ids, audio = golden["in.speaker_embeds"], golden["in.asr_token_ids"], golden["d.audio_unit_embeds"]
    word_ids, rows = golden["in.asr_word_ids"], golden["a.out.llm_indices"]
    speech = golden["in.speech_token_ids"]
    with pytest.raises(ValueError, match="6 TASTE code rows for 7 words"):
        decoder.asr_taste_indices(rows, torch.cat([word_ids[:, :-1], word_ids[:, -1:] + 1], dim=1))
    partial = rows.clone()
    partial[0, 0, 2] = -1
    with pytest.raises(ValueError, match="mixes valid and IGNORE"):
        decoder.asr_taste_indices(partial, word_ids)
    with pytest.raises(ValueError, match="start at 0"):
        decoder.asr_taste_indices(rows, word_ids.flip(1))
    with pytest.raises(ValueError, match="integer codes"):
        decoder.asr_taste_indices(rows.float(), word_ids)
    with pytest.raises(ValueError, match="one TASTE embedding per Whisper token"):
        decoder.prefix_embeds(speaker, audio[:, :-1], asr_ids)
    with pytest.raises(ValueError, match="speaker_embeds"):
        decoder.prefix_embeds(speaker[:, :-1], audio, asr_ids)
    with pytest.raises(ValueError, match="asr_token_ids must lie"):
        decoder.prefix_embeds(speaker, audio, asr_ids + config.speech_decoder_config.text_token_size)
    with pytest.raises(ValueError, match="empty"):
        decoder.prefix_embeds(speaker, audio[:, :0], asr_ids[:, :0])
    with pytest.raises(ValueError, match="speech_token_ids must lie"):
        decoder(speaker, audio, asr_ids, speech + decoder.speech_token_size)
    with pytest.raises(ValueError, match="prefix must be"):
        decoder.start(golden_prefix[0])
    with pytest.raises(ValueError, match="same shape"):
        decoder.taste_rows_from_predictions(rows, rows[:, :-1])
    bad = copy.deepcopy(config)
    bad.speech_decoder_config.fuse_encoded_audio_text_type = "concat"
    with pytest.raises(ValueError, match="weighted_sum"):
        TasteSpeechDecoder(bad)
    bad = copy.deepcopy(config)
    bad.speech_decoder_config.llm__pos_enc_layer_type = "rel_pos"
    with pytest.raises(ValueError, match="rel_pos_espnet"):
        TasteSpeechDecoder(bad)


def test_text_only_conditioning_skips_the_taste_side(parts, golden):
    _, decoder, _ = parts
    with torch.no_grad():
        cond = decoder.condition(golden["in.speaker_embeds"], None, golden["in.asr_token_ids"])
    assert cond.audio_encoded is None and torch.equal(cond.fused, cond.text_encoded)
    assert max_diff(cond.text_encoded, golden["d.text_encoded"]) <= 1e-4


def test_forced_tokens_continue_an_utterance(parts, golden, golden_prefix):
    _, decoder, _ = parts
    expected = golden["d.gen.speech_token_ids"][0].tolist()
    with torch.no_grad():
        state = decoder.start(golden_prefix)
        decoder.step(state)
        decoder.force_tokens(state, expected[1:10])  # after a chosen token (one pending row)
        rest = []
        while (token := decoder.step(state)) is not None:
            rest.append(token)
        assert state.tokens == expected and expected[10:] == rest
        fresh = decoder.start(golden_prefix)
        decoder.force_tokens(fresh, torch.tensor(expected[:5]))  # right after the prefix
        assert decoder.step(fresh) == expected[5]
        with pytest.raises(ValueError, match="EOS cannot be forced"):
            decoder.force_tokens(fresh, [decoder.eos_id])
        with pytest.raises(ValueError, match="has ended"):
            decoder.force_tokens(state, [1])
