"""The built-in ASR's own greedy Whisper loop (pipecat_taste.whisper_decode) against transformers'
``generate``: same token ids for the transcriber's settings, eagerly and through the capture
protocol ('rehearse'); a draft never changes the result; unsupported settings use ``generate``.

Two random Whispers over the tiny checkpoint's ASR tokenizer: the pipeline's ``random_tiny``
(its greedy output hardly depends on the audio) and a "varied" one with large weights, whose
output changes with the audio and the position, with Whisper-large-v3-like generation settings
(language and task tokens, <|notimestamps|>, suppressed tokens, tokens suppressed at the start).
"""

import threading
import time

import numpy as np
import pytest
import torch

from pipecat_taste.asr import STATIC_FAILURES_TO_GIVE_UP, WhisperTranscriber
from pipecat_taste.whisper_decode import StaticWhisperDecoder, greedy_plan
from taste_agents.caller import load_utterances

MODES = ["eager", "rehearse"]
# Special tokens of the varied model: the timestamp tokens after <|notimestamps|> are only the
# end-of-text token (suppressed), as a model prompted without timestamps behaves.
EN, DE, TRANSCRIBE, TRANSLATE, NO_TIMESTAMPS = 505, 506, 507, 508, 510


@pytest.fixture(scope="module")
def checkpoint():
    from taste_speech.tiny import default_tiny_checkpoint

    return default_tiny_checkpoint()  # what TasteEngine.from_pretrained(None) loads


@pytest.fixture(scope="module")
def tiny_asr(checkpoint):
    return WhisperTranscriber.random_tiny(checkpoint, decode="dynamic")


