"""Streaming synthesis: speech tokens arriving in pieces -> seamless audio chunks (flow + HiFT).

The voice generator is non-causal end to end (spec §8): its encoder and U-Net attend over the
whole utterance and HiFT's convolutions look both ways, so a chunk cannot be synthesised alone
and then glued on. Each step therefore works on a bounded *window* and keeps continuity through
the explicit :class:`SynthesisState`:

flow step (tokens -> final mel frames [mel_done, E))
    window = ``context_tokens`` tokens of left context + the chunk + up to ``lookahead_tokens``.
    Tokens are stretched onto the utterance's global frame grid (441/256 frames per token), the
    ODE noise of every frame comes from a per-frame noise tape, and - with
    ``EmissionPolicy.prompt_with_emitted_mel``, off by default - the already emitted mel of the
    left-context frames is given as the CFM's prompt (``cond``; upstream's prompt mechanism), so
    the new frames continue it. The first frames are cross-faded with the provisional frames
    the previous window computed for them; the last ``mel_crossfade_frames`` (or the lookahead
    frames) stay provisional. A window starts on an even frame of the utterance (the flow's
    U-Net runs most layers at half the frame rate, on the frames offline synthesis uses) and,
    on the bucketed path, reaches further back to a size with an unpadded step of its own
    (``EmissionPolicy.window_frames``; see ``_window_start``).
vocoder step (final mel -> final samples [256 voc_done, 256 E_h))
    HiFT runs on ``vocoder_context_frames`` frames of final mel before the new ones. The harmonic
    source of the context is the cached source already used for emitted audio, and the new source
    continues each harmonic's cycle position (no phase reset, unlike calling HiFT per chunk). The
    last ``vocoder_lookahead_frames`` are held back; the first ``wave_crossfade_samples`` of new
    audio are overlap-added with the previous step's provisional tail.

Per-step work depends on the window sizes only, not on how long the utterance already is.
Two ways to run a step (``kind`` of :func:`start_speaking`): 'dynamic', eager at each window's own
size (the reference, the default off CUDA), and 'static': the flow's ODE and HiFT's decode padded to
fixed-size buckets and replayed as CUDA graphs on CUDA (``synthesis_graphs``; the default on CUDA).
Concatenated chunks have exactly the offline length (256 samples per frame, frames =
floor(tokens * 441 / 256)); a fade-in starts the audio and a fade-out ends the final chunk, and
the output is resampled from 22.05 kHz with soxr (streaming; HQ, at 8 kHz LQ: ``resampler_quality``).

Usage::

    state = start_speaking(vg, speaker_embeds, policy="low_latency", out_sampling_rate=16000,
                           generator=torch.Generator().manual_seed(0))
    for token_piece in speech_token_stream:            # any sizes, (1, n) int
        for chunk in speak(vg, state, token_piece):
            play(chunk.audio)                          # (1, samples) float32 at 16 kHz
    for chunk in speak(vg, state, final=True):         # flush the held-back audio, fade out
        play(chunk.audio)
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from taste_speech.device_copies import to_device
from taste_speech.processing_taste import as_speaker_embedding
from taste_speech.streaming.synthesis_graphs import SynthesisGraphs, resolve_kind, shared_graphs
from taste_speech.streaming.synthesis_state import (
    SAMPLES_PER_FRAME,
    SOURCE_RATE,
    SUPPORTED_OUTPUT_RATES,
    EmissionPolicy,
    NoiseTape,
    SynthesisState,
    frames_for_tokens,
    resampler_quality,
)
from taste_speech.voice_generator import SourceDraws, VoiceGenerator

# The flow's U-Net runs most of its layers at half the frame rate (one stride-2 level): offline
# synthesis computes them on the frames 0, 2, 4 ... of the utterance.
FLOW_GRID = 2
# Noise is drawn on the host (the same values on every device) a block at a time, and a reply's
# first block is drawn on its way to first audio: the source's is kept small (64 frames x 256
# samples x 9 harmonics, ~0.5 ms on one core; 512 frames took ~5 ms), the flow's is small anyway.
FLOW_NOISE_BLOCK_FRAMES = 512
SOURCE_NOISE_BLOCK_FRAMES = 64


@dataclass
class SpeechChunk:
    """What one synthesis step produced."""

    audio: torch.Tensor  # (1, n) float32 at sampling_rate (what to play)
    sampling_rate: int
    audio_22k: torch.Tensor  # (1, m) float32 at 22050 Hz, before resampling
    first_sample: int  # 22.05 kHz index of audio_22k[0] in the utterance
    source_22k: torch.Tensor  # (1, m) the harmonic source (HiFT excitation) under audio_22k
    mel: torch.Tensor  # (1, 80, f) mel frames finalised by this step
    first_frame: int  # frame index of mel[..., 0]
    tokens_committed: int  # chunk boundary: tokens covered once this chunk's audio is complete
    is_final: bool
    compute_s: float  # wall time of this step
    flow_s: float = 0.0  # of which the flow step (on CUDA the split is exact only with state.time_stages)

    @property
    def duration_ms(self) -> float:
        return 1000.0 * self.audio.shape[-1] / self.sampling_rate


def _ramp(n: int, device=None) -> torch.Tensor:
    """Raised-cosine weights rising from ~0 to ~1 over n points (the new signal's cross-fade weight)."""
    k = torch.arange(1, n + 1, dtype=torch.float32, device=device)
    return 0.5 - 0.5 * torch.cos(math.pi * k / (n + 1))


def _check_new_tokens(vg: VoiceGenerator, tokens) -> torch.Tensor:
    if tokens is None:
        return torch.zeros(1, 0, dtype=torch.long)
    tokens = torch.as_tensor(tokens)
    if tokens.dim() == 1:
        tokens = tokens.unsqueeze(0)
    return vg.flow.check_tokens(tokens).long()


@torch.inference_mode()
def start_speaking(
    vg: VoiceGenerator,
    speaker_embeds: torch.Tensor,
    policy: EmissionPolicy | str = "low_latency",
    out_sampling_rate: int = 16000,
    generator: Optional[torch.Generator] = None,
    kind: str = "auto",
    graphs: Optional[SynthesisGraphs] = None,
) -> SynthesisState:
    """A fresh continuity state for one utterance in the voice of ``speaker_embeds`` (1, spk_dim).

    ``generator`` seeds the noise tapes and the source phases (the global RNG when None).
    ``kind``: 'dynamic' (eager, every window at its own size), 'static' (bucketed fixed-shape steps
    through ``graphs``, by default the voice generator's shared one) or 'auto' (static on CUDA,
    dynamic elsewhere). Passing ``graphs`` (e.g. ``SynthesisGraphs(vg, "rehearse")``) selects static.
    """
    if out_sampling_rate not in SUPPORTED_OUTPUT_RATES:
        raise ValueError(f"out_sampling_rate must be one of {SUPPORTED_OUTPUT_RATES}, got {out_sampling_rate!r}")
    policy = EmissionPolicy.resolve(policy)
    device = vg.flow.input_embedding.weight.device
    if graphs is not None:
        if kind == "dynamic":
            raise ValueError("graphs were given with kind='dynamic': pass kind='static' (or 'auto'), or no graphs")
        if graphs.vg is not vg:
            raise ValueError("these SynthesisGraphs belong to another voice generator: make one for this one")
    elif resolve_kind(kind, device) == "static":
        graphs = shared_graphs(vg)
    dim = vg.flow.spk_embed_affine_layer.in_features
    if isinstance(speaker_embeds, torch.Tensor) and speaker_embeds.device.type != "cpu":
        # already on the GPU: its values are not read here (a read waits for the GPU's queue)
        if speaker_embeds.numel() != dim:
            raise ValueError(f"speaker_embeds must be one (1, {dim}) voice vector, got {tuple(speaker_embeds.shape)}")
        speaker_embeds = speaker_embeds.reshape(1, dim).float()
    else:  # NaN, zeros or a batch of voices would otherwise surface deep in the flow, or as noise
        speaker_embeds = as_speaker_embedding(speaker_embeds, dim)
    speaker_embeds = to_device(speaker_embeds, device)
    spks = vg.flow.speaker_projection(speaker_embeds)
    harmonics = vg.hift.m_source.n_harmonics
    flow_seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    source_seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    phase_u01 = to_device(torch.rand((1, harmonics, 1), generator=generator), device)
    resampler = None
    if out_sampling_rate != SOURCE_RATE:
        import soxr

        resampler = soxr.ResampleStream(SOURCE_RATE, out_sampling_rate, 1, dtype="float32",
                                        quality=resampler_quality(out_sampling_rate))
    state = SynthesisState(
        policy=policy,
        out_sampling_rate=out_sampling_rate,
        spks=spks,
        speaker_embeds=speaker_embeds.detach().clone(),
        flow_noise=NoiseTape(vg.flow.output_size, flow_seed, block=FLOW_NOISE_BLOCK_FRAMES, device=device),
        source_noise=NoiseTape(harmonics, source_seed, block=SOURCE_NOISE_BLOCK_FRAMES * SAMPLES_PER_FRAME,
                               device=device),
        phase_u01=phase_u01,
        resampler=resampler,
        graphs=graphs,
        window_frames=_window_frames(policy, graphs),
        tokens=torch.zeros(1, 0, dtype=torch.long, device=device),
    )
    if graphs is not None:  # its first window comes soon: other new utterances' first windows wait for it
        graphs.expect_first_window(state)
    return state


class SynthesisFailed(RuntimeError):
    """A step of ``speak`` failed (a GPU error, memory, a shared step that failed). ``chunks``: the
    chunks this call completed before it - good audio, in order, to be played before the
    utterance ends; the state cannot take another step (it may be half-way through one).
    ``audio``: set by ``taste_detokenize`` - all the audio its call made before the failure, (1, n)."""

    def __init__(self, message: str, chunks: list[SpeechChunk]):
        super().__init__(message)
        self.chunks = chunks
        self.audio: Optional[torch.Tensor] = None


def stop_speaking(state: SynthesisState) -> None:
    """An utterance given up before its end (a reply dropped, the caller talking over it): if its
    first window has not come, the shared synthesis steps no longer wait for it (without this, the
    next utterance's first window could wait for it once, up to a first-window step). The state is
    otherwise left as it is."""
    if state.graphs is not None:
        state.graphs.forget_first_window(state)


def _window_frames(policy: EmissionPolicy, graphs: Optional[SynthesisGraphs]) -> tuple[int, ...]:
    """The sizes flow windows are widened to: the policy's, or by default the bucketed path's unpadded sizes."""
    if policy.window_frames is not None:
        return policy.window_frames
    return graphs.full_flow_frames if graphs is not None else ()


IN_USE = ("this utterance's synthesis state is in use by another call right now (another thread, or a "
          "taste_detokenize_stream on it not yet run to its end or closed): an utterance is spoken by one caller "
          "at a time - give each utterance its own state")


@contextlib.contextmanager
def speaking(state: SynthesisState):
    """Hold ``state`` for one speaker while inside; raises (``IN_USE``) if someone holds it."""
    if not state.in_use.acquire(blocking=False):
        raise RuntimeError(IN_USE)
    try:
        yield state
    finally:
        state.in_use.release()


def speak(vg: VoiceGenerator, state: SynthesisState, speech_tokens=None, final: bool = False) -> list[SpeechChunk]:
    """Feed new speech tokens (1, n) (any n >= 0) and get the chunks that became ready.

    With ``final=True`` everything left is synthesised, the held-back audio is flushed and the
    last chunk fades out; the state cannot be fed afterwards. One call at a time per state.
    """
    with speaking(state):
        return speak_held(vg, state, speech_tokens, final)


@torch.inference_mode()
def speak_held(vg: VoiceGenerator, state: SynthesisState, speech_tokens=None, final: bool = False) -> list[SpeechChunk]:
    """``speak`` for a caller already holding ``state`` (``speaking``)."""
    if state.finished:
        raise ValueError("this utterance's synthesis already ended (final=True); a new utterance needs a new state "
                         "(start_speaking, or state=None with taste_detokenize)")
    if state.failure is not None:
        raise ValueError(f"this utterance's synthesis failed earlier ({state.failure}); its state cannot go on: "
                         "a new utterance needs a new state (start_speaking, or state=None with taste_detokenize)")
    new = to_device(_check_new_tokens(vg, speech_tokens), state.tokens.device)
    if new.shape[1]:
        state.tokens = torch.cat([state.tokens, new], dim=1)
        state.n_tokens += new.shape[1]
    chunks = []
    try:
        while (target := _next_boundary(state, final)) is not None:
            chunks.append(_step(vg, state, target, last=final and target == state.n_tokens))
    except Exception as exc:  # a step stopped half-way: keep the chunks made before it, end the utterance
        state.failure = f"{type(exc).__name__}: {exc}"
        stop_speaking(state)
        raise SynthesisFailed(f"synthesis failed after {len(chunks)} new chunk(s): {state.failure}", chunks) from exc
    if final and not state.finished:  # nothing was ever fed
        state.finished = True
        stop_speaking(state)  # (its first window will never come: no other utterance's waits for it)
    return chunks


def _next_boundary(state: SynthesisState, final: bool) -> Optional[int]:
    """Token count the next chunk completes, or None when no chunk is due yet."""
    policy, done, total = state.policy, state.committed_tokens, state.n_tokens
    if total == 0 or state.finished:
        return None
    step = policy.first_chunk_tokens if done == 0 else policy.steady_chunk(done)
    target = done + step
    if final:
        if done == total:
            return total  # only the held-back audio is left: flush it
        # a short remainder joins this chunk rather than making a tiny last one (at most 1.5 chunks,
        # and never past a growing chunk's limit: its window is sized to fit a synthesis bucket)
        joins = total - target < max(1, step // 2) and total - done <= (policy.max_chunk_tokens or total)
        return total if joins else min(target, total)  # (a first chunk over the growth limit)
    return target if total >= target + policy.lookahead_tokens else None


def _step(vg: VoiceGenerator, state: SynthesisState, target: int, last: bool) -> SpeechChunk:
    started = time.perf_counter()
    right = state.n_tokens if last else min(state.n_tokens, target + state.policy.lookahead_tokens)
    mel_start = state.mel_done
    mel = _flow_step(vg, state, target, right, last)
    if state.time_stages and mel.is_cuda:
        torch.cuda.current_stream(mel.device).synchronize()  # the flow's kernels run asynchronously: wait to time it
    flow_s = time.perf_counter() - started
    first_sample = state.voc_done * SAMPLES_PER_FRAME
    # whether the next chunk's tokens are already here (its flow window follows at once)
    more = not last and state.n_tokens >= target + state.policy.steady_chunk(target) + state.policy.lookahead_tokens
    wav, source = _vocoder_step(vg, state, mel, last, more)
    if state.skip_until_sample > first_sample:  # context re-synthesised only to continue from it
        cut = min(wav.shape[-1], state.skip_until_sample - first_sample)
        wav, source, first_sample = wav[:, cut:], source[:, cut:], first_sample + cut
    wav = _apply_fades(state, wav, last)
    state.samples_emitted += wav.shape[-1]
    state.committed_tokens = target
    audio = _resample(state, wav, last)
    state.out_samples_emitted += audio.shape[-1]
    state.chunks_emitted += 1
    state.finished = last
    _release_old_context(state)
    return SpeechChunk(
        audio=audio, sampling_rate=state.out_sampling_rate, audio_22k=wav, source_22k=source, first_sample=first_sample,
        mel=mel, first_frame=mel_start, tokens_committed=target, is_final=last,
        compute_s=time.perf_counter() - started, flow_s=flow_s,
    )


def _flow_step(vg: VoiceGenerator, state: SynthesisState, target: int, right: int, last: bool) -> torch.Tensor:
    """Finalise the mel frames of tokens [.., target): returns them (1, 80, E - mel_done)."""
    policy, flow = state.policy, vg.flow
    frames_right = state.frames(right)
    if last:
        end = frames_right
    else:
        end = min(state.frames(target), frames_right - policy.mel_crossfade_frames)
    if end <= state.mel_done:
        return torch.zeros(1, flow.output_size, 0, device=state.tokens.device)

    # the window: left context, the chunk, the lookahead
    first_token = max(state.token_offset, state.token_of(state.mel_done) - policy.context_tokens)
    first_frame = _window_start(state, state.frames(first_token), frames_right)
    # encode from the token the first frame copies: a token's first frame on the grid usually copies
    # the token before it (frames(t) = t * 441 // 256 rounds down), and widening reaches further back
    first_token = max(state.token_offset, min(first_token, state.token_of(first_frame)))
    tokens = state.window_tokens(first_token, right)
    h = flow.encode_tokens(tokens) if state.graphs is None else state.graphs.encode_tokens(tokens)  # (1, n, 80)
    # nearest-neighbour stretch on the utterance's grid (441/256 frames per token)
    rows = to_device(torch.tensor([state.token_of(f) - first_token for f in range(first_frame, frames_right)]), h.device)
    rows = rows.clamp(0, h.shape[1] - 1)
    stretched = h[:, rows].transpose(1, 2)
    n_frames = frames_right - first_frame
    cond = torch.zeros(1, flow.output_size, n_frames, device=stretched.device, dtype=stretched.dtype)
    n_prompt = state.mel_done - first_frame
    if policy.prompt_with_emitted_mel and n_prompt > 0:
        cond[:, :, :n_prompt] = state.mel_history[:, :, -n_prompt:]
    noise = state.flow_noise.get(first_frame, frames_right)
    if state.graphs is None:  # one whole window: every frame valid
        mel_window = flow.decoder(flow.length_regulator.regulate(stretched), None, state.spks, cond, noise)
    else:  # (the length regulator runs in the flow's step)
        mel_window = state.graphs.flow(stretched, state.spks, cond, noise, owner=state)

    new = mel_window[:, :, n_prompt:end - first_frame].clone()
    if state.mel_tail is not None:
        k = min(state.mel_tail.shape[-1], new.shape[-1])
        if k:
            w = _ramp(k, new.device)
            new[:, :, :k] = (1 - w) * state.mel_tail[:, :, :k] + w * new[:, :, :k]
    tail_start = end - first_frame
    state.mel_tail = None if last else mel_window[:, :, tail_start:tail_start + policy.mel_crossfade_frames]
    keep = max(frames_for_tokens(policy.context_tokens) + 5, max(state.window_frames, default=0))
    history = new if state.mel_history is None else torch.cat([state.mel_history, new], dim=-1)
    state.mel_history = history[:, :, -keep:]
    state.mel_done = end
    return new


def _window_start(state: SynthesisState, narrow_start: int, frames_right: int) -> int:
    """The first frame of a flow window ending at ``frames_right`` that must reach back to ``narrow_start``.

    Two rules, both about matching the offline computation more closely:
    - grid: the flow's U-Net halves its frame rate once (a stride-2 level), so offline synthesis
      computes every frame on a 2-frame grid that starts at the utterance's frame 0. A window that
      starts on an odd frame puts its half-rate frames between the offline ones (on random
      weights its frames land several times further from offline): windows start on even frames;
    - widening: with ``state.window_frames``, the window takes more left context until it has
      exactly the smallest of those sizes that starts on the grid (a bucket it fills runs the
      unpadded step), as far back as the kept tokens reach.
    """
    on_grid = lambda frame: (frame + frames_for_tokens(state.tokens_before)) % FLOW_GRID == 0  # noqa: E731
    earliest = state.frames(state.token_offset)
    if state.token_of(earliest) < state.token_offset:  # that frame still copies the token before
        earliest += 1
    for size in state.window_frames:
        start = frames_right - size
        if size >= frames_right - narrow_start and start >= earliest and on_grid(start):
            return start
    if on_grid(narrow_start):
        return narrow_start
    if narrow_start - 1 >= earliest:
        return narrow_start - 1
    return narrow_start + 1 if narrow_start < state.mel_done else narrow_start


def _vocoder_step(vg: VoiceGenerator, state: SynthesisState, new_mel: torch.Tensor,
                  last: bool, more: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Append final mel; return the newly final waveform samples (1, n) at 22.05 kHz and their source (1, n)."""
    policy, hift, spf = state.policy, vg.hift, SAMPLES_PER_FRAME
    if state.voc_mel is None:
        state.voc_mel, state.voc_mel_start = new_mel, state.mel_done - new_mel.shape[-1]
    else:
        state.voc_mel = torch.cat([state.voc_mel, new_mel], dim=-1)
    mel_end = state.mel_done
    end = mel_end if last else mel_end - policy.vocoder_lookahead_frames
    if end <= state.voc_done:
        empty = torch.zeros(1, 0, device=new_mel.device)
        return empty, empty

    start = max(state.voc_mel_start, state.voc_done - policy.vocoder_context_frames)
    n_context = state.voc_done - start
    mel = state.voc_mel[:, :, start - state.voc_mel_start:]
    f0 = hift.f0_predictor(mel) if state.graphs is None else state.graphs.predict_f0(mel)
    f0_up = hift.upsample_f0(f0[:, n_context:])
    draws = SourceDraws(state.phase_u01, state.source_noise.get(state.voc_done * spf, mel_end * spf))
    carried = state.cycle_pos if policy.carry_source_phase else None
    source_new, cycles = hift.m_source(f0_up, draws, cycle_offset=carried)
    context_source = state.source_history[:, :, -n_context * spf:] if n_context else source_new[:, :, :0]
    source = torch.cat([context_source, source_new], dim=-1)
    if state.graphs is None:
        wav = hift.decode(mel, source)
    else:
        wav = state.graphs.vocoder(mel, source, owner=state, more=more)
    wav = torch.clamp(wav, -hift.audio_limit, hift.audio_limit)

    n_final = (end - state.voc_done) * spf
    out = wav[:, n_context * spf:n_context * spf + n_final].clone()
    if state.wave_tail is not None:
        k = min(state.wave_tail.shape[-1], out.shape[-1])
        if k:
            w = _ramp(k, out.device)
            out[:, :k] = (1 - w) * state.wave_tail[:, :k] + w * out[:, :k]
    tail_start = n_context * spf + n_final
    state.wave_tail = None if last else wav[:, tail_start:tail_start + policy.wave_crossfade_samples]

    final_source = source_new[:, :, :n_final]
    history = final_source if state.source_history is None else torch.cat([state.source_history, final_source], -1)
    state.source_history = history[:, :, -max(1, policy.vocoder_context_frames) * spf:]
    state.cycle_pos = cycles[:, :, n_final - 1:n_final]
    state.voc_done = end
    return out, final_source[:, 0]


def _apply_fades(state: SynthesisState, wav: torch.Tensor, last: bool) -> torch.Tensor:
    policy = state.policy
    if state.samples_emitted == 0 and wav.shape[-1] and policy.fade_in_ms > 0:
        n = min(wav.shape[-1], int(SOURCE_RATE * policy.fade_in_ms / 1000))
        wav = wav.clone()
        wav[:, :n] *= _ramp(n, wav.device)
    if last and wav.shape[-1] and policy.fade_out_ms > 0:
        n = min(wav.shape[-1], int(SOURCE_RATE * policy.fade_out_ms / 1000))
        wav = wav.clone()
        wav[:, -n:] *= _ramp(n, wav.device).flip(0)
    return wav


def _resample(state: SynthesisState, wav: torch.Tensor, last: bool) -> torch.Tensor:
    if state.resampler is None:
        return wav.float().cpu()
    out = state.resampler.resample_chunk(np.ascontiguousarray(wav[0].float().cpu().numpy()), last=last)
    return torch.from_numpy(np.asarray(out, dtype=np.float32).copy()).unsqueeze(0)


def _release_old_context(state: SynthesisState) -> None:
    """Drop tokens, noise and mel no later step can use (bounded memory on long utterances)."""
    policy = state.policy
    # the next window starts at most context_tokens, or the widest window, before mel_done
    reach_back = max(state.window_frames, default=0)
    keep_from = max(0, min(state.token_of(state.mel_done) - policy.context_tokens,
                           state.token_of(max(0, state.mel_done - reach_back))) - 1)
    if keep_from > state.token_offset:
        state.tokens = state.tokens[:, keep_from - state.token_offset:]
        state.token_offset = keep_from
    state.flow_noise.forget_before(state.frames(state.token_offset))
    state.source_noise.forget_before(state.voc_done * SAMPLES_PER_FRAME)
    keep_mel_from = max(state.voc_mel_start, state.voc_done - policy.vocoder_context_frames)
    if state.voc_mel is not None and keep_mel_from > state.voc_mel_start:
        state.voc_mel = state.voc_mel[:, :, keep_mel_from - state.voc_mel_start:]
        state.voc_mel_start = keep_mel_from


@torch.inference_mode()
def offline_reference(vg: VoiceGenerator, state: SynthesisState,
                      tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole-utterance synthesis of ``tokens`` with exactly the noise a state streams with:
    returns (mel (1, 80, T), waveform (1, 256 T) at 22.05 kHz). For seam-quality measurements."""
    tokens = _check_new_tokens(vg, tokens)
    n_frames = frames_for_tokens(tokens.shape[1])
    noise = state.flow_noise.fresh_copy().get(0, n_frames)
    speaker = state.speaker_embeds
    mel = vg.flow.inference(tokens.to(noise.device), speaker, noise=noise)
    draws = SourceDraws(state.phase_u01, state.source_noise.fresh_copy().get(0, n_frames * SAMPLES_PER_FRAME))
    wav = vg.hift.inference(mel, draws=draws)
    return mel, wav
