"""policy_loss: GSPO, CISPO, the on-policy surrogate, the ratio/keep token masks and the new aggregations,
against float64 transcriptions of their formulas (peer parity with TRL and verl: test_peer_parity.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from nla_core import aggregate_loss, grpo_loss, policy_loss
from test_losses import DECOUPLED, TIS_MODES, batches, boundaries_ok, scalar, with_nan_padding

FAST = settings(max_examples=40, deadline=None)
KINDS = ["grpo", "gspo", "cispo", "onpolicy"]


def reference_policy64(
    logp, old, adv, mask, *, kind="grpo", ref=None, beh=None, clip_eps=0.2, clip_eps_high=None, kl_beta=0.04,
    kl_clamp=None, tis="ratio_cap", tis_cap=2.0, token_mask=None, keep=None, aggregation="sequence_mean",
    max_len=None, group_ids=None,
):
    """The docstring's formulas, transcribed in float64 with explicit loops over rows (padding zeroed first)."""

    def z(x):
        return torch.where(mask, x.double(), torch.zeros((), dtype=torch.float64))

    n, t = mask.shape
    lp = z(logp)
    hi = clip_eps if clip_eps_high is None else clip_eps_high
    rows = []
    for i in range(n):
        m = mask[i]
        if kind == "gspo":
            seq = (lp[i].detach() - z(old)[i]).sum() / max(1, int(m.sum()))
            lr = lp[i] - lp[i].detach() + seq
        else:
            lr = lp[i] - z(old)[i]
        r = torch.exp(lr.clamp(max=math.log(tis_cap)) if tis == "ratio_cap" else lr)
        w = torch.ones(t, dtype=torch.float64)
        if tis in DECOUPLED:
            lrho = z(old)[i] - z(beh)[i]
            if tis.startswith("sequence"):
                lrho = lrho.sum().expand(t)
            rho = torch.exp(lrho)
            w = rho.clamp(max=tis_cap) if tis.endswith("truncate") else torch.where(lrho <= math.log(tis_cap), rho, 0 * rho)
        k = m.clone()
        if keep is not None:
            k = k & keep[i]
        if token_mask is not None:
            eng = (z(old)[i] - z(beh)[i]) if tis in DECOUPLED else (lp[i].detach() - z(old)[i])
            k = k & (eng.exp() >= token_mask[0]) & (eng.exp() <= token_mask[1])
        a = float(adv[i])
        if kind in ("grpo", "gspo"):
            s = torch.minimum(r * a, r.clamp(1 - clip_eps, 1 + hi) * a)
        elif kind == "cispo":
            s = r.detach().clamp(max(0.0, 1 - clip_eps), 1 + hi) * a * lp[i]
        else:
            s = a * lp[i]
        per = -(w * k.double() * s)
        if ref is not None and kl_beta != 0:
            d = z(ref)[i] - lp[i]
            if kl_clamp is not None:
                d = d.clamp(-kl_clamp, kl_clamp)
            per = per + kl_beta * (torch.exp(d) - 1 - d)
        rows.append(torch.where(m, per, torch.zeros_like(per)))
    per = torch.stack(rows)
    if aggregation == "sequence_mean":
        loss = sum(per[i].sum() / max(1, int(mask[i].sum())) for i in range(n)) / n
    elif aggregation == "token_mean":
        loss = per.sum() / max(1, int(mask.sum()))
    elif aggregation == "seq_mean_token_sum_norm":
        loss = per.sum() / (n * max_len)
    else:
        gids = group_ids.tolist()
        groups = sorted(set(gids))
        loss = 0.0
        for g in groups:
            members = [i for i in range(n) if gids[i] == g]
            tokens = sum(int(mask[i].sum()) for i in members)
            loss = loss + sum(per[i].sum() for i in members) / max(1, tokens)
        loss = loss / len(groups)
    return loss, per


def kinks_ok(b, *, kind, tis, tis_cap, token_mask, margin=1e-3):
    """No unmasked token within `margin` of a branch point: test_losses' clip edges, caps and TIS
    weights, plus GSPO's sequence ratio at the clip edges and the engine/trainer ratio at the band's."""
    m = b["mask"]
    if not m.any():
        return True
    if not boundaries_ok(b, tis=tis, tis_cap=tis_cap, margin=margin):
        return False
    edges = [math.log(0.8), math.log(1.2)]
    if kind == "gspo":
        lr = torch.where(m, b["logp"].double() - b["old"].double(), torch.zeros((), dtype=torch.float64))
        seq = (lr.sum(-1) / m.sum(-1).clamp_min(1))[:, None].expand_as(lr)
        if (seq[m][:, None] - torch.tensor(edges, dtype=torch.float64)).abs().min() < margin:
            return False
    if token_mask is not None:
        eng = b["old"].double() - b["beh"].double() if tis in DECOUPLED else b["logp"].double() - b["old"].double()
        if (eng[m][:, None] - torch.tensor([math.log(x) for x in token_mask], dtype=torch.float64)).abs().min() < margin:
            return False
    return True


