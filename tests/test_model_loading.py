"""Loading: published names and shapes, key spellings of different peft versions, tied head,
and clear errors for broken checkpoints."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from taste_speech.configuration_taste import TasteConfig
from taste_speech.modeling_taste import LM_HEAD_KEY, CheckpointError, TasteForCausalLM

DATA = os.path.join(os.path.dirname(__file__), "data")


def test_full_size_state_dict_equals_published_manifest():
    config = TasteConfig.from_json_file(os.path.join(DATA, "taste_lm_config_full.json"))
    with torch.device("meta"):
        model = TasteForCausalLM(config)
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    manifest = {e["key"]: tuple(e["shape"]) for e in json.load(open(os.path.join(DATA, "taste_lm_manifest_full.json")))["keys"]}
    assert len(manifest) == 1252
    assert sorted(set(manifest) - set(ours)) == []
    assert sorted(set(ours) - set(manifest)) == []
    assert {k: s for k, s in ours.items() if manifest[k] != s} == {}


def test_config_layouts_load_unchanged(taste_lm_tiny_a, tmp_path):
    full = TasteConfig.from_json_file(os.path.join(DATA, "taste_lm_config_full.json"))
    assert full.joint_whisper_config.encoder_layers == 32 and full.joint_whisper_config.decoder_layers == 2
    assert full.text_config.num_hidden_layers == 16 and full.speech_decoder_config.llm__num_blocks == 7
    tiny = TasteConfig.from_pretrained(taste_lm_tiny_a)
    assert tiny.joint_whisper_config.d_model == 64  # resolved from whisper_joint/ next to the config
    tiny.save_pretrained(tmp_path)
    written = json.load(open(tmp_path / "config.json"))
    for key in ("audio_tower_config", "spoken_lm_config", "speech_decoder_config", "text_config", "asr_config"):
        assert isinstance(written[key], dict)
    again = TasteConfig.from_pretrained(tmp_path)
    assert again.audio_tower_config.kwargs_for_quantizer == tiny.audio_tower_config.kwargs_for_quantizer
    assert again.spoken_lm_config.sos_id == tiny.spoken_lm_config.sos_id


def test_the_published_config_is_written_back_in_its_own_spelling(tmp_path):
    """transformers 5 renames the Llama config's RoPE keys and torch_dtype; written back as the
    published file spells them, the original code (transformers 4.51) reads Llama-3's RoPE
    (theta 500000, llama3 scaling), not its defaults."""
    (tmp_path / "published").mkdir()
    published = json.load(open(os.path.join(DATA, "taste_lm_config_full.json")))
    json.dump(published, open(tmp_path / "published" / "config.json", "w"))
    config = TasteConfig.from_pretrained(tmp_path / "published")
    config.save_pretrained(tmp_path / "saved")
    written = json.load(open(tmp_path / "saved" / "config.json"))
    text = written["text_config"]
    assert "rope_parameters" not in text and "dtype" not in text and "dtype" not in written
    assert text["rope_theta"] == published["text_config"]["rope_theta"] == 500000.0
    assert text["rope_scaling"] == published["text_config"]["rope_scaling"]
    assert text["torch_dtype"] == published["text_config"]["torch_dtype"] and written["torch_dtype"] == "bfloat16"
    again = TasteConfig.from_pretrained(tmp_path / "saved")
    assert again.text_config.rope_parameters == config.text_config.rope_parameters
    assert again.text_config.to_dict() == config.text_config.to_dict()


@pytest.fixture(scope="module")
def reference(taste_lm_tiny_a):
    model = TasteForCausalLM.from_pretrained(taste_lm_tiny_a, torch_dtype=torch.float32)
    io = load_file(os.path.join(taste_lm_tiny_a, "io.safetensors"))
    with torch.no_grad():
        logits = model.spoken_lm(io["b.inputs_embeds"], model.rvq)[1]
    return model, io, logits


def test_tiny_a_loads_with_tied_head(reference, taste_lm_tiny_a):
    model, _, _ = reference
    lm = model.spoken_lm
    assert lm.causal_lm.lm_head.weight is lm.embed_tokens.weight
    stored = load_file(os.path.join(taste_lm_tiny_a, "model.safetensors"))
    assert LM_HEAD_KEY not in stored
    assert set(stored) | {LM_HEAD_KEY} == set(model.state_dict())


def _respell(src, dst, rename, drop=()):
    shutil.copytree(src, dst)
    state = load_file(os.path.join(dst, "model.safetensors"))
    state = {rename(k): v for k, v in state.items() if not any(d in k for d in drop)}
    save_file(state, os.path.join(dst, "model.safetensors"))
    return state


def _logits(directory, io):
    model = TasteForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    with torch.no_grad():
        return model.spoken_lm(io["b.inputs_embeds"], model.rvq)[1]


def test_sharded_checkpoint_loads_identically(reference, taste_lm_tiny_a, tmp_path):
    _, io, logits = reference
    dst = tmp_path / "sharded"
    shutil.copytree(taste_lm_tiny_a, dst)
    state = load_file(dst / "model.safetensors")
    os.remove(dst / "model.safetensors")
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, part in shards.items():
        save_file({k: state[k] for k in part}, dst / name)
    weight_map = {k: name for name, part in shards.items() for k in part}
    json.dump({"metadata": {}, "weight_map": weight_map}, open(dst / "model.safetensors.index.json", "w"))
    assert torch.equal(_logits(dst, io), logits)


def test_old_peft_spelling_loads_identically(reference, taste_lm_tiny_a, tmp_path):
    _, io, logits = reference
    _respell(taste_lm_tiny_a, tmp_path / "old", lambda k: k.replace(".base_layer.weight", ".weight").replace(".default.weight", ".weight"))
    assert torch.equal(_logits(tmp_path / "old", io), logits)


def test_merged_lora_checkpoint_loads_identically(reference, taste_lm_tiny_a, tmp_path):
    model, io, logits = reference
    dst = tmp_path / "merged"
    shutil.copytree(taste_lm_tiny_a, dst)
    state = load_file(dst / "model.safetensors")
    scaling = model.config.spoken_lm_config.kwargs_for_lora["lora_alpha"] / model.config.spoken_lm_config.kwargs_for_lora["lora_r"]
    merged = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        if key.endswith(".base_layer.weight"):
            a = state[key.replace(".base_layer.weight", ".lora_A.default.weight")]
            b = state[key.replace(".base_layer.weight", ".lora_B.default.weight")]
            value = value + scaling * b @ a
            key = key.replace(".base_layer.weight", ".weight")
        merged[key.replace("spoken_lm.language_model.base_model.model.", "spoken_lm.language_model.")] = value
    save_file(merged, dst / "model.safetensors")
    assert torch.allclose(_logits(dst, io), logits, atol=1e-4)


def test_merge_lora_for_inference(taste_lm_tiny_a, reference, tmp_path):
    """Merged: the same logits, one matmul per projection, a state dict that is the model (saved and
    loaded elsewhere it computes the same), and the CUDA-graph-shaped static path agrees."""
    _, io, logits = reference
    model = TasteForCausalLM.from_pretrained(taste_lm_tiny_a, torch_dtype=torch.float32)
    lm = model.spoken_lm
    layers = lm.lora_layers()
    assert len(layers) == 7 * model.config.text_config.num_hidden_layers and not lm.lora_merged
    linears = []
    hooks = [m.register_forward_hook(lambda *_: linears.append(1)) for m in lm.modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        lm(io["b.inputs_embeds"], model.rvq)
        on_the_side = len(linears)
        assert lm.merge_lora() and lm.lora_merged
        linears.clear()
        merged_logits = lm(io["b.inputs_embeds"], model.rvq)[1]
    for hook in hooks:
        hook.remove()
    assert on_the_side - len(linears) == 2 * len(layers)  # lora_A and lora_B no longer run
    torch.testing.assert_close(merged_logits, logits, atol=1e-4, rtol=0)
    assert all(float(layer.lora_B["default"].weight.abs().max()) == 0 for _, layer in layers)
    assert lm.merge_lora()  # merging again changes nothing
    torch.testing.assert_close(lm(io["b.inputs_embeds"], model.rvq)[1], merged_logits, atol=0, rtol=0)
    model.save_pretrained(tmp_path / "saved")
    assert set(load_file(tmp_path / "saved" / "model.safetensors")) == set(load_file(
        os.path.join(taste_lm_tiny_a, "model.safetensors")))  # the published layout
    torch.testing.assert_close(_logits(tmp_path / "saved", io), merged_logits, atol=1e-6, rtol=0)
    # the static cache (the CUDA graphs' shapes, run eagerly here) decodes like the growing one
    rows = io["b.inputs_embeds"][:, :6]
    with torch.no_grad():
        hidden = []
        for kind in ("dynamic", "static"):
            state = lm.new_decode_state(cache=lm.new_cache(kind))
            lm.feed(state, rows[:, :4])
            lm.feed(state, rows[:, 4:5])
            lm.feed(state, rows[:, 5:6])
            hidden.append(state.last_hidden)
    torch.testing.assert_close(hidden[0], hidden[1], atol=1e-5, rtol=0)


def test_missing_and_misshaped_tensors_are_named(taste_lm_tiny_a, tmp_path):
    dst = tmp_path / "broken"
    shutil.copytree(taste_lm_tiny_a, dst)
    state = load_file(dst / "model.safetensors")
    missing = "speech_decoder.llm_decoder.bias"
    misshaped = "audio_tower.vq.rvq.project_in.weight"
    del state[missing]
    state[misshaped] = torch.zeros(3, 3)
    state["spoken_lm.some_stray.weight"] = torch.zeros(1)
    save_file(state, dst / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        TasteForCausalLM.from_pretrained(dst)
    message = str(err.value)
    assert missing in message and misshaped in message and "spoken_lm.some_stray.weight" in message


def test_truncated_safetensors_is_a_clear_error(taste_lm_tiny_a, tmp_path):
    dst = tmp_path / "truncated"
    shutil.copytree(taste_lm_tiny_a, dst)
    data = (dst / "model.safetensors").read_bytes()
    (dst / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cannot read"):
        TasteForCausalLM.from_pretrained(dst)


class NotATensor:
    pass


def test_pickle_that_is_not_a_state_dict_is_refused(taste_lm_tiny_a, tmp_path):
    dst = tmp_path / "pickle"
    shutil.copytree(taste_lm_tiny_a, dst)
    state = load_file(dst / "model.safetensors")
    os.remove(dst / "model.safetensors")
    state["evil"] = NotATensor()
    torch.save(state, dst / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="not a plain tensor state dict"):
        TasteForCausalLM.from_pretrained(dst)


def test_uninitialised_codebooks_are_refused(taste_lm_tiny_a, tmp_path):
    dst = tmp_path / "kmeans"
    shutil.copytree(taste_lm_tiny_a, dst)
    state = load_file(dst / "model.safetensors")
    state["audio_tower.vq.rvq.layers.2._codebook.initted"] = torch.zeros(1)
    save_file(state, dst / "model.safetensors")
    with pytest.raises(ValueError, match="initted"):
        TasteForCausalLM.from_pretrained(dst)


def test_not_a_directory_nor_hub_id(tmp_path):
    with pytest.raises(FileNotFoundError):
        TasteForCausalLM.from_pretrained(str(tmp_path / "nope" / "deeper" / "x"))
