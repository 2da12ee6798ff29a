"""HiFT vocoder: mel (1, 80, T) -> 22.05 kHz waveform (1, 256 T) (spec §7.2).

Neural source filter + iSTFT head (CosyVoice's ``HiFTGenerator``):

    f0   = F0 predictor(mel)                                   (1, T) Hz
    src  = tanh(Linear(9 -> 1)(harmonic sines of f0 + noise))  (1, 1, 256 T)
    S    = STFT(src)  (n_fft 16, hop 4, periodic Hann, centred)  -> 18 channels (real, imag)
    x    = conv_pre(mel); 2 x [leaky 0.1, ConvTranspose x8, (+reflect pad on the last), + source branch,
           mean of 3 ResBlocks]; leaky 0.01; conv_post -> 18 channels
    wav  = iSTFT(exp(x[:9]) clipped at 100, phase sin(x[9:])), clamped to +-0.99

Random draws (three per call, in upstream order): the harmonics' initial phases (uniform), the
source noise (normal), and a noise branch the original draws but never uses. They are injectable
through :class:`SourceDraws` so that parity with the golden vectors is exact.

Padded windows (``decode(..., frame_mask=...)``, used by the fixed-shape streaming buckets): the
mel frames where the mask is 0 are padding after the sequence end. Every convolution then sees
zeros past the end (its activations are masked at each rate), the source's STFT sees the
reflection that centring would give at the true end, and the iSTFT's overlap-add and window
normalisation stop at the last valid frame, so the valid samples equal an unpadded call (up to
float rounding). Without a mask the published computation runs unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from taste_speech.voice_generator.weight_norm import WNConv1d, WNConvTranspose1d


@dataclass
class SourceDraws:
    """The random draws of one HiFT call (L = 256 * mel frames samples, H = harmonics + 1).

    phase_u01: (1, H, 1) uniform [0, 1) -> initial phase -pi + u * 2pi (harmonic 0 forced to 0).
    sine_noise: (1, H, L) standard normal, scaled by 0.003 (voiced) or 0.1/3 (unvoiced).
    noise_branch: (1, L, 1) drawn by the original but unused; kept so the RNG stream matches it.
    """

    phase_u01: torch.Tensor
    sine_noise: torch.Tensor
    noise_branch: Optional[torch.Tensor] = None

    @classmethod
    def draw(cls, n_harmonics: int, n_samples: int, generator: Optional[torch.Generator] = None,
             device=None) -> "SourceDraws":
        where = generator.device if generator is not None else device  # a CPU generator: same draws everywhere
        phase = torch.rand((1, n_harmonics, 1), generator=generator, device=where)
        noise = torch.randn((1, n_harmonics, n_samples), generator=generator, device=where)
        branch = torch.randn((1, n_samples, 1), generator=generator, device=where)
        return cls(phase.to(device), noise.to(device), branch.to(device))


class Snake(nn.Module):
    """x + sin^2(alpha x) / (alpha + 1e-9), one learned alpha per channel (linear scale)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.view(1, -1, 1)
        return x + (1.0 / (alpha + 1e-9)) * torch.sin(x * alpha).pow(2)


def _same_padding(kernel: int, dilation: int) -> int:
    return (kernel * dilation - dilation) // 2


