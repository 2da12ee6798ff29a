"""Greedy Whisper decoding with a preallocated cache and a captured one-token step.

``model.generate`` decodes with a growing cache (new shapes every token) and Python logits
processors: at batch 1 on a GPU the Whisper-large-v3 decoder spends ~30 ms per token launching
kernels (our H100 notes, docs/GPU.md). This loop keeps every tensor at a fixed address instead:

- the self-attention keys/values of a whole transcript are preallocated (``plan.max_length`` rows);
  a row is written at its position and every query sees only the keys at or before its own
  position, so stale rows from an earlier utterance or a rejected draft are never read;
- the cross-attention keys/values are computed once per utterance from the encoder output and
  written into fixed buffers (a captured step of their own); the encoder always sees one shape
  (the 30 s window), so it is a captured step too (eager, Whisper-large-v3's encoder is ~16 ms of
  launches on a GPU, the same for 3 s or 30 s of audio): an ``EncoderGraph`` the transcriber's
  workspaces share (``WhisperEncoderStack``), whose one pass encodes the turns of several calls
  that end together;
- the one-token step (embedding, all layers, logits, suppression, argmax) is a
  :class:`~taste_speech.step_graph.StepGraph`: replayed as a CUDA graph on CUDA, eager on CPU,
  'rehearse' for CPU tests of the capture protocol;
- a workspace holds ``rows`` utterances side by side (each row its own caches, token and
  position): the turns of calls that end together are decoded as one batch (``decode_many``); on
  a GPU, where a step at batch 1 is launch-bound, a row more costs little (the spoken LM's step:
  8 rows 4.4 ms, 1 row 2.9 ms on the H100, ``lm_batch``).

A *draft* (token ids from an earlier transcription of a prefix of the same audio, e.g. a partial
transcript taken while the user was still speaking) can be verified in one multi-row pass:
the longest prefix of the draft that greedy decoding would itself produce is kept, and decoding
goes on one token at a time after it. That pass (the start tokens and the draft) is padded to a
bucket of rows (``VERIFY_BUCKETS``, up to the transcript's length) and captured per bucket too: the padding rows sit after the
real ones, where no real row's query looks, and their keys/values are overwritten by the steps
that reach those positions.

Exactness: in exact arithmetic the ids are ``generate``'s, with or without a draft. In floating
point the loop's kernels (attention over the padded, masked cache; a multi-row pass for a draft)
round differently from ``generate``'s, so a step whose two best logits tie to within rounding can
pick the other token (then the transcripts differ from that token on). The CPU tests see identical
ids; on CUDA in bfloat16 near-ties are likelier (``test_whisper_decode`` has a CUDA test).

Settings supported (``greedy_plan`` returns the reason otherwise, and the caller uses
``generate``): one utterance per features tensor, short-form audio (<= 30 s, what the feature extractor gives), no
timestamps, greedy (``num_beams`` 1, no temperature fallback, no log-prob / no-speech /
compression thresholds), no prompt ids, no two timestamp tokens in a row in the output
(``splits_into_segments``: then ``generate`` runs for that utterance); the start tokens from ``language``/``task`` (or from the
config's ``forced_decoder_ids`` when neither is given, not language detection) plus
``<|notimestamps|>``; ``suppress_tokens`` and ``begin_suppress_tokens``; ``max_new_tokens`` or the
config's ``max_length``; a single ``eos_token_id``. No other logits processor (repetition penalty,
n-gram blocking, bad words, minimum length, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from taste_speech.device_copies import copy_in, to_device
from taste_speech.encoder_graph import event_after_current_work
from taste_speech.step_graph import StepGraph, all_captured, first_fallback_reason, resolve_mode, smallest_bucket

# Rows of the captured draft check (4 start tokens + the draft): these below the transcript's
# length, and the length itself as the last bucket, so that every draft's check is a captured step.
# (With buckets that stopped below the length, a check longer than the largest ran eagerly: in the
# GPU suite's 20-token transcripts, the whole 32-layer decoder over the rows, some 1300 operators
# of the ASR's tail at full size - benchmarks/bench_eager_ops.py, BENCHMARKS.md section 18.)
VERIFY_BUCKETS = (8, 16, 32, 64, 128, 256)


def verify_buckets(length: int) -> tuple[int, ...]:
    """The draft check's buckets for transcripts of at most ``length`` rows: ``VERIFY_BUCKETS`` below
    it, but for one within an eighth of it (a capture of its own for a few rows: 128 beside 132 at
    ``max_new_tokens=128``), and ``length``."""
    return tuple(b for b in VERIFY_BUCKETS if b + b // 8 < length) + (length,)


@dataclass(frozen=True)
class GreedyPlan:
    """What ``model.generate(features, **settings)`` would do, as plain numbers."""

    init_tokens: tuple[int, ...]  # decoder start, language, task, no-timestamps
    suppress_tokens: tuple[int, ...]  # never generated
    begin_suppress_tokens: tuple[int, ...]  # not generated as the first token
    eos_token_id: int
    pad_token_id: int | None
    max_length: int  # decoder length at most, start tokens included
    timestamp_begin: int  # the first timestamp token (<|notimestamps|> + 1)

    @property
    def max_new_tokens(self) -> int:
        return max(0, self.max_length - len(self.init_tokens))

    def finish(self, generated: list[int]) -> list[int]:
        """Token ids as ``generate`` returns them: padding, then the end-of-text token, dropped
        from the end (the same rule as transformers' Whisper post-processing)."""
        seq = list(generated)
        if seq and seq[-1] == self.pad_token_id:
            n = seq.count(self.pad_token_id) - (1 if self.pad_token_id == self.eos_token_id else 0)
            if n:
                seq = seq[:-n]
        if seq and seq[-1] == self.eos_token_id:
            seq = seq[:-1]
        return seq

    def splits_into_segments(self, ids: Sequence[int]) -> bool:
        """Whether ``generate`` would read ``ids`` as timestamped segments (two timestamp tokens in
        a row) and decode the audio after the last one again: this loop does not, so such a
        transcript must come from ``generate``. A model prompted with <|notimestamps|> almost
        never produces timestamp tokens."""
        return any(a >= self.timestamp_begin and b >= self.timestamp_begin for a, b in zip(ids, ids[1:]))


# Generation settings that add a logits processor or change the search: any non-default value
# means the loop would not match ``generate``.
_NEUTRAL = {
    "num_beams": (None, 1), "repetition_penalty": (None, 1.0), "encoder_repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0), "encoder_no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,),
    "min_length": (None, 0), "min_new_tokens": (None, 0), "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,), "sequence_bias": (None,), "exponential_decay_length_penalty": (None,),
    "guidance_scale": (None, 1.0), "watermarking_config": (None,), "return_timestamps": (None, False),
    "no_speech_threshold": (None,), "logprob_threshold": (None,), "compression_ratio_threshold": (None,),
    "stop_strings": (None,), "max_time": (None,), "renormalize_logits": (None, False),
}


