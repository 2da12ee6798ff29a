"""Configuration of the TASTE model family, in the published `config.json` layout.

The published checkpoint stores one top-level `TasteConfig` (model_type ``taste``) whose five
sub-configs are plain dicts: ``audio_tower_config``, ``spoken_lm_config``,
``speech_decoder_config`` (TASTE's own), ``text_config`` (a full LlamaConfig) and ``asr_config``
(a full WhisperConfig, only used for its name). Unknown keys are kept, so a config written by the
original code loads unchanged and is written back in the same layout: the keys transformers 5
renamed are spelled as published, and the generation defaults it leaves out are those defaults.
"""

from __future__ import annotations

import json
import os
from typing import Any

from transformers import AutoConfig, LlamaConfig, PretrainedConfig, WhisperConfig

# Whisper distil-large-v3: the architecture of the audio tower's joint encoder/segmenter in the
# published checkpoint (32 encoder layers, 2 decoder layers). Used when the config names a
# Whisper checkpoint that is not available locally, so that loading never needs the hub.
JOINT_WHISPER_DIR = "whisper_joint"  # where a non-published tower Whisper config is saved, beside config.json
DISTIL_LARGE_V3 = dict(
    d_model=1280,
    encoder_layers=32,
    decoder_layers=2,
    encoder_attention_heads=20,
    decoder_attention_heads=20,
    encoder_ffn_dim=5120,
    decoder_ffn_dim=5120,
    num_mel_bins=128,
    vocab_size=51866,
    max_source_positions=1500,
    max_target_positions=448,
    activation_function="gelu",
    scale_embedding=False,
)


class TasteAudioTowerConfig(PretrainedConfig):
    """Audio tower: Whisper encoder + 2-layer Whisper decoder used as a word-level attention
    pooler + residual VQ (`audio_tower.` in the state dict)."""

    model_type = "taste"  # as in the published config.json (sub-configs share the top-level type)

    def __init__(
        self,
        is_joint_encoder_segmenter: bool = True,
        quantization_on: bool = True,
        audio_dropout_ratio: float = 0.0,
        kwargs_for_joint_encoder_segmenter: dict | None = None,
        kwargs_for_quantizer: dict | None = None,
        encoder__target_hidden_layer: int = 6,
        text_token_size: int = 51866,
        **kwargs,
    ):
        self.is_joint_encoder_segmenter = is_joint_encoder_segmenter
        self.quantization_on = quantization_on
        self.audio_dropout_ratio = audio_dropout_ratio
        self.kwargs_for_joint_encoder_segmenter = dict(
            {
                "model_name_or_path": "distil-whisper/distil-large-v3",
                "forward_type": "asr_attn_pooling",
                "is_word_level": True,
                "skip_prefix_idx": 4,
                "make_v_proj_identity": True,
                "dtype": "bfloat16",
                "use_custom": True,
            },
            **(kwargs_for_joint_encoder_segmenter or {}),
        )
        self.kwargs_for_quantizer = dict(
            {"dim": 1280, "num_quantizers": 4, "codebook_size": 512, "codebook_dim": 256},
            **(kwargs_for_quantizer or {}),
        )
        self.encoder__target_hidden_layer = encoder__target_hidden_layer
        self.text_token_size = text_token_size
        super().__init__(**kwargs)

    # Convenience views used by the model code.
    @property
    def target_hidden_layer(self) -> int:
        # The joint module always taps layer 6 (upstream default; not in the published config).
        return int(self.kwargs_for_joint_encoder_segmenter.get("target_hidden_layer", 6))

    @property
    def skip_prefix_idx(self) -> int:
        return int(self.kwargs_for_joint_encoder_segmenter.get("skip_prefix_idx", 4))

    @property
    def vq_dim(self) -> int:
        return int(self.kwargs_for_quantizer["dim"])

    @property
    def num_quantizers(self) -> int:
        return int(self.kwargs_for_quantizer["num_quantizers"])

    @property
    def codebook_size(self) -> int:
        return int(self.kwargs_for_quantizer["codebook_size"])

    @property
    def codebook_dim(self) -> int:
        return int(self.kwargs_for_quantizer["codebook_dim"])


