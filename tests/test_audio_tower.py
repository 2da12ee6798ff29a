"""Audio tower (TASTE tokenizer), residual VQ and word-alignment helpers.

Parity runs against golden set tiny_a (made with the original implementation); the tower is loaded
here directly from the ``audio_tower.`` tensors of its model.safetensors so that these tests do
not depend on the full-model loader.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from taste_speech.configuration_taste import TasteConfig
from taste_speech.modeling_audio_tower import WHISPER_EOT_ID, WHISPER_PROMPT_IDS, TasteAudioTower
from taste_speech.modeling_rvq import ResidualVQ
from taste_speech.verify import points_audio_tower
from taste_speech.word_alignment import (
    llm_indices_from_asr,
    mean_pool_words,
    multi_token_word_spans,
    per_token_codes_from_word_codes,
    word_rows,
)

PREFIX = "audio_tower."


def load_tower(directory) -> TasteAudioTower:
    tower = TasteAudioTower(TasteConfig.from_pretrained(str(directory))).eval()
    weights = load_file(str(directory / "model.safetensors"))
    state = {k[len(PREFIX):]: v for k, v in weights.items() if k.startswith(PREFIX)}
    result = tower.load_state_dict(state, strict=False)
    assert not result.missing_keys and not result.unexpected_keys, result
    return tower


@pytest.fixture(scope="module")
def tower(taste_lm_tiny_a):
    return load_tower(taste_lm_tiny_a)


def _inputs(golden):
    return golden["in.audio_features"], golden["in.asr_token_ids"], golden["in.asr_word_ids"]


# -- parity -----------------------------------------------------------------------------------


def test_parity_points_all_match(golden, tower):
    results = points_audio_tower.run(golden, tower)
    failed = [r.line() for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    checked = {r.name for r in results}
    expected = {k for k in golden.tensors if k.startswith("a.")}
    expected |= {"e.words_index.out", "e.word_start_map.out", "e.convert_embeds.out"}
    assert expected <= checked, f"parity points not checked: {sorted(expected - checked)}"


def test_parity_catches_a_wrong_weight(golden, taste_lm_tiny_a):
    broken = load_tower(taste_lm_tiny_a)
    with torch.no_grad():
        broken.decoder.layers[1].encoder_attn.v_proj.weight.mul_(1.01)
    bad = {r.name for r in points_audio_tower.run(golden, broken) if not r.ok}
    assert "a.decoder.last_hidden" in bad and "a.encoder.last_hidden" not in bad


def test_forward_layout(golden, tower):
    features, ids, word_ids = _inputs(golden)
    with torch.inference_mode():
        out = tower(features, ids, word_ids)
    n = ids.shape[1]
    assert out.decoder_input_ids[0, :4].tolist() == list(WHISPER_PROMPT_IDS)
    assert out.decoder_input_ids[0, -1].item() == WHISPER_EOT_ID
    assert out.asr_indices.shape == (1, n, 4) and out.asr_indices.dtype == torch.long
    assert out.audio_unit_embeds.shape == (1, n, 64) and out.audio_unit_embeds.dtype == torch.float32
    # every Whisper token of a word carries the same codes
    for w in word_ids[0].unique():
        rows = out.asr_indices[0, word_ids[0] == w]
        assert (rows == rows[0]).all()


def test_the_encoders_fused_self_attention_gives_the_written_out_scores_values(golden, tower):
    """The encoder's self-attention runs as one fused kernel (no (heads, S, S) scores written out);
    with ``fused_encoder_attention`` off it computes them as the original does. Both give the same
    states up to float rounding, and the flag does switch the computation (softmax counted)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Softmaxes(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.overloadpacket.__name__ in ("_softmax", "softmax")
            return func(*args, **(kwargs or {}))

    features = golden["in.audio_features"]
    outputs, softmaxes = {}, {}
    try:
        for fused in (True, False):
            tower.fused_encoder_attention = fused
            with torch.inference_mode(), Softmaxes() as counted:
                outputs[fused] = tower.encode_audio(features)
            softmaxes[fused] = counted.count
    finally:
        tower.fused_encoder_attention = True
    assert softmaxes == {True: 0, False: tower.whisper_config.encoder_layers}
    for fused, written in zip(outputs[True], outputs[False]):
        torch.testing.assert_close(fused, written, rtol=1e-5, atol=1e-5)
        assert not torch.equal(fused, written)  # (two computations, not one run twice)


def test_short_audio_is_zero_padded(golden, tower):
    features, ids, word_ids = _inputs(golden)
    short = features[:, :217]
    padded = torch.cat([short, torch.zeros(1, tower.num_frames - 217, short.shape[-1])], dim=1)
    with torch.inference_mode():
        a = tower(short, ids, word_ids)
        b = tower(padded, ids, word_ids)
    assert torch.equal(a.encoder_last_hidden, b.encoder_last_hidden)
    assert torch.equal(a.asr_indices, b.asr_indices)


def test_extract_vq_word_start_rule(golden, tower):
    features, ids, word_ids = _inputs(golden)
    llm_word_ids = golden["in.llm_word_ids"]
    with torch.inference_mode():
        asr_indices, llm_indices = tower.extract_vq(features, ids, word_ids, llm_word_ids)
    assert torch.equal(llm_indices, golden["a.out.llm_indices"])
    valid = llm_indices[0, :, 0] != -1
    assert int(valid.sum()) == int(word_ids.max()) + 1  # exactly one valid row per word


def test_bf16_tower_runs(golden, taste_lm_tiny_a):
    tower16 = load_tower(taste_lm_tiny_a).to(torch.bfloat16)
    tower16.vq.float()  # the RVQ stays fp32, as in the published model
    features, ids, word_ids = _inputs(golden)
    with torch.inference_mode():
        out = tower16(features, ids, word_ids)
    assert out.encoder_last_hidden.dtype == torch.bfloat16
    assert out.audio_unit_embeds.dtype == torch.float32
    assert out.asr_indices.shape == golden["a.out.asr_indices"].shape
    assert torch.isfinite(out.audio_unit_embeds).all()


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda f, i, w: (torch.zeros(1, 301, 128), i, w), "at most 300"),
        (lambda f, i, w: (f[..., :80], i, w), r"\(1, frames, 128\)"),
        (lambda f, i, w: (f[0], i, w), r"\(1, frames, 128\)"),
        (lambda f, i, w: (f.repeat(2, 1, 1), i, w), r"\(1, frames, 128\)"),
        (lambda f, i, w: (f, i[0], w), r"asr_token_ids must be"),
        (lambda f, i, w: (f, i, w[:, :-1]), "one word id per Whisper token"),
        (lambda f, i, w: (f, i[:, :0], w[:, :0]), "no Whisper tokens"),
        (lambda f, i, w: (f, i.repeat(1, 6), w.repeat(1, 6)), "at most 59"),
        (lambda f, i, w: (f, i + 10 ** 6, w), r"asr_token_ids must lie in \[0, "),  # (Llama ids, say)
        (lambda f, i, w: (f, i - 10 ** 6, w), r"asr_token_ids must lie in \[0, "),
        (lambda f, i, w: (f, i, w + 1), "asr_word_ids must start at 0"),
        (lambda f, i, w: (f, i, 2 * w), "grow by at most 1 per token"),
    ],
)
def test_bad_inputs_raise(golden, tower, make, match):
    args = make(*_inputs(golden))
    with pytest.raises(ValueError, match=match):
        tower(*args)


