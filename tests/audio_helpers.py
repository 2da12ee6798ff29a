"""Test audio that the model can tokenize without a real recording."""

import numpy as np


def voiced(seconds=1.5, rate=16000, seed=0):
    """A voice-like signal: a 150 Hz tone, amplitude-modulated at 3 Hz (syllables), a little noise."""
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.RandomState(seed)
    tone = 0.2 * np.sin(2 * np.pi * 150 * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t))
    return (tone + 0.01 * rng.randn(t.size)).astype(np.float32)
