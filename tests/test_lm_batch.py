"""LMStepBatch: the decode steps of several conversations run as one batched step, on CPU.

Every hidden state a conversation gets from its slot must equal what a cache of its own (the
growing one) gives - whichever other slots take part in a step, sit idle in its range, or are
being prefilled - through crops, closing, running out of slots and outgrowing the capacity. The
steps run eagerly and after the warm-up protocol a CUDA-graph capture goes through ('rehearse')."""

import copy
import threading
import time

import pytest
import torch

from concurrency_helpers import run_in_threads
from taste_speech.batched_steps import BatchedSteps
from taste_speech.lm_batch import LMStepBatch, SlotLMCache
from taste_speech.lm_cache import StaticLMCache
from taste_speech.verify.points_spoken_lm import load_golden_spoken_lm

TOLERANCE = 1e-5  # float32 rounding of batched vs single-row matmuls


@pytest.fixture(scope="module")
def lm(taste_lm_tiny_a):
    return load_golden_spoken_lm(str(taste_lm_tiny_a)).spoken_lm


def random_rows(lm, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, n, lm.causal_lm.config.hidden_size, generator=g) * 0.5


class Reference:
    """The same rows through a growing cache of their own."""

    def __init__(self, lm):
        self.lm, self.state = lm, lm.new_decode_state(cache=lm.new_cache("dynamic"))

    def feed(self, rows):
        with torch.no_grad():
            return self.lm.feed(self.state, rows)


def feed(lm, state, rows):
    with torch.no_grad():
        return lm.feed(state, rows)


@pytest.mark.parametrize("graph_mode", ["eager", "rehearse"])
def test_one_batched_step_equals_each_conversation_alone(lm, graph_mode):
    """Slots 0 and 2 step together; slot 1 (idle, inside the step's range) and slot 3 keep their
    rows: their later steps still equal their references."""
    batch = LMStepBatch(lm, slots=4, capacity=300, graph_mode=graph_mode)
    batch.warm_up()
    rows = [random_rows(lm, 60, seed) for seed in range(4)]
    states = [lm.new_decode_state(cache=batch.open()) for _ in range(4)]  # slots 0..3
    refs = [Reference(lm) for _ in range(4)]
    assert [s.cache.slot for s in states] == [0, 1, 2, 3]
    for i, (state, ref) in enumerate(zip(states, refs)):  # different history lengths per slot
        n = 10 + 9 * i
        assert (feed(lm, state, rows[i][:, :n]) - ref.feed(rows[i][:, :n])).abs().max() < TOLERANCE
    # with graphs a slot's prefill runs the stager's captured bucket (32 rows here), eagerly otherwise
    assert (batch._stager is None) == (graph_mode == "eager")
    assert batch.staged_prefills == (0 if graph_mode == "eager" else 4)

    # One step for slots 0 and 2 only (it covers slots 0..3): slot 0's step waits for slot 2's
    # row, as for two calls that stepped together last time.
    for slot in (0, 2):  # both due within 5 s: whichever comes first waits for the other
        batch._served[slot], batch._work[slot] = time.perf_counter(), 5.0
    out = {}
    other = threading.Thread(target=lambda: out.update({2: feed(lm, states[2], rows[2][:, 28:29])}))
    other.start()
    out[0] = feed(lm, states[0], rows[0][:, 10:11])
    other.join()
    assert batch.steps_run == 1 and batch.rows_stepped == 2
    for slot, n in [(0, 10), (2, 28)]:
        assert states[slot].length == n + 1  # its length moved on by one row
        assert (out[slot] - refs[slot].feed(rows[slot][:, n:n + 1])).abs().max() < TOLERANCE
    assert batch.length(1) == 19 and batch.length(3) == 37  # idle slots: untouched

    for i, n in enumerate([11, 19, 29, 37]):  # every slot goes on, one step each
        for t in range(n, n + 5):
            got = feed(lm, states[i], rows[i][:, t:t + 1])
            assert (got - refs[i].feed(rows[i][:, t:t + 1])).abs().max() < TOLERANCE, (i, t)
    # a new turn after a history (its prefill starts at row 24, staged with graphs), then a step
    got = feed(lm, states[1], rows[1][:, 24:44])
    assert (got - refs[1].feed(rows[1][:, 24:44])).abs().max() < TOLERANCE
    assert (feed(lm, states[1], rows[1][:, 44:45]) - refs[1].feed(rows[1][:, 44:45])).abs().max() < TOLERANCE
    assert batch.staged_prefills == (0 if graph_mode == "eager" else 5)
    assert batch.length(0) == 16 and batch.length(2) == 34  # the others' rows untouched


