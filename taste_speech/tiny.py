"""Tiny random TASTE checkpoints in the published layout.

``python -m taste_speech.tiny DIR --seed N`` writes::

    DIR/config.json                  TasteConfig (model_type taste), tiny sizes, all architectural features
    DIR/whisper_joint/config.json    the audio tower's Whisper architecture (referenced relatively)
    DIR/model.safetensors            random weights, every published tensor name (tied lm_head dropped)
    DIR/llama_tokenizer/             small Llama-3-style BPE tokenizer with the Llama-3 special tokens
    DIR/asr_tokenizer/               small Whisper-style BPE tokenizer
    DIR/cosyvoice/voice_generator.pth (+ voice_generator_config.json)   tiny flow + HiFT
    DIR/cosyvoice/default_speaker.npy                                     a default voice (unit vector)

Everything loads offline with ``TasteForCausalLM.from_pretrained(DIR)``,
``TasteProcessor.from_pretrained(DIR)`` and ``VoiceGenerator.from_pretrained(DIR)``; the same
seed gives the same bytes. ``default_tiny_checkpoint()`` builds the embedded default once, under
the user cache (``$PIPECAT_TASTE_CACHE`` or ``~/.cache/pipecat-taste``), atomically.

Weights follow the golden sets' initialisation (N(0, 1/fan_in) projections, unit-ish norms,
codebooks with shrinking residual scales, non-zero LoRA) so every path carries signal; the speech
decoder's EOS logit is raised so that utterances end a little after their minimum length.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile

import numpy as np
import torch
from safetensors.torch import save_file

SEED_DEFAULT = 0
EOS_BIAS = 5.0
TINY_WHISPER = dict(
    d_model=64, encoder_layers=8, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=128, vocab_size=51866,
    max_source_positions=500, max_target_positions=128, activation_function="gelu", scale_embedding=False,
    model_type="whisper",
)


def tiny_config(special_ids: dict, llm_vocab: int = 1024, asr_vocab: int = 512):
    from taste_speech.configuration_taste import TasteConfig

    return TasteConfig(
        audio_tower_config=dict(
            kwargs_for_joint_encoder_segmenter=dict(model_name_or_path="whisper_joint", dtype="bfloat16",
                                                    forward_type="asr_attn_pooling", is_word_level=True,
                                                    make_v_proj_identity=True, skip_prefix_idx=4, use_custom=True),
            kwargs_for_quantizer=dict(dim=64, num_quantizers=4, codebook_size=64, codebook_dim=16, decay=0.99,
                                      kmeans_init=True, kmeans_iters=100, quantize_dropout=True),
        ),
        spoken_lm_config=dict(sos_id=special_ids["sos_id"], kwargs_for_lora=dict(lora_r=4, lora_alpha=8, lora_dropout=0.05,
                                                                                   lora_target_linear=True)),
        speech_decoder_config=dict(
            encoder_input_size=48, llm_input_size=64, llm_output_size=64, speech_token_size=256, spk_embed_dim=32,
            text_token_size=max(asr_vocab, 512), audio_encoder_input_size=64,
            encoder__num_blocks=2, encoder__attention_heads=4, encoder__linear_units=96,
            llm__num_blocks=2, llm__attention_heads=4, llm__linear_units=128,
        ),
        text_config=dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=llm_vocab, tie_word_embeddings=True, max_position_embeddings=131072,
            rope_theta=500000.0, rms_norm_eps=1e-5,
            rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                              original_max_position_embeddings=8192, rope_type="llama3"),
            bos_token_id=special_ids["sos_id"], eos_token_id=special_ids["end_of_text_id"],
        ),
        asr_config=dict(TINY_WHISPER, _name_or_path="asr_tokenizer"),
        architectures=["TasteForCausalLM"],
    )


@torch.no_grad()
def randomise(model, seed: int) -> None:
    """Deterministic, signal-carrying random weights (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, std):
        return torch.randn(shape, generator=gen) * std

    for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if param.device.type == "meta":
            continue
        shape = param.shape
        if "rvq" in name and "mlps" in name:
            value = normal(shape, 0.02)
        elif name.endswith("embed_positions.weight") and "encoder" in name:
            value = _sinusoids(*shape)
        elif name.endswith("embed_positions.weight"):
            value = normal(shape, 0.3)
        elif "lora_B" in name:
            value = normal(shape, 0.5 / math.sqrt(shape[1]))
        elif "lora_A" in name or param.dim() >= 2 and "embed" not in name and "embedding" not in name:
            value = normal(shape, 1.0 / math.sqrt(shape[-1] if param.dim() == 2 else shape[1] * shape[2]))
        elif "embed" in name or "embedding" in name:
            value = normal(shape, 1.0 if param.dim() == 2 else 0.5)
        elif name.endswith("fuse_for_bridge_in_llm.weights") or name.endswith("fuse_encoded_audio_text_module.weights"):
            value = normal(shape, 0.5)
        elif name.endswith("b_logvar") or "pos_bias" in name:
            value = normal(shape, 0.1)
        elif name.endswith("bias"):
            value = normal(shape, 0.05)
        else:  # norm weights
            value = 1.0 + normal(shape, 0.1)
        param.copy_(value.to(param.dtype))
    rvq = model.rvq
    for level, layer in enumerate(rvq.layers):
        book = layer["_codebook"]
        embed = normal(book.embed.shape, 0.6 ** level)
        book.embed.copy_(embed)
        book.embed_avg.copy_(embed)
        book.cluster_size.fill_(1.0)
        book.initted.fill_(1.0)
    eos = model.speech_decoder.eos_id
    model.speech_decoder.llm_decoder.weight[eos].zero_()
    model.speech_decoder.llm_decoder.bias[eos] = EOS_BIAS