class TasteSpokenLMConfig(PretrainedConfig):
    """Spoken LM: Llama backbone with LoRA, weighted-sum input fusion and latent TASTE head."""

    model_type = "taste"  # as in the published config.json (sub-configs share the top-level type)

    def __init__(
        self,
        sos_id: int = 128000,
        delay: int = 1,
        delay_level: str = "word",
        audio_embed_conv_mode: str = "fill_forward",
        in_llm_module: str = "weighted_sum",
        out_llm_module: str = "continue_latent_linear_last",
        use_lora: bool = True,
        kwargs_for_lora: dict | None = None,
        loss_weights: str = "0.5-0.5",
        **kwargs,
    ):
        self.sos_id = sos_id
        self.delay = delay
        self.delay_level = delay_level
        self.audio_embed_conv_mode = audio_embed_conv_mode
        self.in_llm_module = in_llm_module
        self.out_llm_module = out_llm_module
        self.use_lora = use_lora
        self.kwargs_for_lora = dict(
            {"lora_r": 64, "lora_alpha": 128, "lora_dropout": 0.05, "lora_target_linear": True},
            **(kwargs_for_lora or {}),
        )
        self.loss_weights = loss_weights
        super().__init__(**kwargs)


class TasteSpeechDecoderConfig(PretrainedConfig):
    """Speech decoder: CosyVoice-v1-style AR transformer from (ASR text, TASTE, speaker) to
    50 Hz speech tokens. Block settings use the original's ``encoder__*`` / ``llm__*`` names."""

    model_type = "taste"  # as in the published config.json (sub-configs share the top-level type)

    def __init__(
        self,
        encoder_input_size: int = 512,
        llm_input_size: int = 1024,
        llm_output_size: int = 1024,
        speech_token_size: int = 4096,
        spk_embed_dim: int = 192,
        text_token_size: int = 51866,
        audio_encoder_input_size: int = 1280,
        skip_prefix_idx: int = 4,
        fuse_encoded_audio_text_type: str = "weighted_sum",
        fuse_encoded_audio_text_kwargs: dict | None = None,
        encoder__num_blocks: int = 3,
        encoder__attention_heads: int = 8,
        encoder__linear_units: int = 2048,
        encoder__input_layer: str = "linear",
        encoder__static_chunk_size: int = 1,
        llm__num_blocks: int = 7,
        llm__attention_heads: int = 8,
        llm__linear_units: int = 2048,
        llm__input_layer: str = "linear_legacy",
        llm__static_chunk_size: int = 1,
        **kwargs,
    ):
        self.encoder_input_size = encoder_input_size
        self.llm_input_size = llm_input_size
        self.llm_output_size = llm_output_size
        self.speech_token_size = speech_token_size
        self.spk_embed_dim = spk_embed_dim
        self.text_token_size = text_token_size
        self.audio_encoder_input_size = audio_encoder_input_size
        self.skip_prefix_idx = skip_prefix_idx
        self.fuse_encoded_audio_text_type = fuse_encoded_audio_text_type
        self.fuse_encoded_audio_text_kwargs = fuse_encoded_audio_text_kwargs or {
            "normalize": False,
            "use_layer_norm": False,
            "use_trainable_weight": True,
            "weight_init_type": "balance",
        }
        self.encoder__num_blocks = encoder__num_blocks
        self.encoder__attention_heads = encoder__attention_heads
        self.encoder__linear_units = encoder__linear_units
        self.encoder__input_layer = encoder__input_layer
        self.encoder__static_chunk_size = encoder__static_chunk_size
        self.llm__num_blocks = llm__num_blocks
        self.llm__attention_heads = llm__attention_heads
        self.llm__linear_units = llm__linear_units
        self.llm__input_layer = llm__input_layer
        self.llm__static_chunk_size = llm__static_chunk_size
        super().__init__(**kwargs)


