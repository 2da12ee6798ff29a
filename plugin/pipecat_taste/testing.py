"""A model-free engine with TasteEngine's interface, for testing the processors' mechanics.

It behaves like the real one where the processors can tell: it decides per turn (by a rule you
give), streams a reply word by word with a configurable cost per word, turns each word into
speech tokens and each token into 20 ms of a phase-continuous tone (so joins between chunks are
seamless and any click the plugin adds is measurable), and keeps a conversation that records
exactly what was committed. Failures can be injected by transcript.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from pipecat_taste.session import (INPUT_SAMPLE_RATE, GenerationSettings, ReplyEvent, SpeechState, UserTurn,
                                   VocodingFailed)
from pipecat_taste.start_hold import StartNeeds

TOKEN_SECONDS = 0.02


@dataclass
class FakeSegment:
    words: list[str]
    n_tokens: int


def fake_user_turn_frame(turn_id: int, text: str, tentative: bool = False):
    """A ``TasteUserTurnFrame`` for ``text`` as the capture hands it on, with a FakeSegment of its
    words (for tests that start at the generator)."""
    from pipecat_taste.frames import TasteUserTurnFrame

    now = time.monotonic()
    return TasteUserTurnFrame(turn_id, text, UserTurn(text, FakeSegment(text.split(), 2), 2, 1.0), now, now,
                              tentative=tentative)


@dataclass
class FakeEngine:
    reply_words: tuple[str, ...] = ("sure", "I", "can", "help", "with", "that")
    decide: Callable[[str], str] | None = None  # transcript -> 'reply' | 'no_speech'
    tokens_per_word: int = 2  # LLM tokens per word
    speech_tokens_per_word: int = 10  # 200 ms of audio per word
    word_delay: float = 0.0  # generation cost per word (s)
    turn_delay: float = 0.0  # tokenizing cost per user turn (s)
    first_gap: float = 0.0  # extra cost of the reply's second word (s): its audio comes late, as on slow hardware
    decode_delay: float = 0.0  # speech-decoder cost per word (s)
    vocode_delay: float = 0.0  # vocoder cost per call (s)
    start_speech_delay: float = 0.0  # cost of a reply's speech state (s): caches, a busy compute gate
    lookahead_tokens: int = 0  # tokens the vocoder holds back until more arrive (like the real synthesis)
    fail_on: tuple[str, ...] = ("explode",)  # a transcript containing one of these fails in user_turn
    fail_vocode_on: tuple[str, ...] = ()  # reply words whose synthesis fails
    fail_start_speech: int = 0  # the first this many replies cannot start speaking (e.g. out of GPU memory)
    fail_vocode_call: int = 0  # the session's vocode call (1-based) that fails part-way, its audio made (VocodingFailed)
    asr_text: str | Callable[[np.ndarray], str] | None = None  # what transcribe() returns, or makes of the audio (None: no built-in ASR)
    asr_delay: float = 0.0  # built-in ASR cost per transcription (s)
    incremental_asr: bool = False  # the sessions offer start_transcript (partials while the caller speaks)
    max_turn_seconds: float = 30.0
    amplitude: float = 0.3
    sessions: list = field(default_factory=list)
    input_sample_rate: int = INPUT_SAMPLE_RATE
    start_needs: StartNeeds = field(default_factory=StartNeeds)  # shared by its calls, as TasteEngine's
    session_class: type | None = None  # a FakeSession subclass (a test's fault), made as FakeSession is

    @property
    def has_asr(self) -> bool:
        return self.asr_text is not None

    def speaker_embedding(self, reference_audio=None, sample_rate: int = INPUT_SAMPLE_RATE) -> np.ndarray:
        """A voice vector like TasteEngine's (the fake sessions do not use it)."""
        if reference_audio is not None and len(reference_audio) == 0:
            raise ValueError("no reference audio")
        return np.full((1, 192), 192 ** -0.5, np.float32)

    def new_session(self, settings: GenerationSettings | None = None, voice=None) -> "FakeSession":
        session = (self.session_class or FakeSession)(self, settings or GenerationSettings())
        self.sessions.append(session)
        return session

    @staticmethod
    def speech_samples(n_tokens: int, out_sample_rate: int) -> int:
        return int(round(n_tokens * TOKEN_SECONDS * out_sample_rate))


