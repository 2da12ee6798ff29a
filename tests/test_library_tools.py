"""The library's command-line tools and loading errors: exit codes and messages that name the fix."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from taste_speech import check
from taste_speech.modeling_taste import TasteForCausalLM, resolve_device


def _copy_with_cosyvoice(src: Path, dst: Path) -> Path:
    """A checkpoint copy whose cosyvoice/ folder can be damaged; the rest is linked (no 20 MB copies)."""
    dst.mkdir()
    for entry in src.iterdir():
        if entry.name == "cosyvoice":
            shutil.copytree(entry, dst / entry.name)
        else:
            (dst / entry.name).symlink_to(entry)
    return dst


# -- python -m taste_speech.check: unreadable files -------------------------------------------------
def test_check_truncated_voice_generator_is_unreadable_exit_2(tiny_checkpoint, tmp_path, capsys):
    directory = _copy_with_cosyvoice(tiny_checkpoint, tmp_path / "ck")
    pth = directory / "cosyvoice" / "voice_generator.pth"
    os.truncate(pth, pth.stat().st_size // 2)
    assert check.main([str(directory)]) == 2
    out = capsys.readouterr().out
    assert "UNREADABLE" in out and str(pth) in out and "download it again" in out
    assert "does NOT fit" not in out  # a damaged download is not an architecture mismatch


def test_check_corrupt_voice_generator_config_is_unreadable(tiny_checkpoint, tmp_path):
    directory = _copy_with_cosyvoice(tiny_checkpoint, tmp_path / "ck")
    (directory / "cosyvoice" / "voice_generator_config.json").write_text('{"flow": ')
    report = check.check_checkpoint(str(directory))
    assert report.exit_code == 2 and "voice_generator_config.json" in report.unreadable[0]


@pytest.mark.parametrize("rel", ["cosyvoice/speaker_embed.onnx", "llama_tokenizer/tokenizer.json"])
def test_a_truncated_speaker_model_or_tokenizer_is_named_by_check_and_by_the_processor(tiny_checkpoint, tmp_path, rel):
    """check said OK and the processor failed with onnxruntime's InvalidProtobuf or json's
    'Unterminated string' (no file named)."""
    from taste_speech import TasteProcessor

    directory = _copy_with_cosyvoice(tiny_checkpoint, tmp_path / "ck")
    if rel.startswith("llama_tokenizer"):
        (directory / "llama_tokenizer").unlink()
        shutil.copytree(tiny_checkpoint / "llama_tokenizer", directory / "llama_tokenizer")
    path = directory / rel
    os.truncate(path, path.stat().st_size // 2)
    report = check.check_checkpoint(str(directory))
    assert report.exit_code == 2 and str(path) in report.unreadable[0] and "download it again" in report.unreadable[0]
    with pytest.raises(ValueError, match=f"{path.parent.name}.*(broken or incomplete|download)"):
        processor = TasteProcessor.from_pretrained(str(directory))
        processor.speaker_embedding(np.ones(32000, np.float32) * 0.1, 16000)


def test_an_error_page_saved_as_the_voice_generator_weights_is_not_a_torch_checkpoint(tiny_checkpoint, tmp_path):
    """An HTML page was reported as 'objects other than tensors', quoting torch's advice to load it
    with weights_only=False (running whatever the file holds)."""
    from taste_speech.loading import CheckpointError, load_pickled_state_dict

    directory = _copy_with_cosyvoice(tiny_checkpoint, tmp_path / "ck")
    pth = directory / "cosyvoice" / "voice_generator.pth"
    pth.write_text("<!DOCTYPE html><html><body>502 Bad Gateway</body></html>")
    with pytest.raises(CheckpointError, match=r"is not a torch checkpoint \(it starts with b'<!DO'.*download it again"):
        load_pickled_state_dict(str(pth))
    report = check.check_checkpoint(str(directory))
    assert report.exit_code == 2 and "is not a torch checkpoint" in report.unreadable[0]
    assert "weights_only" not in report.render()


def test_check_mismatch_still_exits_1(tiny_checkpoint, tmp_path):
    directory = _copy_with_cosyvoice(tiny_checkpoint, tmp_path / "ck")
    pth = directory / "cosyvoice" / "voice_generator.pth"
    state = torch.load(pth, weights_only=True)
    state["hift.extra"] = torch.zeros(1)
    torch.save(state, pth)
    report = check.check_checkpoint(str(directory))
    assert report.exit_code == 1 and not report.unreadable


# -- python -m taste_speech.check: paths that do not exist -----------------------------------------
@pytest.mark.parametrize("name", ["{tmp}/nope", "./no-such-dir-xyz", "../no-such-dir-xyz", "~/no-such-dir-xyz",
                                  "a/b/c", "nope"])
def test_check_missing_path_is_no_such_directory(name, tmp_path, monkeypatch, capsys):
    name = name.format(tmp=tmp_path)

    def no_hub(repo_id):
        raise AssertionError(f"{repo_id} is a path, it must not be looked up on the hub")

    monkeypatch.setattr(check, "check_remote", no_hub)
    assert check.main([name]) == 2
    out = capsys.readouterr().out
    assert "no such directory" in out and "hf download" not in out
    # the same rule as loading: from_pretrained does not take it for a hub id either
    from taste_speech.loading import looks_like_hub_id

    assert not looks_like_hub_id(name)
    with pytest.raises(FileNotFoundError, match="neither a local directory nor a hub id"):
        TasteForCausalLM.from_pretrained(name)


def test_check_hub_id_still_goes_to_the_hub(monkeypatch):
    monkeypatch.setattr(check, "check_remote", lambda repo_id: check.CheckReport(f"remote {repo_id}"))
    assert check.check_checkpoint("no-such-owner/no-such-model").source == "remote no-such-owner/no-such-model"


def test_check_an_incomplete_cached_snapshot_asks_the_hub(tiny_checkpoint, tmp_path, monkeypatch):
    """An earlier remote check leaves config.json alone in the hub cache: that is no checkpoint to
    judge; the complete cached snapshot is checked where it lies."""
    import huggingface_hub

    partial = tmp_path / "snapshot"
    partial.mkdir()
    shutil.copy(tiny_checkpoint / "config.json", partial / "config.json")
    snapshot = {"dir": str(partial)}
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, local_files_only: snapshot["dir"])
    monkeypatch.setattr(check, "check_remote", lambda repo_id: check.CheckReport(f"remote {repo_id}"))
    report = check.check_checkpoint("owner/model")
    assert report.source == "remote owner/model" and any("incomplete" in n for n in report.notes)

    snapshot["dir"] = str(tiny_checkpoint)
    report = check.check_checkpoint("owner/model")
    assert report.source.startswith("owner/model (cached at") and report.ok


# -- python -m taste_speech.verify: not a golden directory -----------------------------------------
def test_verify_rejects_a_plain_checkpoint_with_exit_2(tiny_checkpoint, taste_lm_tiny_a, capsys):
    from taste_speech.verify import Golden, NotGoldenDirError
    from taste_speech.verify.__main__ import main

    # checked before any directory runs: the golden one first would otherwise take the time
    assert main([str(taste_lm_tiny_a), str(tiny_checkpoint)]) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert f"{tiny_checkpoint} is not a golden reference directory (no io.safetensors)" in err
    assert "tests/data/taste_lm_tiny_a" in err and "parity" not in captured.out
    with pytest.raises(NotGoldenDirError, match="not a golden reference directory"):
        Golden(str(tiny_checkpoint))


def test_verify_says_which_golden_folder_it_cannot_read_with_exit_2(taste_lm_tiny_a, tmp_path, capsys):
    """A truncated io.safetensors or a voice-generator golden folder without its weights gave a
    traceback and exit 1 (the code of a failed parity point); the latter was taken for a language-model
    folder ('expected model.safetensors')."""
    from taste_speech.verify import Golden
    from taste_speech.verify.__main__ import main

    broken = tmp_path / "broken"
    shutil.copytree(taste_lm_tiny_a, broken)
    os.truncate(broken / "io.safetensors", (broken / "io.safetensors").stat().st_size // 2)
    assert main([str(broken)]) == 2
    err = capsys.readouterr().err
    assert f"ERROR: cannot run the parity points of {broken}" in err and "Traceback" not in err

    voice = tmp_path / "voice"
    shutil.copytree(Path(__file__).parent / "data" / "voice_generator_tiny_a", voice)
    (voice / "weights.safetensors").unlink()
    assert Golden(str(voice)).kind == "voice_generator"  # (from its config.json, not from its weights file)
    assert main([str(voice)]) == 2
    assert "weights.safetensors" in capsys.readouterr().err


def test_verify_command_line_exit_code(tmp_path):
    run = subprocess.run([sys.executable, "-m", "taste_speech.verify", str(tmp_path)], capture_output=True,
                         text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert run.returncode == 2, run.stdout + run.stderr
    assert "Traceback" not in run.stderr and "not a golden reference directory" in run.stderr


# -- device="cuda" without CUDA ---------------------------------------------------------------------
@pytest.fixture
def no_cuda(monkeypatch):
    """This machine has no CUDA (also on a GPU machine), and nothing may be loaded."""
    import taste_speech.modeling_taste as modeling
    import taste_speech.voice_generator as voice_generator

    def no_loading(*args, **kwargs):
        raise AssertionError("the device must be checked before anything is loaded")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(modeling, "resolve_checkpoint_dir", no_loading)
    monkeypatch.setattr(voice_generator, "read_state_dict", no_loading)


@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda")])
def test_cuda_without_cuda_is_a_clear_error(no_cuda, tiny_checkpoint, device):
    from taste_speech.voice_generator import VoiceGenerator

    with pytest.raises(RuntimeError, match=r"CUDA is not available.*device='cpu'.*device='auto'.*CUDA build"):
        TasteForCausalLM.from_pretrained(str(tiny_checkpoint), device=device)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        VoiceGenerator.from_pretrained(tiny_checkpoint, device=device)


def test_engine_cuda_without_cuda_is_a_clear_error(no_cuda):
    from pipecat_taste.engine import TasteEngine

    with pytest.raises(RuntimeError, match="CUDA is not available"):
        TasteEngine.from_pretrained(None, device="cuda")


def test_auto_and_cpu_still_resolve_without_cuda(no_cuda, monkeypatch):
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda") == torch.device("cuda")
    with pytest.raises(RuntimeError, match="has 1 CUDA device"):
        resolve_device("cuda:3")


def _hub_of(folder, cache, monkeypatch):
    """huggingface_hub's two calls that check_remote makes, served from a local checkpoint folder."""
    import struct
    from types import SimpleNamespace

    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError

    def download(repo_id, filename, **kwargs):
        source = folder / filename
        if not source.is_file():
            raise EntryNotFoundError(f"{filename} is not in {repo_id}")
        (cache / filename).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, cache / filename)
        return str(cache / filename)

    def metadata(repo_id, **kwargs):
        files = {}
        for path in folder.glob("*.safetensors"):
            raw = path.read_bytes()
            header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
            files[path.name] = SimpleNamespace(tensors={name: SimpleNamespace(shape=entry["shape"], dtype=entry["dtype"])
                                                        for name, entry in header.items() if name != "__metadata__"})
        return SimpleNamespace(files_metadata=files)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", metadata)


