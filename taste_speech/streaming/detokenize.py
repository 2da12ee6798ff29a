"""taste_detokenize: one segment of LLM output (text ids + TASTE codes) -> speech audio.

Pipeline per segment (spec §6-§7):

1. the segment's Llama-token words (with the previous segment's words before them) are
   re-tokenised into Whisper (ASR) tokens by the processor; each word's TASTE codes are spread
   onto its ASR tokens and turned into TASTE embeddings with the audio tower's RVQ;
2. the speech decoder reads ``[SOS, speaker, fused(previous + current words), TASK]``, is
   force-fed the previous segment's speech tokens (so the new tokens continue that utterance;
   with a ``state`` only that segment's, whatever ``prev_speech_ids`` holds before them),
   then generates the new speech tokens one at a time (KV cache, top-25 sampling);
3. the new speech tokens stream into the voice generator (:mod:`taste_speech.streaming.synthesis`)
   as they are generated; audio chunks come out as soon as the emission policy allows.

Continuity across segments. Two ways:

* keep the returned ``state`` and pass it to the next call with ``final=False`` on every segment
  but the last (or call :func:`finish_speaking`): the voice generator continues seamlessly (same
  noise tapes, carried source phase, mel/waveform cross-fades); the audio held back for the
  cross-fade is emitted by the next call;
* stateless (``state=None``, the reference API): the tail of ``prev_speech_ids`` is re-synthesised
  as left context and not emitted; the audio starts at ``prev_audio_ms`` of the utterance. The
  previous call ended with a fade-out and this one fades in, so the join is a short dip rather
  than a click.

The VoiceGenerator is passed in (``voice_generator=``) or taken from ``processor.get_generator()``
(loaded once, on the speech decoder's device); it is not part of TasteForCausalLM (separate weight file, separate
device placement, and the LM never needs it).
"""

from __future__ import annotations

import math
from typing import Iterator, Optional

import torch

from taste_speech.device_copies import to_device
from taste_speech.espnet_transformer import MAX_CACHED_POSITIONS
from taste_speech.processing_taste import as_speaker_embedding
from taste_speech.sampler import check_generator
from taste_speech.streaming.synthesis import IN_USE, SpeechChunk, SynthesisFailed, speak, speak_held, start_speaking
from taste_speech.streaming.synthesis_state import (
    SAMPLES_PER_FRAME,
    SOURCE_RATE,
    EmissionPolicy,
    SynthesisState,
    frames_for_tokens,
)
from taste_speech.streaming.tokenize import check_llm_ids, check_no_special_ids
from taste_speech.voice_generator import VoiceGenerator

IGNORE = -1
PREV_AUDIO_TOLERANCE_MS = 30.0  # rounding of durations summed by the caller, plus one mel frame


def resolve_voice_generator(processor, voice_generator: Optional[VoiceGenerator], device) -> VoiceGenerator:
    if voice_generator is None:
        getter = getattr(processor, "get_generator", None)
        if not callable(getter):
            raise ValueError(
                "taste_detokenize needs the voice generator: pass voice_generator=VoiceGenerator.from_pretrained("
                "checkpoint_dir) (loaded once and reused), or a TasteProcessor, whose get_generator() loads it")
        voice_generator = getter(device=device)
    dtype = next(voice_generator.parameters()).dtype
    if dtype != torch.float32:  # its flow and vocoder need float32 (parity; the F0 and phase sums)
        raise ValueError(f"the voice generator's weights are {dtype}; it runs in float32 only - use "
                         "voice_generator.float() (the LM may run in bfloat16: from_pretrained(torch_dtype=...))")
    return voice_generator


def _as_ids(value, name: str, allow_empty: bool) -> torch.Tensor:
    if value is None:
        return torch.zeros(1, 0, dtype=torch.long)
    value = torch.as_tensor(value)
    if value.dim() != 2 or value.shape[0] != 1:
        raise ValueError(f"{name} must have shape (1, S), got {tuple(value.shape)}")
    if value.is_floating_point() or value.dtype == torch.bool:
        raise ValueError(f"{name} must be integer ids, got {value.dtype}")
    if not allow_empty and value.shape[1] == 0:
        raise ValueError(f"{name} is empty: a segment needs at least one word")
    return value.long().cpu()  # host bookkeeping (word rows, history); the model copies what it needs


