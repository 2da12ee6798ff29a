"""The audio tower's Whisper encoder as one captured step (a CUDA graph on CUDA).

The encoder always runs at one shape - the turn's log-mel right-padded to the whole window (30 s,
3000 frames, for the published model) - so it needs no buckets: one graph serves every turn. Eager
it is ~500 launches and launch-bound on a GPU (``GPU_NOTES.md``: 16 ms for Whisper-large-v3's
encoder, the same for 3 s or 30 s of audio); replayed, what is left is the GPU's own work.

An :class:`EncoderGraph` belongs to one audio tower on one device and holds the static input
buffer and the step; calls share it (one turn at a time: a lock around copy-in, replay, copy-out;
on CUDA each turn also waits for the last one's queued kernels, which calls running on streams of
their own do not wait for otherwise).
It is passed explicitly (``taste_tokenize(..., encoder=...)``, ``TasteEngine`` makes one on the
CUDA fast path), so a model shared by an eager engine and a graphed one keeps both. Moving or
casting the tower is detected and the step is rebuilt. Its memory: the input window, the two
outputs and the graph's private pool (the largest layer's activations).
"""

from __future__ import annotations

import threading

import torch

from taste_speech.step_graph import StepGraph


class EncoderGraph:
    def __init__(self, tower, graph_mode: str = "auto"):
        """``tower``: a ``TasteAudioTower``; ``graph_mode`` as ``step_graph.StepGraph`` takes it
        ('auto': a CUDA graph on CUDA, eager elsewhere; 'rehearse': the capture protocol on any device)."""
        self.tower, self.graph_mode = tower, graph_mode
        self._lock = threading.Lock()
        self._last_turn = None  # CUDA: an event after the last turn's replay and copy-out
        self._reset()

    @property
    def mode(self) -> str:
        return self.step.mode

    @torch.inference_mode()
    def __call__(self, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``window`` (1, n_mels, frames): the padded log-mel (``tower.encoder_window``) ->
        (target_hidden, last_hidden), each (1, S, d), the tower's own copies."""
        with self._lock:
            if self._weights() != self._fingerprint:
                self._reset()
            if self._last_turn is not None:  # (a no-op when the last turn ran on this thread's stream)
                torch.cuda.current_stream(self.window.device).wait_event(self._last_turn)
            self.window.copy_(window)
            target, last = self.step.run()
            out = target.clone(), last.clone()  # the next turn overwrites the step's outputs
            if self.window.is_cuda:
                self._last_turn = torch.cuda.Event()
                self._last_turn.record(torch.cuda.current_stream(self.window.device))
            return out

    def warm_up(self) -> None:
        """Capture now (on a silent window), so that the first turn does not pay for it."""
        self(torch.zeros_like(self.window))

    def _weights(self):
        weight = self.tower.encoder.conv1.weight
        return weight.device, weight.dtype, weight.data_ptr()

    def _reset(self) -> None:
        if self._last_turn is not None:  # the old buffers are freed: no queued kernel may still use them
            self._last_turn.synchronize()
        self._fingerprint = self._weights()
        device, dtype = self._fingerprint[:2]
        shape = (1, self.tower.whisper_config.num_mel_bins, self.tower.num_frames)
        self.window = torch.zeros(shape, device=device, dtype=dtype)
        self.step = StepGraph(lambda: self.tower.encoder_stack(self.window), device, self.graph_mode,
                              name="audio tower encoder")
