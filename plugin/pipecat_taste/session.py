"""TasteSession: one call's conversation with the model, the plugin's only way into ``taste_speech``.

The processors call the model only through it (of the library they read one constant, the
synthesis's ``SUPPORTED_OUTPUT_RATES``): a per-call :class:`TasteSession`
(``TasteEngine.new_session()``), whose methods are blocking and are run by the processors in worker
threads, one stage per thread:

    start       warm_up()                                  (the call's own captured steps, on the fast path)
    listening   turn_ended(transcript)                     (the caller stopped speaking: its turn comes soon)
                turn_withdrawn(transcript, ...)            (what turn_ended announced will not come)
                transcribe(audio) -> str                  (built-in ASR, when the engine has one)
                start_transcript() -> TurnTranscript | None   (incremental built-in ASR of one turn)
                user_turn(audio, transcript, heard) -> UserTurn  (taste_tokenize)
    thinking    reply(turn, stop) -> iterator of ReplyEvent  (streaming_generate, one Conversation per call)
                commit_reply(played_words)                 (keep the words the caller heard)
                forget_turn(turn) -> int                   (a turn handed on early and taken back)
    speaking    start_speech(rate) -> SpeechState          (one voice-generator state per reply)
                speech_tokens(state, segment) -> iterator of token lists   (speech decoder)
                vocode(state, tokens, final) -> list of float32 chunks      (flow + HiFT)
                speech_samples(n_tokens, rate) -> output samples covered by n speech tokens
                drop_speech(state)                         (a reply cut off or taken back: its shared steps stop waiting)
    end         close()                                    (the call ended: frees its slots in shared batches)

If the library's signatures drift, this file is what changes. ``pipecat_taste.testing`` has a
model-free engine with the same interface for tests of the processors.
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

if TYPE_CHECKING:
    from pipecat_taste.engine import TasteEngine

logger = logging.getLogger(__name__)

# The rate of the audio a session takes from the caller (the audio tower's and Whisper's).
INPUT_SAMPLE_RATE = 16000


@dataclass
class UserTurn:
    """A user turn, tokenized for the spoken LM."""

    transcript: str
    segment: Any  # taste_speech TASTESegment (role user, modality audio)
    n_tokens: int
    audio_seconds: float


@dataclass
class ReplyEvent:
    """What ``TasteSession.reply`` yields, in order: one 'decision' ('reply' or 'no_speech'), then
    for a reply any number of 'segment' events, then one 'end' (reason 'finished', 'truncated' or
    'cancelled')."""

    kind: str
    decision: str | None = None
    text: str = ""
    n_words: int = 0
    segment: Any = None
    reason: str | None = None
    # 'end': the spoken LM's work for this reply (Pipecat's usage metrics): the rows the caller's
    # turn took in its history, and the tokens the reply generated
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class GenerationSettings:
    """Sampling of the spoken LM (the contract's defaults) and the prompt format.

    ``prompt_format``: 'instruct' (role labels around each turn; what the published V0 checkpoint
    can hold a dialogue with: it always answers), 'continuation' (one spoken stream) or
    'dialogue' (fine-tuned checkpoints: the model decides whether to answer at all).
    ``max_reply_tokens``: LLM tokens per reply at most. ``words_per_segment``: words released to
    synthesis at a time."""

    prompt_format: str = "instruct"
    text_top_p: float = 0.3
    taste_top_p: float = 0.0
    text_temperature: float = 0.5
    repetition_penalty: float = 1.1
    max_reply_tokens: int = 64
    words_per_segment: int = 1
    system_prompt: str | None = None
    seed: int = 0
    # Rolling window of the call's history (LM rows / turns kept): bounds memory and per-turn cost.
    history_max_tokens: int = 4096
    history_max_turns: int = 64

    def __post_init__(self):
        # Checked here, where the settings are made: the library would only refuse them mid-call,
        # under its own parameter names.
        from taste_speech.sampler import SamplingParams
        from taste_speech.streaming.prompt import FORMATS

        if self.prompt_format not in FORMATS:
            raise ValueError(f"GenerationSettings.prompt_format must be one of {FORMATS}, got {self.prompt_format!r}")
        for name in ("max_reply_tokens", "words_per_segment", "history_max_tokens", "history_max_turns", "seed"):
            value, least = getattr(self, name), (None if name == "seed" else 1)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or (least is not None and value < least):
                need = "an integer" if least is None else f"an integer >= {least}"
                raise ValueError(f"GenerationSettings.{name} must be {need}, got {value!r}")
        if not -2 ** 63 <= self.seed <= 2 ** 64 - 3:  # it seeds three torch generators: seed, seed + 1, seed + 2
            raise ValueError(f"GenerationSettings.seed must be in [-2**63, 2**64 - 3] (torch seeds are 64-bit), "
                             f"got {self.seed!r}")
        try:
            SamplingParams(text_top_p=self.text_top_p, taste_top_p=self.taste_top_p,
                           text_temperature=self.text_temperature, repetition_penalty=self.repetition_penalty)
        except (TypeError, ValueError) as e:
            raise ValueError(f"GenerationSettings: {e}") from None
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise ValueError(f"GenerationSettings.system_prompt must be a string or None, got {type(self.system_prompt).__name__}")
        if self.system_prompt is not None and not self.system_prompt.strip():
            raise ValueError("GenerationSettings.system_prompt has no words: give one, or None for no system prompt")


@dataclass
class SpeechState:
    """Per-reply speech continuity. The speech-token stage owns the ``prev_*`` fields, the vocoder
    stage owns ``synthesis``; the two stages run in different threads and never touch each
    other's fields."""

    out_sample_rate: int
    prev_text_ids: Any = None
    prev_taste_ids: Any = None
    prev_speech_ids: list[int] = field(default_factory=list)
    synthesis: Any = None  # taste_speech SynthesisState
    sampler: Any = None  # speech-token sampler (its own generator: the stages run concurrently)
    tokens_vocoded: int = 0


class TasteSession:
    """Per-call state: the Conversation (KV cache of the call so far), the voice, random streams."""

    def __init__(self, engine: TasteEngine, settings: GenerationSettings, voice=None):
        import torch

        from taste_speech.processing_taste import as_speaker_embedding
        from taste_speech.streaming import Conversation, TASTESegment

        self.engine, self.settings = engine, settings
        self.model, self.processor = engine.model, engine.processor
        self.input_sample_rate = engine.input_sample_rate
        self.max_turn_seconds = engine.max_turn_seconds
        system = None
        if settings.system_prompt:
            ids = self.processor.process_text(settings.system_prompt).llm_token_ids
            system = TASTESegment("system", "text", ids)
        self.conversation = Conversation(self.model, self.processor, system=system,
                                         prompt_format=settings.prompt_format,
                                         max_tokens=settings.history_max_tokens, max_turns=settings.history_max_turns,
                                         cache_kind=engine.cache_kind, lm_batch=engine.lm_batch)
        if voice is None:
            voice = engine.speaker_embedding()
        self.voice = as_speaker_embedding(voice, self.model.speech_decoder.spk_embed_dim, "voice")
        self._lm_generator = torch.Generator().manual_seed(settings.seed)
        self._speech_generator = torch.Generator().manual_seed(settings.seed + 1)
        self._speech_cache = None  # the speech decoder's cache, reused by every segment of the call
        self._synthesis_generator = torch.Generator().manual_seed(settings.seed + 2)
        self._last_reply_words = 0  # words of the newest assistant turn in the conversation
        self._jobs_lock = threading.Lock()
        self._open_jobs = 0  # reply and speech-token generators still open (they end what close() cannot)
        self._closed = False

    def close(self) -> None:
        """End of the call: free what the call holds in shared structures (its slots in the
        engine's step batches). A reply or speech still being generated stops at its next step,
        and the last one to end frees them (its thread may still be writing to a slot)."""
        with self._jobs_lock:
            self._closed = True
            if self._open_jobs:
                return
        self._release_shared()

    def _release_shared(self) -> None:
        try:
            self.conversation.close()
        finally:
            close = getattr(self._speech_cache, "close", None)
            if close is not None:
                close()
            self._speech_cache = None  # (its buffers and captured steps go with it, as the LM cache's do)

    @contextlib.contextmanager
    def _job(self, when_closed: str = "raise"):
        """One reply, one segment's speech tokens or a change of the history (the call may end
        while they run: the last one to end frees the shared structures). ``when_closed="skip"``
        yields False instead of raising when the call has ended."""
        with self._jobs_lock:
            if self._closed:
                if when_closed == "skip":
                    yield False
                    return
                raise RuntimeError("this session was closed (the call ended)")
            self._open_jobs += 1
        try:
            yield True
        finally:
            with self._jobs_lock:
                self._open_jobs -= 1
                last = self._closed and not self._open_jobs
            if last:
                self._release_shared()

    # -- listening --------------------------------------------------------------------------------
    def transcribe(self, audio: np.ndarray) -> str:
        if self.engine.asr is None:
            raise NotImplementedError(
                "this engine has no built-in ASR: put a Pipecat STT service before TasteTurnCapture (it uses the "
                "TranscriptionFrames; a user context aggregator between the two takes them: put it before the STT) "
                "or load one (TasteEngine.from_pretrained(..., asr='openai/whisper-large-v3'))"
            )
        return self.engine.asr(audio)

    def start_transcript(self):
        """Incremental ASR state for one user turn (``pipecat_taste.asr.TurnTranscript``: partial
        transcripts while the user speaks, then ``finish``), or None when the built-in ASR cannot
        reuse partials (none, or one decoding with ``generate``)."""
        new_turn = getattr(self.engine.asr, "new_turn", None)
        return new_turn() if new_turn is not None else None

    def turn_ended(self, transcript=None) -> None:
        """The caller stopped speaking: this call's turn comes to the shared steps soon - the
        built-in ASR's decoding batches (``transcript``: the turn's ``start_transcript()``,
        finished next; ``UtteranceBatcher.expect``) and the audio tower's encoder (after the
        transcript; ``EncoderGraph.expect_turn``) - and their batch or pass for another call's
        turn that ends at the same moment waits a little for it (on the CUDA fast path; elsewhere
        each takes one turn)."""
        ended = getattr(transcript, "ended", None)
        if ended is not None:
            ended()
        # (an ASR sharing the tower's encoder: its final pass is the turn's tower pass, announced above)
        transcriber = getattr(transcript, "transcriber", None)
        shared = getattr(transcriber, "shares_tower_encoder", False) and transcriber.plan is not None
        if self.engine.tower_encoder is not None and not shared:
            self.engine.tower_encoder.expect_turn(self)

    def turn_withdrawn(self, transcript=None, *, transcription: bool = True, tower: bool = True) -> None:
        """What ``turn_ended`` announced will not come - the built-in ASR's final pass
        (``transcription``: the turn took an upstream STT's words) and the tower's pass (``tower``:
        the turn had no words, or was taken back) - so no batch of another call's waits for it.
        Work that came already is not affected."""
        given_up = getattr(transcript, "given_up", None)
        if transcription and given_up is not None:
            given_up()
        if tower and self.engine.tower_encoder is not None:
            self.engine.tower_encoder.withdraw_turn(self)

    def user_turn(self, audio: np.ndarray, transcript: str, heard=None) -> UserTurn:
        """The turn's TASTE segment (``taste_tokenize``). ``heard``: the turn's
        ``start_transcript()`` after its ``finish(audio)``, whose encoding of the audio the tower
        then uses (an ASR sharing the tower's encoder; taken from it), or None."""
        import functools

        import torch

        from taste_speech.audio import to_mono_float
        from taste_speech.streaming import TASTESegment, taste_tokenize

        words = self.processor.split_words(transcript)
        if not words:
            raise ValueError("the transcript is empty: no words to align the user's audio to")
        text_ids = self.processor.encode_words(words).llm_token_ids
        wav = to_mono_float(audio)  # (channels, samples) or (samples, channels) are mixed down
        take_encoded = getattr(heard, "take_encoded", lambda: None)
        encoder = self.engine.tower_encoder
        if encoder is not None:  # (this call's pass: the one announced by turn_ended)
            encoder = functools.partial(encoder, owner=self)
        taste_ids = taste_tokenize(self.model, self.processor, torch.from_numpy(wav).view(1, -1),
                                   text_ids, sampling_rate=self.input_sample_rate, encoder=encoder,
                                   pooler=self.engine.tower_pooler, encoded=take_encoded())
        segment = TASTESegment("user", "audio", text_ids, taste_ids)
        return UserTurn(transcript, segment, int(text_ids.shape[1]), wav.size / self.input_sample_rate)

    # -- thinking ---------------------------------------------------------------------------------
    def reply(self, turn: UserTurn, stop: threading.Event) -> Iterator[ReplyEvent]:
        with self._job():  # (a closed call says so first)
            if not isinstance(turn, UserTurn):
                raise ValueError(f"reply takes the UserTurn that user_turn() made, got {type(turn).__name__}")
            if not callable(getattr(stop, "is_set", None)):
                raise ValueError(f"reply's stop must be a threading.Event (set it to cut the reply), got {stop!r}")
            yield from self._reply(turn, stop)

    def _reply(self, turn: UserTurn, stop: threading.Event) -> Iterator[ReplyEvent]:
        from taste_speech.streaming import every_n_words, streaming_generate

        s = self.settings
        items = streaming_generate(
            self.model, self.processor, [turn.segment], text_top_p=s.text_top_p, taste_top_p=s.taste_top_p,
            text_temperature=s.text_temperature, repetition_penalty=s.repetition_penalty,
            max_length=s.max_reply_tokens, should_emit_segment=every_n_words(s.words_per_segment),
            conversation=self.conversation, prompt_format=s.prompt_format,
            stop=lambda: stop.is_set() or self._closed, generator=self._lm_generator,
        )
        decided = False
        self._last_reply_words = 0
        emitted: list = []  # the reply's segments handed on so far (on a failure: what may have been heard)
        try:
            if not self.conversation.format.decides_turns:  # instruct / continuation: it always answers
                decided = True
                yield ReplyEvent("decision", decision="reply")
            for item in items:
                if item["completion_reason"] == "no_speech":
                    yield ReplyEvent("decision", decision="no_speech")
                    return
                if not decided:
                    decided = True
                    yield ReplyEvent("decision", decision="reply")
                segment = item["segment"]
                if segment is not None:
                    text = self.processor.llm_tokenizer.decode(segment.text_ids[0].tolist())
                    emitted.append(segment)
                    yield ReplyEvent("segment", text=text, n_words=int(segment.word_starts().sum()), segment=segment)
                if item["is_complete"]:
                    reply = item.get("reply")  # streaming_generate has committed it to the conversation
                    self._last_reply_words = 0 if reply is None else int(reply.word_starts().sum())
                    reason = "cancelled" if item.get("cancelled") else "truncated" if item.get("truncated") else "finished"
                    st = self.conversation.state
                    prompt = next((rows for t, rows in zip(st.turns, st.turn_rows) if t is turn.segment), 0)
                    yield ReplyEvent("end", reason=reason, prompt_tokens=int(prompt),
                                     completion_tokens=int(item.get("steps") or 0))
                    return
        except Exception:
            self._keep_turn(turn, emitted)
            raise
        finally:
            items.close()  # a reply abandoned by its consumer frees the conversation now, not at collection

    def _keep_turn(self, turn: UserTurn, emitted: list) -> None:
        """A failed reply: the library took the caller's turn back (ready for a retry), but the call
        goes on to the next turn, so the conversation keeps what the caller said, and the words of
        the reply already handed on (``commit_reply`` then cuts them to what was played)."""
        from taste_speech.streaming import TASTESegment

        if self.conversation.closed or any(t is turn.segment for t in self.conversation.state.turns):
            return
        try:
            self.conversation.add_turn(turn.segment)
            if emitted:
                said = TASTESegment.concat(emitted)
                self.conversation.add_turn(said)
                self._last_reply_words = said.num_words
        except Exception as exc:  # the model itself fails: the next turn will say so
            logger.warning("the caller's turn or the reply begun could not be kept after a failed reply: %s", exc)

    def commit_reply(self, played_words: int | None) -> int:
        """After a reply: keep all of it (None) or only its first ``played_words`` words (what the
        caller heard before a barge-in). Returns the number of words kept. Runs before the next
        ``reply``, so the history always matches what was heard."""
        counted = isinstance(played_words, numbers.Integral) and not isinstance(played_words, bool)
        if played_words is not None and not (counted and played_words >= 0):
            raise ValueError(f"played_words must be None (all heard) or a number of words >= 0, got {played_words!r}")
        total, self._last_reply_words = self._last_reply_words, 0
        cut = total > 0 and played_words is not None and played_words < total
        if not cut and not self.conversation.window_due:
            return total
        with self._job(when_closed="skip") as open_:  # the call may end meanwhile: close() waits for this
            if not open_ or self.conversation.closed:
                return total
            if cut:
                kept = self.conversation.truncate_last_assistant(max(0, int(played_words)))
                total = 0 if kept is None else int(kept.word_starts().sum())
            try:  # the history past its window: moved now, between turns, not before the next reply
                self.conversation.move_window()
            except Exception as exc:  # (out of memory: the cache is dropped and the next turn prefills it)
                logger.warning("the history's window could not be moved after the reply: %s", exc)
        return total

    def forget_turn(self, turn: UserTurn) -> int:
        """Take back a user turn that was answered too early (the caller went on speaking) and the
        reply begun to it; runs after that reply's generation ended. Returns the turns forgotten."""
        self._last_reply_words = 0
        with self._job(when_closed="skip") as open_:
            if not open_ or self.conversation.closed:
                return 0
            return self.conversation.forget_from(turn.segment)

    # -- speaking ---------------------------------------------------------------------------------
    def start_speech(self, out_sample_rate: int) -> SpeechState:
        import torch

        from taste_speech.modeling_speech_decoder import TopKSampler
        from taste_speech.streaming.synthesis import start_speaking

        state = SpeechState(out_sample_rate=out_sample_rate)
        state.sampler = TopKSampler(generator=self._speech_generator)
        stream = self.engine.synthesis_stream
        if stream is not None and self.voice.is_cuda:  # a voice given as a tensor this thread's stream wrote
            stream.wait_stream(torch.cuda.current_stream(stream.device))
        with self.engine.on_synthesis_stream():
            state.synthesis = start_speaking(self.engine.voice_generator, self.voice, self.engine.speech_policy,
                                             out_sample_rate, self._synthesis_generator, kind=self.engine.cache_kind,
                                             graphs=self.engine.synthesis_graphs)
        return state

    def speech_cache(self):
        """The speech decoder's cache, made once and reused by every segment of the call (on the
        fast path its decode step is captured once per call, not per segment)."""
        if self._speech_cache is None:
            batch = self.engine.speech_batch
            self._speech_cache = (batch.open() if batch is not None
                                  else self.model.speech_decoder.new_cache(self.engine.cache_kind))
        return self._speech_cache

    def warm_up(self) -> None:
        """Capture this call's decode and prefill steps (the spoken LM's and the speech decoder's)
        before the caller's first turn (on the fast path the first step of each static cache captures
        its CUDA graph: tens of ms that would otherwise delay the first reply). Leaves the
        conversation exactly as it was; a no-op on growing caches."""
        import torch

        from taste_speech.lm_cache import StaticLMCache
        from taste_speech.speech_decoder_cache import StaticSpeechCache

        with torch.no_grad():
            # the RVQ's joined code table: made on a GPU with one wait, here rather than in a turn
            self.model.audio_tower.vq.rvq.joined_codebooks()
            decode = self.conversation.ready()
            if isinstance(decode.cache, StaticLMCache):
                length, hidden = decode.length, decode.last_hidden
                self.model.spoken_lm.feed(decode, decode.inputs_embeds()[:, -1:])  # one step: captures
                decode.crop(length)
                decode.last_hidden = hidden
                decode.cache.warm_up_prefill(self.model.spoken_lm.backbone)  # a turn's prefill steps
                lm, rvq = self.model.spoken_lm, self.model.audio_tower.vq.rvq
                lm.heads(hidden, rvq, step=lm.heads_step(decode, rvq))  # the heads' step (kept by the cache)
            cache = self.speech_cache()
            if isinstance(cache, StaticSpeechCache):
                decoder = self.model.speech_decoder
                prefix = torch.zeros(1, 4, decoder.llm.input_size, device=decoder.device, dtype=decoder.dtype)
                state = decoder.start(prefix, min_len=2, max_len=2, cache=cache)
                while decoder.step(state) is not None:  # the 2nd step feeds a token: captured (the next start resets)
                    pass
                cache.warm_up_prefill()  # a segment's prefix and continued speech: padded bucket steps
                if (conditioning := decoder.condition_graph(cache)) is not None:
                    conditioning.warm_up()  # and the encoders of its words

    def speech_tokens(self, state: SpeechState, segment) -> Iterator[list[int]]:
        """Speech tokens of one reply segment, continuing the previous segment of the same reply
        (the speech-decoder half of ``taste_detokenize_stream``; tests check the two agree)."""
        from taste_speech.streaming import TASTESegment

        with self._job():
            if not isinstance(segment, TASTESegment):
                raise ValueError(f"speech_tokens takes a reply segment (ReplyEvent.segment), got "
                                 f"{type(segment).__name__}")
            yield from self._speech_tokens(state, segment)

    def _speech_tokens(self, state: SpeechState, segment) -> Iterator[list[int]]:
        import torch

        from taste_speech.device_copies import to_device

        model, processor = self.model, self.processor
        decoder = model.speech_decoder
        text_ids, taste_ids = segment.text_ids, segment.taste_ids
        if state.prev_text_ids is None:
            prev_text = torch.zeros(1, 0, dtype=torch.long)
            prev_taste = torch.zeros(1, 0, taste_ids.shape[2], dtype=torch.long)
        else:
            prev_text, prev_taste = state.prev_text_ids, state.prev_taste_ids
        full_text = torch.cat([prev_text, text_ids], dim=1)
        full_taste = torch.cat([prev_taste, taste_ids], dim=1)
        aligned = processor.align_llm_ids(full_text)
        current = processor.align_llm_ids(text_ids)
        with torch.inference_mode():
            # the words, codes and voice are host tensors: checked there and copied in without
            # waiting for the GPU (a wait would be for every call's queued work); the speech-token
            # draws are this path's only reads
            audio_embeds = decoder.audio_embeds_from_taste(model.rvq, full_taste, aligned.asr_word_ids)
            cache = self.speech_cache()
            prefix = decoder.prefix_embeds(self.voice, audio_embeds, aligned.asr_token_ids,
                                           graph=decoder.condition_graph(cache))
            min_len, max_len = decoder.length_limits(current.asr_token_ids.shape[1] + 3)
            dec_state = decoder.start(prefix, min_len=min_len, max_len=max_len, cache=cache)
            if state.prev_speech_ids:
                prev = to_device(torch.tensor([state.prev_speech_ids], dtype=torch.long), decoder.device)
                dec_state.next_logp = decoder.feed(dec_state, decoder.speech_embedding(prev))
            new: list[int] = []
            while (token := decoder.step(dec_state, state.sampler)) is not None:
                if self._closed:  # the call ended: nobody will play the rest
                    return
                new.append(int(token))
                if len(new) % 5 == 0:  # hand tokens to the vocoder in small groups
                    yield new[-5:]
            if len(new) % 5:
                yield new[-(len(new) % 5):]
        if not new:
            raise ValueError("the speech decoder produced no speech tokens for this segment")
        # the next segment continues this one's words and speech (as taste_detokenize with a state)
        state.prev_text_ids, state.prev_taste_ids, state.prev_speech_ids = text_ids, taste_ids, new

    def drop_speech(self, state: SpeechState) -> None:
        """A reply given up before its end (taken back: the caller went on): the calls' shared
        synthesis steps no longer wait for its first window (``stop_speaking``)."""
        from taste_speech.streaming.synthesis import stop_speaking

        if state.synthesis is not None:
            stop_speaking(state.synthesis)

    def vocode(self, state: SpeechState, tokens: list[int], final: bool = False) -> list[np.ndarray]:
        """The audio chunks (out sample rate, float32) that ``tokens`` completed; raises
        ``VocodingFailed`` with the chunks completed before a step that failed."""
        import torch

        from taste_speech.streaming.synthesis import SynthesisFailed, speak

        def as_audio(chunks) -> list[np.ndarray]:  # (waits for the stream's work)
            return [c.audio.reshape(-1).float().cpu().numpy() for c in chunks]

        piece = torch.tensor([tokens], dtype=torch.long) if tokens else None
        with torch.inference_mode(), self.engine.on_synthesis_stream():
            try:
                chunks = speak(self.engine.voice_generator, state.synthesis, piece, final=final)
            except SynthesisFailed as failed:
                raise VocodingFailed(str(failed), as_audio(failed.chunks)) from failed
            audio = as_audio(chunks)
        state.tokens_vocoded += len(tokens)
        return audio

    def speech_samples(self, n_tokens: int, out_sample_rate: int) -> int:
        return speech_samples(n_tokens, out_sample_rate)


class VocodingFailed(RuntimeError):
    """``TasteSession.vocode`` failed part-way: ``audio``, the chunks it completed before the failure
    (play them, then end the reply: its synthesis cannot go on)."""

    def __init__(self, message: str, audio: list[np.ndarray]):
        super().__init__(message)
        self.audio = audio


def speech_samples(n_tokens: int, out_sample_rate: int) -> int:
    """Output samples of the first ``n_tokens`` speech tokens (HiFT: 256 samples per mel frame at
    22.05 kHz, floor(n * 441 / 256) mel frames for n tokens)."""
    frames = n_tokens * 441 // 256
    return int(round(frames * 256 * out_sample_rate / 22050))
