"""Bucketed (fixed-shape) streaming synthesis: the path replayed as CUDA graphs on CUDA, checked on
CPU in its 'rehearse' (warm-up/capture protocol, then eager) and 'eager' modes against the dynamic
path (every window at its own size, the reference).

Tolerances (float32, golden tiny voice generator A). The padded steps add the same numbers in other
orders (GroupNorm statistics over the valid frames, attention with a key mask, an iSTFT written
out), so results differ from the reference by rounding only:
    MEL_ATOL: after 10 Euler steps with CFG the mel (values up to ~6) differs by <= 4e-6.
    VOCODER_ATOL: HiFT's padded decode alone reproduces the waveform within ~1.2e-7.
    AUDIO_ATOL: the audio inherits the mel's rounding through the predicted F0, whose phase HiFT
        integrates over thousands of samples: <= 3.5e-5 seen at peaks of ~0.1-0.2.
A padding leak (a missing mask) changes the mel by 0.1-2 and the audio by far more than AUDIO_ATOL.
"""

from __future__ import annotations

import copy
import gc
import threading
import time
from dataclasses import replace

import pytest
import torch

from taste_speech.streaming.synthesis import speak, start_speaking, stop_speaking
from taste_speech.streaming.synthesis_graphs import (
    FIRST_WINDOW_FRAMES,
    FLOW_BUCKETS,
    FULL_FLOW_WINDOWS,
    VOCODER_BUCKETS,
    SynthesisGraphs,
    _FlowBucket,
    _Window,
    shared_graphs,
)
from taste_speech.streaming.synthesis_state import EmissionPolicy, frames_for_tokens
from taste_speech.voice_generator import VoiceGenerator
from concurrency_helpers import run_in_threads
from synthesis_helpers import speak_in_pieces

MEL_ATOL = 2e-5
# float32 rounding of the kernels picked for the padded shapes, carried along a reply by the
# vocoder's caches: up to 2.85e-06 (audio peaking at 0.086) on an AVX-512 machine, 1e-06 elsewhere
VOCODER_ATOL = 1e-5
F0_RTOL = 2e-6  # F0 is in Hz (tens to hundreds): its float32 rounding is relative
AUDIO_ATOL = 2e-4

POLICIES = {
    "low_latency": EmissionPolicy.low_latency(),
    "quality": EmissionPolicy.quality(),
    "small_prompted": EmissionPolicy.low_latency(chunk_tokens=10, context_tokens=8, prompt_with_emitted_mel=True),
}
UNEVEN = [3, 17, 1, 40, 2, 9, 18]  # token pieces: several chunks become due in one call


@pytest.fixture(scope="module")
def vg(voice_generator_tiny_a) -> VoiceGenerator:
    return VoiceGenerator.from_golden_dir(voice_generator_tiny_a)


@pytest.fixture(scope="module")
def utterance(vg):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, vg.flow.vocab_size, (1, 90), generator=g)
    return tokens, torch.randn(1, vg.flow.spk_embed_affine_layer.in_features, generator=g)


@pytest.fixture(scope="module")
def rehearsed(vg) -> SynthesisGraphs:
    """One bucket set shared by the tests below (buckets are reused across utterances, as in a call)."""
    return SynthesisGraphs(vg, "rehearse")


def widened(policy) -> EmissionPolicy:
    """The policy with the flow windows widened to the default buckets, as the bucketed path does
    by default: the dynamic path run this way is the reference of the bucketed one."""
    return replace(EmissionPolicy.resolve(policy), window_frames=FULL_FLOW_WINDOWS)


def stream(vg, tokens, speaker, policy, sizes=(), rate=22050, **kind):
    state = start_speaking(vg, speaker, policy, out_sampling_rate=rate, generator=torch.Generator().manual_seed(0),
                           **kind)
    return state, speak_in_pieces(vg, state, tokens, sizes)


def assert_same_chunks(reference, chunks, mel_atol, audio_atol):
    assert len(chunks) == len(reference) >= 3  # a first chunk, steady chunk(s) and the final flush
    for ref, out in zip(reference, chunks):
        where = f"chunk {ref.tokens_committed} tokens (final={ref.is_final})"
        assert (out.first_sample, out.first_frame, out.tokens_committed, out.is_final) == \
            (ref.first_sample, ref.first_frame, ref.tokens_committed, ref.is_final), where
        assert out.mel.shape == ref.mel.shape and out.audio.shape == ref.audio.shape, where
        torch.testing.assert_close(out.mel, ref.mel, atol=mel_atol, rtol=0, msg=where)
        torch.testing.assert_close(out.audio_22k, ref.audio_22k, atol=audio_atol, rtol=0, msg=where)
        torch.testing.assert_close(out.audio, ref.audio, atol=audio_atol, rtol=0, msg=where)


# -- streaming: bucketed == dynamic --------------------------------------------------------------------
@pytest.mark.parametrize("policy", list(POLICIES))
def test_rehearsed_buckets_give_the_dynamic_chunks(vg, utterance, rehearsed, policy):
    tokens, speaker = utterance
    _, reference = stream(vg, tokens, speaker, widened(POLICIES[policy]), UNEVEN, kind="dynamic")
    before = rehearsed.padded_frames.copy()
    state, chunks = stream(vg, tokens, speaker, POLICIES[policy], UNEVEN, graphs=rehearsed)
    assert state.graphs is rehearsed
    assert_same_chunks(reference, chunks, MEL_ATOL, AUDIO_ATOL)
    # every window fitted a bucket, and real padding was computed through (masking was exercised)
    assert rehearsed.counts["flow", None] == rehearsed.counts["vocoder", None] == 0
    assert rehearsed.padded_frames["flow"] > before["flow"] and rehearsed.padded_frames["vocoder"] > before["vocoder"]
    assert rehearsed.fallback_reasons() == {}


def test_static_kind_on_cpu_runs_eager_buckets(vg, utterance):
    """kind='static' without graphs: the voice generator's shared buckets, eager on CPU (16 kHz
    output through the resampler, one token at a time)."""
    tokens, speaker = utterance
    _, reference = stream(vg, tokens, speaker, widened("low_latency"), rate=16000, kind="dynamic")
    state, chunks = stream(vg, tokens, speaker, "low_latency", rate=16000, kind="static")
    assert state.graphs is shared_graphs(vg) and state.graphs.mode == "eager"
    assert_same_chunks(reference, chunks, MEL_ATOL, AUDIO_ATOL)