def varied_model(tiny_asr, seed=3, no_timestamps=NO_TIMESTAMPS):
    """A copy of the tiny Whisper with large random weights and v3-like generation settings."""
    import copy

    model = copy.deepcopy(tiny_asr.model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    gc = model.generation_config
    gc.lang_to_id = {"<|en|>": EN, "<|de|>": DE}
    gc.task_to_id = {"transcribe": TRANSCRIBE, "translate": TRANSLATE}
    gc.no_timestamps_token_id = no_timestamps
    gc.is_multilingual = True
    gc.suppress_tokens = [t for t in gc.suppress_tokens if t not in (EN, DE, TRANSCRIBE, TRANSLATE, NO_TIMESTAMPS)]
    gc.begin_suppress_tokens = [389, 444, 479]  # frequent first tokens of this model: the rule matters
    return model


@pytest.fixture(scope="module")
def audios():
    clips = [u.audio for u in load_utterances().values()]
    noise = np.random.default_rng(0).standard_normal(16000).astype(np.float32) * 0.05
    return clips + [clips[0][: clips[0].size // 2], noise]


def features(asr, audio):
    return asr.feature_extractor(audio, sampling_rate=16000, return_tensors="pt").input_features


def generate(model, feats, **kwargs):
    with torch.inference_mode():
        return model.generate(feats, **kwargs)[0].tolist()


@pytest.mark.parametrize("mode", MODES)
def test_loop_matches_generate_on_the_pipeline_tiny_asr(checkpoint, tiny_asr, audios, mode):
    plan = greedy_plan(tiny_asr.model)
    assert not isinstance(plan, str), plan
    decoder = StaticWhisperDecoder(tiny_asr.model, plan, mode)
    static = WhisperTranscriber.random_tiny(checkpoint, decode="static", graph_mode=mode)
    for audio in audios:
        feats = features(tiny_asr, audio)
        expected = generate(tiny_asr.model, feats)
        assert decoder.decode(feats)[0] == expected
        assert static(audio) == tiny_asr(audio)  # the transcriber's text, static loop vs generate
    # the encoder (one shape: the padded window) and the cross keys/values went through steps of
    # their own, warmed up like a capture
    cross = decoder._graphs[("cross", 1)]
    assert decoder.encoder.mode == cross.mode == mode
    assert decoder.encoder.step._prepared and cross._prepared
    with pytest.raises(ValueError, match="padded 30 s window"):
        decoder.decode(feats[..., :100])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("language, max_new_tokens", [("en", 12), ("german", 20), (None, None)])
def test_loop_matches_generate_with_language_task_and_suppression(tiny_asr, audios, mode, language, max_new_tokens):
    model = varied_model(tiny_asr)
    if language is None:  # no language: the config's forced decoder ids give the start tokens
        model.generation_config.forced_decoder_ids = [[1, DE], [2, TRANSLATE]]
        model.generation_config.max_length = 9
    task = "transcribe" if language else None
    plan = greedy_plan(model, language, task, max_new_tokens)
    assert not isinstance(plan, str), plan
    decoder = StaticWhisperDecoder(model, plan, mode)
    kwargs = {} if language is None else {"language": language, "task": task, "max_new_tokens": max_new_tokens}
    outputs = set()
    for audio in audios:
        feats = features(tiny_asr, audio)
        expected = generate(model, feats, **kwargs)
        ids, kept = decoder.decode(feats)
        assert ids == expected and kept == 0
        outputs.add(tuple(ids))
    assert len(outputs) > 2  # the output depends on the audio: equal ids mean something


def test_an_english_only_whisper_transcribes_with_the_default_language(tiny_asr, audios):
    """A ``*.en`` Whisper (not multilingual, no language tokens) with the transcriber's default
    ``language='en'``: generate refuses a language for it, so the transcriber asks for none - every
    turn failed before - and its loop gives what generate gives without one."""
    import copy

    model = copy.deepcopy(tiny_asr.model)
    model.generation_config.is_multilingual = False
    asr = WhisperTranscriber(model, tiny_asr.feature_extractor, tiny_asr.tokenizer, max_new_tokens=16)
    assert asr.language is None and asr.plan is not None, asr.generate_reason
    for audio in audios[:2]:
        expected = generate(model, features(tiny_asr, audio), max_new_tokens=16)
        assert asr.transcribe(audio).text == tiny_asr._text(expected)


def test_a_transcript_cut_at_max_new_tokens_is_reported_once(tiny_asr, audios, caplog):
    """A turn longer than the transcript's token budget loses its last words; the transcriber says
    so (once), naming the setting to raise. (The random tiny Whisper never ends a transcript by
    itself: every one here uses its whole budget.)"""
    import logging

    def transcriber(budget):
        return WhisperTranscriber(tiny_asr.model, tiny_asr.feature_extractor, tiny_asr.tokenizer, language=None,
                                  max_new_tokens=budget)

    asr = transcriber(3)
    with caplog.at_level(logging.WARNING, logger="pipecat_taste.asr"):
        transcriber(16)._check_length([7, 8])  # ended within its budget: nothing to say
        cut = [asr.transcribe(audio) for audio in audios[:2]]
    assert all(len(t.ids) == 3 for t in cut)
    warnings = [r.getMessage() for r in caplog.records if "max_new_tokens" in r.getMessage()]
    assert len(warnings) == 1 and "max_new_tokens=3" in warnings[0] and "missing" in warnings[0]


def test_end_of_text_stops_like_generate(tiny_asr, audios):
    model = varied_model(tiny_asr)
    feats = features(tiny_asr, audios[0])
    free = generate(model, feats, language="en", task="transcribe", max_new_tokens=20)
    stop = next(t for t in free[2:] if t not in free[:2])  # a token first produced mid-transcript
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = stop
    expected = generate(model, feats, language="en", task="transcribe", max_new_tokens=20)
    assert len(expected) < 20 and stop not in expected
    decoder = StaticWhisperDecoder(model, greedy_plan(model, "en", "transcribe", 20), "eager")
    assert decoder.decode(feats)[0] == expected


@pytest.mark.parametrize("mode", MODES)
def test_a_draft_is_verified_and_never_changes_the_result(tiny_asr, audios, mode):
    model = varied_model(tiny_asr)
    plan = greedy_plan(model, "en", "transcribe", 16)
    decoder = StaticWhisperDecoder(model, plan, mode)
    feats = features(tiny_asr, audios[1])
    truth, _ = decoder.decode(feats)
    assert len(truth) == 16
    other, _ = decoder.decode(features(tiny_asr, audios[2]))
    wrong = [t for t in range(300, 400) if t != truth[0]]
    cases = [  # (draft, tokens of it kept)
        (truth, 15),  # all of it (the last token comes from the last verified row)
        (truth[:5], 5),
        (truth[:5] + wrong[:6], 5),
        (wrong[:10], 0),
        (truth + truth, 15),  # longer than the transcript can be
        (other, _common(other, truth)),
        ([], 0),
    ]
    for draft, kept in cases:
        ids, n = decoder.decode(feats, draft)
        assert ids == truth and n == kept, (draft, n)
    # with graphs the checks ran padded buckets of 8 and 16 rows (4 start tokens + a draft), and
    # longer ones (19 rows) the last bucket, the transcript's whole length (the plan allows 20): no
    # check runs outside a step; eager, every check runs unpadded (padding would only add rows)
    buckets = [] if mode == "eager" else [8, 16, 20]
    assert list(decoder.verify_buckets) == buckets
    assert sorted(key[2] for key in decoder._graphs if key[0] == "check") == buckets


@pytest.mark.parametrize("mode", MODES)
def test_utterances_decoded_together_get_what_each_gets_alone(tiny_asr, audios, mode):
    """A workspace of 4 rows decodes several utterances as one batch: different audio, drafts
    that keep all, part or none of the transcript (so some rows end while others go on feeding
    tokens, and an end-of-text token stops one early), and a row left idle. Each utterance gets
    the ids and the kept count it gets decoded alone, with any other rows beside it."""
    model = varied_model(tiny_asr)
    feats = [features(tiny_asr, audio) for audio in audios]
    alone_decoder = StaticWhisperDecoder(model, greedy_plan(model, "en", "transcribe", 16), mode)
    truths = [alone_decoder.decode(f)[0] for f in feats]
    assert len({tuple(t) for t in truths}) > 2  # the audio matters
    stop = truths[0][6]  # a token first seen mid-transcript ends one utterance early, as end-of-text
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = stop
    plan = greedy_plan(model, "en", "transcribe", 16)
    alone_decoder = StaticWhisperDecoder(model, plan, mode)
    wrong = [t for t in range(300, 400) if t not in truths[1][:1]]
    utterances = [(feats[0], ()), (feats[1], truths[1][:5]), (feats[2], truths[2]), (feats[3], wrong[:4])]
    alone = [alone_decoder.decode(f, draft) for f, draft in utterances]
    assert len({len(ids) for ids, _ in alone}) > 1 and any(kept for _, kept in alone)
    together = StaticWhisperDecoder(model, plan, mode, rows=4)
    assert together.sizes == [1, 2, 4]
    # 4 rows, 3 (one idle), 2; with the whole transcript as a draft (19 rows) the check runs unpadded,
    # without it in a captured bucket
    for order in ([0, 1, 2, 3], [0, 1, 2], [1, 2], [3, 2, 1, 0], [3, 1, 0], [0, 3]):
        batch = [(*utterances[i], None) for i in order]
        assert together.decode_many(batch) == [alone[i] for i in order], order
    kinds = ("step", "cross") if mode == "eager" else ("step", "cross", "check")  # (eager checks: unpadded)
    assert {key[:2] for key in together._graphs} == {(kind, n) for kind in kinds for n in (2, 4)}
    with pytest.raises(ValueError, match="5 utterances do not fit a workspace of 4 rows"):
        together.decode_many([(feats[0], (), None)] * 5)
    with pytest.raises(ValueError, match="rows must be an integer >= 1"):
        StaticWhisperDecoder(model, plan, mode, rows=0)


def _common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_turn_transcript_partials_then_the_whole_turn(tiny_asr, audios):
    model = varied_model(tiny_asr)
    static = WhisperTranscriber(model, tiny_asr.feature_extractor, tiny_asr.tokenizer, language="en", max_new_tokens=12,
                                decode="static", graph_mode="rehearse")
    full = audios[0]
    static.warm_up()
    assert len(static._workspaces) == 1  # the workspace the turn below reuses
    turn = static.new_turn()
    for end in (0.3, 0.6, 0.9):
        turn.partial(full[: int(full.size * end)])
    assert turn.partials == 3 and turn.draft
    reference = generate(model, features(tiny_asr, full), language="en", task="transcribe", max_new_tokens=12)
    assert turn.finish(full) == tiny_asr.tokenizer.decode(reference, skip_special_tokens=True).strip()
    assert len(static._workspaces) == 1


def test_warm_up_prepares_a_workspace_per_call_that_may_transcribe_at_once(tiny_asr, audios):
    """warm_up(workspaces=n) leaves n prepared workspaces (each with its steps made): n calls
    transcribing at the same moment find one each, and none is made while a caller speaks."""
    model = varied_model(tiny_asr)
    static = WhisperTranscriber(model, tiny_asr.feature_extractor, tiny_asr.tokenizer,
                                language="en", max_new_tokens=12, decode="static", graph_mode="rehearse")
    static.warm_up(workspaces=3)
    prepared = list(static._workspaces)
    assert len(prepared) == 3 and len({id(w) for w in prepared}) == 3
    for w in prepared:  # every step made and rehearsed (= captured on CUDA): one-row workspaces here
        assert w.rows == 1 and sorted(w._graphs) == [("check", 1, 8), ("check", 1, 16), ("cross", 1), ("step", 1)]
        assert all(graph._prepared for graph in w._graphs.values())
    assert all(w.encoder is static._encoder for w in prepared) and static._encoder.step._prepared  # one shared
    borrowed = [static._borrow(static.plan) for _ in range(3)]  # three calls at once
    assert {id(w) for w in borrowed} == {id(w) for w in prepared}
    for workspace in borrowed:
        static._give_back(workspace)
    reference = generate(model, features(tiny_asr, audios[0]), language="en", task="transcribe", max_new_tokens=12)
    expected = tiny_asr.tokenizer.decode(reference, skip_special_tokens=True).strip()
    assert [static.transcribe(audios[0]).text for _ in range(2)] == [expected] * 2  # the given-back workspaces decode
    with pytest.raises(ValueError, match="workspaces must be an integer >= 1"):
        static.warm_up(workspaces=0)


def test_a_batch_whose_workspace_is_busy_is_decoded_in_the_free_ones(tiny_asr, audios):
    """Workspaces after warm_up(workspaces=4) with batches of 4 rows: four of one row and one of
    four. A batch that comes while another batch holds the 4-row one is decoded in parts in the
    free one-row workspaces - no workspace is made (and captured) while callers speak - and each
    utterance gets its transcript; a transcriber not warmed up makes a batch's workspace the first
    time such a batch comes."""
    from pipecat_taste.asr_batches import Utterance

    model = varied_model(tiny_asr)
    asr = WhisperTranscriber(model, tiny_asr.feature_extractor, tiny_asr.tokenizer, language="en", max_new_tokens=12,
                             graph_mode="rehearse", batch_rows=4)
    asr.warm_up(workspaces=4)
    assert sorted(w.rows for w in asr._workspaces) == [1, 1, 1, 1, 4]
    alone = [asr.transcribe(audio).ids for audio in audios[:3]]
    batch = [Utterance(asr._features(audio), ()) for audio in audios[:3]]
    busy = asr._borrow(asr.plan, 4)  # another batch is being decoded in it
    assert busy.rows == 4
    made = len(asr._made)
    assert [ids for ids, _ in asr._decode_batch(batch)] == alone
    assert len(asr._made) == made and sorted(w.rows for w in asr._workspaces) == [1, 1, 1, 1]
    asr._give_back(busy)
    assert [ids for ids, _ in asr._decode_batch(batch)] == alone  # (in the 4-row one, now free)

    cold = WhisperTranscriber(model, tiny_asr.feature_extractor, tiny_asr.tokenizer, language="en", max_new_tokens=12,
                              graph_mode="rehearse", batch_rows=4)
    assert [ids for ids, _ in cold._decode_batch(batch)] == alone
    assert sorted(w.rows for w in cold._workspaces) == [4]


def test_a_batch_workspace_that_cannot_be_made_at_start_up_turns_batching_off(tiny_asr, audios, monkeypatch):
    """The workspace for turns ending together fails at warm-up (out of memory on a full GPU): the
    transcriber decodes turns one by one from then on, instead of failing every batch the same way."""
    model = varied_model(tiny_asr)
    asr = WhisperTranscriber(model, tiny_asr.feature_extractor, tiny_asr.tokenizer, language="en", max_new_tokens=12,
                             graph_mode="rehearse", batch_rows=4)
    working = StaticWhisperDecoder.warm_up

    def out_of_memory_for_batches(self):
        if self.rows > 1:
            raise RuntimeError("CUDA out of memory (injected)")
        working(self)

    monkeypatch.setattr(StaticWhisperDecoder, "warm_up", out_of_memory_for_batches)
    asr.warm_up(workspaces=2)
    assert asr.batch_rows == 1 and asr._batches().rows == 1
    assert sorted(w.rows for w in asr._workspaces) == [1, 1]
    assert asr.transcribe(audios[0]).ids == generate(model, features(tiny_asr, audios[0]), language="en",
                                                     task="transcribe", max_new_tokens=12)


def test_settings_the_loop_does_not_support_use_generate(tiny_asr, audios):
    model = varied_model(tiny_asr)
    assert "detect" in greedy_plan(model, None, None, 10)  # no language: generate detects it
    model.generation_config.num_beams = 2
    assert "num_beams" in greedy_plan(model, "en", "transcribe", 10)
    auto = WhisperTranscriber(model, tiny_asr.feature_extractor, tiny_asr.tokenizer, language="en", max_new_tokens=10)
    assert auto.decode == "dynamic" and "num_beams" in auto.generate_reason and auto.new_turn() is None
    with pytest.raises(ValueError, match="num_beams"):
        WhisperTranscriber(model, tiny_asr.feature_extractor, tiny_asr.tokenizer, language="en", decode="static")
    model.generation_config.num_beams = 1
    assert "lang_to_id" in greedy_plan(model, "klingon", "transcribe", 10)
    assert "exceed" in greedy_plan(model, "en", "transcribe", 1000)


def test_a_failing_static_loop_falls_back_to_generate(tiny_asr, audios, monkeypatch):
    model = varied_model(tiny_asr)
    asr = WhisperTranscriber(model, tiny_asr.feature_extractor, tiny_asr.tokenizer, language="en", max_new_tokens=10)
    assert asr.decode == "static"

    def broken(self, utterances):
        raise RuntimeError("injected")

    working = StaticWhisperDecoder.decode_many
    monkeypatch.setattr(StaticWhisperDecoder, "decode_many", broken)
    expected = generate(model, features(tiny_asr, audios[0]), language="en", task="transcribe", max_new_tokens=10)
    for _ in range(STATIC_FAILURES_TO_GIVE_UP - 1):  # failures with a success between: not in a row
        asr.transcribe(audios[0])
    monkeypatch.setattr(StaticWhisperDecoder, "decode_many", working)
    assert asr.transcribe(audios[0]).ids == expected and asr.decode == "static"
    monkeypatch.setattr(StaticWhisperDecoder, "decode_many", broken)
    for attempt in range(1, STATIC_FAILURES_TO_GIVE_UP + 1):
        result = asr.transcribe(audios[0])
        assert result.ids == expected
        gave_up = attempt == STATIC_FAILURES_TO_GIVE_UP
        assert (asr.decode == "dynamic") == gave_up and (asr.new_turn() is None) == gave_up
    assert "3 times in a row" in asr.generate_reason and "injected" in asr.generate_reason


def test_one_failure_of_the_static_loop_does_not_give_it_up(tiny_asr, audios, monkeypatch):
    """One transient failure (an out-of-memory in one call) sends that utterance to generate; the
    engine's other calls keep the fast path and their incremental transcripts."""
    model = varied_model(tiny_asr)
    asr = WhisperTranscriber(model, tiny_asr.feature_extractor, tiny_asr.tokenizer, language="en", max_new_tokens=10)
    working = StaticWhisperDecoder.decode_many
    failures = iter([True, True, False, True, False])

    def sometimes(self, utterances):
        if next(failures):
            raise RuntimeError("injected")
        return working(self, utterances)

    monkeypatch.setattr(StaticWhisperDecoder, "decode_many", sometimes)
    expected = generate(model, features(tiny_asr, audios[0]), language="en", task="transcribe", max_new_tokens=10)
    for _ in range(5):  # two failures, a success (the count starts again), a failure, a success
        assert asr.transcribe(audios[0]).ids == expected
    assert asr.decode == "static" and asr.new_turn() is not None


def test_timestamp_tokens_in_a_row_go_to_generate(tiny_asr, audios):
    """generate reads two timestamp tokens in a row as a segment end and decodes the rest of the
    audio again; the loop leaves such utterances to generate."""
    model = varied_model(tiny_asr, no_timestamps=504)  # 505.. are timestamps, and frequent here
    asr = WhisperTranscriber(model, tiny_asr.feature_extractor, tiny_asr.tokenizer, language="en", max_new_tokens=20,
                             decode="static", graph_mode="eager")
    split = 0
    for audio in audios:
        feats = features(tiny_asr, audio)
        ids, _ = StaticWhisperDecoder(model, asr.plan, "eager").decode(feats)
        split += asr.plan.splits_into_segments(ids)
        expected = generate(model, feats, language="en", task="transcribe", max_new_tokens=20)
        assert asr.transcribe(audio).ids == expected
    assert split  # some utterances did take the generate path


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_loop_matches_generate(tiny_asr, audios, dtype):
    """The captured step on a GPU: same ids as generate (float32; bfloat16 where no logits nearly tie)."""
    model = varied_model(tiny_asr).to("cuda", dtype)
    asr = WhisperTranscriber(model, tiny_asr.feature_extractor, tiny_asr.tokenizer, device="cuda", language="en",
                             max_new_tokens=16)
    assert asr.decode == "static"
    same = 0
    for audio in audios:
        feats = features(tiny_asr, audio).to("cuda", dtype)
        expected = generate(model, feats, language="en", task="transcribe", max_new_tokens=16)
        result = asr.transcribe(audio)
        same += result.ids == expected
        assert asr.transcribe(audio, draft=result.ids).ids == result.ids
    workspace = asr._workspaces[0]
    assert workspace.captured and workspace.fallback_reason is None
    assert same == len(audios) if dtype == torch.float32 else same >= len(audios) - 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_turns_ending_together_are_transcribed_as_one_captured_batch(tiny_asr, audios):
    """Two calls on CUDA streams of their own whose turns end at once: one batch (8 rows on CUDA)
    decodes both - one captured encoder pass, the draft checks and tails side by side - and each
    gets the transcript it gets alone."""

    from concurrency_helpers import run_in_threads

    model = varied_model(tiny_asr).to("cuda")
    asr = WhisperTranscriber(model, tiny_asr.feature_extractor, tiny_asr.tokenizer, device="cuda", language="en",
                             max_new_tokens=16)
    asr.warm_up(workspaces=2)
    assert asr._encoder.rows == 8 and asr._encoder.captured, asr._encoder.fallback_reason
    assert sorted(w.rows for w in asr._workspaces) == [1, 1, 2]
    assert all(w.captured for w in asr._workspaces), [w.fallback_reason for w in asr._workspaces]
    alone = [asr.transcribe(audio).text for audio in audios[:2]]
    turns = [asr.new_turn() for _ in range(2)]
    for turn in turns:
        turn.ended()
    asr._batches().timed(10.0)  # (a long limit, capped at MAX_WAIT_S: the wait must end because the other came)
    before, batches_before = asr.encoder_stats(), asr.batch_stats()
    streams, texts = [torch.cuda.Stream() for _ in range(2)], [None, None]

    def finish(i):
        time.sleep(0.02 * i)
        with torch.cuda.stream(streams[i]):
            texts[i] = turns[i].finish(audios[i])

    run_in_threads(finish, [(0,), (1,)])
    after, batches_after = asr.encoder_stats(), asr.batch_stats()
    assert (after["turns"] - before["turns"], after["passes"] - before["passes"]) == (2, 1), (before, after)
    assert (batches_after["utterances"] - batches_before["utterances"],
            batches_after["batches"] - batches_before["batches"]) == (2, 1), (batches_before, batches_after)
    assert batches_after["waits_ran_out"] == batches_before["waits_ran_out"]  # ended when the other came
    assert texts == alone


def test_a_whisper_stored_in_float16_runs_in_float32_on_a_cpu(tiny_asr, audios, tmp_path):
    """openai/whisper-large-v3 stores float16 weights, and transformers would load them as float16
    even on a CPU: the transcriber's default runs float32 there (bfloat16 on CUDA), as the LM does."""
    import copy

    from transformers import WhisperProcessor

    copy.deepcopy(tiny_asr.model).half().save_pretrained(tmp_path)
    WhisperProcessor(tiny_asr.feature_extractor, tiny_asr.tokenizer).save_pretrained(tmp_path)

    default = WhisperTranscriber.from_pretrained(str(tmp_path), language=None, max_new_tokens=None, decode="dynamic")
    assert next(default.model.parameters()).dtype == torch.float32
    assert default.transcribe(audios[0]).ids  # it runs
    asked = WhisperTranscriber.from_pretrained(str(tmp_path), dtype="bfloat16", language=None, max_new_tokens=None)
    assert next(asked.model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'half-ish'"):
        WhisperTranscriber.from_pretrained(str(tmp_path), dtype="half-ish")


def test_a_whisper_folder_under_home_can_be_named_with_a_tilde(tiny_asr, tmp_path, monkeypatch):
    """'~/whisper' is a folder to us and to transformers alike (transformers took it for a bad hub id)."""
    from transformers import WhisperProcessor

    folder = tmp_path / "whisper"
    tiny_asr.model.save_pretrained(folder)
    WhisperProcessor(tiny_asr.feature_extractor, tiny_asr.tokenizer).save_pretrained(folder)
    monkeypatch.setenv("HOME", str(tmp_path))
    loaded = WhisperTranscriber.from_pretrained("~/whisper", language=None, max_new_tokens=None)
    assert torch.equal(next(loaded.model.parameters()), next(tiny_asr.model.parameters()))


def test_one_failed_batch_counts_as_one_failure(tiny_asr, audios, monkeypatch):
    """A batch fails every utterance in it with the same error (an out-of-memory in an 8-row
    batch): that is one failure of the fast path, not one per call, so the calls that happened to
    be in it do not give the static loop up for everyone."""
    from concurrency_helpers import run_in_threads

    model = varied_model(tiny_asr)
    asr = WhisperTranscriber(model, tiny_asr.feature_extractor, tiny_asr.tokenizer, language="en", max_new_tokens=10,
                             batch_rows=4)
    shared = RuntimeError("one batch, four turns")

    def in_a_failed_batch(self, utterances):
        raise shared

    monkeypatch.setattr(StaticWhisperDecoder, "decode_many", in_a_failed_batch)
    turns = [asr.new_turn() for _ in range(STATIC_FAILURES_TO_GIVE_UP + 1)]
    for turn in turns:
        turn.ended()
    asr._batches().timed(10.0)  # (a long limit, capped at MAX_WAIT_S: the leader waits until every turn came)
    texts = [None] * len(turns)

    def finish(i):
        texts[i] = turns[i].finish(audios[0])  # each utterance of the batch goes to generate

    run_in_threads(finish, [(i,) for i in range(len(turns))])
    expected = generate(model, features(tiny_asr, audios[0]), language="en", task="transcribe", max_new_tokens=10)
    assert texts == [tiny_asr.tokenizer.decode(expected, skip_special_tokens=True).strip()] * len(turns)
    assert asr.batch_stats()["batches"] == 1
    assert asr.decode == "static" and asr._static_failures == 1
    assert asr.decode == "static" and asr._static_failures == 1


def test_the_shared_encoder_warms_up_without_recording_gradients(tiny_asr):
    """transformers loads a Whisper with trainable weights; capturing its encoder must not keep an
    autograd graph (every layer's activations) alive in the step's outputs."""
    from taste_speech.encoder_graph import EncoderGraph

    from pipecat_taste.whisper_decode import WhisperEncoderStack

    model = varied_model(tiny_asr)
    assert any(p.requires_grad for p in model.parameters())
    graph = EncoderGraph(WhisperEncoderStack(model), "rehearse", rows=2)
    graph.warm_up()
    outputs = [out for step in graph._steps.values() for out in step.outputs]
    assert len(outputs) == 2 and not any(out.requires_grad for out in outputs)


def test_a_partial_running_when_its_turn_ends_does_not_wait_for_its_own_finish(tiny_asr, audios):
    """The turn ends (announced) while its last partial is being transcribed: that partial must not
    wait for the finish that comes after it on the same thread - a call alone never waits."""
    model = varied_model(tiny_asr)
    asr = WhisperTranscriber(model, tiny_asr.feature_extractor, tiny_asr.tokenizer, language="en", max_new_tokens=10,
                             graph_mode="rehearse", batch_rows=2)
    asr.warm_up()
    asr._batches().timed(5.0)
    turn = asr.new_turn()
    turn.ended()  # (the capture announces the turn; the partial below was already on its way)
    turn.partial(audios[0][: len(audios[0]) // 2])
    turn.finish(audios[0])
    assert asr.batch_stats()["waits"] == 0


def test_the_transcribers_features_are_the_whisper_extractors(tiny_asr, audios):
    """The ASR computes its log-mel with the audio tower's front end (it transforms the audio, not
    the 30 s of silence after it): the feature extractor's numbers to float rounding; an extractor
    with other settings is used as it is."""
    import copy

    from transformers import WhisperFeatureExtractor

    for audio in (audios[0], audios[0][:3000], np.zeros(0, np.float32)):
        expected = tiny_asr.feature_extractor(audio, sampling_rate=16000, return_tensors="pt").input_features
        got = tiny_asr._features(audio)
        assert got.shape == expected.shape == (1, 80, 3000)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    other = copy.copy(tiny_asr)
    other.feature_extractor = WhisperFeatureExtractor(feature_size=80, hop_length=200)  # not Whisper's hop
    expected = other.feature_extractor(audios[0], sampling_rate=16000, return_tensors="pt").input_features
    assert torch.equal(other._features(audios[0]), expected)


def test_calls_transcribing_at_random_moments_get_the_transcripts_they_get_alone(tiny_asr, audios):
    """Four calls, three turns each, on their own threads: partial transcripts and turn ends at
    random moments (a few turns ending together), through a transcriber that batches up to 4
    utterances. Every partial and every final transcript is the one a transcriber without batches
    gives, some batches held several utterances, and nobody hung."""
    import random

    from concurrency_helpers import run_in_threads

    model = varied_model(tiny_asr)

    def transcriber(rows):
        return WhisperTranscriber(model, tiny_asr.feature_extractor, tiny_asr.tokenizer, language="en",
                                  max_new_tokens=12, graph_mode="rehearse", batch_rows=rows)

    batched, alone = transcriber(4), transcriber(1)
    batched.warm_up(workspaces=4)
    cuts = (0.4, 0.7)
    expected = {(i, cut): alone.transcribe(audio[: int(audio.size * cut)]).ids
                for i, audio in enumerate(audios) for cut in (*cuts, 1.0)}
    got, lock = [], threading.Lock()

    def call(c):
        rng = random.Random(c)
        for turn_index in range(3):
            i = (c + turn_index) % len(audios)
            audio = audios[i]
            turn = batched.new_turn()
            for cut in cuts:
                time.sleep(rng.uniform(0, 0.01))
                turn.partial(audio[: int(audio.size * cut)])
                with lock:
                    got.append(((i, cut), turn.draft))
            turn.ended()
            time.sleep(rng.uniform(0, 0.005))
            result = batched.transcribe(audio, turn.draft, owner=turn)
            with lock:
                got.append(((i, 1.0), result.ids))

    run_in_threads(call, [(c,) for c in range(4)])
    assert len(got) == 4 * 3 * 3
    assert all(ids == expected[key] for key, ids in got), [key for key, ids in got if ids != expected[key]]
    stats = batched.batch_stats()
    assert stats["utterances"] == 4 * 3 * 3 + 1 and stats["batches"] < stats["utterances"], stats  # (+1: warm-up)


def test_int16_audio_is_transcribed_as_its_float_samples(checkpoint, tiny_asr, audios):
    """The tower's front end takes int16 samples (scaled by 1/32768); the transcriber took them as
    floats peaking near 32767 and refused them, asking for the int16 array it had been given."""
    from pipecat_taste.audio import float_to_pcm16

    wide = WhisperTranscriber(varied_model(tiny_asr), tiny_asr.feature_extractor, tiny_asr.tokenizer,
                              language=None, max_new_tokens=None, decode="dynamic")
    pcm = np.frombuffer(float_to_pcm16(audios[0]), dtype="<i2")
    assert wide(pcm) == wide(pcm.astype(np.float32) / 32768.0)
    static = WhisperTranscriber.random_tiny(checkpoint, decode="static")
    turn = static.new_turn()  # (incremental transcripts: on the static path)
    assert turn.finish(pcm) == static(pcm.astype(np.float32) / 32768.0)


def test_the_draft_check_has_no_bucket_just_below_the_transcript_length():
    """At the agent's max_new_tokens=128 a transcript has up to 132 rows: a bucket of 128 beside the
    one of 132 would be a capture (per row count) for four rows' padding."""
    from pipecat_taste.whisper_decode import verify_buckets

    assert verify_buckets(132) == (8, 16, 32, 64, 132)
    assert verify_buckets(20) == (8, 16, 20)
    assert verify_buckets(300) == (8, 16, 32, 64, 128, 256, 300)
    assert verify_buckets(8) == (8,)
