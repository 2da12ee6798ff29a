"""TasteProcessor and the tiny tokenizers: loading the published layout, audio features, the
original's text rules, LLM-word -> ASR re-encoding, speaker embedding through an ONNX model,
optional ASR, and every bad-input error."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from taste_speech.audio import kaldi_fbank, mean_normalise, resample
from taste_speech.processing_taste import DEFAULT_VOICE_WAV, TasteProcessor, TextInputs, _asr_model_name, _read_default_voice
from taste_speech.tiny_speaker import write_speaker_model
from taste_speech.tiny_tokenizers import build_tiny_tokenizers, llama3_special_tokens

SPEAKER_DIM = 192


# The speaker model is a real ONNX graph (the tiny checkpoints' stand-in for CAMPPlus):
# feats (1, T, 80) -> MatMul W (80, D) -> Tanh -> ReduceMean over T -> (1, D).
def expected_speaker_vector(weight, clips16k):
    vectors = [np.tanh(mean_normalise(kaldi_fbank(c)).astype(np.float64) @ weight).mean(axis=0) for c in clips16k]
    mean = np.mean(vectors, axis=0)
    return mean / np.linalg.norm(mean)


# -- fixtures -------------------------------------------------------------------------------------
def speechlike(seconds: float, rate: int = 16000, seed: int = 0, f0: float = 130.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(seed)
    phase = 2 * np.pi * np.cumsum(f0 + 30 * np.sin(2 * np.pi * 0.8 * t)) / rate
    tone = sum(np.sin(h * phase) / h for h in range(1, 6))
    return (0.2 * tone * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t)) + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizers")
    return build_tiny_tokenizers(str(out), llm_vocab_size=1024, asr_vocab_size=512)


@pytest.fixture(scope="module")
def speaker_weight():
    return np.random.default_rng(3).standard_normal((80, SPEAKER_DIM)).astype(np.float32) * 0.05


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory, tokenizers, taste_lm_tiny_a, speaker_weight):
    """The processor's part of the published layout: the golden tiny_a config (300-frame window,
    asr_config named like the published one), tiny tokenizers and a speaker ONNX model."""
    root = tmp_path_factory.mktemp("checkpoint")
    shutil.copy(taste_lm_tiny_a / "config.json", root / "config.json")
    shutil.copytree(taste_lm_tiny_a / "whisper_joint", root / "whisper_joint")
    shutil.copytree(tokenizers.llm_dir, root / "llama_tokenizer")
    shutil.copytree(tokenizers.asr_dir, root / "asr_tokenizer")
    (root / "cosyvoice").mkdir()
    write_speaker_model(root / "cosyvoice" / "speaker_embed.onnx", speaker_weight)
    (root / "cosyvoice" / "voice_generator.pth").write_bytes(b"")  # only its path is exposed
    return root


@pytest.fixture(scope="module")
def processor(checkpoint_dir):
    return TasteProcessor.from_pretrained(str(checkpoint_dir))


# -- loading --------------------------------------------------------------------------------------
def test_from_pretrained_reads_the_published_layout(processor, checkpoint_dir):
    assert len(processor.llm_tokenizer) == 1024 and len(processor.asr_tokenizer) == 512
    assert processor.num_frames == 300 and processor.max_samples == 48000 and processor.max_seconds == 3.0
    assert processor.n_mels == 128
    assert processor.max_asr_tokens == 64 - 5  # max_target_positions minus the 5 Whisper specials
    assert processor.speaker_model_path == str(checkpoint_dir / "cosyvoice" / "speaker_embed.onnx")
    assert processor.voice_generator_path == str(checkpoint_dir / "cosyvoice" / "voice_generator.pth")
    assert processor.default_speaker_path is None
    # tiny_a's asr_config names the original's local path .../whisper-large-v3
    assert processor.asr_model == "openai/whisper-large-v3"


def test_from_pretrained_errors(tmp_path, checkpoint_dir):
    with pytest.raises(ValueError, match="neither a local directory nor a hub id"):
        TasteProcessor.from_pretrained(str(tmp_path / "missing" / "deeper" / "x"))
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        TasteProcessor.from_pretrained(str(tmp_path / "file.txt"))
    partial = tmp_path / "partial"
    shutil.copytree(checkpoint_dir, partial)
    (partial / "llama_tokenizer" / "tokenizer.json").unlink()  # an interrupted download: the config only
    with pytest.raises(ValueError, match="llama_tokenizer/tokenizer.json"):
        TasteProcessor.from_pretrained(str(partial))
    shutil.rmtree(partial / "llama_tokenizer")
    with pytest.raises(ValueError, match="llama_tokenizer"):
        TasteProcessor.from_pretrained(str(partial))


def test_asr_name_resolution(tmp_path):
    assert _asr_model_name("./storage/pretrained_models/whisper-large-v3", str(tmp_path)) == "openai/whisper-large-v3"
    assert _asr_model_name("openai/whisper-small", str(tmp_path)) == "openai/whisper-small"
    assert _asr_model_name("", str(tmp_path)) == "openai/whisper-large-v3"
    (tmp_path / "asr_tokenizer").mkdir()
    assert _asr_model_name("asr_tokenizer", str(tmp_path)) == str(tmp_path / "asr_tokenizer")
    assert _asr_model_name("asr_tokenizer", str(tmp_path), need_model=True) is None  # not a Whisper model
    assert _asr_model_name("some_local_name", str(tmp_path)) is None


def test_tiny_checkpoint_loads_offline(tiny_checkpoint):
    processor = TasteProcessor.from_pretrained(str(tiny_checkpoint))
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    assert len(processor.llm_tokenizer) <= config["text_config"]["vocab_size"]
    assert len(processor.asr_tokenizer) <= config["speech_decoder_config"]["text_token_size"]
    sos = config["spoken_lm_config"]["sos_id"]
    assert processor.llm_tokenizer.convert_ids_to_tokens(sos) == "<|begin_of_text|>"
    assert processor.voice_generator_path is not None and os.path.isfile(processor.voice_generator_path)
    assert processor.asr_model is None  # the tiny asr_config points at the tokenizer folder, not a Whisper model
    text = processor.process_text("hello there")
    assert text.llm_token_ids.max() < config["text_config"]["vocab_size"]


# -- audio ----------------------------------------------------------------------------------------
def test_audio_features_match_golden(processor, taste_lm_tiny_a):
    io = load_file(str(taste_lm_tiny_a / "io.safetensors"))
    out = processor.process_audio(io["frontend.waveform"], 16000)
    diff = (out["audio_features"] - io["in.audio_features"]).abs().max().item()
    assert out["audio_features"].shape == (1, 300, 128) and diff <= 1e-4, diff
    assert torch.equal(out["audio_feature_lengths"], io["in.audio_feature_lengths"])
    assert out["audio_feature_lengths"].dtype == torch.int32


@pytest.mark.parametrize("rate", [48000, 44100, 8000])
def test_audio_any_rate_and_stereo(processor, rate):
    wav16 = speechlike(1.0)
    native = resample(wav16, 16000, rate)
    stereo = np.stack([native, native])
    out = processor.process_audio(stereo, rate)
    assert out["audio_features"].shape == (1, 300, 128)
    assert abs(int(out["audio_feature_lengths"]) - 100) <= 1
    reference = processor.audio_features(wav16, 16000)
    # the band below 4 kHz survives any of these rates: the low mel bins agree closely
    low = slice(0, 60)
    assert (out["audio_features"][0, 5:95, low] - reference[0, 5:95, low]).abs().mean() < 0.05


@pytest.mark.parametrize("audio, rate, match", [
    (np.zeros(0, np.float32), 16000, "empty"),
    (np.full(1600, np.nan, np.float32), 16000, "NaN"),
    (np.full(1600, np.inf, np.float32), 16000, "NaN or infinite"),
    (np.zeros(16000 * 4, np.float32), 16000, "split the turn"),
    (np.zeros(48000 * 4, np.float32), 48000, "split the turn"),
    (np.zeros(1600, np.float32), None, "sampling_rate is required"),
    (np.zeros(1600, np.float32), 0, "positive integer"),
    (np.zeros(1600, np.float32), 16000.0, "positive integer"),
])
def test_audio_errors(processor, audio, rate, match):
    with pytest.raises(ValueError, match=match):
        processor.process_audio(audio, rate)


# -- text -----------------------------------------------------------------------------------------
def encode(tokenizer, word):
    return tokenizer.encode(word, add_special_tokens=False)


def test_process_text_rules(processor):
    text = processor.process_text("The cat sat on the mat.")
    assert isinstance(text, TextInputs)
    assert text.words == [" The", " cat", " sat", " on", " the", " mat."]
    llm, asr = processor.llm_tokenizer, processor.asr_tokenizer
    expected_llm = [i for w in text.words for i in encode(llm, w)]
    expected_asr = [i for w in text.words for i in encode(asr, w)]
    assert text.llm_token_ids.tolist() == [expected_llm]
    assert text.asr_token_ids.tolist() == [expected_asr]
    assert text.llm_word_ids.tolist() == [[k for k, w in enumerate(text.words) for _ in encode(llm, w)]]
    assert text.asr_word_ids.tolist() == [[k for k, w in enumerate(text.words) for _ in encode(asr, w)]]
    assert text.llm_token_ids.dtype == torch.int64 and text.asr_token_ids.dtype == torch.int64
    assert text.llm_word_ids.dtype == torch.int32 and text.asr_word_ids.dtype == torch.int32
    assert text.llm_token_ids.shape[0] == 1 and text.asr_token_ids.shape[0] == 1
    bos = llm.convert_tokens_to_ids("<|begin_of_text|>")
    assert bos not in text.llm_token_ids[0].tolist()  # no special tokens
    # every word's first Llama piece carries the leading space (what the sampler relies on)
    first_pieces = [llm.decode([encode(llm, w)[0]]) for w in text.words]
    assert all(p.startswith(" ") for p in first_pieces)
    # reads like the original's dict
    as_dict = dict(text)
    assert set(as_dict) == {"asr_token_ids", "asr_token_lengths", "asr_word_ids",
                            "llm_token_ids", "llm_token_lengths", "llm_word_ids"}
    assert as_dict["llm_token_lengths"].tolist() == [text.llm_token_ids.shape[1]]
    assert as_dict["asr_token_lengths"].dtype == torch.int32
    assert text.text == " The cat sat on the mat."


def test_words_are_encoded_in_one_batch_as_each_alone(processor):
    """The batched encoding gives every word the ids it gets on its own, in both tokenizers - special
    tokens' text, punctuation, digits, non-ASCII and unknown characters included."""
    from taste_speech.processing_taste import _encode_each

    words = [" The", " cat's", " <|eot_id|>", " <|endoftext|>", " 1984,", " naïve", " 日本", " ok...", " a"]
    def alone(tokenizer, word):  # (a special token's text stays text)
        return tokenizer.encode(word, add_special_tokens=False, split_special_tokens=True)

    for tokenizer in (processor.llm_tokenizer, processor.asr_tokenizer):
        assert _encode_each(tokenizer, words) == [alone(tokenizer, w) for w in words]
    text = processor.encode_words(words)
    assert text.llm_token_ids[0].tolist() == [i for w in words for i in alone(processor.llm_tokenizer, w)]
    assert text.asr_token_ids[0].tolist() == [i for w in words for i in alone(processor.asr_tokenizer, w)]


