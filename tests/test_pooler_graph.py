"""The audio tower's text side as captured steps per length bucket (``taste_speech.pooler_graph``),
on CPU under the capture protocol ('rehearse'); the CUDA capture itself is in test_gpu_graphs.py."""

import copy
import re
import threading

import numpy as np
import pytest
import torch

from taste_speech.encoder_graph import EncoderGraph
from taste_speech.pooler_graph import PoolerGraph, buckets_for
from taste_speech.streaming import taste_tokenize
from taste_speech.word_alignment import mean_pool_runs, mean_pool_words, word_runs

# Short and long transcripts: the decoder's input lands in three buckets (16, 64 and 128 tokens: the
# tiny checkpoint's Whisper tokenizer splits words finely), and words of several tokens are averaged.
SENTENCES = (
    "hello there",
    "extraordinary circumstances notwithstanding we proceed",
    "the quick brown fox jumps over the lazy dog while the incomprehensible "
    "bureaucrats deliberate about unprecedented administrative reorganisations tonight",
)


def tone(seconds: float, hz: float) -> np.ndarray:
    t = np.arange(int(16000 * seconds)) / 16000
    return (0.2 * np.sin(2 * np.pi * hz * t) * (1 + np.sin(2 * np.pi * 3 * t))).astype(np.float32)


def turn_inputs(processor, text: str, seconds: float = 2.0, hz: float = 180.0):
    """(features, asr ids, asr word ids, llm word ids) of a turn, as taste_tokenize makes them."""
    aligned = processor.align_llm_ids(processor.process_text(text).llm_token_ids)
    return (processor.audio_features(tone(seconds, hz), 16000), aligned.asr_token_ids, aligned.asr_word_ids,
            aligned.llm_word_ids)


def test_buckets_double_up_to_the_decoders_positions():
    assert buckets_for(448) == [16, 32, 64, 128, 256, 448]
    assert buckets_for(16) == [16]
    assert buckets_for(20) == [16, 20]


def test_the_pooling_of_runs_is_the_eager_word_pooling_bit_for_bit():
    states = torch.randn(1, 9, 6)
    word_ids = torch.tensor([[0, 0, 0, 1, 2, 2, 3]])  # a 3-token word, single ones, a 2-token word
    run, sizes = word_runs(word_ids[0])
    assert run.tolist() == [0, 0, 0, 1, 2, 2, 3] and sizes.tolist() == [3, 3, 3, 1, 2, 2, 1]
    # padded to a bucket: two more rows, each a run of its own, changed by nothing
    padded_run = torch.cat([run, torch.tensor([7, 8])])
    padded_sizes = torch.cat([sizes, torch.tensor([1, 1])])
    pooled = mean_pool_runs(states[0], padded_run, padded_sizes)
    assert torch.equal(pooled, mean_pool_words(states, word_ids)[0])
    assert torch.equal(pooled[3], states[0, 3]) and torch.equal(pooled[7:], states[0, 7:])
    torch.testing.assert_close(pooled[0], states[0, :3].mean(0))


@torch.inference_mode()
def test_the_pooler_gives_the_eager_codes_turn_after_turn_in_every_bucket(model, processor):
    tower = model.audio_tower
    pooler = PoolerGraph(tower, "rehearse")
    used, kept = set(), []
    for i, text in enumerate(SENTENCES):
        features, asr_ids, asr_words, llm_words = turn_inputs(processor, text, 1.5 + i, 150.0 + 40 * i)
        eager = tower(features, asr_ids, asr_words)
        target, last = tower.encode_audio(features)
        codes = pooler(tower.decoder_input_ids(asr_ids), last, target, asr_words)
        assert codes.dtype == torch.long and codes.shape == eager.asr_indices.shape
        assert torch.equal(codes, eager.asr_indices), text
        used.add(next(b for b in pooler.buckets if b >= asr_ids.shape[1] + 5))
        kept.append((codes, codes.clone()))
    assert len(used) == 3, used  # the sentences reach three buckets
    for codes, copy_ in kept:  # what a turn got back is its own: later steps did not overwrite it
        assert torch.equal(codes, copy_)
    assert all(pooler._step(b)._prepared for b in used) and pooler.turns == len(SENTENCES)


