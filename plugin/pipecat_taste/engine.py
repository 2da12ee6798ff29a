"""TasteEngine: the one place where the plugin talks to ``taste_speech``.

The processors never import the model library; they call a per-call :class:`TasteSession`
(``engine.new_session()``), whose methods are blocking and are run by the processors in worker
threads, one stage per thread:

    listening   turn_ended(transcript)                     (the caller stopped speaking: its turn comes soon)
                turn_withdrawn(transcript, ...)            (what turn_ended announced will not come)
                transcribe(audio) -> str                  (built-in ASR, when the engine has one)
                start_transcript() -> TurnTranscript | None   (incremental built-in ASR of one turn)
                user_turn(audio, transcript, heard) -> UserTurn  (taste_tokenize)
    thinking    reply(turn, stop) -> iterator of ReplyEvent  (streaming_generate, one Conversation per call)
                commit_reply(played_words)                 (keep the words the caller heard)
    speaking    start_speech(rate) -> SpeechState          (one voice-generator state per reply)
                speech_tokens(state, segment) -> iterator of token lists   (speech decoder)
                vocode(state, tokens, final) -> list of float32 chunks      (flow + HiFT)
                speech_samples(n_tokens, rate) -> output samples covered by n speech tokens
    end         close()                                    (the call ended: frees its slots in shared batches)

If the library's signatures drift, this file is what changes. ``pipecat_taste.testing`` has a
model-free engine with the same interface for tests of the processors.
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from pipecat_taste.start_hold import StartNeeds

logger = logging.getLogger(__name__)

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


# How the hot loops run (docs/GPU.md): the cache kind each one is given.
DECODING = {
    "auto": "auto",  # the fast path (static caches, CUDA graphs) on CUDA, the eager path elsewhere
    "graphed": "static",  # static caches everywhere (graphs on CUDA; on a CPU the same fixed shapes, eagerly)
    "eager": "dynamic",  # growing caches, no graphs: the reference (debugging on CUDA)
}


def is_tiny(model) -> bool:
    """A tiny test checkpoint (``taste_speech.tiny``), not one of the published size."""
    return model.config.text_config.hidden_size < 256


def _asr_tokenizer_folder(asr, checkpoint_dir: str, model) -> str | None:
    """The built-in ASR's local Whisper folder as the processor's ASR tokenizer, where the checkpoint
    ships none of its own (the published one names openai/whisper-large-v3's): offline, the folder
    given for the ASR may be the only copy. Only a Whisper of the tower's vocabulary (the ids of a
    transcript's words are then the tower's); else None, the checkpoint's choice."""
    import json

    from taste_speech.processing_taste import ASR_TOKENIZER_DIR

    if not (isinstance(asr, str) and os.path.isdir(asr)):
        return None
    if os.path.isdir(os.path.join(checkpoint_dir, ASR_TOKENIZER_DIR)):
        return None
    try:
        with open(os.path.join(asr, "config.json")) as f:
            vocab = json.load(f).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return asr if vocab == model.config.joint_whisper_config.vocab_size else None


def default_asr(model, processor, checkpoint_dir: str, *, device: str = "cpu", dtype: str | None = None):
    """The built-in ASR that ``asr='auto'`` loads: the random tiny Whisper for a tiny checkpoint;
    otherwise the Whisper model the checkpoint names (``asr_config``: openai/whisper-large-v3 for
    the published checkpoint, the model whose transcripts TASTE was trained on). Live calls need a
    transcript per turn, so a checkpoint whose ASR cannot be loaded is an error, not a silent
    agent that never answers."""
    from pipecat_taste.asr import WhisperTranscriber

    if is_tiny(model):
        return WhisperTranscriber.random_tiny(checkpoint_dir, device=device, dtype=dtype)
    name = processor.asr_model
    if not name:
        raise ValueError(
            f"the checkpoint in {checkpoint_dir} names no Whisper model for the built-in ASR (asr_config); pass "
            "asr=<Whisper folder or hub id> (taste-agent --asr-model), or asr=None (--asr-model none) when an "
            "upstream Pipecat STT sends TranscriptionFrames")
    try:
        return WhisperTranscriber.from_pretrained(name, device=device, dtype=dtype)
    except Exception as exc:
        raise RuntimeError(
            f"could not load {name!r}, the checkpoint's Whisper model for the built-in ASR "
            f"({type(exc).__name__}: {exc}); download it and pass asr=<its folder> (taste-agent --asr-model DIR), "
            "or asr=None (--asr-model none) when an upstream Pipecat STT sends TranscriptionFrames") from exc


