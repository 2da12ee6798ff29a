"""taste_speech: a weight-compatible implementation of the TASTE spoken language model family.

Model library only: it imports no Pipecat, aiortc or agent code, so it can be used on its own.

    from taste_speech import TasteForCausalLM, TasteProcessor, default_tiny_checkpoint

    path = default_tiny_checkpoint()        # or a download of MediaTek-Research/Llama-1B-TASTE-V0
    model = TasteForCausalLM.from_pretrained(path)
    processor = TasteProcessor.from_pretrained(path)

The configuration classes are imported eagerly (light); the model, processor, loaders and tools
are imported on first access (torch, transformers and peft take a while to import). Importing
``taste_speech.modeling_taste`` registers ``TasteForCausalLM`` with ``AutoModel`` and
``AutoModelForCausalLM`` (model_type ``taste``).
"""

from importlib import import_module

from taste_speech.configuration_taste import (
    TasteAudioTowerConfig,
    TasteConfig,
    TasteSpeechDecoderConfig,
    TasteSpokenLMConfig,
)

# name -> module that defines it (imported on first access)
_LAZY = {
    "TasteForCausalLM": "taste_speech.modeling_taste",
    "TastePreTrainedModel": "taste_speech.modeling_taste",
    "LoadingInfo": "taste_speech.modeling_taste",
    "CheckpointError": "taste_speech.loading",
    "TasteProcessor": "taste_speech.processing_taste",
    "TasteSampler": "taste_speech.sampler",
    "SamplingParams": "taste_speech.sampler",
    "VoiceGenerator": "taste_speech.voice_generator",
    "LMStepBatch": "taste_speech.lm_batch",
    "check_checkpoint": "taste_speech.check",
    "build_tiny_checkpoint": "taste_speech.tiny",
    "default_tiny_checkpoint": "taste_speech.tiny",
}

__all__ = [
    "TasteConfig",
    "TasteAudioTowerConfig",
    "TasteSpokenLMConfig",
    "TasteSpeechDecoderConfig",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'taste_speech' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
