"""The audio tower's Whisper log-mel of a user turn: the silence of the 30 s window transformed vs not.

The tower reads a turn as the log-mel of its 30 s window, mostly zero padding. Frames whose whole
window is padding have zero power, so ``whisper_log_mel`` transforms the audio (and one window of
zeros after it) and appends the rest as zero power. This runs on the host, before any GPU work of
the turn. Baseline in the same run: the same window with its zeros written out and transformed.

    python benchmarks/bench_log_mel.py

Then the same for the built-in ASR's features, against transformers' feature extractor.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from taste_speech.audio import N_SAMPLES, whisper_log_mel  # noqa: E402


def median_ms(fn, repeats: int = 20) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> int:
    print(f"Whisper log-mel of a turn in its 30 s window, CPU ({torch.get_num_threads()} threads), median of 20")
    print("| turn | silence transformed: ms | silence appended as zero power: ms | ratio | identical |")
    print("| --- | --- | --- | --- | --- |")
    for seconds in (1, 3, 10):
        wav = (0.1 * np.random.default_rng(seconds).standard_normal(16000 * seconds)).astype(np.float32)
        written_out = np.pad(wav, (0, N_SAMPLES - wav.size))
        baseline = median_ms(lambda: whisper_log_mel(written_out, n_samples=None))
        now = median_ms(lambda: whisper_log_mel(wav))
        same = torch.equal(whisper_log_mel(wav), whisper_log_mel(written_out, n_samples=None))
        print(f"| {seconds} s | {baseline:.2f} | {now:.2f} | {now / baseline:.2f} | {same} |")
    asr_features()
    return 0


def asr_features() -> None:
    """The built-in ASR's features (whisper-large-v3: 128 mels): transformers' feature extractor,
    what the ASR used, against the tower's front end, what it uses now (``WhisperTranscriber._features``)."""
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor(feature_size=128)
    print()
    print("The built-in ASR's log-mel (128 mels), median of 20")
    print("| turn | transformers' WhisperFeatureExtractor: ms | whisper_log_mel: ms | ratio | largest difference |")
    print("| --- | --- | --- | --- | --- |")
    for seconds in (1, 3, 10):
        wav = (0.1 * np.random.default_rng(seconds).standard_normal(16000 * seconds)).astype(np.float32)
        baseline = median_ms(lambda: extractor(wav, sampling_rate=16000, return_tensors="pt").input_features)
        now = median_ms(lambda: whisper_log_mel(wav, n_mels=128).transpose(1, 2))
        diff = (extractor(wav, sampling_rate=16000, return_tensors="pt").input_features
                - whisper_log_mel(wav, n_mels=128).transpose(1, 2)).abs().max()
        print(f"| {seconds} s | {baseline:.2f} | {now:.2f} | {now / baseline:.2f} | {float(diff):.1e} |")


if __name__ == "__main__":
    sys.exit(main())