def test_eager_buckets_equal_rehearsed_buckets_exactly(vg, utterance):
    """'rehearse' runs every step twice more before using it (the capture's warm-up): nothing of
    that may leak into the result."""
    tokens, speaker = utterance
    eager, rehearse = SynthesisGraphs(vg, "eager"), SynthesisGraphs(vg, "rehearse")
    _, a = stream(vg, tokens, speaker, "quality", UNEVEN, graphs=eager)
    _, b = stream(vg, tokens, speaker, "quality", UNEVEN, graphs=rehearse)
    assert eager.mode == "eager" and rehearse.mode == "rehearse"
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x.mel, y.mel) and torch.equal(x.audio, y.audio)


@pytest.mark.parametrize("policy", ["low_latency", "quality"])
def test_vocoder_buckets_alone_are_exact_to_rounding(vg, utterance, policy):
    """Flow windows all larger than its only bucket (1 frame): the flow runs the reference path, so
    the mel is identical and any audio difference comes from HiFT's padded decode, final flush
    (the window's true end reaches the output there) included."""
    tokens, speaker = utterance
    graphs = SynthesisGraphs(vg, "rehearse", flow_buckets=(1,), token_buckets=())  # (the whole flow eager)
    _, reference = stream(vg, tokens, speaker, POLICIES[policy], UNEVEN, kind="dynamic")
    _, chunks = stream(vg, tokens, speaker, POLICIES[policy], UNEVEN, graphs=graphs)
    assert graphs.counts["flow", None] == sum(graphs.counts[k] for k in graphs.counts if k[0] == "flow") > 0
    assert graphs.padded_frames["vocoder"] > 0
    for ref, out in zip(reference, chunks):
        assert torch.equal(out.mel, ref.mel)
    assert_same_chunks(reference, chunks, 0.0, VOCODER_ATOL)


def test_windows_larger_than_every_bucket_run_the_reference_path(vg):
    policy = EmissionPolicy.low_latency(chunk_tokens=380)  # steady windows of ~690 flow frames
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, vg.flow.vocab_size, (1, 420), generator=g)
    speaker = torch.randn(1, vg.flow.spk_embed_affine_layer.in_features, generator=g)
    graphs = SynthesisGraphs(vg, "rehearse")
    _, reference = stream(vg, tokens, speaker, widened(policy), [60] * 7, kind="dynamic")
    _, chunks = stream(vg, tokens, speaker, policy, [60] * 7, graphs=graphs)
    assert graphs.counts["flow", None] >= 1 and graphs.counts["vocoder", None] >= 1
    assert graphs.counts["flow", FLOW_BUCKETS[0]] >= 1  # the first chunk still used its bucket
    assert_same_chunks(reference, chunks, MEL_ATOL, AUDIO_ATOL)


# -- the padded steps themselves: padding never leaks into valid frames ----------------------------------
def padded(x: torch.Tensor, frames: int, generator) -> torch.Tensor:
    """x (.., n) extended to ``frames`` with large random garbage."""
    garbage = 10 * torch.randn(*x.shape[:-1], frames, generator=generator)
    garbage[..., :x.shape[-1]] = x
    return garbage


def frame_mask(n: int, frames: int) -> torch.Tensor:
    mask = torch.zeros(1, 1, frames)
    mask[..., :n] = 1
    return mask


@pytest.mark.parametrize("n, bucket", [(17, 24), (61, 88), (83, 88), (88, 88)])
@torch.inference_mode()
def test_flow_ode_padding_never_reaches_valid_frames(vg, n, bucket):
    g = torch.Generator().manual_seed(n)
    mu, noise = torch.randn(1, 80, n, generator=g), torch.randn(1, 80, n, generator=g)
    cond = torch.zeros(1, 80, n)
    cond[..., :6] = torch.randn(1, 80, 6, generator=g)
    spks = torch.randn(1, 80, generator=g)
    decoder = vg.flow.decoder
    reference = decoder(mu, torch.ones(1, 1, n), spks, cond, noise)
    inputs = [padded(x, bucket, g) for x in (mu, cond, noise)]
    mask = frame_mask(n, bucket)
    out = decoder(inputs[0], mask, spks, inputs[1], inputs[2], padded=True)
    torch.testing.assert_close(out[..., :n], reference, atol=MEL_ATOL, rtol=0)
    assert torch.isfinite(out).all()
    if n < bucket:  # the same padding without the masked statistics does reach them
        leaky = decoder(inputs[0], mask, spks, inputs[1], inputs[2])
        assert float((leaky[..., :n] - reference).abs().max()) > 100 * MEL_ATOL


@pytest.mark.parametrize("n, bucket", [(17, 24), (61, 88), (88, 88)])
@torch.inference_mode()
def test_length_regulator_padding_never_reaches_valid_frames(vg, n, bucket):
    """The flow's steps run the length regulator on the padded window too: each conv sees zeros
    past the valid frames, GroupNorm their statistics alone."""
    g = torch.Generator().manual_seed(n)
    regulator = vg.flow.length_regulator
    stretched = torch.randn(1, 80, n, generator=g)
    reference = regulator.regulate(stretched)
    assert torch.equal(reference, regulator.model(stretched))  # no mask: the published module as it is
    mask = frame_mask(n, bucket)
    out = regulator.regulate(padded(stretched, bucket, g), mask)
    torch.testing.assert_close(out[..., :n], reference, atol=1e-5, rtol=0)
    assert not out[..., n:].any()  # zeros after the window, as the ODE's inputs are padded
    if n < bucket:  # unmasked, the padding reaches them
        leaky = regulator.regulate(padded(stretched, bucket, g))
        assert float((leaky[..., :n] - reference).abs().max()) > 1e-2


