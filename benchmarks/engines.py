"""The engines the benchmarks run: the embedded tiny checkpoint, and the published full size with
random weights (no weights can be downloaded here; latency depends on the sizes, not the values).

The full-size engine combines
* ``TasteForCausalLM`` built from ``tests/data/taste_lm_config_full.json`` (audio tower with its
  Whisper encoders, Llama-3.2-1B spoken LM with LoRA, speech decoder) with the tiny builder's
  random weights (``taste_speech.tiny.random_state_dict``: LoRA B non-zero, so adapters cost what
  they cost in the published model);
* a full-size random ``VoiceGenerator`` (flow + HiFT, published dimensions), as
  ``bench_synthesis.py --size full`` builds it;
* the tiny checkpoint's tokenizers and speaker vector (their ids fit in the full vocabularies),
  with the log-mel front end set to the full Whisper window (128 mel bins, 30 s).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "plugin", ROOT / "agents"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

FULL_CONFIG = ROOT / "tests" / "data" / "taste_lm_config_full.json"


def tiny_engine(device: str = "cpu", dtype: str | None = None):
    """The embedded tiny checkpoint (built once and cached), without the built-in ASR."""
    from pipecat_taste.engine import TasteEngine

    return TasteEngine.from_pretrained(None, device=device, dtype=dtype, asr=None)


@torch.no_grad()
def full_model(device: str = "cpu", dtype: str | None = None, seed: int = 0):
    from taste_speech.configuration_taste import TasteConfig
    from taste_speech.modeling_taste import TasteForCausalLM, _rebuild_non_persistent
    from taste_speech.tiny import random_state_dict

    config = TasteConfig.from_json_file(str(FULL_CONFIG))
    with torch.device("meta"):  # no default init: the random state dict replaces every tensor anyway
        model = TasteForCausalLM(config)
    model.load_state_dict(random_state_dict(config, seed), strict=False, assign=True)  # lm_head: tied below
    model.spoken_lm.tie_lm_head()
    _rebuild_non_persistent(model, "cpu")  # RoPE tables are not in a state dict
    model.spoken_lm.round_rope_frequencies()
    if device != "cpu" or dtype not in (None, "float32"):
        model.set_run_dtypes(dtype, device)
    return model.eval()


def full_voice_generator(device: str = "cpu", seed: int = 0):
    from taste_speech.voice_generator import VoiceGenerator

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return VoiceGenerator().eval().to(device)


def full_processor(tiny_processor, model):
    """The tiny processor's tokenizers and voice, with the full model's Whisper front end."""
    whisper = model.config.joint_whisper_config
    processor = copy.copy(tiny_processor)
    processor.n_mels = whisper.num_mel_bins
    processor.num_frames = 2 * whisper.max_source_positions
    processor.max_samples = processor.num_frames * (tiny_processor.max_samples // tiny_processor.num_frames)
    processor.max_asr_tokens = whisper.max_target_positions - 5  # Whisper's prompt tokens
    for cached in ("_taste_sampler_tables", "_taste_vocabulary_tables"):  # built for the tiny vocabulary
        processor.__dict__.pop(cached, None)
    return processor


def full_engine(device: str = "cpu", dtype: str | None = None):
    from pipecat_taste.engine import TasteEngine

    tiny = tiny_engine()  # its processor (tokenizers, default voice) only
    model = full_model(device, dtype)
    processor = full_processor(tiny.processor, model)
    torch.set_grad_enabled(False)
    return TasteEngine(model, processor, full_voice_generator(device), checkpoint_dir=tiny.checkpoint_dir,
                       device=device, asr=None)


def parameter_count(engine) -> tuple[float, float]:
    """(TASTE model, voice generator) parameters in millions."""
    return (sum(p.numel() for p in engine.model.parameters()) / 1e6,
            sum(p.numel() for p in engine.voice_generator.parameters()) / 1e6)