def test_process_text_whitespace_follows_the_original(processor):
    """Upstream (spec §2.2, §11.29): whitespace -> space, strip, split on EVERY single space; a
    double space therefore yields a word that is a lone space, which gets its own tokens."""
    text = processor.process_text("  hello\tworld\n again  ")
    assert text.words == [" hello", " world", " ", " again"]
    assert processor.process_text("a   b").words == [" a", " ", " ", " b"]  # n spaces -> n - 1 lone spaces
    space_ids = encode(processor.llm_tokenizer, " ")
    assert len(space_ids) >= 1
    assert text.llm_word_ids[0].tolist().count(2) == len(space_ids)
    assert sorted(set(text.llm_word_ids[0].tolist())) == [0, 1, 2, 3]  # contiguous word ids
    assert sorted(set(text.asr_word_ids[0].tolist())) == [0, 1, 2, 3]  # same words in both streams
    # unicode whitespace counts too
    assert processor.process_text("a\u00a0b").words == [" a", " b"]


def test_process_text_words_and_errors(processor):
    given = processor.process_text(words=[" good", " morning"])
    assert given.words == [" good", " morning"]
    assert torch.equal(given.llm_token_ids, processor.process_text("good morning").llm_token_ids)
    for bad in ["", "   \n\t "]:
        with pytest.raises(ValueError, match="no words"):
            processor.process_text(bad)
    with pytest.raises(ValueError, match="text"):
        processor.process_text()
    with pytest.raises(ValueError, match="string"):
        processor.process_text(42)
    with pytest.raises(ValueError, match="non-empty strings"):
        processor.process_text(words=[" ok", ""])
    for glued in (["hello", " there"], [" good morning"], [" ok", " a\tb"]):  # one word each after one space
        with pytest.raises(ValueError, match="one word after one space"):
            processor.process_text(words=glued)
    with pytest.raises(ValueError, match="not both"):
        processor.process_text("good morning", words=[" good", " morning"])
    assert processor.process_text("a  b").words == [" a", " ", " b"]  # the original's lone-space word passes


