"""From explanation text to reward: extraction, normalised reconstruction error, FVE."""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

from nla_core._checks import require_choice, require_floating, require_ndim, require_same_shape

__all__ = [
    "FAILED_EXTRACTION_REWARD",
    "REWARD_KINDS",
    "Baselines",
    "extract_explanation",
    "fve",
    "hinged_length_penalty",
    "normalize_activation",
    "predict_mean_baselines",
    "reconstruction_mse",
    "reward_from_mse",
]

FAILED_EXTRACTION_REWARD = -2.0
"""Reward of a rollout without a usable <explanation>…</explanation> (the paper's default)."""

REWARD_KINDS = ("neg_log", "neg")
_EXPLANATION = re.compile(r"<explanation>(.*?)</explanation>", re.DOTALL)


def extract_explanation(text: str) -> str | None:
    """The first <explanation>…</explanation> body (non-greedy, across newlines), stripped.

    None when no complete pair exists; "" for an empty pair.
    """
    match = _EXPLANATION.search(text)
    return None if match is None else match.group(1).strip()


def normalize_activation(v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """v * scale / max(||v||, 1e-12) over the last dim (norm in float32); None -> v unchanged.

    Args: v: [..., D]. Returns: [..., D] in v's dtype (a zero vector stays zero).
    """
    require_floating("v", v)
    if scale is None:
        return v
    v32 = v.to(torch.promote_types(v.dtype, torch.float32))
    return (v32 * (scale / v32.norm(dim=-1, keepdim=True).clamp_min(1e-12))).to(v.dtype)


def reconstruction_mse(pred: torch.Tensor, gold: torch.Tensor, *, scale: float | None) -> torch.Tensor:
    """mse_i = mean_d (normalize(pred_i) - normalize(gold_i))_d^2, in float32.

    Args: pred, gold: [N, D]. Returns: [N] float32.
    """
    require_floating("pred", pred)
    require_floating("gold", gold)
    require_ndim("pred", pred, 2, "[N, D]")
    require_same_shape("gold", gold, "pred", pred)
    diff = normalize_activation(pred.float(), scale) - normalize_activation(gold.float(), scale)
    return diff.square().mean(-1)


def reward_from_mse(mse: torch.Tensor | float, *, kind: str = "neg_log") -> torch.Tensor:
    """neg_log: r = -log(max(mse, 1e-8)) (the reference's reward); neg: r = -mse.

    Args: mse: any shape (a float becomes a 0-d tensor). Returns: same shape, float32 or wider.
    """
    require_choice("kind", kind, REWARD_KINDS)
    mse = torch.as_tensor(mse)
    require_floating("mse", mse)
    mse = mse.to(torch.promote_types(mse.dtype, torch.float32))
    return -torch.log(mse.clamp_min(1e-8)) if kind == "neg_log" else -mse


def hinged_length_penalty(lengths: torch.Tensor, *, threshold: int, coef: float) -> torch.Tensor:
    """p_i = coef * max(0, L_i - threshold): free up to `threshold` tokens, linear past it.

    EasyNLA's anti-runaway reward shaping (subtracted from the reward before the group
    advantages), which pushes length back before rollouts reach the max_new_tokens cap.

    Args: lengths: [N] integer response lengths. Returns: [N] float32.
    """
    require_ndim("lengths", lengths, 1, "[N]")
    if lengths.is_floating_point() or lengths.dtype == torch.bool:
        raise ValueError(f"lengths must be an integer tensor, got {lengths.dtype}")
    if threshold < 0 or not coef >= 0:
        raise ValueError(f"need threshold >= 0 and coef >= 0, got threshold={threshold!r}, coef={coef!r}")
    return coef * (lengths - threshold).clamp_min(0).to(torch.float32)


class Baselines(NamedTuple):
    meannorm: torch.Tensor
    """0-d: mean_i mean_d (u_i - normalize(mu))^2 — the older, looser baseline."""
    rawvar: torch.Tensor
    """0-d: mean_i mean_d (u_i - mu)^2 — the paper's predict-the-mean baseline."""


def predict_mean_baselines(acts: torch.Tensor, *, scale: float | None) -> Baselines:
    """Predict-the-mean MSEs that FVE divides by; u = normalize(acts), mu = mean_i u_i.

    Args: acts: [N, D]. Returns: Baselines of 0-d float32 tensors (math in float64).
    """
    require_floating("acts", acts)
    require_ndim("acts", acts, 2, "[N, D]")
    if acts.shape[0] == 0:
        raise ValueError("acts is empty: the baselines need at least one activation")
    u = normalize_activation(acts.to(torch.float64), scale)
    mu = u.mean(0, keepdim=True)
    rawvar = (u - mu).square().mean()
    meannorm = (u - normalize_activation(mu, scale)).square().mean()
    return Baselines(meannorm=meannorm.float(), rawvar=rawvar.float())


def fve(mse_mean, baseline):
    """Fraction of variance explained: 1 - mse_mean / baseline (floats or tensors)."""
    return 1.0 - mse_mean / baseline
