"""ReplyMutes: a mute is provisional until the turn that caused it is settled."""

import asyncio

import pytest

from pipecat_taste.reply_mutes import ReplyMutes


async def _verdict(mutes: ReplyMutes, turn: int, then=None) -> bool | str:
    """The verdict on ``turn``, or 'waiting' if it is still pending after ``then`` ran."""
    task = asyncio.ensure_future(mutes.muted(turn))
    await asyncio.sleep(0)
    if then is not None:
        then()
        await asyncio.sleep(0)
    if not task.done():
        task.cancel()
        return "waiting"
    return task.result()


async def test_an_unmuted_turn_is_answered_at_once():
    mutes = ReplyMutes()
    assert await _verdict(mutes, 1) is False
    mutes.mute(3)
    assert await _verdict(mutes, 3) is False  # a turn does not mute itself
    assert mutes.upto == 2


async def test_the_verdict_waits_for_the_muting_turn():
    mutes = ReplyMutes()
    mutes.mute(2)
    assert await _verdict(mutes, 1) == "waiting"
    assert await _verdict(mutes, 1, then=lambda: mutes.settle(2, keep=True)) is True
    mutes2 = ReplyMutes()
    mutes2.mute(2)
    assert await _verdict(mutes2, 1, then=lambda: mutes2.settle(2, keep=False)) is False
    assert mutes2.upto == 0


async def test_any_kept_later_mute_decides_and_lifted_ones_do_not():
    mutes = ReplyMutes()
    mutes.mute(2)
    mutes.mute(3)
    mutes.settle(3, keep=False)  # a noise
    assert await _verdict(mutes, 1) == "waiting"  # turn 2 may still be speech
    mutes.settle(2, keep=True)
    assert await _verdict(mutes, 1) is True
    mutes.mute(5)
    mutes.settle(5, keep=True)
    assert await _verdict(mutes, 4) is True and await _verdict(mutes, 1) is True


async def test_a_moved_mute_is_settled_by_the_turn_that_goes_on():
    mutes = ReplyMutes()
    mutes.mute(2)
    mutes.settle(2, keep=True)  # handed on early...
    mutes.move(2, 3)  # ...and taken back: the speech goes on as turn 3
    mutes.settle(2, keep=True)  # the retracted turn's own settling changes nothing
    assert await _verdict(mutes, 1) == "waiting"
    assert await _verdict(mutes, 1, then=lambda: mutes.settle(3, keep=False)) is False
    mutes.move(7, 8)  # a turn that muted nothing: nothing to move
    assert mutes.upto == 0


@pytest.mark.parametrize("keep", [True, False])
async def test_settling_twice_or_a_turn_that_muted_nothing_changes_nothing(keep):
    mutes = ReplyMutes()
    mutes.settle(4, keep=keep)
    mutes.mute(2)
    mutes.settle(2, keep=True)
    mutes.settle(2, keep=False)  # already settled: the mute stands
    assert await _verdict(mutes, 1) is True


@pytest.mark.parametrize("muted", [True, False])
async def test_a_muted_turn_joins_the_conversation_with_no_word_of_a_reply_made(muted):
    """The generator asks for a muted turn's verdict before it starts the reply: muted, the turn
    goes into the conversation and no reply is generated at all (generated and thrown away, it
    held up the answer to the caller's new turn by a whole reply's generation)."""
    import time

    import numpy as np
    from pipecat.tests.utils import SleepFrame, run_test

    from pipecat_taste import TasteCall
    from pipecat_taste.frames import TasteUserTurnFrame
    from pipecat_taste.generation import TasteGenerator
    from pipecat_taste.testing import FakeEngine

    engine = FakeEngine(word_delay=0.05)
    call = TasteCall(engine)
    turn_id, later = call.new_turn_id(), call.new_turn_id()
    if muted:  # the caller's next turn came before this one's reply began, and has words
        call.mutes.mute(later)
        call.mutes.settle(later, keep=True)
    session = await call.ensure_session()
    turn = session.user_turn(np.zeros(16000, np.float32), "what time is it")
    now = time.monotonic()
    await run_test(TasteGenerator(call), frames_to_send=[TasteUserTurnFrame(turn_id, turn.transcript, turn, now - 1, now),
                                                         SleepFrame(0.8)])
    record = call.log.turn(turn_id)
    if muted:
        assert (record.decision, record.reason) == ("no_speech", "the caller spoke again before the reply began")
        assert session.history == [("user", "what time is it")]  # not a word of a reply was made
    else:
        assert record.decision == "reply" and session.history[-1] == ("assistant", " ".join(engine.reply_words))
