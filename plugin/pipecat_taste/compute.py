"""ComputeGate: how many model jobs of all calls run at once, each call getting its turn.

Every call runs its stages (listening, thinking, speech tokens, vocoding) on worker threads of its
own. On a CPU with few cores, eight calls mean some thirty threads running model code: they do no
more work than two would, and they hold the GIL in turn, so the event loop that carries every
call's audio and WebRTC traffic waits behind them (measured: connections dropped because ICE
consent checks went unanswered; see BENCHMARKS.md section 6). The engine's gate lets ``slots``
jobs run and queues the others; a queued thread sleeps and leaves the GIL to the
event loop.

Which queued job goes in next is a matter of fairness between calls: a call holding a slot already
waits behind one holding none, and among equals the call let in longest ago goes first (round
robin), then arrival order. In strict arrival order, a call speaking a long reply queues its
next jobs (a segment, its speech tokens, a vocoder chunk) back to back, and another call's turn
or next audio chunk waits behind all of them (``benchmarks/bench_compute_gate.py``).

A job is one blocking engine call (a reply's next segment - the first with its prefill - one
segment's speech tokens, one vocoder chunk, one transcription, a session's start or warm-up).
Jobs of different calls may wait for each other inside (a batched step gathers other calls'
rows, or waits for the step another thread is running; a shared tower or synthesis step waits for
announced work), but every such wait ends on its own - a gather is bounded in time, and a step
waited for is run by a thread already inside the gate - so the gate cannot deadlock.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from contextlib import contextmanager


class ComputeGate:
    """At most ``slots`` jobs inside at once; the others wait, each call in its turn (``fair``:
    fewest jobs inside first, then the call let in longest ago, then arrival) or, with
    ``fair=False``, in arrival order alone."""

    def __init__(self, slots: int, fair: bool = True):
        if slots < 1:
            raise ValueError(f"a compute gate needs at least one slot, got {slots}")
        self.slots, self.fair = slots, fair
        self._cond = threading.Condition()
        self._free = slots
        self._tickets = itertools.count()  # arrival order
        self._waiting: list[tuple[int, object]] = []  # (ticket, owner) of the jobs queued
        self._inside = collections.Counter()  # owner -> its jobs inside now
        self._last_in: dict[object, int] = {}  # owner -> the admission count when it last went in
        self.jobs = 0
        self.waited_s = 0.0  # total time jobs spent queued (how overloaded the process is)
        self.max_wait_s = 0.0

    def _next_in_line(self) -> tuple[int, object]:
        if not self.fair:
            return self._waiting[0]
        # (an owner never let in sorts first; it is forgotten when its last job leaves the gate
        # with none queued, so a gate serving many calls over its life keeps no record of them)
        return min(self._waiting, key=lambda w: (self._inside[w[1]], self._last_in.get(w[1], -1), w[0]))

    @contextmanager
    def slot(self, owner=None):
        """Hold one slot while inside. ``owner``: whose job this is (a call; any hashable): jobs
        without one count as one owner."""
        arrived = time.monotonic()
        with self._cond:
            me = (next(self._tickets), owner)
            self._waiting.append(me)
            while self._free == 0 or self._next_in_line() is not me:
                self._cond.wait()
            self._waiting.remove(me)
            self._free -= 1
            self._inside[owner] += 1
            self._last_in[owner] = self.jobs
            self._cond.notify_all()  # the next in line may go in too if a slot is free
            waited = time.monotonic() - arrived
            self.jobs += 1
            self.waited_s += waited
            self.max_wait_s = max(self.max_wait_s, waited)
        try:
            yield
        finally:
            with self._cond:
                self._free += 1
                self._inside[owner] -= 1
                if not self._inside[owner]:
                    del self._inside[owner]
                    if all(w[1] != owner for w in self._waiting):
                        self._last_in.pop(owner, None)
                self._cond.notify_all()

    def run(self, fn, *args, owner=None):
        """``fn(*args)`` inside a slot (blocks the calling thread while queued)."""
        with self.slot(owner):
            return fn(*args)

    @property
    def busy(self) -> int:
        """Jobs inside now."""
        with self._cond:
            return self.slots - self._free

    def stats(self) -> dict:
        with self._cond:
            # now: busy slots and jobs queued; since the start: jobs let in, their waits
            return {"slots": self.slots, "busy": self.slots - self._free, "queued": len(self._waiting),
                    "jobs_total": self.jobs,
                    "mean_wait_ms": round(1000 * self.waited_s / max(1, self.jobs), 2),
                    "max_wait_ms": round(1000 * self.max_wait_s, 2)}
