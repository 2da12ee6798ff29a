"""The ESPnet-style rel-pos transformer: attention semantics, causality, incremental decoding."""

import math

import pytest
import torch

from taste_speech.espnet_transformer import (
    MAX_CACHED_POSITIONS,
    RelPositionTransformer,
    rel_shift,
    relative_position_table,
    sinusoid_encoding,
)


def make(causal=True, input_layer="linear", activation="silu", norm_names=("norm_mha", "norm_ff"), blocks=2,
         seed=0):
    torch.manual_seed(seed)
    model = RelPositionTransformer(12, 16, 4, 24, blocks, input_layer=input_layer, ffn_activation=activation,
                                   norm_names=norm_names, causal=causal).eval()
    with torch.no_grad():  # non-trivial values everywhere (biases, u/v, norms)
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def test_state_dict_names_follow_the_published_layout():
    conformer = make(norm_names=("norm_mha", "norm_ff"))
    transformer = make(input_layer="linear_legacy", activation="relu", norm_names=("norm1", "norm2"))
    keys = set(conformer.state_dict())
    block = {"self_attn.linear_q.weight", "self_attn.linear_q.bias", "self_attn.linear_k.weight",
             "self_attn.linear_k.bias", "self_attn.linear_v.weight", "self_attn.linear_v.bias",
             "self_attn.linear_out.weight", "self_attn.linear_out.bias", "self_attn.linear_pos.weight",
             "self_attn.pos_bias_u", "self_attn.pos_bias_v", "feed_forward.w_1.weight", "feed_forward.w_1.bias",
             "feed_forward.w_2.weight", "feed_forward.w_2.bias"}
    expected = {"embed.out.0.weight", "embed.out.0.bias", "embed.out.1.weight", "embed.out.1.bias",
                "after_norm.weight", "after_norm.bias"}
    for i in range(2):
        expected |= {f"encoders.{i}.{k}" for k in block}
        expected |= {f"encoders.{i}.{n}.{w}" for n in ("norm_mha", "norm_ff") for w in ("weight", "bias")}
    assert keys == expected
    assert "encoders.0.norm1.weight" in transformer.state_dict()
    assert "encoders.0.norm_mha.weight" not in transformer.state_dict()
    assert conformer.encoders[0].self_attn.linear_pos.bias is None
    assert isinstance(transformer.embed.out[3], torch.nn.ReLU) and len(conformer.embed.out) == 3
    assert isinstance(transformer.encoders[0].feed_forward.activation, torch.nn.ReLU)
    assert isinstance(conformer.encoders[0].feed_forward.activation, torch.nn.SiLU)


def test_relative_position_table_layout():
    table = relative_position_table(5, 8)[0]  # rows: distances 4, 3, 2, 1, 0, -1, ..., -4
    assert table.shape == (9, 8)
    omega = torch.tensor([10000.0 ** (-2 * m / 8) for m in range(4)])
    for row, r in enumerate(range(4, -5, -1)):
        assert torch.allclose(table[row, 0::2], torch.sin(r * omega), atol=1e-6)
        assert torch.allclose(table[row, 1::2], torch.cos(r * omega), atol=1e-6)
    assert torch.equal(sinusoid_encoding(torch.arange(4, -5, -1), 8), table)


