"""UtteranceBatcher (pipecat_taste.asr_batches): where the calls' transcriptions meet.

The decode function here is a plain Python one that records its batches, so the tests see who
met whom; ``test_whisper_decode`` checks what a batch decodes (``StaticWhisperDecoder.decode_many``)
and ``test_asr_incremental`` the transcriber's batches of real turns.
"""

import threading
import time

import pytest
import torch

from concurrency_helpers import run_in_threads
from pipecat_taste.asr_batches import UtteranceBatcher


class Owner:  # a call (owners are held weakly)
    pass


def recording(batches, hold=None):
    """A decode that answers each utterance with its features' value and records the batch."""

    def decode(batch):
        batches.append([int(u.features) for u in batch])
        if hold is not None:
            hold(batch)
        return [([int(u.features)], len(u.draft)) for u in batch]

    return decode


def test_with_one_row_every_utterance_is_decoded_by_its_own_thread_at_once():
    """rows=1 (a CPU): two calls transcribing at the same moment decode side by side - the decode
    below finishes only when both are inside it - and nobody waits for an announced one."""
    batches, both_inside = [], threading.Barrier(2, timeout=5)
    batcher = UtteranceBatcher(recording(batches, lambda batch: both_inside.wait()), rows=1)
    owners = [Owner(), Owner()]
    for owner in owners:
        batcher.expect(owner)  # (ignored: with one row there is nothing to wait for)
    results = [None, None]

    def transcribe(i):
        results[i] = batcher.transcribe(torch.tensor(i), [7] * i, owners[i])

    run_in_threads(transcribe, [(0,), (1,)])
    assert results == [([0], 0), ([1], 1)]
    assert sorted(batches) == [[0], [1]]
    assert batcher.stats() == {"rows": 1, "utterances": 2, "batches": 2, "mean_batch": 1.0, "waits": 0,
                               "waited_ms": 0.0, "waits_ran_out": 0}


def test_announced_utterances_coming_apart_are_decoded_as_one_batch():
    """Three calls' turns end at once (announced); their utterances come 20 ms apart: the first
    one's thread waits for the others and decodes all three in one batch, and each call gets its
    own result back."""
    batches = []
    batcher = UtteranceBatcher(recording(batches), rows=4)
    batcher.timed(10.0)  # (a long limit, capped at MAX_WAIT_S: the wait must end because the others came)
    owners = [Owner() for _ in range(3)]
    for owner in owners:
        batcher.expect(owner)
    results = [None] * 3

    def transcribe(i):
        time.sleep(0.02 * i)
        results[i] = batcher.transcribe(torch.tensor(10 + i), [1] * i, owners[i])

    run_in_threads(transcribe, [(i,) for i in range(3)])
    assert results == [([10], 0), ([11], 1), ([12], 2)]
    assert batches == [[10, 11, 12]]
    stats = batcher.stats()
    assert (stats["utterances"], stats["batches"], stats["waits"], stats["waits_ran_out"]) == (3, 1, 1, 0)


def test_a_batch_takes_at_most_its_rows():
    """Five utterances waiting at once with rows=2: batches of 2, 2 and 1, every utterance answered."""
    batches, gate = [], threading.Event()
    batcher = UtteranceBatcher(recording(batches, lambda batch: gate.wait(5)), rows=2)
    results = [None] * 5

    def transcribe(i):
        results[i] = batcher.transcribe(torch.tensor(i))

    threads = [threading.Thread(target=transcribe, args=(i,)) for i in range(5)]
    for thread in threads:
        thread.start()
    time.sleep(0.2)  # all five queued behind the first batch, held at the gate
    gate.set()
    for thread in threads:
        thread.join(10)
    assert results == [([i], 0) for i in range(5)]
    assert len(batches) >= 3 and all(len(b) <= 2 for b in batches) and sorted(sum(batches, [])) == list(range(5))


def test_a_lone_utterance_does_not_wait_for_a_batch_being_decoded():
    """One call's batch is being decoded (held here until the other call's transcript is out): a
    partial of another call that comes meanwhile is decoded by its own thread at once."""
    batches, decoding, other_done, seen = [], threading.Event(), threading.Event(), []

    def hold(batch):
        if int(batch[0].features) == 0:
            decoding.set()
            seen.append(other_done.wait(5))  # False: the second utterance waited for this batch

    batcher = UtteranceBatcher(recording(batches, hold), rows=4)
    first = threading.Thread(target=batcher.transcribe, args=(torch.tensor(0),))
    first.start()
    assert decoding.wait(5)  # the first batch is being decoded
    assert batcher.transcribe(torch.tensor(1)) == ([1], 0)
    other_done.set()
    first.join(5)
    assert batches == [[0], [1]] and seen == [True]


def test_an_announced_utterance_that_never_comes_is_waited_for_a_bounded_time():
    """A call announced its turn and then hung up: the batch that waits for it gives up after its
    limit (``gather`` x the last batch's time), and the next batch does not wait again."""
    batcher = UtteranceBatcher(recording([]), rows=4)
    batcher.timed(0.05)
    gone = Owner()
    batcher.expect(gone)
    started = time.perf_counter()
    assert batcher.transcribe(torch.tensor(3), owner=Owner()) == ([3], 0)
    assert time.perf_counter() - started > 0.04 and batcher.stats()["waits_ran_out"] == 1
    batcher.transcribe(torch.tensor(4))
    assert batcher.stats()["waits"] == 1  # (the second batch did not wait: the announcement was forgotten)


def test_an_announced_utterance_withdrawn_is_not_waited_for():
    """A call announced its turn, then took an STT's words for it (``TurnTranscript.given_up``):
    the next batch starts at once."""
    batcher = UtteranceBatcher(recording([]), rows=4)
    batcher.timed(0.05)
    took_stt_words, still_coming = Owner(), Owner()
    batcher.expect(took_stt_words)
    batcher.withdraw(took_stt_words)
    assert batcher.transcribe(torch.tensor(3), owner=Owner()) == ([3], 0)
    assert batcher.stats()["waits"] == 0
    batcher.expect(still_coming)  # (withdrawing another owner leaves it announced)
    batcher.withdraw(took_stt_words)
    batcher.transcribe(torch.tensor(4))
    assert batcher.stats()["waits"] == 1 and batcher.stats()["waits_ran_out"] == 1


def test_a_failed_batch_fails_each_of_its_utterances_with_its_error():
    """Every utterance of a batch that failed gets the same exception (the transcriber counts it
    once); a decode that answers the wrong number of utterances fails them too, nobody hangs."""
    error = RuntimeError("out of memory in one batch")

    def failing(batch):
        raise error

    batcher = UtteranceBatcher(failing, rows=4)
    batcher.timed(10.0)
    owners = [Owner(), Owner()]
    for owner in owners:
        batcher.expect(owner)
    caught = [None, None]

    def transcribe(i):
        try:
            batcher.transcribe(torch.tensor(i), owner=owners[i])
        except RuntimeError as e:
            caught[i] = e

    run_in_threads(transcribe, [(0,), (1,)])
    assert caught == [error, error]
    short = UtteranceBatcher(lambda batch: [], rows=1)
    with pytest.raises(RuntimeError, match="a batch of 1 utterances was decoded into 0 results"):
        short.transcribe(torch.tensor(0))
    with pytest.raises(ValueError, match="rows must be an integer >= 1"):
        UtteranceBatcher(failing, rows=0)
