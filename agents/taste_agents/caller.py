"""ScriptedCaller: a caller that plays recorded utterances, waits for the agent, and barges in on cue.

It is a clock-driven state machine with no I/O of its own, so the same caller runs in the
in-process simulated call and as a WebRTC peer: every ``frame_ms`` the host calls
``tick(heard)`` with the agent audio heard during the last frame and sends the returned frame.
The caller only knows what it hears (energy of the agent's audio), like a person on the phone.

Script steps:
    Say(utterance)                          speak now
    WaitForReply(timeout_s, end_silence_s)  wait until the agent spoke and then went quiet
                                            (or until timeout_s passes without any agent speech)
    BargeIn(utterance, after_agent_ms)      wait until the agent has spoken for after_agent_ms,
                                            then talk over it
    Pause(seconds)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

CALLER_AUDIO = Path(__file__).parent / "caller_audio"


@dataclass
class Utterance:
    name: str
    text: str
    audio: np.ndarray  # float32 mono at the caller's rate
    sample_rate: int = 16000

    @property
    def seconds(self) -> float:
        return self.audio.size / self.sample_rate


def read_audio(path: str | Path) -> tuple[np.ndarray, int]:
    """A recording as mono float32 and its rate: WAV of any sample format (16/24-bit, float), FLAC,
    OGG, MP3 - whatever libsndfile reads."""
    import soundfile

    try:
        data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except soundfile.LibsndfileError as e:
        raise ValueError(f"{path}: not a recording this can read ({e})") from None
    return data.mean(axis=1), rate


def load_utterances(directory: str | Path = CALLER_AUDIO, sample_rate: int = 16000) -> dict[str, Utterance]:
    """The utterances listed in ``script.json`` (name -> transcript), resampled to ``sample_rate``."""
    from pipecat_taste.audio import resample

    directory = Path(directory)
    manifest = json.loads((directory / "script.json").read_text())
    out = {}
    for name, text in manifest["utterances"].items():
        audio, rate = read_audio(directory / f"{name}.wav")
        out[name] = Utterance(name, text, resample(audio, rate, sample_rate), sample_rate)
    return out


@dataclass
class Say:
    utterance: Utterance


@dataclass
class WaitForReply:
    timeout_s: float = 15.0  # give up if the agent says nothing for this long
    end_silence_s: float = 1.2  # the reply is over after this much silence


@dataclass
class BargeIn:
    utterance: Utterance
    after_agent_ms: float = 600.0  # how long the agent talks before the caller cuts in
    timeout_s: float = 15.0  # if the agent never talks that long, just say it


@dataclass
class Pause:
    seconds: float


def default_script(utterances: dict[str, Utterance] | None = None, reply_timeout_s: float = 20.0) -> list:
    """Greeting, a follow-up, a barge-in on the agent's answer to the follow-up, goodbye."""
    u = utterances or load_utterances()
    return [
        Pause(0.5),
        Say(u["hello"]), WaitForReply(reply_timeout_s),
        Say(u["time"]), BargeIn(u["bargein"], after_agent_ms=600, timeout_s=reply_timeout_s),
        WaitForReply(reply_timeout_s),
        Say(u["goodbye"]), WaitForReply(reply_timeout_s),
    ]


def short_script(utterances: dict[str, Utterance] | None = None, reply_timeout_s: float = 20.0) -> list:
    """The default script's core, in half its time: a turn, and a barge-in on its reply that gets a
    reply of its own (load tests run many of these at once)."""
    u = utterances or load_utterances()
    return [Pause(0.5), Say(u["time"]), BargeIn(u["bargein"], after_agent_ms=600, timeout_s=reply_timeout_s),
            WaitForReply(reply_timeout_s)]


SCRIPTS = {"default": default_script, "short": short_script}


@dataclass
class CallerEvent:
    sample: int  # position on the caller's clock (samples since the call started)
    kind: str  # utterance_start | utterance_end | reply_heard | no_reply | barge_in | done
    name: str = ""
    text: str = ""