@pytest.mark.parametrize("n, bucket", [(13, 16), (21, 24), (57, 60), (103, 128), (60, 60)])
@torch.inference_mode()
def test_hift_decode_padding_never_reaches_valid_samples(vg, n, bucket):
    g = torch.Generator().manual_seed(n)
    hift = vg.hift
    mel = torch.randn(1, 80, n, generator=g) - 5
    source, _ = hift.m_source(hift.upsample_f0(hift.f0_predictor(mel)), hift.draw_source(n, g))
    reference = hift.decode(mel, source)
    mel_in, source_in, mask = padded(mel, bucket, g), padded(source, 256 * bucket, g), frame_mask(n, bucket)
    out = hift.decode(mel_in, source_in, frame_mask=mask)
    assert out.shape == (1, 256 * bucket)
    torch.testing.assert_close(out[:, :256 * n], reference, atol=VOCODER_ATOL, rtol=0)
    # every sample counts: the last ones depend on the STFT reflection and iSTFT normalisation at the end
    torch.testing.assert_close(out[:, 256 * n - 16:256 * n], reference[:, -16:], atol=VOCODER_ATOL, rtol=0)
    if n < bucket:
        leaky = hift.decode(mel_in, source_in)[:, :256 * n]
        assert float((leaky - reference).abs().max()) > 1e-3


# -- windows of concurrent calls share batched steps -----------------------------------------------------
def window(vg, stage: str, frames: int, generator) -> tuple:
    """Random inputs of one ``frames``-frame window of ``stage``, as ``SynthesisGraphs.flow/vocoder`` take them."""
    if stage == "flow":
        c = vg.flow.output_size
        mu, cond, noise = (torch.randn(1, c, frames, generator=generator) for _ in range(3))
        return mu, torch.randn(1, c, generator=generator), cond, noise
    mel = torch.randn(1, vg.hift.conv_pre.in_channels, frames, generator=generator) - 5
    return mel, torch.randn(1, 1, frames * vg.hift.samples_per_frame, generator=generator)


@pytest.mark.parametrize("stage, bucket, frames", [("flow", 48, (30, 48, 41)), ("vocoder", 60, (57, 33, 60))])
@torch.inference_mode()
def test_one_batched_step_gives_each_window_its_own_result(vg, stage, bucket, frames):
    """Three windows of different lengths run as one step over 4 rows (the idle row holding an
    earlier window) give what each gives alone, and what the unpadded reference gives."""
    g = torch.Generator().manual_seed(7)
    graphs = SynthesisGraphs(vg, "rehearse", rows=4)
    assert graphs.row_counts == [1, 2, 4]
    steps = graphs._flow_bucket(bucket) if stage == "flow" else graphs._vocoder_bucket(bucket)
    steps.run([window(vg, stage, bucket, g) for _ in range(4)], 4)  # every row now holds another window
    windows = [window(vg, stage, n, g) for n in frames]
    together = steps.run(windows, 4)
    atol = MEL_ATOL if stage == "flow" else VOCODER_ATOL
    for w, n, out in zip(windows, frames, together):
        alone = steps.run([w], 1)[0]
        reference = graphs._eager(_Window(stage, None, w))
        assert out.shape == alone.shape == reference.shape and out.shape[-1] == w[-1].shape[-1]
        torch.testing.assert_close(out, alone, atol=atol, rtol=0)
        torch.testing.assert_close(out, reference, atol=atol, rtol=0)


def test_concurrent_utterances_share_steps_and_each_keeps_its_own_audio(vg):
    """Three utterances (own tokens, voices and seeds) spoken from three threads through one
    SynthesisGraphs with rows=4: their windows run in shared steps (the first step waits until
    the others have queued theirs, so batching surely happens) and each utterance gets the
    chunks it gets alone on the dynamic path. A vocoder step waits for the vocoder windows of its
    flow step's utterances, so the windows of one flow step never split over vocoder steps."""
    g = torch.Generator().manual_seed(11)
    utterances = [(torch.randint(0, vg.flow.vocab_size, (1, 60), generator=g),
                   torch.randn(1, vg.flow.spk_embed_affine_layer.in_features, generator=g)) for _ in range(3)]
    references = [stream(vg, tokens, speaker, widened("low_latency"), [4] * 15, kind="dynamic")[1]
                  for tokens, speaker in utterances]
    graphs = SynthesisGraphs(vg, "rehearse", rows=4, gather=1.0)
    run, first = graphs._run, threading.Event()

    def first_step_waits_for_the_others(batch):
        if not first.is_set():
            first.set()
            deadline = time.monotonic() + 30
            while len(graphs._queue) < 2 and time.monotonic() < deadline:
                time.sleep(0.001)
        run(batch)

    graphs._run = first_step_waits_for_the_others
    results = [None] * 3

    def speak_one(i):
        tokens, speaker = utterances[i]
        results[i] = stream(vg, tokens, speaker, "low_latency", [4] * 15, graphs=graphs)[1]

    run_in_threads(speak_one, [(i,) for i in range(3)])
    for reference, chunks in zip(references, results):
        assert_same_chunks(reference, chunks, MEL_ATOL, AUDIO_ATOL)
    stats = graphs.stats()
    assert stats["flow"]["windows"] == sum(c for (s, _), c in graphs.counts.items() if s == "flow")
    assert max(n for (stage, n) in graphs.batches if stage == "flow") >= 2, graphs.batches
    assert stats["flow"]["mean_batch"] > 1 and stats["flow"]["steps"] < stats["flow"]["windows"]
    assert stats["vocoder"]["windows"] == stats["flow"]["windows"]  # a vocoder window per chunk
    # the first chunk's flow windows ran as two steps (see above); their vocoder windows as one
    assert stats["vocoder"]["steps"] < stats["flow"]["steps"], graphs.batches
    assert not graphs._queue and not graphs._stepping


