"""The audio tower's text side as captured steps: encoder states + transcript -> TASTE codes.

After the Whisper encoder (``encoder_graph``), a turn's TASTE codes come from the tower's text
side: the 2-layer Whisper decoder as attention pooler over the transcript's tokens, the word means,
the 4-level RVQ search. Eager that is a few hundred small kernels and several host reads (the
word count, the codebook checks), each of which waits for everything queued on the GPU: at batch 1
launch-bound, and with many calls on one GPU each host read also waits for the other calls' work.

``PoolerGraph`` runs it as one step per length bucket - the decoder's input (prompt + transcript +
<|endoftext|>) padded to 16, 32 ... tokens - replayed as a CUDA graph on CUDA:

- the decoder's self-attention is causal, so the padding after <|endoftext|> changes no real row
  in exact arithmetic (on a CPU the codes are the eager ones bit for bit; on a GPU a matrix
  product over more rows may pick another kernel and round differently, which moves a code only
  where two codes are about equally near);
- the word runs (which rows average together) are computed on the host from the word ids, which
  are host data anyway, and copied in (``word_alignment.mean_pool_runs``: the eager pooling's
  own arithmetic); padded rows are runs of their own and are dropped at the end;
- nothing reads the GPU from the host: the codes are handed back on the device, and the caller's
  first read of them (``taste_tokenize``'s) is the turn's one wait.

The model is the tower's own (``attention_pool``, ``mean_pool_runs``, ``rvq.quantize``): the same
functions the eager path runs, at a padded shape. Calls share one ``PoolerGraph``; a step runs for
one turn at a time (its GPU work is a fraction of a millisecond), on the caller's stream, and the
next turn's inputs wait for the last step's reads (an event), as the calls may run on streams of
their own. Moving or casting the tower (any of the decoder's or the RVQ's tensors in new storage)
is detected and the steps are rebuilt.
"""

from __future__ import annotations

import threading

import torch

from taste_speech.encoder_graph import event_after_current_work
from taste_speech.step_graph import StepGraph, all_captured, first_fallback_reason, resolve_mode, smallest_bucket
from taste_speech.word_alignment import mean_pool_runs, word_runs

MIN_BUCKET = 16  # decoder tokens of the smallest step (the prompt and <|endoftext|> take 5)


def buckets_for(max_tokens: int) -> list[int]:
    """16, 32, 64 ... doubling, the last one ``max_tokens`` (the decoder's positions)."""
    sizes, size = [], MIN_BUCKET
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return sizes + [max_tokens]


