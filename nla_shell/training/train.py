"""`nla train`: GRPO on the activation verbaliser, scored by the activation reconstructor.

One step: sample B prompts -> the engine writes G explanations each -> the AR reconstructs
the activation from each -> reward = -log(normalised MSE) -> group-relative advantages ->
micro-batched GRPO update of the LoRA -> optional AR step -> weight push to engines that
keep their own copy -> held-out eval, logs, atomic checkpoint.

Under torchrun every rank runs this same story on its own device with its own engine,
on its share of each global batch (see nla_shell.training.distributed); the update, the critic
step and the metrics reduce over ranks, and rank 0 alone claims the run directory,
evaluates, logs and saves.
"""

from __future__ import annotations

import json
import math
import random
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

import nla_core
from nla_shell import families
from nla_shell.training import checkpoint as ckpt
from nla_shell.training import distributed
from nla_shell.io.config import (
    RESUME_MUTABLE_KEYS, ConfigError, TrainConfig, config_defaults, config_to_dict, save_config,
)
from nla_shell.io.data import (
    DataError, RLRow, build_prompt_ids, check_tokenizer, load_eval_rows, load_rows, parquet_num_rows, row_windows,
)
from nla_shell.io.sidecars import MODEL_SIDECAR, injection_settings, load_sidecar, model_sidecar, write_sidecar
from nla_shell.engines.base import RolloutEngine, RolloutRequest, held_awake, sample_explanations
from nla_shell.training.distributed import RankInfo
from nla_shell.training.preemption import StopSignals, boundary_save_due
from nla_shell.training.runlock import RunDirLock
from nla_shell.training.stopped import RunSpoiledError
from nla_shell.io.files import write_text_atomically
from nla_shell.io.logging import NullLogger, make_logger, read_metrics
from nla_shell.io.paths import require_file, require_model
from nla_shell.io.progress import progress_bar, say_line
from nla_shell.metrics import cjk_fraction, fve_metrics, token_lengths
from nla_shell.models import (
    ARModel, BackboneAutocast, CompiledBlockParts, Injector, base_model_dir, eos_token_ids, inner_lm, is_adapter_dir,
    is_ar_lora_dir, load_actor, trainable_parameters,
)
from nla_shell.quant import require_quant
from nla_shell.training import sampling
from nla_shell.training.memory import resolve_micro_batches
from nla_shell.training.scoring import (
    DeviceTimer, critic_step, score_and_train_critic, score_explanations, shape_rewards,
)
from nla_shell.training.update import LossOptions, policy_update


CRITIC_EMA_FILE = "critic_ema.safetensors"
"""A checkpoint's EMA of the critic's trained weights (critic_ema), in trainable_parameters order."""

# --------------------------------------------------------------------------- small pieces


