"""Incremental ASR in TasteTurnCapture, on the tiny engine with a real (random) Whisper: partial
transcripts while the caller speaks, one ASR job at a time, the final transcript equal to the
full-turn transcript, the per-turn "ASR work after the end of the turn" figure, and partials that
fail without harming the turn.

The engine's ASR is wrapped in a recorder that logs every call (kind, thread times, audio) and
can slow calls down or make partials fail. The Whisper has large random weights so that its
transcript depends on the audio it hears (the pipeline's random tiny ASR says the same thing
for any audio, which would make "equal transcripts" prove nothing).
"""

import threading
import time

import numpy as np
import pytest
import torch
from pipecat.frames.frames import ErrorFrame, InputAudioRawFrame, TranscriptionFrame
from pipecat.pipeline.worker import PipelineParams
from pipecat.tests.utils import SleepFrame, run_test
from pipecat.utils.time import time_now_iso8601

from pipecat_taste import TasteCall, TasteTurnCapture, TurnCaptureParams, WebRTCVADAnalyzer
from pipecat_taste.asr import WhisperTranscriber
from pipecat_taste.audio import float_to_pcm16
from pipecat_taste.engine import TasteEngine
from pipecat_taste.frames import TasteUserTurnFrame
from taste_agents.caller import load_utterances

SR = 16000


@pytest.fixture(scope="module")
def engine():
    return TasteEngine.from_pretrained(None)  # the embedded tiny checkpoint


@pytest.fixture(scope="module")
def whisper(engine):
    """A random Whisper whose transcript changes with the audio (static loop, rehearsed step)."""
    base = WhisperTranscriber.random_tiny(engine.checkpoint_dir)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in base.model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    base.model.generation_config.max_length = 10
    return WhisperTranscriber(base.model, base.feature_extractor, base.tokenizer, language=None, max_new_tokens=None,
                              decode="static", graph_mode="rehearse")


@pytest.fixture(scope="module")
def reference(whisper):
    """The full-turn transcript as transformers' generate gives it."""
    return WhisperTranscriber(whisper.model, whisper.feature_extractor, whisper.tokenizer, language=None,
                              max_new_tokens=None, decode="dynamic")


@pytest.fixture(scope="module")
def utterances():
    return load_utterances()


class RecordingASR:
    """The built-in ASR with a log of every call: (kind, start, end, audio samples, ok)."""

    def __init__(self, transcriber, delay=0.0, fail_partials=False):
        self.transcriber, self.delay, self.fail_partials = transcriber, delay, fail_partials
        self.calls: list[tuple[str, float, float, int, bool]] = []
        self.audio: dict[str, list[np.ndarray]] = {"partial": [], "final": [], "full": []}
        self._lock = threading.Lock()
        self._running = 0
        self.max_running = 0

    def _timed(self, kind, fn, audio):
        with self._lock:
            self._running += 1
            self.max_running = max(self.max_running, self._running)
        start, ok = time.monotonic(), False
        try:
            time.sleep(self.delay)
            if kind == "partial" and self.fail_partials:
                raise RuntimeError("injected partial ASR failure")
            result = fn(audio)
            ok = True
            return result
        finally:
            with self._lock:
                self._running -= 1
            self.calls.append((kind, start, time.monotonic(), len(audio), ok))
            self.audio[kind].append(np.array(audio))

    def __call__(self, audio):  # TasteSession.transcribe: no incremental state
        return self._timed("full", self.transcriber, audio)

    def new_turn(self):
        return RecordingTurn(self, self.transcriber.new_turn())

    def of(self, kind):
        return [c for c in self.calls if c[0] == kind]


class RecordingTurn:
    def __init__(self, recorder, inner):
        self.recorder, self.inner = recorder, inner

    @property
    def partials(self):
        return self.inner.partials

    @property
    def kept(self):
        return self.inner.kept

    def partial(self, audio):
        return self.recorder._timed("partial", self.inner.partial, audio)

    def finish(self, audio):
        return self.recorder._timed("final", self.inner.finish, audio)


