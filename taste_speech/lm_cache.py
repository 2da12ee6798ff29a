"""KV caches of the spoken LM's Llama: a growing one (CPU, debugging) and a preallocated one whose
one-row decode step is captured as a CUDA graph (the fast path on CUDA).

Both hold the keys/values of every row fed so far and share one interface, used by
``TasteSpokenLM.feed`` and ``LMDecodeState``:

    cache.length                       rows fed so far
    cache.feed(backbone, rows) -> (1, H) hidden state of the last row (rows: (1, T, H))
    cache.crop(length)                 forget every row after the first ``length``
    cache.keys_values()                per layer (keys, values) of the rows fed so far

``StaticLMCache`` keeps ``capacity`` rows preallocated (transformers' ``StaticCache``; its per-layer
length counters are device tensors that every forward advances in place). A stale row beyond the
current length is never seen: every query is masked to the keys at or before its own position, so
``crop`` only moves the counters back. Feeding past the capacity grows the cache (a copy, and the
graph is captured again). A one-row feed (a decode step) copies the row into a static buffer and
replays the captured step. A multi-row feed (prefill: a new turn, a reply's prompt) of up to
``PREFILL_BUCKETS[-1]`` rows is padded to the smallest bucket that holds it and replays that
bucket's captured step: the padding rows are written after the real ones, where no query looks
(the counters are then set to the real length), so the real rows are computed exactly as
unpadded. Longer feeds, and feeds that would reach past the capacity padded, run eagerly. A
cache's prefill steps share one graph memory pool (they never run at the same time, and each
output is copied out at once).

Copies (``copy.deepcopy``, e.g. ``Conversation.snapshot``) copy the keys/values but never the graph:
a copy captures its own at its first step.
"""

from __future__ import annotations

import copy
import inspect

import torch
from transformers import DynamicCache, LlamaModel, StaticCache

from taste_speech.step_graph import StepGraph, first_fallback_reason, fitting_bucket, resolve_mode

CACHE_KINDS = ("auto", "static", "dynamic")
DEFAULT_CAPACITY = 1024
PREFILL_BUCKETS = (32, 64, 128, 256)  # rows of a captured multi-row feed (a user turn is ~20-100)
_GROW_QUANTUM = 256  # capacities are multiples of this (fewer distinct shapes to capture)


# Recent transformers 5.x name the backbone's cache argument ``cache``; ``past_key_values``, the
# older name, warns and goes in 5.40. Pass it under the name this version takes.
_CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def run_backbone(backbone, rows: torch.Tensor, kv, **kwargs):
    """The Llama backbone on ``rows`` (B, T, H) after the keys/values in ``kv``, which it extends."""
    return backbone(inputs_embeds=rows, use_cache=True, **{_CACHE_ARG: kv}, **kwargs)