def test_taste_tokenize_with_the_pooler_and_the_encoder_graph_gives_the_same_codes(model, processor):
    for text in SENTENCES:
        ids = processor.process_text(text).llm_token_ids
        audio = tone(2.5, 200.0)
        eager = taste_tokenize(model, processor, audio, ids, 16000)
        fast = taste_tokenize(model, processor, audio, ids, 16000, pooler=PoolerGraph(model.audio_tower, "rehearse"),
                              encoder=EncoderGraph(model.audio_tower, "rehearse"))
        assert fast.dtype == torch.long and fast.device.type == "cpu"
        assert torch.equal(eager, fast), text


def test_calls_sharing_one_pooler_each_get_their_own_codes(model, processor):
    pooler = PoolerGraph(model.audio_tower, "rehearse")
    pooler.warm_up()
    turns = [(processor.process_text(text).llm_token_ids, tone(1.0 + 0.5 * i, 140.0 + 30 * i))
             for i, text in enumerate(SENTENCES * 2)]
    expected = [taste_tokenize(model, processor, audio, ids, 16000) for ids, audio in turns]
    got, errors = [None] * len(turns), []
    start = threading.Barrier(len(turns))

    def call(i):
        try:
            start.wait()
            for _ in range(3):
                got[i] = taste_tokenize(model, processor, turns[i][1], turns[i][0], 16000, pooler=pooler)
                assert torch.equal(got[i], expected[i])
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(turns))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert pooler.turns == 3 * len(turns)


@torch.inference_mode()
def test_warm_up_makes_every_bucket_and_changes_no_later_turn(model, processor):
    pooler = PoolerGraph(model.audio_tower, "rehearse")
    pooler.warm_up()
    assert sorted(pooler._steps) == pooler.buckets and all(s._prepared for s in pooler._steps.values())
    assert not pooler.captured and pooler.fallback_reason is None  # rehearsed: no CUDA graph, nothing failed
    features, asr_ids, asr_words, _ = turn_inputs(processor, SENTENCES[1])
    target, last = model.audio_tower.encode_audio(features)
    codes = pooler(model.audio_tower.decoder_input_ids(asr_ids), last, target, asr_words)
    assert torch.equal(codes, model.audio_tower(features, asr_ids, asr_words).asr_indices)


@torch.inference_mode()
def test_moving_the_weights_rebuilds_the_steps(model, processor):
    """New storage for a weight makes new steps (a captured graph would read the freed addresses; the
    eager steps rehearsed here read the live weights either way, so only the rebuild is shown)."""
    tower = copy.deepcopy(model.audio_tower)
    pooler = PoolerGraph(tower, "rehearse")
    features, asr_ids, asr_words, _ = turn_inputs(processor, SENTENCES[0])
    target, last = tower.encode_audio(features)
    ids = tower.decoder_input_ids(asr_ids)
    pooler(ids, last, target, asr_words)
    steps = dict(pooler._steps)
    weight = tower.decoder.embed_tokens.weight
    weight.data = weight.data * 1.5  # new storage, as .to() / .half() make: a graph would read freed memory
    again = pooler(ids, last, target, asr_words)
    assert pooler._steps and all(pooler._steps[b] is not steps[b] for b in pooler._steps)
    assert torch.equal(again, tower(features, asr_ids, asr_words).asr_indices)
    assert not again.is_inference()  # a normal tensor, as the eager path gives
    steps = dict(pooler._steps)
    codebook = tower.rvq.codebooks()[-1]
    codebook.embed = codebook.embed.clone()  # a buffer deep in the RVQ, in new storage on its own
    pooler(ids, last, target, asr_words)
    assert all(pooler._steps[b] is not steps[b] for b in pooler._steps)


@torch.inference_mode()
def test_bad_inputs_are_refused_with_the_fix(model, processor):
    tower = model.audio_tower
    pooler = PoolerGraph(tower, "rehearse")
    features, asr_ids, asr_words, _ = turn_inputs(processor, SENTENCES[0])
    target, last = tower.encode_audio(features)
    with pytest.raises(ValueError, match=re.escape("give the prompt, the transcript and <|endoftext|>")):
        pooler(asr_ids, last, target, asr_words)  # the transcript alone, without the decoder's specials
    too_long = torch.full((1, 450), 440, dtype=torch.long)
    with pytest.raises(ValueError, match="at most 448 tokens"):
        pooler(tower.decoder_input_ids(too_long), last, target, torch.arange(450).unsqueeze(0))
    with pytest.raises(ValueError, match="Whisper tokens"):  # the tower's own check comes first
        tower.extract_vq(features, too_long, torch.arange(450).unsqueeze(0), torch.zeros(1, 3, dtype=torch.long),
                         pooler=pooler)
