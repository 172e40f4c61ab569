"""One GRPO step: `train_step(state, step) -> metrics`, four named phases on the run's state.

    rollout  this rank's share of the global batch -> G explanations per prompt (and the canary)
    score    extraction -> AR -> reward -> group advantages; the critic's step (in the scoring
             forward, or after it on chosen pairs); DAPO's redraws; with fp8=score the scoring
             forwards' matmuls in FP8 (the co-trained critic's step backward in its dtype)
    update   the micro-batched GRPO update of the LoRA (gradients summed over ranks); with
             fp8=reference / update the reference pass's / the policy forwards' base matmuls in FP8
    push     the updated weights to an engine that keeps its own copy, every vllm_sync_every steps

The metrics are the global batch's: every rank's samples, in rank (= batch) order, and each
phase's time is the slowest rank's.
"""

from __future__ import annotations

import contextlib
import math
import resource
import time
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

import nla_core
from nla_shell.engines.base import Rollout, RolloutRequest, held_awake
from nla_shell.metrics import cjk_fraction
from nla_shell.models import fp8_matmuls
from nla_shell.training import distributed, sampling
from nla_shell.training.scoring import (
    DeviceTimer, Scores, ShapedRewards, critic_step, score_and_train_critic, score_explanations, shape_rewards,
)
from nla_shell.training.run_state import RunState
from nla_shell.training.stopped import OutOfGPUMemory
from nla_shell.training.runtime import say
from nla_shell.training.update import UpdateStats, policy_update


@dataclass
class Rolled:
    """The rollout phase's output."""

    requests: list[RolloutRequest]
    rollouts: list[Rollout]
    canary: float
    """The steering canary's reading (NaN for engines that need none)."""
    time_rollout: float
    time_pushed: float
    """Under vllm_sleep, the previous step's push, made at this rollout's wake-up."""


@dataclass
class Scored:
    """The score phase's output: the rollouts the update trains on (after any redraws), scored."""

    requests: list[RolloutRequest]
    rollouts: list[Rollout]
    golds: torch.Tensor
    scores: Scores
    shaped: ShapedRewards
    advantages: torch.Tensor
    critic_loss: float
    critic_grad_norm: float
    extra_draws: int
    varied_groups: int
    time_score: float
    time_critic: float
    time_extra_rollouts: float


def train_step(state: RunState, step: int) -> dict[str, Any]:
    """rollout -> score (and the critic) -> update -> push; the step's metrics (this rank's view of the global batch)."""
    t_step = time.perf_counter()
    if state.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(state.device)
    with phase_memory(state, "rollout", step):
        rolled = rollout_phase(state, step)
    with phase_memory(state, "score", step):
        scored = score_phase(state, rolled)
    t0 = time.perf_counter()
    with phase_memory(state, "update", step):
        update = update_phase(state, step, scored)
    time_update = time.perf_counter() - t0
    with phase_memory(state, "sync", step):
        time_sync = rolled.time_pushed + push_phase(state, step)
    times = {"rollout": rolled.time_rollout + scored.time_extra_rollouts, "score": scored.time_score,
             "update": time_update, "critic": scored.time_critic, "sync": time_sync}
    return step_metrics(state, rolled, scored, update, times, t_step=t_step)


# --------------------------------------------------------------------------- the phases


def rollout_phase(state: RunState, step: int) -> Rolled:
    """This rank's share of the global batch, whole prompts, G rollouts each; the canary's verdict."""
    engine = state.engine
    t0 = time.perf_counter()
    requests = next_requests(state)
    with held_awake(engine):  # vllm_sleep: one wake-up (and weight push) serves rollouts and canary
        rollouts = generate(state, requests)
        # Engines that steer on their own (vLLM) prove each step that the vector still lands:
        # a canary of 0 means rollouts came from an unsteered model the trainer never sees.
        canary = engine.steering_canary(requests[0]) if hasattr(engine, "steering_canary") else math.nan
    # Under vllm_sleep the previous step's push is made at this wake-up: it is the sync phase's time.
    time_pushed = getattr(engine, "last_stats", {}).get("push_s", 0.0)
    time_rollout = time.perf_counter() - t0 - time_pushed
    if hasattr(engine, "steering_canary"):
        # Each rank steers with an engine of its own: the worst reading (a failed one as 0) decides for all,
        # so that the ranks stop together.
        (worst,) = distributed.all_reduce_max([-(canary if canary > 0 else 0.0)])
        if (warning := state.canary_watch.check(step, -worst)) is not None:
            say(warning, error=True)
    return Rolled(requests, rollouts, canary, time_rollout, time_pushed)


