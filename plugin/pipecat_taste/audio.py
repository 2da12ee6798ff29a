"""Small audio helpers shared by the processors: PCM conversion, fades and fixed-size framing.

Everything inside the plugin is float32 in [-1, 1]; Pipecat frames carry 16-bit PCM bytes. The
conversions here are the only places where one becomes the other, so the rounding rule (round to
nearest, clip to the int16 range) is applied exactly once per sample.
"""

from __future__ import annotations

import numpy as np


def pcm16_to_float(pcm: bytes) -> np.ndarray:
    """16-bit little-endian PCM bytes -> float32 samples in [-1, 1)."""
    if len(pcm) % 2:
        raise ValueError(f"16-bit PCM needs an even number of bytes, got {len(pcm)}: a frame was cut mid-sample")
    return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0


def float_to_int16(samples: np.ndarray) -> np.ndarray:
    """float32 samples -> int16 (rounded, clipped)."""
    scaled = np.rint(np.asarray(samples, dtype=np.float64) * 32768.0)
    return np.clip(scaled, -32768, 32767).astype("<i2")


def float_to_pcm16(samples: np.ndarray) -> bytes:
    return float_to_int16(samples).tobytes()


def ramp(n: int) -> np.ndarray:
    """Raised-cosine ramp 0 -> 1 over ``n`` samples (first sample 0, last just below 1).

    A raised cosine has zero slope at both ends, so a fade made with it adds no click of its own."""
    if n <= 0:
        return np.ones(0, dtype=np.float32)
    t = np.arange(n, dtype=np.float64) / n
    return (0.5 - 0.5 * np.cos(np.pi * t)).astype(np.float32)


def fade_in(samples: np.ndarray, n: int) -> np.ndarray:
    out = np.array(samples, dtype=np.float32, copy=True)
    n = min(n, out.size)
    out[:n] *= ramp(n)
    return out


def continue_fade_in(samples: np.ndarray, done: int, n: int) -> tuple[np.ndarray, int]:
    """The next ``samples`` of a stream whose first ``n`` samples fade in, ``done`` of them already
    faded: a stream that starts in pieces shorter than the fade gets one ramp, not a ramp per piece.
    Returns the samples and the new ``done``."""
    k = min(max(n - done, 0), samples.size)
    if not k:
        return samples, done
    out = np.array(samples, dtype=np.float32, copy=True)
    out[:k] *= ramp(n)[done:done + k]
    return out, done + k


def fade_out(samples: np.ndarray, n: int) -> np.ndarray:
    """Fade the last ``n`` samples to zero (the final sample is exactly 0 when n > 0)."""
    out = np.array(samples, dtype=np.float32, copy=True)
    n = min(n, out.size)
    if n:
        out[out.size - n:] *= ramp(n)[::-1]
    return out


def samples_for_ms(ms: float, sample_rate: int) -> int:
    return int(round(ms * sample_rate / 1000.0))


class FrameSlicer:
    """Cuts a stream of variable-size chunks into frames of exactly ``frame_samples`` samples.

    Leftover samples wait for the next chunk, so chunk boundaries never shift or drop audio;
    ``flush()`` pads the last partial frame with zeros (only ever at the end of an utterance)."""

    def __init__(self, frame_samples: int):
        if frame_samples <= 0:
            raise ValueError("frame_samples must be positive")
        self.frame_samples = frame_samples
        self._pending = np.zeros(0, dtype=np.float32)

    @property
    def pending(self) -> int:
        return int(self._pending.size)

    def push(self, samples: np.ndarray) -> list[np.ndarray]:
        data = np.concatenate([self._pending, np.asarray(samples, dtype=np.float32).reshape(-1)])
        whole = data.size // self.frame_samples * self.frame_samples
        frames = [data[i:i + self.frame_samples] for i in range(0, whole, self.frame_samples)]
        self._pending = data[whole:]
        return frames

    def flush(self) -> np.ndarray | None:
        """The partial frame padded with zeros, or None when nothing is pending."""
        if not self._pending.size:
            return None
        frame = np.zeros(self.frame_samples, dtype=np.float32)
        frame[: self._pending.size] = self._pending
        self._pending = np.zeros(0, dtype=np.float32)
        return frame

    def clear(self) -> np.ndarray:
        """Drop and return what is pending (used when a reply is cut off)."""
        left, self._pending = self._pending, np.zeros(0, dtype=np.float32)
        return left


def resample(samples: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """Whole-buffer resampling with soxr (HQ). Streams use :class:`StreamResampler`."""
    if from_rate == to_rate:
        return np.asarray(samples, dtype=np.float32)
    import soxr

    return soxr.resample(np.asarray(samples, dtype=np.float32), from_rate, to_rate, quality="HQ").astype(np.float32)


class StreamResampler:
    """Chunk-by-chunk resampling that keeps filter state across chunks (soxr.ResampleStream).

    ``flush()`` returns the samples the filter still holds at the end of an utterance."""

    def __init__(self, from_rate: int, to_rate: int):
        self.from_rate, self.to_rate = from_rate, to_rate
        self._stream = None
        if from_rate != to_rate:
            import soxr

            self._stream = soxr.ResampleStream(from_rate, to_rate, 1, dtype="float32", quality="HQ")

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        if self._stream is None:
            return samples
        return self._stream.resample_chunk(samples, last=False)

    def flush(self) -> np.ndarray:
        if self._stream is None:
            return np.zeros(0, dtype=np.float32)
        return self._stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True)
