"""Streaming speech synthesis (speech tokens -> audio chunks) and taste_detokenize."""

from __future__ import annotations

import math

import numpy as np
import pytest
import soxr
import torch

from taste_speech.streaming.detokenize import finish_speaking, taste_detokenize, taste_detokenize_stream
from taste_speech.streaming.seams import measure_seams
from taste_speech.streaming.synthesis import SynthesisFailed, offline_reference, speak, start_speaking
from taste_speech.streaming.synthesis_state import EmissionPolicy, NoiseTape, frames_for_tokens, resampler_quality
from taste_speech.voice_generator import SourceDraws, VoiceGenerator
from taste_speech.voice_generator.tiny import make_tiny_voice_generator

REGIMES = ["low_latency", "quality"]


@pytest.fixture(scope="module")
def vg() -> VoiceGenerator:
    return make_tiny_voice_generator(0)


@pytest.fixture(scope="module")
def utterance():
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, 4096, (1, 90), generator=g), torch.randn(1, 192, generator=g)


def stream(vg, tokens, speaker, policy, sizes=None, rate=22050, seed=0):
    state = start_speaking(vg, speaker, policy, out_sampling_rate=rate, generator=torch.Generator().manual_seed(seed))
    chunks, position, sizes = [], 0, iter(sizes or [])
    while position < tokens.shape[1]:
        size = next(sizes, 1)
        chunks += speak(vg, state, tokens[:, position:position + size])
        position += size
    chunks += speak(vg, state, final=True)
    return state, chunks


def test_a_step_failing_part_way_hands_back_the_chunks_made_before_it_and_ends_the_utterance(vg, utterance,
                                                                                            monkeypatch):
    """Several chunks due in one call, the vocoder failing on the second: the first chunk (good
    audio, the same as without the failure) comes with the error, and the half-advanced state
    refuses another step with a clear error instead of failing on mismatched sizes."""
    tokens, speaker = utterance
    _, reference = stream(vg, tokens, speaker, "low_latency", sizes=[90])
    state = start_speaking(vg, speaker, "low_latency", out_sampling_rate=22050,
                           generator=torch.Generator().manual_seed(0))
    decode, calls = vg.hift.decode, []

    def fails_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return decode(*args, **kwargs)

    monkeypatch.setattr(vg.hift, "decode", fails_second)
    with pytest.raises(SynthesisFailed, match="after 1 new chunk.*out of memory") as failed:
        speak(vg, state, tokens)
    assert isinstance(failed.value.__cause__, RuntimeError) and len(failed.value.chunks) == 1
    assert torch.equal(failed.value.chunks[0].audio, reference[0].audio)
    monkeypatch.setattr(vg.hift, "decode", decode)
    for more in (dict(speech_tokens=tokens[:, :5]), dict(final=True)):
        with pytest.raises(ValueError, match="failed earlier .*out of memory.*start_speaking"):
            speak(vg, state, **more)


# -- policy and state pieces ---------------------------------------------------------------------
def test_regimes():
    low, quality = EmissionPolicy.resolve("low_latency"), EmissionPolicy.resolve("quality")
    assert low.first_chunk_tokens <= 15 and quality.first_chunk_tokens <= 15
    assert low.lookahead_tokens == 0 < quality.lookahead_tokens
    assert EmissionPolicy.quality(chunk_tokens=30).chunk_tokens == 30
    assert EmissionPolicy.low_latency(chunk_tokens=320).max_chunk_tokens == 0  # above the limit: no growth
    with pytest.raises(ValueError, match="unknown emission policy"):
        EmissionPolicy.resolve("fast")
    with pytest.raises(ValueError, match="first_chunk_tokens"):
        EmissionPolicy(first_chunk_tokens=0)
    # counts from a JSON config: a float or a null is named here, not at the reply's first chunk
    for bad in (dict(first_chunk_tokens=10.0), dict(context_tokens=None), dict(chunk_tokens=True)):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be an integer"):
            EmissionPolicy(**bad)
    with pytest.raises(ValueError, match="fade_in_ms must be a number"):
        EmissionPolicy(fade_in_ms=float("nan"))  # (it switched the fade off)
    assert EmissionPolicy(chunk_tokens=np.int64(30)).chunk_tokens == 30
    with pytest.raises(ValueError, match="vocoder_lookahead_frames"):
        EmissionPolicy(wave_crossfade_samples=1024, vocoder_lookahead_frames=2)
    with pytest.raises(ValueError, match="no audio"):
        EmissionPolicy(first_chunk_tokens=2, mel_crossfade_frames=4)
    # nothing held back: a reply ending on a chunk boundary would end with an empty chunk, unfaded
    with pytest.raises(ValueError, match="fade_out_ms needs held-back audio"):
        EmissionPolicy(mel_crossfade_frames=0, vocoder_lookahead_frames=0, wave_crossfade_samples=0)
    EmissionPolicy(mel_crossfade_frames=0, vocoder_lookahead_frames=0, wave_crossfade_samples=0, fade_out_ms=0)