def test_words_from_llm_ids_and_align(processor):
    sentence = "we walked along the river today"
    text = processor.process_text(sentence)
    groups = processor.words_from_llm_ids(text.llm_token_ids)
    assert len(groups) == len(text.words)
    assert [processor.llm_tokenizer.decode(g) for g in groups] == text.words
    aligned = processor.align_llm_ids(text.llm_token_ids)
    for key in ("llm_token_ids", "llm_word_ids", "asr_token_ids", "asr_word_ids"):
        assert torch.equal(aligned[key], text[key]), key
    # with the sampler's word ids the grouping comes from them, not from the pieces
    merged = torch.zeros_like(text.llm_word_ids)  # pretend it is all one word
    assert len(processor.words_from_llm_ids(text.llm_token_ids, merged)) == 1
    one = processor.align_llm_ids(text.llm_token_ids, merged)
    assert one.words == [" " + "".join(text.words).strip()]
    assert set(one.asr_word_ids[0].tolist()) == {0}


def test_align_first_token_without_space_and_specials(processor, tokenizers):
    llm, asr = processor.llm_tokenizer, processor.asr_tokenizer
    # the first generated token starts a word even without its leading space (spec §11.4)
    ids = encode(llm, "kopa") + encode(llm, " the") + [tokenizers.reserved(50)] + encode(llm, " end")
    aligned = processor.align_llm_ids(torch.tensor([ids]))
    assert aligned.words[:2] == [" kopa", " the"]
    assert aligned.words[2] == " <|reserved_special_token_50|>"  # a special token is a word of its own
    assert aligned.asr_token_ids[0, : len(encode(asr, " kopa"))].tolist() == encode(asr, " kopa")
    assert aligned.llm_token_ids[0].tolist() == ids


