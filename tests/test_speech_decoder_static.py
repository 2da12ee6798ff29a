"""The speech decoder's preallocated (static) cache and its captured one-token step, on CPU.

On CUDA the static cache replays each decode step as a CUDA graph; here the same step runs eagerly
('eager') or after the warm-up/rewind cycle a capture goes through ('rehearse'). Both must give
the growing cache's results on the golden checkpoint, through truncation and re-feeding, growth
past the capacity, copies and reuse of one cache for several utterances."""

import copy

import pytest
import torch
from safetensors.torch import load_file

from taste_speech.configuration_taste import TasteConfig
from taste_speech.espnet_transformer import KVCache
from torch.utils._python_dispatch import TorchDispatchMode

from taste_speech.modeling_speech_decoder import GreedySampler, TasteSpeechDecoder, TopKSampler
from taste_speech.speech_decoder_cache import TOP_K, StaticSpeechCache

MODES = ["eager", "rehearse"]


def load_decoder(directory):
    config = TasteConfig.from_pretrained(str(directory))
    weights = load_file(str(directory / "model.safetensors"))
    decoder = TasteSpeechDecoder(config).eval()
    decoder.load_state_dict({k[len("speech_decoder."):]: v for k, v in weights.items()
                             if k.startswith("speech_decoder.")}, strict=True)
    return decoder


@pytest.fixture(scope="module")
def decoder(taste_lm_tiny_a):
    return load_decoder(taste_lm_tiny_a)


@pytest.fixture(scope="module")
def prefix(decoder, golden):
    with torch.no_grad():
        return decoder.prefix_embeds(golden["in.speaker_embeds"], golden["d.audio_unit_embeds"],
                                     golden["in.asr_token_ids"])


@pytest.fixture(scope="module")
def other_prefix(decoder, golden):
    """Another utterance: other speaker, text-only conditioning, fewer words."""
    with torch.no_grad():
        return decoder.prefix_embeds(-golden["in.speaker_embeds"], None, golden["in.asr_token_ids"][:, :4])


def max_diff(a, b):
    return float((a.double() - b.double()).abs().max())


@pytest.mark.parametrize("graph_mode", MODES)
def test_static_greedy_decoding_equals_the_dynamic_cache(decoder, golden, prefix, graph_mode):
    dynamic = decoder.generate(prefix, GreedySampler(), return_logprobs=True, cache_kind="dynamic")
    static = decoder.generate(prefix, GreedySampler(), return_logprobs=True, cache_kind="static",
                              graph_mode=graph_mode)
    assert torch.equal(dynamic.speech_token_ids, golden["d.gen.speech_token_ids"])
    assert torch.equal(static.speech_token_ids, dynamic.speech_token_ids)
    assert static.stop_reason == dynamic.stop_reason == "eos"
    assert static.step_logprobs.shape == dynamic.step_logprobs.shape
    assert max_diff(static.step_logprobs, dynamic.step_logprobs) < 1e-4


def start_both(decoder, prefix, graph_mode, capacity, **limits):
    static = decoder.start(prefix, cache=decoder.new_cache("static", capacity=capacity, graph_mode=graph_mode),
                           record_logprobs=True, **limits)
    dynamic = decoder.start(prefix, cache=decoder.new_cache("dynamic"), record_logprobs=True, **limits)
    assert isinstance(static.cache, StaticSpeechCache) and isinstance(dynamic.cache, KVCache)
    return static, dynamic


def step_both(decoder, static, dynamic, n):
    """n greedy steps on both: the same tokens, and every decision's log-probs agree."""
    for _ in range(n):
        a, b = decoder.step(static), decoder.step(dynamic)
        assert a == b and static.cache.length == dynamic.cache.length, (static.cache.length, a, b)
    assert len(static.step_logprobs) == len(dynamic.step_logprobs)
    assert max_diff(torch.stack(static.step_logprobs), torch.stack(dynamic.step_logprobs)) < 1e-4


