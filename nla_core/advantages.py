"""Group-relative advantages (GRPO, Dr. GRPO, batch-scaled), and group selection by reward (DAPO, ScaleRL)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from nla_core._checks import require_bool, require_choice, require_floating, require_integer, require_ndim

ADVANTAGE_SCALES = ("std", "none", "batch")


class _Groups(NamedTuple):
    group: torch.Tensor  # [N] int64: 0..K-1, the rank of each sample's id among the distinct ids
    count: torch.Tensor  # [K] float64 samples per group
    mean: torch.Tensor  # [K] float64
    constant: torch.Tensor  # [K] bool: every reward of the group is equal (exactly)


def _check_rewards(rewards: torch.Tensor, group_ids: torch.Tensor) -> None:
    require_floating("rewards", rewards)
    require_integer("group_ids", group_ids)
    require_ndim("rewards", rewards, 1, "[N]")
    require_ndim("group_ids", group_ids, 1, "[N]")
    if rewards.shape != group_ids.shape:
        raise ValueError(
            f"rewards has shape {tuple(rewards.shape)} but group_ids has shape "
            f"{tuple(group_ids.shape)}: one group id per reward"
        )


def _group_stats(r: torch.Tensor, group_ids: torch.Tensor) -> _Groups:
    """Per-group count, mean and constancy of float64 rewards r [N] (N > 0)."""
    _, group = torch.unique(group_ids, return_inverse=True)
    n_groups = int(group.max()) + 1 if group.numel() else 0
    zeros = torch.zeros(n_groups, dtype=torch.float64, device=r.device)
    count = zeros.index_add(0, group, torch.ones_like(r))
    mean = zeros.index_add(0, group, r) / count
    # Equal rewards are detected exactly (max == min), not through a variance that float
    # rounding may leave at 1e-17: such groups carry no signal and must give exactly 0.
    g_max = zeros.scatter_reduce(0, group, r, reduce="amax", include_self=False)
    g_min = zeros.scatter_reduce(0, group, r, reduce="amin", include_self=False)
    return _Groups(group=group, count=count, mean=mean, constant=g_max == g_min)


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
    scale="batch": A_i = (r_i - mean_g) / (std_batch + eps), std_batch the unbiased std of all N
                  rewards (TRL's scale_rewards="batch", ScaleRL's batch-level normalisation; TRL's eps is 1e-4).
    A group of one sample, or whose rewards are all equal, gets A = 0 exactly.

    Args:
      rewards: [N] floating, one scalar per sample.
      group_ids: [N] integer; samples with equal ids form a group, in any order.
    Returns:
      [N] float32 advantages.
    """
    _check_rewards(rewards, group_ids)
    require_choice("scale", scale, ADVANTAGE_SCALES)
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=torch.float32, device=rewards.device)

    # float64 so that the group statistics do not depend on summation order at float32 noise.
    r = rewards.to(torch.float64)
    stats = _group_stats(r, group_ids)
    group = stats.group
    centered = r - stats.mean[group]
    constant = stats.constant[group]
    if scale == "std":
        zeros = torch.zeros_like(stats.mean)
        var = zeros.index_add(0, group, centered.square()) / (stats.count - 1).clamp_min(1)
        centered = centered / (var.sqrt()[group] + eps)
    elif scale == "batch":
        # one std for the whole batch (unbiased; 0 for a single sample)
        std = r.std() if r.numel() > 1 else torch.zeros((), dtype=torch.float64, device=r.device)
        centered = centered / (std + eps)
    adv = torch.where(constant, torch.zeros_like(centered), centered)
    return adv.to(torch.float32)


def group_has_variance(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Which samples belong to a group whose rewards are not all equal (DAPO's dynamic sampling filter).

      keep_i = max_{j in g(i)} r_j != min_{j in g(i)} r_j

    A zero-variance group (all rewards equal, or a single sample) gets A = 0 under every
    `group_advantages` scale, so it adds no policy gradient; dynamic sampling draws more
    prompts in its place. Exact comparison, as in `group_advantages`.

    Args:
      rewards: [N] floating; group_ids: [N] integer, equal ids form a group, in any order.
    Returns:
      [N] bool.
    """
    _check_rewards(rewards, group_ids)
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=rewards.device)
    stats = _group_stats(rewards.to(torch.float64), group_ids)
    return ~stats.constant[stats.group]


def best_in_group(rewards: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each group's best valid sample: the one with the highest reward (the first on a tie).

      best_g = argmax_{i in g, valid_i} r_i   (groups without a valid sample are left out)

    What a critic co-trained on "each group's best rollout" trains on.

    Args:
      rewards: [N] floating; group_ids: [N] integer; valid: [N] bool (e.g. an explanation was scored).
    Returns:
      [K'] int64 sample indices, ascending, at most one per group.
    """
    _check_rewards(rewards, group_ids)
    require_bool("valid", valid)
    if valid.shape != rewards.shape:
        raise ValueError(f"valid has shape {tuple(valid.shape)} but rewards has {tuple(rewards.shape)}")
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=torch.long, device=rewards.device)
    r = torch.where(valid, rewards.to(torch.float64), torch.full((), -torch.inf, dtype=torch.float64))
    ids, group = torch.unique(group_ids, return_inverse=True)
    n_groups = ids.numel()
    top = torch.full((n_groups,), -torch.inf, dtype=torch.float64, device=r.device)
    top = top.scatter_reduce(0, group, r, reduce="amax", include_self=True)
    index = torch.arange(r.numel(), device=r.device)
    is_top = valid & (r == top[group])
    first = torch.full((n_groups,), r.numel(), dtype=torch.long, device=r.device)
    first = first.scatter_reduce(0, group, torch.where(is_top, index, torch.full_like(index, r.numel())),
                                 reduce="amin", include_self=True)
    return first[first < r.numel()].sort().values


__all__ = ["ADVANTAGE_SCALES", "best_in_group", "group_advantages", "group_has_variance"]
