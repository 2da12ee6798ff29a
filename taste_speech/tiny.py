"""Tiny random TASTE checkpoints in the published layout (tests, demos, CI - no download).

``python -m taste_speech.tiny DIR --seed N`` writes::

    DIR/config.json                    TasteConfig (model_type taste) with tiny sizes
    DIR/whisper_joint/config.json      the tower's Whisper architecture, referenced relatively
    DIR/model.safetensors              random weights under every published tensor name
                                       (the tied lm_head is not stored, as in the published file)
    DIR/llama_tokenizer/               small Llama-3-style BPE tokenizer with the Llama-3 special
                                       tokens, <|reserved_special_token_50..54|> included
    DIR/asr_tokenizer/                 small Whisper-style BPE tokenizer (ids < text_token_size)
    DIR/cosyvoice/voice_generator.pth  tiny flow + HiFT (+ voice_generator_config.json)
    DIR/cosyvoice/speaker_embed.onnx   a tiny stand-in for the CAMPPlus speaker encoder
                                       (taste_speech.tiny_speaker); like the published checkpoint,
                                       no default voice: the processor makes one from
                                       taste_speech/default_voice.wav

It loads offline with ``TasteForCausalLM.from_pretrained(DIR)``,
``TasteProcessor.from_pretrained(DIR)`` and ``VoiceGenerator.from_pretrained(DIR)``. The same seed
gives the same bytes (``--seed`` changes the weights, the tokenizers' training subset and the
speaker encoder). ``default_tiny_checkpoint()`` builds the embedded default (seed 0) once, under the
user cache (``$PIPECAT_TASTE_CACHE`` or ``~/.cache/pipecat-taste``), atomically.

Sizes: every architectural feature of the published model is kept - Whisper encoder with the
layer-6 value tap and a 2-layer decoder pooler over a 10 s window (1000 mel frames; the
published model takes 30 s) and the published 443-token transcript limit, 4-level RVQ,
a 2-layer Llama with GQA, llama3 RoPE scaling, tied embeddings and LoRA on all seven projections,
the weighted-sum fusion and latent TASTE head, the speech decoder with its causal rel-pos text,
audio-token and AR transformers (the audio-token encoder keeps its hard-coded 8 heads / 2048
units) - at widths of 48-64, so one LM step takes about 10-20 ms on one CPU core. The speech-token
vocabulary (4096) and speaker size (192) are the published ones, so tiny and real checkpoints
exchange the same kinds of tensors with the rest of the pipeline.

Weights (``random_state_dict``) follow the golden sets' initialisation: Linear/Conv weights
N(0, 1/fan_in), biases N(0, 0.05^2), LayerNorm/RMSNorm weights 1 + N(0, 0.1^2) (biases
N(0, 0.1^2)), embeddings N(0, 1) (Whisper encoder positions = Whisper's sinusoids, decoder
positions N(0, 0.3^2)), LoRA A N(0, 1/in) and B N(0, 0.25/r), fusion mixing weights N(0, 0.5^2),
pad_text_unit_embed N(0, 1), pad_audio_unit_embed N(0, 0.5^2), b_logvar N(0, 0.3^2), rel-pos
biases N(0, 0.1^2), RVQ codebook of level l N(0, 0.6^(2l)) with embed_avg = embed,
cluster_size = 1, initted = 1. Each tensor is drawn from its own generator (seed, tensor name),
so adding a tensor never changes the others.

Two calibrations make random weights behave like a speaking model rather than a stuck one:

* vocabulary prior: the rows of the (tied) Llama embedding are rescaled by the kind of piece they
  hold - word starts x ``EMBED_SCALE_WORD_START`` (0.35, which also softens the otherwise very
  peaked random logits), other pieces x ``EMBED_SCALE_OTHER`` (0.25), special tokens
  x ``EMBED_SCALE_SPECIAL`` (0.1, untrained in the real model too). Without it a random model
  tends to repeat one continuation piece forever: it never starts a new word, so the sampler's
  word-count end rule never fires. With it, replies end by the sampler's rules (after
  3 x extra_words words at the latest) for greedy and sampled decoding alike, and some words
  still span several pieces;
* speech end: the speech decoder's EOS logit is made a constant (zero weight row) whose bias is
  set so that top-k sampling ends an utterance after about ``SPEECH_TOKENS_AFTER_MIN`` tokens past
  its minimum length (greedy decoding may run to the maximum, 20 x the prefix length).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import tempfile

import torch
from torch import nn

SEED_DEFAULT = 0
CACHE_VERSION = "v2"  # bump when the layout changes in a way the builder sources do not show
# Sources whose content decides the bytes of a tiny checkpoint (part of the cache key).
_BUILDER_SOURCES = ("tiny.py", "tiny_tokenizers.py", "tiny_speaker.py", os.path.join("voice_generator", "tiny.py"),
                    os.path.join("voice_generator", "config.py"))
LLM_VOCAB_SIZE = 1024
LLM_HIDDEN_SIZE, LLM_LAYERS = 64, 2  # the tiny Llama's (also how a tiny checkpoint's config.json is told apart)
ASR_VOCAB_SIZE = 512
EMBED_SCALE_WORD_START = 0.35
EMBED_SCALE_OTHER = 0.25
EMBED_SCALE_SPECIAL = 0.1
SPEECH_TOKENS_AFTER_MIN = 40
SPEECH_TOP_K = 25

TINY_WHISPER = dict(
    d_model=64, encoder_layers=8, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=128, vocab_size=51866,
    max_source_positions=500, max_target_positions=448, activation_function="gelu", scale_embedding=False,
    model_type="whisper", begin_suppress_tokens=[220, 50257], bos_token_id=50257, eos_token_id=50257,
    decoder_start_token_id=50258, pad_token_id=50256,
)


def tiny_config(tokenizers, whisper: dict | None = None):
    """The TasteConfig of a tiny checkpoint: the published configuration with small sizes.

    ``tokenizers`` is what ``build_tiny_tokenizers`` returns (its special ids and vocab sizes)."""
    from taste_speech.configuration_taste import TasteConfig

    whisper = dict(TINY_WHISPER, **(whisper or {}))
    return TasteConfig(
        audio_tower_config=dict(
            is_joint_encoder_segmenter=True, quantization_on=True, audio_dropout_ratio=0.0,
            kwargs_for_joint_encoder_segmenter=dict(
                model_name_or_path="whisper_joint", dtype="bfloat16", forward_type="asr_attn_pooling",
                is_word_level=True, make_v_proj_identity=True, skip_prefix_idx=4, use_custom=True,
            ),
            kwargs_for_quantizer=dict(dim=64, num_quantizers=4, codebook_size=64, codebook_dim=16, decay=0.99,
                                      kmeans_init=True, kmeans_iters=100, quantize_dropout=True),
            encoder__target_hidden_layer=6, text_token_size=whisper["vocab_size"],
        ),
        spoken_lm_config=dict(
            sos_id=tokenizers.sos_id, delay=1, delay_level="word", audio_embed_conv_mode="fill_forward",
            in_llm_module="weighted_sum", out_llm_module="continue_latent_linear_last", use_lora=True,
            kwargs_for_lora=dict(lora_r=4, lora_alpha=8, lora_dropout=0.05, lora_target_linear=True),
            loss_weights="0.5-0.5",
        ),
        speech_decoder_config=dict(
            encoder_input_size=48, llm_input_size=64, llm_output_size=64, speech_token_size=4096, spk_embed_dim=192,
            text_token_size=tokenizers.asr_vocab_size, audio_encoder_input_size=64, skip_prefix_idx=4,
            encoder__num_blocks=2, encoder__attention_heads=4, encoder__linear_units=96,
            encoder__input_layer="linear", encoder__static_chunk_size=1,
            llm__num_blocks=2, llm__attention_heads=4, llm__linear_units=128,
            llm__input_layer="linear_legacy", llm__static_chunk_size=1,
        ),
        text_config=dict(
            model_type="llama", hidden_size=LLM_HIDDEN_SIZE, intermediate_size=128, num_hidden_layers=LLM_LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=tokenizers.llm_vocab_size, tie_word_embeddings=True,
            max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5, hidden_act="silu",
            rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                              original_max_position_embeddings=8192, rope_type="llama3"),
            bos_token_id=tokenizers.sos_id, eos_token_id=tokenizers.end_of_text_id,
        ),
        asr_config=dict(whisper, _name_or_path="asr_tokenizer"),
        architectures=["TasteForCausalLM"],
        _attn_implementation="eager",
    )


# -- random weights --------------------------------------------------------------------------------
def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def whisper_sinusoids(length: int, channels: int) -> torch.Tensor:
    """Whisper's fixed encoder position table (sin | cos halves, timescales up to 10 000)."""
    log_timescale = math.log(10000) / (channels // 2 - 1)
    inv = torch.exp(-log_timescale * torch.arange(channels // 2, dtype=torch.float32))
    scaled = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


def _std_for(key: str, module: nn.Module, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of the normal a tensor is drawn from (see the module docstring)."""
    name = key.rpartition(".")[2]
    kind = type(module).__name__
    if ".lora_A." in key:
        return 0.0, 1.0 / math.sqrt(shape[1])
    if ".lora_B." in key:
        return 0.0, math.sqrt(0.25 / shape[1])
    if isinstance(module, (nn.Linear, nn.Conv1d)):
        if name == "weight":
            return 0.0, 1.0 / math.sqrt(math.prod(shape[1:]))
        return 0.0, 0.05
    if isinstance(module, nn.Embedding):
        return 0.0, 0.3 if key.endswith("decoder.embed_positions.weight") else 1.0
    if isinstance(module, nn.LayerNorm) or kind.endswith("RMSNorm"):
        return (1.0, 0.1) if name == "weight" else (0.0, 0.1)
    table = {
        "weights": (0.0, 0.5),  # the two fusion mixing weights
        "pad_text_unit_embed": (0.0, 1.0),
        "pad_audio_unit_embed": (0.0, 0.5),
        "b_logvar": (0.0, 0.3),
        "pos_bias_u": (0.0, 0.1),
        "pos_bias_v": (0.0, 0.1),
    }
    if name in table:
        return table[name]
    raise ValueError(f"no initialisation rule for {key} ({kind}); extend taste_speech.tiny._std_for")


def random_state_dict(config, seed: int) -> dict[str, torch.Tensor]:
    """Random float32 weights for every stored tensor of the model ``config`` describes (the tied
    lm_head excluded), deterministic per (seed, tensor name)."""
    from taste_speech.loading import LM_HEAD_KEY
    from taste_speech.modeling_taste import TasteForCausalLM

    with torch.device("meta"):
        model = TasteForCausalLM(config)
    state: dict[str, torch.Tensor] = {}
    for key, slot in model.state_dict().items():
        if key == LM_HEAD_KEY:
            continue
        shape = tuple(slot.shape)
        gen = _generator(seed, key)
        if "._codebook." in key:
            state[key] = _codebook_buffer(key, shape, seed)
        elif key.endswith("encoder.embed_positions.weight"):
            state[key] = whisper_sinusoids(*shape)
        else:
            module = model.get_submodule(key.rpartition(".")[0])
            mean, std = _std_for(key, module, shape)
            state[key] = mean + std * torch.randn(shape, generator=gen)
    return state


def _codebook_buffer(key: str, shape, seed: int) -> torch.Tensor:
    """RVQ level l: codes N(0, 0.6^(2l)); EMA state consistent with them; initted = 1."""
    prefix, _, name = key.rpartition(".")
    level = int(prefix.split(".layers.")[1].split(".")[0])
    if name in ("embed", "embed_avg"):  # the same draw for both
        return 0.6**level * torch.randn(shape, generator=_generator(seed, prefix + ".embed"))
    return torch.ones(shape)  # cluster_size, initted


# -- calibrations ----------------------------------------------------------------------------------
def apply_vocabulary_prior(state: dict[str, torch.Tensor], llm_tokenizer, vocab_size: int) -> None:
    """Rescale the rows of the tied Llama embedding by the kind of piece they hold (see the module
    docstring): word starts ``EMBED_SCALE_WORD_START``, other pieces ``EMBED_SCALE_OTHER``, special
    tokens ``EMBED_SCALE_SPECIAL``."""
    from taste_speech.loading import EMBED_KEY

    specials = set(getattr(llm_tokenizer, "all_special_ids", []) or [])
    specials |= set((getattr(llm_tokenizer, "added_tokens_decoder", None) or {}).keys())
    scale = torch.empty(vocab_size, 1)
    for i in range(vocab_size):
        piece = llm_tokenizer.decode([i])
        if i in specials:
            scale[i] = EMBED_SCALE_SPECIAL
        elif piece.startswith(" ") and piece.strip():
            scale[i] = EMBED_SCALE_WORD_START
        else:
            scale[i] = EMBED_SCALE_OTHER
    state[EMBED_KEY] = state[EMBED_KEY] * scale


@torch.no_grad()
def calibrate_speech_eos(model, seed: int) -> float:
    """(The model's EOS row must be zero, weight and bias.) Bias of the constant EOS logit so that top-k sampling stops, per step, with probability
    about 1 / SPEECH_TOKENS_AFTER_MIN. Measured on free-running top-k decoding (EOS not allowed)
    from two random prefixes - the decoder's own trajectories are much peakier than teacher-forced
    random tokens - and rounded so that the stored bias does not depend on thread counts."""
    from taste_speech.modeling_speech_decoder import TopKSampler

    sd = model.speech_decoder
    gen = _generator(seed, "calibrate_speech_eos")
    masses = []
    for n_text in (6, 16):
        asr_ids = torch.randint(0, sd.text_token_size, (1, n_text), generator=gen)
        codes = torch.randint(0, model.rvq.codebook_size, (1, n_text, model.rvq.num_quantizers), generator=gen)
        prefix = sd.prefix_embeds(torch.randn(1, sd.spk_embed_dim, generator=gen), model.rvq.decode(codes).float(),
                                  asr_ids)
        steps = 48
        state = sd.start(prefix, min_len=steps, max_len=steps, record_logprobs=True)
        sampler = TopKSampler(SPEECH_TOP_K, generator=gen)
        while sd.step(state, sampler) is not None:
            pass
        logp = torch.stack(state.step_logprobs).double()
        # The EOS logit is 0 here, so raw logits = log-probs minus the EOS log-prob.
        raw = logp[:, : sd.speech_token_size] - logp[:, sd.eos_id:]
        masses.append(raw.topk(SPEECH_TOP_K, dim=-1).values)
    top = torch.cat(masses)  # (steps, k) best raw logits, descending
    mass, kth = top[:, :-1].exp().sum(-1), top[:, -1]
    # With EOS logit b: EOS is among the top k when b beats the k-th best logit, and then takes
    # p_eos(b) = e^b / (e^b + mass of the k-1 best) of the renormalised top-k probability.
    target = 1.0 / SPEECH_TOKENS_AFTER_MIN
    lo, hi = -40.0, 40.0
    for _ in range(80):
        mid = (lo + hi) / 2
        p = float(torch.where(kth < mid, math.exp(mid) / (math.exp(mid) + mass), 0.0).mean())
        lo, hi = (mid, hi) if p < target else (lo, mid)
    return round((lo + hi) / 2, 2)


# -- the builder -----------------------------------------------------------------------------------
# What the builder writes at the top of its folder: anything else there is someone else's
BUILT_ENTRIES = frozenset({"config.json", "model.safetensors", "llama_tokenizer", "asr_tokenizer", "whisper_joint",
                           "cosyvoice"})


def check_build_folder(directory: str) -> None:
    """Refuse a folder holding anything but a tiny checkpoint: writing one there removes its other
    weight files and replaces its config and tokenizers (a real checkpoint would be lost to random
    weights that still load)."""
    if not os.path.isdir(directory):
        return
    foreign = sorted(set(os.listdir(directory)) - BUILT_ENTRIES)
    config = os.path.join(directory, "config.json")
    if not foreign and os.path.isfile(config):
        try:
            with open(config, encoding="utf-8") as f:
                text = json.load(f).get("text_config", {})
            tiny = (text.get("hidden_size"), text.get("num_hidden_layers")) == (LLM_HIDDEN_SIZE, LLM_LAYERS)
        except (OSError, ValueError, AttributeError):
            tiny = False
        if not tiny:
            foreign = ["config.json (not a tiny checkpoint's)"]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ValueError(f"{directory!r} holds files that are not a tiny checkpoint ({shown}): building one there "
                         "would delete its weights and replace its config and tokenizers. Give an empty or new "
                         "folder (or pass overwrite=True, --force, to replace it on purpose)")


def build_tiny_checkpoint(directory: str, seed: int = SEED_DEFAULT, overwrite: bool = False) -> str:
    """Write a complete tiny checkpoint to ``directory`` (see the module docstring): a new or empty
    folder, or one holding a tiny checkpoint already, unless ``overwrite``."""
    from transformers import AutoTokenizer

    from taste_speech.configuration_taste import TasteConfig
    from taste_speech.loading import write_safetensors_checkpoint
    from taste_speech.modeling_taste import TasteForCausalLM
    from taste_speech.tiny_speaker import FBANK_BINS, write_speaker_model
    from taste_speech.tiny_tokenizers import build_tiny_tokenizers
    from taste_speech.voice_generator import write_tiny_voice_generator

    directory = os.fspath(directory)
    if not overwrite:
        check_build_folder(directory)
    os.makedirs(directory, exist_ok=True)
    tokenizers = build_tiny_tokenizers(directory, llm_vocab_size=LLM_VOCAB_SIZE, asr_vocab_size=ASR_VOCAB_SIZE,
                                       seed=seed)
    config = tiny_config(tokenizers)
    _write_config(config, directory)
    config = TasteConfig.from_pretrained(directory)  # exactly what loaders will see

    state = random_state_dict(config, seed)
    llm_tokenizer = AutoTokenizer.from_pretrained(tokenizers.llm_dir)
    apply_vocabulary_prior(state, llm_tokenizer, config.text_config.vocab_size)
    write_safetensors_checkpoint(state, directory)

    # The EOS logit becomes a constant: zero weight row, calibrated bias (needs the model's logits).
    model = TasteForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    eos = model.speech_decoder.eos_id
    state["speech_decoder.llm_decoder.weight"][eos] = 0.0
    model.speech_decoder.llm_decoder.weight[eos] = 0.0
    model.speech_decoder.llm_decoder.bias[eos] = 0.0
    state["speech_decoder.llm_decoder.bias"][eos] = calibrate_speech_eos(model, seed)
    write_safetensors_checkpoint(state, directory)

    sd = config.speech_decoder_config
    write_tiny_voice_generator(directory, seed, vocab_size=int(sd.speech_token_size), spk_embed_dim=int(sd.spk_embed_dim))
    # The speaker encoder, as published (no default voice: it comes from taste_speech/default_voice.wav)
    projection = torch.randn(FBANK_BINS, int(sd.spk_embed_dim), generator=_generator(seed, "speaker_encoder"))
    write_speaker_model(os.path.join(directory, "cosyvoice", "speaker_embed.onnx"), (0.05 * projection).numpy())
    return directory


def _write_config(config, directory: str) -> None:
    """config.json in the published full layout + whisper_joint/config.json next to it."""
    joint_dir = os.path.join(directory, "whisper_joint")
    os.makedirs(joint_dir, exist_ok=True)
    with open(os.path.join(joint_dir, "config.json"), "w") as f:
        json.dump(TINY_WHISPER, f, indent=2, sort_keys=True)
    data = config.to_dict()
    data.pop("transformers_version", None)  # keep the bytes independent of the library version
    data["_attn_implementation"] = "eager"  # as the published taslm.json (to_dict drops it)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)


def cache_key() -> str:
    """``CACHE_VERSION`` + a digest of the builder's sources: editing the builder invalidates caches."""
    package = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for rel in _BUILDER_SOURCES:
        with open(os.path.join(package, rel), "rb") as f:
            digest.update(f.read())
    return f"{CACHE_VERSION}-{digest.hexdigest()[:10]}"


def default_tiny_checkpoint(seed: int = SEED_DEFAULT) -> str:
    """Path of the embedded default tiny checkpoint, built on first use.

    Cached under ``$PIPECAT_TASTE_CACHE`` (default ``~/.cache/pipecat-taste``) as
    ``tiny-seed{seed}-{cache_key()}``; built in a temporary sibling folder and renamed into place,
    so concurrent callers never see a half-written checkpoint."""
    root = os.environ.get("PIPECAT_TASTE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pipecat-taste")
    target = os.path.join(root, f"tiny-seed{seed}-{cache_key()}")
    if _cache_intact(target):
        return target
    if os.path.exists(target):  # damaged (a file deleted or truncated): it is only a cache, built again
        shutil.rmtree(target, ignore_errors=True)
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".tiny-seed{seed}-building-", dir=root)
    try:
        build_tiny_checkpoint(tmp, seed)
        _readable_by_all(tmp)  # (mkdtemp makes it private; a shared $PIPECAT_TASTE_CACHE serves other users)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first: use theirs
            if not os.path.isfile(os.path.join(target, "model.safetensors")):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


CACHED_FILES = ("config.json", "model.safetensors", os.path.join("cosyvoice", "voice_generator.pth"),
                os.path.join("cosyvoice", "speaker_embed.onnx"), os.path.join("llama_tokenizer", "tokenizer.json"))


def _cache_intact(directory: str) -> bool:
    """Every file of the cached checkpoint there, not empty, and the weights' header consistent with
    the file's size (cheap: no tensor is read)."""
    from taste_speech.loading import CheckpointError, read_safetensors_header

    if not all(os.path.isfile(p) and os.path.getsize(p) > 0 for p in (os.path.join(directory, f) for f in CACHED_FILES)):
        return False
    try:
        read_safetensors_header(os.path.join(directory, "model.safetensors"))
    except (CheckpointError, OSError):
        return False
    return True


def _readable_by_all(directory: str) -> None:
    umask = os.umask(0)
    os.umask(umask)
    for folder, _, files in os.walk(directory):
        os.chmod(folder, 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o666 & ~umask)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m taste_speech.tiny",
                                     description="Write a random tiny TASTE checkpoint in the published layout.")
    parser.add_argument("directory", help="output folder (created; a tiny checkpoint there is rebuilt, other "
                                          "contents are refused unless --force)")
    parser.add_argument("--seed", type=int, default=SEED_DEFAULT, help="weights/tokenizer/voice seed (default 0)")
    parser.add_argument("--force", action="store_true",
                        help="build even into a folder holding something else (its weight files are deleted)")
    args = parser.parse_args(argv)
    if os.path.exists(args.directory) and not os.path.isdir(args.directory):
        parser.error(f"{args.directory!r} is a file: give a folder (created if missing)")
    if not args.force:
        try:
            check_build_folder(args.directory)
        except ValueError as e:
            parser.error(str(e))
    try:  # (now, not after the weights are made)
        os.makedirs(args.directory, exist_ok=True)
    except OSError as e:
        parser.error(f"cannot create the folder {args.directory!r}: {e.strerror}")
    if not os.access(args.directory, os.W_OK | os.X_OK):
        parser.error(f"the folder {args.directory!r} is not writable")
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))
    build_tiny_checkpoint(args.directory, args.seed, overwrite=True)
    print(f"wrote tiny TASTE checkpoint (seed {args.seed}) to {args.directory}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
