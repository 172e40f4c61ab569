"""Per-token estimators of KL(pi || pi_ref) from sampled-token log-probs (Schulman's k1/k2/k3)."""

from __future__ import annotations

import torch

from nla_core._checks import float32_or_wider, require_floating, require_same_shape

__all__ = [
    "kl_categorical",
    "kl_k1",
    "kl_k2",
    "kl_k3",
]


def _delta(logp: torch.Tensor, ref_logp: torch.Tensor, clamp: float | None) -> torch.Tensor:
    require_floating("logp", logp)
    require_floating("ref_logp", ref_logp)
    require_same_shape("ref_logp", ref_logp, "logp", logp)
    if clamp is not None and not clamp > 0:
        raise ValueError(f"clamp must be a positive float or None, got {clamp!r}")
    delta = float32_or_wider(ref_logp) - float32_or_wider(logp)
    if clamp is not None:
        delta = delta.clamp(-clamp, clamp)
    return delta


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor, *, clamp: float | None = None) -> torch.Tensor:
    """k1 = -delta with delta = ref_logp - logp; unbiased, high variance, can be negative.

    Args: logp, ref_logp: [...] log-probs of the sampled tokens (same shape).
    Returns: [...] float32 (float64 for float64 inputs).
    """
    return -_delta(logp, ref_logp, clamp)


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor, *, clamp: float | None = None) -> torch.Tensor:
    """k2 = delta^2 / 2 with delta = ref_logp - logp; biased, low variance, >= 0.

    Args: logp, ref_logp: [...] (same shape). Returns: [...] float32 or wider.
    """
    return 0.5 * _delta(logp, ref_logp, clamp).square()


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor, *, clamp: float | None = None) -> torch.Tensor:
    """k3 = exp(delta) - 1 - delta with delta = ref_logp - logp; unbiased and >= 0.

    expm1 keeps precision when delta is small (where exp(delta) - 1 cancels). Under samples
    from pi, E[k3] = KL(pi || pi_ref); over a full categorical, sum_v p_v k3 = KL(p || q).

    Args: logp, ref_logp: [...] (same shape). Returns: [...] float32 or wider, never negative.
    """
    delta = _delta(logp, ref_logp, clamp)
    # Mathematically >= 0; the clamp removes a possible last-ulp negative from rounding.
    return (torch.expm1(delta) - delta).clamp_min(0.0)


def kl_categorical(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """Exact KL(p || q) = sum_v p_v (log p_v - log q_v) of two full next-token distributions.

    p = softmax(logits_p), q = softmax(logits_q) over the last dim, in float32 or wider
    (log_softmax, so large logits do not overflow). Equals sum_v p_v * k3 with k3 at
    logp = log p, ref_logp = log q; never negative (a last-ulp negative is clamped).

    Args: logits_p, logits_q: [..., V] (same shape). Returns: [...] float32 or wider.
    """
    require_floating("logits_p", logits_p)
    require_floating("logits_q", logits_q)
    require_same_shape("logits_q", logits_q, "logits_p", logits_p)
    logp = torch.log_softmax(float32_or_wider(logits_p), dim=-1)
    logq = torch.log_softmax(float32_or_wider(logits_q), dim=-1)
    # p_v -> 0 with log p_v -> -inf would give 0 * inf; where() keeps those terms 0.
    terms = torch.where(logp > -torch.inf, logp.exp() * (logp - logq), torch.zeros_like(logp))
    return terms.sum(-1).clamp_min(0.0)