class DynamicLMCache:
    """transformers' growing ``DynamicCache``: every feed concatenates (new shapes every step)."""

    def __init__(self):
        self.kv = DynamicCache()

    @property
    def length(self) -> int:
        return self.kv.get_seq_length()

    def feed(self, backbone, rows: torch.Tensor) -> torch.Tensor:
        out = run_backbone(backbone, rows, self.kv)
        return out.last_hidden_state[:, -1]

    def keys_values(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values) of the rows fed so far, (1, kv_heads, length, head_dim) each."""
        return [(layer.keys, layer.values) for layer in self.kv.layers]

    def crop(self, length: int) -> None:
        _check_crop(self.length, length)
        drop = self.length - length
        if drop:
            self.kv.crop(-drop)  # transformers >= 5 takes the number of rows to remove


class StaticLMCache:
    def __init__(self, config, capacity: int = DEFAULT_CAPACITY, *, device, dtype: torch.dtype,
                 graph_mode: str = "auto"):
        """``config``: the Llama config; ``graph_mode``: see ``step_graph`` ('auto' captures on CUDA)."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 row, got {capacity}")
        self.config, self.device, self.dtype = config, torch.device(device), dtype
        self.graph_mode = resolve_mode(graph_mode, self.device)
        self._allocate(_round_up(capacity))
        self._length = 0
        # the spoken LM's heads for this cache's decodes, captured too (``modeling_spoken_lm.HeadsStep``,
        # made by the LM on first use): kept here, as the steps are, across the decodes of one call
        self.heads_step = None

    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        config = self.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # Allocated up front (not lazily inside a forward) and never as inference tensors: a cache
        # made under torch.inference_mode must still accept in-place writes outside it.
        with torch.inference_mode(False):
            self.kv = StaticCache(config=config, max_cache_len=capacity)
            self.kv.early_initialization(batch_size=1, num_heads=config.num_key_value_heads, head_dim=head_dim,
                                         dtype=self.dtype, device=self.device)
            self.key_positions = torch.arange(capacity, device=self.device)
            self._row = torch.zeros(1, 1, config.hidden_size, device=self.device, dtype=self.dtype)
            self._rows: dict[int, torch.Tensor] = {}  # a static input per prefill bucket, made on first use
        self._step: StepGraph | None = None
        self._prefill_steps: dict[int, StepGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.graph_mode == "graph" else None

    # -- the interface ------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return self._length

    @property
    def captured(self) -> bool:
        """Whether decode steps replay a CUDA graph."""
        return self._step is not None and self._step.captured

    @property
    def fallback_reason(self) -> str | None:
        return first_fallback_reason([self._step, *self._prefill_steps.values()])

    def prefill_bucket(self, rows: int) -> int | None:
        """The captured prefill step a feed of ``rows`` rows would take now (None: eager)."""
        if self.graph_mode == "eager":
            return None
        return fitting_bucket(PREFILL_BUCKETS, rows, self.capacity - self._length)

    def warm_up_prefill(self, backbone) -> None:
        """Run (and so capture) every prefill bucket that fits after the current rows, then forget
        what they wrote: the cache is left as it was."""
        length = self._length
        for bucket in PREFILL_BUCKETS:
            if self.prefill_bucket(bucket) == bucket:
                rows = torch.zeros(1, bucket, self.config.hidden_size, device=self.device, dtype=self.dtype)
                self.feed(backbone, rows)
                self._set_length(length)

    def feed(self, backbone, rows: torch.Tensor) -> torch.Tensor:
        t = rows.shape[1]
        if self._length + t > self.capacity:
            self._grow(self._length + t)
        if t == 1:
            if self._step is None:
                self._step = StepGraph(lambda: self._decode_step(backbone), self.device, self.graph_mode,
                                       rewind=lambda: self._set_length(self._length), name="spoken LM step")
            self._row.copy_(rows)
            hidden = self._step.run().clone()  # the graph's output buffer is overwritten next step
        elif (bucket := self.prefill_bucket(t)) is not None:
            hidden = self._prefill(backbone, rows, bucket)
        else:
            positions = torch.arange(self._length, self._length + t, device=self.device)
            out = run_backbone(backbone, rows, self.kv, attention_mask=self._mask(positions),
                               position_ids=positions.unsqueeze(0))
            hidden = out.last_hidden_state[:, -1]
        self._length += t
        return hidden

    def keys_values(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        n = self._length
        return [(layer.keys[:, :, :n], layer.values[:, :, :n]) for layer in self.kv.layers]

    def crop(self, length: int) -> None:
        _check_crop(self._length, length)
        self._set_length(length)

    # -- internals ----------------------------------------------------------------------------------
    def _set_length(self, length: int) -> None:
        """Move every layer's write position (a device counter) to ``length``."""
        self._length = length
        for layer in self.kv.layers:
            layer.cumulative_length.fill_(length)

    def _mask(self, positions: torch.Tensor) -> torch.Tensor:
        """(1, 1, T, capacity) additive mask: query at position p sees the keys at 0..p only."""
        visible = self.key_positions.unsqueeze(0) <= positions.unsqueeze(1)
        blocked = torch.finfo(self.dtype).min
        return torch.where(visible, 0.0, blocked).to(self.dtype)[None, None]

    def _prefill(self, backbone, rows: torch.Tensor, bucket: int) -> torch.Tensor:
        """``rows`` (1, t, H) through the bucket's captured step: the hidden state of the last real row."""
        t = rows.shape[1]
        if bucket not in self._prefill_steps:
            with torch.inference_mode(False):  # (as in _allocate: writable whatever mode later feeds run in)
                self._rows[bucket] = torch.zeros(1, bucket, self.config.hidden_size, device=self.device,
                                                 dtype=self.dtype)
            self._prefill_steps[bucket] = StepGraph(
                lambda: self._prefill_step(backbone, bucket), self.device, self.graph_mode, pool=self._pool,
                rewind=lambda: self._set_length(self._length), name=f"spoken LM prefill ({bucket} rows)")
        buffer = self._rows[bucket]
        buffer[:, :t].copy_(rows)
        buffer[:, t:].zero_()
        hidden = self._prefill_steps[bucket].run()[:, t - 1].clone()
        for layer in self.kv.layers:  # the step moved the write position past its padding: back to the real end
            layer.cumulative_length.fill_(self._length + t)
        return hidden

    def _prefill_step(self, backbone, bucket: int) -> torch.Tensor:
        """``bucket`` rows from the bucket's static buffer at the device-side position (graph-safe)."""
        first = self.kv.layers[0].cumulative_length.view(1).clone()
        positions = first + self.key_positions[:bucket]
        out = run_backbone(backbone, self._rows[bucket], self.kv, attention_mask=self._mask(positions),
                           position_ids=positions.view(1, bucket))
        return out.last_hidden_state

    def _decode_step(self, backbone) -> torch.Tensor:
        """One row from the static buffer at the current device-side position (graph-safe)."""
        position = self.kv.layers[0].cumulative_length.view(1).clone()
        out = run_backbone(backbone, self._row, self.kv, attention_mask=self._mask(position),
                           position_ids=position.view(1, 1))
        return out.last_hidden_state[:, -1]

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` rows, made now rather than by growing (and, with graphs, capturing the
        steps again) in the middle of a reply."""
        if rows > self.capacity:
            self._grow(rows)

    def _grow(self, needed: int) -> None:
        old, length = self.kv, self._length
        self._allocate(max(_round_up(needed), 2 * self.capacity))
        self._take_rows(old, length)

    def _take_rows(self, kv: StaticCache, length: int) -> None:
        """The first ``length`` rows of ``kv`` (another allocation's) become this cache's rows."""
        for new_layer, old_layer in zip(self.kv.layers, kv.layers):
            new_layer.keys[:, :, :length] = old_layer.keys[:, :, :length]
            new_layer.values[:, :, :length] = old_layer.values[:, :, :length]
        self._set_length(length)

    def __deepcopy__(self, memo):
        """A copy (``Conversation.snapshot``/``restore``) holds the rows in use, not this cache's
        whole capacity: a snapshot of a short history costs what it holds (a 1B conversation's
        full capacity is some 144 MiB in bf16); it grows on demand like any cache. Its graphs are
        its own: a graph is bound to the tensors it was captured on."""
        twin = copy.copy(self)
        twin._allocate(_round_up(self._length + 1))
        twin._take_rows(self.kv, self._length)
        twin.heads_step = None
        return twin


def _round_up(rows: int) -> int:
    return -(-int(rows) // _GROW_QUANTUM) * _GROW_QUANTUM


def _check_crop(have: int, length: int) -> None:
    if not 0 <= length <= have:
        raise ValueError(f"cannot crop a decode state of {have} rows to {length}")
