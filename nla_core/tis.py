"""Truncated importance sampling between the rollout engine and the trainer: a capped policy ratio
(the reference's ratio_cap) and the decoupled per-token or per-sequence importance weights."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from nla_core._checks import require_bool, require_floating, require_ndim, require_same_shape


class CappedRatio(NamedTuple):
    ratio: torch.Tensor
    """[N, T] r = exp(min(log_ratio, log C)); carries log_ratio's gradient below the cap."""
    capped: torch.Tensor
    """[N, T] bool, detached: log_ratio > log C."""


class ISWeights(NamedTuple):
    weight: torch.Tensor
    """[N, T] detached importance weight w; 0 where mask is False."""
    capped: torch.Tensor
    """[N, T] bool: rho > C (the weight was truncated or masked); False where mask is False."""


def _check_cap(cap: float) -> float:
    if not cap > 0:
        raise ValueError(f"tis_cap must be > 0, got {cap!r}")
    return math.log(cap)


def capped_ratio(log_ratio: torch.Tensor, *, cap: float) -> CappedRatio:
    """The reference's TIS: the policy ratio against the engine's log-probs, capped at C.

      r_it = exp(min(log_ratio_it, log C)),   log_ratio = logp - old_logp (old_logp: the engine's)

    Bounded in log space before exp, so no token overflows to inf (0 * inf would be NaN in the backward).

    Args: log_ratio: [...] floating (with gradient); cap: C > 0 (with a PPO clip: C >= 1 + clip_eps_high).
    Returns: CappedRatio of [...] tensors.
    """
    require_floating("log_ratio", log_ratio)
    log_cap = _check_cap(cap)
    return CappedRatio(torch.exp(log_ratio.clamp(max=log_cap)), log_ratio.detach() > log_cap)


def tis_weights(
    log_rho: torch.Tensor, mask: torch.Tensor, *, cap: float, truncate: bool = True, per_sequence: bool = False
) -> ISWeights:
    """Decoupled truncated importance weights on the engine/trainer ratio rho (detached).

      log rho_it = old_logp_it - behavior_logp_it       (per token: trainer over engine)
                 = sum_t m_it log rho_it on each token of row i   (per_sequence)
      w_it       = min(rho_it, C)                        (truncate; verl's/TRL's TIS)
                 = rho_it 1[rho_it <= C]                 (truncate=False: masked IS, MIS)

    Args:
      log_rho: [N, T] floating, old_logp - behavior_logp; ignored (even NaN) where mask is False.
      mask: [N, T] bool.
      cap: C > 0.
    Returns:
      ISWeights: weight [N, T] and capped [N, T] bool, both 0/False where mask is False.
    """
    require_floating("log_rho", log_rho)
    require_bool("mask", mask)
    require_ndim("log_rho", log_rho, 2, "[N, T]")
    require_same_shape("mask", mask, "log_rho", log_rho)
    log_cap = _check_cap(cap)
    lr = torch.where(mask, log_rho.detach(), torch.zeros((), dtype=log_rho.dtype, device=log_rho.device))
    if per_sequence:
        lr = lr.sum(-1, keepdim=True).expand_as(lr)
    over = lr > log_cap
    weight = torch.exp(lr.clamp(max=log_cap))
    if not truncate:
        weight = torch.where(over, torch.zeros_like(weight), weight)
    return ISWeights(torch.where(mask, weight, torch.zeros_like(weight)), mask & over)


__all__ = ["CappedRatio", "ISWeights", "capped_ratio", "tis_weights"]