def resolve_device(device: str, dtype: str, rank: RankInfo = RankInfo()) -> tuple[torch.device, torch.dtype]:
    """"auto" -> cuda when available, else cpu; dtype "auto" -> bf16 on cuda, fp32 on cpu.

    Under torchrun each rank takes its own GPU: "auto" and "cuda" become cuda:LOCAL_RANK.
    """
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available; use device=cpu or device=auto")
    if dev.type == "cuda" and rank.world_size > 1:
        if dev.index is not None:
            raise ConfigError(
                f"config key 'device' = {device!r} is invalid under torchrun: every rank uses the GPU "
                "of its LOCAL_RANK; use device=cuda or device=auto"
            )
        if rank.local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"rank {rank.rank} has LOCAL_RANK {rank.local_rank} but only {torch.cuda.device_count()} GPU(s) "
                "are visible: launch at most one rank per GPU (--nproc / --nproc_per_node)"
            )
        dev = torch.device("cuda", rank.local_rank)
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dev, {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def make_optimizer(params: list[torch.nn.Parameter], lr: float, *, device: torch.device, label: str) -> torch.optim.Optimizer:
    """8-bit AdamW (bitsandbytes) on CUDA when installed, else torch AdamW; says which."""
    if device.type == "cuda":
        try:
            import bitsandbytes as bnb

            say(f"[optim] {label}: bitsandbytes AdamW8bit")
            return bnb.optim.AdamW8bit(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        except ImportError:
            pass
    say(f"[optim] {label}: torch AdamW (fp32 moments)")
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def make_engine(cfg: TrainConfig, actor, injector: Injector, tokenizer, *, layer_index: int,
                eos_ids: tuple[int, ...]) -> RolloutEngine:
    if cfg.engine == "hf":
        from nla_shell.engines.hf import HFRolloutEngine

        return HFRolloutEngine(actor, injector, tokenizer)
    if cfg.engine == "native":
        from nla_shell.engines.native import NativeRolloutEngine

        return NativeRolloutEngine(actor, injector, tokenizer)
    from nla_shell.engines.vllm import VLLMRolloutEngine

    # vLLM loads the base weights; the trainer's first sync pushes the LoRA-merged actor.
    return VLLMRolloutEngine(
        base_model_dir(cfg.av_ckpt),
        tokenizer,
        marker_id=injector.marker_id,
        left_id=injector.left_id,
        right_id=injector.right_id,
        injection_layer=layer_index,
        injection_style=injector.style,
        injection_norm=injector.injection_norm,
        gpu_memory_utilization=cfg.vllm_gpu_mem,
        max_model_len=cfg.vllm_max_len,
        tensor_parallel_size=cfg.vllm_tp,
        enable_prefix_caching=cfg.vllm_prefix_caching,
        max_num_seqs=cfg.vllm_max_seqs,
        kv_cache_gib=cfg.vllm_kv_cache_gib,
        sleep_level=cfg.vllm_sleep,
        eos_ids=eos_ids,
        # Under torchrun each rank's engine runs on the rank's GPU and samples from a stream of its own.
        seed=distributed.rank_seed(cfg.seed, distributed.rank_info().rank) if distributed.active() else cfg.seed,
        per_rank=distributed.active(),
    )


def say(message: str, *, error: bool = False) -> None:
    """Print on rank 0 only: every rank runs the same story, one voice tells it (above the progress bar)."""
    if distributed.is_main():
        say_line(message, error=error)


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's (CPU and CUDA) global RNGs."""
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed)


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is KiB on Linux: the process's peak resident memory.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


@dataclass
class DataOrder:
    """Epoch-wise seeded permutations of the training rows; the cursor is (epoch, offset)."""

    n_rows: int
    seed: int
    epoch: int = 0
    offset: int = 0

    def next_batch(self, size: int) -> list[int]:
        if self.offset + size > self.n_rows:
            self.epoch, self.offset = self.epoch + 1, 0
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n_rows)
        picked = order[self.offset : self.offset + size].tolist()
        self.offset += size
        return picked

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}


CANARY_PATIENCE = 3
"""Failed canaries in a row that stop a run under vllm_canary=stop."""


class CanaryWatch:
    """The per-step verdict on the steering canary: a failed reading (0: the vector changed nothing; NaN: no
    reading) warns, and CANARY_PATIENCE of them in a row stop the run when `stop`."""

    def __init__(self, *, stop: bool, patience: int = CANARY_PATIENCE) -> None:
        self.stop, self.patience = stop, patience
        self.failed_steps: list[int] = []
        """Steps of the current run of failed readings."""

    def check(self, step: int, reading: float) -> str | None:
        """A warning line when `reading` failed (None when it passed); raises RunSpoiledError at the
        patience-th failure in a row, when stopping."""
        if reading > 0:  # False for 0 and for NaN
            self.failed_steps = []
            return None
        self.failed_steps.append(step)
        steps = ", ".join(map(str, self.failed_steps))
        if self.stop and len(self.failed_steps) >= self.patience:
            raise RunSpoiledError(
                f"steering canary failed at steps {steps} (read {reading}): vLLM's rollouts are not steered, the "
                "injected vector does not reach the model (is vllm==0.24.0 with nla's plugin installed?); stopped "
                f"before step {step}'s update (a checkpoint after step {self.failed_steps[0]} holds updates from "
                "unsteered rollouts); vllm_canary=warn goes on regardless"
            )
        return (f"[warn] step {step}: steering canary read {reading}: the engine's rollouts are unsteered "
                f"({len(self.failed_steps)} step(s) in a row"
                + (f"; the run stops at {self.patience})" if self.stop else "; vllm_canary=warn keeps going)"))


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan}
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), "std": float(arr.std()), "min": float(arr.min()), "max": float(arr.max())}