class TasteEngine:
    """Model, processor and voice generator, loaded once and shared by every call."""

    def __init__(self, model, processor, voice_generator, *, checkpoint_dir: str = "", device: str = "cpu",
                 asr=None, decoding: str = "auto", parallel_jobs: int | str | None = "auto",
                 batch_slots: int | str | None = "auto", merge_lora: bool = True, streams: str = "auto",
                 compile_flow: bool = False, threads_per_job: int | str | None = "auto"):
        """``decoding``: 'auto', 'graphed' or 'eager' (see ``DECODING``); the built-in ASR picks its
        own path (``WhisperTranscriber(decode=...)``). ``parallel_jobs``: model jobs of all calls
        running at once (``compute_gate``): a number, None (no limit) or 'auto' (the CPU cores
        this process may use on a CPU; no limit on CUDA, where jobs mostly wait for the GPU).
        ``batch_slots``: calls whose decode steps (spoken LM, speech decoder) run as one batched
        step (``taste_speech.lm_batch``, ``speech_decoder_batch``), and whose flow and vocoder
        windows share batched steps on the static synthesis path (``synthesis_graphs``, rows;
        without slots, ``CUDA_SYNTHESIS_ROWS`` on CUDA):
        a number, None (each call steps alone) or 'auto' (None: measured on a GPU, batching paid
        nothing at 2-8 calls - BENCHMARKS.md section 5; try a number where many calls speak at once). ``merge_lora``: fold the spoken
        LM's LoRA adapters into its weights before any step runs (``TasteSpokenLM.merge_lora``:
        the same function, fewer kernels per token); False keeps them on the side (a model you go
        on training). ``streams`` (see ``STREAMS``): 'auto' (the default: 'synthesis' on the CUDA
        fast path, 'default' elsewhere), 'default' (every thread's work on the device's default
        stream), or on CUDA 'synthesis' (every call's flow and vocoder work on one stream of its
        own, beside the decoding) or 'calls' (that, and each call's other work on a stream of the
        call's own). ``compile_flow``: the flow's estimator through ``torch.compile`` inside the
        static synthesis path's steps (``SynthesisGraphs(compile_flow=True)``; CUDA only, Triton
        needed, a minute or two more at start-up). Compiled for one static shape it took a flow
        step to 0.70-0.78 of its time on the H100; the engine compiles with dynamic shapes, not yet
        measured there. Off by default. ``threads_per_job``: torch's intra-op threads in the calls'
        stage threads (``prepare_stage_thread``): a number, None (torch's setting as it is) or
        'auto' (1 for a tiny checkpoint on a CPU, whose small operators gain nothing from a thread
        team per stage - the simulated call's first audio 0.73x of torch's setting on 2 cores;
        None otherwise - a lone full-size turn took 1.7x its time with one thread; BENCHMARKS.md
        section 12; with many calls at once on a CPU a small number may answer sooner: measure
        with ``benchmarks/bench_job_threads.py``). torch keeps this
        setting per process: the process's other worker threads get it too, its main thread keeps
        its own."""
        _check_options(asr, decoding, parallel_jobs, batch_slots, streams, compile_flow, threads_per_job)
        if isinstance(asr, str):
            raise ValueError(f"asr={asr!r}: a name is loaded by TasteEngine.from_pretrained(..., asr={asr!r}); here pass "
                             "the transcriber itself (pipecat_taste.asr.WhisperTranscriber.from_pretrained(name)) or "
                             "None")
        _check_device_options(streams, compile_flow, next(voice_generator.parameters()).device)
        if merge_lora:
            model.spoken_lm.merge_lora()
        device_name = str(next(model.parameters()).device)
        self.compute_gate = _compute_gate(parallel_jobs, device_name)  # 'auto' resolved
        self.threads_per_job = _threads_per_job(threads_per_job, device_name, model)
        slots = _batch_slots(batch_slots, device_name, decoding)
        self.lm_batch, self.speech_batch = _step_batches(model, slots, decoding)
        self.model, self.processor, self.voice_generator = model, processor, voice_generator
        self.checkpoint_dir = checkpoint_dir
        self.device = device
        self.decoding, self.cache_kind = decoding, DECODING[decoding]
        self.synthesis_graphs = _synthesis_graphs(voice_generator, slots, self.cache_kind, compile_flow)
        self.streams = _resolve_streams(streams, next(voice_generator.parameters()).device, self.cache_kind)
        self.synthesis_stream = (_new_stream(next(voice_generator.parameters()).device)
                                 if self.streams != "default" else None)
        if self.synthesis_stream is not None:  # what this thread did to the weights (merging the LoRA) comes first
            import torch

            torch.cuda.current_stream(self.synthesis_stream.device).synchronize()  # (not the device: see lm_batch)
        self.speech_policy = _speech_policy(self.synthesis_graphs)
        self.tower_encoder = _tower_encoder(model, decoding, slots)  # the audio tower's encoder as a CUDA graph, or None
        self.tower_pooler = _tower_pooler(model, decoding)  # its text side as CUDA graphs, or None
        self.asr = asr  # built-in ASR (pipecat_taste.asr.WhisperTranscriber) or None
        self.share_tower_encoder()
        self.start_needs = StartNeeds()  # how late recent replies' second chunks came (the playout's start hold)
        # Calls in one process share the weights; every per-call state (KV caches, synthesis
        # continuity) lives in the state objects the session passes to the model.
        self.input_sample_rate = INPUT_SAMPLE_RATE

    @classmethod
    def from_pretrained(cls, name_or_path: str | None = None, *, device: str = "cpu", dtype: str | None = None,
                        asr="auto", decoding: str = "auto", parallel_jobs: int | str | None = "auto",
                        batch_slots: int | str | None = "auto", merge_lora: bool = True,
                        streams: str = "auto", compile_flow: bool = False,
                        threads_per_job: int | str | None = "auto") -> "TasteEngine":
        """``name_or_path``: a checkpoint folder or hub id; None = the embedded tiny checkpoint.
        ``asr``: the built-in ASR - a Whisper folder/hub id, a transcriber, None (transcripts must
        come from an upstream STT) or 'auto' (``default_asr``: the checkpoint's own Whisper)."""
        import torch

        from taste_speech.modeling_taste import TasteForCausalLM, resolve_device
        from taste_speech.processing_taste import TasteProcessor
        from taste_speech.voice_generator import VoiceGenerator

        if isinstance(asr, os.PathLike):
            asr = os.fspath(asr)
        # before the weights load (minutes, for the real one)
        _check_options(asr, decoding, parallel_jobs, batch_slots, streams, compile_flow, threads_per_job)
        if isinstance(asr, str) and asr != "auto":
            from pipecat_taste.asr import check_whisper_name

            asr = check_whisper_name(asr)  # a mistyped path fails now, not after the weights
        device = str(resolve_device(device))  # 'auto' -> 'cuda' or 'cpu', once for every part
        _check_device_options(streams, compile_flow, device)  # (before the weights load, too)
        if name_or_path is None:
            from taste_speech.tiny import default_tiny_checkpoint

            name_or_path = default_tiny_checkpoint()
        torch_dtype = None if dtype in (None, "auto") else dtype
        model = TasteForCausalLM.from_pretrained(name_or_path, torch_dtype=torch_dtype, device=device).eval()
        directory = getattr(getattr(model, "loading_info", None), "directory", None) or str(name_or_path)
        processor = TasteProcessor.from_pretrained(directory, asr_tokenizer=_asr_tokenizer_folder(asr, directory, model))
        voice_generator = VoiceGenerator.from_pretrained(directory, device=device).eval()
        torch.set_grad_enabled(False)
        if asr == "auto":
            asr = default_asr(model, processor, directory, device=device, dtype=dtype)
        elif isinstance(asr, str):
            from pipecat_taste.asr import WhisperTranscriber

            try:
                asr = WhisperTranscriber.from_pretrained(asr, device=device, dtype=dtype)
            except Exception as exc:
                raise RuntimeError(
                    f"could not load the Whisper model {asr!r} for the built-in ASR ({type(exc).__name__}: {exc}); "
                    "pass a local Whisper folder or hub id, or asr=None when an upstream Pipecat STT sends "
                    "TranscriptionFrames") from exc
        return cls(model, processor, voice_generator, checkpoint_dir=directory, device=device, asr=asr,
                   decoding=decoding, parallel_jobs=parallel_jobs, batch_slots=batch_slots, merge_lora=merge_lora,
                   streams=streams, compile_flow=compile_flow, threads_per_job=threads_per_job)

    @property
    def max_turn_seconds(self) -> float:
        return float(self.processor.max_seconds)

    @property
    def has_asr(self) -> bool:
        return self.asr is not None

    def speaker_embedding(self, reference_audio: np.ndarray | None = None, sample_rate: int | None = None):
        """The call's voice: from reference audio at ``sample_rate`` Hz (CAMPPlus), or the default
        voice (the checkpoint's, or the placeholder made from ``taste_speech/default_voice.wav``)."""
        if reference_audio is not None:
            if sample_rate is None:  # a guess would make a 48 kHz clip a voice three times too low
                raise ValueError("speaker_embedding needs the reference audio's sample_rate in Hz (e.g. 48000)")
            return self.processor.speaker_embedding(reference_audio, sample_rate)
        return self.processor.default_speaker_embedding()

    def on_synthesis_stream(self):
        """The context in which flow and vocoder work runs: the engine's synthesis stream, or the
        thread's own stream where there is none."""
        return on_stream(self.synthesis_stream)

    def share_tower_encoder(self, asr=None) -> bool:
        """One Whisper encoder pass a turn, not two: where ``asr`` (default: the built-in ASR) has
        the audio tower's encoder weights (the published tower froze Whisper-large-v3's encoder),
        its passes run through this engine's tower ``EncoderGraph`` and a turn's final transcription
        hands the tower its encoding (``pipecat_taste.asr``; the session's ``user_turn(...,
        heard=)`` takes it). The engine does it for its own ASR when made. Whether it does: only on
        the CUDA fast path (elsewhere the tower has no shared encoder) and for a Whisper decoding
        with the static loop (``generate`` has no passes to share)."""
        from pipecat_taste.asr import WhisperTranscriber

        asr = self.asr if asr is None else asr
        if self.tower_encoder is None or not isinstance(asr, WhisperTranscriber) or asr.plan is None:
            return False
        if not asr.encoder_matches(self.model.audio_tower, self.processor):
            logger.info("the built-in ASR's Whisper encoder differs from the audio tower's (weights, dtype or front "
                        "end): the tower encodes each turn again")
            return False
        asr.share_encoder(self.tower_encoder)
        logger.info("the built-in ASR's Whisper encoder has the audio tower's weights: one encoder pass a turn")
        return True

    def new_call_stream(self):
        """A CUDA stream for one call's work other than synthesis (``streams='calls'``), else None.
        The call runs its jobs with it current (``on_stream``; ``TasteCall`` starts its worker
        threads on it), from its session's creation to its end."""
        if self.streams != "calls":
            return None
        return _new_stream(self.synthesis_stream.device, other_than=self.synthesis_stream)

    def new_session(self, settings: GenerationSettings | None = None, voice=None) -> "TasteSession":
        if settings is not None and not isinstance(settings, GenerationSettings):
            raise ValueError(f"settings must be a GenerationSettings, got {type(settings).__name__} "
                             "(e.g. GenerationSettings(max_reply_tokens=96))")
        return TasteSession(self, settings or GenerationSettings(), voice)

    def warm_up(self, calls: int = 1, rehearse: bool = True, out_sample_rate: int = 16000):
        """Capture the shared synthesis graphs (flow and vocoder, one per window-size bucket and
        batch size), the audio tower's encoder and the batched decode steps before the first call,
        on the fast path (the eager path has nothing to capture). Per-call steps are captured by
        ``TasteSession.warm_up``. ``calls``: how many calls may be served at once; on CUDA the
        built-in ASR prepares a decoding workspace for each (elsewhere one: a workspace there is
        only buffers, made in a moment when needed). ``rehearse``: then run one whole turn of a
        throwaway call (``pipecat_taste.rehearsal``: the first run of every operator around the
        graphs is paid there, not by the first caller), its audio at ``out_sample_rate``; on CUDA
        the turns of ``calls`` throwaway calls ending together (what a first burst of calls pays
        - pinned host blocks, larger batches of the shared steps - is paid there; a CPU has no
        such cost); returns its ``Rehearsal`` (None without). A rehearsal that fails is logged,
        not raised: the agent still starts, and the first call shows the fault where it belongs."""
        import torch

        self._capture(calls)
        if not rehearse:
            return None
        from pipecat_taste.rehearsal import rehearse_turn

        together = calls if torch.device(self.device).type == "cuda" else 1
        try:
            return rehearse_turn(self, out_sample_rate, calls=together)
        except Exception as exc:
            logger.warning("the rehearsal turn at start-up failed (%s: %s); the first call will pay for its "
                           "kernels' first runs", type(exc).__name__, exc, exc_info=True)
            return None

    def _capture(self, calls: int) -> None:
        from taste_speech.streaming.synthesis_graphs import resolve_kind, shared_graphs

        graphs = self.synthesis_graphs
        if graphs is None and resolve_kind(self.cache_kind, next(self.voice_generator.parameters()).device) == "static":
            graphs = shared_graphs(self.voice_generator)
        if graphs is not None and graphs.mode != "eager":  # (eager steps have nothing to capture)
            with self.on_synthesis_stream():  # (its buffers belong to the stream that replays them)
                graphs.warm_up()  # every bucket at every batch size
        for tower_steps in (self.tower_encoder, self.tower_pooler):
            if tower_steps is not None:
                tower_steps.warm_up()
        for batch in (self.lm_batch, self.speech_batch):
            if batch is not None:
                batch.warm_up()  # one captured step per batch size
        if hasattr(self.asr, "warm_up"):
            import torch

            from pipecat_taste.asr import WhisperTranscriber

            cuda = torch.device(self.device).type == "cuda"
            if isinstance(self.asr, WhisperTranscriber):  # the built-in ASR's decode steps (captured on CUDA)
                self.asr.warm_up(workspaces=calls if cuda else 1)
            else:
                self.asr.warm_up()


