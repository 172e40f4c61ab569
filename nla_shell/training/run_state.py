"""The run's state: `RunState`, everything a step reads and moves, and `EvalEngine`, which engine the held-out eval
samples from. nla_shell.training.setup builds them before the first step; nla_shell.training.step and the loop in
nla_shell.training.train read and advance them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import nla_core
from nla_shell.engines.base import RolloutEngine
from nla_shell.io.data import RLRow
from nla_shell.models import ARModel, FP8Linears, Injector
from nla_shell.training import sampling, sharding
from nla_shell.training.canary import CanaryWatch
from nla_shell.training.config import TrainConfig
from nla_shell.training.distributed import RankInfo
from nla_shell.training.runtime import DataOrder
from nla_shell.training.update import LossOptions


class EvalEngine:
    """Which engine the held-out eval samples from, so that it always scores the actor as it is now.

    An engine that shares the actor's weights is always current; one with its own copy is
    current only right after a push. Otherwise the eval samples from the trainer's actor with
    HF generate rather than pushing outside the sync schedule: a push there would make the
    next rollouts fresher than vllm_sync_every says, so eval_every would change training.
    """

    def __init__(self, engine: RolloutEngine, actor, injector: Injector, tokenizer) -> None:
        self.engine, self.actor, self.injector, self.tokenizer = engine, actor, injector, tokenizer
        self.engine_is_current = True  # the initial push (or shared weights)
        self._hf: RolloutEngine | None = None

    def synced(self) -> None:
        """The engine just received the actor's weights."""
        self.engine_is_current = True

    def stepped(self) -> None:
        """The actor moved without a push (a no-op for engines that share its weights)."""
        self.engine_is_current = self.engine.shares_actor_weights

    def current(self) -> RolloutEngine:
        if self.engine_is_current:
            return self.engine
        if self._hf is None:
            from nla_shell.engines.hf import HFRolloutEngine

            self._hf = HFRolloutEngine(self.actor, self.injector, self.tokenizer)
        return self._hf


@dataclass
class RunState:
    """Everything a step reads and moves, built once by `setup` (from a checkpoint when resuming).

    The config is frozen; the state is not: the optimisers, the data order, the RNG streams, the
    critic's EMA and the skipped steps advance with every step, and a checkpoint saves them (the
    canary's count of failures in a row starts afresh on resume).
    """

    cfg: TrainConfig
    """As run: micro-batches that were `auto` are numbers here (and in config.yaml)."""
    rank: RankInfo
    device: torch.device
    nla: nla_core.NLAConfig
    tokenizer: Any
    rows: list[RLRow]
    prompt_ids: list[list[int]]
    eval_rows: list[RLRow]
    """Held-out rows of unseen documents; none when eval is off."""
    eval_prompt_ids: list[list[int]]
    actor: Any
    injector: Injector
    critic: ARModel
    engine: RolloutEngine
    eval_engine: EvalEngine
    optimizer: torch.optim.Optimizer
    critic_optimizer: torch.optim.Optimizer | None
    critic_ema: sampling.CriticEMA | None
    eos_ids: tuple[int, ...]
    mse_scale: float | None
    rawvar: float
    meannorm: float
    order: DataOrder
    start_step: int
    skipped_steps: int
    logger: Any
    save_dir: Path
    canary_watch: CanaryWatch
    fp8_score: FP8Linears | None = None
    """With fp8=score: the AR backbone's FP8 copies, active in the step's scoring forwards (the co-trained
    critic's, which it also steps on, included)."""
    fp8_reference: FP8Linears | None = None
    """With fp8=reference: the actor base's FP8 copies, active in the update's reference pass."""
    fp8_update: FP8Linears | None = None
    """With fp8=update: the actor base's FP8 copies (fp8_reference's, when both), active in the policy
    forwards and backwards of the update."""
    last_record: dict[str, Any] = field(default_factory=dict)
    """The latest step's metrics (with "step"): the checkpoint keeps its eval/fve for keep_last."""

    @property
    def optimized(self) -> sharding.Optimized:
        """The optimisers a checkpoint holds, by name, each with the model it steps."""
        return optimized(self.actor, self.optimizer, self.critic, self.critic_optimizer)

    @property
    def eval_on(self) -> bool:
        return bool(self.eval_rows)

    @property
    def loss_options(self) -> LossOptions:
        cfg = self.cfg
        return LossOptions(
            policy_loss=cfg.policy_loss, clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high, kl_beta=cfg.kl_beta,
            kl_clamp=cfg.kl_clamp, tis=None if cfg.tis == "none" else cfg.tis, tis_cap=cfg.tis_cap,
            aggregation=cfg.aggregation, max_len=cfg.max_new_tokens,
            token_mask=None if cfg.token_mask is None else (cfg.token_mask[0], cfg.token_mask[1]),
            kl_metric=cfg.kl_metric, entropy_metric=cfg.entropy_metric, top_entropy_quantile=cfg.top_entropy_quantile,
        )

    @property
    def score_kwargs(self) -> dict[str, Any]:
        """How the AR scores: the sidecar's template and target scale, the config's reward and micro-batch."""
        return dict(
            template=self.nla.critic_prompt_template, mse_scale=self.mse_scale, reward_kind=self.cfg.reward,
            max_tokens=self.cfg.max_explanation_tokens, micro_batch=self.cfg.critic_micro_batch,
        )


def optimized(actor, optimizer: torch.optim.Optimizer, critic: ARModel,
              critic_optimizer: torch.optim.Optimizer | None) -> sharding.Optimized:
    """The run's optimisers by name ("actor", and "critic" when co-trained), each with the model it steps."""
    return {"actor": (actor, optimizer), **({"critic": (critic, critic_optimizer)} if critic_optimizer else {})}
