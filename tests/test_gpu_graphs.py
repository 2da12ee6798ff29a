"""The CUDA-graph paths on a real GPU (skipped without CUDA; CI has none - run this file on the GPU
machine: ``python -m pytest -q tests/test_gpu_graphs.py``). The CPU tests of the same code paths
(static caches, the capture protocol rehearsed) are test_static_decoding.py and
test_speech_decoder_static.py; here the steps are really captured and replayed, in float32 on the
golden tiny checkpoint, and must emit the eager path's greedy ids."""

import threading
from collections import Counter

import pytest
import torch

from concurrency_helpers import run_in_threads
from cuda_waits import recorded_waits, wait_sites
from taste_speech.verify.points_spoken_lm import golden_sampler, load_golden_spoken_lm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def loaded(golden):
    loaded = load_golden_spoken_lm(golden.dir)  # a namespace: its spoken LM and RVQ move one by one
    loaded.spoken_lm.to("cuda")
    loaded.audio_tower.vq.rvq.to("cuda")
    return loaded


@pytest.fixture(autouse=True, scope="module")
def no_tf32():
    """float32 as float32: cuDNN's default TF32 convolutions round the synthesis paths (bucketed vs
    not) apart by more than these tests' bounds."""
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def on_cuda(golden, key):
    return golden[key].to("cuda")


def test_spoken_lm_graphed_greedy_equals_eager(golden, loaded):
    lm, rvq = loaded.spoken_lm, loaded.audio_tower.vq.rvq
    prompt = dict(llm_token_ids=on_cuda(golden, "in.llm_token_ids"), llm_indices=on_cuda(golden, "a.out.llm_indices"),
                  llm_word_ids=on_cuda(golden, "in.llm_word_ids"))
    with torch.no_grad():
        eager = lm.generate(rvq, golden_sampler(golden, extra_words=6), "audio", max_steps=60, cache_kind="dynamic",
                            **prompt)
        graphed = lm.generate(rvq, golden_sampler(golden, extra_words=6), "audio", max_steps=60, cache_kind="static",
                              **prompt)
    assert torch.equal(graphed.token_ids, eager.token_ids)
    assert torch.equal(graphed.taste_rows, eager.taste_rows)
    diff = (torch.stack(graphed.trace.text_logits_last_raw) - torch.stack(eager.trace.text_logits_last_raw)).abs()
    assert diff.max() < 1e-3


def test_the_spoken_lm_heads_are_captured_and_give_the_eager_heads(loaded):
    """The decode's heads (latent, RVQ search, one-hot codes, text head) replayed as one graph give
    the eager heads' values at every step."""
    lm, rvq = loaded.spoken_lm, loaded.audio_tower.vq.rvq
    state = lm.new_decode_state(cache=lm.new_cache("static", capacity=256))
    g = torch.Generator().manual_seed(2)
    rows = (torch.randn(1, 24, lm.causal_lm.config.hidden_size, generator=g) * 0.5).to("cuda")
    step = lm.heads_step(state, rvq)
    with torch.no_grad():
        lm.feed(state, rows[:, :20])
        for i in range(20, 24):
            replayed, eager = lm.heads(state.last_hidden, rvq, step=step), lm.heads(state.last_hidden, rvq)
            assert (replayed.text_logits - eager.text_logits).abs().max() < 1e-4
            assert torch.equal(replayed.taste_indices, eager.taste_indices)
            assert torch.equal(replayed.taste_logits, eager.taste_logits)
            lm.feed(state, rows[:, i:i + 1])
    assert step.step.captured, step.step.fallback_reason


def test_a_graphed_lm_step_waits_for_the_gpu_once(golden, loaded, monkeypatch):
    """Outside the captured backbone a decode step reads one value back (the chosen text token):
    counted with torch's sync debug mode around the heads, the sampler, the audio side and the next
    row, greedy and with top-p sampling and a repetition penalty."""
    from taste_speech.modeling_spoken_lm import TasteSpokenLM
    from taste_speech.sampler import SamplingParams, TasteSampler

    lm, rvq = loaded.spoken_lm, loaded.audio_tower.vq.rvq
    prompt = dict(llm_token_ids=on_cuda(golden, "in.llm_token_ids"), llm_indices=on_cuda(golden, "a.out.llm_indices"),
                  llm_word_ids=on_cuda(golden, "in.llm_word_ids"))
    sites: list[str] = []  # where each wait was

    def counted(method):
        def wrapper(*args, **kwargs):
            with recorded_waits() as caught:
                try:
                    return method(*args, **kwargs)
                finally:
                    sites.extend(wait_sites(caught))
        return wrapper

    tables = golden_sampler(golden).tables
    top_p = SamplingParams(text_top_p=0.8, text_temperature=0.9, repetition_penalty=1.2, extra_words=6)
    # a CPU generator (the engine's), and torch's global one: drawn on the GPU, where multinomial's
    # own input checks would read it twice more per step
    for params, generator in ((SamplingParams(text_top_p=0.0, extra_words=6), torch.Generator().manual_seed(0)),
                              (top_p, torch.Generator().manual_seed(0)), (top_p, None)):
        sampler = TasteSampler(tables, params)
        sites.clear()
        with monkeypatch.context() as patch:
            for name in ("heads", "advance_audio", "next_row"):
                patch.setattr(TasteSpokenLM, name, counted(getattr(TasteSpokenLM, name)))
            patch.setattr(sampler, "update", counted(sampler.update))
            with torch.no_grad():
                out = lm.generate(rvq, sampler, "audio", max_steps=30, cache_kind="static", generator=generator,
                                  **prompt)
        steps = len(out.trace.action)
        assert steps > 5 and len(sites) == steps, (params, generator, Counter(sites), steps)