def test_utterances_whose_tokens_are_at_hand_step_together(vg):
    """Three utterances whose speech tokens are all there, spoken from three threads: after a
    vocoder step each has its next flow window at once (``more``), so the next flow step waits
    for the three of them instead of starting with whichever came first. Each utterance still
    gets the chunks it gets alone."""
    g = torch.Generator().manual_seed(12)
    utterances = [(torch.randint(0, vg.flow.vocab_size, (1, 150), generator=g),
                   torch.randn(1, vg.flow.spk_embed_affine_layer.in_features, generator=g)) for _ in range(3)]
    references = [stream(vg, tokens, speaker, widened("low_latency"), [150], kind="dynamic")[1]
                  for tokens, speaker in utterances]
    graphs = SynthesisGraphs(vg, "rehearse", rows=4, gather=1.0)
    start = threading.Barrier(3)
    results = [None] * 3

    def speak_one(i):
        tokens, speaker = utterances[i]
        start.wait()
        results[i] = stream(vg, tokens, speaker, "low_latency", [150], graphs=graphs)[1]

    run_in_threads(speak_one, [(i,) for i in range(3)])
    for reference, chunks in zip(references, results):
        assert_same_chunks(reference, chunks, MEL_ATOL, AUDIO_ATOL)
    flow_steps = sum(c for (stage, _), c in graphs.batches.items() if stage == "flow")
    chunks = len(references[0])
    # the first chunk (nobody is awaited yet) and the final flush (its tokens came in a later
    # call) may split; every steady chunk's flow windows run as one step
    assert chunks >= 6 and graphs.batches["flow", 3] >= chunks - 2, (chunks, graphs.batches)
    assert flow_steps <= chunks + 2 and graphs.batches["vocoder", 3] == chunks


def test_a_new_window_does_not_wait_for_an_utterance_that_was_dropped(vg):
    """An utterance awaited after the last vocoder step (its next window was due) but dropped - a
    barge-in - never comes: a window of another utterance, a new reply's first chunk, runs at once
    instead of waiting out the gather time."""
    graphs = SynthesisGraphs(vg, "rehearse", rows=2, gather=1.0)
    c = vg.flow.output_size
    ghost, newcomer = object(), object()
    graphs._awaited["flow"].add(id(ghost))
    graphs._flow_step_s = 5.0

    def no_waiting(timeout=None):
        raise AssertionError(f"the step waited (up to {timeout} s) for an utterance that will not come")

    graphs._lock.wait = no_waiting  # a lone thread's step waits only in the gathering
    with torch.inference_mode():
        mel = graphs.flow(torch.randn(1, c, 17), torch.randn(1, c), torch.zeros(1, c, 17), torch.randn(1, c, 17),
                          owner=newcomer)
    assert mel.shape == (1, c, 17) and graphs.batches["flow", 1] == 1
    assert not graphs._awaited["flow"]  # and the dropped one is not awaited again


