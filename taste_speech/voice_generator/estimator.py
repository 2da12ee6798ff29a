"""The flow-matching vector-field estimator: a 1-D U-Net with transformer blocks (spec §7.1).

Module and attribute names follow the published state dict
(``flow.decoder.estimator.{time_mlp,down_blocks,mid_blocks,up_blocks,final_block,final_proj}``),
including the nesting ``down_blocks.<i>.{0: resnet, 1: transformer blocks, 2: down/up-sampler}``.

Input channels are ``[x, mu, spks broadcast over time, cond]`` (80 each at full size). The U-Net
has two levels: level 0 at T frames, then a stride-2 convolution to ceil(T/2) frames for level 1,
the mid blocks and the first up block; a transposed convolution returns to 2*ceil(T/2) frames,
cut to T before the skip concatenation.

The original passes a float 0/1 "mask" (mask^T mask) to diffusers' attention, which *adds* it to
the logits instead of masking (spec §11 item 24). At B = 1 without padding that is a constant +1
on every logit, a no-op for softmax, so we attend over all frames and do not build it.

Padded windows (``padded=True``, used by the fixed-shape streaming buckets): the frames where
``mask`` is 0 are padding after the sequence end. Convolutions already see them as zeros (every
conv input is multiplied by the mask, as at a real sequence end); in addition GroupNorm takes its
statistics over the valid frames only and attention ignores padded keys, so the valid frames are
computed as in an unpadded run (equal up to float rounding). The default (``padded=False``) is the
published computation, unchanged.

``mask=None`` says every frame is valid (a window without padding, as streaming gives at B = 1):
the multiplications by an all-ones mask are left out - the same numbers, bit for bit, and about 75
kernels fewer per estimator call, which is what a batch-1 ODE step costs on a GPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class SinusoidalTimeEmbedding(nn.Module):
    """sin/cos features of ``scale * t`` over ``dim`` channels (half sines, half cosines)."""

    def __init__(self, dim: int, scale: float = 1000.0):
        super().__init__()
        if dim % 2:
            raise ValueError(f"the time embedding needs an even width, got {dim}")
        self.dim, self.scale = dim, scale

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        t = t.reshape(-1).float()
        half = self.dim // 2
        freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
        angles = (self.scale * t).unsqueeze(1) * freqs.unsqueeze(0)
        return torch.cat([angles.sin(), angles.cos()], dim=-1)


class TimestepMLP(nn.Module):
    def __init__(self, in_channels: int, time_embed_dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, time_embed_dim)
        self.linear_2 = nn.Linear(time_embed_dim, time_embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


def _masked(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """x * mask, or x itself where every frame is valid (mask None)."""
    return x if mask is None else x * mask


def masked_group_norm(x: torch.Tensor, norm: nn.GroupNorm, mask: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` with the statistics of each group taken over the frames where mask (B, 1, T) is 1.

    Frames where it is 0 get normalised too (with the valid frames' statistics) but do not count.
    """
    b, c, t = x.shape
    groups = x.view(b, norm.num_groups, c // norm.num_groups, t)
    m = mask.view(b, 1, 1, t).to(x.dtype)
    count = m.sum(dim=(2, 3), keepdim=True) * (c // norm.num_groups)
    mean = (groups * m).sum(dim=(2, 3), keepdim=True) / count
    centered = groups - mean  # (once: every kernel counts at batch 1)
    var = (centered * m).pow(2).sum(dim=(2, 3), keepdim=True) / count
    y = (centered * torch.rsqrt(var + norm.eps)).view(b, c, t)
    if norm.affine:
        y = y * norm.weight.view(1, -1, 1) + norm.bias.view(1, -1, 1)
    return y


class Block1D(nn.Module):
    """Conv1d k3 -> GroupNorm(8) -> Mish, masked before and after."""

    def __init__(self, dim: int, dim_out: int, groups: int = 8):
        super().__init__()
        self.block = nn.Sequential(nn.Conv1d(dim, dim_out, 3, padding=1), nn.GroupNorm(groups, dim_out), nn.Mish())

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, padded: bool = False) -> torch.Tensor:
        if not padded:
            return _masked(self.block(_masked(x, mask)), mask)
        conv, norm, act = self.block
        return act(masked_group_norm(conv(x * mask), norm, mask)) * mask


class ResnetBlock1D(nn.Module):
    def __init__(self, dim: int, dim_out: int, time_emb_dim: int, groups: int = 8):
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_emb_dim, dim_out))
        self.block1 = Block1D(dim, dim_out, groups)
        self.block2 = Block1D(dim_out, dim_out, groups)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, time_shift: torch.Tensor,
                padded: bool = False) -> torch.Tensor:
        """``time_shift``: this block's ``mlp`` of the time embedding, (B or 1, dim_out)."""
        h = self.block1(x, mask, padded)
        h = h + time_shift.unsqueeze(-1)
        h = self.block2(h, mask, padded)
        return h + self.res_conv(_masked(x, mask))


