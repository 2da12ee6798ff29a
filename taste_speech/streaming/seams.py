"""Seam quality of streamed synthesis, measured against offline synthesis of the same tokens with
the same noise (the streaming state's noise tapes replayed into one whole-utterance run).

Figures (all at 22.05 kHz / on the flow's mel):

* ``mel_dist_junction`` vs ``mel_dist_elsewhere``: mean |streamed mel - offline mel| over frames
  within +-2 of a chunk junction, and over all other frames. Streaming cannot equal offline (the
  model is non-causal), but junctions should not be worse than the rest.
* ``mel_step_junction`` vs ``mel_step_elsewhere``: mean frame-to-frame change of the streamed mel
  across junctions and inside chunks (a discontinuity shows up as a larger step).
* ``wave_jump_junction_max`` vs ``wave_jump_p999``: the largest |y[n] - y[n-1]| at the first
  sample of a chunk, and the 99.9th percentile of the same inside chunks (a click is an outlier).
* ``source_jump_junction_max`` vs ``source_jump_p999``: the same for HiFT's harmonic source (the
  excitation; smooth sines in voiced frames, so a phase reset stands out even when the random-weight
  waveform is too noise-like to show it).
* ``wave_err_junction`` vs ``wave_err_elsewhere``: mean |streamed - offline| within 256 samples of
  a junction and elsewhere.
* ``length_diff_samples``: streamed length minus offline length.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable, Optional

import torch

from taste_speech.streaming.synthesis import SpeechChunk, offline_reference, speak, start_speaking
from taste_speech.streaming.synthesis_state import EmissionPolicy
from taste_speech.voice_generator import VoiceGenerator


@dataclass
class SeamReport:
    policy: str
    chunk_tokens: int
    n_tokens: int
    n_chunks: int
    n_junctions: int
    first_audio_after_tokens: int  # speech tokens fed before the first non-empty chunk
    first_chunk_ms: float
    mel_dist_junction: float
    mel_dist_elsewhere: float
    mel_step_junction: float
    mel_step_elsewhere: float
    wave_jump_junction_max: float
    wave_jump_p999: float
    source_jump_junction_max: float
    source_jump_p999: float
    wave_err_junction: float
    wave_err_elsewhere: float
    length_diff_samples: int

    def as_dict(self) -> dict:
        return asdict(self)


def seam_figures(chunks: list[SpeechChunk], offline_mel: torch.Tensor, offline_wav: torch.Tensor) -> dict:
    """The figures of the module docstring for streamed ``chunks`` against an offline run."""
    mel = torch.cat([c.mel for c in chunks], dim=-1)[0]
    wav = torch.cat([c.audio_22k for c in chunks], dim=-1)[0]
    ref_mel, ref_wav = offline_mel[0], offline_wav[0]
    figures = {"length_diff_samples": int(wav.shape[-1] - ref_wav.shape[-1])}
    n = min(mel.shape[-1], ref_mel.shape[-1])
    mel_junctions = [c.first_frame for c in chunks if c.mel.shape[-1] and c.first_frame > 0]
    near = torch.zeros(n, dtype=torch.bool)
    for j in mel_junctions:
        near[max(0, j - 2):j + 3] = True
    dist = (mel[:, :n] - ref_mel[:, :n]).abs().mean(dim=0)
    figures["mel_dist_junction"] = float(dist[near].mean()) if near.any() else 0.0
    figures["mel_dist_elsewhere"] = float(dist[~near].mean())
    step = (mel[:, 1:] - mel[:, :-1]).abs().mean(dim=0)  # step[i]: frame i -> i + 1
    across = torch.zeros_like(step, dtype=torch.bool)
    across[[j - 1 for j in mel_junctions if 0 < j <= step.shape[0]]] = True
    figures["mel_step_junction"] = float(step[across].mean()) if across.any() else 0.0
    figures["mel_step_elsewhere"] = float(step[~across].mean())

    wave_junctions = [c.first_sample for c in chunks if c.audio_22k.shape[-1] and c.first_sample > 0]
    jump = (wav[1:] - wav[:-1]).abs()  # jump[i]: sample i -> i + 1
    at = torch.zeros_like(jump, dtype=torch.bool)
    at[[s - 1 for s in wave_junctions if 0 < s <= jump.shape[0]]] = True
    figures["wave_jump_junction_max"] = float(jump[at].max()) if at.any() else 0.0
    figures["wave_jump_p999"] = float(torch.quantile(jump[~at].double(), 0.999))
    source = torch.cat([c.source_22k for c in chunks], dim=-1)[0]
    source_jump = (source[1:] - source[:-1]).abs()
    figures["source_jump_junction_max"] = float(source_jump[at].max()) if at.any() else 0.0
    figures["source_jump_p999"] = float(torch.quantile(source_jump[~at].double(), 0.999))
    m = min(wav.shape[-1], ref_wav.shape[-1])
    err = (wav[:m] - ref_wav[:m]).abs()
    close = torch.zeros(m, dtype=torch.bool)
    for s in wave_junctions:
        close[max(0, s - 256):s + 256] = True
    figures["wave_err_junction"] = float(err[close].mean()) if close.any() else 0.0
    figures["wave_err_elsewhere"] = float(err[~close].mean())
    figures["n_junctions"] = len(wave_junctions)
    return figures


@torch.inference_mode()
def measure_seams(
    vg: VoiceGenerator,
    tokens: torch.Tensor,
    speaker_embeds: torch.Tensor,
    policy: EmissionPolicy | str = "low_latency",
    seed: int = 0,
    feed_sizes: Optional[Iterable[int]] = None,
) -> tuple[SeamReport, list[SpeechChunk]]:
    """Stream ``tokens`` (1, N) (fed ``feed_sizes`` at a time, default one by one like a speech
    decoder), then compare with the offline run of the same tokens and noise."""
    policy = EmissionPolicy.resolve(policy)
    state = start_speaking(vg, speaker_embeds, policy, out_sampling_rate=22050,
                           generator=torch.Generator().manual_seed(seed))
    chunks: list[SpeechChunk] = []
    first_audio_after = None
    position, sizes = 0, iter(feed_sizes or [])
    while position < tokens.shape[1]:
        size = next(sizes, 1)
        piece = tokens[:, position:position + size]
        position += piece.shape[1]
        for chunk in speak(vg, state, piece):
            chunks.append(chunk)
            if first_audio_after is None and chunk.audio_22k.shape[-1]:
                first_audio_after = position
    chunks += speak(vg, state, final=True)
    offline_mel, offline_wav = offline_reference(vg, state, tokens)
    figures = seam_figures(chunks, offline_mel, offline_wav)
    first = next((c for c in chunks if c.audio_22k.shape[-1]), None)
    report = SeamReport(
        policy=policy.name, chunk_tokens=policy.chunk_tokens, n_tokens=tokens.shape[1], n_chunks=len(chunks),
        first_audio_after_tokens=first_audio_after or tokens.shape[1],
        first_chunk_ms=0.0 if first is None else 1000.0 * first.audio_22k.shape[-1] / 22050,
        **figures,
    )
    return report, chunks
