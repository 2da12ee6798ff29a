"""The phone-style TASTE agent: one configuration object, one call to build it.

    engine = TasteEngine.from_pretrained(...)               # once per process
    agent = build_phone_agent(engine, PhoneAgentConfig())   # once per call
    pipeline = Pipeline([transport.input(), agent, transport.output()])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pipecat_taste.call import MAX_PENDING_SEGMENTS, CallLog
from pipecat_taste.capture import TurnCaptureParams
from pipecat_taste.playout import PlayoutParams
from pipecat_taste.service import TasteSpeechToSpeech
from pipecat_taste.session import GenerationSettings
from pipecat_taste.vad import WebRTCVADAnalyzer, default_vad_params

DEFAULT_PROMPT = "You are the friendly host of a small restaurant, taking reservations on the phone."


@dataclass
class PhoneAgentConfig:
    """system_prompt: the instruct/dialogue formats' system turn (None: none). voice: a reference
    WAV for the agent's voice (None: ``TasteProcessor.default_speaker_embedding``). vad_*: WebRTC VAD settings
    (stop_secs is the silence that ends a caller's turn)."""

    system_prompt: str | None = DEFAULT_PROMPT
    prompt_format: str = "instruct"
    max_reply_tokens: int = 48
    words_per_segment: int = 1
    seed: int = 0
    voice: str | None = None
    vad_aggressiveness: int = 2
    vad_start_secs: float = 0.2
    vad_stop_secs: float = 0.5
    capture: TurnCaptureParams = field(default_factory=TurnCaptureParams)
    playout: PlayoutParams = field(default_factory=PlayoutParams)
    max_pending_segments: int = MAX_PENDING_SEGMENTS
    history_max_tokens: int = 4096  # rolling window of the conversation (LM rows)
    history_max_turns: int = 64

    def generation(self) -> GenerationSettings:
        return GenerationSettings(prompt_format=self.prompt_format, max_reply_tokens=self.max_reply_tokens,
                                  words_per_segment=self.words_per_segment,
                                  system_prompt=self.system_prompt if self.prompt_format != "continuation" else None,
                                  seed=self.seed, history_max_tokens=self.history_max_tokens,
                                  history_max_turns=self.history_max_turns)


def load_voice(engine, path: str | None):
    """Speaker embedding from a reference recording, or the engine's default voice (made here, so
    that a checkpoint without a usable one fails at start-up rather than at every call)."""
    if path is None:
        return engine.speaker_embedding()
    from taste_agents.caller import read_audio

    try:
        audio, rate = read_audio(Path(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"the voice reference {path!r} could not be read ({type(e).__name__}: {e}); "
                         "give a recording of the voice (WAV, FLAC, OGG or MP3)") from None
    return engine.speaker_embedding(audio, rate)


def build_phone_agent(engine, config: PhoneAgentConfig | None = None, log: CallLog | None = None,
                      voice=None) -> TasteSpeechToSpeech:
    config = config or PhoneAgentConfig()
    vad = WebRTCVADAnalyzer(aggressiveness=config.vad_aggressiveness,
                            params=default_vad_params(start_secs=config.vad_start_secs, stop_secs=config.vad_stop_secs))
    if voice is None and config.voice is not None:
        voice = load_voice(engine, config.voice)
    return TasteSpeechToSpeech(engine, settings=config.generation(), voice=voice, vad_analyzer=vad,
                               capture_params=config.capture, playout_params=config.playout,
                               max_pending_segments=config.max_pending_segments, log=log)
