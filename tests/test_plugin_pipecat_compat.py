"""TasteSpeechToSpeech with Pipecat's standard components, in simulated calls (model-free engine):
the context aggregator pair in its standard places (the assistant half after ``transport.output()``)
and an RTVI observer. The assistant messages must be the words the caller heard, reply by reply, and
RTVI clients must get one bot-tts-started/stopped pair per reply, after the user's turn, and the
bot's words as bot-output."""

import asyncio
import time

import pytest
from pipecat.frames.frames import InputAudioRawFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.processors.frameworks.rtvi import RTVIObserver, RTVIProcessor
from pipecat.workers.runner import WorkerRunner

from pipecat_taste import TasteSpeechToSpeech
from pipecat_taste.audio import float_to_int16, float_to_pcm16
from pipecat_taste.call import CallLog
from pipecat_taste.capture import TurnCaptureParams
from pipecat_taste.testing import FakeEngine
from taste_agents.caller import BargeIn, Pause, Say, ScriptedCaller, WaitForReply, load_utterances
from taste_agents.simulate import LineTransport, SimulatedLine

pytestmark = pytest.mark.slow  # real-time calls

RATE = 16000


class RecordingRTVIObserver(RTVIObserver):
    """Keeps the RTVI messages instead of sending them: (time, type, data)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.messages: list[tuple[float, str, dict | None]] = []

    async def send_rtvi_message(self, model, exclude_none=True):
        message = model.model_dump(exclude_none=exclude_none)
        self.messages.append((time.monotonic(), message.get("type"), message.get("data")))


async def run_call(engine, script, *, capture_params=None, rtvi=False, tail_s=1.0):
    """The standard pipeline: input, user aggregator, TASTE, output, assistant aggregator (with an
    RTVI processor and a recording observer when ``rtvi``). Transcripts come from the engine."""
    line = SimulatedLine(RATE, 60)
    caller = ScriptedCaller(script, sample_rate=RATE)
    log = CallLog()
    transport = LineTransport(line)
    context = LLMContext()
    pair = LLMContextAggregatorPair(context)
    assistant = pair.assistant()
    stopped = []  # (content, interrupted) per assistant turn

    @assistant.event_handler("on_assistant_turn_stopped")
    async def _stopped(_aggregator, message):
        stopped.append((message.content, message.interrupted))

    processors = [transport.input(), pair.user(), TasteSpeechToSpeech(engine, log=log, capture_params=capture_params),
                  transport.output(), assistant]
    observers = []
    if rtvi:
        processor = RTVIProcessor()
        observers.append(RecordingRTVIObserver(processor))
        processors.insert(1, processor)
    worker = PipelineWorker(Pipeline(processors), params=PipelineParams(audio_in_sample_rate=RATE,
                                                                        audio_out_sample_rate=RATE),
                            observers=observers, cancel_on_idle_timeout=False)
    runner = WorkerRunner(handle_sigint=False)
    started = asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def _started(_worker, _frame):
        started.set()

    async def run():
        await runner.add_workers(worker)
        await runner.run()

    task = asyncio.create_task(run())
    await asyncio.wait_for(started.wait(), 60)
    line.start()
    log.t0 = line.t0
    frame, k, done_at = line.frame_samples, 0, None
    period = frame / RATE
    while done_at is None or (k - done_at) * period < tail_s:  # the caller: one 20 ms frame per 20 ms
        delay = line.t0 + (k + 1) * period - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        out = caller.tick(line.heard(k * frame, frame))
        line.caller[k * frame:(k + 1) * frame] = float_to_int16(out)
        await transport.input().push_audio_frame(InputAudioRawFrame(float_to_pcm16(out), RATE, 1))
        k += 1
        if caller.done and done_at is None:
            done_at = k
        assert k * period < 50, "the call did not end"
    await worker.cancel(reason="hangup")
    await asyncio.wait_for(task, 20)
    return log, context, stopped, (observers[0].messages if rtvi else None)


def script(u):
    """Three replies; the second is cut off by a barge-in."""
    return [Pause(0.3), Say(u["hello"]), WaitForReply(timeout_s=6, end_silence_s=0.8), Say(u["time"]),
            BargeIn(u["bargein"], after_agent_ms=500, timeout_s=6), WaitForReply(timeout_s=6, end_silence_s=0.8)]


@pytest.fixture(scope="module")
def u():
    return load_utterances()


@pytest.mark.parametrize("early_reply_secs", [0.2])  # the default; without early replies the playout path is the same
async def test_the_assistant_aggregator_after_the_output_keeps_the_words_heard(u, early_reply_secs):
    engine = FakeEngine(word_delay=0.02, asr_text=lambda audio: f"a turn of {audio.size}")  # (each turn its own words)
    log, context, stopped, _ = await run_call(engine, script(u),
                                              capture_params=TurnCaptureParams(early_reply_secs=early_reply_secs))
    heard = [log.turns[t] for t in sorted(log.turns) if log.turns[t].played_words]
    assert len(heard) == 3, [(r.decision, r.played_text) for r in log.turns.values()]
    cut = heard[1]
    assert cut.interrupted and 0 < cut.played_words < cut.total_words  # the barge-in cut the second reply
    # one message per reply, exactly the words played: none doubled (LLM and TTS text), none of a
    # reply leaking into the next one, the cut reply only up to where it was cut
    assistant = [m["content"] for m in context.get_messages() if m["role"] == "assistant"]
    assert assistant == [r.played_text for r in heard]
    # each after the caller's turn it answers: the cut reply was written before its turn, the user
    # aggregator waiting Pipecat's default transcript latency (1 s) after a realtime reply's start
    said = [(m["role"], m["content"]) for m in context.get_messages()]
    turns = [("user", r.transcript) for r in heard]
    assert said == [m for pair in zip(turns, [("assistant", r.played_text) for r in heard]) for m in pair], said
    assert stopped == [(r.played_text, r.interrupted) for r in heard]
    assert [(role, text) for role, text in engine.sessions[0].history if role == "assistant"] == \
        [("assistant", r.played_text) for r in heard]  # the same words the model remembers


async def test_rtvi_clients_get_one_tts_pair_per_reply_and_the_bots_words(u):
    engine = FakeEngine(word_delay=0.02, asr_text="what the caller said")
    log, _, _, messages = await run_call(engine, script(u), rtvi=True)  # early replies on (the default)
    heard = [log.turns[t] for t in sorted(log.turns) if log.turns[t].played_words]
    assert len(heard) == 3
    kinds = [kind for _, kind, _ in messages if kind in ("user-stopped-speaking", "bot-tts-started", "bot-tts-stopped",
                                                         "bot-llm-started", "bot-llm-stopped")]
    # each reply: announced once, after the caller's turn (an early reply is made before the VAD
    # confirms the end of the turn, but is not announced before)
    assert kinds == ["user-stopped-speaking", "bot-llm-started", "bot-tts-started", "bot-tts-stopped",
                     "bot-llm-stopped"] * 3, kinds
    # the bot's words reach clients as bot-output, each once, exactly the words heard
    output = "".join(data["text"] for _, kind, data in messages if kind == "bot-output")
    assert output.split() == " ".join(r.played_text for r in heard).split()