@settings(max_examples=120, deadline=None)
@given(
    batches(),
    st.sampled_from(KINDS),
    st.sampled_from(TIS_MODES),
    st.sampled_from(["sequence_mean", "token_mean", "seq_mean_token_sum_norm", "prompt_mean"]),
    st.sampled_from([0.0, 0.04]),
    st.sampled_from([None, (0.5, 2.0), (0.8, 1.25)]),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_matches_float64_transcription(b, kind, tis, agg, kl_beta, band, with_keep, seed):
    assume(not (kind == "onpolicy" and tis == "ratio_cap"))
    if tis in DECOUPLED:  # old_logp are the trainer's there: one update per batch
        b = {**b, "old": b["logp"].clone()}
    assume(kinks_ok(b, kind=kind, tis=tis, tis_cap=2.0, token_mask=band))
    n, t = b["mask"].shape
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(n, t, generator=g) > 0.3 if with_keep else None
    group_ids = torch.randint(0, 3, (n,), generator=g)
    beh = b["beh"] if tis in DECOUPLED else None
    extra = dict(max_len=t + 2) if agg == "seq_mean_token_sum_norm" else {}
    extra.update(group_ids=group_ids) if agg == "prompt_mean" else None
    kw = dict(kind=kind, kl_beta=kl_beta, tis=tis, token_mask=band, keep=keep, aggregation=agg, **extra)
    old = b["old"]
    x = b["logp"].clone().requires_grad_(True)
    out = policy_loss(x, old, b["adv"], b["mask"], ref_logp=b["ref"], behavior_logp=beh, **kw)
    out.loss.backward()
    x64 = b["logp"].double().requires_grad_(True)
    loss64, per64 = reference_policy64(x64, old, b["adv"], b["mask"], ref=b["ref"], beh=beh, **kw)
    if isinstance(loss64, torch.Tensor) and loss64.requires_grad:
        loss64.backward()
        grad64 = x64.grad
    else:
        grad64 = torch.zeros_like(x64)
    assert out.loss.dtype == torch.float32 and out.loss.dim() == 0
    assert out.loss.item() == pytest.approx(float(torch.as_tensor(loss64).detach()), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(x.grad.double(), grad64, rtol=1e-5, atol=1e-6)
    m = b["mask"]
    torch.testing.assert_close(out.per_token[m].double(), per64[m].detach(), rtol=1e-5, atol=1e-6)
    for f in out[1:]:
        assert not f.requires_grad
    assert 0.0 <= scalar(out.token_mask_frac) <= 1.0
    assert scalar(out.clip_frac) <= scalar(out.outside_clip_frac) + 1e-7


# ---------------------------------------------------------------- hand-worked


def test_hand_worked_gspo():
    # row 0: log ratios [log 1.5, log 0.5] over 2 tokens -> s = sqrt(0.75) = 0.866 (inside [0.8, 1.2]);
    # row 1: one token, log ratio log 1.5 -> s = 1.5, A = +1 -> clipped at 1.2.
    old = torch.zeros(2, 2)
    logp = torch.tensor([[math.log(1.5), math.log(0.5)], [math.log(1.5), 0.0]], requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])
    adv = torch.tensor([2.0, 1.0])
    out = policy_loss(logp, old, adv, mask, kind="gspo", tis=None, kl_beta=0.0)
    s0 = math.sqrt(0.75)
    assert out.loss.item() == pytest.approx((-2 * s0 - 1.2) / 2, rel=1e-6)
    torch.testing.assert_close(out.ratio, torch.tensor([[s0, s0], [1.5, 0.0]]))
    out.loss.backward()
    # row 0: d/dlogp_t of -(1/2)(1/2) sum_t 2 s_t = -(1/2) s0 on each token; row 1 clipped: 0
    torch.testing.assert_close(logp.grad, torch.tensor([[-s0 / 2, -s0 / 2], [0.0, 0.0]]))
    assert scalar(out.clip_frac) == pytest.approx(1 / 3)


def test_hand_worked_cispo_and_onpolicy():
    # r = [1.5, 0.5]; CISPO clip [0.8, 1.2] -> weights [1.2, 0.8]; A = 1: per-token -w * logp
    logp = torch.tensor([[math.log(0.6), math.log(0.2)]], requires_grad=True)
    old = torch.full((1, 2), math.log(0.4))
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = policy_loss(logp, old, torch.ones(1), mask, kind="cispo", tis=None, kl_beta=0.0)
    assert out.loss.item() == pytest.approx(-(1.2 * math.log(0.6) + 0.8 * math.log(0.2)) / 2, rel=1e-6)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.6, -0.4]]))  # the detached weights / 2
    assert scalar(out.clip_frac) == 1.0
    # ScaleRL / TRL: no lower clip (clip_eps >= 1), upper bound 5 (clip_eps_high = 4)
    wide = policy_loss(logp.detach(), old, torch.ones(1), mask, kind="cispo", tis=None, kl_beta=0.0,
                       clip_eps=1.0, clip_eps_high=4.0)
    assert wide.loss.item() == pytest.approx(-(1.5 * math.log(0.6) + 0.5 * math.log(0.2)) / 2, rel=1e-6)
    # on-policy: -A logp, whatever the ratio
    on = policy_loss(logp.detach(), old, torch.tensor([3.0]), mask, kind="onpolicy", tis=None, kl_beta=0.0)
    assert on.loss.item() == pytest.approx(-3 * (math.log(0.6) + math.log(0.2)) / 2, rel=1e-6)
    assert scalar(on.clip_frac) == 0.0