def announced(vg, graphs, n, seed):
    """``n`` utterances (own tokens and voices) started on ``graphs``: announced, nothing spoken yet."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        tokens = torch.randint(0, vg.flow.vocab_size, (1, 40), generator=g)
        speaker = torch.randn(1, vg.flow.spk_embed_affine_layer.in_features, generator=g)
        state = start_speaking(vg, speaker, "low_latency", out_sampling_rate=22050,
                               generator=torch.Generator().manual_seed(0), graphs=graphs)  # (as stream())
        out.append((tokens, speaker, state))
    return out


def test_utterances_that_start_speaking_together_share_their_first_flow_step(vg):
    """Three calls start speaking at once; their first windows come 30 ms apart (their speech
    decoders finish at different times). The first one waits for the others' (they were announced
    by start_speaking), so the three first chunks take one flow step - on a GPU the cost of one,
    not three - and each utterance still gets the chunks it gets alone."""
    graphs = SynthesisGraphs(vg, "rehearse", rows=4, gather=1.0)
    graphs._first_step.measured(10.0)  # (a long limit, capped at MAX_WAIT_S: the wait must end because they came)
    utterances = announced(vg, graphs, 3, seed=21)
    references = [stream(vg, tokens, speaker, widened("low_latency"), [4] * 10, kind="dynamic")[1]
                  for tokens, speaker, _ in utterances]
    results = [None] * 3

    def speak_one(i):
        tokens, _, state = utterances[i]
        time.sleep(0.03 * i)
        results[i] = speak_in_pieces(vg, state, tokens, [4] * 10)

    run_in_threads(speak_one, [(i,) for i in range(3)])
    for reference, chunks in zip(references, results):
        assert_same_chunks(reference, chunks, MEL_ATOL, AUDIO_ATOL)
    assert graphs.first_batches == {3: 1}, graphs.first_batches
    first = graphs.stats()["first_windows"]
    assert (first["windows"], first["steps"], first["mean_batch"], first["waits"]) == (3, 1, 3.0, 1)
    assert first["waited_ms"] >= 40 and first["waits_ran_out"] == 0  # it waited for the last one, 60 ms after it
    assert not graphs._starting.pending() and not graphs._queue and not graphs._stepping


def test_a_call_speaking_alone_never_waits_for_its_first_window(vg):
    graphs = SynthesisGraphs(vg, "rehearse", rows=4)
    graphs._first_step.measured(5.0)
    [(tokens, _, state)] = announced(vg, graphs, 1, seed=22)

    def no_waiting(timeout=None):
        raise AssertionError(f"the step waited (up to {timeout} s) though no other utterance was starting")

    graphs._lock.wait = no_waiting  # one thread: a step waits only in the gathering
    chunks = speak_in_pieces(vg, state, tokens, [40])
    assert len(chunks) >= 2 and graphs.first_batches == {1: 1} and graphs._starting.waits == 0


def test_an_utterance_announced_but_never_spoken_costs_one_bounded_wait(vg):
    """A reply that started speaking and was cut before its first window (a barge-in) keeps its
    state alive for a while: the next first window waits for it at most ``first_gather`` steps,
    and no first window waits for it again."""
    graphs = SynthesisGraphs(vg, "rehearse", rows=4, first_gather=2.0)
    graphs._first_step.measured(0.05)
    silent, newcomer = announced(vg, graphs, 2, seed=23)
    started = time.monotonic()
    first = speak(vg, newcomer[2], newcomer[0][:, :20])
    waited = time.monotonic() - started
    assert first and 0.09 <= graphs._starting.waited_s <= waited  # two first-window steps of 50 ms
    assert graphs._starting.ran_out == 1
    assert graphs._starting.waits == 1 and not graphs._starting.pending()
    [(tokens, _, state)] = announced(vg, graphs, 1, seed=24)  # a later reply: nobody else is starting
    assert speak(vg, state, tokens[:, :20]) and graphs._starting.waits == 1
    assert silent[2].chunks_emitted == 0


def test_an_utterance_dropped_before_its_first_window_is_not_waited_for(vg):
    graphs = SynthesisGraphs(vg, "rehearse", rows=4)
    graphs._first_step.measured(5.0)
    dropped, (tokens, _, state) = announced(vg, graphs, 2, seed=25)
    del dropped  # the reply's state is gone (its call ended)
    gc.collect()

    def no_waiting(timeout=None):
        raise AssertionError(f"the step waited (up to {timeout} s) for an utterance that no longer exists")

    graphs._lock.wait = no_waiting
    assert speak(vg, state, tokens[:, :20]) and graphs.first_batches == {1: 1} and not graphs._starting.pending()


def test_an_utterance_given_up_before_its_first_window_is_not_waited_for(vg):
    """A reply taken back after it started speaking, its state still alive (the plugin holds it
    until the next reply): ``stop_speaking`` withdraws its announcement, so the next first window
    does not wait for it. (Without, it waits once, up to first_gather steps: the test above.)"""
    graphs = SynthesisGraphs(vg, "rehearse", rows=4)
    graphs._first_step.measured(5.0)
    (_, _, given_up), (tokens, _, state) = announced(vg, graphs, 2, seed=26)
    stop_speaking(given_up)
    stop_speaking(given_up)  # (twice: nothing more to withdraw)

    def no_waiting(timeout=None):
        raise AssertionError(f"the step waited (up to {timeout} s) for an utterance given up")

    graphs._lock.wait = no_waiting
    assert speak(vg, state, tokens[:, :20]) and graphs.first_batches == {1: 1} and graphs._starting.waits == 0
    assert given_up.chunks_emitted == 0


def test_an_utterance_ended_without_a_token_is_not_waited_for(vg):
    """A reply whose speech decoder gave no token ends its synthesis with ``final=True`` and nothing
    fed: its first window never comes, so its announcement is withdrawn then."""
    graphs = SynthesisGraphs(vg, "rehearse", rows=4)
    graphs._first_step.measured(5.0)
    (_, _, empty), (tokens, _, state) = announced(vg, graphs, 2, seed=27)
    assert speak(vg, empty, final=True) == [] and empty.finished

    def no_waiting(timeout=None):
        raise AssertionError(f"the step waited (up to {timeout} s) for an utterance that ended without a token")

    graphs._lock.wait = no_waiting
    assert speak(vg, state, tokens[:, :20]) and graphs.first_batches == {1: 1} and graphs._starting.waits == 0


def test_first_gather_is_checked_and_one_row_announces_nothing(vg):
    for bad in (-1, True, float("nan"), "1"):
        with pytest.raises(ValueError, match="first_gather must be a number"):
            SynthesisGraphs(vg, rows=2, first_gather=bad)
    graphs = SynthesisGraphs(vg, "rehearse", rows=1)
    announced(vg, graphs, 2, seed=26)
    assert not graphs._starting.pending()  # one window a step: nothing to gather
    graphs = SynthesisGraphs(vg, "rehearse", rows=2, first_gather=0)
    announced(vg, graphs, 2, seed=26)
    assert not graphs._starting.pending()


def test_a_failing_step_fails_its_windows_and_the_next_steps_still_run(vg, utterance):
    tokens, speaker = utterance
    graphs = SynthesisGraphs(vg, "eager", rows=2)
    bucket = graphs._flow_bucket(FLOW_BUCKETS[0])
    run = bucket.run

    def fails_once(windows, n):
        bucket.run = run
        raise RuntimeError("the step failed")

    bucket.run = fails_once
    state = start_speaking(vg, speaker, out_sampling_rate=22050, graphs=graphs)
    with pytest.raises(RuntimeError, match="the step failed"):
        speak(vg, state, tokens[:, :20])
    _, reference = stream(vg, tokens, speaker, widened("low_latency"), UNEVEN, kind="dynamic")
    _, chunks = stream(vg, tokens, speaker, "low_latency", UNEVEN, graphs=graphs)
    assert_same_chunks(reference, chunks, MEL_ATOL, AUDIO_ATOL)


def test_warm_up_prepares_every_row_count_without_counting_windows(vg):
    graphs = SynthesisGraphs(vg, "rehearse", rows=3)
    assert graphs.row_counts == [1, 2, 3]
    with torch.inference_mode():
        graphs.warm_up(flow_frames=[20], vocoder_frames=[14, 30])
    assert graphs.prepared() == {"flow": [24], "vocoder": [16, 60]}
    for bucket in (graphs._flow[24], graphs._vocoder[16], graphs._vocoder[60]):
        assert sorted(bucket.steps) == [(1, False), (2, False), (3, False)]  # padded steps
    with torch.inference_mode():
        graphs.warm_up(flow_frames=[17], vocoder_frames=[])  # a first chunk's window: its bucket's full step too
    assert sorted(graphs._flow[17].steps) == [(n, full) for n in (1, 2, 3) for full in (False, True)]
    with torch.inference_mode():
        graphs.warm_up(flow_frames=[87, 88], vocoder_frames=[])  # later windows: unpadded steps alone only
    assert sorted(graphs._flow[88].steps) == [(1, False), (1, True), (2, False), (3, False)]
    assert sorted(graphs._flow[87].steps) == [(1, True)]
    assert not graphs.counts and graphs.stats()["flow"] == {"windows": 0, "steps": 0, "mean_batch": None}
    assert graphs._first_step.seconds > 0  # a first window's step alone, timed: how long first windows wait
    with pytest.raises(ValueError, match="rows must be an integer >= 1"):
        SynthesisGraphs(vg, rows=0)
    with pytest.raises(ValueError, match="gather must be a fraction"):
        SynthesisGraphs(vg, rows=2, gather=2)


def test_a_computation_captured_again_at_another_row_count_warms_up_once(vg, monkeypatch):
    """Warm-up runs before a capture: two the first time a bucket captures a computation (padded
    or unpadded), ``repeat_warmup_runs`` at its other row counts; and fewer steps to capture than
    with every unpadded size batched. Counted on the rehearsed capture protocol (a run per
    warm-up run, and one for the capture)."""
    runs = {}
    compute = _FlowBucket._compute

    def counted(bucket, n, full):
        runs[bucket.frames, n, full] = runs.get((bucket.frames, n, full), 0) + 1
        return compute(bucket, n, full)

    monkeypatch.setattr(_FlowBucket, "_compute", counted)

    def warm(**options):
        runs.clear()
        graphs = SynthesisGraphs(vg, "rehearse", rows=4, **options)
        with torch.inference_mode():
            graphs.warm_up(flow_frames=[17, 88], vocoder_frames=[])
        return dict(runs)

    now = warm()
    # largest row count first: its captures are each computation's first; then the first window's
    # step alone once more, timed (how long first windows wait for other calls')
    assert now == {(17, 4, False): 3, (17, 4, True): 3, (17, 2, False): 2, (17, 2, True): 2,
                   (17, 1, False): 2, (17, 1, True): 2 + 1,
                   (88, 4, False): 3, (88, 2, False): 2, (88, 1, False): 2, (88, 1, True): 3}
    before = warm(batched_full_frames=None, repeat_warmup_runs=2)  # every unpadded size batched, two runs each
    assert set(before) - set(now) == {(88, 4, True), (88, 2, True)}
    assert set(before.values()) == {3, 4} and before[17, 1, True] == 3 + 1
    assert sum(now.values()) == 24 + 1 and sum(before.values()) == 36 + 1
    with pytest.raises(ValueError, match="repeat_warmup_runs must be an integer >= 0"):
        SynthesisGraphs(vg, repeat_warmup_runs=-1)


# -- selection and lifecycle ---------------------------------------------------------------------------
def test_kind_selection(vg, utterance):
    _, speaker = utterance
    assert start_speaking(vg, speaker, kind="auto").graphs is None  # CPU: the dynamic path
    assert start_speaking(vg, speaker, kind="dynamic").graphs is None
    static = start_speaking(vg, speaker, out_sampling_rate=22050, kind="static")  # (no resampler: copyable)
    assert static.graphs is shared_graphs(vg) and static.graphs.mode == "eager"
    assert start_speaking(vg, speaker, kind="static").graphs is static.graphs  # one per voice generator
    own = SynthesisGraphs(vg, "rehearse")
    assert start_speaking(vg, speaker, graphs=own).graphs is own
    assert copy.deepcopy(static).graphs is static.graphs  # a copied state shares the buckets
    with pytest.raises(ValueError, match="synthesis kind"):
        start_speaking(vg, speaker, kind="graphed")
    with pytest.raises(ValueError, match="kind='dynamic'"):
        start_speaking(vg, speaker, kind="dynamic", graphs=own)
    with pytest.raises(ValueError, match="CUDA"):
        SynthesisGraphs(vg, "graph")


def test_calls_starting_at_once_share_one_set_of_graphs(vg, monkeypatch):
    """Two threads asking for the voice generator's shared graphs at the same moment get one object
    (each making its own would leave one call stepping alone, its buckets captured twice)."""
    import threading

    twin = copy.deepcopy(vg)
    made = []
    init = SynthesisGraphs.__init__

    def slow_init(self, *args, **kwargs):
        made.append(self)
        time.sleep(0.2)  # (another thread looks in meanwhile)
        init(self, *args, **kwargs)

    monkeypatch.setattr(SynthesisGraphs, "__init__", slow_init)
    got = [None, None]

    def ask(i):
        got[i] = shared_graphs(twin)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(made) == 1 and got[0] is got[1] is made[0]


def test_graphs_are_rebuilt_when_the_weights_move(vg, utterance):
    twin = copy.deepcopy(vg)
    _, speaker = utterance
    original = shared_graphs(vg)
    graphs = shared_graphs(twin)
    assert graphs is not original and graphs.vg is twin  # a copied voice generator gets its own
    with torch.inference_mode():
        graphs.warm_up(flow_frames=[20], vocoder_frames=[])
    assert graphs.prepared() == {"flow": [24], "vocoder": []}
    captured = graphs._flow[24]
    parameter = next(twin.flow.decoder.estimator.parameters())
    parameter.data = parameter.data.clone()  # what .to() / .half() do: new storage, old graphs would read freed memory
    tokens = torch.randint(0, twin.flow.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    state = start_speaking(twin, speaker, kind="static")
    speak(twin, state, tokens, final=True)  # one 20-frame window: flow bucket 24, vocoder bucket 24
    assert graphs.prepared() == {"flow": [24], "vocoder": [24]} and graphs.counts["flow", 24] == 1
    assert graphs._flow[24] is not captured  # rebuilt for the new weights


def test_first_window_sizes_fit_their_buckets(vg, utterance, rehearsed):
    """The named policies' first-chunk flow windows fill a bucket of their own exactly."""
    firsts = [frames_for_tokens(p.first_chunk_tokens + p.lookahead_tokens)
              for p in (EmissionPolicy.low_latency(), EmissionPolicy.quality())]
    assert firsts == list(FIRST_WINDOW_FRAMES)
    assert all(rehearsed.bucket_for("flow", first) == first for first in firsts)
    assert rehearsed.bucket_for("flow", 18) == 24
    assert rehearsed.bucket_for("flow", 83) == 88 and rehearsed.bucket_for("vocoder", 58) == 60
    assert rehearsed.bucket_for("flow", 87) == 88  # (alone, an 87-frame window runs its own unpadded step)
    assert rehearsed.bucket_for("flow", 10_000) is None