@pytest.mark.parametrize("top_p", [0.0, 0.8])
def test_a_streamed_reply_waits_for_the_gpu_about_once_per_step(monkeypatch, top_p):
    """The agent's reply (the turn added, then word by word): each step's one wait is the chosen
    token, and a finished word's TASTE code rides with it (before, each word's code was a wait of
    its own when its segment was made). Adding the turn (its rows, the bucketed prefill) and a
    reply's first step (the sampler's ban mask) wait for nothing; one wait more is allowed for the
    code of the word in progress when the reply is cut off at ``max_reply_tokens`` (a step the
    sampler does not take). The instruct format: no turn decision to read."""
    from pipecat_taste.engine import TasteEngine
    from pipecat_taste.session import GenerationSettings
    from taste_agents.caller import load_utterances
    from taste_speech.sampler import TasteSampler

    engine = TasteEngine.from_pretrained(None, device="cuda", asr=None)
    hello = load_utterances()["hello"]
    session = engine.new_session(GenerationSettings(max_reply_tokens=16, seed=3, text_top_p=top_p))
    session.warm_up()
    turn = session.user_turn(hello.audio, hello.text)
    steps = {"n": 0}
    update = TasteSampler.update

    def counted_update(*args, **kwargs):
        steps["n"] += 1
        return update(*args, **kwargs)

    monkeypatch.setattr(TasteSampler, "update", counted_update)
    with recorded_waits() as caught:
        events = list(session.reply(turn, threading.Event()))
    sites = wait_sites(caught)
    words = sum(e.n_words for e in events if e.kind == "segment")
    assert words >= 3 and steps["n"] >= words
    assert steps["n"] <= len(sites) <= steps["n"] + 1, (Counter(sites), steps, words)
    session.close()


def test_speech_token_draws_on_cuda_are_the_cpu_draws(golden):
    """A CPU generator's top-k draws from CUDA log-probs (one copy of the k probabilities and ids)
    are the draws from the same log-probs on the CPU."""
    from taste_speech.modeling_speech_decoder import TopKSampler

    logp = torch.randn(20, 4097, generator=torch.Generator().manual_seed(0)).log_softmax(-1)
    on_cpu = TopKSampler(generator=torch.Generator().manual_seed(3))
    on_gpu = TopKSampler(generator=torch.Generator().manual_seed(3))
    eos = 4096
    for row in logp:
        assert on_gpu(row.cuda(), eos, allow_eos=False) == on_cpu(row, eos, allow_eos=False)
        assert on_gpu(row.cuda(), eos, allow_eos=True) == on_cpu(row, eos, allow_eos=True)


def test_spoken_lm_step_is_really_captured(loaded):
    lm = loaded.spoken_lm
    rows = torch.randn(1, 40, lm.causal_lm.config.hidden_size, device="cuda")
    state = lm.new_decode_state(cache=lm.new_cache("static", capacity=64))
    reference = lm.new_decode_state(cache=lm.new_cache("dynamic"))
    with torch.no_grad():
        a, b = lm.feed(state, rows[:, :20]), lm.feed(reference, rows[:, :20])  # the 32-row prefill graph
        assert (a - b).abs().max() < 1e-3
        for i in range(20, 40):
            a, b = lm.feed(state, rows[:, i:i + 1]), lm.feed(reference, rows[:, i:i + 1])
            assert (a - b).abs().max() < 1e-3
    assert state.cache.captured, state.cache.fallback_reason
    assert state.cache._prefill_steps[32].captured, state.cache.fallback_reason


def test_calls_capturing_their_steps_at_once_all_get_graphs_and_the_right_outputs(loaded):
    """Calls warm up from their own threads at the same moment (a server's calls starting
    together): each capture runs alone, none falls back to eager, and every cache's outputs equal
    its own growing reference."""
    lm = loaded.spoken_lm
    hidden = lm.causal_lm.config.hidden_size
    inputs = [torch.randn(1, 30, hidden, device="cuda", generator=torch.Generator("cuda").manual_seed(i))
              for i in range(4)]
    caches = []

    def call(rows):
        state = lm.new_decode_state(cache=lm.new_cache("static", capacity=48))
        reference = lm.new_decode_state(cache=lm.new_cache("dynamic"))
        caches.append(state.cache)
        with torch.no_grad():
            lm.feed(state, rows[:, :10]), lm.feed(reference, rows[:, :10])
            for i in range(10, 30):
                a, b = lm.feed(state, rows[:, i:i + 1]), lm.feed(reference, rows[:, i:i + 1])
                assert (a - b).abs().max() < 1e-3

    run_in_threads(call, [(rows,) for rows in inputs])
    assert len(caches) == 4 and all(c.captured for c in caches), [c.fallback_reason for c in caches]


