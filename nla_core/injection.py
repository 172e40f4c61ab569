"""Injection of an activation vector at a marker token, in the two upstream styles.

The AV prompt holds one marker token (found by find_injection_sites). The styles, by name:

- "residual_add" (the reference trainer, EasyNLA nla/train_rl_vllm.py; Karvonen): at the
  output of block 1 the residual becomes h' = h + ||h|| * v / ||v||, the vector's direction
  at the residual's scale. It has no scale setting: upstream's injection_scale is ignored.
- "embedding_replace" (kitft nla/train_actor.py, nla_inference.py): the marker's input
  embedding (after any embedding scale the model applies, e.g. Gemma's sqrt(D)) is replaced
  by v rescaled to L2 norm injection_scale (v itself when injection_scale is None).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from nla_core._checks import require_floating, require_integer, require_ndim

__all__ = [
    "INJECTION_STYLES",
    "find_injection_sites",
    "inject_norm_matched",
    "karvonen_inject",
    "marker_well_formed",
    "replace_at_sites",
]

INJECTION_STYLES = ("residual_add", "embedding_replace")
"""The injection styles by name (module docstring); sidecars nla writes record one under `injection_style`."""


def find_injection_sites(
    input_ids: torch.Tensor,
    *,
    marker_id: int,
    left_id: int,
    right_id: int,
) -> torch.Tensor:
    """(row, position) of every marker whose neighbours are left_id and right_id.

    A marker at position 0 or S-1 has no neighbour on one side and never counts, so a
    generated response that echoes the marker token (mid-sequence, with other neighbours)
    is not mistaken for a site.

    Args:
      input_ids: [B, S] integer.
    Returns:
      [M, 2] int64 sites in row-major order.
    """
    require_integer("input_ids", input_ids)
    require_ndim("input_ids", input_ids, 2, "[B, S]")
    hits = torch.zeros(input_ids.shape, dtype=torch.bool, device=input_ids.device)
    if input_ids.shape[1] >= 3:
        hits[:, 1:-1] = (
            (input_ids[:, 1:-1] == marker_id)
            & (input_ids[:, :-2] == left_id)
            & (input_ids[:, 2:] == right_id)
        )
    return hits.nonzero().to(torch.int64)


def _require_sites_and_vectors(sites: torch.Tensor, vectors: torch.Tensor, d_model: int) -> None:
    if sites.dim() != 2 or sites.shape[1] != 2:
        raise ValueError(f"sites must be [M, 2] (row, position), got shape {tuple(sites.shape)}")
    if vectors.dim() != 2 or vectors.shape[0] != sites.shape[0] or vectors.shape[1] != d_model:
        raise ValueError(
            f"vectors must be [M, D] = [{sites.shape[0]}, {d_model}] (one per site, the "
            f"residual's D), got shape {tuple(vectors.shape)}"
        )


def inject_norm_matched(
    resid: torch.Tensor,
    sites: torch.Tensor,
    vectors: torch.Tensor,
    *,
    scale: float = 1.0,
    eps: float = 1e-12,
) -> torch.Tensor:
    """h'[b, p] = h[b, p] + scale * ||h[b, p]|| * v_m / max(||v_m||, eps) at each site m = (b, p).

    Norms and the sum are float32; the result is rounded once to resid's dtype. Other
    positions are returned untouched. Out-of-place and differentiable w.r.t. resid.

    Args:
      resid: [B, S, D] residual stream.
      sites: [M, 2] integer (row, position), e.g. from find_injection_sites.
      vectors: [M, D] one activation per site, in site order.
    Returns:
      [B, S, D] in resid's dtype.
    """
    require_floating("resid", resid)
    require_integer("sites", sites)
    require_floating("vectors", vectors)
    require_ndim("resid", resid, 3, "[B, S, D]")
    _require_sites_and_vectors(sites, vectors, resid.shape[2])
    rows, positions = sites[:, 0], sites[:, 1]
    h = resid[rows, positions].float()
    v = vectors.to(device=resid.device, dtype=torch.float32)
    direction = v / v.norm(dim=-1, keepdim=True).clamp_min(eps)
    injected = h + scale * h.norm(dim=-1, keepdim=True) * direction
    return resid.index_put((rows, positions), injected.to(resid.dtype))


def replace_at_sites(
    embeds: torch.Tensor,
    sites: torch.Tensor,
    vectors: torch.Tensor,
    *,
    norm: float | None,
    eps: float = 1e-12,
) -> torch.Tensor:
    """e'[b, p] = v_m / (max(||v_m||, eps) / norm) at each site m = (b, p); v_m itself when norm is None.

    kitft's embedding replacement: the quotient is upstream's normalize_activation (float32
    norm, one division), then the row is rounded once to embeds' dtype. Other positions are
    returned untouched; out-of-place. The gradient reaches embeds only off the sites.

    Args:
      embeds: [B, S, D] input embeddings (after the model's embedding scale).
      sites: [M, 2] integer (row, position), e.g. from find_injection_sites.
      vectors: [M, D] one activation per site, in site order.
    Returns:
      [B, S, D] in embeds' dtype.
    """
    require_floating("embeds", embeds)
    require_integer("sites", sites)
    require_floating("vectors", vectors)
    require_ndim("embeds", embeds, 3, "[B, S, D]")
    _require_sites_and_vectors(sites, vectors, embeds.shape[2])
    if norm is not None and not (math.isfinite(norm) and norm > 0):
        raise ValueError(f"norm must be finite and > 0 (or None for the raw vector), got {norm}")
    v = vectors.to(device=embeds.device, dtype=torch.float32)
    if norm is not None:
        v = v / (v.norm(dim=-1, keepdim=True).clamp_min(eps) / norm)
    return embeds.index_put((sites[:, 0], sites[:, 1]), v.to(embeds.dtype))


def karvonen_inject(
    resid: torch.Tensor,
    input_ids: torch.Tensor,
    vectors: torch.Tensor,
    *,
    marker_id: int,
    left_id: int,
    right_id: int,
    scale: float = 1.0,
) -> torch.Tensor:
    """find_injection_sites + inject_norm_matched: one vector per well-formed marker.

    Args:
      resid: [B, S, D]; input_ids: [B, S]; vectors: [M, D], M = number of sites.
    Returns:
      [B, S, D] in resid's dtype.
    Raises:
      ValueError naming both counts when the sites and vectors disagree.
    """
    require_ndim("input_ids", input_ids, 2, "[B, S]")
    require_ndim("resid", resid, 3, "[B, S, D]")
    if input_ids.shape != resid.shape[:2]:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and resid {tuple(resid.shape)} disagree on [B, S]"
        )
    sites = find_injection_sites(input_ids, marker_id=marker_id, left_id=left_id, right_id=right_id)
    if sites.shape[0] != vectors.shape[0]:
        raise ValueError(
            f"found {sites.shape[0]} injection sites (marker {marker_id} between {left_id} and "
            f"{right_id}) in input_ids {tuple(input_ids.shape)} but got {vectors.shape[0]} vectors; "
            "each prompt needs exactly one well-formed marker and one activation"
        )
    return inject_norm_matched(resid, sites, vectors, scale=scale)


def marker_well_formed(prompt_ids: Sequence[int], *, marker_id: int, left_id: int, right_id: int) -> bool:
    """True iff prompt_ids holds exactly one marker, not at either end, between left_id and right_id."""
    ids = [int(t) for t in prompt_ids]
    positions = [i for i, t in enumerate(ids) if t == marker_id]
    if len(positions) != 1:
        return False
    p = positions[0]
    return 0 < p < len(ids) - 1 and ids[p - 1] == left_id and ids[p + 1] == right_id
