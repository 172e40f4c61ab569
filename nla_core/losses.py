"""Policy-gradient losses: GRPO (PPO clip), GSPO, CISPO and the on-policy A log p surrogate, with a
k3 KL to a reference, truncated importance sampling, token masks and four aggregations."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from nla_core._checks import (
    require_bool,
    require_choice,
    require_floating,
    require_integer,
    require_ndim,
    require_same_shape,
    require_tensor,
)
from nla_core.kl import kl_k3
from nla_core.ratios import _check_ratio_band, gspo_token_log_ratio, ratio_band_mask

TIS_MODES = ("ratio_cap", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", None)
AGGREGATIONS = ("sequence_mean", "token_mean", "seq_mean_token_sum_norm", "prompt_mean")
POLICY_LOSSES = ("grpo", "gspo", "cispo", "onpolicy")


class PolicyLossOutput(NamedTuple):
    loss: torch.Tensor
    """Scalar loss, differentiable w.r.t. `logp` only."""
    per_token: torch.Tensor
    """[N, T] float32 per-token loss; 0 where the mask is False."""
    kl: torch.Tensor
    """[N, T] float32 detached k3(logp, ref_logp) (also at kl_beta = 0); 0 where masked or without a reference."""
    ratio: torch.Tensor
    """[N, T] float32 detached policy ratio as used in the surrogate (after a ratio_cap; GSPO: the
    sequence ratio s_i on each of its tokens)."""
    tis_weight: torch.Tensor
    """[N, T] float32 detached importance weight w (1 for ratio_cap and tis=None), after the token masks."""
    clip_frac: torch.Tensor
    """Scalar: fraction of unmasked tokens where the clip is active. grpo/gspo: the clipped term is
    the minimum and the token gets no surrogate gradient: r > 1 + clip_eps_high with A > 0,
    or r < 1 - clip_eps with A < 0 (verl's pg_clipfrac, TRL's clip_ratio/region_mean).
    cispo: the IS weight was clipped (verl's pg_clipfrac for CISPO). onpolicy: 0."""
    outside_clip_frac: torch.Tensor
    """Scalar: fraction of unmasked tokens whose ratio lies outside [1 - clip_eps, 1 + clip_eps_high],
    whatever their advantage (what the reference logs as clip_frac); >= clip_frac."""
    kl_mean: torch.Tensor
    """Scalar: mean k3 over unmasked tokens."""
    tis_frac: torch.Tensor
    """Scalar: fraction of unmasked tokens where truncation/masking changed the weight or ratio."""
    token_mask_frac: torch.Tensor
    """Scalar: fraction of unmasked tokens whose surrogate the token masks dropped (the ratio band
    `token_mask`, the caller's `keep`); 0 without them."""


GRPOLossOutput = PolicyLossOutput
"""The output of `grpo_loss`: the same NamedTuple as `policy_loss`'s."""


def aggregate_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str = "sequence_mean",
    denominator: float | torch.Tensor | None = None,
    max_len: int | None = None,
    group_ids: torch.Tensor | None = None,
    group_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    sequence_mean: sum_i (sum_t m_it l_it / max(1, sum_t m_it)) / D, D = N by default
                   (a sample with no tokens adds 0 but still counts in N: the reference's arithmetic).
    token_mean:    sum_it m_it l_it / D, D = max(1, sum_it m_it) by default (TRL's bnpo/dapo, verl's token-mean).
    seq_mean_token_sum_norm: sum_it m_it l_it / (D * L), L = max_len (Dr. GRPO's constant: the longest
                   allowed response), D = N by default (TRL's dr_grpo; verl's seq-mean-token-sum-norm
                   with loss_scale_factor = L is D = 1).
    prompt_mean:   sum_i (sum_t m_it l_it) / T_g(i) / D, T_g the tokens of all samples of i's group,
                   D = the number of groups by default (ScaleRL's prompt-level average: each prompt
                   weighs the same, its tokens equally).
    Pass the full batch's D when this is one micro-batch (or one rank) of a larger batch,
    so that the parts' losses and gradients add up to the whole batch's (for prompt_mean also
    group_tokens, when a group spans parts).

    Args:
      per_token: [N, T] floating; values at masked positions are ignored even if NaN/inf.
      mask: [N, T] bool.
      max_len: seq_mean_token_sum_norm only: L >= 1.
      group_ids: prompt_mean only: [N] integer, equal ids form a group.
      group_tokens: prompt_mean only, optional: [N] each sample's T_g (default: counted from mask).
    Returns: scalar float32 (or float64 for float64 input).
    """
    require_floating("per_token", per_token)
    require_bool("mask", mask)
    require_ndim("per_token", per_token, 2, "[N, T]")
    require_same_shape("mask", mask, "per_token", per_token)
    _check_aggregation(per_token.shape[0], mode, max_len=max_len, group_ids=group_ids, group_tokens=group_tokens)
    kept = torch.where(mask, per_token, torch.zeros_like(per_token))
    if mode == "sequence_mean":
        per_seq = kept.sum(-1) / mask.sum(-1).clamp_min(1)
        return per_seq.sum() / (per_token.shape[0] if denominator is None else denominator)
    if mode == "token_mean":
        total = kept.sum()
        return total / (mask.sum().clamp_min(1) if denominator is None else denominator)
    if mode == "seq_mean_token_sum_norm":
        return kept.sum() / ((per_token.shape[0] if denominator is None else denominator) * max_len)
    ids, group = torch.unique(group_ids, return_inverse=True)
    n_groups = ids.numel()
    if group_tokens is None:
        counts = torch.zeros(n_groups, dtype=per_token.dtype, device=per_token.device)
        group_tokens = counts.index_add(0, group, mask.sum(-1).to(per_token.dtype))[group]
    per_seq = kept.sum(-1) / group_tokens.to(per_token.dtype).clamp_min(1)
    return per_seq.sum() / (n_groups if denominator is None else denominator)


def _check_aggregation(
    n: int, mode: str, *, max_len: int | None, group_ids: torch.Tensor | None, group_tokens: torch.Tensor | None
) -> None:
    """`aggregate_loss`'s mode and its extra arguments, for N samples."""
    require_choice("mode", mode, AGGREGATIONS)
    if (max_len is not None) != (mode == "seq_mean_token_sum_norm"):
        raise ValueError(f"max_len is needed by mode='seq_mean_token_sum_norm' and only by it; mode={mode!r}, "
                         f"max_len={max_len!r}")
    if mode == "seq_mean_token_sum_norm" and not (isinstance(max_len, int) and max_len >= 1):
        raise ValueError(f"max_len must be an integer >= 1 (the longest allowed response), got {max_len!r}")
    if mode != "prompt_mean":
        if group_ids is not None or group_tokens is not None:
            raise ValueError(f"group_ids / group_tokens are for mode='prompt_mean' only, not {mode!r}")
        return
    if group_ids is None:
        raise ValueError("mode='prompt_mean' needs group_ids ([N] integer, one group per prompt)")
    require_integer("group_ids", group_ids)
    if group_ids.shape != (n,):
        raise ValueError(f"group_ids must be [N] = [{n}], got shape {tuple(group_ids.shape)}")
    if group_tokens is not None:
        require_tensor("group_tokens", group_tokens)
        if group_tokens.shape != (n,):
            raise ValueError(f"group_tokens must be [N] = [{n}], got shape {tuple(group_tokens.shape)}")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros_like(x)).sum() / mask.sum().clamp_min(1)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    kind: str = "grpo",
    ref_logp: torch.Tensor | None = None,
    behavior_logp: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    kl_beta: float = 0.04,
    kl_clamp: float | None = None,
    tis: str | None = "ratio_cap",
    tis_cap: float = 2.0,
    token_mask: tuple[float, float] | None = None,
    keep: torch.Tensor | None = None,
    aggregation: str = "sequence_mean",
    denominator: float | torch.Tensor | None = None,
    max_len: int | None = None,
    group_ids: torch.Tensor | None = None,
    group_tokens: torch.Tensor | None = None,
    max_log_ratio: float = 20.0,
) -> PolicyLossOutput:
    """A policy-gradient loss over sampled tokens, with k3 KL and truncated importance sampling.

      r_it  = exp(logp_it - old_logp_it)                      (grpo, cispo, onpolicy)
            = exp(logp_it - sg[logp_it] + sg[log s_i])        (gspo; log s_i = mean_t (logp_it - old_logp_it))
      s_it  = min(r_it A_i, clip(r_it, 1 - clip_eps, 1 + clip_eps_high) A_i)    grpo (PPO clip), gspo (GSPO)
            = sg[clip(r_it, 1 - clip_eps, 1 + clip_eps_high)] A_i logp_it       cispo (MiniMax-M1's CISPO)
            = A_i logp_it                                                       onpolicy (EasyNLA; no ratio)
      l_it  = -(w_it k_it s_it - kl_beta k3(logp_it, ref_logp_it))
      loss  = aggregate_loss(l, mask, mode=aggregation, ...)

    k_it = 1[keep_it] 1[token_mask[0] <= rho_it <= token_mask[1]] drops a token's surrogate (its
    KL term stays; the aggregation's counts do not change), rho_it the engine/trainer ratio:
    exp(old - behavior) in the decoupled TIS modes, exp(sg[logp] - old) otherwise (there old_logp
    are the engine's). token_mask = (0.5, 2) is IcePop's band (verl / prime-rl: masked IS).
    `keep` is any caller's token mask, e.g. `top_entropy_mask`.

    TIS (engine/trainer mismatch):
      "ratio_cap" (the reference): old_logp are the engine's log-probs; r = min(r, tis_cap); w = 1
        (gspo caps s_i; onpolicy, which has no ratio, refuses it).
      "token_*" / "sequence_*" (decoupled): old_logp are the trainer's (logp.detach() for a
        single update per batch), behavior_logp the engine's; rho = exp(old - behavior) per
        token, or exp(sum_t over the mask) per sequence; truncate: w = min(rho, tis_cap);
        mask: w = rho * 1[rho <= tis_cap]. w is detached.
      None: w = 1 and no cap.
    With "ratio_cap", tis_cap must be >= 1 + clip_eps_high: a lower cap would bind before the
    PPO clip on positive-advantage tokens. behavior_logp is refused where it would be ignored
    (tis "ratio_cap" or None: there old_logp *are* the engine's log-probs).
    The KL term is dropped when ref_logp is None or kl_beta == 0; kl_clamp bounds the log-ratio
    inside k3 (EasyNLA: onpolicy with kl_clamp = 12). Outside ratio_cap the log-ratio is clamped
    at max_log_ratio before exp (a ratio beyond e^20 carries no gradient) so that no token can
    overflow to inf and turn the backward into NaN. cispo takes any clip_eps > 0 (>= 1: no
    lower clip; TRL's epsilon_high = 5 is clip_eps_high = 4).

    Args (N = B prompts x G samples each, T response tokens):
      logp: [N, T] trainer log-probs of the sampled tokens (the only input with gradient).
      old_logp: [N, T] log-probs the ratio is taken against (see TIS above).
      advantages: [N] one advantage per sample.
      mask: [N, T] bool, True on generated tokens. Masked positions never reach the loss or
        the gradients, even if they hold NaN or inf.
      kind: "grpo", "gspo", "cispo" or "onpolicy" (POLICY_LOSSES).
      ref_logp: [N, T] reference-policy log-probs (adapter off), or None.
      behavior_logp: [N, T] engine log-probs, required by the decoupled TIS modes.
      token_mask: (low, high) with 0 < low <= 1 <= high, or None.
      keep: [N, T] bool, or None.
      aggregation, denominator, max_len, group_ids, group_tokens: see `aggregate_loss`.
    Returns:
      PolicyLossOutput; every tensor but `loss` is detached.
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
    if keep is not None:
        require_bool("keep", keep)
        require_same_shape("keep", keep, "logp", logp)
    require_choice("kind", kind, POLICY_LOSSES)
    require_choice("tis", tis, TIS_MODES)
    require_choice("aggregation", aggregation, AGGREGATIONS)
    _check_aggregation(logp.shape[0], aggregation, max_len=max_len, group_ids=group_ids, group_tokens=group_tokens)
    if kind == "onpolicy" and tis == "ratio_cap":
        raise ValueError("kind='onpolicy' has no ratio for tis='ratio_cap' to cap: use tis=None (EasyNLA) "
                         "or a decoupled mode (token_/sequence_ truncate or mask) with behavior_logp")
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
    if token_mask is not None:
        _check_ratio_band(*token_mask)

    def masked_f32(x: torch.Tensor) -> torch.Tensor:
        # Zero out padding *before* any exp, so NaN/inf there cannot leak into values or grads.
        return torch.where(mask, x.float(), torch.zeros((), dtype=torch.float32, device=x.device))

    lp = masked_f32(logp)
    old = masked_f32(old_logp).detach()
    log_ratio = gspo_token_log_ratio(lp, old, mask) if kind == "gspo" else lp - old
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

    dropped = torch.zeros_like(mask)
    if token_mask is not None or keep is not None:
        kept = mask if keep is None else mask & keep
        if token_mask is not None:
            # The engine/trainer ratio: decoupled, old_logp are the trainer's; else old_logp are the engine's.
            engine_log_ratio = old - masked_f32(behavior_logp).detach() if decoupled else lp.detach() - old
            kept = kept & ratio_band_mask(engine_log_ratio, mask, low=token_mask[0], high=token_mask[1])
        dropped = mask & ~kept
        weight = torch.where(kept, weight, torch.zeros_like(weight))

    adv = advantages.float().detach()[:, None]
    lo_clip = 1.0 - clip_eps
    if kind in ("grpo", "gspo"):
        surrogate = torch.minimum(ratio * adv, ratio.clamp(lo_clip, 1.0 + high) * adv)
    elif kind == "cispo":
        surrogate = ratio.detach().clamp(max(lo_clip, 0.0), 1.0 + high) * adv * lp
    else:
        surrogate = adv * lp
    per_token = -(weight * surrogate)
    kl = torch.zeros_like(lp)
    if ref_logp is not None:
        # Measured whenever a reference is given (KL is worth watching at kl_beta = 0 too).
        kl = kl_k3(lp, masked_f32(ref_logp).detach(), clamp=kl_clamp)
        if kl_beta != 0:
            per_token = per_token + kl_beta * kl
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    loss = aggregate_loss(per_token, mask, mode=aggregation, denominator=denominator, max_len=max_len,
                          group_ids=group_ids, group_tokens=group_tokens)

    ratio_d = ratio.detach()
    outside = (ratio_d < lo_clip) | (ratio_d > 1.0 + high)
    if kind in ("grpo", "gspo"):
        # The clip binds where the clipped term is the minimum: above the range for A > 0, below it for A < 0.
        active = ((ratio_d > 1.0 + high) & (adv > 0)) | ((ratio_d < lo_clip) & (adv < 0))
    elif kind == "cispo":
        active = outside
    else:
        active = torch.zeros_like(mask)
    return PolicyLossOutput(
        loss=loss,
        per_token=per_token.detach(),
        kl=torch.where(mask, kl, torch.zeros_like(kl)).detach(),
        ratio=torch.where(mask, ratio_d, torch.zeros_like(ratio_d)),
        tis_weight=torch.where(mask, weight, torch.zeros_like(weight)).detach(),
        clip_frac=_masked_mean(active.float(), mask),
        outside_clip_frac=_masked_mean(outside.float(), mask),
        kl_mean=_masked_mean(kl.detach(), mask),
        tis_frac=_masked_mean(capped.float(), mask),
        token_mask_frac=_masked_mean(dropped.float(), mask),
    )


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    **options: Any,
) -> PolicyLossOutput:
    """GRPO loss with PPO clipping, k3 KL and truncated importance sampling: `policy_loss(kind="grpo")`.

      r_it  = exp(logp_it - old_logp_it)
      s_it  = min(r_it A_i, clip(r_it, 1 - clip_eps, 1 + clip_eps_high) A_i)
      l_it  = -(w_it s_it - kl_beta k3(logp_it, ref_logp_it))
      loss  = aggregate_loss(l, mask, mode=aggregation, denominator=denominator)

    TIS modes, shapes and every keyword option (ref_logp, behavior_logp, clip_eps, clip_eps_high,
    kl_beta, kl_clamp, tis, tis_cap, aggregation, denominator, max_log_ratio, ...) with their
    defaults as in `policy_loss`.

    Args:
      logp: [N, T] (the only input with gradient); old_logp: [N, T]; advantages: [N]; mask: [N, T] bool.
    Returns:
      PolicyLossOutput (GRPOLossOutput); every tensor but `loss` is detached.
    """
    if "kind" in options:
        raise ValueError(f"grpo_loss is policy_loss(kind='grpo'); call policy_loss for kind={options['kind']!r}")
    return policy_loss(logp, old_logp, advantages, mask, kind="grpo", **options)


__all__ = [
    "AGGREGATIONS", "GRPOLossOutput", "POLICY_LOSSES", "PolicyLossOutput", "TIS_MODES",
    "aggregate_loss", "grpo_loss", "policy_loss",
]