@dataclass
class ScriptedCaller:
    steps: list
    sample_rate: int = 16000
    frame_ms: int = 20
    speech_threshold: float = 0.003  # RMS above this counts as the agent speaking (about -50 dBFS)
    events: list[CallerEvent] = field(default_factory=list)

    def __post_init__(self):
        self.frame_samples = self.sample_rate * self.frame_ms // 1000
        self.clock = 0  # samples sent so far
        self._step = 0
        self._playing: Utterance | None = None
        self._pos = 0
        self._step_started = 0
        self._agent_spoke_ms = 0.0
        self._silence_ms = 0.0
        self.speech_intervals: list[tuple[int, int, str]] = []  # (start, end, name) in samples

    @property
    def done(self) -> bool:
        return self._step >= len(self.steps) and self._playing is None

    def _emit(self, kind: str, name: str = "", text: str = "") -> CallerEvent:
        event = CallerEvent(self.clock, kind, name, text)
        self.events.append(event)
        return event

    def _start(self, utterance: Utterance, kind: str = "utterance_start"):
        self._playing, self._pos = utterance, 0
        self._emit(kind, utterance.name, utterance.text)
        if kind != "utterance_start":
            self._emit("utterance_start", utterance.name, utterance.text)

    def _next_step(self):
        self._step += 1
        self._step_started = self.clock
        self._agent_spoke_ms = 0.0
        self._silence_ms = 0.0

    def tick(self, heard: np.ndarray | None = None) -> np.ndarray:
        """One frame: ``heard`` is the agent audio of the last frame (any length, may be None)."""
        frame_s = self.frame_ms / 1000.0
        if heard is not None and heard.size and float(np.sqrt(np.mean(np.square(heard)))) > self.speech_threshold:
            self._agent_spoke_ms += self.frame_ms
            self._silence_ms = 0.0
        else:
            self._silence_ms += self.frame_ms
        out = np.zeros(self.frame_samples, dtype=np.float32)
        if self._playing is None:
            self._advance(frame_s)
        if self._playing is not None:
            piece = self._playing.audio[self._pos:self._pos + self.frame_samples]
            out[: piece.size] = piece
            if self._pos == 0:
                self._utt_start = self.clock
            self._pos += self.frame_samples
            if self._pos >= self._playing.audio.size:
                end = self.clock + piece.size
                self.speech_intervals.append((self._utt_start, end, self._playing.name))
                self.clock += self.frame_samples
                self.events.append(CallerEvent(end, "utterance_end", self._playing.name, self._playing.text))
                self._playing = None
                self._next_step()
                return out
        self.clock += self.frame_samples
        return out

    def _advance(self, frame_s: float):
        """Decide what to do at this frame when not speaking."""
        while self._step < len(self.steps) and self._playing is None:
            step = self.steps[self._step]
            waited = (self.clock - self._step_started) / self.sample_rate
            if isinstance(step, Say):
                self._start(step.utterance)
                return
            if isinstance(step, Pause):
                if waited >= step.seconds:
                    self._next_step()
                    continue
                return
            if isinstance(step, WaitForReply):
                if self._agent_spoke_ms > 0 and self._silence_ms >= step.end_silence_s * 1000:
                    self._emit("reply_heard")
                    self._next_step()
                    continue
                if self._agent_spoke_ms == 0 and waited >= step.timeout_s:
                    self._emit("no_reply")
                    self._next_step()
                    continue
                return
            if isinstance(step, BargeIn):
                if self._agent_spoke_ms >= step.after_agent_ms and self._silence_ms == 0:
                    self._start(step.utterance, "barge_in")
                    return
                if waited >= step.timeout_s:
                    self._emit("no_reply")
                    self._start(step.utterance)
                    return
                return
            raise ValueError(f"unknown script step {step!r}")
        if self._step >= len(self.steps) and not any(e.kind == "done" for e in self.events):
            self._emit("done")
