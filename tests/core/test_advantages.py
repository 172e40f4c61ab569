"""group_advantages (per-group centring; group std, batch std or no scaling), group_has_variance, best_in_group."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from nla_core import best_in_group, group_advantages, group_has_variance

FAST = settings(max_examples=40, deadline=None)

# Rewards are drawn as integers / 4 so that float32 holds them exactly; the group
# labels come from a small alphabet so that groups have several members.
reward_values = st.integers(-40, 40).map(lambda k: k / 4.0)


@st.composite
def grouped_rewards(draw, min_n=1, max_n=12):
    n = draw(st.integers(min_n, max_n))
    rewards = draw(st.lists(reward_values, min_size=n, max_size=n))
    gids = draw(st.lists(st.integers(-3, 3), min_size=n, max_size=n))
    return rewards, gids


def reference_advantages(rewards, gids, *, scale="std", eps=1e-6):
    """float64 loop re-implementation of the reference's advantage block (groups by value)."""
    out = [0.0] * len(rewards)
    n = len(rewards)
    batch_mu = math.fsum(rewards) / n if n else 0.0
    batch_sd = math.sqrt(math.fsum((v - batch_mu) ** 2 for v in rewards) / (n - 1)) if n > 1 else 0.0
    for g in set(gids):
        idx = [i for i, x in enumerate(gids) if x == g]
        vals = [rewards[i] for i in idx]
        mu = math.fsum(vals) / len(vals)
        if len(vals) > 1:
            sd = math.sqrt(math.fsum((v - mu) ** 2 for v in vals) / (len(vals) - 1))
        else:
            sd = 1.0  # the reference's fallback; the numerator is 0 anyway
        for i, v in zip(idx, vals):
            if len(set(vals)) == 1:
                out[i] = 0.0  # a constant group: exactly 0
            elif scale == "none":
                out[i] = v - mu
            elif scale == "batch":
                out[i] = (v - mu) / (batch_sd + eps)
            else:
                out[i] = (v - mu) / (sd + eps)
    return torch.tensor(out, dtype=torch.float64)


def run(rewards, gids, **kw):
    return group_advantages(
        torch.tensor(rewards, dtype=torch.float32), torch.tensor(gids, dtype=torch.long), **kw
    )


def groups_of(gids):
    return {g: [i for i, x in enumerate(gids) if x == g] for g in set(gids)}


# ---------------------------------------------------------------- hand-worked


def test_hand_worked_std():
    # group 0: [1,2,3] mean 2, unbiased std 1 -> [-1, 0, 1] / (1 + 1e-6)
    # group 7: [5,5] constant -> 0; group 3: singleton -> 0
    adv = run([1.0, 5.0, 2.0, 4.0, 3.0, 5.0], [0, 7, 0, 3, 0, 7])
    expected = torch.tensor([-1.0, 0.0, 0.0, 0.0, 1.0, 0.0]) / (1 + 1e-6)
    assert adv.dtype == torch.float32 and adv.shape == (6,)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-7)
    assert adv[1] == 0 and adv[3] == 0 and adv[5] == 0


def test_hand_worked_none():
    # Dr. GRPO: centring only. group 0: [1, 4] mean 2.5 -> [-1.5, 1.5]; group 1: [2] -> 0
    adv = run([1.0, 2.0, 4.0], [0, 1, 0], scale="none")
    assert adv.tolist() == [-1.5, 0.0, 1.5]


def test_two_member_group_std():
    # [0, 2]: mean 1, unbiased std sqrt(2) -> -+1/sqrt(2)
    adv = run([0.0, 2.0], [5, 5], eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0]) / math.sqrt(2.0))


# ---------------------------------------------------------------- properties


@FAST
@given(grouped_rewards(), st.sampled_from(["std", "none", "batch"]))
@example(([3.0], [0]), "std")  # singleton
@example(([1.5, 1.5, 1.5], [2, 2, 2]), "std")  # constant group
def test_matches_float64_reference(data, scale):
    rewards, gids = data
    adv = run(rewards, gids, scale=scale)
    assert adv.dtype == torch.float32 and adv.shape == (len(rewards),)
    assert torch.isfinite(adv).all()
    torch.testing.assert_close(
        adv.double(), reference_advantages(rewards, gids, scale=scale), rtol=1e-6, atol=1e-6
    )