def _masked(x: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """x with padded positions zeroed (x itself when there is no padding)."""
    return x if mask is None else x * mask


class ResBlock(nn.Module):
    """Three residual units: Snake -> WN conv (dilation d_i) -> Snake -> WN conv (dilation 1)."""

    def __init__(self, channels: int, kernel_size: int, dilations=(1, 3, 5)):
        super().__init__()
        self.convs1 = nn.ModuleList(
            WNConv1d(channels, channels, kernel_size, 1, dilation=d, padding=_same_padding(kernel_size, d))
            for d in dilations
        )
        self.convs2 = nn.ModuleList(
            WNConv1d(channels, channels, kernel_size, 1, dilation=1, padding=_same_padding(kernel_size, 1))
            for _ in dilations
        )
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    @property
    def receptive_radius(self) -> int:
        return sum(_same_padding(c.kernel_size[0], c.dilation[0]) for c in [*self.convs1, *self.convs2])

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``mask`` (B, 1, T): zero past the valid end (x must be zero there too); Snake keeps zeros."""
        for act1, conv1, act2, conv2 in zip(self.activations1, self.convs1, self.activations2, self.convs2):
            x = x + _masked(conv2(act2(_masked(conv1(act1(x)), mask))), mask)
        return x


class F0Predictor(nn.Module):
    """``ConvRNNF0Predictor`` (no RNN): 5 x [WN Conv1d k3 + ELU], Linear -> 1, abs -> F0 in Hz per frame."""

    def __init__(self, num_class: int = 1, in_channels: int = 80, cond_channels: int = 512):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            layers += [WNConv1d(in_channels if i == 0 else cond_channels, cond_channels, 3, padding=1), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, num_class)

    receptive_radius = 5  # frames on each side (five k3 convs)

    def forward(self, mel: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(B, 80, T) -> (B, T). ``mask`` (B, 1, T): only the frames where it is 1 are the window's (a
        window padded to a fixed size): every conv sees zeros past them, as at the true end, so
        their F0 is the unpadded window's."""
        x = mel
        for conv, act in zip(self.condnet[::2], self.condnet[1::2]):
            x = act(conv(x if mask is None else x * mask))
        return self.classifier(x.transpose(1, 2)).squeeze(-1).abs()


class SineSource(nn.Module):
    """Harmonic source (``SourceModuleHnNSF`` with its ``SineGen``): f0 at sample rate -> (B, 1, L).

    Holds the merge layer ``l_linear`` (published key ``hift.m_source.l_linear``).
    """

    def __init__(self, sampling_rate: int, harmonic_num: int, sine_amp: float, noise_std: float,
                 voiced_threshold: float):
        super().__init__()
        self.sampling_rate = sampling_rate
        self.n_harmonics = harmonic_num + 1
        self.sine_amp, self.noise_std, self.voiced_threshold = sine_amp, noise_std, voiced_threshold
        self.l_linear = nn.Linear(self.n_harmonics, 1)

    def cycles(self, f0_up: torch.Tensor) -> torch.Tensor:
        """Per-sample phase increment in cycles for each harmonic: (B, 1, L) -> (B, H, L), f0 times the
        harmonic's number, over the sampling rate (all harmonics at once: three operators, where one
        per harmonic took 27 - each a kernel launch on a GPU - for the same numbers)."""
        numbers = torch.arange(1, self.n_harmonics + 1, device=f0_up.device, dtype=f0_up.dtype).view(1, -1, 1)
        return f0_up * numbers / self.sampling_rate

    def initial_phase(self, phase_u01: torch.Tensor) -> torch.Tensor:
        """Uniform draw u -> phase -pi + u * 2pi in float32 (torch's Uniform(-pi, pi)), harmonic 0 at 0."""
        low = torch.tensor(-math.pi, dtype=torch.float32)
        high = torch.tensor(math.pi, dtype=torch.float32)
        phase = (low + phase_u01.float() * (high - low)).clone()
        phase[:, 0, :] = 0
        return phase

    def forward(self, f0_up: torch.Tensor, draws: SourceDraws, cycle_offset: Optional[torch.Tensor] = None,
                trace: Optional[dict] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """f0_up (B, 1, L) Hz -> (source (B, 1, L), cycle position of every harmonic after each sample (B, H, L)).

        The phase integral restarts at 0 on every call, like the original. A streaming caller passes
        ``cycle_offset`` (B, H, 1): the cycle position (in [0, 1)) reached at the end of its previous
        chunk, so the sines continue without a phase jump.
        """
        cumulative = torch.cumsum(self.cycles(f0_up), dim=-1)
        if cycle_offset is not None:
            cumulative = cumulative + cycle_offset
        cycles = cumulative % 1
        theta = 2 * math.pi * cycles
        phase = self.initial_phase(draws.phase_u01).to(f0_up)
        sines = self.sine_amp * torch.sin(theta + phase)
        uv = (f0_up > self.voiced_threshold).float()
        noise_amp = uv * self.noise_std + (1 - uv) * self.sine_amp / 3
        sines = sines * uv + noise_amp * draws.sine_noise.to(f0_up)
        source = torch.tanh(self.l_linear(sines.transpose(1, 2))).transpose(1, 2)
        if trace is not None:
            trace.update(phase_vec=phase, uv=uv, sine_waves=sines, s=source)
        return source, cycles


class HiFTGenerator(nn.Module):
    def __init__(
        self,
        in_channels: int = 80,
        base_channels: int = 512,
        nb_harmonics: int = 8,
        sampling_rate: int = 22050,
        nsf_alpha: float = 0.1,
        nsf_sigma: float = 0.003,
        nsf_voiced_threshold: float = 10,
        upsample_rates=(8, 8),
        upsample_kernel_sizes=(16, 16),
        istft_params: Optional[dict] = None,
        resblock_kernel_sizes=(3, 7, 11),
        resblock_dilation_sizes=((1, 3, 5), (1, 3, 5), (1, 3, 5)),
        source_resblock_kernel_sizes=(7, 11),
        source_resblock_dilation_sizes=((1, 3, 5), (1, 3, 5)),
        lrelu_slope: float = 0.1,
        audio_limit: float = 0.99,
        f0_predictor: Optional[dict] = None,
    ):
        super().__init__()
        istft_params = dict(istft_params or {"n_fft": 16, "hop_len": 4})
        upsample_rates = list(upsample_rates)
        self.sampling_rate = sampling_rate
        self.n_fft, self.hop = istft_params["n_fft"], istft_params["hop_len"]
        self.lrelu_slope, self.audio_limit = lrelu_slope, audio_limit
        self.num_kernels = len(resblock_kernel_sizes)
        self.num_upsamples = len(upsample_rates)
        self.samples_per_frame = math.prod(upsample_rates) * self.hop  # 256

        self.m_source = SineSource(sampling_rate, nb_harmonics, nsf_alpha, nsf_sigma, nsf_voiced_threshold)
        self.conv_pre = WNConv1d(in_channels, base_channels, 7, 1, padding=3)
        self.ups = nn.ModuleList(
            WNConvTranspose1d(base_channels // 2**i, base_channels // 2 ** (i + 1), k, u, padding=(k - u) // 2)
            for i, (u, k) in enumerate(zip(upsample_rates, upsample_kernel_sizes))
        )
        # Source branch per level: the source STFT (hop 4) is brought to that level's rate.
        # Level i needs a stride of prod(upsample_rates[i+1:]) (8 then 1 at full size).
        spec_channels = self.n_fft + 2
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (k, d) in enumerate(zip(source_resblock_kernel_sizes, source_resblock_dilation_sizes)):
            stride = math.prod(upsample_rates[i + 1:])
            ch = base_channels // 2 ** (i + 1)
            if stride == 1:
                self.source_downs.append(nn.Conv1d(spec_channels, ch, 1, 1))
            else:
                self.source_downs.append(nn.Conv1d(spec_channels, ch, stride * 2, stride, padding=stride // 2))
            self.source_resblocks.append(ResBlock(ch, k, d))
        self.resblocks = nn.ModuleList(
            ResBlock(base_channels // 2 ** (i + 1), k, d)
            for i in range(self.num_upsamples)
            for k, d in zip(resblock_kernel_sizes, resblock_dilation_sizes)
        )
        self.conv_post = WNConv1d(base_channels // 2**self.num_upsamples, spec_channels, 7, 1, padding=3)
        self.f0_predictor = F0Predictor(**(f0_predictor or {}))
        # Periodic Hann window, computed in float64 then rounded (as scipy.signal.get_window + astype).
        n = torch.arange(self.n_fft, dtype=torch.float64)
        window = (0.5 - 0.5 * torch.cos(2 * math.pi * n / self.n_fft)).float()
        self.register_buffer("stft_window", window, persistent=False)

    # -- pieces ---------------------------------------------------------------------------------
    def upsample_f0(self, f0: torch.Tensor) -> torch.Tensor:
        """(B, T) per-frame F0 -> (B, 1, 256 T), each frame repeated (nearest)."""
        return f0.unsqueeze(1).repeat_interleave(self.samples_per_frame, dim=-1)

    def stft(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L) -> (B, n_fft + 2, L / hop + 1): [real; imag] of the centred STFT."""
        spec = torch.stft(x, self.n_fft, self.hop, self.n_fft, window=self.stft_window, return_complex=True)
        return torch.cat([spec.real, spec.imag], dim=1)

    def istft(self, magnitude: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
        magnitude = torch.clip(magnitude, max=1e2)
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        return torch.istft(spec, self.n_fft, self.hop, self.n_fft, window=self.stft_window)

    def level_masks(self, frame_mask: torch.Tensor) -> list[torch.Tensor]:
        """Masks of a padded window at each upsampling level's rate: (B, 1, 8 T), then (B, 1, 64 T + 1)
        (the last level is reflect-padded by one on the left; its length is also the source STFT's)."""
        masks, rate = [], 1
        b, _, t = frame_mask.shape
        for i, up in enumerate(self.ups):
            rate *= up.stride[0]
            m = frame_mask.unsqueeze(-1).expand(b, 1, t, rate).reshape(b, 1, t * rate)  # (no host sync)
            masks.append(torch.cat([m[..., :1], m], dim=-1) if i == self.num_upsamples - 1 else m)
        return masks

    def reflect_past_end(self, source: torch.Tensor, frame_mask: torch.Tensor) -> torch.Tensor:
        """source (B, 1, L) with the samples after the valid end replaced by their reflection, as the
        centred STFT pads a sequence that really ends there (device-side length: no host sync)."""
        n_valid = (frame_mask.sum(dim=-1, keepdim=True) * self.samples_per_frame).long()  # (B, 1, 1)
        index = torch.arange(source.shape[-1], device=source.device).view(1, 1, -1)
        reflected = (2 * (n_valid - 1) - index).clamp(min=0)
        return source.gather(-1, torch.where(index < n_valid, index, reflected))

    def istft_padded(self, magnitude: torch.Tensor, phase: torch.Tensor, frame_mask: torch.Tensor) -> torch.Tensor:
        """``istft`` over the STFT frames where frame_mask (B, 1, F) is 1 only: overlap-add and window
        normalisation written out (torch.istft checks its window envelope on the host, which a CUDA
        graph cannot do); samples no valid frame reaches are 0."""
        magnitude = torch.clip(magnitude, max=1e2) * frame_mask
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        window = self.stft_window.view(1, -1, 1)
        frames = torch.fft.irfft(spec, n=self.n_fft, dim=1) * window  # (B, n_fft, F)
        total = self.n_fft + self.hop * (frames.shape[-1] - 1)

        def overlap_add(columns: torch.Tensor) -> torch.Tensor:
            folded = F.fold(columns, (1, total), (1, self.n_fft), stride=(1, self.hop))
            return folded.view(columns.shape[0], total)[:, self.n_fft // 2:total - self.n_fft // 2]

        wav = overlap_add(frames)
        envelope = overlap_add((window * window * frame_mask).expand(frames.shape[0], -1, -1))
        return torch.where(envelope > 1e-11, wav / envelope, torch.zeros_like(wav))

    def decode(self, mel: torch.Tensor, source: torch.Tensor, trace: Optional[dict] = None,
               frame_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """mel (B, 80, T) and source (B, 1, 256 T) -> waveform (B, 256 T), before the final clamp.

        ``frame_mask`` (B, 1, T): 1 on the valid frames, 0 on padding after them (module docstring);
        the samples past 256 x valid frames are then meaningless."""
        masks = [None] * self.num_upsamples
        if frame_mask is not None:
            masks = self.level_masks(frame_mask)
            source = self.reflect_past_end(source, frame_mask)
            mel = mel * frame_mask
        s_stft = _masked(self.stft(source.squeeze(1)), masks[-1])
        x = _masked(self.conv_pre(mel), frame_mask)
        for i in range(self.num_upsamples):
            x = self.ups[i](F.leaky_relu(x, self.lrelu_slope))
            if i == self.num_upsamples - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            m = masks[i]
            x = _masked(x, m) + self.source_resblocks[i](_masked(self.source_downs[i](s_stft), m), m)
            blocks = self.resblocks[i * self.num_kernels:(i + 1) * self.num_kernels]
            total = blocks[0](x, m)
            for block in blocks[1:]:
                total = total + block(x, m)
            x = total / self.num_kernels
        x = self.conv_post(F.leaky_relu(x))  # torch's default slope 0.01 here (not lrelu_slope)
        half = self.n_fft // 2 + 1
        if frame_mask is None:
            wav = self.istft(torch.exp(x[:, :half]), torch.sin(x[:, half:]))
        else:
            wav = self.istft_padded(torch.exp(x[:, :half]), torch.sin(x[:, half:]), masks[-1])
        if trace is not None:
            trace.update(s_stft=s_stft, conv_post_out=x, istft_out=wav)
        return wav

    def draw_source(self, n_frames: int, generator: Optional[torch.Generator] = None) -> SourceDraws:
        return SourceDraws.draw(self.m_source.n_harmonics, n_frames * self.samples_per_frame, generator,
                                self.stft_window.device)

    @torch.inference_mode()
    def inference(self, mel: torch.Tensor, draws: Optional[SourceDraws] = None,
                  generator: Optional[torch.Generator] = None, trace: Optional[dict] = None) -> torch.Tensor:
        """mel (1, 80, T) -> waveform (1, 256 T) at ``sampling_rate``, clamped to +-audio_limit."""
        if mel.dim() != 3 or mel.shape[1] != self.conv_pre.in_channels:
            raise ValueError(f"mel must be (1, {self.conv_pre.in_channels}, T), got {tuple(mel.shape)}")
        n_samples = mel.shape[-1] * self.samples_per_frame
        if draws is None:
            draws = self.draw_source(mel.shape[-1], generator)
        elif draws.sine_noise.shape[-1] != n_samples:
            raise ValueError(f"source draws cover {draws.sine_noise.shape[-1]} samples, the mel needs {n_samples}")
        f0 = self.f0_predictor(mel)
        f0_up = self.upsample_f0(f0)
        source, _ = self.m_source(f0_up, draws, trace=trace)
        wav = self.decode(mel, source, trace)
        if trace is not None:
            trace.update(f0=f0, f0_up=f0_up)
        return torch.clamp(wav, -self.audio_limit, self.audio_limit)
