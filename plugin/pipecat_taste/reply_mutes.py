"""ReplyMutes: which turns get no reply because the caller spoke again before it began.

A turn's reply that has not begun when the caller speaks again (``min_speech_secs`` of speech)
would talk over the caller: the turn gets none and the new turn answers for both. But that new
speech may prove to be no turn at all (a noise the STT finds no words in): had its mute stood, the
earlier turn would go unanswered and the call fall silent. So a mute is provisional until its
turn is settled - kept when the turn is handed on with words (or the call ends), lifted when it
is not (no words, or it failed) - and the generator waits for that verdict before it treats a turn
as muted. A turn handed on early is settled when the VAD confirms it; taken back, its mute moves to
the speech that goes on.

One object per call (``TasteCall.mutes``); the capture mutes and settles, the generator asks.
"""

from __future__ import annotations

import asyncio


class ReplyMutes:
    def __init__(self):
        self._upto: dict[int, int] = {}  # muting turn -> the last turn it mutes
        self._unsettled: set[int] = set()  # muting turns not yet known to be answerable speech
        self._changed = asyncio.Event()

    @property
    def upto(self) -> int:
        """The latest turn muted, settled or not (0: none)."""
        return max(self._upto.values(), default=0)

    def mute(self, by_turn: int) -> None:
        """``by_turn`` has enough speech: the turns before it get no reply (once it is settled)."""
        self._upto[by_turn] = by_turn - 1
        self._unsettled.add(by_turn)
        self._changed.set()

    def move(self, old_turn: int, new_turn: int) -> None:
        """The speech of ``old_turn`` goes on as ``new_turn`` (an early hand-over taken back): its
        mute goes with it."""
        if old_turn in self._upto:
            del self._upto[old_turn]
            self._unsettled.discard(old_turn)
            self.mute(new_turn)

    def settle(self, turn: int, keep: bool) -> None:
        """``turn`` is finished: its mute stands (``keep``: it will be answered, or the call ends) or
        is lifted (it was no turn to answer). A turn that muted nothing is ignored."""
        if turn not in self._unsettled:
            return
        self._unsettled.discard(turn)
        if not keep:
            del self._upto[turn]
        self._changed.set()

    async def muted(self, turn: int) -> bool:
        """Whether ``turn`` gets no reply: a later turn that will be answered muted it. While only
        unsettled turns mute it, wait for their verdicts."""
        while True:
            by = [t for t, upto in self._upto.items() if upto >= turn]
            if any(t not in self._unsettled for t in by):
                return True
            if not by:
                return False
            self._changed.clear()
            await self._changed.wait()
