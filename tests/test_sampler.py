"""TasteSampler: vocabulary tables, text/TASTE sampling and the per-step end rules (spec §5.3)."""

import pytest
import torch
from transformers.generation.logits_process import TopPLogitsWarper

from taste_speech.sampler import (
    BAN_VALUE,
    Action,
    SamplingParams,
    TasteAction,
    TasteSampler,
    VocabularyTables,
    end_of_text_ids,
)
from taste_speech.verify import Golden
from taste_speech.verify.points_spoken_lm import PieceTokenizer

K, C = 4, 8  # TASTE levels / codes in the synthetic tests


class ListTokenizer:
    """len() + decode(i), plus optional transformers-style special-token attributes."""

    def __init__(self, pieces, special_ids=(), tokens=None):
        self.pieces = list(pieces)
        self.all_special_ids = list(special_ids)
        self.tokens = tokens or {}
        self.unk_token_id = None

    def __len__(self):
        return len(self.pieces)

    def decode(self, i):
        return self.pieces[i]

    def convert_tokens_to_ids(self, token):
        return self.tokens.get(token)


# A small vocabulary: word starts " a", " b.", " c"; continuations "d", "e."; punctuation.
PIECES = [" a", " b.", " c", "d", "e.", "!", "?", "\n", " ", ".", ",", "'", "x\n", "é", " .", "<|end_of_text|>"]
A, B_DOT, C_, D, E_DOT = 0, 1, 2, 3, 4


def sampler(**params):
    params.setdefault("text_top_p", 0.0)
    return TasteSampler(VocabularyTables.from_tokenizer(ListTokenizer(PIECES)), SamplingParams(**params))


def one_hot_logits(i, size=len(PIECES)):
    logits = torch.full((size,), -5.0)
    logits[i] = 5.0
    return logits


def taste_logits(code=3):
    logits = torch.zeros(K, C)
    logits[:, code] = 1000.0
    return logits


# -- tables ------------------------------------------------------------------------------------------
def test_tables_match_golden_masks(taste_lm_tiny_a):
    golden = Golden(str(taste_lm_tiny_a))
    tables = VocabularyTables.from_tokenizer(PieceTokenizer.from_golden(golden.dir))
    s = TasteSampler(tables)
    assert torch.equal(s.ban_mask, golden["sampler.ban_mask"])
    assert torch.equal(s.sentence_end_mask, golden["sampler.sentence_end_mask"])
    assert torch.equal(s.word_start_mask, golden["sampler.word_start_mask"])


def test_ban_rules():
    banned = VocabularyTables.from_tokenizer(ListTokenizer(PIECES)).banned
    as_dict = dict(zip(PIECES, banned.tolist()))
    for piece in ["!", "?", "\n", " ", "x\n", "é"]:
        assert as_dict[piece], piece
    for piece in [" a", " b.", "d", ".", ",", "'", " .", "<|end_of_text|>"]:
        assert not as_dict[piece], piece  # '.' explicitly kept; specials other than end-of-text allowed


def test_word_start_and_sentence_end_rules():
    tables = VocabularyTables.from_tokenizer(ListTokenizer(PIECES))
    assert tables.word_start[[A, B_DOT, C_]].all() and not tables.word_start[[D, E_DOT]].any()
    assert tables.sentence_end[[B_DOT, E_DOT, 9, 14]].all() and not tables.sentence_end[[A, D]].any()


def test_ids_from_128000_and_added_special_tokens_are_word_starts():
    pieces = ["x"] * 128010
    pieces[5] = "<|special|>"
    tables = VocabularyTables.from_tokenizer(ListTokenizer(pieces, special_ids=[5]))
    assert tables.word_start[5] and tables.word_start[128000:].all() and not tables.word_start[6:128000].any()
    # the original's literal 128001 is banned when the vocabulary has it; other specials are not
    assert tables.banned[128001] and int(tables.banned.sum()) == 1


def test_end_of_text_resolution_never_indexes_out_of_range():
    tok = ListTokenizer(PIECES, tokens={"<|end_of_text|>": 15})
    assert end_of_text_ids(tok) == [15]
    assert VocabularyTables.from_tokenizer(tok).banned[15]
    assert end_of_text_ids(ListTokenizer(PIECES), eos_token_id=[3, 4]) == [3, 4]
    assert end_of_text_ids(ListTokenizer(PIECES)) == [128001]
    tables = VocabularyTables.from_tokenizer(ListTokenizer(PIECES))  # 128001 dropped: 16-id vocabulary
    assert not tables.banned[15]
    # the LM's embedding may have more rows than the tokenizer: unknown ids decode to '' -> banned
    bigger = VocabularyTables.from_tokenizer(ListTokenizer(PIECES), vocab_size=20)
    assert bigger.banned[16:].all() and bigger.vocab_size == 20


