"""The output end, one processor at a time: on barge-in the playout ends the audio with a fade that
continues the waveform however much of the reply had arrived unreleased (the just-in-time case has
none), and the synthesizer gives each segment's back-pressure slot back where it was taken."""

import asyncio
import time

import numpy as np
import pytest
from pipecat.frames.frames import InterruptionFrame, TTSAudioRawFrame, TTSStartedFrame
from pipecat.pipeline.worker import PipelineParams
from pipecat.tests.utils import SleepFrame, run_test

from pipecat_taste.audio import float_to_pcm16, pcm16_to_float
from pipecat_taste.call import TasteCall
from pipecat_taste.playout import PlayoutParams, TastePlayout
from pipecat_taste.synthesis import context_id_for
from pipecat_taste.testing import FakeEngine

RATE = 24000


@pytest.mark.parametrize("chunk_ms, barge_in_after_s", [
    (100, 0.03),  # unreleased frames queued: the fade is made of them
    (100, 0.085),  # everything received is out: nothing queued, nothing pending
    (110, 0.085),  # only the slicer's partial frame is left
])
async def test_barge_in_fades_without_a_step(chunk_ms, barge_in_after_s):
    call = TasteCall(FakeEngine())
    call.active_reply_turn = 1
    t = np.arange(RATE * chunk_ms // 1000) / RATE
    tone = (0.3 * np.sin(2 * np.pi * 437 * t)).astype(np.float32)
    context = context_id_for(1)
    frames = [TTSStartedFrame(context_id=context), TTSAudioRawFrame(float_to_pcm16(tone), RATE, 1, context_id=context),
              SleepFrame(barge_in_after_s), InterruptionFrame(), SleepFrame(0.3)]
    down, _ = await run_test(TastePlayout(call), frames_to_send=frames,
                             pipeline_params=PipelineParams(audio_out_sample_rate=RATE))
    audio = np.concatenate([pcm16_to_float(f.audio) for f in down if isinstance(f, TTSAudioRawFrame)])
    assert audio.size >= 480  # some of the reply was heard
    steepest_in_tone = np.abs(np.diff(tone)).max()
    assert abs(audio[-1]) < 1e-3  # faded to silence
    assert np.abs(np.diff(audio)).max() <= 1.1 * steepest_in_tone + 2e-3  # and no step anywhere: no click



@pytest.mark.parametrize("barge_in_after_s", [0.1, 0.5, 0.9])
async def test_the_words_pushed_on_a_barge_in_are_the_words_the_call_keeps(barge_in_after_s):
    """A barge-in cuts a three-word reply: the text frames the playout pushed (what Pipecat's
    assistant context keeps) are exactly the words the call records as heard (what the TASTE
    history keeps) - also a word whose heard point falls in the barge-in's fade. (200 ms frames;
    each word's heard point lies 5 ms past a frame's end, and each barge-in time in the middle of
    the frame that ends there.)"""
    from pipecat.frames.frames import TTSStoppedFrame, TTSTextFrame

    from pipecat_taste.frames import TasteSegmentAudioFrame

    call = TasteCall(FakeEngine())
    call.active_reply_turn = 1
    bounds = [0, 9840, 19200, 29040]  # heard points (half of each word) at 4920, 14520, 24120
    tone, context = _tone(1.3), context_id_for(1)
    frames = [TTSStartedFrame(context_id=context)]
    for i, text in enumerate((" one", " two", " three")):
        start, end = bounds[i], bounds[i + 1]
        frames += [TasteSegmentAudioFrame(1, i, text, 1, start, end),
                   TTSAudioRawFrame(float_to_pcm16(tone[start:end]), RATE, 1, context_id=context)]
    frames += [TTSStoppedFrame(context_id=context), SleepFrame(barge_in_after_s), InterruptionFrame(), SleepFrame(0.5)]
    down, _ = await run_test(TastePlayout(call, params=PlayoutParams(frame_ms=200.0)), frames_to_send=frames,
                             pipeline_params=PipelineParams(audio_out_sample_rate=RATE))
    record = call.log.turn(1)
    assert record.interrupted and record.played_words >= 1, record
    assert "".join(f.text for f in down if isinstance(f, TTSTextFrame)).strip() == record.played_text


def _line_output(chunks_10ms: int):
    from pipecat.transports.base_transport import TransportParams

    from taste_agents.simulate import SimulatedLine, _LineOutput

    return _LineOutput(SimulatedLine(RATE, 2.0, frame_ms=10 * chunks_10ms),
                       TransportParams(audio_out_enabled=True, audio_out_sample_rate=RATE,
                                       audio_out_10ms_chunks=chunks_10ms, audio_out_end_silence_secs=0))


async def _frame_ms_after_start(processors, call) -> float:
    from pipecat.pipeline.pipeline import Pipeline

    await run_test(Pipeline(processors), frames_to_send=[SleepFrame(0.05)],
                   pipeline_params=PipelineParams(audio_out_sample_rate=RATE))
    return 1000.0 * call.log.frame_samples / RATE


@pytest.mark.parametrize("chunks_10ms", [1, 3, 4])
async def test_the_frames_are_the_output_transport_s_chunks(chunks_10ms):
    """Unset, the frame size is the chunk of the transport the playout's frames reach, also from
    inside the speech-to-speech service (a pipeline: its frames leave through its end), so no
    partial chunk waits in the transport; without a transport in reach, Pipecat's default 40 ms."""
    from pipecat_taste import TasteSpeechToSpeech

    call = TasteCall(FakeEngine())
    assert await _frame_ms_after_start([TastePlayout(call), _line_output(chunks_10ms)], call) == 10 * chunks_10ms
    service = TasteSpeechToSpeech(FakeEngine())
    assert await _frame_ms_after_start([service, _line_output(chunks_10ms)], service.call) == 10 * chunks_10ms
    call = TasteCall(FakeEngine())
    assert await _frame_ms_after_start([TastePlayout(call)], call) == 40


@pytest.mark.parametrize("frame_ms, warned", [(30, True), (10, True), (40, False)])
async def test_a_frame_size_that_does_not_fill_the_transport_s_chunks_is_warned_about(frame_ms, warned):
    from loguru import logger

    messages = []
    sink = logger.add(lambda m: messages.append(str(m)), level="WARNING")
    try:
        call = TasteCall(FakeEngine())
        playout = TastePlayout(call, params=PlayoutParams(frame_ms=frame_ms))
        assert await _frame_ms_after_start([playout, _line_output(2)], call) == frame_ms  # as set
    finally:
        logger.remove(sink)
    assert any("not a whole number of the output transport's 20 ms chunks" in m for m in messages) == warned


@pytest.mark.serial  # what a transport plays in real time around a gap
@pytest.mark.parametrize("rate", [8000, 24000, 48000])
async def test_a_gap_in_the_synthesis_fades_out_and_back_in(rate):
    """The second chunk comes 350 ms late (the synthesizer fell behind real time): as the transport
    plays the frames, the audio must neither stop dead on a sample of the tone nor restart on one
    (both clicks); the reply's audio is all there, and the gap is counted and recorded."""
    import time

    from pipecat.frames.frames import TTSStoppedFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor

    from taste_agents.report import reply_audio_intact

    class Timed(FrameProcessor):
        def __init__(self):
            super().__init__()
            self.audio = []  # (arrival time, samples)

        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            if isinstance(frame, TTSAudioRawFrame) and direction == FrameDirection.DOWNSTREAM:
                self.audio.append((time.monotonic(), pcm16_to_float(frame.audio)))
            await self.push_frame(frame, direction)

    call = TasteCall(FakeEngine())
    call.active_reply_turn = 1
    call.log.keep_audio = True
    t = np.arange(rate * 300 // 1000) / rate
    tone = (0.3 * np.sin(2 * np.pi * 437 * t)).astype(np.float32)
    first, second = tone[: rate * 110 // 1000], tone[rate * 110 // 1000:]
    context = context_id_for(1)
    timed = Timed()
    frames = [TTSStartedFrame(context_id=context), TTSAudioRawFrame(float_to_pcm16(first), rate, 1, context_id=context),
              SleepFrame(0.35), TTSAudioRawFrame(float_to_pcm16(second), rate, 1, context_id=context),
              TTSStoppedFrame(context_id=context), SleepFrame(0.4)]
    await run_test(Pipeline([TastePlayout(call), timed]), frames_to_send=frames,
                   pipeline_params=PipelineParams(audio_out_sample_rate=rate))
    # played back to back; a frame that comes after the transport ran dry starts after silence
    ends_before_silence, starts_after_silence, heard_until, previous = [], [], None, None
    for arrived, samples in timed.audio:
        if heard_until is not None and arrived > heard_until + 0.002:
            ends_before_silence.append(previous[-1])
            starts_after_silence.append(samples[0])
            heard_until = arrived
        heard_until = (heard_until or arrived) + samples.size / rate
        previous = samples
    assert starts_after_silence, "no gap: the test did not make the synthesis fall behind"
    assert np.abs(ends_before_silence).max() < 1e-3 and np.abs(starts_after_silence).max() < 1e-3
    record = call.log.turn(1)
    assert record.underruns == 1 and len(record.audio_gaps) == 1
    released = np.frombuffer(b"".join(call.log.released_audio[1]), "<i2")  # the bridge, and all the tone
    assert reply_audio_intact(np.frombuffer(float_to_pcm16(tone), "<i2"), released, record, call.log.frame_samples,
                              call.log.fade_samples)[0]


async def test_a_segment_gives_its_slot_back_to_the_semaphore_it_took_it_from():
    """After a barge-in the generator has a new back-pressure semaphore; a segment sent before it
    that the synthesizer takes afterwards must not add a place to the new one (the limit would
    loosen for good, a little at each barge-in)."""
    import asyncio

    from pipecat_taste.frames import TasteReplyEndFrame, TasteReplySegmentFrame
    from pipecat_taste.synthesis import TasteSynthesizer
    from pipecat_taste.testing import FakeSegment

    call = TasteCall(FakeEngine())
    old = asyncio.Semaphore(1)
    await old.acquire()  # the generator's place for the segment below
    call.reset_segment_slots()  # the barge-in's new semaphore, every place taken
    new = call.segment_slots
    for _ in range(call.max_pending_segments):
        await new.acquire()
    segment = TasteReplySegmentFrame(1, 0, " sure", 1, FakeSegment(["sure"], 2), old)
    frames = [segment, TasteReplyEndFrame(1, "finished", 1), SleepFrame(0.3)]
    await run_test(TasteSynthesizer(call), frames_to_send=frames,
                   pipeline_params=PipelineParams(audio_out_sample_rate=RATE))
    assert not old.locked() and new.locked()


@pytest.mark.parametrize("when", ["queued", "late", "starting"])
async def test_segments_dropped_by_an_interruption_give_their_slots_back(when):
    """The generator may be done with the reply (idle: it renews no semaphore on the interruption)
    while its last segments still wait for the speech decoder: those dropped unspoken must give
    their slots back, or the next reply waits for room that never comes. ``late``: segments of the
    interrupted reply that arrive after the interruption; ``starting``: the interruption comes while
    the reply's speech state is being made (the first segment is off the queue, not yet decoded)."""
    from pipecat.frames.frames import InterruptionFrame

    from pipecat_taste.frames import TasteReplyEndFrame, TasteReplySegmentFrame
    from pipecat_taste.synthesis import TasteSynthesizer
    from pipecat_taste.testing import FakeSegment

    # a speech decoder slower than the LM; or a reply slow to start
    call = TasteCall(FakeEngine(decode_delay=0.3, start_speech_delay=0.5 if when == "starting" else 0.0))
    slots = call.segment_slots
    segments = []
    for i in range(call.max_pending_segments):
        await slots.acquire()
        segments.append(TasteReplySegmentFrame(1, i, f" w{i}", 1, FakeSegment([f"w{i}"], 2), slots))
    call.active_reply_turn = 1
    if when == "late":
        frames = [segments[0], SleepFrame(0.1), InterruptionFrame(), SleepFrame(0.05), *segments[1:]]
    elif when == "starting":
        frames = [segments[0], SleepFrame(0.2), InterruptionFrame(), *segments[1:]]
    else:
        frames = [*segments, SleepFrame(0.1), InterruptionFrame()]
    frames += [TasteReplyEndFrame(1, "finished", len(segments)), SleepFrame(0.6)]
    await run_test(TasteSynthesizer(call), frames_to_send=frames,
                   pipeline_params=PipelineParams(audio_out_sample_rate=RATE))
    assert call.segment_slots is slots and slots._value == call.max_pending_segments  # all given back
    assert not [e for e in call.log.events if e["kind"] == "synthesis_done"]  # nothing of it was spoken


@pytest.mark.parametrize("chunks_10ms, barge_in_delay_s", [(1, 0.0), (2, 0.005)])
async def test_a_barge_in_as_a_reply_ends_keeps_its_closing_frames(chunks_10ms, barge_in_delay_s):
    """The caller cuts in just after the playout sent the reply's TTSStoppedFrame, while the
    transport still has its last audio queued: the transport's interruption reset kept the audio
    (uninterruptible) but dropped the interruptible TTSStopped and LLMFullResponseEnd, so the bot
    was reported speaking until the next reply ended."""
    from pipecat.frames.frames import (BotStartedSpeakingFrame, BotStoppedSpeakingFrame, LLMFullResponseEndFrame,
                                       LLMFullResponseStartFrame, TTSStoppedFrame)
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.processors.frame_processor import FrameProcessor
    from pipecat.transports.base_transport import TransportParams

    from pipecat_taste.frames import TasteSegmentAudioFrame
    from taste_agents.simulate import SimulatedLine, _LineOutput

    class BargeIn(FrameProcessor):  # before the playout: an InterruptionFrame when the trigger says so
        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            await self.push_frame(frame, direction)

    class AtFirstStop(FrameProcessor):  # after the playout: fires once the first TTSStoppedFrame passes
        fired = False

        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            await self.push_frame(frame, direction)
            if isinstance(frame, TTSStoppedFrame) and not self.fired:
                self.fired = True
                self.create_task(self._barge_in())

        async def _barge_in(self):
            await asyncio.sleep(barge_in_delay_s)
            await barge_in.push_frame(InterruptionFrame())

    class Tap(FrameProcessor):
        seen: list = []

        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            self.seen.append(frame)
            await self.push_frame(frame, direction)

    call = TasteCall(FakeEngine())
    call.active_reply_turn = 1  # the generator keeps it until the playout's report is committed
    line = SimulatedLine(RATE, 10.0, frame_ms=10 * chunks_10ms)
    out = _LineOutput(line, TransportParams(audio_out_enabled=True, audio_out_sample_rate=RATE,
                                            audio_out_10ms_chunks=chunks_10ms, audio_out_end_silence_secs=0))
    t = np.arange(int(0.3 * RATE)) / RATE
    tone = (0.3 * np.sin(2 * np.pi * 437 * t)).astype(np.float32)
    frames = []
    for turn in (1, 2):
        context = context_id_for(turn)
        frames += [TTSStartedFrame(context_id=context), TasteSegmentAudioFrame(turn, 0, " hello", 1, 0, tone.size),
                   TTSAudioRawFrame(float_to_pcm16(tone), RATE, 1, context_id=context),
                   TTSStoppedFrame(context_id=context), SleepFrame(1.0)]
    barge_in, tap = BargeIn(), Tap()
    await run_test(Pipeline([barge_in, TastePlayout(call), AtFirstStop(), out, tap]), frames_to_send=frames,
                   pipeline_params=PipelineParams(audio_out_sample_rate=RATE))
    counts = {cls.__name__: sum(isinstance(f, cls) for f in tap.seen)
              for cls in (TTSStartedFrame, TTSStoppedFrame, LLMFullResponseStartFrame, LLMFullResponseEndFrame,
                          BotStartedSpeakingFrame, BotStoppedSpeakingFrame)}
    assert set(counts.values()) == {2}, counts  # one of each per reply


async def test_a_reply_after_one_taken_back_starts_clean_and_its_segments_tile_its_audio():
    """The synthesizer alone: a reply taken back part-way (its turn retracted), then the next reply
    with the same words. The next one starts exactly as the first did - faded in, none of the
    taken-back reply's held-back tail in front of it - and its segment markers (where the
    playout counts each word heard) tile its audio: each starts where the one before ends, the
    last ends with it."""
    from pipecat.frames.frames import TTSAudioRawFrame as Audio
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.processors.frame_processor import FrameProcessor

    from pipecat_taste.frames import TasteReplyEndFrame, TasteReplySegmentFrame, TasteSegmentAudioFrame, \
        TasteTurnStatusFrame
    from pipecat_taste.synthesis import TasteSynthesizer
    from pipecat_taste.testing import FakeSegment

    class Tap(FrameProcessor):
        def __init__(self):
            super().__init__()
            self.audio, self.markers = {}, {}

        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            if isinstance(frame, Audio):
                self.audio.setdefault(frame.context_id, []).append(pcm16_to_float(frame.audio))
            elif isinstance(frame, TasteSegmentAudioFrame):
                self.markers.setdefault(frame.turn_id, []).append(frame)
            await self.push_frame(frame, direction)

    call = TasteCall(FakeEngine())
    words = ("sure", "I", "can", "help")

    def segment(turn, i):
        return TasteReplySegmentFrame(turn, i, " " + words[i], 1, FakeSegment([words[i]], 2), None)

    frames = [segment(1, 0), segment(1, 1), SleepFrame(0.3), TasteTurnStatusFrame(1, "retracted"), SleepFrame(0.1),
              *(segment(2, i) for i in range(4)), TasteReplyEndFrame(2, "finished", 4), SleepFrame(0.5)]
    tap = Tap()
    await run_test(Pipeline([TasteSynthesizer(call), tap]), frames_to_send=frames,
                   pipeline_params=PipelineParams(audio_out_sample_rate=RATE))
    first, second = (np.concatenate(tap.audio[context_id_for(t)]) for t in (1, 2))
    n = min(first.size, int(0.05 * RATE))
    assert n > int(0.02 * RATE) and np.allclose(second[:n], first[:n], atol=1e-4)  # the same clean start
    markers = sorted(tap.markers[2], key=lambda m: m.index)
    assert [m.index for m in markers] == [0, 1, 2, 3] and markers[0].start_sample == 0
    assert all(m.end_sample > m.start_sample for m in markers)
    assert all(b.start_sample == a.end_sample for a, b in zip(markers, markers[1:]))
    assert markers[-1].end_sample == second.size


async def test_a_reply_whose_synthesis_fails_ends_where_it_failed():
    """The third word's synthesis fails while the LM is still generating: the audio before it plays
    straight through and fades out, and the reply ends there (its last partial frame waited in the
    playout until the generation ended, 4 s later, and then played alone: a blip and an underrun)."""
    from pipecat.frames.frames import TTSStoppedFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.processors.frame_processor import FrameProcessor

    from pipecat_taste.frames import TasteReplyEndFrame, TasteReplySegmentFrame
    from pipecat_taste.synthesis import TasteSynthesizer
    from pipecat_taste.testing import FakeSegment

    class Tap(FrameProcessor):
        seen: list = []

        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            self.seen.append((time.monotonic(), frame))
            await self.push_frame(frame, direction)

    call = TasteCall(FakeEngine(fail_vocode_on=("can",)))
    call.active_reply_turn = 1

    def segment(i, word):
        return TasteReplySegmentFrame(1, i, " " + word, 1, FakeSegment([word], 2), None)

    frames = [segment(0, "sure"), segment(1, "I"), segment(2, "can"), SleepFrame(4.0),  # still generating
              segment(3, "help"), TasteReplyEndFrame(1, "finished", 4), SleepFrame(0.5)]
    tap = Tap()
    # 30 ms frames: the fake's 20 ms words leave a partial frame in the playout's slicer at the failure
    await run_test(Pipeline([TasteSynthesizer(call), TastePlayout(call, params=PlayoutParams(frame_ms=30)), tap]),
                   frames_to_send=frames, pipeline_params=PipelineParams(audio_out_sample_rate=RATE))
    audio_at = [t for t, f in tap.seen if isinstance(f, TTSAudioRawFrame)]
    stopped_at = [t for t, f in tap.seen if isinstance(f, TTSStoppedFrame)]
    record = call.log.turns[1]
    assert len(record.errors) == 1 and record.played_words == 2
    assert audio_at[-1] - audio_at[0] < 1.0 and len(stopped_at) == 1 and stopped_at[0] - audio_at[-1] < 1.0
    assert record.underruns == 0 and record.audio_gaps == []
    audio = np.concatenate([pcm16_to_float(f.audio) for _, f in tap.seen if isinstance(f, TTSAudioRawFrame)])
    assert abs(audio[-1]) < 1e-3  # faded out


async def test_an_interruption_before_the_reply_s_first_segment_drops_the_segments_that_follow_it():
    """The caller barges in while the generator is on the reply's first word: nothing of it reached
    the synthesizer yet. A segment the interruption overtook, and the reply's end, arrive after it:
    no speech is started for them, and without a playout no audio of the cut reply goes out."""
    from pipecat.frames.frames import TTSAudioRawFrame as Audio

    from pipecat_taste.frames import TasteReplyEndFrame, TasteReplySegmentFrame
    from pipecat_taste.synthesis import TasteSynthesizer
    from pipecat_taste.testing import FakeSegment

    engine = FakeEngine()
    call = TasteCall(engine)
    call.active_reply_turn = 1  # the generator answers turn 1, and the interruption stops it:
    call.replies_cut_upto = 1  # (the generator names the reply it cut as it takes the interruption)
    frames = [InterruptionFrame(), SleepFrame(0.05), TasteReplySegmentFrame(1, 0, " sure", 1, FakeSegment(["sure"], 2), None),
              TasteReplyEndFrame(1, "cancelled", 1), SleepFrame(0.4)]
    down, _ = await run_test(TasteSynthesizer(call), frames_to_send=frames,
                             pipeline_params=PipelineParams(audio_out_sample_rate=24000))
    assert not [f for f in down if isinstance(f, Audio)]
    assert all(session.replies_started == 0 for session in engine.sessions)


async def test_a_barge_in_held_for_the_transport_passes_before_the_next_reply_starts():
    """The caller cuts into reply 1 while the transport plays it: the interruption is held until the
    transport stops (up to ``interruption_hold_secs``). Reply 2 arriving inside that hold first lets
    it pass, with reply 1's closing frame: each reply's frames stay between its Start and End, as an
    assistant aggregator downstream needs them."""
    from pipecat.frames.frames import (BotStartedSpeakingFrame, LLMFullResponseEndFrame, LLMFullResponseStartFrame,
                                       TTSStoppedFrame)

    call = TasteCall(FakeEngine())
    call.active_reply_turn = 1
    tone = (0.3 * np.sin(2 * np.pi * 437 * np.arange(RATE * 3 // 10) / RATE)).astype(np.float32)
    first, second = context_id_for(1), context_id_for(2)
    frames = [TTSStartedFrame(context_id=first), TTSAudioRawFrame(float_to_pcm16(tone), RATE, 1, context_id=first),
              SleepFrame(0.1), BotStartedSpeakingFrame(), SleepFrame(0.02), InterruptionFrame(), SleepFrame(0.1),
              TTSStartedFrame(context_id=second), TTSAudioRawFrame(float_to_pcm16(tone), RATE, 1, context_id=second),
              TTSStoppedFrame(context_id=second), SleepFrame(0.9)]
    down, _ = await run_test(TastePlayout(call), frames_to_send=frames,
                             pipeline_params=PipelineParams(audio_out_sample_rate=RATE))
    marks = [("start" if isinstance(f, LLMFullResponseStartFrame) else "end" if isinstance(f, LLMFullResponseEndFrame)
              else "interruption" if isinstance(f, InterruptionFrame) else f.context_id)
             for f in down if isinstance(f, (LLMFullResponseStartFrame, LLMFullResponseEndFrame, InterruptionFrame,
                                             TTSAudioRawFrame))]
    marks = [m for i, m in enumerate(marks) if i == 0 or m != marks[i - 1]]
    assert marks == ["start", first, "interruption", "end", "start", second, "end"], marks
    assert sum(isinstance(f, TTSStoppedFrame) for f in down) == 2


async def test_an_interruption_while_idle_does_not_cut_the_next_turn_s_reply():
    """An InterruptionFrame from elsewhere (an RTVI client, the app) while no reply is made or
    played, and the next user turn right behind it: by the time the frame reaches the playout, the
    generator may be on that turn already. The playout cuts what the generator cut (nothing), not
    the turn active by then: the reply is played whole and kept."""
    from pipecat.pipeline.pipeline import Pipeline

    from pipecat_taste.frames import TastePlaybackFrame
    from pipecat_taste.generation import TasteGenerator
    from pipecat_taste.synthesis import TasteSynthesizer
    from pipecat_taste.testing import fake_user_turn_frame as turn

    engine = FakeEngine(reply_words=("a", "b", "c"))
    call = TasteCall(engine)
    frames = [turn(1, "hello there"), SleepFrame(1.5), InterruptionFrame(), turn(2, "and you"), SleepFrame(2.0)]
    down, up = await run_test(Pipeline([TasteGenerator(call), TasteSynthesizer(call), TastePlayout(call)]),
                              frames_to_send=frames, pipeline_params=PipelineParams(audio_out_sample_rate=RATE))
    reports = [(f.turn_id, f.played_words, f.interrupted) for f in up if isinstance(f, TastePlaybackFrame)]
    assert reports == [(1, 3, False), (2, 3, False)]
    assert not call.log.turns[2].interrupted and call.log.turns[2].played_words == 3
    assert engine.sessions[0].history[-1] == ("assistant", "a b c")
    assert sum(isinstance(f, TTSAudioRawFrame) and f.context_id == context_id_for(2) for f in down) > 0


@pytest.mark.parametrize("name, value, words", [
    ("frame_ms", float("nan"), "PlayoutParams.frame_ms must be a finite number, got nan"),
    ("fade_out_ms", float("inf"), "PlayoutParams.fade_out_ms must be a finite number, got inf"),
    ("lead_ms", float("nan"), "PlayoutParams.lead_ms must be a finite number"),  # (was taken silently)
    ("lead_ms", "30", "PlayoutParams.lead_ms must be a finite number, got '30'"),
    ("frame_ms", 0, "PlayoutParams.frame_ms must be > 0, got 0"),
    ("prebuffer_ms", -1.0, "PlayoutParams.prebuffer_ms must be >= 0, got -1.0"),
    ("heard_fraction", 0.0, r"heard_fraction must be in \(0, 1\]"),
])
def test_playout_params_refuse_what_no_playout_can_run_with(name, value, words):
    """NaN frame_ms failed in the playout's setup, and Pipecat stopped the pipeline 20 s later."""
    with pytest.raises(ValueError, match=words):
        PlayoutParams(**{name: value})
    assert PlayoutParams(frame_ms=None, lead_ms=0, fade_out_ms=0).frame_ms is None


@pytest.mark.parametrize("pipeline_rate, line_rate", [(24000, 8000), (24000, 48000), (16000, 16000)])
async def test_the_reply_is_made_at_the_output_transport_s_rate_and_reaches_the_line_without_gaps(pipeline_rate,
                                                                                                 line_rate):
    """A transport that runs at another rate than the pipeline resamples the audio it is given, and
    Pipecat's streaming resampler releases it in bursts: paced at the pipeline's rate, every reply
    had a 20-40 ms hole (two clicks) about 140 ms in. The synthesizer and the playout now make and
    pace the audio at the transport's rate."""
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.transports.base_transport import TransportParams

    from pipecat_taste.frames import TasteReplyEndFrame, TasteReplySegmentFrame
    from pipecat_taste.synthesis import TasteSynthesizer
    from pipecat_taste.testing import FakeEngine, FakeSegment
    from taste_agents.simulate import SimulatedLine, _LineOutput

    call = TasteCall(FakeEngine())
    call.active_reply_turn = 1
    line = SimulatedLine(line_rate, 20.0)
    output = _LineOutput(line, TransportParams(audio_out_enabled=True, audio_out_sample_rate=line_rate,
                                               audio_out_10ms_chunks=2, audio_out_end_silence_secs=0))
    words = ["sure", "I", "can", "help", "with", "that"] * 2
    frames = [TasteReplySegmentFrame(1, i, " " + w, 1, FakeSegment([w], 2), None) for i, w in enumerate(words)]
    await run_test(Pipeline([TasteSynthesizer(call), TastePlayout(call), output]),
                   frames_to_send=frames + [TasteReplyEndFrame(1, "finished", len(words)), SleepFrame(0.3 * len(words) + 1)],
                   pipeline_params=PipelineParams(audio_out_sample_rate=pipeline_rate))
    assert call.log.audio_rate == line_rate
    writes = line.writes
    gaps = [(start - (prev + prev_samples.size)) for (prev, prev_samples), (start, _) in zip(writes, writes[1:])
            if start != prev + prev_samples.size]
    assert gaps == [], gaps  # one stretch of audio on the line, as released
    played = np.concatenate([samples for _, samples in writes])
    assert abs(played.size / line_rate - 0.2 * len(words)) < 0.05  # 200 ms a word, at the line's rate


async def test_a_transport_at_a_rate_the_synthesis_cannot_make_gets_the_pipeline_s_rate_and_a_warning():
    from loguru import logger
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.transports.base_transport import TransportParams

    from pipecat_taste.frames import TasteReplyEndFrame, TasteReplySegmentFrame
    from pipecat_taste.synthesis import TasteSynthesizer
    from pipecat_taste.testing import FakeEngine, FakeSegment
    from taste_agents.simulate import SimulatedLine, _LineOutput

    warnings = []
    sink = logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING")
    call = TasteCall(FakeEngine())
    call.active_reply_turn = 1
    line = SimulatedLine(11025, 10.0)
    output = _LineOutput(line, TransportParams(audio_out_enabled=True, audio_out_sample_rate=11025,
                                               audio_out_end_silence_secs=0))
    frames = [TasteReplySegmentFrame(1, 0, " sure", 1, FakeSegment(["sure"], 2), None),
              TasteReplyEndFrame(1, "finished", 1), SleepFrame(1.0)]
    try:
        await run_test(Pipeline([TasteSynthesizer(call), TastePlayout(call), output]), frames_to_send=frames,
                       pipeline_params=PipelineParams(audio_out_sample_rate=24000))
    finally:
        logger.remove(sink)
    assert call.log.audio_rate == 24000
    said = [w for w in warnings if "the output transport runs at 11025 Hz, which the TASTE synthesis does not make" in w]
    assert len(said) == 1, warnings  # decided once, by the synthesizer; the playout paces at its rate


def _tone(seconds: float) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * 437 * np.arange(int(RATE * seconds)) / RATE)).astype(np.float32)


def _reply(turn_id: int, audio: np.ndarray) -> list:
    from pipecat.frames.frames import TTSStoppedFrame

    context = context_id_for(turn_id)
    return [TTSStartedFrame(context_id=context), TTSAudioRawFrame(float_to_pcm16(audio), RATE, 1, context_id=context),
            TTSStoppedFrame(context_id=context)]


async def _play(call: TasteCall, frames: list, within_s: float = 20.0):
    """The playout alone; a pipeline that has not ended within ``within_s`` fails the test (the
    EndFrame run_test sends last was held)."""
    from pipecat.frames.frames import CancelFrame

    playout = TastePlayout(call)
    task = asyncio.ensure_future(run_test(playout, frames_to_send=frames,
                                          pipeline_params=PipelineParams(audio_out_sample_rate=RATE)))
    done, _ = await asyncio.wait({task}, timeout=within_s)
    if not done:
        await playout.queue_frame(CancelFrame())  # (ends the held pipeline, so that the test fails, not hangs)
        await asyncio.wait({task}, timeout=5.0)
        pytest.fail(f"the call did not end within {within_s} s")
    return task.result()


async def test_the_transport_never_holds_more_than_the_lead_also_after_the_synthesis_fell_behind():
    """Frames go out as they are due, ``lead_ms`` ahead: a transport playing them back to back holds
    at most the lead and a frame - also after a gap in the synthesis (without the clock restarted
    there, the audio after it went out at once: a transport holding 300 ms of uninterruptible reply
    stops a barge-in that much later, and counts as heard what was not)."""
    from pipecat.frames.frames import TTSStoppedFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor

    class Arrivals(FrameProcessor):
        def __init__(self):
            super().__init__()
            self.frames = []

        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            if isinstance(frame, TTSAudioRawFrame) and direction == FrameDirection.DOWNSTREAM:
                self.frames.append((time.monotonic(), len(frame.audio) // 2))
            await self.push_frame(frame, direction)

    call = TasteCall(FakeEngine())
    tone, context, arrivals = _tone(1.2), context_id_for(1), Arrivals()
    first = int(0.11 * RATE)
    frames = [TTSStartedFrame(context_id=context), TTSAudioRawFrame(float_to_pcm16(tone[:first]), RATE, 1, context_id=context),
              SleepFrame(0.35), TTSAudioRawFrame(float_to_pcm16(tone[first:]), RATE, 1, context_id=context),
              TTSStoppedFrame(context_id=context), SleepFrame(1.5)]
    await run_test(Pipeline([TastePlayout(call, params=PlayoutParams(lead_ms=30.0)), arrivals]), frames_to_send=frames,
                   pipeline_params=PipelineParams(audio_out_sample_rate=RATE))
    assert call.log.turn(1).underruns >= 1  # the gap happened
    heard_until, held = None, []
    for arrived, samples in arrivals.frames:  # a transport playing each frame after the one before
        heard_until = max(heard_until or arrived, arrived) + samples / RATE
        held.append(heard_until - arrived)
    frame_s = call.log.frame_samples / RATE
    assert max(held) <= 0.030 + frame_s + 0.03, (max(held), frame_s)


async def test_a_paused_reply_fades_out_and_fades_back_in_where_it_stopped():
    """Paused by the caller's sound and resumed, the reply fades out into the pause and back in
    after it: no step anywhere (the audio sits well away from zero, so an unfaded restart would be
    one), and after the pause it goes on exactly where it stopped."""
    from pipecat_taste.frames import TasteReplyPauseFrame

    call = TasteCall(FakeEngine())
    reply = (0.2 + 0.1 * np.sin(2 * np.pi * 437 * np.arange(int(RATE * 0.6)) / RATE)).astype(np.float32)
    frames = _reply(1, reply) + [SleepFrame(0.2), TasteReplyPauseFrame(2, paused=True), SleepFrame(0.3),
                                 TasteReplyPauseFrame(2, paused=False), SleepFrame(0.7)]
    down, _ = await _play(call, frames)
    record = call.log.turn(1)
    assert len(record.pauses_s) == 1 and len(record.audio_gaps) == 1, (record.pauses_s, record.audio_gaps)
    audio = np.concatenate([pcm16_to_float(f.audio) for f in down if isinstance(f, TTSAudioRawFrame)])
    steepest = np.abs(np.diff(reply)).max()
    assert np.abs(np.diff(audio)).max() <= 1.1 * steepest + 2e-3
    before, bridge = record.audio_gaps[0]  # the reply's samples heard before the pause, its faded frame
    resumed = audio[before + bridge:]
    assert abs(resumed[0]) < 0.02  # faded in
    assert np.allclose(resumed[480:960], reply[before + 480:before + 960], atol=1e-3)  # where it stopped


async def test_a_pause_that_comes_once_all_of_the_reply_is_out_leaves_no_gap_and_no_pause():
    """The caller's sound begins as the reply's last audio goes out: nothing is left to pause (the
    synthesizer faded its end), so no faded frame is added after it and its record shows no gap."""
    from pipecat_taste.frames import TasteReplyPauseFrame

    call = TasteCall(FakeEngine())
    frames = _reply(1, _tone(0.3)) + [SleepFrame(0.285), TasteReplyPauseFrame(2, paused=True), SleepFrame(0.3),
                                      TasteReplyPauseFrame(2, paused=False), SleepFrame(0.3)]
    down, _ = await _play(call, frames)
    record = call.log.turn(1)
    assert record.audio_gaps == [] and record.pauses_s == [] and record.underruns == 0
    released = sum(len(f.audio) // 2 for f in down if isinstance(f, TTSAudioRawFrame))
    frame = call.log.frame_samples
    assert released == -(-int(0.3 * RATE) // frame) * frame  # (the last frame padded with silence)


def test_the_start_hold_is_the_largest_recent_need_plus_the_lead_and_capped():
    """The hold covers the largest need of the engine's last replies plus ``lead_ms``, never more
    than ``start_hold_max_ms`` (a cap taken as a floor would hold every reply 400 ms), and is 0
    once the recent replies' chunks came with time to spare."""
    call = TasteCall(FakeEngine())
    playout = TastePlayout(call, params=PlayoutParams(lead_ms=30.0, start_hold_max_ms=400.0))
    assert playout.start_hold_s == 0.0  # nothing learned yet
    call.start_needs.record(0.1)
    assert playout.start_hold_s == pytest.approx(0.13)
    call.start_needs.record(1.0)
    assert playout.start_hold_s == pytest.approx(0.4)
    for _ in range(3):  # the memory's worth of replies with time to spare
        call.start_needs.record(-0.05)
    assert playout.start_hold_s == 0.0
    never = TastePlayout(TasteCall(FakeEngine()), params=PlayoutParams(start_hold_max_ms=0.0))
    never._call.start_needs.record(0.3)
    assert never.start_hold_s == 0.0


async def test_a_pause_before_the_first_audio_is_not_counted_as_the_start_hold():
    """A reply held back at its start (the hold learned from earlier replies) is paused by the
    caller's sound meanwhile: the record's start hold is the hold's, not the caller's sound's."""
    from pipecat_taste.frames import TasteReplyPauseFrame

    call = TasteCall(FakeEngine())
    call.start_needs.record(0.2)  # the earlier replies needed their first audio held back
    frames = [*_reply(1, _tone(0.5))[:2], SleepFrame(0.05), TasteReplyPauseFrame(2, paused=True), SleepFrame(0.6),
              TasteReplyPauseFrame(2, paused=False), SleepFrame(0.1), _reply(1, _tone(0.5))[2], SleepFrame(0.8)]
    started = time.monotonic()
    down, _ = await _play(call, frames)
    record = call.log.turn(1)
    assert record.first_audio_at - started > 0.6  # it was held through the pause
    assert 0.0 < record.start_hold_s < 0.2, record.start_hold_s


async def test_a_call_that_ends_with_a_reply_paused_by_no_one_s_verdict_still_ends():
    """A pause that nothing lifts (an app's TasteReplyPauseFrame; the capture lifts its own before
    its EndFrame) would hold the reply, and the EndFrame queued behind it, for ever: the end of the
    call lifts it, and the reply plays out, recorded as paused until then."""
    from pipecat_taste.frames import TasteReplyPauseFrame

    call = TasteCall(FakeEngine())
    frames = _reply(1, _tone(1.0)) + [SleepFrame(0.3), TasteReplyPauseFrame(2, paused=True), SleepFrame(0.1)]
    down, _ = await _play(call, frames)
    record = call.log.turn(1)
    assert len(record.pauses_s) == 1 and len(record.audio_gaps) == 1
    released = sum(len(f.audio) // 2 for f in down if isinstance(f, TTSAudioRawFrame))
    frame = call.log.frame_samples  # all of it, and the faded frame into the pause
    assert released == -(-int(1.0 * RATE) // frame) * frame + frame


async def test_a_hang_up_records_what_the_caller_heard_not_what_the_transport_still_held():
    """A CancelFrame mid-reply: the transport drops the lead it held, unheard; the record's played
    audio (and the words counted by it) ends where the caller stopped hearing."""
    from pipecat.frames.frames import CancelFrame

    call = TasteCall(FakeEngine())
    frames = [*_reply(1, _tone(2.0))[:2], SleepFrame(0.6), CancelFrame()]
    playout = TastePlayout(call, params=PlayoutParams(lead_ms=200))
    down, _ = await run_test(playout, frames_to_send=frames, send_end_frame=False,
                             pipeline_params=PipelineParams(audio_out_sample_rate=RATE))
    record = call.log.turn(1)
    released = sum(len(f.audio) // 2 for f in down if isinstance(f, TTSAudioRawFrame))
    assert record.ended_by_hangup
    heard_s = record.played_samples / RATE
    assert released / RATE - heard_s > 0.1, (released / RATE, heard_s)  # the lead was not heard
    assert 0.4 < heard_s < 0.7


async def test_a_hang_up_just_after_a_pause_began_records_the_audio_before_its_fade():
    """The pause's faded frame moves the reply's clock on by a frame; the audio released before it
    is heard on the old clock. A hang-up right then counted one frame too few: below zero when the
    pause came during the first frame."""
    from pipecat.frames.frames import CancelFrame

    from pipecat_taste.frames import TasteReplyPauseFrame

    call = TasteCall(FakeEngine())
    frames = [*_reply(1, _tone(2.0))[:2], SleepFrame(0.005), TasteReplyPauseFrame(2, paused=True), SleepFrame(0.01),
              CancelFrame()]
    await run_test(TastePlayout(call), frames_to_send=frames, send_end_frame=False,
                   pipeline_params=PipelineParams(audio_out_sample_rate=RATE))
    record = call.log.turn(1)
    [(gap_at, _)] = record.audio_gaps
    assert 0 < record.played_samples <= gap_at, (record.played_samples, gap_at)
