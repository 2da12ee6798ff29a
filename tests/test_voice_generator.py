"""VoiceGenerator (flow + HiFT): parity with golden set A, safe loading, full-size layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from taste_speech.verify import Golden
from taste_speech.verify import points_voice_generator as points
from taste_speech.voice_generator import SourceDraws, VoiceGenerator, write_tiny_voice_generator
from taste_speech.voice_generator.config import FULL_SIZE
from taste_speech.voice_generator.flow import mel_frames_for_tokens, nearest_source_index
from taste_speech.voice_generator.weight_norm import WNConv1d, WNConvTranspose1d, weight_normed_module_names


@pytest.fixture(scope="module")
def golden(voice_generator_tiny_a) -> Golden:
    return Golden(str(voice_generator_tiny_a))


@pytest.fixture(scope="module")
def model(voice_generator_tiny_a) -> VoiceGenerator:
    return VoiceGenerator.from_golden_dir(voice_generator_tiny_a)


def _assert_all_ok(results):
    failed = [r.line() for r in results if not r.ok]
    assert results and not failed, "\n".join(failed)


# -- parity ------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["flow_empty", "flow_prompt"])
def test_flow_parity(golden, model, case):
    results = points.flow_points(golden, model, case)
    names = {r.name for r in results}
    assert {f"{case}.out.mel", f"{case}.est_cond", f"{case}.ode_states", f"{case}.h_enc", f"{case}.lr_index"} <= names
    _assert_all_ok(results)


def test_hift_parity(golden, model):
    results = points.hift_points(golden, model)
    assert {"hift.out.wav", "hift.f0", "hift.s", "hift.conv_post_out"} <= {r.name for r in results}
    _assert_all_ok(results)


def test_streaming_experiments_reproduced(golden, model):
    _assert_all_ok(points.stream_points(golden, model))


def test_unbatched_cfg_matches_too(golden, model):
    model.flow.decoder.batch_cfg = False
    try:
        _assert_all_ok(points.flow_points(golden, model, "flow_empty"))
    finally:
        model.flow.decoder.batch_cfg = True


def test_generator_draws_follow_the_reference_rng_stream(golden, model):
    """The golden draws came from one RNG seeded 20240603, in the order flow_empty z, flow_prompt z,
    then HiFT (phase, sine noise, noise branch): our default draws consume a generator the same way."""
    g = torch.Generator().manual_seed(20240603)
    mel = model.flow.inference(golden["flow_empty.in.token"], golden["flow_empty.in.embedding"], generator=g)
    torch.testing.assert_close(mel, golden["flow_empty.out.mel"], atol=1e-4, rtol=0)
    mel_p = model.flow.inference(golden["flow_prompt.in.token"], golden["flow_prompt.in.embedding"],
                                 prompt_tokens=golden["flow_prompt.in.prompt_token"],
                                 prompt_mel=golden["flow_prompt.in.prompt_feat"], generator=g)
    torch.testing.assert_close(mel_p, golden["flow_prompt.out.mel"], atol=1e-4, rtol=0)
    with points.f0_fed_in(model.hift, golden["hift.f0"]):  # F0's float noise would move the phase (verify's docstring)
        wav = model.hift.inference(golden["hift.in.mel"], generator=g)
    torch.testing.assert_close(wav, golden["hift.out.wav"], atol=1e-5, rtol=0)


def test_inference_end_to_end_with_injected_draws(golden, model):
    draws = SourceDraws(golden["hift.draw.phase_u01"], golden["hift.draw.sine_noise"])
    wav, sr = model.inference(golden["flow_empty.in.token"], golden["flow_empty.in.embedding"],
                              flow_noise=golden["flow_empty.draw.z"], source_draws=draws)
    assert sr == 22050 and wav.shape == (1, 256 * 68)
    # the mel's ~3e-6 rounding differences grow through HiFT: 1e-4 end to end
    torch.testing.assert_close(wav, golden["hift.out.wav"], atol=1e-4, rtol=0)


def test_frame_formula_and_nearest_index():
    assert mel_frames_for_tokens(100) == 172 and mel_frames_for_tokens(40) == 68
    assert all(mel_frames_for_tokens(n) == n * 441 // 256 for n in range(1, 600))
    # torch 'nearest' in float32 differs from the exact integer floor for L = 26 (T = 44)
    exact = torch.arange(44) * 26 // 44
    assert not torch.equal(nearest_source_index(26, 44), exact)
    assert int((nearest_source_index(26, 44) - exact).abs().max()) == 1


# -- input validation --------------------------------------------------------------------------
def test_bad_inputs_raise_value_errors(model, golden):
    emb = golden["flow_empty.in.embedding"]
    with pytest.raises(ValueError, match="vocab_size"):
        model.inference(torch.tensor([[1, 2, 256]]), emb)
    with pytest.raises(ValueError, match="empty"):
        model.inference(torch.zeros(1, 0, dtype=torch.long), emb)
    with pytest.raises(ValueError, match=r"\(1, N\)"):
        model.inference(torch.tensor([1, 2, 3]), emb)
    with pytest.raises(ValueError, match="speaker embedding"):
        model.inference(torch.tensor([[1, 2, 3]]), torch.randn(1, 7))
    with pytest.raises(ValueError, match="flow noise"):
        model.inference(torch.tensor([[1, 2, 3]]), emb, flow_noise=torch.randn(1, 80, 9))


# -- weight norm -------------------------------------------------------------------------------
# -- fewer kernels per estimator call, the same numbers ---------------------------------------------
def test_fused_qkv_attention_keeps_the_published_weights(model):
    """q, k and v are one matrix product, but the state dict holds the published three weights; the
    attention is the one of three separate projections; a checkpoint lacking one is named."""
    from torch.nn import functional as F

    attention = model.flow.decoder.estimator.mid_blocks[0][1][0].attn1
    state = attention.state_dict()
    assert list(state) == ["to_q.weight", "to_k.weight", "to_v.weight", "to_out.0.weight", "to_out.0.bias"]
    assert all(state[k].data_ptr() != attention.to_qkv.data_ptr() for k in state)  # saved copies, not views
    x = torch.randn(2, 7, attention.to_qkv.shape[1], generator=torch.Generator().manual_seed(0))

    def heads(y):
        return y.view(2, 7, attention.heads, attention.head_dim).transpose(1, 2)

    q, k, v = (heads(F.linear(x, state[f"to_{n}.weight"])) for n in "qkv")
    separate = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 7, -1)
    torch.testing.assert_close(attention(x), attention.to_out[0](separate), atol=1e-6, rtol=1e-5)

    other = type(attention)(attention.to_qkv.shape[1], attention.heads, attention.head_dim)
    other.load_state_dict(state)
    assert torch.equal(other.to_qkv, attention.to_qkv)
    del state["to_k.weight"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "to_k.weight"'):
        other.load_state_dict(state)


@torch.inference_mode()
def test_an_estimator_call_without_a_mask_is_the_all_ones_mask_bit_for_bit_with_fewer_operators(model):
    """mask=None (every frame valid) leaves out the multiplications by ones: the same output bit for
    bit, fewer operators (kernels on a GPU); padded=True still needs a mask."""
    from benchmarks.bench_lora_merge import OperatorCount

    estimator = model.flow.decoder.estimator
    g = torch.Generator().manual_seed(1)
    c, frames = model.flow.output_size, 13
    x, mu, cond = (torch.randn(2, c, frames, generator=g) for _ in range(3))
    spks, t = torch.randn(2, c, generator=g), torch.tensor(0.3)
    with OperatorCount() as ones_ops:
        with_ones = estimator(x, torch.ones(2, 1, frames), mu, t, spks, cond)
    with OperatorCount() as none_ops:
        without = estimator(x, None, mu, t, spks, cond)
    assert torch.equal(with_ones, without)
    assert none_ops.ops["mul"] < ones_ops.ops["mul"] and none_ops.total < ones_ops.total
    with pytest.raises(ValueError, match="padded=True needs the mask"):
        estimator(x, None, mu, t, spks, cond, padded=True)


@torch.inference_mode()
def test_the_odes_time_conditioning_in_one_pass_is_the_per_call_one_with_fewer_operators(model, golden):
    """The ODE makes every step's time conditioning in one batched pass before its loop: the mel
    of making it in each estimator call (the published way) up to float rounding, fewer operators;
    the golden flow cases still match with either."""
    from benchmarks.bench_lora_merge import OperatorCount

    cfm = model.flow.decoder
    g = torch.Generator().manual_seed(2)
    c, frames = model.flow.output_size, 19
    mu, cond, noise = (torch.randn(1, c, frames, generator=g) for _ in range(3))
    spks = torch.randn(1, c, generator=g)
    assert cfm.batch_time
    with OperatorCount() as batched_ops:
        batched = cfm(mu, None, spks, cond, noise)
    cfm.batch_time = False
    try:
        with OperatorCount() as per_call_ops:
            per_call = cfm(mu, None, spks, cond, noise)
        _assert_all_ok(points.flow_points(golden, model, "flow_empty"))
    finally:
        cfm.batch_time = True
    torch.testing.assert_close(batched, per_call, rtol=0, atol=1e-5)
    n_steps = cfm.n_timesteps
    resnets = len(cfm.estimator.resnets())
    # per call: a sinusoidal embedding, the MLP and a Mish + Linear per resnet block, in every step
    assert per_call_ops.total - batched_ops.total >= (n_steps - 1) * (2 * resnets + 3)


def test_the_sources_harmonic_increments_come_all_at_once_bit_for_bit_with_few_operators(model):
    """f0 times each harmonic's number over the sampling rate: one broadcast, the numbers of one
    product per harmonic (the published way), a handful of operators whatever the harmonics."""
    from benchmarks.bench_lora_merge import OperatorCount

    source = model.hift.m_source
    f0 = torch.rand(2, 1, 300, generator=torch.Generator().manual_seed(4)) * 400
    per_harmonic = torch.cat([f0 * (h + 1) / source.sampling_rate for h in range(source.n_harmonics)], dim=1)
    with OperatorCount() as ops:
        together = source.cycles(f0)
    assert torch.equal(together, per_harmonic) and ops.total <= 4 < source.n_harmonics


@pytest.mark.parametrize("transpose", [False, True])
def test_legacy_weight_norm_matches_torch(transpose):
    torch.manual_seed(0)
    cls, ref_cls = (WNConvTranspose1d, torch.nn.ConvTranspose1d) if transpose else (WNConv1d, torch.nn.Conv1d)
    ours = cls(6, 4, 5, 2, padding=1)
    ref = torch.nn.utils.parametrizations.weight_norm(ref_cls(6, 4, 5, 2, padding=1), dim=0)
    with torch.no_grad():
        ours.weight_v.normal_()
        ours.weight_g.uniform_(0.5, 2.0)
        ref.parametrizations.weight.original0.copy_(ours.weight_g)
        ref.parametrizations.weight.original1.copy_(ours.weight_v)
        ref.bias.copy_(ours.bias)
    assert ours.weight_g.shape == ((6, 1, 1) if transpose else (4, 1, 1))  # axis 0 = in-channels for transpose
    x = torch.randn(1, 6, 11)
    torch.testing.assert_close(ours(x), ref(x))


# -- full-size layout --------------------------------------------------------------------------
def test_full_size_meta_build_matches_manifest(voice_generator_tiny_a):
    manifest = json.loads((voice_generator_tiny_a.parent / "voice_generator_manifest_full.json").read_text())
    with torch.device("meta"):
        model = VoiceGenerator()
    got = {k: list(v.shape) for k, v in model.state_dict().items()}
    expected = {e["key"]: e["shape"] for e in manifest["entries"]}
    assert sorted(set(expected) - set(got)) == [] and sorted(set(got) - set(expected)) == []
    assert got == expected
    assert sum(v.numel() for v in model.state_dict().values()) == manifest["n_total_elements"] == 125_335_343
    assert weight_normed_module_names(model) == sorted(manifest["weight_norm"]["modules"])
    for section, entry in manifest["constructor_args"].items():
        for name, value in entry["args"].items():
            if not (isinstance(value, str) and value.startswith("<module")):
                assert FULL_SIZE[section][name] == value, f"{section}.{name}"


# -- safe loading ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_vg")
    write_tiny_voice_generator(directory, seed=1)
    return directory


def test_tiny_checkpoint_round_trip_and_is_audible(tiny_dir):
    pth = tiny_dir / "cosyvoice" / "voice_generator.pth"
    state = torch.load(pth, weights_only=True)
    assert any(k.endswith("weight_g") for k in state) and all(k.startswith(("flow.", "hift.")) for k in state)
    model = VoiceGenerator.from_pretrained(tiny_dir)
    again = VoiceGenerator.from_pretrained(pth)
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 4096, (1, 60), generator=torch.Generator().manual_seed(0))
    speaker = torch.randn(1, 192, generator=torch.Generator().manual_seed(0))
    wav, _ = model.inference(tokens, speaker, generator=g1)
    wav2, _ = again.inference(tokens, speaker, generator=g2)
    assert torch.equal(wav, wav2)
    rms = float(wav.pow(2).mean().sqrt())
    assert 0.02 < rms < 0.5, rms  # speech-level noise, neither silence nor clipping


def test_golden_weights_load_from_a_pth_file(tmp_path, voice_generator_tiny_a, model):
    state = load_file(voice_generator_tiny_a / "weights.safetensors")
    torch.save(state, tmp_path / "voice_generator.pth")
    config = json.loads((voice_generator_tiny_a / "config.json").read_text())
    loaded = VoiceGenerator.from_pretrained(tmp_path / "voice_generator.pth", config=config)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_new_parametrization_names_are_accepted(tmp_path, voice_generator_tiny_a):
    state = load_file(voice_generator_tiny_a / "weights.safetensors")
    renamed = {k.replace(".weight_g", ".parametrizations.weight.original0")
               .replace(".weight_v", ".parametrizations.weight.original1"): v for k, v in state.items()}
    torch.save(renamed, tmp_path / "voice_generator.pth")
    config = json.loads((voice_generator_tiny_a / "config.json").read_text())
    loaded = VoiceGenerator.from_pretrained(tmp_path, config=config).state_dict()
    assert sorted(loaded) == sorted(state)  # (the model keeps the published names)
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key


class _NotATensor:
    pass


def test_pickle_with_foreign_object_is_refused(tmp_path, tiny_dir):
    state = torch.load(tiny_dir / "cosyvoice" / "voice_generator.pth", weights_only=True)
    state["evil"] = _NotATensor()
    torch.save(state, tmp_path / "voice_generator.pth")
    with pytest.raises(ValueError, match="other than tensors"):
        VoiceGenerator.from_pretrained(tmp_path)


def test_non_tensor_entries_and_nested_dicts_are_refused(tmp_path, tiny_dir):
    state = torch.load(tiny_dir / "cosyvoice" / "voice_generator.pth", weights_only=True)
    torch.save({**state, "epoch": 3}, tmp_path / "a.pth")
    with pytest.raises(ValueError, match="not a flat name -> tensor state dict.*'epoch'"):
        VoiceGenerator.from_pretrained(tmp_path / "a.pth")
    torch.save({"state_dict": state}, tmp_path / "b.pth")
    with pytest.raises(ValueError, match="nested dict"):
        VoiceGenerator.from_pretrained(tmp_path / "b.pth")
    torch.save([1, 2], tmp_path / "c.pth")
    with pytest.raises(ValueError, match="not a state dict"):
        VoiceGenerator.from_pretrained(tmp_path / "c.pth")


def test_truncated_file_is_refused(tmp_path, tiny_dir):
    data = (tiny_dir / "cosyvoice" / "voice_generator.pth").read_bytes()
    (tmp_path / "voice_generator.pth").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        VoiceGenerator.from_pretrained(tmp_path / "voice_generator.pth")


def test_wrong_shapes_and_keys_are_named(tmp_path, tiny_dir):
    state = torch.load(tiny_dir / "cosyvoice" / "voice_generator.pth", weights_only=True)
    config_file = tiny_dir / "cosyvoice" / "voice_generator_config.json"
    config = json.loads(config_file.read_text())
    bad = dict(state)
    bad["hift.conv_pre.weight_v"] = torch.zeros(3, 3, 3)
    del bad["flow.encoder_proj.bias"]
    bad["flow.extra.weight"] = torch.zeros(1)
    torch.save(bad, tmp_path / "voice_generator.pth")
    with pytest.raises(ValueError) as info:
        VoiceGenerator.from_pretrained(tmp_path / "voice_generator.pth", config=config)
    message = str(info.value)
    assert "hift.conv_pre.weight_v: (3, 3, 3)" in message
    assert "missing: flow.encoder_proj.bias" in message
    assert "unexpected: flow.extra.weight" in message
    # the tiny weights against the full-size architecture: clear mismatch, not a crash
    torch.save(state, tmp_path / "voice_generator.pth")
    with pytest.raises(ValueError, match="wrong shape"):
        VoiceGenerator.from_pretrained(tmp_path / "voice_generator.pth")


def test_folder_without_weights_is_explained(tmp_path):
    with pytest.raises(ValueError, match="cosyvoice/voice_generator.pth"):
        VoiceGenerator.from_pretrained(tmp_path)
