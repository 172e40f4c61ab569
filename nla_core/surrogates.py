"""Policy-gradient surrogates: PPO's clipped ratio, CISPO's clipped detached IS weight and the on-policy
A log p. Each maps per-token ratios or log-probs and per-sample advantages to the per-token value to
maximise; the loss is its negative, reduced by `aggregate_loss`."""

from __future__ import annotations

from typing import NamedTuple

import torch

from nla_core._checks import require_floating, require_ndim, require_same_shape


class Surrogate(NamedTuple):
    value: torch.Tensor
    """[N, T] per-token surrogate s_it, to be maximised (the loss is -s); carries the input's gradient."""
    clipped: torch.Tensor
    """[N, T] bool, detached: tokens where the surrogate's clip is active (all False for onpolicy)."""


def clip_range(clip_eps: float, clip_eps_high: float | None = None) -> tuple[float, float]:
    """The clip band (1 - clip_eps, 1 + clip_eps_high) on a ratio; clip_eps_high defaults to clip_eps.

    Both must be > 0. clip_eps >= 1 leaves no lower clip on a ratio (it is never negative).
    """
    if not clip_eps > 0 or (clip_eps_high is not None and not clip_eps_high > 0):
        raise ValueError(f"clip_eps and clip_eps_high must be > 0, got {clip_eps!r}, {clip_eps_high!r}")
    return 1.0 - clip_eps, 1.0 + (clip_eps if clip_eps_high is None else clip_eps_high)


def _advantage_column(name: str, x: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Check x [N, T] and advantages [N]; advantages as a detached [N, 1] column in x's dtype."""
    require_floating(name, x)
    require_floating("advantages", advantages)
    require_ndim(name, x, 2, "[N, T]")
    if advantages.shape != x.shape[:1]:
        raise ValueError(f"advantages must be [N] = [{x.shape[0]}] (one per row of {name} {tuple(x.shape)}), "
                         f"got shape {tuple(advantages.shape)}")
    return advantages.detach().to(x.dtype)[:, None]


def ppo_clip_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, *, clip_eps: float = 0.2, clip_eps_high: float | None = None
) -> Surrogate:
    """PPO's clipped surrogate (GRPO; GSPO when `ratio` is GSPO's, see `gspo_token_log_ratio`).

      s_it       = min(r_it A_i, clip(r_it, 1 - clip_eps, 1 + clip_eps_high) A_i)
      clipped_it = (r_it > 1 + clip_eps_high and A_i > 0) or (r_it < 1 - clip_eps and A_i < 0)

    `clipped` marks where the clipped term is the minimum, so the token gets no gradient
    (verl's pg_clipfrac, TRL's clip_ratio/region_mean).

    Args:
      ratio: [N, T] floating, pi / pi_old per token (with gradient).
      advantages: [N] one per sample (detached).
      clip_eps, clip_eps_high: > 0; clip_eps_high defaults to clip_eps (DAPO's clip-higher sets it larger).
    Returns:
      Surrogate: value [N, T] in ratio's dtype, clipped [N, T] bool.
    """
    adv = _advantage_column("ratio", ratio, advantages)
    low, high = clip_range(clip_eps, clip_eps_high)
    value = torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)
    r = ratio.detach()
    return Surrogate(value, ((r > high) & (adv > 0)) | ((r < low) & (adv < 0)))


def cispo_surrogate(
    ratio: torch.Tensor, logp: torch.Tensor, advantages: torch.Tensor, *, clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
) -> Surrogate:
    """CISPO's surrogate (MiniMax-M1): a clipped, detached importance weight times log p.

      s_it       = sg[clip(r_it, max(0, 1 - clip_eps), 1 + clip_eps_high)] A_i logp_it
      clipped_it = r_it < 1 - clip_eps or r_it > 1 + clip_eps_high

    Every token keeps a gradient (the weight is clipped, not the token); clip_eps >= 1 means no lower
    clip (ScaleRL: clip_eps = 1, clip_eps_high = 4; TRL's epsilon_high = 5 is clip_eps_high = 4).

    Args:
      ratio: [N, T] floating, pi / pi_old (only its detached value is used).
      logp: [N, T] the policy's log-probs of the sampled tokens (with gradient).
      advantages: [N].
    Returns:
      Surrogate: value [N, T], clipped [N, T] bool (verl's pg_clipfrac for CISPO).
    """
    adv = _advantage_column("logp", logp, advantages)
    require_floating("ratio", ratio)
    require_same_shape("ratio", ratio, "logp", logp)
    low, high = clip_range(clip_eps, clip_eps_high)
    r = ratio.detach()
    return Surrogate(r.clamp(max(low, 0.0), high) * adv * logp, (r < low) | (r > high))


def onpolicy_surrogate(logp: torch.Tensor, advantages: torch.Tensor) -> Surrogate:
    """The on-policy REINFORCE surrogate with no ratio (EasyNLA): s_it = A_i logp_it.

    Its gradient equals the PPO surrogate's at r = 1 (one update per batch).

    Args: logp: [N, T] floating (with gradient); advantages: [N].
    Returns: Surrogate: value [N, T], clipped all False.
    """
    adv = _advantage_column("logp", logp, advantages)
    return Surrogate(adv * logp, torch.zeros(logp.shape, dtype=torch.bool, device=logp.device))


__all__ = ["Surrogate", "clip_range", "cispo_surrogate", "onpolicy_surrogate", "ppo_clip_surrogate"]
