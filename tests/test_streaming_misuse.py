"""taste_speech.streaming used the wrong way round: a Conversation shared by two replies, a
generation that fails half-way, durations summed from resampled chunks, and inputs that are
plausible but wrong (int16-scale float audio, ids outside the vocabulary, a NaN voice, a
conversation of another model). Each must either work or fail with an error that names the
problem, and leave the conversation consistent."""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
import torch

from taste_speech.audio import to_mono_float
from taste_speech.streaming import (
    CONTINUATION,
    INSTRUCT,
    Conversation,
    TASTESegment,
    streaming_generate,
    taste_detokenize,
    taste_tokenize,
)
from taste_speech.streaming.detokenize import PREV_AUDIO_TOLERANCE_MS
from taste_speech.streaming.synthesis_state import EmissionPolicy
from taste_speech.voice_generator import VoiceGenerator
from audio_helpers import voiced

BUSY = "a reply is being generated on this conversation"


def audio_turn(model, processor, text, seed=0):
    ids = processor.process_text(text).llm_token_ids
    return TASTESegment("user", "audio", ids, taste_tokenize(model, processor, voiced(seed=seed)[None], ids, 16000))


@pytest.fixture(scope="module")
def user_turn(model, processor):
    return audio_turn(model, processor, "hello there how are you doing today")


@pytest.fixture(scope="module")
def second_turn(model, processor):
    return audio_turn(model, processor, "tell me about the garden", seed=1)


def generate(model, processor, segments, conv, **kw):
    kw.setdefault("generator", torch.Generator().manual_seed(0))
    kw.setdefault("extra_words", 3)
    return streaming_generate(model, processor, segments, conversation=conv, **kw)


def assert_consistent(model, processor, conv):
    """The cache holds exactly the rows of the conversation's turns, as a fresh prefill does."""
    fresh = Conversation(model, processor, system=conv.system, prompt_format=conv.prompt_format)
    fresh.state.turns = list(conv.state.turns)
    built, ours = fresh.ready(), conv.ready()
    assert built.length == ours.length and built.input_ids == ours.input_ids
    assert torch.allclose(built.last_hidden, ours.last_hidden, atol=1e-4)


# -- one reply at a time ------------------------------------------------------------------------------
def test_an_open_reply_holds_the_conversation(model, processor, user_turn, second_turn):
    conv = Conversation(model, processor)
    first = generate(model, processor, [user_turn], conv)
    assert conv.reply_in_progress  # held from the call on, before the first item
    next(first)
    assert conv.reply_in_progress
    with pytest.raises(RuntimeError, match=BUSY):
        next(generate(model, processor, [second_turn], conv))
    for use in (lambda: conv.add_turn(second_turn), conv.ready, conv.begin_reply, conv.snapshot,
                lambda: conv.truncate_last_assistant(0), lambda: conv.forget_from(user_turn),
                lambda: conv.commit_reply(None)):
        with pytest.raises(RuntimeError, match=BUSY):
            use()
    assert conv.turns == [user_turn]  # the refused turn was not added
    items = list(first)  # the first reply goes on undisturbed
    assert items[-1]["is_complete"] and not conv.reply_in_progress
    assert [t.role for t in conv.turns] == ["user", "assistant"]
    assert_consistent(model, processor, conv)
    list(generate(model, processor, [second_turn], conv))  # free again
    assert [t.role for t in conv.turns] == ["user", "assistant", "user", "assistant"]


def test_the_conversation_is_free_once_the_reply_is_committed(model, processor, user_turn):
    """What a voice agent does: read up to the final item, then cut the reply to what was heard
    (barge-in) or forget the turn (answered too early) - without exhausting the iterator."""
    conv = Conversation(model, processor)
    items = generate(model, processor, [user_turn], conv, extra_words=4)
    last = next(item for item in items if item["is_complete"])
    assert last["reply"] is not None and not conv.reply_in_progress
    kept = conv.truncate_last_assistant(np.int64(1))  # (a count from numpy arithmetic: was refused)
    assert kept.num_words == 1
    assert conv.forget_from(user_turn) == 2 and conv.turns == []
    assert_consistent(model, processor, conv)
    # closing an iterator half-way frees it too (its turn stays, the reply is dropped)
    items = generate(model, processor, [user_turn], conv, extra_words=8)
    next(items)
    items.close()
    assert not conv.reply_in_progress and conv.turns == [user_turn]
    conv.add_turn(user_turn)
    assert_consistent(model, processor, conv)