def _as_codes(value, n: int, name: str, k: Optional[int]) -> torch.Tensor:
    if value is None:
        if n:
            raise ValueError(f"{name} is missing but its text ids are not empty")
        return torch.zeros(1, 0, k or 1, dtype=torch.long)
    value = torch.as_tensor(value)
    if value.dim() != 3 or value.shape[0] != 1 or value.is_floating_point() or value.dtype == torch.bool:
        raise ValueError(f"{name} must be integer codes of shape (1, S, K), got {value.dtype} {tuple(value.shape)}")
    if value.shape[1] != n:
        raise ValueError(f"{name} has {value.shape[1]} rows but its text ids have {n}: they must align one row per token")
    return value.long().cpu()  # (codes from extract_vq on a GPU come back there)


def _check_word_rows(processor, text_ids: torch.Tensor, taste_ids: torch.Tensor, name: str) -> None:
    """Codes must sit exactly on the word-start tokens (IGNORE rows elsewhere)."""
    if text_ids.shape[1] == 0:
        return
    starts = torch.zeros(text_ids.shape[1], dtype=torch.bool)
    position = 0
    for group in processor.words_from_llm_ids(text_ids):
        starts[position] = True
        position += len(group)
    has_code = taste_ids[0, :, 0] != IGNORE
    if not torch.equal(has_code, starts):
        raise ValueError(
            f"{name}: TASTE codes must be on the first token of every word and IGNORE (-1) elsewhere; got codes at "
            f"rows {has_code.nonzero().view(-1).tolist()} for word starts {starts.nonzero().view(-1).tolist()}"
        )


def _check_words_add_up(processor, prev_text_ids: torch.Tensor, text_ids: torch.Tensor) -> None:
    """The previous segment's words, then this one's: a segment that goes on with the last word of
    ``prev`` (its first token has no leading space, as a new reply's first token may) cannot be
    aligned with both segments' codes."""
    if prev_text_ids.shape[1] == 0:
        return
    apart = len(processor.words_from_llm_ids(prev_text_ids)) + len(processor.words_from_llm_ids(text_ids))
    if len(processor.words_from_llm_ids(torch.cat([prev_text_ids, text_ids], dim=1))) != apart:
        raise ValueError("text_ids continue the last word of prev_text_ids (their first token starts no new word): "
                         "prev_* must be the previous segment of the same utterance; start a new reply's speech "
                         "with empty prev_* (None)")


def _as_prev_audio_ms(value) -> float:
    try:
        ms = float(value)
    except (TypeError, ValueError):
        ms = math.nan
    if not math.isfinite(ms) or ms < 0:
        raise ValueError(f"prev_audio_ms must be a finite number of milliseconds >= 0 (0 for the first segment), "
                         f"got {value!r}")
    return ms


def _check_stateless_prev_audio(prev_speech_ids: torch.Tensor, prev_audio_ms: float) -> None:
    """Without a state the audio restarts at ``prev_audio_ms``: it must lie within the previous tokens' audio."""
    n_prev = prev_speech_ids.shape[1]
    available_ms = 1000.0 * frames_for_tokens(n_prev) * SAMPLES_PER_FRAME / SOURCE_RATE
    if prev_audio_ms > available_ms + PREV_AUDIO_TOLERANCE_MS:
        raise ValueError(f"prev_audio_ms={prev_audio_ms:.1f} but prev_speech_ids ({n_prev} tokens) make only "
                         f"{available_ms:.1f} ms of audio: pass the duration of the audio played for those tokens "
                         "(the sum of the previous calls' chunk_duration_ms)")


def _stateless_start(vg, speaker_embeds, policy, out_sampling_rate, generator, prev_speech_ids, prev_audio_ms):
    """A fresh state primed with the tail of the previous speech tokens (computed up to
    ``prev_audio_ms``, not emitted), and the chunks that priming made beyond that point: when less
    was played than the previous tokens make, the audio goes on from where it stopped."""
    state = start_speaking(vg, speaker_embeds, policy, out_sampling_rate, generator)
    n_prev = prev_speech_ids.shape[1]
    if n_prev == 0 and prev_audio_ms <= 0:
        return state, []
    # audio of the previous tokens runs to sample 256 * frames(n_prev); what was played may differ
    played = round(prev_audio_ms * SOURCE_RATE / 1000)
    context = state.policy.context_tokens
    start = max(0, n_prev - context - state.policy.first_chunk_tokens)
    while start > 0 and frames_for_tokens(start + context) * SAMPLES_PER_FRAME > played:
        start -= 1  # less was played: the tail begins a context before that point, to go on from there
    tail = prev_speech_ids[:, start:]
    state.tokens_before = start  # the state continues the utterance's frame grid
    overshoot = played - frames_for_tokens(n_prev) * SAMPLES_PER_FRAME
    state.skip_until_sample = max(0, state.frames(tail.shape[1]) * SAMPLES_PER_FRAME + overshoot)
    state.audio_ms_before = prev_audio_ms
    primed = speak(vg, state, tail) if tail.shape[1] else []
    return state, [chunk for chunk in primed if chunk.audio.shape[-1]]


