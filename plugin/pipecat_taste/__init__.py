"""pipecat_taste: the TASTE spoken language model as Pipecat processors.

    engine = TasteEngine.from_pretrained("MediaTek-Research/Llama-1B-TASTE-V0", device="cuda")
    engine.warm_up()  # captures the graphs (CUDA), then one rehearsal turn, before the first call
    freeze_startup_objects()  # full garbage collections then skip start-up's objects (gc_pauses)
    pipeline = Pipeline([transport.input(), TasteSpeechToSpeech(engine), transport.output()])

Pieces (usable on their own): :class:`WebRTCVADAnalyzer` (a Pipecat VAD analyzer),
:class:`TasteTurnCapture`, :class:`TasteGenerator`, :class:`TasteSynthesizer`,
:class:`TastePlayout`, sharing one :class:`TasteCall` per call.
"""

from pipecat_taste.call import CallLog, TasteCall, TurnRecord
from pipecat_taste.capture import TasteTurnCapture, TurnCaptureParams
from pipecat_taste.engine import TasteEngine
from pipecat_taste.frames import (
    TastePlaybackFrame,
    TasteReplyEndFrame,
    TasteReplyPauseFrame,
    TasteReplySegmentFrame,
    TasteSegmentAudioFrame,
    TasteTurnDecisionFrame,
    TasteTurnMetricsFrame,
    TasteTurnStatusFrame,
    TasteUserTurnFrame,
)
from pipecat_taste.gc_pauses import freeze_startup_objects
from pipecat_taste.generation import TasteGenerator
from pipecat_taste.playout import PlayoutParams, TastePlayout
from pipecat_taste.service import TasteSpeechToSpeech
from pipecat_taste.session import GenerationSettings, TasteSession
from pipecat_taste.synthesis import TasteSynthesizer
from pipecat_taste.vad import WebRTCVADAnalyzer, default_vad_params

__all__ = [
    "CallLog", "TasteCall", "TurnRecord", "TasteTurnCapture", "TurnCaptureParams", "GenerationSettings",
    "TasteEngine", "TasteSession", "TastePlaybackFrame", "TasteReplyEndFrame", "TasteReplyPauseFrame", "TasteReplySegmentFrame",
    "TasteSegmentAudioFrame", "TasteTurnDecisionFrame", "TasteTurnMetricsFrame", "TasteTurnStatusFrame",
    "TasteUserTurnFrame",
    "TasteGenerator", "PlayoutParams", "TastePlayout", "TasteSpeechToSpeech", "TasteSynthesizer",
    "WebRTCVADAnalyzer", "default_vad_params", "freeze_startup_objects",
]