def _check_options(asr, decoding: str, parallel_jobs, batch_slots, streams: str = "auto",
                   compile_flow: bool = False, threads_per_job="auto") -> None:
    if decoding not in DECODING:
        raise ValueError(f"decoding must be one of {sorted(DECODING)}, got {decoding!r}")
    for name, value in (("parallel_jobs", parallel_jobs), ("batch_slots", batch_slots),
                        ("threads_per_job", threads_per_job)):
        if value not in (None, "auto") and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be an integer >= 1, None or 'auto', got {value!r}")
    if not (asr is None or isinstance(asr, str) or callable(asr)):
        raise ValueError(f"asr must be 'auto', a Whisper folder or hub id, a transcriber (audio16k -> text) or None "
                         f"(transcripts from an upstream STT), got {asr!r}")
    if not isinstance(streams, str) or streams not in STREAMS:
        raise ValueError(f"streams must be one of {STREAMS}, got {streams!r}")
    if streams == "calls" and batch_slots not in (None, "auto"):
        raise ValueError("streams='calls' cannot be combined with batch_slots: a batched step runs the rows of several "
                         "calls, each written on its call's stream; use streams='synthesis' with batch slots")
    if not isinstance(compile_flow, bool):
        raise ValueError(f"compile_flow must be True or False, got {compile_flow!r}")
    if compile_flow and decoding == "eager":
        raise ValueError("compile_flow compiles the flow steps of the static synthesis path, which decoding='eager' "
                         "does not take: use decoding='auto' (on CUDA) or 'graphed', or compile_flow=False")