def test_batched_lm_steps_are_captured_and_equal_each_call_alone(loaded):
    """Three conversations in an LMStepBatch (4 slots: sizes 1, 2, 4 captured at warm-up) step
    from three threads at once; each equals its own growing cache, and every step size used was
    replayed from a graph."""
    from taste_speech.lm_batch import LMStepBatch

    lm = loaded.spoken_lm
    batch = LMStepBatch(lm, slots=4, capacity=128)
    batch.warm_up()
    assert batch.stats()["graphs"] == [1, 2, 4]
    diffs = {}

    def conversation(seed):
        g = torch.Generator().manual_seed(seed)
        rows = (torch.randn(1, 60, lm.causal_lm.config.hidden_size, generator=g) * 0.5).to("cuda")
        state = lm.new_decode_state(cache=batch.open())
        reference = lm.new_decode_state(cache=lm.new_cache("dynamic"))
        with torch.no_grad():
            lm.feed(state, rows[:, :10 + seed]), lm.feed(reference, rows[:, :10 + seed])
            worst = 0.0
            for i in range(10 + seed, 50 + seed):
                a, b = lm.feed(state, rows[:, i:i + 1]), lm.feed(reference, rows[:, i:i + 1])
                worst = max(worst, float((a - b).abs().max()))
        state.cache.close()
        diffs[seed] = worst

    run_in_threads(conversation, [(seed,) for seed in range(3)])
    assert all(d < 1e-3 for d in diffs.values()), diffs
    stats = batch.stats()
    assert stats["rows_stepped"] == 120 and stats["slots_in_use"] == 0
    assert all(g.captured for g in batch._graphs.values()), [g.fallback_reason for g in batch._graphs.values()]
    # each conversation's first rows went through the stager's captured prefill bucket
    assert batch.staged_prefills == 3 and batch._stager._prefill_steps[32].captured, batch._stager.fallback_reason


def test_batched_speech_decoder_steps_are_captured_and_equal_each_call_alone(taste_lm_tiny_a):
    """Three calls' speech decoders step from three threads through one SpeechStepBatch (captured
    sizes 1, 2, 4): each emits its own growing cache's greedy tokens."""
    from taste_speech.speech_decoder_batch import SpeechStepBatch
    from test_speech_decoder_batch import greedy, prefixes
    from test_speech_decoder_static import load_decoder

    decoder = load_decoder(taste_lm_tiny_a).to("cuda")
    batch = SpeechStepBatch(decoder, slots=4, capacity=128)
    batch.warm_up()
    assert batch.stats()["graphs"] == [1, 2, 4]
    inputs = [p.to("cuda") for p in prefixes(decoder, 3)]
    expected = [greedy(decoder, p, decoder.new_cache("dynamic")) for p in inputs]
    results = {}

    def call(i):
        cache = batch.open()
        results[i] = greedy(decoder, inputs[i], cache)
        cache.close()

    run_in_threads(call, [(i,) for i in range(3)])
    for i, (tokens, logp) in enumerate(expected):
        assert results[i][0] == tokens and float((results[i][1] - logp).abs().max()) < 1e-3
    assert all(g.captured for g in batch._graphs.values()), [g.fallback_reason for g in batch._graphs.values()]


def test_speech_decoder_graphed_greedy_equals_eager(golden, taste_lm_tiny_a):
    from safetensors.torch import load_file

    from taste_speech.configuration_taste import TasteConfig
    from taste_speech.modeling_speech_decoder import GreedySampler, TasteSpeechDecoder

    weights = load_file(str(taste_lm_tiny_a / "model.safetensors"))
    decoder = TasteSpeechDecoder(TasteConfig.from_pretrained(str(taste_lm_tiny_a))).eval()
    decoder.load_state_dict({k[len("speech_decoder."):]: v for k, v in weights.items()
                             if k.startswith("speech_decoder.")})
    decoder.to("cuda")
    with torch.no_grad():
        prefix = decoder.prefix_embeds(on_cuda(golden, "in.speaker_embeds"), on_cuda(golden, "d.audio_unit_embeds"),
                                       on_cuda(golden, "in.asr_token_ids"))
        eager = decoder.generate(prefix, GreedySampler(), cache_kind="dynamic")  # step() below is greedy too
        cache = decoder.new_cache("static")
        state = decoder.start(prefix, cache=cache)
        tokens = []
        while (token := decoder.step(state)) is not None:
            tokens.append(token)
    assert len(tokens) > 0
    assert tokens == eager.speech_token_ids[0].tolist()
    assert cache.captured, cache.fallback_reason
    # the prefix went through its bucket's captured step, not eagerly
    bucket = cache.prefill_bucket(prefix.shape[1])
    assert bucket is not None and cache._prefill_steps[bucket].captured, cache.fallback_reason

    # top-k draws from the top-k the captured step computed: those of the sampler's own top-k
    from taste_speech.modeling_speech_decoder import TopKSampler

    def sampled(sampler):
        state = decoder.start(prefix, min_len=20, max_len=20, cache=cache)
        return [decoder.step(state, sampler) for _ in range(20)]

    own = TopKSampler(generator=torch.Generator().manual_seed(5))
    assert (sampled(TopKSampler(generator=torch.Generator().manual_seed(5)))
            == sampled(lambda logp, eos_id, allow_eos: own(logp, eos_id, allow_eos)))
    assert cache.last_top is not None and cache.last_top.is_cuda

    # the conditioning (both encoders, the fusion) replayed from its padded bucket: the eager prefix
    graph = decoder.condition_graph(cache)
    with torch.no_grad():
        replayed = decoder.prefix_embeds(on_cuda(golden, "in.speaker_embeds"), on_cuda(golden, "d.audio_unit_embeds"),
                                         on_cuda(golden, "in.asr_token_ids"), graph=graph)
    assert graph.captured, graph.fallback_reason
    assert replayed.shape == prefix.shape and (replayed - prefix).abs().max() < 1e-4


