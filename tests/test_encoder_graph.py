"""The audio tower's Whisper encoder as one fixed-shape captured step (``taste_speech.encoder_graph``),
on CPU under the capture protocol ('rehearse'); the CUDA capture itself is in test_gpu_graphs.py."""

import numpy as np
import pytest
import torch

from taste_speech.encoder_graph import EncoderGraph
from taste_speech.streaming import taste_tokenize


class Caller:
    """A call (announces its turns; held weakly by the encoder)."""


def tone(seconds: float, hz: float) -> np.ndarray:
    t = np.arange(int(16000 * seconds)) / 16000
    return (0.2 * np.sin(2 * np.pi * hz * t) * (1 + np.sin(2 * np.pi * 3 * t))).astype(np.float32)[None]


@torch.inference_mode()
def test_the_captured_encoder_gives_the_eager_encoding_turn_after_turn(model, processor):
    tower = model.audio_tower
    graph = EncoderGraph(tower, "rehearse")
    for seconds, hz in ((1.5, 150.0), (2.5, 220.0)):  # the second turn must not see the first's buffers
        features = processor.audio_features(tone(seconds, hz)[0], 16000)
        eager = tower.encode_audio(features)
        graphed = tower.encode_audio(features, graph)
        for a, b in zip(eager, graphed):
            torch.testing.assert_close(b, a, atol=0, rtol=0)
    assert graph.step._prepared and graph.mode == "rehearse"  # it went through warm-up and "capture"
    kept = graphed[1].clone()
    graph.warm_up()  # another window through the step: what a turn got back is its own
    torch.testing.assert_close(graphed[1], kept, atol=0, rtol=0)
    with pytest.raises(ValueError, match="log-mel features"):
        tower.encode_audio(torch.zeros(1, 10, 7), graph)


def test_taste_tokenize_with_the_graph_gives_the_same_codes(model, processor):
    ids = processor.process_text("hello there how are you").llm_token_ids
    audio = tone(2.0, 180.0)
    eager = taste_tokenize(model, processor, audio, ids, 16000)
    graphed = taste_tokenize(model, processor, audio, ids, 16000, encoder=EncoderGraph(model.audio_tower, "rehearse"))
    assert torch.equal(eager, graphed)


@torch.inference_mode()
def test_moving_the_weights_rebuilds_the_step(model, processor):
    import copy

    tower = copy.deepcopy(model.audio_tower)
    graph = EncoderGraph(tower, "rehearse")
    features = processor.audio_features(tone(1.0, 200.0)[0], 16000)
    tower.encode_audio(features, graph)
    step = graph.step
    weight = tower.encoder.conv1.weight
    weight.data = weight.data.clone()  # what .to() / .half() do: new storage, a graph would read freed memory
    again = tower.encode_audio(features, graph)
    assert graph.step is not step
    torch.testing.assert_close(again[1], tower.encode_audio(features)[1], atol=0, rtol=0)


def test_turns_of_calls_ending_together_share_one_pass_and_get_their_own_encodings(model, processor):
    """Three calls' turns end at once (announced: ``expect_turn``); their windows come 30 ms apart
    (their transcripts finish at different times), yet go through one pass of the shared encoder,
    and each gets its eager encoding; a fourth turn, alone, does not wait."""
    import copy
    import time

    from concurrency_helpers import run_in_threads

    tower = copy.deepcopy(model.audio_tower)
    graph = EncoderGraph(tower, "rehearse", rows=4)
    graph.warm_up()
    assert graph._pass_time.seconds > 0 and sorted(graph._steps) == [1, 2, 4]
    graph._pass_time.measured(10.0)  # (a long limit, capped at MAX_WAIT_S: the wait must end because the turns came)
    callers = [Caller() for _ in range(3)]
    features = [processor.audio_features(tone(1.0 + 0.5 * i, 150.0 + 40 * i)[0], 16000) for i in range(3)]
    with torch.inference_mode():
        eager = [tower.encode_audio(f) for f in features]
    for caller in callers:
        graph.expect_turn(caller)
    got = [None] * 3

    def turn(i):
        time.sleep(0.03 * i)
        with torch.inference_mode():
            got[i] = tower.encode_audio(features[i], lambda window: graph(window, owner=callers[i]))

    run_in_threads(turn, [(i,) for i in range(3)])
    for expected, encoded in zip(eager, got):
        for a, b in zip(expected, encoded):
            assert b.shape == a.shape
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    stats = graph.stats()
    assert (stats["turns"], stats["passes"], stats["waits"]) == (3, 1, 1) and stats["waited_ms"] >= 40
    assert stats["waits_ran_out"] == 0  # the wait ended when the last turn came
    with torch.inference_mode():
        tower.encode_audio(features[0], graph)  # nobody announced: no wait
    assert graph.stats()["waits"] == 1 and graph.stats()["passes"] == 2


def test_an_announced_turn_that_never_comes_costs_one_bounded_wait(model, processor):
    import time

    graph = EncoderGraph(model.audio_tower, "rehearse", rows=2, gather=2.0)
    graph._pass_time.measured(0.05)
    silent, dropped = Caller(), Caller()
    graph.expect_turn(silent)  # its transcript came out empty: no tower pass
    graph.expect_turn(dropped)
    del dropped  # a call that ended: never waited for
    features = processor.audio_features(tone(1.0, 200.0)[0], 16000)
    started = time.monotonic()
    with torch.inference_mode():
        model.audio_tower.encode_audio(features, graph)
    assert 0.09 <= graph.stats()["waited_ms"] / 1000 <= time.monotonic() - started
    assert graph.stats()["waits_ran_out"] == 1
    with torch.inference_mode():
        model.audio_tower.encode_audio(features, graph)  # forgotten: no second wait
    assert graph.stats()["waits"] == 1
    with pytest.raises(ValueError, match="rows must be an integer"):
        EncoderGraph(model.audio_tower, rows=0)
    with pytest.raises(ValueError, match="gather must be a number"):
        EncoderGraph(model.audio_tower, rows=2, gather=-1)
    one = EncoderGraph(model.audio_tower, "rehearse")
    one.expect_turn(silent)  # one turn a pass: nothing to gather
    assert not one._ending.pending()
    graph.expect_turn(silent)  # withdrawn when its transcript had no words: no wait at all
    graph.withdraw_turn(silent)
    with torch.inference_mode():
        model.audio_tower.encode_audio(features, graph)
    assert graph.stats()["waits"] == 1
