"""Streaming API of taste_speech: listen (taste_tokenize), think (streaming_generate with a
per-call Conversation) and speak (taste_detokenize)."""

from taste_speech.streaming.conversation import Conversation, ConversationSnapshot
from taste_speech.streaming.generate import at_punctuation, every_n_words, every_word, streaming_generate
from taste_speech.streaming.prompt import CONTINUATION, DIALOGUE
from taste_speech.streaming.segment import TASTESegment

__all__ = [
    "TASTESegment", "streaming_generate", "Conversation", "ConversationSnapshot",
    "every_word", "every_n_words", "at_punctuation", "CONTINUATION", "DIALOGUE",
]

try:  # parts written in their own modules
    from taste_speech.streaming.tokenize import taste_tokenize  # noqa: F401
    __all__.append("taste_tokenize")
except ImportError:  # pragma: no cover
    pass
try:
    from taste_speech.streaming.detokenize import taste_detokenize  # noqa: F401
    __all__.append("taste_detokenize")
except ImportError:  # pragma: no cover
    pass
