"""taste_speech.audio: Whisper log-mel against the golden front end, Kaldi fbank against an
independent numpy re-derivation of torchaudio's algorithm, waveform normalisation, resampling."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from taste_speech.audio import (
    kaldi_fbank,
    mean_normalise,
    mel_filterbank,
    resample,
    to_mono_float,
    whisper_log_mel,
)


@pytest.fixture(scope="module")
def golden_io(taste_lm_tiny_a):
    return load_file(str(taste_lm_tiny_a / "io.safetensors"))


# -- Whisper log-mel ----------------------------------------------------------------------------------
def test_log_mel_matches_golden_front_end(golden_io):
    waveform = golden_io["frontend.waveform"]  # (1, 38400): 2.4 s
    expected = golden_io["in.audio_features"]  # (1, 300, 128), window 300 frames * 160 samples
    actual = whisper_log_mel(waveform[0], n_mels=128, n_samples=300 * 160)
    assert actual.shape == expected.shape and actual.dtype == torch.float32
    diff = (actual - expected).abs().max().item()
    assert diff <= 1e-4, diff
    # numpy and (1, T) input give the same features
    assert torch.equal(whisper_log_mel(waveform.numpy(), n_samples=300 * 160), actual)
    assert golden_io["in.audio_feature_lengths"].item() == waveform.shape[1] // 160


def test_log_mel_default_window_pads_and_trims():
    rng = np.random.default_rng(0)
    wav = (0.1 * rng.standard_normal(16000 * 31)).astype(np.float32)
    trimmed = whisper_log_mel(wav)
    assert trimmed.shape == (1, 3000, 128)
    assert torch.equal(trimmed, whisper_log_mel(wav[: 16000 * 30]))
    short = whisper_log_mel(wav[:16000])
    assert short.shape == (1, 3000, 128)
    # the padded tail is silence: every bin sits on the (max - 8) floor -> (floor + 4) / 4
    floor = short.max() - 2.0  # 8 log10 units / 4
    assert torch.allclose(short[0, 200:], torch.full_like(short[0, 200:], floor.item()), atol=1e-6)
    unpadded = whisper_log_mel(wav[:16000], n_samples=None)
    assert unpadded.shape == (1, 100, 128)


@pytest.mark.parametrize("samples", [201, 16000, 47_999, 48_000, 160_000, 479_400, 479_599, 479_800, 479_999])
def test_a_padded_window_is_the_transform_of_its_silence(samples):
    """The window's padding is not transformed (its frames have zero power): the features are
    those of the audio with its zeros written out, at every length up to the window - to a
    float32 step or two (the FFT of fewer frames may round its last bit differently: on an AMD EPYC a
    201-sample clip differed by 6e-8 in 8 of 240 000 values; elsewhere bit for bit)."""
    wav = (0.1 * np.random.default_rng(samples).standard_normal(samples)).astype(np.float32)
    written_out = np.pad(wav, (0, 16000 * 30 - samples))
    one_step = dict(atol=2.4e-7, rtol=0)  # (two float32 steps at most for the log-mel's values, within +-2)
    torch.testing.assert_close(whisper_log_mel(wav), whisper_log_mel(written_out, n_samples=None), **one_step)
    odd_window = 48_000 + 37  # a window that is not a whole number of hops
    if samples < odd_window:
        zeros = np.pad(wav, (0, odd_window - samples))
        torch.testing.assert_close(whisper_log_mel(wav, n_samples=odd_window), whisper_log_mel(zeros, n_samples=None),
                                   **one_step)


def test_mel_filterbank_is_slaney():
    filters = mel_filterbank(16000, 400, 128)
    assert filters.shape == (128, 201) and filters.dtype == np.float32
    freqs = np.linspace(0, 8000, 201)
    peaks = freqs[filters.argmax(axis=1)]
    assert np.all(np.diff(peaks) >= 0)  # centres rise monotonically
    # the area normalisation makes high (wide) filters lower than low (narrow) ones
    assert filters[0].max() > filters[-1].max()
    assert np.all(filters >= 0)
    assert mel_filterbank(16000, 400, 80).shape == (80, 201)


def test_log_mel_rejects_bad_input():
    with pytest.raises(ValueError, match="empty"):
        whisper_log_mel(np.zeros(0, np.float32))
    with pytest.raises(ValueError, match="NaN"):
        whisper_log_mel(np.array([0.0, np.nan] * 400, np.float32))
    with pytest.raises(ValueError, match="too short"):
        whisper_log_mel(np.zeros(100, np.float32), n_samples=None)


# -- Kaldi fbank -------------------------------------------------------------------------------------
def reference_kaldi_fbank(wave: np.ndarray, num_bins: int = 80, rate: int = 16000) -> np.ndarray:
    """float64 re-derivation of torchaudio.compliance.kaldi.fbank(wave, num_mel_bins, dither=0,
    sample_frequency=16000) with every other option at its default (spec §2.4)."""
    wave = wave.astype(np.float64)
    length, shift, n_fft = 400, 160, 512
    count = 1 + (len(wave) - length) // shift  # snip_edges
    frames = np.stack([wave[i * shift : i * shift + length] for i in range(count)])
    frames = frames - frames.mean(axis=1, keepdims=True)  # remove DC
    previous = np.concatenate([frames[:, :1], frames[:, :-1]], axis=1)
    frames = frames - 0.97 * previous  # pre-emphasis, first sample against itself
    n = np.arange(length)
    frames = frames * (0.5 - 0.5 * np.cos(2 * np.pi * n / (length - 1))) ** 0.85  # povey
    power = np.abs(np.fft.rfft(frames, n=n_fft)) ** 2

    def mel(f):
        return 1127.0 * np.log(1.0 + f / 700.0)

    low, high = mel(20.0), mel(rate / 2)
    delta = (high - low) / (num_bins + 1)
    bin_mel = mel(np.arange(n_fft // 2) * rate / n_fft)
    banks = np.zeros((num_bins, n_fft // 2 + 1))
    for b in range(num_bins):
        left, centre, right = low + b * delta, low + (b + 1) * delta, low + (b + 2) * delta
        inside = (bin_mel > left) & (bin_mel < right)
        rising = (bin_mel - left) / (centre - left)
        falling = (right - bin_mel) / (right - centre)
        banks[b, : n_fft // 2] = np.where(inside, np.where(bin_mel <= centre, rising, falling), 0.0)
    energies = power @ banks.T
    return np.log(np.maximum(energies, np.finfo(np.float32).eps))


def speechlike(seconds: float, rate: int = 16000, seed: int = 0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(seed)
    f0 = 120 + 40 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    tone = sum(np.sin(h * phase) / h for h in range(1, 6))
    return (0.2 * tone * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t)) + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


def test_kaldi_fbank_matches_torchaudio_algorithm():
    wave = speechlike(1.3)
    actual = kaldi_fbank(wave)
    expected = reference_kaldi_fbank(wave)
    assert actual.shape == expected.shape == (1 + (wave.size - 400) // 160, 80)
    assert actual.dtype == np.float32
    assert np.abs(actual - expected).max() < 2e-3
    # the float waveform is used as it is (no int16 rescaling): scaling by 32768 shifts every
    # log energy by log(32768^2), which the reference does not see
    assert np.abs(kaldi_fbank(wave * 0.5) - (expected + np.log(0.25))).max() < 2e-3


def test_fbank_mean_normalisation_and_errors():
    feats = mean_normalise(kaldi_fbank(speechlike(0.5)))
    assert np.abs(feats.mean(axis=0)).max() < 1e-4
    with pytest.raises(ValueError, match="too short"):
        kaldi_fbank(np.zeros(399, np.float32))
    assert kaldi_fbank(np.zeros(400, np.float32) + 0.01).shape == (1, 80)


# -- waveform normalisation --------------------------------------------------------------------------
def test_to_mono_float_layouts_and_types():
    left = np.linspace(-0.5, 0.5, 1000, dtype=np.float32)
    right = -0.25 * left
    mixed = (left + right) / 2
    assert np.allclose(to_mono_float(np.stack([left, right])), mixed)  # (C, T)
    assert np.allclose(to_mono_float(np.stack([left, right], axis=1)), mixed)  # (T, C)
    assert np.allclose(to_mono_float(left[None]), left)  # (1, T)
    assert np.allclose(to_mono_float(torch.from_numpy(np.stack([left, right]))), mixed)
    assert to_mono_float(torch.from_numpy(left).to(torch.bfloat16)).dtype == np.float32
    assert to_mono_float(left.astype(np.float64)).dtype == np.float32
    pcm = np.array([0, 16384, -32768, 32767], dtype=np.int16)
    assert np.allclose(to_mono_float(pcm), [0.0, 0.5, -1.0, 32767 / 32768])
    assert np.allclose(to_mono_float(np.array([2**30], dtype=np.int32)), [0.5])
    assert np.allclose(to_mono_float(np.array([128, 192], dtype=np.uint8)), [0.0, 0.5])
    stereo_pcm = np.stack([pcm, pcm])
    assert np.allclose(to_mono_float(stereo_pcm), to_mono_float(pcm))
    assert np.allclose(to_mono_float(pcm.astype(">i2")), to_mono_float(pcm))  # big-endian, as some files hold it


@pytest.mark.parametrize("wide", [np.int32, np.int64, "torch"])
def test_int16_samples_in_a_wider_integer_type_are_named_not_taken_for_silence(wide):
    """torch.tensor(list) and np.array(list) make int64: int16 samples in it (or in int32, scaled by
    2**31 to near silence) are refused with the fix, not reported silent later."""
    pcm = np.array([0, 16384, -32768, 32767], dtype=np.int16)
    audio = torch.tensor(pcm.tolist()) if wide == "torch" else pcm.astype(wide)
    with pytest.raises(ValueError, match=r"peaks at 32768, like int16 samples stored in a wider type.*astype\(np.int16\)"):
        to_mono_float(audio)


@pytest.mark.parametrize("audio, match", [
    (np.zeros(0, np.float32), "empty"),
    (np.zeros((2, 0), np.float32), "empty"),
    (np.array([0.1, np.nan], np.float32), "NaN"),
    (np.array([0.1, np.inf], np.float32), "infinite"),
    (np.zeros((1, 2, 100), np.float32), "1-D"),
    (np.zeros((40, 50), np.float32), "channels"),
    (np.array([True, False]), "sample type"),
    ("speech.wav", "numpy array or torch tensor"),
])
def test_to_mono_float_rejects(audio, match):
    with pytest.raises(ValueError, match=match):
        to_mono_float(audio)


# -- resampling --------------------------------------------------------------------------------------
def dominant_frequency(wave: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(wave * np.hanning(wave.size)))
    return float(np.fft.rfftfreq(wave.size, 1.0 / rate)[spectrum.argmax()])


@pytest.mark.parametrize("rate", [48000, 44100, 22050, 8000])
def test_resample_length_and_tone(rate):
    seconds, tone = 1.0, 1000.0
    t = np.arange(int(seconds * rate)) / rate
    wave = (0.5 * np.sin(2 * np.pi * tone * t)).astype(np.float32)
    out = resample(wave, rate, 16000)
    assert out.dtype == np.float32 and out.ndim == 1
    assert abs(out.size - round(wave.size * 16000 / rate)) <= 1
    assert abs(dominant_frequency(out, 16000) - tone) <= 2.0  # 1 Hz FFT bins
    middle = out[2000:-2000]
    assert abs(np.abs(middle).max() - 0.5) < 0.02  # amplitude kept


def test_resample_removes_content_above_new_nyquist_and_mixes_down():
    rate = 48000
    t = np.arange(rate) / rate
    high = np.sin(2 * np.pi * 12000 * t).astype(np.float32)  # above 8 kHz: must not alias into the band
    out = resample(np.stack([high, high]), rate, 16000)
    assert out.ndim == 1 and np.abs(out[2000:-2000]).max() < 0.01
    same = resample(high, 16000, 16000)
    assert np.array_equal(same, high) and same is not high


@pytest.mark.parametrize("rates", [(0, 16000), (16000, -1), (16000.5, 16000), (True, 16000)])
def test_resample_rejects_bad_rates(rates):
    with pytest.raises(ValueError, match="sample rate"):
        resample(np.zeros(100, np.float32), *rates)
