"""A segment's speech-decoder conditioning as padded bucket steps (taste_speech.condition_graph), on a
CPU: rehearsed (the capture protocol, then runs that overwrite the same outputs, as replays do). The
GPU test of the captured steps is in test_gpu_graphs.py."""

import copy

import pytest
import torch

from taste_speech.condition_graph import BUCKETS, ConditionGraph
from test_speech_decoder_static import load_decoder, max_diff


@pytest.fixture(scope="module")
def decoder(taste_lm_tiny_a):
    return load_decoder(taste_lm_tiny_a)


def words(decoder, golden, n, seed):
    """n Whisper tokens and their TASTE embeddings (the golden ones, repeated and shifted)."""
    g = torch.Generator().manual_seed(seed)
    ids = golden["in.asr_token_ids"][:, torch.arange(n) % golden["in.asr_token_ids"].shape[1]]
    ids = (ids + torch.randint(0, 50, (1, n), generator=g)) % decoder.text_token_size
    audio = golden["d.audio_unit_embeds"][:, torch.arange(n) % golden["d.audio_unit_embeds"].shape[1]]
    return audio + 0.1 * torch.randn(audio.shape, generator=g), ids


def test_padded_bucket_steps_give_the_eager_conditioning(decoder, golden):
    """Every length up to the largest bucket: the same text, TASTE and fused encodings as the eager
    encoders (the padding after the real tokens is never seen: both encoders are causal); results
    kept from an earlier segment are not overwritten by the next; longer inputs are left eager."""
    cache = decoder.new_cache("static", capacity=256, graph_mode="rehearse")
    graph = decoder.condition_graph(cache)
    assert isinstance(graph, ConditionGraph) and decoder.condition_graph(cache) is graph  # kept by the cache
    speaker = golden["in.speaker_embeds"]
    kept = []
    with torch.no_grad():
        for n in (1, 5, 16, 17, 40, 128):
            audio, ids = words(decoder, golden, n, seed=n)
            replayed = decoder.condition(speaker, audio, ids, graph)
            eager = decoder.condition(speaker, audio, ids)
            for name in ("text_encoded", "audio_encoded", "fused"):
                assert getattr(replayed, name).shape == (1, n, eager.fused.shape[-1])
                assert max_diff(getattr(replayed, name), getattr(eager, name)) < 1e-5, (n, name)
            assert max_diff(decoder.prefix_embeds(speaker, audio, ids, graph), eager.prefix) < 1e-5
            kept.append((replayed.fused, eager.fused))
        assert sorted(graph._steps) == [16, 32, 64, 128]
        assert all(max_diff(a, b) < 1e-5 for a, b in kept)  # (copies, not the steps' outputs)
        assert graph.bucket(129) is None
        audio, ids = words(decoder, golden, 129, seed=0)
        assert graph.encode(audio, ids) is None
        assert max_diff(decoder.prefix_embeds(speaker, audio, ids, graph),
                        decoder.prefix_embeds(speaker, audio, ids)) == 0.0
        # the text-only conditioning (no TASTE side) stays eager
        assert torch.equal(decoder.condition(speaker, None, ids[:, :4], graph).fused,
                           decoder.condition(speaker, None, ids[:, :4]).fused)
    graph.warm_up()
    assert sorted(graph._steps) == list(BUCKETS)
    assert copy.deepcopy(cache).condition_graph is None and cache.clone().condition_graph is None


def test_only_a_static_cache_that_captures_and_causal_encoders_get_the_steps(decoder):
    assert decoder.condition_graph(decoder.new_cache("dynamic")) is None
    assert decoder.condition_graph(decoder.new_cache("static", capacity=64, graph_mode="eager")) is None
    assert decoder.condition_graph(None) is None
    whole_sequence = copy.deepcopy(decoder)
    whole_sequence.text_encoder.causal = False  # a text encoder without chunk masking sees later tokens
    assert whole_sequence.condition_graph(whole_sequence.new_cache("static", capacity=64,
                                                                   graph_mode="rehearse")) is None
    with pytest.raises(ValueError, match="causal text and TASTE encoders"):
        ConditionGraph(whole_sequence, "rehearse")
