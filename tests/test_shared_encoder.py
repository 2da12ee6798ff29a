"""One Whisper encoder pass a turn for the built-in ASR and the audio tower (``WhisperTranscriber.
share_encoder``, ``TasteEngine.share_tower_encoder``), on the tiny checkpoint: an ASR whose encoder
is the tower's (as the published ASR's is the published tower's) runs its passes through the
tower's EncoderGraph, and the turn's final pass is the tower's too - the same codes as encoding
again, one pass fewer. The engine shares on its CUDA fast path only; here its tower encoder is
made rehearsed (the capture protocol on a CPU)."""

import numpy as np
import pytest
import torch

from pipecat_taste import engine as engine_module
from pipecat_taste.asr import WhisperTranscriber
from pipecat_taste.engine import TasteEngine
from pipecat_taste.session import GenerationSettings
from taste_agents.caller import load_utterances
from taste_speech.encoder_graph import EncodedTurn, EncoderGraph
from taste_speech.streaming import taste_tokenize


@pytest.fixture(scope="module")
def base():
    return TasteEngine.from_pretrained(None)  # the embedded tiny checkpoint


@pytest.fixture(scope="module")
def hello():
    return load_utterances()["hello"]


def tower_asr(base) -> WhisperTranscriber:
    tiny = WhisperTranscriber.random_tiny(base.checkpoint_dir, tower=base.model.audio_tower)
    # a decoder with large random weights: its transcript depends on the states it attends to
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in tiny.model.model.decoder.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    tiny.model.generation_config.max_length = 10
    return WhisperTranscriber(tiny.model, tiny.feature_extractor, tiny.tokenizer, language=None, max_new_tokens=None,
                              decode="static", graph_mode="rehearse")


def fast_engine(base, asr, monkeypatch) -> TasteEngine:
    """The tiny engine as on the CUDA fast path: the tower's encoder one shared (rehearsed) step."""
    monkeypatch.setattr(engine_module, "_tower_encoder",
                        lambda model, decoding, slots: EncoderGraph(model.audio_tower, "rehearse", rows=2))
    return TasteEngine(base.model, base.processor, base.voice_generator, checkpoint_dir=base.checkpoint_dir, asr=asr,
                       decoding="graphed")


def test_an_asr_with_the_tower_s_encoder_weights_matches_it_and_no_other(base):
    assert tower_asr(base).encoder_matches(base.model.audio_tower, base.processor)
    other = WhisperTranscriber.random_tiny(base.checkpoint_dir)  # its own random encoder (and window)
    assert not other.encoder_matches(base.model.audio_tower, base.processor)
    changed = tower_asr(base)
    with torch.no_grad():
        changed.model.model.encoder.layers[3].fc1.weight[0, 0] += 1e-3  # one weight of one layer
    assert not changed.encoder_matches(base.model.audio_tower, base.processor)
    cast = tower_asr(base)
    cast.model.to(torch.float64)
    assert not cast.encoder_matches(base.model.audio_tower, base.processor)


def test_the_engine_shares_its_tower_encoder_on_the_fast_path_only(base, monkeypatch):
    asr = tower_asr(base)
    plain = TasteEngine(base.model, base.processor, base.voice_generator, checkpoint_dir=base.checkpoint_dir,
                        asr=asr, decoding="graphed")  # (a CPU: no shared tower encoder)
    assert plain.tower_encoder is None and not asr.shares_tower_encoder
    fast = fast_engine(base, asr, monkeypatch)
    assert asr.shares_tower_encoder and asr._shared_encoder() is fast.tower_encoder
    other = WhisperTranscriber.random_tiny(base.checkpoint_dir, decode="static", graph_mode="rehearse")
    fast_engine(base, other, monkeypatch)  # (its own encoder: nothing to share)
    assert not other.shares_tower_encoder and other._shared_encoder() is not fast.tower_encoder