def _as_config(cls, value):
    if value is None:
        return cls()
    if isinstance(value, PretrainedConfig):
        return value
    return cls(**value)


class TasteConfig(PretrainedConfig):
    """Top-level TASTE config (model_type ``taste``).

    ``joint_whisper_config`` is not part of the published file: it is resolved from
    ``audio_tower_config.kwargs_for_joint_encoder_segmenter.model_name_or_path`` at load time
    (a local folder with a Whisper config.json, relative to the checkpoint, or the built-in
    distil-large-v3 architecture) and kept out of the serialised dict.
    """

    model_type = "taste"
    sub_configs = {
        "audio_tower_config": TasteAudioTowerConfig,
        "spoken_lm_config": TasteSpokenLMConfig,
        "speech_decoder_config": TasteSpeechDecoderConfig,
        "text_config": LlamaConfig,
        "asr_config": WhisperConfig,
    }

    def __init__(
        self,
        audio_tower_config=None,
        spoken_lm_config=None,
        speech_decoder_config=None,
        text_config=None,
        asr_config=None,
        ignore_index: int = -100,
        load_language_model_during_init: bool = True,
        **kwargs,
    ):
        kwargs.pop("joint_whisper_config", None)
        self.audio_tower_config = _as_config(TasteAudioTowerConfig, audio_tower_config)
        self.spoken_lm_config = _as_config(TasteSpokenLMConfig, spoken_lm_config)
        self.speech_decoder_config = _as_config(TasteSpeechDecoderConfig, speech_decoder_config)
        self.text_config = _as_config(LlamaConfig, text_config)
        self.asr_config = _as_config(WhisperConfig, asr_config)
        self.ignore_index = ignore_index
        self.load_language_model_during_init = load_language_model_during_init
        super().__init__(**kwargs)
        self._joint_whisper_config: WhisperConfig | None = None

    # -- the Whisper architecture of the audio tower -------------------------------------------
    @property
    def joint_whisper_config(self) -> WhisperConfig:
        if self._joint_whisper_config is None:  # e.g. a config from AutoConfig: its folder is its name
            base = getattr(self, "_name_or_path", "") or ""
            self._joint_whisper_config = resolve_joint_whisper_config(self, base_dir=base if os.path.isdir(base) else None)
        return self._joint_whisper_config

    @joint_whisper_config.setter
    def joint_whisper_config(self, value: WhisperConfig) -> None:
        self._joint_whisper_config = value

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs) -> "TasteConfig":
        base = os.path.expanduser(os.fspath(pretrained_model_name_or_path))
        if os.path.isdir(base):
            _check_config_file(base)
        try:
            config = super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        except Exception as exc:  # a value of the wrong type, deep in a sub-config's class (huggingface_hub's
            if not os.path.isdir(base) or isinstance(exc, OSError):  # strict dataclass errors are plain Exceptions)
                raise
            raise ValueError(f"{os.path.join(base, 'config.json')} does not make a TASTE config "
                             f"({type(exc).__name__}: {' '.join(str(exc).split())[:300]}): a value has the wrong type "
                             "or the file was edited - download it again") from exc
        if isinstance(config, tuple):  # return_unused_kwargs=True
            return config
        config.joint_whisper_config = resolve_joint_whisper_config(
            config, base_dir=base if os.path.isdir(base) else None
        )
        return config

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **unused) -> None:
        """``config.json`` in the published layout, plus ``whisper_joint/config.json`` when the
        tower's Whisper is not distil-large-v3 (the published config names a copy that is not
        shipped; any other architecture travels with the checkpoint)."""
        if push_to_hub:
            raise NotImplementedError("push_to_hub is not supported: save to a folder, then upload it (hf upload)")
        os.makedirs(save_directory, exist_ok=True)
        config = self.to_dict()
        joint = self.joint_whisper_config
        if any(getattr(joint, k) != v for k, v in DISTIL_LARGE_V3.items()):
            os.makedirs(os.path.join(save_directory, JOINT_WHISPER_DIR), exist_ok=True)
            joint.to_json_file(os.path.join(save_directory, JOINT_WHISPER_DIR, "config.json"), use_diff=False)
            config["audio_tower_config"]["kwargs_for_joint_encoder_segmenter"]["model_name_or_path"] = JOINT_WHISPER_DIR
        attn = getattr(self.text_config, "_attn_implementation", None)
        if attn:  # to_dict drops it; the published layout carries it at the top level
            config["_attn_implementation"] = attn
        _published_spellings(config)
        for key in self.sub_configs:
            if isinstance(config.get(key), dict):
                _published_spellings(config[key])
        with open(os.path.join(save_directory, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.pop("_joint_whisper_config", None)
        out.pop("joint_whisper_config", None)
        return out


def _published_spellings(config: dict) -> None:
    """Write transformers 5's renamed keys back as the published config (transformers 4.51) spells
    them, which both read: ``dtype`` as ``torch_dtype``, and ``rope_parameters`` as ``rope_theta``
    and ``rope_scaling`` (an older transformers ignores ``rope_parameters`` and would run Llama-3's
    RoPE with the default theta and no llama3 scaling)."""
    if "dtype" in config:
        config["torch_dtype"] = config.pop("dtype")
    rope = config.pop("rope_parameters", None)
    if isinstance(rope, dict):
        rope = dict(rope)
        if "rope_theta" in rope:
            config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None


def _check_config_file(directory: str) -> None:
    """A checkpoint folder's config.json exists and describes a TASTE model (transformers would
    otherwise return a default config, and the weights would fail to match by the thousand)."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{directory} has no config.json: it is not a TASTE checkpoint folder, or its "
                                "download was interrupted - download it again")
    try:
        with open(path) as f:
            data = json.load(f)
        model_type = data.get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"{path} is not a readable JSON config ({exc}); download it again") from exc
    if model_type != "taste":
        raise ValueError(f"{path} describes a {model_type!r} model, not a TASTE one (model_type 'taste'): pass the "
                         "folder of a TASTE checkpoint such as MediaTek-Research/Llama-1B-TASTE-V0")
    # a sub-config left out would silently become its default: the weights then fail by the hundred
    bad = {key: data.get(key) for key in TasteConfig.sub_configs if not isinstance(data.get(key), dict)}
    if bad:
        shown = ", ".join(f"{key} is {'missing' if key not in data else type(value).__name__}" for key, value in bad.items())
        raise ValueError(f"{path}: {shown}; each of {', '.join(TasteConfig.sub_configs)} must be a JSON object - the "
                         "file is incomplete or was edited: download it again")


def resolve_joint_whisper_config(config: TasteConfig, base_dir: str | None) -> WhisperConfig:
    """Find the Whisper architecture named by the audio tower config, without the hub.

    Order: a folder (absolute, or relative to the checkpoint folder) holding a Whisper
    ``config.json``; for a name ending in ``distil-large-v3`` (the published config names a
    training machine's copy) the built-in dimensions. Any other name must be found."""
    name = config.audio_tower_config.kwargs_for_joint_encoder_segmenter.get("model_name_or_path")
    candidates = []
    if name:
        if base_dir is not None and not os.path.isabs(name):
            candidates.append(os.path.join(base_dir, name))
        candidates.append(name)
    for folder in candidates:
        path = os.path.join(folder, "config.json")
        if os.path.isfile(path):
            with open(path) as f:
                data = json.load(f)
            return WhisperConfig(**data)
    if name and os.path.basename(os.path.normpath(name)) != "distil-large-v3":
        where = f" (looked in {', '.join(candidates)})"
        raise FileNotFoundError(f"the audio tower's Whisper config {name!r} was not found{where}: the folder "
                                f"{name}/config.json belongs next to the checkpoint's config.json - download it again")
    return WhisperConfig(**DISTIL_LARGE_V3)


AutoConfig.register("taste", TasteConfig)
