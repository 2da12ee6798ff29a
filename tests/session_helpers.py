"""A reply's speech through a TasteSession's two synthesis stages, as the plugin's processors run them."""

import numpy as np


def speak_segments(session, segments):
    """Speech tokens and audio of reply segments: the speech decoder, then the vocoder, per piece."""
    state = session.start_speech(16000)
    tokens, audio = [], []
    for seg in segments:
        for piece in session.speech_tokens(state, seg.segment):
            tokens += piece
            audio += session.vocode(state, piece)
    audio += session.vocode(state, [], final=True)
    return tokens, np.concatenate(audio)
