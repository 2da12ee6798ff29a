"""TasteProcessor: waveforms and text in, the model's inputs out (spec §2).

* audio: any rate (resampled with soxr), mono (channels averaged), float in [-1, 1] -> Whisper
  128-bin log-mel over the audio tower's window (30 s for the published model), computed by
  transformers' WhisperFeatureExtractor (the openai-whisper algorithm; no torchaudio);
* text: split on every single whitespace character, a leading space on each word, each word
  encoded separately by the Llama tokenizer and by the ASR (Whisper) tokenizer -> ids and word ids;
* speaker: 80-bin Kaldi fbank (kaldi-native-fbank), mean-normalised, through the published
  CAMPPlus ONNX model, averaged over clips and L2-normalised.

``from_pretrained`` reads the published layout: ``llama_tokenizer/``, the ASR tokenizer named by
``asr_config`` (or ``asr_tokenizer/`` inside the folder, which tiny checkpoints ship),
``cosyvoice/speaker_embed.onnx`` and ``cosyvoice/voice_generator.pth``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from transformers import AutoTokenizer, WhisperFeatureExtractor

SAMPLE_RATE = 16000
HOP = 160


def to_mono_float(audio, name: str = "audio") -> np.ndarray:
    """(T,), (C, T) or (1, T) numpy/torch, float or int16 -> mono float32 (T,)."""
    if isinstance(audio, torch.Tensor):
        audio = audio.detach().cpu().numpy()
    audio = np.asarray(audio)
    if audio.dtype == np.int16:
        audio = audio.astype(np.float32) / 32768.0
    elif not np.issubdtype(audio.dtype, np.floating):
        raise ValueError(f"{name} must be float in [-1, 1] or int16 PCM, got dtype {audio.dtype}")
    if audio.ndim == 2:
        if audio.shape[0] > 8 and audio.shape[1] <= 8:  # (T, C) layout
            audio = audio.T
        audio = audio.mean(axis=0)
    elif audio.ndim != 1:
        raise ValueError(f"{name} must be (T,) or (channels, T), got shape {audio.shape}")
    audio = audio.astype(np.float32)
    if audio.size == 0:
        raise ValueError(f"{name} is empty: give at least a few hundred milliseconds of speech")
    if not np.isfinite(audio).all():
        raise ValueError(f"{name} contains NaN or inf samples: check the capture/decoder that produced it")
    return audio


def resample(audio: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    if from_rate <= 0 or to_rate <= 0:
        raise ValueError(f"sampling rates must be positive, got {from_rate} -> {to_rate}")
    if from_rate == to_rate:
        return audio.astype(np.float32)
    import soxr

    return soxr.resample(audio.astype(np.float32), from_rate, to_rate, quality="HQ").astype(np.float32)


@dataclass
class TextInputs:
    words: list[str]
    llm_token_ids: torch.Tensor  # (1, N) int64
    llm_word_ids: torch.Tensor  # (1, N) int32
    asr_token_ids: torch.Tensor  # (1, L) int64
    asr_word_ids: torch.Tensor  # (1, L) int32


class TasteProcessor:
    def __init__(self, llm_tokenizer, asr_tokenizer, num_frames: int = 3000, n_mels: int = 128,
                 speaker_model_path: str | None = None, voice_generator_path: str | None = None,
                 default_speaker_path: str | None = None):
        self.llm_tokenizer = llm_tokenizer
        self.asr_tokenizer = asr_tokenizer
        self.num_frames = num_frames
        self.max_samples = num_frames * HOP
        self.feature_extractor = WhisperFeatureExtractor(
            feature_size=n_mels, sampling_rate=SAMPLE_RATE, hop_length=HOP,
            chunk_length=self.max_samples // SAMPLE_RATE, n_fft=400,
        )
        self.feature_extractor.n_samples = self.max_samples
        self.feature_extractor.nb_max_frames = num_frames
        self.speaker_model_path = speaker_model_path
        self.voice_generator_path = voice_generator_path
        self.default_speaker_path = default_speaker_path
        self._speaker_session = None

    @classmethod
    def from_pretrained(cls, name_or_path) -> "TasteProcessor":
        from taste_speech.configuration_taste import TasteConfig
        from taste_speech.modeling_taste import resolve_checkpoint_dir

        directory = resolve_checkpoint_dir(name_or_path)
        config = TasteConfig.from_pretrained(directory)
        llm = AutoTokenizer.from_pretrained(os.path.join(directory, "llama_tokenizer"))
        local_asr = os.path.join(directory, "asr_tokenizer")
        if os.path.isdir(local_asr):
            asr = AutoTokenizer.from_pretrained(local_asr)
        else:
            asr = AutoTokenizer.from_pretrained(config.asr_config._name_or_path or "openai/whisper-large-v3")
        whisper = config.joint_whisper_config
        cosy = os.path.join(directory, "cosyvoice")

        def optional(name):
            path = os.path.join(cosy, name)
            return path if os.path.exists(path) else None

        return cls(llm, asr, num_frames=2 * whisper.max_source_positions, n_mels=whisper.num_mel_bins,
                   speaker_model_path=optional("speaker_embed.onnx"),
                   voice_generator_path=optional("voice_generator.pth"),
                   default_speaker_path=optional("default_speaker.npy"))

    # -- audio -------------------------------------------------------------------------------------
    @property
    def max_seconds(self) -> float:
        return self.max_samples / SAMPLE_RATE

    def prepare_audio(self, audio, sampling_rate: int) -> np.ndarray:
        """Mono float32 16 kHz waveform, checked: not empty, finite, within the tower's window."""
        wav = resample(to_mono_float(audio), int(sampling_rate), SAMPLE_RATE)
        if wav.size > self.max_samples:
            raise ValueError(
                f"audio is {wav.size / SAMPLE_RATE:.1f} s long; the audio tower takes at most "
                f"{self.max_seconds:.0f} s per turn: split the turn (e.g. at pauses) before tokenizing"
            )
        return wav

    def audio_features(self, audio, sampling_rate: int = SAMPLE_RATE) -> torch.Tensor:
        """(1, frames, n_mels) Whisper log-mel of the (padded) window."""
        wav = self.prepare_audio(audio, sampling_rate)
        feats = self.feature_extractor(wav, sampling_rate=SAMPLE_RATE, return_tensors="np", padding="max_length")
        return torch.from_numpy(feats["input_features"][0].T.copy()).unsqueeze(0).float()

    # -- text -----------------------------------------------------------------------------------------
    @staticmethod
    def split_words(text: str) -> list[str]:
        """The original's rule: whitespace -> space, strip, split on every single space, and a
        leading space on each word (two spaces in a row give a lone-space word)."""
        text = "".join(" " if c.isspace() else c for c in text).strip()
        if not text:
            return []
        return [" " + piece for piece in text.split(" ")]

    def encode_words(self, words: list[str]) -> TextInputs:
        if not words:
            raise ValueError("the text has no words: give a non-empty transcript")
        llm_ids, llm_wids, asr_ids, asr_wids = [], [], [], []
        for i, word in enumerate(words):
            l_ids = self.llm_tokenizer.encode(word, add_special_tokens=False)
            a_ids = self.asr_tokenizer.encode(word, add_special_tokens=False)
            llm_ids += l_ids
            llm_wids += [i] * len(l_ids)
            asr_ids += a_ids
            asr_wids += [i] * len(a_ids)
        return TextInputs(
            words,
            torch.tensor([llm_ids], dtype=torch.long), torch.tensor([llm_wids], dtype=torch.int32),
            torch.tensor([asr_ids], dtype=torch.long), torch.tensor([asr_wids], dtype=torch.int32),
        )

    def process_text(self, text: str) -> TextInputs:
        return self.encode_words(self.split_words(text))

    def words_from_llm_ids(self, text_ids) -> list[list[int]]:
        """Group Llama ids into words: a word starts at a piece that decodes with a leading
        space (how every word is encoded), and the first id always starts one."""
        ids = torch.as_tensor(text_ids).reshape(-1).tolist()
        words: list[list[int]] = []
        for tid in ids:
            piece = self.llm_tokenizer.decode([tid])
            if not words or piece.startswith(" "):
                words.append([tid])
            else:
                words[-1].append(tid)
        return words

    def align_llm_ids(self, text_ids) -> TextInputs:
        """Text ids of a segment -> both token streams with word ids, keeping the given Llama ids."""
        groups = self.words_from_llm_ids(text_ids)
        if not groups:
            raise ValueError("text_ids decode to no words: give at least one token")
        words = [self.llm_tokenizer.decode(g) for g in groups]
        if not any(w.strip() for w in words):
            raise ValueError("text_ids decode to no words (only whitespace or special tokens)")
        llm_wids, asr_ids, asr_wids = [], [], []
        for i, (group, word) in enumerate(zip(groups, words)):
            llm_wids += [i] * len(group)
            a_ids = self.asr_tokenizer.encode(word if word.startswith(" ") else " " + word, add_special_tokens=False)
            if not a_ids:
                raise ValueError(f"word {word!r} has no ASR tokens")
            asr_ids += a_ids
            asr_wids += [i] * len(a_ids)
        flat = [t for g in groups for t in g]
        return TextInputs(words, torch.tensor([flat], dtype=torch.long), torch.tensor([llm_wids], dtype=torch.int32),
                          torch.tensor([asr_ids], dtype=torch.long), torch.tensor([asr_wids], dtype=torch.int32))

    # -- speaker -------------------------------------------------------------------------------------------
    def fbank(self, wav16k: np.ndarray) -> np.ndarray:
        """80-bin Kaldi fbank of a 16 kHz float waveform (no int16 scaling, dither 0), CMN."""
        import kaldi_native_fbank as knf

        opts = knf.FbankOptions()
        opts.frame_opts.samp_freq = SAMPLE_RATE
        opts.frame_opts.dither = 0.0
        opts.mel_opts.num_bins = 80
        fb = knf.OnlineFbank(opts)
        fb.accept_waveform(SAMPLE_RATE, wav16k.tolist())
        fb.input_finished()
        frames = np.stack([fb.get_frame(i) for i in range(fb.num_frames_ready)]) if fb.num_frames_ready else None
        if frames is None:
            raise ValueError("reference audio is too short for a speaker embedding (needs >= 25 ms)")
        return frames - frames.mean(axis=0, keepdims=True)

    def speaker_embedding(self, clips, sampling_rate: int = SAMPLE_RATE) -> torch.Tensor:
        """(1, 192) L2-normalised mean CAMPPlus x-vector of one or more reference clips."""
        if self.speaker_model_path is None:
            raise ValueError("no cosyvoice/speaker_embed.onnx in this checkpoint: pass speaker embeddings "
                             "directly or use default_speaker_embedding()")
        if self._speaker_session is None:
            import onnxruntime as ort

            so = ort.SessionOptions()
            so.intra_op_num_threads = so.inter_op_num_threads = 1
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            self._speaker_session = ort.InferenceSession(self.speaker_model_path, so, providers=["CPUExecutionProvider"])
        if isinstance(clips, (np.ndarray, torch.Tensor)):
            clips = [clips]
        session = self._speaker_session
        vectors = []
        for clip in clips:
            feats = self.fbank(resample(to_mono_float(clip, "reference audio"), int(sampling_rate), SAMPLE_RATE))
            out = session.run(None, {session.get_inputs()[0].name: feats[None].astype(np.float32)})[0]
            vectors.append(np.asarray(out).reshape(-1))
        mean = torch.from_numpy(np.mean(vectors, axis=0)).float().unsqueeze(0)
        return torch.nn.functional.normalize(mean, dim=-1)

    def default_speaker_embedding(self) -> torch.Tensor:
        """The checkpoint's default voice (``cosyvoice/default_speaker.npy``), (1, D)."""
        if self.default_speaker_path is None:
            raise ValueError("this checkpoint has no default voice (cosyvoice/default_speaker.npy): give reference audio")
        vec = torch.from_numpy(np.load(self.default_speaker_path)).float().reshape(1, -1)
        return torch.nn.functional.normalize(vec, dim=-1)