def test_steady_chunks_grow_to_their_limit(vg, monkeypatch):
    """Each steady chunk covers half the tokens already emitted (at least chunk_tokens, at most
    max_chunk_tokens); 0 keeps them all chunk_tokens; the last chunk never joins past the limit;
    the named regimes' largest windows fit the largest synthesis buckets (graphed on a GPU)."""
    from taste_speech.streaming.synthesis_graphs import FLOW_BUCKETS, VOCODER_BUCKETS

    low = EmissionPolicy.low_latency()
    assert [low.steady_chunk(done) for done in (10, 35, 60, 90, 135, 202, 303, 454, 681, 981)] == [
        25, 25, 30, 45, 67, 101, 151, 227, 300, 300]
    assert EmissionPolicy.low_latency(max_chunk_tokens=0).steady_chunk(500) == 25
    with pytest.raises(ValueError, match="max_chunk_tokens"):
        EmissionPolicy(chunk_tokens=25, max_chunk_tokens=20)
    for regime in REGIMES:
        policy = EmissionPolicy.resolve(regime)
        speaker = torch.randn(1, 192, generator=torch.Generator().manual_seed(0))
        for total in (1200, 1291):  # the last chunk joins a short remainder; it would, past the limit
            tokens = torch.randint(0, 4096, (1, total), generator=torch.Generator().manual_seed(total))
            flow_frames, hift_frames = [], []
            state = start_speaking(vg, speaker, policy, out_sampling_rate=22050)
            hift = vg.hift.decode
            monkeypatch.setattr(vg.hift, "decode", lambda m, *a: hift_frames.append(m.shape[-1]) or hift(m, *a))
            hook = vg.flow.decoder.register_forward_pre_hook(lambda _, args: flow_frames.append(args[0].shape[-1]))
            try:
                chunks = speak(vg, state, tokens) + speak(vg, state, final=True)
            finally:
                hook.remove()
                monkeypatch.undo()
            committed = [0] + [c.tokens_committed for c in chunks]
            sizes = [b - a for a, b in zip(committed, committed[1:]) if b > a]
            assert sizes[0] == policy.first_chunk_tokens and max(sizes) == policy.max_chunk_tokens
            assert sizes[1:-1] == [policy.steady_chunk(done) for done in committed[1:len(sizes) - 1]]
            assert max(flow_frames) <= FLOW_BUCKETS[-1] and max(hift_frames) <= VOCODER_BUCKETS[-1]


def test_noise_tape_is_independent_of_request_chunking():
    whole = NoiseTape(5, seed=3, block=16).get(0, 100)
    tape = NoiseTape(5, seed=3, block=16)
    pieces = [tape.get(a, b) for a, b in [(0, 7), (7, 40), (40, 41), (41, 100)]]
    assert torch.equal(torch.cat(pieces, -1), whole)
    tape.forget_before(50)
    assert torch.equal(tape.get(48, 60), whole[:, :, 48:60])
    with pytest.raises(ValueError, match="released"):
        tape.get(10, 20)
    assert torch.equal(tape.fresh_copy().get(0, 100), whole)


@torch.inference_mode()
def test_source_phase_carries_across_calls(vg):
    """Two source calls chained by the carried cycle position equal one call over both."""
    source = vg.hift.m_source
    f0 = (120 + 40 * torch.rand(1, 1, 3000, generator=torch.Generator().manual_seed(0))).repeat_interleave(4, -1)
    draws = SourceDraws(torch.rand(1, 9, 1), torch.randn(1, 9, f0.shape[-1]))
    whole, _ = source(f0, draws)
    cut = 5000
    first, cycles = source(f0[..., :cut], SourceDraws(draws.phase_u01, draws.sine_noise[..., :cut]))
    second, _ = source(f0[..., cut:], SourceDraws(draws.phase_u01, draws.sine_noise[..., cut:]),
                       cycle_offset=cycles[..., -1:])
    torch.testing.assert_close(torch.cat([first, second], -1), whole, atol=2e-3, rtol=0)
    restarted, _ = source(f0[..., cut:], SourceDraws(draws.phase_u01, draws.sine_noise[..., cut:]))
    assert float((restarted - whole[..., cut:]).abs().max()) > 0.05  # what a phase reset would do


