"""TasteEngine: the model, its processor and voice generator, loaded once and shared by every call,
with what the calls share on the fast path (static caches, captured steps, CUDA streams).

Each call talks to the model through its own :class:`~pipecat_taste.session.TasteSession`
(``engine.new_session()``).
"""

from __future__ import annotations

import logging
import os

import numpy as np

from pipecat_taste.session import INPUT_SAMPLE_RATE, GenerationSettings, TasteSession
from pipecat_taste.start_hold import StartNeeds
from pipecat_taste.streams import STREAMS, new_stream, on_stream, resolve_streams

logger = logging.getLogger(__name__)


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
        self.streams = resolve_streams(streams, next(voice_generator.parameters()).device, self.cache_kind)
        self.synthesis_stream = (new_stream(next(voice_generator.parameters()).device)
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
        return new_stream(self.synthesis_stream.device, other_than=self.synthesis_stream)

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
# its rows (our H100 notes, docs/GPU.md: the flow estimator 1.87 ms for one window, 2.22 ms for eight), so calls
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


def _check_device_options(streams: str, compile_flow: bool, device) -> None:
    """The options that only CUDA has, against the engine's (resolved) device."""
    cuda = str(device).startswith("cuda")
    if streams not in ("auto", "default") and not cuda:
        raise ValueError(f"streams={streams!r} needs a CUDA device (streams are CUDA's), not {device}: "
                         "use streams='auto' or 'default' there")
    if compile_flow and not cuda:  # (a CPU takes the eager synthesis path: nothing there to compile)
        raise ValueError(f"compile_flow=True needs a CUDA device (it compiles the captured flow steps of the "
                         f"static synthesis path), not {device}: leave it off there")


def _speech_policy(graphs):
    """'low_latency' with the flow windows of the bucketed path on every decoding path (widened to
    the sizes with an unpadded step), so that an engine speaks the same audio whichever path it
    takes: the eager engine reproduces the graphed one (on a CPU the wider windows cost up to 1.1x
    the synthesis time, BENCHMARKS.md section 10; the tiny main job's first audio did not move)."""
    from taste_speech.streaming.synthesis_graphs import FULL_FLOW_WINDOWS
    from taste_speech.streaming.synthesis_state import EmissionPolicy

    sizes = graphs.full_flow_frames if graphs is not None else FULL_FLOW_WINDOWS
    return EmissionPolicy.low_latency(window_frames=sizes)
