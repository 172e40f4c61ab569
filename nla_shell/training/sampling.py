"""Which rollouts a step trains on, and what the critic learns from (issue 30's trainer options).

- `redraw_until_varied`, `keep_varied_groups`: DAPO's dynamic sampling, the groups whose rewards vary first.
- `step_advantages`: `nla_core.group_advantages` over the global batch (the batch scale's std spans ranks).
- `critic_pairs`: every valid pair, or each group's best (`critic_rollouts`).
- `CriticEMA`: an exponential moving average of the critic's trained weights, swapped in for scoring.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Sequence

import torch

import nla_core
from nla_shell.engines.base import Rollout, RolloutRequest
from nla_shell.models import trainable_parameters
from nla_shell.training import distributed
from nla_shell.training.scoring import Scores, ShapedRewards


@dataclass(frozen=True)
class Draw:
    """One batch of prompts with its G rollouts each, scored."""

    requests: list[RolloutRequest]
    rollouts: list[Rollout]
    """prompt_index indexes `requests`."""
    shaped: ShapedRewards

    def group_ids(self) -> torch.Tensor:
        return torch.tensor([r.prompt_index for r in self.rollouts], dtype=torch.long)

    def varied_groups(self) -> list[int]:
        """Prompt indices whose rollouts' rewards are not all equal, in order."""
        if not self.rollouts:
            return []
        varied = nla_core.group_has_variance(self.shaped.reward, self.group_ids())
        return sorted({r.prompt_index for r, v in zip(self.rollouts, varied.tolist()) if v})


def keep_varied_groups(draws: Sequence[Draw], n_groups: int) -> Draw:
    """One Draw of `n_groups` prompt groups from `draws`: the groups with reward variance first (in draw
    order), then, if too few varied, the earliest constant groups (advantage 0: they add only their KL term).

    The kept groups are renumbered 0..n_groups-1 in that order; each keeps its G rollouts whole.
    """
    varied, constant = [], []
    for d_index, draw in enumerate(draws):
        has = set(draw.varied_groups())
        for p in range(len(draw.requests)):
            (varied if p in has else constant).append((d_index, p))
    chosen = (varied + constant)[:n_groups]
    requests, rollouts, rows = [], [], []
    for new_index, (d_index, p) in enumerate(chosen):
        draw = draws[d_index]
        requests.append(draw.requests[p])
        for i, r in enumerate(draw.rollouts):
            if r.prompt_index == p:
                rollouts.append(replace(r, prompt_index=new_index))
                rows.append((d_index, i))
    return Draw(requests=requests, rollouts=rollouts, shaped=_take_shaped([d.shaped for d in draws], rows))


def _take_shaped(parts: Sequence[ShapedRewards], rows: Sequence[tuple[int, int]]) -> ShapedRewards:
    """The rows (part, index) of several ShapedRewards, as one."""

    def take(get) -> torch.Tensor:
        if not rows:
            return get(parts[0])[:0]
        return torch.stack([get(parts[p])[i] for p, i in rows])

    scores = Scores(
        mse=take(lambda s: s.scores.mse),
        reward=take(lambda s: s.scores.reward),
        valid=take(lambda s: s.scores.valid),
        ar_inputs=[parts[p].scores.ar_inputs[i] for p, i in rows],
    )
    return ShapedRewards(scores=scores, reward=take(lambda s: s.reward), truncated=take(lambda s: s.truncated),
                         length_penalty=take(lambda s: s.length_penalty))


def varied_deficit(draws: Sequence[Draw], n_groups: int) -> int:
    """Groups still missing from `n_groups` varied ones, the most over ranks (every rank draws again together)."""
    missing = max(0, n_groups - sum(len(d.varied_groups()) for d in draws))
    (worst,) = distributed.all_reduce_max([missing])
    return int(worst)


def redraw_until_varied(first: Draw, draw: Callable[[], Draw], *, max_draws: int) -> tuple[Draw, int]:
    """DAPO's dynamic sampling: call `draw()` (a fresh batch, scored) while fewer than len(first.requests)
    groups vary, at most `max_draws` times; returns the kept groups (`keep_varied_groups`) and the draws made."""
    n_groups = len(first.requests)
    draws = [first]
    while len(draws) - 1 < max_draws and varied_deficit(draws, n_groups):
        draws.append(draw())
    return keep_varied_groups(draws, n_groups), len(draws) - 1


def step_advantages(reward: torch.Tensor, group_ids: torch.Tensor, *, scale: str) -> torch.Tensor:
    """`nla_core.group_advantages` of this rank's samples as the global batch defines them.

    Groups never span ranks, so the group scales are local; scale="batch" divides by the std of
    every rank's rewards, gathered (each rank's samples are a contiguous slice of the batch).
    """
    if scale != "batch" or not distributed.active():
        return nla_core.group_advantages(reward, group_ids, scale=scale)
    info = distributed.rank_info()
    # Disjoint group ids per rank: offset by rank * (the largest local id + 1) over ranks.
    (span,) = distributed.all_reduce_max([int(group_ids.max()) + 1 if group_ids.numel() else 1])
    everything = distributed.gather_samples({"reward": reward.float(), "group": group_ids + info.rank * int(span)})
    sizes = distributed.all_gather(reward.numel())
    start = sum(sizes[: info.rank])
    adv = nla_core.group_advantages(everything["reward"], everything["group"], scale=scale)
    return adv[start : start + reward.numel()]


def critic_pairs(scores: Scores, group_ids: torch.Tensor, *, rollouts: str) -> list[int]:
    """Sample indices the critic trains on: every valid one ("all") or each group's best valid one ("best")."""
    if rollouts == "all":
        return [i for i, ids in enumerate(scores.ar_inputs) if ids is not None]
    valid = torch.tensor([ids is not None for ids in scores.ar_inputs], dtype=torch.bool)
    return nla_core.best_in_group(scores.reward, group_ids, valid).tolist()


class CriticEMA:
    """ema <- decay * ema + (1 - decay) * w over the critic's trainable weights, after each critic step.

    `scoring()` swaps the averaged weights in (and back) without a copy. Every rank steps the
    same critic, so every rank holds the same average.
    """

    def __init__(self, critic: torch.nn.Module, decay: float) -> None:
        self.decay = decay
        self.params = trainable_parameters(critic)
        self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params], 1.0 - self.decay)

    @contextlib.contextmanager
    def scoring(self) -> Iterator[None]:
        self._swap()
        try:
            yield
        finally:
            self._swap()

    def _swap(self) -> None:
        for p, s in zip(self.params, self.shadow):
            p.data, s.data = s.data, p.data

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {str(i): s.detach().cpu() for i, s in enumerate(self.shadow)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if len(state) != len(self.shadow):
            raise ValueError(f"critic EMA state holds {len(state)} tensors, the critic trains {len(self.shadow)}")
        for i, s in enumerate(self.shadow):
            s.copy_(state[str(i)])


@contextlib.contextmanager
def scoring_weights(ema: CriticEMA | None) -> Iterator[None]:
    """The critic's EMA weights swapped in when there is one, else nothing."""
    if ema is None:
        yield
        return
    with ema.scoring():
        yield