def test_onpolicy_gradient_equals_grpo_at_ratio_one():
    # One update per batch (old = logp): d(A r)/dlogp = A = d(A logp)/dlogp, so the two agree in gradient
    g = torch.Generator().manual_seed(1)
    logp = -torch.rand(4, 6, generator=g)
    ref = logp + 0.3 * torch.randn(4, 6, generator=g)
    adv, mask = torch.randn(4, generator=g), torch.rand(4, 6, generator=g) > 0.2
    grads = []
    for kind in ("grpo", "onpolicy", "cispo", "gspo"):
        x = logp.clone().requires_grad_(True)
        policy_loss(x, logp, adv, mask, kind=kind, tis=None, ref_logp=ref, kl_clamp=12.0).loss.backward()
        grads.append(x.grad)
    for gr in grads[1:]:
        torch.testing.assert_close(gr, grads[0], rtol=1e-6, atol=1e-7)


def test_onpolicy_refuses_ratio_cap():
    z = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="onpolicy.*ratio_cap"):
        policy_loss(z, z, torch.zeros(1), torch.ones(1, 1, dtype=torch.bool), kind="onpolicy")


def test_token_mask_drops_the_surrogate_not_the_kl():
    # engine/trainer log ratio (ratio_cap: logp - old) = [log 3, 0]: band (0.5, 2) drops token 0's surrogate
    logp = torch.tensor([[math.log(0.6), math.log(0.2)]], requires_grad=True)
    old = torch.tensor([[math.log(0.2), math.log(0.2)]])
    ref = old.clone()
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = policy_loss(logp, old, torch.ones(1), mask, ref_logp=ref, kl_beta=0.5, token_mask=(0.5, 2.0), tis_cap=3.0)
    d = math.log(0.2) - math.log(0.6)
    k3 = math.exp(d) - 1 - d
    assert out.loss.item() == pytest.approx((0.5 * k3 + (-1.0)) / 2, rel=1e-6)
    assert scalar(out.token_mask_frac) == 0.5
    assert out.tis_weight[0, 0] == 0


# ---------------------------------------------------------------- masking


@FAST
@given(batches(), st.sampled_from(KINDS), st.sampled_from([float("nan"), float("inf"), float("-inf")]),
       st.sampled_from(["sequence_mean", "seq_mean_token_sum_norm", "prompt_mean"]))