def test_a_remote_check_reads_a_tower_config_kept_beside_config_json(tiny_checkpoint, tmp_path, monkeypatch):
    """A hub checkpoint whose tower is not the published one (the tiny one, uploaded) keeps its
    Whisper config in whisper_joint/: the remote check fetches it and passes the headers."""
    _hub_of(tiny_checkpoint, tmp_path / "cache", monkeypatch)
    report = check.check_remote("owner/tiny-taste")
    assert report.exit_code == 0, report.render()
    assert (tmp_path / "cache" / "whisper_joint" / "config.json").is_file()


def test_a_remote_check_of_something_else_is_an_error_line(tmp_path, monkeypatch, capsys):
    """A hub id that is no TASTE checkpoint (a Whisper's config.json, say): ERROR and exit 2, no traceback."""
    other = tmp_path / "whisper"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "whisper", "d_model": 384}))
    _hub_of(other, tmp_path / "cache", monkeypatch)
    monkeypatch.setattr(check, "check_checkpoint", check.check_remote)  # (not looked up in the local cache)
    assert check.main(["openai/whisper-tiny"]) == 2
    out = capsys.readouterr().out
    assert "ERROR: cannot read the config.json of openai/whisper-tiny as a TASTE config" in out


@pytest.mark.parametrize("edit, words", [
    (lambda c: c.pop("text_config"), "text_config is missing; each of audio_tower_config"),
    (lambda c: c.update(speech_decoder_config=None), "speech_decoder_config is NoneType"),
    (lambda c: c.update(spoken_lm_config=[1, 2]), "spoken_lm_config is list"),
    (lambda c: c["text_config"].update(hidden_size="64"), "does not make a TASTE config .*hidden_size"),
])
def test_a_config_json_with_a_broken_sub_config_is_named(tiny_checkpoint, tmp_path, edit, words):
    """A sub-config left out or null became its default silently (747 mismatched tensors followed);
    a value of the wrong type escaped as huggingface_hub's validation error, naming no file."""
    from taste_speech.configuration_taste import TasteConfig

    directory = tmp_path / "ck"
    directory.mkdir()
    for entry in tiny_checkpoint.iterdir():
        if entry.name != "config.json":
            (directory / entry.name).symlink_to(entry)
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"{directory / 'config.json'}.*{words}.*download it again"):
        TasteConfig.from_pretrained(str(directory))