@pytest.mark.parametrize("graph_mode", ["eager", "rehearse"])
def test_concurrent_conversations_get_their_own_results(lm, graph_mode):
    """Four threads decode at once (prefill, 40 steps, a crop and re-feed): each gets its
    reference's hidden states, and every step served some row (steps <= rows stepped)."""
    batch = LMStepBatch(lm, slots=4, capacity=300, graph_mode=graph_mode)
    results = {}
    start = threading.Barrier(4)

    def conversation(seed):
        rows = random_rows(lm, 80, seed)
        state = lm.new_decode_state(cache=batch.open())
        hidden = [feed(lm, state, rows[:, :12 + seed])]
        start.wait(timeout=60)  # a thread that failed before it must not hang the others
        for t in range(12 + seed, 52 + seed):
            hidden.append(feed(lm, state, rows[:, t:t + 1]))
        state.crop(30)
        for t in range(30, 35):
            hidden.append(feed(lm, state, rows[:, t:t + 1]))
        state.cache.close()
        results[seed] = torch.cat(hidden)

    run_in_threads(conversation, [(seed,) for seed in range(4)])
    for seed in range(4):
        rows, ref = random_rows(lm, 80, seed), Reference(lm)
        expected = [ref.feed(rows[:, :12 + seed])] + [ref.feed(rows[:, t:t + 1]) for t in range(12 + seed, 52 + seed)]
        ref.state.crop(30)
        expected += [ref.feed(rows[:, t:t + 1]) for t in range(30, 35)]
        assert (results[seed] - torch.cat(expected)).abs().max() < TOLERANCE, seed
    stats = batch.stats()
    assert stats["rows_stepped"] == 4 * 45 and 1 <= stats["steps"] <= 4 * 45
    assert stats["slots_in_use"] == 0


def test_slots_are_given_back_and_a_full_batch_falls_back_to_a_private_cache(lm):
    batch = LMStepBatch(lm, slots=2, capacity=300, graph_mode="eager")
    a, b = batch.open(), batch.open()
    assert (a.slot, b.slot) == (0, 1) and a.batched and b.batched
    c = batch.open()  # no slot left: a cache of its own, same results
    assert not c.batched and isinstance(c.private, StaticLMCache) and batch.slots_in_use == 2
    rows, ref = random_rows(lm, 20, 5), Reference(lm)
    state = lm.new_decode_state(cache=c)
    assert (feed(lm, state, rows[:, :15]) - ref.feed(rows[:, :15])).abs().max() < TOLERANCE
    assert (feed(lm, state, rows[:, 15:16]) - ref.feed(rows[:, 15:16])).abs().max() < TOLERANCE

    a.close()
    assert batch.slots_in_use == 1 and batch.open().slot == 0  # the lowest free slot again
    with pytest.raises(RuntimeError, match="closed"):
        feed(lm, lm.new_decode_state(cache=a), rows[:, :1])
    a.close()  # twice is fine


def test_outgrowing_the_capacity_leaves_the_batch_without_losing_rows(lm):
    batch = LMStepBatch(lm, slots=2, capacity=64, graph_mode="eager")
    rows, ref = random_rows(lm, 100, 7), Reference(lm)
    state = lm.new_decode_state(cache=batch.open())
    assert (feed(lm, state, rows[:, :60]) - ref.feed(rows[:, :60])).abs().max() < TOLERANCE
    for t in range(60, 64):
        assert (feed(lm, state, rows[:, t:t + 1]) - ref.feed(rows[:, t:t + 1])).abs().max() < TOLERANCE
    assert state.cache.batched and batch.slots_in_use == 1
    got = feed(lm, state, rows[:, 64:65])  # row 65 does not fit: continues in a private cache
    assert (got - ref.feed(rows[:, 64:65])).abs().max() < TOLERANCE
    assert not state.cache.batched and batch.slots_in_use == 0 and state.length == 65
    assert (feed(lm, state, rows[:, 65:90]) - ref.feed(rows[:, 65:90])).abs().max() < TOLERANCE


