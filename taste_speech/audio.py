"""Waveform utilities for TASTE, without torchaudio (spec §2.1, §2.3, §2.4).

* ``to_mono_float``: any numpy / torch waveform (int or float, mono or multi-channel) -> mono
  float32 numpy in [-1, 1].
* ``resample``: band-limited resampling with soxr.
* ``whisper_log_mel``: the openai-whisper 128-bin log-mel front end the audio tower was trained
  on (30 s window, STFT 400/160, Slaney mel filters computed here exactly as librosa does).
* ``kaldi_fbank``: the Kaldi-compatible 80-bin fbank CAMPPlus (the speaker encoder) expects,
  through kaldi-native-fbank, with the options torchaudio's ``compliance.kaldi.fbank`` uses by
  default (what the original processor called).

torchaudio is deliberately not used: it has no release for current torch versions.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

SAMPLE_RATE = 16000  # every model input is 16 kHz
N_FFT = 400  # 25 ms Whisper STFT window
HOP_LENGTH = 160  # 10 ms -> 100 frames per second
N_SAMPLES = 30 * SAMPLE_RATE  # Whisper's fixed 30 s window (3000 frames)
N_MELS = 128  # large-v3 family
LOG_FLOOR = 1e-10
DYNAMIC_RANGE = 8.0  # log10 units kept below the loudest bin

# A 2-D array whose smaller side is at most this is read as (channels, samples) or
# (samples, channels); anything wider is refused as ambiguous.
_MAX_CHANNELS = 16
# Float audio peaking above this is int16-scale samples passed as float (e.g. pcm.astype(np.float32)).
# Hot float audio beyond [-1, 1] (a clipped microphone, too much gain) is accepted: it stays far
# below, while int16-scale speech peaks in the hundreds or thousands.
FLOAT_PEAK_LIMIT = 64.0


# -- waveform normalisation ---------------------------------------------------------------------
def to_mono_float(audio) -> np.ndarray:
    """Return ``audio`` as a 1-D float32 numpy waveform (channels averaged).

    Accepts numpy arrays or torch tensors shaped (T,), (C, T) / (1, T) or, as soundfile returns
    them, (T, C). Integer samples are scaled to [-1, 1] (int16 / 32768, int32 / 2**31, uint8
    centred at 128); float samples are taken as they are, unless they peak above
    ``FLOAT_PEAK_LIMIT`` (int16-scale samples stored as float: refused).
    """
    if isinstance(audio, torch.Tensor):
        tensor = audio.detach().cpu()
        if tensor.is_floating_point() and tensor.dtype not in (torch.float32, torch.float64):
            tensor = tensor.float()  # bf16 / fp16 have no numpy dtype
        array = tensor.numpy()
    elif isinstance(audio, np.ndarray):
        array = audio
    elif isinstance(audio, (list, tuple)):
        if len(audio) == 2 and isinstance(audio[0], (np.ndarray, torch.Tensor)) and np.isscalar(audio[1]):
            raise ValueError("audio is a (samples, rate) pair, as soundfile.read returns it: pass the samples "
                             "and the rate separately (data, rate = soundfile.read(path))")
        array = np.asarray(audio)
    else:
        raise ValueError(
            f"audio must be a numpy array or torch tensor, got {type(audio).__name__}; "
            "load files first (e.g. soundfile.read(path)) and pass the samples"
        )

    float_input = np.issubdtype(array.dtype, np.floating)
    array = _to_float32(array)
    if array.size == 0:
        raise ValueError("audio is empty (0 samples); pass at least a few milliseconds of sound")
    if array.ndim == 2:
        array = _mix_down(array)
    elif array.ndim != 1:
        raise ValueError(
            f"audio must be 1-D (samples) or 2-D (channels, samples), got shape {array.shape}; "
            "squeeze batch dimensions before passing it"
        )
    if not np.isfinite(array).all():
        raise ValueError("audio contains NaN or infinite samples; clean or replace them (e.g. np.nan_to_num)")
    if float_input:
        peak = float(np.abs(array).max())
        if peak > FLOAT_PEAK_LIMIT:
            raise ValueError(f"float audio must be in [-1, 1] but peaks at {peak:.0f}, like int16 samples: pass the "
                             "int16 array itself or divide by 32768")
    return np.ascontiguousarray(array, dtype=np.float32)


def _to_float32(array: np.ndarray) -> np.ndarray:
    if array.dtype.byteorder not in ("=", "|"):  # (big-endian samples, as read from some files)
        array = array.astype(array.dtype.newbyteorder("="))
    if array.dtype == np.int16:
        return array.astype(np.float32) / 32768.0
    if array.dtype.kind == "i" and array.size:
        peak = int(np.abs(array.astype(np.int64)).max())
        if 0 < peak <= 32768:  # int16 samples in a wider array (e.g. torch.tensor(list) makes int64)
            raise ValueError(f"{array.dtype} audio peaks at {peak}, like int16 samples stored in a wider type "
                             f"({array.dtype} samples are scaled to their own range: this would be near silence); "
                             "pass .astype(np.int16)")
    if array.dtype == np.int32:
        return (array.astype(np.float64) / 2147483648.0).astype(np.float32)
    if array.dtype == np.uint8:
        return (array.astype(np.float32) - 128.0) / 128.0
    if np.issubdtype(array.dtype, np.floating):
        return array.astype(np.float32, copy=False)
    raise ValueError(
        f"unsupported audio sample type {array.dtype}; use float32 in [-1, 1], int16, int32 or uint8"
    )


def _mix_down(array: np.ndarray) -> np.ndarray:
    rows, cols = array.shape
    if rows <= cols and rows <= _MAX_CHANNELS:
        return array.mean(axis=0)  # (C, T)
    if cols < rows and cols <= _MAX_CHANNELS:
        return array.mean(axis=1)  # (T, C)
    raise ValueError(
        f"cannot tell channels from samples in audio of shape {array.shape}; pass (channels, samples) "
        f"with at most {_MAX_CHANNELS} channels"
    )


def resample(audio, from_sr: int, to_sr: int = SAMPLE_RATE) -> np.ndarray:
    """Resample a waveform (converted with ``to_mono_float``) with soxr's high-quality filter."""
    for name, rate in (("from_sr", from_sr), ("to_sr", to_sr)):
        if not isinstance(rate, (int, np.integer)) or isinstance(rate, bool) or rate <= 0:
            raise ValueError(f"{name} must be a positive integer sample rate in Hz, got {rate!r}")
    waveform = to_mono_float(audio)
    if from_sr == to_sr:
        return waveform.copy()
    import soxr  # imported lazily: only needed for non-16 kHz input

    out = soxr.resample(waveform, int(from_sr), int(to_sr), quality="HQ")
    return np.ascontiguousarray(out, dtype=np.float32)


