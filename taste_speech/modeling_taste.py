"""TasteForCausalLM: the whole TASTE model, loadable from the published checkpoint.

Three parts with the published state-dict prefixes: ``audio_tower`` (audio -> TASTE codes),
``spoken_lm`` (joint text + TASTE Llama) and ``speech_decoder`` (text + TASTE -> speech tokens).
The voice generator (flow + HiFT) ships as a separate file and lives in
``taste_speech.voice_generator``.

Loading (``from_pretrained``) takes a local directory or a hub id, reads single or sharded
safetensors (or a plain ``.bin`` state dict through ``torch.load(weights_only=True)``), accepts
the LoRA key spellings different peft versions write, ties the LM head to the input embedding
when the checkpoint drops it, and refuses missing, unexpected or mis-shaped tensors by name.
"""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PreTrainedModel

from taste_speech.configuration_taste import TasteConfig
from taste_speech.modeling_audio_tower import TasteAudioTower
from taste_speech.modeling_speech_decoder import TasteSpeechDecoder
from taste_speech.modeling_spoken_lm import TasteSpokenLM

LM_HEAD_KEY = "spoken_lm.language_model.base_model.model.lm_head.weight"
EMBED_KEY = "spoken_lm.language_model.base_model.model.model.embed_tokens.weight"
_LORA_PREFIX = "spoken_lm.language_model.base_model.model."
_ADAPTED = r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


class CheckpointError(ValueError):
    """A checkpoint does not match the architecture; the message names every offending tensor."""


class TastePreTrainedModel(PreTrainedModel):
    config_class = TasteConfig
    base_model_prefix = ""
    supports_gradient_checkpointing = False
    _no_split_modules = []

    def _init_weights(self, module):  # weights always come from a checkpoint or the tiny builder
        pass


class TasteForCausalLM(TastePreTrainedModel):
    def __init__(self, config: TasteConfig):
        super().__init__(config)
        self.audio_tower = TasteAudioTower(config)
        self.spoken_lm = TasteSpokenLM(config)
        self.speech_decoder = TasteSpeechDecoder(config)

    @property
    def rvq(self):
        return self.audio_tower.vq.rvq

    def tie_weights(self, *args, **kwargs):
        self.spoken_lm.tie_lm_head()

    # -- loading --------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, torch_dtype=None, device=None, strict=True, **kwargs):
        """Load from a local directory or a hub id (downloaded with huggingface_hub).

        ``torch_dtype=None`` keeps the published run dtypes (Llama and Whisper in bfloat16 on
        CUDA; everything float32 on CPU). ``torch_dtype=torch.float32`` makes everything fp32."""
        directory = resolve_checkpoint_dir(pretrained_model_name_or_path)
        config = TasteConfig.from_pretrained(directory)
        with torch.device("meta"):
            model = cls(config)
        state = normalise_keys(read_state_dict(directory))
        model.load_checkpoint_state(state, strict=strict)
        device = torch.device(device) if device is not None else torch.device("cpu")
        model.to(device)
        model.set_run_dtypes(torch_dtype, device)
        return model.eval()

    def load_checkpoint_state(self, state: dict[str, torch.Tensor], strict: bool = True):
        expected = self.state_dict()
        state = dict(state)
        if LM_HEAD_KEY not in state:  # dropped by save_pretrained: the head is tied
            state[LM_HEAD_KEY] = state.get(EMBED_KEY)
        if not any(".lora_" in k for k in state):
            # A merged checkpoint (LoRA folded into the base weights): adapters that add nothing.
            for key, slot in expected.items():
                if ".lora_" in key:
                    state[key] = torch.zeros(slot.shape, dtype=slot.dtype)
        missing = sorted(k for k in expected if k not in state or state[k] is None)
        unexpected = sorted(k for k in state if k not in expected)
        misshaped = sorted(
            f"{k}: checkpoint {tuple(state[k].shape)} != model {tuple(expected[k].shape)}"
            for k in expected
            if k in state and state[k] is not None and tuple(state[k].shape) != tuple(expected[k].shape)
        )
        if strict and (missing or unexpected or misshaped):
            raise CheckpointError(describe_mismatch(missing, unexpected, misshaped))
        loadable = {k: v for k, v in state.items() if k in expected and v is not None
                    and tuple(v.shape) == tuple(expected[k].shape)}
        # Materialise from meta: assign the checkpoint tensors (cast to each slot's dtype).
        for key, value in loadable.items():
            _assign(self, key, value.to(expected[key].dtype))
        self.spoken_lm.tie_lm_head()
        _rebuild_non_persistent(self)
        self.spoken_lm.round_rope_frequencies()
        self.rvq.check_initialised()
        return missing, unexpected, misshaped

    def set_run_dtypes(self, torch_dtype, device) -> None:
        """Cast parts to their run dtypes: one dtype if given, else the published choice."""
        if torch_dtype is not None:
            self.to(torch_dtype)
        elif torch.device(device).type == "cuda":
            self.audio_tower.audio_joint_encoder_segmenter.to(torch.bfloat16)
            self.spoken_lm.language_model.to(torch.bfloat16)
            self.spoken_lm.tie_lm_head()
        else:
            self.to(torch.float32)
        self.spoken_lm.round_rope_frequencies()


