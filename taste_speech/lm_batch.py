"""LMStepBatch: the decode steps of many conversations' spoken LM, run as one batched step.

At batch 1 a decode step is bound by kernel launches, not by the GPU (our H100 notes, docs/GPU.md): eight
calls each replaying their own graphed step cost 8 x 2.9 ms, one step batched over the same
eight 4.4 ms. So one ``LMStepBatch`` per model (per GPU) keeps the KV rows of up to ``slots``
conversations side by side, and every decode step that is waiting when a step starts - from
any call's thread - runs in that one forward (continuous batching without a scheduler thread:
the first waiting thread runs the step for everyone, the others sleep until their row is done).

Storage: per layer ``(slots, kv_heads, capacity + 1, head_dim)`` keys and values. A slot's rows
0..length-1 are its conversation; row ``capacity`` is a scratch row. A batched step covers the
first ``n`` slots (``n`` a power of two, one captured graph per size): a slot in that range
without a step of its own writes its garbage row to the scratch row and its output is dropped,
so it never touches its real rows - it may be prefilling them at the same moment. Each row's
query sees the keys at or before its own position (per-row position, per-row mask).

A conversation uses its slot through ``SlotLMCache`` (the same interface as ``lm_cache``'s
caches): one-row feeds join the batch; a multi-row feed (prefill, a new turn) runs on the slot
alone - with graphs, staged: the slot's rows are copied into one shared ``StaticLMCache`` whose
captured prefill bucket runs it, and the new rows are copied back (on the H100 a 48-row turn's
prefill took 12.5 ms eager and 3.3 ms replayed; the copies are two per layer), eagerly otherwise.
A cache that finds no free slot, or outgrows ``capacity``, leaves the batch and continues in a
private ``StaticLMCache`` - slower, never wrong. ``close()`` returns the slot.

One CUDA stream: the calls' rows meet in shared buffers (the step's, the stager's) whose order
the host's locks keep only if every call works on the same stream (``TasteEngine`` refuses
``streams='calls'`` with batch slots).
"""

from __future__ import annotations

import copy
import threading

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from taste_speech.batched_steps import BatchedSteps, SlotCache
from taste_speech.device_copies import copy_in
from taste_speech.lm_cache import StaticLMCache, _check_crop, run_backbone
from taste_speech.step_graph import resolve_mode

_EAGER_VIEW_QUANTUM = 64  # eager steps attend to a prefix of the rows rounded up to this (fewer shapes)


class _SlotRowsLayer(CacheLayerMixin):
    """One layer's keys/values of a range of slots, written at per-slot positions (decode) or as
    one span of one slot (prefill). ``update`` returns the first ``view_rows`` rows of every slot."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.is_initialized = keys, values, True
        self.write_positions: torch.Tensor | None = None  # (n,) one row per slot (decode)
        self.span_start = 0  # first row of a multi-row write (prefill of one slot)
        self.view_rows = keys.shape[2]

    def lazy_initialization(self, key_states, value_states) -> None:  # storage is preallocated
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.write_positions is not None:
            slots = torch.arange(key_states.shape[0], device=key_states.device)
            self.keys[slots, :, self.write_positions] = key_states[:, :, 0]
            self.values[slots, :, self.write_positions] = value_states[:, :, 0]
        else:
            end = self.span_start + key_states.shape[2]
            self.keys[:, :, self.span_start:end] = key_states
            self.values[:, :, self.span_start:end] = value_states
        return self.keys[:, :, :self.view_rows], self.values[:, :, :self.view_rows]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.view_rows, 0

    def get_seq_length(self) -> int:
        return self.view_rows

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class _SlotRowsCache(Cache):
    """transformers' ``Cache`` over ``_SlotRowsLayer``s (what the Llama forward writes into)."""

    def __init__(self, layers: list[_SlotRowsLayer]):
        super().__init__(layers=layers)

    def set_view_rows(self, rows: int) -> None:
        for layer in self.layers:
            layer.view_rows = rows


