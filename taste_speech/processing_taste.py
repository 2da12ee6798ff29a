"""TasteProcessor: waveforms and text in, the model's inputs out (spec §2).

* audio (§2.1, §2.3): any rate (resampled with soxr), channels averaged, int or float samples ->
  Whisper 128-bin log-mel over the audio tower's window (3000 frames = 30 s for the published
  model; ``2 * max_source_positions`` frames in general), see ``taste_speech.audio``;
* text (§2.2): every whitespace character becomes a space, the text is stripped and split on
  EVERY single space, and each piece gets a leading space (the first word too). So two spaces in
  a row give a word that is a lone space (upstream behaviour, §11.29, kept: the model was trained
  on it). Each word is encoded on its own, without special tokens, by the Llama tokenizer and the
  ASR (Whisper) tokenizer -> ids and 0-based word ids for both streams;
* speaker (§2.4): 80-bin Kaldi fbank of each 16 kHz reference clip (float samples, no int16
  scaling), mean-normalised over time, through the published CAMPPlus ONNX model; the clip
  vectors are averaged and L2-normalised -> (1, 192);
* ASR (§2.5, optional): when no transcript is given, a transformers Whisper pipeline transcribes
  the audio (built on first use, from any local Whisper model folder or hub id).

``from_pretrained`` reads the published layout: ``llama_tokenizer/``; the ASR tokenizer from
``asr_tokenizer/`` inside the checkpoint when present (tiny checkpoints ship one), otherwise the
model named by ``asr_config`` (openai/whisper-large-v3 for the published checkpoint);
``cosyvoice/speaker_embed.onnx`` (optional) and ``cosyvoice/voice_generator.pth`` (its path is
exposed for the voice generator). The S3 speech tokenizer the original also loads is not needed
for inference (§2.6) and is not read.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from taste_speech.audio import (
    HOP_LENGTH,
    N_MELS,
    SAMPLE_RATE,
    kaldi_fbank,
    mean_normalise,
    resample,
    to_mono_float,
    whisper_log_mel,
)

LLAMA_TOKENIZER_DIR = "llama_tokenizer"
ASR_TOKENIZER_DIR = "asr_tokenizer"
COSYVOICE_DIR = "cosyvoice"
SPEAKER_MODEL_FILE = "speaker_embed.onnx"
VOICE_GENERATOR_FILE = "voice_generator.pth"
DEFAULT_SPEAKER_FILE = "default_speaker.npy"
DEFAULT_VOICE_WAV = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_voice.wav")
PUBLISHED_ASR_MODEL = "openai/whisper-large-v3"
WHISPER_PROMPT_TOKENS = 5  # <|startoftranscript|><|en|><|transcribe|><|notimestamps|> ... <|endoftext|>
MIN_AUDIO_SECONDS = 0.1  # shorter than any spoken word: a truncated buffer or a wrong sampling_rate
MIN_SAMPLE_RATE = 4000  # below telephone band (8 kHz): not the rate of a speech recording
SILENCE_PEAK = 1e-4  # audio whose loudest sample is below this (-80 dBFS) holds no speech
# A voice reference this short gives an x-vector of a few syllables: a voice unlike the speaker's.
MIN_REFERENCE_SECONDS, SHORT_REFERENCE_SECONDS = 0.5, 2.0

logger = logging.getLogger(__name__)

# What the processor needs from a hub repository (never the multi-GB model weights).
_PROCESSOR_FILES = [
    "config.json",
    f"{LLAMA_TOKENIZER_DIR}/*",
    f"{ASR_TOKENIZER_DIR}/*",
    f"{COSYVOICE_DIR}/{SPEAKER_MODEL_FILE}",
    f"{COSYVOICE_DIR}/{VOICE_GENERATOR_FILE}",
    f"{COSYVOICE_DIR}/*.json",
    f"{COSYVOICE_DIR}/*.npy",
    "whisper_joint/*",
]


@dataclass(eq=False)
class TextInputs(Mapping):
    """Both token streams of a transcript (batch 1). Reads like the original's dict:
    ``model.extract_vq(**text_inputs, ...)`` or ``text_inputs["llm_token_ids"]``."""

    words: list[str]
    llm_token_ids: torch.Tensor  # (1, N) int64
    llm_word_ids: torch.Tensor  # (1, N) int32
    asr_token_ids: torch.Tensor  # (1, L) int64
    asr_word_ids: torch.Tensor  # (1, L) int32
    _keys: ClassVar[tuple[str, ...]] = (
        "asr_token_ids", "asr_token_lengths", "asr_word_ids",
        "llm_token_ids", "llm_token_lengths", "llm_word_ids",
    )

    @property
    def llm_token_lengths(self) -> torch.Tensor:  # (1,) int32
        return torch.tensor([self.llm_token_ids.shape[1]], dtype=torch.int32)

    @property
    def asr_token_lengths(self) -> torch.Tensor:  # (1,) int32
        return torch.tensor([self.asr_token_ids.shape[1]], dtype=torch.int32)

    @property
    def text(self) -> str:
        return "".join(self.words)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class TasteProcessor:
    def __init__(
        self,
        llm_tokenizer,
        asr_tokenizer,
        num_frames: int = 3000,
        n_mels: int = N_MELS,
        speaker_model_path: str | None = None,
        voice_generator_path: str | None = None,
        default_speaker_path: str | None = None,
        asr_model: str | None = None,
        max_asr_tokens: int | None = None,
    ):
        """``num_frames``: the audio tower's window in mel frames (2 * Whisper
        max_source_positions); ``max_asr_tokens``: transcript tokens the tower's Whisper decoder
        can take (max_target_positions - 5), checked when audio and text go in together;
        ``asr_model``: Whisper model folder or hub id used when no transcript is given."""
        if num_frames <= 0 or n_mels <= 0:
            raise ValueError(f"num_frames and n_mels must be positive, got {num_frames} and {n_mels}")
        self.llm_tokenizer = llm_tokenizer
        self.asr_tokenizer = asr_tokenizer
        self.num_frames = int(num_frames)
        self.n_mels = int(n_mels)
        self.max_samples = self.num_frames * HOP_LENGTH
        self.speaker_model_path = speaker_model_path
        self.voice_generator_path = voice_generator_path
        self.default_speaker_path = default_speaker_path
        self.asr_model = asr_model
        self.max_asr_tokens = max_asr_tokens
        self._speaker_session = None
        self._default_voice: torch.Tensor | None = None  # made on first use (it may run the speaker encoder)
        self._asr_pipeline = None
        self._voice_generator = None  # loaded on first use (get_generator)
        self._llm_special_ids: set[int] | None = None

    @classmethod
    def from_pretrained(
        cls, name_or_path, asr_model: str | None = None, asr_tokenizer=None, **hub_kwargs
    ) -> "TasteProcessor":
        """Load from a checkpoint folder or a hub id (only the processor's files are fetched).

        ``asr_tokenizer``: a tokenizer object or folder overriding the checkpoint's choice;
        ``asr_model``: Whisper model (folder or hub id) for transcription when no text is given;
        default: the checkpoint's ``asr_config`` name when it names a Whisper model."""
        from transformers import AutoTokenizer

        from taste_speech.configuration_taste import TasteConfig

        directory = _resolve_processor_dir(name_or_path, **hub_kwargs)
        config = TasteConfig.from_pretrained(directory)

        llm_dir = os.path.join(directory, LLAMA_TOKENIZER_DIR)
        # (checked by its file: an interrupted download may leave the folder without it)
        if not os.path.isfile(os.path.join(llm_dir, "tokenizer.json")):
            raise ValueError(
                f"{directory} has no {LLAMA_TOKENIZER_DIR}/tokenizer.json; the published checkpoint ships the "
                "Llama-3.2 tokenizer there - download the whole repository, or build a tiny checkpoint with "
                "python -m taste_speech.tiny DIR (a folder written by model.save_pretrained holds the weights and "
                "config only: write the processor's files there too, processor.save_pretrained(DIR))"
            )
        try:
            llm = AutoTokenizer.from_pretrained(llm_dir)
        except (ValueError, OSError) as e:  # (a truncated tokenizer.json: json's error names no file)
            raise ValueError(f"cannot read the Llama tokenizer in {llm_dir} ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}): the files are broken or "
                             "incomplete - download them again") from e

        asr_name = config.asr_config._name_or_path or ""
        if asr_tokenizer is None:
            local = os.path.join(directory, ASR_TOKENIZER_DIR)
            source = local if os.path.isdir(local) else _asr_model_name(asr_name, directory)
            if source is None:
                raise ValueError(
                    f"no ASR tokenizer: {directory} has no {ASR_TOKENIZER_DIR}/ and asr_config names "
                    f"{asr_name!r}; pass asr_tokenizer=<Whisper tokenizer folder> (e.g. a local copy of "
                    f"{PUBLISHED_ASR_MODEL})"
                )
            asr_tokenizer = _load_tokenizer(source)
        elif isinstance(asr_tokenizer, (str, os.PathLike)):
            asr_tokenizer = _load_tokenizer(os.fspath(asr_tokenizer))

        if asr_model is None:
            asr_model = _asr_model_name(asr_name, directory, need_model=True)

        whisper = config.joint_whisper_config
        cosy = os.path.join(directory, COSYVOICE_DIR)

        def optional(name):
            path = os.path.join(cosy, name)
            return path if os.path.isfile(path) else None

        return cls(
            llm,
            asr_tokenizer,
            num_frames=2 * whisper.max_source_positions,
            n_mels=whisper.num_mel_bins,
            speaker_model_path=optional(SPEAKER_MODEL_FILE),
            voice_generator_path=optional(VOICE_GENERATOR_FILE),
            default_speaker_path=optional(DEFAULT_SPEAKER_FILE),
            asr_model=asr_model,
            max_asr_tokens=whisper.max_target_positions - WHISPER_PROMPT_TOKENS,
        )

    def save_pretrained(self, directory) -> str:
        """Write the processor's files in the published layout into ``directory``: its two
        tokenizers and the ``cosyvoice/`` files it was loaded with (speaker encoder, voice
        generator, default voice). ``model.save_pretrained`` writes the config and the weights:
        both into one folder make a checkpoint that loads again (a model with merged LoRA or
        fine-tuned keeps its processor). Returns ``directory``."""
        import shutil

        from taste_speech.voice_generator.loading import CONFIG_NAME as VOICE_GENERATOR_CONFIG

        directory = os.fspath(directory)
        self.llm_tokenizer.save_pretrained(os.path.join(directory, LLAMA_TOKENIZER_DIR))
        self.asr_tokenizer.save_pretrained(os.path.join(directory, ASR_TOKENIZER_DIR))
        files = [(self.speaker_model_path, SPEAKER_MODEL_FILE), (self.voice_generator_path, VOICE_GENERATOR_FILE),
                 (self.default_speaker_path, DEFAULT_SPEAKER_FILE)]
        if self.voice_generator_path is not None:  # (a tiny voice generator's sizes, next to its weights)
            files.append((os.path.join(os.path.dirname(self.voice_generator_path), VOICE_GENERATOR_CONFIG),
                          VOICE_GENERATOR_CONFIG))
        cosy = os.path.join(directory, COSYVOICE_DIR)
        os.makedirs(cosy, exist_ok=True)
        for source, name in files:
            target = os.path.join(cosy, name)
            if source is not None and os.path.isfile(source) and not (
                    os.path.exists(target) and os.path.samefile(source, target)):
                shutil.copyfile(source, target)
        return directory

    # -- all inputs at once ----------------------------------------------------------------------
    def __call__(
        self,
        audio,
        sampling_rate: int,
        text: str | None = None,
        words: list[str] | None = None,
        reference_audio=None,
        reference_sampling_rate: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """The model inputs for one utterance (the original processor's output, without S3 tokens).

        ``audio``: the utterance (any rate, see ``prepare_audio``). ``text`` or ``words``: its
        transcript; when both are None the audio is transcribed (``transcribe``).
        ``reference_audio``: one clip or a list of clips for the speaker vector (at
        ``reference_sampling_rate``, default ``sampling_rate``); without it there is no
        ``speaker_embeds`` key. Returns audio_features (1, frames, n_mels) float32,
        audio_feature_lengths (1,) int32, the six token tensors of ``process_text`` and, with
        reference audio, speaker_embeds (1, 192) float32."""
        wav = self.prepare_audio(audio, sampling_rate)
        data = self._features(wav)
        if text is None and words is None:
            text = self.transcribe(wav, SAMPLE_RATE)
        text_inputs = self.process_text(text, words=words)
        if self.max_asr_tokens is not None and text_inputs.asr_token_ids.shape[1] > self.max_asr_tokens:
            raise ValueError(
                f"the transcript has {text_inputs.asr_token_ids.shape[1]} ASR tokens; the audio tower takes at most "
                f"{self.max_asr_tokens}: split the utterance into shorter turns"
            )
        data.update(dict(text_inputs))
        if reference_audio is not None:
            rate = sampling_rate if reference_sampling_rate is None else reference_sampling_rate
            data["speaker_embeds"] = self.speaker_embedding(reference_audio, rate)
        return data

    # -- audio -------------------------------------------------------------------------------------
    @property
    def max_seconds(self) -> float:
        return self.max_samples / SAMPLE_RATE

    def prepare_audio(self, audio, sampling_rate: int) -> np.ndarray:
        """Mono float32 16 kHz waveform, checked: not empty, finite, at least ``MIN_AUDIO_SECONDS``
        and within the tower's window."""
        _check_rate(sampling_rate)
        wav = resample(to_mono_float(audio), int(sampling_rate), SAMPLE_RATE)
        if wav.size < MIN_AUDIO_SECONDS * SAMPLE_RATE:
            raise ValueError(
                f"audio too short: {1000 * wav.size / SAMPLE_RATE:.1f} ms at {SAMPLE_RATE} Hz, the minimum is "
                f"{1000 * MIN_AUDIO_SECONDS:g} ms: pass the whole turn, at its real sampling_rate"
            )
        if wav.size > self.max_samples:
            raise ValueError(
                f"audio is {wav.size / SAMPLE_RATE:.2f} s long; the audio tower takes at most "
                f"{self.max_seconds:g} s per turn: split the turn (e.g. at pauses) before tokenizing"
            )
        return wav

    def process_audio(self, audio, sampling_rate: int) -> dict[str, torch.Tensor]:
        """audio_features (1, frames, n_mels) float32 and audio_feature_lengths (1,) int32."""
        return self._features(self.prepare_audio(audio, sampling_rate))

    def audio_features(self, audio, sampling_rate: int) -> torch.Tensor:
        """(1, frames, n_mels) Whisper log-mel of the zero-padded window."""
        return self.process_audio(audio, sampling_rate)["audio_features"]

    def _features(self, wav16k: np.ndarray) -> dict[str, torch.Tensor]:
        features = whisper_log_mel(wav16k, n_mels=self.n_mels, n_samples=self.max_samples)
        lengths = torch.tensor([wav16k.size // HOP_LENGTH], dtype=torch.int32)  # informational (§2.3)
        return {"audio_features": features, "audio_feature_lengths": lengths}

    # -- text --------------------------------------------------------------------------------------
    @staticmethod
    def split_words(text: str) -> list[str]:
        """The original's rule: whitespace -> space, strip, split on every single space, and a
        leading space on each word (two spaces in a row give a lone-space word)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        text = re.sub(r"\s", " ", text).strip()
        if not text:
            return []
        return [" " + piece for piece in text.split(" ")]

    def process_text(self, text: str | None = None, words: list[str] | None = None) -> TextInputs:
        """Transcript (or ready-made words, each with its leading space) -> both token streams."""
        if text is not None and words is not None:
            raise ValueError("give process_text a transcript (text) or its words, not both")
        if words is None:
            if text is None:
                raise ValueError("process_text needs text (a transcript) or words")
            words = self.split_words(text)
        return self.encode_words(words)

    def encode_words(self, words: list[str]) -> TextInputs:
        if not words:
            raise ValueError("the text has no words: give a non-empty transcript")
        for i, word in enumerate(words):
            if not isinstance(word, str) or not word:
                raise ValueError(f"word {i} is {word!r}; words must be non-empty strings (' ' + word)")
            if word[0] != " " or any(c.isspace() for c in word[1:]):
                # the word alignment finds each word by its leading space: 'hello' 'there' would
                # silently become one word, ' good morning' two
                raise ValueError(f"word {i} ({word!r}) must be one word after one space (' ' + word, as "
                                 "split_words(text) makes them)")
        llm_ids, llm_wids, asr_ids, asr_wids = [], [], [], []
        for i, (word, l_ids, a_ids) in enumerate(zip(words, _encode_each(self.llm_tokenizer, words),
                                                     _encode_each(self.asr_tokenizer, words))):
            if not l_ids or not a_ids:
                raise ValueError(f"word {i} ({word!r}) has no tokens in one of the tokenizers; remove it")
            llm_ids += l_ids
            llm_wids += [i] * len(l_ids)
            asr_ids += a_ids
            asr_wids += [i] * len(a_ids)
        return TextInputs(
            list(words),
            torch.tensor([llm_ids], dtype=torch.int64), torch.tensor([llm_wids], dtype=torch.int32),
            torch.tensor([asr_ids], dtype=torch.int64), torch.tensor([asr_wids], dtype=torch.int32),
        )

    def words_from_llm_ids(self, text_ids, word_ids=None) -> list[list[int]]:
        """Group Llama ids into words. With ``word_ids`` (what the sampler carries, the robust
        way, §11.10) a new group starts where the word id changes; without, a word starts at a
        piece that decodes with a leading space (how every word is encoded) or at a special token
        (like the sampler), and the first id always starts one (§11.4)."""
        ids = torch.as_tensor(text_ids).reshape(-1).tolist()
        if word_ids is not None:
            wids = torch.as_tensor(word_ids).reshape(-1).tolist()
            if len(wids) != len(ids):
                raise ValueError(f"word_ids has {len(wids)} entries for {len(ids)} text ids; give one per id")
            starts = [k == 0 or wids[k] != wids[k - 1] for k in range(len(ids))]
        else:
            specials = self._special_ids()
            starts = [k == 0 or tid in specials or self.llm_tokenizer.decode([tid]).startswith(" ")
                      for k, tid in enumerate(ids)]
        words: list[list[int]] = []
        for tid, start in zip(ids, starts):
            if start:
                words.append([tid])
            else:
                words[-1].append(tid)
        return words

    def align_llm_ids(self, text_ids, word_ids=None) -> TextInputs:
        """Llama ids of a segment (e.g. generated text) -> both token streams with word ids,
        keeping the given Llama ids: each word's pieces are decoded and the word, with one leading
        space, is re-encoded by the ASR tokenizer (what the original does with generated text)."""
        groups = self.words_from_llm_ids(text_ids, word_ids)
        if not groups:
            raise ValueError("text_ids decode to no words: give at least one token")
        words = [" " + self.llm_tokenizer.decode(g).strip() for g in groups]
        if all(w == " " for w in words):
            raise ValueError("text_ids decode to no words (only whitespace): give at least one real word")
        llm_wids, asr_ids, asr_wids = [], [], []
        for i, (group, word, a_ids) in enumerate(zip(groups, words, _encode_each(self.asr_tokenizer, words))):
            llm_wids += [i] * len(group)
            if not a_ids:
                raise ValueError(f"word {word!r} has no ASR tokens")
            asr_ids += a_ids
            asr_wids += [i] * len(a_ids)
        flat = [t for g in groups for t in g]
        return TextInputs(
            words,
            torch.tensor([flat], dtype=torch.int64), torch.tensor([llm_wids], dtype=torch.int32),
            torch.tensor([asr_ids], dtype=torch.int64), torch.tensor([asr_wids], dtype=torch.int32),
        )

    def _special_ids(self) -> set[int]:
        if self._llm_special_ids is None:
            tok = self.llm_tokenizer
            ids = set(getattr(tok, "all_special_ids", []) or [])
            added = getattr(tok, "added_tokens_decoder", None) or {}
            ids |= {i for i, t in added.items() if getattr(t, "special", False)}
            self._llm_special_ids = ids
        return self._llm_special_ids

    # -- speaker ----------------------------------------------------------------------------------
    def fbank(self, wav16k) -> np.ndarray:
        """(T, 80) mean-normalised Kaldi fbank of a 16 kHz float waveform (CAMPPlus input)."""
        return mean_normalise(kaldi_fbank(wav16k, num_mel_bins=80))

    def speaker_embedding(self, clips, sampling_rate: int) -> torch.Tensor:
        """(1, D) float32: L2-normalised mean of the CAMPPlus x-vectors (D = 192) of one or more
        reference clips, each any rate / channel count (``sampling_rate``, in Hz, is theirs)."""
        if self.speaker_model_path is None:
            raise ValueError(
                f"no {COSYVOICE_DIR}/{SPEAKER_MODEL_FILE} in this checkpoint: pass speaker embeddings directly "
                "or use default_speaker_embedding()"
            )
        _check_rate(sampling_rate)
        if isinstance(clips, (np.ndarray, torch.Tensor)) or (isinstance(clips, (list, tuple)) and clips
                                                              and np.isscalar(clips[-1])):
            clips = [clips]  # one clip (a list of samples; a soundfile (data, rate) pair is refused by its check)
        clips = list(clips)
        if not clips:
            raise ValueError("no reference audio: give at least one clip of the speaker")
        session = self._speaker_onnx()
        input_name = session.get_inputs()[0].name
        vectors = []
        for i, clip in enumerate(clips):
            which = "the reference clip" if len(clips) == 1 else f"reference clip {i}"
            wav = resample(clip, int(sampling_rate), SAMPLE_RATE)
            seconds = wav.size / SAMPLE_RATE
            if seconds < MIN_REFERENCE_SECONDS:
                raise ValueError(f"{which} is {seconds:.2f} s long: give a few seconds of the speaker "
                                 f"talking (at least {MIN_REFERENCE_SECONDS} s; is sampling_rate={sampling_rate} right?)")
            peak = float(np.abs(wav).max())
            if peak < SILENCE_PEAK:  # its x-vector would be a voice nobody has
                raise ValueError(f"{which} is silent (peak {peak:.1e}, below -80 dBFS): give a clip "
                                 "of the speaker talking")
            feats = self.fbank(wav)
            if seconds < SHORT_REFERENCE_SECONDS:
                logger.warning(f"{which} is only {seconds:.1f} s long: a few seconds of the speaker "
                               "give a voice closer to theirs")
            out = session.run(None, {input_name: feats[None].astype(np.float32)})[0]
            vectors.append(np.asarray(out, dtype=np.float32).reshape(-1))
        if len({v.size for v in vectors}) != 1:
            raise ValueError(f"the speaker model returned vectors of different sizes {[v.size for v in vectors]}")
        mean = torch.from_numpy(np.mean(np.stack(vectors), axis=0)).float().unsqueeze(0)
        if not torch.isfinite(mean).all() or float(mean.norm()) == 0.0:
            raise ValueError("the speaker model returned a zero or non-finite vector; use other reference audio")
        return torch.nn.functional.normalize(mean, dim=-1)

    def _speaker_onnx(self):
        if self._speaker_session is None:
            import onnxruntime as ort

            options = ort.SessionOptions()
            options.intra_op_num_threads = 1
            options.inter_op_num_threads = 1
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            try:
                self._speaker_session = ort.InferenceSession(
                    self.speaker_model_path, sess_options=options, providers=["CPUExecutionProvider"]
                )
            except Exception as e:  # onnxruntime's own error types (InvalidProtobuf, Fail, ...)
                raise ValueError(f"cannot load the speaker model {self.speaker_model_path} ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:200]}): the file is broken or incomplete - download it "
                                 "again") from e
        return self._speaker_session

    def default_speaker_embedding(self) -> torch.Tensor:
        """The voice used when none is given, (1, D): the checkpoint's own
        (``cosyvoice/default_speaker.npy``) if it ships one; otherwise the speaker encoder's vector
        of ``taste_speech/default_voice.wav``, a synthetic placeholder voice (the published checkpoint
        has no default voice: give reference audio of a real voice for a natural one)."""
        if self._default_voice is None:
            if self.default_speaker_path is not None:
                vec = torch.from_numpy(np.load(self.default_speaker_path, allow_pickle=False)).float().reshape(1, -1)
                self._default_voice = torch.nn.functional.normalize(vec, dim=-1)
            elif self.speaker_model_path is not None:
                self._default_voice = self.speaker_embedding(*_read_default_voice())
            else:
                raise ValueError(
                    f"this checkpoint has neither a default voice ({COSYVOICE_DIR}/{DEFAULT_SPEAKER_FILE}) nor a "
                    f"speaker encoder ({COSYVOICE_DIR}/{SPEAKER_MODEL_FILE}) to make one: pass speaker embeddings "
                    "directly, or download the checkpoint's cosyvoice folder"
                )
        return self._default_voice.clone()

    def get_generator(self, device: torch.device | str | None = None):
        """The checkpoint's voice generator (``cosyvoice/voice_generator.pth``), loaded on ``device``
        on the first call and the same object after: ``taste_detokenize`` takes it from here when it
        is given none."""
        if self._voice_generator is None:
            if self.voice_generator_path is None:
                raise ValueError(
                    f"this processor knows no voice generator ({COSYVOICE_DIR}/{VOICE_GENERATOR_FILE}): load it with "
                    "TasteProcessor.from_pretrained(<checkpoint with that file>), or pass "
                    "voice_generator=VoiceGenerator.from_pretrained(path)")
            from taste_speech.voice_generator import VoiceGenerator

            self._voice_generator = VoiceGenerator.from_pretrained(self.voice_generator_path, device=device)
        elif device is not None:
            loaded = next(self._voice_generator.parameters()).device
            if loaded != torch.empty(0, device=device).device:
                raise ValueError(f"the voice generator is loaded on {loaded}, not {device}: one processor keeps one "
                                 "(pass voice_generator= for another device)")
        return self._voice_generator

    # -- ASR -------------------------------------------------------------------------------------
    def transcribe(self, audio, sampling_rate: int) -> str:
        """English transcript of ``audio`` by the Whisper ASR pipeline (built on first use)."""
        wav = self.prepare_audio(audio, sampling_rate)
        pipe = self._asr()
        kwargs = {}
        generation_config = getattr(getattr(pipe, "model", None), "generation_config", None)
        if getattr(generation_config, "lang_to_id", None):  # multilingual Whisper: force English transcription
            kwargs["generate_kwargs"] = {"language": "english", "task": "transcribe"}
        result = pipe({"raw": wav, "sampling_rate": SAMPLE_RATE}, **kwargs)
        text = result["text"] if isinstance(result, dict) else str(result)
        if not text.strip():
            raise ValueError("the ASR heard no words in the audio: use audio with speech, or give its transcript "
                             "(processor(audio, sampling_rate, text=...), or process_text(text))")
        return text

    def _asr(self):
        if self._asr_pipeline is None:
            if not self.asr_model:
                raise ValueError(
                    "no transcript was given and no ASR model is configured: give the transcript (processor(audio, "
                    "sampling_rate, text=...), or process_text(text)), or load the processor "
                    f"with asr_model=<local Whisper model folder or hub id, e.g. {PUBLISHED_ASR_MODEL}>"
                )
            from transformers import pipeline

            device = 0 if torch.cuda.is_available() else -1
            dtype = torch.float16 if device == 0 else torch.float32
            try:
                # no chunk_length_s (the original's 30): inputs never exceed the 30 s window
                self._asr_pipeline = pipeline(
                    "automatic-speech-recognition", model=self.asr_model, dtype=dtype, device=device
                )
            except (OSError, ValueError) as exc:
                raise ValueError(
                    f"could not load the ASR model {self.asr_model!r} ({type(exc).__name__}: {exc}); download it "
                    "and pass asr_model=<its folder>, or give the transcript (text=... to the processor's call)"
                ) from exc
        return self._asr_pipeline


# -- helpers ------------------------------------------------------------------------------------------
def _encode_each(tokenizer, words: list[str]) -> list[list[int]]:
    """Each word's ids on its own (no special tokens added), in one batched call of the tokenizer:
    a word at a time was one call per word of every segment, on the way to a reply's first audio.
    A transcript's "<|eot_id|>" (or Whisper's "<|endoftext|>") is text the caller said, never a
    control token (``split_special_tokens``)."""
    return tokenizer(list(words), add_special_tokens=False, split_special_tokens=True)["input_ids"]


def as_speaker_embedding(value, dim: int, name: str = "speaker_embeds") -> torch.Tensor:
    """``value`` as the (1, ``dim``) float32 voice vector of a call, checked: a mistake here would
    otherwise surface deep in the decoder, or as a voice nobody has."""
    make = "processor.speaker_embedding(audio, rate) or processor.default_speaker_embedding()"
    if value is None:
        raise ValueError(f"{name} is required: a (1, {dim}) speaker embedding from {make}")
    if not isinstance(value, (torch.Tensor, np.ndarray, list, tuple)):
        raise ValueError(f"{name} must be a (1, {dim}) tensor, got {type(value).__name__}: make it with {make}")
    vector = torch.as_tensor(np.asarray(value) if isinstance(value, (list, tuple)) else value).float()
    if vector.numel() != dim:
        raise ValueError(f"{name} must be a (1, {dim}) speaker embedding, got shape {tuple(vector.shape)} "
                         f"(audio is not a voice vector): make one with {make}")
    vector = vector.reshape(1, dim)
    if not bool(torch.isfinite(vector).all()):
        raise ValueError(f"{name} contains NaN or infinite values: compute it again with {make}")
    if float(vector.norm()) == 0.0:
        raise ValueError(f"{name} is all zeros, a voice nobody has: make one with {make}")
    return vector


def _read_default_voice() -> tuple[np.ndarray, int]:
    """The placeholder voice's reference recording (16-bit mono WAV shipped with the package)."""
    import wave

    with wave.open(DEFAULT_VOICE_WAV, "rb") as f:
        rate, frames = f.getframerate(), f.readframes(f.getnframes())
    return np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32768.0, rate


def _check_rate(sampling_rate) -> None:
    if sampling_rate is None:
        raise ValueError("sampling_rate is required: pass the rate of the audio in Hz (e.g. 16000, 48000)")
    if isinstance(sampling_rate, bool) or not isinstance(sampling_rate, (int, np.integer)) or sampling_rate <= 0:
        raise ValueError(f"sampling_rate must be a positive integer in Hz, got {sampling_rate!r}")
    if sampling_rate < MIN_SAMPLE_RATE:
        raise ValueError(f"sampling_rate={sampling_rate} Hz is below {MIN_SAMPLE_RATE} Hz, no speech recording's rate: "
                         "pass the audio's rate in Hz (e.g. 16000, 48000), not in kHz")


def _resolve_processor_dir(name_or_path, **hub_kwargs) -> str:
    from taste_speech.loading import check_checkpoint_name

    check_checkpoint_name(name_or_path)
    path = os.path.expanduser(os.fspath(name_or_path))
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise ValueError(f"{path} is a file; pass the checkpoint directory (the one holding config.json)")
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", str(name_or_path)) is None:
        raise ValueError(f"{name_or_path!r} is neither a local directory nor a hub id (owner/name)")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id=str(name_or_path), allow_patterns=_PROCESSOR_FILES, **hub_kwargs)
    except Exception as exc:  # offline, unknown repository, no access
        raise ValueError(
            f"could not fetch {name_or_path!r} from the Hugging Face hub ({type(exc).__name__}: {exc}); download "
            f"it first (hf download {name_or_path} --local-dir DIR) and pass DIR"
        ) from exc


def _asr_model_name(name: str, checkpoint_dir: str, need_model: bool = False) -> str | None:
    """Where the model named by ``asr_config`` is: a folder (absolute or relative to the
    checkpoint), a hub id, or - for the original's local training path ``.../whisper-large-v3`` -
    the published hub id. With ``need_model`` only folders holding a Whisper model count."""
    if not name:
        return PUBLISHED_ASR_MODEL
    for folder in (os.path.join(checkpoint_dir, name), os.path.expanduser(name)):
        if os.path.isdir(folder):
            if not need_model or _is_whisper_model_dir(folder):
                return folder
            return None
    base = os.path.basename(os.path.normpath(name))
    if base.startswith("whisper-") and not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name):
        return f"openai/{base}"  # e.g. ./storage/pretrained_models/whisper-large-v3
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name):
        return name
    return None


def _is_whisper_model_dir(folder: str) -> bool:
    try:
        with open(os.path.join(folder, "config.json")) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError):
        return False
    has_weights = any(n.endswith((".safetensors", ".bin")) for n in os.listdir(folder))
    return model_type == "whisper" and has_weights


def _load_tokenizer(source: str):
    from transformers import AutoTokenizer

    if os.path.isdir(source) and not any(os.path.isfile(os.path.join(source, name))
                                         for name in ("tokenizer.json", "vocab.json")):
        # (else transformers falls back to converting a slow tokenizer, and says sentencepiece is missing)
        raise ValueError(f"the ASR tokenizer folder {source!r} has no tokenizer.json (an interrupted download?): "
                         "download it again, or pass asr_tokenizer=<a Whisper tokenizer folder>")
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"could not load the ASR tokenizer {source!r} ({type(exc).__name__}: {exc}); download it and pass "
            "asr_tokenizer=<its folder>"
        ) from exc