def _compute_gate(parallel_jobs: int | str | None, device: str):
    from pipecat_taste.compute import ComputeGate

    if parallel_jobs == "auto":
        if str(device).startswith("cuda"):
            return None
        parallel_jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return None if parallel_jobs is None else ComputeGate(parallel_jobs)


def _threads_per_job(threads: int | str | None, device: str, model) -> int | None:
    # 'auto': one thread for a tiny model's small operators on a CPU, where a thread team's upkeep
    # outweighs its work; the full size's large ones gain from the cores more than the stages lose
    # (BENCHMARKS.md section 12: a lone full-size turn took 1.7x its time with one thread)
    if threads == "auto":
        return 1 if not str(device).startswith("cuda") and is_tiny(model) else None
    return threads


def _batch_slots(slots: int | str | None, device: str, decoding: str) -> int | None:
    # 'auto' is None everywhere: on the H200 (BENCHMARKS.md section 5) the batched path gave the
    # same first audio as per-call graphs at 2-8 calls (calls rarely step together) and set aside
    # 3.7 GB; its slots then prefilled eagerly (now staged through a captured bucket, lm_batch), and
    # calls ending at once (the worst case) have not been measured on it yet.
    return None if slots == "auto" else slots


def _step_batches(model, slots: int | None, decoding: str):
    """(LMStepBatch, SpeechStepBatch) shared by all calls, or (None, None)."""
    from taste_speech.lm_batch import LMStepBatch
    from taste_speech.speech_decoder_batch import SpeechStepBatch
    from taste_speech.streaming.conversation import REPLY_ROWS

    if slots is None:
        return None, None
    capacity = GenerationSettings.history_max_tokens + REPLY_ROWS  # a call with a longer window leaves the batch
    graph_mode = "eager" if decoding == "eager" else "auto"
    return (LMStepBatch(model.spoken_lm, slots=slots, capacity=capacity, graph_mode=graph_mode),
            SpeechStepBatch(model.speech_decoder, slots=slots, graph_mode=graph_mode))


