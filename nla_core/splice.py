"""Vectors to splice back into the residual stream: a reconstruction and its two references.

Splice-KL asks how much the LM's next-token distribution moves when the activation h at the
extraction layer is replaced by what the AR rebuilt from the explanation. The AR predicts
in the normalised space (||u|| = scale) and FVE compares directions at that norm, so the
reconstruction goes back at h's own norm. The references are a random vector with exactly
the same reconstruction error (same MSE, random direction of error) and the dataset mean
(the predict-the-mean floor), at h's norm too.
"""

from __future__ import annotations

import torch

from nla_core._checks import require_floating, require_ndim, require_same_shape
from nla_core.reconstruction import normalize_activation

__all__ = [
    "denormalize_activation",
    "random_at_same_error",
]

_EPS = 1e-12


def denormalize_activation(u: torch.Tensor, gold: torch.Tensor, *, scale: float | None) -> torch.Tensor:
    """u from the normalised space back to gold's units: h = u * ||gold|| / scale (scale None: u).

    The inverse of normalize_activation for a vector of gold's norm, so
    denormalize(normalize(gold)) = gold. For the AR's reconstruction, splice
    denormalize(normalize(pred)): pred's direction at ||gold||, the only part of pred that
    reconstruction_mse sees. For the mean mu of the normalised activations, denormalize(mu)
    is predict-the-mean in gold's units (its normalised error is the rawvar baseline's).

    Args: u, gold: [N, D]. Returns: [N, D] float32 or wider.
    """
    _check_pair(u, gold)
    u, gold = _wide(u, gold)
    return u if scale is None else u * (gold.norm(dim=-1, keepdim=True) / scale)


def random_at_same_error(gold: torch.Tensor, spliced: torch.Tensor, noise: torch.Tensor, *, scale: float | None) -> torch.Tensor:
    """A random vector whose reconstruction error equals spliced's, error direction from noise.

    scale set (errors are angles on the sphere of radius ||gold||): gold rotated by the
    angle theta between spliced and gold, towards n_perp, noise's unit component orthogonal
    to gold: r = ||gold|| (cos(theta) g + sin(theta) n_perp) with g = gold / ||gold||.
    Then ||r|| = ||gold|| and reconstruction_mse(r, gold) = reconstruction_mse(spliced, gold).
    scale None (raw errors): r = gold + ||spliced - gold|| * noise / ||noise||.

    Args: gold, spliced, noise: [N, D]. Returns: [N, D] float32 or wider.
    """
    _check_pair(spliced, gold, "spliced")
    require_floating("noise", noise)
    require_same_shape("noise", noise, "gold", gold)
    gold, spliced, noise = _wide(gold, spliced, noise)
    if scale is None:
        return gold + (spliced - gold).norm(dim=-1, keepdim=True) * normalize_activation(noise, 1.0)
    radius = gold.norm(dim=-1, keepdim=True)
    g = gold / radius.clamp_min(_EPS)
    cos = (normalize_activation(spliced, 1.0) * g).sum(-1, keepdim=True).clamp(-1.0, 1.0)
    sin = (1.0 - cos.square()).clamp_min(0.0).sqrt()
    n_perp = normalize_activation(noise - (noise * g).sum(-1, keepdim=True) * g, 1.0)
    return radius * (cos * g + sin * n_perp)


def _check_pair(x: torch.Tensor, gold: torch.Tensor, name: str = "u") -> None:
    require_floating(name, x)
    require_floating("gold", gold)
    require_ndim("gold", gold, 2, "[N, D]")
    require_same_shape(name, x, "gold", gold)


def _wide(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    dtype = torch.float32
    for x in xs:
        dtype = torch.promote_types(dtype, x.dtype)
    return tuple(x.to(dtype) for x in xs)
