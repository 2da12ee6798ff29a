"""Frames the TASTE processors exchange (besides Pipecat's own audio, text and TTS frames).

    TasteTurnCapture --TasteUserTurnFrame--> TasteGenerator --TasteReplySegmentFrame--> TasteSynthesizer
                                                             --TasteReplyEndFrame----->
    TasteSynthesizer --TasteAudioStartedFrame, TTSAudioRawFrame(+TasteSegmentAudioFrame),
                       TasteAudioStoppedFrame--> TastePlayout
    TastePlayout --TastePlaybackFrame (upstream: what the caller actually heard)--> TasteGenerator

With a playout, only the playout tells the rest of the pipeline about a reply, as it is heard:
``LLMFullResponseStartFrame``, ``TTSStartedFrame``, per segment ``LLMTextFrame`` (not for the
context) and ``TTSTextFrame``, ``TTSStoppedFrame``, ``LLMFullResponseEndFrame``. (Observers such as
RTVI report a frame where it is first pushed, and an assistant aggregator after the output
transport must see the End after the reply's last heard word.)

Early replies: the capture may hand a turn on after a short silence, before the VAD confirms
its end (``TasteUserTurnFrame.tentative``); the generator tells the processors after it with a
``TasteTurnStatusFrame`` 'tentative'. The capture then says what became of the turn with another
('confirmed': the VAD confirmed the end; 'retracted': the caller went on speaking). The
generator holds the reply's announcement frames and the playout its audio until the turn is
confirmed; a retracted turn's reply is dropped everywhere and forgotten by the conversation.

Barge-in (``TurnCaptureParams.barge_in='pause'``): the capture sends a ``TasteReplyPauseFrame``
when the caller speaks over a reply; the playout holds the reply until a second one resumes it (the
speech had no words) or an ``InterruptionFrame`` cuts it off (it had).

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
    turn: Any  # engine's tokenized turn (pipecat_taste.session.UserTurn)
    speech_start: float  # monotonic seconds: estimated start of speech (VAD start minus start_secs)
    speech_end: float  # monotonic seconds: estimated end of speech (VAD stop minus stop_secs)
    tentative: bool = False  # handed on early: a TasteTurnStatusFrame will confirm or retract it
    interruptible: bool = field(default=False, init=False)


TURN_STATUSES = ("tentative", "confirmed", "retracted")


@dataclass
class TasteTurnStatusFrame(DataFrame):
    """A user turn handed on early: 'tentative' (from the generator: its reply must wait), then
    from the capture 'confirmed' (the VAD confirmed the end of the turn: the reply may be heard)
    or 'retracted' (the caller went on speaking: drop the reply)."""

    turn_id: int
    status: str
    interruptible: bool = field(default=False, init=False)

    def __post_init__(self):
        super().__post_init__()
        if self.status not in TURN_STATUSES:
            raise ValueError(f"status must be one of {TURN_STATUSES}, got {self.status!r}")


@dataclass
class TasteReplyPauseFrame(SystemFrame):
    """From the capture (``barge_in='pause'``): the caller's speech ``by_turn`` pauses the reply
    being played (``paused``; the playout fades it out and holds it), then, once the speech proves
    to have no words, resumes it (``paused=False``; the playout fades it back in where it stopped).
    Speech with words cuts the reply off with an ``InterruptionFrame`` instead. A system frame: it
    must not wait behind the reply's audio."""

    by_turn: int
    paused: bool


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
    # The back-pressure semaphore the generator took a place in for it (the synthesizer gives the
    # place back to this one: after a barge-in the generator has a new one)
    slot: Any = None


@dataclass
class TasteReplyEndFrame(ControlFrame):
    """No more segments for ``turn_id``: 'finished', 'truncated' (max length), 'cancelled' or 'error'."""

    turn_id: int
    reason: str
    n_segments: int


@dataclass
class TasteAudioStartedFrame(ControlFrame):
    """From the synthesizer: the audio of ``turn_id``'s reply follows (private: the playout sends
    the ``TTSStartedFrame`` when the reply is heard)."""

    turn_id: int


@dataclass
class TasteAudioStoppedFrame(ControlFrame):
    """From the synthesizer: the last audio of ``turn_id``'s reply went before it."""

    turn_id: int


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
