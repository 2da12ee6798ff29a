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
