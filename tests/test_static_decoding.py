"""The preallocated (static) LM cache and the captured-step protocol, on CPU.

On CUDA the static cache replays each decode step as a CUDA graph; here the same step runs eagerly
('eager') or after the same warm-up/rewind cycle a capture goes through ('rehearse'). Both must
give the greedy results of the growing cache on the golden checkpoint, through crops, growth past
the capacity and copies."""

import copy

import pytest
import torch

from taste_speech.lm_cache import DynamicLMCache, StaticLMCache
from taste_speech.step_graph import StepGraph, resolve_mode
from taste_speech.verify.points_spoken_lm import golden_sampler


def audio_prompt(golden):
    return dict(llm_token_ids=golden["in.llm_token_ids"], llm_indices=golden["a.out.llm_indices"],
                llm_word_ids=golden["in.llm_word_ids"])


def test_static_cache_generates_the_golden_greedy_reply(golden, lm, rvq):
    with torch.no_grad():
        dynamic = lm.generate(rvq, golden_sampler(golden, extra_words=6), "audio", max_steps=60,
                              cache_kind="dynamic", **audio_prompt(golden))
        static = lm.generate(rvq, golden_sampler(golden, extra_words=6), "audio", max_steps=60,
                             cache_kind="static", **audio_prompt(golden))
    assert static.token_ids.shape[1] > 5
    assert torch.equal(static.token_ids, dynamic.token_ids)
    assert torch.equal(static.word_ids, dynamic.word_ids)
    assert torch.equal(static.taste_rows, dynamic.taste_rows)
    assert static.trace.seq_len == dynamic.trace.seq_len
    diff = (torch.stack(static.trace.text_logits_last_raw) - torch.stack(dynamic.trace.text_logits_last_raw)).abs()
    assert diff.max() < 1e-4


def random_rows(lm, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, n, lm.causal_lm.config.hidden_size, generator=g) * 0.5


@pytest.mark.parametrize("graph_mode", ["eager", "rehearse"])
def test_static_steps_crops_and_growth_equal_the_growing_cache(lm, graph_mode):
    """Prefill, one-row steps, a crop and re-feed, and growth past the capacity (300 rows in a
    256-row cache): every hidden state equals the growing cache's."""
    rows = random_rows(lm, 300)
    static = lm.new_decode_state(cache=lm.new_cache("static", capacity=200, graph_mode=graph_mode))
    dynamic = lm.new_decode_state(cache=lm.new_cache("dynamic"))
    assert isinstance(static.cache, StaticLMCache) and isinstance(dynamic.cache, DynamicLMCache)
    assert static.cache.capacity == 256  # rounded up to whole blocks

    def both(block):
        a, b = lm.feed(static, block), lm.feed(dynamic, block)
        assert static.length == dynamic.length
        assert (a - b).abs().max() < 1e-5, static.length

    with torch.no_grad():
        both(rows[:, :40])
        for i in range(40, 60):
            both(rows[:, i:i + 1])
        static.crop(50), dynamic.crop(50)
        for i in range(50, 70):  # the stale rows 50..59 must not be seen
            both(rows[:, i:i + 1])
        both(rows[:, 70:250])
        for i in range(250, 300):  # crosses the capacity: the cache grows (and re-captures)
            both(rows[:, i:i + 1])
    assert static.cache.capacity == 512 and static.length == 300
    for (ks, vs), (kd, vd) in zip(static.cache.keys_values(), dynamic.cache.keys_values()):
        assert torch.allclose(ks, kd, atol=1e-5) and torch.allclose(vs, vd, atol=1e-5)


def test_prefill_buckets_pad_where_no_query_looks(lm):
    """Under the capture protocol a multi-row feed takes the smallest bucket that holds it and fits
    (its padding rows are written after the real ones, then the write position goes back); one
    that would reach past the capacity padded runs eagerly; a warm-up of every bucket leaves the
    cache as it was. Every hidden state equals the growing cache's."""
    rows = random_rows(lm, 120, seed=3)
    static = lm.new_decode_state(cache=lm.new_cache("static", capacity=256, graph_mode="rehearse"))
    dynamic = lm.new_decode_state(cache=lm.new_cache("dynamic"))
    cache = static.cache
    with torch.no_grad():
        assert cache.prefill_bucket(1) is None and cache.prefill_bucket(20) == 32 and cache.prefill_bucket(65) == 128
        cache.warm_up_prefill(lm.backbone)  # every bucket fits after 0 rows: all captured, nothing kept
        assert sorted(cache._prefill_steps) == [32, 64, 128, 256] and cache.length == 0
        assert all(int(layer.cumulative_length) == 0 for layer in cache.kv.layers)
        for start, stop, bucket in ((0, 20, 32), (20, 21, None), (21, 60, 64), (60, 61, None), (61, 100, 64)):
            block = slice(start, stop)
            assert cache.prefill_bucket(stop - start) == bucket
            a, b = lm.feed(static, rows[:, block]), lm.feed(dynamic, rows[:, block])
            assert static.length == dynamic.length == block.stop
            assert all(int(layer.cumulative_length) == block.stop for layer in cache.kv.layers)
            assert (a - b).abs().max() < 1e-5, block
    assert cache.prefill_bucket(200) is None  # 100 + 256 rows would pass the 256-row capacity: eager
    # a bucket first used under inference_mode stays usable outside it (a graph's buffers must)
    fresh = lm.new_decode_state(cache=lm.new_cache("static", capacity=256, graph_mode="rehearse"))
    with torch.inference_mode():
        lm.feed(fresh, rows[:, :20])
    with torch.no_grad():
        fresh.crop(0)
        lm.feed(fresh, rows[:, :20])
    eager = lm.new_cache("static", capacity=256, graph_mode="eager")
    assert eager.prefill_bucket(20) is None  # the eager mode (a CPU's 'auto') never pads


