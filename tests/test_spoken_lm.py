"""TasteSpokenLM: published names and shapes, parity with the original on golden set tiny_a
(teacher forcing, greedy generation with per-step traces, layout helpers), KV cache == the original
no-cache loop, the other conditional modes and bad input."""

import json
import os

import pytest
import torch

from taste_speech.configuration_taste import TasteConfig
from taste_speech.modeling_spoken_lm import Action, TasteSpokenLM
from taste_speech.sampler import SamplingParams, TasteSampler
from taste_speech.verify.points_spoken_lm import golden_sampler, run

DATA = os.path.join(os.path.dirname(__file__), "data")
HEAD = "language_model.base_model.model.lm_head.weight"


@pytest.fixture(scope="module")
def points(golden, loaded):
    with torch.inference_mode():
        return {r.name: r for r in run(golden, loaded)}


def audio_prompt(golden):
    return dict(llm_token_ids=golden["in.llm_token_ids"], llm_indices=golden["a.out.llm_indices"],
                llm_word_ids=golden["in.llm_word_ids"])


# -- names and shapes --------------------------------------------------------------------------------
def test_full_size_keys_and_shapes_equal_the_manifest_group():
    config = TasteConfig.from_json_file(os.path.join(DATA, "taste_lm_config_full.json"))
    with torch.device("meta"):
        model = TasteSpokenLM(config)
    ours = {f"spoken_lm.{k}": tuple(v.shape) for k, v in model.state_dict().items()}
    manifest = json.load(open(os.path.join(DATA, "taste_lm_manifest_full.json")))["keys"]
    expected = {e["key"]: tuple(e["shape"]) for e in manifest if e["top"] == "spoken_lm"}
    assert len(expected) == 379
    assert ours == expected
    assert model.causal_lm.lm_head.weight is model.embed_tokens.weight  # tied
    layer = model.causal_lm.model.layers[0].self_attn.q_proj
    assert layer.scaling["default"] == 2.0 and layer.r["default"] == 64  # alpha 128 / r 64
    assert model.fuse_for_bridge_in_llm.linear.in_features == 1280
    assert sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n) == 45_088_768


def test_tiny_keys_equal_the_checkpoint(golden, lm):
    from safetensors import safe_open

    with safe_open(os.path.join(golden.dir, "model.safetensors"), "pt") as f:
        stored = {k[len("spoken_lm."):] for k in f.keys() if k.startswith("spoken_lm.")}
    assert set(lm.state_dict()) == stored | {HEAD}
    assert lm.pad_audio_unit_embed.shape[0] == 64  # the RVQ dim, not a hard-coded 1280
    assert lm.causal_lm.lm_head.weight is lm.embed_tokens.weight


# -- parity with the original ---------------------------------------------------------------------------
def test_every_spoken_lm_point_matches(points, golden):
    failed = [r.line() for r in points.values() if not r.ok]
    assert not failed, "\n".join(failed)
    ours = ("b.", "c.", "sampler.", "e.fill_forward", "e.encode_audio_fill_forward", "e.prepare_single_oneword")
    expected = {k for k in golden.tensors if k.startswith(ours) and not k.endswith("nn_distance_gap")}
    assert expected == {name.split(" ")[0] for name in points}
    c_points = [k for k in expected if k.startswith("c.")]
    assert all(f"{k} (no cache)" in points for k in c_points)  # the original loop is checked too


@pytest.mark.parametrize("name", ["b.taste_pred_indices", "b.taste_labels", "b.text_labels",
                                  "c.audio.generated_llm_token_ids", "c.audio.generated_llm_indices",
                                  "c.text.generated_llm_word_ids", "c.text.trace.action",
                                  "c.audio.trace.taste_action (no cache)", "c.text.trace.taste_ids",
                                  "sampler.ban_mask", "e.fill_forward.out", "e.prepare_single_oneword.taste_labels"])
def test_discrete_points_are_exact(points, name):
    assert points[name].ok and points[name].tolerance == 0


@pytest.mark.parametrize("name", ["b.text_logits", "b.llm_last_hidden", "b.taste_z",
                                  "c.audio.trace.text_logits_last_raw", "c.text.trace.text_logits_last_raw",
                                  "c.text.trace.text_logits_last_raw (no cache)", "c.audio.final_inputs_embeds"])
def test_float_points_within_1e4(points, name):
    assert points[name].max_abs_diff <= 1e-4


def test_golden_generation_end_rules(golden, lm, rvq):
    sampler = golden_sampler(golden)
    with torch.no_grad():
        audio = lm.generate(rvq, sampler, "audio", **audio_prompt(golden))
        text = lm.generate(rvq, sampler, "text", llm_token_ids=golden["in.text_prompt_ids"])
    assert audio.end_reason == "sentence_end" and text.end_reason == "max_words"
    assert text.word_ids.max() + 1 == 3 * 4 + 1  # 3E + 1 words
    # one valid code per generated word
    assert audio.word_codes().shape[0] == int(audio.word_ids.max()) + 1