def test_align_errors(processor):
    with pytest.raises(ValueError, match="no words"):
        processor.align_llm_ids(torch.tensor([encode(processor.llm_tokenizer, " ")]))
    with pytest.raises(ValueError, match="no words"):
        processor.align_llm_ids(torch.zeros(1, 0, dtype=torch.long))
    ids = torch.tensor([encode(processor.llm_tokenizer, " good morning")])
    with pytest.raises(ValueError, match="one per id"):
        processor.words_from_llm_ids(ids, torch.zeros(1, ids.shape[1] + 1, dtype=torch.int32))


# -- everything at once ------------------------------------------------------------------------------
def test_call_returns_the_model_inputs(processor, speaker_weight):
    wav = speechlike(2.0)
    out = processor(wav, 16000, text="hello there how are you", reference_audio=[wav])
    assert out["audio_features"].shape == (1, 300, 128)
    assert out["audio_feature_lengths"].tolist() == [200]
    text = processor.process_text("hello there how are you")
    for key in text:
        assert torch.equal(out[key], text[key]), key
    expected = expected_speaker_vector(speaker_weight, [wav])
    assert out["speaker_embeds"].shape == (1, SPEAKER_DIM) and out["speaker_embeds"].dtype == torch.float32
    assert np.abs(out["speaker_embeds"][0].numpy() - expected).max() < 1e-5
    assert "speaker_embeds" not in processor(wav, 16000, text="hello")


