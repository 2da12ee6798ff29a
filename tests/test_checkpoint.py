"""Checkpoint compatibility: published names/shapes/dtypes, every accepted key spelling, the tied
head, clear errors for broken files, and ``python -m taste_speech.check``."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from taste_speech import check
from taste_speech.configuration_taste import TasteConfig
from taste_speech.loading import EMBED_KEY, LM_HEAD_KEY, CheckpointError
from taste_speech.modeling_taste import TasteForCausalLM, run_dtype_for_key

DATA = Path(__file__).parent / "data"
MANIFEST = json.loads((DATA / "taste_lm_manifest_full.json").read_text())


# -- the full-size architecture ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def full_meta_model():
    config = TasteConfig.from_json_file(str(DATA / "taste_lm_config_full.json"))
    with torch.device("meta"):
        return TasteForCausalLM(config)


def test_full_size_state_dict_equals_manifest(full_meta_model):
    ours = {k: tuple(v.shape) for k, v in full_meta_model.state_dict().items()}
    published = {e["key"]: tuple(e["shape"]) for e in MANIFEST["keys"]}
    assert len(published) == 1252 and LM_HEAD_KEY in published
    assert sorted(set(published) - set(ours)) == []
    assert sorted(set(ours) - set(published)) == []
    assert {k: (s, published[k]) for k, s in ours.items() if published[k] != s} == {}


def test_published_run_dtypes_follow_the_manifest(full_meta_model):
    """The default CUDA layout (half dtype for Whisper + Llama base, fp32 elsewhere, LoRA fp32) is
    exactly the dtype layout the original constructs."""
    wrong = {}
    for entry in MANIFEST["keys"]:
        expected = getattr(torch, entry["dtype"])
        if expected.is_floating_point and run_dtype_for_key(entry["key"], torch.bfloat16) != expected:
            wrong[entry["key"]] = entry["dtype"]
    assert wrong == {}


# -- the golden tiny checkpoint --------------------------------------------------------------------
@pytest.fixture(scope="module")
def golden_io(taste_lm_tiny_a):
    return load_file(str(taste_lm_tiny_a / "io.safetensors"))


@pytest.fixture(scope="module")
def reference(taste_lm_tiny_a, golden_io):
    model, info = TasteForCausalLM.from_pretrained(taste_lm_tiny_a, torch_dtype=torch.float32,
                                                   output_loading_info=True)
    return model, info, _text_logits(model, golden_io)


def _text_logits(model, io):
    with torch.no_grad():
        return model.spoken_lm(io["b.inputs_embeds"], model.rvq)[1]


def test_tiny_a_loads_without_missing_or_unexpected_keys(reference, taste_lm_tiny_a):
    model, info, _ = reference
    assert info.missing_keys == [] and info.unexpected_keys == [] and info.mismatched_keys == []
    assert info.tied_lm_head and not info.merged_lora and info.spelling == "canonical"
    assert model.loading_info is info
    lm = model.spoken_lm
    assert lm.causal_lm.lm_head.weight is lm.embed_tokens.weight  # Caution 1 of the golden README
    stored = load_file(str(taste_lm_tiny_a / "model.safetensors"))
    assert set(stored) | {LM_HEAD_KEY} == set(model.state_dict())
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert not model.training


def test_tiny_a_reproduces_golden_logits_and_codes(reference, golden_io):
    model, _, logits = reference
    assert (logits - golden_io["b.text_logits"]).abs().max() <= 1e-3
    asr_indices, llm_indices = model.extract_vq(
        audio_features=golden_io["in.audio_features"], asr_token_ids=golden_io["in.asr_token_ids"],
        asr_word_ids=golden_io["in.asr_word_ids"], llm_word_ids=golden_io["in.llm_word_ids"],
        llm_token_ids=golden_io["in.llm_token_ids"],  # extra processor outputs are accepted
    )
    assert torch.equal(asr_indices, golden_io["a.out.asr_indices"])
    assert torch.equal(llm_indices, golden_io["a.out.llm_indices"])


def test_mixed_dtype_layout_on_request(taste_lm_tiny_a, golden_io, reference):
    model = TasteForCausalLM.from_pretrained(taste_lm_tiny_a, torch_dtype=torch.bfloat16)
    for key, value in model.state_dict().items():
        assert value.dtype == run_dtype_for_key(key, torch.bfloat16), key
    assert model.spoken_lm.causal_lm.lm_head.weight is model.spoken_lm.embed_tokens.weight
    logits = _text_logits(model, golden_io)  # runs, and stays close to fp32 (bf16 weight rounding only)
    assert logits.dtype == torch.float32 and (logits - reference[2]).abs().max() < 1.0
    default = TasteForCausalLM.from_pretrained(taste_lm_tiny_a)  # CPU default: float32 everywhere
    assert {p.dtype for p in default.parameters()} == {torch.float32}
    default.set_run_dtypes("bfloat16")  # re-cast a loaded model to the mixed layout
    assert {k: v.dtype for k, v in default.state_dict().items()} == {k: v.dtype for k, v in model.state_dict().items()}
    assert default.spoken_lm.causal_lm.lm_head.weight is default.spoken_lm.embed_tokens.weight


def test_auto_classes_load_the_checkpoint(taste_lm_tiny_a, reference, golden_io):
    from transformers import AutoConfig, AutoModelForCausalLM

    assert isinstance(AutoConfig.from_pretrained(taste_lm_tiny_a), TasteConfig)
    model = AutoModelForCausalLM.from_pretrained(taste_lm_tiny_a, dtype=torch.float32)
    assert isinstance(model, TasteForCausalLM)
    assert model.config.joint_whisper_config.d_model == 64  # whisper_joint/ resolved next to config.json
    assert torch.equal(_text_logits(model, golden_io), reference[2])


# -- key spellings and file layouts ---------------------------------------------------------------------
def _variant(src: Path, dst: Path, state: dict, weights_name: str = "model.safetensors") -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors", "io.safetensors"))
    if weights_name.endswith(".bin"):
        torch.save(state, dst / weights_name)
    else:
        save_file(state, str(dst / weights_name))
    return dst


@pytest.fixture(scope="module")
def stored(taste_lm_tiny_a):
    return load_file(str(taste_lm_tiny_a / "model.safetensors"))


def _loads_identically(directory, reference, io, exact=True):
    model = TasteForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    logits = _text_logits(model, io)
    if exact:
        assert torch.equal(logits, reference[2])
    else:
        assert (logits - reference[2]).abs().max() <= 1e-4
    return model


def test_sharded_checkpoint_from_save_pretrained(reference, golden_io, taste_lm_tiny_a, tmp_path):
    model = reference[0]
    model.save_pretrained(tmp_path / "sharded", max_shard_size=2_000_000)
    files = sorted(os.listdir(tmp_path / "sharded"))
    assert "model.safetensors.index.json" in files and "whisper_joint" in files
    shards = [f for f in files if f.startswith("model-") and f.endswith(".safetensors")]
    assert len(shards) > 2
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert LM_HEAD_KEY not in index["weight_map"]  # the tied head is not written
    loaded = _loads_identically(tmp_path / "sharded", reference, golden_io)
    assert loaded.loading_info.tied_lm_head and len(loaded.loading_info.files) == len(shards)


def test_old_peft_spelling(stored, reference, golden_io, taste_lm_tiny_a, tmp_path):
    old = {k.replace(".base_layer.weight", ".weight").replace(".default.weight", ".weight"): v for k, v in stored.items()}
    assert any(k.endswith("self_attn.q_proj.weight") for k in old)
    model = _loads_identically(_variant(taste_lm_tiny_a, tmp_path / "old", old), reference, golden_io)
    assert model.loading_info.spelling == "old peft"


def test_merged_lora_checkpoint(stored, reference, golden_io, taste_lm_tiny_a, tmp_path):
    lora = reference[0].config.spoken_lm_config.kwargs_for_lora
    scaling = lora["lora_alpha"] / lora["lora_r"]
    merged = {}
    for key, value in stored.items():
        if ".lora_" in key:
            continue
        if key.endswith(".base_layer.weight"):
            a = stored[key.replace(".base_layer.weight", ".lora_A.default.weight")]
            b = stored[key.replace(".base_layer.weight", ".lora_B.default.weight")]
            value, key = value + scaling * b @ a, key.replace(".base_layer.weight", ".weight")
        merged[key.replace("spoken_lm.language_model.base_model.model.", "spoken_lm.language_model.")] = value
    assert not any("base_model" in k for k in merged)
    model = _loads_identically(_variant(taste_lm_tiny_a, tmp_path / "merged", merged), reference, golden_io,
                               exact=False)
    assert model.loading_info.merged_lora and model.loading_info.spelling == "merged"


def test_an_unmerged_base_without_its_adapters_is_refused(stored, taste_lm_tiny_a, tmp_path):
    """A base stored in peft's unmerged spelling (".base_layer.") without its LoRA adapters is not a
    merged model: loading it with the adapters set to zero would silently run another model."""
    bare = {k: v for k, v in stored.items() if ".lora_" not in k}
    assert any(".base_layer." in k for k in bare)
    with pytest.raises(CheckpointError, match="lora_A"):
        TasteForCausalLM.from_pretrained(_variant(taste_lm_tiny_a, tmp_path / "bare", bare))
    # the same in old peft's spelling (the plain weight under peft's wrapper prefix): it loaded as
    # "merged", adapters zero
    old_bare = {k.replace(".base_layer.weight", ".weight"): v for k, v in bare.items()}
    assert not any(".base_layer." in k for k in old_bare)
    with pytest.raises(CheckpointError, match="lora_A"):
        TasteForCausalLM.from_pretrained(_variant(taste_lm_tiny_a, tmp_path / "old_bare", old_bare))


def test_plain_bin_and_stored_duplicate_head(stored, reference, golden_io, taste_lm_tiny_a, tmp_path):
    with_head = dict(stored)
    with_head[LM_HEAD_KEY] = stored[EMBED_KEY].clone()  # older scripts saved an untied copy
    model = _loads_identically(_variant(taste_lm_tiny_a, tmp_path / "bin", with_head, "pytorch_model.bin"),
                               reference, golden_io)
    assert not model.loading_info.tied_lm_head
    assert model.spoken_lm.causal_lm.lm_head.weight is model.spoken_lm.embed_tokens.weight


def test_a_different_stored_head_is_kept(stored, taste_lm_tiny_a, tmp_path):
    state = dict(stored)
    state[LM_HEAD_KEY] = torch.randn_like(stored[EMBED_KEY])
    model = TasteForCausalLM.from_pretrained(_variant(taste_lm_tiny_a, tmp_path / "head", state))
    assert torch.equal(model.spoken_lm.causal_lm.lm_head.weight, state[LM_HEAD_KEY])
    assert torch.equal(model.spoken_lm.embed_tokens.weight, stored[EMBED_KEY])


def test_a_head_without_lora_is_kept_and_saved(stored, taste_lm_tiny_a, tmp_path):
    """Without LoRA the head has the plain spelling; a stored, different head must not be re-tied."""
    plain = {}
    for key, value in stored.items():
        if ".lora_" in key:
            continue
        key = key.replace("spoken_lm.language_model.base_model.model.", "spoken_lm.language_model.")
        plain[key.replace(".base_layer.weight", ".weight")] = value
    head = torch.randn_like(stored[EMBED_KEY])
    plain["spoken_lm.language_model.lm_head.weight"] = head
    directory = _variant(taste_lm_tiny_a, tmp_path / "nolora", plain)
    config = json.loads((directory / "config.json").read_text())
    config["spoken_lm_config"]["use_lora"] = False
    (directory / "config.json").write_text(json.dumps(config))
    model = TasteForCausalLM.from_pretrained(directory)
    lm = model.spoken_lm.causal_lm
    assert not model.loading_info.tied_lm_head and torch.equal(lm.lm_head.weight, head)
    model.save_pretrained(tmp_path / "saved")  # two distinct tensors: nothing shared in the file
    again = TasteForCausalLM.from_pretrained(tmp_path / "saved")
    assert torch.equal(again.spoken_lm.causal_lm.lm_head.weight, head)


def test_transformers_loading_options_are_accepted(taste_lm_tiny_a):
    # the original README's call, and options scripts pass out of habit
    model = TasteForCausalLM.from_pretrained(str(taste_lm_tiny_a), attn_implementation="eager",
                                             low_cpu_mem_usage=False, use_safetensors=True)
    assert model.loading_info.missing_keys == []
    with pytest.raises(ValueError, match="one device"):
        TasteForCausalLM.from_pretrained(str(taste_lm_tiny_a), device_map={"": 0, "spoken_lm": 1})


def test_a_second_save_replaces_the_first(reference, tmp_path):
    model = reference[0]
    model.save_pretrained(tmp_path, max_shard_size=2_000_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    model.save_pretrained(tmp_path)  # single file: the old shards and index must go
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("model")) == ["model.safetensors"]
    shutil.copy(tmp_path / "model.safetensors", tmp_path / "model-00001-of-00001.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "model-00001-of-00001.safetensors" for k in load_file(str(tmp_path / "model.safetensors"))}}))
    with pytest.raises(CheckpointError, match="left over from an older save"):
        TasteForCausalLM.from_pretrained(tmp_path)


def test_a_save_over_a_bin_checkpoint_is_what_loads_next(reference, tmp_path):
    """A sharded ``.bin`` checkpoint (as ``safe_serialization=False`` writes it), edited and saved
    into its own folder: the next load reads the new safetensors (it read the old .bin shards)."""
    model = reference[0]
    state = load_file(str(reference_file(model, tmp_path / "src")))
    keys = sorted(state)
    shards = {"pytorch_model-00001-of-00002.bin": keys[: len(keys) // 2],
              "pytorch_model-00002-of-00002.bin": keys[len(keys) // 2:]}
    folder = tmp_path / "bin"
    shutil.copytree(tmp_path / "src", folder, ignore=shutil.ignore_patterns("model*.safetensors*"))
    for name, names in shards.items():
        torch.save({k: state[k] for k in names}, folder / name)
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {k: name for name, names in shards.items() for k in names}}))
    loaded = TasteForCausalLM.from_pretrained(folder)
    assert [os.path.basename(f) for f in loaded.loading_info.files] == sorted(shards)
    with torch.no_grad():
        loaded.spoken_lm.pad_audio_unit_embed.add_(1.0)
    loaded.save_pretrained(folder)
    assert sorted(f for f in os.listdir(folder) if "model" in f and f != "config.json") == ["model.safetensors"]
    again = TasteForCausalLM.from_pretrained(folder)
    assert torch.equal(again.spoken_lm.pad_audio_unit_embed, loaded.spoken_lm.pad_audio_unit_embed)
    # a folder that holds both formats (e.g. two downloads): safetensors first, as transformers reads them
    for name in shards:
        torch.save({k: torch.zeros_like(state[k]) for k in shards[name]}, folder / name)
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {k: name for name, names in shards.items() for k in names}}))
    assert [os.path.basename(f) for f in TasteForCausalLM.from_pretrained(folder).loading_info.files] == \
        ["model.safetensors"]


def reference_file(model, folder):
    model.save_pretrained(folder)
    return folder / "model.safetensors"


def test_a_failed_save_leaves_the_previous_checkpoint_whole(reference, tmp_path, monkeypatch):
    import safetensors.torch

    model = reference[0]
    model.save_pretrained(tmp_path, max_shard_size=2_000_000)
    before = sorted(os.listdir(tmp_path))

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        model.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == before
    monkeypatch.undo()
    assert TasteForCausalLM.from_pretrained(tmp_path).loading_info.missing_keys == []


# -- broken checkpoints ------------------------------------------------------------------------------
def test_a_folder_without_config_is_named(taste_lm_tiny_a, tmp_path):
    """An interrupted download: transformers alone would return a default config and every tensor
    would be reported as mis-shaped."""
    shutil.copytree(taste_lm_tiny_a, tmp_path / "partial", ignore=shutil.ignore_patterns("config.json"))
    for load in (TasteForCausalLM.from_pretrained, TasteConfig.from_pretrained):
        with pytest.raises((CheckpointError, FileNotFoundError), match="has no config.json"):
            load(str(tmp_path / "partial"))
    os.remove(tmp_path / "partial" / "model.safetensors")
    (tmp_path / "partial" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="not a TASTE one"):
        TasteConfig.from_pretrained(str(tmp_path / "partial"))


def test_a_missing_tower_whisper_config_is_named(taste_lm_tiny_a, tmp_path):
    shutil.copytree(taste_lm_tiny_a, tmp_path / "c", ignore=shutil.ignore_patterns("whisper_joint"))
    with pytest.raises(FileNotFoundError, match="whisper_joint"):
        TasteConfig.from_pretrained(str(tmp_path / "c"))


def test_auto_config_finds_the_tower_whisper_next_to_it(taste_lm_tiny_a):
    from transformers import AutoConfig  # the taste type is registered by importing taste_speech

    config = AutoConfig.from_pretrained(str(taste_lm_tiny_a))
    assert config.joint_whisper_config.d_model == TasteConfig.from_pretrained(str(taste_lm_tiny_a)).joint_whisper_config.d_model != 1280


def test_missing_unexpected_and_misshaped_tensors_are_named(stored, taste_lm_tiny_a, tmp_path):
    state = dict(stored)
    del state["speech_decoder.llm_decoder.bias"]
    state["audio_tower.vq.rvq.project_in.weight"] = torch.zeros(3, 3)
    state["spoken_lm.extract_for_bridge_out_llm.linear.weight"] = torch.zeros(4, 4)  # an older TASTE head
    directory = _variant(taste_lm_tiny_a, tmp_path / "broken", state)
    with pytest.raises(CheckpointError) as err:
        TasteForCausalLM.from_pretrained(directory)
    message = str(err.value)
    assert "1 missing tensor(s)" in message and "speech_decoder.llm_decoder.bias" in message
    assert "audio_tower.vq.rvq.project_in.weight: checkpoint (3, 3) != model (16, 64)" in message
    assert "spoken_lm.extract_for_bridge_out_llm.linear.weight" in message and "weighted_layer" in message

    model, info = TasteForCausalLM.from_pretrained(directory, strict=False, output_loading_info=True)
    assert info.missing_keys == ["speech_decoder.llm_decoder.bias"]
    assert info.unexpected_keys == ["spoken_lm.extract_for_bridge_out_llm.linear.weight"]
    assert [m.split(":")[0] for m in info.mismatched_keys] == ["audio_tower.vq.rvq.project_in.weight"]
    assert not any(v.device.type == "meta" for v in model.state_dict().values())
    assert torch.count_nonzero(model.speech_decoder.llm_decoder.bias) == 0  # gaps are zero-filled


@pytest.mark.parametrize("cut", ["data", "header"])
def test_truncated_safetensors(taste_lm_tiny_a, tmp_path, cut):
    directory = tmp_path / cut
    shutil.copytree(taste_lm_tiny_a, directory)
    data = (directory / "model.safetensors").read_bytes()
    (directory / "model.safetensors").write_bytes(data[: len(data) - 1000] if cut == "data" else data[:100])
    with pytest.raises(CheckpointError, match="cannot read .*model.safetensors.*download it again"):
        TasteForCausalLM.from_pretrained(directory)


def test_missing_shard_is_named(reference, tmp_path):
    reference[0].save_pretrained(tmp_path / "sharded", max_shard_size=4_000_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    second = sorted(set(index["weight_map"].values()))[1]
    os.remove(tmp_path / "sharded" / second)
    with pytest.raises(CheckpointError, match=f"not there: .*{second}"):
        TasteForCausalLM.from_pretrained(tmp_path / "sharded")


class _Payload:
    """Unpickling this would create a file: proof that no arbitrary object is ever unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_bin_with_a_non_tensor_object_is_refused_unopened(stored, taste_lm_tiny_a, tmp_path):
    marker = tmp_path / "unpickled"
    state = dict(stored)
    state["evil"] = _Payload(str(marker))
    directory = _variant(taste_lm_tiny_a, tmp_path / "pickle", state, "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="not a plain tensor state dict"):
        TasteForCausalLM.from_pretrained(directory)
    assert check.main([str(directory)]) == 2
    assert not marker.exists()


def test_uninitialised_codebooks_are_refused(stored, taste_lm_tiny_a, tmp_path):
    state = dict(stored)
    state["audio_tower.vq.rvq.layers.2._codebook.initted"] = torch.zeros(1)
    directory = _variant(taste_lm_tiny_a, tmp_path / "kmeans", state)
    with pytest.raises(ValueError, match="layers.2._codebook.initted"):
        TasteForCausalLM.from_pretrained(directory)
    report = check.check_checkpoint(str(directory))
    assert not report.ok and any("layers.2._codebook.initted" in p for p in report.problems)


def test_not_a_directory_nor_a_hub_id(tmp_path):
    with pytest.raises(FileNotFoundError):
        TasteForCausalLM.from_pretrained(str(tmp_path / "nope" / "deeper" / "x"))


def test_unknown_hub_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="hf download"):
        TasteForCausalLM.from_pretrained("no-such-owner/no-such-taste-model")
    with pytest.raises(CheckpointError, match="no local directory 'models/x'"):  # a mistyped relative path
        TasteForCausalLM.from_pretrained("models/x")