def test_synthesis_graphed_chunks_equal_the_dynamic_ones(voice_generator_tiny_a):
    """Streaming synthesis with the flow loop and the vocoder replayed from captured buckets gives
    the dynamic path's chunks (float32; GPU kernels round differently from the CPU, hence looser
    bounds than test_synthesis_graphs.py's)."""
    from taste_speech.streaming.synthesis import speak, start_speaking
    from taste_speech.streaming.synthesis_graphs import SynthesisGraphs
    from taste_speech.streaming.synthesis_state import EmissionPolicy
    from taste_speech.voice_generator import VoiceGenerator

    vg = VoiceGenerator.from_golden_dir(voice_generator_tiny_a).to("cuda")
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, vg.flow.vocab_size, (1, 90), generator=g)
    speaker = torch.randn(1, vg.flow.spk_embed_affine_layer.in_features, generator=g)
    graphs = SynthesisGraphs(vg, "graph")
    # the dynamic path with the windows the bucketed path widens to by default
    widened = EmissionPolicy.low_latency(window_frames=graphs.full_flow_frames)
    out = {}
    for name, kind in (("dynamic", {"kind": "dynamic"}), ("graphed", {"graphs": graphs})):
        state = start_speaking(vg, speaker, widened if name == "dynamic" else "low_latency",
                               out_sampling_rate=22050, generator=torch.Generator().manual_seed(0), **kind)
        chunks = []
        for i in range(0, 90, 5):
            chunks += speak(vg, state, tokens[:, i:i + 5])
        out[name] = chunks + speak(vg, state, final=True)
    assert len(out["graphed"]) == len(out["dynamic"]) >= 3
    for ref, got in zip(out["dynamic"], out["graphed"]):
        assert got.audio.shape == ref.audio.shape
        torch.testing.assert_close(got.mel, ref.mel, atol=1e-3, rtol=0)
        torch.testing.assert_close(got.audio, ref.audio, atol=5e-3, rtol=0)
    assert graphs.prepared()["flow"] and graphs.prepared()["vocoder"]
    assert graphs._encoders and all(e.step.captured for e in graphs._encoders.values())  # the token encoder's too
    assert graphs._f0 and all(f0.step.captured for f0 in graphs._f0.values())  # and the F0 predictor's
    assert not graphs.fallback_reasons(), graphs.fallback_reasons()  # every bucket was captured


def test_compiled_flow_steps_are_captured_and_give_the_plain_steps_chunks(voice_generator_tiny_a):
    """SynthesisGraphs(compile_flow=True): the estimator compiled by inductor (Triton kernels, shapes
    dynamic) inside captured steps - every bucket captured, the chunks the plain captured steps'
    up to the fused kernels' rounding (on the H100 at full size, 0.0009 of mel)."""
    from taste_speech.streaming.synthesis import speak, start_speaking
    from taste_speech.streaming.synthesis_graphs import SynthesisGraphs
    from taste_speech.voice_generator import VoiceGenerator

    vg = VoiceGenerator.from_golden_dir(voice_generator_tiny_a).to("cuda")
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, vg.flow.vocab_size, (1, 90), generator=g)
    speaker = torch.randn(1, vg.flow.spk_embed_affine_layer.in_features, generator=g)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    out = {}
    for name, graphs in (("plain", SynthesisGraphs(vg, "graph")), ("compiled", SynthesisGraphs(vg, "graph",
                                                                                              compile_flow=True))):
        state = start_speaking(vg, speaker, "low_latency", out_sampling_rate=22050,
                               generator=torch.Generator().manual_seed(0), graphs=graphs)
        chunks = []
        for i in range(0, 90, 5):
            chunks += speak(vg, state, tokens[:, i:i + 5])
        out[name] = chunks + speak(vg, state, final=True)
        assert graphs.mode == "graph" and not graphs.fallback_reasons(), graphs.fallback_reasons()
    assert len(out["compiled"]) == len(out["plain"]) >= 3
    assert 1 <= counters["stats"]["unique_graphs"] <= 2  # the compiled estimator ran (once per step kind)
    for ref, got in zip(out["plain"], out["compiled"]):
        assert got.audio.shape == ref.audio.shape
        torch.testing.assert_close(got.mel, ref.mel, atol=1e-2, rtol=0)
        torch.testing.assert_close(got.audio, ref.audio, atol=1e-2, rtol=0)


def assert_same_chunks(references, results):
    """Each utterance's chunks as on the dynamic path, within the synthesis bounds above."""
    for reference, chunks in zip(references, results, strict=True):
        assert len(chunks) == len(reference) >= 3
        for ref, got in zip(reference, chunks):
            assert got.audio.shape == ref.audio.shape
            torch.testing.assert_close(got.mel, ref.mel, atol=1e-3, rtol=0)
            torch.testing.assert_close(got.audio, ref.audio, atol=5e-3, rtol=0)