def greedy_plan(model, language: str | None = None, task: str | None = None,
                max_new_tokens: int | None = None) -> GreedyPlan | str:
    """The plan for ``model.generate(features, language=..., task=..., max_new_tokens=...)``, or
    a sentence saying why this loop does not apply (then use ``generate``)."""
    gc, config = model.generation_config, model.config
    for name, neutral in _NEUTRAL.items():
        if getattr(gc, name, None) not in neutral:
            return f"generation setting {name}={getattr(gc, name)!r} is not supported by the static loop"
    eos = gc.eos_token_id
    if isinstance(eos, (list, tuple)):
        if len(eos) != 1:
            return "several end-of-text tokens are not supported by the static loop"
        eos = eos[0]
    if eos is None or gc.decoder_start_token_id is None:
        return "the generation config has no eos_token_id or decoder_start_token_id"
    language = language if language is not None else getattr(gc, "language", None)
    task = task if task is not None else getattr(gc, "task", None)
    if (language is not None or task is not None) and getattr(gc, "is_multilingual", True) is False:
        return "language/task given for an English-only model (generate raises)"
    if isinstance(language, (list, tuple)):
        return "a language per batch item is not supported by the static loop"

    init: list = [gc.decoder_start_token_id]
    if language is None and task is None:
        forced = getattr(gc, "forced_decoder_ids", None) or getattr(config, "forced_decoder_ids", None)
        if forced and forced[0][0] == 1:  # (position, token) pairs right after the start token
            for i, (position, token) in enumerate(forced, start=1):
                if position != i:
                    return "forced_decoder_ids that do not follow the start token are not supported"
                init.append(token)
    if language is not None:
        lang_id = _language_id(gc, language)
        if isinstance(lang_id, str):
            return lang_id
        if len(init) > 1:
            init[1] = lang_id
        else:
            init.append(lang_id)
    elif hasattr(gc, "lang_to_id") and (len(init) <= 1 or init[1] is None):
        return "no language given: generate would detect it (not supported by the static loop)"
    task_to_id = getattr(gc, "task_to_id", None)
    if task is not None:
        if not task_to_id or task not in task_to_id:
            return f"task {task!r} is not in the generation config's task_to_id"
        init.append(task_to_id[task])
    elif language is not None and task_to_id and not any(t in init for t in task_to_id.values()):
        init.append(task_to_id["transcribe"])
    no_timestamps = getattr(gc, "no_timestamps_token_id", None)
    if no_timestamps is not None and init[-1] != no_timestamps:
        init.append(no_timestamps)
    init = [t for t in init if t is not None]

    limit = config.max_target_positions
    if max_new_tokens is None:
        max_new_tokens = getattr(gc, "max_new_tokens", None)
    if max_new_tokens is not None:
        if max_new_tokens + len(init) > limit:
            return f"max_new_tokens={max_new_tokens} plus {len(init)} start tokens exceed the decoder's {limit} positions"
        max_length = len(init) + max_new_tokens
    else:
        max_length = min((gc.max_length or 20) + min(limit // 2 - 1, len(init)), limit)
    timestamp_begin = no_timestamps + 1 if no_timestamps is not None else config.vocab_size + 1
    return GreedyPlan(tuple(int(t) for t in init), tuple(gc.suppress_tokens or ()),
                      tuple(gc.begin_suppress_tokens or ()), int(eos), gc.pad_token_id, int(max_length),
                      int(timestamp_begin))


def _language_id(gc, language: str) -> int | str:
    from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

    lang_to_id = getattr(gc, "lang_to_id", None)
    if not lang_to_id:
        return "language given but the generation config has no lang_to_id"
    language = language.lower()
    if language in lang_to_id:
        token = language
    elif language in TO_LANGUAGE_CODE:
        token = f"<|{TO_LANGUAGE_CODE[language]}|>"
    else:
        token = f"<|{language}|>"
    if token not in lang_to_id:
        return f"language {language!r} is not in the generation config's lang_to_id"
    return lang_to_id[token]


class WhisperEncoderStack:
    """A transformers Whisper model's encoder with the audio tower's encoder interface, for an
    ``EncoderGraph``: the padded 30 s log-mel window (rows, mels, 3000) -> (last_hidden_state,)."""

    def __init__(self, model):
        self.encoder = model.model.encoder
        self.whisper_config = model.config
        self.num_frames = 2 * model.config.max_source_positions

    def encoder_stack(self, window: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.encoder(window).last_hidden_state,)


class StaticWhisperDecoder:
    """One decoding workspace (buffers + captured steps) for up to ``rows`` utterances decoded
    together: the turns of calls that end at the same moment go through every step as one batch
    (a step at batch 1 is launch-bound on a GPU: a row more costs little). Each row has its
    own keys/values, cross keys/values, token and position. A transcriber shared by concurrent
    calls keeps several workspaces; they share the ``encoder`` (an ``EncoderGraph`` of
    ``WhisperEncoderStack``; None: one of their own).

    A step over m utterances runs the first n rows, n the smallest of ``sizes`` (1, 2, 4 ...
    ``rows``) that holds them, one captured graph per n; a row without an utterance, or whose
    utterance has ended, feeds end-of-text at position 0 of its own cache, which no later step of
    this decode reads (a new decode writes its rows again)."""

    def __init__(self, model, plan: GreedyPlan, graph_mode: str = "auto", encoder=None, rows: int = 1):
        from taste_speech.batched_steps import step_sizes
        from taste_speech.encoder_graph import EncoderGraph

        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows must be an integer >= 1 (utterances decoded together), got {rows!r}")
        self.model, self.plan, self.rows = model, plan, rows
        self.sizes = step_sizes(rows)
        self.decoder = model.model.decoder
        weight = model.proj_out.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.graph_mode = resolve_mode(graph_mode, self.device)
        config = model.config
        self.heads = config.decoder_attention_heads
        self.head_dim = config.d_model // self.heads
        length, sources = plan.max_length, config.max_source_positions
        zeros = lambda n: torch.zeros(rows, self.heads, n, self.head_dim, device=self.device, dtype=self.dtype)  # noqa: E731
        layers = len(self.decoder.layers)
        self.self_k, self.self_v = [zeros(length) for _ in range(layers)], [zeros(length) for _ in range(layers)]
        self.cross_k, self.cross_v = [zeros(sources) for _ in range(layers)], [zeros(sources) for _ in range(layers)]
        self.key_positions = torch.arange(length, device=self.device)
        self.row_ids = torch.arange(rows, device=self.device).unsqueeze(1)  # (rows, 1): each row's own cache
        self.suppress_bias = self._bias(plan.suppress_tokens)
        self.begin_bias = self._bias(plan.begin_suppress_tokens)
        # The one-token step's inputs: each row's token to feed and its position (device tensors).
        # Its only side effect is writing the keys/values of those positions, which the real run
        # writes again: the warm-up runs need no rewind.
        self.token = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        self.position = torch.zeros(rows, dtype=torch.long, device=self.device)
        # The utterances' encodings: the encoder's outputs in, the cross keys/values written (again
        # the same values on a re-run: no rewind either).
        self.encoder = encoder if encoder is not None else EncoderGraph(WhisperEncoderStack(model), graph_mode)
        self.states = torch.zeros(rows, sources, config.d_model, device=self.device, dtype=self.dtype)
        # The draft check per bucket of rows: each row's tokens in (padding: end-of-text), the greedy
        # token after each of them out; it writes the keys/values of positions 0..bucket-1, which the
        # real run writes again (no rewind). (Eager, padding would only add work: the check runs at
        # the longest row's length.)
        self.verify_buckets = () if self.graph_mode == "eager" else \
            verify_buckets(length)
        self._check_tokens = {bucket: torch.full((rows, bucket), plan.eos_token_id, dtype=torch.long,
                                                 device=self.device) for bucket in self.verify_buckets}
        # Every graph of the workspace, made when first run: ('step', n), ('cross', n), ('check', n, bucket).
        # They share one memory pool: one thread at a time uses a workspace, and reads each output
        # before the next graph runs.
        self._graphs: dict[tuple, StepGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.graph_mode == "graph" else None

    def _bias(self, tokens: Sequence[int]) -> torch.Tensor:
        vocab = self.model.proj_out.out_features
        bias = torch.zeros(vocab, dtype=torch.float32, device=self.device)
        ids = [t for t in tokens if 0 <= t < vocab]
        if ids:
            bias[torch.tensor(ids, device=self.device)] = float("-inf")
        return bias

    @property
    def captured(self) -> bool:
        """Every graph made so far (and the shared encoder's) is captured, and some were made."""
        return all_captured(self._graphs.values()) and self.encoder.captured

    @property
    def fallback_reason(self) -> str | None:
        return first_fallback_reason(self._graphs.values()) or self.encoder.fallback_reason

    def _graph(self, key: tuple) -> StepGraph:
        if key not in self._graphs:
            kind, n = key[:2]
            if kind == "step":
                step, name = (lambda: self._one_token(n)), f"Whisper decoder step x{n}"
            elif kind == "cross":
                step, name = (lambda: self._cross_keys_values(n)), f"Whisper cross keys/values x{n}"
            else:
                bucket = key[2]
                step, name = (lambda: self._check(n, bucket)), f"Whisper draft check x{n} ({bucket} rows)"
            self._graphs[key] = StepGraph(step, self.device, self.graph_mode, pool=self._pool, name=name)
        return self._graphs[key]

    def _size(self, utterances: int) -> int:
        """The step size (rows run) for ``utterances`` utterances."""
        if utterances > self.rows:
            raise ValueError(f"{utterances} utterances do not fit a workspace of {self.rows} rows")
        return next(n for n in self.sizes if n >= utterances)

    # -- the transformer --------------------------------------------------------------------------
    def _rows(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states (n, T, d) of ``tokens`` (n, T) at ``positions`` (n, T) in the first n rows,
        writing their self-attention keys/values. Same operations, in the same order, as
        transformers' WhisperDecoder (pre-norm layers, query scaled before attention), graph-safe."""
        dec, (n, t) = self.decoder, tokens.shape
        x = dec.embed_tokens(tokens) + dec.embed_positions.weight[positions]
        visible = (self.key_positions <= positions.unsqueeze(-1)).unsqueeze(1)  # (n, 1, T, length)
        rows = self.row_ids[:n]
        for i, layer in enumerate(dec.layers):
            attn = layer.self_attn
            h = layer.self_attn_layer_norm(x)
            q = self._heads(attn.q_proj(h) * attn.scaling)
            keys, values = self.self_k[i][:n], self.self_v[i][:n]
            keys[rows, :, positions] = attn.k_proj(h).view(n, t, self.heads, self.head_dim)
            values[rows, :, positions] = attn.v_proj(h).view(n, t, self.heads, self.head_dim)
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=1.0)
            x = x + attn.out_proj(o.transpose(1, 2).reshape(n, t, -1))
            cross = layer.encoder_attn
            h = layer.encoder_attn_layer_norm(x)
            q = self._heads(cross.q_proj(h) * cross.scaling)
            o = F.scaled_dot_product_attention(q, self.cross_k[i][:n], self.cross_v[i][:n], scale=1.0)
            x = x + cross.out_proj(o.transpose(1, 2).reshape(n, t, -1))
            h = layer.final_layer_norm(x)
            x = x + layer.fc2(layer.activation_fn(layer.fc1(h)))
        return dec.layer_norm(x)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        n, t = x.shape[:2]
        return x.view(n, t, self.heads, self.head_dim).transpose(1, 2).contiguous()

    def _scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, T, vocab) float32 logits with the always-suppressed tokens at -inf."""
        return self.model.proj_out(hidden).float() + self.suppress_bias

    def _one_token(self, n: int) -> torch.Tensor:
        """The captured step: each of the first ``n`` rows' next token (n,) after its ``token`` at its ``position``."""
        return self._scores(self._rows(self.token[:n], self.position[:n].unsqueeze(1)))[:, 0].argmax(-1)

    def _cross_keys_values(self, n: int) -> torch.Tensor:
        """The captured step: the first ``n`` rows of ``states`` (the encoder's outputs) -> every
        layer's cross-attention keys/values."""
        states = self.states[:n]
        for i, layer in enumerate(self.decoder.layers):
            cross = layer.encoder_attn
            self.cross_k[i][:n].copy_(self._heads(cross.k_proj(states)))
            self.cross_v[i][:n].copy_(self._heads(cross.v_proj(states)))
        return self.cross_v[-1]

    def _check(self, n: int, bucket: int) -> torch.Tensor:
        """The captured draft check of the first ``n`` rows: the greedy token after each of their
        ``bucket`` tokens from the last start token on."""
        return self._greedy_after_start(self._rows(self._check_tokens[bucket][:n],
                                                   self.key_positions[:bucket].expand(n, bucket)))

    def _greedy_after_start(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy token after each row of ``hidden`` (n, T, d) from the last start token on (the
        first with the begin suppression)."""
        scores = self._scores(hidden[:, len(self.plan.init_tokens) - 1:])
        scores[:, 0] += self.begin_bias
        return scores.argmax(-1)

    def _check_drafts(self, rows: list[list[int]]) -> list[list[int]]:
        """For each utterance's tokens (start tokens + draft), the greedy token after each of them
        from the last start token on: one pass for all, captured where a bucket holds the longest."""
        first, eos = len(self.plan.init_tokens) - 1, self.plan.eos_token_id
        n, longest = self._size(len(rows)), max(len(r) for r in rows)
        bucket = smallest_bucket(self.verify_buckets, longest)
        width = bucket or longest
        padded = torch.tensor([r + [eos] * (width - len(r)) for r in rows] + [[eos] * width] * (n - len(rows)))
        if bucket is None:
            padded = to_device(padded, self.device)
            predicted = self._greedy_after_start(self._rows(padded, self.key_positions[:width].expand(n, width)))
        else:
            copy_in(self._check_tokens[bucket][:n], padded)
            predicted = self._graph(("check", n, bucket)).run()
        predicted = predicted.tolist()
        return [predicted[i][:len(r) - first] for i, r in enumerate(rows)]

    def warm_up(self) -> None:
        """Run (capture, on CUDA) every graph of every step size now - the cross keys/values, the
        one-token step and the draft check of every bucket - so that no utterance pays for a capture
        (their rows: end-of-text at the first positions; a real decode writes its rows again)."""
        with torch.inference_mode():
            self.token.fill_(self.plan.eos_token_id)
            self.position.zero_()
            for n in reversed(self.sizes):  # largest first: the others reuse its pool memory
                self._graph(("cross", n)).run()
                self._graph(("step", n)).run()
                for bucket in self.verify_buckets:
                    self._check_tokens[bucket].fill_(self.plan.eos_token_id)
                    self._graph(("check", n, bucket)).run()

    # -- decoding ---------------------------------------------------------------------------------
    def decode(self, features: torch.Tensor, draft: Sequence[int] = (), owner=None) -> tuple[list[int], int]:
        """Greedy token ids for ``features`` (1, mels, 3000), as ``generate`` returns them, and
        how many tokens of ``draft`` were verified and kept. ``owner``: who brings it to the
        shared encoder, if anyone."""
        return self.decode_many([(features, draft, owner)])[0]

    def decode_many(self, utterances: list[tuple]) -> list[tuple[list[int], int]]:
        """``decode`` for several utterances at once, each ``(features, draft, owner)``; at most
        ``rows`` of them. Each gets what it gets decoded alone: its rows never see another's (in
        exact arithmetic; the CPU tests see identical ids - on CUDA in bfloat16 a batch's other
        matrix shapes may round a near-tie the other way, as the module's docstring says)."""
        plan, eos = self.plan, self.plan.eos_token_id
        room = plan.max_new_tokens
        n = self._size(len(utterances))
        if room == 0:
            return [([], 0) for _ in utterances]
        with torch.inference_mode():
            self._encode([u[0] for u in utterances], [u[2] if len(u) > 2 else None for u in utterances], n)
            drafts = [[int(t) for t in u[1]][: room - 1] for u in utterances]
            checked = self._check_drafts([list(plan.init_tokens) + draft for draft in drafts])
            generated = []
            for predicted, draft in zip(checked, drafts):  # accept each draft while greedy decoding agrees
                tokens: list[int] = []
                for token in predicted:
                    tokens.append(token)
                    k = len(tokens) - 1
                    if token == eos or len(tokens) == room or k >= len(draft) or token != draft[k]:
                        break
                generated.append(tokens)
            kept = [_common_prefix(tokens, draft) for tokens, draft in zip(generated, drafts)]
            live = lambda tokens: tokens[-1] != eos and len(tokens) < room  # noqa: E731
            start = len(plan.init_tokens) - 1
            while active := [i for i, tokens in enumerate(generated) if live(tokens)]:
                feed, at = [eos] * n, [0] * n  # idle and ended rows: end-of-text at position 0 of their own cache
                for i in active:
                    feed[i], at[i] = generated[i][-1], start + len(generated[i])
                copy_in(self.token[:n, 0], feed)  # (no wait for the GPU before the step: its read is the wait)
                copy_in(self.position[:n], at)
                out = self._graph(("step", n)).run().tolist()
                for i in active:
                    generated[i].append(out[i])
        return [(plan.finish(tokens), k) for tokens, k in zip(generated, kept)]

    def _encode(self, features: list[torch.Tensor], owners: list, n: int) -> None:
        config = self.model.config
        expected = (1, config.num_mel_bins, 2 * config.max_source_positions)
        for feats in features:
            if tuple(feats.shape) != expected:
                raise ValueError(f"Whisper features must be {expected} (the padded 30 s window), "
                                 f"got {tuple(feats.shape)}: use the model's feature extractor")
        windows = [to_device(feats, self.device).to(self.dtype) for feats in features]
        encoded = self.encoder.encode(windows, owners)
        keeps = [getattr(owner, "keep_encoding", None) for owner in owners]  # (TurnTranscripts: the tower may use them)
        # (an owner may read its outputs on another stream: after this event)
        ready = event_after_current_work(self.device) if any(keeps) else None
        for row, (keep, outputs) in enumerate(zip(keeps, encoded)):
            self.states[row:row + 1].copy_(outputs[-1])  # the last layer's states (the tower's stack: its 2nd output)
            if keep is not None:
                keep(outputs, ready)
        self._graph(("cross", n)).run()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