def test_nan_at_masked_positions_is_ignored(b, kind, fill, agg):
    m = b["mask"]
    n = m.shape[0]
    tis = None if kind == "onpolicy" else "ratio_cap"
    extra = {"seq_mean_token_sum_norm": dict(max_len=9), "prompt_mean": dict(group_ids=torch.arange(n) // 2)}
    kw = dict(kind=kind, tis=tis, token_mask=(0.5, 2.0), aggregation=agg, **extra.get(agg, {}))

    def run(f):
        x = with_nan_padding(b["logp"], m, f).requires_grad_(True)
        out = policy_loss(x, with_nan_padding(b["old"], m, f), b["adv"], m,
                          ref_logp=with_nan_padding(b["ref"], m, f), **kw)
        out.loss.backward()
        return out, x.grad

    clean, g0 = run(0.0)
    dirty, g1 = run(fill)
    assert torch.isfinite(dirty.loss) and dirty.loss.item() == pytest.approx(clean.loss.item(), rel=1e-6, abs=1e-7)
    assert torch.isfinite(g1).all() and (g1[~m] == 0).all()
    torch.testing.assert_close(g1, g0)
    for f in dirty[1:]:
        assert torch.isfinite(f).all()


@FAST
@given(batches(), st.sampled_from(TIS_MODES))
def test_grpo_kind_is_grpo_loss(b, tis):
    beh = b["beh"] if tis in DECOUPLED else None
    a = grpo_loss(b["logp"], b["old"], b["adv"], b["mask"], ref_logp=b["ref"], behavior_logp=beh, tis=tis)
    c = policy_loss(b["logp"], b["old"], b["adv"], b["mask"], ref_logp=b["ref"], behavior_logp=beh, tis=tis)
    for x, y in zip(a, c):
        assert torch.equal(x, y)


# ---------------------------------------------------------------- aggregations


def test_aggregations_hand_worked():
    per = torch.tensor([[1.0, 3.0, float("nan")], [10.0, float("inf"), 0.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False], [True, True, True]])
    # seq_mean_token_sum_norm, L = 4: (4 + 10 + 4) / (3 * 4)
    assert aggregate_loss(per, mask, mode="seq_mean_token_sum_norm", max_len=4).item() == pytest.approx(18 / 12)
    # prompt_mean, groups {0, 1} and {2}: group 0 has 3 tokens summing to 14, group 1 3 tokens summing to 4
    gids = torch.tensor([7, 7, 9])
    assert aggregate_loss(per, mask, mode="prompt_mean", group_ids=gids).item() == pytest.approx((14 / 3 + 4 / 3) / 2)
    x = per.clone().requires_grad_(True)
    aggregate_loss(x, mask, mode="prompt_mean", group_ids=gids).backward()
    torch.testing.assert_close(x.grad, torch.tensor([[1 / 6, 1 / 6, 0.0], [1 / 6, 0.0, 0.0], [1 / 6] * 3]))


@FAST
@given(batches(), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_prompt_mean_parts_add_up(b, parts, seed):
    # Split into micro-batches with the whole batch's group_tokens and D: the losses add up
    m, per = b["mask"], b["logp"]
    n = m.shape[0]
    gids = torch.randint(0, 3, (n,), generator=torch.Generator().manual_seed(seed))
    whole = aggregate_loss(per, m, mode="prompt_mean", group_ids=gids)
    counts = torch.stack([m[gids == g].sum() for g in gids])
    d = len(set(gids.tolist()))
    total = sum(
        aggregate_loss(per[i : i + parts], m[i : i + parts], mode="prompt_mean", group_ids=gids[i : i + parts],
                       group_tokens=counts[i : i + parts], denominator=d)
        for i in range(0, n, parts)
    )
    assert float(total) == pytest.approx(whole.item(), rel=1e-5, abs=1e-6)


def test_aggregation_arguments_checked():
    per, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="max_len"):
        aggregate_loss(per, mask, mode="seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="max_len"):
        aggregate_loss(per, mask, mode="token_mean", max_len=3)
    with pytest.raises(ValueError, match="group_ids"):
        aggregate_loss(per, mask, mode="prompt_mean")
    with pytest.raises(ValueError, match="group_ids"):
        aggregate_loss(per, mask, mode="sequence_mean", group_ids=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="5"):
        aggregate_loss(per, mask, mode="prompt_mean", group_ids=torch.zeros(5, dtype=torch.long))


def test_bad_policy_arguments_rejected():
    z, m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="kind"):
        policy_loss(z, z, torch.zeros(2), m, kind="ppo2")
    with pytest.raises(ValueError, match="band"):
        policy_loss(z, z, torch.zeros(2), m, token_mask=(1.5, 2.0))
    with pytest.raises(ValueError, match="keep"):
        policy_loss(z, z, torch.zeros(2), m, keep=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="keep"):
        policy_loss(z, z, torch.zeros(2), m, keep=torch.ones(2, 3))


def test_aggregation_arguments_are_checked_before_any_arithmetic():
    z, m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"group_ids must be \[N\] = \[2\].*\(5,\)"):
        policy_loss(z, z, torch.zeros(2), m, aggregation="prompt_mean", group_ids=torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="group_tokens"):
        policy_loss(z, z, torch.zeros(2), m, aggregation="prompt_mean", group_ids=torch.zeros(2, dtype=torch.long),
                    group_tokens=torch.ones(3))
    with pytest.raises(ValueError, match="max_len"):
        policy_loss(z, z, torch.zeros(2), m, aggregation="seq_mean_token_sum_norm", max_len=0)