def test_a_copy_holds_no_slot_and_equals_the_original(lm):
    batch = LMStepBatch(lm, slots=1, capacity=128, graph_mode="eager")
    rows = random_rows(lm, 40, 9)
    state = lm.new_decode_state(cache=batch.open())
    feed(lm, state, rows[:, :30])
    twin = copy.deepcopy(state)
    assert isinstance(twin.cache, StaticLMCache) and batch.slots_in_use == 1 and twin.length == 30
    for (ka, va), (kb, vb) in zip(state.cache.keys_values(), twin.cache.keys_values()):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert (feed(lm, state, rows[:, 30:31]) - feed(lm, twin, rows[:, 30:31])).abs().max() < TOLERANCE


def test_a_slot_closed_while_its_step_runs_is_freed_when_the_step_ends(lm):
    batch = LMStepBatch(lm, slots=1, capacity=64, graph_mode="eager")
    cache = batch.open()
    rows = random_rows(lm, 8, 3)
    state = lm.new_decode_state(cache=cache)
    feed(lm, state, rows[:, :4])
    inside, release = threading.Event(), threading.Event()
    original = batch._run

    def slow_run(waiting):  # the step is running (another thread) when the conversation ends
        inside.set()
        release.wait(10)
        return original(waiting)

    batch._run = slow_run
    worker = threading.Thread(target=feed, args=(lm, state, rows[:, 4:5]))
    worker.start()
    assert inside.wait(10)
    cache.close()
    other = batch.open()  # the slot is still written to: nobody may take it yet
    assert not other.batched
    release.set()
    worker.join(10)
    assert batch.slots_in_use == 0 and batch.open().batched


def test_a_failing_step_fails_its_rows_and_the_batch_goes_on(lm):
    batch = LMStepBatch(lm, slots=2, capacity=64, graph_mode="eager")
    rows, ref = random_rows(lm, 10, 4), Reference(lm)
    state = lm.new_decode_state(cache=batch.open())
    feed(lm, state, rows[:, :5])
    ref.feed(rows[:, :5])
    with pytest.raises(RuntimeError):
        feed(lm, state, torch.zeros(1, 1, 3))  # a row of the wrong width
    assert state.length == 5 and batch.stats()["slots_in_use"] == 1
    assert (feed(lm, state, rows[:, 5:6]) - ref.feed(rows[:, 5:6])).abs().max() < TOLERANCE