# -- KV cache ------------------------------------------------------------------------------------------
def generate_both(lm, rvq, sampler, seed=None, **kwargs):
    outs = []
    for use_cache in (True, False):
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        with torch.no_grad():
            outs.append(lm.generate(rvq, sampler, use_cache=use_cache, generator=gen, max_steps=60, **kwargs))
    return outs


def assert_same_generation(a, b):
    assert torch.equal(a.token_ids, b.token_ids)
    assert torch.equal(a.word_ids, b.word_ids)
    assert torch.equal(a.taste_rows, b.taste_rows)
    assert a.trace.action == b.trace.action and a.trace.taste_action == b.trace.taste_action
    assert a.trace.seq_len == b.trace.seq_len
    diff = (torch.stack(a.trace.text_logits_last_raw) - torch.stack(b.trace.text_logits_last_raw)).abs().max()
    assert diff < 1e-4
    assert (a.final_inputs_embeds - b.final_inputs_embeds).abs().max() < 1e-5


@pytest.mark.parametrize("mode", ["audio", "zero"])
def test_cache_equals_no_cache_greedy(golden, lm, rvq, mode):
    kwargs = audio_prompt(golden) if mode == "audio" else {}
    assert_same_generation(*generate_both(lm, rvq, golden_sampler(golden, extra_words=6), mode=mode, **kwargs))


def test_cache_equals_no_cache_with_top_p_sampling(golden, lm, rvq):
    tables = golden_sampler(golden).tables
    sampler = TasteSampler(tables, SamplingParams(text_top_p=0.8, text_temperature=0.9, repetition_penalty=1.2,
                                                  extra_words=4))
    cached, reference = generate_both(lm, rvq, sampler, seed=7, mode="audio", **audio_prompt(golden))
    assert_same_generation(cached, reference)
    greedy = lm.generate(rvq, golden_sampler(golden), "audio", **audio_prompt(golden))
    assert not torch.equal(cached.token_ids, greedy.token_ids)  # the sampling path really sampled


def test_cached_decode_feeds_one_row_per_step(golden, lm, rvq):
    out = lm.generate(rvq, golden_sampler(golden), "audio", **audio_prompt(golden))
    n = golden["in.llm_token_ids"].shape[1]
    assert out.trace.seq_len == list(range(n + 1, n + 1 + len(out.trace.seq_len)))


def test_decode_state_crop_then_refeed_matches_a_fresh_prefill(golden, lm, rvq):
    rows = lm.prepare_inputs(**{k: v for k, v in audio_prompt(golden).items()}, rvq=rvq).inputs_embeds
    with torch.no_grad():
        fresh = lm.new_decode_state()
        h_fresh = lm.feed(fresh, rows)
        state = lm.new_decode_state()
        lm.feed(state, rows[:, :4])
        lm.feed(state, rows[:, 4:7])
        state.crop(5)
        assert state.length == 5 and state.inputs_embeds().shape[1] == 5
        h = lm.feed(state, rows[:, 5:])
    assert (h - h_fresh).abs().max() < 1e-5
    assert torch.equal(state.inputs_embeds(), rows)


# -- other modes -----------------------------------------------------------------------------------------
def test_instruct_mode_layout_and_stop_id(golden, lm, rvq):
    prompt = audio_prompt(golden)
    prefix, suffix = [13, 14], [15]
    ctx = lm.initial_context("instruct", rvq, instruct_prefix_ids=prefix, instruct_suffix_ids=suffix, **prompt)
    layout = lm.prepare_inputs(rvq=rvq, **prompt).inputs_embeds
    n = prompt["llm_token_ids"].shape[1]
    assert ctx.rows.shape[1] == 2 + n + 1 and not ctx.has_prefix and ctx.pending_audio is None
    assert torch.equal(ctx.rows[0, :2], lm.token_embeds(prefix))
    assert torch.equal(ctx.rows[0, 2:2 + n], layout[0, 1:n + 1])  # SOS dropped, last code never fed
    assert torch.equal(ctx.rows[0, -1], lm.token_embeds(suffix)[0])
    assert ctx.input_ids == prefix + prompt["llm_token_ids"][0, 1:].tolist() + suffix

    sampler = golden_sampler(golden, extra_words=20)
    free = lm.generate(rvq, sampler, "instruct", instruct_prefix_ids=prefix, instruct_suffix_ids=suffix,
                       max_steps=8, **prompt)
    stop = int(free.trace.text_id[3])
    stopped, reference = generate_both(lm, rvq, sampler, mode="instruct", stop_id=stop, instruct_prefix_ids=prefix,
                                       instruct_suffix_ids=suffix, **prompt)
    assert_same_generation(stopped, reference)
    first_stop = free.trace.text_id.index(stop)
    assert stopped.end_reason == "stop_id" and stopped.trace.action[-1] == Action.TERMINATE
    assert len(stopped.trace.text_id) == first_stop + 1
    assert stopped.token_ids[0].tolist() == free.trace.text_id[:first_stop]  # the stop token is not emitted


