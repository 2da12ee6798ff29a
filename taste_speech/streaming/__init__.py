"""Streaming API of taste_speech: listen (``taste_tokenize``), think (``streaming_generate`` with a
per-call ``Conversation``) and speak (``taste_detokenize``).

    from taste_speech.streaming import taste_tokenize, streaming_generate, TASTESegment, taste_detokenize
"""

from taste_speech.streaming.conversation import Conversation, ConversationState
from taste_speech.streaming.detokenize import finish_speaking, taste_detokenize, taste_detokenize_stream
from taste_speech.streaming.generate import (
    PendingWord,
    ReplyIterator,
    at_punctuation,
    every_n_words,
    every_word,
    streaming_generate,
    vocabulary_tables,
)
from taste_speech.streaming.prompt import CONTINUATION, DIALOGUE, FORMATS, INSTRUCT
from taste_speech.streaming.segment import TASTESegment
from taste_speech.streaming.synthesis import SynthesisFailed
from taste_speech.streaming.synthesis_state import EmissionPolicy
from taste_speech.streaming.tokenize import taste_tokenize

__all__ = [
    "TASTESegment", "taste_tokenize", "streaming_generate", "Conversation", "ConversationState", "PendingWord",
    "ReplyIterator",
    "every_word", "every_n_words", "at_punctuation", "vocabulary_tables",
    "CONTINUATION", "INSTRUCT", "DIALOGUE", "FORMATS", "taste_detokenize",
    "taste_detokenize_stream", "finish_speaking", "EmissionPolicy", "SynthesisFailed",
]