@pytest.mark.parametrize("policy", ["low_latency", "quality"])
def test_windows_filling_their_bucket_run_the_unpadded_step(vg, policy):
    """The first chunk's flow window fills its bucket, and later windows are widened to fill
    theirs: the full step (no masks, the published computation) runs them all, except the second
    chunk's, which cannot reach back far enough (the utterance starts inside its bucket); growing
    chunks visit every large bucket. The chunks are the dynamic path's with the same windows."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vg.flow.vocab_size, (1, 300), generator=g)
    speaker = torch.randn(1, vg.flow.spk_embed_affine_layer.in_features, generator=g)
    graphs = SynthesisGraphs(vg, "rehearse")
    _, reference = stream(vg, tokens, speaker, widened(policy), UNEVEN, kind="dynamic")
    _, chunks = stream(vg, tokens, speaker, policy, UNEVEN, graphs=graphs)
    assert_same_chunks(reference, chunks, MEL_ATOL, AUDIO_ATOL)
    flow_windows = sum(n for (stage, _), n in graphs.counts.items() if stage == "flow")
    assert flow_windows == len(chunks) >= 6 and graphs.counts["flow", None] == 0
    assert graphs.counts["flow", FIRST_WINDOW_FRAMES[policy == "quality"]] == 1
    # the second chunk, and with 'quality' (longer windows) the fourth: they cannot reach back far enough
    assert 1 <= graphs.padded_windows["flow"] <= 2, dict(graphs.padded_windows)
    full = {size for size, bucket in graphs._flow.items() for _, is_full in bucket.steps if is_full}
    first = FIRST_WINDOW_FRAMES[policy == "quality"]
    assert first in full and len(full - {first}) >= 2 and full <= set(FULL_FLOW_WINDOWS), full


def test_only_the_chosen_buckets_take_full_steps(vg):
    """A window that happens to fill another bucket takes its padded step (a full one would be a
    capture no warm-up made: a stall in the middle of a reply on a GPU)."""
    graphs = SynthesisGraphs(vg, "rehearse", full_flow_frames=(17,))
    c = vg.flow.output_size
    with torch.inference_mode():
        graphs.warm_up(flow_frames=[17, 24], vocoder_frames=[])
        warmed = {size: sorted(bucket.steps) for size, bucket in graphs._flow.items()}
        for frames in (17, 24):
            graphs.flow(torch.randn(1, c, frames), torch.randn(1, c), torch.zeros(1, c, frames),
                        torch.randn(1, c, frames))
    assert warmed == {17: [(1, False), (1, True)], 24: [(1, False)]}
    assert {size: sorted(bucket.steps) for size, bucket in graphs._flow.items()} == warmed  # no new step


@pytest.mark.parametrize("policy", ["low_latency", "quality"])
def test_after_warm_up_no_reply_needs_a_new_step(vg, policy):
    """warm_up() prepares every step a reply's windows take - the padded buckets and every
    unpadded size the windows are widened to - so that on a GPU no capture stalls a reply."""
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, vg.flow.vocab_size, (1, 400), generator=g)
    speaker = torch.randn(1, vg.flow.spk_embed_affine_layer.in_features, generator=g)
    graphs = SynthesisGraphs(vg, "rehearse")
    with torch.inference_mode():
        graphs.warm_up()
    steps = {(stage, size): sorted(bucket.steps) for stage, buckets in (("flow", graphs._flow),
                                                                        ("vocoder", graphs._vocoder))
             for size, bucket in buckets.items()}
    assert {size for (stage, size) in steps if stage == "flow"} == set(FLOW_BUCKETS) | set(FULL_FLOW_WINDOWS)
    for sizes in ([5] * 80, UNEVEN, [400]):
        stream(vg, tokens, speaker, policy, sizes, graphs=graphs)
    after = {(stage, size): sorted(bucket.steps) for stage, buckets in (("flow", graphs._flow),
                                                                        ("vocoder", graphs._vocoder))
             for size, bucket in buckets.items()}
    assert after == steps
    assert sum(n for (stage, size), n in graphs.counts.items() if stage == "flow" and size in FULL_FLOW_WINDOWS) > 6


@pytest.mark.parametrize("sizes, step", [((87, 88), (88, False)), ((87, 87), (88, False)), ((88, 88), (88, False)),
                                         ((17, 17), (17, True)), ((37, 37), (37, True))])
def test_windows_of_one_bucket_share_one_step_whatever_their_parity(vg, sizes, step):
    """Widened windows of one bucket (87 and 88 frames: their end's parity decides) run as one
    step - the bucket's padded one, whatever their sizes (alone, each runs its size's unpadded
    step) - never a step per size; first chunks of calls that start speaking together share
    their size's unpadded step. Each window gets what it gets alone."""
    graphs = SynthesisGraphs(vg, "rehearse", rows=2)
    g, c = torch.Generator().manual_seed(4), vg.flow.output_size
    windows = [_Window("flow", graphs.bucket_for("flow", n),
                       (torch.randn(1, c, n, generator=g), torch.randn(1, c, generator=g),
                        torch.zeros(1, c, n), torch.randn(1, c, n, generator=g))) for n in sizes]
    with torch.inference_mode():
        alone = [graphs.flow(*w.inputs) for w in windows]
        steps_before = {size: set(bucket.steps) for size, bucket in graphs._flow.items()}
        with graphs._lock:
            graphs._queue.extend(windows)
            batch = graphs._next_batch()
        assert batch == windows and {w.bucket for w in batch} == {step[0]}
        graphs._run(batch)
    for w, reference in zip(windows, alone):
        torch.testing.assert_close(w.output, reference, atol=MEL_ATOL, rtol=0)
    new_steps = {(size, key) for size, bucket in graphs._flow.items() for key in bucket.steps} - \
        {(size, key) for size, keys in steps_before.items() for key in keys}
    assert new_steps == {(step[0], (2, step[1]))}, new_steps
    assert graphs.padded_windows["flow"] == (0 if step[1] else 2)  # (alone, each ran its unpadded step)


