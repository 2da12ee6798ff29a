"""TasteForCausalLM: the whole TASTE model, loadable from the published checkpoint.

Three parts with the published state-dict prefixes: ``audio_tower`` (audio + transcript -> TASTE
codes), ``spoken_lm`` (joint text + TASTE Llama) and ``speech_decoder`` (text + TASTE + speaker ->
speech tokens). The voice generator (flow + HiFT) ships as a separate file and lives in
``taste_speech.voice_generator``.

``from_pretrained`` takes a local directory or a hub id, builds the model on the meta device (no
time spent on random init), compares the checkpoint's names and shapes with it before reading any
tensor data, then fills every slot with the checkpoint tensor cast to the dtype that part runs in.
It accepts single or sharded safetensors and plain ``.bin`` state dicts (``weights_only=True``),
every LoRA key spelling of spec §10.2, ties the LM head to the input embedding when the file drops
it, checks that the RVQ codebooks are initialised, and refuses anything else by name.

Run dtypes (``torch_dtype``):

* ``None`` / ``"auto"``: the published layout on CUDA - the Whisper tower and the Llama base
  weights in bfloat16, LoRA adapters, bridges, RVQ and speech decoder in float32 - and float32
  everywhere on CPU;
* ``torch.float32``: everything float32 (parity tests and the golden sets need this);
* ``torch.bfloat16`` / ``torch.float16``: the published mixed layout with that half type, on any
  device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PreTrainedModel

from taste_speech.configuration_taste import TasteConfig, resolve_joint_whisper_config
from taste_speech.loading import (
    LM_HEAD_KEY,
    CheckpointError,
    CheckpointReader,
    KeyMatch,
    canonical_key,
    match_keys,
    resolve_checkpoint_dir,
)
from taste_speech.modeling_audio_tower import TasteAudioTower
from taste_speech.modeling_speech_decoder import TasteSpeechDecoder
from taste_speech.modeling_spoken_lm import TasteSpokenLM

logger = logging.getLogger(__name__)

# Parts that the published model runs in a half dtype (their weights are stored in bfloat16).
HALF_PRECISION_PREFIXES = ("audio_tower.audio_joint_encoder_segmenter.", "spoken_lm.language_model.")
_HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "force_download", "proxies", "subfolder")
_IGNORED_KWARGS = ("trust_remote_code", "adapter_kwargs", "attn_implementation", "low_cpu_mem_usage",
                   "use_safetensors")

__all__ = [
    "TastePreTrainedModel", "TasteForCausalLM", "TasteCompletion", "LoadingInfo", "CheckpointError", "run_dtype_for_key",
]


def run_dtype_for_key(key: str, half_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a float tensor runs in: ``half_dtype`` for the Whisper tower and the Llama base
    weights (not its LoRA adapters) when given, float32 for everything else."""
    if half_dtype is not None and key.startswith(HALF_PRECISION_PREFIXES) and ".lora_" not in key:
        return half_dtype
    return torch.float32


def set_spoken_lm_run_dtypes(spoken_lm, half_dtype: torch.dtype | None):
    """The spoken LM alone (benchmarks, parity checks) in the layout ``set_run_dtypes`` gives the
    whole model: the Llama base in ``half_dtype``, its LoRA adapters and the heads in float32."""
    with torch.no_grad():
        for name, param in spoken_lm.named_parameters():
            if param.is_floating_point():
                param.data = param.data.to(run_dtype_for_key(f"spoken_lm.{name}", half_dtype))
    spoken_lm.tie_lm_head()
    return spoken_lm


def resolve_run_dtypes(torch_dtype, device: torch.device) -> torch.dtype | None:
    """The half dtype of the mixed layout, or None for float32 everywhere."""
    if isinstance(torch_dtype, str):
        if torch_dtype == "auto":
            torch_dtype = None
        else:
            try:
                torch_dtype = getattr(torch, torch_dtype)
            except AttributeError:
                raise ValueError(f"unknown torch_dtype {torch_dtype!r}: use 'auto', 'float32' or 'bfloat16'") from None
    if torch_dtype is None:
        return torch.bfloat16 if device.type == "cuda" else None
    if torch_dtype == torch.float32:
        return None
    if torch_dtype in (torch.bfloat16, torch.float16):
        return torch_dtype
    raise ValueError(f"torch_dtype {torch_dtype} is not supported: use None ('auto'), torch.float32, "
                     "torch.bfloat16 or torch.float16")