def test_a_reply_running_in_another_thread_holds_the_conversation(model, processor, user_turn, second_turn):
    conv = Conversation(model, processor)
    inside, go = threading.Event(), threading.Event()

    def stop():  # pauses the other thread inside its generation until the test lets it go
        inside.set()
        assert go.wait(30)
        return False

    errors = []

    def worker():
        try:
            list(generate(model, processor, [user_turn], conv, stop=stop, max_length=4))
        except Exception as e:  # reported below
            errors.append(e)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert inside.wait(30)
        with pytest.raises(RuntimeError, match=BUSY):
            list(generate(model, processor, [second_turn], conv))
        with pytest.raises(RuntimeError, match=BUSY):
            conv.add_turn(second_turn)
    finally:
        go.set()
        thread.join(60)
    assert errors == [] and [t.role for t in conv.turns] == ["user", "assistant"]
    assert_consistent(model, processor, conv)


# -- a failed generation leaves nothing behind --------------------------------------------------------
def test_an_error_mid_reply_takes_the_input_turns_back(model, processor, user_turn, second_turn):
    conv = Conversation(model, processor)
    list(generate(model, processor, [user_turn], conv))
    before = list(conv.turns)
    steps = []

    def failing_stop():
        steps.append(1)
        if len(steps) == 3:
            raise ConnectionError("transient failure")
        return False

    with pytest.raises(ConnectionError, match="transient"):
        list(generate(model, processor, [second_turn], conv, stop=failing_stop))
    assert conv.turns == before and not conv.reply_in_progress
    assert_consistent(model, processor, conv)
    items = list(generate(model, processor, [second_turn], conv))  # the retry adds the turn once
    assert [t for t in conv.turns if t is second_turn] == [second_turn]
    assert conv.turns[-1] is items[-1]["reply"]


def _bad_segment(model, processor, turn):
    """A user turn whose TASTE codes have one RVQ level too few: refused when it is added."""
    return TASTESegment("user", "audio", turn.text_ids, turn.taste_ids[..., :-1])


def test_a_failed_reply_takes_back_a_system_segment_it_opened_with(model, processor, user_turn):
    conv = Conversation(model, processor, prompt_format=INSTRUCT)
    system = TASTESegment("system", "text", processor.process_text(" be brief").llm_token_ids)
    with pytest.raises(ValueError, match="codes per word"):
        list(generate(model, processor, [system, user_turn, _bad_segment(model, processor, user_turn)], conv))
    assert conv.system is None and conv.turns == []  # the system segment stayed, and the turn
    items = list(generate(model, processor, [system, user_turn], conv))  # was: "can only open a conversation"
    assert conv.system is system and conv.turns == [user_turn, items[-1]["reply"]]
    assert_consistent(model, processor, conv)


def test_a_failed_reply_takes_back_the_same_turn_given_twice(model, processor, user_turn):
    conv = Conversation(model, processor)

    def failing_stop():
        raise ConnectionError("transient failure")

    with pytest.raises(ConnectionError):
        list(generate(model, processor, [user_turn, user_turn], conv, stop=failing_stop))
    assert conv.turns == []  # both copies (the first one stayed)
    assert_consistent(model, processor, conv)


def test_a_failed_reply_puts_back_what_the_window_dropped_meanwhile(model, processor, user_turn, second_turn):
    conv = Conversation(model, processor, max_turns=3)
    list(generate(model, processor, [user_turn], conv))
    before = list(conv.turns)
    with pytest.raises(ValueError, match="codes per word"):  # the window rolls while the turns go in
        list(generate(model, processor, [second_turn, user_turn, _bad_segment(model, processor, user_turn)], conv))
    assert conv.turns == before  # as if the call never happened (only the later turns were taken back)
    assert_consistent(model, processor, conv)