class SelfAttention(nn.Module):
    """Multi-head self-attention with bias-free q/k/v and a biased output projection.

    The q, k and v projections are one (3 x inner, dim) matrix, ``to_qkv``: one matrix product
    instead of three, since at batch 1 the flow's ODE costs its kernels, not its arithmetic. The
    state dict holds the published three (``to_q.weight``, ``to_k.weight``, ``to_v.weight``)."""

    PROJECTIONS = ("to_q", "to_k", "to_v")

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        inner = heads * head_dim
        self.heads, self.head_dim = heads, head_dim
        # initialised as three nn.Linear(dim, inner) in a row would be (the same fan-in and draws)
        self.to_qkv = nn.Parameter(torch.empty(3 * inner, dim))
        nn.init.kaiming_uniform_(self.to_qkv, a=math.sqrt(5))
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Dropout(0.0)])

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, dim); key_mask (B, 1, 1, T) bool: the keys each query may see (None: all)."""
        b, t, _ = x.shape
        # (B, T, 3 inner) -> three (B, heads, T, head_dim) views
        q, k, v = F.linear(x, self.to_qkv).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        out = out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        return self.to_out[0](out)

    # the published layout: three weights in the state dict, one matrix here
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        fused = destination.pop(prefix + "to_qkv")
        for name, part in zip(self.PROJECTIONS, fused.chunk(3)):
            destination[f"{prefix}{name}.weight"] = part if keep_vars else part.clone()  # no shared storage

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        keys = [f"{prefix}{name}.weight" for name in self.PROJECTIONS]
        present = [k for k in keys if k in state_dict]
        if len(present) == len(keys):
            state_dict[prefix + "to_qkv"] = torch.cat([state_dict.pop(k) for k in keys])
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if prefix + "to_qkv" in missing_keys:  # name what the checkpoint lacks in its own terms
            missing_keys.remove(prefix + "to_qkv")
            missing_keys.extend(k for k in keys if k not in present)  # (those present are unexpected)


class GELUProjection(nn.Module):
    """Linear followed by exact GELU (the first layer of the feed-forward)."""

    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x))


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int = 4, dropout: float = 0.0):
        super().__init__()
        self.net = nn.ModuleList([GELUProjection(dim, dim * mult), nn.Dropout(dropout), nn.Linear(dim * mult, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.net:
            x = layer(x)
        return x


class TransformerBlock(nn.Module):
    """Pre-norm self-attention + feed-forward (``norm1``/``attn1``, ``norm3``/``ff``: the names of the
    diffusers-style block, whose unused cross-attention would have been ``norm2``/``attn2``)."""

    def __init__(self, dim: int, heads: int, head_dim: int, dropout: float = 0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = SelfAttention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim, dropout=dropout)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn1(self.norm1(x), key_mask)
        return x + self.ff(self.norm3(x))


class Downsample1D(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, 3, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class Upsample1D(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(dim, dim, 4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def _transformer_stack(dim: int, n_blocks: int, heads: int, head_dim: int, dropout: float) -> nn.ModuleList:
    return nn.ModuleList(TransformerBlock(dim, heads, head_dim, dropout) for _ in range(n_blocks))


def _run_transformers(blocks: nn.ModuleList, x: torch.Tensor, mask: torch.Tensor | None, padded: bool) -> torch.Tensor:
    key_mask = mask.bool().unsqueeze(1) if padded else None  # (B, 1, T) -> (B, 1, 1, T)
    x = x.transpose(1, 2)  # (B, C, T) -> (B, T, C)
    for block in blocks:
        x = block(x, key_mask)
    return x.transpose(1, 2)


class ConditionalDecoder(nn.Module):
    def __init__(
        self,
        in_channels: int = 320,
        out_channels: int = 80,
        channels: tuple[int, ...] = (256, 256),
        dropout: float = 0.0,
        attention_head_dim: int = 64,
        n_blocks: int = 4,
        num_mid_blocks: int = 12,
        num_heads: int = 8,
        act_fn: str = "gelu",
    ):
        super().__init__()
        if act_fn != "gelu":
            raise ValueError(f"estimator act_fn {act_fn!r} is not supported (the published model uses 'gelu')")
        channels = tuple(channels)
        self.in_channels, self.out_channels = in_channels, out_channels
        time_dim = channels[0] * 4
        self.time_embeddings = SinusoidalTimeEmbedding(in_channels)
        self.time_mlp = TimestepMLP(in_channels, time_dim)

        def stack(dim: int) -> nn.ModuleList:
            return _transformer_stack(dim, n_blocks, num_heads, attention_head_dim, dropout)

        self.down_blocks = nn.ModuleList()
        width = in_channels
        for i, out in enumerate(channels):
            is_last = i == len(channels) - 1
            sampler = nn.Conv1d(out, out, 3, padding=1) if is_last else Downsample1D(out)
            self.down_blocks.append(nn.ModuleList([ResnetBlock1D(width, out, time_dim), stack(out), sampler]))
            width = out

        self.mid_blocks = nn.ModuleList(
            nn.ModuleList([ResnetBlock1D(width, width, time_dim), stack(width)]) for _ in range(num_mid_blocks)
        )

        up_channels = channels[::-1] + (channels[0],)
        self.up_blocks = nn.ModuleList()
        for i in range(len(up_channels) - 1):
            out = up_channels[i + 1]
            is_last = i == len(up_channels) - 2
            sampler = nn.Conv1d(out, out, 3, padding=1) if is_last else Upsample1D(out)
            self.up_blocks.append(
                nn.ModuleList([ResnetBlock1D(up_channels[i] * 2, out, time_dim), stack(out), sampler])
            )
        self.final_block = Block1D(up_channels[-1], up_channels[-1])
        self.final_proj = nn.Conv1d(up_channels[-1], out_channels, 1)

    def resnets(self) -> list[ResnetBlock1D]:
        """The resnet blocks in the order ``forward`` runs them."""
        return [blocks[0] for level in (self.down_blocks, self.mid_blocks, self.up_blocks) for blocks in level]

    def time_shifts(self, t: torch.Tensor) -> list[torch.Tensor]:
        """What each resnet block adds for times ``t`` (scalar or (N,)): its ``mlp`` of the time
        embedding, (N, dim_out) per block, in ``resnets()`` order. It depends on t alone, so the flow
        computes those of all its Euler steps in one batched pass (N = steps) instead of some forty
        small kernels per estimator call."""
        # (the sin/cos features in float32, then the MLP's dtype: a half-precision copy takes them too)
        temb = self.time_mlp(self.time_embeddings(t).to(self.time_mlp.linear_1.weight.dtype))
        return [block.mlp(temb) for block in self.resnets()]

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        mu: torch.Tensor,
        t: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        padded: bool = False,
        time_shifts: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x, mu, cond: (B, 80, T); mask: (B, 1, T), or None (every frame valid); t: scalar or (B,);
        spks: (B, 80) -> (B, 80, T).

        ``padded``: frames where mask is 0 are padding (see the module docstring). ``time_shifts``:
        ``self.time_shifts(t)`` made beforehand (rows 1 or B), or None to make them here."""
        if padded and mask is None:
            raise ValueError("padded=True needs the mask of the valid frames; mask=None means there is no padding")
        shifts = iter(self.time_shifts(t) if time_shifts is None else time_shifts)
        h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.shape[-1]), cond], dim=1)

        skips, masks = [], [mask]
        for resnet, transformers, sampler in self.down_blocks:
            level_mask = masks[-1]
            h = _run_transformers(transformers, resnet(h, level_mask, next(shifts), padded), level_mask, padded)
            skips.append(h)
            h = sampler(_masked(h, level_mask))
            masks.append(None if level_mask is None else level_mask[:, :, ::2])  # stride-2 conv (k3, p1): ceil(T/2) frames

        mid_mask = masks[-2]  # the last down block keeps its resolution
        for resnet, transformers in self.mid_blocks:
            h = _run_transformers(transformers, resnet(h, mid_mask, next(shifts), padded), mid_mask, padded)

        up_masks = masks[:-1]
        for resnet, transformers, sampler in self.up_blocks:
            level_mask, skip = up_masks.pop(), skips.pop()
            # the transposed conv yields 2*ceil(T/2) frames: cut to the skip's length (odd T)
            h = torch.cat([h[:, :, : skip.shape[-1]], skip], dim=1)
            h = _run_transformers(transformers, resnet(h, level_mask, next(shifts), padded), level_mask, padded)
            h = sampler(_masked(h, level_mask))
        h = self.final_block(h, level_mask, padded)
        return _masked(self.final_proj(_masked(h, level_mask)), mask)
