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
        phase = torch.rand((1, n_harmonics, 1), generator=generator, device=device)
        noise = torch.randn((1, n_harmonics, n_samples), generator=generator, device=device)
        branch = torch.randn((1, n_samples, 1), generator=generator, device=device)
        return cls(phase, noise, branch)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for act1, conv1, act2, conv2 in zip(self.activations1, self.convs1, self.activations2, self.convs2):
            x = x + conv2(act2(conv1(act1(x))))
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

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """(B, 80, T) -> (B, T)."""
        return self.classifier(self.condnet(mel).transpose(1, 2)).squeeze(-1).abs()


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
        """Per-sample phase increment in cycles for each harmonic: (B, 1, L) -> (B, H, L)."""
        return torch.cat([f0_up * (h + 1) / self.sampling_rate for h in range(self.n_harmonics)], dim=1)

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

    def decode(self, mel: torch.Tensor, source: torch.Tensor, trace: Optional[dict] = None) -> torch.Tensor:
        """mel (B, 80, T) and source (B, 1, 256 T) -> waveform (B, 256 T), before the final clamp."""
        s_stft = self.stft(source.squeeze(1))
        x = self.conv_pre(mel)
        for i in range(self.num_upsamples):
            x = self.ups[i](F.leaky_relu(x, self.lrelu_slope))
            if i == self.num_upsamples - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + self.source_resblocks[i](self.source_downs[i](s_stft))
            blocks = self.resblocks[i * self.num_kernels:(i + 1) * self.num_kernels]
            total = blocks[0](x)
            for block in blocks[1:]:
                total = total + block(x)
            x = total / self.num_kernels
        x = self.conv_post(F.leaky_relu(x))  # torch's default slope 0.01 here (not lrelu_slope)
        half = self.n_fft // 2 + 1
        wav = self.istft(torch.exp(x[:, :half]), torch.sin(x[:, half:]))
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
