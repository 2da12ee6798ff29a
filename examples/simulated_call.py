"""A scripted phone call with the TASTE agent, in process, written as a Pipecat user would.

    .venv/bin/python examples/simulated_call.py                 # embedded tiny checkpoint
    .venv/bin/python examples/simulated_call.py /path/to/Llama-1B-TASTE-V0 cuda

The caller says two things, barges in on the second answer, and hangs up; the call is saved to
out/example-call/ (recording.wav: caller left, agent right; report.json; timeline.png).
"""

import argparse
import asyncio
import sys

from loguru import logger

from pipecat_taste import TasteEngine, freeze_startup_objects
from taste_agents.caller import BargeIn, Pause, Say, WaitForReply, load_utterances
from taste_agents.phone_agent import PhoneAgentConfig
from taste_agents.simulate import simulate_call


def load(model: str | None, device: str) -> TasteEngine:
    # None: the embedded tiny checkpoint (with its small built-in ASR). With a real checkpoint the
    # scripted caller sends its own transcripts, so no Whisper is loaded (asr=None).
    try:
        return TasteEngine.from_pretrained(model, device=device, asr="auto" if model is None else None)
    except (ValueError, OSError, RuntimeError) as e:  # a wrong path or device: its message says what to do
        sys.exit(f"cannot load the model: {e}")


async def main(engine: TasteEngine, model: str | None) -> None:
    engine.warm_up()  # every stage run once (on CUDA: the graphs captured) before the call, not in its first turn
    freeze_startup_objects()  # full garbage collections then skip start-up's objects: no long stalls mid-call
    config = PhoneAgentConfig(max_reply_tokens=6 if model is None else 48)
    u = load_utterances()
    script = [
        Pause(0.5),
        Say(u["hello"]), WaitForReply(),
        Say(u["time"]), BargeIn(u["bargein"], after_agent_ms=600), WaitForReply(),
    ]
    # the scripted caller's STT: interim words 0.8 s into each utterance, its final words 0.3 s after it
    result = await simulate_call(engine, script, config=config, progress=print, out_dir="out/example-call",
                                 stt_interim_after_s=0.8, stt_delay_s=0.3)
    for turn in result.report["turns"]:
        print(turn["utterance"], turn["decision"], turn.get("first_audio_latency_ms"), turn.get("barge_in_stop_ms"))
    print(result.paths)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None,
                        help="checkpoint folder or hub id (default: the embedded tiny checkpoint)")
    parser.add_argument("device", nargs="?", default="cpu", help="cpu, cuda, cuda:N (default: cpu)")
    args = parser.parse_args()
    logger.remove()  # Pipecat logs every frame link at DEBUG: keep the console for the call
    logger.add(sys.stderr, level="WARNING")
    asyncio.run(main(load(args.model, args.device), args.model))
