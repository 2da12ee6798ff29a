"""Where a TASTE processor sits in its pipeline: the output transport after it.

The playout sizes its frames by that transport's chunk, and the synthesizer and the playout make
their audio at that transport's rate: a transport that resamples what it is given releases it in
bursts (Pipecat's streaming resampler holds a filter's worth of samples back), so audio paced in
real time at another rate reaches the line with gaps - a click early in every reply.
"""

from __future__ import annotations

from loguru import logger
from pipecat.processors.frame_processor import FrameProcessor
from pipecat.transports.base_output import BaseOutputTransport


def output_transport_after(processor: FrameProcessor) -> BaseOutputTransport | None:
    """The first output transport after ``processor`` in its worker's pipeline, nested pipelines
    (the speech-to-speech service) walked through as Pipecat walks them (``processors``), or None
    (no transport after it, or not run by a pipeline worker)."""
    order: list[FrameProcessor] = []

    def walk(node: FrameProcessor):
        order.append(node)
        for inner in node.processors:
            walk(inner)

    try:
        walk(processor.pipeline_worker.pipeline)
    except AttributeError:  # (not set up by a pipeline worker)
        return None
    after = next((i for i, p in enumerate(order) if p is processor), len(order))
    return next((p for p in order[after + 1:] if isinstance(p, BaseOutputTransport)), None)


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
