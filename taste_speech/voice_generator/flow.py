"""Speech tokens -> 80-bin log-mel: CosyVoice v1's ``MaskedDiffWithXvec`` at inference (spec §7.1).

    spks = Linear(l2norm(x-vector))                         (1, 80)
    h    = encoder(Embedding(tokens.clamp(min=0)))          (1, N, D)   non-causal rel-pos transformer
    h    = encoder_proj(h)                                  (1, N, 80)
    mu   = length_regulator(h, T)                           (1, 80, T)  T = int(float32(N)/50*22050/256)
    mel  = CFM(mu, spks, cond, z)                           (1, 80, T)  10 Euler steps with CFG 0.7

A prompt (tokens + their mel) can be prepended exactly as upstream's ``flow.inference`` does; the
TASTE pipeline never passes one. The only random draw is the ODE start ``z`` (standard normal of
mu's shape): pass ``noise`` to inject it, or a ``torch.Generator``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from taste_speech.voice_generator.estimator import ConditionalDecoder, masked_group_norm

TOKEN_RATE = 50  # speech tokens per second (20 ms each)
OUTPUT_RATE = 22050  # Hz of the audio HiFT makes from the mel
MEL_HOP = 256  # samples per mel frame


def mel_frames_for_tokens(n_tokens: int) -> int:
    """Mel frames for ``n_tokens`` speech tokens, evaluated like upstream: int(float32(n) / 50 * 22050 / 256).

    Equals floor(n * 441 / 256) for n <= 5000 (about 1.7227 frames per token).
    """
    n = torch.tensor([n_tokens], dtype=torch.int32)
    return int((n / TOKEN_RATE * OUTPUT_RATE / MEL_HOP).int()[0])


def nearest_source_index(n_tokens: int, n_frames: int) -> torch.Tensor:
    """Token row copied to each mel frame by torch's 'nearest' interpolation: min(floor(i*float32(L/T)), L-1)
    in float32 arithmetic (sometimes one off from the exact integer floor(i*L/T))."""
    rows = torch.arange(n_tokens, dtype=torch.float32).view(1, 1, -1)
    return F.interpolate(rows, size=n_frames, mode="nearest").view(-1).long()


class LengthRegulator(nn.Module):
    """``InterpolateRegulator``: nearest-neighbour stretch from tokens to mel frames, then convs.

    ``model`` = per sampling ratio [Conv1d k3, GroupNorm(groups), Mish], then Conv1d k1.
    """

    def __init__(self, channels: int = 80, sampling_ratios=(1, 1, 1, 1), out_channels: Optional[int] = None,
                 groups: int = 1):
        super().__init__()
        layers: list[nn.Module] = []
        for _ in sampling_ratios:
            layers += [nn.Conv1d(channels, channels, 3, 1, 1), nn.GroupNorm(groups, channels), nn.Mish()]
        layers.append(nn.Conv1d(channels, out_channels or channels, 1, 1))
        self.model = nn.Sequential(*layers)

    @property
    def receptive_radius(self) -> int:
        """Frames of context on each side that one output frame depends on (1 per k3 conv)."""
        return sum(1 for m in self.model if isinstance(m, nn.Conv1d) and m.kernel_size[0] == 3)

    def stretch(self, h: torch.Tensor, n_frames: int) -> torch.Tensor:
        """(B, N, C) -> (B, C, T) by torch 'nearest' interpolation (no convs)."""
        return F.interpolate(h.transpose(1, 2).contiguous(), size=n_frames, mode="nearest")

    def forward(self, h: torch.Tensor, n_frames: int) -> torch.Tensor:
        """(B, N, C) token features -> (B, C, T) frame features (channel-major, ready for the CFM)."""
        return self.model(self.stretch(h, n_frames))

    def regulate(self, stretched: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The convolutions on frames already stretched, (B, C, T) -> (B, C_out, T). ``mask`` (B, 1, T):
        only the frames where it is 1 are the window's (a window padded to a fixed size): each conv
        sees zeros past them, as at the window's true end, and GroupNorm takes its statistics over
        them alone - their values are the unpadded window's up to float rounding, the padding's are
        zeros."""
        if mask is None:
            return self.model(stretched)
        x = stretched
        layers = list(self.model)
        for conv, norm, act in zip(layers[:-1:3], layers[1:-1:3], layers[2:-1:3]):
            x = act(masked_group_norm(conv(x * mask), norm, mask))
        return layers[-1](x * mask) * mask