def test_an_incomplete_cached_snapshot_names_the_fix(taste_lm_tiny_a, tmp_path, monkeypatch):
    """Only the processor's files were cached (an earlier TasteProcessor.from_pretrained), now offline."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "hub" / "models--owner--taste"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    shutil.copy(taste_lm_tiny_a / "config.json", snapshot / "config.json")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    with pytest.raises(CheckpointError, match="cached copy of owner/taste is incomplete.*hf download owner/taste"):
        TasteForCausalLM.from_pretrained("owner/taste", cache_dir=str(tmp_path / "hub"))


# -- python -m taste_speech.check -------------------------------------------------------------------
def test_check_accepts_the_golden_checkpoint(taste_lm_tiny_a, capsys):
    assert check.main([str(taste_lm_tiny_a)]) == 0
    out = capsys.readouterr().out
    assert "result: OK" in out and "tied to embed_tokens" in out


def test_check_names_every_problem_without_reading_tensor_data(stored, taste_lm_tiny_a, tmp_path, monkeypatch,
                                                               capsys):
    state = dict(stored)
    del state["speech_decoder.llm_decoder.bias"]
    state["audio_tower.vq.rvq.project_in.weight"] = torch.zeros(3, 3)
    state["spoken_lm.stray"] = torch.zeros(1)
    directory = _variant(taste_lm_tiny_a, tmp_path / "broken", state)

    import safetensors

    def no_data(*args, **kwargs):
        raise AssertionError("the checker must not read tensor data")

    monkeypatch.setattr(safetensors, "safe_open", no_data)
    monkeypatch.setattr(check.CheckpointReader, "get", no_data)
    assert check.main([str(directory)]) == 1
    out = capsys.readouterr().out
    assert "missing tensor: speech_decoder.llm_decoder.bias" in out
    assert "unexpected tensor: spoken_lm.stray" in out
    assert "mis-shaped tensor: audio_tower.vq.rvq.project_in.weight: checkpoint (3, 3) != model (16, 64)" in out
    assert "does NOT fit" in out


def test_check_accepts_other_spellings_and_reports_truncation(stored, taste_lm_tiny_a, tmp_path):
    old = {k.replace(".base_layer.weight", ".weight"): v for k, v in stored.items()}
    report = check.check_checkpoint(str(_variant(taste_lm_tiny_a, tmp_path / "old", old)))
    assert report.ok and any("old peft" in n for n in report.notes)
    truncated = tmp_path / "truncated"
    shutil.copytree(taste_lm_tiny_a, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match="truncated"):
        check.check_checkpoint(str(truncated))


def test_check_voice_generator(tiny_checkpoint, tmp_path):
    report = check.check_checkpoint(str(tiny_checkpoint))
    assert report.ok, report.render()
    assert any("voice_generator.pth" in n and "tensors" in n for n in report.notes)
    broken = tmp_path / "vg"
    shutil.copytree(tiny_checkpoint, broken)
    pth = broken / "cosyvoice" / "voice_generator.pth"
    state = torch.load(pth, weights_only=True)
    dropped = sorted(state)[0]
    del state[dropped]
    state["hift.extra"] = torch.zeros(1)
    torch.save(state, pth)
    report = check.check_checkpoint(str(broken))
    assert not report.ok
    assert f"missing tensor in cosyvoice/voice_generator.pth: {dropped}" in report.problems
    assert "unexpected tensor in cosyvoice/voice_generator.pth: hift.extra" in report.problems


def test_check_command_line(taste_lm_tiny_a, tmp_path):
    ok = subprocess.run([sys.executable, "-m", "taste_speech.check", str(taste_lm_tiny_a)],
                        capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    missing = subprocess.run([sys.executable, "-m", "taste_speech.check", str(tmp_path)],
                             capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert missing.returncode == 2 and "ERROR" in missing.stdout
