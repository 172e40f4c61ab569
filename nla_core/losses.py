"""The GRPO objective: PPO-clipped surrogate, k3 KL to a reference, truncated importance sampling."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from nla_core._checks import (
    require_bool,
    require_choice,
    require_floating,
    require_ndim,
    require_same_shape,
)
from nla_core.kl import kl_k3

TIS_MODES = ("ratio_cap", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", None)
AGGREGATIONS = ("sequence_mean", "token_mean")


class GRPOLossOutput(NamedTuple):
    loss: torch.Tensor
    """Scalar loss, differentiable w.r.t. `logp` only."""
    per_token: torch.Tensor
    """[N, T] float32 per-token loss; 0 where the mask is False."""
    kl: torch.Tensor
    """[N, T] float32 detached k3(logp, ref_logp) (also at kl_beta = 0); 0 where masked or without a reference."""
    ratio: torch.Tensor
    """[N, T] float32 detached policy ratio as used in the surrogate (after a ratio_cap)."""
    tis_weight: torch.Tensor
    """[N, T] float32 detached importance weight w (1 for ratio_cap and tis=None)."""
    clip_frac: torch.Tensor
    """Scalar: fraction of unmasked tokens where the clip is active, i.e. the clipped term is
    the minimum and the token gets no surrogate gradient: r > 1 + clip_eps_high with A > 0,
    or r < 1 - clip_eps with A < 0 (verl's pg_clipfrac, TRL's clip_ratio/region_mean)."""
    outside_clip_frac: torch.Tensor
    """Scalar: fraction of unmasked tokens whose ratio lies outside [1 - clip_eps, 1 + clip_eps_high],
    whatever their advantage (what the reference logs as clip_frac); >= clip_frac."""
    kl_mean: torch.Tensor
    """Scalar: mean k3 over unmasked tokens."""
    tis_frac: torch.Tensor
    """Scalar: fraction of unmasked tokens where truncation/masking changed the weight or ratio."""


def aggregate_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str = "sequence_mean",
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    sequence_mean: sum_i (sum_t m_it l_it / max(1, sum_t m_it)) / D, D = N by default
                   (a sample with no tokens adds 0 but still counts in N: the reference's arithmetic).
    token_mean:    sum_it m_it l_it / D, D = max(1, sum_it m_it) by default.
    Pass the full batch's D when this is one micro-batch (or one rank) of a larger batch,
    so that the parts' losses and gradients add up to the whole batch's.

    Args:
      per_token: [N, T] floating; values at masked positions are ignored even if NaN/inf.
      mask: [N, T] bool.
    Returns: scalar float32 (or float64 for float64 input).
    """
    require_floating("per_token", per_token)
    require_bool("mask", mask)
    require_ndim("per_token", per_token, 2, "[N, T]")
    require_same_shape("mask", mask, "per_token", per_token)
    require_choice("mode", mode, AGGREGATIONS)
    kept = torch.where(mask, per_token, torch.zeros_like(per_token))
    if mode == "sequence_mean":
        per_seq = kept.sum(-1) / mask.sum(-1).clamp_min(1)
        return per_seq.sum() / (per_token.shape[0] if denominator is None else denominator)
    total = kept.sum()
    return total / (mask.sum().clamp_min(1) if denominator is None else denominator)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros_like(x)).sum() / mask.sum().clamp_min(1)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logp: torch.Tensor | None = None,
    behavior_logp: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    kl_beta: float = 0.04,
    kl_clamp: float | None = None,
    tis: str | None = "ratio_cap",
    tis_cap: float = 2.0,
    aggregation: str = "sequence_mean",
    denominator: float | torch.Tensor | None = None,
    max_log_ratio: float = 20.0,
) -> GRPOLossOutput:
    """GRPO loss with PPO clipping, k3 KL and truncated importance sampling.

      r_it  = exp(logp_it - old_logp_it)
      s_it  = min(r_it A_i, clip(r_it, 1 - clip_eps, 1 + clip_eps_high) A_i)
      l_it  = -(w_it s_it - kl_beta k3(logp_it, ref_logp_it))
      loss  = aggregate_loss(l, mask, mode=aggregation, denominator=denominator)

    TIS (engine/trainer mismatch):
      "ratio_cap" (the reference): old_logp are the engine's log-probs; r = min(r, tis_cap); w = 1.
      "token_*" / "sequence_*" (decoupled): old_logp are the trainer's (logp.detach() for a
        single update per batch), behavior_logp the engine's; rho = exp(old - behavior) per
        token, or exp(sum_t over the mask) per sequence; truncate: w = min(rho, tis_cap);
        mask: w = rho * 1[rho <= tis_cap]. w is detached.
      None: w = 1 and no cap.
    With "ratio_cap", tis_cap must be >= 1 + clip_eps_high: a lower cap would bind before the
    PPO clip on positive-advantage tokens. behavior_logp is refused where it would be ignored
    (tis "ratio_cap" or None: there old_logp *are* the engine's log-probs).
    The KL term is dropped when ref_logp is None or kl_beta == 0. Outside ratio_cap the
    log-ratio is clamped at max_log_ratio before exp (a ratio beyond e^20 carries no gradient)
    so that no token can overflow to inf and turn the backward into NaN.

    Args:
      logp: [N, T] trainer log-probs of the sampled tokens (the only input with gradient).
      old_logp: [N, T] log-probs the ratio is taken against (see TIS above).
      advantages: [N] one advantage per sample.
      mask: [N, T] bool, True on generated tokens. Masked positions never reach the loss or
        the gradients, even if they hold NaN or inf.
      ref_logp: [N, T] reference-policy log-probs (adapter off), or None.
      behavior_logp: [N, T] engine log-probs, required by the decoupled TIS modes.
    Returns:
      GRPOLossOutput; every tensor but `loss` is detached.
    """
    for name, x in (("logp", logp), ("old_logp", old_logp), ("advantages", advantages)):
        require_floating(name, x)
    require_bool("mask", mask)
    require_ndim("logp", logp, 2, "[N, T]")
    require_same_shape("old_logp", old_logp, "logp", logp)
    require_same_shape("mask", mask, "logp", logp)
    if advantages.shape != logp.shape[:1]:
        raise ValueError(
            f"advantages must be [N] = [{logp.shape[0]}] (one per row of logp {tuple(logp.shape)}), "
            f"got shape {tuple(advantages.shape)}"
        )
    if ref_logp is not None:
        require_floating("ref_logp", ref_logp)
        require_same_shape("ref_logp", ref_logp, "logp", logp)
    require_choice("tis", tis, TIS_MODES)
    require_choice("aggregation", aggregation, AGGREGATIONS)
    decoupled = tis not in ("ratio_cap", None)
    if decoupled:
        if behavior_logp is None:
            raise ValueError(f"tis={tis!r} needs behavior_logp (the rollout engine's log-probs)")
        require_floating("behavior_logp", behavior_logp)
        require_same_shape("behavior_logp", behavior_logp, "logp", logp)
    elif behavior_logp is not None:
        raise ValueError(
            f"behavior_logp would be ignored with tis={tis!r}: pass the engine's log-probs as old_logp, "
            "or choose a decoupled tis mode (token_/sequence_ truncate or mask)"
        )
    if not clip_eps > 0 or (clip_eps_high is not None and not clip_eps_high > 0):
        raise ValueError(f"clip_eps and clip_eps_high must be > 0, got {clip_eps!r}, {clip_eps_high!r}")
    high = clip_eps if clip_eps_high is None else clip_eps_high
    if tis is not None and not tis_cap > 0:
        raise ValueError(f"tis_cap must be > 0, got {tis_cap!r}")
    if tis == "ratio_cap" and tis_cap < 1.0 + high:
        raise ValueError(
            f"tis_cap = {tis_cap!r} is below 1 + clip_eps_high = {1.0 + high!r}: with tis='ratio_cap' it would "
            "cap positive-advantage ratios inside the PPO clip range; use tis_cap >= 1 + clip_eps_high"
        )

    def masked_f32(x: torch.Tensor) -> torch.Tensor:
        # Zero out padding *before* any exp, so NaN/inf there cannot leak into values or grads.
        return torch.where(mask, x.float(), torch.zeros((), dtype=torch.float32, device=x.device))

    lp = masked_f32(logp)
    old = masked_f32(old_logp).detach()
    log_ratio = lp - old
    capped = torch.zeros_like(mask)
    weight = torch.ones_like(lp)
    # The log-ratio is bounded *before* exp: an overflowing ratio would make 0 * inf = NaN
    # in the backward even where the clip zeroes the gradient.
    if tis == "ratio_cap":
        capped = log_ratio.detach() > math.log(tis_cap)
        ratio = torch.exp(log_ratio.clamp(max=math.log(tis_cap)))
    else:
        ratio = torch.exp(log_ratio.clamp(max=max_log_ratio))
    if decoupled:
        log_rho = old - masked_f32(behavior_logp).detach()
        if tis.startswith("sequence"):
            log_rho = log_rho.sum(-1, keepdim=True).expand_as(lp)
        over = log_rho > math.log(tis_cap)
        capped = over
        if tis.endswith("truncate"):
            weight = torch.exp(log_rho.clamp(max=math.log(tis_cap)))
        else:
            weight = torch.where(over, torch.zeros_like(log_rho), torch.exp(log_rho.clamp(max=math.log(tis_cap))))

    adv = advantages.float().detach()[:, None]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1.0 - clip_eps, 1.0 + high) * adv)
    per_token = -(weight * surrogate)
    kl = torch.zeros_like(lp)
    if ref_logp is not None:
        # Measured whenever a reference is given (KL is worth watching at kl_beta = 0 too).
        kl = kl_k3(lp, masked_f32(ref_logp).detach(), clamp=kl_clamp)
        if kl_beta != 0:
            per_token = per_token + kl_beta * kl
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    loss = aggregate_loss(per_token, mask, mode=aggregation, denominator=denominator)

    ratio_d = ratio.detach()
    outside = (ratio_d < 1.0 - clip_eps) | (ratio_d > 1.0 + high)
    # The clip binds where the clipped term is the minimum: above the range for A > 0, below it for A < 0.
    active = ((ratio_d > 1.0 + high) & (adv > 0)) | ((ratio_d < 1.0 - clip_eps) & (adv < 0))
    return GRPOLossOutput(
        loss=loss,
        per_token=per_token.detach(),
        kl=torch.where(mask, kl, torch.zeros_like(kl)).detach(),
        ratio=torch.where(mask, ratio_d, torch.zeros_like(ratio_d)),
        tis_weight=torch.where(mask, weight, torch.zeros_like(weight)).detach(),
        clip_frac=_masked_mean(active.float(), mask),
        outside_clip_frac=_masked_mean(outside.float(), mask),
        kl_mean=_masked_mean(kl.detach(), mask),
        tis_frac=_masked_mean(capped.float(), mask),
    )