@FAST
@given(grouped_rewards(), st.sampled_from(["std", "none", "batch"]))
def test_zero_mean_per_group(data, scale):
    rewards, gids = data
    adv = run(rewards, gids, scale=scale).double()
    for idx in groups_of(gids).values():
        assert abs(adv[idx].mean().item()) < 1e-5


@FAST
@given(grouped_rewards(min_n=2))
def test_unit_unbiased_std_per_group(data):
    rewards, gids = data
    eps = 1e-6
    adv = run(rewards, gids, eps=eps).double()
    for idx in groups_of(gids).values():
        vals = torch.tensor([rewards[i] for i in idx], dtype=torch.float64)
        if len(idx) < 2 or vals.max() == vals.min():
            continue
        sd = vals.std(unbiased=True).item()
        # exactly std_g / (std_g + eps): within 1e-5 of 1 for these reward scales
        assert adv[idx].std(unbiased=True).item() == pytest.approx(sd / (sd + eps), abs=1e-5)
        assert adv[idx].std(unbiased=True).item() == pytest.approx(1.0, abs=1e-5)


@FAST
@given(
    grouped_rewards(),
    st.lists(st.integers(-64, 64).map(lambda k: k / 2.0), min_size=7, max_size=7),
    st.lists(st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0, 8.0]), min_size=7, max_size=7),
)
def test_shift_and_positive_scale_invariance_per_group(data, shifts, scales):
    rewards, gids = data
    # every group g gets its own affine map r -> a_g * r + c_g with a_g > 0
    moved = [scales[g + 3] * r + shifts[g + 3] for r, g in zip(rewards, gids)]
    a = run(rewards, gids)
    b = run(moved, gids)
    torch.testing.assert_close(b, a, rtol=0, atol=3e-4)
    # Dr. GRPO: shift-invariant, positively homogeneous per group
    a0 = run(rewards, gids, scale="none")
    b0 = run(moved, gids, scale="none")
    expected = torch.tensor([scales[g + 3] for g in gids]) * a0
    torch.testing.assert_close(b0, expected, rtol=1e-6, atol=1e-5)


@FAST
@given(grouped_rewards(), st.randoms(use_true_random=False), st.sampled_from(["std", "none", "batch"]))
def test_permutation_equivariant(data, rnd, scale):
    rewards, gids = data
    perm = list(range(len(rewards)))
    rnd.shuffle(perm)
    a = run(rewards, gids, scale=scale)
    b = run([rewards[p] for p in perm], [gids[p] for p in perm], scale=scale)
    torch.testing.assert_close(b, a[perm], rtol=1e-6, atol=1e-6)


@FAST
@given(grouped_rewards(), st.sampled_from(["std", "none", "batch"]))
def test_groups_identified_by_value_not_label(data, scale):
    rewards, gids = data
    relabel = {g: 1000 - 17 * g for g in set(gids)}  # any distinct labels
    a = run(rewards, gids, scale=scale)
    b = run(rewards, [relabel[g] for g in gids], scale=scale)
    assert torch.equal(a, b)


@FAST
@given(
    st.floats(-1e4, 1e4, allow_nan=False, width=32),
    st.integers(1, 9),
    st.sampled_from(["std", "none", "batch"]),
    grouped_rewards(),
)
@example(0.1, 3, "std", ([1.0], [0]))
@example(0.1, 7, "none", ([1.0, 2.0], [1, 1]))
@example(-3.3, 1, "std", ([1.0, 2.0], [0, 0]))
def test_constant_groups_and_singletons_give_exactly_zero(value, size, scale, other):
    # A constant group (any float value, any size) next to arbitrary other groups:
    # its advantages are exactly 0, never NaN, never float noise.
    rewards, gids = other
    rewards = rewards + [value] * size
    gids = gids + [99] * size
    adv = run(rewards, gids, scale=scale)
    assert torch.isfinite(adv).all()
    assert (adv[-size:] == 0).all(), adv[-size:]
    # every singleton group is exactly 0 too
    for idx in groups_of(gids).values():
        if len(idx) == 1:
            assert adv[idx[0]] == 0


