"""The tiny-checkpoint builder: layout, determinism, initialisation, offline loading and a whole
simulated call (audio -> TASTE -> continuation -> speech tokens -> waveform) that always ends."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from taste_speech import tiny
from taste_speech.configuration_taste import TasteConfig
from taste_speech.loading import EMBED_KEY, LM_HEAD_KEY
from taste_speech.modeling_taste import TasteForCausalLM

LAYOUT = [
    "config.json", "model.safetensors", "whisper_joint/config.json",
    "llama_tokenizer/tokenizer.json", "asr_tokenizer/tokenizer.json",
    "cosyvoice/voice_generator.pth", "cosyvoice/voice_generator_config.json", "cosyvoice/speaker_embed.onnx",
]


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    from taste_speech.processing_taste import TasteProcessor

    model, info = TasteForCausalLM.from_pretrained(tiny_checkpoint, output_loading_info=True)
    return model, info, TasteProcessor.from_pretrained(tiny_checkpoint)


def test_published_layout(tiny_checkpoint):
    for rel in LAYOUT:
        assert (tiny_checkpoint / rel).is_file(), rel
    raw = json.loads((tiny_checkpoint / "config.json").read_text())
    assert raw["model_type"] == "taste" and raw["architectures"] == ["TasteForCausalLM"]
    assert raw["audio_tower_config"]["kwargs_for_joint_encoder_segmenter"]["model_name_or_path"] == "whisper_joint"
    for sub in ("audio_tower_config", "spoken_lm_config", "speech_decoder_config", "text_config", "asr_config"):
        assert isinstance(raw[sub], dict)  # sub-configs as plain dicts, like the published file
    assert LM_HEAD_KEY not in load_file(str(tiny_checkpoint / "model.safetensors"))


def test_every_architectural_feature_at_tiny_size(tiny_checkpoint):
    config = TasteConfig.from_pretrained(tiny_checkpoint)
    whisper = config.joint_whisper_config
    assert whisper.d_model == 64 and whisper.decoder_layers == 2 and whisper.encoder_layers > 6  # layer-6 tap
    assert whisper.vocab_size == 51866  # the Whisper prompt / eot ids are hard-coded
    quant = config.audio_tower_config
    assert quant.num_quantizers == 4 and quant.vq_dim == 64
    lm = config.spoken_lm_config
    assert lm.use_lora and lm.delay == 1 and lm.in_llm_module == "weighted_sum"
    assert lm.out_llm_module == "continue_latent_linear_last" and lm.audio_embed_conv_mode == "fill_forward"
    text = config.text_config
    assert text.tie_word_embeddings and text.num_key_value_heads < text.num_attention_heads  # GQA
    rope = getattr(text, "rope_parameters", None) or text.rope_scaling
    assert rope["rope_type"] == "llama3"
    sd = config.speech_decoder_config
    assert sd.speech_token_size == 4096 and sd.spk_embed_dim == 192  # the published interfaces
    assert sd.encoder__static_chunk_size == 1 and sd.llm__static_chunk_size == 1


def test_loads_offline_with_model_and_processor(loaded, tiny_checkpoint):
    model, info, processor = loaded
    assert info.missing_keys == [] and info.unexpected_keys == [] and info.tied_lm_head
    assert model.spoken_lm.causal_lm.lm_head.weight is model.spoken_lm.embed_tokens.weight
    sos = processor.llm_tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
    assert model.config.spoken_lm_config.sos_id == sos
    assert len(processor.llm_tokenizer) <= model.config.text_config.vocab_size
    assert len(processor.asr_tokenizer) <= model.config.speech_decoder_config.text_token_size
    for k in range(50, 55):  # the conversation markers of the streaming format exist
        token = f"<|reserved_special_token_{k}|>"
        assert processor.llm_tokenizer.convert_tokens_to_ids(token) < model.config.text_config.vocab_size


def test_initialisation_follows_the_golden_recipe(tiny_checkpoint):
    state = load_file(str(tiny_checkpoint / "model.safetensors"))
    for level in range(4):
        prefix = f"audio_tower.vq.rvq.layers.{level}._codebook."
        assert torch.equal(state[prefix + "initted"], torch.ones(1))
        assert torch.equal(state[prefix + "embed"], state[prefix + "embed_avg"])
        assert abs(float(state[prefix + "embed"].std()) - 0.6**level) < 0.1 * 0.6**level
    positions = state["audio_tower.audio_joint_encoder_segmenter.audio_encoder.encoder.embed_positions.weight"]
    assert torch.allclose(positions, tiny.whisper_sinusoids(*positions.shape))
    q = "spoken_lm.language_model.base_model.model.model.layers.0.self_attn.q_proj."
    assert abs(float(state[q + "base_layer.weight"].std()) * 8 - 1) < 0.15  # N(0, 1/fan_in), fan_in 64
    assert float(state[q + "lora_B.default.weight"].abs().sum()) > 0  # adapters carry signal
    eos = 4096
    assert float(state["speech_decoder.llm_decoder.weight"][eos].abs().sum()) == 0  # constant EOS logit
    assert 0 < float(state["speech_decoder.llm_decoder.bias"][eos]) < 10


def test_same_seed_same_bytes_other_seed_other_weights(tiny_checkpoint, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # the same bytes whatever torch's thread count (float sums differ)
    try:
        assert tiny.main([str(tmp_path / "again"), "--seed", "0"]) == 0
    finally:
        torch.set_num_threads(threads)
    first, again = _files(tiny_checkpoint), _files(tmp_path / "again")
    assert sorted(first) == sorted(again)
    assert {name for name in first if first[name] != again[name]} == set()
    tiny.build_tiny_checkpoint(str(tmp_path / "seed1"), seed=1)
    other = load_file(str(tmp_path / "seed1" / "model.safetensors"))
    base = load_file(str(tiny_checkpoint / "model.safetensors"))
    assert set(other) == set(base)
    assert not torch.equal(other[EMBED_KEY], base[EMBED_KEY])
    assert not (tiny_checkpoint / "cosyvoice" / "default_speaker.npy").exists()  # none published either
    from taste_speech.processing_taste import TasteProcessor

    voices = [TasteProcessor.from_pretrained(str(d)).default_speaker_embedding() for d in (tiny_checkpoint, tmp_path / "seed1")]
    assert voices[0].shape == (1, 192) and not torch.allclose(voices[0], voices[1], atol=1e-3)


PROMPTS = ["the birds return to the trees", "hello how are you today", "we went down to the river",
           "my mother said that it was cold"]


@pytest.mark.parametrize("top_p", [0.0, 0.3])
def test_generation_always_ends_by_the_sampler_rules(loaded, top_p):
    """Random weights never learnt to stop: the builder's vocabulary prior makes words advance, so
    every reply ends by the sampler's own rules (at the latest after 3 x extra_words words)."""
    from taste_speech.sampler import SamplingParams, TasteSampler

    model, _, processor = loaded
    extra_words = 4
    params = SamplingParams(text_top_p=top_p, text_temperature=0.5, repetition_penalty=1.1, extra_words=extra_words)
    sampler = TasteSampler.from_tokenizer(processor.llm_tokenizer, params, model.config.text_config.vocab_size)
    wav = np.random.default_rng(0).normal(0, 0.1, 16000 * 2).astype(np.float32)
    for i, prompt in enumerate(PROMPTS):
        inputs = processor(wav, 16000, text=prompt)
        _, llm_indices = model.extract_vq(**inputs)
        out = model.spoken_lm.generate(model.rvq, sampler, "audio", inputs["llm_token_ids"], llm_indices,
                                       inputs["llm_word_ids"], extra_words=extra_words, max_steps=200,
                                       generator=torch.Generator().manual_seed(i))
        assert out.end_reason in ("sentence_end", "max_words"), (prompt, out.end_reason)
        words = int(out.word_ids.max()) + 1
        assert extra_words <= words <= 3 * extra_words + 1
        assert out.word_codes().shape[0] == words  # one TASTE code per generated word