def score_phase(state: RunState, rolled: Rolled) -> Scored:
    """Extraction -> AR -> reward -> advantages (groups are whole: exact), and the critic's step.

    A co-trained critic takes its regression step on the same forward that scores (the reward
    is the pre-update prediction's); every rank steps, even one with no pairs. With
    critic_rollouts=best, an EMA or dynamic sampling, it scores first and steps after.
    """
    cfg = state.cfg
    t0 = time.perf_counter()
    requests, rollouts = rolled.requests, rolled.rollouts
    golds = gold_vectors(requests, rollouts)
    explanations = [nla_core.extract_explanation(r.text) for r in rollouts]
    critic_loss = critic_grad_norm = math.nan
    time_critic = 0.0
    if state.critic_optimizer is not None and not cfg.critic_steps_after_scoring:
        with fp8_matmuls(state.fp8_score):  # the forward in FP8, its backward the bf16 weights' (straight-through)
            scores, critic_loss, critic_grad_norm, time_critic = score_and_train_critic(
                state.critic, state.critic_optimizer, state.tokenizer, explanations, golds, **state.score_kwargs,
                max_grad_norm=cfg.max_grad_norm,
            )
    else:
        with scoring_forward(state):
            scores = score_explanations(state.critic, state.tokenizer, explanations, golds, **state.score_kwargs)
    shaped = shape(state, scores, rollouts)
    extra_draws, time_extra_rollouts = 0, 0.0
    if cfg.dynamic_sampling:  # DAPO: draw again until the step holds batch_prompts groups with varied rewards
        (requests, rollouts, shaped), extra_draws, time_extra_rollouts = redraw(state, requests, rollouts, shaped)
        golds = gold_vectors(requests, rollouts)
    scores = shaped.scores
    group_ids = torch.tensor([r.prompt_index for r in rollouts])
    advantages = sampling.step_advantages(shaped.reward, group_ids, scale=cfg.advantage_scale)
    if state.critic_optimizer is not None and cfg.critic_steps_after_scoring:
        critic_loss, critic_grad_norm, time_critic = critic_phase(state, scores, golds, group_ids)
    varied = nla_core.group_has_variance(shaped.reward, group_ids).tolist() if rollouts else []
    varied_groups = int(distributed.all_reduce_sum([len({g for g, v in zip(group_ids.tolist(), varied) if v})])[0])
    # The critic's own backward and step are its phase; extra draws are rollout time.
    time_score = time.perf_counter() - t0 - time_extra_rollouts - time_critic
    return Scored(requests, rollouts, golds, scores, shaped, advantages, critic_loss, critic_grad_norm, extra_draws,
                  varied_groups, time_score, time_critic, time_extra_rollouts)


def critic_phase(state: RunState, scores: Scores, golds: torch.Tensor,
                 group_ids: torch.Tensor) -> tuple[float, float, float]:
    """The critic's step on the pairs it learns from (critic_rollouts), then its EMA: (loss, grad norm, seconds).

    With fp8=score its forward runs in FP8 as the one-forward step's does (copies re-made from the critic's own
    weights, its backward straight-through, and with backward its input gradients in FP8)."""
    cfg = state.cfg
    pairs = sampling.critic_pairs(scores, group_ids, rollouts=cfg.critic_rollouts)
    timer = DeviceTimer(state.device)
    with timer, fp8_matmuls(state.fp8_score):
        critic_loss, critic_grad_norm = critic_step(
            state.critic, state.critic_optimizer, [scores.ar_inputs[i] for i in pairs], golds[pairs],
            pad_id=state.tokenizer.pad_token_id, micro_batch=cfg.critic_micro_batch, max_grad_norm=cfg.max_grad_norm,
        )
    if state.critic_ema is not None and math.isfinite(critic_loss):
        state.critic_ema.update()
    return critic_loss, critic_grad_norm, timer.seconds()