def paced_frames(audio, ms=20, frames_per_sleep=5):
    """20 ms input frames at about real time (a sleep after every 100 ms of audio): the turn is
    captured over time, as in a call, so partials can run while it is being spoken."""
    n = SR * ms // 1000
    audio = np.concatenate([audio, np.zeros((-audio.size) % n, np.float32)])
    frames = []
    for i in range(0, audio.size, n):
        frames.append(InputAudioRawFrame(float_to_pcm16(audio[i:i + n]), SR, 1))
        if len(frames) % (frames_per_sleep + 1) == frames_per_sleep:
            frames.append(SleepFrame(ms * frames_per_sleep / 1000))
    return frames


def silence(seconds):
    return np.zeros(int(seconds * SR), np.float32)


class CountingCall(TasteCall):
    """Logs every job given to the listening thread: what it is and how many listening jobs were
    still queued or running when it was submitted."""

    def __init__(self, engine):
        super().__init__(engine)
        self.submitted: list[tuple[str, int]] = []
        self._outstanding = 0

    async def run(self, stage, fn, *args):
        if stage != "listen":
            return await super().run(stage, fn, *args)
        self.submitted.append((getattr(fn, "__qualname__", ""), self._outstanding))
        self._outstanding += 1
        try:
            return await super().run(stage, fn, *args)
        finally:
            self._outstanding -= 1

    @property
    def partial_submissions(self):
        return [busy for name, busy in self.submitted if "_partial" in name]


async def run_call(engine, recorder, frames, params, tail_secs=2.5):
    engine.asr = recorder
    call = CountingCall(engine)
    capture = TasteTurnCapture(call, vad_analyzer=WebRTCVADAnalyzer(), params=params)
    down, up = await run_test(capture, frames_to_send=frames + [SleepFrame(tail_secs)],
                              pipeline_params=PipelineParams(audio_in_sample_rate=SR))
    return call, [f for f in down if isinstance(f, TasteUserTurnFrame)], [f for f in up if isinstance(f, ErrorFrame)]


def one_turn(utterances, name="hello"):
    return paced_frames(np.concatenate([silence(0.5), utterances[name].audio, silence(1.0)]))


async def test_partials_while_speaking_and_the_final_is_the_full_turn_transcript(engine, whisper, reference, utterances):
    recorder = RecordingASR(whisper)
    call, turns, errors = await run_call(engine, recorder, one_turn(utterances), TurnCaptureParams(transcripts="asr"))
    assert not errors and len(turns) == 1
    record = call.log.turns[turns[0].turn_id]
    partials, finals = recorder.of("partial"), recorder.of("final")
    assert len(partials) >= 2 and len(finals) == 1 and not recorder.of("full")
    assert all(start < record.vad_stop_at for _, start, _, _, _ in partials)  # while the caller spoke
    assert record.asr_partials == len(partials)
    assert [e for e in call.log.events if e["kind"] == "asr_partial" and e["turn_id"] == record.turn_id]
    # Partials heard growing prefixes of the turn; the final heard all of it, and its transcript is
    # generate's transcript of that audio (the partials were only drafts).
    sizes = [size for _, _, _, size, _ in partials]
    assert sizes == sorted(sizes) and sizes[-1] < finals[0][3]
    full_audio = recorder.audio["final"][0]
    assert turns[0].transcript == reference(full_audio) == record.transcript
    assert [reference(a) for a in recorder.audio["partial"]] != [turns[0].transcript] * len(partials)
    assert record.asr_after_end_ms is not None and record.asr_after_end_ms >= 0
    assert 0 <= record.asr_kept_tokens <= 10
    assert recorder.max_running == 1 and all(busy == 0 for busy in call.partial_submissions)


async def test_the_figure_is_the_asr_work_after_the_end_of_the_turn(engine, whisper, utterances):
    """With every ASR call slowed down, the figure covers the final transcription and the part of
    a partial still running at the end of the turn - and nothing before the end."""
    recorder = RecordingASR(whisper, delay=0.3)
    # the VAD's end here (an early hand-over, 300 ms sooner, starts the final transcription sooner)
    call, turns, _ = await run_call(engine, recorder, one_turn(utterances),
                                    TurnCaptureParams(transcripts="asr", early_reply_secs=None))
    record = call.log.turns[turns[0].turn_id]
    stop = record.vad_stop_at
    after = sum(max(0.0, end - max(start, stop)) for _, start, end, _, _ in recorder.calls)
    final = recorder.of("final")[0]
    assert after >= final[2] - final[1] >= 0.3
    # the capture's own timing wraps the recorder's calls (plus a little Python overhead; the
    # record is rounded to 0.1 ms)
    assert 1000 * after - 0.1 <= record.asr_after_end_ms <= 1000 * after + 50


