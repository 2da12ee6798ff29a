"""UtteranceBatcher: the transcriptions of calls whose turns end together, decoded as one batch.

When several callers stop speaking at the same moment, each call's listening thread asks the
shared transcriber for its turn's transcript. One by one, those are eight decodes in a row on a
GPU, each launch-bound (a draft check, then the tail token by token). As one batch
(``StaticWhisperDecoder.decode_many``) each step serves all eight, and in a launch-bound step a
row more costs little.

How the utterances meet (continuous batching without a scheduler thread, as ``EncoderGraph`` does
for its passes): every utterance joins one queue; a thread whose utterance is waiting and which
finds no other thread gathering becomes the leader, waits a little for the utterances announced
as coming (``expect``: a call whose turn ended, ``TurnTranscript.ended``; at most ``gather``
times a batch's last time, as ``taste_speech.announcements`` bounds it), takes up to ``rows`` of
the queue and decodes them (``decode(batch)``, lock not held); the others sleep until their result
is there. A batch being decoded does not hold the queue up: the next leader gathers the next one
meanwhile (a lone partial never waits for a batch it is not in). With ``rows`` 1 nobody waits for
anybody: each utterance is decoded by its own thread, as it comes.

A failed batch fails each of its utterances with the same exception (the transcriber then sends
each to ``generate``, and counts the failure once).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from taste_speech.announcements import Announcements, StepTimer
from taste_speech.encoder_graph import event_after_current_work


class Utterance:
    """One transcription waiting for its batch, and what it gets back."""

    __slots__ = ("features", "draft", "owner", "ready", "result")

    def __init__(self, features, draft, owner=None):
        self.features, self.draft, self.owner = features, draft, owner
        # CUDA: an event after the features were written on this thread's stream (the leader's
        # stream waits for it: calls may run on streams of their own)
        self.ready = event_after_current_work(features.device)
        self.result = None  # (ids, kept), or the exception its batch raised


class UtteranceBatcher:
    def __init__(self, decode: Callable[[list[Utterance]], list[tuple[list[int], int]]], rows: int,
                 gather: float = 1.0):
        """``decode(batch)``: the results of up to ``rows`` utterances, in order. ``gather``: how
        long a leader waits for announced utterances, in batches (its last batch's time; 0: never)."""
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows must be an integer >= 1, got {rows!r}")
        self._decode, self.rows, self.gather = decode, rows, float(gather)
        self._lock = threading.Condition()
        self._queue: list[Utterance] = []
        self._gathering = False
        self._ending = Announcements()  # calls whose turn ended and whose transcription has not come yet
        self._batch_time = StepTimer()  # host time: a decode returns token ids, so it has waited for the device
        self.batches = 0
        self.utterances = 0

    def expect(self, owner) -> None:
        """Announce ``owner``'s next utterance (its caller stopped speaking): a leader that starts
        before it comes waits for it a little. Held weakly."""
        if self.rows > 1 and self.gather:
            with self._lock:
                self._ending.add(owner)

    def withdraw(self, owner) -> None:
        """``owner``'s announced utterance will not come (the turn took an STT's words, or was
        given up): no leader waits for it."""
        with self._lock:
            self._ending.withdraw(owner)

    def transcribe(self, features, draft=(), owner=None) -> tuple[list[int], int]:
        """``(ids, kept)`` of one utterance, decoded in whichever batch takes it; raises its batch's error."""
        utterance = Utterance(features, draft, owner)
        with self._lock:
            self._ending.arrive(owner)
            self._queue.append(utterance)
            self._lock.notify_all()  # a leader may be waiting for this utterance
            while utterance.result is None:
                if self._gathering or utterance not in self._queue:  # another leader gathers, or took it
                    self._lock.wait()
                    continue
                batch = self._lead()
                self._lock.release()
                try:
                    self._run(batch)
                finally:
                    self._lock.acquire()
                    self._lock.notify_all()
        if isinstance(utterance.result, BaseException):
            raise utterance.result
        return utterance.result

    def timed(self, seconds: float) -> None:
        """Set a batch's time (how long a leader waits for announced utterances) by hand; each
        batch decoded sets it too."""
        self._batch_time.measured(seconds)

    def stats(self) -> dict:
        with self._lock:
            return {"rows": self.rows, "utterances": self.utterances, "batches": self.batches,
                    "mean_batch": round(self.utterances / self.batches, 3) if self.batches else None,
                    **self._ending.stats()}

    # -- internals ------------------------------------------------------------------------------
    def _lead(self) -> list[Utterance]:
        """(Lock held.) Wait for the announced utterances, then take the next batch off the queue."""
        self._gathering = True
        try:
            full = lambda: len(self._queue) >= self.rows  # noqa: E731
            # (a call whose partial is queued brings its announced finish only after that partial)
            here = lambda: {id(u.owner) for u in self._queue if u.owner is not None}  # noqa: E731
            seconds = self.gather * self._batch_time.last() if self.rows > 1 else 0.0
            self._ending.gather(self._lock, seconds, full, here)
        finally:
            self._gathering = False
            self._lock.notify_all()  # the next leader may gather now
        batch, self._queue = self._queue[:self.rows], self._queue[self.rows:]
        self.batches += 1
        self.utterances += len(batch)
        return batch

    def _run(self, batch: list[Utterance]) -> None:
        """Decode ``batch`` (lock not held); each utterance gets its result or the error."""
        started = time.perf_counter()
        interrupted = None
        try:
            results = list(self._decode(batch))
            if len(results) != len(batch):
                raise RuntimeError(f"a batch of {len(batch)} utterances was decoded into {len(results)} results")
        except Exception as error:
            results = [error] * len(batch)
        except BaseException as error:  # (the leader's thread is being stopped: it raises, the others fail)
            interrupted = error
            results = [RuntimeError(f"the thread decoding this batch stopped ({type(error).__name__})")] * len(batch)
        else:
            self._batch_time.measured(time.perf_counter() - started)
        for utterance, result in zip(batch, results):  # (every waiting thread must get an answer)
            utterance.result = result
        if interrupted is not None:
            raise interrupted
