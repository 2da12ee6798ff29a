"""Announcements: the bounded waits of shared steps for work that calls said is coming."""

import threading
import time

from taste_speech.announcements import MAX_WAIT_S, Announcements, StepTimer


class Owner:
    """A call (held weakly)."""


def test_pending_counts_live_owners_whose_work_is_not_here():
    announced, a, b, c = Announcements(), Owner(), Owner(), Owner()
    for owner in (a, b, c):
        announced.add(owner)
    assert announced.arrive(a) and not announced.arrive(a)  # came once; a second time it was not announced
    assert announced.pending() == 2
    assert announced.pending(lambda: {id(b)}) == 1  # b's other work is queued: its announced work comes after it
    del c, owner  # a call that ended
    assert announced.pending() == 1


def test_gather_ends_when_the_work_comes_and_forgets_who_did_not():
    lock, announced, late, never = threading.Condition(), Announcements(), Owner(), Owner()
    announced.add(late)

    def arrives():
        time.sleep(0.03)
        with lock:
            announced.arrive(late)
            lock.notify_all()

    threading.Thread(target=arrives).start()
    started = time.monotonic()
    with lock:
        announced.gather(lock, 5.0)
    assert time.monotonic() - started > 0.02 and announced.waits == 1
    assert announced.ran_out == 0  # ended by the arrival, not at the limit
    announced.add(never)
    waited = announced.waited_s
    with lock:
        announced.gather(lock, 0.05)  # it does not come: one bounded wait, then forgotten
    assert announced.pending() == 0 and announced.stats()["waits"] == 2
    assert announced.stats()["waits_ran_out"] == 1 and announced.waited_s - waited >= 0.05


def test_no_wait_without_announcements_and_never_longer_than_the_cap():
    lock, announced, owner = threading.Condition(), Announcements(), Owner()
    with lock:
        announced.gather(lock, 5.0)
    assert announced.waits == 0  # nobody announced: no wait at all
    announced.add(owner)
    started = time.monotonic()
    with lock:
        announced.gather(lock, 60.0)  # a step timed while it was captured: absurdly long
    assert time.monotonic() - started >= MAX_WAIT_S and announced.ran_out == 1  # capped, not 60 s (the test would hang)
    announced.add(owner)
    with lock:
        announced.gather(lock, 60.0, here=lambda: {id(owner)})  # its own work leads: nothing to wait for
    assert announced.waits == 1 and announced.pending() == 0


def test_the_step_timer_keeps_the_host_time_off_cuda():
    import torch

    timer = StepTimer()
    token = timer.start(torch.device("cpu"))
    timer.stop(token, 0.012)
    assert token is None and timer.last() == 0.012
    timer.measured(0.05)
    assert timer.last() == 0.05
