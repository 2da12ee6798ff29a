"""SpeechStepBatch: the speech decoders of several calls step as one batch, on CPU.

Each call's utterance must decode to what a cache of its own gives (the growing KVCache): the
same greedy tokens and log-probs, whichever other slots step with it, sit idle in the step's
range or are prefilled meanwhile - across utterances reusing one cache, forced tokens, running
out of slots, outgrowing the capacity, copies and closing. Eagerly and under the rehearsed
capture protocol."""

import pytest
import torch

from concurrency_helpers import run_in_threads
from taste_speech.speech_decoder_batch import SlotSpeechCache, SpeechStepBatch
from taste_speech.speech_decoder_cache import StaticSpeechCache
from test_speech_decoder_static import load_decoder, max_diff

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def decoder(taste_lm_tiny_a):
    return load_decoder(taste_lm_tiny_a)


def prefixes(decoder, n, length=12):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(1, length + 3 * i, decoder.llm.input_size, generator=g) for i in range(n)]


def greedy(decoder, prefix, cache, tokens=25):
    """Greedy tokens and the log-probs of every decision (min_len forces ``tokens`` of them)."""
    with torch.no_grad():
        state = decoder.start(prefix, min_len=tokens, max_len=tokens, record_logprobs=True, cache=cache)
        out = []
        while (token := decoder.step(state)) is not None:
            out.append(token)
    return out, torch.stack(state.step_logprobs)


@pytest.mark.parametrize("graph_mode", ["eager", "rehearse"])
def test_concurrent_utterances_decode_as_each_alone(decoder, graph_mode):
    batch = SpeechStepBatch(decoder, slots=4, capacity=128, graph_mode=graph_mode)
    batch.warm_up()
    inputs = prefixes(decoder, 3)
    expected = [greedy(decoder, p, decoder.new_cache("dynamic")) for p in inputs]
    caches = [batch.open() for _ in inputs]
    assert [c.slot for c in caches] == [0, 1, 2] and all(isinstance(c, SlotSpeechCache) for c in caches)
    results = {}

    def call(i):
        for _ in range(2):  # two utterances on one cache, as a call's segments
            results[i] = greedy(decoder, inputs[i], caches[i])

    run_in_threads(call, [(i,) for i in range(3)])
    for (tokens, logp), (want_tokens, want_logp) in zip((results[i] for i in range(3)), expected):
        assert tokens == want_tokens and max_diff(logp, want_logp) < TOLERANCE
    stats = batch.stats()
    assert stats["rows_stepped"] == 3 * 2 * 24 and stats["steps"] <= stats["rows_stepped"]
    for cache in caches:
        cache.close()
    assert batch.slots_in_use == 0


def test_an_idle_slot_in_the_step_keeps_its_positions(decoder):
    """Slot 0 decodes while slot 1 (inside every step's range) holds a half-done utterance: slot 1
    then goes on exactly as if nobody had stepped beside it."""
    batch = SpeechStepBatch(decoder, slots=2, capacity=128, graph_mode="eager")
    first, second = prefixes(decoder, 2)
    want_tokens, want_logp = greedy(decoder, second, decoder.new_cache("dynamic"))
    busy, idle = batch.open(), batch.open()
    with torch.no_grad():
        state = decoder.start(second, min_len=25, max_len=25, record_logprobs=True, cache=idle)
        tokens = [decoder.step(state) for _ in range(10)]
    greedy(decoder, first, busy)  # 24 batched steps covering slots 0..1
    with torch.no_grad():
        while (token := decoder.step(state)) is not None:
            tokens.append(token)
    assert tokens == want_tokens and max_diff(torch.stack(state.step_logprobs), want_logp) < TOLERANCE


def test_forced_tokens_and_truncation(decoder):
    """Forced tokens (a multi-row feed) and truncating back, as the plugin continues a reply."""
    batch = SpeechStepBatch(decoder, slots=2, capacity=128, graph_mode="eager")
    prefix = prefixes(decoder, 1)[0]
    results = {}
    with torch.no_grad():
        for name, cache in (("dynamic", decoder.new_cache("dynamic")), ("batched", batch.open())):
            state = decoder.start(prefix, min_len=30, max_len=30, record_logprobs=True, cache=cache)
            forced = decoder.speech_embedding(torch.tensor([[3, 7, 11]]))
            logps = [decoder.feed(state, forced)]
            state.cache.truncate(prefix.shape[1] + 1)
            state.next_logp = decoder.feed(state, forced[:, 1:])
            tokens = [decoder.step(state) for _ in range(6)]
            results[name] = (tokens, torch.stack(logps + state.step_logprobs))
    assert results["dynamic"][0] == results["batched"][0]
    assert max_diff(results["dynamic"][1], results["batched"][1]) < TOLERANCE


def test_full_batch_long_utterances_copies_and_closing(decoder):
    batch = SpeechStepBatch(decoder, slots=1, capacity=40, graph_mode="eager")
    prefix = prefixes(decoder, 1)[0]  # 12 rows + 25 tokens < 40; a 36-token utterance does not fit
    want = greedy(decoder, prefix, decoder.new_cache("dynamic"), tokens=36)
    a = batch.open()
    b = batch.open()  # no slot left: a private static cache
    assert a.batched and not b.batched and isinstance(b.private, StaticSpeechCache)
    for cache in (a, b):
        tokens, logp = greedy(decoder, prefix, cache, tokens=36)  # a leaves the batch at position 40
        assert tokens == want[0] and max_diff(logp, want[1]) < TOLERANCE
    assert not a.batched and batch.slots_in_use == 0
    c = batch.open()
    assert c.batched and c.slot == 0
    greedy(decoder, prefix, c, tokens=20)
    twin = c.clone()
    assert isinstance(twin, StaticSpeechCache) and twin.length == c.length and batch.slots_in_use == 1
    c.close()
    assert batch.slots_in_use == 0
    with pytest.raises(RuntimeError, match="closed"):
        greedy(decoder, prefix, c)


def test_a_cache_of_another_decoder_and_bad_settings_are_refused(decoder, taste_lm_tiny_a):
    other = load_decoder(taste_lm_tiny_a)
    cache = SpeechStepBatch(other, slots=1, capacity=64, graph_mode="eager").open()
    with pytest.raises(ValueError, match="another speech decoder"):
        decoder.start(prefixes(decoder, 1)[0], cache=cache)
    for kwargs in (dict(slots=0), dict(capacity=0), dict(capacity=5000), dict(gather=2.0)):
        with pytest.raises(ValueError):
            SpeechStepBatch(decoder, **kwargs)