def resolve_device(device) -> torch.device:
    """None -> CPU, ``"auto"`` -> CUDA when available, else the device asked for. An explicit CUDA
    device that this machine cannot provide fails here, by name, before anything is loaded (torch
    would only fail later, with "Torch not compiled with CUDA enabled")."""
    if device is None:
        return torch.device("cpu")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        device = f"cuda:{device}"  # torch's accelerator N: on the machines we serve, a CUDA GPU
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is not a torch device: use 'cpu', 'cuda', 'cuda:N' or 'auto'") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch build has no CUDA support" if torch.version.cuda is None
                   else "torch finds no CUDA GPU or driver")
            raise RuntimeError(f"device={str(device)!r} was requested but CUDA is not available ({why}; torch "
                               f"{torch.__version__}). Use device='cpu', or device='auto' (CUDA when available), "
                               "or install a CUDA build of torch on a machine with an NVIDIA GPU.")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise RuntimeError(f"device={str(device)!r} was requested but this machine has "
                               f"{torch.cuda.device_count()} CUDA device(s); use device='cuda' (the first one)")
    return device


@dataclass
class LoadingInfo:
    """What ``from_pretrained`` found (``model.loading_info``)."""

    directory: str
    files: list[str]
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    mismatched_keys: list[str] = field(default_factory=list)
    tied_lm_head: bool = False
    merged_lora: bool = False
    spelling: str = "canonical"


@dataclass
class TasteCompletion:
    """Result of ``TasteForCausalLM.inference_completion`` (batch 1)."""

    text: str  # the generated words, each with its leading space
    generated_llm_token_ids: torch.Tensor  # (1, G)
    generated_llm_word_ids: torch.Tensor  # (1, G) int32
    taste_codes: torch.Tensor  # (1, W, K): one code row per synthesised word
    asr_token_ids: torch.Tensor  # (1, L) Whisper-space ids of the synthesised words
    asr_word_ids: torch.Tensor  # (1, L)
    speech_token_ids: torch.Tensor  # (1, S) int32, 50 Hz speech tokens
    text_end_reason: str  # 'sentence_end' | 'max_words' | 'stop_id' | 'max_steps'
    speech_stop_reason: str  # 'eos' | 'max_len'


def _vocabulary_tables(processor, vocab_size: int):
    """The sampler's vocabulary tables for the processor's Llama tokenizer, built once per processor
    (decoding every id takes seconds for the 128 256-id vocabulary)."""
    from taste_speech.sampler import VocabularyTables

    tables = getattr(processor, "_taste_vocabulary_tables", None)
    if tables is None or tables.word_start.numel() != vocab_size:
        tables = VocabularyTables.from_tokenizer(processor.llm_tokenizer, vocab_size)
        processor._taste_vocabulary_tables = tables
    return tables


class TastePreTrainedModel(PreTrainedModel):
    config_class = TasteConfig
    base_model_prefix = ""
    supports_gradient_checkpointing = False
    _no_split_modules = []

    def _init_weights(self, module):  # weights always come from a checkpoint or the tiny builder
        pass