# -- the compiled estimator (opt-in) ---------------------------------------------------------------------
def test_compiled_flow_steps_give_the_same_chunks_with_one_graph_for_every_window_size(vg, utterance):
    """``compile_flow``: the flow steps call the estimator through torch.compile, its shapes dynamic,
    so one traced graph serves the first chunk's unpadded window and every later size (here the
    'eager' backend: the tracing without inductor's C compiler). The chunks equal the plain steps'."""
    from torch._dynamo.utils import counters

    tokens, speaker = utterance
    _, reference = stream(vg, tokens, speaker, "low_latency", [30] * 3, graphs=SynthesisGraphs(vg, "rehearse"))
    torch._dynamo.reset()  # (no graph left from elsewhere: the count below is this test's)
    counters.clear()
    graphs = SynthesisGraphs(vg, "rehearse", compile_flow="eager")
    _, chunks = stream(vg, tokens, speaker, "low_latency", [30] * 3, graphs=graphs)
    assert_same_chunks(reference, chunks, 1e-6, 1e-6)
    sizes = {size for (stage, size), _ in graphs.counts.items() if stage == "flow"}
    assert len(sizes) >= 3, sizes  # several window sizes ...
    # ... one graph each for the unpadded and the padded steps (and the compiled estimator was used)
    assert 1 <= counters["stats"]["unique_graphs"] <= 2
    assert vg.flow.decoder.estimator is not graphs._estimator  # the voice generator's own stays plain