class LMStepBatch(BatchedSteps):
    name = "spoken LM step"

    def __init__(self, spoken_lm, slots: int = 16, capacity: int = 4608, graph_mode: str = "auto",
                 gather: float = 0.5):
        """``spoken_lm``: a ``TasteSpokenLM``; ``slots``: conversations batched at most;
        ``capacity``: rows per conversation (a conversation's ``max_tokens`` plus a reply and a
        turn); ``graph_mode``: see ``step_graph`` ('auto' captures the steps on CUDA);
        ``gather``: how long past its due time a step waits for a conversation's row, as a
        fraction of the conversation's work between steps (``batched_steps``)."""
        super().__init__(slots, gather)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an integer >= 1 row, got {capacity!r}")
        self.lm = spoken_lm
        config = spoken_lm.causal_lm.config
        self.config, self.capacity = config, capacity
        self.device = spoken_lm.embed_tokens.weight.device
        self.dtype = spoken_lm.lm_dtype
        self.graph_mode = resolve_mode(graph_mode, self.device)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (slots, config.num_key_value_heads, capacity + 1, head_dim)  # + the scratch row
        with torch.inference_mode(False):  # written in place outside inference mode too
            self._keys = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(config.num_hidden_layers)]
            self._values = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(config.num_hidden_layers)]
            self._rows = torch.zeros(slots, 1, config.hidden_size, device=self.device, dtype=self.dtype)
            self._positions = torch.full((slots,), capacity, dtype=torch.long, device=self.device)
            self._key_positions = torch.arange(capacity + 1, device=self.device)
        self._step_caches = {n: self._cache(slice(0, n)) for n in self.sizes}
        for n, cache in self._step_caches.items():
            for layer in cache.layers:
                layer.write_positions = self._positions[:n]
        # With graphs: where a slot's prefill runs, one at a time (its captured buckets; eager, a
        # plain feed on the slot is as fast)
        self._stager = None if self.graph_mode == "eager" else \
            StaticLMCache(config, capacity, device=self.device, dtype=self.dtype, graph_mode=self.graph_mode)
        self._stager_lock = threading.Lock()
        self.staged_prefills = 0  # prefills that ran a captured bucket

    def open(self) -> "SlotLMCache":
        """A cache for one conversation: in a free slot, or private when every slot is taken."""
        return SlotLMCache(self)

    # -- feeding -----------------------------------------------------------------------------------
    @torch.no_grad()
    def warm_up(self) -> None:
        """The batched steps (``BatchedSteps.warm_up``), and the stager's prefill buckets."""
        super().warm_up()
        if self._stager is not None:
            with self._stager_lock:
                self._stager._set_length(0)  # every bucket fits after no rows
                self._stager.warm_up_prefill(self.lm.backbone)

    @torch.no_grad()  # grad mode is per thread: callers' threads may not have turned it off
    def prefill(self, slot: int, owner: "SlotLMCache", rows: torch.Tensor) -> torch.Tensor:
        """Rows (1, T, H) after the slot's rows, this slot alone (staged through a captured
        prefill bucket where one fits, else eagerly); returns the last hidden state."""
        with self._using(slot, owner):
            start, t = self.length(slot), rows.shape[1]
            if (hidden := self._staged_prefill(slot, start, rows)) is not None:
                self.set_length(slot, start + t)
                return hidden
            cache = self._cache(slice(slot, slot + 1))
            view = min(self.capacity, _round_up_to(start + t, _EAGER_VIEW_QUANTUM))
            cache.set_view_rows(view)
            for layer in cache.layers:
                layer.span_start = start
            positions = torch.arange(start, start + t, device=self.device)
            out = run_backbone(self.lm.backbone, rows.to(self.dtype), cache,
                               attention_mask=self._visible(positions, view)[None, None],
                               position_ids=positions.unsqueeze(0))
            self.set_length(slot, start + t)
            return out.last_hidden_state[:, -1]

    def step(self, slot: int, owner: "SlotLMCache", row: torch.Tensor) -> torch.Tensor:
        """One row (1, 1, H) after the slot's rows, in the next batched step; returns (1, H)."""
        return self._step(slot, owner, row)

    # -- internals ---------------------------------------------------------------------------------
    def _staged_prefill(self, slot: int, start: int, rows: torch.Tensor) -> torch.Tensor | None:
        """The prefill through the stager's captured bucket: the slot's ``start`` rows in, the
        new rows back out. None where no bucket fits (too many rows, or past the capacity)."""
        if self._stager is None:
            return None
        t = rows.shape[1]
        with self._stager_lock:
            stager = self._stager
            if start + t > self.capacity:  # (a SlotLMCache leaves the batch before that)
                return None
            stager._set_length(start)  # (its rows past the slot's are stale: no query sees them)
            if stager.prefill_bucket(t) is None:
                return None
            for layer, keys, values in zip(stager.kv.layers, self._keys, self._values):
                layer.keys[:, :, :start].copy_(keys[slot:slot + 1, :, :start])
                layer.values[:, :, :start].copy_(values[slot:slot + 1, :, :start])
            hidden = stager.feed(self.lm.backbone, rows.to(self.dtype))
            for layer, keys, values in zip(stager.kv.layers, self._keys, self._values):
                keys[slot:slot + 1, :, start:start + t].copy_(layer.keys[:, :, start:start + t])
                values[slot:slot + 1, :, start:start + t].copy_(layer.values[:, :, start:start + t])
            self.staged_prefills += 1
            return hidden

    def _cache(self, slots: slice) -> _SlotRowsCache:
        return _SlotRowsCache([_SlotRowsLayer(k[slots], v[slots]) for k, v in zip(self._keys, self._values)])

    def _visible(self, positions: torch.Tensor, view: int) -> torch.Tensor:
        """(len(positions), view) additive mask: a query sees the keys at or before its position."""
        visible = self._key_positions[:view].unsqueeze(0) <= positions.unsqueeze(1)
        return torch.where(visible, 0.0, torch.finfo(self.dtype).min).to(self.dtype)

    def _decode(self, n: int) -> torch.Tensor:
        """The batched step over the first ``n`` slots (graph-safe: every input is a static buffer)."""
        cache = self._step_caches[n]
        positions = self._positions[:n]
        mask = self._visible(positions, cache.layers[0].view_rows)[:, None, None]  # one query row per slot
        out = run_backbone(self.lm.backbone, self._rows[:n], cache, attention_mask=mask,
                           position_ids=positions.unsqueeze(1))
        return out.last_hidden_state[:, -1]

    @torch.no_grad()
    def _run(self, batch: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        n = self.step_size(batch)
        positions = [self.capacity] * n  # slots without a step write the scratch row
        for slot in batch:
            positions[slot] = self.length(slot)
            self._rows[slot].copy_(batch[slot].reshape(1, -1))
        copy_in(self._positions[:n], positions)  # (no wait for the GPU before the step is launched)
        if self.graph_mode == "eager":
            furthest = max(self.length(s) for s in batch) + 1
            self._step_caches[n].set_view_rows(min(self.capacity + 1, _round_up_to(furthest, _EAGER_VIEW_QUANTUM)))
        hidden = self._graph(n).run()
        # (no wait for the GPU: each row's reader waits when it reads; the next step, on this
        # stream, runs after the copies out of the graph's buffer)
        return {slot: hidden[slot:slot + 1].clone() for slot in batch}


class SlotLMCache(SlotCache):
    """One conversation's KV cache in an ``LMStepBatch`` slot (``lm_cache``'s interface)."""

    def feed(self, backbone, rows: torch.Tensor) -> torch.Tensor:
        if self._use_private(rows.shape[1]):
            return self.private.feed(backbone, rows)
        if rows.shape[1] == 1:
            return self.batch.step(self.slot, self, rows)
        return self.batch.prefill(self.slot, self, rows)

    def crop(self, length: int) -> None:
        self._check_open()
        if self.private is not None:
            self.private.crop(length)
            return
        _check_crop(self.length, length)
        self.batch.set_length(self.slot, length)

    def keys_values(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.private is not None:
            return self.private.keys_values()
        n, s = self.length, self.slot
        return [(k[s:s + 1, :, :n], v[s:s + 1, :, :n]) for k, v in zip(self.batch._keys, self.batch._values)]

    def __deepcopy__(self, memo):
        """A snapshot (``Conversation.snapshot``) is a private cache: it holds no slot."""
        if self.closed:
            raise RuntimeError("cannot copy a closed KV cache")
        return copy.deepcopy(self.private, memo) if self.private is not None else self._private_copy()

    def _new_private(self) -> StaticLMCache:
        b = self.batch
        return StaticLMCache(b.config, b.capacity, device=b.device, dtype=b.dtype, graph_mode=b.graph_mode)

    def _private_copy(self) -> StaticLMCache:
        """The slot's rows in a cache of their own, as large as they need (it grows on demand)."""
        length = self.length
        b = self.batch
        private = StaticLMCache(b.config, length + 1, device=b.device, dtype=b.dtype, graph_mode=b.graph_mode)
        for layer, (keys, values) in zip(private.kv.layers, self.keys_values()):
            layer.keys[:, :, :length] = keys
            layer.values[:, :, :length] = values
        private._set_length(length)
        return private


def _round_up_to(rows: int, quantum: int) -> int:
    return -(-int(rows) // quantum) * quantum
