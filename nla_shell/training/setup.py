"""The run before its first step: `setup(cfg, ...) -> RunState` and the pieces it is built from.

`setup` validates the inputs, claims the run directory (rank 0), loads the actor (LoRA and
injection hook) and the critic, starts the rollout engine, makes the optimisers, computes the FVE
baselines and, when a verified checkpoint is there, restores the data cursor, the optimiser
moments and every rank's RNG stream from it: a resumed run goes on exactly where it stopped. RunState
itself, what a step reads and moves, is nla_shell.training.run_state's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

import nla_core
from nla_shell import families
from nla_shell.engines.base import RolloutEngine
from nla_shell.io.config import ConfigError, config_defaults, config_to_dict, save_config
from nla_shell.training.config import FRESH_LORA_KEYS, RESUME_MUTABLE_KEYS, TrainConfig
from nla_shell.io.data import (
    DataError, RLRow, build_prompt_ids, check_tokenizer, load_eval_rows, load_rows, parquet_num_rows, row_windows,
)
from nla_shell.io.logging import NullLogger, make_logger
from nla_shell.io.sidecars import Injection, injection_settings, load_sidecar
from nla_shell.models import (
    ARModel, BackboneAutocast, CompiledBlockParts, FP8Linears, Injector, base_model_dir, eos_token_ids, inner_lm,
    is_adapter_dir, load_actor, require_fp8, require_injection_block, trainable_parameters,
)
from nla_shell.training import checkpoint as ckpt
from nla_shell.training import distributed, run_identity, sampling, sharding
from nla_shell.training.canary import CanaryWatch
from nla_shell.training.distributed import RankInfo
from nla_shell.training.memory import resolve_micro_batches
from nla_shell.training.run_state import EvalEngine, RunState, optimized
from nla_shell.training.runtime import DataOrder, make_optimizer, say, seed_everything


CRITIC_EMA_FILE = "critic_ema.safetensors"
"""A checkpoint's EMA of the critic's trained weights (critic_ema), in trainable_parameters order."""

# --------------------------------------------------------------------------- small pieces


def make_engine(cfg: TrainConfig, actor, injector: Injector, tokenizer, *, eos_ids: tuple[int, ...]) -> RolloutEngine:
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
        **injector.vllm_kwargs(),
        gpu_memory_utilization=cfg.vllm_gpu_mem,
        max_model_len=cfg.vllm_max_len,
        tensor_parallel_size=cfg.vllm_tp,
        enable_prefix_caching=cfg.vllm_prefix_caching,
        max_num_seqs=cfg.vllm_max_seqs,
        kv_cache_gib=cfg.vllm_kv_cache_gib,
        sleep_level=cfg.vllm_sleep,
        quantization=None if cfg.vllm_quantization == "none" else cfg.vllm_quantization,
        eos_ids=eos_ids,
        # Under torchrun each rank's engine runs on the rank's GPU and samples from a stream of its own.
        seed=distributed.rank_seed(cfg.seed, distributed.rank_info().rank) if distributed.active() else cfg.seed,
        per_rank=distributed.active(),
    )


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
                                   docs=cfg.heldout_docs, key="eval_parquet")
        where = f"{cfg.eval_parquet} ({cfg.heldout_docs} documents)"
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


def say_actor_start(cfg: TrainConfig, actor, *, continues_sft: bool) -> None:
    """Say which LoRA RL trains, and what the lora_* keys mean for it."""
    if not is_adapter_dir(cfg.av_ckpt):
        return
    adapter = actor.peft_config["default"]
    if continues_sft:
        say(f"[actor] continuing the SFT adapter {cfg.av_ckpt} (r={adapter.r}, alpha={adapter.lora_alpha}, "
            f"rsLoRA={adapter.use_rslora}); {'/'.join(FRESH_LORA_KEYS)} are unused and left out of the run identity. "
            "sft_adapter=merge trains a fresh LoRA on the merged SFT model instead (the reference's path)")
    else:
        say(f"[actor] merged the SFT adapter {cfg.av_ckpt} into the base; training a fresh LoRA r={adapter.r}, "
            f"alpha={adapter.lora_alpha}, rsLoRA={adapter.use_rslora}; the KL reference is the merged SFT model")


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


# --------------------------------------------------------------------------- the run's state


def setup(cfg: TrainConfig, rank: RankInfo, device: torch.device, dtype: torch.dtype) -> RunState:
    """Validate every input, claim the run directory, build the models, engine and optimisers, and
    resume from the latest verified checkpoint when there is one: the run's state before its first step.

    Each part runs in the order the run has always run them: the RNG draws (the LoRA's init, the
    engine's seed) and the printed lines stay the same.
    """
    if cfg.bf16_autocast and dtype != torch.bfloat16:
        raise ConfigError(
            f"config key 'bf16_autocast' = true needs the models in bfloat16 but dtype resolves to {dtype}: "
            "set dtype=bfloat16 (auto is bfloat16 on a GPU) or bf16_autocast=false"
        )
    tokenizer = families.load_tokenizer(cfg.av_ckpt)
    nla = load_sidecar(cfg.sidecar or cfg.rl_parquet)
    injection = injection_settings(nla, style=cfg.injection_style, scale=cfg.injection_scale,
                                   layer=cfg.injection_layer, av_dir=cfg.av_ckpt)
    require_injection_block(base_model_dir(cfg.av_ckpt), injection)
    check_tokenizer(nla, tokenizer)
    mse_scale = nla_core.resolve_target_scale(nla.mse_scale, nla.d_model)
    rows, eval_rows = load_train_and_eval_rows(cfg, nla)
    prompt_ids = [build_prompt_ids(r.prompt, nla, tokenizer, row=r.index) for r in rows]
    eval_prompt_ids = [build_prompt_ids(r.prompt, nla, tokenizer, row=r.index) for r in eval_rows]
    critic = ARModel.from_pretrained(cfg.ar_ckpt, mse_scale=mse_scale, dtype=dtype, device=device, quant=cfg.quant)
    if critic.lm.config.hidden_size != nla.d_model:
        raise ValueError(f"ar_ckpt has hidden size {critic.lm.config.hidden_size}, the sidecar's d_model is {nla.d_model}")
    continues_sft = is_adapter_dir(cfg.av_ckpt) and cfg.sft_adapter == "continue"
    if not continues_sft:  # a fresh LoRA's modules, checked before the run dir is claimed
        families.require_lora_targets(base_model_dir(cfg.av_ckpt), cfg.lora_targets)
    # Rank 0 claims the directory and picks the checkpoint; every rank resumes from that one.
    resume_from = distributed.on_main(lambda: claim_run_dir(cfg, continues_sft=continues_sft))

    actor, injector, critic = load_models(cfg, nla, critic, resume_from, injection=injection,
                                          continues_sft=continues_sft, mse_scale=mse_scale, device=device, dtype=dtype)
    fp8_score, fp8_reference, fp8_update = make_fp8_copies(cfg, actor, critic, device=device)
    eos_ids = eos_token_ids(inner_lm(actor).generation_config, tokenizer)  # every one stops a rollout
    engine = make_engine(cfg, actor, injector, tokenizer, eos_ids=eos_ids)
    optimizer, critic_optimizer, critic_ema = make_optimizers(cfg, actor, critic, resume_from, device=device)
    baselines = nla_core.predict_mean_baselines(torch.stack([r.activation for r in rows[:4000]]), scale=mse_scale)
    rawvar, meannorm = float(baselines.rawvar), float(baselines.meannorm)
    say(f"[fve] predict-the-mean mse: rawvar {rawvar:.4f} (paper), meannorm {meannorm:.4f}")

    # The data order is global: every rank draws the same batch, then takes its share.
    order = DataOrder(len(rows), cfg.seed)
    start_step, skipped_steps = resume_progress(cfg, rank, order, optimized(actor, optimizer, critic, critic_optimizer),
                                                resume_from)
    cfg, config_dict = choose_micro_batches(cfg, rank, actor, resume_from, device=device, dtype=dtype,
                                            tokens=max(map(len, prompt_ids)) + cfg.max_new_tokens)
    logger = (
        make_logger(cfg.logger, save_dir=Path(cfg.save_dir), config_dict=config_dict, project=cfg.wandb_project,
                    run_name=cfg.wandb_name, start_step=start_step)
        if rank.is_main
        else NullLogger()
    )
    if not engine.shares_actor_weights:
        say(f"[sync] initial weight push: {engine.sync_weights(actor):.2f}s")
        if eval_rows and cfg.vllm_sync_every != 1:
            say(f"[eval] vllm_sync_every={cfg.vllm_sync_every}: at eval steps whose update was not pushed to "
                f"{cfg.engine}, the held-out eval samples from the trainer's actor (HF generate) instead")
    state = RunState(
        cfg=cfg, rank=rank, device=device, nla=nla, tokenizer=tokenizer, rows=rows, prompt_ids=prompt_ids,
        eval_rows=eval_rows, eval_prompt_ids=eval_prompt_ids, actor=actor, injector=injector, critic=critic,
        engine=engine, eval_engine=EvalEngine(engine, actor, injector, tokenizer), optimizer=optimizer,
        critic_optimizer=critic_optimizer, critic_ema=critic_ema, eos_ids=eos_ids, mse_scale=mse_scale, rawvar=rawvar, meannorm=meannorm,
        order=order, start_step=start_step, skipped_steps=skipped_steps, logger=logger, save_dir=Path(cfg.save_dir),
        canary_watch=CanaryWatch(stop=cfg.vllm_canary == "stop"), fp8_score=fp8_score, fp8_reference=fp8_reference,
        fp8_update=fp8_update,
    )
    if not state.loss_options.runs_reference:
        say("[train] kl_beta=0, kl_metric=false: the reference pass is skipped (no KL is computed or logged)")
    if cfg.policy_loss == "gspo" and cfg.tis in ("ratio_cap", "none"):
        say(f"[train] policy_loss=gspo with tis={cfg.tis}: the sequence ratio is taken against the engine's "
            "log-probs, so the engine/trainer gap counts against the clip (bf16 SmolLM2, clip 3e-4: 97% of "
            "sequences outside it, FVE -0.05); tis=sequence_truncate takes it against the trainer's (docs/losses.md)")
    return state


def claim_run_dir(cfg: TrainConfig, *, continues_sft: bool) -> Path | None:
    """Claim save_dir for this config (rank 0, under the run lock); the checkpoint to resume from, if any."""
    save_dir = Path(cfg.save_dir)
    # A continued SFT adapter keeps its own rank, alpha and modules: the fresh LoRA's keys decide nothing then.
    mutable_keys = RESUME_MUTABLE_KEYS | (set(FRESH_LORA_KEYS) if continues_sft else set())
    run_identity.claim_save_dir(save_dir, config_to_dict(cfg), overwrite=cfg.overwrite, resume=cfg.resume,
                                mutable_keys=mutable_keys, defaults=config_defaults(TrainConfig),
                                num_steps=cfg.num_steps)
    ckpt.remove_stale_entries(save_dir)  # under the lock: no other run's save is in flight
    if cfg.resume != "auto":
        return None
    needed = ("adapter", ckpt.TRAINING_STATE_NAME, *(("critic",) if cfg.train_critic else ()),
              *((CRITIC_EMA_FILE,) if cfg.critic_ema is not None else ()))
    return ckpt.latest_verified_checkpoint(save_dir, required=needed)


def load_models(cfg: TrainConfig, nla: nla_core.NLAConfig, critic: ARModel, resume_from: Path | None, *,
                injection: Injection, continues_sft: bool, mse_scale: float | None, device: torch.device,
                dtype: torch.dtype) -> tuple[Any, Injector, ARModel]:
    """The actor (a fresh or resumed LoRA; the same seed on every rank: identical initial LoRA), its
    injector, and the critic (the checkpoint's when resuming a co-trained one)."""
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
        lora_targets=cfg.lora_targets,
    )
    if cfg.bf16_autocast:
        BackboneAutocast(actor, torch.bfloat16)  # for the actor's lifetime: engines see it too
    say_actor_start(cfg, actor, continues_sft=continues_sft)
    if nla.injection_token_id >= actor.get_base_model().config.vocab_size:
        raise ValueError(f"sidecar's injection_token_id {nla.injection_token_id} is outside the AV's vocabulary")
    injector = Injector.for_sidecar(actor, nla, injection)
    if resume_from is not None and cfg.train_critic:
        critic = ARModel.from_pretrained(resume_from / "critic", mse_scale=mse_scale, dtype=dtype, device=device)
    critic.requires_grad_(cfg.train_critic)
    critic.eval()  # Qwen3 has no dropout: eval mode serves the gradient steps too
    if cfg.compile_blocks:  # for the run
        CompiledBlockParts(actor)
        CompiledBlockParts(critic.lm)
    distributed.broadcast_parameters(trainable_parameters(actor))
    if cfg.sharding == "fsdp2":
        blocks, critic_blocks = sharding.shard_actor(actor), sharding.shard_critic(critic)
        say(f"[sharding] fsdp2: the actor's {blocks} decoder blocks (base and LoRA) and the critic's {critic_blocks} "
            f"sharded over {torch.distributed.get_world_size()} rank(s)")
    return actor, injector, critic


def make_fp8_copies(cfg: TrainConfig, actor, critic: ARModel, *,
                    device: torch.device) -> tuple[FP8Linears | None, FP8Linears | None, FP8Linears | None]:
    """The FP8 copies of fp8's phases, (score: the AR's backbone, reference and update: one set of the actor's
    base), None for a phase in the model's dtype; each set said in a line (how many layers convert). With
    compile_blocks, the converted layers outside the compiled block parts run compiled too (inductor)."""
    if not cfg.fp8:
        return None, None, None
    require_fp8(device)
    backend = "inductor" if cfg.compile_blocks else None
    backward = "backward" in cfg.fp8
    fast = cfg.fp8_fast_accum
    score = (FP8Linears(families.backbone(critic.lm), label="score", compile_backend=backend, backward=backward,
                        fast_accum=fast)
             if "score" in cfg.fp8 else None)
    actor_phases = [phase for phase in ("reference", "update") if phase in cfg.fp8]
    base = (FP8Linears(families.backbone(inner_lm(actor)), label="+".join(actor_phases), compile_backend=backend,
                       backward=backward and "update" in cfg.fp8, fast_accum=fast)
            if actor_phases else None)
    for copies in (score, base):
        if copies is not None:
            say(copies.summary())
    return score, base if "reference" in cfg.fp8 else None, base if "update" in cfg.fp8 else None


def make_optimizers(cfg: TrainConfig, actor, critic: ARModel, resume_from: Path | None, *,
                    device: torch.device) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer | None,
                                                   sampling.CriticEMA | None]:
    """The actor's optimiser, the critic's (when co-trained) and the critic's EMA (the checkpoint's when resuming)."""
    optimizer = make_optimizer(trainable_parameters(actor), cfg.lr, device=device, label="actor")
    critic_optimizer = (
        make_optimizer(trainable_parameters(critic), cfg.critic_lr, device=device, label="critic")
        if cfg.train_critic
        else None
    )
    critic_ema = sampling.CriticEMA(critic, cfg.critic_ema) if cfg.critic_ema is not None else None
    if critic_ema is not None and resume_from is not None:
        critic_ema.load_state_dict(load_file(str(resume_from / CRITIC_EMA_FILE)))
    return optimizer, critic_optimizer, critic_ema