def load_train_and_eval_rows(cfg: TrainConfig, nla: nla_core.NLAConfig) -> tuple[list[RLRow], list[RLRow]]:
    """The training rows and the held-out eval rows (none when eval is off), as `cfg` windows them.

    Held-out rows come from eval_parquet when given, else from rl_parquet past the training
    window (data.row_windows); either way only rows of documents unseen in training.
    """
    eval_on = cfg.eval_every > 0 and cfg.eval_n_prompts > 0
    windows = row_windows(
        parquet_num_rows(cfg.rl_parquet), max_rows=cfg.max_rows, eval_skip_rows=cfg.eval_skip_rows,
        n_eval=cfg.eval_n_prompts if eval_on and cfg.eval_parquet is None else 0,
    )
    rows = load_rows(cfg.rl_parquet, nla, max_rows=windows.train_stop, min_rows=cfg.batch_prompts)
    if not eval_on:
        return rows, []
    train_docs = [r.doc_id for r in rows]
    if cfg.eval_parquet is not None:
        check_same_geometry(nla, cfg.eval_parquet)
        eval_rows = load_eval_rows(cfg.eval_parquet, nla, skip_rows=0, n=cfg.eval_n_prompts, train_doc_ids=train_docs,
                                   key="eval_parquet")
        where = cfg.eval_parquet
    else:
        eval_rows = load_eval_rows(cfg.rl_parquet, nla, skip_rows=windows.eval_start, n=cfg.eval_n_prompts,
                                   train_doc_ids=train_docs)
        where = f"{cfg.rl_parquet} rows {windows.eval_start}+ (training reads rows [0, {windows.train_stop}))"
    say(f"[data] {len(rows)} training rows; held-out eval: {len(eval_rows)} rows of unseen documents from {where}")
    return rows, eval_rows


def check_same_geometry(nla: nla_core.NLAConfig, parquet: str) -> None:
    """A second parquet (the eval split) whose own sidecar, if any, agrees with `nla` on D, layer and marker."""
    try:
        other = load_sidecar(parquet)
    except DataError:
        return  # no sidecar of its own: the schema check still holds it to nla's D
    for name in ("d_model", "extraction_layer_index", "injection_char", "injection_token_id"):
        if getattr(other, name) != getattr(nla, name):
            raise DataError(
                f"eval_parquet: {parquet}'s sidecar has {name} {getattr(other, name)!r}, rl_parquet's has "
                f"{getattr(nla, name)!r}; give the eval split written by the same nla datagen run"
            )


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
    with distributed.process_group(rank, device), RunDirLock(cfg.save_dir), StopSignals(cfg.save_dir) as stop:
        return run_ranked(cfg, rank, device, dtype, stop)


