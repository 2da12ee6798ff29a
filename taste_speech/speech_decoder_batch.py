"""SpeechStepBatch: the one-token decode steps of many calls' speech decoders, run as one batched step.

The speech decoder's AR transformer decodes one speech token per step; at batch 1 a step is bound
by its kernel launches (our H100 notes, docs/GPU.md), so calls stepping at the same time share one forward,
as ``lm_batch`` does for the spoken LM (the slot and step bookkeeping is ``batched_steps``).

Storage: per layer ``(slots, heads, capacity + 1, d_k)`` keys and values, and the projected
positional keys of the distances 0..capacity (they depend only on the weights: shared by all
slots). A slot's positions 0..length-1 hold its utterance; position ``capacity`` is a scratch
column that a slot without a step of its own writes in a batched step (its output is dropped).
The attention is ``StaticSpeechCache``'s relative-position math with one position per row: the
query of row b at position p_b scores key j against the positional key of distance p_b - j and
sees the keys at or before p_b. A batched step - token embedding, AR decoder, output layer,
log-softmax for the first n slots - is one ``StepGraph`` per n (captured on CUDA).

A call uses its slot through ``SlotSpeechCache`` (``StaticSpeechCache``'s interface: ``start``,
``feed`` and ``step`` of ``TasteSpeechDecoder`` take it): the prefix and forced tokens run eagerly
on the slot alone, one-token steps join the batch. No free slot, or an utterance longer than
``capacity``: the cache continues in a private ``StaticSpeechCache``. ``close()`` frees the slot.
"""

from __future__ import annotations

import torch

from taste_speech.batched_steps import BatchedSteps, SlotCache
from taste_speech.device_copies import copy_in
from taste_speech.espnet_transformer import MAX_CACHED_POSITIONS, sinusoid_encoding
from taste_speech.speech_decoder_cache import DEFAULT_CAPACITY, StaticSpeechCache, _plain_tensors
from taste_speech.step_graph import resolve_mode


class SpeechStepBatch(BatchedSteps):
    name = "speech decoder step"

    def __init__(self, decoder, slots: int = 16, capacity: int = DEFAULT_CAPACITY, graph_mode: str = "auto",
                 gather: float = 0.5):
        """``decoder``: a ``TasteSpeechDecoder``; ``slots``: calls batched at most; ``capacity``:
        positions per call (prefix plus tokens of one utterance); ``graph_mode``: see
        ``step_graph``; ``gather``: see ``batched_steps``."""
        super().__init__(slots, gather)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity < MAX_CACHED_POSITIONS:
            raise ValueError(f"capacity must be 1..{MAX_CACHED_POSITIONS - 1} positions, got {capacity!r}")
        if not decoder.llm.causal:
            raise ValueError("batched decoding needs a causal AR decoder")
        self.decoder, self.llm, self.capacity = decoder, decoder.llm, capacity
        self.device, self.dtype = decoder.device, decoder.dtype
        self.graph_mode = resolve_mode(graph_mode, self.device)
        with _plain_tensors():
            self._key_positions = torch.arange(capacity + 1, device=self.device)  # + the scratch column
            self._keys, self._values, self._pos_keys = [], [], []
            for layer in self.llm.encoders:
                attn = layer.self_attn
                shape = (slots, attn.h, capacity + 1, attn.d_k)
                self._keys.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
                self._values.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
                table = sinusoid_encoding(self._key_positions, attn.h * attn.d_k).to(self.dtype).unsqueeze(0)
                self._pos_keys.append(attn._split_heads(attn.linear_pos(table)))  # (1, H, capacity + 1, d_k)
            self._tokens = torch.zeros(slots, dtype=torch.long, device=self.device)
            self._positions = torch.full((slots,), capacity, dtype=torch.long, device=self.device)

    def open(self) -> "SlotSpeechCache":
        """A cache for one call's utterances: in a free slot, or private when every slot is taken."""
        return SlotSpeechCache(self)

    # -- feeding -----------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, slot: int, owner: "SlotSpeechCache", rows: torch.Tensor) -> torch.Tensor:
        """Rows (1, t, in) after the slot's positions, eagerly, this slot alone -> (1, t, out)."""
        with self._using(slot, owner):
            start, t = self.length(slot), rows.shape[1]
            positions = start + self._key_positions[:t]
            distance = positions.unsqueeze(1) - self._key_positions.unsqueeze(0)  # (t, capacity + 1)
            visible = (distance >= 0).unsqueeze(0)
            distance = distance.clamp(min=0)
            h = self.llm.embed(rows.to(self.dtype))
            for layer, keys, values, pos_keys in zip(self.llm.encoders, self._keys, self._values, self._pos_keys):
                h = h + StaticSpeechCache._attention(layer.self_attn, layer.attention_norm(h), keys[slot:slot + 1],
                                                     values[slot:slot + 1], pos_keys, positions, distance, visible)
                h = h + layer.feed_forward(layer.feed_forward_norm(h))
            self.set_length(slot, start + t)
            return self.llm.after_norm(h)

    def step(self, slot: int, owner: "SlotSpeechCache", token: int) -> torch.Tensor:
        """Feed one speech token in the next batched step; returns the log-probs (V+1,) after it."""
        return self._step(slot, owner, int(token))

    # -- internals ---------------------------------------------------------------------------------
    def _decode(self, n: int) -> torch.Tensor:
        """Token buffer -> log-probs (n, V+1) for the first ``n`` slots, each at its own position
        (graph-safe: static buffers, no host synchronisation)."""
        positions = self._positions[:n]
        slots = torch.arange(n, device=self.device)
        distance = positions.unsqueeze(1) - self._key_positions.unsqueeze(0)  # (n, capacity + 1): p_b - j
        visible = (distance >= 0).unsqueeze(1)  # (n, 1, capacity + 1)
        distance = distance.clamp(min=0)
        h = self.llm.embed(self.decoder.speech_embedding(self._tokens[:n]).unsqueeze(1).to(self.dtype))
        for layer, keys, values, pos_keys in zip(self.llm.encoders, self._keys, self._values, self._pos_keys):
            attn = layer.self_attn
            x = layer.attention_norm(h)
            q = attn.linear_q(x).view(n, 1, attn.h, attn.d_k)
            keys[slots, :, positions] = attn._split_heads(attn.linear_k(x))[:, :, 0]
            values[slots, :, positions] = attn._split_heads(attn.linear_v(x))[:, :, 0]
            by_distance = (q + attn.pos_bias_v).transpose(1, 2) @ pos_keys.transpose(-1, -2)  # (n, H, 1, capacity + 1)
            position_scores = by_distance.gather(-1, distance[:, None, None, :].expand(n, attn.h, 1, distance.shape[1]))
            h = h + attn._attend(q, keys[:n], values[:n], position_scores, visible)
            h = h + layer.feed_forward(layer.feed_forward_norm(h))
        hidden = self.llm.after_norm(h)
        return self.decoder.llm_decoder(hidden[:, -1]).float().log_softmax(dim=-1)

    @torch.no_grad()
    def _run(self, batch: dict[int, int]) -> dict[int, torch.Tensor]:
        n = self.step_size(batch)
        positions, tokens = [self.capacity] * n, [0] * n
        for slot, token in batch.items():
            positions[slot], tokens[slot] = self.length(slot), token
        copy_in(self._positions[:n], positions)  # (no wait for the GPU before the step is launched)
        copy_in(self._tokens[:n], tokens)
        logp = self._graph(n).run()
        return {slot: logp[slot].clone() for slot in batch}  # (no wait for the GPU: see lm_batch)