async def test_one_asr_job_at_a_time_and_partials_are_skipped_not_queued(engine, whisper, utterances):
    recorder = RecordingASR(whisper, delay=0.4)
    params = TurnCaptureParams(transcripts="asr", incremental_asr_every_secs=0.1)
    call, turns, _ = await run_call(engine, recorder, one_turn(utterances), params)
    assert len(turns) == 1
    record = call.log.turns[turns[0].turn_id]
    partials = recorder.of("partial")
    assert recorder.max_running == 1
    # a partial is only submitted to an idle listening thread: never one queued behind another
    assert call.partial_submissions and all(busy == 0 for busy in call.partial_submissions)
    intervals = sorted((start, end) for _, start, end, _, _ in recorder.calls)
    assert all(b[0] >= a[1] for a, b in zip(intervals, intervals[1:]))  # never overlapping
    # every 0.1 s of audio would ask for ~30 partials; the busy worker skipped most of them
    assert 1 <= len(partials) < record.audio_seconds / 0.1 / 2
    assert all(start < record.vad_stop_at for _, start, _, _, _ in partials)  # none queued past the end


async def test_failing_partials_do_not_break_the_turn(engine, whisper, reference, utterances):
    recorder = RecordingASR(whisper, fail_partials=True)
    call, turns, errors = await run_call(engine, recorder, one_turn(utterances), TurnCaptureParams(transcripts="asr"))
    assert recorder.of("partial") and not any(ok for *_, ok in recorder.of("partial"))
    assert not errors and len(turns) == 1
    record = call.log.turns[turns[0].turn_id]
    assert turns[0].transcript == reference(recorder.audio["final"][0])
    assert record.errors == [] and record.asr_partials == 0 and record.asr_after_end_ms >= 0
    failed = [e for e in call.log.events if e["kind"] == "asr_partial_failed"]
    assert len(failed) == len(recorder.of("partial")) and "injected" in failed[0]["error"]


async def test_incremental_off_transcribes_once_at_the_end(engine, whisper, reference, utterances):
    recorder = RecordingASR(whisper)
    params = TurnCaptureParams(transcripts="asr", incremental_asr=False)
    call, turns, _ = await run_call(engine, recorder, one_turn(utterances), params)
    assert [c[0] for c in recorder.calls] == ["full"]
    record = call.log.turns[turns[0].turn_id]
    assert turns[0].transcript == reference(recorder.audio["full"][0])
    assert record.asr_partials == 0 and record.asr_after_end_ms >= 0


async def test_an_upstream_transcript_ends_partials_for_the_call(engine, whisper, utterances):
    """'auto': once an STT upstream has sent a transcript, the built-in ASR only runs as the
    fallback at the end of a turn that got none."""
    upstream = [SleepFrame(0.2), TranscriptionFrame(utterances["hello"].text, "caller", time_now_iso8601(),
                                                     finalized=True), SleepFrame(0.2)]
    frames = paced_frames(np.concatenate([silence(0.5), utterances["hello"].audio])) + upstream + \
        paced_frames(np.concatenate([silence(1.0), utterances["time"].audio, silence(1.0)]))
    recorder = RecordingASR(whisper)
    call, turns, _ = await run_call(engine, recorder, frames, TurnCaptureParams(transcript_timeout_secs=0.3))
    assert len(turns) == 2 and turns[0].transcript == utterances["hello"].text
    first, second = (call.log.turns[t.turn_id] for t in turns)
    assert first.asr_after_end_ms is None  # the upstream transcript was used
    assert second.asr_partials == 0 and second.asr_after_end_ms is not None
    assert all(start < first.vad_stop_at for _, start, *_ in recorder.of("partial"))
    assert [c[0] for c in recorder.calls if c[1] > first.vad_stop_at] == ["full"]  # the second turn, once