def run_ranked(cfg: TrainConfig, rank: RankInfo, device: torch.device, dtype: torch.dtype, stop: StopSignals) -> Path:
    """The training run as seen by one rank (the only one, outside torchrun).

    Raises preemption.RunStopped when a signal stops it (after saving, if save_on_signal).
    """
    # --- validate every input before anything is written ------------------------------
    if cfg.bf16_autocast and dtype != torch.bfloat16:
        raise ConfigError(
            f"config key 'bf16_autocast' = true needs the models in bfloat16 but dtype resolves to {dtype}: "
            "set dtype=bfloat16 (auto is bfloat16 on a GPU) or bf16_autocast=false"
        )
    tokenizer = families.load_tokenizer(cfg.av_ckpt)
    nla = load_sidecar(cfg.sidecar or cfg.rl_parquet)
    style, injection_norm = injection_settings(nla, style=cfg.injection_style, scale=cfg.injection_scale, av_dir=cfg.av_ckpt)
    check_tokenizer(nla, tokenizer)
    mse_scale = nla_core.resolve_target_scale(nla.mse_scale, nla.d_model)
    rows, eval_rows = load_train_and_eval_rows(cfg, nla)
    prompt_ids = [build_prompt_ids(r.prompt, nla, tokenizer, row=r.index) for r in rows]
    eval_on = bool(eval_rows)
    eval_prompt_ids = [build_prompt_ids(r.prompt, nla, tokenizer, row=r.index) for r in eval_rows]
    critic = ARModel.from_pretrained(cfg.ar_ckpt, mse_scale=mse_scale, dtype=dtype, device=device, quant=cfg.quant)
    if critic.lm.config.hidden_size != nla.d_model:
        raise ValueError(f"ar_ckpt has hidden size {critic.lm.config.hidden_size}, the sidecar's d_model is {nla.d_model}")

    save_dir = Path(cfg.save_dir)
    config_dict = config_to_dict(cfg)
    continues_sft = is_adapter_dir(cfg.av_ckpt) and cfg.sft_adapter == "continue"
    # A continued SFT adapter keeps its own rank and alpha: the lora_* keys decide nothing then.
    mutable_keys = RESUME_MUTABLE_KEYS | ({"lora_r", "lora_alpha", "use_rslora"} if continues_sft else set())

    def claim() -> Path | None:
        ckpt.claim_save_dir(save_dir, config_dict, overwrite=cfg.overwrite, resume=cfg.resume, mutable_keys=mutable_keys,
                            defaults=config_defaults(TrainConfig), num_steps=cfg.num_steps)
        ckpt.remove_stale_entries(save_dir)  # under the lock: no other run's save is in flight
        if cfg.resume != "auto":
            return None
        needed = ("adapter", ckpt.TRAINING_STATE_NAME, *(("critic",) if cfg.train_critic else ()),
                  *((CRITIC_EMA_FILE,) if cfg.critic_ema is not None else ()))
        return ckpt.latest_verified_checkpoint(save_dir, required=needed)

    # Rank 0 claims the directory and picks the checkpoint; every rank resumes from that one.
    resume_from = distributed.on_main(claim)

    # --- models (the same seed on every rank: identical initial LoRA) ---------------------
    seed_everything(cfg.seed)
    actor = load_actor(
        cfg.av_ckpt,
        lora_r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        use_rslora=cfg.use_rslora,
        resume_adapter=(resume_from / "adapter") if resume_from else cfg.resume_from_lora,
        dtype=dtype,
        device=device,
        gradient_checkpointing=cfg.gradient_checkpointing,
        merge_sft_adapter=cfg.sft_adapter == "merge",
        quant=cfg.quant,
    )
    if cfg.bf16_autocast:
        BackboneAutocast(actor, torch.bfloat16)  # for the actor's lifetime: engines see it too
    say_actor_start(cfg, actor, continues_sft=continues_sft)
    if nla.injection_token_id >= actor.get_base_model().config.vocab_size:
        raise ValueError(f"sidecar's injection_token_id {nla.injection_token_id} is outside the AV's vocabulary")
    injector = Injector(
        actor,
        marker_id=nla.injection_token_id,
        left_id=nla.injection_left_neighbor_id,
        right_id=nla.injection_right_neighbor_id,
        style=style,
        injection_norm=injection_norm,
    )
    if resume_from is not None and cfg.train_critic:
        critic = ARModel.from_pretrained(resume_from / "critic", mse_scale=mse_scale, dtype=dtype, device=device)
    critic.requires_grad_(cfg.train_critic)
    critic.eval()  # Qwen3 has no dropout: eval mode serves the gradient steps too
    if cfg.compile_blocks:  # for the run
        CompiledBlockParts(actor)
        CompiledBlockParts(critic.lm)
    distributed.broadcast_parameters(trainable_parameters(actor))

    # --- engine, optimisers, baselines ---------------------------------------------------
    eos_ids = eos_token_ids(inner_lm(actor).generation_config, tokenizer)  # every one stops a rollout
    engine = make_engine(cfg, actor, injector, tokenizer, layer_index=1, eos_ids=eos_ids)
    optimizer = make_optimizer(trainable_parameters(actor), cfg.lr, device=device, label="actor")
    critic_optimizer = (
        make_optimizer(trainable_parameters(critic), cfg.critic_lr, device=device, label="critic")
        if cfg.train_critic
        else None
    )
    critic_ema = sampling.CriticEMA(critic, cfg.critic_ema) if cfg.critic_ema is not None else None
    if critic_ema is not None and resume_from is not None:
        critic_ema.load_state_dict(load_file(str(resume_from / CRITIC_EMA_FILE)))
    baselines = nla_core.predict_mean_baselines(
        torch.stack([r.activation for r in rows[:4000]]), scale=mse_scale
    )
    rawvar, meannorm = float(baselines.rawvar), float(baselines.meannorm)
    say(f"[fve] predict-the-mean mse: rawvar {rawvar:.4f} (paper), meannorm {meannorm:.4f}")

    # --- resume; one sampling RNG stream per rank -------------------------------------------
    # The data order is global: every rank draws the same batch, then takes its share.
    order = DataOrder(len(rows), cfg.seed)
    start_step, skipped_steps = cfg.start_step, 0
    if resume_from is not None:
        state = ckpt.load_training_state(resume_from)
        start_step = state.step
        order.epoch, order.offset = state.data_cursor["epoch"], state.data_cursor["offset"]
        ckpt.restore_optimizer(optimizer, state, "actor", resume_from)
        if critic_optimizer is not None:
            ckpt.restore_optimizer(critic_optimizer, state, "critic", resume_from)
        skipped_steps = int(state.extra.get("skipped_steps", 0))
        restore_rank_rng(state, rank, seed=cfg.seed, step=start_step)
        say(f"[resume] from {resume_from} at step {start_step}")
    elif rank.world_size > 1:
        # Ranks must not sample alike (a one-process run keeps the stream seeded above).
        seed_everything(distributed.rank_seed(cfg.seed, rank.rank))
    # --- micro-batches: "auto" sized by the memory the models and the engine left free ---------
    free_bytes = None
    if device.type == "cuda":  # the tightest rank's, so that every rank runs (and records) the same
        free_bytes = -int(distributed.all_reduce_max([-torch.cuda.mem_get_info(device)[0]])[0])
    cfg, chosen = resolve_micro_batches(
        cfg, inner_lm(actor).config, free_bytes=free_bytes, tokens=max(map(len, prompt_ids)) + cfg.max_new_tokens,
        dtype_bytes=torch.finfo(dtype).bits // 8, resumed=ckpt.saved_config(resume_from) if resume_from else None,
    )
    if chosen is not None:
        say(chosen)
        config_dict = config_to_dict(cfg)
        if rank.is_main:
            save_config(cfg, save_dir / ckpt.CONFIG_NAME)
    logger = (
        make_logger(
            cfg.logger, save_dir=save_dir, config_dict=config_dict, project=cfg.wandb_project,
            run_name=cfg.wandb_name, start_step=start_step,
        )
        if rank.is_main
        else NullLogger()
    )
    if not engine.shares_actor_weights:
        say(f"[sync] initial weight push: {engine.sync_weights(actor):.2f}s")
        if eval_on and cfg.vllm_sync_every != 1:
            say(f"[eval] vllm_sync_every={cfg.vllm_sync_every}: at eval steps whose update was not pushed to "
                f"{cfg.engine}, the held-out eval samples from the trainer's actor (HF generate) instead")
    eval_engine = EvalEngine(engine, actor, injector, tokenizer)

    def sidecar_for(role: str) -> dict[str, Any]:
        return model_sidecar(nla, role=role, stage="rl", base_checkpoint=str(base_model_dir(cfg.av_ckpt)),
                             injection_style=injector.style, injection_norm=injector.injection_norm,
                             trained_on=[str(Path(cfg.rl_parquet).resolve())])

    def save(step_done: int) -> None:
        # Every rank calls this (gathering the RNG states is a collective); rank 0 writes.
        rng_states = distributed.all_gather(ckpt.rng_state())
        if not rank.is_main:
            return
        extra: dict[str, Any] = {"skipped_steps": skipped_steps}
        if rank.world_size > 1:
            extra["rank_rng"] = rng_states

        def write(tmp: Path) -> None:
            actor.save_pretrained(tmp / "adapter", selected_adapters=["default"])
            write_sidecar(sidecar_for("av"), tmp / "adapter" / MODEL_SIDECAR)
            if cfg.train_critic:
                critic.save_pretrained(tmp / "critic")
                if critic_ema is not None:
                    save_file(critic_ema.state_dict(), str(tmp / CRITIC_EMA_FILE))
                write_sidecar(sidecar_for("ar"), tmp / "critic" / MODEL_SIDECAR)
            optimizers = {"actor": optimizer.state_dict()}
            if critic_optimizer is not None:
                optimizers["critic"] = critic_optimizer.state_dict()
            ckpt.save_training_state(
                tmp, step=step_done, data_cursor=order.state(), optimizer_states=optimizers,
                rng=rng_states[0], extra=extra,
            )
            (tmp / ckpt.CONFIG_NAME).write_text((save_dir / ckpt.CONFIG_NAME).read_text())

        # keep_last protects the checkpoint with the best held-out score; this step's eval scored these weights.
        path = ckpt.save_checkpoint(save_dir, step_done, write=write, metrics={"eval/fve": last_record.get("eval/fve")})
        say(f"[save] {path}")
        if cfg.keep_last is not None:
            for pruned in ckpt.prune_checkpoints(save_dir, keep_last=cfg.keep_last, best_by="eval/fve"):
                say(f"[save] pruned {pruned.name} (keep_last={cfg.keep_last})")

    loss_options = LossOptions(
        policy_loss=cfg.policy_loss, clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high, kl_beta=cfg.kl_beta,
        kl_clamp=cfg.kl_clamp, tis=None if cfg.tis == "none" else cfg.tis, tis_cap=cfg.tis_cap,
        aggregation=cfg.aggregation, max_len=cfg.max_new_tokens,
        token_mask=None if cfg.token_mask is None else (cfg.token_mask[0], cfg.token_mask[1]), kl_metric=cfg.kl_metric,
    )
    # The critic steps in the scoring forward (reference), unless it learns from chosen pairs or scores with an EMA.
    critic_steps_after_scoring = cfg.critic_rollouts != "all" or cfg.critic_ema is not None or cfg.dynamic_sampling
    score_kwargs = dict(
        template=nla.critic_prompt_template, mse_scale=mse_scale, reward_kind=cfg.reward,
        max_tokens=cfg.max_explanation_tokens, micro_batch=cfg.critic_micro_batch,
    )
    last_record: dict[str, Any] = {}
    canary_watch = CanaryWatch(stop=cfg.vllm_canary == "stop")
    bar = progress_bar(total=cfg.num_steps, initial=start_step, desc="train", unit="step",
                       enabled=rank.is_main)

    def held_out(step: int, step_logger) -> dict[str, float]:
        """The held-out eval at `step` (rank 0 only)."""
        with sampling.scoring_weights(critic_ema):
            return evaluate_rows(
                eval_engine.current(), critic, tokenizer, eval_rows, eval_prompt_ids, logger=step_logger, step=step,
                max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens, rawvar=rawvar, meannorm=meannorm,
                score_kwargs=score_kwargs,
            )

    def finish(steps_done: int, final_eval: dict[str, Any] | None = None) -> None:
        """Close the bar, the engine and the logger; rank 0 writes summary.json."""
        bar.close()
        engine.close()
        logger.close()
        if rank.is_main:
            write_summary(save_dir, steps_done=steps_done, rawvar=rawvar, meannorm=meannorm, final_eval=final_eval)

    for step in range(start_step, cfg.num_steps):
        # --- preemption: a signal ends the run here, between steps, on every rank at once ----
        if stop.should_stop(step):
            if boundary_save_due(step, start_step=start_step, save_every=cfg.save_every,
                                 save_on_signal=cfg.save_on_signal):
                save(step)
            finish(step)
            raise stop.stopped(ckpt.latest_checkpoint(save_dir), command="train")

        t_step = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

        # --- rollouts: this rank's share of the global batch, whole prompts -----------------
        t0 = time.perf_counter()
        batch_idx = distributed.shard(order.next_batch(cfg.batch_prompts), rank)
        requests = [RolloutRequest(tuple(prompt_ids[i]), rows[i].activation) for i in batch_idx]
        with held_awake(engine):  # vllm_sleep: one wake-up (and weight push) serves rollouts and canary
            rollouts = engine.generate(requests, group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens)
            # Engines that steer on their own (vLLM) prove each step that the vector still lands:
            # a canary of 0 means rollouts came from an unsteered model the trainer never sees.
            canary = engine.steering_canary(requests[0]) if hasattr(engine, "steering_canary") else math.nan
        golds = torch.stack([requests[r.prompt_index].activation for r in rollouts])
        # Under vllm_sleep the previous step's push is made at this wake-up: it is the sync phase's time.
        time_pushed = getattr(engine, "last_stats", {}).get("push_s", 0.0)
        time_rollout = time.perf_counter() - t0 - time_pushed
        if hasattr(engine, "steering_canary"):
            # Each rank steers with an engine of its own: the worst reading (a failed one as 0) decides for all,
            # so that the ranks stop together.
            (worst,) = distributed.all_reduce_max([-(canary if canary > 0 else 0.0)])
            if (warning := canary_watch.check(step, -worst)) is not None:
                say(warning, error=True)

        # --- score: extraction -> AR -> reward -> advantages (groups are whole: exact) -----
        # A co-trained critic takes its regression step here, on the same forward that scores
        # (the reward is the pre-update prediction's); every rank steps, even one with no pairs.
        # With critic_rollouts=best, an EMA or dynamic sampling, it scores first and steps below.
        t0 = time.perf_counter()
        explanations = [nla_core.extract_explanation(r.text) for r in rollouts]
        critic_loss = critic_grad_norm = math.nan
        time_critic = 0.0
        if critic_optimizer is not None and not critic_steps_after_scoring:
            scores, critic_loss, critic_grad_norm, time_critic = score_and_train_critic(
                critic, critic_optimizer, tokenizer, explanations, golds, **score_kwargs,
                max_grad_norm=cfg.max_grad_norm,
            )
        else:
            with sampling.scoring_weights(critic_ema):
                scores = score_explanations(critic, tokenizer, explanations, golds, **score_kwargs)
        shaped = shape_rewards(
            scores, rollouts, max_new_tokens=cfg.max_new_tokens, eos_ids=eos_ids, length_penalty=cfg.length_penalty,
            length_margin=cfg.length_margin, truncated_as_failed=cfg.truncated_as_failed,
        )
        extra_draws, time_extra_rollouts = 0, 0.0
        if cfg.dynamic_sampling:  # DAPO: draw again until the step holds batch_prompts groups with varied rewards

            def another_draw() -> sampling.Draw:
                nonlocal time_extra_rollouts
                t1 = time.perf_counter()
                more = [RolloutRequest(tuple(prompt_ids[i]), rows[i].activation)
                        for i in distributed.shard(order.next_batch(cfg.batch_prompts), rank)]
                with held_awake(engine):
                    more_rollouts = engine.generate(more, group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens)
                time_extra_rollouts += time.perf_counter() - t1
                more_golds = torch.stack([more[r.prompt_index].activation for r in more_rollouts])
                with sampling.scoring_weights(critic_ema):
                    more_scores = score_explanations(
                        critic, tokenizer, [nla_core.extract_explanation(r.text) for r in more_rollouts], more_golds,
                        **score_kwargs)
                return sampling.Draw(more, more_rollouts, shape_rewards(
                    more_scores, more_rollouts, max_new_tokens=cfg.max_new_tokens, eos_ids=eos_ids,
                    length_penalty=cfg.length_penalty, length_margin=cfg.length_margin,
                    truncated_as_failed=cfg.truncated_as_failed))

            kept, extra_draws = sampling.redraw_until_varied(
                sampling.Draw(requests, rollouts, shaped), another_draw, max_draws=cfg.dynamic_sampling_max_draws)
            requests, rollouts, shaped = kept.requests, kept.rollouts, kept.shaped
            golds = torch.stack([requests[r.prompt_index].activation for r in rollouts])
        scores = shaped.scores
        group_ids = torch.tensor([r.prompt_index for r in rollouts])
        advantages = sampling.step_advantages(shaped.reward, group_ids, scale=cfg.advantage_scale)
        if critic_optimizer is not None and critic_steps_after_scoring:
            pairs = sampling.critic_pairs(scores, group_ids, rollouts=cfg.critic_rollouts)
            timer = DeviceTimer(device)
            with timer:
                critic_loss, critic_grad_norm = critic_step(
                    critic, critic_optimizer, [scores.ar_inputs[i] for i in pairs], golds[pairs],
                    pad_id=tokenizer.pad_token_id, micro_batch=cfg.critic_micro_batch, max_grad_norm=cfg.max_grad_norm,
                )
            time_critic = timer.seconds()
            if critic_ema is not None and math.isfinite(critic_loss):
                critic_ema.update()
        varied = nla_core.group_has_variance(shaped.reward, group_ids).tolist() if rollouts else []
        varied_groups = int(distributed.all_reduce_sum([len({g for g, v in zip(group_ids.tolist(), varied) if v})])[0])
        time_rollout += time_extra_rollouts
        # The critic's own backward and step are its phase; extra draws are rollout time.
        time_score = time.perf_counter() - t0 - time_extra_rollouts - time_critic

        # --- policy update (global denominator, gradients summed over ranks) ----------------
        t0 = time.perf_counter()
        actor.train()
        update = policy_update(
            actor, injector, optimizer, rollouts, advantages, golds,
            loss=loss_options, micro_batch=cfg.logp_micro_batch, max_grad_norm=cfg.max_grad_norm,
            pad_id=tokenizer.pad_token_id, mismatch_threshold=cfg.mismatch_threshold,
            prompt_block=cfg.logp_prompt_block, reference_micro_batch=cfg.ref_micro_batch,
        )
        if not update.stepped:  # the grad norm is global: every rank skips together
            skipped_steps += 1
            say(f"[warn] step {step}: grad norm {update.grad_norm} is not finite; optimizer step skipped "
                f"({skipped_steps} so far)", error=True)
        time_update = time.perf_counter() - t0

        # --- weight push to engines with their own copy -------------------------------------
        time_sync = time_pushed
        if not engine.shares_actor_weights and cfg.vllm_sync_every > 0 and (step + 1) % cfg.vllm_sync_every == 0:
            time_sync += engine.sync_weights(actor)  # 0 while vLLM sleeps: the push waits for its wake-up
            eval_engine.synced()
        else:
            eval_engine.stepped()

        # --- metrics of the global batch: every rank's samples, in rank (= batch) order --------
        marker = nla.injection_token_id
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
        fve = nla_core.fve(mse_stats["mean"], rawvar)
        advantages_all, n_generated = samples["advantage"], int(samples["length"].sum())
        # The slowest rank sets the pace: times (and peak memory) are maxima over ranks.
        time_step = time.perf_counter() - t_step
        time_rollout, time_score, time_update, time_critic, time_sync, time_step, peak_mem = (
            distributed.all_reduce_max(
                [time_rollout, time_score, time_update, time_critic, time_sync, time_step, peak_memory_gb(device)]
            )
        )
        record: dict[str, Any] = {
            "loss": update.loss,
            **{f"reward_{k}": v for k, v in reward_stats.items()},
            **{f"mse_{k}": v for k, v in mse_stats.items()},
            "fve": fve,
            "fve_pct": 100.0 * fve,  # the reference's keys, for dashboards built on it
            "fve_baseline": rawvar,
            "fve_meannorm": nla_core.fve(mse_stats["mean"], meannorm),
            "advantage_mean": float(advantages_all.mean()),
            "advantage_std": float(advantages_all.std()) if advantages_all.numel() > 1 else 0.0,
            "extraction_rate": float(samples["valid"].float().mean()),
            "cjk_fraction": float(np.mean(samples["cjk"].numpy())),
            "response_len_mean": n_generated / len(samples["length"]),
            "kl_mean": update.kl_mean,
            "clip_frac": update.clip_frac,
            "outside_clip_frac": update.outside_clip_frac,
            "tis_frac": update.tis_frac,
            "token_mask_frac": update.token_mask_frac,
            "dynamic_sampling_draws": extra_draws,
            "varied_groups": varied_groups,
            "logp_diff_mean": update.logp_diff_mean,
            "logp_diff_max": update.logp_diff_max,
            "grad_norm": update.grad_norm,
            "skipped_steps": skipped_steps,
            "critic_loss": critic_loss,
            "critic_grad_norm": critic_grad_norm,
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
            "steering_canary": canary,
        }

        # --- held-out eval (document-disjoint rows): rank 0 alone, the others wait ------------
        if eval_on and step % cfg.eval_every == 0:
            if rank.is_main:
                record.update(held_out(step, logger))
            distributed.barrier()
        logger.log(step, record)
        last_record = {"step": step, **record}
        bar.update()

        # --- checkpoint ------------------------------------------------------------------------
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.num_steps:
            save(step + 1)

    # --- a held-out point at the final step (summary.json only; its own RNG, so resume stays exact)
    final_eval = None
    # Decided from the step alone, so every rank takes the same branch (only rank 0's record holds eval keys).
    if eval_on and last_record and last_record["step"] % cfg.eval_every != 0:
        if rank.is_main:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                final_eval = {"step": last_record["step"], **held_out(last_record["step"], NullLogger())}
        distributed.barrier()
    finish(max(start_step, cfg.num_steps), final_eval)
    if rank.is_main:
        say(f"[nla train] done: {cfg.num_steps} step{'s' if cfg.num_steps != 1 else ''}; checkpoint {ckpt.checkpoint_dir(save_dir, cfg.num_steps)} "
            f"(adapter/ is the AV{', critic/ the AR' if cfg.train_critic else ''}); metrics {save_dir / 'metrics.jsonl'}, "
            f"summary {save_dir / 'summary.json'}; curves: nla plot {save_dir}")
    return save_dir


