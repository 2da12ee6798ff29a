"""ESPnet/WeNet-style transformer encoder with relative-position self-attention.

Shared by the speech decoder (its text and TASTE encoders and its causal AR decoder, spec §6.2 and
§6.4) and by the flow encoder of the voice generator (§7.1). Blocks are pre-LayerNorm:
``x += RelMHA(LN(x)); x += W2(act(W1(LN(x))))``, then a final ``after_norm``. There is no
convolution module and no macaron feed-forward.

Public API::

    RelPositionTransformer(input_size, output_size, attention_heads, linear_units, num_blocks,
                           input_layer='linear',            # or 'linear_legacy' (adds a ReLU)
                           ffn_activation='silu',           # 'silu' (= 'swish') or 'relu'
                           norm_names=('norm_mha', 'norm_ff'),  # ('norm1', 'norm2') for the AR decoder
                           causal=False)                    # True = static chunk size 1
    .forward(x (B,T,in), mask (B,T) bool or None) -> (B,T,out)     # mask: True on valid positions
    .new_cache() -> KVCache
    .forward_incremental(x (1,t,in), cache) -> (1,t,out)            # causal models only

``forward_incremental`` appends t new positions after everything already in ``cache`` (they attend
to all cached positions and causally among themselves) and equals the matching rows of a full
causal ``forward`` over the whole sequence. Each call costs work proportional to the new rows
times the cached length per layer; nothing already cached is recomputed.

Which settings the published modules use (spec §6, §7, §10): the speech decoder's text and TASTE
encoders are the original's Conformer class (SiLU, ``norm_mha``/``norm_ff``, input 'linear',
causal); its AR decoder ``llm`` is the Transformer class (ReLU, ``norm1``/``norm2``, input
'linear_legacy', causal); the flow encoder is the Conformer class, non-causal.

Submodule names equal the published ones: ``embed.out.{0: Linear, 1: LayerNorm, 2: Dropout
[, 3: ReLU]}``, ``encoders.{i}.self_attn.{linear_q, linear_k, linear_v, linear_out, linear_pos
(no bias), pos_bias_u, pos_bias_v}``, ``encoders.{i}.feed_forward.{w_1, w_2}``,
``encoders.{i}.<norm names>``, ``after_norm``. The positional table is computed on the fly, never
persisted.

Relative-position attention ("rel_pos_espnet", Transformer-XL): for query i and key j,
``score = [(q_i + u)·k_j + (q_i + v)·linear_pos(PE(i - j))] / sqrt(d_k)`` with the sinusoid
``PE(r)[2m] = sin(r·ω_m)``, ``PE(r)[2m+1] = cos(r·ω_m)``, ``ω_m = 10000^(-2m/d)``. The model input
is scaled by sqrt(d) after the input layer; no absolute position is ever added.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

# The original precomputes its relative-position table for distances up to ±(5000 - 1). Its full
# forward extends the table when needed, but its cached decoding slices the fixed table, so a
# cached sequence (prefix + generated tokens) must stay within this many positions.
MAX_CACHED_POSITIONS = 5000

ACTIVATIONS = {"silu": nn.SiLU, "swish": nn.SiLU, "relu": nn.ReLU}
INPUT_LAYERS = ("linear", "linear_legacy")


def sinusoid_encoding(distances: torch.Tensor, d_model: int) -> torch.Tensor:
    """(n, d_model) fp32 sinusoids of the given relative distances (any sign), interleaved sin/cos."""
    frequencies = torch.exp(
        torch.arange(0, d_model, 2, dtype=torch.float32, device=distances.device)
        * -(math.log(10000.0) / d_model)
    )
    angles = distances.to(torch.float32).unsqueeze(1) * frequencies
    table = torch.zeros(distances.shape[0], d_model, device=distances.device)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles)
    return table


def relative_position_table(size: int, d_model: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """(1, 2*size-1, d_model): encodings of the distances size-1, …, 1, 0, -1, …, -(size-1)
    (the layout of the original's table slice for a sequence of ``size`` positions)."""
    distances = torch.arange(size - 1, -size, -1, device=device)
    return sinusoid_encoding(distances, d_model).unsqueeze(0).to(dtype)


def rel_shift(scores: torch.Tensor) -> torch.Tensor:
    """(B,H,T,2T-1) scores against the table of ``relative_position_table(T)`` -> (B,H,T,T) with
    the score of distance i - j at (i, j). (The same result as Transformer-XL's pad-and-reshape.)"""
    b, h, t, width = scores.shape
    if width != 2 * t - 1:
        raise ValueError(f"rel_shift expects 2*T-1 = {2 * t - 1} distance columns, got {width}")
    i = torch.arange(t, device=scores.device).unsqueeze(1)
    j = torch.arange(t, device=scores.device).unsqueeze(0)
    column = (t - 1) - (i - j)  # distance i - j sits at column (t - 1) - (i - j) of the table
    return scores.gather(-1, column.expand(b, h, t, t))


@dataclass
class LayerCache:
    """Keys/values of every position fed so far to one layer, plus that layer's projected positional
    keys ``linear_pos(PE(r))`` for the distances r = 0, 1, … (they depend only on the weights)."""

    keys: torch.Tensor | None = None  # (1, H, T, d_k)
    values: torch.Tensor | None = None  # (1, H, T, d_k)
    pos_keys: torch.Tensor | None = None  # (1, H, R, d_k), distances 0..R-1 ascending

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]


