"""grpo_loss and aggregate_loss: the GRPO objective, its TIS weights and its aggregation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from nla_core import GRPOLossOutput, aggregate_loss, grpo_loss

FAST = settings(max_examples=40, deadline=None)

TIS_MODES = [None, "ratio_cap", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
DECOUPLED = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


# ---------------------------------------------------------------- inputs and references


@st.composite
def batches(draw, max_n=5, max_t=6):
    """A padded batch: float32 log-probs [N,T], advantages [N], a bool mask [N,T]."""
    n = draw(st.integers(1, max_n))
    t = draw(st.integers(1, max_t))
    bits = draw(st.lists(st.booleans(), min_size=n * t, max_size=n * t))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    logp = -3.0 * torch.rand(n, t, generator=g)
    old = logp - 0.7 * (2 * torch.rand(n, t, generator=g) - 1)  # r = exp(logp - old) in [e^-.7, e^.7]
    ref = logp + (2 * torch.rand(n, t, generator=g) - 1)
    beh = old + (2 * torch.rand(n, t, generator=g) - 1)  # token rho in [e^-1, e]
    adv = torch.randn(n, generator=g)
    mask = torch.tensor(bits, dtype=torch.bool).reshape(n, t)
    return dict(logp=logp, old=old, ref=ref, beh=beh, adv=adv, mask=mask)


def reference_loss64(
    logp, old, adv, mask, *, ref=None, beh=None, clip_eps=0.2, clip_eps_high=None, kl_beta=0.04,
    kl_clamp=None, tis="ratio_cap", tis_cap=2.0, aggregation="sequence_mean",
):
    """The spec, transcribed in float64 (vectorised; padding zeroed before any arithmetic)."""

    def z(x):
        return torch.where(mask, x.double(), torch.zeros((), dtype=torch.float64))

    lp = z(logp)  # keeps the graph if logp requires grad
    r = torch.exp(lp - z(old))
    w = torch.ones_like(r)
    if tis == "ratio_cap":
        r = r.clamp(max=tis_cap)
    elif tis is not None:
        lrho = z(old) - z(beh)
        if tis.startswith("sequence"):
            lrho = lrho.sum(-1, keepdim=True).expand_as(lp)
        rho = torch.exp(lrho)
        if tis.endswith("truncate"):
            w = torch.clamp(rho, max=tis_cap)
        else:
            w = torch.where(lrho <= math.log(tis_cap), rho, torch.zeros_like(rho))
    hi = clip_eps if clip_eps_high is None else clip_eps_high
    a = adv.double()[:, None]
    s = torch.minimum(r * a, r.clamp(1 - clip_eps, 1 + hi) * a)
    per = -(w * s)
    if ref is not None and kl_beta != 0:
        d = z(ref) - lp
        if kl_clamp is not None:
            d = d.clamp(-kl_clamp, kl_clamp)
        per = per + kl_beta * (torch.expm1(d) - d)
    per = torch.where(mask, per, torch.zeros_like(per))
    if aggregation == "sequence_mean":
        loss = (per.sum(-1) / mask.sum(-1).clamp_min(1)).sum() / mask.shape[0]
    else:
        loss = per.sum() / mask.sum().clamp_min(1)
    return loss, per, w


def reference_loop_ratio_cap(new_lps, old_lps, ref_lps, advantages, *, clip_eps, kl_beta, tis_cap, micro_batch=2):
    """The reference's per-sample loop from grpo_update_microbatched, verbatim in its arithmetic.

    new_lps: list of 1-D leaf tensors (requires_grad); samples with no tokens are skipped
    but still count in n. Returns the total loss (the sum of the chunk losses); gradients
    accumulate into new_lps[i].grad through one backward per micro-batch, as there.
    """
    n = len(new_lps)
    total = 0.0
    for cs in range(0, n, micro_batch):
        idxs = list(range(cs, min(cs + micro_batch, n)))
        chunk_losses = []
        for i in idxs:
            new_lp = new_lps[i]
            ref_lp = ref_lps[i].detach()
            old_lp = old_lps[i].detach()
            if new_lp.numel() == 0 or old_lp.numel() != new_lp.numel():
                continue
            ratio = torch.exp(new_lp - old_lp)
            if tis_cap is not None:
                ratio = torch.clamp(ratio, max=tis_cap)
            clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
            A = advantages[i]
            surrogate = torch.minimum(ratio * A, clipped * A)
            delta = ref_lp - new_lp
            kl = torch.exp(delta) - delta - 1.0
            per_tok = -(surrogate - kl_beta * kl)
            sample_loss = per_tok.mean()
            chunk_losses.append(sample_loss)
        if not chunk_losses:
            continue
        chunk_loss = torch.stack(chunk_losses).sum() / n
        chunk_loss.backward()
        total += chunk_loss.item()
    return total


def boundaries_ok(b, *, clip_eps=0.2, clip_eps_high=None, tis="ratio_cap", tis_cap=2.0, kl_clamp=None, margin=1e-3):
    """True when no unmasked token sits within `margin` of a kink (clip edges, caps, KL clamp),
    where float32 and float64 may legitimately pick different branches."""
    m = b["mask"]
    if not m.any():
        return True
    lr = (b["logp"].double() - b["old"].double())[m]
    hi = clip_eps if clip_eps_high is None else clip_eps_high
    kinks = [math.log(1 - clip_eps), math.log(1 + hi)]
    if tis == "ratio_cap":
        kinks.append(math.log(tis_cap))
    if any((lr - k).abs().min() < margin for k in kinks):
        return False
    if tis in DECOUPLED:
        lrho = torch.where(m, b["old"].double() - b["beh"].double(), torch.zeros((), dtype=torch.float64))
        if tis.startswith("sequence"):
            lrho = lrho.sum(-1, keepdim=True).expand_as(lrho)
        if (lrho[m] - math.log(tis_cap)).abs().min() < margin:
            return False
    if kl_clamp is not None:
        d = (b["ref"].double() - b["logp"].double())[m].abs()
        if (d - kl_clamp).abs().min() < margin:
            return False
    return True


def scalar(x) -> float:
    if isinstance(x, torch.Tensor):
        assert x.dim() == 0 and not x.requires_grad
    return float(x)


def with_nan_padding(x, mask, fill):
    return torch.where(mask, x, torch.full_like(x, fill))


# ---------------------------------------------------------------- hand-worked


def test_hand_worked_example():
    # old = log 0.4; logp = log 0.6, log 0.2 -> r = [1.5, 0.5] on both rows, eps = 0.2.
    # row 0, A = +1: min(1.5, 1.2) = 1.2; min(0.5, 0.8) = 0.5 -> per-token [-1.2, -0.5], mean -0.85
    # row 1, A = -1, only its first token counts: min(-1.5, -1.2) = -1.5 -> per-token [1.5]
    old = torch.full((2, 2), math.log(0.4))
    logp = torch.tensor([[math.log(0.6), math.log(0.2)]] * 2)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[True, True], [True, False]])
    out = grpo_loss(logp, old, adv, mask, tis=None, kl_beta=0.0)
    assert isinstance(out, GRPOLossOutput)
    assert out.loss.item() == pytest.approx((-0.85 + 1.5) / 2, abs=1e-6)
    torch.testing.assert_close(out.per_token[mask], torch.tensor([-1.2, -0.5, 1.5]))
    torch.testing.assert_close(out.ratio[mask], torch.tensor([1.5, 0.5, 1.5]))
    tok = grpo_loss(logp, old, adv, mask, tis=None, kl_beta=0.0, aggregation="token_mean")
    assert tok.loss.item() == pytest.approx((-1.2 - 0.5 + 1.5) / 3, abs=1e-6)
    # every unmasked ratio (1.5, 0.5, 1.5) lies outside [0.8, 1.2]; the clip binds on row 0's 1.5 only
    assert scalar(out.outside_clip_frac) == pytest.approx(1.0)
    assert scalar(out.clip_frac) == pytest.approx(1 / 3)
    # ratio_cap at 1.4: row 1's r = 1.5 -> 1.4, min(-1.4, -1.2) = -1.4; row 0 unchanged
    cap = grpo_loss(logp, old, adv, mask, tis="ratio_cap", tis_cap=1.4, kl_beta=0.0)
    assert cap.loss.item() == pytest.approx((-0.85 + 1.4) / 2, abs=1e-6)
    # asymmetric clip (0.2, 0.6): row 0's 1.5 < 1.6 stays unclipped -> [-1.5, -0.5], mean -1.0
    asym = grpo_loss(logp, old, adv, mask, tis=None, kl_beta=0.0, clip_eps_high=0.6)
    assert asym.loss.item() == pytest.approx((-1.0 + 1.5) / 2, abs=1e-6)


def test_hand_worked_kl_term():
    # one token, A = 0, delta = ref - logp = log 2 -> k3 = 2 - 1 - log 2; loss = beta * k3
    logp = torch.tensor([[math.log(0.25)]])
    ref = torch.tensor([[math.log(0.5)]])
    out = grpo_loss(logp, logp.clone(), torch.zeros(1), torch.ones(1, 1, dtype=torch.bool), ref_logp=ref, kl_beta=0.1)
    k3 = 1 - math.log(2)
    assert out.loss.item() == pytest.approx(0.1 * k3, rel=1e-6)
    assert out.kl[0, 0].item() == pytest.approx(k3, rel=1e-6)
    assert scalar(out.kl_mean) == pytest.approx(k3, rel=1e-6)


def test_hand_worked_sequence_level_weights():
    # old - behavior per token: row 0 [0.5, 0.5] -> rho = e^1 = 2.718 > cap 2; row 1 [0.1, -0.3] -> e^-0.2
    logp = torch.zeros(2, 2)
    old = torch.zeros(2, 2)  # on-policy: r = 1, s = A
    beh = -torch.tensor([[0.5, 0.5], [0.1, -0.3]])
    adv = torch.tensor([1.0, 2.0])
    mask = torch.ones(2, 2, dtype=torch.bool)
    kw = dict(behavior_logp=beh, kl_beta=0.0)
    trunc = grpo_loss(logp, old, adv, mask, tis="sequence_truncate", **kw)
    # row 0: w = 2 -> -2 * 1; row 1: w = e^-0.2 -> -e^-0.2 * 2
    assert trunc.loss.item() == pytest.approx((-2.0 - 2 * math.exp(-0.2)) / 2, rel=1e-6)
    msk = grpo_loss(logp, old, adv, mask, tis="sequence_mask", **kw)
    # row 0 dropped (rho > cap) but still counts in N
    assert msk.loss.item() == pytest.approx((0.0 - 2 * math.exp(-0.2)) / 2, rel=1e-6)
    torch.testing.assert_close(msk.tis_weight, torch.tensor([[0.0, 0.0], [math.exp(-0.2)] * 2]))
    # token level: row 0 tokens rho = e^0.5 each (< 2) -> -(e^.5 + e^.5)/2; row 1 -(e^.1 + e^-.3)
    tok = grpo_loss(logp, old, adv, mask, tis="token_truncate", **kw)
    expected = (-math.exp(0.5) - (math.exp(0.1) + math.exp(-0.3))) / 2
    assert tok.loss.item() == pytest.approx(expected, rel=1e-6)


# ---------------------------------------------------------------- against the spec, transcribed


@settings(max_examples=80, deadline=None)
@given(
    batches(),
    st.sampled_from(TIS_MODES),
    st.sampled_from(["sequence_mean", "token_mean"]),
    st.sampled_from([0.0, 0.04, 0.5]),
    st.sampled_from([None, 0.3]),
    st.sampled_from([None, 0.28]),
    st.sampled_from([2.0, 1.3]),
    st.booleans(),
)
def test_matches_float64_transcription_of_spec(b, tis, agg, kl_beta, kl_clamp, eps_high, cap, with_ref):
    assume(boundaries_ok(b, clip_eps_high=eps_high, tis=tis, tis_cap=cap, kl_clamp=kl_clamp))
    assume(with_ref or kl_beta == 0)  # a KL weight without a reference is refused (test_kl_weight_needs_a_reference)
    ref = b["ref"] if with_ref else None
    beh = b["beh"] if tis in DECOUPLED else None
    kw = dict(
        clip_eps_high=eps_high, kl_beta=kl_beta, kl_clamp=kl_clamp, tis=tis, tis_cap=cap, aggregation=agg
    )
    x = b["logp"].clone().requires_grad_(True)
    out = grpo_loss(x, b["old"], b["adv"], b["mask"], ref_logp=ref, behavior_logp=beh, **kw)
    out.loss.backward()
    x64 = b["logp"].double().requires_grad_(True)
    loss64, per64, w64 = reference_loss64(x64, b["old"], b["adv"], b["mask"], ref=ref, beh=beh, **kw)
    loss64.backward()
    assert out.loss.dim() == 0 and out.loss.dtype == torch.float32
    assert out.loss.item() == pytest.approx(loss64.item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-6)
    for f in (out.per_token, out.kl, out.ratio, out.tis_weight):
        assert f.shape == b["mask"].shape and not f.requires_grad
    m = b["mask"]
    torch.testing.assert_close(out.per_token[m].double(), per64[m], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.tis_weight[m].double(), w64[m], rtol=1e-5, atol=1e-6)
    if tis is None or tis in DECOUPLED:  # the ratio actually used: exp(logp - old), uncapped
        r64 = torch.exp(b["logp"].double() - b["old"].double())
        torch.testing.assert_close(out.ratio[m].double(), r64[m], rtol=1e-5, atol=1e-6)
    if with_ref and kl_beta != 0:
        d = (b["ref"].double() - b["logp"].double())
        if kl_clamp is not None:
            d = d.clamp(-kl_clamp, kl_clamp)
        torch.testing.assert_close(out.kl[m].double(), (torch.expm1(d) - d)[m], rtol=1e-5, atol=1e-6)
    for metric in (out.clip_frac, out.kl_mean, out.tis_frac):
        v = scalar(metric)
        assert math.isfinite(v)
    assert 0.0 <= scalar(out.clip_frac) <= 1.0 and 0.0 <= scalar(out.tis_frac) <= 1.0
    assert scalar(out.kl_mean) >= 0.0


# ---------------------------------------------------------------- on-policy closed forms


@FAST
@given(batches(), st.sampled_from([None, "ratio_cap"]))
@example(
    dict(logp=torch.zeros(2, 3), old=torch.zeros(2, 3), ref=torch.zeros(2, 3), beh=torch.zeros(2, 3),
         adv=torch.tensor([1.5, -2.0]), mask=torch.tensor([[True, True, False], [False, False, False]])),
    None,
)  # a fully masked row: contributes 0, counts in N
@example(
    dict(logp=torch.zeros(1, 1), old=torch.zeros(1, 1), ref=torch.zeros(1, 1), beh=torch.zeros(1, 1),
         adv=torch.tensor([0.7]), mask=torch.ones(1, 1, dtype=torch.bool)),
    "ratio_cap",
)  # T = 1
def test_on_policy_sequence_mean_closed_form(b, tis):
    n = b["mask"].shape[0]
    t_i = b["mask"].sum(-1)
    x = b["logp"].clone().requires_grad_(True)
    out = grpo_loss(x, b["logp"].clone(), b["adv"], b["mask"], tis=tis, kl_beta=0.0)
    out.loss.backward()
    present = t_i > 0
    expected = -(b["adv"].double() * present).sum() / n
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-6, abs=1e-7)
    grad = torch.where(
        b["mask"], -(b["adv"] / (n * t_i.clamp_min(1)))[:, None].expand_as(x), torch.zeros_like(x)
    )
    torch.testing.assert_close(x.grad, grad, rtol=1e-6, atol=1e-7)
    assert scalar(out.clip_frac) == 0.0
    assert scalar(out.tis_frac) == 0.0


@FAST
@given(batches())
def test_on_policy_token_mean_closed_form(b):
    mask = b["mask"]
    total = mask.sum().clamp_min(1)
    x = b["logp"].clone().requires_grad_(True)
    out = grpo_loss(x, b["logp"].clone(), b["adv"], mask, kl_beta=0.0, aggregation="token_mean")
    out.loss.backward()
    expected = -(b["adv"].double() * mask.sum(-1)).sum() / total
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-6, abs=1e-7)
    grad = torch.where(mask, -(b["adv"] / total)[:, None].expand_as(x), torch.zeros_like(x))
    torch.testing.assert_close(x.grad, grad, rtol=1e-6, atol=1e-7)


def test_fully_masked_row_counts_in_n():
    logp = torch.zeros(3, 2)
    adv = torch.tensor([1.0, 5.0, 2.0])
    mask = torch.tensor([[True, True], [False, False], [True, False]])
    out = grpo_loss(logp, logp.clone(), adv, mask, kl_beta=0.0)
    assert out.loss.item() == pytest.approx(-(1.0 + 2.0) / 3)
    everything_masked = grpo_loss(logp, logp.clone(), adv, torch.zeros(3, 2, dtype=torch.bool), kl_beta=0.0)
    assert everything_masked.loss.item() == 0.0


# ---------------------------------------------------------------- clipping


@FAST
@given(batches(), st.sampled_from([None, "ratio_cap"]))
def test_clipped_tokens_have_zero_gradient(b, tis):
    # kl_beta = 0: a token with A > 0 and r > 1 + eps, or A < 0 and r < 1 - eps, gets no gradient
    assume(boundaries_ok(b, tis=tis))
    x = b["logp"].clone().requires_grad_(True)
    grpo_loss(x, b["old"], b["adv"], b["mask"], tis=tis, kl_beta=0.0).loss.backward()
    r = torch.exp(b["logp"] - b["old"])
    a = b["adv"][:, None].expand_as(r)
    clipped = b["mask"] & (((a > 0) & (r > 1.2)) | ((a < 0) & (r < 0.8)))
    assert (x.grad[clipped] == 0).all()
    # the pessimistic side keeps its gradient -A r / (N T_i) (for tis=None, or r under the cap)
    kept = b["mask"] & (((a > 0) & (r < 0.8)) | ((a < 0) & (r > 1.2) & (tis is None or r < 2.0)))
    kept &= a != 0
    n, t_i = b["mask"].shape[0], b["mask"].sum(-1, keepdim=True).expand_as(r)
    expected = -a * r / (n * t_i)
    torch.testing.assert_close(x.grad[kept], expected[kept], rtol=1e-5, atol=1e-7)


def test_ratio_cap_zeroes_gradient_above_cap_even_for_negative_advantage():
    # the reference clamps r at tis_cap *before* the surrogate: past the cap nothing flows back
    logp = torch.tensor([[math.log(3.0)]], requires_grad=True)
    out = grpo_loss(logp, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1, dtype=torch.bool), kl_beta=0.0)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(2.0)  # -min(2 * -1, 1.2 * -1) = 2
    assert logp.grad.item() == 0.0


def test_clip_eps_high_is_asymmetric():
    # eps_low 0.2, eps_high 0.28: for A > 0 a ratio of 1.25 is inside, 1.3 outside;
    # for A < 0 the low edge is still 0.8: 0.75 is clipped.
    r = torch.tensor([[1.25, 1.3, 0.75]])
    old = torch.zeros(1, 3)
    mask = torch.ones(1, 3, dtype=torch.bool)
    x = torch.log(r).requires_grad_(True)
    grpo_loss(x, old, torch.tensor([1.0]), mask, tis=None, kl_beta=0.0, clip_eps_high=0.28).loss.backward()
    assert x.grad[0, 0] != 0 and x.grad[0, 1] == 0
    torch.testing.assert_close(x.grad[0, 0], torch.tensor(-1.25 / 3))
    y = torch.log(r).requires_grad_(True)
    grpo_loss(y, old, torch.tensor([-1.0]), mask, tis=None, kl_beta=0.0, clip_eps_high=0.28).loss.backward()
    assert y.grad[0, 2] == 0 and y.grad[0, 0] != 0 and y.grad[0, 1] != 0
    # symmetric default: 1.25 is outside [0.8, 1.2] and gets no gradient for A > 0
    z = torch.log(r).requires_grad_(True)
    grpo_loss(z, old, torch.tensor([1.0]), mask, tis=None, kl_beta=0.0).loss.backward()
    assert z.grad[0, 0] == 0


@pytest.mark.parametrize("tis", [None, "ratio_cap", "token_truncate"])
def test_clipped_token_gradient_is_zero_even_when_ratio_overflows(tis):
    # A > 0 and r = e^100 > 1 + eps: mathematically the token is clipped (and, for ratio_cap,
    # capped first), so its gradient is exactly 0; the other token is on-policy.
    logp = torch.tensor([[0.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-100.0, -1.0]])
    out = grpo_loss(
        logp, old, torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool),
        tis=tis, behavior_logp=old if tis == "token_truncate" else None, kl_beta=0.0,
    )
    out.loss.backward()
    assert math.isfinite(out.loss.item())
    assert torch.isfinite(logp.grad).all(), logp.grad
    assert logp.grad[0, 0] == 0.0
    assert logp.grad[0, 1].item() == pytest.approx(-0.5)


# ---------------------------------------------------------------- the reference's loop


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 6), min_size=1, max_size=6),
    st.integers(0, 2**31 - 1),
    st.sampled_from([0.0, 0.04]),
    st.sampled_from([2.0, 1.3]),
)
@example([0, 3], 0, 0.04, 2.0)  # a sample without tokens
@example([1], 1, 0.04, 2.0)  # T = 1
def test_ratio_cap_equals_reference_loop(lengths, seed, kl_beta, cap):
    g = torch.Generator().manual_seed(seed)
    n, t = len(lengths), max(max(lengths), 1)
    new = [(-3 * torch.rand(L, generator=g)) for L in lengths]
    old = [x - (2 * torch.rand(x.numel(), generator=g) - 1) for x in new]  # r up to e: the cap bites
    ref = [x + (2 * torch.rand(x.numel(), generator=g) - 1) for x in new]
    adv = torch.randn(n, generator=g)
    for x, o in zip(new, old):
        lr = (x - o).double()
        for k in (math.log(0.8), math.log(1.2), math.log(cap)):
            assume(lr.numel() == 0 or (lr - k).abs().min() > 1e-4)
    leaves = [x.clone().requires_grad_(True) for x in new]
    ref_total = reference_loop_ratio_cap(leaves, old, ref, adv, clip_eps=0.2, kl_beta=kl_beta, tis_cap=cap)

    def pad(xs, fill):
        out = torch.full((n, t), fill)
        for i, x in enumerate(xs):
            out[i, : x.numel()] = x.detach()
        return out

    mask = torch.zeros(n, t, dtype=torch.bool)
    for i, L in enumerate(lengths):
        mask[i, :L] = True
    logp = pad(new, float("nan")).requires_grad_(True)
    out = grpo_loss(
        logp, pad(old, float("inf")), adv, mask, ref_logp=pad(ref, float("-inf")),
        clip_eps=0.2, kl_beta=kl_beta, tis="ratio_cap", tis_cap=cap,
    )
    out.loss.backward()
    assert out.loss.item() == pytest.approx(ref_total, rel=1e-5, abs=1e-6)
    for i, L in enumerate(lengths):
        if L:
            torch.testing.assert_close(logp.grad[i, :L], leaves[i].grad, rtol=1e-5, atol=1e-7)
        assert (logp.grad[i, L:] == 0).all()


# ---------------------------------------------------------------- padding and masking


@FAST
@given(
    batches(),
    st.sampled_from(TIS_MODES),
    st.sampled_from(["sequence_mean", "token_mean"]),
    st.integers(1, 3),
    st.sampled_from([float("nan"), float("inf"), float("-inf")]),
)
def test_extra_masked_columns_change_nothing(b, tis, agg, extra, fill):
    beh = b["beh"] if tis in DECOUPLED else None
    kw = dict(tis=tis, aggregation=agg, kl_beta=0.04)
    x = b["logp"].clone().requires_grad_(True)
    base = grpo_loss(x, b["old"], b["adv"], b["mask"], ref_logp=b["ref"], behavior_logp=beh, **kw)
    base.loss.backward()

    n = b["mask"].shape[0]

    def widen(v):
        return torch.cat([v, torch.full((n, extra), fill)], dim=1)

    mask = torch.cat([b["mask"], torch.zeros(n, extra, dtype=torch.bool)], dim=1)
    y = widen(b["logp"]).requires_grad_(True)
    wide = grpo_loss(
        y, widen(b["old"]), b["adv"], mask, ref_logp=widen(b["ref"]),
        behavior_logp=None if beh is None else widen(beh), **kw,
    )
    wide.loss.backward()
    assert torch.isfinite(wide.loss)
    assert wide.loss.item() == pytest.approx(base.loss.item(), rel=1e-6, abs=1e-7)
    assert (y.grad[:, -extra:] == 0).all()
    torch.testing.assert_close(y.grad[:, :-extra], x.grad, rtol=1e-6, atol=1e-7)


@FAST
@given(batches(), st.sampled_from(TIS_MODES), st.sampled_from([float("nan"), float("inf"), float("-inf")]))
def test_nan_at_interior_masked_positions_is_ignored(b, tis, fill):
    # Masked holes anywhere in the row (not just trailing padding) holding NaN/inf in every
    # input give the same loss as holes holding 0, and exactly zero, finite gradients there.
    m = b["mask"]
    beh = b["beh"] if tis in DECOUPLED else None

    def run(f):
        x = with_nan_padding(b["logp"], m, f).requires_grad_(True)
        out = grpo_loss(
            x, with_nan_padding(b["old"], m, f), b["adv"], m,
            ref_logp=with_nan_padding(b["ref"], m, f),
            behavior_logp=None if beh is None else with_nan_padding(beh, m, f),
            tis=tis,
        )
        out.loss.backward()
        return out, x.grad

    clean, g0 = run(0.0)
    dirty, g1 = run(fill)
    assert torch.isfinite(dirty.loss)
    assert dirty.loss.item() == pytest.approx(clean.loss.item(), rel=1e-6, abs=1e-7)
    assert torch.isfinite(g1).all()
    assert (g1[~m] == 0).all()
    torch.testing.assert_close(g1, g0)
    for metric in (dirty.clip_frac, dirty.kl_mean, dirty.tis_frac):
        assert math.isfinite(scalar(metric))


# ---------------------------------------------------------------- TIS modes


@FAST
@given(batches(), st.sampled_from(DECOUPLED), st.sampled_from(["sequence_mean", "token_mean"]))
def test_behavior_equal_old_equals_no_tis(b, tis, agg):
    # rho = 1 <= cap: every decoupled mode reduces to tis=None
    x = b["logp"].clone().requires_grad_(True)
    y = b["logp"].clone().requires_grad_(True)
    kw = dict(ref_logp=b["ref"], aggregation=agg)
    a = grpo_loss(x, b["old"], b["adv"], b["mask"], tis=None, **kw)
    c = grpo_loss(y, b["old"], b["adv"], b["mask"], tis=tis, behavior_logp=b["old"].clone(), **kw)
    a.loss.backward()
    c.loss.backward()
    assert c.loss.item() == pytest.approx(a.loss.item(), rel=1e-6, abs=1e-7)
    torch.testing.assert_close(y.grad, x.grad, rtol=1e-6, atol=1e-7)
    assert scalar(c.tis_frac) == 0.0


def test_sequence_mask_survives_overflowing_rho():
    # sum(old - behavior) = 200 -> rho = e^200 overflows float32; the weight is still 0
    mask = torch.ones(1, 2, dtype=torch.bool)
    logp = torch.zeros(1, 2, requires_grad=True)
    beh = torch.full((1, 2), -100.0)
    for tis in ("sequence_mask", "token_mask"):
        out = grpo_loss(logp, torch.zeros(1, 2), torch.ones(1), mask, behavior_logp=beh, tis=tis, kl_beta=0.0)
        assert out.loss.item() == 0.0
        (g,) = torch.autograd.grad(out.loss, logp)
        assert torch.isfinite(g).all() and (g == 0).all()
        assert scalar(out.tis_frac) == 1.0
    out = grpo_loss(logp, torch.zeros(1, 2), torch.ones(1), mask, behavior_logp=beh, tis="sequence_truncate", kl_beta=0.0)
    assert out.loss.item() == pytest.approx(-2.0)  # w = cap = 2, s = 1


def test_sequence_masked_row_keeps_its_kl_term():
    # w multiplies only the surrogate: a dropped sequence still pays its KL penalty
    logp = torch.tensor([[math.log(0.25)]], requires_grad=True)
    ref = torch.tensor([[math.log(0.5)]])
    out = grpo_loss(
        logp, logp.detach().clone(), torch.tensor([3.0]), torch.ones(1, 1, dtype=torch.bool),
        ref_logp=ref, behavior_logp=torch.tensor([[-5.0]]), tis="sequence_mask", kl_beta=0.5,
    )
    assert out.loss.item() == pytest.approx(0.5 * (1 - math.log(2)), rel=1e-6)


@FAST
@given(batches(), st.sampled_from(TIS_MODES))
def test_loss_differentiable_wrt_logp_only(b, tis):
    # old_logp, ref_logp, behavior_logp and advantages get no gradient, even if they require it
    m = b["mask"]
    assume(m.any())
    old = b["old"].clone().requires_grad_(True)
    ref = b["ref"].clone().requires_grad_(True)
    beh = b["beh"].clone().requires_grad_(True)
    adv = b["adv"].clone().requires_grad_(True)
    x = b["logp"].clone().requires_grad_(True)
    out = grpo_loss(x, old, adv, m, ref_logp=ref, behavior_logp=beh if tis in DECOUPLED else None, tis=tis)
    grads = torch.autograd.grad(out.loss, [old, ref, beh, adv], allow_unused=True)
    for gr in grads:
        assert gr is None or (gr == 0).all()


def test_kl_dropped_at_zero_beta_and_measured():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 4, generator=g)
    old = logp + 0.1 * torch.randn(3, 4, generator=g)
    ref = logp + torch.randn(3, 4, generator=g)
    adv = torch.randn(3, generator=g)
    mask = torch.rand(3, 4, generator=g) > 0.3
    none = grpo_loss(logp, old, adv, mask, kl_beta=0.0)
    zero_beta = grpo_loss(logp, old, adv, mask, ref_logp=ref, kl_beta=0.0)
    with_kl = grpo_loss(logp, old, adv, mask, ref_logp=ref, kl_beta=0.5)
    assert zero_beta.loss.item() == pytest.approx(none.loss.item(), abs=1e-7)
    assert scalar(zero_beta.kl_mean) > 0 and scalar(none.kl_mean) == 0  # measured at kl_beta = 0 too
    assert with_kl.loss.item() > none.loss.item()  # k3 >= 0 and some delta != 0


@pytest.mark.parametrize("kl_beta", [None, 0.5])
def test_kl_weight_needs_a_reference(kl_beta):
    # The default kl_beta (0.04) or any other non-zero weight without ref_logp used to drop the KL silently.
    logp, old, adv, mask = _ok()
    kw = {} if kl_beta is None else dict(kl_beta=kl_beta)
    with pytest.raises(ValueError, match=r"^kl_beta=0\.(04|5) weighs a KL to the reference, but ref_logp is None: "
                                         r"pass ref_logp, or kl_beta=0 for no KL term$"):
        grpo_loss(logp, old, adv, mask, **kw)


def test_kl_mean_zero_when_reference_equals_policy():
    logp = -torch.rand(2, 3)
    out = grpo_loss(logp, logp.clone(), torch.ones(2), torch.ones(2, 3, dtype=torch.bool), ref_logp=logp.clone())
    assert scalar(out.kl_mean) == 0.0
    assert (out.kl == 0).all()


# ---------------------------------------------------------------- aggregate_loss


@FAST
@given(batches(), st.sampled_from([float("nan"), float("inf"), 7.0]))
@example(
    dict(logp=torch.tensor([[1.0, 2.0], [3.0, 4.0]]), old=None, ref=None, beh=None, adv=None,
         mask=torch.tensor([[True, False], [False, False]])),
    float("nan"),
)
def test_aggregate_loss_modes(b, fill):
    per = with_nan_padding(b["logp"], b["mask"], fill)
    m = b["mask"]
    p64 = torch.where(m, b["logp"].double(), torch.zeros((), dtype=torch.float64))
    seq = (p64.sum(-1) / m.sum(-1).clamp_min(1)).sum() / m.shape[0]
    a = aggregate_loss(per, m, mode="sequence_mean")
    assert a.dim() == 0 and torch.isfinite(a)
    assert a.item() == pytest.approx(seq.item(), rel=1e-6, abs=1e-7)
    tok = aggregate_loss(per, m, mode="token_mean")
    if m.any():
        assert tok.item() == pytest.approx((p64.sum() / m.sum()).item(), rel=1e-6, abs=1e-7)


def test_aggregate_loss_hand_worked():
    per = torch.tensor([[1.0, 3.0, float("nan")], [10.0, float("inf"), float("inf")], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    # sequence_mean: (2 + 10 + 0) / 3 ; token_mean: (1 + 3 + 10) / 3
    assert aggregate_loss(per, mask, mode="sequence_mean").item() == pytest.approx(4.0)
    assert aggregate_loss(per, mask, mode="token_mean").item() == pytest.approx(14.0 / 3)
    x = per.clone().requires_grad_(True)
    aggregate_loss(x, mask, mode="sequence_mean").backward()
    torch.testing.assert_close(x.grad, torch.tensor([[1 / 6, 1 / 6, 0.0], [1 / 3, 0.0, 0.0], [0.0, 0.0, 0.0]]))


def test_aggregate_loss_bad_input():
    with pytest.raises(ValueError):
        aggregate_loss(torch.zeros(2, 3), torch.ones(2, 3), mode="sequence_mean")
    with pytest.raises(ValueError) as ei:
        aggregate_loss(torch.zeros(2, 7), torch.ones(2, 11, dtype=torch.bool), mode="token_mean")
    assert "7" in str(ei.value) and "11" in str(ei.value)
    with pytest.raises(ValueError):
        aggregate_loss(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), mode="median")


# ---------------------------------------------------------------- bad input


def _ok():
    return torch.zeros(3, 7), torch.zeros(3, 7), torch.zeros(3), torch.ones(3, 7, dtype=torch.bool)


@pytest.mark.parametrize("bad_mask", [torch.ones(3, 7), torch.ones(3, 7, dtype=torch.long), torch.ones(3, 7, dtype=torch.uint8)])
def test_non_bool_mask_rejected(bad_mask):
    logp, old, adv, _ = _ok()
    with pytest.raises(ValueError):
        grpo_loss(logp, old, adv, bad_mask)


def test_shape_mismatches_name_the_shapes():
    logp, old, adv, mask = _ok()
    cases = [
        dict(old_logp=torch.zeros(3, 11)),
        dict(mask=torch.ones(3, 11, dtype=torch.bool)),
        dict(advantages=torch.zeros(11)),
        dict(ref_logp=torch.zeros(3, 11)),
        dict(behavior_logp=torch.zeros(3, 11), tis="token_truncate"),
    ]
    for case in cases:
        args = dict(logp=logp, old_logp=old, advantages=adv, mask=mask)
        kw = {}
        for k, v in case.items():
            (args if k in args else kw)[k] = v
        with pytest.raises(ValueError) as ei:
            grpo_loss(args["logp"], args["old_logp"], args["advantages"], args["mask"], **kw)
        assert "11" in str(ei.value), (case.keys(), str(ei.value))


def test_other_bad_arguments_rejected():
    logp, old, adv, mask = _ok()
    with pytest.raises(ValueError):
        grpo_loss(torch.zeros(7), torch.zeros(7), torch.zeros(1), torch.ones(7, dtype=torch.bool))
    with pytest.raises(ValueError):
        grpo_loss(logp, old, torch.zeros(3, 1), mask)
    with pytest.raises(ValueError):
        grpo_loss(logp, old, adv, mask, tis="importance")
    with pytest.raises(ValueError):
        grpo_loss(logp, old, adv, mask, aggregation="median")
    for tis in DECOUPLED:
        with pytest.raises(ValueError):
            grpo_loss(logp, old, adv, mask, tis=tis)  # decoupled TIS needs behavior_logp


# ---------------------------------------------------------------- clip fraction, argument checks


def test_clip_frac_counts_only_tokens_where_the_clip_binds():
    # eps = 0.2. Tokens (r, A): (1.5, +1) binds high; (0.5, +1) is outside but the unclipped
    # side is the minimum; (1.5, -1) likewise; (0.5, -1) binds low; (1.5, 0) has no advantage.
    # One advantage per row: five rows of one token each.
    r = torch.tensor([[1.5], [0.5], [1.5], [0.5], [1.5]])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.0])
    mask = torch.ones(5, 1, dtype=torch.bool)
    out = grpo_loss(torch.log(r), torch.zeros(5, 1), adv, mask, tis=None, kl_beta=0.0)
    assert scalar(out.clip_frac) == pytest.approx(2 / 5)
    assert scalar(out.outside_clip_frac) == pytest.approx(1.0)


@FAST
@given(batches(), st.sampled_from(TIS_MODES), st.sampled_from([None, 0.28]))
def test_clip_frac_is_verls_and_trls_active_clip_fraction(b, tis, eps_high):
    # verl (verl/trainer/ppo/core_algos.py, compute_policy_loss):
    #   pg_clipfrac = masked_mean(gt(-A * clip(r), -A * r));
    # TRL (trl/trainer/grpo_trainer.py): is_low_clipped = (r < 1 - eps) & (A < 0),
    #   is_high_clipped = (r > 1 + eps_high) & (A > 0), clip_ratio/region = low | high.
    assume(boundaries_ok(b, tis=tis, clip_eps_high=eps_high))
    beh = b["beh"] if tis in DECOUPLED else None
    out = grpo_loss(b["logp"], b["old"], b["adv"], b["mask"], behavior_logp=beh, tis=tis, kl_beta=0.0,
                    clip_eps_high=eps_high)
    r = out.ratio.double()  # the ratio the surrogate used (after a ratio_cap)
    a = b["adv"].double()[:, None].expand_as(r)
    hi = 0.2 if eps_high is None else eps_high
    m = b["mask"]
    verl = torch.gt(-a * r.clamp(0.8, 1 + hi), -a * r)
    trl = ((r < 0.8) & (a < 0)) | ((r > 1 + hi) & (a > 0))
    count = max(int(m.sum()), 1)
    assert scalar(out.clip_frac) == pytest.approx(float(verl[m].sum()) / count, abs=1e-6)
    assert scalar(out.clip_frac) == pytest.approx(float(trl[m].sum()) / count, abs=1e-6)
    outside = (r < 0.8) | (r > 1 + hi)
    assert scalar(out.outside_clip_frac) == pytest.approx(float(outside[m].sum()) / count, abs=1e-6)
    assert scalar(out.clip_frac) <= scalar(out.outside_clip_frac)


def test_ratio_cap_below_the_upper_clip_is_refused():
    logp, old, adv, mask = _ok()
    with pytest.raises(ValueError, match=r"tis_cap.*1\.1.*1 \+ clip_eps_high.*1\.2"):
        grpo_loss(logp, old, adv, mask, tis="ratio_cap", tis_cap=1.1)
    with pytest.raises(ValueError, match="tis_cap"):
        grpo_loss(logp, old, adv, mask, tis="ratio_cap", tis_cap=1.3, clip_eps_high=0.4)
    # at or above the upper clip edge the cap is fine; the decoupled modes cap a different ratio
    grpo_loss(logp, old, adv, mask, tis="ratio_cap", tis_cap=1.2, kl_beta=0.0)
    grpo_loss(logp, old, adv, mask, tis="token_truncate", tis_cap=1.1, behavior_logp=old, kl_beta=0.0)


@pytest.mark.parametrize("tis", ["ratio_cap", None])
def test_behavior_logp_that_would_be_ignored_is_refused(tis):
    logp, old, adv, mask = _ok()
    with pytest.raises(ValueError, match="behavior_logp.*ignored"):
        grpo_loss(logp, old, adv, mask, tis=tis, behavior_logp=old)
