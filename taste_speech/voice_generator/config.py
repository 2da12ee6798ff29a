"""Constructor arguments of the VoiceGenerator, in the layout of the golden ``config.json``.

The published checkpoint ships no configuration: upstream hard-codes the full-size arguments in
``VoiceGenerator.__init__``. :data:`FULL_SIZE` holds them (every argument, including ones inference
ignores). A config dict maps section names (``flow``, ``flow.encoder``, ``flow.length_regulator``,
``flow.decoder``, ``flow.decoder.estimator``, ``hift``, ``hift.f0_predictor``, ``inference``) to
either ``{"args": {...}}`` (the golden layout, other keys ignored) or the argument dict itself;
missing sections and arguments take the full-size values.
"""

from __future__ import annotations

import copy
from typing import Optional

_CFM_PARAMS = {
    "sigma_min": 1e-06, "solver": "euler", "t_scheduler": "cosine", "training_cfg_rate": 0.2,
    "inference_cfg_rate": 0.7, "reg_loss_type": "l1",
}

FULL_SIZE: dict[str, dict] = {
    "flow": {
        "input_size": 512, "output_size": 80, "spk_embed_dim": 192, "output_type": "mel", "vocab_size": 4096,
        "input_frame_rate": 50, "only_mask_loss": True,
        # stored on the module only; inference ignores them (spec §11 item 26)
        "decoder_conf": {
            "in_channels": 240, "out_channel": 80, "spk_emb_dim": 80, "n_spks": 1, "cfm_params": dict(_CFM_PARAMS),
            "decoder_params": {"channels": [256, 256], "dropout": 0.0, "attention_head_dim": 64, "n_blocks": 4,
                               "num_mid_blocks": 12, "num_heads": 8, "act_fn": "gelu"},
        },
        "mel_feat_conf": {"n_fft": 1024, "num_mels": 80, "sampling_rate": 16000, "hop_size": 256, "win_size": 1024,
                          "fmin": 0, "fmax": 8000},
    },
    "flow.encoder": {
        "input_size": 512, "output_size": 512, "attention_heads": 8, "linear_units": 2048, "num_blocks": 6,
        "dropout_rate": 0.1, "positional_dropout_rate": 0.1, "attention_dropout_rate": 0.1, "input_layer": "linear",
        "pos_enc_layer_type": "rel_pos_espnet", "normalize_before": True, "static_chunk_size": 0,
        "use_dynamic_chunk": False, "global_cmvn": None, "use_dynamic_left_chunk": False,
        "positionwise_conv_kernel_size": 1, "macaron_style": False, "selfattention_layer_type": "rel_selfattn",
        "activation_type": "swish", "use_cnn_module": False, "cnn_module_kernel": 15, "causal": False,
        "cnn_module_norm": "batch_norm", "key_bias": True, "gradient_checkpointing": False,
    },
    "flow.length_regulator": {"channels": 80, "sampling_ratios": [1, 1, 1, 1], "out_channels": None, "groups": 1},
    "flow.decoder": {"in_channels": 240, "cfm_params": dict(_CFM_PARAMS), "n_spks": 1, "spk_emb_dim": 8},
    "flow.decoder.estimator": {
        "in_channels": 320, "out_channels": 80, "channels": [256, 256], "dropout": 0.0, "attention_head_dim": 64,
        "n_blocks": 4, "num_mid_blocks": 12, "num_heads": 8, "act_fn": "gelu",
    },
    "hift": {
        "in_channels": 80, "base_channels": 512, "nb_harmonics": 8, "sampling_rate": 22050, "nsf_alpha": 0.1,
        "nsf_sigma": 0.003, "nsf_voiced_threshold": 10, "upsample_rates": [8, 8], "upsample_kernel_sizes": [16, 16],
        "istft_params": {"n_fft": 16, "hop_len": 4}, "resblock_kernel_sizes": [3, 7, 11],
        "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]], "source_resblock_kernel_sizes": [7, 11],
        "source_resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5]], "lrelu_slope": 0.1, "audio_limit": 0.99,
    },
    "hift.f0_predictor": {"num_class": 1, "in_channels": 80, "cond_channels": 512},
    "inference": {"flow_inference_n_timesteps": 10, "temperature": 1.0},
}

# Encoder options our rel-pos transformer implements (anything else would silently change the model).
_ENCODER_FIXED = {
    "input_layer": "linear", "pos_enc_layer_type": "rel_pos_espnet", "normalize_before": True,
    "static_chunk_size": 0, "use_dynamic_chunk": False, "macaron_style": False,
    "selfattention_layer_type": "rel_selfattn", "activation_type": "swish", "use_cnn_module": False,
    "causal": False, "key_bias": True, "global_cmvn": None,
}


def resolve_config(config: Optional[dict] = None) -> dict[str, dict]:
    """Full-size defaults overridden by ``config``; returns ``{section: args}`` for every section."""
    resolved = copy.deepcopy(FULL_SIZE)
    for section, value in (config or {}).items():
        if section not in resolved:
            continue  # e.g. "io_sizes" of a golden config: not a constructor section
        if not isinstance(value, dict):
            raise ValueError(f"voice generator config section {section!r} must be a dict, got {type(value).__name__}")
        args = value.get("args", value)
        for name, arg in args.items():
            if isinstance(arg, str) and arg.startswith("<module:"):
                continue  # placeholder for a sub-module, described by its own section
            resolved[section][name] = copy.deepcopy(arg)
    for name, expected in _ENCODER_FIXED.items():
        if resolved["flow.encoder"][name] != expected:
            raise ValueError(
                f"flow.encoder {name}={resolved['flow.encoder'][name]!r} is not supported; the published "
                f"voice generator uses {expected!r}"
            )
    return resolved


def to_golden_layout(resolved: dict[str, dict]) -> dict[str, dict]:
    """``{section: {"args": ...}}`` (the layout of the golden config.json, written next to tiny weights)."""
    return {section: {"args": copy.deepcopy(args)} for section, args in resolved.items()}

# A small configuration with the architecture of the published model (the sizes of golden set A):
# used by the tiny-checkpoint builder and tests. Sections not listed keep their full-size values.
TINY: dict[str, dict] = {
    "flow": {"input_size": 64, "spk_embed_dim": 192, "vocab_size": 4096},
    "flow.encoder": {"input_size": 64, "output_size": 64, "attention_heads": 4, "linear_units": 128, "num_blocks": 2},
    "flow.length_regulator": {"sampling_ratios": [1, 1]},
    "flow.decoder.estimator": {
        "channels": [64, 64], "attention_head_dim": 16, "n_blocks": 1, "num_mid_blocks": 2, "num_heads": 4,
    },
    "hift": {"base_channels": 64},
    "hift.f0_predictor": {"cond_channels": 64},
}