def test_word_ids_of_another_text_are_refused_by_extract_vq(golden, tower):
    """llm_word_ids numbering more or fewer words than asr_word_ids would leave words without
    codes (or codes on the wrong words) silently."""
    f, i, w = _inputs(golden)
    words = int(w.max()) + 1
    _, codes = tower.extract_vq(f, i, w, torch.arange(words)[None])
    assert (codes[0, :, 0] >= 0).all()  # the same words: one code each
    for other in (words - 1, words + 1):
        with pytest.raises(ValueError, match=f"llm_word_ids number {other} word"):
            tower.extract_vq(f, i, w, torch.arange(other)[None])


# -- full-size structure ------------------------------------------------------------------------


def test_full_size_keys_and_shapes_match_manifest(taste_lm_tiny_a):
    data = taste_lm_tiny_a.parent
    config = TasteConfig.from_json_file(str(data / "taste_lm_config_full.json"))
    with torch.device("meta"):
        tower = TasteAudioTower(config)
    ours = {PREFIX + k: tuple(v.shape) for k, v in tower.state_dict().items()}
    manifest = json.loads((data / "taste_lm_manifest_full.json").read_text())
    published = {e["key"]: tuple(e["shape"]) for e in manifest["keys"] if e["top"] == "audio_tower"}
    assert len(published) == 613
    assert sorted(set(published) - set(ours)) == [], "missing keys"
    assert sorted(set(ours) - set(published)) == [], "unexpected keys"
    assert {k: v for k, v in ours.items() if published[k] != v} == {}
    persistent_buffers = {
        e["key"] for e in manifest["keys"] if e["top"] == "audio_tower" and e["kind"] != "parameter"
    }
    ours_buffers = {PREFIX + name for name, _ in tower.named_buffers()}
    assert persistent_buffers == ours_buffers
    assert tower.max_text_tokens == 443 and tower.num_frames == 3000


