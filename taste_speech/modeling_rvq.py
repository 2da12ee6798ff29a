"""Residual vector quantiser of the TASTE tokenizer (``audio_tower.vq.rvq``).

Four Euclidean codebooks applied residually in a 256-d code space (spec §3.5). The same codebooks
serve three users: the audio tower quantises pooled word features (``quantize``), the spoken LM's
TASTE head quantises a regressed latent that already lives in code space (``indices_from_code``),
and everything downstream turns codes back into TASTE embeddings (``decode``).
"""

from __future__ import annotations

import torch
from torch import nn


class Codebook(nn.Module):
    """One level: the codebook plus the k-means/EMA training buffers the checkpoint carries."""

    def __init__(self, codebook_size: int, codebook_dim: int):
        super().__init__()
        self.register_buffer("initted", torch.ones(1))
        self.register_buffer("cluster_size", torch.ones(1, codebook_size))
        self.register_buffer("embed", torch.zeros(1, codebook_size, codebook_dim))
        self.register_buffer("embed_avg", torch.zeros(1, codebook_size, codebook_dim))

    def nearest(self, x: torch.Tensor) -> torch.Tensor:
        """Index of the nearest code for each row of x (..., d); ties go to the lowest index."""
        codes = self.embed[0].float()
        x = x.float()
        dist2 = x.pow(2).sum(-1, keepdim=True) + codes.pow(2).sum(-1) - 2 * x @ codes.t()
        return (-dist2.clamp(min=0).sqrt()).argmax(dim=-1)


class _UnusedImplicitCodebookMLP(nn.Module):
    """Present in the published state dict (the original always creates three), never used."""

    def __init__(self, codebook_dim: int, depth: int = 4):
        super().__init__()
        self.proj_in = nn.Linear(2 * codebook_dim, codebook_dim)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(codebook_dim, codebook_dim), nn.SiLU(), nn.Linear(codebook_dim, codebook_dim))
            for _ in range(depth)
        )


class ResidualVQ(nn.Module):
    def __init__(self, dim: int, num_quantizers: int, codebook_size: int, codebook_dim: int):
        super().__init__()
        self.dim, self.num_quantizers = dim, num_quantizers
        self.codebook_size, self.codebook_dim = codebook_size, codebook_dim
        self.project_in = nn.Linear(dim, codebook_dim)
        self.project_out = nn.Linear(codebook_dim, dim)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"_codebook": Codebook(codebook_size, codebook_dim)}) for _ in range(num_quantizers)
        )
        self.mlps = nn.ModuleList(_UnusedImplicitCodebookMLP(codebook_dim) for _ in range(num_quantizers - 1))

    def codebooks(self) -> list[torch.Tensor]:
        return [layer["_codebook"].embed[0] for layer in self.layers]

    def check_initialised(self) -> None:
        """A codebook with initted == 0 would make the original run k-means on the first batch;
        a loaded checkpoint must never be in that state."""
        for k, layer in enumerate(self.layers):
            if float(layer["_codebook"].initted.reshape(-1)[0]) != 1.0:
                raise ValueError(
                    f"audio_tower.vq.rvq.layers.{k}._codebook.initted is not 1: this checkpoint's codebooks "
                    "were never initialised (a training-time state). Load a trained/published checkpoint."
                )

    def indices_from_code(self, z: torch.Tensor) -> torch.Tensor:
        """Residual nearest-neighbour search for z (..., codebook_dim) already in code space."""
        residual = z.float()
        indices = []
        for layer in self.layers:
            book = layer["_codebook"]
            idx = book.nearest(residual)
            residual = residual - book.embed[0].float()[idx]
            indices.append(idx)
        return torch.stack(indices, dim=-1)

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Indices (..., K) of features x (..., dim): project_in, then the residual search."""
        return self.indices_from_code(self.project_in(x.to(self.project_in.weight.dtype)).float())

    def codes_from_indices(self, indices: torch.Tensor) -> torch.Tensor:
        """Chosen code vectors per level, (K, ..., codebook_dim); index -1 gives a zero vector."""
        out = []
        for k, book in enumerate(self.codebooks()):
            idx = indices[..., k]
            valid = idx >= 0
            vec = book.float()[idx.clamp(min=0)] * valid.unsqueeze(-1)
            out.append(vec)
        return torch.stack(out, dim=0)

    def decode(self, indices: torch.Tensor) -> torch.Tensor:
        """TASTE embedding of indices (..., K): project_out of the summed codes, (..., dim)."""
        summed = self.codes_from_indices(indices).sum(dim=0)
        return self.project_out(summed.to(self.project_out.weight.dtype))
