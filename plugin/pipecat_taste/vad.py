"""WebRTCVADAnalyzer: Google's WebRTC voice activity detector as a Pipecat ``VADAnalyzer``.

Usable anywhere Pipecat takes a VAD analyzer (``VADProcessor(vad_analyzer=...)``,
``LLMUserAggregatorParams(vad_analyzer=...)``, our ``TasteTurnCapture``). webrtcvad decides
speech/non-speech per 10, 20 or 30 ms frame of 16-bit mono PCM at 8, 16, 32 or 48 kHz; the
base class turns those decisions into QUIET/STARTING/SPEAKING/STOPPING with ``start_secs`` and
``stop_secs``. It needs no model file and costs a few microseconds per frame.
"""

from __future__ import annotations

from pipecat.audio.vad.vad_analyzer import VADAnalyzer, VADParams

SUPPORTED_RATES = (8000, 16000, 32000, 48000)
SUPPORTED_FRAME_MS = (10, 20, 30)

# Pipecat's default min_volume (0.6 of its loudness scale) rejects quiet but clear speech
# (e.g. 8 kHz telephone audio); webrtcvad already separates speech from noise, so the volume
# gate here only drops near-silence (0.5 of the scale is about -60 LUFS: line noise, not speech).
DEFAULT_PARAMS = dict(confidence=0.5, start_secs=0.2, stop_secs=0.5, min_volume=0.5)


def default_vad_params(**overrides) -> VADParams:
    return VADParams(**{**DEFAULT_PARAMS, **overrides})


class WebRTCVADAnalyzer(VADAnalyzer):
    """``aggressiveness`` 0 (most permissive) .. 3 (most aggressive filtering of non-speech);
    ``frame_ms`` 10, 20 or 30."""

    def __init__(self, *, aggressiveness: int = 2, frame_ms: int = 20, sample_rate: int | None = None,
                 params: VADParams | None = None):
        import webrtcvad  # provided by the webrtcvad-wheels package

        if aggressiveness not in (0, 1, 2, 3):
            raise ValueError(f"aggressiveness must be 0, 1, 2 or 3, got {aggressiveness!r}")
        if frame_ms not in SUPPORTED_FRAME_MS:
            raise ValueError(f"frame_ms must be one of {SUPPORTED_FRAME_MS} (webrtcvad's frame sizes), got {frame_ms!r}")
        if sample_rate is not None:
            _check_rate(sample_rate)
        self.aggressiveness = aggressiveness
        self.frame_ms = frame_ms
        self._vad = webrtcvad.Vad(aggressiveness)
        super().__init__(sample_rate=sample_rate, params=params or default_vad_params())

    def set_sample_rate(self, sample_rate: int):
        _check_rate(self._init_sample_rate or sample_rate)
        super().set_sample_rate(sample_rate)

    def num_frames_required(self) -> int:
        return self.sample_rate * self.frame_ms // 1000

    def voice_confidence(self, buffer: bytes) -> float:
        # The base class hands over exactly num_frames_required() samples of 16-bit mono PCM.
        return 1.0 if self._vad.is_speech(buffer, self.sample_rate) else 0.0

    def is_speech(self, pcm16: bytes) -> bool:
        """One frame's raw decision (no start/stop smoothing)."""
        return self._vad.is_speech(pcm16, self.sample_rate)


def _check_rate(rate: int) -> None:
    if rate not in SUPPORTED_RATES:
        raise ValueError(
            f"webrtcvad works at {SUPPORTED_RATES} Hz, not {rate} Hz: set the pipeline's audio_in_sample_rate "
            "to one of them (16000 is the model's native rate)"
        )
