"""Explicit state of streaming speech synthesis (speech tokens -> audio chunks), one object per call.

Nothing here is global: a :class:`SynthesisState` holds everything that must survive between
chunks of one utterance (or of consecutive segments that continue one utterance):

* the speech tokens still needed as left context (a bounded window, with their absolute offset);
* the noise "tapes": the flow's ODE start noise per mel frame and HiFT's source noise per sample,
  drawn in fixed blocks from per-tape generators, so a frame's noise does not depend on how the
  stream was chunked (and an offline run can be given exactly the same noise);
* the finalised mel of the last frames (the flow's prompt for the next window with
  ``prompt_with_emitted_mel``) and the provisional mel of the frames just after them (cross-faded
  with the next window's estimate);
* the vocoder's finalised mel/source context, the per-harmonic cycle position reached by the
  harmonic source (phase carried across chunks), and the provisional waveform tail;
* the output resampler (22.05 kHz -> the caller's rate) and emission counters;
* which synthesis path its steps take: ``graphs`` (a ``SynthesisGraphs``: fixed-shape bucketed
  steps, CUDA graphs on CUDA), or None for the dynamic eager path (the reference, CPU default).

:class:`EmissionPolicy` decides when chunks are emitted and how much context each one uses; the
two named regimes are ``low_latency`` and ``quality``.
"""

from __future__ import annotations

import math
import numbers
import threading
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from taste_speech.device_copies import to_device

SAMPLES_PER_FRAME = 256  # HiFT: 22050 Hz output, one mel frame per 256 samples
SOURCE_RATE = 22050
SUPPORTED_OUTPUT_RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)


def resampler_quality(out_sampling_rate: int) -> str:
    """soxr's quality for streaming to ``out_sampling_rate``. HQ holds back audio in proportion to
    1 / rate - 16 ms at 24 kHz, 27 ms at 16 kHz, but 60 ms at 8 kHz: a reply's first chunk (128 ms)
    then brought 67 ms, and phone lines ran dry after the first syllable. LQ holds back 5.5 ms at
    8 kHz; it is flat to 3 kHz and -3 dB at 3.25 kHz (the phone band ends at 3.4 kHz), and keeps
    aliases over 100 dB down."""
    return "LQ" if out_sampling_rate <= 8000 else "HQ"


def frames_for_tokens(n_tokens: int) -> int:
    """Mel frames of the first ``n_tokens`` tokens on the utterance's global grid: floor(n * 441 / 256)
    (upstream's float32 formula gives the same for n <= 5000)."""
    return n_tokens * 441 // 256


def token_of_frame(frame: int) -> int:
    """Token whose features a mel frame copies (the nearest-neighbour stretch at 441/256 frames per token)."""
    return frame * 256 // 441