def test_batched_synthesis_steps_are_captured_and_give_each_utterance_its_chunks(voice_generator_tiny_a):
    """Three utterances spoken from three threads through one SynthesisGraphs with rows=4 (every
    bucket and row count captured up front, one shared graph pool): the windows that meet run as
    one replay, and each utterance gets its dynamic-path chunks (the bounds of the test above)."""
    from taste_speech.streaming.synthesis import speak, start_speaking
    from taste_speech.streaming.synthesis_graphs import SynthesisGraphs
    from taste_speech.streaming.synthesis_state import EmissionPolicy
    from taste_speech.voice_generator import VoiceGenerator

    vg = VoiceGenerator.from_golden_dir(voice_generator_tiny_a).to("cuda")
    g = torch.Generator().manual_seed(11)
    utterances = [(torch.randint(0, vg.flow.vocab_size, (1, 60), generator=g),
                   torch.randn(1, vg.flow.spk_embed_affine_layer.in_features, generator=g)) for _ in range(3)]
    graphs = SynthesisGraphs(vg, "graph", rows=4)
    graphs.warm_up()

    def chunks_of(tokens, speaker, **kind):
        # the dynamic reference with the windows the bucketed path widens to by default
        policy = EmissionPolicy.low_latency(window_frames=graphs.full_flow_frames)
        state = start_speaking(vg, speaker, policy if "kind" in kind else "low_latency", out_sampling_rate=22050,
                               generator=torch.Generator().manual_seed(0), **kind)
        chunks = []
        for i in range(0, tokens.shape[1], 4):
            chunks += speak(vg, state, tokens[:, i:i + 4])
        return chunks + speak(vg, state, final=True)

    references = [chunks_of(tokens, speaker, kind="dynamic") for tokens, speaker in utterances]
    results = [None] * 3

    def speak_one(i):
        results[i] = chunks_of(*utterances[i], graphs=graphs)

    run_in_threads(speak_one, [(i,) for i in range(3)])
    assert_same_chunks(references, results)
    assert not graphs.fallback_reasons(), graphs.fallback_reasons()
    steps = [step for bucket in (*graphs._flow.values(), *graphs._vocoder.values()) for step in bucket.steps.values()]
    assert steps and all(step.captured for step in steps)
    print("synthesis batches (stage, windows per step): steps", dict(graphs.batches))


def test_first_windows_of_utterances_starting_together_run_as_one_captured_step(voice_generator_tiny_a):
    """Three utterances announced at once (start_speaking) whose first windows come 20 ms apart:
    one captured first-window step serves them (its time read from CUDA events), and each gets
    its dynamic-path chunks."""
    import time

    from taste_speech.streaming.synthesis import speak, start_speaking
    from taste_speech.streaming.synthesis_graphs import SynthesisGraphs
    from taste_speech.streaming.synthesis_state import EmissionPolicy
    from taste_speech.voice_generator import VoiceGenerator

    vg = VoiceGenerator.from_golden_dir(voice_generator_tiny_a).to("cuda")
    g = torch.Generator().manual_seed(13)
    utterances = [(torch.randint(0, vg.flow.vocab_size, (1, 40), generator=g),
                   torch.randn(1, vg.flow.spk_embed_affine_layer.in_features, generator=g)) for _ in range(3)]
    graphs = SynthesisGraphs(vg, "graph", rows=4)
    graphs.warm_up()
    assert graphs._first_step.seconds > 0  # a first window's step alone, synchronised and timed
    policy = EmissionPolicy.low_latency(window_frames=graphs.full_flow_frames)

    def start(speaker, **kind):
        return start_speaking(vg, speaker, policy if "kind" in kind else "low_latency", out_sampling_rate=22050,
                              generator=torch.Generator().manual_seed(0), **kind)

    def chunks_of(state, tokens):
        chunks = []
        for i in range(0, tokens.shape[1], 4):
            chunks += speak(vg, state, tokens[:, i:i + 4])
        return chunks + speak(vg, state, final=True)

    references = [chunks_of(start(speaker, kind="dynamic"), tokens) for tokens, speaker in utterances]
    states = [start(speaker, graphs=graphs) for _, speaker in utterances]  # all announced
    graphs._first_step.measured(10.0)  # (the wait must end because they came)
    results = [None] * 3

    def speak_one(i):
        time.sleep(0.02 * i)
        results[i] = chunks_of(states[i], utterances[i][0])

    run_in_threads(speak_one, [(i,) for i in range(3)])
    assert graphs.first_batches == {3: 1} and graphs._starting.ran_out == 0, graphs.first_batches
    torch.cuda.synchronize()
    assert 0 < graphs._first_step.last() < 10  # the live step's GPU time replaced the limit above
    assert_same_chunks(references, results)
    assert not graphs.fallback_reasons(), graphs.fallback_reasons()


