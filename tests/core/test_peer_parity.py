"""Peer parity: nla_core's losses, aggregations, advantages and masks against TRL's and verl's own code.

The peers' functions are extracted verbatim into tests/third_party/trl_losses.py (huggingface/trl at
f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/trainer/grpo_trainer.py and trl/trainer/utils.py) and
tests/third_party/verl_losses.py (volcengine/verl at b178a3cd56f58b2d502255daba591e92833930a7,
verl/trainer/ppo/core_algos.py, verl/utils/torch_functional.py, verl/trainer/ppo/rollout_corr_helper.py);
each file's header names the functions and lines. Every mode below is meant to match its peer in
value and gradient; where the peers' conventions differ from nla's (verl's seq-mean-token-sum-norm
has no 1/N; TRL's eps is 1e-4), the test says which keyword maps one onto the other.
Inputs keep every ratio inside (e^-0.7, e^0.7), so verl's dual clip (ratio > 3, A < 0) and its
log-ratio clamps (10, 20) never bind; every row has a token, so verl's exclusion of empty rows
from the sequence mean does not apply.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from third_party import trl_losses, verl_losses
from nla_core import (
    aggregate_loss, group_advantages, policy_loss, ratio_band_mask, token_entropy, top_entropy_mask,
)
from test_losses import batches, boundaries_ok

PARITY = settings(max_examples=40, deadline=None)


def nonempty(b):
    b = dict(b)
    mask = b["mask"].clone()
    mask[:, 0] = True
    b["mask"] = mask
    return b


def ours(b, *, kind, aggregation="sequence_mean", kl_beta=0.0, clip_eps=0.2, clip_eps_high=None, keep=None, **kw):
    x = b["logp"].clone().requires_grad_(True)
    out = policy_loss(x, b["old"], b["adv"], b["mask"], kind=kind, tis=None, ref_logp=b["ref"], kl_beta=kl_beta,
                      clip_eps=clip_eps, clip_eps_high=clip_eps_high, aggregation=aggregation, keep=keep, **kw)
    out.loss.backward()
    return out, x.grad


def assert_same(loss_a, grad_a, loss_b, grad_b, rtol=1e-5, atol=1e-6):
    assert float(loss_a.detach()) == pytest.approx(float(loss_b.detach()), rel=rtol, abs=atol)
    torch.testing.assert_close(grad_a.double(), grad_b.double(), rtol=rtol, atol=atol)


# ---------------------------------------------------------------- TRL


def trl_loss(b, *, entropies=None, **trainer_kw):
    trainer = trl_losses.StandInTrainer(**trainer_kw)
    x = b["logp"].clone().requires_grad_(True)
    mask = b["mask"].float()
    inputs = {
        "advantages": b["adv"].clone(),
        "old_per_token_logps": b["old"].clone(),
        "ref_per_token_logps": b["ref"].clone(),
        "num_items_in_batch": mask.sum(),
    }
    if entropies is None:
        entropies = torch.zeros_like(x)
    loss = trainer.compute_loss_from_logps(x, entropies, mask, inputs)
    loss.backward()
    return loss, x.grad


TRL_MODES = [
    # (TRL trainer keywords, nla policy_loss keywords)
    (dict(loss_type="grpo"), dict(kind="grpo", aggregation="sequence_mean")),
    (dict(loss_type="grpo", importance_sampling_level="sequence"), dict(kind="gspo", aggregation="sequence_mean")),
    (dict(loss_type="bnpo"), dict(kind="grpo", aggregation="token_mean")),
    (dict(loss_type="dapo", epsilon_high=0.28), dict(kind="grpo", aggregation="token_mean", clip_eps_high=0.28)),
    (dict(loss_type="dr_grpo", max_completion_length=9), dict(kind="grpo", aggregation="seq_mean_token_sum_norm",
                                                              max_len=9)),
    # TRL's CISPO caps the IS weight at epsilon_high (5: ScaleRL's eps_max) with no lower bound
    (dict(loss_type="cispo", epsilon_high=5.0), dict(kind="cispo", aggregation="token_mean", clip_eps=1.0,
                                                     clip_eps_high=4.0)),
    (dict(loss_type="cispo", epsilon_high=1.3), dict(kind="cispo", aggregation="token_mean", clip_eps=1.0,
                                                     clip_eps_high=0.3)),
]


@PARITY
@given(batches(), st.sampled_from(range(len(TRL_MODES))), st.sampled_from([0.0, 0.04]))
def test_trl_loss_types(b, mode, beta):
    b = nonempty(b)
    trl_kw, nla_kw = TRL_MODES[mode]
    assume(boundaries_ok(b, clip_eps_high=nla_kw.get("clip_eps_high"), tis=None))
    if nla_kw["kind"] == "gspo":  # GSPO clips the sequence ratio: keep it off the clip edges
        seq = ((b["logp"] - b["old"]) * b["mask"]).sum(-1) / b["mask"].sum(-1)
        assume(((seq - np.log(0.8)).abs().min() > 1e-3) and ((seq - np.log(1.2)).abs().min() > 1e-3))
    if nla_kw["kind"] == "cispo":
        hi = np.log(1 + nla_kw["clip_eps_high"])
        assume(((b["logp"] - b["old"])[b["mask"]] - hi).abs().min() > 1e-3)
    loss_t, grad_t = trl_loss(b, beta=beta, **trl_kw)
    out, grad = ours(b, kl_beta=beta, **nla_kw)
    assert_same(out.loss, grad, loss_t, grad_t)


@PARITY
@given(batches(), st.sampled_from([0.2, 0.5, 0.8]), st.integers(0, 2**31 - 1))
def test_trl_top_entropy_quantile(b, q, seed):
    b = nonempty(b)
    assume(boundaries_ok(b, tis=None))
    ent = 3 * torch.rand(b["mask"].shape, generator=torch.Generator().manual_seed(seed))
    trainer = trl_losses.StandInTrainer(loss_type="grpo", top_entropy_quantile=q)
    theirs = trainer.get_high_entropy_mask(ent, b["mask"].float(), 1 - q)
    mine = top_entropy_mask(ent, b["mask"], quantile=q)
    assert torch.equal(mine, theirs)
    loss_t, grad_t = trl_loss(b, entropies=ent, loss_type="grpo", top_entropy_quantile=q)
    out, grad = ours(b, kind="grpo", keep=mine)
    assert_same(out.loss, grad, loss_t, grad_t)


@PARITY
@given(st.integers(1, 4), st.integers(1, 5), st.integers(2, 50), st.integers(0, 2**31 - 1))
def test_trl_and_verl_entropy(n, t, v, seed):
    logits = 4 * torch.randn(n, t, v, generator=torch.Generator().manual_seed(seed))
    mine = token_entropy(logits, chunk_size=3)
    torch.testing.assert_close(mine, trl_losses.entropy_from_logits(logits), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mine, verl_losses.entropy_from_logits(logits), rtol=1e-5, atol=1e-5)


# Quarter-integer rewards: group sums and means are exact in float32, so a constant group's
# centred rewards are exactly 0 for the peers too.
quarter = st.integers(-20, 20).map(lambda k: k / 4.0)


@PARITY
@given(st.integers(1, 5), st.sampled_from([2, 4]), st.data(), st.sampled_from(["group", "batch", "none"]))
def test_trl_advantages(n_groups, g, data, scale_rewards):
    rewards = torch.tensor(data.draw(st.lists(quarter, min_size=n_groups * g, max_size=n_groups * g)))
    trainer = trl_losses.StandInTrainer(scale_rewards=scale_rewards, num_generations=g)
    theirs = trainer.advantages_from_rewards(rewards[:, None], torch.ones(1), g)
    ids = torch.arange(n_groups).repeat_interleave(g)
    mine = group_advantages(rewards, ids, scale={"group": "std", "batch": "batch", "none": "none"}[scale_rewards],
                            eps=1e-4)
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- verl


def verl_loss(fn, b, *, loss_agg_mode, **config_kw):
    x = b["logp"].clone().requires_grad_(True)
    adv = b["adv"][:, None].expand_as(x)
    loss, metrics = fn(b["old"], x, adv, b["mask"].float(), loss_agg_mode=loss_agg_mode,
                       config=verl_losses.ActorConfig(**config_kw))
    loss.backward()
    return loss, x.grad, metrics


VERL_MODES = [
    # (verl loss, verl keywords, nla keywords)
    ("vanilla", dict(loss_agg_mode="seq-mean-token-mean"), dict(kind="grpo", aggregation="sequence_mean")),
    ("vanilla", dict(loss_agg_mode="token-mean", clip_ratio_high=0.28),
     dict(kind="grpo", aggregation="token_mean", clip_eps_high=0.28)),
    ("gspo", dict(loss_agg_mode="seq-mean-token-mean"), dict(kind="gspo", aggregation="sequence_mean")),
    ("cispo", dict(loss_agg_mode="token-mean"), dict(kind="cispo", aggregation="token_mean")),
    ("cispo", dict(loss_agg_mode="seq-mean-token-mean", clip_ratio_high=0.5),
     dict(kind="cispo", aggregation="sequence_mean", clip_eps_high=0.5)),
]
VERL_FNS = {"vanilla": verl_losses.compute_policy_loss_vanilla, "gspo": verl_losses.compute_policy_loss_gspo,
            "cispo": verl_losses.compute_policy_loss_cispo}


@PARITY
@given(batches(), st.sampled_from(range(len(VERL_MODES))))
def test_verl_policy_losses(b, mode):
    b = nonempty(b)
    name, verl_kw, nla_kw = VERL_MODES[mode]
    assume(boundaries_ok(b, clip_eps_high=nla_kw.get("clip_eps_high"), tis=None))
    if name == "gspo":
        seq = ((b["logp"] - b["old"]) * b["mask"]).sum(-1) / b["mask"].sum(-1)
        assume(((seq - np.log(0.8)).abs().min() > 1e-3) and ((seq - np.log(1.2)).abs().min() > 1e-3))
    loss_v, grad_v, metrics = verl_loss(VERL_FNS[name], b, **verl_kw)
    out, grad = ours(b, **nla_kw)
    assert_same(out.loss, grad, loss_v, grad_v)
    if name != "gspo":  # verl's GSPO clip fraction compares per-token terms: nla's counts the same tokens
        assert float(out.clip_frac) == pytest.approx(metrics["actor/pg_clipfrac"], abs=1e-6)


@PARITY
@given(batches(), st.integers(1, 12))
def test_verl_seq_mean_token_sum_norm(b, extra):
    # verl's mode is sum / L with no 1/N: nla's with denominator = 1
    m = b["mask"]
    per = b["logp"]
    L = m.shape[1] + extra
    theirs = verl_losses.agg_loss(per, m.float(), "seq-mean-token-sum-norm", loss_scale_factor=L)
    mine = aggregate_loss(per, m, mode="seq_mean_token_sum_norm", max_len=L, denominator=1)
    assert mine.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-6)
    assert aggregate_loss(per, m, mode="seq_mean_token_sum_norm", max_len=L).item() == pytest.approx(
        theirs.item() / m.shape[0], rel=1e-6, abs=1e-6)


@PARITY
@given(st.integers(1, 5), st.sampled_from([2, 4]), st.data(), st.booleans())
def test_verl_grpo_advantage(n_groups, g, data, by_std):
    n = n_groups * g
    rewards = torch.tensor(data.draw(st.lists(quarter, min_size=n, max_size=n)))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 999))))
    ids = torch.arange(n_groups).repeat_interleave(g)[order]
    token_rewards = torch.zeros(n, 3)
    token_rewards[:, -1] = rewards
    theirs, _ = verl_losses.compute_grpo_outcome_advantage(
        token_rewards, torch.ones(n, 3), np.array(ids.tolist()), norm_adv_by_std_in_grpo=by_std)
    mine = group_advantages(rewards, ids, scale="std" if by_std else "none")
    torch.testing.assert_close(mine, theirs[:, 0], rtol=1e-5, atol=1e-5)


@PARITY
@given(st.integers(1, 5), st.integers(1, 6), st.sampled_from([(0.5, 2.0), (0.2, 5.0), (0.9, 1.1)]),
       st.integers(0, 2**31 - 1))
def test_verl_token_k1_rejection_is_the_ratio_band(n, t, band, seed):
    g = torch.Generator().manual_seed(seed)
    trainer_minus_engine = torch.randn(n, t, generator=g)
    mask = torch.rand(n, t, generator=g) > 0.3
    mask[0, 0] = True  # verl's metrics need one valid token
    for edge in band:
        assume((trainer_minus_engine - np.log(edge)).abs().min() > 1e-4)
    low, high = band
    # verl keeps a <= pi_engine / pi_trainer <= b ("a_b"): the band on pi_trainer / pi_engine is [1/b, 1/a]
    theirs, _ = verl_losses.compute_rollout_rejection_mask(
        trainer_minus_engine, mask.float(), rollout_rs="token_k1", rollout_rs_threshold=f"{1 / high}_{1 / low}")
    mine = ratio_band_mask(trainer_minus_engine, mask, low=low, high=high)
    assert torch.equal(mine, theirs.bool())