def resume_progress(cfg: TrainConfig, rank: RankInfo, order: DataOrder, optimizers: sharding.Optimized,
                    resume_from: Path | None) -> tuple[int, int]:
    """(start step, skipped steps): the checkpoint's, with its data cursor, optimiser moments and this
    rank's RNG stream restored; else the config's start, with one sampling RNG stream per rank."""
    if resume_from is None:
        if rank.world_size > 1:
            # Ranks must not sample alike (a one-process run keeps the stream seeded above).
            seed_everything(distributed.rank_seed(cfg.seed, rank.rank))
        return cfg.start_step, 0
    state = ckpt.load_training_state(resume_from)
    order.epoch, order.offset = state.data_cursor["epoch"], state.data_cursor["offset"]
    restore_optimizers(cfg, optimizers, state, resume_from)
    restore_rank_rng(state, rank, seed=cfg.seed, step=state.step)
    say(f"[resume] from {resume_from} at step {state.step}")
    return state.step, int(state.extra.get("skipped_steps", 0))


def restore_optimizers(cfg: TrainConfig, optimizers: sharding.Optimized, state: ckpt.TrainingState,
                       resume_from: Path) -> None:
    """The checkpoint's optimiser moments: every rank's shard of a sharding=fsdp2 checkpoint's (which only fsdp2 can
    read), or an unsharded checkpoint's whole moments (cut to this rank's shard under fsdp2)."""
    shards = resume_from / ckpt.OPTIMIZER_SHARDS_NAME
    if shards.is_dir():
        if cfg.sharding != "fsdp2":
            raise ckpt.CheckpointError(
                f"checkpoint {resume_from} was saved under sharding=fsdp2 (its optimiser moments are sharded in "
                f"{ckpt.OPTIMIZER_SHARDS_NAME}/); resume with sharding=fsdp2")
        sharding.load_optimizer_shards(optimizers, shards)
        return
    for name, (_, optimizer) in optimizers.items():
        ckpt.restore_optimizer(optimizer, state, name, resume_from)
        sharding.shard_optimizer_state(optimizer)  # a no-op for whole parameters


def choose_micro_batches(cfg: TrainConfig, rank: RankInfo, actor, resume_from: Path | None, *, device: torch.device,
                         dtype: torch.dtype, tokens: int) -> tuple[TrainConfig, dict[str, Any]]:
    """`cfg` with "auto" micro-batches sized by the memory the models and the engine left free (the
    checkpoint's choice when resuming), saved in config.yaml; and the config as the logger records it."""
    free_bytes = None
    if device.type == "cuda":  # the tightest rank's, so that every rank runs (and records) the same
        free_bytes = -int(distributed.all_reduce_max([-torch.cuda.mem_get_info(device)[0]])[0])
    cfg, chosen = resolve_micro_batches(
        cfg, inner_lm(actor).config, free_bytes=free_bytes, tokens=tokens, dtype_bytes=torch.finfo(dtype).bits // 8,
        resumed=run_identity.saved_config(resume_from) if resume_from else None,
    )
    if chosen is not None:
        say(chosen)
        if rank.is_main:
            save_config(cfg, Path(cfg.save_dir) / ckpt.CONFIG_NAME)
    return cfg, config_to_dict(cfg)
