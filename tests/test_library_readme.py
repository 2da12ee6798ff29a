"""The README's example of the model library on its own runs as written, on the tiny checkpoint:
a turn listened to, a reply generated and spoken segment by segment in one utterance."""

import re
from pathlib import Path

import numpy as np
import torch

from taste_speech.streaming.synthesis_state import frames_for_tokens

README = Path(__file__).resolve().parents[1] / "README.md"


def library_example() -> str:
    section = README.read_text().split("## The model library on its own", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_library_example_speaks_the_reply_as_one_utterance(tiny_checkpoint):
    heard = []
    scope = {
        "path": str(tiny_checkpoint),
        "wav": (0.2 * np.sin(2 * np.pi * 150 * np.arange(96000) / 48000)).astype(np.float32),  # 2 s at 48 kHz
        "play": heard.append,
    }
    torch.manual_seed(0)  # (the example samples with the global generator)
    exec(compile(library_example(), str(README), "exec"), scope)
    assert scope["conversation"].turns[-1].role == "assistant"  # the reply is in the history
    audio = torch.cat(heard, dim=-1)
    # every segment's speech, nothing repeated or dropped at the joins: the utterance's length at 24 kHz
    expected = frames_for_tokens(scope["speech_ids"].shape[1]) * 256 * 24000 / 22050
    assert all(chunk.shape[-1] for chunk in heard)  # (an empty chunk is not played)
    assert len(heard) >= 2 and abs(audio.shape[-1] - expected) <= 2
    assert float(audio.pow(2).mean().sqrt()) > 0.01
