"""Explanation extraction, activation normalisation, reconstruction MSE, reward, FVE baselines."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from nla_core import (
    FAILED_EXTRACTION_REWARD,
    Baselines,
    extract_explanation,
    fve,
    hinged_length_penalty,
    normalize_activation,
    predict_mean_baselines,
    reconstruction_mse,
    reward_from_mse,
)

FAST = settings(max_examples=40, deadline=None)
OPEN, CLOSE = "<explanation>", "</explanation>"


def test_failed_extraction_reward():
    assert FAILED_EXTRACTION_REWARD == -2.0


# ---------------------------------------------------------------- extract_explanation


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<explanation>cats</explanation>", "cats"),
        ("The answer: <explanation>  a cat on a mat \n</explanation> trailing", "a cat on a mat"),
        ("<explanation>first</explanation> and <explanation>second</explanation>", "first"),
        ("<explanation>a</explanation>x</explanation>", "a"),  # non-greedy
        ("<explanation>\nline one\nline two\n</explanation>", "line one\nline two"),  # across newlines
        ("<explanation></explanation>", ""),
        ("<explanation> \n\t </explanation>", ""),
        ("no tags here", None),
        ("", None),
        ("<explanation>never closed", None),
        ("closed only</explanation>", None),
        ("</explanation>backwards<explanation>", None),
        ("<explanation><explanation>nested</explanation>", "<explanation>nested"),
    ],
)
def test_extract_cases(text, expected):
    assert extract_explanation(text) == expected


body_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40).filter(
    lambda s: CLOSE not in s
)
outer_text = st.text(max_size=20).filter(lambda s: OPEN not in s and CLOSE not in s)


@FAST
@given(outer_text, body_text, outer_text, body_text)
@example("", "", "", "x")
@example("pre\n", "\n multi\nline \n", "\npost", "later")
def test_extract_first_pair_stripped(pre, body, post, later):
    text = f"{pre}{OPEN}{body}{CLOSE}{post}{OPEN}{later}{CLOSE}"
    assert extract_explanation(text) == body.strip()


@FAST
@given(st.text(max_size=60).filter(lambda s: CLOSE not in s))
def test_extract_none_without_closing_tag(text):
    assert extract_explanation(text) is None


# ---------------------------------------------------------------- normalize_activation


@st.composite
def activations(draw, max_n=6, max_d=16):
    n = draw(st.integers(1, max_n))
    d = draw(st.integers(1, max_d))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mag = draw(st.sampled_from([1e-3, 1.0, 100.0]))
    return torch.randn(n, d, generator=g) * mag


@FAST
@given(activations(), st.sampled_from([1.0, 8.0, math.sqrt(64), 0.5]))
def test_normalize_norm_equals_scale_and_direction_kept(v, scale):
    out = normalize_activation(v, scale)
    assert out.shape == v.shape and out.dtype == v.dtype
    torch.testing.assert_close(out.double().norm(dim=-1), torch.full((v.shape[0],), scale, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    ref = v.double() * scale / v.double().norm(dim=-1, keepdim=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


@FAST
@given(activations(), st.floats(0.01, 100.0))
def test_normalize_positively_homogeneous(v, c):
    torch.testing.assert_close(normalize_activation(c * v, 3.0), normalize_activation(v, 3.0), rtol=1e-5, atol=1e-5)


def test_normalize_zero_vector_stays_zero():
    v = torch.zeros(3, 5)
    v[1] = torch.arange(5.0)
    out = normalize_activation(v, 2.0)
    assert torch.equal(out[0], torch.zeros(5)) and torch.equal(out[2], torch.zeros(5))
    assert torch.isfinite(out).all()
    assert out[1].norm().item() == pytest.approx(2.0)
    assert torch.equal(normalize_activation(torch.zeros(4), 5.0), torch.zeros(4))  # 1-D [D]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
def test_normalize_none_is_identity_and_dtype_kept(dtype):
    v = torch.randn(4, 8).to(dtype)
    assert torch.equal(normalize_activation(v, None), v)
    out = normalize_activation(v, 4.0)
    assert out.dtype == dtype
    ref = v.double() * 4.0 / v.double().norm(dim=-1, keepdim=True)
    tol = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_normalize_batched_leading_dims():
    v = torch.randn(2, 3, 7)
    out = normalize_activation(v, 1.0)
    torch.testing.assert_close(out[1, 2], normalize_activation(v[1, 2], 1.0))


def test_normalize_is_out_of_place():
    v = torch.randn(3, 4)
    before = v.clone()
    normalize_activation(v, 2.0)
    assert torch.equal(v, before)


# ---------------------------------------------------------------- reconstruction_mse


@FAST
@given(activations(), st.integers(0, 2**31 - 1), st.sampled_from([None, 1.0, 8.0]))
def test_mse_vs_float64(gold, seed, scale):
    g = torch.Generator().manual_seed(seed)
    pred = torch.randn(gold.shape, generator=g) * 3
    mse = reconstruction_mse(pred, gold, scale=scale)
    assert mse.shape == (gold.shape[0],) and mse.dtype == torch.float32

    def nrm(x):
        x = x.double()
        return x if scale is None else x * scale / x.norm(dim=-1, keepdim=True)

    ref = (nrm(pred) - nrm(gold)).square().mean(-1)
    torch.testing.assert_close(mse.double(), ref, rtol=1e-5, atol=1e-7)
    if scale is not None:
        # closed form: 2 s^2 (1 - cos) / D
        cos = torch.nn.functional.cosine_similarity(pred.double(), gold.double(), dim=-1)
        torch.testing.assert_close(mse.double(), 2 * scale**2 * (1 - cos) / gold.shape[1], rtol=1e-4, atol=1e-6)


@FAST
@given(activations(), st.floats(0.01, 100.0))
def test_mse_zero_for_same_direction(gold, c):
    mse = reconstruction_mse(c * gold, gold, scale=5.0)
    assert (mse.abs() < 1e-10).all(), mse


def test_mse_hand_worked():
    # D = 2, scale 1: pred (1,0), gold (0,5)->(0,1): mean((1,-1)^2) = 1 ; opposite: mean((2,0)^2) = 2
    pred = torch.tensor([[1.0, 0.0], [3.0, 0.0]])
    gold = torch.tensor([[0.0, 5.0], [-1.0, 0.0]])
    assert reconstruction_mse(pred, gold, scale=1.0).tolist() == [1.0, 2.0]
    assert reconstruction_mse(torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 2.0]]), scale=None).tolist() == [2.0]


def test_mse_bf16_input_gives_float32():
    pred = torch.randn(3, 8).to(torch.bfloat16)
    gold = torch.randn(3, 8).to(torch.bfloat16)
    assert reconstruction_mse(pred, gold, scale=1.0).dtype == torch.float32


def test_mse_shape_mismatch_names_shapes():
    with pytest.raises(ValueError) as ei:
        reconstruction_mse(torch.zeros(3, 7), torch.zeros(3, 11), scale=1.0)
    assert "7" in str(ei.value) and "11" in str(ei.value)
    with pytest.raises(ValueError):
        reconstruction_mse(torch.zeros(7), torch.zeros(7), scale=1.0)


# ---------------------------------------------------------------- reward_from_mse


@FAST
@given(st.lists(st.floats(0.0, 1e3), min_size=1, max_size=10))
@example([0.0, 1e-12, 1e-8, 1.0])
def test_reward_neg_log_and_neg(values):
    mse = torch.tensor(values, dtype=torch.float64)
    r = reward_from_mse(mse)
    assert r.shape == mse.shape
    ref = -torch.log(mse.clamp_min(1e-8))
    torch.testing.assert_close(r.double(), ref, rtol=1e-6, atol=1e-6)
    assert (r <= -math.log(1e-8) + 1e-4).all()  # the clamp bounds the reward
    torch.testing.assert_close(reward_from_mse(mse, kind="neg").double(), -mse)


def test_reward_hand_worked():
    r = reward_from_mse(torch.tensor([1.0, math.exp(-2), 0.0, 1e-20]))
    torch.testing.assert_close(r, torch.tensor([0.0, 2.0, -math.log(1e-8), -math.log(1e-8)]))
    assert reward_from_mse(torch.tensor([[0.25]]), kind="neg").tolist() == [[-0.25]]


def test_reward_monotone_decreasing():
    mse = torch.logspace(-10, 3, 50, dtype=torch.float64)
    r = reward_from_mse(mse)
    assert (r[1:] <= r[:-1]).all()


def test_reward_unknown_kind():
    with pytest.raises(ValueError):
        reward_from_mse(torch.tensor([0.5]), kind="log")


# ---------------------------------------------------------------- predict_mean_baselines, fve


def baselines64(acts, scale):
    def nrm(x):
        return x if scale is None else x * scale / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)

    u = nrm(acts.double())
    mu = u.mean(0, keepdim=True)
    return (u - nrm(mu)).square().mean().item(), (u - mu).square().mean().item()


@FAST
@given(activations(), st.sampled_from([None, 1.0, 8.0]))
def test_baselines_vs_float64(acts, scale):
    b = predict_mean_baselines(acts, scale=scale)
    assert isinstance(b, Baselines) and b._fields == ("meannorm", "rawvar")
    meannorm, rawvar = baselines64(acts, scale)
    assert float(b.rawvar) == pytest.approx(rawvar, rel=1e-5, abs=1e-9)
    assert float(b.meannorm) == pytest.approx(meannorm, rel=1e-5, abs=1e-9)
    # the mean is the best constant predictor: rawvar <= meannorm
    assert float(b.rawvar) <= float(b.meannorm) * (1 + 1e-6) + 1e-12


def test_baselines_mean_zero_direction():
    # opposite unit vectors: mu = 0, normalize(mu) = 0 (a zero vector stays zero) -> meannorm = mean(u^2)
    b = predict_mean_baselines(torch.tensor([[2.0, 0.0], [-5.0, 0.0]]), scale=1.0)
    assert float(b.rawvar) == pytest.approx(0.5)
    assert float(b.meannorm) == pytest.approx(0.5)


def test_baselines_hand_worked():
    # u = (1,0), (0,1) at scale 1: mu = (.5,.5); rawvar = mean of (.5^2 x 4) = .25;
    # normalize(mu) = (1/sqrt2, 1/sqrt2): meannorm = ((1-a)^2 + a^2) / 2 with a = 1/sqrt2 = 1 - a
    acts = torch.tensor([[2.0, 0.0], [0.0, 3.0]])
    b = predict_mean_baselines(acts, scale=1.0)
    a = 1 / math.sqrt(2)
    assert float(b.rawvar) == pytest.approx(0.25)
    assert float(b.meannorm) == pytest.approx(((1 - a) ** 2 + a**2) / 2)
    # identical rows: zero for both
    same = predict_mean_baselines(torch.tensor([[1.0, 2.0]] * 3), scale=4.0)
    assert float(same.rawvar) == pytest.approx(0.0, abs=1e-10)
    assert float(same.meannorm) == pytest.approx(0.0, abs=1e-10)


def test_fve():
    assert fve(0.0, 0.72) == 1.0
    assert fve(0.72, 0.72) == 0.0
    assert fve(0.36, 0.72) == pytest.approx(0.5)
    assert fve(1.44, 0.72) == pytest.approx(-1.0)
    t = fve(torch.tensor(0.18), torch.tensor(0.72))
    assert float(t) == pytest.approx(0.75)


def test_baselines_bad_shape():
    with pytest.raises(ValueError) as ei:
        predict_mean_baselines(torch.zeros(7), scale=1.0)
    assert "7" in str(ei.value)


# ---------------------------------------------------------------- hinged length penalty


@FAST
@given(st.lists(st.integers(0, 300), min_size=1, max_size=16), st.integers(0, 256), st.floats(0.0, 1.0))
def test_hinged_length_penalty_is_free_below_the_hinge_and_linear_past_it(lengths, threshold, coef):
    out = hinged_length_penalty(torch.tensor(lengths), threshold=threshold, coef=coef)
    assert out.dtype == torch.float32 and out.shape == (len(lengths),)
    expected = [coef * max(0, n - threshold) for n in lengths]  # EasyNLA: coef * clamp_min(L - threshold, 0)
    assert out.double().tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_hinged_length_penalty_bad_input():
    with pytest.raises(ValueError, match="integer"):
        hinged_length_penalty(torch.tensor([1.0, 2.0]), threshold=1, coef=0.1)
    with pytest.raises(ValueError, match="coef"):
        hinged_length_penalty(torch.tensor([1, 2]), threshold=1, coef=-0.1)
    with pytest.raises(ValueError, match=r"\[N\]"):
        hinged_length_penalty(torch.tensor([[1, 2]]), threshold=1, coef=0.1)
