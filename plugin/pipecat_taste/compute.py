"""ComputeGate: how many model jobs of all calls run at once, admitted first come, first served.

Every call runs its stages (listening, thinking, speech tokens, vocoding) on worker threads of its
own. On a CPU with few cores, eight calls mean some thirty threads running model code: they do no
more work than two would, and they hold the GIL in turn, so the event loop that carries every
call's audio and WebRTC traffic waits behind them (measured: connections dropped because ICE
consent checks went unanswered; see BENCHMARKS.md section 6). The engine's gate lets ``slots``
jobs run and queues the others in arrival order; a queued thread sleeps and leaves the GIL to the
event loop.

A job is one blocking engine call (a reply's next segment - the first with its prefill - one
segment's speech tokens, one vocoder chunk, one transcription, a session's start or warm-up).
Jobs of different calls may wait for each other inside (a batched step gathers other calls'
rows, or waits for the step another thread is running; a shared tower or synthesis step waits for
announced work), but every such wait ends on its own - a gather is bounded in time, and a step
waited for is run by a thread already inside the gate - so the gate cannot deadlock.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager


class ComputeGate:
    """At most ``slots`` jobs inside at once; the others wait in arrival order."""

    def __init__(self, slots: int):
        if slots < 1:
            raise ValueError(f"a compute gate needs at least one slot, got {slots}")
        self.slots = slots
        self._cond = threading.Condition()
        self._free = slots
        self._next_ticket = 0  # the ticket the next arrival draws
        self._next_in = 0  # the ticket allowed in next
        self.jobs = 0
        self.waited_s = 0.0  # total time jobs spent queued (how overloaded the process is)
        self.max_wait_s = 0.0

    @contextmanager
    def slot(self):
        arrived = time.monotonic()
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            while ticket != self._next_in or self._free == 0:
                self._cond.wait()
            self._next_in += 1
            self._free -= 1
            self._cond.notify_all()  # the next ticket may go in too if a slot is free
            waited = time.monotonic() - arrived
            self.jobs += 1
            self.waited_s += waited
            self.max_wait_s = max(self.max_wait_s, waited)
        try:
            yield
        finally:
            with self._cond:
                self._free += 1
                self._cond.notify_all()

    def run(self, fn, *args):
        """``fn(*args)`` inside a slot (blocks the calling thread while queued)."""
        with self.slot():
            return fn(*args)

    @property
    def busy(self) -> int:
        """Jobs inside now."""
        with self._cond:
            return self.slots - self._free

    def stats(self) -> dict:
        with self._cond:
            # now: busy slots and jobs queued; since the start: jobs let in, their waits
            return {"slots": self.slots, "busy": self.slots - self._free, "queued": self._next_ticket - self._next_in,
                    "jobs_total": self.jobs,
                    "mean_wait_ms": round(1000 * self.waited_s / max(1, self.jobs), 2),
                    "max_wait_ms": round(1000 * self.max_wait_s, 2)}