# -- residual VQ --------------------------------------------------------------------------------


def _separated_rvq(seed=0, dim=24, k=4, size=8, code_dim=16) -> ResidualVQ:
    """An RVQ whose level-l codebook has scale 0.05**l, so sums of one code per level decode back
    unambiguously."""
    gen = torch.Generator().manual_seed(seed)
    rvq = ResidualVQ(dim, k, size, code_dim)
    with torch.no_grad():
        for level, book in enumerate(rvq.codebooks()):
            book.embed.copy_(torch.randn(1, size, code_dim, generator=gen) * 0.05**level)
    return rvq.eval()


def test_rvq_code_space_roundtrip():
    rvq = _separated_rvq()
    gen = torch.Generator().manual_seed(1)
    indices = torch.randint(0, 8, (2, 5, 4), generator=gen)
    z = rvq.codes_from_indices(indices).sum(0)
    assert torch.equal(rvq.indices_from_code(z), indices)


def test_rvq_quantize_and_decode_definitions():
    rvq = _separated_rvq()
    x = torch.randn(1, 7, 24, generator=torch.Generator().manual_seed(2))
    indices = rvq.quantize(x)
    assert indices.shape == (1, 7, 4) and indices.dtype == torch.long
    assert torch.equal(indices, rvq.indices_from_code(rvq.project_in(x)))
    codes = torch.stack([book.embed[0][indices[..., k]] for k, book in enumerate(rvq.codebooks())])
    assert torch.equal(rvq.codes_from_indices(indices), codes)
    torch.testing.assert_close(rvq.decode(indices), rvq.project_out(codes.sum(0)))


def test_rvq_nearest_matches_brute_force():
    rvq = _separated_rvq(size=64)
    z = torch.randn(200, 16, generator=torch.Generator().manual_seed(3))
    residual = z.double()
    expected = []
    for book in rvq.codebooks():
        idx = torch.cdist(residual, book.embed[0].double()).argmin(-1)
        expected.append(idx)
        residual = residual - book.embed[0].double()[idx]
    assert torch.equal(rvq.indices_from_code(z), torch.stack(expected, -1))


def test_rvq_ties_go_to_lowest_index():
    rvq = _separated_rvq()
    book = rvq.codebooks()[0]
    with torch.no_grad():
        book.embed.zero_()
        book.embed[0, :, :8] = 5 * torch.eye(8)  # code c = 5 * unit vector c: all equally far from 0
    assert book.nearest(torch.zeros(1, 16)).item() == 0
    x = torch.zeros(1, 16)
    x[0, 3] = x[0, 6] = 2.5  # exactly equidistant from codes 3 and 6, farther from the rest
    assert book.nearest(x).item() == 3
    with torch.no_grad():
        book.embed[0, 1] = book.embed[0, 6]  # duplicate code: the lower index wins
    assert book.nearest(book.embed[0, 6:7]).item() == 1


def test_rvq_ignore_index_decodes_to_zero_at_that_level():
    rvq = _separated_rvq()
    full = torch.tensor([[[1, 2, 3, 4]]])
    partial = torch.tensor([[[1, 2, -1, 4]]])
    codes = rvq.codes_from_indices(partial)
    assert torch.equal(codes[2], torch.zeros_like(codes[2]))
    expected = rvq.project_out(rvq.codes_from_indices(full).sum(0) - rvq.codebooks()[2].embed[0, 3])
    torch.testing.assert_close(rvq.decode(partial), expected)
    torch.testing.assert_close(rvq.decode(torch.full((1, 1, 4), -1)), rvq.project_out.bias.view(1, 1, -1))