# -- prev_audio_ms --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def speech(model, processor, tiny_checkpoint):
    ids = processor.process_text("hello there how are you doing today my friend").llm_token_ids
    t = np.arange(24000) / 16000
    taste = taste_tokenize(model, processor, (0.2 * np.sin(2 * np.pi * 150 * t)).astype(np.float32)[None], ids, 16000)
    starts = (taste[0, :, 0] != -1).nonzero().view(-1).tolist()
    return VoiceGenerator.from_pretrained(tiny_checkpoint), ids, taste, starts


@pytest.mark.parametrize("rate", [16000, 48000])
@pytest.mark.parametrize("split", ["two_segments", "word_by_word"])
def test_a_state_continues_with_the_summed_chunk_durations(model, processor, speech, rate, split):
    """prev_audio_ms = the sum of the returned chunk_duration_ms, at a rate the output resampler
    converts to (it holds back some audio, so that sum falls behind the audio synthesised)."""
    vg, ids, taste, starts = speech
    cuts = [0, starts[len(starts) // 2]] if split == "two_segments" else starts
    cuts = cuts + [ids.shape[1]]
    speaker = processor.default_speaker_embedding()
    policy = EmissionPolicy.low_latency(max_chunk_tokens=0)  # 25-token chunks: the resampler holds back most
    state, prev, played_ms, samples, behind = None, (None, None, None), 0.0, 0, []
    for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        out = taste_detokenize(model, processor, speaker, *prev, played_ms, ids[:, a:b], taste[:, a:b], rate,
                               voice_generator=vg, state=state, final=b == ids.shape[1], policy=policy,
                               generator=torch.Generator().manual_seed(i))
        state, prev = out["state"], (ids[:, a:b], taste[:, a:b], out["speech_ids"])
        played_ms += out["chunk_duration_ms"]
        samples += out["audio_waveform"].shape[-1]
        behind.append(state.audio_ms_before + state.emitted_ms - played_ms)
    assert state.finished and played_ms == pytest.approx(1000 * samples / rate)
    if split == "word_by_word":  # the case that used to be refused really happened
        assert max(behind) > PREV_AUDIO_TOLERANCE_MS, behind


@pytest.mark.parametrize("unplayed_ms", [0, 200, 500, 700])
def test_without_a_state_the_audio_goes_on_from_prev_audio_ms(unplayed_ms):
    """A stateless continuation after less was played than the previous tokens make (a reply cut
    off part-way): it starts where the audio stopped. Audio between that point and the primed tail
    was lost, and the first chunks went unfaded, when prev_audio_ms was far below their audio."""
    from taste_speech.streaming.detokenize import _stateless_start
    from taste_speech.streaming.synthesis import speak, start_speaking
    from taste_speech.voice_generator.tiny import make_tiny_voice_generator

    vg = make_tiny_voice_generator(0)
    g = torch.Generator().manual_seed(11)
    tokens, speaker = torch.randint(0, 4096, (1, 97), generator=g), torch.randn(1, 192, generator=g)
    whole = start_speaking(vg, speaker, "low_latency", 22050, torch.Generator().manual_seed(0))
    total = sum(c.audio.shape[-1] for c in speak(vg, whole, tokens, final=True))
    first = start_speaking(vg, speaker, "low_latency", 22050, torch.Generator().manual_seed(0))
    made = sum(c.audio.shape[-1] for c in speak(vg, first, tokens[:, :50], final=True))
    played = made - round(unplayed_ms * 22050 / 1000)
    state, primed = _stateless_start(vg, speaker, "low_latency", 22050, torch.Generator().manual_seed(1),
                                     tokens[:, :50], 1000 * played / 22050)
    rest = torch.cat([c.audio for c in primed + speak(vg, state, tokens[:, 50:], final=True)], dim=-1)[0]
    assert played + rest.numel() == total  # nothing lost, nothing repeated
    assert abs(float(rest[0])) < 1e-3  # it fades in where it starts


def test_prev_audio_ms_must_match_the_audio(model, processor, speech):
    vg, ids, taste, starts = speech
    speaker, cut, kw = processor.default_speaker_embedding(), starts[len(starts) // 2], dict(voice_generator=vg)
    first = taste_detokenize(model, processor, speaker, None, None, None, 0, ids[:, :cut], taste[:, :cut], 16000,
                             final=False, generator=torch.Generator().manual_seed(0), **kw)  # (not the tests' order)
    played = first["chunk_duration_ms"]
    assert played > 100
    for wrong in (played + 500, played - 100):  # with a state: the audio returned so far
        with pytest.raises(ValueError, match="audio returned with this state"):
            taste_detokenize(model, processor, speaker, ids[:, :cut], taste[:, :cut], first["speech_ids"], wrong,
                             ids[:, cut:], taste[:, cut:], 16000, state=first["state"], **kw)
    for bad in (float("nan"), float("inf"), None, "soon", -1.0):
        with pytest.raises(ValueError, match="prev_audio_ms must be a finite number"):
            taste_detokenize(model, processor, speaker, None, None, None, bad, ids, taste, **kw)
    # stateless: no further than the previous tokens' audio (5 tokens: 93 ms)
    prev_tokens = torch.ones(1, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"prev_speech_ids \(5 tokens\) make only 92.9 ms"):
        taste_detokenize(model, processor, speaker, None, None, prev_tokens, 1e6, ids, taste, **kw)
    out = taste_detokenize(model, processor, speaker, None, None, prev_tokens, 90.0, ids, taste, **kw)
    assert out["audio_waveform"].shape[-1] > 0


def test_a_state_left_by_a_failure_or_a_closed_stream_says_so_when_given_again(model, processor, speech, monkeypatch):
    """Both said "prev_speech_ids has 15 tokens but the state covers 35: pass the 'speech_ids'
    returned by the previous call" - speech ids no call had returned."""
    from taste_speech.streaming import finish_speaking, taste_detokenize_stream
    from taste_speech.streaming.synthesis import SynthesisFailed

    vg, ids, taste, starts = speech
    speaker, cut, kw = processor.default_speaker_embedding(), starts[len(starts) // 2], dict(voice_generator=vg)

    def first_half():
        return taste_detokenize(model, processor, speaker, None, None, None, 0, ids[:, :cut], taste[:, :cut], 16000,
                                final=False, generator=torch.Generator().manual_seed(0), **kw)

    def second_half(first, **more):
        return (ids[:, :cut], taste[:, :cut], first["speech_ids"], first["chunk_duration_ms"], ids[:, cut:],
                taste[:, cut:], 16000), dict(state=first["state"], **kw, **more)

    # a synthesis step fails in the second segment
    first, decode = first_half(), vg.hift.decode

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(vg.hift, "decode", out_of_memory)
    args, more = second_half(first)
    with pytest.raises(SynthesisFailed):
        taste_detokenize(model, processor, speaker, *args, **more)
    monkeypatch.setattr(vg.hift, "decode", decode)
    with pytest.raises(ValueError, match=r"failed earlier \(RuntimeError: out of memory\): it cannot go on.*state=None"):
        taste_detokenize(model, processor, speaker, *args, **more)

    # a stream of the second segment closed after its first chunk (a barge-in)
    first = first_half()
    args, more = second_half(first)
    stream = taste_detokenize_stream(model, processor, speaker, *args, **more)
    next(stream)
    stream.close()
    with pytest.raises(ValueError, match="last segment was left part-way.*finish_speaking"):
        taste_detokenize(model, processor, speaker, *args, **more)
    assert finish_speaking(vg, first["state"]).shape[-1] > 0  # what it holds still fades out


@pytest.mark.parametrize("state", [None, "swapped"])
def test_finish_speaking_names_its_arguments(speech, state):
    from taste_speech.streaming import finish_speaking

    vg = speech[0]
    with pytest.raises(ValueError, match=r"finish_speaking\(voice_generator, state\) takes the 'state'"):
        finish_speaking(vg, vg if state == "swapped" else None)


# -- plausible but wrong inputs --------------------------------------------------------------------------
def test_int16_scale_float_audio_is_refused(model, processor, user_turn):
    pcm = np.round(voiced() * 32767).astype(np.int16)
    with pytest.raises(ValueError, match="divide by 32768"):
        taste_tokenize(model, processor, pcm.astype(np.float32)[None], user_turn.text_ids, 16000)
    with pytest.raises(ValueError, match="float audio must be in"):
        to_mono_float(torch.from_numpy(pcm.astype(np.float64)))
    assert torch.equal(taste_tokenize(model, processor, pcm[None], user_turn.text_ids, 16000),
                       taste_tokenize(model, processor, (pcm / 32768.0)[None], user_turn.text_ids, 16000))
    assert to_mono_float(np.array([0.5, -8.0], np.float32)).tolist() == [0.5, -8.0]  # hot, not int16: kept


def test_text_ids_outside_the_vocabulary(model, processor, speech):
    vg, ids, taste, _ = speech
    vocab = len(processor.llm_tokenizer)
    speaker = processor.default_speaker_embedding()
    wav = voiced()[None]
    for bad in (torch.tensor([[-5, 3]]), torch.tensor([[3, vocab]])):
        with pytest.raises(ValueError, match=rf"text_ids must be Llama token ids in \[0, {vocab}\)"):
            taste_tokenize(model, processor, wav, bad, 16000)
        codes = torch.full((1, 2, taste.shape[2]), -1)
        codes[0, 0] = 0
        with pytest.raises(ValueError, match=rf"text_ids must be Llama token ids in \[0, {vocab}\)"):
            taste_detokenize(model, processor, speaker, None, None, None, 0, bad, codes, voice_generator=vg)
        with pytest.raises(ValueError, match=r"prev_text_ids must be Llama token ids"):
            taste_detokenize(model, processor, speaker, bad, codes, None, 0, ids, taste, voice_generator=vg)
    with pytest.raises(ValueError, match=r"taste_ids must be integer codes of shape \(1, S, K\), got torch.bool"):
        taste_detokenize(model, processor, speaker, None, None, None, 0, ids, taste >= 0, voice_generator=vg)


def test_a_segment_that_goes_on_with_prev_s_last_word_is_refused_by_name(model, processor, speech):
    """A new reply's first token may start no word ('mmm' after ' friend'): given the previous
    reply's last segment as prev_*, the words of the two do not add up (the error blamed the
    codes' layout)."""
    vg, ids, taste, starts = speech
    cut = starts[-1]
    mmm = torch.tensor([processor.llm_tokenizer.encode("mmm", add_special_tokens=False)])
    assert not processor.llm_tokenizer.decode(mmm[0, :1]).startswith(" ")
    codes = torch.full((1, mmm.shape[1], taste.shape[2]), -1)
    codes[0, 0] = 0
    with pytest.raises(ValueError, match="text_ids continue the last word of prev_text_ids.*empty prev_"):
        taste_detokenize(model, processor, processor.default_speaker_embedding(), ids[:, :cut], taste[:, :cut], None, 0,
                         mmm, codes, voice_generator=vg)
    taste_detokenize(model, processor, processor.default_speaker_embedding(), None, None, None, 0, mmm, codes,
                     voice_generator=vg)  # as a new utterance it is fine


def test_a_non_finite_voice_is_refused(model, processor, speech):
    vg, ids, taste, _ = speech
    speaker = processor.default_speaker_embedding().clone()
    speaker[0, 3] = float("nan")
    with pytest.raises(ValueError, match="speaker_embeds contains NaN or infinite"):
        taste_detokenize(model, processor, speaker, None, None, None, 0, ids, taste, voice_generator=vg)


def test_a_conversation_belongs_to_its_model_and_format(model, processor, user_turn):
    conv = Conversation(model, processor, prompt_format=INSTRUCT)
    with pytest.raises(ValueError, match="made for another model"):
        list(generate(copy.deepcopy(model), processor, [user_turn], conv))
    with pytest.raises(ValueError, match="fixed per conversation"):  # the default format, given explicitly
        list(generate(model, processor, [user_turn], conv, prompt_format=CONTINUATION))
    assert conv.turns == []
    items = list(generate(model, processor, [user_turn], conv, prompt_format=INSTRUCT, max_length=3))
    assert items[-1]["is_complete"] and conv.turns[0] is user_turn


# -- special tokens in text segments ---------------------------------------------------------------------
def test_text_ids_with_special_tokens_are_refused_everywhere(model, processor, speech):
    """``tokenizer(text).input_ids`` starts with <|begin_of_text|>: taste_tokenize refused it, but a
    text turn fed it to the LM as a second start of text, and taste_detokenize spoke it as a word."""
    vg, ids, taste, _ = speech
    tokenizer = processor.llm_tokenizer
    with_bos = tokenizer(" be brief and friendly", return_tensors="pt").input_ids
    assert with_bos[0, 0] == tokenizer.bos_token_id
    with pytest.raises(ValueError, match=r"system segment's text_ids contain special token ids .*process_text"):
        Conversation(model, processor, system=TASTESegment("system", "text", with_bos))
    conv = Conversation(model, processor)
    with pytest.raises(ValueError, match=r"user segment's text_ids contain special token ids"):
        conv.add_turn(TASTESegment("user", "text", with_bos))
    with pytest.raises(ValueError, match=r"user segment's text_ids contain special token ids"):
        list(generate(model, processor, [TASTESegment("user", "text", with_bos)], conv))
    assert conv.state.turns == []  # nothing of it was fed
    clean = processor.process_text(" be brief and friendly").llm_token_ids
    conv.add_turn(TASTESegment("user", "text", clean))
    assert_consistent(model, processor, conv)
    speaker, kw = processor.default_speaker_embedding(), dict(voice_generator=vg)
    for args, name in (((None, None, None, 0, with_bos, torch.zeros(1, with_bos.shape[1], taste.shape[2]).long()),
                        "text_ids"),
                       ((with_bos, torch.zeros(1, with_bos.shape[1], taste.shape[2]).long(), None, 0, ids, taste),
                        "prev_text_ids")):
        with pytest.raises(ValueError, match=rf"^{name} contain special token ids"):
            taste_detokenize(model, processor, speaker, *args, **kw)


# -- models cast with the plain nn.Module API ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_a_model_cast_with_to_dtype_generates(model, processor, user_turn, dtype):
    """``model.to(torch.bfloat16)`` casts the heads too (``set_run_dtypes`` keeps them float32): the
    latent head ran its input in float32 against bfloat16 weights and generation failed."""
    cast = copy.deepcopy(model).to(dtype)
    conv = Conversation(cast, processor)
    items = list(generate(cast, processor, [user_turn], conv))
    segments = [item["segment"] for item in items if item["segment"] is not None]
    assert items[-1]["is_complete"] and items[-1]["completion_reason"] == "finished", items[-1]
    assert segments and all(s.taste_ids.dtype == torch.long and s.taste_ids.shape[1] == s.text_ids.shape[1]
                            for s in segments)
    assert_consistent(cast, processor, conv)


def test_a_voice_generator_in_half_precision_is_refused_by_name(model, processor, speech):
    vg, ids, taste, _ = speech
    half = copy.deepcopy(vg).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"voice generator's weights are torch.bfloat16; .*voice_generator.float\(\)"):
        taste_detokenize(model, processor, processor.default_speaker_embedding(), None, None, None, 0, ids, taste,
                         voice_generator=half)
    out = taste_detokenize(model, processor, processor.default_speaker_embedding(), None, None, None, 0, ids, taste,
                           voice_generator=half.float())
    assert out["audio_waveform"].abs().max() > 0


def test_start_speaking_checks_the_voice_vector():
    """``start_speaking`` is public (batched synthesis uses it directly): a NaN, all-zero or batched
    voice is refused by name, as ``taste_detokenize`` refuses it, not turned into NaN audio or a
    size error deep in the flow."""
    from taste_speech.streaming.synthesis import start_speaking
    from taste_speech.voice_generator.tiny import make_tiny_voice_generator

    vg = make_tiny_voice_generator(0)
    for voice, message in ((torch.full((1, 192), float("nan")), "NaN"), (torch.zeros(1, 192), "all zeros"),
                           (torch.randn(2, 192), r"\(1, 192\)"), (np.ones(100, dtype=np.float32), r"\(1, 192\)")):
        with pytest.raises(ValueError, match=message):
            start_speaking(vg, voice, "low_latency", 16000, torch.Generator().manual_seed(0))
    state = start_speaking(vg, torch.randn(192).numpy(), "low_latency", 16000, torch.Generator().manual_seed(0))
    assert not state.finished
    with pytest.raises(ValueError, match="out_sampling_rate must be one of .*, got '24000'"):
        start_speaking(vg, torch.randn(192).numpy(), "low_latency", "24000", torch.Generator().manual_seed(0))


def test_a_first_chunk_over_the_growth_limit_never_reports_more_tokens_than_were_fed():
    """A policy of one's own may make the first chunk longer than steady chunks may grow: a short
    reply flushed at once is one chunk of what was fed, and the boundaries only go forward."""
    from taste_speech.streaming.synthesis import speak, start_speaking
    from taste_speech.streaming.synthesis_state import EmissionPolicy, frames_for_tokens
    from taste_speech.voice_generator.tiny import make_tiny_voice_generator

    vg = make_tiny_voice_generator(0)
    policy = EmissionPolicy(name="long_first", first_chunk_tokens=50, chunk_tokens=25, max_chunk_tokens=30)
    tokens = torch.randint(0, 4096, (1, 40), generator=torch.Generator().manual_seed(40))
    state = start_speaking(vg, torch.randn(1, 192, generator=torch.Generator().manual_seed(3)), policy, 22050,
                           torch.Generator().manual_seed(0))
    chunks = speak(vg, state, tokens[:, :20]) + speak(vg, state, tokens[:, 20:], final=True)
    committed = [chunk.tokens_committed for chunk in chunks]
    assert committed == sorted(committed) and max(committed) == 40 == state.committed_tokens
    assert sum(chunk.audio_22k.shape[-1] for chunk in chunks) == 256 * frames_for_tokens(40)


def test_codes_of_another_width_are_named_as_such(model, processor, speech):
    """TASTE codes with fewer levels than the model's RVQ (another checkpoint's, or sliced): the
    message said 'must be an integer tensor' of an integer tensor."""
    vg, ids, taste, _ = speech
    speaker = processor.default_speaker_embedding()
    levels = taste.shape[-1]
    with pytest.raises(ValueError, match=rf"have 2 codes each .* this RVQ has {levels} levels: give \(\.\.\., {levels}\)"):
        taste_detokenize(model, processor, speaker, None, None, None, 0, ids, taste[..., :2], 16000,
                         voice_generator=vg)


def test_a_segment_s_ids_and_codes_out_of_range_are_refused_at_the_call_naming_the_segment(model, processor):
    """They failed at the first item, deep in the model ('RVQ indices must lie in ...'), naming no
    segment: now the call says which segment and what makes valid ones."""
    good = TASTESegment("user", "text", processor.process_text(" hello there").llm_token_ids, None)
    words = good.text_ids.shape[1]
    codes = torch.full((1, words, 4), 1_000_001)
    bad_codes = TASTESegment("user", "audio", good.text_ids, codes)
    with pytest.raises(ValueError, match=r"input_segments\[1\] \(user, audio\): taste_ids must lie in \[0, 64\)"):
        streaming_generate(model, processor, [good, bad_codes])
    bad_text = TASTESegment("user", "text", torch.tensor([[5, 10**6]]), None)
    with pytest.raises(ValueError, match=r"input_segments\[0\] \(user, text\): text_ids must be Llama token ids"):
        streaming_generate(model, processor, [bad_text])
