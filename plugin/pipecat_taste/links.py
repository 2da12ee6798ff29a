"""Where a TASTE processor sits in its pipeline: the output transport after it, a context aggregator
or a service switcher before it that would keep the capture's frames from where they must go.

The playout sizes its frames by that transport's chunk, and the synthesizer and the playout make
their audio at that transport's rate: a transport that resamples what it is given releases it in
bursts (Pipecat's streaming resampler holds a filter's worth of samples back), so audio paced in
real time at another rate reaches the line with gaps - a click early in every reply.
"""

from __future__ import annotations

from loguru import logger
from pipecat.pipeline.parallel_pipeline import ParallelPipeline
from pipecat.pipeline.service_switcher import ServiceSwitcher
from pipecat.processors.aggregators.llm_response_universal import LLMUserAggregator
from pipecat.processors.frame_processor import FrameProcessor
from pipecat.services.stt_service import STTService
from pipecat.transports.base_output import BaseOutputTransport


def _around(processor: FrameProcessor) -> tuple[list[FrameProcessor], list[FrameProcessor]]:
    """The processors on ``processor``'s path through its worker's pipeline, before and after it:
    nested pipelines (the speech-to-speech service) walked through as Pipecat walks them
    (``processors``); of a parallel pipeline (a ``ServiceSwitcher`` is one) holding ``processor``
    only its branch, and one elsewhere on the path counted as one processor (its branches are no
    chain). Both empty when it is not run by a pipeline worker."""
    try:
        found = _path(processor.pipeline_worker.pipeline, processor)
    except AttributeError:  # (not set up by a pipeline worker)
        return [], []
    return found if found is not None else ([], [])


def _path(node: FrameProcessor, target: FrameProcessor):
    if node is target:
        return [], []
    children = list(node.processors)
    if isinstance(node, ParallelPipeline):
        return next((found for branch in children if (found := _path(branch, target)) is not None), None)
    for i, child in enumerate(children):
        found = _path(child, target)
        if found is not None:
            return _flat(children[:i]) + found[0], found[1] + _flat(children[i + 1:])
    return None


def _flat(nodes) -> list[FrameProcessor]:
    flat = []
    for node in nodes:
        flat.append(node)
        if not isinstance(node, ParallelPipeline):
            flat.extend(_flat(node.processors))
    return flat


def output_transport_after(processor: FrameProcessor) -> BaseOutputTransport | None:
    """The first output transport after ``processor`` on its path, or None."""
    return next((p for p in _around(processor)[1] if isinstance(p, BaseOutputTransport)), None)


def _is_stt(processor: FrameProcessor) -> bool:
    return isinstance(processor, STTService) or (
        isinstance(processor, ServiceSwitcher) and any(isinstance(s, STTService) for s in processor.strategy.services))


def stt_before(processor: FrameProcessor) -> bool:
    """Whether an STT service (or a switcher of them) sits before ``processor`` on its path."""
    return any(_is_stt(p) for p in _around(processor)[0])


def aggregator_taking_transcripts(processor: FrameProcessor) -> tuple[FrameProcessor, FrameProcessor] | None:
    """(STT or switcher of STTs, user context aggregator) where the aggregator sits between them
    and ``processor``: it takes the STT's TranscriptionFrames (Pipecat's cascade order), which the
    capture needs; None otherwise."""
    before = _around(processor)[0]
    stt = next((i for i in range(len(before) - 1, -1, -1) if _is_stt(before[i])), None)
    if stt is None:
        return None
    aggregator = next((p for p in before[stt + 1:] if isinstance(p, LLMUserAggregator)), None)
    return None if aggregator is None else (before[stt], aggregator)


def switcher_after_aggregator(processor: FrameProcessor) -> tuple[LLMUserAggregator, ServiceSwitcher] | None:
    """(user context aggregator, service switcher) where a switcher sits between the nearest user
    aggregator before ``processor`` and it: Pipecat's switcher lets only its active service's
    metadata frames through, so what ``processor`` broadcasts upstream never reaches the aggregator."""
    before = _around(processor)[0]
    at = next((i for i in range(len(before) - 1, -1, -1) if isinstance(before[i], LLMUserAggregator)), None)
    if at is None:
        return None
    switcher = next((p for p in before[at + 1:] if isinstance(p, ServiceSwitcher)), None)
    return None if switcher is None else (before[at], switcher)


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