class ConditionalCFM(nn.Module):
    """Conditional flow matching sampler: fixed-step Euler over a cosine time schedule with
    classifier-free guidance ``v = (1 + r) v(mu, spks, cond) - r v(0, 0, 0)``, r = 0.7."""

    def __init__(self, estimator: ConditionalDecoder, inference_cfg_rate: float = 0.7, n_timesteps: int = 10,
                 temperature: float = 1.0, solver: str = "euler", t_scheduler: str = "cosine"):
        super().__init__()
        if solver != "euler" or t_scheduler != "cosine":
            raise ValueError(f"only the euler solver with the cosine schedule is supported, got {solver}/{t_scheduler}")
        self.estimator = estimator
        self.inference_cfg_rate = inference_cfg_rate
        self.n_timesteps = n_timesteps
        self.temperature = temperature
        # The original makes two sequential estimator calls per step; one batch-2 call is the same
        # computation (equal up to float rounding) and uses the hardware better.
        self.batch_cfg = True
        # Each resnet block's time projection depends on t alone: made for all steps in one batched
        # pass before the loop (some forty small kernels per step fewer), not in every estimator call.
        self.batch_time = True

    def t_span(self, device=None) -> torch.Tensor:
        t = torch.linspace(0, 1, self.n_timesteps + 1, device=device)
        return 1 - torch.cos(t * 0.5 * torch.pi)

    def velocity(self, x, mask, mu, t, spks, cond, trace: Optional[dict] = None, padded: bool = False,
                 time_shifts: Optional[list] = None, estimator: Optional[Callable] = None) -> torch.Tensor:
        """CFG-combined estimator output at time t (``padded``, ``time_shifts``: see the estimator;
        ``estimator``: what to call instead of ``self.estimator``, e.g. a compiled one)."""
        rate = self.inference_cfg_rate
        estimator = self.estimator if estimator is None else estimator
        if rate <= 0:
            return estimator(x, mask, mu, t, spks, cond, padded, time_shifts)
        if self.batch_cfg:
            both = estimator(
                torch.cat([x, x]), None if mask is None else torch.cat([mask, mask]), torch.cat([mu, torch.zeros_like(mu)]), t,
                torch.cat([spks, torch.zeros_like(spks)]), torch.cat([cond, torch.zeros_like(cond)]), padded, time_shifts,
            )
            v_cond, v_uncond = both.chunk(2)
        else:
            v_cond = estimator(x, mask, mu, t, spks, cond, padded, time_shifts)
            v_uncond = estimator(x, mask, torch.zeros_like(mu), t, torch.zeros_like(spks), torch.zeros_like(cond),
                                 padded, time_shifts)
        if trace is not None:
            trace.setdefault("est_cond", []).append(v_cond)
            trace.setdefault("est_uncond", []).append(v_uncond)
        return (1.0 + rate) * v_cond - rate * v_uncond

    @torch.inference_mode()
    def forward(self, mu, mask, spks, cond, noise: torch.Tensor, trace: Optional[dict] = None,
                padded: bool = False, estimator: Optional[Callable] = None) -> torch.Tensor:
        """Integrate from ``x_0 = noise * temperature`` to t = 1. All (B, 80, T) except mask (B, 1, T),
        which may be None where every frame is valid (no multiplications by ones: fewer kernels).

        ``padded``: the frames where mask is 0 are padding after the sequence end (a fixed-shape
        window); the valid frames come out as without it. The loop has no host synchronisation and
        no data-dependent shapes, so it can be captured whole as a CUDA graph. ``estimator``: called
        in place of ``self.estimator`` (the same module compiled, say); the time conditioning stays
        ``self.estimator``'s."""
        x = noise * self.temperature
        t_span = self.t_span(mu.device)
        # The steps' times first: t accumulates in float32 and dt is recomputed from the schedule,
        # exactly like upstream.
        times, deltas = [], []
        t, dt = t_span[0], t_span[1] - t_span[0]
        for step in range(1, len(t_span)):
            times.append(t)
            deltas.append(dt)
            if step < len(t_span) - 1:
                t = t + dt
                dt = t_span[step + 1] - t
        # Then the time conditioning of every step in one batched pass (it depends on t alone).
        shifts = self.estimator.time_shifts(torch.stack(times)) if self.batch_time else None
        if trace is not None:
            trace.update(t_span=t_span, t_used=times, dt_used=deltas, ode_states=[x])
        for step, (t, dt) in enumerate(zip(times, deltas)):
            step_shifts = None if shifts is None else [shift[step:step + 1] for shift in shifts]
            x = x + dt * self.velocity(x, mask, mu, t, spks, cond, trace, padded, step_shifts, estimator)
            if trace is not None:
                trace["ode_states"].append(x)
        return x


