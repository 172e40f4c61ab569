"""Importance ratios between policies: GSPO's sequence-level ratio and the two-sided ratio mask (IcePop / MIS)."""

from __future__ import annotations

import math

import torch

from nla_core._checks import require_bool, require_floating, require_ndim, require_same_shape


def _masked_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    require_floating("log_ratio", log_ratio)
    require_bool("mask", mask)
    require_ndim("log_ratio", log_ratio, 2, "[N, T]")
    require_same_shape("mask", mask, "log_ratio", log_ratio)
    # Padding is zeroed first, so NaN/inf there never reaches a sum.
    return torch.where(mask, log_ratio, torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device))


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's length-normalised sequence log-ratio (Zheng et al. 2025, arXiv:2507.18071).

      log s_i = (1 / |y_i|) sum_t m_it (logp_it - old_logp_it),   |y_i| = max(1, sum_t m_it)

    so s_i = (pi(y_i) / pi_old(y_i))^(1 / |y_i|), the geometric mean of the token ratios.
    Differentiable through `log_ratio` (the GSPO-token ratio `gspo_token_log_ratio` detaches it).

    Args:
      log_ratio: [N, T] floating, logp - old_logp per token; ignored (even NaN) where mask is False.
      mask: [N, T] bool, True on response tokens.
    Returns:
      [N], log_ratio's dtype (0 for a row with no tokens).
    """
    kept = _masked_log_ratio(log_ratio, mask)
    return kept.sum(-1) / mask.sum(-1).clamp_min(1)


def gspo_token_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO-token's per-token log-ratio: log s_it = logp_it - sg[logp_it] + sg[log s_i].

    Its value is the sequence log-ratio log s_i on every token of row i (`sequence_log_ratio`),
    its gradient that of logp_it: d s_it / d logp_it = s_i. Under a sequence mean over tokens
    the clipped surrogate min(s_it A_i, clip(s_it) A_i) then has exactly GSPO's value and
    gradient (verl's compute_policy_loss_gspo; TRL's importance_sampling_level="sequence").

    Args:
      logp: [N, T] floating (with gradient); old_logp: [N, T]; mask: [N, T] bool.
    Returns:
      [N, T], 0 where mask is False.
    """
    require_floating("logp", logp)
    require_floating("old_logp", old_logp)
    require_same_shape("old_logp", old_logp, "logp", logp)
    lp = _masked_log_ratio(logp, mask)
    seq = sequence_log_ratio(lp.detach() - _masked_log_ratio(old_logp, mask).detach(), mask)
    return torch.where(mask, lp - lp.detach() + seq[:, None], torch.zeros_like(lp))


def _check_ratio_band(low: float, high: float) -> None:
    """Refuse a band [low, high] on a ratio unless 0 < low <= 1 <= high < inf."""
    if not (0 < low <= 1 <= high and math.isfinite(high)):
        raise ValueError(f"the ratio band needs 0 < low <= 1 <= high < inf, got low={low!r}, high={high!r}")


def ratio_band_mask(log_ratio: torch.Tensor, mask: torch.Tensor, *, low: float, high: float) -> torch.Tensor:
    """Tokens whose engine/trainer ratio lies inside [low, high] (IcePop; prime-rl's and verl's MIS).

      keep_it = m_it and low <= exp(log_ratio_it) <= high,   log_ratio = log pi_trainer - log pi_engine

    Compared in log space, so an overflowing ratio is simply outside. verl's rejection option
    "token_k1" with thresholds "a_b" keeps a <= pi_engine / pi_trainer <= b: the band
    [low, high] = [1 / b, 1 / a].

    Args:
      log_ratio: [N, T] floating (detached or not; the mask has no gradient); NaN is outside.
      mask: [N, T] bool.
      low, high: 0 < low <= 1 <= high, the band on pi_trainer / pi_engine (IcePop: 0.5, 2).
    Returns:
      [N, T] bool, False wherever mask is False.
    """
    _check_ratio_band(low, high)
    lr = _masked_log_ratio(log_ratio, mask).detach()
    return mask & (lr >= math.log(low)) & (lr <= math.log(high))


__all__ = ["gspo_token_log_ratio", "ratio_band_mask", "sequence_log_ratio"]
