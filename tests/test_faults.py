"""Faults on a live call (issue 7, item 4), each on an in-process simulated call with the real
tiny TASTE engine: the peer vanishes mid-reply, the model raises mid-turn, an interrupt storm
(barge-in every 300 ms), a slow consumer.

For each: the call (or, after a vanished peer, the next call on the same engine) keeps working,
the call's worker threads and asyncio tasks are released (counted before and after), nothing of
the call stays alive (weak references), and the recording keeps everything already spoken: the
agent audio on the line is, reply by reply, exactly the audio the synthesizer produced (a
bit-exact prefix of it for a reply that was cut, followed by at most a short fade-out).
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
import wave
import weakref

import numpy as np
import pytest
from pipecat.frames.frames import CancelWorkerFrame, Frame, StartFrame, TTSAudioRawFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor

from pipecat_taste.engine import TasteEngine
from taste_agents.caller import Pause, Say, WaitForReply, load_utterances
from taste_agents.phone_agent import PhoneAgentConfig, build_phone_agent
from taste_agents.report import reply_audio_intact
from taste_agents.simulate import SimulatedLine, simulate_call

SR = 16000
FADE = int(0.02 * SR)  # the playout's fade-out after a cut is at most this long (10 ms + one frame)
FRAME = int(0.02 * SR)  # the playout's frames


@pytest.fixture(scope="module")
def engine():
    return TasteEngine.from_pretrained(None)  # the embedded tiny checkpoint


@pytest.fixture(scope="module")
def u():
    return load_utterances()


@pytest.fixture(autouse=True)
def quiet_logs():
    from loguru import logger

    logger.remove()
    handler = logger.add(lambda message: None, level="ERROR")
    yield
    logger.remove(handler)


def config(tokens: int = 3) -> PhoneAgentConfig:
    return PhoneAgentConfig(max_reply_tokens=tokens)


# -- bookkeeping: threads, tasks, liveness, audio ----------------------------------------------------------
class Resources:
    """Threads and asyncio tasks before a call; ``released()`` waits until they are back."""

    def __init__(self):
        self.threads = set(threading.enumerate())
        self.tasks = set(asyncio.all_tasks())
        self.objects: list[weakref.ref] = []

    def track(self, obj) -> None:
        if obj is not None:
            self.objects.append(weakref.ref(obj))

    async def released(self, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            gc.collect()
            threads = [t.name for t in threading.enumerate() if t not in self.threads]
            tasks = [t.get_name() for t in asyncio.all_tasks() if t not in self.tasks and t is not asyncio.current_task()]
            alive = [type(r()).__name__ for r in self.objects if r() is not None]
            if (not threads and not tasks and not alive) or time.monotonic() > deadline:
                return {"threads": threads, "tasks": tasks, "alive": alive}
            await asyncio.sleep(0.1)


def tracking_factory(engine, cfg: PhoneAgentConfig, resources: Resources, wrap=None):
    """A ``service_factory`` for simulate_call that builds the phone agent, records weak
    references to it and to its call, and optionally wraps it (``wrap(agent, call) -> processor``)."""
    holder = {}

    def factory(log):
        agent = build_phone_agent(engine, cfg, log=log)
        holder["agent"] = agent
        resources.track(agent)
        resources.track(agent.call)
        processor = wrap(agent, agent.call) if wrap is not None else agent
        if processor is not agent:
            resources.track(processor)
        return processor

    return factory, holder


def pcm(chunks) -> np.ndarray:
    return np.frombuffer(b"".join(chunks), dtype="<i2") if chunks else np.zeros(0, "<i2")


def check_reply_audio(log, turn_id: int) -> tuple[str, np.ndarray]:
    """'complete' (released = synthesized) or 'cut' (a bit-exact prefix + at most FADE samples of
    fade-out, never louder than the audio it fades): the reports' audio rule
    (``report.reply_audio_intact``; gaps where the synthesis fell behind are bridged), else
    AssertionError. Returns the kind and the released audio."""
    synth, released = pcm(log.synthesized_audio.get(turn_id, [])), pcm(log.released_audio.get(turn_id, []))
    intact, same = reply_audio_intact(synth, released, log.turns[turn_id], FRAME, FADE)
    assert intact, f"turn {turn_id}: the released audio differs from the synthesized audio from sample {same} on"
    return ("complete" if same == synth.size else "cut"), released


def check_line(result) -> None:
    """What the transport wrote is the released audio, reply after reply, in order, without
    overlaps (each reply padded with zeros to whole 20 ms frames)."""
    line, log = result.line, result.log
    expected = []
    for turn_id in sorted(log.released_audio):
        released = pcm(log.released_audio[turn_id])
        expected.append(np.concatenate([released, np.zeros((-released.size) % line.frame_samples, "<i2")]))
    written = np.concatenate([w for _, w in line.writes]) if line.writes else np.zeros(0, "<i2")
    assert np.array_equal(written, np.concatenate(expected) if expected else written)
    for (start, samples), (nxt, _) in zip(line.writes, line.writes[1:]):
        assert nxt >= start + samples.size
        assert np.array_equal(line.agent[start:start + samples.size], samples)


def replies(log) -> list[int]:
    return sorted(t for t, r in log.turns.items() if r.decision == "reply")


# -- 1. the peer vanishes mid-reply -------------------------------------------------------------------------
class PeerVanishes(FrameProcessor):
    """Between the agent and the transport: after ``after_ms`` of the first reply's audio it asks
    the worker to cancel, as a transport does when its client disconnects."""

    def __init__(self, after_ms: float, **kwargs):
        super().__init__(**kwargs)
        self._after = int(after_ms * SR / 1000)
        self._seen = 0
        self.vanished_at: float | None = None

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        await self.push_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame) and self.vanished_at is None:
            self._seen += len(frame.audio) // 2
            if self._seen >= self._after:
                self.vanished_at = time.monotonic()
                await self.push_frame(CancelWorkerFrame(reason="peer vanished"), FrameDirection.UPSTREAM)


async def test_peer_vanishes_mid_reply(engine, u, tmp_path):
    resources = Resources()
    vanisher = {}

    def wrap(agent, call):
        vanisher["p"] = PeerVanishes(after_ms=400)
        vanisher["call"] = call
        return Pipeline([agent, vanisher["p"]])

    factory, holder = tracking_factory(engine, config(4), resources, wrap)
    script = [Pause(0.3), Say(u["hello"]), WaitForReply(20.0, end_silence_s=1.0)]
    closed_after = {}

    async def watch_close():
        while "p" not in vanisher or vanisher["p"].vanished_at is None or not vanisher["call"].closed:
            await asyncio.sleep(0.02)
        closed_after["s"] = time.monotonic() - vanisher["p"].vanished_at

    watcher = asyncio.create_task(watch_close())
    result = await simulate_call(engine, script, service_factory=factory, out_dir=tmp_path / "vanished", max_call_s=60)
    await asyncio.wait_for(watcher, 10)
    assert vanisher["p"].vanished_at is not None, "the reply never started: nothing to cut"
    # the call's pipeline let go at once: its worker threads closed within 2 s of the peer leaving
    assert closed_after["s"] < 2.0
    print(f"peer vanished: call closed {1000 * closed_after['s']:.0f} ms later")

    # the recording keeps everything already spoken: the start of the reply, bit-exact
    (turn_id,) = replies(result.log)
    kind, released = check_reply_audio(result.log, turn_id)
    written = np.concatenate([w for _, w in result.line.writes])
    assert 0.3 * SR <= written.size <= released.size + result.line.frame_samples
    assert np.array_equal(written[: released.size], released[: written.size])
    with wave.open(result.paths["recording"], "rb") as f:
        stereo = np.frombuffer(f.readframes(f.getnframes()), "<i2").reshape(-1, 2)
    for start, samples in result.line.writes:  # every write, where it was heard
        assert np.array_equal(stereo[start:start + samples.size, 1], samples)

    holder.clear(), vanisher.clear()  # our own references: nothing else may keep the call alive
    del result
    leftovers = await resources.released()
    assert leftovers == {"threads": [], "tasks": [], "alive": []}

    # the server keeps working: the next call on the same engine gets a whole reply
    after = await simulate_call(engine, [Pause(0.3), Say(u["goodbye"]), WaitForReply(20.0, end_silence_s=1.5)],
                                config=config(2), max_call_s=60)
    assert after.errors == [] and not after.timed_out
    (turn_id,) = replies(after.log)
    assert check_reply_audio(after.log, turn_id)[0] == "complete"
    check_line(after)


async def test_a_call_stopped_from_outside_ends_like_a_hang_up_and_writes_what_was_recorded(engine, u, tmp_path,
                                                                                              monkeypatch):
    """Ctrl-C on ``taste-agent call --simulate`` cancels the call's task: the call ends as a hang-up
    does (its worker and tasks released; before, asyncio.run's clean-up waited on Pipecat's tasks
    forever), the recording and report of what was heard are written, and the cancellation goes on."""
    resources = Resources()
    factory, holder = tracking_factory(engine, config(4), resources)
    logs = []

    def keep_log(log):
        logs.append(log)
        return factory(log)

    lines = []

    class KeptLine(SimulatedLine):  # (simulate_call does not return: the test keeps its line)
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            lines.append(self)

    monkeypatch.setattr("taste_agents.simulate.SimulatedLine", KeptLine)
    said = []
    script = [Pause(0.3), Say(u["hello"]), WaitForReply(20.0, end_silence_s=0.5), Pause(60.0)]
    call = asyncio.create_task(simulate_call(engine, script, service_factory=keep_log, out_dir=tmp_path / "stopped",
                                             max_call_s=90, progress=said.append))
    deadline = time.monotonic() + 40
    while not any(": done, said" in line for line in said) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert any(": done, said" in line for line in said), said
    await asyncio.sleep(0.5)  # ("done" comes with the last write, before the line has played it)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(call, 30)
    assert said[-1].startswith("what was recorded before the stop: ")

    report = json.loads((tmp_path / "stopped" / "report.json").read_text())
    assert report["stopped_early"] is True and report["checks"]["written_equals_released"]
    (turn_id,) = replies(logs[0])
    kind, released = check_reply_audio(logs[0], turn_id)
    assert kind == "complete"
    written = np.concatenate([w for _, w in lines[0].writes])
    assert np.array_equal(written, released)  # the whole reply reached the line, bit-exact
    with wave.open(str(tmp_path / "stopped" / "recording.wav"), "rb") as f:
        stereo = np.frombuffer(f.readframes(f.getnframes()), "<i2").reshape(-1, 2)
    for start, samples in lines[0].writes:  # and the recording has every write, where it was heard
        assert np.array_equal(stereo[start:start + samples.size, 1], samples)

    holder.clear(), logs.clear(), lines.clear()
    leftovers = await resources.released()
    assert leftovers == {"threads": [], "tasks": [], "alive": []}


# -- 2. the model raises mid-turn -------------------------------------------------------------------------
class _FailingSession:
    """The real session, except that reply 1 raises after its first segment and the vocoder of
    reply 2 raises after its first chunk."""

    def __init__(self, session):
        self._session = session
        self._replies = 0
        self._vocode_calls: dict[int, int] = {}

    def __getattr__(self, name):
        return getattr(self._session, name)

    def reply(self, turn, stop):
        self._replies += 1
        number = self._replies
        for i, event in enumerate(self._session.reply(turn, stop)):
            yield event
            if number == 1 and event.kind == "segment":
                raise RuntimeError("injected: the spoken LM failed mid-reply")

    def start_speech(self, rate):
        state = self._session.start_speech(rate)
        state.reply_number = self._replies
        return state

    def vocode(self, state, tokens, final=False):
        key = id(state)
        self._vocode_calls[key] = self._vocode_calls.get(key, 0) + 1
        chunks = self._session.vocode(state, tokens, final)
        if state.reply_number == 2 and sum(c.size for c in chunks) and self._vocode_calls[key] > 2:
            raise RuntimeError("injected: the vocoder failed mid-reply")
        return chunks


class _FailingEngine:
    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def new_session(self, settings=None, voice=None):
        return _FailingSession(self._engine.new_session(settings, voice))


async def test_model_raises_mid_turn(engine, u):
    resources = Resources()
    failing = _FailingEngine(engine)
    factory, holder = tracking_factory(failing, config(3), resources)
    script = [Pause(0.3), Say(u["hello"]), WaitForReply(20.0, end_silence_s=1.5),
              Say(u["time"]), WaitForReply(20.0, end_silence_s=1.5),
              Say(u["goodbye"]), WaitForReply(20.0, end_silence_s=1.5)]
    result = await simulate_call(failing, script, service_factory=factory, max_call_s=90)
    assert not result.timed_out
    # each failure is reported as an error of its turn, not as the end of the call
    assert any("spoken LM failed" in e for e in result.errors), result.errors
    assert any("vocoder failed" in e for e in result.errors), result.errors
    assert len(result.errors) == 2
    turns = replies(result.log)
    assert len(turns) == 3
    # the words synthesized before each failure were played and recorded, and nothing else
    for turn_id in turns:
        kind, released = check_reply_audio(result.log, turn_id)
        assert kind == "complete" and released.size > 0
    check_line(result)
    first, second, third = (result.log.turns[t] for t in turns)
    assert first.errors and second.errors and not third.errors
    assert first.total_words == 1  # the reply ended at the failure
    # the call went on: the last turn is a whole, normal reply
    assert third.total_words >= 1 and third.played_words == third.total_words
    session = holder["agent"].call.session
    assert [t.role for t in session.conversation.turns][-2:] == ["user", "assistant"]

    holder.clear()
    del result, session
    assert await resources.released() == {"threads": [], "tasks": [], "alive": []}


# -- 3. interrupt storm --------------------------------------------------------------------------------------
class InterruptStorm(FrameProcessor):
    """Between the capture and the generator: every ``period`` seconds (from ``start`` to ``stop``
    seconds after the pipeline started) it broadcasts an interruption, as a barge-in does, and
    every ``turn_every``-th time it also hands the generator a new user turn (the caller's hello,
    tokenized once), so that replies are cut at every stage: generating, synthesizing, playing."""

    def __init__(self, call, utterance, start: float, stop: float, period: float = 0.3, turn_every: int = 3,
                 count: int = 30, **kwargs):
        super().__init__(**kwargs)
        self._call, self._utterance = call, utterance
        self._window, self._period, self._turn_every, self._count = (start, stop), period, turn_every, count
        self.interruptions = 0
        self.turns: list[int] = []
        self._task = None

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        await self.push_frame(frame, direction)
        if isinstance(frame, StartFrame):
            self._task = self.create_task(self._storm())

    async def _storm(self):
        from pipecat_taste.frames import TasteUserTurnFrame

        t0 = time.monotonic()
        session = await self._call.ensure_session()
        turn = await self._call.run("listen", session.user_turn, self._utterance.audio, self._utterance.text)
        await asyncio.sleep(max(0.0, self._window[0] - (time.monotonic() - t0)))
        injected = 0
        while self.interruptions < self._count and time.monotonic() - t0 < self._window[1]:
            await self.broadcast_interruption()
            self.interruptions += 1
            if self.interruptions % self._turn_every == 1:
                turn_id = self._call.new_turn_id()
                now = time.monotonic()
                record = self._call.log.turn(turn_id)
                record.speech_start, record.speech_end = now - turn.audio_seconds, now
                self.turns.append(turn_id)
                await self.push_frame(TasteUserTurnFrame(turn_id, turn.transcript, turn, now - turn.audio_seconds, now))
                injected += 1
                if injected in (2, 4):
                    # two replies are left alone until their audio plays, so that the storm cuts
                    # replies while they are heard too, however fast this machine makes them
                    await self._until_bot_speaks(timeout=min(3.0, self._window[1] - (time.monotonic() - t0)))
                    await asyncio.sleep(0.1)
                    continue
            await asyncio.sleep(self._period)

    async def _until_bot_speaks(self, timeout: float):
        deadline = time.monotonic() + max(0.0, timeout)
        while not self._call.bot_speaking and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def cleanup(self):
        await super().cleanup()
        if self._task is not None:
            await self.cancel_task(self._task)


async def test_interrupt_storm(engine, u):
    resources = Resources()
    storm = {}

    def wrap(agent, call):
        storm["p"] = InterruptStorm(call, u["hello"], start=0.5, stop=17.0, period=0.3, turn_every=3)
        return Pipeline([agent.capture, storm["p"], agent.generator, agent.synthesizer, agent.playout])

    factory, holder = tracking_factory(engine, config(4), resources, wrap)
    # the caller speaks inside the storm too, and once more after it
    script = [Pause(2.0), Say(u["time"]), Pause(16.0), Say(u["goodbye"]), WaitForReply(25.0, end_silence_s=2.0)]
    result = await simulate_call(engine, script, service_factory=factory, max_call_s=90)
    assert not result.timed_out and result.errors == []
    log, p = result.log, storm["p"]
    assert p.interruptions >= 25 and len(p.turns) >= 8
    turns = replies(log)
    kinds = {t: check_reply_audio(log, t)[0] for t in turns}
    check_line(result)
    heard = {t: pcm(log.released_audio.get(t, [])).size for t in turns}
    print(f"storm: {p.interruptions} interruptions, {len(p.turns)} injected turns; "
          f"replies (kind, samples heard): {[(kinds[t], heard[t]) for t in turns]}")
    # replies were cut at every stage: before any audio and in the middle of their audio
    cut = [t for t in turns[:-1] if kinds[t] == "cut"]
    assert len(cut) >= 2 and any(heard[t] == 0 for t in turns[:-1])
    # the conversation keeps exactly the words that were heard
    for t in turns[:-1]:
        record = log.turns[t]
        assert record.kept_words == record.played_words <= record.total_words
    # after the storm the call works normally: the last reply (to goodbye) is whole
    stopped = {e["turn_id"]: e["interrupted"] for e in log.events if e["kind"] == "bot_audio_stopped"}
    last = turns[-1]
    assert log.turns[last].transcript == u["goodbye"].text
    assert kinds[last] == "complete" and heard[last] > 0 and stopped[last] is False
    assert log.turns[last].played_words == log.turns[last].total_words >= 1

    holder.clear(), storm.clear()
    del result, log, p
    assert await resources.released() == {"threads": [], "tasks": [], "alive": []}


# -- 4. slow consumer --------------------------------------------------------------------------------------
async def test_slow_consumer(engine, u, monkeypatch):
    """The far end takes audio slower than real time (each 20 ms frame takes 30 ms, and every
    25th write stalls for 300 ms): nothing is lost, duplicated or reordered, and the call goes on."""
    play = SimulatedLine.play
    writes = {"n": 0}

    async def slow_play(self, samples):
        writes["n"] += 1
        await play(self, samples)
        await asyncio.sleep(0.3 if writes["n"] % 25 == 0 else 0.5 * samples.size / self.sample_rate)

    monkeypatch.setattr(SimulatedLine, "play", slow_play)
    resources = Resources()
    factory, holder = tracking_factory(engine, config(2), resources)
    script = [Pause(0.3), Say(u["hello"]), WaitForReply(25.0, end_silence_s=2.0),
              Say(u["goodbye"]), WaitForReply(25.0, end_silence_s=2.0)]
    result = await simulate_call(engine, script, service_factory=factory, max_call_s=90)
    assert not result.timed_out and result.errors == []
    turns = replies(result.log)
    assert len(turns) == 2
    for turn_id in turns:
        assert check_reply_audio(result.log, turn_id)[0] == "complete"
    check_line(result)
    assert writes["n"] > 100
    # the line took longer than the audio lasts: the consumer really was slow
    written = sum(w.size for _, w in result.line.writes)
    span = result.line.writes[-1][0] + result.line.writes[-1][1].size - result.line.writes[0][0]
    assert span > written

    holder.clear()
    del result
    assert await resources.released() == {"threads": [], "tasks": [], "alive": []}


async def test_replies_that_fail_mid_way_give_back_their_segment_slots():
    """A reply whose model fails after its first segment: each such failure used to keep one of the
    call's segment slots, and after max_pending_segments of them the next reply waited for a slot
    forever (decided, no words, no end). Now every failure gives its slot back."""
    from pipecat.frames.frames import CancelFrame
    from pipecat.tests.utils import SleepFrame, run_test

    from pipecat_taste.call import TasteCall
    from pipecat_taste.generation import TasteGenerator
    from pipecat_taste.synthesis import TasteSynthesizer
    from pipecat_taste.testing import FakeEngine, FakeSession, fake_user_turn_frame as turn

    class FailingMidReply(FakeSession):
        def reply(self, turn, stop):
            for i, event in enumerate(super().reply(turn, stop)):
                if "fail" in turn.transcript and event.kind == "segment" and i >= 2:
                    raise RuntimeError("the model failed mid-reply")
                yield event

    call = TasteCall(FakeEngine(session_class=FailingMidReply, word_delay=0.01))
    frames = []
    for turn_id in range(1, call.max_pending_segments + 1):
        frames += [turn(turn_id, "fail fail"), SleepFrame(0.5)]
    last = call.max_pending_segments + 1
    frames += [turn(last, "hello there"), SleepFrame(3.0), CancelFrame()]
    await run_test(Pipeline([TasteGenerator(call), TasteSynthesizer(call)]), frames_to_send=frames,
                   send_end_frame=False)
    records = [call.log.turns[t] for t in range(1, last + 1)]
    assert all(any("generation failed" in e for e in r.errors) for r in records[:-1]), [r.errors for r in records]
    assert records[-1].generation_done_at is not None and records[-1].total_words > 0 and not records[-1].errors
    assert call.segment_slots._value == call.max_pending_segments  # every slot back


async def test_a_reply_taken_back_gives_up_its_speech_when_the_next_reply_starts():
    """An early reply that started speaking and was taken back (the caller went on) is given up
    (``drop_speech``) before the next reply's speech starts: on the fast path the calls' shared
    synthesis steps then no longer wait for its first window. A reply that ended is not."""
    from pipecat.frames.frames import CancelFrame
    from pipecat.tests.utils import SleepFrame, run_test

    from pipecat_taste.call import TasteCall
    from pipecat_taste.frames import TasteTurnStatusFrame
    from pipecat_taste.generation import TasteGenerator
    from pipecat_taste.synthesis import TasteSynthesizer
    from pipecat_taste.testing import FakeEngine, fake_user_turn_frame as turn

    engine = FakeEngine(word_delay=0.05)
    call = TasteCall(engine)
    frames = [turn(1, "hello there friend", tentative=True), SleepFrame(0.3),  # speaking, not yet confirmed
              TasteTurnStatusFrame(1, "retracted"), SleepFrame(0.2),
              turn(2, "hello there friend how are you"), SleepFrame(2.0),
              turn(3, "and you"), SleepFrame(2.0), CancelFrame()]
    await run_test(Pipeline([TasteGenerator(call), TasteSynthesizer(call)]), frames_to_send=frames,
                   send_end_frame=False)
    (session,) = engine.sessions
    assert session.replies_started >= 2 and len(session.dropped_speech) == 1  # turn 1's; turn 2's ended
    assert call.log.turns[2].total_words > 0


async def barge_in_then_answer_again(engine, cut_after: float, pause: float, listen: float) -> dict[int, int]:
    """Turn 1, a barge-in ``cut_after`` s later, turn 2 ``pause`` s after that, through a generator
    and a synthesizer: the number of audio frames each reply sent."""
    from pipecat.frames.frames import InterruptionFrame
    from pipecat.pipeline.worker import PipelineParams
    from pipecat.tests.utils import SleepFrame, run_test

    from pipecat_taste.call import TasteCall
    from pipecat_taste.generation import TasteGenerator
    from pipecat_taste.synthesis import TasteSynthesizer, context_id_for
    from pipecat_taste.testing import fake_user_turn_frame as turn

    call = TasteCall(engine)
    frames = [turn(1, "hello there"), SleepFrame(cut_after), InterruptionFrame(), SleepFrame(pause),
              turn(2, "and you"), SleepFrame(listen)]
    down, _ = await run_test(Pipeline([TasteGenerator(call), TasteSynthesizer(call)]), frames_to_send=frames,
                             pipeline_params=PipelineParams(audio_out_sample_rate=24000))
    return {t: sum(isinstance(f, TTSAudioRawFrame) and f.context_id == context_id_for(t) for f in down) for t in (1, 2)}


async def test_a_reply_cut_off_before_its_first_audio_gives_up_its_speech():
    """A barge-in while a reply's speech has started but no audio has come yet (a slow vocoder):
    its speech state is given up (``drop_speech``) at the interruption, not left for the shared
    synthesis steps to wait on; the next reply is heard whole."""
    from pipecat_taste.testing import FakeEngine

    engine = FakeEngine(word_delay=0.05, vocode_delay=0.4)
    audio = await barge_in_then_answer_again(engine, cut_after=0.25, pause=0.3, listen=4.0)
    (session,) = engine.sessions
    assert audio[1] == 0 and audio[2] > 0, audio  # (cut before its first audio, as meant)
    assert session.replies_started == 2 and len(session.dropped_speech) == 1  # turn 1's, at the barge-in


async def test_a_turn_taken_back_while_its_reply_waits_for_a_mute_gets_no_reply():
    """A tentative turn waits to learn whether later speech mutes it; meanwhile it is taken back.
    When the mute is then lifted (the later speech had no words), no reply is made for the turn
    taken back (a whole reply was generated for it, and the agent was busy with it)."""
    from pipecat.tests.utils import SleepFrame, run_test

    from pipecat_taste.call import TasteCall
    from pipecat_taste.frames import TasteReplySegmentFrame, TasteTurnStatusFrame
    from pipecat_taste.generation import TasteGenerator
    from pipecat_taste.testing import FakeEngine, fake_user_turn_frame as turn

    class LiftTheMuteLater(FrameProcessor):  # as the capture does once the muting speech proves wordless
        def __init__(self, call):
            super().__init__()
            self.call = call

        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            await self.push_frame(frame, direction)
            if isinstance(frame, TasteTurnStatusFrame) and frame.status == "retracted":
                self.create_task(self.lift())

        async def lift(self):
            await asyncio.sleep(0.3)
            self.call.mutes.settle(3, keep=False)

    engine = FakeEngine(word_delay=0.2)
    call = TasteCall(engine)
    call.mutes.mute(3)  # speech after turn 2, not yet settled, mutes the turns before it
    frames = [turn(2, "hello there", tentative=True), SleepFrame(0.1), TasteTurnStatusFrame(2, "retracted"),
              SleepFrame(1.5)]
    down, _ = await run_test(Pipeline([LiftTheMuteLater(call), TasteGenerator(call)]), frames_to_send=frames)
    assert not [f for f in down if isinstance(f, TasteReplySegmentFrame)]
    assert engine.sessions[0].replies_started == 0
    assert "reply_retracted" in [e["kind"] for e in call.log.events]


async def test_a_reply_whose_first_chunks_are_shorter_than_its_fade_in_fades_in_once():
    """The vocoder's first chunks can be a few ms (shorter than the 10 ms held back for the
    fade-out): the reply still starts with one 5 ms ramp. (The held audio got the ramp again with
    the next chunk: a squared ramp, and a 2 ms chunk got a whole 2 ms ramp of its own.)"""
    from pipecat.pipeline.worker import PipelineParams
    from pipecat.tests.utils import SleepFrame, run_test

    from pipecat_taste.audio import ramp
    from pipecat_taste.call import TasteCall
    from pipecat_taste.synthesis import TasteSynthesizer
    from pipecat_taste.testing import FakeEngine, FakeSession, fake_user_turn_frame as turn
    from pipecat_taste.generation import TasteGenerator

    level, first = 0.5, [int(0.002 * 24000), int(0.003 * 24000)]  # 2 ms, then 3 ms, then whole chunks

    class ShortFirstChunks(FakeSession):
        def vocode(self, state, tokens, final=False):
            chunks = super().vocode(state, tokens, final)
            size = first.pop(0) if first and chunks else sum(c.size for c in chunks)
            return [np.full(size, level, np.float32)] if chunks else []

    call = TasteCall(FakeEngine(session_class=ShortFirstChunks))
    down, _ = await run_test(Pipeline([TasteGenerator(call), TasteSynthesizer(call, fade_in_ms=5.0)]),
                             frames_to_send=[turn(1, "hello there"), SleepFrame(1.0)],
                             pipeline_params=PipelineParams(audio_out_sample_rate=24000))
    audio = pcm([f.audio for f in down if isinstance(f, TTSAudioRawFrame)]) / 32768.0
    n = int(0.005 * 24000)
    assert audio.size > 4 * n and not first  # (the short chunks came first, as meant)
    np.testing.assert_allclose(audio[:n], level * ramp(n), atol=2 / 32768)
    np.testing.assert_allclose(audio[n:2 * n], level, atol=1 / 32768)


async def test_a_barge_in_after_a_reply_was_heard_to_its_end_does_not_mark_it_interrupted():
    """The playout reported the reply heard to its end; the caller speaks while the generator keeps
    its words (``commit_reply``, on the model's thread: a few ms, longer when the thread is busy).
    Nothing is cut: the reply's record stays not interrupted, and the agent is no longer busy."""
    from pipecat.frames.frames import InterruptionFrame
    from pipecat.pipeline.worker import PipelineParams
    from pipecat.tests.utils import SleepFrame, run_test

    from pipecat_taste.call import TasteCall
    from pipecat_taste.generation import TasteGenerator
    from pipecat_taste.playout import TastePlayout
    from pipecat_taste.synthesis import TasteSynthesizer
    from pipecat_taste.testing import FakeEngine, FakeSession, fake_user_turn_frame as turn

    committing, started = [], threading.Event()  # (start, end) of each commit; a commit began

    class SlowCommit(FakeSession):
        def commit_reply(self, played_words):
            start = time.monotonic()
            started.set()
            time.sleep(0.5)
            committing.append((start, time.monotonic()))
            return super().commit_reply(played_words)

    class BargeInWhileCommitting(FrameProcessor):
        at: float | None = None

        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            await self.push_frame(frame, direction)
            if isinstance(frame, StartFrame):
                self.create_task(self.barge_in())

        async def barge_in(self):
            if await asyncio.to_thread(started.wait, 10.0):
                BargeInWhileCommitting.at = time.monotonic()
                await self.push_frame(InterruptionFrame())

    call = TasteCall(FakeEngine(session_class=SlowCommit, reply_words=("sure", "thing")))  # 0.4 s of audio
    pipeline = Pipeline([BargeInWhileCommitting(), TasteGenerator(call), TasteSynthesizer(call), TastePlayout(call)])
    await run_test(pipeline, frames_to_send=[turn(1, "hello there"), SleepFrame(2.5)],
                   pipeline_params=PipelineParams(audio_out_sample_rate=16000))
    ((start, end),) = committing
    assert start < BargeInWhileCommitting.at < end  # (the barge-in came while the words were being kept, as meant)
    record = call.log.turns[1]
    assert record.played_samples > 0 and not record.interrupted and record.kept_words == 2
    assert "generation_cancelled" not in [e["kind"] for e in call.log.events]


async def test_a_reply_cut_off_while_its_speech_state_is_made_gives_it_up_once_made():
    """A barge-in while a reply's speech state is being made (``start_speech`` on the speech
    decoder's thread: caches, a busy compute gate): the state made after the cut is given up
    (``drop_speech``), not left for the shared synthesis steps to wait on; the next reply is heard."""
    from pipecat_taste.testing import FakeEngine

    made = []

    class Engine(FakeEngine):
        def new_session(self, settings=None, voice=None):
            session = super().new_session(settings, voice)
            start_speech = session.start_speech
            session.start_speech = lambda rate: made.append(start_speech(rate)) or made[-1]
            return session

    engine = Engine(start_speech_delay=0.5)
    audio = await barge_in_then_answer_again(engine, cut_after=0.2, pause=0.6, listen=2.5)
    (session,) = engine.sessions
    assert audio[1] == 0 and audio[2] > 0, audio
    assert len(made) == 2 and session.dropped_speech == made[:1]  # turn 1's, once made
