"""The built-in ASR: a Whisper model (transformers) that gives each user turn its transcript when no
Pipecat STT service sits upstream (a phone stream or a browser carries audio only).

TASTE aligns the user's audio to the words of its transcript, so every turn needs one. The
published model was built around ``openai/whisper-large-v3`` (the checkpoint's ``asr_config``):

    asr = WhisperTranscriber.from_pretrained("openai/whisper-large-v3", device="cuda")   # or a local folder
    engine = TasteEngine.from_pretrained(..., asr=asr)

``random_tiny`` builds a random tiny Whisper over the tiny checkpoint's ASR tokenizer: like the
rest of the tiny checkpoint it only exercises the code path (its transcripts are gibberish).

Decoding (``decode``): 'static' is our greedy loop (``whisper_decode``: preallocated cache, the
one-token step a CUDA graph on CUDA and eager elsewhere, ``graph_mode``); 'dynamic' is
``model.generate``; 'auto' (default) is the static loop wherever it reproduces ``generate`` for
the transcriber's settings and ``generate`` otherwise. Unlike the spoken LM's 'auto' it picks the
static loop on CPU too: only that loop can verify a draft (the incremental ASR below), and it
gives ``generate``'s ids.

Incremental ASR (``new_turn``): while the user speaks, the capture transcribes the audio so far
now and then (``TurnTranscript.partial``); at the end of the turn ``TurnTranscript.finish``
transcribes the whole turn with the latest partial's tokens as a draft.

Calls whose turns end together (``batch_rows``): their transcriptions meet in one queue
(``asr_batches.UtteranceBatcher``) and go through the static loop as one batch - one encoder
pass, one draft check, the tails token by token side by side - instead of one after the other.

One encoder pass for the transcript and the audio tower (``share_encoder``): the published
tower's Whisper encoder is Whisper-large-v3's, frozen, so where this model's encoder has the
tower's weights (``encoder_matches``; ``TasteEngine`` checks it on its CUDA fast path) the
encoder passes run through the tower's ``EncoderGraph``, and a turn's final transcription hands
the tower's outputs on (``TurnTranscript.encoded``, an ``EncodedTurn``): the tower does not encode
the turn again.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Sequence

import numpy as np

logger = logging.getLogger(__name__)

DECODE_KINDS = ("auto", "static", "dynamic")
STATIC_FAILURES_TO_GIVE_UP = 3  # static-loop failures in a row before every utterance goes to generate
# Utterances of calls ending together that one batch of the static loop takes on CUDA
# (``batch_rows='auto'``); elsewhere a row costs what it computes, and each utterance goes alone.
CUDA_BATCH_ROWS = 8


@dataclass
class Transcription:
    text: str
    ids: list[int]  # the generated token ids (no start tokens, no end-of-text)
    kept: int = 0  # tokens of the draft that decoding verified and kept


def check_whisper_name(name_or_path) -> str:
    """A Whisper folder (``~`` expanded) or hub id, as given; refused by name when it is neither
    (checked before any model loads: the TASTE checkpoint takes minutes)."""
    from taste_speech.loading import looks_like_hub_id

    name = os.path.expanduser(os.fspath(name_or_path))
    if not os.path.isdir(name) and not looks_like_hub_id(name):
        raise FileNotFoundError(f"no Whisper model at {name_or_path!r}: it is neither a folder nor a hub id "
                                "(owner/name, e.g. openai/whisper-large-v3); for no built-in ASR (transcripts from "
                                "an upstream STT) pass asr=None (taste-agent: --asr-model none)")
    return name


class WhisperTranscriber:
    def __init__(self, model, feature_extractor, tokenizer, *, device="cpu", language: str | None = "en",
                 max_new_tokens: int | None = 128, decode: str = "auto", graph_mode: str = "auto",
                 batch_rows: int | str = "auto"):
        """``batch_rows``: utterances decoded as one batch at most (the turns of calls that end
        together, announced by ``TurnTranscript.ended``; their encoder pass, draft check and tail
        steps are shared); 'auto': ``CUDA_BATCH_ROWS`` on CUDA, 1 elsewhere."""
        from pipecat_taste.whisper_decode import greedy_plan

        if decode not in DECODE_KINDS:
            raise ValueError(f"decode must be one of {DECODE_KINDS}, got {decode!r}")
        if batch_rows != "auto" and (isinstance(batch_rows, bool) or not isinstance(batch_rows, int)
                                     or batch_rows < 1):
            raise ValueError(f"batch_rows must be an integer >= 1 or 'auto', got {batch_rows!r}")
        self.model, self.feature_extractor, self.tokenizer = model.eval(), feature_extractor, tokenizer
        if getattr(model.generation_config, "is_multilingual", None) is False:
            language = None  # an English-only Whisper (*.en) has no language or task tokens: generate refuses them
        self.device, self.language, self.max_new_tokens = device, language, max_new_tokens
        self.graph_mode = graph_mode
        self._warned_length = False  # (a transcript cut at max_new_tokens: said once)
        plan = "decode='dynamic' asks for generate" if decode == "dynamic" else \
            greedy_plan(model, language, "transcribe" if language is not None else None, max_new_tokens)
        if isinstance(plan, str) and decode == "static":
            raise ValueError(f"the static Whisper loop cannot decode with these settings: {plan}. "
                             "Use decode='auto' (falls back to generate) or 'dynamic'.")
        self.plan = None if isinstance(plan, str) else plan
        self.generate_reason = plan if isinstance(plan, str) else None  # why generate is used, if it is
        # Decoding workspaces (static buffers + captured steps), one per batch being decoded:
        # calls share this transcriber and transcribe on their own threads at the same time.
        self._workspaces: list = []  # the free ones
        self._made = weakref.WeakSet()  # every workspace alive, free or in use
        self._encoder = None  # the workspaces' shared EncoderGraph, made with the first workspace
        self.shares_tower_encoder = False  # its passes are the audio tower's (``share_encoder``)
        self._batcher = None  # where the calls' utterances meet (UtteranceBatcher), made at the first
        self.batch_rows = batch_rows
        self._lock = threading.Lock()
        self._static_failures = 0  # in a row: the fast path is given up only when it keeps failing
        self._last_failure = None

    @property
    def decode(self) -> str:
        """The path in use: 'static' or 'dynamic' (generate)."""
        return "static" if self.plan is not None else "dynamic"

    @classmethod
    def from_pretrained(cls, name_or_path: str, device: str = "cpu", dtype=None, language: str = "en", **kwargs):
        """``dtype``: None or 'auto' runs Whisper the way the spoken LM runs its Llama, bfloat16 on
        CUDA and float32 elsewhere (left to transformers it would be the repo's stored dtype:
        float16 for openai/whisper-large-v3, even on a CPU); or 'float32', 'bfloat16', 'float16'."""
        from transformers import AutoProcessor, WhisperForConditionalGeneration

        from taste_speech.modeling_taste import resolve_device

        name_or_path = check_whisper_name(name_or_path)
        device = resolve_device(device)
        dtype = _whisper_dtype(dtype, device)
        processor = AutoProcessor.from_pretrained(name_or_path)
        model = WhisperForConditionalGeneration.from_pretrained(name_or_path, dtype=dtype).to(device)
        return cls(model, processor.feature_extractor, processor.tokenizer, device=str(device), language=language,
                   **kwargs)

    @classmethod
    def random_tiny(cls, checkpoint_dir: str, seed: int = 0, tower=None, device=None, dtype=None, **kwargs):
        """A random 2-layer Whisper over ``checkpoint_dir/asr_tokenizer`` (tiny checkpoints only).
        ``tower``: the tiny model's audio tower, whose encoder (architecture, window and weights)
        it takes, as the published ASR has the published tower's (``share_encoder``); its decoder
        stays a random 1-layer one. ``device`` / ``dtype``: as ``from_pretrained`` (without a
        tower; with one, the tower's)."""
        import torch

        from taste_speech.modeling_taste import resolve_device
        from transformers import AutoTokenizer, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

        tokenizer = AutoTokenizer.from_pretrained(os.path.join(checkpoint_dir, "asr_tokenizer"))
        vocab = len(tokenizer)
        encoder = dict(num_mel_bins=80, d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64,
                       decoder_attention_heads=2, decoder_ffn_dim=64, max_source_positions=1500)
        if tower is not None:
            c = tower.whisper_config
            encoder = dict(num_mel_bins=c.num_mel_bins, d_model=c.d_model, encoder_layers=c.encoder_layers,
                           encoder_attention_heads=c.encoder_attention_heads, encoder_ffn_dim=c.encoder_ffn_dim,
                           decoder_attention_heads=c.encoder_attention_heads, decoder_ffn_dim=c.encoder_ffn_dim,
                           max_source_positions=c.max_source_positions, activation_function=c.activation_function)
        config = WhisperConfig(vocab_size=vocab, decoder_layers=1, max_target_positions=32,
                               decoder_start_token_id=0, eos_token_id=vocab - 1, pad_token_id=vocab - 1,
                               bos_token_id=0, suppress_tokens=[], begin_suppress_tokens=[], **encoder)
        # Only pieces that read as (parts of) words, so the gibberish is at least made of words.
        import re

        wordish = re.compile(r"^ ?[a-z]{2,}$")
        config.suppress_tokens = [i for i in range(vocab) if not wordish.match(tokenizer.decode([i]))]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = WhisperForConditionalGeneration(config)
        features = WhisperFeatureExtractor(feature_size=config.num_mel_bins,
                                           chunk_length=2 * config.max_source_positions // 100)
        if tower is not None:
            weights = tower.encoder.conv1.weight
            model.to(device=weights.device, dtype=weights.dtype)
            model.model.encoder.load_state_dict(tower.encoder.state_dict())
        else:
            where = resolve_device(device or "cpu")
            model.to(device=where, dtype=_whisper_dtype(dtype, where))
        model.generation_config.forced_decoder_ids = None
        model.generation_config.suppress_tokens = config.suppress_tokens
        model.generation_config.max_length = 7
        return cls(model, features, tokenizer, language=None, max_new_tokens=None, device=str(model.device), **kwargs)

    # -- transcribing -----------------------------------------------------------------------------
    def __call__(self, audio16k: np.ndarray) -> str:
        return self.transcribe(audio16k).text

    def transcribe(self, audio16k: np.ndarray, draft: Sequence[int] = (), owner=None) -> Transcription:
        """The transcript of ``audio16k`` (16 kHz mono float32). ``draft``: token ids of an
        earlier transcript of (a prefix of) the same audio; the static loop keeps the part of it
        that greedy decoding confirms (same result, less decoding). ``generate`` ignores it.
        ``owner``: who announced this utterance (``expect_turn``), if anyone."""
        features = self._features(audio16k)
        plan = self.plan
        if plan is not None:
            try:
                ids, kept = self._batches().transcribe(features, draft, owner)
            except Exception as error:  # a broken fast path must not cost the call its transcripts
                # This utterance goes to generate (its batch's workspace is dropped). One failure (a
                # transient out-of-memory in one call) must not slow every call of the engine down
                # for good: the fast path is given up after STATIC_FAILURES_TO_GIVE_UP in a row.
                with self._lock:
                    if error is not self._last_failure:  # (a failed batch fails all its utterances: once)
                        self._static_failures += 1
                    self._last_failure = error
                    give_up = self._static_failures >= STATIC_FAILURES_TO_GIVE_UP
                    if give_up:
                        self.plan = None
                        self.generate_reason = f"the static loop failed {self._static_failures} times in a row " \
                                               f"({type(error).__name__}: {error})"
                logger.warning("Whisper static decoding failed (%s): %s", "using generate from now on" if give_up
                               else "this utterance goes to generate", error, exc_info=True)
            else:
                self._static_failures = 0
                if not plan.splits_into_segments(ids):
                    self._check_length(ids)
                    return Transcription(self._text(ids), ids, kept)
        ids = self._generate(features)
        return Transcription(self._text(ids), ids, 0)

    def _check_length(self, ids: list[int]) -> None:
        """Say once when a transcript used every one of ``max_new_tokens`` without reaching its end
        of text: the rest of the turn's words are missing from it (a long, fast turn)."""
        if self.max_new_tokens is not None and len(ids) >= self.max_new_tokens and not self._warned_length:
            self._warned_length = True
            logger.warning("a transcript reached max_new_tokens=%d before its end: the turn's last words are "
                           "missing from it (give the transcriber a larger max_new_tokens for turns this long)",
                           self.max_new_tokens)

    def warm_up(self, workspaces: int = 1) -> None:
        """Prepare the decoding of ``workspaces`` utterances at once (one per call that may
        transcribe at the same moment): that many one-row workspaces, and where utterances are
        batched (``batch_rows`` > 1) one workspace of a batch's rows, each with its buffers
        allocated and, on CUDA, every step captured now - not while a caller speaks (a capture
        then delays every call's reply); then a second of silence is transcribed, timing a batch
        (how long a batch waits for the turns announced as ending)."""
        from taste_speech.batched_steps import step_sizes

        if isinstance(workspaces, bool) or not isinstance(workspaces, int) or workspaces < 1:
            raise ValueError(f"workspaces must be an integer >= 1 (calls that may transcribe at once), got {workspaces!r}")
        silence = np.zeros(16000, np.float32)
        plan = self.plan
        if plan is None:  # (generate keeps no workspace)
            self.transcribe(silence)
            return
        try:  # the shared encoder's passes of every row count
            self._shared_encoder().warm_up()
        except Exception as error:  # the calls still transcribe: a failing pass fails their workspace
            logger.warning("warming up the shared Whisper encoder failed: %s", error, exc_info=True)
        together = min(workspaces, self._rows())
        rows = [1] * workspaces + ([next(n for n in step_sizes(self._rows()) if n >= together)] if together > 1 else [])
        ready = []
        try:
            for n in rows:
                workspace = self._borrow(plan, n, new=True)
                workspace.warm_up()
                ready.append(workspace)
        except Exception as error:  # the calls still transcribe: transcribe() falls back by itself
            batch_failed = rows[len(ready)] > 1
            logger.warning("warming up Whisper decoding workspace %d of %d failed%s: %s", len(ready) + 1, len(rows),
                           " (turns ending together are decoded one by one)" if batch_failed else "", error,
                           exc_info=True)
            if batch_failed:  # (every batch would try to make it again, and fail the same way)
                self.batch_rows = 1
                if self._batcher is not None:
                    self._batcher.rows = 1
        finally:
            for workspace in ready:
                self._give_back(workspace)
        self.transcribe(silence)  # (a batch, its steps captured: its time bounds the waits)

    def expect_turn(self, owner) -> None:
        """Announce ``owner``'s utterance (a turn that ended: ``TurnTranscript.ended``): a batch
        that starts before it comes waits for it a little."""
        if self.plan is not None:
            self._batches().expect(owner)

    def withdraw_turn(self, owner) -> None:
        """``owner``'s announced utterance will not come: nothing waits for it."""
        if self.plan is not None:
            self._batches().withdraw(owner)

    @property
    def encoder(self):
        """The ``EncoderGraph`` its passes run through (the audio tower's after ``share_encoder``),
        or None before the first workspace is made."""
        return self._encoder

    def encoder_stats(self) -> dict | None:
        """The shared encoder's turns and passes (``EncoderGraph.stats``), None before any."""
        return self._encoder.stats() if self._encoder is not None else None

    def batch_stats(self) -> dict | None:
        """The utterances decoded and the batches they took (``UtteranceBatcher.stats``), None before any."""
        return self._batcher.stats() if self._batcher is not None else None

    def encoder_matches(self, tower, processor) -> bool:
        """Whether this model's Whisper encoder makes the states ``tower``'s encoder makes, on the
        same window: Whisper's standard front end at the tower's window (``processor``'s mel bins
        and samples), and every encoder tensor equal to the tower's (names, shapes, dtype, device,
        values). The published checkpoint's tower froze Whisper-large-v3's encoder; a Whisper run
        in another dtype, or fine-tuned, does not match."""
        import torch

        config = self.model.config
        if not _standard_whisper_front_end(self.feature_extractor, config.num_mel_bins) or \
                (config.num_mel_bins, self.feature_extractor.n_samples) != (processor.n_mels, processor.max_samples):
            return False
        mine, theirs = self.model.model.encoder.state_dict(), tower.encoder.state_dict()
        if mine.keys() != theirs.keys():
            return False
        with torch.no_grad():
            return all(a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
                       for a, b in ((mine[k], theirs[k]) for k in mine))

    def share_encoder(self, tower_encoder) -> None:
        """Run the encoder passes through ``tower_encoder`` (the audio tower's ``EncoderGraph``, its
        encoder's weights this model's: ``encoder_matches``), and hand each turn's final encoding on
        (``TurnTranscript.encoded``). Workspaces made before are dropped (they hold the old encoder)."""
        with self._lock:
            self._encoder = tower_encoder
            self.shares_tower_encoder = True
            self._workspaces = []
            self._made = weakref.WeakSet()

    def new_turn(self) -> "TurnTranscript | None":
        """Incremental ASR state for one user turn, or None where partials would not help
        (``generate`` cannot reuse them)."""
        return TurnTranscript(self) if self.plan is not None else None

    # -- internals --------------------------------------------------------------------------------
    def _features(self, audio16k: np.ndarray):
        """The padded 30 s log-mel window (1, mels, 3000): the audio tower's front end where the
        feature extractor is Whisper's standard one (the same numbers to float rounding: it
        transforms the audio, not the silence after it - BENCHMARKS.md section 9), else (and for
        no audio at all: the silent window) the extractor itself."""
        from taste_speech.device_copies import to_device

        audio16k = _samples(audio16k)
        if audio16k.size and _standard_whisper_front_end(self.feature_extractor, self.model.config.num_mel_bins):
            from taste_speech.audio import whisper_log_mel

            features = whisper_log_mel(audio16k, n_mels=self.model.config.num_mel_bins,
                                       n_samples=self.feature_extractor.n_samples).transpose(1, 2)
        else:
            features = self.feature_extractor(audio16k, sampling_rate=16000, return_tensors="pt").input_features
        # (pinned on CUDA: the copy does not wait for the kernels queued before it, other calls')
        return to_device(features, self.device).to(next(self.model.parameters()).dtype)

    def _generate(self, features) -> list[int]:
        import torch

        kwargs = {} if self.max_new_tokens is None else {"max_new_tokens": self.max_new_tokens}
        if self.language is not None:
            kwargs.update(language=self.language, task="transcribe")
        with torch.inference_mode():
            return self.model.generate(features, **kwargs)[0].tolist()

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()

    def _rows(self) -> int:
        """Utterances one batch takes (``batch_rows``; 'auto' by where the weights are)."""
        if self.batch_rows == "auto":
            return CUDA_BATCH_ROWS if self.model.proj_out.weight.is_cuda else 1
        return self.batch_rows

    def _batches(self):
        from pipecat_taste.asr_batches import UtteranceBatcher

        with self._lock:
            if self._batcher is None:
                self._batcher = UtteranceBatcher(self._decode_batch, self._rows())
            return self._batcher

    def _decode_batch(self, batch) -> list[tuple[list[int], int]]:
        """(A batch's leader thread.) Decode ``batch`` (``asr_batches.Utterance``) in a workspace
        that holds it; a workspace that fails is dropped."""
        import torch

        plan = self.plan
        if plan is None:
            raise RuntimeError("the static Whisper loop was given up while these utterances waited")
        for utterance in batch:  # their features were made on their own threads' streams
            if utterance.ready is not None:
                torch.cuda.current_stream(utterance.features.device).wait_event(utterance.ready)
        results: list = []
        while len(results) < len(batch):  # (in parts where no free workspace holds the whole batch)
            workspace = self._borrow(plan, len(batch) - len(results))
            part = batch[len(results):len(results) + workspace.rows]
            try:
                results += workspace.decode_many([(u.features, u.draft, u.owner) for u in part])
            except BaseException:
                _settle(part[0].features)  # the dropped workspace's buffers are freed: its queued kernels end first
                raise
            self._give_back(workspace)
        return results

    def _borrow(self, plan, utterances: int = 1, new: bool = False):
        """A free workspace for ``utterances`` - its ``rows`` may hold fewer (the caller decodes the
        rest next): the smallest free one that holds them all; else, where one that large exists
        but another batch is in it, the largest free one; else a new one, of the batch's size the
        first time a batch that large comes (an engine not warmed up for it), of one row otherwise
        (more utterances at once than ``warm_up`` prepared for). ``new``: a new one of the batch's size."""
        from taste_speech.batched_steps import step_sizes

        from pipecat_taste.whisper_decode import StaticWhisperDecoder

        weight = self.model.proj_out.weight
        size = next(n for n in step_sizes(max(self._rows(), utterances)) if n >= utterances)
        with self._lock:
            # a workspace is bound to the weights' device and dtype (the model may have moved since)
            usable = lambda w: w.plan is plan and (w.device, w.dtype) == (weight.device, weight.dtype)  # noqa: E731
            self._workspaces = [w for w in self._workspaces if usable(w)]
            if not new:
                fitting = [w for w in self._workspaces if w.rows >= utterances]
                if fitting:
                    workspace = min(fitting, key=lambda w: w.rows)
                elif any(w.rows >= size for w in self._made if usable(w)):
                    workspace = max(self._workspaces, key=lambda w: w.rows, default=None)
                    size = 1
                else:
                    workspace = None
                if workspace is not None:
                    self._workspaces.remove(workspace)
                    return workspace
        workspace = StaticWhisperDecoder(self.model, plan, self.graph_mode, encoder=self._shared_encoder(), rows=size)
        with self._lock:
            self._made.add(workspace)
        return workspace

    def _shared_encoder(self):
        """The Whisper encoder as one ``EncoderGraph`` for every workspace (it follows the weights
        when they move or are cast). Its passes take up to a batch's rows; the batches gather the
        utterances, so the encoder waits for no announced turn of its own."""
        from taste_speech.encoder_graph import EncoderGraph

        from pipecat_taste.whisper_decode import WhisperEncoderStack

        with self._lock:
            if self._encoder is None:
                self._encoder = EncoderGraph(WhisperEncoderStack(self.model), self.graph_mode, rows=self._rows(),
                                             gather=0)
            return self._encoder

    def _give_back(self, workspace) -> None:
        with self._lock:
            if workspace.encoder is self._encoder:  # (one made before ``share_encoder`` is not used again)
                self._workspaces.append(workspace)


def _samples(audio16k) -> np.ndarray:
    """Float32 mono samples, int16 ones scaled as the tower's front end takes them (no audio: none,
    which transcribes the silent window)."""
    from taste_speech.audio import to_mono_float

    return to_mono_float(audio16k) if np.size(audio16k) else np.zeros(0, np.float32)


def _whisper_dtype(dtype, device):
    """None or 'auto': the way the spoken LM runs its Llama (bfloat16 on CUDA, float32 elsewhere);
    else a torch dtype or its name."""
    import torch

    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r} for the Whisper ASR: use 'auto', 'float32', 'bfloat16' or 'float16'")
        return getattr(torch, dtype)
    return dtype


def _standard_whisper_front_end(extractor, n_mels: int) -> bool:
    """Whether ``extractor`` computes what ``taste_speech.audio.whisper_log_mel`` does: openai
    Whisper's log-mel (400-sample window, 160 hop, 16 kHz, ``n_mels`` Slaney filters, zero padding,
    no dither)."""
    from taste_speech.audio import HOP_LENGTH, N_FFT, SAMPLE_RATE

    settings = (getattr(extractor, name, None) for name in
                ("n_fft", "hop_length", "sampling_rate", "feature_size", "padding_value", "dither"))
    return type(extractor).__name__ == "WhisperFeatureExtractor" and \
        tuple(settings) == (N_FFT, HOP_LENGTH, SAMPLE_RATE, n_mels, 0.0, 0.0)


def _settle(tensor) -> None:
    """Wait for this thread's queued GPU work (a workspace about to be dropped may be in use on this
    thread's stream, while its memory goes back to the stream that allocated it). Never raises: the
    error that brought us here is the one to report."""
    try:
        if tensor.is_cuda:
            import torch

            torch.cuda.current_stream(tensor.device).synchronize()
    except Exception:
        pass


class TurnTranscript:
    """Incremental ASR of one user turn (its own state; used from the call's listening thread).

    Why a draft and not "transcribe only the new audio and append": Whisper's transcript of the
    whole turn depends on all of its audio (one encoder pass over the turn, the decoder attends to
    all of it), so pieces transcribed apart and stitched together can differ from the full-turn
    transcript. Here every transcription, partial or final, encodes the whole audio so far (one
    encoder call); the previous partial's tokens are a draft that the decoder checks in a single
    pass, keeping the longest prefix it would itself produce and decoding only the rest token by
    token. The final transcript is therefore the full-turn greedy transcript (see
    ``whisper_decode`` for the one floating-point caveat), and after the end of the turn only the
    encoder, one verification pass and the tail (the words the last partial had not heard yet)
    are left.
    """

    def __init__(self, transcriber: WhisperTranscriber):
        self.transcriber = transcriber
        self.draft: list[int] = []
        self.text = ""  # the latest partial transcript
        self.partials = 0
        self.kept = 0  # draft tokens the final transcription kept
        # The audio tower's encoding of the whole turn, made by the final transcription's pass
        # (an EncodedTurn, when the transcriber shares the tower's encoder; else None)
        self.encoded = None
        self._encoding = None  # (outputs, ready) of the transcription running (``keep_encoding``)

    def ended(self) -> None:
        """The caller stopped speaking: ``finish`` comes next. A decoding batch that another call's
        turn ending now starts waits a little for this one's (``UtteranceBatcher.expect``)."""
        self.transcriber.expect_turn(self)

    def given_up(self) -> None:
        """``finish`` will not come after all (``ended`` announced it): nothing waits for it."""
        self.transcriber.withdraw_turn(self)

    def partial(self, audio16k: np.ndarray) -> str:
        """Transcribe the audio so far; its tokens become the draft of the next transcription."""
        # (as its owner: once the turn has ended, a pass leading this partial does not wait for the finish)
        result = self.transcriber.transcribe(audio16k, self.draft, owner=self)
        self._encoding = None  # (a partial's encoding is of no use to the tower)
        self.draft, self.text = result.ids, result.text
        self.partials += 1
        return result.text

    def finish(self, audio16k: np.ndarray) -> str:
        """The transcript of the whole turn (and, sharing the tower's encoder, its ``encoded``)."""
        from taste_speech.encoder_graph import EncodedTurn

        audio16k = _samples(audio16k)
        self._encoding = self.encoded = None
        result = self.transcriber.transcribe(audio16k, self.draft, owner=self)
        self.kept = result.kept
        encoding, self._encoding = self._encoding, None
        if encoding is not None and len(encoding[0]) == 2 and self.transcriber.shares_tower_encoder:
            self.encoded = EncodedTurn(audio16k, *encoding)  # (the tower's two outputs: its pass)
        return result.text

    def take_encoded(self):
        """The turn's ``encoded`` (or None), handed over once: the turn keeps no GPU memory after."""
        encoded, self.encoded = self.encoded, None
        return encoded

    def keep_encoding(self, outputs: tuple, ready=None) -> None:
        """(The decoding workspace, on the thread that ran the pass.) The encoder's outputs for this
        turn's transcription running now; ``ready``: on CUDA an event after them."""
        self._encoding = (outputs, ready)
