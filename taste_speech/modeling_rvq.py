"""Residual vector quantiser of the TASTE tokenizer (``audio_tower.vq.rvq``).

Four Euclidean codebooks applied residually in a 256-d code space (spec §3.5). The same codebooks
serve three users: the audio tower quantises pooled word features (``quantize``), the spoken LM's
TASTE head quantises a regressed latent that already lives in code space (``indices_from_code``),
and everything downstream turns codes back into TASTE embeddings (``decode``).

The module layout mirrors the published state dict: ``project_in``, ``project_out``,
``layers.{k}._codebook.{initted, cluster_size, embed_avg, embed}`` (persistent buffers; only
``embed`` is used, the rest is k-means/EMA training state) and three never-used ``mlps.{j}``.
"""

from __future__ import annotations

import torch
from torch import nn

from taste_speech.device_copies import to_device

IGNORE = -1  # "no code" marker: decodes to a zero vector at that level


class EuclideanCodebook(nn.Module):
    """One level's codebook (``embed``, shape (1, codebook_size, codebook_dim)) plus the training
    buffers the checkpoint carries."""

    def __init__(self, codebook_size: int, codebook_dim: int):
        super().__init__()
        embed = torch.randn(1, codebook_size, codebook_dim)
        # Registration order follows the published checkpoint.
        self.register_buffer("initted", torch.ones(1))
        self.register_buffer("cluster_size", torch.ones(1, codebook_size))
        self.register_buffer("embed_avg", embed.clone())
        self.register_buffer("embed", embed)

    @property
    def codes(self) -> torch.Tensor:
        """(codebook_size, codebook_dim) in fp32."""
        return self.embed[0].float()

    def nearest(self, x: torch.Tensor) -> torch.Tensor:
        """Index of the nearest code for every row of x (..., codebook_dim), computed in fp32 the
        way the original does (spec §3.5): argmax of -sqrt(clamp(|x|^2 + |e|^2 - 2 x.e, 0));
        ties go to the lowest index."""
        codes = self.codes
        x = x.float()
        dist_sq = x.pow(2).sum(-1, keepdim=True) + codes.pow(2).sum(-1) - 2 * (x @ codes.t())
        return (-dist_sq.clamp(min=0).sqrt()).argmax(dim=-1)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Load-time guard for torch's load_state_dict path (transformers' loader sets tensors
        # directly; TasteForCausalLM calls ResidualVQ.check_initialised() after loading).
        initted = state_dict.get(prefix + "initted")
        if initted is not None and initted.device.type != "meta":
            _raise_if_not_initted(prefix + "initted", initted)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter (it grows with every in-place write), or None for an inference
    tensor, which keeps none."""
    try:
        return tensor._version
    except RuntimeError:
        return None


def _raise_if_not_initted(name: str, initted: torch.Tensor) -> None:
    if not bool((initted == 1).all()):
        raise ValueError(
            f"{name} is not 1: these codebooks were never initialised (a training-time state in which "
            "the original would run k-means on the first batch). Load a trained checkpoint such as "
            "MediaTek-Research/Llama-1B-TASTE-V0."
        )


class QuantizerLevel(nn.Module):
    """``layers.{k}``: one residual level. Its own in/out projections are identities
    (dim == codebook_dim) and therefore have no weights."""

    def __init__(self, codebook_size: int, codebook_dim: int):
        super().__init__()
        self._codebook = EuclideanCodebook(codebook_size, codebook_dim)


class UnusedImplicitCodebookMLP(nn.Module):
    """``mlps.{j}``: present in the published state dict (the original always creates one per level
    after the first), never used at inference. Kept only so the checkpoint loads strictly."""

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
        self.dim = dim
        self.num_quantizers = num_quantizers
        self.codebook_size = codebook_size
        self.codebook_dim = codebook_dim
        self.project_in = nn.Linear(dim, codebook_dim)
        self.project_out = nn.Linear(codebook_dim, dim)
        self.layers = nn.ModuleList(QuantizerLevel(codebook_size, codebook_dim) for _ in range(num_quantizers))
        self.mlps = nn.ModuleList(UnusedImplicitCodebookMLP(codebook_dim) for _ in range(num_quantizers - 1))
        self._joined = None  # (the codebooks' key, their joined table, its row offsets): ``joined_codebooks``

    def codebooks(self) -> list[EuclideanCodebook]:
        return [layer._codebook for layer in self.layers]

    def check_initialised(self) -> None:
        """Raise ValueError unless every level's ``initted`` buffer is 1 (spec §9.6 check 3)."""
        for k, book in enumerate(self.codebooks()):
            _raise_if_not_initted(f"audio_tower.vq.rvq.layers.{k}._codebook.initted", book.initted)

    # -- encoding ---------------------------------------------------------------------------
    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Indices (..., K) int64 of features x (..., dim): project_in, then the residual search."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"ResidualVQ.quantize expects features of size {self.dim}, got {tuple(x.shape)}")
        z = self.project_in(x.to(self.project_in.weight.dtype))
        return self.indices_from_code(z)

    def indices_from_code(self, z: torch.Tensor) -> torch.Tensor:
        """Residual nearest-neighbour search for z (..., codebook_dim), already in code space (no
        project_in; this is what the spoken LM's TASTE head uses). Returns (..., K) int64."""
        if z.shape[-1] != self.codebook_dim:
            raise ValueError(
                f"ResidualVQ.indices_from_code expects codes of size {self.codebook_dim}, got {tuple(z.shape)}"
            )
        residual = z.float()
        indices = []
        for book in self.codebooks():
            idx = book.nearest(residual)
            residual = residual - book.codes[idx]
            indices.append(idx)
        return torch.stack(indices, dim=-1)

    # -- decoding ---------------------------------------------------------------------------
    def codes_from_indices(self, indices: torch.Tensor, check: bool = True) -> torch.Tensor:
        """The chosen code vectors per level, (K, ..., codebook_dim) fp32; index -1 gives zeros.
        ``check=False`` skips the range check, which reads the indices back (on CUDA a wait for the
        GPU): for indices this RVQ's own search just made."""
        if check:
            self.check_indices(indices)
        return self._gathered_codes(indices).movedim(-2, 0)

    def decode(self, indices: torch.Tensor, check: bool = True) -> torch.Tensor:
        """TASTE embedding of indices (..., K): project_out of the summed codes, (..., dim), in the
        dtype of project_out. ``check``: see ``codes_from_indices``. Host indices (a turn's or a
        word's codes) are checked on the host and copied in without waiting for the GPU."""
        if check:
            self.check_indices(indices)
        summed = self._gathered_codes(indices).sum(dim=-2)
        return self.project_out(summed.to(self.project_out.weight.dtype))

    def _gathered_codes(self, indices: torch.Tensor) -> torch.Tensor:
        """(..., K, codebook_dim) fp32: each level's code, zeros for IGNORE - one gather from the
        levels' joined table. (A word is decoded after every step of a reply, by the spoken LM and
        the speech decoder: level by level it was some 35 operators, each a kernel launch on a GPU;
        joined, the rows are worked out where the indices are - on the host for a turn's codes -
        and the device runs a copy, a gather and a sum.)"""
        table, offsets = self.joined_codebooks()
        if table.is_cuda:  # read on this thread's stream: not reused before that, should the table be made again
            stream = torch.cuda.current_stream(table.device)
            table.record_stream(stream)
            offsets.record_stream(stream)
        if offsets.device != indices.device:  # host indices: their rows are worked out on the host
            offsets = torch.arange(self.num_quantizers, device=indices.device) * (self.codebook_size + 1)
        rows = indices.long().remainder(self.codebook_size + 1) + offsets  # IGNORE (-1): the level's zero row
        return nn.functional.embedding(to_device(rows, table.device), table)

    def joined_codebooks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every level's codes in one (K * (codebook_size + 1), codebook_dim) fp32 table, each level
        followed by a zero row (IGNORE's), and each level's first row (K,). Kept until a codebook is
        moved, cast, replaced or written in place (its version; an inference tensor keeps none),
        then made again - by an eager caller: a captured step would go on reading the table it was
        captured with. Threads that make it at the same moment each make one; either serves."""
        books = self.codebooks()
        key = tuple((book.embed.data_ptr(), book.embed.device, book.embed.dtype, _version(book.embed))
                    for book in books)
        kept = self._joined
        if kept is None or kept[0] != key:
            with torch.no_grad():
                table = torch.cat([torch.cat([book.codes, book.codes.new_zeros(1, self.codebook_dim)])
                                   for book in books])
            offsets = torch.arange(self.num_quantizers, device=table.device) * (self.codebook_size + 1)
            if table.is_cuda:  # other threads' streams read it next: written first (once per set of weights)
                torch.cuda.current_stream(table.device).synchronize()
            kept = self._joined = (key, table, offsets)  # (one assignment: another thread sees them together)
        return kept[1], kept[2]

    def check_indices(self, indices: torch.Tensor) -> None:
        """Raise on indices that are not (..., K) integers in [0, codebook_size) or IGNORE. Host
        indices are read as a list (no tensor reduction, nothing waits for a GPU); device ones
        through their least and largest value (one read)."""
        if indices.is_floating_point() or indices.dim() == 0:
            raise ValueError(
                f"RVQ indices must be an integer tensor (..., {self.num_quantizers}), got "
                f"{indices.dtype} {tuple(indices.shape)}"
            )
        if indices.shape[-1] != self.num_quantizers:
            raise ValueError(
                f"RVQ indices have {indices.shape[-1]} codes each (shape {tuple(indices.shape)}), but this RVQ has "
                f"{self.num_quantizers} levels: give (..., {self.num_quantizers}) codes, as this checkpoint's "
                "taste_tokenize makes them"
            )
        if not indices.numel():
            return
        if indices.device.type == "cpu":
            values = indices.reshape(-1).tolist()
            low, high = min(values), max(values)
        else:
            low, high = torch.stack([indices.min(), indices.max()]).tolist()
        if low < IGNORE or high >= self.codebook_size:
            raise ValueError(
                f"RVQ indices must lie in [0, {self.codebook_size}) or be {IGNORE} (no code); got values in "
                f"[{low}, {high}]"
            )