@dataclass
class KVCache:
    """Per-layer attention cache of one causal sequence (batch 1)."""

    layers: list[LayerCache] = field(default_factory=list)
    epoch: int = 0  # bumped when a new decode takes the cache over (a decode started before can tell)

    @property
    def length(self) -> int:
        """Number of positions already fed."""
        return self.layers[0].length if self.layers else 0

    def clone(self) -> "KVCache":
        """An independent copy (tensors are never modified in place, so sharing them is safe)."""
        return KVCache([LayerCache(c.keys, c.values, c.pos_keys) for c in self.layers], self.epoch)

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on (e.g. to re-feed a changed suffix)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        for c in self.layers:
            if c.keys is not None:
                c.keys, c.values = c.keys[:, :, :length], c.values[:, :, :length]


class RelPositionMultiHeadedAttention(nn.Module):
    def __init__(self, n_head: int, n_feat: int):
        super().__init__()
        if n_feat % n_head:
            raise ValueError(f"attention width {n_feat} is not divisible by {n_head} heads")
        self.h, self.d_k = n_head, n_feat // n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(self.h, self.d_k))  # content bias (Transformer-XL u)
        self.pos_bias_v = nn.Parameter(torch.zeros(self.h, self.d_k))  # position bias (Transformer-XL v)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B,T,H*d_k) -> (B,H,T,d_k)."""
        return x.view(x.shape[0], x.shape[1], self.h, self.d_k).transpose(1, 2)

    def _attend(self, q, k, v, position_scores, mask):
        """q (B,Tq,H,d_k) untransposed so the per-head biases broadcast; k, v (B,H,Tk,d_k);
        position_scores (B|1,H,Tq,Tk); mask broadcastable to (B,Tq,Tk), True = attend."""
        content = (q + self.pos_bias_u).transpose(1, 2) @ k.transpose(-1, -2)
        scores = (content + position_scores) / math.sqrt(self.d_k)
        if mask is None:
            attn = scores.softmax(dim=-1)
        else:
            blocked = ~mask.unsqueeze(1)
            # The original re-zeroes blocked weights after the softmax (rows with no visible key
            # then give zeros instead of NaN).
            attn = scores.masked_fill(blocked, float("-inf")).softmax(dim=-1).masked_fill(blocked, 0.0)
        out = (attn @ v).transpose(1, 2).reshape(q.shape[0], q.shape[1], self.h * self.d_k)
        return self.linear_out(out)

    def forward(self, x: torch.Tensor, pos_table: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Whole-sequence attention. x (B,T,d); pos_table (1,2T-1,d) from relative_position_table."""
        q = self.linear_q(x).view(x.shape[0], x.shape[1], self.h, self.d_k)
        k, v = self._split_heads(self.linear_k(x)), self._split_heads(self.linear_v(x))
        p = self._split_heads(self.linear_pos(pos_table))  # (1,H,2T-1,d_k)
        position = rel_shift((q + self.pos_bias_v).transpose(1, 2) @ p.transpose(-1, -2))
        return self._attend(q, k, v, position, mask)

    def forward_incremental(self, x: torch.Tensor, cache: LayerCache) -> torch.Tensor:
        """x (1,t,d): t new positions after the ``cache.length`` cached ones; updates ``cache``."""
        t_new, start = x.shape[1], cache.length
        q = self.linear_q(x).view(1, t_new, self.h, self.d_k)
        k, v = self._split_heads(self.linear_k(x)), self._split_heads(self.linear_v(x))
        cache.keys = k if cache.keys is None else torch.cat([cache.keys, k], dim=2)
        cache.values = v if cache.values is None else torch.cat([cache.values, v], dim=2)
        total = cache.length
        self._extend_pos_keys(cache, total, x)
        # Only distances >= 0 are visible (keys at or before the query): score the query against
        # the positional keys of distances 0..total-1, then pick distance (start + i) - j per key.
        by_distance = (q + self.pos_bias_v).transpose(1, 2) @ cache.pos_keys[:, :, :total].transpose(-1, -2)
        query_pos = torch.arange(start, total, device=x.device).unsqueeze(1)
        key_pos = torch.arange(total, device=x.device).unsqueeze(0)
        distance = query_pos - key_pos  # (t, total)
        visible = distance >= 0
        position = by_distance.gather(-1, distance.clamp(min=0).expand(1, self.h, t_new, total))
        mask = None if t_new == 1 else visible.unsqueeze(0)  # one new row sees every key (no read of the mask)
        return self._attend(q, cache.keys, cache.values, position, mask)

    def _extend_pos_keys(self, cache: LayerCache, needed: int, like: torch.Tensor) -> None:
        have = 0 if cache.pos_keys is None else cache.pos_keys.shape[2]
        if have >= needed:
            return
        # Grow geometrically so that token-by-token decoding projects each distance once.
        grow_to = max(needed, min(2 * have, MAX_CACHED_POSITIONS))
        distances = torch.arange(have, grow_to, device=like.device)
        new = self._split_heads(self.linear_pos(sinusoid_encoding(distances, self.h * self.d_k).to(like.dtype)
                                                .unsqueeze(0)))
        cache.pos_keys = new if cache.pos_keys is None else torch.cat([cache.pos_keys, new], dim=2)


class PositionwiseFeedForward(nn.Module):
    def __init__(self, size: int, hidden: int, activation: nn.Module):
        super().__init__()
        self.w_1 = nn.Linear(size, hidden)
        self.w_2 = nn.Linear(hidden, size)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(self.activation(self.w_1(x)))


class RelPositionEncoderLayer(nn.Module):
    """Pre-LN block; its two LayerNorms are registered under the given names (the original's
    Conformer class calls them norm_mha/norm_ff, its Transformer class norm1/norm2)."""

    def __init__(self, size: int, heads: int, units: int, activation: nn.Module, norm_names: tuple[str, str]):
        super().__init__()
        self.self_attn = RelPositionMultiHeadedAttention(heads, size)
        self.feed_forward = PositionwiseFeedForward(size, units, activation)
        self.norm_names = norm_names
        for name in norm_names:
            self.add_module(name, nn.LayerNorm(size, eps=1e-5))

    @property
    def attention_norm(self) -> nn.LayerNorm:
        return getattr(self, self.norm_names[0])

    @property
    def feed_forward_norm(self) -> nn.LayerNorm:
        return getattr(self, self.norm_names[1])

    def forward(self, x, pos_table, mask):
        x = x + self.self_attn(self.attention_norm(x), pos_table, mask)
        return x + self.feed_forward(self.feed_forward_norm(x))

    def forward_incremental(self, x, cache: LayerCache):
        x = x + self.self_attn.forward_incremental(self.attention_norm(x), cache)
        return x + self.feed_forward(self.feed_forward_norm(x))


class LinearInputLayer(nn.Module):
    """``embed``: 'linear' = Linear, LayerNorm, Dropout; 'linear_legacy' adds a ReLU. The result is
    scaled by sqrt(d) (the rel-pos encoding's xscale)."""

    def __init__(self, input_size: int, output_size: int, kind: str):
        super().__init__()
        if kind not in INPUT_LAYERS:
            raise ValueError(f"input_layer must be one of {INPUT_LAYERS}, got {kind!r}")
        layers = [nn.Linear(input_size, output_size), nn.LayerNorm(output_size, eps=1e-5), nn.Dropout(0.0)]
        if kind == "linear_legacy":
            layers.append(nn.ReLU())
        self.out = nn.Sequential(*layers)
        self.xscale = math.sqrt(output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) * self.xscale


class RelPositionTransformer(nn.Module):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        attention_heads: int,
        linear_units: int,
        num_blocks: int,
        input_layer: str = "linear",
        ffn_activation: str = "silu",
        norm_names: tuple[str, str] = ("norm_mha", "norm_ff"),
        causal: bool = False,
    ):
        super().__init__()
        if ffn_activation not in ACTIVATIONS:
            raise ValueError(f"ffn_activation must be one of {sorted(ACTIVATIONS)}, got {ffn_activation!r}")
        if len(norm_names) != 2 or len(set(norm_names)) != 2:
            raise ValueError(f"norm_names must be two distinct names, got {norm_names!r}")
        self.input_size = input_size
        self.output_size = output_size
        self.causal = causal
        self.embed = LinearInputLayer(input_size, output_size, input_layer)
        self.encoders = nn.ModuleList(
            RelPositionEncoderLayer(output_size, attention_heads, linear_units, ACTIVATIONS[ffn_activation](),
                                    tuple(norm_names))
            for _ in range(num_blocks)
        )
        self.after_norm = nn.LayerNorm(output_size, eps=1e-5)

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() != 3 or x.shape[-1] != self.input_size:
            raise ValueError(f"expected input (B, T, {self.input_size}), got {tuple(x.shape)}")

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B,T,in); mask (B,T) bool, True on valid positions (padding keys are never attended;
        outputs at padded positions are meaningless). Returns (B,T,out)."""
        self._check_input(x)
        b, t = x.shape[:2]
        h = self.embed(x)
        pos_table = relative_position_table(t, self.output_size, h.device, h.dtype)
        attn_mask = None
        if mask is not None:
            if tuple(mask.shape) != (b, t):
                raise ValueError(f"mask must be (B, T) = {(b, t)}, got {tuple(mask.shape)}")
            attn_mask = mask.to(torch.bool).unsqueeze(1).expand(b, t, t)
        if self.causal:  # static chunk size 1: position i sees 0..i
            tri = torch.ones(t, t, dtype=torch.bool, device=h.device).tril().unsqueeze(0)
            attn_mask = tri if attn_mask is None else attn_mask & tri
        for layer in self.encoders:
            h = layer(h, pos_table, attn_mask)
        return self.after_norm(h)

    def new_cache(self) -> KVCache:
        return KVCache([LayerCache() for _ in self.encoders])

    def forward_incremental(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Feed t new positions x (1,t,in) after those in ``cache`` (updated in place); returns
        (1,t,out), equal to the matching rows of ``forward`` over everything fed so far."""
        if not self.causal:
            raise ValueError("incremental decoding needs a causal transformer (causal=True)")
        self._check_input(x)
        if x.shape[0] != 1:
            raise ValueError(f"incremental decoding is batch 1, got batch {x.shape[0]}")
        if len(cache.layers) != len(self.encoders):
            raise ValueError("this cache belongs to a transformer with a different number of blocks")
        if cache.length + x.shape[1] > MAX_CACHED_POSITIONS:
            raise ValueError(
                f"{cache.length + x.shape[1]} positions exceed the relative-position range of cached "
                f"decoding ({MAX_CACHED_POSITIONS}); shorten the utterance"
            )
        h = self.embed(x)
        for layer, layer_cache in zip(self.encoders, cache.layers):
            h = layer.forward_incremental(h, layer_cache)
        return self.after_norm(h)