def test_vocab_size_mismatch_is_an_error():
    with pytest.raises(ValueError, match="vocab_size"):
        sampler().sample_text(torch.zeros(len(PIECES) + 1), [])


@pytest.mark.parametrize("kwargs, match", [
    (dict(text_top_p=1.5), "text_top_p"), (dict(taste_top_p=-0.1), "taste_top_p"),
    (dict(text_temperature=0), "text_temperature"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(extra_words=0), "extra_words"), (dict(delay=2), "delay"),
])
def test_bad_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


# -- text sampling -----------------------------------------------------------------------------------
def test_greedy_bans_in_place_and_skips_penalty_and_temperature():
    s = sampler(text_top_p=0.0, repetition_penalty=100.0, text_temperature=0.01)
    logits = one_hot_logits(5)  # '!' is the best raw logit but banned
    logits[A] = 4.0
    text_id, used = s.sample_text(logits, input_ids=[A, A, A])
    assert text_id == A
    assert used[5] == BAN_VALUE and used[A] == 4.0  # no penalty, no temperature on the greedy path


def test_top_p_is_stricter_than_hf():
    # probabilities 0.5, 0.3, 0.2: with p = 0.7 HF keeps the token that crosses p, TASTE drops it.
    logits = torch.full((len(PIECES),), -1e4)
    logits[[A, C_, D]] = torch.tensor([0.5, 0.3, 0.2]).log()
    hf = TopPLogitsWarper(top_p=0.7)(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())[0]
    assert torch.isfinite(hf[C_])  # HF keeps the second token
    s = sampler(text_top_p=0.7, text_temperature=1.0, repetition_penalty=1.0)
    gen = torch.Generator().manual_seed(0)
    ids = {s.sample_text(logits, [], gen)[0] for _ in range(50)}
    assert ids == {A}
    # the best token always survives, even when it alone exceeds p
    assert s._top_p(logits, 0.01)[A] == logits[A] and (s._top_p(logits, 0.01)[[C_, D]] == BAN_VALUE).all()


def test_order_is_top_p_then_penalty_then_temperature():
    logits = torch.full((len(PIECES),), -50.0)
    logits[A], logits[C_] = 2.0, 1.9
    s = sampler(text_top_p=0.5, repetition_penalty=10.0, text_temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    # top-p first removes C; the penalty on A (seen before) comes too late to let C win.
    assert {s.sample_text(logits, [A], gen)[0] for _ in range(30)} == {A}
    _, used = s.sample_text(logits, [A, A], gen)
    assert used[A] == pytest.approx(0.2) and used[C_] == BAN_VALUE * 1.0


def test_repetition_penalty_ctrl_style_and_temperature():
    s = sampler(text_top_p=0.99999, repetition_penalty=2.0, text_temperature=0.5)
    logits = torch.full((len(PIECES),), -10.0)
    logits[A], logits[D] = 3.0, -1.0  # A and D hold > 0.99998 of the mass: both survive top-p
    _, used = s.sample_text(logits, [A, D, D], torch.Generator().manual_seed(0))
    assert used[A] == pytest.approx(3.0 / 2.0 / 0.5)  # positive: divided by the penalty, then by tau
    assert used[D] == pytest.approx(-1.0 * 2.0 / 0.5)  # negative: multiplied
    assert used[5] == pytest.approx(BAN_VALUE / 0.5)  # banned '!' (temperature applies to everything)


def test_injected_generator_makes_sampling_reproducible():
    s = sampler(text_top_p=0.95, text_temperature=1.0)
    logits = torch.randn(len(PIECES), generator=torch.Generator().manual_seed(1))

    def draw(seed):
        gen = torch.Generator().manual_seed(seed)
        return [s.sample_text(logits, [], gen)[0] for _ in range(20)]

    assert draw(3) == draw(3)
    assert len(set(draw(3))) > 1 and draw(4) != draw(3)  # the generator decides the draws


def test_the_device_draw_is_multinomial_s_own_and_refuses_what_it_refuses():
    """``pick_on_device`` (used where the probabilities live on a GPU, so that the draw reads the
    GPU once) gives torch.multinomial's pick for the same generator state, and still refuses NaN,
    negative and all-zero probabilities."""
    from taste_speech.sampler import checked_pick, draw, pick_on_device

    probs = torch.rand(500, generator=torch.Generator().manual_seed(0)) ** 8
    probs[::3] = 0.0  # banned entries
    probs = probs / probs.sum()
    for seed in range(50):
        ours = pick_on_device(probs, torch.Generator().manual_seed(seed)).tolist()
        assert ours[1] == 1 and checked_pick(ours) == int(
            torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed)))
    picks = {checked_pick(pick_on_device(probs, torch.Generator().manual_seed(s)).tolist()) for s in range(50)}
    assert len(picks) > 5 and all(probs[i] > 0 for i in picks)
    for broken in (torch.full((4,), float("nan")), torch.tensor([0.5, -0.1, 0.6]), torch.zeros(3),
                   torch.tensor([1.0, float("inf")])):
        values = pick_on_device(broken, torch.Generator().manual_seed(0)).tolist()
        with pytest.raises(RuntimeError, match="probability tensor"):
            checked_pick(values)
        with pytest.raises(RuntimeError):
            draw(broken, torch.Generator().manual_seed(0))  # on the CPU: multinomial's own check


