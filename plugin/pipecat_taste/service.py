"""TasteSpeechToSpeech: capture, generation, synthesis and playout composed into one processor.

    pipeline = Pipeline([transport.input(), TasteSpeechToSpeech(engine), transport.output()])

It is a Pipecat ``Pipeline`` of the four processors sharing one :class:`TasteCall` (make one per
connection: it holds the conversation, the voice and the worker threads). Audio in, audio out,
with the frames Pipecat's own speech-to-speech services produce: VAD and user speaking frames,
``InterruptionFrame`` on barge-in, ``TranscriptionFrame`` upstream, ``LLMFullResponseStart/End``
with ``LLMTextFrame``, ``TTSStarted/Stopped`` with ``TTSAudioRawFrame`` and ``TTSTextFrame``,
``MetricsFrame`` (TTFB and processing per stage, user-to-bot latency per turn) and ``ErrorFrame``
for a failing turn (the call goes on).
"""

from __future__ import annotations

from pipecat.audio.vad.vad_analyzer import VADAnalyzer
from pipecat.pipeline.pipeline import Pipeline

from pipecat_taste.call import MAX_PENDING_SEGMENTS, CallLog, TasteCall
from pipecat_taste.capture import TasteTurnCapture, TurnCaptureParams
from pipecat_taste.generation import TasteGenerator
from pipecat_taste.playout import PlayoutParams, TastePlayout
from pipecat_taste.session import GenerationSettings
from pipecat_taste.synthesis import TasteSynthesizer
from pipecat_taste.vad import WebRTCVADAnalyzer


class TasteSpeechToSpeech(Pipeline):
    def __init__(self, engine, *, settings: GenerationSettings | None = None, voice=None,
                 vad_analyzer: VADAnalyzer | None = None, use_own_vad: bool = True,
                 capture_params: TurnCaptureParams | None = None, playout_params: PlayoutParams | None = None,
                 max_pending_segments: int = MAX_PENDING_SEGMENTS, log: CallLog | None = None,
                 call: TasteCall | None = None):
        """``engine``: a :class:`~pipecat_taste.engine.TasteEngine` (shared by all calls) or any
        object with its interface. ``voice``: the call's speaker embedding
        (``engine.speaker_embedding(audio, sample_rate)``; None: the engine's default voice).
        ``vad_analyzer``: defaults to :class:`WebRTCVADAnalyzer`; with
        ``use_own_vad=False`` the capture follows an upstream ``VADProcessor`` instead (with its own
        VAD, an upstream VAD's frames are dropped, with a warning: they would announce every turn
        twice). ``call``: a :class:`TasteCall` made already (it holds the engine, settings, voice,
        log and segment limit: give those to it, not here); one service per call."""
        if call is not None:
            given = [name for name, value in (("settings", settings), ("voice", voice), ("log", log))
                     if value is not None]
            given += ["max_pending_segments"] if max_pending_segments != MAX_PENDING_SEGMENTS else []
            given += ["another engine"] if engine is not None and engine is not call.engine else []
            if given:
                raise ValueError(f"{', '.join(given)} given with call=: the call holds its own; pass them to "
                                 "TasteCall(...) instead")
        if vad_analyzer is not None and not use_own_vad:
            raise ValueError("vad_analyzer given with use_own_vad=False: the capture then follows the upstream "
                             "VADProcessor's frames; put the analyzer in that VADProcessor")
        self.call = call or TasteCall(engine, settings, voice=voice, max_pending_segments=max_pending_segments,
                                      log=log)
        vad = None
        if use_own_vad:
            vad = vad_analyzer or WebRTCVADAnalyzer()
        self.capture = TasteTurnCapture(self.call, vad_analyzer=vad, params=capture_params)
        self.generator = TasteGenerator(self.call)
        self.synthesizer = TasteSynthesizer(self.call)
        self.playout = TastePlayout(self.call, params=playout_params)
        super().__init__([self.capture, self.generator, self.synthesizer, self.playout])

    @property
    def log(self) -> CallLog:
        return self.call.log