def redraw(state: RunState, requests: list[RolloutRequest], rollouts: list[Rollout],
           shaped: ShapedRewards) -> tuple[tuple[list[RolloutRequest], list[Rollout], ShapedRewards], int, float]:
    """DAPO's dynamic sampling: ((requests, rollouts, shaped) kept, extra draws, their rollouts' seconds)."""
    time_extra_rollouts = 0.0

    def another_draw() -> sampling.Draw:
        nonlocal time_extra_rollouts
        t1 = time.perf_counter()
        more = next_requests(state)
        with held_awake(state.engine):
            more_rollouts = generate(state, more)
        time_extra_rollouts += time.perf_counter() - t1
        with scoring_forward(state):
            more_scores = score_explanations(
                state.critic, state.tokenizer, [nla_core.extract_explanation(r.text) for r in more_rollouts],
                gold_vectors(more, more_rollouts), **state.score_kwargs)
        return sampling.Draw(more, more_rollouts, shape(state, more_scores, more_rollouts))

    kept, extra_draws = sampling.redraw_until_varied(
        sampling.Draw(requests, rollouts, shaped), another_draw, max_draws=state.cfg.dynamic_sampling_max_draws)
    return (kept.requests, kept.rollouts, kept.shaped), extra_draws, time_extra_rollouts


def update_phase(state: RunState, step: int, scored: Scored) -> UpdateStats:
    """The policy update (global denominator, gradients summed over ranks); a non-finite grad norm skips it."""
    cfg = state.cfg
    state.actor.train()
    update = policy_update(
        state.actor, state.injector, state.optimizer, scored.rollouts, scored.advantages, scored.golds,
        loss=state.loss_options, micro_batch=cfg.logp_micro_batch, max_grad_norm=cfg.max_grad_norm,
        pad_id=state.tokenizer.pad_token_id, mismatch_threshold=cfg.mismatch_threshold,
        prompt_block=cfg.logp_prompt_block, reference_micro_batch=cfg.ref_micro_batch,
        fp8_reference=state.fp8_reference, fp8_update=state.fp8_update,
    )
    if not update.stepped:  # the grad norm is global: every rank skips together
        state.skipped_steps += 1
        say(f"[warn] step {step}: grad norm {update.grad_norm} is not finite; optimizer step skipped "
            f"({state.skipped_steps} so far)", error=True)
    return update


def push_phase(state: RunState, step: int) -> float:
    """The weight push to an engine with its own copy, on the sync schedule: its seconds."""
    cfg, engine = state.cfg, state.engine
    if not engine.shares_actor_weights and cfg.vllm_sync_every > 0 and (step + 1) % cfg.vllm_sync_every == 0:
        seconds = engine.sync_weights(state.actor)  # 0 while vLLM sleeps: the push waits for its wake-up
        state.eval_engine.synced()
        return seconds
    state.eval_engine.stepped()
    return 0.0


# --------------------------------------------------------------------------- pieces of the phases


@contextlib.contextmanager
def phase_memory(state: RunState, phase: str, step: int) -> Iterator[None]:
    """A GPU out-of-memory error inside the block (torch's, or vLLM's "CUDA Error: out of memory" from its
    sleep-mode allocator) -> OutOfGPUMemory naming the phase, the memory in use and the keys that lower it."""
    try:
        yield
    except RuntimeError as err:
        if "out of memory" not in str(err).lower() or isinstance(err, OutOfGPUMemory):
            raise
        in_use = total = None
        if state.device.type == "cuda":
            free, whole = torch.cuda.mem_get_info(state.device)
            in_use, total = (whole - free) / 2**30, whole / 2**30
        raise OutOfGPUMemory(phase, step, in_use_gib=in_use, total_gib=total) from err


@contextlib.contextmanager
def scoring_forward(state: RunState) -> Iterator[None]:
    """How a no-grad scoring forward runs: on the critic's EMA weights when there is one, and with fp8=score
    its backbone's matmuls in FP8 (quantised inside the EMA swap, from the weights as they are now)."""
    with sampling.scoring_weights(state.critic_ema), fp8_matmuls(state.fp8_score):
        yield


def next_requests(state: RunState) -> list[RolloutRequest]:
    """This rank's share of the next global batch of the data order."""
    batch = distributed.shard(state.order.next_batch(state.cfg.batch_prompts), state.rank)
    return [RolloutRequest(tuple(state.prompt_ids[i]), state.rows[i].activation) for i in batch]


def generate(state: RunState, requests: list[RolloutRequest]) -> list[Rollout]:
    return state.engine.generate(requests, group_size=state.cfg.group_size, max_new_tokens=state.cfg.max_new_tokens)


def gold_vectors(requests: list[RolloutRequest], rollouts: list[Rollout]) -> torch.Tensor:
    """Each rollout's target activation."""
    return torch.stack([requests[r.prompt_index].activation for r in rollouts])