def test_all_singletons_exactly_zero():
    adv = run([1.0, -2.0, 3.5, 1e6], [0, 1, 2, 3])
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_output_float32_and_input_untouched():
    r = torch.tensor([1.0, 2.0, 4.0])
    g = torch.tensor([0, 0, 0])
    r0 = r.clone()
    adv = group_advantages(r, g)
    assert adv.dtype == torch.float32
    assert torch.equal(r, r0)
    assert not adv.requires_grad


# ---------------------------------------------------------------- bad input


def test_length_mismatch_names_shapes():
    with pytest.raises(ValueError) as ei:
        group_advantages(torch.zeros(7), torch.zeros(11, dtype=torch.long))
    msg = str(ei.value)
    assert "7" in msg and "11" in msg


def test_float_group_ids_rejected():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(3), torch.zeros(3))


def test_two_dimensional_rewards_rejected():
    with pytest.raises(ValueError) as ei:
        group_advantages(torch.zeros(3, 5), torch.zeros(3, dtype=torch.long))
    assert "5" in str(ei.value)


def test_unknown_scale_rejected():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(3), torch.zeros(3, dtype=torch.long), scale="mad")


# ---------------------------------------------------------------- batch scale, group selection


def test_hand_worked_batch():
    # groups {1, 3} and {2, 2, 8}: group means 2 and 4; batch std of [1, 3, 2, 2, 8] = sqrt(30.8 / 4)
    adv = run([1.0, 3.0, 2.0, 2.0, 8.0], [0, 0, 1, 1, 1], scale="batch", eps=0.0)
    sd = math.sqrt(30.8 / 4)
    torch.testing.assert_close(adv, torch.tensor([-1 / sd, 1 / sd, -2 / sd, -2 / sd, 4 / sd]))


@FAST
@given(grouped_rewards(), st.floats(0.1, 10.0), st.floats(-5.0, 5.0))
def test_batch_scale_is_none_scale_over_one_std(data, scale, shift):
    # batch = none / (one batch-wide std): every group's advantages share one factor
    rewards, gids = data
    none = run(rewards, gids, scale="none").double()
    batch = run(rewards, gids, scale="batch", eps=0.0).double()
    r = torch.tensor(rewards, dtype=torch.float64)
    sd = float(r.std()) if len(rewards) > 1 else 0.0
    if sd > 0:
        torch.testing.assert_close(batch, none / sd, rtol=1e-5, atol=1e-6)
    moved = run([shift + scale * x for x in rewards], gids, scale="batch", eps=0.0).double()
    torch.testing.assert_close(moved, batch, rtol=1e-4, atol=1e-4)


def reference_has_variance(rewards, gids):
    groups = groups_of(gids)
    return [len({rewards[j] for j in groups[g]}) > 1 for g in gids]


@FAST
@given(grouped_rewards(min_n=0))
def test_group_has_variance(data):
    rewards, gids = data
    out = group_has_variance(torch.tensor(rewards, dtype=torch.float32), torch.tensor(gids, dtype=torch.long))
    assert out.dtype == torch.bool and out.tolist() == reference_has_variance(rewards, gids)
    if rewards:
        adv = run(rewards, gids)
        assert (adv[~out] == 0).all()  # what it filters out carries no advantage


@FAST
@given(grouped_rewards(min_n=0), st.lists(st.booleans(), min_size=12, max_size=12))
def test_best_in_group(data, valid_bits):
    rewards, gids = data
    valid = valid_bits[: len(rewards)]
    out = best_in_group(torch.tensor(rewards, dtype=torch.float32), torch.tensor(gids, dtype=torch.long),
                        torch.tensor(valid, dtype=torch.bool))
    expect = []
    for g, idx in groups_of(gids).items():
        ok = [i for i in idx if valid[i]]
        if ok:
            top = max(rewards[i] for i in ok)
            expect.append(min(i for i in ok if rewards[i] == top))
    assert out.dtype == torch.long and out.tolist() == sorted(expect)


def test_group_selection_bad_input():
    with pytest.raises(ValueError, match="valid"):
        best_in_group(torch.zeros(3), torch.zeros(3, dtype=torch.long), torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError):
        group_has_variance(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(3), torch.zeros(3, dtype=torch.long), scale="global")