async def test_partials_wait_for_an_earlier_turn_to_be_finished(engine, whisper, reference, utterances):
    """The next turn starts while the previous one is still being transcribed and tokenized: its
    partials stay off the listening thread until that is done, and both turns come out whole."""
    recorder = RecordingASR(whisper, delay=1.0)
    frames = paced_frames(np.concatenate([silence(0.5), utterances["hello"].audio, silence(0.7),
                                          utterances["time"].audio, silence(1.0)]))
    params = TurnCaptureParams(transcripts="asr", incremental_asr_every_secs=0.3)
    call, turns, errors = await run_call(engine, recorder, frames, params, tail_secs=4.0)
    assert not errors and len(turns) == 2
    assert call.partial_submissions and all(busy == 0 for busy in call.partial_submissions)
    assert [t.transcript for t in turns] == [reference(a) for a in recorder.audio["final"]]


def test_turns_ending_together_are_transcribed_as_one_batch(whisper, reference, utterances):
    """Two calls' turns end at once (``TurnTranscript.ended``, as ``TasteSession.turn_ended`` calls
    it); their final transcriptions come 30 ms apart, yet they are decoded as one batch - one pass
    of the transcriber's shared encoder - and each transcript is the full-turn one."""
    from concurrency_helpers import run_in_threads

    shared = WhisperTranscriber(whisper.model, whisper.feature_extractor, whisper.tokenizer, language=None,
                                max_new_tokens=None, decode="static", graph_mode="rehearse", batch_rows=2)
    shared.warm_up(workspaces=2)
    audios = [utterances["hello"].audio, utterances["time"].audio]
    turns = [shared.new_turn() for _ in audios]
    for turn, audio in zip(turns, audios):
        turn.partial(audio[: len(audio) // 2])
    shared._batches().timed(10.0)  # (a long limit, capped at MAX_WAIT_S: the wait must end because the other came)
    before, batches_before = shared.encoder_stats(), shared.batch_stats()
    for turn in turns:
        turn.ended()
    texts = [None, None]

    def finish(i):
        time.sleep(0.03 * i)
        texts[i] = turns[i].finish(audios[i])

    run_in_threads(finish, [(0,), (1,)])
    after, batches_after = shared.encoder_stats(), shared.batch_stats()
    assert (after["turns"] - before["turns"], after["passes"] - before["passes"]) == (2, 1), (before, after)
    assert (batches_after["utterances"] - batches_before["utterances"],
            batches_after["batches"] - batches_before["batches"]) == (2, 1), (batches_before, batches_after)
    assert batches_after["waits"] == batches_before["waits"] + 1
    assert batches_after["waits_ran_out"] == batches_before["waits_ran_out"]  # ended when the other came
    assert texts == [reference(audio) for audio in audios]
    with pytest.raises(ValueError, match="batch_rows must be"):
        WhisperTranscriber(whisper.model, whisper.feature_extractor, whisper.tokenizer, batch_rows=0)


def test_a_partial_s_tokens_are_the_draft_the_next_transcription_starts_from(whisper, reference, utterances):
    """What a partial heard is the next pass's draft (the finish checks it instead of decoding it
    again); the finish's transcript is the whole turn's all the same."""
    audio = utterances["hello"].audio
    turn = whisper.new_turn()
    half = audio[:audio.size // 2]
    text = turn.partial(half)
    assert turn.draft == whisper.transcribe(half).ids and text == turn.text and turn.draft
    assert turn.finish(audio) == reference(audio)


def test_a_turn_given_up_after_it_ended_is_no_longer_waited_for(whisper):
    """A turn announced to the shared decoding batches (its caller stopped speaking) that will
    not be transcribed after all (it took an STT's words) is withdrawn: another call's batch does
    not wait for it."""
    batched = WhisperTranscriber(whisper.model, whisper.feature_extractor, whisper.tokenizer, language=None,
                                 max_new_tokens=None, decode="static", graph_mode="rehearse", batch_rows=4)
    turn = batched.new_turn()
    turn.ended()
    assert batched._batches()._ending.pending() == 1
    turn.given_up()
    assert batched._batches()._ending.pending() == 0