def test_taste_sampling_returns_the_head_code():
    for top_p in (0.0, 0.9):
        s = sampler(taste_top_p=top_p)
        logits = torch.zeros(K, C)
        logits[torch.arange(K), torch.tensor([1, 5, 0, 7])] = 1000.0
        assert s.sample_taste(logits, torch.Generator().manual_seed(0)).tolist() == [1, 5, 0, 7]


# -- update: word starts, delay, end rules -------------------------------------------------------------
def run_steps(s, state, ids):
    out = []
    for i in ids:
        out.append(s.update(state, one_hot_logits(i), taste_logits(), []))
    return out


def test_first_token_is_a_word_start_and_prefix_actions():
    s = sampler(extra_words=5)
    state = s.reset(has_prefix=True)
    d = run_steps(s, state, [D, E_DOT, C_, D])
    assert [x.action for x in d] == [Action.CONTINUE_AT_WORD_START, Action.CONTINUE_NOT_AT_WORD_START,
                                     Action.CONTINUE_AT_WORD_START, Action.CONTINUE_NOT_AT_WORD_START]
    assert [x.taste_action for x in d] == [TasteAction.USE_PREFIX, TasteAction.USE_PREFIX_IGNORE,
                                           TasteAction.SAMPLE, TasteAction.SAMPLE]
    # the code of word 0 is read at the first token of word 1, inner tokens get -1 rows
    assert [x.has_taste for x in d] == [False, False, True, False]
    assert state.word_counter == 2


def test_without_prefix_the_first_word_waits_on_the_pad_vector():
    s = sampler(extra_words=5)
    d = run_steps(s, s.reset(has_prefix=False), [A, D, C_])
    assert [x.taste_action for x in d] == [TasteAction.WAIT, TasteAction.WAIT, TasteAction.SAMPLE]


def test_sentence_end_after_extra_words_then_terminate():
    s = sampler(extra_words=2)
    state = s.reset(has_prefix=False)
    # " b." at word 1 (counter 0 before it) does not end: too few words.
    d = run_steps(s, state, [B_DOT, A, E_DOT, C_])
    assert [x.action for x in d[:3]] == [0, 0, 1]
    assert state.end_text and state.end_reason == "sentence_end"  # 'e.' after 2 words
    assert d[2].emits_text  # the '.' token itself is emitted
    assert d[3].action == Action.TERMINATE and not d[3].emits_text
    assert d[3].has_taste  # the last word's code is read at the terminating step


def test_max_words_allows_3e_plus_1_words():
    e = 3
    s = sampler(extra_words=e)
    state = s.reset(has_prefix=False)
    emitted_words = 0
    for step in range(100):
        d = s.update(state, one_hot_logits(A), taste_logits(), [])
        if d.action == Action.TERMINATE:
            break
        emitted_words += d.action == Action.CONTINUE_AT_WORD_START
    assert emitted_words == 3 * e + 1 and state.end_reason == "max_words"
    assert step == 3 * e + 1


def test_stop_id_terminates_at_once():
    s = sampler(extra_words=10)
    state = s.reset(has_prefix=False, stop_id=C_)
    d = run_steps(s, state, [A, A, D, C_])
    assert d[-1].action == Action.TERMINATE and state.end_reason == "stop_id"
    assert d[-1].has_taste  # a word-start stop token reads the last word's code