# -- Whisper log-mel ----------------------------------------------------------------------------
def _hz_to_mel_slaney(freq: np.ndarray) -> np.ndarray:
    """Slaney's auditory-toolbox mel scale: linear below 1 kHz, logarithmic above."""
    freq = np.asarray(freq, dtype=np.float64)
    f_sp = 200.0 / 3.0
    mels = freq / f_sp
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = np.log(6.4) / 27.0
    high = freq >= min_log_hz
    mels = np.where(high, min_log_mel + np.log(np.maximum(freq, 1e-300) / min_log_hz) / logstep, mels)
    return mels


def _mel_to_hz_slaney(mels: np.ndarray) -> np.ndarray:
    mels = np.asarray(mels, dtype=np.float64)
    f_sp = 200.0 / 3.0
    freqs = mels * f_sp
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = np.log(6.4) / 27.0
    high = mels >= min_log_mel
    return np.where(high, min_log_hz * np.exp(logstep * (mels - min_log_mel)), freqs)


@lru_cache(maxsize=8)
def mel_filterbank(sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT, n_mels: int = N_MELS) -> np.ndarray:
    """(n_mels, n_fft // 2 + 1) float32 triangular filters, Slaney scale and area normalisation.

    Same numbers as ``librosa.filters.mel(sr, n_fft, n_mels)`` (htk=False, norm='slaney', fmin 0,
    fmax sr/2), which is what openai-whisper stores in its ``mel_filters.npz``."""
    fft_freqs = np.linspace(0.0, sample_rate / 2.0, 1 + n_fft // 2)
    mel_edges = np.linspace(_hz_to_mel_slaney(0.0), _hz_to_mel_slaney(sample_rate / 2.0), n_mels + 2)
    hz_edges = _mel_to_hz_slaney(mel_edges)
    widths = np.diff(hz_edges)
    # ramps[i, k] = distance of filter edge i above FFT bin k
    ramps = hz_edges[:, None] - fft_freqs[None, :]
    rising = -ramps[:-2] / widths[:-1, None]
    falling = ramps[2:] / widths[1:, None]
    # float32 before the area normalisation, in the same order as librosa, so the stored
    # Whisper filters are matched to the last bit
    weights = np.maximum(0.0, np.minimum(rising, falling)).astype(np.float32)
    weights = (weights * (2.0 / (hz_edges[2:] - hz_edges[:-2]))[:, None]).astype(np.float32)
    weights.setflags(write=False)
    return weights


def whisper_log_mel(waveform_16k, n_mels: int = N_MELS, n_samples: int | None = N_SAMPLES) -> torch.Tensor:
    """Whisper log-mel features of a 16 kHz waveform -> (1, frames, n_mels) float32.

    The waveform is zero-padded or trimmed to ``n_samples`` first (``None`` keeps its length), so
    the default gives the (1, 3000, 128) input of the audio tower. Algorithm (openai-whisper):
    centred STFT (periodic Hann 400, hop 160, reflect padding) with the last frame dropped,
    power spectrum, Slaney mel filters, log10 floored at 1e-10 and at (max - 8), then (x + 4) / 4.
    """
    samples = torch.from_numpy(to_mono_float(waveform_16k))
    silent_frames = 0  # trailing frames whose whole window is padding: zero power, not transformed
    if n_samples is not None:
        if n_samples <= 0:
            raise ValueError(f"n_samples must be positive or None, got {n_samples}")
        if samples.numel() >= n_samples:
            samples = samples[:n_samples]
        else:
            # A 3 s turn in the 30 s window: transform the audio and one window of zeros after it
            # (so that the reflection at the end mirrors zeros too), then append the frames of pure
            # padding as zero power - the same numbers as transforming the silence, a tenth of the work.
            computed = min(n_samples, HOP_LENGTH * -(-(samples.numel() + N_FFT) // HOP_LENGTH))
            silent_frames = n_samples // HOP_LENGTH - computed // HOP_LENGTH
            samples = torch.nn.functional.pad(samples, (0, computed - samples.numel()))
    if samples.numel() <= N_FFT // 2:
        raise ValueError(
            f"audio too short for the Whisper front end ({samples.numel()} samples); "
            f"pass more than {N_FFT // 2} samples or a padding window (n_samples)"
        )
    window = torch.hann_window(N_FFT)  # periodic
    spectrum = torch.stft(
        samples, N_FFT, HOP_LENGTH, window=window, center=True, pad_mode="reflect", return_complex=True
    )
    power = spectrum[..., :-1].abs() ** 2  # Whisper drops the last (partial) frame
    filters = torch.from_numpy(np.array(mel_filterbank(SAMPLE_RATE, N_FFT, n_mels)))
    mel = filters @ power  # (n_mels, frames)
    if silent_frames:
        mel = torch.cat([mel, mel.new_zeros(n_mels, silent_frames)], dim=1)
    log_mel = torch.clamp(mel, min=LOG_FLOOR).log10()
    log_mel = torch.maximum(log_mel, log_mel.max() - DYNAMIC_RANGE)
    log_mel = (log_mel + 4.0) / 4.0
    return log_mel.transpose(0, 1).unsqueeze(0).contiguous()


# -- Kaldi fbank (speaker encoder input) --------------------------------------------------------
FBANK_FRAME_LENGTH = int(0.025 * SAMPLE_RATE)  # 400 samples: shortest clip that gives a frame


def kaldi_fbank(waveform_16k, num_mel_bins: int = 80) -> np.ndarray:
    """Kaldi fbank (T, num_mel_bins) float32 of a 16 kHz float waveform, NOT rescaled to int16.

    Options equal torchaudio ``compliance.kaldi.fbank(wave, num_mel_bins, dither=0,
    sample_frequency=16000)``: 25 ms / 10 ms frames with snip_edges, DC removal, pre-emphasis
    0.97, povey window, 512-point FFT, power spectrum, Kaldi mel banks from 20 Hz to Nyquist,
    natural log floored at float32 epsilon, no energy term."""
    import kaldi_native_fbank as knf  # imported lazily: only the speaker embedding needs it

    samples = to_mono_float(waveform_16k)
    if samples.size < FBANK_FRAME_LENGTH:
        raise ValueError(
            f"reference audio too short for a speaker embedding ({samples.size} samples at 16 kHz); "
            f"pass at least {FBANK_FRAME_LENGTH} samples (25 ms), preferably a few seconds"
        )
    opts = knf.FbankOptions()
    opts.frame_opts.samp_freq = SAMPLE_RATE
    opts.frame_opts.frame_shift_ms = 10.0
    opts.frame_opts.frame_length_ms = 25.0
    opts.frame_opts.dither = 0.0
    opts.frame_opts.preemph_coeff = 0.97
    opts.frame_opts.remove_dc_offset = True
    opts.frame_opts.window_type = "povey"
    opts.frame_opts.round_to_power_of_two = True
    opts.frame_opts.snip_edges = True
    opts.mel_opts.num_bins = num_mel_bins
    opts.mel_opts.low_freq = 20.0
    opts.mel_opts.high_freq = 0.0  # 0 = Nyquist
    opts.mel_opts.is_librosa = False
    opts.use_energy = False
    opts.use_log_fbank = True
    opts.use_power = True
    fbank = knf.OnlineFbank(opts)
    fbank.accept_waveform(SAMPLE_RATE, samples.tolist())
    fbank.input_finished()
    frames = [fbank.get_frame(i) for i in range(fbank.num_frames_ready)]
    return np.asarray(frames, dtype=np.float32).reshape(len(frames), num_mel_bins)


def mean_normalise(features: np.ndarray) -> np.ndarray:
    """Cepstral mean normalisation: subtract the per-bin mean over time (per clip)."""
    return (features - features.mean(axis=0, keepdims=True)).astype(np.float32)
