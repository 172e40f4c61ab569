"""`nla train`: GRPO on the activation verbaliser, scored by the activation reconstructor.

One step: sample B prompts -> the engine writes G explanations each -> the AR reconstructs
the activation from each -> reward = -log(normalised MSE) -> group-relative advantages ->
micro-batched GRPO update of the LoRA -> optional AR step -> weight push to engines that
keep their own copy -> held-out eval, logs, atomic checkpoint.

Under torchrun every rank runs this same story on its own device with its own engine,
on its share of each global batch (see nla_shell.training.distributed); the update, the critic
step and the metrics reduce over ranks, and rank 0 alone claims the run directory,
evaluates, logs and saves.

Where each part lives: `training.setup` builds the run's state (`setup(cfg) -> RunState`, resumed
from a checkpoint when there is one; RunState is `training.run_state`'s), `training.step` runs a
step's phases (`train_step`), and this module is the loop around them: preemption, the held-out
eval, logging, checkpoints and the summary.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

import nla_core
from nla_shell import families
from nla_shell.engines.base import RolloutEngine, sample_explanations
from nla_shell.io.config import ConfigError
from nla_shell.training.config import TrainConfig
from nla_shell.io.files import write_text_atomically
from nla_shell.io.logging import NullLogger, read_metrics
from nla_shell.io.paths import require_file, require_model
from nla_shell.io.progress import progress_bar
from nla_shell.io.sidecars import MODEL_SIDECAR, model_sidecar, write_sidecar
from nla_shell.metrics import fve_metrics, token_lengths
from nla_shell.models import ARModel, base_model_dir, is_ar_lora_dir
from nla_shell.quant import require_quant
from nla_shell.training import checkpoint as ckpt
from nla_shell.training import distributed, sampling, sharding
from nla_shell.training.preemption import StopSignals, boundary_save_due
from nla_shell.training.runlock import RunDirLock
from nla_shell.training.scoring import score_explanations
from nla_shell.training.run_state import RunState
from nla_shell.training.setup import CRITIC_EMA_FILE, setup
from nla_shell.training.runtime import resolve_device, say
from nla_shell.training.step import train_step
from nla_shell.training.stopped import OutOfGPUMemory


def check_paths(cfg: TrainConfig) -> None:
    """Every input path exists (or is a hub id where one may be), before any hub call or write."""
    require_model("av_ckpt", cfg.av_ckpt)
    require_model("ar_ckpt", cfg.ar_ckpt, hub_ok=False)
    require_model("resume_from_lora", cfg.resume_from_lora, hub_ok=False)
    for key in ("rl_parquet", "eval_parquet", "sidecar"):
        require_file(key, getattr(cfg, key))


# --------------------------------------------------------------------------- the run


def train(cfg: TrainConfig) -> Path:
    """Run (or resume) GRPO training as configured; returns save_dir.

    One process, or one rank of a torchrun job (RANK / WORLD_SIZE / LOCAL_RANK in the
    environment): then the ranks join a process group (NCCL on CUDA, gloo on CPU) for the
    run, and the batch must split into equal shares of whole prompts.
    """
    check_paths(cfg)
    from transformers import AutoConfig

    rank = distributed.rank_info()
    sharding.check_supported(cfg, rank.world_size)
    device, dtype = resolve_device(cfg.device, cfg.dtype, rank)
    families.require_engine(AutoConfig.from_pretrained(base_model_dir(cfg.av_ckpt)), cfg.engine)
    require_quant(cfg.quant, device, engine=cfg.engine, trains_ar_backbone=cfg.train_critic and not is_ar_lora_dir(cfg.ar_ckpt))
    if rank.world_size > 1 and cfg.engine == "vllm" and cfg.vllm_tp != 1:
        # Each rank runs a vLLM engine of its own on its own GPU (VLLMRolloutEngine's per_rank).
        raise ConfigError(
            f"config key 'vllm_tp' = {cfg.vllm_tp} is not supported under torchrun ({rank.world_size} ranks): "
            "each rank runs its own vLLM engine on its own GPU; set vllm_tp=1"
        )
    if cfg.engine == "vllm":
        from nla_shell.engines.vllm import require_vllm

        require_vllm()  # before anything is written: say how to install it
    distributed.check_divisible("batch_prompts", cfg.batch_prompts, rank.world_size)
    # Rank 0 holds the run dir's lock for the whole run; a signal stops every rank at one step.
    with distributed.process_group(rank, device, single=cfg.sharding == "fsdp2"), RunDirLock(cfg.save_dir), StopSignals(cfg.save_dir) as stop:
        return loop(setup(cfg, rank, device, dtype), stop)


def loop(state: RunState, stop: StopSignals) -> Path:
    """The steps left to run, as one rank sees them (the only one, outside torchrun): preemption,
    the step, the held-out eval, logging, checkpoints; then the final eval and the summary.

    Raises preemption.RunStopped when a signal stops it (after saving, if save_on_signal).
    """
    cfg, rank, device, save_dir = state.cfg, state.rank, state.device, state.save_dir
    # Rank 0 evaluates alone, the others wait; under sharding=fsdp2 every rank runs the eval with it (each forward
    # gathers blocks from every rank), and rank 0's is the one logged.
    evaluates = rank.is_main or cfg.sharding == "fsdp2"
    # Off a terminal the console logger's step lines are the progress; a run without it gets progress lines.
    bar = progress_bar(total=cfg.num_steps, initial=state.start_step, desc="train", unit="step", enabled=rank.is_main,
                       lines="console" not in cfg.logger)
    for step in range(state.start_step, cfg.num_steps):
        # A signal ends the run here, between steps, on every rank at once.
        if stop.should_stop(step):
            if boundary_save_due(step, start_step=state.start_step, save_every=cfg.save_every,
                                 save_on_signal=cfg.save_on_signal):
                save(state, step)
            finish(state, bar, step)
            raise stop.stopped(ckpt.latest_checkpoint(save_dir), command="train")
        try:
            record = train_step(state, step)
        except OutOfGPUMemory as err:  # the one-line error says where the run resumes from
            raise err.with_checkpoint(ckpt.latest_checkpoint(save_dir)) from err.__cause__
        # The held-out eval (document-disjoint rows).
        if state.eval_on and step % cfg.eval_every == 0:
            if evaluates:
                record.update(held_out(state, step, state.logger))
            distributed.barrier()
        state.logger.log(step, record)
        state.last_record = {"step": step, **record}
        bar.update()
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.num_steps:
            save(state, step + 1)

    # A held-out point at the final step (summary.json only; its own RNG, so resume stays exact).
    # Decided from the step alone, so every rank takes the same branch (only rank 0's eval is written).
    final_eval, last = None, state.last_record
    if state.eval_on and last and last["step"] % cfg.eval_every != 0:
        if evaluates:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                final_eval = {"step": last["step"], **held_out(state, last["step"], NullLogger())}
        distributed.barrier()
    finish(state, bar, max(state.start_step, cfg.num_steps), final_eval)
    if rank.is_main:
        say(f"[nla train] done: {cfg.num_steps} step{'s' if cfg.num_steps != 1 else ''}; checkpoint {ckpt.checkpoint_dir(save_dir, cfg.num_steps)} "
            f"(adapter/ is the AV{', critic/ the AR' if cfg.train_critic else ''}); metrics {save_dir / 'metrics.jsonl'}, "
            f"summary {save_dir / 'summary.json'}; curves: nla plot {save_dir}")
    return save_dir


def save(state: RunState, step_done: int) -> None:
    """The checkpoint after `step_done` steps: adapter, critic (and its EMA), optimisers, data cursor, RNG.

    Every rank calls this (gathering the RNG states is a collective; under sharding=fsdp2 so are gathering the
    LoRA and the critic, and every rank writes its shard of the optimisers' moments); rank 0 writes the rest.
    """
    cfg, rank, save_dir = state.cfg, state.rank, state.save_dir
    rng_states = distributed.all_gather(ckpt.rng_state())
    sharded = cfg.sharding == "fsdp2"
    adapter = sharding.full_trainable_state(state.actor) if sharded else None
    critic = sharding.full_critic_state(state.critic) if sharded and cfg.train_critic else None
    shards = save_shards(state, step_done) if sharded else None
    optimizers = {} if sharded else {name: o.state_dict() for name, (_, o) in state.optimized.items()}
    if not rank.is_main:
        return
    extra: dict[str, Any] = {"skipped_steps": state.skipped_steps}
    if rank.world_size > 1:
        extra["rank_rng"] = rng_states

    def write(tmp: Path) -> None:
        state.actor.save_pretrained(tmp / "adapter", selected_adapters=["default"], state_dict=adapter)
        write_sidecar(sidecar_for(state, "av"), tmp / "adapter" / MODEL_SIDECAR)
        if cfg.train_critic:
            state.critic.save_pretrained(tmp / "critic", tensors=critic)
            if state.critic_ema is not None:
                save_file(state.critic_ema.state_dict(), str(tmp / CRITIC_EMA_FILE))
            write_sidecar(sidecar_for(state, "ar"), tmp / "critic" / MODEL_SIDECAR)
        if shards is not None:
            os.replace(shards, tmp / ckpt.OPTIMIZER_SHARDS_NAME)
        ckpt.save_training_state(
            tmp, step=step_done, data_cursor=state.order.state(), optimizer_states=optimizers,
            rng=rng_states[0], extra=extra,
        )
        (tmp / ckpt.CONFIG_NAME).write_text((save_dir / ckpt.CONFIG_NAME).read_text())

    # keep_last protects the checkpoint with the best held-out score; this step's eval scored these weights.
    path = ckpt.save_checkpoint(save_dir, step_done, write=write,
                                metrics={"eval/fve": state.last_record.get("eval/fve")})
    say(f"[save] {path}")
    if cfg.keep_last is not None:
        for pruned in ckpt.prune_checkpoints(save_dir, keep_last=cfg.keep_last, best_by="eval/fve"):
            say(f"[save] pruned {pruned.name} (keep_last={cfg.keep_last})")


def save_shards(state: RunState, step_done: int) -> Path:
    """Every rank's shard of the optimisers' moments (sharding=fsdp2), in the directory that rank 0's save then
    takes into the checkpoint."""
    directory = ckpt.shards_dir(state.save_dir, step_done)

    def fresh() -> None:
        shutil.rmtree(directory, ignore_errors=True)  # left by a run killed mid-save
        directory.mkdir()

    distributed.on_main(fresh)
    sharding.save_optimizer_shards(state.optimized, directory)
    distributed.barrier()
    return directory


def sidecar_for(state: RunState, role: str) -> dict[str, Any]:
    """The nla_meta.yaml a checkpoint's AV ("av") or AR ("ar") carries, with the run's predict-the-mean baselines
    (a co-trained AR's fve_nrm divides by those of the activations it trained on, as an SFT'd AR's does)."""
    cfg = state.cfg
    baselines = nla_core.Baselines(meannorm=torch.tensor(state.meannorm), rawvar=torch.tensor(state.rawvar))
    return model_sidecar(state.nla, role=role, stage="rl", base_checkpoint=str(base_model_dir(cfg.av_ckpt)),
                         injection=state.injector.injection,
                         trained_on=[str(Path(cfg.rl_parquet).resolve())], baselines=baselines)


def held_out(state: RunState, step: int, step_logger) -> dict[str, float]:
    """The held-out eval at `step` (rank 0; every rank under sharding=fsdp2), scored with the critic's EMA when
    there is one."""
    cfg = state.cfg
    with sampling.scoring_weights(state.critic_ema):
        return evaluate_rows(
            state.eval_engine.current(), state.critic, state.tokenizer, state.eval_rows, state.eval_prompt_ids,
            logger=step_logger, step=step, max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens,
            rawvar=state.rawvar, meannorm=state.meannorm, score_kwargs=state.score_kwargs,
        )


def finish(state: RunState, bar, steps_done: int, final_eval: dict[str, Any] | None = None) -> None:
    """Close the bar, the engine and the logger; rank 0 writes summary.json."""
    bar.close()
    state.engine.close()
    state.logger.close()
    if state.rank.is_main:
        write_summary(state.save_dir, steps_done=steps_done, rawvar=state.rawvar, meannorm=state.meannorm,
                      final_eval=final_eval)


def evaluate_rows(
    engine: RolloutEngine,
    critic: ARModel,
    tokenizer,
    rows,
    prompt_ids,
    *,
    logger,
    step: int,
    max_new_tokens: int,
    rawvar: float,
    meannorm: float,
    score_kwargs: dict[str, Any],
) -> dict[str, float]:
    """One sample per held-out prompt: reward, FVE (both baselines), extraction rate, length, samples table."""
    golds = torch.stack([r.activation for r in rows])
    explanations = sample_explanations(engine, prompt_ids, golds, max_new_tokens=max_new_tokens)
    scores = score_explanations(critic, tokenizer, explanations, golds, **score_kwargs)
    lengths = [n for n in token_lengths(explanations, tokenizer) if n is not None]
    logger.log_table(
        "eval_samples",
        ["step", "idx", "doc_id", "reward", "mse", "fve", "extracted", "explanation"],
        [
            [step, i, rows[i].doc_id, float(scores.reward[i]), float(scores.mse[i]),
             float(nla_core.fve(scores.mse[i], rawvar)), explanations[i] is not None,
             (explanations[i] if explanations[i] is not None else "<extraction failed>")[:500]]
            for i in range(len(rows))
        ],
    )
    metrics = fve_metrics(scores.mse, scores.reward, scores.valid, rawvar=rawvar, meannorm=meannorm, prefix="eval/")
    return {
        **metrics,
        "eval/explanation_tokens_mean": float(np.mean(lengths)) if lengths else math.nan,
        # The reference's keys, for dashboards built on it.
        "eval/reward_mean_valid": float(scores.reward[scores.valid].mean()) if bool(scores.valid.any()) else math.nan,
        "eval/mse_mean_valid": metrics["eval/mse_mean"],
        "eval/fve_pct": 100.0 * metrics["eval/fve"],
    }


def write_summary(
    save_dir: Path, *, steps_done: int, rawvar: float, meannorm: float, final_eval: dict[str, Any] | None = None
) -> None:
    """save_dir/summary.json: the last completed step's metrics, its checkpoint, the FVE baselines.

    `steps_done` counts finished steps, like the step_NNNNNN dir names; "final" is the
    metrics.jsonl record of the last of them (its "step" is the 0-based index, steps_done
    - 1), read back from the file, so a rerun that has nothing left to do (or follows a
    kill before the summary was written) writes the same summary as the run that did the
    work. final_eval is the held-out eval run after the last step when that step was not
    an eval step (`nla plot` draws it as the held-out series' last point); a rerun that
    ran no step keeps the one already in summary.json. Written to a temp file and
    renamed: never torn.
    """
    final: dict[str, Any] = {}
    metrics_path = save_dir / "metrics.jsonl"
    if metrics_path.exists():
        final = next((r for r in reversed(read_metrics(metrics_path)) if r.get("step") == steps_done - 1), {})
    summary_path = save_dir / "summary.json"
    if final_eval is None and summary_path.exists():
        try:
            kept = json.loads(summary_path.read_text(encoding="utf-8")).get("final_eval")
        except (json.JSONDecodeError, AttributeError):
            kept = None
        final_eval = kept if isinstance(kept, dict) and kept.get("step") == steps_done - 1 else None
    checkpoint = ckpt.checkpoint_dir(save_dir, steps_done)
    summary: dict[str, Any] = {
        "steps_done": steps_done,
        "checkpoint": checkpoint.name if (checkpoint / ckpt.COMPLETE).is_file() else None,
        "final": final,
        "baselines": {"rawvar": rawvar, "meannorm": meannorm},
    }
    if final_eval is not None:
        summary["final_eval"] = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                 for k, v in final_eval.items()}
    write_text_atomically(summary_path, json.dumps(summary, indent=2))