def test_turns_ending_together_share_one_captured_tower_pass_across_call_streams(model, processor):
    """Three calls, each on a CUDA stream of its own, whose turns end at once (announced): one
    captured pass of the shared encoder serves them, run on one caller's stream - the pass waits
    for each window, each caller for the pass - and each gets its eager encoding."""
    import copy
    import time

    from taste_speech.encoder_graph import EncoderGraph

    model = copy.deepcopy(model).to("cuda")
    tower = model.audio_tower
    graph = EncoderGraph(tower, rows=4)
    graph.warm_up()
    assert all(graph._step(n).captured for n in (1, 2, 4)), graph.step.fallback_reason
    g = torch.Generator().manual_seed(1)
    features = [processor.audio_features((0.1 * torch.randn(int(16000 * (1 + i)), generator=g)).numpy(), 16000)
                for i in range(3)]
    with torch.inference_mode():
        eager = [tower.encode_audio(f.to("cuda")) for f in features]
    callers = [torch.cuda.Stream() for _ in range(3)]  # (streams can be weakly referenced: the callers)
    for caller in callers:
        graph.expect_turn(caller)
    graph._pass_time.measured(10.0)
    got = [None] * 3

    def turn(i):
        time.sleep(0.02 * i)
        with torch.cuda.stream(callers[i]), torch.inference_mode():
            target, last = tower.encode_audio(features[i].to("cuda"), lambda w: graph(w, owner=callers[i]))
            got[i] = (target.cpu(), last.cpu())  # read on the caller's stream

    run_in_threads(turn, [(i,) for i in range(3)])
    stats = graph.stats()
    assert (stats["turns"], stats["passes"]) == (3, 1), stats
    for expected, encoded in zip(eager, got):
        for a, b in zip(expected, encoded):
            torch.testing.assert_close(b, a.cpu(), atol=1e-4, rtol=0)


def test_the_audio_tower_encoder_is_captured_and_equals_eager(model, processor):
    """The Whisper encoder of the audio tower as one CUDA graph (the padded window, one shape):
    two turns in a row, each its eager encoding."""
    import copy

    from taste_speech.encoder_graph import EncoderGraph

    model = copy.deepcopy(model).to("cuda")
    tower = model.audio_tower
    graph = EncoderGraph(tower)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for seconds in (1.5, 2.5):
            wav = 0.1 * torch.randn(int(16000 * seconds), generator=g)
            features = processor.audio_features(wav.numpy(), 16000).to("cuda")
            eager = tower.encode_audio(features)
            graphed = tower.encode_audio(features, graph)
            for a, b in zip(eager, graphed):
                torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
    assert graph.step.captured, graph.step.fallback_reason


def test_the_audio_tower_text_side_is_captured_per_bucket_and_gives_the_eager_codes(model, processor):
    """The pooler, the word means and the RVQ search as one CUDA graph per length bucket: turns of
    three lengths, from host ids or device ids, against the eager codes. On a GPU a product over the
    padded rows may round differently (another kernel) and the word sums use atomics, so a code may
    move where two are about equally near: nearly every token's codes must agree (a broken capture -
    stale buffers, padding seen by real rows - gives unrelated codes)."""
    import copy

    from taste_speech.pooler_graph import PoolerGraph

    model = copy.deepcopy(model).to("cuda")
    tower = model.audio_tower
    pooler = PoolerGraph(tower)
    pooler.warm_up()
    padded_eager = PoolerGraph(tower, "eager")  # the same padded shapes, no graph
    g = torch.Generator().manual_seed(0)
    texts = ("hello there", "extraordinary circumstances notwithstanding we proceed",
             "the quick brown fox jumps over the lazy dog while the incomprehensible bureaucrats deliberate")
    same = same_padded = tokens = 0
    with torch.inference_mode():
        for text in texts:
            aligned = processor.align_llm_ids(processor.process_text(text).llm_token_ids)
            wav = 0.1 * torch.randn(32000, generator=g)
            features = processor.audio_features(wav.numpy(), 16000).to("cuda")
            eager = tower(features, aligned.asr_token_ids.cuda(), aligned.asr_word_ids.cuda()).asr_indices.cpu()
            host, llm = tower.extract_vq(features, aligned.asr_token_ids, aligned.asr_word_ids, aligned.llm_word_ids,
                                         pooler=pooler)
            device, _ = tower.extract_vq(features, aligned.asr_token_ids.cuda(), aligned.asr_word_ids.cuda(),
                                         aligned.llm_word_ids.cuda(), pooler=pooler)
            padded, _ = tower.extract_vq(features, aligned.asr_token_ids, aligned.asr_word_ids, aligned.llm_word_ids,
                                         pooler=padded_eager)
            assert llm.device.type == "cpu" and host.shape == eager.shape
            # where the ids are does not matter (two replays of one graph: only the word sums'
            # atomics could round apart, at a near-tie)
            assert device.shape == host.shape and int((device.cpu() == host).all(-1).sum()) >= host.shape[1] - 1
            same += int((host == eager).all(-1).sum())
            same_padded += int((host == padded).all(-1).sum())
            tokens += eager.shape[1]
    assert same >= 0.9 * tokens and same_padded >= 0.9 * tokens, (same, same_padded, tokens)
    assert pooler.captured, pooler.fallback_reason
    assert sorted(pooler._steps) == pooler.buckets


