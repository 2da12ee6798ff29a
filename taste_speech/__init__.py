"""taste_speech: a weight-compatible implementation of the TASTE spoken language model family.

Model library only: it imports no Pipecat, aiortc or agent code, so it can be used on its own.
"""

from taste_speech.configuration_taste import (
    TasteAudioTowerConfig,
    TasteConfig,
    TasteSpeechDecoderConfig,
    TasteSpokenLMConfig,
)

__all__ = [
    "TasteConfig",
    "TasteAudioTowerConfig",
    "TasteSpokenLMConfig",
    "TasteSpeechDecoderConfig",
]