def test_a_copied_static_state_decodes_on_its_own(lm):
    rows = random_rows(lm, 30, seed=1)
    state = lm.new_decode_state(cache=lm.new_cache("static", capacity=64, graph_mode="rehearse"))
    with torch.no_grad():
        lm.feed(state, rows[:, :20])
        lm.feed(state, rows[:, 20:21])
        twin = copy.deepcopy(state)
        assert twin.cache._step is None  # a copy never shares the original's (graph) step
        h_twin = [lm.feed(twin, rows[:, i:i + 1]) for i in range(21, 30)]
        h_orig = [lm.feed(state, rows[:, i:i + 1]) for i in range(21, 30)]
    assert state.length == twin.length == 30
    assert all(torch.equal(a, b) for a, b in zip(h_twin, h_orig))


def test_the_captured_heads_step_gives_the_eager_heads_and_stays_with_its_cache(lm, rvq):
    """Rehearsed (the capture protocol, then runs that overwrite the same outputs, as replays do): each
    step's heads equal the eager ones, and what an earlier step returned is not overwritten by the
    next. The cache keeps the step for its later decodes; a copy starts without; eager caches and
    growing ones have none."""
    state = lm.new_decode_state(cache=lm.new_cache("static", capacity=64, graph_mode="rehearse"))
    rows = random_rows(lm, 24, seed=2)
    step = lm.heads_step(state, rvq)
    assert step is not None and lm.heads_step(state, rvq) is step
    got, want = [], []
    with torch.no_grad():
        lm.feed(state, rows[:, :20])
        for i in range(20, 24):
            got.append(lm.heads(state.last_hidden, rvq, step=step))
            want.append(lm.heads(state.last_hidden, rvq))
            lm.feed(state, rows[:, i:i + 1])
    assert len({float(h.text_logits.sum()) for h in got}) == len(got)  # four different steps
    for a, b in zip(got, want):  # (kept from earlier steps: copies, not the step's outputs)
        assert torch.equal(a.text_logits, b.text_logits) and torch.equal(a.taste_logits, b.taste_logits)
        assert torch.equal(a.taste_indices, b.taste_indices) and torch.equal(a.taste_z, b.taste_z)
    assert step.step is not None and step.step.mode == "rehearse"
    assert state.cache.heads_step is step
    assert copy.deepcopy(state).cache.heads_step is None
    for cache in (lm.new_cache("static", capacity=64, graph_mode="eager"), lm.new_cache("dynamic")):
        assert lm.heads_step(lm.new_decode_state(cache=cache), rvq) is None


def test_bad_cache_requests_fail_clearly(lm):
    with pytest.raises(ValueError, match="cache kind"):
        lm.new_cache("paged")
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        lm.new_cache("static", graph_mode="graph")
    state = lm.new_decode_state(cache=lm.new_cache("static", capacity=16))
    with torch.no_grad():
        lm.feed(state, random_rows(lm, 4))
    with pytest.raises(ValueError, match="cannot crop a decode state of 4 rows to 5"):
        state.crop(5)


def test_auto_modes_pick_the_eager_path_on_cpu(lm):
    assert resolve_mode("auto", "cpu") == "eager"
    assert resolve_mode("auto", "cuda") == "graph"
    assert isinstance(lm.new_cache("auto"), DynamicLMCache)  # on CPU the growing cache is faster


def test_rehearsal_runs_the_capture_protocol():
    """A step with side effects: each warm-up run is rewound, so only the real runs count."""
    counter = torch.zeros(())
    calls = []

    def step():
        counter.add_(1)
        calls.append(int(counter))
        return counter * 10

    graph = StepGraph(step, "cpu", "rehearse", rewind=lambda: counter.sub_(1), warmup_runs=3)
    assert float(graph.run()) == 10 and float(graph.run()) == 20
    assert calls == [1, 1, 1, 1, 2] and not graph.captured
    eager = StepGraph(step, "cpu", "eager", rewind=lambda: pytest.fail("eager steps never rewind"))
    assert float(eager.run()) == 30


def test_a_cache_made_under_inference_mode_is_usable_outside_it(lm):
    """The engine may create a call's cache in an inference_mode block and decode under no_grad
    later: the preallocated tensors must not be inference tensors."""
    rows = random_rows(lm, 12, seed=2)
    with torch.inference_mode():
        state = lm.new_decode_state(cache=lm.new_cache("static", capacity=32))
        lm.feed(state, rows[:, :8])
    reference = lm.new_decode_state(cache=lm.new_cache("dynamic"))
    with torch.no_grad():
        lm.feed(reference, rows[:, :8])
        for i in range(8, 12):
            a, b = lm.feed(state, rows[:, i:i + 1]), lm.feed(reference, rows[:, i:i + 1])
            assert (a - b).abs().max() < 1e-5
