"""The audio tower's Whisper encoder as one fixed-shape captured step (``taste_speech.encoder_graph``),
on CPU under the capture protocol ('rehearse'); the CUDA capture itself is in test_gpu_graphs.py."""

import numpy as np
import pytest
import torch

from taste_speech.encoder_graph import EncoderGraph
from taste_speech.streaming import taste_tokenize


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
