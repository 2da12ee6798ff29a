"""Where the flow's windows start: on the U-Net's 2-frame grid, and widened leftwards to a size
with an unpadded step of its own (``synthesis._window_start``, ``EmissionPolicy.window_frames``).

Offline synthesis of the whole utterance is the reference a streamed chunk should approach: the
flow runs most of its layers at half the frame rate, on the utterance's even frames, and a
window that starts on an odd frame computes those layers between them (on the random tiny weights
its frames land several times further from offline). Widening only adds left context.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import taste_speech.streaming.synthesis as synthesis
from taste_speech.streaming.synthesis import offline_reference, speak, start_speaking
from taste_speech.streaming.synthesis_graphs import FULL_FLOW_WINDOWS
from taste_speech.streaming.synthesis_state import EmissionPolicy, NoiseTape, frames_for_tokens
from taste_speech.voice_generator import VoiceGenerator
from synthesis_helpers import speak_in_pieces

UNEVEN = [3, 17, 1, 40, 2, 9, 18]


@pytest.fixture(scope="module")
def vg(voice_generator_tiny_a) -> VoiceGenerator:
    return VoiceGenerator.from_golden_dir(voice_generator_tiny_a)


def utterance(vg, n_tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vg.flow.vocab_size, (1, n_tokens), generator=g),
            torch.randn(1, vg.flow.spk_embed_affine_layer.in_features, generator=g))


class RecordingTape(NoiseTape):
    """The flow's noise tape, recording the frame span each window asks for (= the window)."""

    def __init__(self, tape: NoiseTape):
        super().__init__(tape.channels, tape.seed, tape.block, tape.device, tape.dtype)
        self.windows: list[tuple[int, int]] = []

    def get(self, start: int, stop: int) -> torch.Tensor:
        self.windows.append((start, stop))
        return super().get(start, stop)


def stream(vg, tokens, speaker, policy, sizes=UNEVEN):
    state = start_speaking(vg, speaker, policy, out_sampling_rate=22050, generator=torch.Generator().manual_seed(0),
                           kind="dynamic")
    state.flow_noise = RecordingTape(state.flow_noise)
    return state, speak_in_pieces(vg, state, tokens, sizes, default_size=5)


def distance_to_offline(vg, state, tokens, chunks) -> float:
    mel_offline, _ = offline_reference(vg, state, tokens)
    mel = torch.cat([c.mel for c in chunks], -1)
    return (mel - mel_offline).abs().mean().item()


@pytest.mark.parametrize("policy", ["low_latency", "quality"])
def test_windows_start_on_the_flow_grid_and_come_closer_to_offline(vg, policy, monkeypatch):
    tokens, speaker = utterance(vg, 160, seed=5)
    state, chunks = stream(vg, tokens, speaker, policy)
    starts = [start for start, _ in state.flow_noise.windows]
    assert len(starts) == len(chunks) >= 5 and all(start % 2 == 0 for start in starts), starts
    on_grid = distance_to_offline(vg, state, tokens, chunks)

    monkeypatch.setattr(synthesis, "FLOW_GRID", 1)  # windows start where their context does
    state, chunks = stream(vg, tokens, speaker, policy)
    starts = [start for start, _ in state.flow_noise.windows]
    assert any(start % 2 for start in starts)  # the grid really moved some windows
    off_grid = distance_to_offline(vg, state, tokens, chunks)
    assert on_grid < 0.75 * off_grid, (on_grid, off_grid)


@pytest.mark.parametrize("policy", ["low_latency", "quality"])
@pytest.mark.parametrize("widened", [False, True])
def test_each_window_encodes_from_the_token_its_first_frame_copies(vg, policy, widened, monkeypatch):
    """The stretch copies token ``token_of(frame)`` into each frame, as offline synthesis does over
    the whole utterance; a window's first frame is usually the last frame of the token before its
    first context token (frames(t) rounds down), so the window encodes from that token - starting
    a token later would give the frame the next token's features (a row clamped to the window)."""
    from taste_speech.streaming.synthesis_state import SynthesisState

    encoded = []
    window_tokens = SynthesisState.window_tokens

    def recording(state, start, stop):
        encoded.append(start)
        return window_tokens(state, start, stop)

    monkeypatch.setattr(SynthesisState, "window_tokens", recording)
    base = EmissionPolicy.low_latency() if policy == "low_latency" else EmissionPolicy.quality()
    tokens, speaker = utterance(vg, 160, seed=7)
    state, chunks = stream(vg, tokens, speaker, replace(base, window_frames=FULL_FLOW_WINDOWS if widened else ()))
    starts = [start for start, _ in state.flow_noise.windows]
    assert len(starts) == len(encoded) == len(chunks) >= 5
    assert encoded == [state.token_of(start) for start in starts]