def _tower_encoder(model, decoding: str, slots: int | None):
    """The audio tower's Whisper encoder as one captured step shared by the calls, the turns of up
    to ``slots`` calls (``CUDA_SYNTHESIS_ROWS`` without slots) in one pass (CUDA fast path only:
    elsewhere there is nothing to capture, and a pass costs its rows)."""
    from taste_speech.encoder_graph import EncoderGraph

    if decoding == "eager" or model.audio_tower.encoder.conv1.weight.device.type != "cuda":
        return None
    return EncoderGraph(model.audio_tower, rows=slots or CUDA_SYNTHESIS_ROWS)


def _tower_pooler(model, decoding: str):
    """The audio tower's text side (attention pooler, word means, RVQ search) as one captured step
    per transcript-length bucket, shared by the calls (CUDA fast path only: on a CPU its few hundred
    operators cost their arithmetic, not their launches, and padding would add to it)."""
    from taste_speech.pooler_graph import PoolerGraph

    if decoding == "eager" or model.audio_tower.decoder.embed_tokens.weight.device.type != "cuda":
        return None
    return PoolerGraph(model.audio_tower)


# Calls whose waiting flow or vocoder windows share one step on a GPU, without batch slots (and
# whose ended turns share one pass of the audio tower's encoder): a step costs its launches, not
# its rows (GPU_NOTES.md: the flow estimator 1.87 ms for one window, 2.22 ms for eight), so calls
# whose first chunks queue behind a running step go in the next one together instead of one after
# another, and a first chunk (a turn) waits a little for the others announced. A single call never
# waits for others.
CUDA_SYNTHESIS_ROWS = 8