def test_rvq_decoding_gathers_every_level_at_once_and_gives_the_level_by_level_values():
    """One gather from the levels' joined table, not ~35 operators a word (each a kernel launch on
    a GPU): the same numbers as selecting, masking and summing level by level."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        operators = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.operators += 1
            return func(*args, **(kwargs or {}))

    rvq = _separated_rvq()
    indices = torch.tensor([[[1, 2, -1, 4], [7, 0, 3, -1], [-1, -1, -1, -1]]])
    level_by_level = torch.stack([book.embed[0][indices[..., k].clamp(min=0)] * (indices[..., k] >= 0).unsqueeze(-1)
                                  for k, book in enumerate(rvq.codebooks())])
    rvq.decode(indices)  # (the table is made once)
    with Count():
        decoded = rvq.decode(indices, check=False)
    assert Count.operators <= 10
    assert torch.equal(decoded, rvq.project_out(level_by_level.sum(0)))
    assert torch.equal(rvq.codes_from_indices(indices), level_by_level)


def test_rvq_decoding_follows_its_codebooks_when_they_change():
    rvq = _separated_rvq()
    indices = torch.tensor([[[1, 2, 3, 4]]])
    before = rvq.decode(indices)
    with torch.no_grad():
        rvq.codebooks()[3].embed[0, 4] += 1.0  # written in place
    after = rvq.decode(indices)
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, rvq.project_out(rvq.codes_from_indices(indices).sum(0)))
    other = _separated_rvq(seed=5)
    rvq.load_state_dict(other.state_dict())  # loaded over
    assert torch.equal(rvq.decode(indices), other.decode(indices))
    rvq.to(torch.float64)  # cast: the table follows (fp32 codes either way)
    assert torch.equal(rvq.codes_from_indices(indices), other.codes_from_indices(indices))


@pytest.mark.parametrize(
    "indices, match",
    [
        (torch.tensor([[[0, 1, 2, -2]]]), "must lie in"),
        (torch.tensor([[[0, 1, 2, 8]]]), "must lie in"),
        (torch.tensor([[[0, 1, 2]]]), r"\(\.\.\., 4\)"),
        (torch.tensor([[[0.0, 1.0, 2.0, 3.0]]]), "integer"),
    ],
)
def test_rvq_bad_indices_raise(indices, match):
    with pytest.raises(ValueError, match=match):
        _separated_rvq().decode(indices)


def test_rvq_bad_feature_sizes_raise():
    rvq = _separated_rvq()
    with pytest.raises(ValueError, match="size 24"):
        rvq.quantize(torch.zeros(1, 2, 16))
    with pytest.raises(ValueError, match="size 16"):
        rvq.indices_from_code(torch.zeros(1, 2, 24))


def test_rvq_initted_guard(golden, taste_lm_tiny_a):
    rvq = _separated_rvq()
    state = rvq.state_dict()
    state["layers.2._codebook.initted"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"layers\.2\._codebook\.initted is not 1"):
        rvq.load_state_dict(state)
    rvq.check_initialised()  # the failed load left the good state in place
    with torch.no_grad():
        rvq.codebooks()[1].initted.zero_()  # e.g. set directly by another loader
    with pytest.raises(ValueError, match=r"layers\.1\._codebook\.initted is not 1"):
        rvq.check_initialised()
    # the tower refuses to quantise with such codebooks
    tower = load_tower(taste_lm_tiny_a)
    with torch.no_grad():
        tower.vq.rvq.codebooks()[0].initted.zero_()
    with pytest.raises(ValueError, match="never initialised"):
        tower(*_inputs(golden))


# -- word alignment -----------------------------------------------------------------------------


def test_mean_pool_words_pools_runs_and_keeps_eos_row():
    states = torch.randn(1, 7, 3, generator=torch.Generator().manual_seed(4))
    word_ids = torch.tensor([[0, 1, 1, 2, 3, 3]])
    pooled = mean_pool_words(states, word_ids)
    assert torch.equal(pooled[0, 0], states[0, 0]) and torch.equal(pooled[0, 3], states[0, 3])
    torch.testing.assert_close(pooled[0, 1], states[0, 1:3].mean(0))
    assert torch.equal(pooled[0, 1], pooled[0, 2]) and torch.equal(pooled[0, 4], pooled[0, 5])
    assert torch.equal(pooled[0, 6], states[0, 6])  # the <|endoftext|> row
    assert multi_token_word_spans(word_ids).tolist() == [[0, 1, 3], [0, 4, 6]]


def test_llm_indices_appendix_a_example():
    # words w0 = 2 llm tokens / 1 asr token, w1 = 1 / 2, w2 = 2 / 1 (spec Appendix A layout)
    asr_word_ids = torch.tensor([[0, 1, 1, 2]])
    llm_word_ids = torch.tensor([[0, 0, 1, 2, 2]])
    t0, t1, t2 = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 511]
    asr_indices = torch.tensor([[t0, t1, t1, t2]])
    ignore = [-1, -1, -1, -1]
    expected = torch.tensor([[t0, ignore, t1, t2, ignore]])
    assert torch.equal(llm_indices_from_asr(asr_indices, asr_word_ids, llm_word_ids), expected)


def test_word_rows_spread_to_asr_tokens_matches_golden(golden):
    # spec §6.1 on the golden prompt: one code row per word, gathered onto the Whisper tokens
    rows = word_rows(golden["a.out.llm_indices"])
    spread = per_token_codes_from_word_codes(rows, golden["in.asr_word_ids"])
    assert torch.equal(spread, golden["d.asr_taste_indices"])
    assert torch.equal(spread, golden["a.out.asr_indices"])