@pytest.mark.parametrize("decoding", ["auto", "eager"])
def test_the_engine_answers_a_turn_on_cuda_with_its_cpu_seeded_samplers(decoding):
    """A whole reply on CUDA with the agent's default sampling (text top-p, top-k speech tokens,
    synthesis noise): the sessions' generators are CPU ones, the logits and weights on the GPU."""
    import numpy as np

    from pipecat_taste.engine import TasteEngine
    from pipecat_taste.session import GenerationSettings
    from session_helpers import speak_segments
    from taste_agents.caller import load_utterances

    engine = TasteEngine.from_pretrained(None, device="cuda", decoding=decoding)
    engine.warm_up()
    assert (engine.tower_encoder is None) == (decoding == "eager")  # the fast path's encoder graph
    # calls' waiting flow and vocoder windows share steps on the fast path, batch slots or not
    assert (engine.synthesis_graphs is None) == (decoding == "eager")
    assert engine.synthesis_graphs is None or engine.synthesis_graphs.rows == 8
    assert engine.tower_encoder is None or engine.tower_encoder.step.captured
    assert (engine.tower_pooler is None) == (decoding == "eager")  # and its text side's
    assert engine.tower_pooler is None or engine.tower_pooler.captured
    # streams='auto': the fast path's synthesis on a stream of its own, the reference on one stream
    assert engine.streams == ("default" if decoding == "eager" else "synthesis")
    assert (engine.synthesis_stream is None) == (decoding == "eager")
    hello = load_utterances()["hello"]
    session = engine.new_session(GenerationSettings(max_reply_tokens=6))
    session.warm_up()
    if decoding != "eager":  # a segment's multi-row speech-decoder feeds: captured bucket steps, ready before the turn
        heads = session.conversation.state.decode.cache.heads_step  # and the spoken LM's heads
        assert heads is not None and heads.step.captured, heads.step.fallback_reason
        speech = session.speech_cache()
        assert speech._prefill_steps and all(step.captured for step in speech._prefill_steps.values()), \
            speech.fallback_reason
        assert speech.condition_graph is not None and speech.condition_graph.captured, \
            speech.condition_graph and speech.condition_graph.fallback_reason
    turn = session.user_turn(hello.audio, hello.text)
    segments = [e for e in session.reply(turn, threading.Event()) if e.kind == "segment"]
    assert segments
    tokens, audio = speak_segments(session, segments)
    assert tokens and audio.size > 0 and np.isfinite(audio).all()
    session.close()

    # the whole-utterance path (the benchmarks' batch baseline) with a CPU generator
    wav, _ = engine.voice_generator.inference(torch.tensor([tokens]), session.voice.to("cuda"),
                                              generator=torch.Generator().manual_seed(0))
    assert wav.numel() > 0 and torch.isfinite(wav).all()


def test_speaking_waits_for_the_gpu_only_at_the_draws_and_the_audio(monkeypatch):
    """Starting each segment's speech decoder (the words' codes spread and checked on the host, the
    voice and the previous segment's tokens copied from pinned memory) does not wait for the GPU,
    and vocoding waits once per chunk, for its audio (the tokens, positions and noise go in from
    pinned memory): counted with torch's sync debug mode."""
    from pipecat_taste.engine import TasteEngine
    from pipecat_taste.session import GenerationSettings
    from taste_agents.caller import load_utterances

    engine = TasteEngine.from_pretrained(None, device="cuda", asr=None)
    hello = load_utterances()["hello"]
    session = engine.new_session(GenerationSettings(max_reply_tokens=8, seed=3))
    session.warm_up()
    segments = [e for e in session.reply(session.user_turn(hello.audio, hello.text), threading.Event())
                if e.kind == "segment"][:3]
    assert len(segments) == 3
    decoder, waits = engine.model.speech_decoder, {"speech_tokens": 0, "draws": 0, "steps": 0, "vocode": 0}
    step = decoder.step

    def counted(key, run):
        before = len(caught)
        out = run()
        waits[key] += len(wait_sites(caught[before:]))
        return out

    def counted_step(*args, **kwargs):
        waits["steps"] += 1
        return counted("draws", lambda: step(*args, **kwargs))

    monkeypatch.setattr(decoder, "step", counted_step)
    state = session.start_speech(16000)
    tokens, chunks = [], 0
    with recorded_waits() as caught:
        for seg in segments:
            pieces = session.speech_tokens(state, seg.segment)
            while (piece := counted("speech_tokens", lambda: next(pieces, None))) is not None:
                tokens += piece
                chunks += len(counted("vocode", lambda: session.vocode(state, piece)))
        chunks += len(counted("vocode", lambda: session.vocode(state, [], final=True)))
    assert len(tokens) > 10 and waits["steps"] == len(tokens) + 3 and chunks > 0
    assert waits["draws"] >= len(tokens) and waits["speech_tokens"] == waits["draws"], waits
    assert waits["vocode"] <= chunks, (waits, chunks)
    session.close()