# -- length, determinism, bounded work -------------------------------------------------------------
@pytest.mark.parametrize("regime", REGIMES)
def test_streamed_length_equals_offline_and_feeding_pattern_does_not_matter(vg, utterance, regime):
    tokens, speaker = utterance
    state, one_by_one = stream(vg, tokens, speaker, regime)
    _, uneven = stream(vg, tokens, speaker, regime, sizes=[3, 17, 1, 40, 2, 9, 18])
    _, at_once = stream(vg, tokens, speaker, regime, sizes=[tokens.shape[1]])
    audio = [torch.cat([c.audio for c in chunks], -1) for chunks in (one_by_one, uneven, at_once)]
    assert audio[0].shape[-1] == frames_for_tokens(tokens.shape[1]) * 256
    assert torch.equal(audio[0], audio[1]) and torch.equal(audio[0], audio[2])
    _, offline_wav = offline_reference(vg, state, tokens)
    assert audio[0].shape == offline_wav.shape
    assert one_by_one[-1].is_final and not any(c.is_final for c in one_by_one[:-1])
    # nothing repeated or dropped: chunk sample ranges tile the utterance
    position = 0
    for c in one_by_one:
        if c.audio_22k.shape[-1]:
            assert c.first_sample == position
            position += c.audio_22k.shape[-1]
    assert position == offline_wav.shape[-1]


def test_first_chunk_comes_early(vg, utterance):
    tokens, speaker = utterance
    for regime in REGIMES:
        policy = EmissionPolicy.resolve(regime)
        state = start_speaking(vg, speaker, policy, out_sampling_rate=22050)
        first = policy.first_chunk_tokens + policy.lookahead_tokens
        assert speak(vg, state, tokens[:, :first - 1]) == []
        chunks = speak(vg, state, tokens[:, first - 1:first])
        assert len(chunks) == 1 and chunks[0].audio.shape[-1] > 0


@pytest.mark.parametrize("grow_to", [0, 30])
def test_per_chunk_work_is_bounded(vg, monkeypatch, grow_to):
    """The flow and HiFT windows stay the same size however long the utterance gets (growing
    chunks: once they reached their limit)."""
    policy = EmissionPolicy.low_latency(chunk_tokens=10, max_chunk_tokens=grow_to, context_tokens=8)
    largest = grow_to or policy.chunk_tokens
    flow_windows, hift_windows = [], []
    encode, decode = vg.flow.encode_tokens, vg.hift.decode
    monkeypatch.setattr(vg.flow, "encode_tokens", lambda t, *a: flow_windows.append(t.shape[1]) or encode(t, *a))
    monkeypatch.setattr(vg.hift, "decode", lambda m, s, *a: hift_windows.append(m.shape[-1]) or decode(m, s, *a))
    tokens = torch.randint(0, 4096, (1, 250), generator=torch.Generator().manual_seed(0))
    state, chunks = stream(vg, tokens, torch.randn(1, 192), policy, sizes=[7] * 36)
    assert len(chunks) >= (250 - 60) // largest
    # left context + chunk + the held-back cross-fade frames (2 tokens) + rounding
    assert max(flow_windows) <= policy.context_tokens + largest + 4
    assert max(hift_windows) <= policy.vocoder_context_frames + frames_for_tokens(largest) + 8
    assert state.tokens.shape[1] <= policy.context_tokens + largest + 4  # old tokens released
    # the noise kept covers the last window and at most a block on either side, and is released up
    # to the block of the first position a later window may still read
    for tape, window in ((state.flow_noise, max(flow_windows) * 2), (state.source_noise, max(hift_windows) * 256)):
        assert len(tape._blocks) <= math.ceil(window / tape.block) + 2
    assert state.source_noise._first_block == state.voc_done * 256 // state.source_noise.block > 0
    assert state.flow_noise._first_block == state.frames(state.token_offset) // state.flow_noise.block