class PoolerGraph:
    def __init__(self, tower, graph_mode: str = "auto"):
        """``tower``: a ``TasteAudioTower``; ``graph_mode`` as ``step_graph.StepGraph`` takes it ('auto':
        a CUDA graph on CUDA, eager elsewhere; 'rehearse': the capture protocol on any device)."""
        self.tower, self.graph_mode = tower, graph_mode
        self.skip = tower.skip_prefix_idx  # the prompt's rows, dropped before the word pooling
        self.buckets = buckets_for(tower.whisper_config.max_target_positions)
        self._lock = threading.Lock()
        self._last_step = None  # CUDA: an event after the last step and its copy
        self.turns = 0
        self._reset()

    @property
    def mode(self) -> str:
        """'graph', 'eager' or 'rehearse': what ``graph_mode`` means on the tower's device."""
        return resolve_mode(self.graph_mode, self.device)

    @property
    def captured(self) -> bool:
        """Every step made so far is a captured graph (and one was made)."""
        return all_captured(self._steps.values())

    @property
    def fallback_reason(self) -> str | None:
        """Why a step runs eagerly where a graph was asked for, if one does."""
        return first_fallback_reason(self._steps.values())

    @torch.inference_mode()
    def __call__(self, decoder_input_ids: torch.Tensor, keys_from: torch.Tensor, values_from: torch.Tensor,
                 word_ids: torch.Tensor) -> torch.Tensor:
        """The tower's ``forward`` from its encoder states on, for one turn: ``decoder_input_ids``
        (1, L+5) (``tower.decoder_input_ids``), ``keys_from`` / ``values_from`` (1, S, d) (the
        encoder's last and target hidden states), ``word_ids`` (1, L) -> ``asr_indices`` (1, L, K)
        int64 on the tower's device, the turn's own. Ids may be on any device (read on the host)."""
        ids = decoder_input_ids.reshape(-1).cpu()
        words = word_ids.reshape(-1).cpu()
        n = words.shape[0]
        if ids.shape[0] != n + self.skip + 1:
            raise ValueError(f"decoder_input_ids has {ids.shape[0]} tokens for {n} word ids: give the "
                             f"prompt, the transcript and <|endoftext|> ({n + self.skip + 1} tokens)")
        size = smallest_bucket(self.buckets, ids.shape[0])
        if size is None:
            raise ValueError(f"the decoder takes at most {self.buckets[-1]} tokens, got {ids.shape[0]}: split the turn")
        inputs = self._host_inputs(ids, words, size)
        with self._lock:
            self._check_weights()
            stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
            if self._last_step is not None:  # the last step (maybe another call's stream) has read its inputs
                stream.wait_event(self._last_step)
            self.inputs.copy_(inputs, non_blocking=True)
            self.keys.copy_(keys_from)
            self.values.copy_(values_from)
            codes = self._step(size).run()[:n]
            with torch.inference_mode(False):  # the turn's own copy, a normal tensor (as the eager path's)
                codes = codes.unsqueeze(0).clone()
            self._last_step = event_after_current_work(self.device)
            self.turns += 1
        return codes

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Make every bucket's step now (a capture each on CUDA), so that no turn pays for one."""
        with self._lock:
            self._check_weights()
            if self._last_step is not None:  # a turn's step on another stream has read the buffers
                torch.cuda.current_stream(self.device).wait_event(self._last_step)
            self.inputs.zero_()  # (run 0 of size 0 everywhere: every row its own, nothing averaged)
            for size in reversed(self.buckets):  # largest first: the others reuse its pool memory
                self._step(size).run()
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
                self._last_step = None

    # -- internals ------------------------------------------------------------------------------
    def _host_inputs(self, ids: torch.Tensor, words: torch.Tensor, size: int) -> torch.Tensor:
        """(3, largest bucket) int64: the decoder ids padded with <|endoftext|> to ``size``, each
        pooled row's run and run size (the transcript's word runs, then one run per row for
        <|endoftext|> and the padding); pinned on CUDA, so that copying it in does not wait for the GPU."""
        run, sizes = word_runs(words)
        out = torch.zeros(3, self.buckets[-1], dtype=torch.long)  # (all of it: one contiguous copy)
        out[0, :ids.shape[0]] = ids
        out[0, ids.shape[0]:size] = ids[-1]
        out[1, :size - self.skip] = torch.arange(size - self.skip)
        out[1, :words.shape[0]] = run
        out[2, :size - self.skip] = 1
        out[2, :words.shape[0]] = sizes
        return out.pin_memory() if self.device.type == "cuda" else out

    def _codes(self, size: int) -> torch.Tensor:
        """The step of one bucket (graph-safe: reads only the static buffers) -> (size - skip, K)."""
        rows = size - self.skip
        states, _ = self.tower.attention_pool(self.inputs[0:1, :size], keys_from=self.keys, values_from=self.values)
        # fp32 from the prompt's end on, as the eager forward (the original's final LayerNorm and RVQ)
        pooled = mean_pool_runs(states[0, self.skip:].float(), self.inputs[1, :rows], self.inputs[2, :rows])
        return self.tower.rvq.quantize(pooled)

    def _step(self, size: int) -> StepGraph:
        if size not in self._steps:
            self._steps[size] = StepGraph(lambda: self._codes(size), self.device, self.graph_mode,
                                          pool=self._pool, name=f"audio tower pooler x{size}")
        return self._steps[size]

    def _weights(self):
        """Where the steps' weights live: every parameter and buffer of the decoder and the RVQ."""
        weight = self.tower.decoder.embed_tokens.weight
        tensors = [*self.tower.decoder.parameters(), *self.tower.decoder.buffers(), *self.tower.rvq.parameters(),
                   *self.tower.rvq.buffers()]
        return (weight.device, weight.dtype, *(t.data_ptr() for t in tensors))

    def _check_weights(self) -> None:
        """A graph replays the weights at the addresses it was captured with: rebuild after a move or cast."""
        if self._weights() != self._fingerprint:
            self._reset()

    def _reset(self) -> None:
        if self._last_step is not None:  # the old buffers are freed: no queued kernel may still use them
            self._last_step.synchronize()
            self._last_step = None
        self.tower.rvq.check_initialised()  # (a host read: once here, not per turn as the eager path)
        self._fingerprint = self._weights()
        self.device, dtype = self._fingerprint[:2]
        frames, width = self.tower.whisper_config.max_source_positions, self.tower.whisper_config.d_model
        self.inputs = torch.zeros(3, self.buckets[-1], dtype=torch.long, device=self.device)
        self.keys = torch.zeros(1, frames, width, device=self.device, dtype=dtype)
        self.values = torch.zeros(1, frames, width, device=self.device, dtype=dtype)
        # one pool for every bucket's graph: one step runs at a time, its codes are copied out at once
        cuda_graphs = self.device.type == "cuda" and self.graph_mode != "eager"
        self._pool = torch.cuda.graph_pool_handle() if cuda_graphs else None
        self._steps: dict[int, StepGraph] = {}