def test_a_whole_completion_produces_words_speech_tokens_and_audio(loaded, tiny_checkpoint):
    from taste_speech.voice_generator import VoiceGenerator

    model, _, processor = loaded
    voice = VoiceGenerator.from_pretrained(tiny_checkpoint)
    wav = np.random.default_rng(1).normal(0, 0.1, 16000 * 3).astype(np.float32)
    inputs = processor(wav, 16000, text="please tell me a story about the farm")
    out = model.inference_completion(processor, **inputs, extra_words=4, generator=torch.Generator().manual_seed(0))
    assert out.text_end_reason in ("sentence_end", "max_words") and out.text.startswith(" ")
    n_words = out.taste_codes.shape[1]
    assert n_words == 8 + int(out.generated_llm_word_ids.max()) + 1  # prompt + generated words, one code each
    s = out.speech_token_ids.shape[1]
    prefix = out.asr_token_ids.shape[1] + 3
    assert 2 * prefix <= s <= 20 * prefix and int(out.speech_token_ids.max()) < 4096
    audio, rate = voice.inference(out.speech_token_ids, processor.default_speaker_embedding(),
                                  generator=torch.Generator().manual_seed(0))
    assert rate == 22050 and audio.shape[1] > 0 and float(audio.pow(2).mean().sqrt()) > 0.01


