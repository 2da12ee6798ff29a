"""Preallocated KV cache of the speech decoder's AR transformer, with the one-token decode step
captured as a CUDA graph (the fast path on CUDA).

The AR decoder ``llm`` (a causal ``RelPositionTransformer``) decodes one speech token per step.
Its growing ``KVCache`` concatenates keys and values every step (new shapes each time, so a step
is a few hundred eager kernel launches: ~10 ms at the real size, our H100 notes, docs/GPU.md).
``StaticSpeechCache`` keeps per layer

- keys and values (1, H, capacity, d_k), written in place at the positions being fed;
- the projected positional keys ``linear_pos(PE(r))`` for the distances r = 0..capacity-1,
  computed once (they depend only on the weights);
- the number of positions fed as a device counter (``position``) advanced in place, with a host
  twin (``length``) so that no step reads it back from the device.

The relative-position math is that of ``RelPositionMultiHeadedAttention.forward_incremental``:
the query at position p scores every key slot j against the positional key of distance p - j.
Slots after p (not fed yet, or stale after a ``truncate``) are masked, so truncating only moves
the counter back. One decode step therefore has fixed shapes and reads its position from the
device: the whole step (speech-token embedding -> AR decoder -> ``llm_decoder`` -> log-softmax)
is run by a ``StepGraph`` (captured on CUDA; eager or rehearsed elsewhere), with the token id in
a static buffer. The draw stays outside, but the step also takes the original sampler's first two
calls on its log-probs (softmax, the ``TOP_K`` largest: ``last_top``, packed for one copy to the
host), so the top-k sampler needs no kernels of its own per token. A multi-row feed (a segment's
prefix, the speech tokens it continues, forced tokens) is padded to the smallest of ``PREFILL_BUCKETS`` rows that holds it and
replays that bucket's captured step: eagerly it is a few hundred kernel launches (seven blocks of
attention and feed-forward), replayed one. The padding rows come after the real ones, so no real
query sees them (causal); their keys and values land in slots past the real end, masked until a
later feed overwrites them, and the counters then move back to the real end. Longer feeds, and
feeds whose padding would pass the capacity, run eagerly on the same buffers. Feeding past the
capacity grows the cache (a copy; the steps are captured again).

Interface shared with ``KVCache`` (what ``TasteSpeechDecoder`` and ``SpeechDecodeState`` use):
``length``, ``truncate(length)``, ``clone()``. Static only: ``forward(rows)``, ``decode_step(token)``,
``reset()``. A cache is bound to the decoder that made it (its weights are read at creation).

One cache can serve every utterance of a call: ``TasteSpeechDecoder.start(prefix, cache=cache)``
resets it and prefills, and the captured step is replayed again (no capture per utterance).
``reset`` bumps ``epoch``, so a decode started before it can tell that its cache was taken over.
Copies (``clone``, ``copy.deepcopy``) copy the tensors, never the captured graph.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from taste_speech.espnet_transformer import MAX_CACHED_POSITIONS, sinusoid_encoding
from taste_speech.step_graph import StepGraph, first_fallback_reason, fitting_bucket, resolve_mode

CACHE_KINDS = ("auto", "static", "dynamic")
DEFAULT_CAPACITY = 1024
# Multi-row feeds padded to one of these and replayed as that bucket's step: a segment's prefix is its
# words' Whisper tokens plus 3 rows, the speech it continues some tens of tokens.
PREFILL_BUCKETS = (16, 32, 64, 128)
# The original samples each speech token among the 25 most likely (``TopKSampler``); the decode step
# computes that top-k of its log-probs too.
TOP_K = 25
_GROW_QUANTUM = 256  # capacities are multiples of this (fewer distinct shapes to capture)


class StaticSpeechCache:
    def __init__(self, decoder, capacity: int = DEFAULT_CAPACITY, *, graph_mode: str = "auto"):
        """``decoder``: the ``TasteSpeechDecoder`` whose AR decoder this cache serves;
        ``capacity``: positions preallocated (rounded up to a multiple of 256; grows when needed);
        ``graph_mode``: see ``step_graph`` ('auto' captures a CUDA graph on CUDA)."""
        if not 1 <= capacity <= MAX_CACHED_POSITIONS:
            raise ValueError(f"capacity must be 1..{MAX_CACHED_POSITIONS} positions (the relative-position range "
                             f"of cached decoding), got {capacity}")
        self.llm, self.embedding, self.head = decoder.llm, decoder.speech_embedding, decoder.llm_decoder
        if not self.llm.causal:
            raise ValueError("a static cache needs a causal AR decoder")
        self.device, self.dtype = decoder.device, decoder.dtype
        self.graph_mode = resolve_mode(graph_mode, self.device)
        self.epoch = 0
        self._length = 0
        with _plain_tensors():  # usable inside and outside inference_mode
            self.position = torch.zeros((), dtype=torch.long, device=self.device)
            self._token = torch.zeros(1, dtype=torch.long, device=self.device)
        self.last_top: torch.Tensor | None = None
        self._rows: dict[int, torch.Tensor] = {}  # a static input per prefill bucket, made on first use
        self._prefill_steps: dict[int, StepGraph] = {}
        # one memory pool for this cache's steps: they run one after another, never together
        self._pool = torch.cuda.graph_pool_handle() if self.graph_mode == "graph" else None
        # the call's captured conditioning steps (``TasteSpeechDecoder.condition_graph``, made on first
        # use): kept here, with the call's other steps
        self.condition_graph = None
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._allocate(_round_up(capacity))

    # -- the interface shared with KVCache ---------------------------------------------------------
    @property
    def length(self) -> int:
        """Number of positions already fed."""
        return self._length

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on (the slots stay, masked, until overwritten)."""
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a cache of {self._length} positions to {length}")
        self._set_length(length)

    def clone(self) -> "StaticSpeechCache":
        """An independent copy of the keys/values and counters; it captures its own step when it
        decodes (a graph is bound to the tensors it was captured with)."""
        twin = copy.copy(self)
        with _plain_tensors():
            twin.keys = [k.clone() for k in self.keys]
            twin.values = [v.clone() for v in self.values]
            twin.position = self.position.clone()
            twin._token = torch.zeros_like(self._token)
        twin._step, twin._rows, twin._prefill_steps, twin.last_top = None, {}, {}, None
        twin._pool = torch.cuda.graph_pool_handle() if self.graph_mode == "graph" else None
        twin.condition_graph = None
        return twin  # pos_keys and key_positions are never written in place: shared

    def __deepcopy__(self, memo):
        return self.clone()  # the modules it reads are shared, never copied

    # -- static only ------------------------------------------------------------------------------
    @property
    def captured(self) -> bool:
        """Whether decode steps replay a CUDA graph."""
        return self._step is not None and self._step.captured

    @property
    def fallback_reason(self) -> str | None:
        return first_fallback_reason([self._step, *self._prefill_steps.values()])

    def prefill_bucket(self, rows: int) -> int | None:
        """The captured step a feed of ``rows`` rows would take now (None: eager)."""
        if self.graph_mode == "eager":
            return None
        return fitting_bucket(PREFILL_BUCKETS, rows, self.capacity - self._length)

    def warm_up_prefill(self) -> None:
        """Run (and so capture) every prefill bucket that fits after the current positions, then
        forget what they wrote: the cache is left as it was."""
        length = self._length
        for bucket in PREFILL_BUCKETS:
            if self.prefill_bucket(bucket) == bucket:
                self.forward(torch.zeros(1, bucket, self.llm.input_size, device=self.device, dtype=self.dtype))
                self._set_length(length)

    def reset(self) -> None:
        """Empty the cache for a new utterance; the captured step stays valid."""
        self.epoch += 1
        self._set_length(0)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """Feed rows (1, t, d) after the positions fed so far (a bucket's captured step, or
        eagerly); returns the AR decoder's outputs (1, t, out), as ``llm.forward_incremental`` would."""
        if rows.dim() != 3 or rows.shape[0] != 1 or rows.shape[1] == 0 or rows.shape[2] != self.llm.input_size:
            raise ValueError(f"rows must be (1, t>0, {self.llm.input_size}), got {tuple(rows.shape)}")
        t = rows.shape[1]
        self._make_room(t)
        self.last_top = None  # (of a decode step's log-probs, not of these rows')
        if (bucket := self.prefill_bucket(t)) is not None:
            hidden = self._prefill(rows, bucket)
        else:
            hidden = self._run(rows.to(self.dtype))
        self._length += t
        if bucket is not None:
            self._sync_position()  # the step moved the device counter past its padding: back to the real end
        return hidden

    def decode_step(self, token: int) -> torch.Tensor:
        """Feed one speech token; returns the log-probs (V+1,) of the next decision, and ``last_top``
        holds their top-k (see ``_token_step``): both the step's output buffers, overwritten by the
        next step (clone what is kept longer; a copy is a kernel launch per token on a GPU)."""
        self._make_room(1)
        if self._step is None:
            self._step = StepGraph(self._token_step, self.device, self.graph_mode, pool=self._pool,
                                   rewind=self._sync_position,
                                   name="speech decoder step")
        self._token.fill_(int(token))
        logp, self.last_top = self._step.run()
        self._length += 1
        return logp

    # -- internals ----------------------------------------------------------------------------------
    def _allocate(self, capacity: int) -> None:
        """(Re)allocate ``capacity`` slots per layer, keeping the positions fed so far."""
        keep = self._length
        with _plain_tensors():
            keys, values, pos_keys = [], [], []
            distances = torch.arange(capacity, device=self.device)
            for i, layer in enumerate(self.llm.encoders):
                attn = layer.self_attn
                shape = (1, attn.h, capacity, attn.d_k)
                # zeros, not empty: masked slots get weight 0, and 0 * NaN would still be NaN
                keys.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
                values.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
                if keep:
                    keys[i][:, :, :keep] = self.keys[i][:, :, :keep]
                    values[i][:, :, :keep] = self.values[i][:, :, :keep]
                table = sinusoid_encoding(distances, attn.h * attn.d_k).to(self.dtype).unsqueeze(0)
                pos_keys.append(attn._split_heads(attn.linear_pos(table)))  # (1, H, capacity, d_k)
            self.keys, self.values, self.pos_keys = keys, values, pos_keys
            self.key_positions = distances
        self.capacity = capacity
        self._step = None  # captured steps are bound to the old tensors
        self._prefill_steps = {}

    def _make_room(self, t: int) -> None:
        needed = self._length + t
        if needed > MAX_CACHED_POSITIONS:
            raise ValueError(f"{needed} positions exceed the relative-position range of cached decoding "
                             f"({MAX_CACHED_POSITIONS}); shorten the utterance")
        if needed > self.capacity:
            self._allocate(min(max(_round_up(needed), 2 * self.capacity), MAX_CACHED_POSITIONS))

    def _set_length(self, length: int) -> None:
        self._length = length
        self._sync_position()

    def _sync_position(self) -> None:
        """Device counter := host length (also the step's rewind after a warm-up run)."""
        self.position.fill_(self._length)

    def _token_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured step: token id buffer -> log-probs (V+1,), and their top-k as one (2k,)
        float32 tensor, [probabilities, ids]: ``TopKSampler``'s softmax and topk, the same calls on
        the same values (so the same numbers), and ids < 2^24 are exact as floats. Graph-safe:
        fixed shapes, the position read from the device counter, no host synchronisation."""
        rows = self.embedding(self._token).unsqueeze(0).to(self.dtype)  # (1, 1, d)
        hidden = self._run(rows)
        logp = self.head(hidden[:, -1]).float().log_softmax(dim=-1)[0]
        probs, ids = logp.softmax(dim=-1).topk(min(TOP_K, logp.shape[-1]))
        return logp, torch.cat([probs, ids.to(probs.dtype)])

    def _prefill(self, rows: torch.Tensor, bucket: int) -> torch.Tensor:
        """``rows`` (1, t, in) through the bucket's captured step: (1, t, out), a copy (the step's
        output buffer is overwritten by its next run)."""
        t = rows.shape[1]
        if bucket not in self._prefill_steps:
            with _plain_tensors():
                self._rows[bucket] = torch.zeros(1, bucket, self.llm.input_size, device=self.device, dtype=self.dtype)
            self._prefill_steps[bucket] = StepGraph(lambda: self._run(self._rows[bucket]), self.device, self.graph_mode,
                                                    pool=self._pool, rewind=self._sync_position,
                                                    name=f"speech decoder prefill ({bucket} rows)")
        buffer = self._rows[bucket]
        buffer[:, :t].copy_(rows)
        buffer[:, t:].zero_()  # (finite padding: its masked keys are weighted 0, and 0 * NaN is NaN)
        return self._prefill_steps[bucket].run()[:, :t].clone()

    def _run(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (1, t, in) at positions position..position+t-1 -> (1, t, out); writes their keys
        and values and advances the device counter (not the host one)."""
        t = rows.shape[1]
        positions = self.position + self.key_positions[:t]  # (t,)
        distance = positions.unsqueeze(1) - self.key_positions.unsqueeze(0)  # (t, capacity): p - j
        visible = (distance >= 0).unsqueeze(0)  # query at p sees the keys at 0..p
        distance = distance.clamp(min=0)
        h = self.llm.embed(rows)
        for layer, keys, values, pos_keys in zip(self.llm.encoders, self.keys, self.values, self.pos_keys):
            h = h + self._attention(layer.self_attn, layer.attention_norm(h), keys, values, pos_keys, positions,
                                    distance, visible)
            h = h + layer.feed_forward(layer.feed_forward_norm(h))
        self.position.add_(t)
        return self.llm.after_norm(h)

    @staticmethod
    def _attention(attn, x, keys, values, pos_keys, positions, distance, visible) -> torch.Tensor:
        """``forward_incremental``'s attention over all slots, writing the new keys/values in place."""
        t = x.shape[1]
        q = attn.linear_q(x).view(1, t, attn.h, attn.d_k)
        keys.index_copy_(2, positions, attn._split_heads(attn.linear_k(x)))
        values.index_copy_(2, positions, attn._split_heads(attn.linear_v(x)))
        by_distance = (q + attn.pos_bias_v).transpose(1, 2) @ pos_keys.transpose(-1, -2)  # (1, H, t, capacity)
        position_scores = by_distance.gather(-1, distance.expand(1, attn.h, t, distance.shape[1]))
        return attn._attend(q, keys, values, position_scores, visible)


@contextlib.contextmanager
def _plain_tensors():
    """Allocate ordinary tensors even inside ``torch.inference_mode`` (a cache made in one decode
    may be written in place by a later one that runs outside it), without autograd."""
    with torch.inference_mode(False), torch.no_grad():
        yield


def _round_up(positions: int) -> int:
    return min(-(-int(positions) // _GROW_QUANTUM) * _GROW_QUANTUM, MAX_CACHED_POSITIONS)