def test_reset_rearms_the_state():
    s = sampler(extra_words=1)
    state = s.reset(has_prefix=True, stop_id=C_)
    run_steps(s, state, [A, B_DOT, A])
    assert state.word_counter and state.end_text
    state.reset(extra_words=4, has_prefix=False, stop_id=None)
    assert (state.word_counter, state.end_text, state.end_countdown, state.word_start_history) == (0, False, None, [])
    assert (state.extra_words, state.max_words, state.has_prefix, state.stop_id) == (4, 12, False, None)
    with pytest.raises(ValueError, match="extra_words"):
        s.reset(has_prefix=False, extra_words=0)


# -- no reads of the GPU before the choice ------------------------------------------------------------
def reads_in(run):
    """(values read back to the host while ``run()`` ran - on CUDA each waits for every kernel
    queued before it -, what it returned)."""
    from benchmarks.bench_lora_merge import OperatorCount

    with OperatorCount() as count:
        out = run()
    return count.reads, out


def masked_top_p(logits, top_p):
    """The top-p filter written with a mask as indices (the sampler's way before it scattered)."""
    sorted_logits, order = logits.sort(descending=True)
    remove = sorted_logits.softmax(-1).cumsum(-1) > top_p
    remove[..., 0] = False
    out = logits.clone()
    out[order[remove]] = BAN_VALUE
    return out


def test_top_p_by_scatter_is_the_masked_filter_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(300, generator=g).round(decimals=1)  # ties among the logits
        for p in (0.01, 0.3, 0.9, 1.0):
            assert torch.equal(TasteSampler._top_p(logits, p), masked_top_p(logits, p))


def test_choosing_a_text_token_reads_the_logits_once():
    """Greedy, and top-p with a repetition penalty: the one read is the choice itself."""
    logits = torch.randn(len(PIECES), generator=torch.Generator().manual_seed(2))
    greedy = sampler(text_top_p=0.0)
    assert reads_in(lambda: greedy.sample_text(logits, [A, D]))[0] == 1
    top_p = sampler(text_top_p=0.9, repetition_penalty=1.3, text_temperature=0.7)
    reads, (text_id, used) = reads_in(lambda: top_p.sample_text(logits, [A, D, D, 99], torch.Generator().manual_seed(0)))
    assert reads == 1 and 0 <= text_id < len(PIECES)
    assert used[A] != logits[A] / 0.7  # the penalty applied (an out-of-range id is skipped)


def test_a_decision_knows_whether_it_sampled_a_code_without_reading_it():
    s = sampler(extra_words=5)
    state = s.reset(has_prefix=False)
    decisions = run_steps(s, state, [A, D, C_, A, D, B_DOT])
    assert any(d.taste_sampled for d in decisions) and not all(d.taste_sampled for d in decisions)
    for d in decisions:
        assert d.taste_sampled == bool((d.taste_ids >= 0).all())
        reads, has = reads_in(lambda d=d: d.has_taste)
        assert reads == 0 and has == d.taste_sampled


@pytest.mark.parametrize("top_p,own_generator", [(0.0, True), (0.9, True), (0.9, False)])
def test_a_word_s_code_rides_with_the_text_choice_and_changes_no_draw(top_p, own_generator):
    """update() reads the TASTE head's code in the same copy as the text choice (greedy; a top-p
    draw with a CPU generator, or with the global one): the text ids are sample_text's with the
    same seed, a word's code is the head's, on the host, and a step reads back once, word start
    or not."""
    g = torch.Generator().manual_seed(5)
    rows = [torch.randn(len(PIECES), generator=g) for _ in range(12)]
    codes = [int(c) for c in torch.randint(0, C, (12,), generator=g)]
    plain, riding = sampler(text_top_p=top_p), sampler(text_top_p=top_p, extra_words=50)

    def seeded(i):
        if own_generator:
            return torch.Generator().manual_seed(i)
        torch.manual_seed(i)  # (the global generator)
        return None

    alone = [plain.sample_text(row, [], seeded(i))[0] for i, row in enumerate(rows)]
    state = riding.reset(has_prefix=False)
    for i, (row, code) in enumerate(zip(rows, codes)):
        reads, decision = reads_in(lambda: riding.update(state, row, taste_logits(code), [], seeded(i)))
        assert reads == 1 and decision.text_id == alone[i]
        assert decision.head_codes == [code] * K
        assert decision.taste_ids.device.type == "cpu"
        if decision.taste_sampled:
            assert decision.taste_ids.tolist() == [code] * K
        else:
            assert decision.taste_ids.tolist() == [-1] * K
    assert sum(state.word_start_history) > 2  # (some codes were sampled)
