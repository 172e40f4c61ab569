"""Group-relative advantages (GRPO, Dr. GRPO)."""

from __future__ import annotations

import torch

from nla_core._checks import require_choice, require_floating, require_integer, require_ndim

ADVANTAGE_SCALES = ("std", "none")


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    scale: str = "std",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Advantage of each sample relative to the other samples of its prompt group.

    scale="std":  A_i = (r_i - mean_g) / (std_g + eps), std_g the unbiased (Bessel) std.
    scale="none": A_i = r_i - mean_g (Dr. GRPO: no per-group rescaling).
    A group of one sample, or whose rewards are all equal, gets A = 0 exactly.

    Args:
      rewards: [N] floating, one scalar per sample.
      group_ids: [N] integer; samples with equal ids form a group, in any order.
    Returns:
      [N] float32 advantages.
    """
    require_floating("rewards", rewards)
    require_integer("group_ids", group_ids)
    require_ndim("rewards", rewards, 1, "[N]")
    require_ndim("group_ids", group_ids, 1, "[N]")
    if rewards.shape != group_ids.shape:
        raise ValueError(
            f"rewards has shape {tuple(rewards.shape)} but group_ids has shape "
            f"{tuple(group_ids.shape)}: one group id per reward"
        )
    require_choice("scale", scale, ADVANTAGE_SCALES)
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=torch.float32, device=rewards.device)

    # float64 so that the group statistics do not depend on summation order at float32 noise.
    r = rewards.to(torch.float64)
    _, group = torch.unique(group_ids, return_inverse=True)
    n_groups = int(group.max()) + 1 if group.numel() else 0
    zeros = torch.zeros(n_groups, dtype=torch.float64, device=r.device)
    count = zeros.index_add(0, group, torch.ones_like(r))
    mean = zeros.index_add(0, group, r) / count
    centered = r - mean[group]
    # Equal rewards are detected exactly (max == min), not through a variance that float
    # rounding may leave at 1e-17: such groups carry no signal and must give exactly 0.
    g_max = zeros.scatter_reduce(0, group, r, reduce="amax", include_self=False)
    g_min = zeros.scatter_reduce(0, group, r, reduce="amin", include_self=False)
    constant = (g_max == g_min)[group]
    if scale == "std":
        var = zeros.index_add(0, group, centered.square()) / (count - 1).clamp_min(1)
        centered = centered / (var.sqrt()[group] + eps)
    adv = torch.where(constant, torch.zeros_like(centered), centered)
    return adv.to(torch.float32)
