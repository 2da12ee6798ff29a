"""Safe reading of voice-generator weight files and strict, explained state-dict checks."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch
from torch import nn

from taste_speech.voice_generator.weight_norm import to_legacy_weight_norm_keys

PUBLISHED_WEIGHTS = os.path.join("cosyvoice", "voice_generator.pth")
CONFIG_NAME = "voice_generator_config.json"  # ours: written next to tiny weights; absent = full size


def resolve_weights_path(path: str | os.PathLike) -> Path:
    """A weights file, or a checkpoint folder holding ``cosyvoice/voice_generator.pth``
    (or ``voice_generator.pth`` directly)."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"pass the checkpoint folder (or the voice generator's weight file), got {path!r}")
    path = Path(path)
    if path.is_dir():
        for candidate in (path / PUBLISHED_WEIGHTS, path / "voice_generator.pth"):
            if candidate.is_file():
                return candidate
        raise ValueError(
            f"{path} holds no voice generator weights: expected {PUBLISHED_WEIGHTS} (the published layout) "
            "or voice_generator.pth; pass the weight file itself if it is named differently"
        )
    if not path.is_file():
        raise ValueError(f"voice generator weights {path} do not exist: pass a local checkpoint folder holding "
                         f"{PUBLISHED_WEIGHTS} (for a hub id, the folder TasteForCausalLM.from_pretrained found: "
                         "model.loading_info.directory)")
    return path


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a flat ``{name: tensor}`` dict without executing code from the file.

    ``.safetensors`` files are read with safetensors; anything else with
    ``torch.load(weights_only=True)``, which refuses pickled objects other than tensors and
    containers. The result must be a flat dict of str -> Tensor.
    """
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            state = load_file(str(path))
        except Exception as exc:  # safetensors raises its own error types
            raise ValueError(f"could not read {path} as safetensors ({exc}); the file is corrupt or truncated") from exc
    else:
        try:
            state = torch.load(str(path), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise ValueError(
                f"{path} contains objects other than tensors and refuses to load safely (weights_only=True): "
                f"{str(exc).splitlines()[0]}. Re-save it as a plain state dict: torch.save(model.state_dict(), path)"
            ) from exc
        except (RuntimeError, EOFError, OSError) as exc:
            raise ValueError(
                f"could not read {path} as a torch checkpoint ({str(exc).splitlines()[0]}); "
                "the file is truncated or not a torch.save archive — download it again"
            ) from exc
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict (a dict of name -> tensor)")
    bad = [k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        shown = ", ".join(f"{k!r} ({type(state[k]).__name__})" for k in bad[:5])
        hint = ""
        if any(isinstance(state[k], dict) for k in bad):
            hint = " (a nested dict: pass the inner state dict, e.g. checkpoint['state_dict'], re-saved on its own)"
        raise ValueError(f"{path} is not a flat name -> tensor state dict: {len(bad)} entries are not tensors: {shown}{hint}")
    return to_legacy_weight_norm_keys(state)


def check_state_dict(model: nn.Module, state: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Raise ValueError naming every missing, unexpected and wrongly shaped tensor."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong_shape = sorted(
        f"{k}: {tuple(state[k].shape)} in {source}, model expects {tuple(expected[k].shape)}"
        for k in set(expected) & set(state)
        if tuple(state[k].shape) != tuple(expected[k].shape)
    )
    not_float = sorted(k for k in set(expected) & set(state) if not state[k].is_floating_point())
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing: " + ", ".join(missing[:10]) + (" ..." if len(missing) > 10 else ""))
    if unexpected:
        problems.append(
            f"{len(unexpected)} unexpected: " + ", ".join(unexpected[:10]) + (" ..." if len(unexpected) > 10 else "")
        )
    if wrong_shape:
        problems.append(f"{len(wrong_shape)} wrong shape: " + "; ".join(wrong_shape[:10]))
    if not_float:
        problems.append(f"{len(not_float)} not floating point: " + ", ".join(not_float[:10]))
    if problems:
        raise ValueError(
            f"{source} does not match this VoiceGenerator ({'; '.join(problems)}). Is it a voice_generator.pth "
            f"of the configuration in use (a tiny checkpoint needs its {CONFIG_NAME})?"
        )
