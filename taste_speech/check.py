"""``python -m taste_speech.check DIR_OR_HUB_ID``: does a checkpoint fit the TASTE architecture?

Compares every tensor name and shape of a checkpoint with the model its ``config.json`` describes
(built on the meta device: no memory, no random init) BEFORE any tensor data is read: safetensors
files are judged by their JSON headers, ``.bin``/``.pth`` files are memory-mapped through
``torch.load(weights_only=True)`` (never unpickling arbitrary objects). It prints every missing,
unexpected or mis-shaped tensor and exits non-zero when there is any.

Also checked:

* that each safetensors file is as long as its header says (truncated downloads);
* the accepted key spellings (§10.2: peft >= 0.7, old peft, merged) and the tied LM head;
* once names and shapes match: the RVQ ``initted`` flags (four one-element tensors are read);
* ``cosyvoice/voice_generator.pth`` when present, against ``taste_speech.voice_generator``
  (full size, or the ``voice_generator_config.json`` next to it), including that its speech
  vocabulary and speaker size fit the speech decoder;
* the rest of the published layout (``llama_tokenizer/``, ``cosyvoice/*.onnx``): absent files
  are reported as notes, they do not fail the check.

A hub id is checked from the local cache when the snapshot is there; otherwise only
``config.json`` and the safetensors headers are fetched (HTTP range requests, no tensor data)
and ``voice_generator.pth`` is skipped.

Exit codes: 0 = fits, 1 = mismatching tensors, 2 = unreadable checkpoint or config (a truncated or
corrupt file, also ``voice_generator.pth``; or no such directory).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch

from taste_speech.configuration_taste import JOINT_WHISPER_DIR, TasteConfig
from taste_speech.loading import (
    SAFETENSORS_DTYPES,
    CheckpointError,
    CheckpointReader,
    TensorInfo,
    load_pickled_state_dict,
    looks_like_hub_id,
    match_keys,
    require_checkpoint_files,
)

VOICE_GENERATOR_PTH = os.path.join("cosyvoice", "voice_generator.pth")
LAYOUT_FILES = (
    (os.path.join("llama_tokenizer", "tokenizer.json"), "Llama tokenizer (TasteProcessor)"),
    (os.path.join("cosyvoice", "speaker_embed.onnx"), "CAMPPlus speaker encoder (TasteProcessor)"),
    (os.path.join("cosyvoice", "speech_tokenizer_v1.onnx"), "S3 speech tokenizer (not used by inference)"),
    (VOICE_GENERATOR_PTH, "voice generator weights (speech synthesis)"),
)


@dataclass
class CheckReport:
    source: str
    problems: list[str] = field(default_factory=list)  # each line names one bad tensor or file
    notes: list[str] = field(default_factory=list)
    # files that could not be read at all (truncated, corrupt): the check is incomplete, exit 2
    unreadable: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.unreadable

    @property
    def exit_code(self) -> int:
        return 2 if self.unreadable else 1 if self.problems else 0

    def render(self) -> str:
        lines = [f"checkpoint: {self.source}"]
        lines += [f"  {n}" for n in self.notes]
        if self.problems:
            lines.append(f"PROBLEMS ({len(self.problems)}):")
            lines += [f"  {p}" for p in self.problems]
        if self.unreadable:
            lines.append(f"UNREADABLE FILES ({len(self.unreadable)}):")
            lines += [f"  {u}" for u in self.unreadable]
            lines.append("result: could NOT be checked - a file is unreadable (the fix is named above)")
        elif self.problems:
            lines.append("result: does NOT fit the TASTE architecture")
        else:
            lines.append("result: OK - every tensor name and shape fits")
        return "\n".join(lines)


def expected_state_shapes(config: TasteConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the model a config describes, built on the meta device."""
    from taste_speech.modeling_taste import TasteForCausalLM

    with torch.device("meta"):
        model = TasteForCausalLM(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _dtype_summary(infos: dict[str, TensorInfo]) -> str:
    counts = Counter((k.split(".")[0], str(info.dtype).replace("torch.", "")) for k, info in infos.items())
    return ", ".join(f"{part} {dtype} x{n}" for (part, dtype), n in sorted(counts.items()))


def check_weights(config: TasteConfig, infos: dict[str, TensorInfo], report: CheckReport) -> bool:
    """Names/shapes of the main weights against the architecture; returns True when they fit."""
    match = match_keys({k: i.shape for k, i in infos.items()}, expected_state_shapes(config))
    report.notes.append(f"tensors: {len(infos)} stored ({_dtype_summary(infos)})")
    report.notes.append(f"key spelling: {match.spelling}")
    if match.tied_lm_head:
        report.notes.append("lm_head.weight not stored: it will be tied to embed_tokens (expected)")
    if match.merged_lora:
        report.notes.append("no LoRA adapters stored: merged weights (adapters will be zero)")
    report.problems += [f"missing tensor: {k}" for k in match.missing]
    report.problems += [f"unexpected tensor: {k}" for k in match.unexpected]
    report.problems += [f"mis-shaped tensor: {k}" for k in match.mismatched]
    return match.ok


def check_rvq_initialised(reader: CheckpointReader, report: CheckReport) -> None:
    flags = sorted(k for k in reader.infos if k.startswith("audio_tower.vq.rvq.layers.") and k.endswith(".initted"))
    for key in flags:
        if not bool((reader.get(key) == 1).all()):
            report.problems.append(f"uninitialised codebook: {key} is not 1 (training state: the original would run "
                                   "k-means on the first batch)")


def check_voice_generator(path: str, config: TasteConfig, report: CheckReport) -> None:
    """``voice_generator.pth`` against the VoiceGenerator architecture (keys, shapes, fit with the
    speech decoder), memory-mapped and unpickled with weights_only=True."""
    try:
        from taste_speech.voice_generator import VoiceGenerator
        from taste_speech.voice_generator.loading import CONFIG_NAME
        from taste_speech.voice_generator.weight_norm import to_legacy_weight_norm_keys
    except ImportError as exc:  # pragma: no cover - the package is part of taste_speech
        report.notes.append(f"voice generator not checked ({exc})")
        return
    vg_config = None
    config_path = os.path.join(os.path.dirname(path), CONFIG_NAME)
    # A file that cannot be read is not a shape mismatch: it goes to `unreadable` (exit 2).
    try:
        if os.path.isfile(config_path):
            with open(config_path) as f:
                vg_config = json.load(f)
    except ValueError as exc:
        report.unreadable.append(f"cannot read {config_path} as JSON ({exc}); download it again")
        return
    if vg_config is not None and not isinstance(vg_config, dict):
        report.unreadable.append(f"{config_path} holds a JSON {type(vg_config).__name__}, not an object of "
                                 "VoiceGenerator settings; download it again")
        return
    try:
        state = to_legacy_weight_norm_keys(load_pickled_state_dict(path, mmap=True))
    except CheckpointError as exc:  # the message names the file and says to download it again
        report.unreadable.append(str(exc))
        return
    with torch.device("meta"):
        model = VoiceGenerator(vg_config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    rel = os.path.relpath(path, report.source) if os.path.isdir(report.source) else path
    size = "tiny (" + CONFIG_NAME + ")" if vg_config is not None else "full size"
    report.notes.append(f"{rel}: {len(state)} tensors, checked against the {size} VoiceGenerator")
    report.problems += [f"missing tensor in {rel}: {k}" for k in sorted(set(expected) - set(state))]
    report.problems += [f"unexpected tensor in {rel}: {k}" for k in sorted(set(state) - set(expected))]
    report.problems += [
        f"mis-shaped tensor in {rel}: {k}: checkpoint {tuple(state[k].shape)} != model {expected[k]}"
        for k in sorted(set(state) & set(expected)) if tuple(state[k].shape) != expected[k]
    ]
    # The two halves must speak the same token and speaker spaces.
    vocab, spk = model.flow.input_embedding.num_embeddings, model.flow.spk_embed_affine_layer.in_features
    sd = config.speech_decoder_config
    if vocab < int(sd.speech_token_size):
        report.problems.append(f"{rel}: the flow knows {vocab} speech tokens but the speech decoder emits "
                               f"{sd.speech_token_size}")
    if spk != int(sd.spk_embed_dim):
        report.problems.append(f"{rel}: speaker vectors of size {spk}, but the speech decoder takes {sd.spk_embed_dim}")


def check_layout(directory: str, report: CheckReport) -> None:
    for rel, what in LAYOUT_FILES:
        path = os.path.join(directory, rel)
        if not os.path.exists(path):
            report.notes.append(f"note: {rel} is absent - {what}")
        elif not os.path.isfile(path):
            report.problems.append(f"{rel} is not a file - {what}")
    check_readable(directory, report)


def check_readable(directory: str, report: CheckReport) -> None:
    """The files the processor reads at start-up, read as it reads them (a truncated download names
    itself here, not at the first call)."""
    tokenizer = os.path.join(directory, "llama_tokenizer", "tokenizer.json")
    if os.path.isfile(tokenizer):
        try:
            with open(tokenizer, encoding="utf-8") as f:
                json.load(f)
        except (ValueError, OSError) as exc:
            report.unreadable.append(f"cannot read {tokenizer} as JSON ({exc}); download it again")
    speaker = os.path.join(directory, "cosyvoice", "speaker_embed.onnx")
    if os.path.isfile(speaker):
        try:
            import onnxruntime as ort

            ort.InferenceSession(speaker, providers=["CPUExecutionProvider"])
        except ImportError:
            report.notes.append("note: onnxruntime is not installed: cosyvoice/speaker_embed.onnx not opened")
        except Exception as exc:  # onnxruntime's own error types
            report.unreadable.append(f"cannot load {speaker} ({type(exc).__name__}: "
                                     f"{str(exc).splitlines()[0][:200]}); download it again")


def check_directory(directory: str, source: str | None = None) -> CheckReport:
    report = CheckReport(source or directory)
    try:
        config = TasteConfig.from_pretrained(directory)
    except Exception as exc:
        raise CheckpointError(f"cannot read {os.path.join(directory, 'config.json')}: {exc}") from exc
    reader = CheckpointReader(directory)
    report.notes.append("weights: " + ", ".join(os.path.relpath(p, directory) for p in reader.files))
    if check_weights(config, reader.infos, report):
        check_rvq_initialised(reader, report)
    vg = os.path.join(directory, VOICE_GENERATOR_PTH)
    if os.path.isfile(vg):
        check_voice_generator(vg, config, report)
    check_layout(directory, report)
    return report


def check_remote(repo_id: str) -> CheckReport:
    """A hub repository not in the local cache: config.json + safetensors headers only."""
    from huggingface_hub import get_safetensors_metadata, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    report = CheckReport(repo_id)
    try:
        config_dir = os.path.dirname(hf_hub_download(repo_id, "config.json"))
        metadata = get_safetensors_metadata(repo_id)
    except Exception as exc:
        raise CheckpointError(f"cannot reach {repo_id} on the hub ({type(exc).__name__}: {exc}); download it with "
                              f"hf download {repo_id} --local-dir DIR and check DIR") from exc
    try:  # a tower other than the published one keeps its Whisper config beside config.json
        hf_hub_download(repo_id, f"{JOINT_WHISPER_DIR}/config.json")
    except LocalEntryNotFoundError as exc:  # (not cached, and the hub could not be asked: no answer)
        raise CheckpointError(f"cannot reach {repo_id} on the hub for {JOINT_WHISPER_DIR}/config.json ({exc}); "
                              f"download it with hf download {repo_id} --local-dir DIR and check DIR") from exc
    except EntryNotFoundError:
        pass  # the published layout: the tower's Whisper config is built in
    except Exception as exc:
        raise CheckpointError(f"cannot fetch {JOINT_WHISPER_DIR}/config.json of {repo_id} ({type(exc).__name__}: "
                              f"{exc}); download the checkpoint with hf download {repo_id} --local-dir DIR and "
                              "check DIR") from exc
    try:
        config = TasteConfig.from_pretrained(config_dir)
    except Exception as exc:
        raise CheckpointError(f"cannot read the config.json of {repo_id} as a TASTE config ({type(exc).__name__}: "
                              f"{exc}); is it a TASTE checkpoint?") from exc
    infos = {
        name: TensorInfo(tuple(t.shape), _hub_dtype(t.dtype), file)
        for file, meta in metadata.files_metadata.items()
        for name, t in meta.tensors.items()
    }
    report.notes.append("remote check: headers only; voice_generator.pth and the RVQ flags were not read")
    check_weights(config, infos, report)
    return report


def _hub_dtype(name: str) -> torch.dtype:
    return SAFETENSORS_DTYPES.get(name, torch.float32)


def check_checkpoint(name_or_path: str) -> CheckReport:
    """Check a local directory or a hub id; raises CheckpointError when it cannot be read at all."""
    path = os.path.expanduser(name_or_path)
    if os.path.isdir(path):
        return check_directory(path)
    if os.path.exists(path):
        raise CheckpointError(f"{path} is a file; pass the checkpoint directory that holds config.json")
    if not looks_like_hub_id(name_or_path):  # same rule as from_pretrained: a mistyped path, not a hub id
        raise CheckpointError(f"no such directory: {path} (and it is not a hub id of the form owner/name); "
                              "pass the checkpoint directory that holds config.json")
    try:
        from huggingface_hub import snapshot_download

        cached = snapshot_download(name_or_path, local_files_only=True)
    except Exception:
        cached = None
    if cached is None:
        return check_remote(name_or_path)
    try:
        require_checkpoint_files(cached)
    except CheckpointError as exc:
        # e.g. only the config.json an earlier remote check fetched: ask the hub, not the partial copy
        try:
            report = check_remote(name_or_path)
        except CheckpointError as remote_exc:
            raise CheckpointError(f"the cached snapshot at {cached} is incomplete ({exc}), and {remote_exc}") from remote_exc
        report.notes.append(f"the cached snapshot at {cached} is incomplete ({exc}): checked on the hub instead")
        return report
    return check_directory(cached, source=f"{name_or_path} (cached at {cached})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m taste_speech.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="checkpoint directory or hub id (e.g. MediaTek-Research/Llama-1B-TASTE-V0)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)  # library deprecation chatter, not findings
    try:
        report = check_checkpoint(args.checkpoint)
    except CheckpointError as exc:
        print(f"checkpoint: {args.checkpoint}\nERROR: {exc}")
        return 2
    print(report.render())
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
