"""In-process simulated calls: a scripted caller and the TASTE agent on a virtual phone line.

Everything runs in real time in one process, with no network: the caller sends a 20 ms frame
every 20 ms into the agent's input transport, and the agent's output transport "plays" what it
is given on the line the way a sound card would (it blocks while more than one frame is
buffered). The line records both sides on one sample clock, so latencies, overlaps and the
barge-in stop time are measured on the recording itself.

    result = await simulate_call(engine, default_script(), out_dir="out/call")
    result.report["turns"]   # per caller utterance: decision, first-audio latency, ...

An oracle STT stands in for a speech recogniser: when the caller finishes an utterance its
transcript goes into the agent's pipeline as a ``TranscriptionFrame`` after ``stt_delay_s``; with
``stt_interim_after_s``, as a streaming STT's do, the first half of its words go in as an
``InterimTranscriptionFrame`` that long after the utterance began (if it still goes on).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from pipecat.frames.frames import (
    BotStartedSpeakingFrame,
    BotStoppedSpeakingFrame,
    ErrorFrame,
    Frame,
    InputAudioRawFrame,
    InterimTranscriptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    MetricsFrame,
    OutputAudioRawFrame,
    TranscriptionFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.transports.base_input import BaseInputTransport
from pipecat.transports.base_output import BaseOutputTransport
from pipecat.transports.base_transport import BaseTransport, TransportParams
from pipecat.utils.time import time_now_iso8601
from pipecat.workers.runner import WorkerRunner

from pipecat_taste.audio import float_to_int16, float_to_pcm16, resample
from pipecat_taste.call import CallLog
from pipecat_taste.frames import TasteTurnDecisionFrame, TasteTurnMetricsFrame

from taste_agents.caller import CallerEvent, ScriptedCaller


# What the call records after the output transport (the frames a Pipecat app would observe).
OBSERVED_FRAMES = (
    BotStartedSpeakingFrame, BotStoppedSpeakingFrame, LLMFullResponseStartFrame, LLMFullResponseEndFrame,
    LLMTextFrame, TTSStartedFrame, TTSStoppedFrame, TTSTextFrame, MetricsFrame, TasteTurnMetricsFrame,
    TasteTurnDecisionFrame,
)


class SimulatedLine:
    """Both sides of the call on one sample clock (sample 0 = the call's start)."""

    def __init__(self, sample_rate: int, max_seconds: float, frame_ms: int = 20):
        self.sample_rate = sample_rate
        self.frame_samples = sample_rate * frame_ms // 1000
        n = int(max_seconds * sample_rate) + sample_rate
        self.caller = np.zeros(n, dtype=np.int16)
        self.agent = np.zeros(n, dtype=np.int16)
        self.t0 = time.monotonic()
        self.play_sample = 0  # where the agent's next sample will be heard
        self.writes: list[tuple[int, np.ndarray]] = []  # (first sample, int16 samples) as played
        self.device_buffer = self.frame_samples

    def start(self):
        self.t0 = time.monotonic()

    def now_sample(self) -> int:
        return int(round((time.monotonic() - self.t0) * self.sample_rate))

    def sample_of(self, t: float | None) -> int | None:
        return None if t is None else int(round((t - self.t0) * self.sample_rate))

    async def play(self, samples: np.ndarray) -> None:
        """The agent's sound card: play after what is queued, block while a frame is buffered."""
        now = self.now_sample()
        if self.play_sample < now:
            self.play_sample = now  # the line was idle
        start = self.play_sample
        end = min(start + samples.size, self.agent.size)
        self.agent[start:end] = samples[: end - start]
        self.writes.append((start, samples.copy()))
        self.play_sample = start + samples.size
        wait = (self.play_sample - self.device_buffer - self.now_sample()) / self.sample_rate
        if wait > 0:
            await asyncio.sleep(wait)

    def heard(self, start: int, n: int) -> np.ndarray:
        start = max(0, start)
        return self.agent[start:start + n].astype(np.float32) / 32768.0


class _LineInput(BaseInputTransport):
    async def start(self, frame):
        await super().start(frame)
        await self.set_transport_ready(frame)


class _LineOutput(BaseOutputTransport):
    def __init__(self, line: SimulatedLine, params: TransportParams, **kwargs):
        super().__init__(params, **kwargs)
        self._line = line

    async def start(self, frame):
        await super().start(frame)
        await self.set_transport_ready(frame)

    async def write_audio_frame(self, frame: OutputAudioRawFrame) -> bool:
        samples = np.frombuffer(frame.audio, dtype="<i2")
        if frame.sample_rate != self._line.sample_rate:
            samples = float_to_int16(resample(samples.astype(np.float32) / 32768.0, frame.sample_rate,
                                              self._line.sample_rate))
        await self._line.play(samples)
        return True


class LineTransport(BaseTransport):
    """A Pipecat transport whose far end is a :class:`SimulatedLine`."""

    def __init__(self, line: SimulatedLine):
        super().__init__()
        params = TransportParams(
            audio_in_enabled=True, audio_in_sample_rate=line.sample_rate,
            audio_out_enabled=True, audio_out_sample_rate=line.sample_rate,
            audio_out_10ms_chunks=max(1, line.frame_samples * 100 // line.sample_rate),
            audio_out_end_silence_secs=0,
        )
        self._input = _LineInput(params, name="LineInput")
        self._output = _LineOutput(line, params, name="LineOutput")

    def input(self) -> FrameProcessor:
        return self._input

    def output(self) -> FrameProcessor:
        return self._output


class FrameTap(FrameProcessor):
    """Keeps the frames of the given types that pass (in one direction), and passes everything on."""

    def __init__(self, types: tuple, direction: FrameDirection, **kwargs):
        super().__init__(**kwargs)
        self._types, self._direction = types, direction
        self.frames: list[tuple[float, Frame]] = []

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if direction == self._direction and isinstance(frame, self._types):
            self.frames.append((time.monotonic(), frame))
        await self.push_frame(frame, direction)


@dataclass
class SimulatedCall:
    line: SimulatedLine
    caller: ScriptedCaller
    log: CallLog
    errors: list[str]
    metrics: list[dict]
    duration_s: float
    timed_out: bool
    frames: list = field(default_factory=list)  # (time, frame) seen after the output transport
    upstream_frames: list = field(default_factory=list)  # (time, frame) arriving at the input side
    report: dict = field(default_factory=dict)
    paths: dict = field(default_factory=dict)

    @property
    def recording(self) -> np.ndarray:
        """(N, 2) int16: caller | agent."""
        n = self.line.caller.size
        return np.stack([self.line.caller[:n], self.line.agent[:n]], axis=1)


async def simulate_call(engine, script: list, *, config=None, sample_rate: int = 16000, stt_delay_s: float = 0.3,
                        stt_interim_after_s: float | None = None, tail_s: float = 1.5, max_call_s: float = 300.0,
                        progress: Callable[[str], None] | None = None,
                        out_dir: str | Path | None = None, meta: dict | None = None,
                        service_factory=None, voice=None) -> SimulatedCall:
    """Run one call between ``script`` (a ScriptedCaller script) and the phone agent built from
    ``engine`` and ``config`` (a PhoneAgentConfig; or any processor from
    ``service_factory(call_log)``; ``voice``: the agent's speaker embedding if made already, else
    made from ``config.voice``). Returns the recording and the call log; with ``out_dir`` it
    writes ``recording.wav`` (stereo: caller | agent), ``report.json`` and ``timeline.png`` there
    (``{call_id}`` in it: the first 8 characters of the call's id, the one in the report)."""
    from taste_agents.phone_agent import build_phone_agent
    from taste_agents.report import build_report, write_outputs

    line = SimulatedLine(sample_rate, max_call_s)
    caller = ScriptedCaller(script, sample_rate=sample_rate)
    log = CallLog(keep_audio=True)
    transport = LineTransport(line)
    agent = service_factory(log) if service_factory is not None else \
        build_phone_agent(engine, config, log=log, voice=voice)
    up_tap = FrameTap((ErrorFrame, TranscriptionFrame), FrameDirection.UPSTREAM, name="UpstreamTap")
    out_tap = FrameTap(OBSERVED_FRAMES, FrameDirection.DOWNSTREAM, name="DownstreamTap")
    pipeline = Pipeline([transport.input(), up_tap, agent, transport.output(), out_tap])
    worker = PipelineWorker(pipeline, params=PipelineParams(audio_in_sample_rate=sample_rate,
                                                             audio_out_sample_rate=sample_rate,
                                                             enable_metrics=True, enable_usage_metrics=True),
                            cancel_on_idle_timeout=False)
    runner = WorkerRunner(handle_sigint=False)
    started = asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def _started(_worker, _frame):
        started.set()

    say = progress or (lambda message: None)
    printer = _ProgressPrinter(line, caller, log, say)
    run_task = asyncio.create_task(_run(runner, worker))
    timed_out, stopped, connected = False, None, False
    try:
        await asyncio.wait_for(started.wait(), timeout=120)
        line.start()
        log.t0, connected = line.t0, True
        say("call connected")
        timed_out = not await _drive_caller(line, caller, worker, transport, stt_delay_s, stt_interim_after_s, tail_s,
                                            max_call_s, printer)
        # The caller hangs up (as the server does when the peer leaves): what is still playing is cut.
        await _hang_up(worker, run_task, "the caller hung up")
    except asyncio.CancelledError as e:
        # Stopped from outside (Ctrl-C): end the call the way a hang-up does, keep what was recorded, and
        # stop once it is written. (Leaving the pipeline's tasks to asyncio.run's clean-up hangs it.)
        stopped = e
        if connected:
            say("call stopped: ending it and writing what was recorded")
        await _hang_up(worker, run_task, "the call was stopped")
    finally:
        if not run_task.done():
            run_task.cancel()
    if stopped is not None and not connected:
        raise stopped  # (stopped before the call connected: nothing was recorded)
    duration = (line.now_sample()) / sample_rate
    printer.flush()
    result = SimulatedCall(line, caller, log, [f.error for _, f in up_tap.frames if isinstance(f, ErrorFrame)],
                           _metrics(out_tap.frames, log), duration, timed_out,
                           frames=out_tap.frames, upstream_frames=up_tap.frames)
    call = getattr(agent, "call", None)
    result.report = build_report(result, {"call_id": getattr(call, "call_id", None), **(meta or {}),
                                          **({"stopped_early": True} if stopped is not None else {})})
    if out_dir is not None:
        call_id = result.report.get("call_id") or uuid.uuid4().hex  # (a service without a TasteCall)
        result.paths = write_outputs(result, str(out_dir).replace("{call_id}", call_id[:8]))
    if stopped is not None:
        if result.paths:
            say("what was recorded before the stop: " + ", ".join(result.paths.values()))
        raise stopped
    return result


async def _hang_up(worker: PipelineWorker, run_task: asyncio.Task, reason: str):
    await worker.cancel(reason=reason)
    await asyncio.wait_for(asyncio.shield(run_task), timeout=20)


async def _run(runner: WorkerRunner, worker: PipelineWorker):
    await runner.add_workers(worker)
    await runner.run()


async def _drive_caller(line: SimulatedLine, caller: ScriptedCaller, worker, transport, stt_delay_s: float,
                        stt_interim_after_s: float | None, tail_s: float, max_call_s: float, printer) -> bool:
    """The caller's clock: one frame per frame period, on absolute time. Returns False on timeout."""
    frame = line.frame_samples
    period = frame / line.sample_rate
    k, seen_events, done_at = 0, 0, None
    pending: list[asyncio.Task] = []  # transcripts on their way (the simulated STT's delay)
    under_way = None  # the utterance the caller is saying (its start event), for the STT's interim words
    try:
        while True:
            target = line.t0 + (k + 1) * period
            delay = target - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            heard = line.heard(k * frame, frame)
            out = caller.tick(heard)
            line.caller[k * frame:(k + 1) * frame] = float_to_int16(out)
            await transport.input().push_audio_frame(InputAudioRawFrame(float_to_pcm16(out), line.sample_rate, 1))
            for event in caller.events[seen_events:]:
                if event.kind == "utterance_start":
                    under_way = event
                    if stt_interim_after_s is not None and event.text.strip():
                        pending.append(asyncio.create_task(
                            _interim_later(worker, event, stt_interim_after_s, lambda: under_way)))
                elif event.kind == "utterance_end":
                    under_way = None
                    pending.append(asyncio.create_task(_transcribe_later(worker, event.text, stt_delay_s)))
            seen_events = len(caller.events)
            printer.poll()
            k += 1
            if caller.done and done_at is None:
                done_at = k
            if done_at is not None and (k - done_at) * period >= tail_s:
                break
            if k * period >= max_call_s:
                return False
        for task in pending:
            await task
        return True
    finally:  # (a call cut short leaves no transcript behind)
        for task in pending:
            task.cancel()


async def _interim_later(worker, start: CallerEvent, delay: float, under_way: Callable[[], CallerEvent | None]):
    await asyncio.sleep(delay)
    if under_way() is start:  # (a shorter utterance has no interim words)
        words = start.text.split()
        await worker.queue_frame(InterimTranscriptionFrame(" ".join(words[: max(1, len(words) // 2)]), "caller",
                                                           time_now_iso8601()))


async def _transcribe_later(worker, text: str, delay: float):
    await asyncio.sleep(delay)
    await worker.queue_frame(TranscriptionFrame(text, "caller", time_now_iso8601(), finalized=True))


def _metrics(frames, log: CallLog) -> list[dict]:
    out = []
    for t, frame in frames:
        if isinstance(frame, MetricsFrame):
            for data in frame.data:
                out.append({"t": round(t - log.t0, 4), "type": type(data).__name__, "processor": data.processor,
                            "model": data.model, "value": getattr(data, "value", None)})
    return out


class _ProgressPrinter:
    """Turns caller events and call-log events into one line each, as they happen."""

    def __init__(self, line: SimulatedLine, caller: ScriptedCaller, log: CallLog, say: Callable[[str], None]):
        self.line, self.caller, self.log, self.say = line, caller, log, say
        self._caller_seen = 0
        self._log_seen = 0

    def _stamp(self, seconds: float) -> str:
        return f"[{seconds:6.2f}s]"

    def poll(self):
        sr = self.line.sample_rate
        for event in self.caller.events[self._caller_seen:]:
            t = event.sample / sr
            if event.kind == "utterance_start":
                self.say(f"{self._stamp(t)} caller: {event.text!r}")
            elif event.kind == "barge_in":
                self.say(f"{self._stamp(t)} caller barges in")
            elif event.kind == "no_reply":
                self.say(f"{self._stamp(t)} caller heard no reply")
        self._caller_seen = len(self.caller.events)
        for event in self.log.events[self._log_seen:]:
            kind, turn, t = event["kind"], event["turn_id"], event["t"]
            record = self.log.turns.get(turn) if turn is not None else None
            if kind == "decision":
                # a turn handed on early may still be taken back: its decision is tentative until the VAD's end
                early = record is not None and record.early_end_at is not None and record.vad_stop_at is None
                self.say(f"{self._stamp(t)} agent turn {turn}: decision {event['decision']}"
                         + (f" ({event['reason']})" if event.get("reason") else "")
                         + (", tentative: the VAD is still making sure the caller stopped" if early else ""))
            elif kind == "bot_audio_started" and record is not None:
                latency = record.user_to_bot_s
                self.say(f"{self._stamp(t)} agent turn {turn}: speaking"
                         + (f", {1000 * latency:.0f} ms after its VAD heard the caller stop" if latency is not None
                            else ""))
            elif kind == "bot_audio_stopped" and record is not None:
                how = "cut off by barge-in" if event.get("interrupted") else "done"
                text = record.played_text or record.reply_text
                self.say(f"{self._stamp(t)} agent turn {turn}: {how}, said {text!r}")
            elif kind == "reply_paused":
                self.say(f"{self._stamp(t)} agent turn {turn}: paused, the caller speaks over it (cut off once "
                         "their words come)")
            elif kind == "reply_resumed":
                self.say(f"{self._stamp(t)} agent turn {turn}: goes on, the caller's sound had no words")
            elif kind == "barge_in":
                paused = any(e["kind"] == "reply_paused" and e.get("by_turn") == event.get("by_turn")
                             for e in self.log.events)
                self.say(f"{self._stamp(t)} " + (f"barge-in on turn {turn}: the caller's words came" if paused
                                                 else f"barge-in detected on turn {turn}"))
            elif kind == "user_turn_retracted":
                self.say(f"{self._stamp(t)} agent turn {turn}: taken back, the caller went on speaking (the turn "
                         "goes on under the next number)")
        self._log_seen = len(self.log.events)

    def flush(self):
        self.poll()