def _hold(state: SynthesisState) -> SynthesisState:
    """Take ``state`` for this stream (released when the stream ends or is closed)."""
    if not isinstance(state, SynthesisState):
        raise ValueError(f"state must be the 'state' a previous taste_detokenize call returned, got {type(state).__name__}")
    if not state.in_use.acquire(blocking=False):
        raise RuntimeError(IN_USE)
    return state


def _check_state(state: SynthesisState, speaker_embeds, prev_speech_ids: torch.Tensor, prev_audio_ms: float,
                 prev_text_ids: torch.Tensor, prev_taste_ids: torch.Tensor, policy) -> None:
    if not isinstance(state, SynthesisState):
        raise ValueError(f"state must be the 'state' a previous taste_detokenize call returned, got {type(state).__name__}")
    if state.finished:
        raise ValueError("the given state already ended (its last call had final=True); pass final=False on every "
                         "segment but the last of an utterance, or start without a state")
    # (before the token count below: a state left part-way has taken tokens no 'speech_ids' returned)
    if state.failure is not None:
        raise ValueError(f"the given state's synthesis failed earlier ({state.failure}): it cannot go on; play the "
                         "audio the failure carried (SynthesisFailed.audio) and go on without a state (state=None: "
                         "a new utterance, or this one continued from its prev_speech_ids)")
    if state.segment_open:
        raise ValueError("the given state's last segment was left part-way (its taste_detokenize_stream was closed "
                         "before its last chunk, e.g. at a barge-in, or the speech decoder failed in it): it cannot "
                         "take another segment; "
                         "finish_speaking(voice_generator, state) fades out what it holds, then go on without a "
                         "state (state=None)")
    if not torch.allclose(state.speaker_embeds.cpu().float(), speaker_embeds.cpu().float(), atol=1e-5):
        raise ValueError("speaker_embeds differ from the ones this state was started with: one state per voice")
    n_prev = prev_speech_ids.shape[1]
    if n_prev == 0 and state.tokens_before + state.n_tokens:
        raise ValueError(f"this state belongs to an utterance under way ({state.tokens_before + state.n_tokens} speech "
                         "tokens spoken) but prev_speech_ids is empty: a new reply starts with state=None (end the "
                         "old one with finish_speaking(voice_generator, state)); to go on with this utterance, pass "
                         "the 'speech_ids' returned with the state")
    if n_prev != state.tokens_before + state.n_tokens:
        raise ValueError(f"prev_speech_ids has {n_prev} tokens but the state covers {state.tokens_before + state.n_tokens}:"
                         " pass the 'speech_ids' returned by the previous call together with its 'state'")
    kept = state.tokens[0].cpu()
    if n_prev and not torch.equal(prev_speech_ids[0, n_prev - kept.shape[0]:].cpu(), kept):
        raise ValueError("prev_speech_ids do not end with the speech tokens this state synthesised")
    if state.segment_words is not None:  # the decoder reads these words before the new ones
        text_ids, taste_ids = state.segment_words
        if not (torch.equal(prev_text_ids, text_ids) and torch.equal(prev_taste_ids, taste_ids)):
            raise ValueError("prev_text_ids / prev_taste_ids are not the segment this state spoke last: pass the "
                             "text_ids and taste_ids of the call that returned this state")
    if policy is not None and EmissionPolicy.resolve(policy) != state.policy:
        raise ValueError(f"policy={policy!r} differs from the policy this state was started with: a state keeps "
                         "its policy for the whole utterance (leave policy out, or start a new state)")
    # The output resampler holds back some of what was synthesised, so the audio returned so far
    # (what the caller can have summed) is a little shorter than the audio synthesised; accept both.
    returned_ms = state.audio_ms_before + 1000.0 * state.out_samples_emitted / state.out_sampling_rate
    synthesised_ms = state.audio_ms_before + state.emitted_ms
    if not returned_ms - PREV_AUDIO_TOLERANCE_MS <= prev_audio_ms <= synthesised_ms + PREV_AUDIO_TOLERANCE_MS:
        raise ValueError(f"prev_audio_ms={prev_audio_ms:.1f} but the audio returned with this state so far lasts "
                         f"{returned_ms:.1f} ms; pass the total duration of the utterance's audio played so far "
                         "(the sum of the returned chunk_duration_ms)")