class FakeTurnTranscript:
    """A turn's transcript made while the caller speaks: each partial (and the finish) transcribes
    the audio so far, as the engine's ``asr_text`` says."""

    def __init__(self, session: "FakeSession"):
        self.session, self.partials = session, 0

    def partial(self, audio16k: np.ndarray) -> str:
        self.partials += 1
        return self.session.transcribe(audio16k)

    def finish(self, audio16k: np.ndarray) -> str:
        return self.session.transcribe(audio16k)


class FakeSession:
    def __init__(self, engine: FakeEngine, settings: GenerationSettings):
        self.engine, self.settings = engine, settings
        self.input_sample_rate = engine.input_sample_rate
        self.max_turn_seconds = engine.max_turn_seconds
        self.history: list[tuple[str, str]] = []  # committed (role, text)
        self._turn_starts: list[tuple[UserTurn, int]] = []  # each answered turn and where it begins in history
        self.forgotten: list[str] = []  # transcripts of turns taken back (answered too early)
        self.dropped_speech: list[SpeechState] = []  # speech states of replies given up (drop_speech)
        self._last_reply: list[str] = []
        self.replies_started = 0
        self.threads: set[str] = set()
        self.closed = False
        self.listening: list[str] = []  # the listening calls in order: ended, withdrawn ..., user_turn
        self.vocode_calls = 0
        self.vocoded_samples = 0  # audio handed back by vocode, a failed call's included

    def warm_up(self) -> None:
        self.threads.add(threading.current_thread().name)  # nothing to capture: the fake has no caches

    def close(self) -> None:
        self.closed = True

    def turn_ended(self, transcript=None) -> None:
        self.listening.append("ended")  # (the fake has no shared steps to announce the turn to)

    def turn_withdrawn(self, transcript=None, *, transcription: bool = True, tower: bool = True) -> None:
        self.listening.append("withdrawn" + " transcription" * transcription + " tower" * tower)

    def start_transcript(self) -> "FakeTurnTranscript | None":
        """An incremental transcript of one turn, as TasteSession's (with ``incremental_asr``)."""
        return FakeTurnTranscript(self) if self.engine.incremental_asr and self.engine.asr_text is not None else None

    def transcribe(self, audio: np.ndarray) -> str:
        if self.engine.asr_text is None:
            raise NotImplementedError("no built-in ASR in this engine")
        time.sleep(self.engine.asr_delay)
        text = self.engine.asr_text
        return text(audio) if callable(text) else text

    def user_turn(self, audio: np.ndarray, transcript: str, heard=None) -> UserTurn:
        self.listening.append("user_turn")
        self.threads.add(threading.current_thread().name)
        time.sleep(self.engine.turn_delay)
        if any(bad in transcript for bad in self.engine.fail_on):
            raise RuntimeError(f"injected tokenizer failure for {transcript!r}")
        words = transcript.split()
        if not words:
            raise ValueError("the transcript is empty")
        if not np.isfinite(audio).all():
            raise ValueError("audio contains NaN or inf")
        return UserTurn(transcript, FakeSegment(words, len(words) * self.engine.tokens_per_word),
                        len(words) * self.engine.tokens_per_word, len(audio) / self.input_sample_rate)

    def speech_samples(self, n_tokens: int, out_sample_rate: int) -> int:
        return self.engine.speech_samples(n_tokens, out_sample_rate)

    def reply(self, turn: UserTurn, stop: threading.Event) -> Iterator[ReplyEvent]:
        self.threads.add(threading.current_thread().name)
        self._turn_starts.append((turn, len(self.history)))
        self.history.append(("user", turn.transcript))
        self.replies_started += 1
        decision = self.engine.decide(turn.transcript) if self.engine.decide else "reply"
        yield ReplyEvent("decision", decision=decision)
        if decision != "reply":
            return
        produced: list[str] = []
        reason = "finished"
        for i, word in enumerate(self.engine.reply_words):
            if stop.is_set():
                reason = "cancelled"
                break
            time.sleep(self.engine.word_delay + (self.engine.first_gap if i == 1 else 0.0))
            produced.append(word)
            yield ReplyEvent("segment", text=" " + word, n_words=1,
                             segment=FakeSegment([word], self.engine.tokens_per_word))
        # Like streaming_generate, the reply is in the history once generated; commit_reply
        # cuts it to what was heard.
        if produced:
            self.history.append(("assistant", " ".join(produced)))
        self._last_reply = produced
        yield ReplyEvent("end", reason=reason, prompt_tokens=turn.segment.n_tokens,
                         completion_tokens=len(produced) * self.engine.tokens_per_word)

    def commit_reply(self, played_words: int | None) -> int:
        words, self._last_reply = self._last_reply, []
        if not words or played_words is None or played_words >= len(words):
            return len(words)
        self.history.pop()
        if played_words > 0:
            self.history.append(("assistant", " ".join(words[:played_words])))
        return max(0, played_words)

    def forget_turn(self, turn: UserTurn) -> int:
        """Take back ``turn`` and everything after it (it was answered too early)."""
        self._last_reply = []
        start = next((index for t, index in reversed(self._turn_starts) if t is turn), None)
        if start is None:
            return 0
        self._turn_starts = [(t, index) for t, index in self._turn_starts if index < start]
        forgotten = len(self.history) - start
        del self.history[start:]
        self.forgotten.append(turn.transcript)
        return forgotten

    # -- speaking: each speech token is 20 ms of a tone; the phase carries across chunks --------
    def start_speech(self, out_sample_rate: int) -> SpeechState:
        if self.engine.fail_start_speech > 0:
            self.engine.fail_start_speech -= 1
            raise RuntimeError("out of memory (FakeEngine.fail_start_speech)")
        time.sleep(self.engine.start_speech_delay)
        state = SpeechState(out_sample_rate=out_sample_rate)
        state.synthesis = {"phase": 0.0, "tokens": 0, "held": []}
        return state

    def speech_tokens(self, state: SpeechState, segment: FakeSegment) -> Iterator[list[int]]:
        self.threads.add(threading.current_thread().name)
        time.sleep(self.engine.decode_delay)
        word = segment.words[0] if segment.words else ""
        if word in self.engine.fail_vocode_on:
            raise RuntimeError(f"injected synthesis failure on {word!r}")
        base = 1 + (sum(map(ord, word)) % 7)
        tokens = [base] * self.engine.speech_tokens_per_word
        half = len(tokens) // 2
        yield tokens[:half]
        yield tokens[half:]
        state.prev_speech_ids = state.prev_speech_ids + tokens

    def drop_speech(self, state: SpeechState) -> None:
        self.dropped_speech.append(state)

    def vocode(self, state: SpeechState, tokens: list[int], final: bool = False) -> list[np.ndarray]:
        self.threads.add(threading.current_thread().name)
        time.sleep(self.engine.vocode_delay)
        tokens = state.synthesis["held"] + list(tokens)
        keep = 0 if final else min(len(tokens), self.engine.lookahead_tokens)
        tokens, state.synthesis["held"] = tokens[:len(tokens) - keep], tokens[len(tokens) - keep:]
        if not tokens:
            return []
        rate = state.out_sample_rate
        n = self.speech_samples(len(tokens), rate)
        freqs = np.repeat(np.array([110.0 * t for t in tokens]), n // len(tokens) + 1)[:n]
        phase = state.synthesis["phase"] + np.cumsum(2 * np.pi * freqs / rate)
        state.synthesis["phase"] = float(phase[-1] % (2 * np.pi))
        state.synthesis["tokens"] += len(tokens)
        audio = [(self.engine.amplitude * np.sin(phase)).astype(np.float32)]
        self.vocoded_samples += n
        self.vocode_calls += 1
        if self.vocode_calls == self.engine.fail_vocode_call:  # a later step of the call failed
            raise VocodingFailed(f"injected vocoder failure after {n} samples", audio)
        state.tokens_vocoded += len(tokens)
        return audio
