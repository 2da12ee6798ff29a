"""Where a TASTE processor sits in its pipeline: the output transport after it, a context aggregator
misplaced before it.

The playout sizes its frames by that transport's chunk, and the synthesizer and the playout make
their audio at that transport's rate: a transport that resamples what it is given releases it in
bursts (Pipecat's streaming resampler holds a filter's worth of samples back), so audio paced in
real time at another rate reaches the line with gaps - a click early in every reply.
"""

from __future__ import annotations

from loguru import logger
from pipecat.processors.frame_processor import FrameProcessor
from pipecat.transports.base_output import BaseOutputTransport


def _around(processor: FrameProcessor) -> tuple[list[FrameProcessor], list[FrameProcessor]]:
    """The processors before and after ``processor`` in its worker's pipeline, nested pipelines
    (the speech-to-speech service) walked through as Pipecat walks them (``processors``); both
    empty when it is not run by a pipeline worker."""
    order: list[FrameProcessor] = []

    def walk(node: FrameProcessor):
        order.append(node)
        for inner in node.processors:
            walk(inner)

    try:
        walk(processor.pipeline_worker.pipeline)
    except AttributeError:  # (not set up by a pipeline worker)
        return [], []
    at = next((i for i, p in enumerate(order) if p is processor), None)
    return ([], []) if at is None else (order[:at], order[at + 1:])


def output_transport_after(processor: FrameProcessor) -> BaseOutputTransport | None:
    """The first output transport after ``processor`` in its pipeline, or None."""
    return next((p for p in _around(processor)[1] if isinstance(p, BaseOutputTransport)), None)


def aggregator_taking_transcripts(processor: FrameProcessor) -> tuple[FrameProcessor, FrameProcessor] | None:
    """(STT service, user context aggregator) where the aggregator sits between an STT and
    ``processor``: it takes the STT's TranscriptionFrames (Pipecat's cascade order), which the
    capture needs; None otherwise."""
    from pipecat.processors.aggregators.llm_response_universal import LLMUserAggregator
    from pipecat.services.stt_service import STTService

    before = _around(processor)[0]
    stt = next((i for i in range(len(before) - 1, -1, -1) if isinstance(before[i], STTService)), None)
    if stt is None:
        return None
    aggregator = next((p for p in before[stt + 1:] if isinstance(p, LLMUserAggregator)), None)
    return None if aggregator is None else (before[stt], aggregator)


def taste_output_rate(processor: FrameProcessor, pipeline_rate: int) -> int:
    """The rate the call's TASTE audio is made and paced at: the output transport's (set up before
    the StartFrame) where the synthesis makes that rate, else the pipeline's."""
    from taste_speech.streaming.synthesis_state import SUPPORTED_OUTPUT_RATES

    transport = output_transport_after(processor)
    rate = int(getattr(transport, "sample_rate", 0) or 0) if transport is not None else 0
    if not rate or rate == pipeline_rate:
        return pipeline_rate
    if rate not in SUPPORTED_OUTPUT_RATES:
        logger.warning(f"{processor}: the output transport runs at {rate} Hz, which the TASTE synthesis does not "
                       f"make ({SUPPORTED_OUTPUT_RATES}): its audio is made at the pipeline's {pipeline_rate} Hz and "
                       "resampled by the transport, in bursts (gaps early in a reply); run the transport at one "
                       "of those rates")
        return pipeline_rate
    return rate