def test_call_checks_the_asr_token_budget(processor):
    wav = speechlike(1.0)
    too_many = " ".join(["photosynthesis"] * 20)  # far more than 59 ASR tokens
    with pytest.raises(ValueError, match="split the utterance"):
        processor(wav, 16000, text=too_many)


# -- speaker embedding -------------------------------------------------------------------------------
def test_speaker_embedding_averages_clips_at_any_rate(processor, speaker_weight):
    a, b = speechlike(1.5, seed=1, f0=110), speechlike(2.0, seed=2, f0=220)
    expected = expected_speaker_vector(speaker_weight, [a, b])
    both = processor.speaker_embedding([a, b], 16000)
    assert both.shape == (1, SPEAKER_DIM)
    assert np.abs(both[0].numpy() - expected).max() < 1e-5
    assert abs(float(both.norm()) - 1.0) < 1e-6
    single = processor.speaker_embedding(torch.from_numpy(a), 16000)  # one clip, torch
    assert np.abs(single[0].numpy() - expected_speaker_vector(speaker_weight, [a])).max() < 1e-5
    # 48 kHz stereo reference: resampled and mixed down before the fbank
    up = resample(a, 16000, 48000)
    stereo = processor.speaker_embedding([np.stack([up, up])], 48000)
    via16k = expected_speaker_vector(speaker_weight, [resample(up, 48000, 16000)])
    assert np.abs(stereo[0].numpy() - via16k).max() < 1e-5
    assert float(torch.nn.functional.cosine_similarity(stereo, single)) > 0.99


def test_speaker_embedding_errors(processor, checkpoint_dir, tmp_path):
    with pytest.raises(ValueError, match="at least one clip"):
        processor.speaker_embedding([], 16000)
    with pytest.raises(ValueError, match="the reference clip is 0.01 s long"):
        processor.speaker_embedding([np.zeros(100, np.float32)], 16000)
    with pytest.raises(ValueError, match="NaN"):
        processor.speaker_embedding([np.full(16000, np.nan, np.float32)], 16000)
    with pytest.raises(ValueError, match="sampling_rate"):
        processor.speaker_embedding([speechlike(1.0)], None)
    bare = tmp_path / "bare"
    shutil.copytree(checkpoint_dir, bare)
    os.remove(bare / "cosyvoice" / "speaker_embed.onnx")
    without = TasteProcessor.from_pretrained(str(bare))
    assert without.speaker_model_path is None
    with pytest.raises(ValueError, match="speaker_embed.onnx"):
        without.speaker_embedding([speechlike(1.0)], 16000)
    with pytest.raises(ValueError, match="neither a default voice .* nor a speaker encoder"):
        without.default_speaker_embedding()
    np.save(bare / "cosyvoice" / "default_speaker.npy", np.full(SPEAKER_DIM, 2.0, np.float32))
    assert processor.default_speaker_path is None and processor.speaker_model_path is not None
    voice = TasteProcessor.from_pretrained(str(bare)).default_speaker_embedding()
    assert voice.shape == (1, SPEAKER_DIM) and abs(float(voice.norm()) - 1.0) < 1e-6


def test_default_voice_without_a_default_speaker_file(processor, speaker_weight):
    """The published layout: a speaker encoder, no default voice. The placeholder reference
    recording goes through the checkpoint's own encoder, once."""
    wav, rate = _read_default_voice()
    assert rate == 16000 and 3.0 < len(wav) / rate < 15.0 and 0.3 < np.abs(wav).max() <= 1.0
    voice = processor.default_speaker_embedding()
    expected = expected_speaker_vector(speaker_weight, [wav])
    assert voice.shape == (1, SPEAKER_DIM) and np.abs(voice[0].numpy() - expected).max() < 1e-4
    voice[0, 0] = 9.0  # callers get a copy of the cached vector
    assert float(processor.default_speaker_embedding()[0, 0]) != 9.0
    assert os.path.isfile(DEFAULT_VOICE_WAV)


