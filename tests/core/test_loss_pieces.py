"""The policy loss's pieces alone: each surrogate, the TIS ratio and weights, checked against float64
transcriptions of their docstrings' formulas, and `policy_loss` as their composition."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import nla_core
from nla_core import (
    capped_ratio,
    cispo_surrogate,
    clip_range,
    kl_k3,
    onpolicy_surrogate,
    policy_loss,
    ppo_clip_surrogate,
    tis_weights,
)
from test_losses import batches

FAST = settings(max_examples=60, deadline=None)
EPS = st.sampled_from([(0.2, None), (0.2, 0.28), (1.0, 4.0), (0.0003, 0.0004)])


def far_from(x: torch.Tensor, edges: list[float], margin: float = 1e-4) -> bool:
    """No value of x within `margin` of an edge, where float32 and float64 may pick different branches."""
    return x.numel() == 0 or all((x.double() - e).abs().min() > margin for e in edges)


@FAST
@given(batches(), EPS)
def test_ppo_clip_surrogate_is_its_formula(b, eps):
    lo_eps, hi_eps = eps
    r = torch.exp(b["logp"] - b["old"])
    low, high = 1 - lo_eps, 1 + (lo_eps if hi_eps is None else hi_eps)
    assume(far_from(r, [low, high]))
    x = r.clone().requires_grad_(True)
    out = ppo_clip_surrogate(x, b["adv"], clip_eps=lo_eps, clip_eps_high=hi_eps)
    out.value.sum().backward()
    r64, a64 = r.double(), b["adv"].double()[:, None]
    want = torch.minimum(r64 * a64, r64.clamp(low, high) * a64)
    torch.testing.assert_close(out.value.detach().double(), want, rtol=1e-6, atol=1e-7)
    binds = ((r64 > high) & (a64 > 0)) | ((r64 < low) & (a64 < 0))
    assert torch.equal(out.clipped, binds)
    # the gradient is A where the clip does not bind, 0 where it does
    torch.testing.assert_close(x.grad.double(), torch.where(binds, 0.0, a64.expand_as(r64)), rtol=1e-6, atol=1e-7)
    assert not out.clipped.requires_grad


@FAST
@given(batches(), EPS)
def test_cispo_surrogate_is_its_formula(b, eps):
    lo_eps, hi_eps = eps
    r = torch.exp(b["logp"] - b["old"])
    low, high = clip_range(lo_eps, hi_eps)
    assume(far_from(r, [low, high]))
    lp = b["logp"].clone().requires_grad_(True)
    out = cispo_surrogate(r, lp, b["adv"], clip_eps=lo_eps, clip_eps_high=hi_eps)
    out.value.sum().backward()
    w64 = r.double().clamp(max(low, 0.0), high)
    a64 = b["adv"].double()[:, None]
    torch.testing.assert_close(out.value.detach().double(), w64 * a64 * b["logp"].double(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(lp.grad.double(), w64 * a64, rtol=1e-6, atol=1e-7)  # every token keeps a gradient
    assert torch.equal(out.clipped, (r.double() < low) | (r.double() > high))


@FAST
@given(batches())
def test_onpolicy_surrogate_has_the_ppo_gradient_at_ratio_one(b):
    lp = b["logp"].clone().requires_grad_(True)
    onpolicy_surrogate(lp, b["adv"]).value.sum().backward()
    x = b["logp"].clone().requires_grad_(True)
    ppo_clip_surrogate(torch.exp(x - b["logp"]), b["adv"]).value.sum().backward()
    torch.testing.assert_close(lp.grad, x.grad)
    assert not onpolicy_surrogate(b["logp"], b["adv"]).clipped.any()


@FAST
@given(batches(), st.sampled_from([1.2, 2.0, 5.0]))
def test_capped_ratio_is_its_formula(b, cap):
    lr = b["logp"] - b["beh"]
    assume(far_from(lr, [math.log(cap)]))
    x = lr.clone().requires_grad_(True)
    out = capped_ratio(x, cap=cap)
    out.ratio.sum().backward()
    want = torch.exp(lr.double()).clamp(max=cap)
    torch.testing.assert_close(out.ratio.detach().double(), want, rtol=1e-6, atol=1e-7)
    assert torch.equal(out.capped, lr.double() > math.log(cap))
    torch.testing.assert_close(x.grad.double(), torch.where(out.capped, 0.0, want), rtol=1e-6, atol=1e-7)


def test_capped_ratio_never_overflows():
    x = torch.tensor([[1e4, -1e4, 0.0]], requires_grad=True)
    out = capped_ratio(x, cap=2.0)
    out.ratio.sum().backward()
    assert torch.isfinite(out.ratio).all() and torch.isfinite(x.grad).all()


@FAST
@given(batches(), st.booleans(), st.booleans(), st.sampled_from([1.5, 2.0]))
def test_tis_weights_are_their_formula(b, truncate, per_sequence, cap):
    m = b["mask"]
    log_rho = torch.where(m, b["old"] - b["beh"], torch.tensor(float("nan")))  # NaN padding is ignored
    lr64 = torch.where(m, b["old"].double() - b["beh"].double(), 0.0)
    if per_sequence:
        lr64 = lr64.sum(-1, keepdim=True).expand_as(lr64)
    assume(far_from(lr64[m], [math.log(cap)]))
    out = tis_weights(log_rho, m, cap=cap, truncate=truncate, per_sequence=per_sequence)
    rho = torch.exp(lr64)
    want = rho.clamp(max=cap) if truncate else torch.where(rho <= cap, rho, 0.0)
    torch.testing.assert_close(out.weight.double(), torch.where(m, want, 0.0), rtol=1e-5, atol=1e-7)
    assert torch.equal(out.capped, m & (rho > cap))
    assert not out.weight.requires_grad


def test_pieces_refuse_bad_input_in_one_line():
    r, a = torch.ones(2, 3), torch.zeros(2)
    cases = [
        (lambda: ppo_clip_surrogate(r, torch.zeros(3)), r"advantages must be \[N\] = \[2\]"),
        (lambda: ppo_clip_surrogate(r, a, clip_eps=0.0), "clip_eps and clip_eps_high must be > 0"),
        (lambda: cispo_surrogate(r, torch.ones(2, 4), a), "ratio has shape"),
        (lambda: onpolicy_surrogate(torch.ones(3), a), r"logp must be \[N, T\]"),
        (lambda: capped_ratio(r, cap=0.0), "tis_cap must be > 0"),
        (lambda: tis_weights(r, torch.ones(2, 3), cap=2.0), "mask must be a bool tensor"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            call()
        assert "\n" not in str(err.value)


@FAST
@given(batches(), st.sampled_from([0.0, 0.04]))
def test_policy_loss_is_the_composition_of_its_pieces(b, kl_beta):
    """GRPO with token TIS, composed by hand from the pieces, is policy_loss (value and gradient)."""
    m = b["mask"]
    kw = dict(clip_eps=0.2, clip_eps_high=0.28)
    x = b["logp"].clone().requires_grad_(True)
    out = policy_loss(x, b["logp"], b["adv"], m, ref_logp=b["ref"], behavior_logp=b["beh"], kl_beta=kl_beta,
                      tis="token_truncate", tis_cap=2.0, **kw)
    out.loss.backward()
    y = b["logp"].clone().requires_grad_(True)
    lp = torch.where(m, y, 0.0)
    old = lp.detach()
    w = tis_weights(old - b["beh"], m, cap=2.0)
    s = ppo_clip_surrogate(torch.exp(lp - old), b["adv"], **kw)
    per = torch.where(m, -(w.weight * s.value) + kl_beta * kl_k3(lp, b["ref"]), 0.0)
    mine = nla_core.aggregate_loss(per, m)
    mine.backward()
    torch.testing.assert_close(out.loss, mine)
    torch.testing.assert_close(x.grad, y.grad)


def test_gspo_must_name_its_tis():
    z, m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"^kind='gspo' needs tis stated: .*tis='sequence_truncate'"):
        policy_loss(z, z, torch.zeros(2), m, kind="gspo", kl_beta=0.0)
    policy_loss(z, z, torch.zeros(2), m, kind="gspo", tis="ratio_cap", kl_beta=0.0)  # stated: accepted
    policy_loss(z, z, torch.zeros(2), m, kl_beta=0.0)  # grpo keeps the reference's default