@torch.inference_mode()
def taste_detokenize_stream(
    model,
    processor,
    speaker_embeds: torch.Tensor,
    prev_text_ids,
    prev_taste_ids,
    prev_speech_ids,
    prev_audio_ms: float,
    text_ids,
    taste_ids,
    out_sampling_rate: int = 16000,
    *,
    voice_generator: Optional[VoiceGenerator] = None,
    state: Optional[SynthesisState] = None,
    final: bool = True,
    policy: EmissionPolicy | str | None = None,
    sampler=None,
    generator: Optional[torch.Generator] = None,
    decoder_cache=None,
) -> Iterator[dict]:
    """Like :func:`taste_detokenize`, yielding audio chunks while the speech tokens are generated.

    Each item: ``audio_waveform`` (1, n), ``sampling_rate``, ``chunk_duration_ms``, ``speech_ids`` (1, Q + s):
    ``prev_speech_ids`` and the new speech tokens generated so far - the last item's is the next call's
    ``prev_speech_ids``, as ``taste_detokenize`` returns it - ``new_speech_ids`` (1, s) those new tokens,
    ``is_final`` (last chunk of this call), ``state``.
    """
    from taste_speech.modeling_speech_decoder import TopKSampler

    check_generator(generator)
    vg = resolve_voice_generator(processor, voice_generator, model.speech_decoder.device)
    speaker_embeds = as_speaker_embedding(speaker_embeds, model.speech_decoder.spk_embed_dim)
    text_ids = _as_ids(text_ids, "text_ids", allow_empty=False)
    taste_ids = _as_codes(taste_ids, text_ids.shape[1], "taste_ids", None)
    prev_text_ids = _as_ids(prev_text_ids, "prev_text_ids", allow_empty=True)
    prev_taste_ids = _as_codes(prev_taste_ids, prev_text_ids.shape[1], "prev_taste_ids", taste_ids.shape[2])
    prev_speech_ids = _as_ids(prev_speech_ids, "prev_speech_ids", allow_empty=True)
    if prev_taste_ids.shape[1] and prev_taste_ids.shape[2] != taste_ids.shape[2]:
        raise ValueError(f"prev_taste_ids has K={prev_taste_ids.shape[2]} codes per row, taste_ids K={taste_ids.shape[2]}")
    for ids, name in ((text_ids, "text_ids"), (prev_text_ids, "prev_text_ids")):
        check_llm_ids(processor, ids, name)
        check_no_special_ids(processor, ids, name)
    prev_audio_ms = _as_prev_audio_ms(prev_audio_ms)
    decoder = model.speech_decoder
    if prev_speech_ids.shape[1] and bool(((prev_speech_ids < 0) | (prev_speech_ids >= decoder.speech_token_size)).any()):
        raise ValueError(f"prev_speech_ids must lie in [0, {decoder.speech_token_size})")
    if decoder.speech_token_size > vg.flow.vocab_size:
        raise ValueError(f"the speech decoder emits {decoder.speech_token_size} token ids but the voice generator "
                         f"knows {vg.flow.vocab_size}: they come from different checkpoints")
    _check_word_rows(processor, prev_text_ids, prev_taste_ids, "prev_taste_ids")
    _check_word_rows(processor, text_ids, taste_ids, "taste_ids")
    _check_words_add_up(processor, prev_text_ids, text_ids)
    # The state is held for the whole segment: a second stream or speak on it at once raises.
    held = None if state is None else _hold(state)
    try:
        if state is None:
            _check_stateless_prev_audio(prev_speech_ids, prev_audio_ms)
        else:
            _check_state(state, speaker_embeds, prev_speech_ids, prev_audio_ms, prev_text_ids, prev_taste_ids, policy)
            if state.out_sampling_rate != out_sampling_rate:
                raise ValueError(f"the state resamples to {state.out_sampling_rate} Hz, not {out_sampling_rate}")

        # 1. words -> ASR tokens and TASTE embeddings (previous segment first)
        full_text = torch.cat([prev_text_ids, text_ids], dim=1)
        full_taste = torch.cat([prev_taste_ids, taste_ids], dim=1)
        aligned = processor.align_llm_ids(full_text)
        current = processor.align_llm_ids(text_ids)
        # (host tensors: checked there and copied in without waiting for the GPU)
        audio_embeds = decoder.audio_embeds_from_taste(model.rvq, full_taste, aligned.asr_word_ids)
        prefix = decoder.prefix_embeds(speaker_embeds, audio_embeds, aligned.asr_token_ids,
                                       graph=decoder.condition_graph(decoder_cache))

        # 2. the speech decoder, continuing the previous segment's speech tokens. With a state they are
        # the last segment's (the prefix holds that segment's words; feeding the whole utterance would
        # also cost more with every segment); without one, what the caller gave.
        min_len, max_len = decoder.length_limits(current.asr_token_ids.shape[1] + 3)
        continued = prev_speech_ids
        if state is not None and state.segment_tokens:  # (0: the state spoke tokens outside detokenize)
            continued = prev_speech_ids[:, prev_speech_ids.shape[1] - state.segment_tokens:]
        # The decoder's positions hold the prefix, the continued tokens and the new ones: refused before
        # any audio goes out if not even the fewest new tokens fit (not at the step that runs out), and
        # the most new tokens capped at the room left (a decode rarely comes near its 20x limit).
        room = MAX_CACHED_POSITIONS - prefix.shape[1] - continued.shape[1]
        if room < max(min_len, 1):
            raise ValueError(f"this segment needs at least {prefix.shape[1] + continued.shape[1] + max(min_len, 1)} "
                             f"speech-decoder positions ({prefix.shape[1]} of its prefix, {continued.shape[1]} continued "
                             f"speech tokens, at least {max(min_len, 1)} new ones), more than the decoder's "
                             f"{MAX_CACHED_POSITIONS}: pass state= (only the last segment is continued) or fewer "
                             "prev_speech_ids")
        max_len = min(max_len, room)
        dec_state = decoder.start(prefix, min_len=min_len, max_len=max_len, cache=decoder_cache)
        if continued.shape[1]:
            dec_state.next_logp = decoder.feed(dec_state, decoder.speech_embedding(to_device(continued, decoder.device)))
        sampler = TopKSampler(generator=generator) if sampler is None else sampler

        # 3. the voice generator, fed token by token
        primed = []
        if state is None:
            state, primed = _stateless_start(vg, speaker_embeds, policy or "low_latency", out_sampling_rate, generator,
                                             prev_speech_ids, prev_audio_ms)
            held = _hold(state)  # (handed out with the first item: held like a given one)
        new_tokens: list[int] = []

        def item(chunk: SpeechChunk | None, is_final: bool) -> dict:
            new = torch.tensor([new_tokens], dtype=torch.long).view(1, -1)
            audio = chunk.audio if chunk is not None else torch.zeros(1, 0)
            return {
                "audio_waveform": audio,
                "sampling_rate": chunk.sampling_rate if chunk is not None else out_sampling_rate,
                "chunk_duration_ms": chunk.duration_ms if chunk is not None else 0.0,
                "speech_ids": torch.cat([prev_speech_ids, new.to(prev_speech_ids.device)], dim=1),
                "new_speech_ids": new,
                "is_final": is_final,
                "state": state,
            }

        for chunk in primed:  # the previous tokens' audio after prev_audio_ms
            yield item(chunk, False)
        state.segment_open = True
        try:
            while (token := decoder.step(dec_state, sampler)) is not None:
                new_tokens.append(token)
                for chunk in speak_held(vg, state, torch.tensor([[token]])):
                    yield item(chunk, False)
            if not new_tokens:
                state.segment_open = False  # (nothing was fed: the state is as it was)
                raise ValueError("the speech decoder produced no speech tokens for this segment")
            state.segment_open = False
            state.segment_tokens = len(new_tokens)
            state.segment_words = (text_ids, taste_ids)
            chunks = speak_held(vg, state, final=True) if final else []
        except SynthesisFailed as failed:
            for chunk in failed.chunks:  # made before the failed step: good audio, handed on before the error
                yield item(chunk, False)
            raise
        if chunks:
            for chunk in chunks[:-1]:
                yield item(chunk, False)
            yield item(chunks[-1], True)
        else:
            yield item(None, True)
    finally:
        if held is not None:
            held.in_use.release()


