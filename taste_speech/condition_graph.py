"""ConditionGraph: a segment's conditioning of the speech decoder as captured steps, one per length bucket.

Each segment's speech starts from its words (``TasteSpeechDecoder.condition``): their Whisper tokens
through the text encoder, their TASTE embeddings through the TASTE encoder, the two fused. Eagerly
that is every block of two transformers, some hundreds of kernel launches per segment at the real
size. Here the tokens are padded to the smallest of ``BUCKETS`` that holds them and that bucket's
step is replayed (a CUDA graph on CUDA; ``step_graph``). Both encoders are causal (chunk 1, as
published), so rows padded after the real ones change nothing before them, and the padded rows'
outputs are dropped. A decoder whose text encoder sees the whole sequence is not served (eager).

A ConditionGraph owns its input buffers, so it serves one call: the call's static speech-decoder
cache keeps it (``TasteSpeechDecoder.condition_graph``).
"""

from __future__ import annotations

import torch

from taste_speech.step_graph import StepGraph, first_fallback_reason, smallest_bucket

# Whisper tokens of the words a segment's speech is conditioned on (the previous segment's and its own)
BUCKETS = (16, 32, 64, 128)


class ConditionGraph:
    def __init__(self, decoder, graph_mode: str):
        """``decoder``: a ``TasteSpeechDecoder`` with causal encoders (``serves``); ``graph_mode``:
        see ``step_graph`` (resolved: 'graph' or 'rehearse')."""
        if not self.serves(decoder):
            raise ValueError("padded conditioning steps need causal text and TASTE encoders (static chunk size 1)")
        self.decoder, self.graph_mode = decoder, graph_mode
        self._ids: dict[int, torch.Tensor] = {}  # static inputs per bucket
        self._audio: dict[int, torch.Tensor] = {}
        self._steps: dict[int, StepGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if graph_mode == "graph" else None  # steps run one at a time

    @staticmethod
    def serves(decoder) -> bool:
        return bool(decoder.text_encoder.causal and decoder.audio_token_encoder.causal)

    @property
    def captured(self) -> bool:
        return bool(self._steps) and all(step.captured for step in self._steps.values())

    @property
    def fallback_reason(self) -> str | None:
        return first_fallback_reason(self._steps.values())

    @staticmethod
    def bucket(tokens: int) -> int | None:
        """The step ``tokens`` tokens take (None: more than the largest bucket, eager)."""
        return smallest_bucket(BUCKETS, tokens)

    def encode(self, audio_unit_embeds: torch.Tensor, asr_token_ids: torch.Tensor) -> tuple | None:
        """(text, audio, fused) encodings, each (1, L, d), of device inputs (1, L, in) and (1, L), as
        ``encode_text``, ``encode_audio`` and the fusion give them; None when no bucket holds L."""
        n = asr_token_ids.shape[1]
        bucket = self.bucket(n)
        if bucket is None:
            return None
        if bucket not in self._steps:
            self._make(bucket)
        ids, audio = self._ids[bucket], self._audio[bucket]
        ids[:, :n].copy_(asr_token_ids)
        ids[:, n:].zero_()  # (any valid id: causal rows before it never see it)
        audio[:, :n].copy_(audio_unit_embeds)
        audio[:, n:].zero_()
        return tuple(out[:, :n].clone() for out in self._steps[bucket].run())  # (outputs are overwritten next run)

    def warm_up(self) -> None:
        """Run (and so capture) every bucket's step once."""
        for bucket in BUCKETS:
            if bucket not in self._steps:
                self._make(bucket)
            self._steps[bucket].run()

    def _make(self, bucket: int) -> None:
        d = self.decoder
        with torch.inference_mode(False):  # (writable whatever mode later segments run in)
            self._ids[bucket] = torch.zeros(1, bucket, dtype=torch.long, device=d.device)
            self._audio[bucket] = torch.zeros(1, bucket, d.audio_input_size, dtype=d.dtype, device=d.device)
        self._steps[bucket] = StepGraph(lambda: self._encode(bucket), d.device, self.graph_mode, pool=self._pool,
                                        name=f"speech decoder conditioning ({bucket} tokens)")

    def _encode(self, bucket: int) -> tuple:
        d = self.decoder
        text = d.encode_text(self._ids[bucket])
        audio = d.encode_audio(self._audio[bucket])
        return text, audio, d.fuse_encoded_audio_text_module(audio, text)
