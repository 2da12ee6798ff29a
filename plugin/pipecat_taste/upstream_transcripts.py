"""An upstream STT's words, routed to the capture's turns: which turn they belong to, and when a
turn has all of them.

An STT upstream of ``TasteTurnCapture`` sends ``TranscriptionFrame``s at its own pace: often after
the caller's turn has ended, sometimes after the next one has begun, sometimes in parts. The
routing rule: the oldest closed turn still collecting its words takes the next transcript, else
the turn being captured. A closed turn collects parts until one marked ``finalized`` arrives after
its speech ended, or ``quiet_secs`` pass without one; an STT seen to mark no part finalized (many
of Pipecat's send one transcript per turn) has its turns taken at their first words, unless it
sent parts while the caller spoke (a streaming STT: more may follow, and are waited for). A turn
handed on early waits from the VAD's confirmation of its end, not from its early close. Words that
no turn takes wait for the next turn, which keeps them only if they came after its speech began:
older ones are late words of a turn already taken, and are logged and dropped. So are words that
come, while no closed turn waits, within the transcript timeout of a turn the built-in ASR took
instead (``absorb``): they are that turn's, late, not the words of the turn being spoken. A turn
not answered (an 'mm-hm' over the agent's reply) stops taking words at once: words an STT sends for
it after the caller's next turn began go to that turn (by their arrival they cannot be told from
its own words, which a segmented STT may finalize while the caller still speaks; a word too many
is the lesser evil than a phrase of the turn lost). A turn
split at the length limit takes no words once the part that went on has ended (``spent``): they are
the whole speech's, and go to that last part, which is answered. A split speech takes its words
from one source: after a part the built-in ASR transcribed, the capture has the ASR transcribe the
next part too, and drops the STT's words for it. A part after a split too short to be a turn
``stands_alone``: the part before it answers for the speech, with the STT's words.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Callable

from loguru import logger
from pipecat.frames.frames import TranscriptionFrame

# A turn's words beyond this are dropped: two minutes of the fastest speech (a long speech split at
# the length limit gets all its words in its last part) hold fewer. More is a client or STT gone
# wrong, whose turn would only be refused after seconds of compute.
MAX_TURN_TRANSCRIPT_CHARS = 4000
# Why an upstream transcript that came while no turn was captured is dropped.
UNCLAIMED = "no turn claimed it (the VAD heard no speech there)"


@dataclass
class TurnWords:
    """What an upstream STT said of one turn (its ``TranscriptionFrame`` texts, as they arrive)."""

    parts: list[tuple[float, str]] = field(default_factory=list)  # (arrival time, text)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # set at each arrival
    # A turn that went on after a retracted early hand-over is complete only with words that came
    # after its (last) speech end: words about the speech before the pause do not finish it.
    continued: bool = False
    after: float | None = None
    # On the capture's sample clock: where the last part marked finalized arrived, and where the
    # turn's speech ended (set when the turn is closed, at closed_at).
    final_sample: int | None = None
    end_sample: int | None = None
    closed_at: float | None = None
    unconfirmed: bool = False  # handed on early, its end not yet confirmed by the VAD
    frames: list = field(default_factory=list)  # the STT's own TranscriptionFrames of these parts
    # Answered without its STT's words (the built-in ASR stepped in): words still coming for it until
    # then are dropped, never given to the next turn.
    absorb_until: float | None = None
    by_asr: bool = False  # (the built-in ASR transcribed it)
    # A turn closed at the length limit: the words of the part that goes on. Once that part ended, an
    # STT's words (one transcript for the whole speech, as a segmented STT sends) go to it.
    next_part: TurnWords | None = field(default=None, repr=False)
    previous_part: TurnWords | None = field(default=None, repr=False)

    def add(self, text: str, at: float, finalized: bool = False, sample: int = 0, frame=None) -> None:
        self.parts.append((at, text))
        if frame is not None:
            self.frames.append(frame)
        if finalized:
            self.final_sample = sample
        self.arrived.set()

    def close(self, now: float, speech_end: float, end_sample: int, words_follow: bool = True) -> None:
        """The turn's speech ended at ``speech_end`` (``end_sample``); the capture closed it at ``now``.
        ``words_follow``: a continued turn's speech after its retraction was long enough to hold
        words (not a click), so the STT's words for it are waited for."""
        if self.continued and words_follow:
            self.after = speech_end
        self.end_sample, self.closed_at = end_sample, now
        if self.previous_part is not None:
            self.previous_part.arrived.set()  # it is spent now: its wait is over

    def handed_on_early(self) -> None:
        """The turn was closed before the VAD's end (an early reply): until the VAD confirms it
        (``confirmed``) its words are not done but for a part finalized after the speech ended."""
        self.unconfirmed = True

    def confirmed(self, now: float) -> None:
        """The VAD confirmed the end of a turn handed on early, at ``now``. The STT's last words
        come after that - a Pipecat STT finalizes on the VAD's stop, which goes upstream only now -
        so the quiet wait runs from here, as for a turn closed at the VAD's end (an early hand-over
        must not cut the turn's transcript short)."""
        if self.unconfirmed:
            self.unconfirmed = False
            self.closed_at = max(self.closed_at or now, now)
            self.arrived.set()

    def goes_on_in(self, next_part: TurnWords) -> None:
        """This turn was closed at the length limit and its speech goes on as ``next_part``."""
        self.next_part, next_part.previous_part = next_part, self

    def stands_alone(self) -> None:
        """This part after a split is too short to be a turn (it is not answered): the part before
        it answers for the speech again and takes the STT's words, as an unsplit turn does."""
        previous, self.previous_part = self.previous_part, None
        if previous is not None:
            previous.next_part = None
            previous.arrived.set()  # (its wait for this part to end is over)

    def continuation(self) -> TurnWords:
        """The words of a turn whose early hand-over was retracted: the speech goes on as a new turn,
        with the words of the speech before the pause (an STT may also send them a little later), and
        their frames (they never went upstream: a retracted turn's transcript is not announced)."""
        return TurnWords(parts=list(self.parts), frames=list(self.frames), continued=True)

    @property
    def spent(self) -> bool:
        """A part of a split turn whose speech went on and has ended since: words arriving now are
        the whole speech's, and go to the last part (the one answered)."""
        return self.next_part is not None and self.next_part.closed_at is not None

    def complete(self) -> bool:
        return any(self.after is None or at > self.after for at, _ in self.parts)

    def done(self, now: float, quiet: float, finals_flagged: bool | None) -> bool:
        """No more parts are expected: the STT finalized one after the speech ended (one finalized
        while the caller went on speaking does not cover the rest), or none has come for ``quiet``
        seconds since the last part and the turn's close. Once the STT is known to mark no part
        finalized (``finals_flagged`` False), a turn whose words all came after its close is taken
        at its first words, without the wait."""
        if self.spent:
            return True
        if self.closed_at is None or not self.complete():
            return False
        if self.final_sample is not None and self.final_sample >= self.end_sample:
            return True
        if self.unconfirmed:
            return False
        if finals_flagged is False and self.parts[0][0] > self.closed_at:
            return True  # (one that sent parts while the caller spoke may send more after: it is waited for)
        return now - max(self.parts[-1][0], self.closed_at) >= quiet

    def text(self) -> str:
        return " ".join(text for _, text in self.parts)