def _synthesis_graphs(voice_generator, slots: int | None, cache_kind: str, compile_flow: bool = False):
    """The calls' shared flow and vocoder steps on the static synthesis path, batching the windows
    of up to ``slots`` calls (``CUDA_SYNTHESIS_ROWS`` on CUDA without slots); None: the voice
    generator's own (one window per step: a CPU's static path, where a step costs its rows) or eager.
    ``compile_flow``: their flow steps run the estimator compiled (CUDA: ``_check_device_options``)."""
    from taste_speech.streaming.synthesis_graphs import SynthesisGraphs, resolve_kind

    device = next(voice_generator.parameters()).device
    if resolve_kind(cache_kind, device) != "static":
        return None
    if slots is None:
        if device.type != "cuda":
            return None
        slots = CUDA_SYNTHESIS_ROWS
    return SynthesisGraphs(voice_generator, rows=slots, compile_flow=compile_flow)


# Which CUDA streams the engine's work goes to. On one stream a call's host syncs - every token's
# sampling reads its logits - wait for all the kernels queued before them, other calls' flow steps
# included (70-90 ms each on the H100, BENCHMARKS.md section 5: the slowest of 8 calls waited 639 ms).
#   default    every thread's work on its current stream: the device's default stream
#   synthesis  every call's flow and vocoder work on one stream of its own, beside the decoding (one
#              for all calls, not one per call: their shared synthesis steps - ``SynthesisGraphs``,
#              one graph memory pool - must stay in order); a decoding sync waits for decoding only
#   calls      that, and each call's other work (ASR, audio tower, spoken LM, speech decoder) on a
#              stream of the call's own: one call's syncs wait for its own work only, and the GPU
#              runs the calls' small kernels side by side
#   auto       synthesis on the CUDA fast path (static caches, graphs), default elsewhere
# Measured on the H100 (``python -m benchmarks.gpu_suite``; BENCHMARKS.md section 5): a whole reply as
# the agent runs it took 0.096 s per audio second with the synthesis stream against 0.106 on one
# stream, its first audio 197 against 214 ms (the H200: 0.094 / 0.106, 207 / 218 ms); eight calls
# ending at once got their first audio in at most 1348 ms (default), 1127 ms (synthesis), 1077 ms
# (calls), one call alone in that table 159, 244 and 183 ms (an earlier run, before the calls shared
# their first-audio work).
STREAMS = ("auto", "default", "synthesis", "calls")