@pytest.mark.parametrize("graph_mode", MODES)
def test_steps_truncation_and_growth_equal_the_dynamic_cache(decoder, prefix, graph_mode):
    """Prefill, one-token steps, a truncation followed by different rows (the stale slots must not
    be seen), forced tokens (a multi-row feed) and growth past the capacity (256 slots) in a
    decode step: every decision equals the growing cache's."""
    static, dynamic = start_both(decoder, prefix, graph_mode, capacity=100, min_len=400, max_len=400)
    assert static.cache.capacity == 256  # rounded up to whole blocks
    p = prefix.shape[1]
    step_both(decoder, static, dynamic, 12)
    # forget the last 8 tokens and feed other rows in their place
    for state in (static, dynamic):
        state.cache.truncate(p + 4)
        del state.tokens[4:]
        state.pending_token = None
    other = decoder.speech_embedding.weight[torch.arange(7, 13)].unsqueeze(0)
    a, b = decoder.feed(static, other), decoder.feed(dynamic, other)
    assert max_diff(a, b) < 1e-4
    static.next_logp, dynamic.next_logp = a, b
    step_both(decoder, static, dynamic, 5)
    # jump close to the capacity with one multi-row feed, then cross it one step at a time
    forced = torch.arange(256 - static.cache.length - 3) % decoder.speech_token_size
    decoder.force_tokens(static, forced), decoder.force_tokens(dynamic, forced)
    assert max_diff(static.next_logp, dynamic.next_logp) < 1e-4
    step_before_growth = static.cache._step
    step_both(decoder, static, dynamic, 10)
    assert static.cache.capacity == 512 and static.cache.length == dynamic.cache.length > 256
    assert static.cache._step is not step_before_growth  # the step was made again for the new tensors
    n = static.cache.length
    for keys, values, layer in zip(static.cache.keys, static.cache.values, dynamic.cache.layers):
        assert max_diff(keys[:, :, :n], layer.keys) < 1e-4 and max_diff(values[:, :, :n], layer.values) < 1e-4


class TopkCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.topk.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("graph_mode", MODES)
def test_the_top_k_sampler_draws_from_the_top_k_the_decode_step_computed(decoder, prefix, graph_mode):
    """The decode step takes the sampler's softmax and top-k (on CUDA: inside the captured graph),
    so each token costs one top-k, not two; the draws are those of the sampler's own top-k."""
    cache = decoder.new_cache("static", graph_mode=graph_mode)

    def sample(sampler):
        state = decoder.start(prefix, min_len=30, max_len=30, cache=cache)
        with TopkCalls() as calls:
            tokens = [decoder.step(state, sampler) for _ in range(30)]
        return tokens, calls.count

    sample(GreedySampler())  # (the step's first run: its warm-up runs, when rehearsed)
    from_step, topk_calls = sample(TopKSampler(generator=torch.Generator().manual_seed(3)))
    own = TopKSampler(generator=torch.Generator().manual_seed(3))
    by_itself, own_calls = sample(lambda logp, eos_id, allow_eos: own(logp, eos_id, allow_eos))
    assert from_step == by_itself and len(set(from_step)) > 5  # drawn, not greedy
    # 30 decisions: the first from the prefix's feed (the sampler's own top-k), 29 after decode steps
    assert own_calls == 1 + 2 * 29 and topk_calls == 1 + 29