class TasteForCausalLM(TastePreTrainedModel):
    def __init__(self, config: TasteConfig):
        super().__init__(config)
        self.audio_tower = TasteAudioTower(config)
        self.spoken_lm = TasteSpokenLM(config)
        self.speech_decoder = TasteSpeechDecoder(config)
        self.post_init()
        self.loading_info: LoadingInfo | None = None

    @property
    def rvq(self):
        """The residual VQ shared by all three parts (owned by the audio tower)."""
        return self.audio_tower.vq.rvq

    def tie_weights(self, *args, **kwargs):
        self.spoken_lm.tie_lm_head()

    # -- the model-level API ----------------------------------------------------------------------
    @torch.no_grad()
    def extract_vq(self, audio_features, asr_token_ids, asr_word_ids, llm_word_ids, encoder=None, pooler=None,
                   **unused):
        """TASTE codes of one turn (batch 1): ``(asr_indices (1, L, K), llm_indices (1, N, K))``.

        ``llm_indices`` carries each word's code on its first Llama token and -1 elsewhere (what the
        spoken LM's prompt takes). Extra processor outputs (lengths, llm_token_ids, ...) are accepted
        and ignored, so ``model.extract_vq(**processor_outputs)`` works. ``encoder``: an
        ``EncoderGraph`` of the audio tower (``taste_speech.encoder_graph``), or None (eager);
        ``pooler``: a ``PoolerGraph`` of it for the text side (``taste_speech.pooler_graph``), or None."""
        return self.audio_tower.extract_vq(audio_features, asr_token_ids, asr_word_ids, llm_word_ids, encoder, pooler)

    @torch.no_grad()
    def inference_completion(self, processor, llm_token_ids=None, llm_word_ids=None, asr_token_ids=None,
                             asr_word_ids=None, audio_features=None, speaker_embeds=None, *,
                             conditional_mode: str = "audio", extra_words: int = 8, text_top_p: float = 0.3,
                             taste_top_p: float = 0.0, text_temperature: float = 0.5,
                             repetition_penalty: float = 1.1, out_generated_part_only: bool = False,
                             generator: torch.Generator | None = None, speech_sampler=None,
                             max_steps: int | None = 4096, **unused) -> "TasteCompletion":
        """Continue an utterance, end to end up to speech tokens (the original's
        ``inference_completion``, spec §1.2 / §5.4), for batch 1.

        ``conditional_mode``: ``'audio'`` (the prompt's audio and transcript - take the inputs from
        ``processor(audio, sr, text=...)``), ``'text'`` (transcript ids only, no audio) or
        ``'zero'`` (no prompt). Text decoding uses the TasteSampler with the given settings (README
        defaults; ``text_top_p=0`` is greedy); the generated words are re-tokenised for the speech
        decoder by ``processor.align_llm_ids``. With ``out_generated_part_only=False`` (audio mode)
        the speech tokens re-synthesise prompt + continuation, as the original does.
        ``speaker_embeds`` (1, spk_dim) defaults to ``processor.default_speaker_embedding()``;
        ``speech_sampler`` defaults to the original top-k 25 sampling (seeded by ``generator``).
        Synthesise audio from ``speech_token_ids`` with ``taste_speech.voice_generator.VoiceGenerator``."""
        from taste_speech.modeling_speech_decoder import TopKSampler
        from taste_speech.sampler import SamplingParams, TasteSampler

        if conditional_mode not in ("audio", "text", "zero"):
            raise ValueError(f"conditional_mode must be 'audio', 'text' or 'zero', got {conditional_mode!r}")
        llm_indices = None
        if conditional_mode == "audio":
            if audio_features is None:
                raise ValueError("conditional_mode 'audio' needs audio_features (use processor(audio, sr, text=...))")
            _, llm_indices = self.extract_vq(audio_features, asr_token_ids, asr_word_ids, llm_word_ids)
        params = SamplingParams(text_top_p, taste_top_p, text_temperature, repetition_penalty, extra_words)
        sampler = TasteSampler(_vocabulary_tables(processor, self.config.text_config.vocab_size), params)
        generation = self.spoken_lm.generate(
            self.rvq, sampler, conditional_mode, llm_token_ids=llm_token_ids, llm_indices=llm_indices,
            llm_word_ids=llm_word_ids, extra_words=extra_words, max_steps=max_steps, generator=generator,
        )
        if generation.token_ids.shape[1] == 0:
            raise ValueError("the spoken LM generated no text (it terminated at once); nothing to synthesise")
        new = processor.align_llm_ids(generation.token_ids, generation.word_ids)
        codes = generation.word_codes()
        if codes.shape[0] != len(new.words):
            raise ValueError(f"generation produced {codes.shape[0]} TASTE codes for {len(new.words)} words")
        asr_ids, asr_wids = new.asr_token_ids, new.asr_word_ids
        if conditional_mode == "audio" and not out_generated_part_only:
            prompt_codes = llm_indices[0][(llm_indices[0] >= 0).all(-1)]
            codes = torch.cat([prompt_codes, codes.to(prompt_codes.device)], dim=0)
            asr_ids = torch.cat([asr_token_ids.long(), asr_ids.to(asr_token_ids.device)], dim=1)
            asr_wids = torch.cat([asr_word_ids.int(), (asr_wids + len(prompt_codes)).int().to(asr_word_ids.device)],
                                 dim=1)
        if speaker_embeds is None:
            speaker_embeds = processor.default_speaker_embedding()
        device = self.rvq.project_out.weight.device
        speech = self.speech_decoder.generate_from_taste(
            self.rvq, speaker_embeds.to(device), codes.unsqueeze(0).to(device), asr_ids.to(device),
            asr_wids.to(device), sampler=speech_sampler or TopKSampler(generator=generator),
        )
        return TasteCompletion(
            text="".join(new.words), generated_llm_token_ids=generation.token_ids,
            generated_llm_word_ids=generation.word_ids, taste_codes=codes.unsqueeze(0), asr_token_ids=asr_ids,
            asr_word_ids=asr_wids, speech_token_ids=speech.speech_token_ids, text_end_reason=generation.end_reason,
            speech_stop_reason=speech.stop_reason,
        )

    # -- loading ----------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, torch_dtype=None, device=None, *, strict: bool = True,
                        output_loading_info: bool = False, config: TasteConfig | None = None, **kwargs):
        """Load a TASTE checkpoint from a local directory or a hub id.

        ``torch_dtype``: see the module docstring (None = published layout on CUDA, float32 on CPU).
        ``device``: where the weights go (default CPU; ``"auto"`` = CUDA when available).
        ``strict=False`` loads despite missing/unexpected/mis-shaped tensors (missing ones become
        zeros) - ``model.loading_info`` lists them; ``output_loading_info=True`` returns
        ``(model, loading_info)``. Raises ``CheckpointError`` (a ValueError) naming every bad tensor.

        Returns the model in eval mode with ``requires_grad=False`` weights. On the CPU, tensors
        stored in their run dtype stay memory-mapped from the safetensors files (no copy, fast
        loading): replace checkpoint files rather than rewriting them in place while a model uses them.
        """
        torch_dtype = kwargs.pop("dtype", torch_dtype)  # transformers >= 5 spelling
        device_map = kwargs.pop("device_map", None)
        if device_map is not None and not isinstance(device_map, (str, torch.device)):
            raise ValueError(f"device_map={device_map!r}: the model loads onto one device; pass device='cuda' "
                             "(or device_map='cuda')")
        if device is None and device_map is not None:
            device = device_map
        hub = {k: kwargs.pop(k) for k in _HUB_KWARGS if k in kwargs}
        # transformers' loading options that have no meaning here (the attention implementation is
        # the model's own; loading is always memory-mapped and safetensors-first): accepted, ignored
        for key in [k for k in kwargs if k.startswith("_") or k in _IGNORED_KWARGS]:
            logger.debug("TasteForCausalLM.from_pretrained ignores %s=%r", key, kwargs.pop(key))
        if kwargs:
            raise TypeError(f"TasteForCausalLM.from_pretrained got unsupported arguments: {sorted(kwargs)}")
        if hub.get("subfolder"):
            raise ValueError("subfolder is not supported: pass the checkpoint directory itself")
        device = resolve_device(device)  # before any download or loading: an unusable device fails first
        directory = resolve_checkpoint_dir(pretrained_model_name_or_path, revision=hub.get("revision"),
                                           cache_dir=hub.get("cache_dir"), token=hub.get("token"),
                                           local_files_only=hub.get("local_files_only"),
                                           force_download=bool(hub.get("force_download")), proxies=hub.get("proxies"))
        if config is None:
            config = TasteConfig.from_pretrained(directory)
        elif config._joint_whisper_config is None:  # e.g. from AutoConfig: resolve whisper_joint here
            config.joint_whisper_config = resolve_joint_whisper_config(config, base_dir=directory)
        half_dtype = resolve_run_dtypes(torch_dtype, device)

        with torch.device("meta"):
            model = cls(config)
        reader = CheckpointReader(directory)
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        match = match_keys({k: info.shape for k, info in reader.infos.items()}, expected)
        if strict and not match.ok:
            raise CheckpointError(match.describe(directory))
        model._fill_from_checkpoint(reader, match, half_dtype, device)
        model.loading_info = LoadingInfo(
            directory=directory, files=reader.files, missing_keys=match.missing, unexpected_keys=match.unexpected,
            mismatched_keys=match.mismatched, tied_lm_head=match.tied_lm_head, merged_lora=match.merged_lora,
            spelling=match.spelling,
        )
        if not match.ok:
            logger.warning(match.describe(directory))
        model.eval()
        return (model, model.loading_info) if output_loading_info else model

    @torch.no_grad()
    def _fill_from_checkpoint(self, reader: CheckpointReader, match: KeyMatch, half_dtype, device) -> None:
        """Replace every meta tensor by its checkpoint tensor (cast to its run dtype, on ``device``)."""
        slots = self.state_dict()
        filled = set()
        stored_to_model = {stored: key for key, stored in match.sources.items()}
        bad_shape = {m.split(":")[0] for m in match.mismatched}
        names = [s for s, k in stored_to_model.items() if k not in bad_shape]
        for stored, value in reader.iter_tensors(names):
            key = stored_to_model[stored]
            _assign(self, key, _to_run(value, key, half_dtype, device))
            filled.add(key)
        head_key = self._lm_head_key()
        for key, slot in slots.items():  # zero adapters of a merged checkpoint; zeros for strict=False gaps
            if key in filled or key == head_key:
                continue
            dtype = run_dtype_for_key(key, half_dtype) if slot.is_floating_point() else slot.dtype
            _assign(self, key, torch.zeros(slot.shape, dtype=dtype, device=device))
        self._settle_lm_head(filled, device, half_dtype)
        _rebuild_non_persistent(self, device)
        self.spoken_lm.round_rope_frequencies()
        self.rvq.check_initialised()

    def _lm_head_key(self) -> str:
        """The head's state-dict key: its peft spelling with LoRA, the plain one without."""
        lora_model = any(".lora_A." in name for name, _ in self.named_parameters())
        return canonical_key(LM_HEAD_KEY, lora_model)

    def _settle_lm_head(self, filled: set, device, half_dtype) -> None:
        """Tie the head to the embedding unless the checkpoint stores a different head."""
        lm = self.spoken_lm
        if self._lm_head_key() in filled:
            head = lm.causal_lm.lm_head.weight
            if head.shape == lm.embed_tokens.weight.shape and torch.equal(head, lm.embed_tokens.weight):
                lm.tie_lm_head()  # a stored duplicate: share one tensor
            else:
                logger.warning("the checkpoint stores an lm_head that differs from embed_tokens; keeping it untied")
        else:
            lm.tie_lm_head()

    def set_run_dtypes(self, torch_dtype=None, device=None) -> "TasteForCausalLM":
        """Re-cast a loaded model to another run-dtype layout (see the module docstring)."""
        device = resolve_device(device) if device is not None else self.rvq.project_in.weight.device
        half_dtype = resolve_run_dtypes(torch_dtype, device)
        with torch.no_grad():
            for key, param in list(self.named_parameters()):
                if param.is_floating_point():
                    _assign(self, key, param.data.to(device=device, dtype=run_dtype_for_key(key, half_dtype)))
        self.to(device)
        self.spoken_lm.tie_lm_head()
        return self

    # -- saving -----------------------------------------------------------------------------------
    def save_pretrained(self, save_directory, max_shard_size: int | None = None, push_to_hub: bool = False,
                        **unused) -> None:
        """Write the published layout: ``config.json`` (plus ``whisper_joint/config.json`` when the
        tower's Whisper is not distil-large-v3) and safetensors weights without the tied lm_head,
        sharded with an index when ``max_shard_size`` (bytes) is given."""
        from taste_speech.loading import write_safetensors_checkpoint

        self.config.architectures = [type(self).__name__]
        self.config.save_pretrained(save_directory, push_to_hub=push_to_hub)
        state = self.state_dict()
        lm = self.spoken_lm
        if lm.causal_lm.lm_head.weight is lm.embed_tokens.weight:
            state.pop(self._lm_head_key(), None)
        write_safetensors_checkpoint(state, save_directory, max_shard_size)


