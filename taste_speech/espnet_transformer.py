"""ESPnet/WeNet-style transformer encoder with relative-position self-attention.

Shared by the speech decoder (its text and audio encoders, and its causal AR decoder) and by the
flow encoder of the voice generator. Pre-LayerNorm blocks of rel-pos self-attention (Transformer-XL
u/v biases, "rel_pos_espnet") and a position-wise feed-forward net; no convolution module.

Public API::

    RelPositionTransformer(input_size, output_size, attention_heads, linear_units, num_blocks,
                           input_layer='linear' | 'linear_legacy', ffn_activation='silu' | 'relu',
                           norm_names=('norm_mha', 'norm_ff') | ('norm1', 'norm2'), causal=False)
    .forward(x (B,T,in), mask (B,T) bool or None) -> (B,T,out)
    .new_cache() -> KVCache;  .forward_incremental(x (1,t,in), cache) -> (1,t,out)

Submodule names equal the published ones: ``embed.out.{0,1}``, ``encoders.{i}.self_attn.
{linear_q,linear_k,linear_v,linear_out,linear_pos,pos_bias_u,pos_bias_v}``,
``encoders.{i}.feed_forward.{w_1,w_2}``, ``encoders.{i}.<norm names>``, ``after_norm``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

MAX_RELATIVE_POSITIONS = 5000  # the original's table covers relative distances up to ±4999


def relative_position_table(size: int, d_model: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """(1, 2*size-1, d) sinusoidal encodings of relative distances size-1, …, 0, …, -(size-1)."""
    if size > MAX_RELATIVE_POSITIONS:
        raise ValueError(
            f"sequence of {size} positions exceeds the relative-position table ({MAX_RELATIVE_POSITIONS})"
        )
    div_term = torch.exp(
        torch.arange(0, d_model, 2, dtype=torch.float32, device=device) * -(math.log(10000.0) / d_model)
    )
    distances = torch.arange(size - 1, -size, -1, dtype=torch.float32, device=device).unsqueeze(1)
    table = torch.zeros(2 * size - 1, d_model, device=device)
    table[:, 0::2] = torch.sin(distances * div_term)
    table[:, 1::2] = torch.cos(distances * div_term)
    return table.unsqueeze(0).to(dtype)


def rel_shift(scores: torch.Tensor) -> torch.Tensor:
    """(B,H,Tq,2Tk-1) scores over distances -> (B,H,Tq,Tk) with distance (i - j) at (i, j),
    for queries that are the last Tq of Tk positions."""
    b, h, tq, width = scores.shape
    tk = (width + 1) // 2
    # query i (absolute position tk - tq + i) and key j have distance tk - tq + i - j, found at
    # column (tk - 1) - distance of the table.
    i = torch.arange(tq, device=scores.device).unsqueeze(1)
    j = torch.arange(tk, device=scores.device).unsqueeze(0)
    columns = (tk - 1) - (tk - tq + i - j)
    return scores.gather(-1, columns.expand(b, h, tq, tk))


class RelPositionMultiHeadedAttention(nn.Module):
    def __init__(self, n_head: int, n_feat: int):
        super().__init__()
        self.h, self.d_k = n_head, n_feat // n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(self.h, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(self.h, self.d_k))

    def _heads(self, x):
        return x.view(x.shape[0], -1, self.h, self.d_k)

    def forward(self, x, pos_table, mask=None, cache: "LayerCache | None" = None):
        """x (B,Tq,d); pos_table (1, 2Tk-1, d); mask (B or 1, Tq, Tk) bool, True = attend."""
        q = self._heads(self.linear_q(x))  # (B,Tq,H,dk)
        k = self._heads(self.linear_k(x)).transpose(1, 2)
        v = self._heads(self.linear_v(x)).transpose(1, 2)
        if cache is not None:
            k, v = cache.append(k, v)
        p = self._heads(self.linear_pos(pos_table)).transpose(1, 2)  # (1,H,2Tk-1,dk)
        q_u = (q + self.pos_bias_u).transpose(1, 2)
        q_v = (q + self.pos_bias_v).transpose(1, 2)
        content = q_u @ k.transpose(-1, -2)
        position = rel_shift(q_v @ p.transpose(-1, -2))
        scores = (content + position) / math.sqrt(self.d_k)
        if mask is not None:
            scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
            attn = scores.softmax(dim=-1).masked_fill(~mask.unsqueeze(1), 0.0)
        else:
            attn = scores.softmax(dim=-1)
        out = (attn @ v).transpose(1, 2).reshape(x.shape[0], -1, self.h * self.d_k)
        return self.linear_out(out)


class PositionwiseFeedForward(nn.Module):
    def __init__(self, idim: int, hidden: int, activation: nn.Module):
        super().__init__()
        self.w_1 = nn.Linear(idim, hidden)
        self.w_2 = nn.Linear(hidden, idim)
        self.activation = activation

    def forward(self, x):
        return self.w_2(self.activation(self.w_1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, size, heads, units, activation, norm_names):
        super().__init__()
        self.self_attn = RelPositionMultiHeadedAttention(heads, size)
        self.feed_forward = PositionwiseFeedForward(size, units, activation)
        self.norm_names = norm_names
        setattr(self, norm_names[0], nn.LayerNorm(size, eps=1e-5))
        setattr(self, norm_names[1], nn.LayerNorm(size, eps=1e-5))

    def forward(self, x, pos_table, mask=None, cache=None):
        norm_attn, norm_ff = (getattr(self, n) for n in self.norm_names)
        x = x + self.self_attn(norm_attn(x), pos_table, mask, cache)
        return x + self.feed_forward(norm_ff(x))


class InputLayer(nn.Module):
    """'linear': Linear + LayerNorm (+dropout); 'linear_legacy' adds a ReLU. Then x * sqrt(d)."""

    def __init__(self, idim, odim, kind):
        super().__init__()
        if kind not in ("linear", "linear_legacy"):
            raise ValueError(f"unsupported input layer {kind!r}")
        layers = [nn.Linear(idim, odim), nn.LayerNorm(odim, eps=1e-5), nn.Dropout(0.0)]
        if kind == "linear_legacy":
            layers.append(nn.ReLU())
        self.out = nn.Sequential(*layers)
        self.xscale = math.sqrt(odim)

    def forward(self, x):
        return self.out(x) * self.xscale


@dataclass
class LayerCache:
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    def append(self, k, v):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


@dataclass
class KVCache:
    """Per-layer keys/values of everything fed so far (batch 1)."""

    layers: list[LayerCache] = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if not self.layers or self.layers[0].k is None else self.layers[0].k.shape[2]


ACTIVATIONS = {"silu": nn.SiLU, "swish": nn.SiLU, "relu": nn.ReLU}


class RelPositionTransformer(nn.Module):
    def __init__(self, input_size, output_size, attention_heads, linear_units, num_blocks,
                 input_layer="linear", ffn_activation="silu", norm_names=("norm_mha", "norm_ff"), causal=False):
        super().__init__()
        self.output_size = output_size
        self.causal = causal
        self.embed = InputLayer(input_size, output_size, input_layer)
        self.encoders = nn.ModuleList(
            EncoderLayer(output_size, attention_heads, linear_units, ACTIVATIONS[ffn_activation](), tuple(norm_names))
            for _ in range(num_blocks)
        )
        self.after_norm = nn.LayerNorm(output_size, eps=1e-5)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        t = x.shape[1]
        h = self.embed(x)
        pos = relative_position_table(t, self.output_size, h.device, h.dtype)
        attn_mask = None
        if mask is not None:
            attn_mask = mask.bool().unsqueeze(1).expand(-1, t, -1)  # padding: keys must be valid
        if self.causal:
            tri = torch.ones(t, t, dtype=torch.bool, device=h.device).tril().unsqueeze(0)
            attn_mask = tri if attn_mask is None else attn_mask & tri
        for layer in self.encoders:
            h = layer(h, pos, attn_mask)
        return self.after_norm(h)

    def new_cache(self) -> KVCache:
        return KVCache([LayerCache() for _ in self.encoders])

    def forward_incremental(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Feed t new positions (1, t, in) after those in ``cache`` (causal); returns (1, t, out).
        Equal to the matching rows of a full causal forward over everything fed so far."""
        t_new = x.shape[1]
        t_total = cache.length + t_new
        h = self.embed(x)
        pos = relative_position_table(t_total, self.output_size, h.device, h.dtype)
        mask = torch.ones(t_total, t_total, dtype=torch.bool, device=h.device).tril()[-t_new:].unsqueeze(0)
        for layer, layer_cache in zip(self.encoders, cache.layers):
            h = layer(h, pos, mask, layer_cache)
        return self.after_norm(h)