def test_speaker_embedding_with_a_torch_exported_model(processor, tmp_path):
    """When the `onnx` package is available, a torch.onnx-exported conv model works too."""
    pytest.importorskip("onnx")

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv1d(80, SPEAKER_DIM, 3, padding=1)

        def forward(self, feats):
            return torch.tanh(self.conv(feats.transpose(1, 2))).mean(dim=2)

    torch.manual_seed(0)
    model = Tiny().eval()
    path = tmp_path / "speaker.onnx"
    torch.onnx.export(model, (torch.randn(1, 50, 80),), str(path), input_names=["x"],
                      dynamic_axes={"x": {1: "T"}}, dynamo=False)
    exported = TasteProcessor(processor.llm_tokenizer, processor.asr_tokenizer, speaker_model_path=str(path))
    wav = speechlike(1.0)
    with torch.no_grad():
        feats = torch.from_numpy(mean_normalise(kaldi_fbank(wav)))[None]
        expected = torch.nn.functional.normalize(model(feats), dim=-1)
    assert (exported.speaker_embedding(wav, 16000) - expected).abs().max() < 1e-5


# -- ASR --------------------------------------------------------------------------------------------
class FakeWhisperPipeline:
    """Stands in for transformers' ASR pipeline (no Whisper weights can be downloaded here)."""

    def __init__(self, text):
        self.text = text
        self.calls = []

    def __call__(self, inputs, **kwargs):
        self.calls.append((inputs, kwargs))
        return {"text": self.text}


def test_call_without_text_transcribes(checkpoint_dir):
    processor = TasteProcessor.from_pretrained(str(checkpoint_dir))
    fake = FakeWhisperPipeline(" Hello there,  friend.")
    processor._asr_pipeline = fake
    wav48 = resample(speechlike(1.0), 16000, 48000)
    out = processor(wav48, 48000)
    assert torch.equal(out["llm_token_ids"], processor.process_text(" Hello there,  friend.").llm_token_ids)
    (inputs, _), = fake.calls
    assert inputs["sampling_rate"] == 16000 and inputs["raw"].shape == (16000,)  # resampled before the ASR
    processor._asr_pipeline = FakeWhisperPipeline("   ")
    with pytest.raises(ValueError, match="no words"):
        processor(speechlike(1.0), 16000)


@pytest.mark.slow
def test_transcribe_with_a_local_whisper_model(tokenizers, tmp_path):
    """The real transformers pipeline on a tiny random Whisper folder (any local Whisper works)."""
    from transformers import (
        AutoTokenizer,
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
    )

    eot = tokenizers.asr_end_of_text_id
    config = WhisperConfig(
        vocab_size=tokenizers.asr_vocab_size, num_mel_bins=80, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_target_positions=32, decoder_start_token_id=eot, eos_token_id=eot, pad_token_id=eot, bos_token_id=eot,
        suppress_tokens=[], begin_suppress_tokens=[eot],
    )
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(decoder_start_token_id=eot, eos_token_id=eot, pad_token_id=eot,
                                               max_new_tokens=6, no_timestamps_token_id=eot - 1,
                                               begin_suppress_tokens=[eot])
    folder = tmp_path / "whisper"
    model.save_pretrained(folder)
    WhisperFeatureExtractor(feature_size=80).save_pretrained(folder)
    shutil.copytree(tokenizers.asr_dir, folder, dirs_exist_ok=True)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    tok_config["tokenizer_class"] = "WhisperTokenizer"  # the pipeline decodes with Whisper's tokenizer class
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))

    llm = AutoTokenizer.from_pretrained(tokenizers.llm_dir)
    asr = AutoTokenizer.from_pretrained(tokenizers.asr_dir)
    processor = TasteProcessor(llm, asr, num_frames=3000, asr_model=str(folder))
    wav = speechlike(1.0)
    transcript = processor.transcribe(wav, 16000)
    assert isinstance(transcript, str) and transcript.strip()
    out = processor(wav, 16000)  # no text: transcribed by the same (deterministic) model
    assert torch.equal(out["asr_token_ids"], processor.process_text(transcript).asr_token_ids)