def _to_run(value: torch.Tensor, key: str, half_dtype, device) -> torch.Tensor:
    dtype = run_dtype_for_key(key, half_dtype) if value.is_floating_point() else value.dtype
    return value.to(device=device, dtype=dtype)


def _assign(model: torch.nn.Module, key: str, value: torch.Tensor) -> None:
    """Put ``value`` in the parameter or buffer slot ``key`` (replacing a meta tensor)."""
    module_path, _, name = key.rpartition(".")
    module = model.get_submodule(module_path)
    if name in module._parameters:
        module._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
    elif name in module._buffers:
        module._buffers[name] = value
    else:
        raise KeyError(f"{key} is neither a parameter nor a buffer of the model")


def _rebuild_non_persistent(model: torch.nn.Module, device) -> None:
    """Modules whose buffers are not in checkpoints (RoPE tables) are rebuilt on ``device``."""
    for path, module in list(model.named_modules()):
        if not any(b.device.type == "meta" for b in module.buffers(recurse=False)):
            continue
        if not hasattr(module, "rope_type"):
            raise CheckpointError(f"cannot rebuild the non-persistent buffers of {path}")
        parent_path, _, child = path.rpartition(".")
        with torch.device(device):
            setattr(model.get_submodule(parent_path), child, type(module)(module.config))
    leftovers = [k for k, v in model.state_dict().items() if v.device.type == "meta"]
    if leftovers:
        raise CheckpointError(f"tensors left unloaded: {', '.join(leftovers)}")


AutoConfig.register("taste", TasteConfig, exist_ok=True)
AutoModel.register(TasteConfig, TasteForCausalLM, exist_ok=True)
AutoModelForCausalLM.register(TasteConfig, TasteForCausalLM, exist_ok=True)
