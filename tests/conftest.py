import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(1)  # the goldens were made with 1 intra-op thread

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def taste_lm_tiny_a() -> Path:
    """Golden set A of TasteForCausalLM (copied from the reference data: tests run without it)."""
    return DATA / "taste_lm_tiny_a"


@pytest.fixture(scope="session")
def voice_generator_tiny_a() -> Path:
    return DATA / "voice_generator_tiny_a"


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny random checkpoint in the published layout, built by taste_speech.tiny (seed 0)."""
    from taste_speech.tiny import build_tiny_checkpoint

    directory = tmp_path_factory.mktemp("tiny") / "ckpt"
    build_tiny_checkpoint(str(directory), seed=0)
    return directory


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint):
    from taste_speech.modeling_taste import TasteForCausalLM
    from taste_speech.processing_taste import TasteProcessor

    return TasteForCausalLM.from_pretrained(str(tiny_checkpoint)), TasteProcessor.from_pretrained(str(tiny_checkpoint))


@pytest.fixture(scope="session")
def model(tiny_model):
    return tiny_model[0]


@pytest.fixture(scope="session")
def processor(tiny_model):
    return tiny_model[1]


# Golden set A, and the spoken LM loaded from it: per test module, so that one module's changes to
# the model (caches, graphs) never reach another's. A module with other goldens defines its own.
@pytest.fixture(scope="module")
def golden(taste_lm_tiny_a):
    from taste_speech.verify import Golden

    return Golden(str(taste_lm_tiny_a))


@pytest.fixture(scope="module")
def loaded(golden):
    from taste_speech.verify.points_spoken_lm import load_golden_spoken_lm

    return load_golden_spoken_lm(golden.dir)


@pytest.fixture(scope="module")
def lm(loaded):
    return loaded.spoken_lm


@pytest.fixture(scope="module")
def rvq(loaded):
    return loaded.audio_tower.vq.rvq
