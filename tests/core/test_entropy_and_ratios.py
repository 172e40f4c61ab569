"""token_entropy, the fused log-prob path's entropy, top_entropy_mask, GSPO's sequence ratio and the ratio band."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nla_core import (
    gspo_token_log_ratio, ratio_band_mask, sequence_log_ratio, token_entropy, token_logprobs_from_hidden,
    top_entropy_mask,
)

FAST = settings(max_examples=40, deadline=None)


def entropy64(logits):
    lp = torch.log_softmax(logits.double(), -1)
    return -(lp.exp() * lp).sum(-1)


@FAST
@given(st.integers(1, 4), st.integers(1, 6), st.integers(2, 40), st.integers(1, 7), st.floats(0.1, 30.0),
       st.integers(0, 2**31 - 1))
def test_token_entropy_matches_float64(n, t, v, chunk, scale, seed):
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(n, t, v, generator=g)
    out = token_entropy(logits, chunk_size=chunk)
    assert out.shape == (n, t) and out.dtype == torch.float32 and not out.requires_grad
    torch.testing.assert_close(out.double(), entropy64(logits), rtol=1e-5, atol=1e-5)
    assert (out >= 0).all() and (out <= math.log(v) + 1e-5).all()
    bf = token_entropy(logits.bfloat16(), chunk_size=chunk)  # bf16 in, float32 math, no copy of the whole
    assert bf.dtype == torch.float32
    torch.testing.assert_close(bf.double(), entropy64(logits.bfloat16()), rtol=1e-4, atol=1e-4)


def test_token_entropy_hand_worked():
    # uniform over 4 -> log 4; one-hot (very peaked) -> ~0
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]])
    out = token_entropy(logits)
    assert out[0, 0].item() == pytest.approx(math.log(4), rel=1e-6)
    assert out[0, 1].item() == pytest.approx(0.0, abs=1e-6)


@FAST
@given(st.integers(1, 3), st.integers(1, 5), st.integers(2, 30), st.integers(1, 8), st.integers(1, 6),
       st.sampled_from([None, 5.0]), st.integers(0, 2**31 - 1))
def test_fused_path_gives_entropy_and_unchanged_logprobs(n, t, v, d, chunk, softcap, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, t, d, generator=g, requires_grad=True)
    weight = torch.randn(v, d, generator=g)
    targets = torch.randint(0, v, (n, t), generator=g)
    plain = token_logprobs_from_hidden(hidden, weight, targets, softcap=softcap, chunk_size=chunk)
    (g_plain,) = torch.autograd.grad(plain.sum(), hidden)
    both = token_logprobs_from_hidden(hidden, weight, targets, softcap=softcap, chunk_size=chunk, with_entropy=True)
    (g_both,) = torch.autograd.grad(both.logp.sum(), hidden)
    assert torch.equal(both.logp, plain) and torch.equal(g_both, g_plain)
    z = hidden.detach().double() @ weight.double().T
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    assert not both.entropy.requires_grad
    torch.testing.assert_close(both.entropy.double(), entropy64(z), rtol=1e-5, atol=1e-5)


def reference_top_entropy(entropy, mask, q):
    vals = sorted(entropy[mask].double().tolist())
    if not vals:
        return torch.zeros_like(mask)
    pos = (1 - q) * (len(vals) - 1)  # linear interpolation, torch.quantile's and numpy's default
    lo, hi = math.floor(pos), math.ceil(pos)
    tau = vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)
    return mask & (entropy.double() >= tau - 1e-7)


@FAST
@given(st.integers(1, 5), st.integers(1, 6), st.sampled_from([0.2, 0.5, 0.8, 1.0]), st.integers(0, 2**31 - 1))
def test_top_entropy_mask(n, t, q, seed):
    g = torch.Generator().manual_seed(seed)
    ent = torch.rand(n, t, generator=g) * 3
    mask = torch.rand(n, t, generator=g) > 0.3
    out = top_entropy_mask(with_nan(ent, mask), mask, quantile=q)
    assert out.dtype == torch.bool and not (out & ~mask).any()
    assert torch.equal(out, reference_top_entropy(ent, mask, q))
    if q == 1.0:
        assert torch.equal(out, mask)
    k = int(mask.sum())
    if k:
        assert int(out.sum()) >= math.floor(q * (k - 1)) + 1 - 1  # about the top q share, ties included


def with_nan(x, mask):
    return torch.where(mask, x, torch.full_like(x, float("nan")))


def test_top_entropy_mask_edge_cases():
    assert not top_entropy_mask(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool), quantile=0.2).any()
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="quantile"):
            top_entropy_mask(torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), quantile=bad)


@FAST
@given(st.integers(1, 5), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_sequence_ratio_and_its_token_form(n, t, seed):
    g = torch.Generator().manual_seed(seed)
    logp = -3 * torch.rand(n, t, generator=g)
    old = logp + 0.5 * torch.randn(n, t, generator=g)
    mask = torch.rand(n, t, generator=g) > 0.3
    seq = sequence_log_ratio(with_nan(logp - old, mask), mask)
    for i in range(n):
        k = int(mask[i].sum())
        expect = float((logp[i] - old[i])[mask[i]].double().sum()) / max(1, k)
        assert seq[i].item() == pytest.approx(expect, rel=1e-5, abs=1e-6)
    x = logp.clone().requires_grad_(True)
    tok = gspo_token_log_ratio(x, old, mask)
    torch.testing.assert_close(tok[mask], seq[:, None].expand(n, t)[mask])
    assert (tok[~mask] == 0).all()
    (torch.exp(tok) * mask).sum().backward()  # d s_it / d logp_it = s_i
    torch.testing.assert_close(x.grad, torch.where(mask, seq.exp()[:, None].expand(n, t), torch.zeros(n, t)))


@FAST
@given(st.integers(1, 5), st.integers(1, 6), st.sampled_from([(0.5, 2.0), (0.2, 5.0), (1.0, 1.0)]),
       st.integers(0, 2**31 - 1))
def test_ratio_band_mask(n, t, band, seed):
    g = torch.Generator().manual_seed(seed)
    lr = 2 * torch.randn(n, t, generator=g)
    mask = torch.rand(n, t, generator=g) > 0.3
    out = ratio_band_mask(with_nan(lr, mask), mask, low=band[0], high=band[1])
    r = lr.double().exp()
    assert torch.equal(out, mask & (r >= band[0]) & (r <= band[1]))


def test_ratio_band_mask_overflow_and_bad_bands():
    mask = torch.ones(1, 3, dtype=torch.bool)
    out = ratio_band_mask(torch.tensor([[1000.0, -1000.0, float("nan")]]), mask, low=0.5, high=2.0)
    assert not out.any()
    for low, high in ((0.0, 2.0), (1.2, 2.0), (0.5, 0.9), (0.5, float("inf"))):
        with pytest.raises(ValueError, match="band"):
            ratio_band_mask(torch.zeros(1, 3), mask, low=low, high=high)
