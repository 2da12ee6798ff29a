"""Parity checks against golden directories made from the original TASTE implementation.

A golden directory holds a small random checkpoint in the published layout plus
``io.safetensors`` with inputs and outputs at several parity points. Each part of the model owns
one module here (``points_<part>.py``) with ``run(golden, model) -> list[PointResult]``; the
runner (``python -m taste_speech.verify DIR``) loads the checkpoint once, runs every part that
applies to the directory, prints one line per point and fails on any mismatch.

Exit codes: 0 = every point matches, 1 = a parity mismatch, 2 = a directory is not a golden
reference directory (no ``io.safetensors``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

# Default tolerances (see the golden READMEs): float32 rounding differences of a correct
# re-implementation are ~3.5e-5.
FLOAT_TOL = 1e-4


@dataclass
class PointResult:
    name: str
    max_abs_diff: float  # 0.0 for exact (integer / boolean) comparisons that match
    tolerance: float  # 0.0 means exact equality was required
    ok: bool
    note: str = ""

    def line(self) -> str:
        kind = "exact" if self.tolerance == 0 else f"tol {self.tolerance:.0e}"
        status = "ok  " if self.ok else "FAIL"
        note = f"  ({self.note})" if self.note else ""
        return f"{status} {self.name:<55} max_abs_diff {self.max_abs_diff:.3e}  [{kind}]{note}"


class NotGoldenDirError(FileNotFoundError):
    """The directory given is not a golden reference directory (e.g. a plain checkpoint)."""


def require_golden_dir(directory: str) -> None:
    if not os.path.isfile(os.path.join(directory, "io.safetensors")):
        raise NotGoldenDirError(
            f"{directory} is not a golden reference directory (no io.safetensors); pass one of the "
            "project's golden folders: tests/data/taste_lm_tiny_a, tests/data/voice_generator_tiny_a (the project's "
            "reference set, where you have it, holds more). To check an ordinary checkpoint use python -m taste_speech.check DIR")


class Golden:
    """The tensors (``io.safetensors``) and metadata of one golden directory."""

    def __init__(self, directory: str):
        require_golden_dir(directory)
        self.dir = directory
        self.tensors: dict[str, torch.Tensor] = load_file(os.path.join(directory, "io.safetensors"))
        meta_path = os.path.join(directory, "io_meta.json")
        self.meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    @property
    def kind(self) -> str:
        """``taste_lm`` (TasteForCausalLM checkpoint, config.json of model_type 'taste') or
        ``voice_generator`` (flow + HiFT: its config.json describes the flow)."""
        try:
            with open(os.path.join(self.dir, "config.json")) as f:
                config = json.load(f)
        except (OSError, ValueError):
            config = {}
        if isinstance(config, dict) and "flow" in config:
            return "voice_generator"
        if isinstance(config, dict) and config.get("model_type") == "taste":
            return "taste_lm"
        return "voice_generator" if os.path.exists(os.path.join(self.dir, "weights.safetensors")) else "taste_lm"


def compare(name: str, actual, expected: torch.Tensor, tol: float = FLOAT_TOL) -> PointResult:
    """Floating tensors: max |actual - expected| <= tol. Integer/boolean: exact equality."""
    actual = torch.as_tensor(actual).detach().cpu()
    expected = expected.detach().cpu()
    if tuple(actual.shape) != tuple(expected.shape):
        return PointResult(name, float("inf"), tol, False,
                           f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if expected.is_floating_point():
        diff = (actual.double() - expected.double()).abs()
        mad = float(diff.max()) if diff.numel() else 0.0
        return PointResult(name, mad, tol, mad <= tol)
    equal = torch.equal(actual.to(expected.dtype), expected)
    mad = 0.0 if equal else float((actual.long() - expected.long()).abs().max())
    return PointResult(name, mad, 0.0, equal)