def test_default_checkpoint_is_built_once_atomically(tiny_checkpoint, tmp_path, monkeypatch):
    import shutil

    calls = []

    def fake_build(directory, seed):  # copy the session's build instead of building again
        calls.append(seed)
        shutil.copytree(tiny_checkpoint, directory, dirs_exist_ok=True)
        return directory

    monkeypatch.setenv("PIPECAT_TASTE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tiny, "build_tiny_checkpoint", fake_build)
    path = Path(tiny.default_tiny_checkpoint())
    assert path.parent == tmp_path / "cache" and path.name == f"tiny-seed0-{tiny.cache_key()}"
    assert (path / "model.safetensors").is_file() and calls == [0]
    assert Path(tiny.default_tiny_checkpoint()) == path and calls == [0]  # cached: not rebuilt
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [path.name]  # no leftovers

    def failing_build(directory, seed):
        (Path(directory) / "partial").write_text("x")
        raise RuntimeError("disk full")

    monkeypatch.setattr(tiny, "build_tiny_checkpoint", failing_build)
    with pytest.raises(RuntimeError):
        tiny.default_tiny_checkpoint(seed=3)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [path.name]  # the half build is gone

    # a damaged cache (truncated weights, a deleted file) is built again, not handed out
    monkeypatch.setattr(tiny, "build_tiny_checkpoint", fake_build)
    weights = path / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    assert Path(tiny.default_tiny_checkpoint()) == path and calls == [0, 0]
    assert weights.stat().st_size == (tiny_checkpoint / "model.safetensors").stat().st_size
    (path / "cosyvoice" / "speaker_embed.onnx").unlink()
    assert Path(tiny.default_tiny_checkpoint()) == path and calls == [0, 0, 0]
    assert Path(tiny.default_tiny_checkpoint()) == path and calls == [0, 0, 0]  # intact again: cached
    assert path.stat().st_mode & 0o005 == 0o005 and weights.stat().st_mode & 0o004  # a shared cache: readable


def test_the_builder_refuses_a_file_for_its_folder(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(SystemExit) as exit_:
        tiny.main([str(afile)])
    assert exit_.value.code == 2 and "is a file: give a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # (a folder under a file cannot be made: said, not a traceback)
        tiny.main([str(afile / "under")])
    assert exit_.value.code == 2 and f"cannot create the folder {str(afile / 'under')!r}" in capsys.readouterr().err


def test_the_builder_refuses_a_folder_holding_another_checkpoint_unless_forced(tiny_checkpoint, tmp_path, capsys):
    """Building removes a folder's other weight files: a real checkpoint given by mistake stays
    whole (the builder says why and how to go on); a tiny checkpoint's folder is rebuilt."""
    real = tmp_path / "real"
    real.mkdir()
    (real / "config.json").write_text(json.dumps({"model_type": "taste", "text_config": {"hidden_size": 2048,
                                                                                        "num_hidden_layers": 16}}))
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"):
        (real / name).write_text("weights")
    before = sorted(p.name for p in real.iterdir())
    with pytest.raises(SystemExit) as exit_:
        tiny.main([str(real)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "holds files that are not a tiny checkpoint" in err and "--force" in err
    assert "model-00001-of-00002.safetensors" in err and sorted(p.name for p in real.iterdir()) == before
    (real / "model-00001-of-00002.safetensors").unlink()
    (real / "model-00002-of-00002.safetensors").unlink()
    (real / "model.safetensors.index.json").unlink()
    with pytest.raises(ValueError, match=r"config.json \(not a tiny checkpoint's\)"):  # its config alone, too
        tiny.build_tiny_checkpoint(str(real))
    tiny.check_build_folder(str(tiny_checkpoint))  # a tiny checkpoint's folder: fine to rebuild
    tiny.check_build_folder(str(tmp_path / "new"))  # (a folder not there yet)
    assert tiny.main([str(real), "--force"]) == 0 and (real / "model.safetensors").exists()