def _assign(model: torch.nn.Module, key: str, value: torch.Tensor) -> None:
    module_path, _, name = key.rpartition(".")
    module = model.get_submodule(module_path)
    if name in module._parameters:
        module._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[name] = value


def _rebuild_non_persistent(model: torch.nn.Module) -> None:
    """Modules whose buffers are not in checkpoints (RoPE tables) are rebuilt on the CPU."""
    for path, module in list(model.named_modules()):
        if not any(b.device.type == "meta" for b in module.buffers(recurse=False)):
            continue
        if not hasattr(module, "rope_type"):
            raise CheckpointError(f"cannot rebuild the non-persistent buffers of {path}")
        parent_path, _, child = path.rpartition(".")
        with torch.device("cpu"):
            setattr(model.get_submodule(parent_path), child, type(module)(module.config))


def describe_mismatch(missing, unexpected, misshaped) -> str:
    lines = ["checkpoint does not match the TASTE architecture:"]
    for title, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
        if items:
            lines.append(f"  {len(items)} {title} tensor(s):")
            lines.extend(f"    {k}" for k in items)
    lines.append("Check that the directory holds the published TASTE layout (python -m taste_speech.check DIR).")
    return "\n".join(lines)


def resolve_checkpoint_dir(name_or_path: str) -> str:
    """A local directory as is; otherwise a hub id, downloaded (or found in the local cache)."""
    path = os.path.expanduser(str(name_or_path))
    if os.path.isdir(path):
        return path
    if re.fullmatch(r"[\w.-]+/[\w.-]+", str(name_or_path)) is None:
        raise FileNotFoundError(f"{name_or_path!r} is neither a local directory nor a hub id (owner/name)")
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id=str(name_or_path))


def weight_files(directory: str) -> list[str]:
    """The weight files of a checkpoint directory, in the order they should be read."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(directory, s) for s in shards]
    for name in ("model.safetensors", "pytorch_model.bin"):
        if os.path.exists(os.path.join(directory, name)):
            return [os.path.join(directory, name)]
    raise FileNotFoundError(
        f"no model weights in {directory}: expected model.safetensors, sharded model-*.safetensors with "
        "model.safetensors.index.json, or pytorch_model.bin"
    )


def read_state_dict(directory: str) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        state.update(read_weight_file(path))
    return state


def read_weight_file(path: str) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        try:
            with safe_open(path, framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}
        except Exception as exc:  # truncated or corrupt file
            raise CheckpointError(f"cannot read {path}: {exc}. Re-download the file.") from exc
    return load_plain_state_dict(path)


def load_plain_state_dict(path: str) -> dict[str, torch.Tensor]:
    """A ``.bin``/``.pth`` file, loaded without unpickling arbitrary objects."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"{path} is not a plain tensor state dict (refused to unpickle it safely: {exc}). "
            "Use the published file or convert it to safetensors."
        ) from exc
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        raise CheckpointError(f"{path} must hold a flat dict of name -> tensor (a state dict)")
    return obj


def normalise_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map the LoRA spellings of §10.2 onto ours (peft >= 0.7: ``.base_layer.weight`` and
    ``.lora_A.default.weight``): old peft (base weight at ``q_proj.weight`` beside adapters
    without ``.default``) and merged checkpoints (``spoken_lm.language_model.model.…``, no
    adapters; see ``load_checkpoint_state``)."""
    merged = not any(k.startswith(_LORA_PREFIX) for k in state) and any(
        k.startswith("spoken_lm.language_model.model.") for k in state
    )
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if merged and key.startswith("spoken_lm.language_model."):
            key = _LORA_PREFIX + key[len("spoken_lm.language_model."):]
        if key.startswith(_LORA_PREFIX) and ".layers." in key:
            key = re.sub(rf"\.{_ADAPTED}\.weight$", r".\1.base_layer.weight", key)
            key = re.sub(r"\.lora_([AB])\.weight$", r".lora_\1.default.weight", key)
        out[key] = value
    return out


AutoConfig.register("taste", TasteConfig, exist_ok=True)
AutoModel.register(TasteConfig, TasteForCausalLM, exist_ok=True)
AutoModelForCausalLM.register(TasteConfig, TasteForCausalLM, exist_ok=True)