def _build_encoder(args: dict) -> nn.Module:
    """The flow encoder: a non-causal rel-pos (Transformer-XL style) transformer, shared code with the
    speech decoder's encoders."""
    from taste_speech.espnet_transformer import RelPositionTransformer

    return RelPositionTransformer(
        input_size=args["input_size"],
        output_size=args["output_size"],
        attention_heads=args["attention_heads"],
        linear_units=args["linear_units"],
        num_blocks=args["num_blocks"],
        input_layer="linear",
        ffn_activation="silu",
        norm_names=("norm_mha", "norm_ff"),
        causal=False,
    )


class MelFlow(nn.Module):
    """Our equivalent of ``MaskedDiffWithXvec`` (inference only); attribute names = published keys."""

    def __init__(self, flow_args: dict, encoder_args: dict, regulator_args: dict, cfm_args: dict,
                 estimator_args: dict):
        super().__init__()
        self.input_size = flow_args["input_size"]
        self.output_size = flow_args["output_size"]
        self.vocab_size = flow_args["vocab_size"]
        if flow_args.get("input_frame_rate", TOKEN_RATE) != TOKEN_RATE:
            raise ValueError("input_frame_rate must be 50: upstream's inference hard-codes 50 tokens per second")
        self.input_embedding = nn.Embedding(self.vocab_size, self.input_size)
        self.spk_embed_affine_layer = nn.Linear(flow_args["spk_embed_dim"], self.output_size)
        self.encoder = _build_encoder(encoder_args)
        self.encoder_proj = nn.Linear(encoder_args["output_size"], self.output_size)
        self.length_regulator = LengthRegulator(
            channels=regulator_args["channels"],
            sampling_ratios=regulator_args["sampling_ratios"],
            out_channels=regulator_args.get("out_channels"),
            groups=regulator_args.get("groups", 1),
        )
        self.decoder = ConditionalCFM(ConditionalDecoder(**estimator_args), **cfm_args)

    # -- pieces (also used by the streaming synthesiser) ---------------------------------------
    def speaker_projection(self, speaker_embedding: torch.Tensor, trace: Optional[dict] = None) -> torch.Tensor:
        """(1, spk_embed_dim) x-vector -> (1, 80) ``spks``; the x-vector is L2-normalised first."""
        if speaker_embedding.dim() != 2 or speaker_embedding.shape[1] != self.spk_embed_affine_layer.in_features:
            raise ValueError(
                f"speaker embedding must be (1, {self.spk_embed_affine_layer.in_features}), "
                f"got {tuple(speaker_embedding.shape)}"
            )
        normalized = F.normalize(speaker_embedding.to(self.spk_embed_affine_layer.weight), dim=1)
        if trace is not None:
            trace["spk_normalized"] = normalized
        return self.spk_embed_affine_layer(normalized)

    def check_tokens(self, tokens: torch.Tensor, name: str = "speech tokens") -> torch.Tensor:
        if tokens.dim() != 2 or tokens.shape[0] != 1:
            raise ValueError(f"{name} must be shaped (1, N) (batch size 1), got {tuple(tokens.shape)}")
        if tokens.is_floating_point():
            raise ValueError(f"{name} must be integer ids, got dtype {tokens.dtype}")
        values = tokens.reshape(-1).tolist()  # (host ids: checked without waiting for the GPU)
        if values and max(values) >= self.vocab_size:
            raise ValueError(
                f"{name} contain id {max(values)} >= vocab_size {self.vocab_size}; the speech decoder's "
                "EOS (4096) or other special ids must be stripped before the voice generator"
            )
        return tokens

    def encode_tokens(self, tokens: torch.Tensor, trace: Optional[dict] = None) -> torch.Tensor:
        """(1, N) ids -> (1, N, 80) projected encoder output (negative ids are clamped to 0 like upstream)."""
        emb = self.input_embedding(tokens.clamp(min=0).long())
        if trace is not None:
            trace["token_emb_masked"] = emb
        h = self.encoder(emb, None)  # batch 1 without padding: every position is valid
        if trace is not None:
            trace["h_enc"] = h
        h = self.encoder_proj(h)
        if trace is not None:
            trace["h_proj"] = h
        return h

    def draw_noise(self, n_frames: int, generator: Optional[torch.Generator] = None, device=None) -> torch.Tensor:
        """The CFM start noise for ``n_frames`` frames: standard normal (1, 80, T), drawn where the
        generator lives (a CPU generator gives the same noise on every device)."""
        device = device or self.input_embedding.weight.device
        where = generator.device if generator is not None else device
        return torch.randn((1, self.output_size, n_frames), generator=generator, device=where,
                           dtype=self.input_embedding.weight.dtype).to(device)

    # -- whole-utterance inference ------------------------------------------------------------
    @torch.inference_mode()
    def inference(
        self,
        tokens: torch.Tensor,
        speaker_embedding: torch.Tensor,
        prompt_tokens: Optional[torch.Tensor] = None,
        prompt_mel: Optional[torch.Tensor] = None,
        noise: Optional[torch.Tensor] = None,
        generator: Optional[torch.Generator] = None,
        trace: Optional[dict] = None,
    ) -> torch.Tensor:
        """Mel (1, 80, T - Tp) for ``tokens`` (1, N).

        prompt_tokens (1, P) and prompt_mel (1, Tp, 80) (time-major, as upstream) are prepended;
        noise (1, 80, T) with T = frames of P + N tokens is the injected ODE start, else drawn with
        ``generator`` (or the global RNG).
        """
        self.check_tokens(tokens)
        device = self.input_embedding.weight.device
        if prompt_tokens is None:
            prompt_tokens = torch.zeros(1, 0, dtype=torch.long, device=device)
        self.check_tokens(prompt_tokens, "prompt tokens")
        if prompt_mel is None:
            prompt_mel = torch.zeros(1, 0, self.output_size, device=device)
        if prompt_mel.dim() != 3 or prompt_mel.shape[0] != 1 or prompt_mel.shape[2] != self.output_size:
            raise ValueError(f"prompt_mel must be time-major (1, Tp, {self.output_size}), got {tuple(prompt_mel.shape)}")
        all_tokens = torch.cat([prompt_tokens.to(device).long(), tokens.to(device).long()], dim=1)
        if all_tokens.shape[1] == 0:
            raise ValueError("no speech tokens to synthesise")

        spks = self.speaker_projection(speaker_embedding.to(device), trace)
        h = self.encode_tokens(all_tokens, trace)
        n_frames = mel_frames_for_tokens(all_tokens.shape[1])
        n_prompt_frames = prompt_mel.shape[1]
        if n_prompt_frames > n_frames:
            raise ValueError(f"prompt mel has {n_prompt_frames} frames but all tokens give only {n_frames}")
        mu = self.length_regulator(h, n_frames)
        mask = torch.ones(1, 1, n_frames, device=device, dtype=mu.dtype)
        cond = torch.zeros(1, self.output_size, n_frames, device=device, dtype=mu.dtype)
        cond[:, :, :n_prompt_frames] = prompt_mel.to(mu).transpose(1, 2)
        if noise is None:
            noise = self.draw_noise(n_frames, generator, device)
        elif tuple(noise.shape) != (1, self.output_size, n_frames):
            raise ValueError(
                f"flow noise must be (1, {self.output_size}, {n_frames}) for {all_tokens.shape[1]} tokens, "
                f"got {tuple(noise.shape)}"
            )
        if trace is not None:
            trace.update(
                spk_proj=spks, spks=spks, feat_len=torch.tensor([n_frames], dtype=torch.int32),
                lr_index=nearest_source_index(all_tokens.shape[1], n_frames), mu_frames=mu.transpose(1, 2),
                mu=mu, mask=mask, conds=cond, draw_z=noise,
            )
        mel = self.decoder(mu, mask, spks, cond, noise.to(mu), trace)
        return mel[:, :, n_prompt_frames:]