class UpstreamTranscripts:
    """One call's routing of upstream transcripts to turns (module docstring). ``owner`` names the
    capture in log lines; dropped words are recorded in ``log`` (the call's ``CallLog``)."""

    def __init__(self, quiet_secs: float, log, owner: str = "TasteTurnCapture"):
        self.quiet_secs = quiet_secs
        self._log = log
        self._owner = owner
        self.seen = False  # an upstream transcript came in this call
        # Whether the STT marks the last part of a turn finalized: None until known (a part marked so
        # arrives: True; a turn's parts end without one: False).
        self.finals_flagged: bool | None = None
        self.collecting: collections.deque[TurnWords] = collections.deque()  # closed turns, oldest first
        self.ending = False  # the call is ending: no turn waits for more words
        self._unclaimed: tuple[float, str, TranscriptionFrame | None] | None = None  # (arrival, text, frame)

    def new_turn(self, now: float, start_secs: float) -> TurnWords:
        """The words of a turn whose speech the VAD confirmed at ``now`` (``start_secs`` after it began)."""
        words = TurnWords()
        unclaimed, self._unclaimed = self._unclaimed, None
        if unclaimed is not None:
            at, text, frame = unclaimed
            if now - at <= start_secs:  # an STT cannot transcribe speech before it began
                words.add(text, at, frame=frame)
            else:
                self.drop(text, UNCLAIMED)
        return words

    def _route(self, now: float) -> tuple[TurnWords | None, bool]:
        """Where words arriving now go: the closed turn still collecting words (None: none), and
        whether a closed turn absorbs its late ones (then they are no one's)."""
        self._forget_absorbed(now)
        taker = next((w for w in self.collecting
                      if w.absorb_until is None and not w.done(now, self.quiet_secs, self.finals_flagged)), None)
        return taker, any(w.absorb_until is not None and not w.spent for w in self.collecting)

    def for_current(self) -> bool:
        """Whether words arriving now are the turn being captured's (``add``'s routing)."""
        taker, absorbing = self._route(time.monotonic())
        return taker is None and not absorbing

    def add(self, text: str, finalized: bool, frame: TranscriptionFrame | None, sample: int,
            current: TurnWords | None) -> None:
        """A transcript arrived while the capture's sample clock read ``sample``; ``current`` is the
        turn being captured, if any."""
        self.seen = True
        text = (text or "").strip()
        if not text:
            return
        now = time.monotonic()
        if finalized:
            self.finals_flagged = True
        taker, absorbing = self._route(now)
        if taker is None and absorbing:
            # late words of a turn the built-in ASR took, not of the one being spoken: said as a warning,
            # as the turn was answered on other words than the STT's
            self.drop(text, "late words of a turn the built-in ASR transcribed (the capture stopped waiting for the "
                            "STT: first_transcript_grace_secs on the call's first turn, transcript_timeout_secs "
                            "later; TurnCaptureParams(transcripts='upstream') always waits for it)", warn=True)
            return
        if taker is None:
            taker = current
        held = sum(len(part) for _, part in taker.parts) if taker is not None else 0
        if held + len(text) > MAX_TURN_TRANSCRIPT_CHARS:
            self.drop(text, f"the turn's transcript would pass {MAX_TURN_TRANSCRIPT_CHARS} characters, more than "
                            "two minutes of speech")
            return
        if taker is not None:
            taker.add(text, now, finalized, sample, frame)
            return
        if self._unclaimed is not None:
            self.drop(self._unclaimed[1], UNCLAIMED)
        self._unclaimed = (now, text, frame)

    def expect(self, words: TurnWords) -> None:
        """A closed turn collects words until it is taken (``stop``)."""
        self.collecting.append(words)

    def stop(self, words: TurnWords) -> None:
        """The turn takes no more words (taken, ignored, failed or retracted); one that absorbs
        its late words (``absorb``) stays until its time is up."""
        if words.absorb_until is None:
            self.collecting = collections.deque(w for w in self.collecting if w is not words)

    def withdraw(self, words: TurnWords) -> None:
        """The turn was taken back (retracted: its speech goes on in a new turn, ``continuation``):
        it takes no more words, not even as late ones to drop - the STT's words for it are the next
        turn's now."""
        words.absorb_until = None
        self.stop(words)

    def absorb(self, words: TurnWords, seconds: float) -> None:
        """The turn goes on without its STT's words (the built-in ASR transcribes it): words that
        still come in the next ``seconds`` are its own, late, and are dropped."""
        now = time.monotonic()
        self._forget_absorbed(now)
        words.absorb_until = now + seconds
        words.by_asr = True
        if not any(w is words for w in self.collecting):
            self.collecting.append(words)

    def _forget_absorbed(self, now: float) -> None:
        self.collecting = collections.deque(w for w in self.collecting if w.absorb_until is None or w.absorb_until > now)

    def end_of_call(self) -> None:
        """What the STT had to say came before the end of the call: no turn waits any longer."""
        self.ending = True
        for words in self.collecting:
            words.arrived.set()
        if self._unclaimed is not None:
            self.drop(self._unclaimed[1], UNCLAIMED)
            self._unclaimed = None

    async def wait(self, words: TurnWords, wait_secs: Callable[[], float], retracted: asyncio.Event,
                   split_waits: bool = False) -> None:
        """Until all parts of the turn's transcript are in (``TurnWords.done``), the turn is
        retracted, the call ends, or ``wait_secs()`` (re-read: it may grow) have passed. With
        ``split_waits``, a part of a split turn waits until the part after it ends (an STT may
        send its words only then; the wait costs nothing: that part is finished after it)."""
        started, quiet = time.monotonic(), self.quiet_secs
        while not retracted.is_set() and not self.ending:
            now = time.monotonic()
            if words.done(now, quiet, self.finals_flagged):
                if self.finals_flagged is None and words.final_sample is None and not words.spent:
                    self.finals_flagged = False  # the parts ended without a final mark: it sets none
                return
            remaining = started + wait_secs() - now
            if split_waits and words.next_part is not None and not words.parts:
                remaining = None  # until the next part ends (``close`` wakes this wait)
            elif remaining <= 0:
                return
            elif words.complete() and not words.unconfirmed:
                remaining = min(remaining, max(words.parts[-1][0], words.closed_at) + quiet - now)
            words.arrived.clear()
            await _first_of(remaining, words.arrived, retracted)

    def drop(self, text: str, why: str = "late words of a turn already taken", warn: bool = False) -> None:
        if len(text) > 200:  # (the log keeps a preview of what was too long)
            text = f"{text[:200]}... ({len(text)} characters)"
        (logger.warning if warn else logger.info)(f"{self._owner}: dropped upstream transcript {text!r}: {why}")
        self._log.event("transcript_dropped", text=text)


async def _first_of(timeout: float | None, *events: asyncio.Event) -> None:
    """Wait until one of ``events`` is set, at most ``timeout`` seconds (None: no limit)."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
