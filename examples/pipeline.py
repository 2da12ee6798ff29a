"""Composing the TASTE processors yourself in a Pipecat pipeline.

TasteSpeechToSpeech bundles capture -> generation -> synthesis -> playout. Here they are laid out
one by one, with Pipecat's own VADProcessor (driven by our WebRTC VAD analyzer) in front of the
capture and any STT service free to sit before it (the capture uses its TranscriptionFrames).
Behind an upstream VAD a barge-in is heard only once that VAD confirms it (its stop_secs later
than with the capture's own VAD) and there are no early replies: use this layout where a VAD of
your own must decide the turns.
The transport here is the simulated phone line; swap in SmallWebRTCTransport, a websocket
transport, Daily, ... - nothing else changes.

    .venv/bin/python examples/pipeline.py
"""

import argparse
import asyncio
import sys

from loguru import logger
from pipecat.pipeline.pipeline import Pipeline
from pipecat.processors.audio.vad_processor import VADProcessor

from pipecat_taste import (GenerationSettings, TasteCall, TasteEngine, TasteGenerator, TastePlayout, TasteSynthesizer,
                           TasteTurnCapture, WebRTCVADAnalyzer)
from taste_agents.caller import Pause, Say, WaitForReply, load_utterances
from taste_agents.simulate import simulate_call


def build(engine, log):
    call = TasteCall(engine, GenerationSettings(max_reply_tokens=6), log=log)  # one per call
    return Pipeline([
        VADProcessor(vad_analyzer=WebRTCVADAnalyzer(aggressiveness=2, frame_ms=20)),
        # stt_service,  # any Pipecat STT: its TranscriptionFrames become the turn's transcript
        TasteTurnCapture(call, vad_analyzer=None),  # follows the VADProcessor's frames
        TasteGenerator(call),
        TasteSynthesizer(call),
        TastePlayout(call),
    ])


async def main():
    engine = TasteEngine.from_pretrained(None)
    u = load_utterances()
    result = await simulate_call(engine, [Pause(0.3), Say(u["hello"]), WaitForReply()],
                                 service_factory=lambda log: build(engine, log), progress=print)
    print(result.report["turns"][0])


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # --help; no options
    logger.remove()  # Pipecat logs every frame link at DEBUG: keep the console for the call
    logger.add(sys.stderr, level="WARNING")
    asyncio.run(main())
