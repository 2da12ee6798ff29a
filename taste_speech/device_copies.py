"""Copies between the host and a device, and when they wait for the GPU.

A copy from ordinary (pageable) host memory to a CUDA device waits until the stream has run every
kernel queued before it; with several calls sharing a GPU that is everyone's queued work. Small
host tensors (token ids, codes, a speaker vector) go through pinned memory instead and are copied
asynchronously, in stream order. The other way, reading values back is a wait by nature: what a
step chose is read in one copy (``read_back``), not value by value.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """A small host tensor on ``device`` without waiting for the kernels queued there (pinned, copied
    asynchronously on CUDA); as ``host.to(device)`` elsewhere, and as it is for ``None``."""
    if device is None:
        return host
    device = torch.device(device)
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return _pinned(host).to(device, non_blocking=True)


def copy_in(buffer: torch.Tensor, values) -> torch.Tensor:
    """``buffer.copy_(values)`` for small host values (a tensor, or a list made into one of the
    buffer's dtype) without waiting for the GPU: pinned, copied asynchronously in stream order."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=buffer.dtype)
    if buffer.device.type == "cuda" and host.device.type == "cpu":
        return buffer.copy_(_pinned(host), non_blocking=True)
    return buffer.copy_(host)


def _pinned(host: torch.Tensor) -> torch.Tensor:
    """A dense pinned copy: from a strided one (a slice) the copy would be staged through a pageable
    buffer again. (Torch's pinned-memory cache keeps it until the copy from it has run.)"""
    return torch.empty(host.shape, dtype=host.dtype, pin_memory=True).copy_(host)


def read_back(values: torch.Tensor) -> list:
    """A small tensor's values as a (nested) list, in one copy to the host: on a GPU the one wait.
    (A copy on a CPU too, so that counting the operators that read back sees it.)"""
    return values.to("cpu", copy=True).tolist()