def test_compile_flow_is_checked():
    with pytest.raises(ValueError, match="compile_flow must be True, False or a torch.compile backend"):
        SynthesisGraphs(torch.nn.Linear(1, 1), compile_flow=1)
    with pytest.raises(ValueError, match="repeat_warmup_runs >= 1"):
        SynthesisGraphs(torch.nn.Linear(1, 1), compile_flow=True, repeat_warmup_runs=0)


def test_the_token_encoder_s_padded_steps_give_the_flow_s_encodings(vg):
    """Rehearsed: a window's tokens padded to a token bucket, the padding keys masked (the encoder
    attends to the whole window), give ``flow.encode_tokens``'s rows; encodings kept from an earlier
    window are not overwritten; more tokens than the largest bucket are encoded eagerly."""
    from taste_speech.streaming.synthesis_graphs import TOKEN_BUCKETS

    graphs = SynthesisGraphs(vg, "rehearse")
    g = torch.Generator().manual_seed(3)
    kept = []
    with torch.no_grad():
        for n in (1, 9, 16, 17, 40, 256, 257):
            tokens = torch.randint(0, vg.flow.vocab_size, (1, n), generator=g)
            got, want = graphs.encode_tokens(tokens), vg.flow.encode_tokens(tokens)
            assert got.shape == want.shape == (1, n, vg.flow.output_size)
            assert float((got - want).abs().max()) < 1e-5, n
            kept.append((got, want))
    assert all(float((a - b).abs().max()) < 1e-5 for a, b in kept)
    assert sorted(graphs._encoders) == [16, 32, 64, 256]  # 257 tokens: eager
    graphs.warm_up(flow_frames=[17], vocoder_frames=[16])
    assert sorted(graphs._encoders) == list(TOKEN_BUCKETS)
    assert all(e.step.mode == "rehearse" for e in graphs._encoders.values())


def test_new_token_encoder_weights_are_noticed_and_encoded_eagerly_until_the_steps_are_rebuilt(vg):
    """A graph replays the weights it was captured with: token-encoder weights replaced (not only the
    estimator's or the vocoder's) change the fingerprint, so windows are encoded eagerly with the new
    weights until the next step rebuilds the buckets."""
    own = copy.deepcopy(vg)
    graphs = SynthesisGraphs(own, "rehearse")
    tokens = torch.randint(0, own.flow.vocab_size, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        graphs.encode_tokens(tokens)
        assert list(graphs._encoders) == [16]
        own.flow.encoder.load_state_dict({k: v * 1.01 for k, v in own.flow.encoder.state_dict().items()}, assign=True)
        assert graphs._weights() != graphs._fingerprint
        assert torch.equal(graphs.encode_tokens(tokens), own.flow.encode_tokens(tokens))
        graphs._check_weights()  # (what the next flow or vocoder step does first)
    assert graphs._encoders == {} and graphs._weights() == graphs._fingerprint


@pytest.mark.parametrize("n, bucket", [(13, 16), (57, 60), (60, 60)])
@torch.inference_mode()
def test_f0_predictor_padding_never_reaches_valid_frames(vg, n, bucket):
    g = torch.Generator().manual_seed(n)
    predictor = vg.hift.f0_predictor
    mel = torch.randn(1, 80, n, generator=g) - 5
    reference = predictor(mel)
    out = predictor(padded(mel, bucket, g), frame_mask(n, bucket))
    assert out.shape == (1, bucket)
    torch.testing.assert_close(out[:, :n], reference, atol=1e-5, rtol=F0_RTOL)
    if n < bucket:  # unmasked, the padding reaches the last frames
        leaky = predictor(padded(mel, bucket, g))
        assert float((leaky[:, :n] - reference).abs().max()) > 1e-3


def f0_close(got, want) -> bool:
    return bool(((got - want).abs() <= 1e-5 + F0_RTOL * want.abs()).all())


def test_the_f0_predictor_s_padded_steps_give_its_eager_values(vg):
    """Rehearsed: a vocoder window's mel padded to its vocoder bucket, the padding masked, gives
    ``hift.f0_predictor``'s values; an F0 kept from an earlier window is not overwritten; a window
    longer than the largest bucket is predicted eagerly; warm_up makes a step per vocoder bucket."""
    graphs = SynthesisGraphs(vg, "rehearse")
    g = torch.Generator().manual_seed(6)
    kept = []
    with torch.no_grad():
        for n in (1, 13, 16, 17, 100, VOCODER_BUCKETS[-1] + 1):
            mel = torch.randn(1, 80, n, generator=g) - 5
            got, want = graphs.predict_f0(mel), vg.hift.f0_predictor(mel)
            assert got.shape == want.shape == (1, n)
            assert f0_close(got, want), n
            kept.append((got, want))
    assert all(f0_close(a, b) for a, b in kept)
    assert sorted(graphs._f0) == [16, 24, 128]  # the last window: eager
    graphs.warm_up(flow_frames=[17])
    assert sorted(graphs._f0) == list(VOCODER_BUCKETS)
    assert all(f0.step.mode == "rehearse" for f0 in graphs._f0.values())
    mel = torch.randn(1, 80, 50, generator=g) - 5
    with torch.no_grad():  # a step made by the warm-up (in inference mode), run outside it
        assert f0_close(graphs.predict_f0(mel), vg.hift.f0_predictor(mel))