def say_actor_start(cfg: TrainConfig, actor, *, continues_sft: bool) -> None:
    """Say which LoRA RL trains, and what the lora_* keys mean for it."""
    if not is_adapter_dir(cfg.av_ckpt):
        return
    adapter = actor.peft_config["default"]
    if continues_sft:
        say(f"[actor] continuing the SFT adapter {cfg.av_ckpt} (r={adapter.r}, alpha={adapter.lora_alpha}, "
            f"rsLoRA={adapter.use_rslora}); lora_r/lora_alpha/use_rslora are unused and left out of the run identity. "
            "sft_adapter=merge trains a fresh LoRA on the merged SFT model instead (the reference's path)")
    else:
        say(f"[actor] merged the SFT adapter {cfg.av_ckpt} into the base; training a fresh LoRA r={adapter.r}, "
            f"alpha={adapter.lora_alpha}, rsLoRA={adapter.use_rslora}; the KL reference is the merged SFT model")


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


def restore_rank_rng(state: ckpt.TrainingState, rank: RankInfo, *, seed: int, step: int) -> None:
    """Give this rank back its own RNG stream from a checkpoint.

    A torchrun checkpoint holds every rank's state (extra["rank_rng"], in rank order); a
    one-process checkpoint holds one. Resuming with another number of ranks cannot be
    exact: each rank then starts a fresh stream of its own, and says so.
    """
    states = state.extra.get("rank_rng") or [state.rng]
    if len(states) == rank.world_size:
        ckpt.set_rng_state(states[rank.rank])
        return
    say(f"[warn] the checkpoint holds RNG states of {len(states)} rank(s), this run has {rank.world_size}: "
        "fresh per-rank RNG streams, so the resumed run is not bit-exact", error=True)
    seed_everything(distributed.rank_seed(seed, rank.rank, step))


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