def test_the_step_s_top_k_is_that_of_its_log_probs_and_other_sizes_draw_their_own(decoder, prefix):
    cache = decoder.new_cache("static", graph_mode="rehearse")
    state = decoder.start(prefix, cache=cache)
    assert cache.last_top is None  # a feed computes none
    logp = cache.decode_step(decoder.step(state, GreedySampler()))
    probs, ids = logp.softmax(dim=-1).topk(TOP_K)
    assert torch.equal(cache.last_top, torch.cat([probs, ids.float()]))
    with pytest.raises(ValueError, match="holds 25 tokens, the sampler draws among 5"):
        TopKSampler(5).from_top(cache.last_top, logp, decoder.eos_id, True)
    # a top-k sampler of another k draws from its own top-k: with k = 1 the arg-max
    state = decoder.start(prefix, min_len=8, max_len=8, cache=cache)
    greedy = decoder.generate(prefix, GreedySampler(), min_len=8, max_len=8, cache_kind="dynamic")
    assert [decoder.step(state, TopKSampler(1)) for _ in range(8)] == greedy.speech_token_ids[0].tolist()


def test_multi_row_feeds_replay_a_padded_bucket_step_and_equal_eager_feeds(decoder, prefix):
    """Rehearsed (the capture protocol, then the bucket steps run as replays would): feeds of 2..100
    rows go through the smallest bucket that holds them, padded after the real rows; what they
    return, and every decision after them, equals the eager feeds of a cache without steps. A feed
    whose padding would pass the capacity runs eagerly."""
    from taste_speech.speech_decoder_cache import PREFILL_BUCKETS

    rehearsed = decoder.start(prefix, cache=decoder.new_cache("static", capacity=256, graph_mode="rehearse"),
                              record_logprobs=True, min_len=300, max_len=400)
    eager = decoder.start(prefix, cache=decoder.new_cache("static", capacity=256, graph_mode="eager"),
                          record_logprobs=True, min_len=300, max_len=400)
    assert max_diff(rehearsed.next_logp, eager.next_logp) < 1e-4
    buckets = [rehearsed.cache.prefill_bucket(prefix.shape[1])]
    for rows in (2, 16, 17, 100):
        bucket = rehearsed.cache.prefill_bucket(rows)
        assert bucket == min(b for b in PREFILL_BUCKETS if b >= rows)
        buckets.append(bucket)
        ids = torch.arange(rows) % decoder.speech_token_size
        decoder.force_tokens(rehearsed, ids), decoder.force_tokens(eager, ids)
        assert rehearsed.cache.length == eager.cache.length
        assert int(rehearsed.cache.position) == rehearsed.cache.length  # back at the real end after the padding
        assert max_diff(rehearsed.next_logp, eager.next_logp) < 1e-4
        step_both(decoder, rehearsed, eager, 2)  # the padding's slots are overwritten, never seen
    assert sorted(rehearsed.cache._prefill_steps) == sorted(set(buckets))
    assert eager.cache._prefill_steps == {}
    # near the capacity the padding would not fit: eager on the same buffers, still equal
    left = rehearsed.cache.capacity - rehearsed.cache.length
    assert 2 <= left - 3 < 128 and rehearsed.cache.prefill_bucket(left - 3) is None
    ids = torch.arange(left - 3) % decoder.speech_token_size
    decoder.force_tokens(rehearsed, ids), decoder.force_tokens(eager, ids)
    assert max_diff(rehearsed.next_logp, eager.next_logp) < 1e-4


def test_warming_up_the_prefill_buckets_leaves_the_cache_as_it_was(decoder, prefix):
    from taste_speech.speech_decoder_cache import PREFILL_BUCKETS

    cache = decoder.new_cache("static", capacity=256, graph_mode="rehearse")
    warmed = decoder.start(prefix, cache=cache, record_logprobs=True)
    length = cache.length
    cache.warm_up_prefill()
    assert cache.length == int(cache.position) == length
    assert sorted(cache._prefill_steps) == list(PREFILL_BUCKETS)  # each fits after the prefix in 256 slots
    plain = decoder.start(prefix, cache=decoder.new_cache("dynamic"), record_logprobs=True)
    step_both(decoder, warmed, plain, 8)