@pytest.mark.parametrize("kwargs, match", [
    (dict(slots=0), "slots"), (dict(slots=True), "slots"), (dict(capacity=0), "capacity"),
    (dict(graph_mode="fast"), "mode"), (dict(graph_mode="graph"), "CUDA"),
])
def test_bad_settings_are_refused(lm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LMStepBatch(lm, **kwargs)


def test_a_conversation_of_another_model_is_refused(lm, tiny_model):
    batch = LMStepBatch(lm, slots=1, capacity=64, graph_mode="eager")
    from taste_speech.streaming import Conversation

    with pytest.raises(ValueError, match="another model"):
        Conversation(tiny_model[0], tiny_model[1], lm_batch=batch)


def test_slot_cache_type(lm):
    batch = LMStepBatch(lm, slots=1, capacity=64, graph_mode="eager")
    assert isinstance(batch.open(), SlotLMCache)


class LaunchOnly(BatchedSteps):
    """Steps that return at once, as a CUDA graph's launch does: the decodes' time goes into reading
    the result and working on it, between the steps."""

    name = "launch only"

    def _run(self, batch):
        return dict(batch)


class Decode:
    """An owner of a slot (held weakly by the batch)."""


def step_in_turn(steps, slot, owner, rounds, host_s, start=None):
    if start is not None:
        start.wait()
    for i in range(rounds):
        assert steps._step(slot, owner, i) == i
        time.sleep(host_s)  # the read of the result and the host's work on it


def test_decodes_whose_work_between_steps_outlasts_the_step_still_step_together():
    """The steps take no time (a CUDA graph's launch), the decodes' threads 5 and 15 ms between
    them (the read, the sampling): each step waits for the decode due by its own work, so the two
    step together, at the slower one's pace. (Waiting a fraction of the step's own time, they ran
    about one to a step.)"""
    steps = LaunchOnly(slots=2, gather=0.5)
    owners = [Decode(), Decode()]
    slots = [steps._acquire(owner) for owner in owners]
    start = threading.Barrier(2)
    run_in_threads(step_in_turn, [(steps, slots[0], owners[0], 30, 0.005, start),
                                  (steps, slots[1], owners[1], 30, 0.015, start)])
    stats = steps.stats()
    assert stats["rows_stepped"] == 60 and stats["mean_batch"] >= 1.4 and stats["gather_waits"] > 10, stats


def test_a_thread_stepping_several_slots_in_turn_does_not_wait_for_its_own():
    """One thread alternating two decodes (two conversations driven round-robin): the step of one
    cannot wait for the other, whose input only this thread can give."""
    steps = LaunchOnly(slots=2, gather=1.0)
    owners = [Decode(), Decode()]
    slots = [steps._acquire(owner) for owner in owners]
    took = []

    def round_robin():
        started = time.perf_counter()
        for i in range(40):
            for slot, owner in zip(slots, owners):
                assert steps._step(slot, owner, i) == i
            time.sleep(0.001)
        took.append(time.perf_counter() - started)

    driver = threading.Thread(target=round_robin, daemon=True)  # (waiting for itself, it would never end)
    driver.start()
    driver.join(timeout=30)
    assert took, "the round robin never ended"
    assert steps._work[slots[0]] > 0 and steps._work[slots[1]] > 0  # (due: each would be waited for...)
    assert steps.stats()["gather_waits"] == 0  # (... were it another thread's)


def test_a_decode_that_stopped_or_paused_is_not_waited_for_long():
    """A decode that stopped stepping (its reply ended; its slot stays open) is waited for until
    gather x its work past its due time, then no more; one that comes back after a pause is not
    then waited for as long as its pause."""
    steps = LaunchOnly(slots=2, gather=1.0)
    owners = [Decode(), Decode()]
    slots = [steps._acquire(owner) for owner in owners]
    run_in_threads(step_in_turn, [(steps, slots[0], owners[0], 10, 0.003), (steps, slots[1], owners[1], 10, 0.003)])
    assert 0 < max(steps._work) < 0.1
    before = steps.stats()["gather_waits"]
    for i in range(3):  # slot 1 stays open but does not come: waited for once, until it was overdue
        steps._step(slots[0], owners[0], i)
    assert steps.stats()["gather_waits"] - before <= 1
    time.sleep(0.5)  # a pause of both, then slot 1 once more: its work stays its work, not the pause
    steps._step(slots[1], owners[1], 0)
    assert steps._work[slots[1]] < 0.1  # (so slot 0's steps wait at most 1.5 x that for it, not 0.5 s)
    before = steps.stats()["gather_waits"]
    for i in range(3):
        steps._step(slots[0], owners[0], i)
    assert steps.stats()["gather_waits"] - before <= 1


class InterruptibleCondition(threading.Condition):
    """The batch's lock, whose waits raise KeyboardInterrupt in the thread named by ``interrupt``
    (as Ctrl-C does in a main thread waiting for its step). Waits poll, so the interrupt reaches a
    thread already waiting; the batch treats an early return as a spurious wake-up."""

    interrupt = None

    def wait(self, timeout=None):
        if threading.get_ident() == self.interrupt:
            self.interrupt = None
            raise KeyboardInterrupt
        return super().wait(0.01 if timeout is None else min(timeout, 0.01))


class HeldSteps(LaunchOnly):
    """Steps that run until released, noting which thread ran each."""

    def __init__(self, slots):
        super().__init__(slots, gather=0.0)
        self._lock = InterruptibleCondition()
        self.started, self.release, self.runners = threading.Semaphore(0), threading.Semaphore(0), []

    def _run(self, batch):
        self.runners.append((threading.get_ident(), sorted(batch)))
        self.started.release()
        assert self.release.acquire(timeout=10)
        return dict(batch)


def test_a_decode_interrupted_while_another_thread_runs_its_step_gets_no_stale_result():
    """Two decodes' inputs are in one step that one of their threads runs; the other thread is
    interrupted while it waits. The slot stays in use until that step ends (it still writes the
    slot), and the step's result does not become the answer to the slot's next step."""
    steps = HeldSteps(slots=3)
    owners = [Decode() for _ in range(3)]
    slots = [steps._acquire(owner) for owner in owners]
    answers, idents = {}, {}

    def step(i, payload):
        idents[i] = threading.get_ident()
        try:
            answers[i] = steps._step(slots[i], owners[i], payload)
        except KeyboardInterrupt as interrupt:
            answers[i] = interrupt

    first = threading.Thread(target=step, args=(2, "first"))  # a step that holds the lock's turn...
    first.start()
    assert steps.started.acquire(timeout=10)
    others = [threading.Thread(target=step, args=(i, f"stale {i}")) for i in (0, 1)]
    for thread in others:  # ... while both inputs come in: the next step takes both
        thread.start()
    deadline = time.monotonic() + 10
    while len(steps._waiting) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    steps.release.release()
    assert steps.started.acquire(timeout=10)
    runner, batch = steps.runners[-1]
    assert batch == [0, 1]
    interrupted = next(i for i in (0, 1) if idents[i] != runner)
    steps._lock.interrupt = idents[interrupted]
    while steps._lock.interrupt is not None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)
    assert isinstance(answers.get(interrupted), KeyboardInterrupt)
    steps._release(slots[interrupted])  # its decode ends, but the running step still writes the slot
    assert steps.slots_in_use == 3
    steps.release.release()
    for thread in [first] + others:
        thread.join(10)
    runner_slot = 1 - interrupted
    assert answers[runner_slot] == f"stale {runner_slot}" and answers[2] == "first"
    assert steps.slots_in_use == 2  # freed once the step ended
    newcomer = Decode()
    slot = steps._acquire(newcomer)
    assert slot == slots[interrupted]
    steps.release.release()
    assert steps._step(slot, newcomer, "fresh") == "fresh"  # not the old owner's result