# -- seams ------------------------------------------------------------------------------------------
def _junctions_are_not_outliers(report) -> list[str]:
    problems = []
    if report.wave_jump_junction_max > report.wave_jump_p999:
        problems.append(f"junction jump {report.wave_jump_junction_max:.4f} > in-chunk p99.9 {report.wave_jump_p999:.4f}")
    if report.source_jump_junction_max > report.source_jump_p999:
        problems.append(f"source jump {report.source_jump_junction_max:.4f} > in-chunk p99.9 {report.source_jump_p999:.4f}")
    if report.mel_dist_junction > 1.25 * report.mel_dist_elsewhere:
        problems.append(f"mel distance at junctions {report.mel_dist_junction:.3f} vs {report.mel_dist_elsewhere:.3f}")
    if report.wave_err_junction > 1.25 * report.wave_err_elsewhere:
        problems.append(f"waveform error at junctions {report.wave_err_junction:.4f} vs {report.wave_err_elsewhere:.4f}")
    return problems


@pytest.mark.parametrize("regime", REGIMES)
def test_junctions_are_not_outliers(vg, regime):
    g = torch.Generator().manual_seed(5)
    tokens, speaker = torch.randint(0, 4096, (1, 160), generator=g), torch.randn(1, 192, generator=g)
    report, _ = measure_seams(vg, tokens, speaker, regime, seed=1)
    assert report.n_junctions >= 4 and report.length_diff_samples == 0
    assert _junctions_are_not_outliers(report) == []


def test_seam_check_catches_a_phase_reset(vg):
    """Negative control: restarting the harmonic phase per chunk (calling HiFT chunk by chunk) makes
    the junctions outliers. (With random weights the waveform itself is noise-like: its sample
    jumps hide such seams, which is why the excitation is measured too.)"""
    g = torch.Generator().manual_seed(5)
    tokens, speaker = torch.randint(0, 4096, (1, 160), generator=g), torch.randn(1, 192, generator=g)
    reset = EmissionPolicy.low_latency(carry_source_phase=False)
    report, _ = measure_seams(vg, tokens, speaker, reset, seed=1)
    assert any("source jump" in problem for problem in _junctions_are_not_outliers(report))


# -- output rate and fades ------------------------------------------------------------------------
@pytest.mark.parametrize("rate", [8000, 16000, 24000, 44100, 48000])
def test_output_resampling(vg, utterance, rate):
    tokens, speaker = utterance
    state, chunks = stream(vg, tokens[:, :60], speaker, "low_latency", sizes=[60], rate=rate)
    audio = torch.cat([c.audio for c in chunks], -1)
    source = torch.cat([c.audio_22k for c in chunks], -1)
    reference = soxr.resample(source[0].numpy(), 22050, rate, quality=resampler_quality(rate))
    assert all(c.sampling_rate == rate for c in chunks)
    assert abs(audio.shape[-1] - reference.shape[0]) <= 2
    n = min(audio.shape[-1], reference.shape[0])
    assert np.abs(audio[0, :n].numpy() - reference[:n]).max() < 1e-3


@pytest.mark.parametrize("rate", [8000, 16000, 24000, 48000])
def test_the_first_chunk_brings_most_of_its_audio_at_every_rate(vg, utterance, rate):
    """The output resampler holds back the end of each chunk until the next: at 8 kHz soxr's HQ held
    back 60 ms of the first chunk's 128 ms, and phone lines ran dry after a reply's first syllable
    before the second chunk came. No rate may hold back more than 30 ms."""
    tokens, speaker = utterance
    policy = EmissionPolicy.resolve("low_latency")
    state = start_speaking(vg, speaker, policy, out_sampling_rate=rate, generator=torch.Generator().manual_seed(0))
    first = speak(vg, state, tokens[:, :policy.first_chunk_tokens + policy.lookahead_tokens])
    assert len(first) == 1
    made_ms = 1000 * first[0].audio_22k.shape[-1] / 22050
    out_ms = 1000 * first[0].audio.shape[-1] / rate
    assert made_ms > 100 and made_ms - out_ms <= 30, (made_ms, out_ms)


def test_unsupported_rate_and_finished_state(vg, utterance):
    tokens, speaker = utterance
    with pytest.raises(ValueError, match="out_sampling_rate"):
        start_speaking(vg, speaker, out_sampling_rate=11025)
    state = start_speaking(vg, speaker)
    speak(vg, state, tokens[:, :20], final=True)
    with pytest.raises(ValueError, match="already ended"):
        speak(vg, state, tokens[:, 20:30])
    with pytest.raises(ValueError, match="vocab_size"):
        speak(vg, start_speaking(vg, speaker), torch.tensor([[5000]]))