@pytest.mark.parametrize("graph_mode", MODES)
def test_a_cloned_state_decodes_on_its_own(decoder, golden, prefix, graph_mode):
    expected = golden["d.gen.speech_token_ids"][0].tolist()
    state = decoder.start(prefix, cache=decoder.new_cache("static", capacity=64, graph_mode=graph_mode))
    first = [decoder.step(state) for _ in range(10)]
    fork = state.clone()
    twin = copy.deepcopy(state.cache)
    assert fork.cache._step is None and twin._step is None  # a copy never shares a (captured) step
    assert fork.cache._prefill_steps == {} == twin._prefill_steps
    assert fork.cache.keys[0].data_ptr() != state.cache.keys[0].data_ptr()
    assert twin.llm is state.cache.llm  # the weights are shared, not copied
    # the fork goes another way first; the original must not see its positions
    decoder.force_tokens(fork, [5, 6, 7])
    rest = []
    while (token := decoder.step(state)) is not None:
        rest.append(token)
    assert first + rest == expected
    fork_rest = []
    while (token := decoder.step(fork)) is not None:
        fork_rest.append(token)
    reference = decoder.start(prefix, cache=decoder.new_cache("dynamic"))
    decoder.force_tokens(reference, first + [5, 6, 7])
    reference_rest = []
    while (token := decoder.step(reference)) is not None:
        reference_rest.append(token)
    assert fork_rest == reference_rest


@pytest.mark.parametrize("graph_mode", MODES)
def test_a_state_cloned_after_a_failed_draw_draws_from_its_own_log_probs(decoder, prefix, graph_mode):
    """A failed draw leaves the step's log-probs pending; a clone made then keeps a copy of them,
    not the step's buffer, which the original's next steps overwrite."""
    state = decoder.start(prefix, min_len=10, max_len=30, cache=decoder.new_cache("static", graph_mode=graph_mode))
    decoder.step(state), decoder.step(state)

    def failing(logp, eos_id, allow_eos):
        raise RuntimeError("no draw")

    with pytest.raises(RuntimeError, match="no draw"):
        decoder.step(state, failing)
    own = int(state.next_logp[:decoder.eos_id].argmax())
    twin = state.clone()
    for _ in range(3):
        decoder.step(state)
    assert decoder.step(twin) == own


@pytest.mark.parametrize("graph_mode", MODES)
def test_a_sampler_of_the_caller_s_may_keep_the_log_probs_it_was_given(decoder, prefix, graph_mode):
    kept = []

    def keeping(logp, eos_id, allow_eos):
        kept.append(logp)
        return GreedySampler()(logp, eos_id, allow_eos)

    out = decoder.generate(prefix, keeping, min_len=6, max_len=6, cache_kind="static", graph_mode=graph_mode,
                           return_logprobs=True)
    assert len(kept) == out.step_logprobs.shape[0] == 6
    assert all(torch.equal(a, b) for a, b in zip(kept, out.step_logprobs))


@pytest.mark.parametrize("graph_mode", MODES)
def test_one_cache_serves_several_utterances(decoder, golden, prefix, other_prefix, graph_mode):
    """A call keeps one cache: each start empties it and keeps its step (on CUDA: no new capture),
    also when the first utterance ran inside inference_mode and the next one does not."""
    with torch.inference_mode():  # as the engine makes its per-call cache
        cache = decoder.new_cache("static", capacity=256, graph_mode=graph_mode)
        first = decoder.start(prefix, cache=cache)
        tokens = []
        while (token := decoder.step(first)) is not None:
            tokens.append(token)
    assert tokens == golden["d.gen.speech_token_ids"][0].tolist()
    step = cache._step
    second = decoder.start(other_prefix, cache=cache, min_len=3, max_len=12, record_logprobs=True)
    assert cache.length == other_prefix.shape[1] and cache.capacity == 256
    while decoder.step(second) is not None:
        pass
    assert cache._step is step
    reference = decoder.generate(other_prefix, GreedySampler(), min_len=3, max_len=12, return_logprobs=True,
                                 cache_kind="dynamic")
    assert second.tokens == reference.speech_token_ids[0].tolist()
    assert max_diff(torch.stack(second.step_logprobs), reference.step_logprobs) < 1e-4
    # the first decode's cache now belongs to the second one
    first.finished = False
    with pytest.raises(ValueError, match="taken over by a later start"):
        decoder.feed(first, other_prefix[:, :1])