def test_without_gather_a_step_never_waits():
    steps = LaunchOnly(slots=2, gather=0.0)
    owners = [Decode(), Decode()]
    slots = [steps._acquire(owner) for owner in owners]
    steps._served[slots[1]], steps._work[slots[1]] = time.perf_counter(), 5.0  # due, but not waited for
    assert steps._step(slots[0], owners[0], "x") == "x"
    assert steps.stats()["gather_waits"] == 0


@pytest.mark.parametrize("gather, steps", [(1.0, 1), (0.0, 2)])
def test_a_step_waits_for_the_calls_of_the_previous_step(lm, gather, steps):
    """Slots 0 and 1 stepped together last time; now slot 1's row comes 50 ms after slot 0's.
    With gather, slot 0's step waits for it (one step serves both); without, they run apart."""
    batch = LMStepBatch(lm, slots=2, capacity=64, graph_mode="eager", gather=gather)
    rows = [random_rows(lm, 10, seed) for seed in (0, 1)]
    states = [lm.new_decode_state(cache=batch.open()) for _ in rows]
    for state, r in zip(states, rows):
        feed(lm, state, r[:, :5])
    batch._served[1], batch._work[1] = time.perf_counter(), 5.0  # as if its work between steps took 5 s
    late = threading.Thread(target=lambda: (time.sleep(0.05), feed(lm, states[1], rows[1][:, 5:6])))
    late.start()
    feed(lm, states[0], rows[0][:, 5:6])
    late.join()
    assert batch.stats()["steps"] == steps and batch.stats()["rows_stepped"] == 2
    assert states[0].length == states[1].length == 6