def _sinusoids(length: int, channels: int) -> torch.Tensor:
    log_timescale = math.log(10000) / (channels // 2 - 1)
    inv = torch.exp(-log_timescale * torch.arange(channels // 2))
    scaled = torch.arange(length)[:, None] * inv[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


def build_tiny_checkpoint(directory: str, seed: int = SEED_DEFAULT) -> str:
    from taste_speech.modeling_taste import LM_HEAD_KEY, TasteForCausalLM
    from taste_speech.tiny_tokenizers import build_tiny_tokenizers
    from taste_speech.voice_generator import write_tiny_voice_generator

    os.makedirs(directory, exist_ok=True)
    special = build_tiny_tokenizers(directory, llm_vocab_size=1024, asr_vocab_size=512)
    config = tiny_config(special)
    os.makedirs(os.path.join(directory, "whisper_joint"), exist_ok=True)
    with open(os.path.join(directory, "whisper_joint", "config.json"), "w") as f:
        json.dump(TINY_WHISPER, f, indent=1)
    config.save_pretrained(directory)
    from taste_speech.configuration_taste import TasteConfig

    config = TasteConfig.from_pretrained(directory)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TasteForCausalLM(config)
    randomise(model, seed)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != LM_HEAD_KEY}
    save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    sd = config.speech_decoder_config
    write_tiny_voice_generator(directory, seed, vocab_size=sd.speech_token_size, spk_embed_dim=sd.spk_embed_dim)
    voice = torch.randn(sd.spk_embed_dim, generator=torch.Generator().manual_seed(seed + 7))
    np.save(os.path.join(directory, "cosyvoice", "default_speaker.npy"), (voice / voice.norm()).numpy())
    return directory


def default_tiny_checkpoint(seed: int = SEED_DEFAULT) -> str:
    """Path of the embedded default tiny checkpoint, built on first use (atomically)."""
    root = os.environ.get("PIPECAT_TASTE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pipecat-taste"))
    target = os.path.join(root, f"tiny-seed{seed}-v1")
    if os.path.exists(os.path.join(target, "model.safetensors")):
        return target
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=root)
    try:
        build_tiny_checkpoint(tmp, seed)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Write a random tiny TASTE checkpoint in the published layout.")
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=SEED_DEFAULT)
    args = parser.parse_args(argv)
    build_tiny_checkpoint(args.directory, args.seed)
    print(f"wrote tiny TASTE checkpoint (seed {args.seed}) to {args.directory}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