def test_auto_picks_the_dynamic_cache_on_cpu(decoder, prefix):
    assert isinstance(decoder.new_cache(), KVCache)
    assert isinstance(decoder.start(prefix).cache, KVCache)
    assert decoder.new_cache("static").graph_mode == "eager"
    reused = decoder.new_cache("dynamic")
    a = decoder.start(prefix, cache=reused)
    decoder.step(a), decoder.step(a)
    b = decoder.start(prefix, cache=reused)  # a reused growing cache is emptied too
    assert reused.length == prefix.shape[1] and torch.equal(a.prefix, b.prefix)


def test_bad_cache_requests_fail_clearly(decoder, taste_lm_tiny_a, prefix):
    with pytest.raises(ValueError, match="cache kind must be one of"):
        decoder.new_cache("paged")
    with pytest.raises(ValueError, match="graph_mode must be one of"):
        decoder.new_cache("static", graph_mode="fast")
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        decoder.new_cache("static", graph_mode="graph")
    for capacity in (0, 5001):
        with pytest.raises(ValueError, match="capacity must be 1..5000"):
            decoder.new_cache("static", capacity=capacity)
    with pytest.raises(TypeError, match="cache must come from new_cache"):
        decoder.start(prefix, cache="static")
    with pytest.raises(ValueError, match="made by another speech decoder"):
        decoder.start(prefix, cache=load_decoder(taste_lm_tiny_a).new_cache("static"))
    state = decoder.start(prefix, cache=decoder.new_cache("static", capacity=16))
    with pytest.raises(ValueError, match=f"cannot truncate a cache of {prefix.shape[1]} positions to 99"):
        state.cache.truncate(99)
    with pytest.raises(ValueError, match="exceed the relative-position range"):
        state.cache.forward(torch.zeros(1, 5000, decoder.llm.input_size))
    with pytest.raises(ValueError, match="rows must be"):
        state.cache.forward(torch.zeros(1, 0, decoder.llm.input_size))


def test_a_growing_cache_taken_over_by_a_later_start_is_refused(decoder, prefix, other_prefix):
    """Like the static cache above: a decode whose KVCache a later start took over must not go on
    against the new prefix."""
    cache = decoder.new_cache("dynamic")
    first = decoder.start(prefix, cache=cache, min_len=3, max_len=12)
    copy_of_first = first.clone()  # a clone owns its cache: it goes on decoding
    decoder.start(other_prefix, cache=cache, min_len=3, max_len=12)
    with pytest.raises(ValueError, match="taken over by a later start"):
        decoder.feed(first, other_prefix[:, :1])
    decoder.feed(copy_of_first, other_prefix[:, :1])


def test_a_decode_whose_draw_failed_is_refused_once_its_cache_is_taken_over(decoder, prefix, other_prefix):
    """Its log-probs are the step's output buffer, which the later decode overwrites: a retried
    step must not draw from another utterance's log-probs."""
    cache = decoder.new_cache("static", graph_mode="rehearse")
    first = decoder.start(prefix, min_len=5, max_len=10, cache=cache)
    decoder.step(first, GreedySampler())

    def failing(logp, eos_id, allow_eos):
        raise RuntimeError("the draw failed")

    with pytest.raises(RuntimeError, match="the draw failed"):
        decoder.step(first, failing)  # after the decode step: its log-probs are kept for a retry
    assert first.next_logp is not None
    decoder.start(other_prefix, cache=cache)
    with pytest.raises(ValueError, match="taken over"):
        decoder.step(first, GreedySampler())
