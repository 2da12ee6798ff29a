"""Announcements: whose work is coming soon, so that a step shared by the calls can wait for it.

On a GPU a shared step's host part is only its launches: calls whose inputs come a few
milliseconds apart never find each other in a queue, and each runs a step of its own - launch
bound, about as long for one row as for eight. So a call announces the work it is about to bring
(a reply that started speaking: its first flow window; a turn that ended: its audio tower pass),
and the step that finds announced work missing waits for it, at most a bounded time (a step's
own time: waiting longer would cost the early calls more than a step of its own costs the late
one). Whoever did not come in time is forgotten - its work will wait for nobody - and an owner
that was garbage collected (a call that ended) is never waited for.

An :class:`Announcements` belongs to one shared step (``SynthesisGraphs``, ``EncoderGraph``) and is
guarded by that step's lock; owners are held weakly. :class:`StepTimer` keeps how long that step
takes on its device (the GPU's time on CUDA, read from events once they have passed; the host's
elsewhere), which bounds the waits.
"""

from __future__ import annotations

import time
import weakref
from typing import Callable

import torch

# The longest a step ever waits for announced work, whatever its measured time says (a step timed
# while it was being captured - lazily, after a failed warm-up - reads far longer than it runs).
MAX_WAIT_S = 0.2


class Announcements:
    def __init__(self):
        self._owners: dict[int, weakref.ref] = {}  # id(owner) -> weakref
        self.waits = 0  # steps that waited for announced work
        self.waited_s = 0.0  # and how long, in all
        self.ran_out = 0  # of those, the waits that ended at their time limit with work still missing

    def add(self, owner) -> None:
        self._owners[id(owner)] = weakref.ref(owner)

    def arrive(self, owner) -> bool:
        """``owner``'s work came: True if it had been announced (it is no longer awaited)."""
        return self._owners.pop(id(owner), None) is not None

    def withdraw(self, owner) -> None:
        """``owner``'s announced work will not come (it was given up): nothing waits for it."""
        self._owners.pop(id(owner), None)

    def pending(self, here: Callable[[], set[int]] = set) -> int:
        """Announced owners still alive whose work has not come. ``here()``: the ids of owners with
        other work already queued (a call's partial transcript when its turn ends): their
        announced work comes only after that, so it is not waited for."""
        for key in [key for key, ref in self._owners.items() if ref() is None]:
            del self._owners[key]
        return len(self._owners.keys() - here()) if self._owners else 0

    def gather(self, lock, seconds: float, enough: Callable[[], bool] = lambda: False,
               here: Callable[[], set[int]] = set) -> None:
        """(``lock`` - a Condition - held; its ``notify_all`` must follow every arrival.) Wait until
        no announced work is missing (``pending``), ``enough()`` (the step is full) or ``seconds``
        (at most ``MAX_WAIT_S``) have passed; then forget the announcements left."""
        seconds = min(seconds, MAX_WAIT_S)
        if self.pending(here) and seconds > 0:
            started = time.perf_counter()
            deadline = started + seconds
            while self.pending(here) and not enough():
                if (left := deadline - time.perf_counter()) <= 0:
                    self.ran_out += 1
                    break
                lock.wait(left)
            self.waits += 1
            self.waited_s += time.perf_counter() - started
        self._owners.clear()

    def stats(self) -> dict:
        return {"waits": self.waits, "waited_ms": round(1000 * self.waited_s, 1), "waits_ran_out": self.ran_out}


class StepTimer:
    """How long the last timed step took on its device. On CUDA a step is timed with events (the
    host only launches it) and read once the GPU has passed them, without waiting; elsewhere the
    host time given to :meth:`stop` is the step's time."""

    def __init__(self):
        self.seconds = 0.0
        self._pending = None  # CUDA: (start, end) of the last step not read yet

    def start(self, device: torch.device):
        """Before a step (on the stream it runs on): a token for ``stop`` (None off CUDA)."""
        if device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event, device

    def stop(self, token, host_seconds: float) -> None:
        """After the step: ``host_seconds`` is its time off CUDA."""
        if token is None:
            self.seconds = host_seconds
            return
        start, device = token
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(device))
        self._pending = (start, end)

    def measured(self, seconds: float) -> None:
        """A time measured by the caller (a synchronised run at warm-up)."""
        self.seconds, self._pending = seconds, None

    def last(self) -> float:
        if self._pending is not None and self._pending[1].query():
            start, end = self._pending
            self.seconds = start.elapsed_time(end) / 1000
            self._pending = None
        return self.seconds