def test_asr_errors(processor, tiny_checkpoint, tmp_path):
    none = TasteProcessor(processor.llm_tokenizer, processor.asr_tokenizer, num_frames=300)
    with pytest.raises(ValueError, match=r"give the transcript \(processor\(audio, sampling_rate, text=...\)"):
        none(speechlike(1.0), 16000)
    unfinished = tmp_path / "asr_tokenizer"  # (an interrupted download: the folder, not its tokenizer)
    unfinished.mkdir()
    (unfinished / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="has no tokenizer.json .an interrupted download"):
        TasteProcessor.from_pretrained(str(tiny_checkpoint), asr_tokenizer=str(unfinished))
    missing = TasteProcessor(processor.llm_tokenizer, processor.asr_tokenizer, num_frames=300,
                             asr_model=str(tmp_path / "no-such-whisper"))
    with pytest.raises(ValueError, match="could not load the ASR model"):
        missing.transcribe(speechlike(1.0), 16000)


# -- tiny tokenizers -------------------------------------------------------------------------------
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, how are you doing today? I'm fine, thanks!",
    "We met at 7:30 in the morning and talked about 42 different things.",
    "She said: \"don't worry, it's going to be okay\" and smiled.",
    "Photosynthesis converts light energy into chemical energy.",
]


def test_tiny_tokenizers_round_trip_and_word_starts(tokenizers):
    from transformers import AutoTokenizer

    for folder in (tokenizers.llm_dir, tokenizers.asr_dir):
        tok = AutoTokenizer.from_pretrained(folder)
        assert json.load(open(os.path.join(folder, "tokenizer_config.json")))["tokenizer_class"] == "PreTrainedTokenizerFast"
        for sentence in SENTENCES:
            ids = tok.encode(sentence, add_special_tokens=False)
            assert tok.decode(ids) == sentence
            assert max(ids) < len(tok)
            for word in sentence.split(" "):
                pieces = tok.encode(" " + word, add_special_tokens=False)
                assert pieces and tok.decode(pieces[:1]).startswith(" ")  # the leading-space marker
                assert tok.convert_ids_to_tokens(pieces[0]).startswith("Ġ")
        assert len(tok.encode(" the", add_special_tokens=False)) == 1  # common words are whole pieces


def test_tiny_tokenizers_special_ids(tokenizers):
    from transformers import AutoTokenizer

    llm = AutoTokenizer.from_pretrained(tokenizers.llm_dir)
    names = llama3_special_tokens(55)
    assert len(names) == 63 and names[4] == "<|finetune_right_pad_id|>" and names[-1] == "<|reserved_special_token_54|>"
    assert tokenizers.llm_vocab_size == len(llm) == 1024
    first = 1024 - len(names)
    assert [llm.convert_tokens_to_ids(n) for n in names] == list(range(first, 1024))  # the LAST ids
    assert tokenizers.sos_id == first == llm.bos_token_id
    assert tokenizers.end_of_text_id == first + 1 == llm.eos_token_id
    # Llama-3.1/3.2 numbering relative to begin_of_text: reserved_k at +8+k for k >= 3
    assert [tokenizers.reserved(k) - tokenizers.sos_id for k in (0, 1, 2, 3, 50, 54)] == [2, 3, 5, 11, 58, 62]
    assert tokenizers["reserved_50_54"] == list(range(1019, 1024))
    assert tokenizers["sos_id"] == tokenizers.sos_id
    assert llm.encode("hi", add_special_tokens=True)[0] == tokenizers.sos_id  # BOS like Llama-3
    added = llm.added_tokens_decoder
    assert all(added[i].special for i in range(first, 1024))
    assert llm.decode([tokenizers.reserved(50)]) == "<|reserved_special_token_50|>"
    asr = AutoTokenizer.from_pretrained(tokenizers.asr_dir)
    assert len(asr) == tokenizers.asr_vocab_size == 512
    assert asr.convert_tokens_to_ids("<|endoftext|>") == tokenizers.asr_end_of_text_id == 511 == asr.eos_token_id