def test_a_turn_is_encoded_once_and_gets_the_codes_of_encoding_it_again(base, hello, monkeypatch):
    asr = tower_asr(base)
    engine = fast_engine(base, asr, monkeypatch)
    session = engine.new_session(GenerationSettings(seed=1))
    try:
        transcript = session.start_transcript()
        transcript.partial(hello.audio[: hello.audio.size // 2])
        assert transcript.encoded is None  # (a partial's encoding is not kept)
        session.turn_ended(transcript)
        heard = transcript.finish(hello.audio)
        assert isinstance(transcript.encoded, EncodedTurn) and transcript.encoded.matches(hello.audio)
        passes = engine.tower_encoder.stats()["passes"]
        turn = session.user_turn(hello.audio, hello.text, transcript)
        assert engine.tower_encoder.stats()["passes"] == passes  # the ASR's pass was the tower's
        assert transcript.encoded is None  # (handed over: the turn keeps no encoder states)
        again = session.user_turn(hello.audio, hello.text)  # (no transcript: the tower encodes the turn)
        assert engine.tower_encoder.stats()["passes"] == passes + 1
    finally:
        session.close()
    assert torch.equal(turn.segment.taste_ids, again.segment.taste_ids)
    text_ids = base.processor.process_text(hello.text).llm_token_ids
    eager = taste_tokenize(base.model, base.processor, torch.from_numpy(hello.audio).view(1, -1), text_ids, 16000)
    assert torch.equal(turn.segment.taste_ids, eager)
    # the transcript is the one the ASR's own encoder gives (up to the two stacks' float rounding),
    # and not the one of other states (the tower's shallow layer, say)
    alone = WhisperTranscriber(asr.model, asr.feature_extractor, asr.tokenizer, language=None, max_new_tokens=None,
                               decode="dynamic")
    assert heard == alone(hello.audio) != alone(hello.audio[::-1].copy())


def test_an_encoding_of_other_audio_is_not_used(base, hello):
    """``taste_tokenize`` uses an EncodedTurn only for the audio it was made from."""
    text_ids = base.processor.process_text(hello.text).llm_token_ids
    audio = torch.from_numpy(hello.audio).view(1, -1)
    window = base.model.audio_tower.encoder_window(base.processor.audio_features(hello.audio, 16000))
    outputs = base.model.audio_tower.encoder_stack(window)
    louder = EncodedTurn(hello.audio * 1.5, tuple(torch.zeros_like(o) for o in outputs))  # not this turn's
    assert not louder.matches(hello.audio)
    expected = taste_tokenize(base.model, base.processor, audio, text_ids, 16000)
    assert torch.equal(taste_tokenize(base.model, base.processor, audio, text_ids, 16000, encoded=louder), expected)
    # this turn's (zeroed, to see that they are what the tower pools): used as they are
    zeroed = EncodedTurn(np.array(hello.audio), tuple(torch.zeros_like(o) for o in outputs))
    assert not torch.equal(taste_tokenize(base.model, base.processor, audio, text_ids, 16000, encoded=zeroed),
                           expected)
    same = EncodedTurn(np.array(hello.audio), outputs)
    assert torch.equal(taste_tokenize(base.model, base.processor, audio, text_ids, 16000, encoded=same), expected)


def test_a_workspace_made_before_the_encoder_was_shared_is_not_used_after(base):
    """A transcription in flight while ``share_encoder`` runs gives its workspace back after: that
    workspace holds the old encoder (its outputs are not the tower's), so it is dropped."""
    asr = tower_asr(base)
    old = asr._borrow(asr.plan)
    tower = EncoderGraph(base.model.audio_tower, "rehearse")
    asr.share_encoder(tower)
    asr._give_back(old)
    assert old not in asr._workspaces
    assert asr._borrow(asr.plan).encoder is tower is asr.encoder


def test_what_a_turn_announced_and_will_not_bring_is_withdrawn(base, monkeypatch):
    """``turn_ended`` announces the turn's final ASR pass and its tower pass to the shared steps;
    ``turn_withdrawn`` takes back what will not come (an STT's words were the transcript; no words
    to tokenize), so no other call's batch waits for it."""
    asr = tower_asr(base)
    batched = WhisperTranscriber(asr.model, asr.feature_extractor, asr.tokenizer, language=None, max_new_tokens=None,
                                 decode="static", graph_mode="rehearse", batch_rows=2)
    batched.warm_up()
    engine = fast_engine(base, batched, monkeypatch)
    session = engine.new_session(GenerationSettings(seed=1))
    try:
        transcript = session.start_transcript()
        session.turn_ended(transcript)  # (sharing the tower's encoder: its final pass is the tower's)
        assert batched._batches()._ending.pending() == 1 and not engine.tower_encoder._ending.pending()
        session.turn_withdrawn(transcript, tower=False)
        assert batched._batches()._ending.pending() == 0
        session.turn_ended(None)  # (no built-in transcription: the tower's pass is announced)
        assert engine.tower_encoder._ending.pending() == 1
        session.turn_withdrawn(None, transcription=False)
        assert engine.tower_encoder._ending.pending() == 0
    finally:
        session.close()
