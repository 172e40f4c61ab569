"""hf_param_name, layer_buckets, merge_lora_weight: moving trained weights into an engine."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nla_core import hf_param_name, layer_buckets, merge_lora_weight

FAST = settings(max_examples=60, deadline=None)

PREFIX = "base_model.model."
SEGMENTS = ["model", "layers", "0", "3", "12", "self_attn", "q_proj", "o_proj", "mlp", "down_proj",
            "embed_tokens", "norm", "lm_head", "visual", "blocks", "default", "base", "layer"]

plain_stems = st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=6).map(".".join)
plain_names = st.builds(lambda stem, leaf: f"{stem}.{leaf}", plain_stems, st.sampled_from(["weight", "bias"]))


# ---------------------------------------------------------------- hf_param_name


@pytest.mark.parametrize(
    "peft, hf",
    [
        ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("base_model.model.model.layers.11.self_attn.o_proj.base_layer.bias", "model.layers.11.self_attn.o_proj.bias"),
        ("base_model.model.model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight"),
        ("base_model.model.model.embed_tokens.weight", "model.embed_tokens.weight"),
        ("base_model.model.lm_head.weight", "lm_head.weight"),
        ("model.norm.weight", "model.norm.weight"),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", None),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight", None),
        ("base_model.model.model.embed_tokens.lora_embedding_A.default", None),
        ("base_model.model.model.layers.2.self_attn.v_proj.lora_magnitude_vector.default.weight", None),
        ("base_model.model.lm_head.modules_to_save.default.weight", None),
    ],
)
def test_hf_param_name_cases(peft, hf):
    assert hf_param_name(peft) == hf


@FAST
@given(plain_names)
def test_plain_names_unchanged(name):
    assert hf_param_name(name) == name


@FAST
@given(plain_names, st.booleans(), st.booleans())
def test_peft_forms_map_to_plain_and_idempotent(name, prefixed, base_layer):
    peft = name
    if base_layer:
        stem, leaf = peft.rsplit(".", 1)
        peft = f"{stem}.base_layer.{leaf}"
    if prefixed:
        peft = PREFIX + peft
    out = hf_param_name(peft)
    assert out == name
    assert hf_param_name(out) == out  # idempotent


@FAST
@given(plain_stems, st.sampled_from(["lora_A", "lora_B", "lora_embedding_A", "lora_magnitude_vector", "modules_to_save"]), st.booleans())
def test_adapter_entries_dropped(stem, part, prefixed):
    name = f"{stem}.{part}.default.weight"
    assert hf_param_name(PREFIX + name if prefixed else name) is None


def _tiny_qwen3():
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(cfg)


def test_real_peft_model_maps_onto_base_state_dict():
    peft = pytest.importorskip("peft")
    base_keys = set(_tiny_qwen3().state_dict().keys())  # a fresh base built the same way
    model = _tiny_qwen3()
    base_sd = {k: v.clone() for k, v in model.state_dict().items()}
    assert set(base_sd) == base_keys
    wrapped = peft.get_peft_model(
        model, peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    )
    sd = wrapped.state_dict()
    assert any(".base_layer." in k for k in sd) and any("lora_" in k for k in sd)  # really wrapped
    mapped = [(hf_param_name(k), v) for k, v in sd.items()]
    mapped = [(k, v) for k, v in mapped if k is not None]
    names = [k for k, _ in mapped]
    assert len(names) == len(set(names)), "two PEFT entries map to one name"
    assert set(names) == base_keys
    for k, v in mapped:  # fresh LoRA (B = 0): the mapped tensors are the base weights
        assert torch.equal(v, base_sd[k]), k
    # the engine-side buckets of the mapped state dict: every tensor once, other first
    buckets = layer_buckets(mapped)
    assert buckets[0][0] == "other"
    assert sorted(n for _, items in buckets for n, _ in items) == sorted(names)
    assert len(buckets) == 3  # other + 2 layers


# ---------------------------------------------------------------- layer_buckets


NON_LAYER = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.rotary.inv_freq"]
LAYER_LEAVES = ["self_attn.q_proj.weight", "mlp.up_proj.weight", "input_layernorm.weight"]


@st.composite
def named_tensor_lists(draw):
    layer_names = [
        f"model.layers.{i}.{leaf}"
        for i in draw(st.sets(st.integers(0, 13), max_size=8))
        for leaf in draw(st.lists(st.sampled_from(LAYER_LEAVES), min_size=1, max_size=3, unique=True))
    ]
    other = draw(st.lists(st.sampled_from(NON_LAYER), unique=True, max_size=4))
    names = draw(st.permutations(layer_names + other))
    return [(n, torch.full((1,), float(k))) for k, n in enumerate(names)]


def layer_of(name):
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return None if m is None else int(m.group(1))


@FAST
@given(named_tensor_lists())
def test_buckets_cover_every_tensor_once_in_numeric_order(items):
    buckets = layer_buckets(iter(items))  # any iterable, consumed once
    flat = [pair for _, bucket in buckets for pair in bucket]
    assert len(flat) == len(items)
    assert sorted(id(t) for _, t in flat) == sorted(id(t) for _, t in items)  # the same tensors, once
    assert sorted(n for n, _ in flat) == sorted(n for n, _ in items)
    has_other = any(layer_of(n) is None for n, _ in items)
    layer_buckets_seen = buckets
    if has_other:
        assert buckets[0][0] == "other"
        assert all(layer_of(n) is None for n, _ in buckets[0][1])
        layer_buckets_seen = buckets[1:]
    indices = []
    for name, bucket in layer_buckets_seen:
        assert name != "other" and bucket
        ks = {layer_of(n) for n, _ in bucket}
        assert len(ks) == 1 and None not in ks
        indices.append(ks.pop())
    assert indices == sorted(indices) and len(indices) == len(set(indices))  # strictly ascending


def test_layer_ten_after_nine():
    items = [(f"model.layers.{i}.mlp.weight", torch.zeros(1)) for i in (10, 2, 9, 1, 11, 0)]
    items.append(("lm_head.weight", torch.zeros(1)))
    buckets = layer_buckets(items)
    assert buckets[0] == ("other", [items[-1]])
    order = [layer_of(bucket[0][0]) for _, bucket in buckets[1:]]
    assert order == [0, 1, 2, 9, 10, 11]


# ---------------------------------------------------------------- merge_lora_weight


@st.composite
def lora_mats(draw):
    o, i, r = draw(st.integers(1, 12)), draw(st.integers(1, 12)), draw(st.integers(1, 4))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    return torch.randn(o, i, generator=g), torch.randn(r, i, generator=g), torch.randn(o, r, generator=g)


@FAST
@given(lora_mats(), st.sampled_from([0.0, 0.125, 1.0, 2.0 / math.sqrt(3)]))
def test_merge_equals_float64_reference(mats, scaling):
    base, a, b = mats
    before = base.clone()
    out = merge_lora_weight(base, a, b, scaling=scaling)
    assert out.shape == base.shape and out.dtype == base.dtype
    exact = base.double() + scaling * (b.double() @ a.double())
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)
    assert torch.equal(base, before)  # out-of-place
    assert out.data_ptr() != base.data_ptr()
    if scaling == 0.0:
        assert torch.equal(out, base)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    # spacing of bf16 numbers (8 significant bits) around |x|
    _, e = torch.frexp(x.abs().double().clamp_min(1e-30))
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), e - 8)


@FAST
@given(lora_mats(), st.sampled_from([0.5, 1.0, 3.0]))
def test_bf16_base_is_rounded_once(mats, scaling):
    # The float32 sum is rounded once to bf16: within half an ulp of the exact value (plus the
    # float32 accumulation's tiny error). Rounding B@A to bf16 first, or adding in bf16, can
    # be off by up to a full ulp, and is at the magnitudes drawn here (B@A ~ base).
    base, a, b = (m.to(torch.bfloat16) for m in mats)
    out = merge_lora_weight(base, a, b, scaling=scaling)
    assert out.dtype == torch.bfloat16 and out.shape == base.shape
    exact = base.double() + scaling * (b.double() @ a.double())
    err = (out.double() - exact).abs()
    bound = 0.5 * torch.maximum(bf16_ulp(exact), bf16_ulp(out.double())) * (1 + 1e-3) + 1e-6 * exact.abs() + 1e-30
    assert (err <= bound).all(), (err - bound).max()


def test_bf16_single_rounding_hand_worked():
    # base = 1, B@A = 2^-8 + 2^-10: exact 1.0048828125, whose nearest bf16 is 1 + 2^-7
    # (bf16 spacing at 1 is 2^-7). Adding the rank-1 terms to the bf16 base one by one
    # would round 1 + 2^-8 (a tie) to 1 and then 1 + 2^-10 to 1 again.
    base = torch.ones(1, 1, dtype=torch.bfloat16)
    a = torch.tensor([[1.0], [1.0]], dtype=torch.bfloat16)  # [r=2, I=1]
    b = torch.tensor([[2.0**-8, 2.0**-10]], dtype=torch.bfloat16)  # [O=1, r=2]
    out = merge_lora_weight(base, a, b, scaling=1.0)
    assert out.dtype == torch.bfloat16
    assert out.item() == 1.0 + 2.0**-7


def test_merge_bad_shapes_name_them():
    with pytest.raises(ValueError) as ei:
        merge_lora_weight(torch.zeros(5, 7), torch.zeros(3, 11), torch.zeros(5, 3), scaling=1.0)
    assert "7" in str(ei.value) and "11" in str(ei.value)
    with pytest.raises(ValueError) as ei:
        merge_lora_weight(torch.zeros(5, 7), torch.zeros(3, 7), torch.zeros(5, 13), scaling=1.0)
    assert "13" in str(ei.value)
    with pytest.raises(ValueError):
        merge_lora_weight(torch.zeros(5), torch.zeros(3, 5), torch.zeros(5, 3), scaling=1.0)
    with pytest.raises(ValueError):
        merge_lora_weight(torch.zeros(5, 7, dtype=torch.long), torch.zeros(3, 7), torch.zeros(5, 3), scaling=1.0)