class SlotSpeechCache(SlotCache):
    """One call's speech-decoder cache in a ``SpeechStepBatch`` slot (``StaticSpeechCache``'s interface)."""

    def __init__(self, batch: SpeechStepBatch):
        self.llm = batch.llm  # (TasteSpeechDecoder.start checks the cache is its own)
        self.epoch = 0  # bumped by reset(): a decode started before can tell (TasteSpeechDecoder checks it)
        self.last_top: torch.Tensor | None = None  # (see decode_step)
        super().__init__(batch)

    def truncate(self, length: int) -> None:
        self._check_open()
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        if self.private is not None:
            self.private.truncate(length)
        else:
            self.batch.set_length(self.slot, length)

    def reset(self) -> None:
        """Empty the cache for a new utterance (keeps the slot)."""
        self.epoch += 1
        self.truncate(0)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """Feed rows (1, t, in) eagerly; returns the AR decoder's outputs (1, t, out)."""
        if rows.dim() != 3 or rows.shape[0] != 1 or rows.shape[1] == 0 or rows.shape[2] != self.llm.input_size:
            raise ValueError(f"rows must be (1, t>0, {self.llm.input_size}), got {tuple(rows.shape)}")
        if self._use_private(rows.shape[1]):
            return self.private.forward(rows)
        return self.batch.prefill(self.slot, self, rows)

    def decode_step(self, token: int) -> torch.Tensor:
        """Feed one speech token (batched with the other calls' steps); returns the log-probs (V+1,).
        ``last_top``: their top-k where the step computed it (a private cache's step), else None."""
        if self._use_private(1):
            logp = self.private.decode_step(token)
            self.last_top = self.private.last_top
            return logp
        self.last_top = None
        return self.batch.step(self.slot, self, token)

    def clone(self) -> StaticSpeechCache:
        """A private copy (it holds no slot)."""
        if self.closed:
            raise RuntimeError("cannot copy a closed cache")
        return self.private.clone() if self.private is not None else self._private_copy()

    def __deepcopy__(self, memo):
        return self.clone()

    def _new_private(self) -> StaticSpeechCache:
        return StaticSpeechCache(self.batch.decoder, graph_mode=self.batch.graph_mode)

    def _private_copy(self) -> StaticSpeechCache:
        n, slot = self.length, self.slot
        copy = StaticSpeechCache(self.batch.decoder, max(n + 1, DEFAULT_CAPACITY), graph_mode=self.batch.graph_mode)
        with _plain_tensors():
            for mine, theirs, keys, values in zip(copy.keys, copy.values, self.batch._keys, self.batch._values):
                mine[:, :, :n] = keys[slot:slot + 1, :, :n]
                theirs[:, :, :n] = values[slot:slot + 1, :, :n]
        copy._set_length(n)
        return copy