def _resolve_streams(streams: str, device, cache_kind: str) -> str:
    """'auto' made one of the others for the engine's device and decoding."""
    from taste_speech.streaming.synthesis_graphs import resolve_kind

    if streams != "auto":
        return streams
    cuda = str(device).startswith("cuda")
    return "synthesis" if cuda and resolve_kind(cache_kind, device) == "static" else "default"


def _check_device_options(streams: str, compile_flow: bool, device) -> None:
    """The options that only CUDA has, against the engine's (resolved) device."""
    cuda = str(device).startswith("cuda")
    if streams not in ("auto", "default") and not cuda:
        raise ValueError(f"streams={streams!r} needs a CUDA device (streams are CUDA's), not {device}: "
                         "use streams='auto' or 'default' there")
    if compile_flow and not cuda:  # (a CPU takes the eager synthesis path: nothing there to compile)
        raise ValueError(f"compile_flow=True needs a CUDA device (it compiles the captured flow steps of the "
                         f"static synthesis path), not {device}: leave it off there")


def _new_stream(device, other_than=None):
    """A stream of torch's pool (non-blocking: no implicit waits on the legacy default stream).
    The pool is small and handed out round-robin, so streams repeat: ``other_than`` is skipped
    (a call sharing the synthesis stream would be correct, only slower). The capture stream is
    never among them (``step_graph``: another priority)."""
    import torch

    while True:
        stream = torch.cuda.Stream(torch.device(device), priority=0)
        if other_than is None or stream.cuda_stream != other_than.cuda_stream:
            return stream


def on_stream(stream):
    """A context with ``stream`` current in this thread (the current stream is per thread), or
    nothing changed for None."""
    if stream is None:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(stream)


def prepare_stage_thread(stream=None, threads: int | None = None) -> None:
    """A call's stage worker thread, before its first job (``TasteCall.executor``): ``stream`` its
    current CUDA stream for good (``use_stream``), and ``threads`` torch's intra-op threads
    (the engine's ``threads_per_job``; None: as they are)."""
    if threads is not None:
        import torch

        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
    use_stream(stream)


def use_stream(stream) -> None:
    """Make ``stream`` this thread's current stream for good (a call's own worker threads); None:
    nothing changes."""
    if stream is not None:
        import torch

        torch.cuda.set_stream(stream)


def _speech_policy(graphs):
    """'low_latency' with the flow windows of the bucketed path on every decoding path (widened to
    the sizes with an unpadded step), so that an engine speaks the same audio whichever path it
    takes: the eager engine reproduces the graphed one (on a CPU the wider windows cost up to 1.1x
    the synthesis time, BENCHMARKS.md section 10; the tiny main job's first audio did not move)."""
    from taste_speech.streaming.synthesis_graphs import FULL_FLOW_WINDOWS
    from taste_speech.streaming.synthesis_state import EmissionPolicy

    sizes = graphs.full_flow_frames if graphs is not None else FULL_FLOW_WINDOWS
    return EmissionPolicy.low_latency(window_frames=sizes)


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
                "TranscriptionFrames) or load one (TasteEngine.from_pretrained(..., asr='openai/whisper-large-v3'))"
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
                    yield ReplyEvent("end", reason=reason)
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
        if total == 0 or played_words is None or played_words >= total:
            return total
        with self._job(when_closed="skip") as open_:  # the call may end meanwhile: close() waits for this
            if not open_ or self.conversation.closed:
                return total
            kept = self.conversation.truncate_last_assistant(max(0, int(played_words)))
        return 0 if kept is None else int(kept.word_starts().sum())

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


def checkpoint_label(name_or_path: str | None) -> str:
    return "embedded tiny checkpoint" if name_or_path is None else os.fspath(name_or_path)
