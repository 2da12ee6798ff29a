"""BatchedSteps: slots for many decodes of one model, and their one-row steps run as one batch.

The bookkeeping shared by ``LMStepBatch`` (spoken LM) and ``SpeechStepBatch`` (speech decoder):
each decode (a call's conversation, a call's speech) holds a slot; a thread that wants one step
puts its input in the waiting set and the first thread that finds no step running runs one step
for every waiting input (``_run``, the subclass's batched forward) and wakes the others -
continuous batching without a scheduler thread. Before it runs it waits for the decodes due
soon: each decode's work between two steps (from its result handed back to its next input: the
read, the sampling, the next input made) says when its next input is due, and a step waits for
it until ``gather`` x that work past then. Without the wait the decodes take turns instead of
stepping together. (Its own work, not a step's time: on a GPU a replayed step is shorter than
that work, and waits of a fraction of the step's time gathered nothing - on the H100 eight calls'
speech-decoder steps ran 1.16 to a step. Not the time between its inputs either: that includes
its waits in other steps' gathers, and one call's pause would then slow every call's pace.)

A step covers the first n slots, n a power of two (slots are handed out lowest first); the
subclass's ``_decode(n)`` runs it from static buffers, replayed as one CUDA graph per n on CUDA
(``StepGraph``; ``warm_up()`` captures them all before the first call).

A slot is given back by ``_release``, or when its owner is garbage collected (owners are held
weakly: a decode dropped without ``close()`` must not keep its slot for ever); while a step or a
prefill of it is still running (another thread) it stays reserved and is freed when that work
ends, so nothing writes into a slot that a new owner already uses.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref

import torch

from taste_speech.step_graph import StepGraph


class SlotsBusy(RuntimeError):
    """Every slot holds a decode."""


class _Releasing:
    """Owner of a slot whose decode ended while work on it was still running."""


_RELEASING = _Releasing()


class BatchedSteps:
    def __init__(self, slots: int, gather: float = 0.5):
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an integer >= 1, got {slots!r}")
        if not 0 <= gather <= 1:
            raise ValueError(f"gather must be a fraction of a decode's work between steps, between 0 and 1, "
                             f"got {gather!r}")
        self.slots, self.gather = slots, float(gather)
        self.sizes = step_sizes(slots)  # steps cover the first n slots, n one of these
        self._lock = threading.Condition()
        self._owners: list[object | None] = [None] * slots  # None, _RELEASING or a weakref to the owner
        self._lengths = [0] * slots  # positions each slot holds
        self._busy = [0] * slots  # steps and prefills of the slot in flight
        self._waiting: dict[int, object] = {}
        self._running: dict[int, object] = {}  # the inputs of the step running now
        self._finished: dict[int, object] = {}
        self._abandoned: set[int] = set()  # slots whose thread left while their input was in the running step
        self._stepping = False
        self._served: list[float | None] = [None] * slots  # when each slot's last step handed its result back
        self._last_work = [0.0] * slots  # each slot's latest time from its result to its next input
        self._work = [0.0] * slots  # each slot's work between steps (see _arrive); 0: not known yet
        self._threads: list[int | None] = [None] * slots  # the thread that gave each slot's latest input
        self._prefills = [0] * slots  # prefills of the slot in flight (``_using``)
        self._graphs: dict[int, StepGraph] = {}
        self.steps_run = 0  # batched steps so far
        self.rows_stepped = 0  # decode steps they served
        self.gather_waits = 0  # steps that waited for a due decode's input

    # -- to implement ------------------------------------------------------------------------------
    # Subclasses set ``device``, ``graph_mode``, ``capacity`` and ``_positions`` (a (slots,) device
    # tensor: each slot's write position in a step; ``capacity`` = the scratch position).
    name = "step"

    def _run(self, batch: dict[int, object]) -> dict[int, object]:
        """One batched step for ``{slot: input}`` (lock not held; each slot's owner is waiting, so
        nothing else moves its length); returns ``{slot: output}``."""
        raise NotImplementedError

    def _decode(self, n: int):
        """The step over the first ``n`` slots, from static buffers (what a graph captures)."""
        raise NotImplementedError

    # -- one graph per step size -------------------------------------------------------------------
    def _graph(self, n: int) -> StepGraph:
        # Capturing at a first real step is safe too: its warm-up runs write the same rows twice.
        if n not in self._graphs:
            self._graphs[n] = StepGraph(lambda: self._decode(n), self.device, self.graph_mode,
                                        name=f"{self.name} x{n}")
        return self._graphs[n]

    @torch.no_grad()
    def warm_up(self) -> None:
        """Capture every step size now, before calls run (capturing while other threads use the
        GPU is what ``StepGraph`` must otherwise guard against); a no-op without graphs."""
        if self.graph_mode == "eager":
            return
        with self._exclusive():
            self._positions.fill_(self.capacity)  # every slot writes the scratch position only
            for n in self.sizes:
                self._graph(n).run()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # (not the device: see lm_batch)

    # -- slots -------------------------------------------------------------------------------------
    @property
    def slots_in_use(self) -> int:
        with self._lock:
            return sum(owner is not None for owner in self._owners)

    def stats(self) -> dict:
        with self._lock:
            return {"slots": self.slots, "slots_in_use": sum(o is not None for o in self._owners),
                    "steps": self.steps_run, "rows_stepped": self.rows_stepped,
                    "mean_batch": round(self.rows_stepped / self.steps_run, 3) if self.steps_run else None,
                    "gather_waits": self.gather_waits,
                    "graphs": sorted(n for n, g in self._graphs.items() if g.captured)}

    def length(self, slot: int) -> int:
        return self._lengths[slot]

    def set_length(self, slot: int, length: int) -> None:
        with self._lock:
            self._lengths[slot] = length

    def step_size(self, batch) -> int:
        """The smallest step size covering every slot of ``batch``."""
        return next(size for size in self.sizes if size > max(batch))

    def _acquire(self, owner) -> int:
        """The lowest free slot (steps then cover fewer slots); raises SlotsBusy."""
        with self._lock:
            for slot, held in enumerate(self._owners):
                if held is None and not self._busy[slot]:
                    ref = weakref.ref(owner)
                    self._owners[slot], self._lengths[slot] = ref, 0
                    self._served[slot], self._last_work[slot], self._work[slot], self._threads[slot] = (
                        None, 0.0, 0.0, None)
                    # dropped without close(); not at exit, where a daemon thread may hold the lock
                    weakref.finalize(owner, self._release_dead, slot, ref).atexit = False
                    return slot
        raise SlotsBusy(f"all {self.slots} slots hold a decode")

    def _release(self, slot: int) -> None:
        with self._lock:
            self._owners[slot] = _RELEASING if self._busy[slot] else None

    def _release_dead(self, slot: int, ref: weakref.ref) -> None:
        """The owner behind ``ref`` was garbage collected: free its slot, unless it was given back
        (and maybe handed to a new owner) already."""
        with self._lock:
            if self._owners[slot] is ref:
                self._owners[slot] = _RELEASING if self._busy[slot] else None

    def _owner(self, slot: int):
        """(Lock held.) The live owner of ``slot``, or None."""
        held = self._owners[slot]
        return held() if isinstance(held, weakref.ref) else None

    def _enter(self, slot: int, owner) -> None:
        if self._owner(slot) is not owner:
            raise RuntimeError("this cache was closed (its call ended): open a new one")
        self._busy[slot] += 1

    def _leave(self, slot: int) -> None:
        self._busy[slot] -= 1
        if not self._busy[slot] and self._owners[slot] is _RELEASING:
            self._owners[slot] = None

    @contextlib.contextmanager
    def _using(self, slot: int, owner):
        """Work on one slot outside a batched step (a prefill): the slot cannot be freed meanwhile."""
        with self._lock:
            self._enter(slot, owner)
            self._prefills[slot] += 1
        try:
            yield
        finally:
            with self._lock:
                self._prefills[slot] -= 1
                self._leave(slot)

    # -- steps -------------------------------------------------------------------------------------
    def _step(self, slot: int, owner, payload):
        """One step of ``slot`` in the next batched step; returns its output (or raises the step's error)."""
        with self._lock:
            self._enter(slot, owner)
            self._waiting[slot] = payload
            self._arrive(slot, time.perf_counter())
            self._lock.notify_all()  # a step gathering its inputs may be waiting for this one
            try:
                while slot not in self._finished:
                    if self._stepping:
                        self._lock.wait()
                        continue
                    self._stepping = True
                    try:
                        self._gather_inputs()
                    except BaseException:  # (an interrupt in the wait: another thread steps)
                        self._stepping = False
                        self._lock.notify_all()
                        raise
                    batch, self._waiting = self._waiting, {}
                    self._running = batch
                    self._lock.release()
                    try:
                        results = self._run(batch)
                        failed = None
                    except BaseException as error:  # every input of this step fails; later steps may not
                        results, failed = {s: error for s in batch}, error
                    finally:
                        self._lock.acquire()
                        self._stepping, self._running = False, {}
                    served = time.perf_counter()
                    for s in batch:
                        self._served[s] = served
                    if failed is None:
                        self.steps_run += 1
                        self.rows_stepped += len(batch)
                        for s in batch:
                            self._lengths[s] += 1
                    for s in self._abandoned & batch.keys():  # nobody waits for these results
                        self._abandoned.discard(s)
                        results.pop(s)
                        self._leave(s)
                    self._finished.update(results)
                    self._lock.notify_all()
                result = self._finished.pop(slot)
            finally:
                self._waiting.pop(slot, None)
                if slot in self._running:
                    # Left early (an interrupt in the wait) while another thread runs a step with this
                    # input: that step still writes the slot, so the slot stays in use until it ends,
                    # and its result must not reach the slot's next step (or next owner).
                    self._abandoned.add(slot)
                else:
                    self._finished.pop(slot, None)  # (a result that came as the interrupt did)
                    self._leave(slot)
        if isinstance(result, BaseException):
            raise result
        return result

    def _arrive(self, slot: int, now: float) -> None:
        """(Lock held.) ``slot``'s input came at ``now``, from the calling thread. Its work between
        steps is the shorter of its last two times from a result to the next input: a pause
        (between replies, between segments) makes one long time, not its work - waiting for a
        decode as long as its pause would stall the others."""
        served = self._served[slot]
        if served is not None:
            work, previous = now - served, self._last_work[slot]
            self._work[slot] = min(work, previous) if previous else 0.0
            self._last_work[slot] = work
        self._threads[slot] = threading.get_ident()

    def _gather_inputs(self) -> None:
        """(Lock held.) Wait until every slot due soon has its input in: a slot is due its work's
        time after its result came back, and waited for until ``gather`` x its work past that. Not
        waited for: slots of the calling thread (it cannot give their inputs while it waits here),
        slots in a prefill (``_using``), closed ones."""
        if not self.gather:
            return
        me, waited = threading.get_ident(), False
        while True:
            now = time.perf_counter()
            deadlines = [self._served[s] + (1 + self.gather) * self._work[s] for s in range(self.slots)
                         if self._work[s] and s not in self._waiting and not self._prefills[s]
                         and self._threads[s] != me and self._owner(s) is not None]
            last = max((d for d in deadlines if d > now), default=None)
            if last is None:
                return
            if not waited:
                self.gather_waits, waited = self.gather_waits + 1, True
            self._lock.wait(last - now)

    @contextlib.contextmanager
    def _exclusive(self):
        """No step runs inside (e.g. while the subclass captures its step graphs)."""
        with self._lock:
            if self._stepping:
                raise RuntimeError("a step is running: do this before any decode steps")
            self._stepping = True
        try:
            yield
        finally:
            with self._lock:
                self._stepping = False
                self._lock.notify_all()


class SlotCache:
    """A decode's cache in a slot of a ``BatchedSteps``. It continues in a private cache of its
    own (the subclass's ``_new_private`` / ``_private_copy``) when no slot is free or it would
    outgrow the batch's ``capacity``: slower, never wrong. ``close()`` gives the slot back (so does
    its garbage collection)."""

    def __init__(self, batch: BatchedSteps):
        self.batch, self.closed = batch, False
        self.private = None  # where it continues once it left the batch
        try:
            self.slot: int | None = batch._acquire(self)
        except SlotsBusy:
            self.slot = None
            self.private = self._new_private()

    @property
    def batched(self) -> bool:
        """Whether its steps join the batch (False once it left it)."""
        return self.private is None and not self.closed

    @property
    def length(self) -> int:
        return self.private.length if self.private is not None else self.batch.length(self.slot)

    def close(self) -> None:
        """Give the slot back (deferred until a step or prefill of this cache still running ends)."""
        if self.closed:
            return
        self.closed = True
        if self.private is None:
            self.batch._release(self.slot)
        self.private = None

    def _check_open(self) -> None:
        """A closed cache's slot may be another call's by now: it must not be touched."""
        if self.closed:
            raise RuntimeError(f"this {type(self).__name__} was closed (its call ended): open a new one")

    def _use_private(self, t: int) -> bool:
        """Before feeding ``t`` positions: whether they go to the private cache (leaving the batch
        now if they would not fit)."""
        self._check_open()
        if self.private is None and self.length + t > self.batch.capacity:
            self.private = self._private_copy()
            self.batch._release(self.slot)
        return self.private is not None

    def _new_private(self):
        raise NotImplementedError

    def _private_copy(self):
        """A private cache holding this slot's positions."""
        raise NotImplementedError


def step_sizes(slots: int) -> list[int]:
    """1, 2, 4 ... up to ``slots`` (included): the batch sizes a step is built for."""
    sizes, n = [], 1
    while n < slots:
        sizes.append(n)
        n *= 2
    return sizes + [slots]