def taste_detokenize(
    model,
    processor,
    speaker_embeds: torch.Tensor,
    prev_text_ids,
    prev_taste_ids,
    prev_speech_ids,
    prev_audio_ms: float,
    text_ids,
    taste_ids,
    out_sampling_rate: int = 16000,
    **kwargs,
) -> dict:
    """Synthesize one segment of LLM output, continuing the previous segment's speech.

    Args:
        model: TasteForCausalLM (its speech decoder and the audio tower's RVQ are used).
        processor: TasteProcessor (LLM-token words -> ASR tokens; ``get_generator()`` if available).
        speaker_embeds: (1, spk_dim) x-vector (the voice; the same for every segment of a call).
        prev_text_ids / prev_taste_ids: the previous segment's Llama ids (1, P) and TASTE codes
            (1, P, K); empty tensors (or None) for the first segment.
        prev_speech_ids: (1, Q) the utterance's speech tokens so far (the previous call's
            ``speech_ids``). The decoder continues the previous segment's part of them when a
            ``state`` is given, all of them otherwise (their cost grows with the utterance).
        prev_audio_ms: duration of the audio already played for this utterance (0 for the first segment):
            the sum of the ``chunk_duration_ms`` returned so far. Without a state it must not exceed
            the audio of ``prev_speech_ids``.
        text_ids / taste_ids: this segment's Llama ids (1, S) and codes (1, S, K) (codes on word starts).
        out_sampling_rate: 8000, 16000, 22050, 24000, 32000, 44100 or 48000.
        keyword-only: voice_generator, state (continuity from the previous call), final (this segment
            ends the utterance: flush and fade out; default True), policy ('low_latency' | 'quality' |
            EmissionPolicy: a new utterance's, 'low_latency' when not given; a ``state`` keeps its own), sampler (speech-token sampler; the original's top-25 by default),
            generator (torch.Generator for sampling and synthesis noise), decoder_cache (from
            ``model.speech_decoder.new_cache()``, kept by the caller and passed to every call: on CUDA
            its captured decode step is reused instead of captured per segment).

    Returns a dict: ``audio_waveform`` (1, T) float32, ``sampling_rate``, ``chunk_duration_ms``,
    ``speech_ids`` (1, Q + n): previous plus new speech tokens (pass as ``prev_speech_ids`` next time),
    ``new_speech_ids`` (1, n), ``state`` (pass to the next call for seamless continuation).
    A synthesis step that fails raises ``SynthesisFailed`` with ``.audio``: what the call made before
    it, to be played.
    """
    pieces, last = [], None
    try:
        for last in taste_detokenize_stream(model, processor, speaker_embeds, prev_text_ids, prev_taste_ids,
                                            prev_speech_ids, prev_audio_ms, text_ids, taste_ids, out_sampling_rate,
                                            **kwargs):
            pieces.append(last["audio_waveform"])
    except SynthesisFailed as failed:
        # the failed step's chunks came out of the stream before the error, after the earlier ones
        failed.audio = torch.cat(pieces, dim=-1) if pieces else torch.zeros(1, 0)
        raise
    audio = torch.cat(pieces, dim=-1)
    return {
        "audio_waveform": audio,
        "sampling_rate": out_sampling_rate,
        "chunk_duration_ms": 1000.0 * audio.shape[-1] / out_sampling_rate,
        "speech_ids": last["speech_ids"],
        "new_speech_ids": last["new_speech_ids"],
        "state": last["state"],
    }


@torch.inference_mode()
def finish_speaking(voice_generator: VoiceGenerator, state: SynthesisState) -> torch.Tensor:
    """Flush a state kept with ``final=False``: the held-back audio with the final fade-out, (1, n)."""
    if not isinstance(state, SynthesisState):
        raise ValueError(f"finish_speaking(voice_generator, state) takes the 'state' a taste_detokenize call returned "
                         f"as its second argument, got {type(state).__name__}"
                         + (" (a reply cut off before its first segment has no state to finish)" if state is None else ""))
    chunks = speak(voice_generator, state, final=True)
    if not chunks:
        return torch.zeros(1, 0)
    return torch.cat([c.audio for c in chunks], dim=-1)
