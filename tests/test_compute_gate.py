"""pipecat_taste.compute.ComputeGate: the engine-wide limit on model jobs running at once."""

import asyncio
import gc
import threading
import time
import weakref

import pytest

from pipecat_taste.call import TasteCall
from pipecat_taste.compute import ComputeGate
from pipecat_taste.engine import TasteEngine, _check_options, _compute_gate
from pipecat_taste.testing import FakeEngine


def test_needs_a_slot():
    with pytest.raises(ValueError, match="at least one slot"):
        ComputeGate(0)


def test_never_more_jobs_inside_than_slots():
    gate = ComputeGate(2)
    inside, most = 0, 0
    lock = threading.Lock()

    def job():
        nonlocal inside, most
        with lock:
            inside += 1
            most = max(most, inside)
        time.sleep(0.02)
        with lock:
            inside -= 1

    threads = [threading.Thread(target=gate.run, args=(job,)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most == 2  # the gate filled both slots and never a third
    stats = gate.stats()
    assert stats["jobs_total"] == 8 and stats["queued"] == 0 and stats["busy"] == gate.busy == 0
    with gate.slot():  # (busy and queued are now; jobs_total counts since the start)
        assert gate.stats()["busy"] == 1 and gate.stats()["jobs_total"] == 9
    assert stats["max_wait_ms"] > 0  # some jobs had to queue


def _wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.002)


def test_queued_jobs_go_in_in_arrival_order():
    gate = ComputeGate(1)
    release = threading.Event()
    holder = threading.Thread(target=gate.run, args=(release.wait,))
    holder.start()
    _wait_until(lambda: gate.busy == 1)
    order = []
    threads = []
    for i in range(6):  # each one queued before the next arrives
        t = threading.Thread(target=gate.run, args=(order.append, i))
        t.start()
        threads.append(t)
        _wait_until(lambda: gate.stats()["queued"] == i + 1)
    release.set()
    for t in [holder, *threads]:
        t.join()
    assert order == list(range(6))


def _queue(gate, owner, order, label, queued_before):
    """A thread whose job (under ``owner``) notes ``label``; returns once it is queued."""
    thread = threading.Thread(target=gate.run, args=(order.append, label), kwargs={"owner": owner})
    thread.start()
    _wait_until(lambda: gate.stats()["queued"] == queued_before + 1)
    return thread


@pytest.mark.parametrize("fair", [True, False])
def test_a_call_holding_a_slot_waits_behind_one_holding_none(fair):
    """A long reply's stages fill both slots and queue a third job; another call's vocoder chunk,
    queued after it, goes in first when a slot frees (in arrival order: after it)."""
    gate = ComputeGate(2, fair=fair)
    releases = [threading.Event(), threading.Event()]
    holders = [threading.Thread(target=gate.run, args=(r.wait,), kwargs={"owner": "long reply"}) for r in releases]
    for h in holders:
        h.start()
    _wait_until(lambda: gate.busy == 2)
    order = []
    threads = [_queue(gate, "long reply", order, "long reply's third", 0),
               _queue(gate, "other call", order, "other call's chunk", 1)]
    releases[0].set()
    _wait_until(lambda: len(order) == 2)  # both went in: the other holder still holds its slot
    releases[1].set()
    for t in holders + threads:
        t.join()
    first = "other call's chunk" if fair else "long reply's third"
    assert order[0] == first, order


def test_with_one_slot_the_calls_take_turns():
    """The slot goes round the calls, each call's own jobs in their order, where arrival order
    would run one call's whole queue first."""
    gate = ComputeGate(1)
    release = threading.Event()
    holder = threading.Thread(target=gate.run, args=(release.wait,), kwargs={"owner": "a"})
    holder.start()
    _wait_until(lambda: gate.busy == 1)
    order, threads = [], []
    for i, (owner, label) in enumerate([("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1"), ("b", "b2"), ("c", "c1")]):
        threads.append(_queue(gate, owner, order, label, i))
    release.set()
    for t in [holder, *threads]:
        t.join()
    # b and c were never let in: they go first (in arrival order), then the one let in longest ago
    assert order == ["b1", "c1", "a1", "b2", "a2", "a3"], order


def test_the_gate_keeps_no_call_alive():
    """Whose turn it is is remembered only while a call has jobs inside or queued: an ended call is
    not held by the engine's gate."""
    class Call:
        pass

    gate, call = ComputeGate(2), Call()
    ref = weakref.ref(call)
    threads = [threading.Thread(target=gate.run, args=(time.sleep, 0.01), kwargs={"owner": call}) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    del call, threads
    gc.collect()
    assert ref() is None


def test_a_failing_job_frees_its_slot():
    gate = ComputeGate(1)

    def boom():
        raise RuntimeError("model error")

    with pytest.raises(RuntimeError, match="model error"):
        gate.run(boom)
    assert gate.busy == 0
    assert gate.run(lambda x: x + 1, 1) == 2  # the next job is not stuck behind it


def test_calls_run_their_jobs_through_the_engines_gate():
    engine = FakeEngine()
    engine.compute_gate = ComputeGate(1)
    call = TasteCall(engine)

    async def main():
        seen = await asyncio.gather(*(call.run(stage, lambda: engine.compute_gate.busy)
                                      for stage in ("listen", "think", "speech_tokens", "vocode")))
        await call.close()
        return seen

    assert asyncio.run(main()) == [1, 1, 1, 1]  # each ran inside the gate's one slot
    assert engine.compute_gate.stats()["jobs_total"] == 4


def test_two_calls_jobs_take_turns_in_the_engines_gate():
    """Each call's jobs are its own in the gate: a call's job queued after three of another call's
    goes in second, not last."""
    engine = FakeEngine()
    gate = engine.compute_gate = ComputeGate(1)
    talker, other = TasteCall(engine), TasteCall(engine)
    release = threading.Event()
    holder = threading.Thread(target=gate.run, args=(release.wait,))
    order = []

    async def queued(n):
        while gate.stats()["queued"] < n:
            await asyncio.sleep(0.002)

    async def main():
        holder.start()
        while gate.busy < 1:
            await asyncio.sleep(0.002)
        jobs = []
        for i, stage in enumerate(("think", "speech_tokens", "vocode")):
            jobs.append(asyncio.ensure_future(talker.run(stage, order.append, f"talker {stage}")))
            await queued(i + 1)
        jobs.append(asyncio.ensure_future(other.run("vocode", order.append, "other vocode")))
        await queued(4)
        release.set()
        await asyncio.gather(*jobs)
        await talker.close()
        await other.close()

    asyncio.run(main())
    holder.join()
    assert order == ["talker think", "other vocode", "talker speech_tokens", "talker vocode"], order


def test_engine_gate_settings():
    import os

    auto = _compute_gate("auto", "cpu")
    assert isinstance(auto, ComputeGate) and auto.slots == len(os.sched_getaffinity(0))
    assert _compute_gate("auto", "cuda:0") is None  # jobs mostly wait for the GPU there
    assert _compute_gate(None, "cpu") is None
    assert _compute_gate(3, "cpu").slots == 3
    for bad in (0, "four", 2.5, True):  # refused before any weights load
        with pytest.raises(ValueError, match="parallel_jobs must be an integer >= 1"):
            _check_options(None, "auto", bad, None)
        with pytest.raises(ValueError, match="parallel_jobs must be an integer >= 1"):
            TasteEngine.from_pretrained("/no/such/checkpoint", parallel_jobs=bad)



def test_the_cli_option():
    from taste_agents.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["serve"]).parallel_jobs == "auto"
    assert parse(["serve", "--parallel-jobs", "3"]).parallel_jobs == 3
    assert parse(["call", "--simulate", "--parallel-jobs", "none"]).parallel_jobs is None
    assert parse(["serve"]).batch_slots == "auto"
    assert parse(["serve", "--batch-slots", "8"]).batch_slots == 8
    assert parse(["serve", "--batch-slots", "none"]).batch_slots is None
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            parse(["serve", "--parallel-jobs", bad])


def test_threads_per_job_settings_and_the_cli_option():
    from pipecat_taste.engine import _threads_per_job
    from taste_agents.cli import build_parser

    from types import SimpleNamespace

    def model(hidden):
        return SimpleNamespace(config=SimpleNamespace(text_config=SimpleNamespace(hidden_size=hidden)))

    tiny, full = model(64), model(2048)
    assert _threads_per_job("auto", "cpu", tiny) == 1  # small operators (BENCHMARKS.md section 12)
    assert _threads_per_job("auto", "cpu", full) is None  # large ones gain from the cores
    assert _threads_per_job("auto", "cuda:0", tiny) is None and _threads_per_job(None, "cpu", tiny) is None
    assert _threads_per_job(3, "cpu", full) == 3
    for bad in (0, "one", 1.5, True):  # refused before any weights load
        with pytest.raises(ValueError, match="threads_per_job must be an integer >= 1"):
            TasteEngine.from_pretrained("/no/such/checkpoint", threads_per_job=bad)
    parse = build_parser().parse_args
    assert parse(["serve"]).threads_per_job == "auto"
    assert parse(["call", "--simulate", "--threads-per-job", "none"]).threads_per_job is None
    assert parse(["serve", "--threads-per-job", "4"]).threads_per_job == 4


def test_a_calls_stage_threads_run_with_the_engines_threads_per_job():
    import torch

    engine = FakeEngine()
    before = torch.get_num_threads()  # (1 under the test suite: conftest)
    engine.threads_per_job = before + 1  # a count the threads would not have anyway
    call = TasteCall(engine)

    def threads_in_a_new_thread(threads=None):
        seen = []
        worker = threading.Thread(target=lambda: (threads and torch.set_num_threads(threads),
                                                  seen.append(torch.get_num_threads())))
        worker.start()
        worker.join()
        return seen[0]

    async def main():
        seen = await asyncio.gather(*(call.run(stage, torch.get_num_threads)
                                      for stage in ("listen", "think", "speech_tokens", "vocode")))
        await call.close()
        return seen

    try:
        assert asyncio.run(main()) == [before + 1] * 4
    finally:
        threads_in_a_new_thread(before)  # (torch keeps it per process: the next tests get theirs back)
    assert threads_in_a_new_thread() == before