@pytest.mark.parametrize("streams", ["synthesis", "calls"])
def test_cuda_streams_give_the_same_audio_alone_and_beside_other_calls(streams):
    """TasteEngine(streams='synthesis'): every call's flow and vocoder work on one CUDA stream
    beside the decoding; 'calls': each call's other work on a stream of its own too (its session
    made and used with it current, as a TasteCall's worker threads do). Each call's reply - words,
    speech tokens, audio - is the one the engine on the default stream speaks, alone and with three
    calls speaking at once from their own threads."""
    import numpy as np

    from concurrency_helpers import run_in_threads
    from pipecat_taste.call import TasteCall
    from pipecat_taste.engine import TasteEngine
    from pipecat_taste.session import GenerationSettings
    from pipecat_taste.streams import on_stream
    from session_helpers import speak_segments
    from taste_agents.caller import load_utterances

    plain = TasteEngine.from_pretrained(None, device="cuda", streams="default")
    engine = TasteEngine(plain.model, plain.processor, plain.voice_generator, device="cuda", asr=None, streams=streams)
    assert plain.synthesis_stream is None and engine.synthesis_stream is not None
    assert (engine.new_call_stream() is not None) == (streams == "calls")
    assert (TasteCall(engine).stream is not None) == (streams == "calls")
    for e in (plain, engine):
        e.warm_up()
    hello = load_utterances()["hello"]

    def reply(engine, seed):
        with on_stream(engine.new_call_stream()):
            session = engine.new_session(GenerationSettings(max_reply_tokens=6, seed=seed))
            session.warm_up()
            turn = session.user_turn(hello.audio, hello.text)
            segments = [e for e in session.reply(turn, threading.Event()) if e.kind == "segment"]
            tokens, audio = speak_segments(session, segments)
            session.close()
        return [e.text for e in segments], tokens, audio

    expected = {seed: reply(plain, seed) for seed in range(3)}
    results = {}
    run_in_threads(lambda seed: results.__setitem__(seed, reply(engine, seed)), [(seed,) for seed in range(3)])
    results["alone"] = reply(engine, 0)
    for key, (words, tokens, audio) in results.items():
        want = expected[0 if key == "alone" else key]
        assert words == want[0] and tokens == want[1]
        assert audio.shape == want[2].shape and np.abs(audio - want[2]).max() < 2e-4


def test_no_call_stream_is_the_capture_stream_or_the_synthesis_stream():
    """torch hands streams out round-robin from a small pool per priority: a call whose stream were
    the capture stream would have its kernels recorded into another call's graph, one on the
    synthesis stream would wait for every call's flow steps. Many calls later, neither happened."""
    from pipecat_taste.engine import TasteEngine
    from taste_speech.step_graph import _CAPTURE_STREAMS

    engine = TasteEngine.from_pretrained(None, device="cuda", asr=None, streams="calls")
    engine.warm_up()  # captures: the capture stream exists
    captures = {stream.cuda_stream for stream in _CAPTURE_STREAMS.values()}
    calls = {engine.new_call_stream().cuda_stream for _ in range(100)}
    assert captures and len(calls) > 1
    assert not captures & calls and engine.synthesis_stream.cuda_stream not in calls


def test_no_automatic_garbage_collection_runs_while_a_step_is_captured():
    """An ended call's graphs can be cyclic garbage: an automatic collection that frees them in
    the capturing thread breaks the capture (seen on the GPU: "operation not permitted when stream
    is capturing (function reset)", and the live call's step ran eagerly). So collections wait
    until the capture is done: the step sees them off while it is captured, on again after."""
    import gc

    from taste_speech.step_graph import StepGraph

    x, seen = torch.ones(4, device="cuda"), []

    def step():
        if torch.cuda.is_current_stream_capturing():
            seen.append(gc.isenabled())
        return x * 2

    assert gc.isenabled()
    graph = StepGraph(step, "cuda", "graph", name="a live call's step")
    out = graph.run()
    assert graph.captured and graph.fallback_reason is None, graph.fallback_reason
    assert seen == [False] and gc.isenabled()
    assert torch.equal(out, torch.full((4,), 2.0, device="cuda"))


def test_an_asr_with_the_tower_s_encoder_encodes_each_turn_once_on_cuda():
    """The fast path's engine shares its captured tower encoder with a built-in ASR that has the
    tower's encoder weights: the turn's final transcription pass is the tower's pass too, and its
    codes are those of the tower encoding the turn again (no new capture, no second pass)."""
    from pipecat_taste.asr import WhisperTranscriber
    from pipecat_taste.engine import TasteEngine
    from pipecat_taste.session import GenerationSettings
    from taste_agents.caller import load_utterances

    base = TasteEngine.from_pretrained(None, device="cuda", asr=None)
    asr = WhisperTranscriber.random_tiny(base.checkpoint_dir, tower=base.model.audio_tower, decode="static")
    engine = TasteEngine(base.model, base.processor, base.voice_generator, checkpoint_dir=base.checkpoint_dir,
                         device="cuda", asr=asr)
    assert engine.tower_encoder is not None and asr.shares_tower_encoder
    engine.warm_up()
    hello = load_utterances()["hello"]
    session = engine.new_session(GenerationSettings(seed=1))
    try:
        transcript = session.start_transcript()
        transcript.partial(hello.audio[: hello.audio.size // 2])
        session.turn_ended(transcript)
        transcript.finish(hello.audio)
        assert transcript.encoded is not None and transcript.encoded.ready is not None
        passes = engine.tower_encoder.stats()["passes"]
        shared = session.user_turn(hello.audio, hello.text, transcript)
        assert engine.tower_encoder.stats()["passes"] == passes
        again = session.user_turn(hello.audio, hello.text)
        assert engine.tower_encoder.stats()["passes"] == passes + 1
    finally:
        session.close()
    assert torch.equal(shared.segment.taste_ids, again.segment.taste_ids)
    assert engine.tower_encoder.step.captured
