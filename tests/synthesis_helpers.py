"""Streaming synthesis of an utterance's tokens fed in pieces, as a reply's speech tokens arrive."""

from taste_speech.streaming.synthesis import speak


def speak_in_pieces(vg, state, tokens, sizes=(), default_size=1) -> list:
    """Every chunk of ``tokens`` (1, n) spoken in pieces of ``sizes`` (then ``default_size`` each),
    the final flush included."""
    chunks, position, sizes = [], 0, iter(sizes)
    while position < tokens.shape[1]:
        size = next(sizes, default_size)
        chunks += speak(vg, state, tokens[:, position:position + size])
        position += size
    return chunks + speak(vg, state, final=True)