def shape(state: RunState, scores: Scores, rollouts: list[Rollout]) -> ShapedRewards:
    cfg = state.cfg
    return shape_rewards(
        scores, rollouts, max_new_tokens=cfg.max_new_tokens, eos_ids=state.eos_ids, length_penalty=cfg.length_penalty,
        length_margin=cfg.length_margin, truncated_as_failed=cfg.truncated_as_failed,
    )


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is KiB on Linux: the process's peak resident memory.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan}
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), "std": float(arr.std()), "min": float(arr.min()), "max": float(arr.max())}


# --------------------------------------------------------------------------- metrics


def step_metrics(state: RunState, rolled: Rolled, scored: Scored, update: UpdateStats, times: dict[str, float], *,
                 t_step: float) -> dict[str, Any]:
    """The step's metrics record: the global batch's samples gathered from every rank, in rank (= batch)
    order; the slowest rank's times and peak memory."""
    rollouts, scores, shaped, advantages = scored.rollouts, scored.scores, scored.shaped, scored.advantages
    marker = state.nla.injection_token_id
    samples = distributed.gather_samples({
        "reward": scores.reward,
        "mse": scores.mse,
        "valid": scores.valid,
        "advantage": advantages,
        "cjk": torch.tensor([cjk_fraction(r.text) for r in rollouts], dtype=torch.float64),
        "length": torch.tensor([r.response_len for r in rollouts]),
        "echo": torch.tensor([bool((r.full_ids[r.prompt_len :] == marker).any()) for r in rollouts]),
        "truncated": shaped.truncated,
        "length_penalty": shaped.length_penalty,
    })
    mse_stats = _stats(samples["mse"][samples["valid"]].tolist())
    reward_stats = _stats(samples["reward"][samples["valid"]].tolist())
    fve = nla_core.fve(mse_stats["mean"], state.rawvar)
    advantages_all, n_generated = samples["advantage"], int(samples["length"].sum())
    # The slowest rank sets the pace: times (and peak memory) are maxima over ranks.
    time_step = time.perf_counter() - t_step
    time_rollout, time_score, time_update, time_critic, time_sync, time_step, peak_mem = distributed.all_reduce_max(
        [times["rollout"], times["score"], times["update"], times["critic"], times["sync"], time_step,
         peak_memory_gb(state.device)]
    )
    return {
        "loss": update.loss,
        **{f"reward_{k}": v for k, v in reward_stats.items()},
        **{f"mse_{k}": v for k, v in mse_stats.items()},
        "fve": fve,
        "fve_pct": 100.0 * fve,  # the reference's keys, for dashboards built on it
        "fve_baseline": state.rawvar,
        "fve_meannorm": nla_core.fve(mse_stats["mean"], state.meannorm),
        "advantage_mean": float(advantages_all.mean()),
        "advantage_std": float(advantages_all.std()) if advantages_all.numel() > 1 else 0.0,
        "extraction_rate": float(samples["valid"].float().mean()),
        "cjk_fraction": float(np.mean(samples["cjk"].numpy())),
        "response_len_mean": n_generated / len(samples["length"]),
        "kl_mean": update.kl_mean,
        "entropy_mean": update.entropy_mean,
        "clip_frac": update.clip_frac,
        "outside_clip_frac": update.outside_clip_frac,
        "tis_frac": update.tis_frac,
        "token_mask_frac": update.token_mask_frac,
        "entropy_mask_frac": update.entropy_mask_frac,
        "dynamic_sampling_draws": scored.extra_draws,
        "varied_groups": scored.varied_groups,
        "logp_diff_mean": update.logp_diff_mean,
        "logp_diff_max": update.logp_diff_max,
        "grad_norm": update.grad_norm,
        "skipped_steps": state.skipped_steps,
        "critic_loss": scored.critic_loss,
        "critic_grad_norm": scored.critic_grad_norm,
        "truncated_frac": float(samples["truncated"].float().mean()),
        "length_penalty_mean": float(samples["length_penalty"].mean()),
        "time_rollout": time_rollout,
        "time_score": time_score,
        "time_update": time_update,
        "time_critic": time_critic,
        "time_sync": time_sync,
        "time_step": time_step,
        "tokens_per_s": n_generated / max(time_rollout, 1e-9),
        "peak_mem_gb": peak_mem,
        "marker_echo_count": int(samples["echo"].sum()),
        "mismatch_masked_frac": update.mismatch_masked_frac,
        "time_allreduce": update.time_allreduce,
        "steering_canary": rolled.canary,
    }
