"""kl_k1 / kl_k2 / kl_k3: Schulman's per-token KL estimators, delta = ref_logp - logp."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from nla_core import kl_categorical, kl_k1, kl_k2, kl_k3

FAST = settings(max_examples=40, deadline=None)

logps = st.floats(-30.0, 0.0, allow_nan=False)
pairs = st.lists(st.tuples(logps, logps), min_size=1, max_size=16)


def t64(xs):
    return torch.tensor(xs, dtype=torch.float64)


# ---------------------------------------------------------------- hand-worked


def test_hand_worked_values():
    logp = torch.tensor([math.log(0.5), math.log(0.25)], dtype=torch.float64)
    ref = torch.tensor([math.log(0.25), math.log(0.5)], dtype=torch.float64)
    # delta = ref - logp = [-log 2, +log 2]
    l2 = math.log(2.0)
    torch.testing.assert_close(kl_k1(logp, ref), t64([l2, -l2]))
    torch.testing.assert_close(kl_k2(logp, ref), t64([l2 * l2 / 2, l2 * l2 / 2]))
    # k3 = exp(d) - 1 - d: [0.5 - 1 + l2, 2 - 1 - l2]
    torch.testing.assert_close(kl_k3(logp, ref), t64([l2 - 0.5, 1.0 - l2]))


# ---------------------------------------------------------------- properties


@settings(max_examples=60, deadline=None)
@given(pairs, st.sampled_from([torch.float32, torch.float64]))
@example([(0.0, -30.0), (-30.0, 0.0)], torch.float32)
def test_formulas_vs_float64(ps, dtype):
    lp = torch.tensor([a for a, _ in ps], dtype=dtype)
    rf = torch.tensor([b for _, b in ps], dtype=dtype)
    d = rf.double() - lp.double()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    k1, k2, k3 = kl_k1(lp, rf), kl_k2(lp, rf), kl_k3(lp, rf)
    for k in (k1, k2, k3):
        assert k.shape == lp.shape
        assert k.dtype == dtype  # float32 in -> float32 out; float64 stays float64
    torch.testing.assert_close(k1.double(), -d, **tol)
    torch.testing.assert_close(k2.double(), d * d / 2, **tol)
    torch.testing.assert_close(k3.double(), torch.expm1(d) - d, **tol)


@settings(max_examples=60, deadline=None)
@given(pairs, st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
@example([(-1e-7, 0.0), (0.0, -1e-7)], torch.float32)
def test_k3_never_negative(ps, dtype):
    lp = torch.tensor([a for a, _ in ps]).to(dtype)
    rf = torch.tensor([b for _, b in ps]).to(dtype)
    assert (kl_k3(lp, rf) >= 0).all()
    assert (kl_k2(lp, rf) >= 0).all()


@FAST
@given(st.lists(logps, min_size=1, max_size=16))
def test_k3_zero_when_equal(xs):
    x = torch.tensor(xs, dtype=torch.float32)
    assert (kl_k3(x, x.clone()) == 0).all()
    assert (kl_k1(x, x.clone()) == 0).all()
    assert (kl_k2(x, x.clone()) == 0).all()


@FAST
@given(
    st.lists(
        st.tuples(logps, st.floats(0.01, 5.0), st.booleans()),
        min_size=1,
        max_size=16,
    )
)
def test_k3_positive_when_different(rows):
    # |delta| >= 0.01 so the value (~delta^2/2 >= 5e-5) is far above float32 resolution
    lp = torch.tensor([a for a, _, _ in rows], dtype=torch.float32)
    rf = torch.tensor([a + (d if s else -d) for a, d, s in rows], dtype=torch.float32)
    assert (kl_k3(lp, rf) > 0).all()


@st.composite
def two_distributions(draw):
    v = draw(st.integers(1, 12))
    a = draw(st.lists(st.floats(-8, 8), min_size=v, max_size=v))
    b = draw(st.lists(st.floats(-8, 8), min_size=v, max_size=v))
    return torch.log_softmax(t64(a), -1), torch.log_softmax(t64(b), -1)


@settings(max_examples=60, deadline=None)
@given(two_distributions())
def test_full_categorical_expectation_is_exact_kl(pq):
    # sum_v p_v k(log p_v, log q_v) = KL(p || q) exactly for k3 (and k1), since sum q = 1
    logp, logq = pq
    p = logp.exp()
    kl = (p * (logp - logq)).sum()
    assert (p * kl_k3(logp, logq)).sum().item() == pytest.approx(kl.item(), abs=1e-10, rel=1e-9)
    assert (p * kl_k1(logp, logq)).sum().item() == pytest.approx(kl.item(), abs=1e-10, rel=1e-9)


@FAST
@given(pairs, st.floats(0.01, 10.0))
@example([(0.0, -30.0), (-30.0, 0.0), (-1.0, -1.0)], 1.0)
def test_clamp_limits_delta_first(ps, c):
    lp = t64([a for a, _ in ps])
    rf = t64([b for _, b in ps])
    d = (rf - lp).clamp(-c, c)
    torch.testing.assert_close(kl_k1(lp, rf, clamp=c), -d)
    torch.testing.assert_close(kl_k2(lp, rf, clamp=c), d * d / 2)
    torch.testing.assert_close(kl_k3(lp, rf, clamp=c), torch.expm1(d) - d)
    # a clamp wider than any |delta| changes nothing
    torch.testing.assert_close(kl_k3(lp, rf, clamp=100.0), kl_k3(lp, rf))
    assert (kl_k1(lp, rf, clamp=c).abs() <= c).all()


def test_gradient_of_k3():
    # d k3 / d logp = -(exp(delta) - 1) = 1 - exp(delta)
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    rf = torch.tensor([-1.5, -1.0, -0.5], dtype=torch.float64)
    kl_k3(lp, rf).sum().backward()
    torch.testing.assert_close(lp.grad, 1 - torch.exp(rf - lp.detach()))


def test_elementwise_on_higher_rank():
    lp = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(0))
    rf = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(1))
    out = kl_k3(lp, rf)
    assert out.shape == (3, 4, 5)
    torch.testing.assert_close(out[1, 2], kl_k3(lp[1, 2], rf[1, 2]))


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("fn", [kl_k1, kl_k2, kl_k3])
def test_shape_mismatch_raises_with_shapes(fn):
    with pytest.raises(ValueError) as ei:
        fn(torch.zeros(3, 7), torch.zeros(3, 11))
    msg = str(ei.value)
    assert "7" in msg and "11" in msg


@pytest.mark.parametrize("fn", [kl_k1, kl_k2, kl_k3])
def test_integer_input_rejected(fn):
    with pytest.raises(ValueError):
        fn(torch.zeros(3, dtype=torch.long), torch.zeros(3))


# ---------------------------------------------------------------- kl_categorical (full distributions)

vocab_logits = st.lists(st.floats(-20.0, 20.0, allow_nan=False), min_size=2, max_size=12)


def test_kl_categorical_hand_worked():
    # p = (1/2, 1/2), q = (1/4, 3/4): KL = 1/2 log 2 + 1/2 log(2/3).
    p = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    q = torch.log(torch.tensor([[0.25, 0.75]], dtype=torch.float64))
    expected = 0.5 * math.log(2.0) + 0.5 * math.log(2.0 / 3.0)
    torch.testing.assert_close(kl_categorical(p, q), t64([expected]))
    torch.testing.assert_close(kl_categorical(p, p), t64([0.0]))


@settings(max_examples=60, deadline=None)
@given(st.data(), st.sampled_from([torch.float32, torch.float64]))
def test_kl_categorical_vs_float64_and_k3(data, dtype):
    p_list = data.draw(vocab_logits)
    q_list = data.draw(st.lists(st.floats(-20.0, 20.0, allow_nan=False), min_size=len(p_list), max_size=len(p_list)))
    p, q = torch.tensor([p_list], dtype=dtype), torch.tensor([q_list], dtype=dtype)
    kl = kl_categorical(p, q)
    assert kl.shape == (1,) and kl.dtype == dtype and float(kl) >= 0.0
    lp, lq = torch.log_softmax(p.double(), -1), torch.log_softmax(q.double(), -1)
    reference = (lp.exp() * (lp - lq)).sum(-1)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(kl.double(), reference, **tol)
    # The full-vocabulary expectation of k3 under p is the same KL (kl_k3's docstring).
    torch.testing.assert_close((lp.exp() * kl_k3(lp, lq)).sum(-1), reference, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(kl_categorical(p, p), torch.zeros(1, dtype=dtype))


def test_kl_categorical_zero_probability_tokens_and_shapes():
    # exp(-1000) underflows to p_v = 0 exactly: the term is 0, not 0 * inf = nan.
    p = torch.tensor([[0.0, -1000.0, 0.0]])
    q = torch.tensor([[0.0, 5.0, 0.0]])
    kl = kl_categorical(p, q)
    assert torch.isfinite(kl).all() and float(kl) > 0
    assert kl_categorical(torch.zeros(2, 3, 5), torch.zeros(2, 3, 5)).shape == (2, 3)
    with pytest.raises(ValueError, match="same shape|must match"):
        kl_categorical(torch.zeros(2, 5), torch.zeros(2, 4))
