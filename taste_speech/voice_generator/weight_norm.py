"""Weight-normalised convolutions stored in the legacy ``weight_g`` / ``weight_v`` layout.

The published ``voice_generator.pth`` was saved from modules wrapped with the legacy
``torch.nn.utils.weight_norm`` (dim 0): each such module stores ``<name>.weight_g`` (the norm,
shape ``(dim0, 1, 1)``) and ``<name>.weight_v`` (the direction), and the effective weight is
``g * v / ||v||`` with the norm over every axis except axis 0. For ``ConvTranspose1d`` axis 0 is
the *input*-channel axis, so ``weight_g`` is ``(in, 1, 1)`` there.

We keep those parameter names natively (no load-time remapping), so ``state_dict()`` is the
published layout. Checkpoints written with the newer parametrisation API
(``<name>.parametrizations.weight.original0/1``) are accepted by :func:`to_legacy_weight_norm_keys`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_PARAMETRIZED_G = ".parametrizations.weight.original0"
_PARAMETRIZED_V = ".parametrizations.weight.original1"


class _LegacyWeightNorm:
    """Mixin: replace the module's ``weight`` parameter by ``weight_g`` and ``weight_v``."""

    def _split_weight(self) -> None:
        weight = self.weight.detach()
        del self._parameters["weight"]
        # norm_except_dim(v, 2, 0): one norm per slice along axis 0, shaped (dim0, 1, 1).
        self.weight_g = nn.Parameter(torch.norm_except_dim(weight, 2, 0))
        self.weight_v = nn.Parameter(weight.clone())

    def effective_weight(self) -> torch.Tensor:
        # torch._weight_norm is the kernel both weight-norm APIs use, so results match them bit for bit.
        return torch._weight_norm(self.weight_v, self.weight_g, 0)


class WNConv1d(_LegacyWeightNorm, nn.Conv1d):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._split_weight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.effective_weight(), self.bias)


class WNConvTranspose1d(_LegacyWeightNorm, nn.ConvTranspose1d):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._split_weight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv_transpose1d(
            x, self.effective_weight(), self.bias, self.stride, self.padding, self.output_padding,
            self.groups, self.dilation,
        )


def to_legacy_weight_norm_keys(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename ``X.parametrizations.weight.original0/1`` to ``X.weight_g`` / ``X.weight_v``."""
    renamed = {}
    for key, value in state_dict.items():
        if key.endswith(_PARAMETRIZED_G):
            key = key[: -len(_PARAMETRIZED_G)] + ".weight_g"
        elif key.endswith(_PARAMETRIZED_V):
            key = key[: -len(_PARAMETRIZED_V)] + ".weight_v"
        renamed[key] = value
    return renamed


def weight_normed_module_names(model: nn.Module) -> list[str]:
    """Qualified names of every legacy weight-normalised module (the manifest's ``weight_norm`` list)."""
    return sorted(name for name, m in model.named_modules() if isinstance(m, _LegacyWeightNorm))