def test_tiny_tokenizers_are_deterministic(tmp_path, tokenizers):
    again = build_tiny_tokenizers(str(tmp_path / "again"), llm_vocab_size=1024, asr_vocab_size=512)
    for a, b in ((tokenizers.llm_dir, again.llm_dir), (tokenizers.asr_dir, again.asr_dir)):
        assert open(os.path.join(a, "tokenizer.json"), "rb").read() == open(os.path.join(b, "tokenizer.json"), "rb").read()
    other = build_tiny_tokenizers(str(tmp_path / "seed1"), llm_vocab_size=1024, asr_vocab_size=512, seed=1)
    vocab = json.load(open(os.path.join(tokenizers.llm_dir, "tokenizer.json")))["model"]["vocab"]
    vocab1 = json.load(open(os.path.join(other.llm_dir, "tokenizer.json")))["model"]["vocab"]
    assert vocab != vocab1 and other.sos_id == tokenizers.sos_id


def test_tiny_tokenizers_sizes(tmp_path):
    small = build_tiny_tokenizers(str(tmp_path / "small"), llm_vocab_size=400, asr_vocab_size=300)
    assert small.llm_vocab_size == 400 and small.asr_vocab_size == 300 and small.sos_id == 400 - 63
    for kwargs in (dict(llm_vocab_size=300), dict(asr_vocab_size=200), dict(llm_vocab_size=100000),
                   dict(llm_vocab_size=1024.0)):
        with pytest.raises(ValueError, match="vocab_size"):
            build_tiny_tokenizers(str(tmp_path / "bad"), **kwargs)


def test_a_saved_model_and_its_processor_make_a_checkpoint_that_loads_again(tiny_checkpoint, tmp_path):
    """model.save_pretrained writes the config and weights only: with processor.save_pretrained in
    the same folder (a model with its LoRA merged, say), it loads as the checkpoint it came from."""
    from taste_speech.modeling_taste import TasteForCausalLM

    model = TasteForCausalLM.from_pretrained(str(tiny_checkpoint), torch_dtype=torch.float32)
    processor = TasteProcessor.from_pretrained(str(tiny_checkpoint))
    model.spoken_lm.merge_lora()
    saved = tmp_path / "merged"
    model.save_pretrained(saved)
    with pytest.raises(ValueError, match=r"processor.save_pretrained\(DIR\)"):  # the weights alone: said what to do
        TasteProcessor.from_pretrained(str(saved))
    assert processor.save_pretrained(saved) == str(saved)
    again = TasteProcessor.from_pretrained(str(saved))
    text = " we met at seven and talked about the garden"
    assert torch.equal(again.process_text(text).llm_token_ids, processor.process_text(text).llm_token_ids)
    assert torch.equal(again.process_text(text).asr_token_ids, processor.process_text(text).asr_token_ids)
    for name in ("speaker_embed.onnx", "voice_generator.pth", "voice_generator_config.json"):
        assert (saved / "cosyvoice" / name).read_bytes() == (tiny_checkpoint / "cosyvoice" / name).read_bytes()
    speech = torch.randn(1, 16000, generator=torch.Generator().manual_seed(0)) * 0.1
    assert torch.allclose(again.speaker_embedding(speech, 16000), processor.speaker_embedding(speech, 16000))
    assert again.get_generator() is not None
    TasteForCausalLM.from_pretrained(str(saved), torch_dtype=torch.float32)  # (its weights: test_checkpoint.py)
    own = shutil.copytree(tiny_checkpoint, tmp_path / "own")
    TasteProcessor.from_pretrained(str(own)).save_pretrained(own)  # into the folder it came from: no harm
    assert TasteProcessor.from_pretrained(str(own)).get_generator() is not None
    assert (own / "cosyvoice" / "voice_generator.pth").read_bytes() == (saved / "cosyvoice" / "voice_generator.pth").read_bytes()