def test_rel_shift_equals_transformer_xl_pad_and_reshape():
    scores = torch.randn(2, 3, 6, 11)
    b, h, t, w = scores.shape
    padded = torch.cat([torch.zeros(b, h, t, 1), scores], dim=-1).view(b, h, w + 1, t)
    expected = padded[:, :, 1:].reshape(b, h, t, w)[..., : w // 2 + 1]
    assert torch.equal(rel_shift(scores), expected)


def naive_attention(attn, x, mask):
    """score(i,j) = [(q_i+u)·k_j + (q_i+v)·linear_pos(PE(i-j))] / sqrt(d_k), written with loops."""
    t, d = x.shape[1], x.shape[2]
    h, dk = attn.h, attn.d_k
    q = attn.linear_q(x)[0].view(t, h, dk)
    k = attn.linear_k(x)[0].view(t, h, dk)
    v = attn.linear_v(x)[0].view(t, h, dk)
    out = torch.zeros(t, h, dk)
    for head in range(h):
        for i in range(t):
            scores = torch.full((t,), float("-inf"))
            for j in range(t):
                if mask[i, j]:
                    p = attn.linear_pos(sinusoid_encoding(torch.tensor([i - j]), d))[0].view(h, dk)
                    content = (q[i, head] + attn.pos_bias_u[head]) @ k[j, head]
                    position = (q[i, head] + attn.pos_bias_v[head]) @ p[head]
                    scores[j] = (content + position) / math.sqrt(dk)
            out[i, head] = scores.softmax(-1) @ v[:, head]
    return attn.linear_out(out.reshape(1, t, h * dk))


@pytest.mark.parametrize("causal", [True, False])
def test_attention_matches_the_rel_pos_formula(causal):
    model = make(causal=causal)
    attn = model.encoders[0].self_attn
    x = torch.randn(1, 6, 16)
    t = x.shape[1]
    mask = torch.ones(t, t, dtype=torch.bool)
    if causal:
        mask = mask.tril()
    with torch.no_grad():
        ours = attn(x, relative_position_table(t, 16), mask.unsqueeze(0))
        reference = naive_attention(attn, x, mask)
    assert (ours - reference).abs().max() < 1e-5


def test_causal_model_ignores_future_inputs():
    model = make(causal=True)
    x = torch.randn(1, 9, 12)
    changed = x.clone()
    changed[:, 6:] += torch.randn(1, 3, 12)
    with torch.no_grad():
        a, b = model(x), model(changed)
    assert torch.equal(a[:, :6], b[:, :6])
    assert (a[:, 6:] - b[:, 6:]).abs().max() > 1e-3


def test_full_context_model_sees_future_inputs():
    model = make(causal=False)
    x = torch.randn(1, 9, 12)
    changed = x.clone()
    changed[:, 8] += 1.0
    with torch.no_grad():
        assert (model(x)[:, 0] - model(changed)[:, 0]).abs().max() > 1e-4


def test_padding_mask_hides_padded_positions():
    model = make(causal=False)
    x = torch.randn(1, 7, 12)
    padded = torch.cat([x, torch.randn(1, 3, 12)], dim=1)
    mask = torch.tensor([[True] * 7 + [False] * 3])
    with torch.no_grad():
        alone, with_padding = model(x), model(padded, mask)
        unmasked = model(padded)
    assert (alone - with_padding[:, :7]).abs().max() < 1e-5
    assert (alone - unmasked[:, :7]).abs().max() > 1e-4  # the mask is what made the difference


@pytest.mark.parametrize("chunks", [[11], [1] * 11, [4, 1, 1, 5], [6, 2, 3]])
def test_incremental_equals_full_forward(chunks):
    model = make(causal=True, input_layer="linear_legacy", activation="relu", norm_names=("norm1", "norm2"),
                 blocks=3)
    x = torch.randn(1, sum(chunks), 12)
    with torch.no_grad():
        full = model(x)
        cache, outs, start = model.new_cache(), [], 0
        for n in chunks:
            outs.append(model.forward_incremental(x[:, start:start + n], cache))
            start += n
    assert cache.length == x.shape[1]
    assert (torch.cat(outs, dim=1) - full).abs().max() < 1e-5


def test_cache_truncate_and_clone():
    model = make(causal=True)
    x = torch.randn(1, 10, 12)
    with torch.no_grad():
        full = model(x)
        cache = model.new_cache()
        model.forward_incremental(torch.randn(1, 8, 12), cache)  # a different sequence ...
        cache.truncate(0)  # ... forgotten
        model.forward_incremental(x[:, :6], cache)
        fork = cache.clone()
        model.forward_incremental(torch.randn(1, 2, 12), fork)  # the fork diverges
        rest = model.forward_incremental(x[:, 6:], cache)  # the original continues unaffected
    assert fork.length == 8 and cache.length == 10
    assert (rest - full[:, 6:]).abs().max() < 1e-5
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(11)


def test_bad_inputs_raise_value_errors():
    with pytest.raises(ValueError, match="input_layer"):
        RelPositionTransformer(4, 8, 2, 8, 1, input_layer="conv2d")
    with pytest.raises(ValueError, match="ffn_activation"):
        RelPositionTransformer(4, 8, 2, 8, 1, ffn_activation="gelu")
    with pytest.raises(ValueError, match="divisible"):
        RelPositionTransformer(4, 10, 3, 8, 1)
    with pytest.raises(ValueError, match="norm_names"):
        RelPositionTransformer(4, 8, 2, 8, 1, norm_names=("norm1", "norm1"))
    model = make(causal=True)
    with pytest.raises(ValueError, match=r"\(B, T, 12\)"):
        model(torch.randn(1, 3, 5))
    with pytest.raises(ValueError, match="mask"):
        model(torch.randn(1, 3, 12), torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="batch 1"):
        model.forward_incremental(torch.randn(2, 3, 12), model.new_cache())
    with pytest.raises(ValueError, match="causal"):
        make(causal=False).forward_incremental(torch.randn(1, 3, 12), model.new_cache())
    cache = model.new_cache()
    cache.layers[0].keys = torch.zeros(1, 4, MAX_CACHED_POSITIONS, 4)  # pretend it is full
    with pytest.raises(ValueError, match="relative-position range"):
        model.forward_incremental(torch.randn(1, 1, 12), cache)