def test_text_mode_feeds_raw_embeddings_without_sos(golden, lm, rvq):
    ids = golden["in.text_prompt_ids"]
    ctx = lm.initial_context("text", rvq, llm_token_ids=ids)
    assert torch.equal(ctx.rows[0], lm.token_embeds(ids[0]))
    zero = lm.initial_context("zero", rvq)
    assert torch.equal(zero.rows[0], lm.token_embeds([lm.sos_id])) and zero.input_ids == [lm.sos_id]


# -- bad input ---------------------------------------------------------------------------------------------
def test_bad_inputs_raise_value_errors(golden, lm, rvq):
    prompt = audio_prompt(golden)
    sampler = golden_sampler(golden)
    with pytest.raises(ValueError, match="conditional mode"):
        lm.generate(rvq, sampler, "speech", **prompt)
    with pytest.raises(ValueError, match="needs llm_token_ids"):
        lm.generate(rvq, sampler, "text")
    with pytest.raises(ValueError, match="needs llm_indices"):
        lm.generate(rvq, sampler, "audio", llm_token_ids=prompt["llm_token_ids"])
    with pytest.raises(ValueError, match="instruct_prefix_ids"):
        lm.generate(rvq, sampler, "instruct", **prompt)
    with pytest.raises(ValueError, match="batch size 1"):
        lm.prepare_inputs(prompt["llm_indices"].expand(2, -1, -1), prompt["llm_token_ids"].expand(2, -1),
                          prompt["llm_word_ids"].expand(2, -1), rvq)
    no_code = prompt["llm_indices"].clone()
    no_code[0, 2] = -1  # position 2 starts word 2
    with pytest.raises(ValueError, match="no TASTE code at the first token"):
        lm.prepare_inputs(no_code, prompt["llm_token_ids"], prompt["llm_word_ids"], rvq)
    with pytest.raises(ValueError, match="llm_word_ids must start at 0"):
        lm.prepare_inputs(prompt["llm_indices"], prompt["llm_token_ids"], prompt["llm_word_ids"] + 1, rvq)
    with pytest.raises(ValueError, match="integer"):
        lm.prepare_inputs(prompt["llm_indices"].float(), prompt["llm_token_ids"], prompt["llm_word_ids"], rvq)
    with pytest.raises(ValueError, match="token ids must lie"):
        lm.generate(rvq, sampler, "text", llm_token_ids=torch.tensor([[5, 4096]]))
    with pytest.raises(ValueError, match="first TASTE row"):
        lm.fill_forward(torch.tensor([[[-1, -1, -1, -1], [1, 2, 3, 4]]]))
    with pytest.raises(ValueError, match="rows must have shape"):
        lm.feed(lm.new_decode_state(), torch.zeros(1, 0, 64))
    with pytest.raises(ValueError, match="needs rvq"):
        lm(golden["b.inputs_embeds"])


def test_a_decode_step_reads_back_only_the_chosen_token(golden, lm, rvq, monkeypatch):
    """Outside the backbone (a replayed graph on CUDA) a step reads one value back to the host: the
    text token chosen. Every other read - range checks of the codes, a mask used as indices, the
    one-hot check - would wait for the GPU (on CUDA every kernel queued before it, other calls' too)."""
    from test_sampler import reads_in

    reads = {"heads": 0, "update": 0, "advance_audio": 0, "next_row": 0}

    def counted(name, method):
        def wrapper(*args, **kwargs):
            n, out = reads_in(lambda: method(*args, **kwargs))
            reads[name] += n
            return out
        return wrapper

    sampler = golden_sampler(golden, extra_words=6)
    for name in ("heads", "advance_audio", "next_row"):
        monkeypatch.setattr(TasteSpokenLM, name, counted(name, getattr(TasteSpokenLM, name)))
    monkeypatch.setattr(sampler, "update", counted("update", sampler.update))
    with torch.no_grad():
        out = lm.generate(rvq, sampler, mode="audio", max_steps=40, **audio_prompt(golden))
    steps = len(out.trace.action)
    assert steps > 5 and any(a != out.trace.action[0] for a in out.trace.taste_action)  # codes were sampled
    assert reads == {"heads": 0, "update": steps, "advance_audio": 0, "next_row": 0}, (reads, steps)