def test_fade_in_and_fade_out(vg, utterance):
    tokens, speaker = utterance
    _, chunks = stream(vg, tokens[:, :80], speaker, "low_latency", sizes=[80])
    wav = torch.cat([c.audio_22k for c in chunks], -1)[0]
    assert abs(float(wav[0])) < 1e-3 and abs(float(wav[-1])) < 1e-3
    # the last 100 samples sit under the end of the 20 ms fade (weights <= 0.13)
    assert float(wav[-100:].abs().max()) < 0.3 * float(wav[-4000:-1000].abs().max())


# -- taste_detokenize on the tiny checkpoint ------------------------------------------------------
@pytest.fixture(scope="module")
def speech_setup(tiny_model, tiny_checkpoint):
    from taste_speech.streaming import taste_tokenize

    model, processor = tiny_model
    vg = VoiceGenerator.from_pretrained(tiny_checkpoint)
    t = np.arange(24000) / 16000
    wav = (0.2 * np.sin(2 * np.pi * 150 * t)).astype(np.float32)
    text = processor.process_text("hello there how are you doing today my friend")
    taste = taste_tokenize(model, processor, wav[None], text.llm_token_ids, 16000)
    starts = (taste[0, :, 0] != -1).nonzero().view(-1).tolist()
    cut = starts[len(starts) // 2]
    return model, processor, vg, processor.default_speaker_embedding(), text.llm_token_ids, taste, cut


def test_detokenize_single_segment(speech_setup):
    model, processor, vg, speaker, ids, taste, _ = speech_setup
    out = taste_detokenize(model, processor, speaker, None, None, None, 0, ids, taste, 16000,
                           voice_generator=vg, generator=torch.Generator().manual_seed(0))
    assert set(out) >= {"audio_waveform", "sampling_rate", "chunk_duration_ms", "speech_ids", "state"}
    n = out["speech_ids"].shape[1]
    assert n > 0 and out["sampling_rate"] == 16000
    expected = frames_for_tokens(n) * 256 * 16000 / 22050
    assert abs(out["audio_waveform"].shape[-1] - expected) <= 2
    assert out["chunk_duration_ms"] == pytest.approx(1000 * out["audio_waveform"].shape[-1] / 16000)
    assert float(out["audio_waveform"].pow(2).mean().sqrt()) > 0.01  # audible


def test_detokenizing_hands_on_the_chunks_made_before_a_failed_step_then_the_error(speech_setup, monkeypatch):
    """A synthesis step failing in the final flush: the stream yields the chunks that call completed
    before the failure, then raises (a caller plays what was made)."""
    import taste_speech.streaming.detokenize as detokenize

    model, processor, vg, speaker, ids, taste, _ = speech_setup
    speak_for_real = detokenize.speak_held  # (the stream holds its state)

    def failing_flush(vg_, state, tokens=None, final=False):
        chunks = speak_for_real(vg_, state, tokens, final=final)
        if final:  # (the real chunks of the flush, as if a later step of it had failed)
            raise SynthesisFailed("synthesis failed after 1 new chunk(s): out of memory", chunks) from None
        return chunks

    monkeypatch.setattr(detokenize, "speak_held", failing_flush)
    items = []
    with pytest.raises(SynthesisFailed, match="out of memory"):
        for item in taste_detokenize_stream(model, processor, speaker, None, None, None, 0, ids, taste, 16000,
                                            voice_generator=vg, generator=torch.Generator().manual_seed(0)):
            items.append(item)
    # taste_detokenize hands on all of it too: the chunks of the earlier steps with the failed step's
    with pytest.raises(SynthesisFailed, match="out of memory") as failed:
        taste_detokenize(model, processor, speaker, None, None, None, 0, ids, taste, 16000, voice_generator=vg,
                         generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(detokenize, "speak_held", speak_for_real)
    whole = taste_detokenize(model, processor, speaker, None, None, None, 0, ids, taste, 16000, voice_generator=vg,
                             generator=torch.Generator().manual_seed(0))
    assert not any(item["is_final"] for item in items)
    assert len(items) > len(failed.value.chunks)  # (the earlier steps made chunks of their own)
    assert torch.equal(torch.cat([item["audio_waveform"] for item in items], -1), whole["audio_waveform"])
    assert torch.equal(failed.value.audio, whole["audio_waveform"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: ids that live on a GPU")
def test_ids_on_a_gpu_are_read_as_host_ids(speech_setup):
    """Codes from extract_vq on a GPU stay there; detokenize takes them as it takes host ids."""
    model, processor, vg, speaker, ids, taste, _ = speech_setup
    outs = [taste_detokenize(model, processor, speaker, None, None, None, 0, i, t, 16000, voice_generator=vg,
                             generator=torch.Generator().manual_seed(0)) for i, t in ((ids, taste), (ids.cuda(), taste.cuda()))]
    assert torch.equal(outs[0]["speech_ids"], outs[1]["speech_ids"])
    assert torch.equal(outs[0]["audio_waveform"], outs[1]["audio_waveform"])


def test_detokenize_two_segments_with_state_is_one_utterance(speech_setup):
    model, processor, vg, speaker, ids, taste, cut = speech_setup
    g = torch.Generator().manual_seed(0)
    first = taste_detokenize(model, processor, speaker, None, None, None, 0, ids[:, :cut], taste[:, :cut], 22050,
                             voice_generator=vg, generator=g, final=False)
    second = taste_detokenize(model, processor, speaker, ids[:, :cut], taste[:, :cut], first["speech_ids"],
                              first["chunk_duration_ms"], ids[:, cut:], taste[:, cut:], 22050,
                              voice_generator=vg, generator=g, state=first["state"])
    assert torch.equal(second["speech_ids"][:, :first["speech_ids"].shape[1]], first["speech_ids"])
    total = first["audio_waveform"].shape[-1] + second["audio_waveform"].shape[-1]
    assert total == frames_for_tokens(second["speech_ids"].shape[1]) * 256  # nothing repeated or dropped
    with pytest.raises(ValueError, match="already ended"):
        taste_detokenize(model, processor, speaker, ids[:, cut:], taste[:, cut:], second["speech_ids"],
                         first["chunk_duration_ms"] + second["chunk_duration_ms"], ids[:, :cut], taste[:, :cut],
                         22050, voice_generator=vg, state=second["state"])


def test_with_a_state_the_decoder_continues_only_the_previous_segment(speech_setup):
    """Its text prefix holds the previous segment's words: the speech fed after it is that
    segment's, not the whole utterance's (which would also cost more with every segment)."""
    model, processor, vg, speaker, ids, taste, _ = speech_setup
    starts = (taste[0, :, 0] != -1).nonzero().view(-1).tolist() + [ids.shape[1]]
    fed = []  # a continuation is embedded at once, generated tokens one by one
    hook = model.speech_decoder.speech_embedding.register_forward_hook(lambda m, args, out: fed.append(args[0].shape[-1]))
    g, state, prev, played, new_counts = torch.Generator().manual_seed(0), None, None, 0.0, []
    try:
        for i in range(3):  # three one-word segments
            a, b = starts[i], starts[i + 1]
            prev_text = ids[:, starts[i - 1]:a] if i else None
            prev_taste = taste[:, starts[i - 1]:a] if i else None
            out = taste_detokenize(model, processor, speaker, prev_text, prev_taste, prev, played, ids[:, a:b],
                                   taste[:, a:b], 22050, voice_generator=vg, generator=g, state=state, final=i == 2)
            state, prev, played = out["state"], out["speech_ids"], played + out["chunk_duration_ms"]
            new_counts.append(out["new_speech_ids"].shape[1])
    finally:
        hook.remove()
    assert prev.shape[1] == sum(new_counts)  # speech_ids is still the whole utterance
    assert [n for n in fed if n > 1] == new_counts[:2]  # segment 2 was fed segment 1's tokens, 3 those of 2


def test_detokenize_stateless_continuation_and_stream(speech_setup):
    model, processor, vg, speaker, ids, taste, cut = speech_setup
    prev = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    prev_ms = frames_for_tokens(40) * 256 / 22.05
    items = list(taste_detokenize_stream(model, processor, speaker, ids[:, :cut], taste[:, :cut], prev, prev_ms,
                                         ids[:, cut:], taste[:, cut:], 22050, voice_generator=vg,
                                         generator=torch.Generator().manual_seed(2)))
    assert items[-1]["is_final"] and not any(i["is_final"] for i in items[:-1])
    new = items[-1]["new_speech_ids"].shape[1]
    # speech_ids as taste_detokenize returns them: the next call's prev_speech_ids
    assert torch.equal(items[-1]["speech_ids"], torch.cat([prev, items[-1]["new_speech_ids"]], dim=1))
    audio = torch.cat([i["audio_waveform"] for i in items], -1)
    # only the new tokens' audio: frames(40 + new) - frames(40) frames
    assert audio.shape[-1] == (frames_for_tokens(40 + new) - frames_for_tokens(40)) * 256
    # a stateless continuation kept open (final=False) continues with its state
    first = taste_detokenize(model, processor, speaker, ids[:, :cut], taste[:, :cut], prev, prev_ms, ids[:, cut:],
                             taste[:, cut:], 22050, voice_generator=vg, final=False)
    second = taste_detokenize(model, processor, speaker, ids[:, cut:], taste[:, cut:], first["speech_ids"],
                              prev_ms + first["chunk_duration_ms"], ids[:, :cut], taste[:, :cut], 22050,
                              voice_generator=vg, state=first["state"])
    total = first["audio_waveform"].shape[-1] + second["audio_waveform"].shape[-1]
    assert total == (frames_for_tokens(second["speech_ids"].shape[1]) - frames_for_tokens(40)) * 256
    # a state kept with final=False is flushed by finish_speaking
    kept = taste_detokenize(model, processor, speaker, None, None, None, 0, ids, taste, 22050, voice_generator=vg,
                            final=False, generator=torch.Generator().manual_seed(3))
    tail = finish_speaking(vg, kept["state"])
    assert kept["audio_waveform"].shape[-1] + tail.shape[-1] == frames_for_tokens(kept["speech_ids"].shape[1]) * 256


def test_detokenize_rejects_bad_input(speech_setup):
    model, processor, vg, speaker, ids, taste, cut = speech_setup
    kw = dict(voice_generator=vg)
    with pytest.raises(ValueError, match="empty"):
        taste_detokenize(model, processor, speaker, None, None, None, 0, ids[:, :0], taste[:, :0], **kw)
    with pytest.raises(ValueError, match="align one row per token"):
        taste_detokenize(model, processor, speaker, None, None, None, 0, ids, taste[:, :-1], **kw)
    shifted = torch.roll(taste, 1, dims=1)
    with pytest.raises(ValueError, match="first token of every word"):
        taste_detokenize(model, processor, speaker, None, None, None, 0, ids, shifted, **kw)
    with pytest.raises(ValueError, match="prev_audio_ms"):
        taste_detokenize(model, processor, speaker, None, None, None, -5, ids, taste, **kw)
    with pytest.raises(ValueError, match="out_sampling_rate"):
        taste_detokenize(model, processor, speaker, None, None, None, 0, ids, taste, 11025, **kw)
    with pytest.raises(ValueError, match="voice generator"):
        taste_detokenize(model, object(), speaker, None, None, None, 0, ids, taste)
    first = taste_detokenize(model, processor, speaker, None, None, None, 0, ids[:, :cut], taste[:, :cut], final=False,
                             **kw)
    with pytest.raises(ValueError, match="prev_speech_ids has"):
        taste_detokenize(model, processor, speaker, ids[:, :cut], taste[:, :cut], first["speech_ids"][:, :-1],
                         first["chunk_duration_ms"], ids[:, cut:], taste[:, cut:], state=first["state"], **kw)
    with pytest.raises(ValueError, match="prev_audio_ms"):
        taste_detokenize(model, processor, speaker, ids[:, :cut], taste[:, :cut], first["speech_ids"],
                         first["chunk_duration_ms"] + 500, ids[:, cut:], taste[:, cut:], state=first["state"], **kw)
    # the words before must be the segment the state spoke: the decoder reads them before the new ones
    second_word = (taste[0, :, 0] != -1).nonzero().view(-1)[1]
    for prev_text, prev_taste in ((None, None), (ids[:, cut:], taste[:, cut:]),
                                  (ids[:, :second_word], taste[:, :second_word])):
        with pytest.raises(ValueError, match="not the segment this state spoke last"):
            taste_detokenize(model, processor, speaker, prev_text, prev_taste, first["speech_ids"],
                             first["chunk_duration_ms"], ids[:, cut:], taste[:, cut:], state=first["state"], **kw)
    with pytest.raises(ValueError, match="differs from the policy this state was started with"):
        taste_detokenize(model, processor, speaker, ids[:, :cut], taste[:, :cut], first["speech_ids"],
                         first["chunk_duration_ms"], ids[:, cut:], taste[:, cut:], state=first["state"],
                         policy="quality", **kw)
    taste_detokenize(model, processor, speaker, ids[:, :cut], taste[:, :cut], first["speech_ids"],
                     first["chunk_duration_ms"], ids[:, cut:], taste[:, cut:], state=first["state"],
                     policy="low_latency", **kw)  # its own policy, named: accepted


def test_the_processor_loads_the_checkpoint_s_voice_generator_once(speech_setup, tiny_checkpoint):
    """taste_detokenize without voice_generator= takes the processor's: the checkpoint's, loaded once."""
    from taste_speech import TasteProcessor

    model, _, vg, speaker, ids, taste, _ = speech_setup
    processor = TasteProcessor.from_pretrained(tiny_checkpoint)
    loaded = processor.get_generator()
    assert processor.get_generator() is loaded and processor.get_generator("cpu") is loaded
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), vg.state_dict().values()))
    with pytest.raises(ValueError, match="loaded on cpu, not meta"):
        processor.get_generator("meta")
    own = taste_detokenize(model, processor, speaker, None, None, None, 0, ids, taste, 16000,
                           generator=torch.Generator().manual_seed(0))
    given = taste_detokenize(model, processor, speaker, None, None, None, 0, ids, taste, 16000, voice_generator=vg,
                             generator=torch.Generator().manual_seed(0))
    assert torch.equal(own["audio_waveform"], given["audio_waveform"])
    processor.voice_generator_path, processor._voice_generator = None, None
    with pytest.raises(ValueError, match="knows no voice generator.*voice_generator=VoiceGenerator.from_pretrained"):
        processor.get_generator()


def test_a_continuation_past_the_decoder_s_positions_is_refused_before_any_audio(speech_setup):
    """Stateless, prev_speech_ids is continued whole: ~100 s of it leaves the speech decoder no
    room for this segment, which is said at the first item - not after chunks went out."""
    model, processor, vg, speaker, ids, taste, cut = speech_setup
    long_prev = torch.randint(0, 256, (1, 4990), generator=torch.Generator().manual_seed(4))
    prev_ms = frames_for_tokens(4990) * 256 / 22.05
    items = taste_detokenize_stream(model, processor, speaker, ids[:, :cut], taste[:, :cut], long_prev, prev_ms,
                                    ids[:, cut:], taste[:, cut:], 22050, voice_generator=vg)
    with pytest.raises(ValueError, match="speech-decoder positions .* pass state="):
        next(items)


def test_a_state_is_spoken_by_one_caller_at_a_time(speech_setup):
    """A stream holds its state until it ends or is closed: a second stream or a speak on the same
    state meanwhile (another thread, a retry wrapper) is refused with the reason, not left to mix
    two callers' tokens into one utterance's caches; and a new reply given an old state is told
    to start without one."""
    model, processor, vg, speaker, ids, taste, cut = speech_setup
    kw = dict(voice_generator=vg, generator=torch.Generator().manual_seed(0))
    first = taste_detokenize(model, processor, speaker, None, None, None, 0, ids[:, :cut], taste[:, :cut], final=False,
                             **kw)
    state = first["state"]
    args = (model, processor, speaker, ids[:, :cut], taste[:, :cut], first["speech_ids"], first["chunk_duration_ms"],
            ids[:, cut:], taste[:, cut:])
    stream = taste_detokenize_stream(*args, state=state, final=False, **kw)
    next(stream)  # under way: it holds the state
    with pytest.raises(RuntimeError, match="in use by another call right now"):
        next(taste_detokenize_stream(*args, state=state, final=False, **kw))
    with pytest.raises(RuntimeError, match="in use by another call right now"):
        speak(vg, state, torch.tensor([[1]]))
    with pytest.raises(RuntimeError, match="in use by another call right now"):
        finish_speaking(vg, state)
    stream.close()  # (a barge-in): let go
    assert finish_speaking(vg, state).shape[-1] > 0  # the held-back end, faded out
    fresh = taste_detokenize(model, processor, speaker, None, None, None, 0, ids[:, :cut], taste[:, :cut],
                             final=False, **kw)
    with pytest.raises(ValueError, match="a new reply starts with state=None"):
        taste_detokenize(model, processor, speaker, None, None, None, 0, ids[:, cut:], taste[:, cut:],
                         state=fresh["state"], **kw)