@dataclass(frozen=True)
class EmissionPolicy:
    """When chunks are emitted and how much context they use (all counts in speech tokens (20 ms),
    mel frames (256 samples, 11.6 ms) or 22.05 kHz samples).

    first_chunk_tokens: tokens that complete the first chunk (plus ``lookahead_tokens`` before it is emitted).
    chunk_tokens: tokens per steady chunk (the least, when chunks grow).
    max_chunk_tokens: 0, or the most a steady chunk grows to: each covers half the tokens already
        emitted (at least ``chunk_tokens``). The audio queued by then pays for waiting for the bigger
        chunk (it needs production only 1.5x faster than real time), and a step's fixed cost - its
        kernel launches on a GPU, the re-encoded left context everywhere - is paid less often per
        second of audio (on the H100 a 24 s reply's synthesis took 0.064 s per audio second with
        chunks growing to 100 tokens, 0.046 growing to 300: BENCHMARKS.md section 5). Keep context +
        chunk + lookahead within the largest synthesis bucket (``synthesis_graphs.FLOW_BUCKETS``:
        640 frames, 371 tokens) or big chunks run eagerly on a GPU.
    lookahead_tokens: right context the flow waits for before finalising a chunk's frames.
    context_tokens: left context re-encoded with every chunk; bounds the per-chunk cost.
    mel_crossfade_frames: frames of provisional mel cross-faded into the next chunk.
    vocoder_context_frames / vocoder_lookahead_frames: HiFT's left context / held-back frames.
    wave_crossfade_samples: provisional waveform overlap-added into the next chunk (<= held-back audio).
    fade_in_ms: fade at the very start of the audio; fade_out_ms: fade at the end of the final chunk.
    prompt_with_emitted_mel: give the flow the already emitted mel of the left context as its prompt
        (the CFM's ``cond``, upstream's prompt mechanism) so new frames continue it. Off by default:
        TASTE never prompts the flow, and on the random reference weights it moved the output
        further from offline synthesis (see benchmarks/bench_synthesis.py); worth re-measuring
        with trained weights.
    carry_source_phase: continue each harmonic's phase across chunks (False restarts it per chunk, as
        calling HiFT chunk by chunk does: only useful to measure what the carry prevents).
    window_frames: flow window sizes (mel frames) a window is widened to, leftwards, with more of the
        already final speech as context: the smallest size that holds it, as far as the utterance
        reaches back. A window of a size with an unpadded step of its own on the bucketed path
        (``SynthesisGraphs.full_flow_frames``) runs that step (no masked statistics:
        ``benchmarks/bench_flow_kernels.py``). Only sizes whose window starts
        on the flow's 2-frame grid count (``synthesis._window_start``). None (default): the
        bucketed path's unpadded sizes (``synthesis_graphs.FULL_FLOW_WINDOWS``; on a GPU the
        padding frames were computed anyway), no widening on the dynamic path (on a CPU every
        frame costs time); () never widens. Chunk boundaries, and so the audio's timing, do not
        change.
    """

    name: str = "custom"
    first_chunk_tokens: int = 10
    chunk_tokens: int = 25
    max_chunk_tokens: int = 0
    lookahead_tokens: int = 0
    context_tokens: int = 20
    mel_crossfade_frames: int = 4
    vocoder_context_frames: int = 12
    vocoder_lookahead_frames: int = 2
    wave_crossfade_samples: int = 256
    fade_in_ms: float = 10.0
    fade_out_ms: float = 20.0
    prompt_with_emitted_mel: bool = False
    carry_source_phase: bool = True
    window_frames: Optional[tuple[int, ...]] = None

    def __post_init__(self):
        if self.window_frames is not None:
            sizes = tuple(self.window_frames) if isinstance(self.window_frames, (tuple, list)) else None
            if sizes is None or not all(isinstance(f, numbers.Integral) and not isinstance(f, bool) and f >= 1
                                        for f in sizes):
                raise ValueError(f"EmissionPolicy.window_frames must be None or a sequence of mel frame counts >= 1, "
                                 f"got {self.window_frames!r}")
            object.__setattr__(self, "window_frames", tuple(sorted({int(f) for f in sizes})))
        counts = {"first_chunk_tokens": 1, "chunk_tokens": 1}  # the least each count may be
        counts.update(dict.fromkeys(("lookahead_tokens", "context_tokens", "mel_crossfade_frames",
                                     "vocoder_context_frames", "vocoder_lookahead_frames", "wave_crossfade_samples",
                                     "max_chunk_tokens"), 0))
        for name, least in counts.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
                raise ValueError(f"EmissionPolicy.{name} must be an integer >= {least}, got {value!r}")
            object.__setattr__(self, name, int(value))  # (a numpy integer from a config works as a Python one)
        for name in ("fade_in_ms", "fade_out_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"EmissionPolicy.{name} must be a number of milliseconds >= 0, got {value!r}")
        if 0 < self.max_chunk_tokens < self.chunk_tokens:
            raise ValueError(f"EmissionPolicy.max_chunk_tokens ({self.max_chunk_tokens}) is below chunk_tokens "
                             f"({self.chunk_tokens}): raise it, or 0 for chunks that do not grow")
        if self.fade_in_ms < 0 or self.fade_out_ms < 0:
            raise ValueError("EmissionPolicy fades must be >= 0 ms")
        if self.fade_out_ms > 0 and self.mel_crossfade_frames + self.vocoder_lookahead_frames == 0:
            # the fade-out is applied to the final chunk, which holds only what was held back
            raise ValueError("fade_out_ms needs held-back audio to fade out: set vocoder_lookahead_frames >= 1 "
                             "(or mel_crossfade_frames >= 1), or fade_out_ms=0")
        if self.wave_crossfade_samples > self.vocoder_lookahead_frames * SAMPLES_PER_FRAME:
            raise ValueError(
                f"wave_crossfade_samples ({self.wave_crossfade_samples}) needs that much held-back audio: raise "
                f"vocoder_lookahead_frames to >= {-(-self.wave_crossfade_samples // SAMPLES_PER_FRAME)}"
            )
        if frames_for_tokens(self.first_chunk_tokens) <= self.mel_crossfade_frames + self.vocoder_lookahead_frames:
            raise ValueError(
                f"first_chunk_tokens={self.first_chunk_tokens} gives no audio after holding back "
                f"{self.mel_crossfade_frames}+{self.vocoder_lookahead_frames} frames; use more tokens or less holdback"
            )

    def steady_chunk(self, emitted_tokens: int) -> int:
        """Tokens of the chunk after ``emitted_tokens`` tokens were emitted (not the first chunk)."""
        if not self.max_chunk_tokens:
            return self.chunk_tokens
        return min(self.max_chunk_tokens, max(self.chunk_tokens, emitted_tokens // 2))

    @classmethod
    def low_latency(cls, **overrides) -> "EmissionPolicy":
        """Emit as soon as 10 tokens (200 ms of speech) exist; no right context beyond the held-back
        cross-fade frames; fade-in at the start; steady chunks of 25 tokens growing to 300 (6 s)."""
        return _named(cls(name="low_latency", max_chunk_tokens=300), overrides)

    @classmethod
    def quality(cls, **overrides) -> "EmissionPolicy":
        """Wait for 10 tokens of lookahead before finalising frames; longer context and cross-fades."""
        base = cls(
            name="quality", first_chunk_tokens=12, chunk_tokens=40, max_chunk_tokens=300, lookahead_tokens=10,
            context_tokens=30,
            mel_crossfade_frames=6, vocoder_context_frames=16, vocoder_lookahead_frames=4,
            wave_crossfade_samples=512, fade_in_ms=2.0, fade_out_ms=20.0,
        )
        return _named(base, overrides)

    @classmethod
    def resolve(cls, policy: "EmissionPolicy | str") -> "EmissionPolicy":
        if isinstance(policy, EmissionPolicy):
            return policy
        if policy == "low_latency":
            return cls.low_latency()
        if policy == "quality":
            return cls.quality()
        raise ValueError(f"unknown emission policy {policy!r}: use 'low_latency', 'quality' or an EmissionPolicy")


def _named(base: EmissionPolicy, overrides: dict) -> EmissionPolicy:
    """A named regime with overrides; steady chunks set above its growth limit simply do not grow."""
    if "max_chunk_tokens" not in overrides and overrides.get("chunk_tokens", 0) > base.max_chunk_tokens:
        overrides = {**overrides, "max_chunk_tokens": 0}
    return replace(base, **overrides)


class NoiseTape:
    """Standard-normal noise (1, channels, position) addressed by absolute position.

    Drawn lazily in blocks of ``block`` positions from the tape's own generator, always in order,
    so the value at a position is the same however the requests are chunked. Blocks before
    :meth:`forget_before` are dropped (memory stays bounded on long utterances).
    """

    def __init__(self, channels: int, seed: int, block: int = 4096, device=None, dtype=torch.float32):
        self.channels, self.seed, self.block = channels, int(seed), block
        self.device, self.dtype = device, dtype
        self._generator = torch.Generator(device="cpu").manual_seed(self.seed)
        self._blocks: list[torch.Tensor] = []
        self._first_block = 0  # absolute index of self._blocks[0]

    def get(self, start: int, stop: int) -> torch.Tensor:
        if start < self._first_block * self.block:
            raise ValueError(f"noise before position {self._first_block * self.block} was already released")
        if stop <= start:
            return torch.zeros(1, self.channels, 0, device=self.device, dtype=self.dtype)
        while (self._first_block + len(self._blocks)) * self.block < stop:
            self._blocks.append(torch.randn(self.channels, self.block, generator=self._generator))
        first = start // self.block - self._first_block
        last = (stop - 1) // self.block - self._first_block
        joined = torch.cat(self._blocks[first:last + 1], dim=1)
        offset = (first + self._first_block) * self.block
        # (pinned on CUDA: the copy does not wait for the kernels queued before it)
        return to_device(joined[:, start - offset:stop - offset].unsqueeze(0).to(self.dtype), self.device)

    def forget_before(self, position: int) -> None:
        drop = position // self.block - self._first_block
        if drop > 0:
            del self._blocks[:drop]
            self._first_block += drop

    def fresh_copy(self) -> "NoiseTape":
        """An unread tape with the same seed (the same noise from position 0)."""
        return NoiseTape(self.channels, self.seed, self.block, self.device, self.dtype)


class SpeakerHold:
    """The lock behind ``SynthesisState.in_use``; a copy of a state (deepcopy, pickle) gets a free
    one of its own."""

    def __init__(self):
        self._lock = threading.Lock()

    def acquire(self, blocking: bool = True) -> bool:
        return self._lock.acquire(blocking)

    def release(self) -> None:
        self._lock.release()

    def __deepcopy__(self, memo) -> "SpeakerHold":
        return SpeakerHold()

    def __reduce__(self):
        return SpeakerHold, ()


@dataclass
class SynthesisState:
    """Continuity state of one streamed utterance (see the module docstring). Create it with
    ``start_speaking``; pass it to every ``speak`` call of that utterance, and to the next segment's
    call when segments continue one utterance."""

    policy: EmissionPolicy
    out_sampling_rate: int
    spks: torch.Tensor  # (1, 80) projected speaker embedding
    speaker_embeds: torch.Tensor  # (1, spk_dim) as given (to check later segments use the same voice)
    flow_noise: NoiseTape  # (1, 80, frame)
    source_noise: NoiseTape  # (1, harmonics, sample)
    phase_u01: torch.Tensor  # (1, harmonics, 1) the source's initial-phase draw, fixed per utterance
    resampler: Optional[object] = None  # soxr.ResampleStream when out_sampling_rate != 22050
    graphs: Optional[object] = None  # SynthesisGraphs for the bucketed path (shared, not per utterance); None: dynamic
    window_frames: tuple[int, ...] = ()  # sizes flow windows are widened to (the policy's, resolved for the path)
    time_stages: bool = False  # wait for the GPU after the flow so SpeechChunk.flow_s is exact (benchmarks)

    # tokens: all tokens fed so far number n_tokens; only tokens[token_offset:] are kept
    tokens: torch.Tensor = field(default_factory=lambda: torch.zeros(1, 0, dtype=torch.long))
    token_offset: int = 0
    n_tokens: int = 0
    committed_tokens: int = 0  # tokens whose chunks have been emitted (chunk boundaries)

    # flow: frames [0, mel_done) are final
    mel_done: int = 0
    mel_history: Optional[torch.Tensor] = None  # (1, 80, h): final mel of frames [mel_done - h, mel_done)
    mel_tail: Optional[torch.Tensor] = None  # (1, 80, x): provisional mel of frames [mel_done, mel_done + x)

    # vocoder: samples [0, 256 * voc_done) are final (emitted)
    voc_done: int = 0
    voc_mel: Optional[torch.Tensor] = None  # (1, 80, m): final mel of frames [voc_mel_start, mel_done)
    voc_mel_start: int = 0
    source_history: Optional[torch.Tensor] = None  # (1, 1, 256 k): source of frames [voc_done - k, voc_done)
    cycle_pos: Optional[torch.Tensor] = None  # (1, harmonics, 1) harmonic cycle position at sample 256 * voc_done
    wave_tail: Optional[torch.Tensor] = None  # (1, w): provisional waveform after sample 256 * voc_done

    # a stateless continuation is primed with the tail of earlier speech: what preceded it
    tokens_before: int = 0  # speech tokens of the utterance before this state's first token (its frame
    # grid is the utterance's: frames(n) = floor((before + n) * 441/256) - floor(before * 441/256))
    audio_ms_before: float = 0.0  # audio of the utterance played before this state's first emitted sample
    skip_until_sample: int = 0  # 22.05 kHz samples before this are computed but not emitted (already played)
    samples_emitted: int = 0  # at 22.05 kHz: what was actually emitted
    out_samples_emitted: int = 0  # at out_sampling_rate
    chunks_emitted: int = 0
    finished: bool = False  # the final chunk (with fade-out) was emitted
    failure: Optional[str] = None  # a step failed part-way (its state half-advanced): no step may follow
    # detokenize: speech tokens of the last segment spoken with this state (the speech decoder
    # continues only those: its text prefix holds the previous segment's words, not the utterance's)
    segment_tokens: int = 0
    segment_words: Optional[tuple] = None  # (text_ids, taste_ids) of that segment: the next one's prev_*
    segment_open: bool = False  # a segment's speech tokens are being fed (a stream left there cannot go on)
    # held by whoever is speaking the utterance now (a speak call, a whole taste_detokenize_stream):
    # a second thread at once would interleave its tokens and caches with the first's
    in_use: SpeakerHold = field(default_factory=lambda: SpeakerHold(), repr=False, compare=False)

    def frames(self, n_tokens: int) -> int:
        """Mel frames of this state's first ``n_tokens`` tokens, on the utterance's frame grid."""
        return frames_for_tokens(self.tokens_before + n_tokens) - frames_for_tokens(self.tokens_before)

    def token_of(self, frame: int) -> int:
        """This state's token index whose features mel frame ``frame`` copies."""
        return token_of_frame(frame + frames_for_tokens(self.tokens_before)) - self.tokens_before

    @property
    def emitted_ms(self) -> float:
        return 1000.0 * self.samples_emitted / SOURCE_RATE

    def window_tokens(self, start: int, stop: int) -> torch.Tensor:
        """Tokens [start, stop) (absolute indices) from the kept window."""
        if start < self.token_offset:
            raise ValueError(f"token {start} was released from the context window (kept from {self.token_offset})")
        return self.tokens[:, start - self.token_offset:stop - self.token_offset]