def test_a_continuation_keeps_the_utterances_grid(vg):
    """A state that continues an utterance (``tokens_before``) starts its windows on the
    utterance's even frames, not its own."""
    tokens, speaker = utterance(vg, 120, seed=6)
    state = start_speaking(vg, speaker, "low_latency", out_sampling_rate=22050, kind="dynamic",
                           generator=torch.Generator().manual_seed(0))
    state.tokens_before = 9  # its frame 0 is the utterance's frame 15: an odd one
    state.flow_noise = RecordingTape(state.flow_noise)
    for i in range(0, 120, 6):
        speak(vg, state, tokens[:, i:i + 6])
    speak(vg, state, final=True)
    offset = frames_for_tokens(9)
    later = state.flow_noise.windows[1:]  # the first window starts at the state's frame 0, as it must
    assert later and all((start + offset) % 2 == 0 for start, _ in later), (offset, later)


def test_widened_windows_keep_the_chunks_and_have_the_chosen_sizes(vg):
    """Widening changes only the left context: the same chunk boundaries and lengths; every window
    that reaches back far enough has one of the sizes, and the audio is no further from offline."""
    tokens, speaker = utterance(vg, 200, seed=5)
    policy = EmissionPolicy.low_latency()
    narrow_state, narrow = stream(vg, tokens, speaker, policy)
    state, wide = stream(vg, tokens, speaker, replace(policy, window_frames=FULL_FLOW_WINDOWS))
    assert [(c.first_sample, c.tokens_committed, c.audio_22k.shape) for c in wide] == \
        [(c.first_sample, c.tokens_committed, c.audio_22k.shape) for c in narrow]
    sizes = [stop - start for start, stop in state.flow_noise.windows]
    starts = [start for start, _ in state.flow_noise.windows]
    assert sizes[0] == FULL_FLOW_WINDOWS[0]  # the first chunk fills its own size
    widened = [size for size, start in zip(sizes, starts) if start > 0]
    assert len(widened) >= 4 and all(size in FULL_FLOW_WINDOWS for size in widened), sizes
    narrow_sizes = [stop - start for start, stop in narrow_state.flow_noise.windows]
    assert sum(narrow_sizes) < sum(sizes)
    assert distance_to_offline(vg, state, tokens, wide) <= 1.05 * distance_to_offline(vg, narrow_state, tokens,
                                                                                        narrow)


def test_long_utterances_keep_bounded_state_with_widened_windows(vg):
    """Widening reaches back at most the widest window: the kept tokens stay bounded and never
    fall short of what a window needs (a released token would raise)."""
    tokens, speaker = utterance(vg, 1200, seed=3)
    policy = EmissionPolicy.low_latency(window_frames=FULL_FLOW_WINDOWS)
    state, chunks = stream(vg, tokens, speaker, policy, [40] * 30)
    assert state.finished and chunks[-1].tokens_committed == 1200
    widest_tokens = max(FULL_FLOW_WINDOWS) * 256 // 441  # (441/256 frames per token)
    assert state.tokens.shape[1] <= widest_tokens + 10 and state.mel_history.shape[-1] <= max(FULL_FLOW_WINDOWS)
    # the longest chunks' windows fill the widest pair of sizes (which of the two: the parity of its end)
    assert max(stop - start for start, stop in state.flow_noise.windows) in FULL_FLOW_WINDOWS[-2:]


def test_window_frames_must_be_frame_counts():
    assert EmissionPolicy(window_frames=[88, 17, 88]).window_frames == (17, 88)
    for bad in ((0,), (12.5,), "88", (True,)):
        with pytest.raises(ValueError, match="window_frames must be None or a sequence of mel frame counts"):
            EmissionPolicy(window_frames=bad)
