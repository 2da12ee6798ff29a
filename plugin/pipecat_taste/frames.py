"""Frames the TASTE processors exchange (besides Pipecat's own audio, text and TTS frames).

    TasteTurnCapture --TasteUserTurnFrame--> TasteGenerator --TasteReplySegmentFrame--> TasteSynthesizer
                                                             --TasteReplyEndFrame----->
    TasteSynthesizer --TTSStartedFrame, TTSAudioRawFrame(+TasteSegmentAudioFrame), TTSStoppedFrame--> TastePlayout
    TastePlayout --TastePlaybackFrame (upstream: what the caller actually heard)--> TasteGenerator

``turn_id`` ties everything to one user turn (and the reply to it); ids only grow during a call, so
a processor can drop anything that belongs to a turn it has already cancelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipecat.frames.frames import ControlFrame, DataFrame, SystemFrame


@dataclass
class TasteUserTurnFrame(DataFrame):
    """A captured and tokenized user turn, ready for the spoken LM.

    Uninterruptible: a barge-in must not lose what the user said (the conversation keeps it)."""

    turn_id: int
    transcript: str
    turn: Any  # engine's tokenized turn (pipecat_taste.engine.UserTurn)
    speech_start: float  # monotonic seconds: estimated start of speech (VAD start minus start_secs)
    speech_end: float  # monotonic seconds: estimated end of speech (VAD stop minus stop_secs)
    interruptible: bool = field(default=False, init=False)


@dataclass
class TasteTurnDecisionFrame(DataFrame):
    """The model's choice for a user turn: 'reply', 'no_speech' (keep listening), 'error' or 'ignored'."""

    turn_id: int
    decision: str
    reason: str = ""
    interruptible: bool = field(default=False, init=False)


@dataclass
class TasteReplySegmentFrame(DataFrame):
    """One emitted piece of the assistant's reply (one or more whole words)."""

    turn_id: int
    index: int
    text: str
    n_words: int
    segment: Any  # engine's segment object (a taste_speech TASTESegment for the real engine)


@dataclass
class TasteReplyEndFrame(ControlFrame):
    """No more segments for ``turn_id``: 'finished', 'truncated' (max length), 'cancelled' or 'error'."""

    turn_id: int
    reason: str
    n_segments: int


@dataclass
class TasteSegmentAudioFrame(DataFrame):
    """Placed by the synthesizer before a segment's first audio: where its audio starts and ends in
    the reply's output samples (``end_sample`` is known once its speech tokens are)."""

    turn_id: int
    index: int
    text: str
    n_words: int
    start_sample: int
    end_sample: int


@dataclass
class TastePlaybackFrame(SystemFrame):
    """Sent upstream by the playout when a reply has finished playing or was cut off: how much of
    it the caller heard, so the conversation keeps exactly those words."""

    turn_id: int
    played_words: int
    total_words: int
    played_samples: int
    interrupted: bool


@dataclass
class TasteTurnMetricsFrame(SystemFrame):
    """Per-turn figures (seconds), pushed downstream by the playout when a reply ends."""

    turn_id: int
    decision: str
    user_to_bot_s: float | None  # end of user speech -> first bot audio released to the transport
    reply_s: float  # duration of the bot audio that was played
    interrupted: bool
    barge_in_stop_s: float | None  # barge-in detected -> last bot audio sample released
