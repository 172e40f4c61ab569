"""`nla sft --mode av|ar`: the supervised warm starts that `nla train` starts from.

AV: the target LM plus an rsLoRA adapter (or, with av_lora=false, the whole LM) learns to write the gold response
(`<explanation>…</explanation>` + EOS) after the AV prompt, with the activation injected
at the marker; the loss is the token-mean NLL of the response tokens only.
AR: an `ARModel` (the LM truncated after the extraction layer + a float32 value head)
regresses the normalised activation from the AR prompt; the loss is `critic_step`'s MSE.

Each checkpoint `save_dir/step_NNNNNN/` is directly what `nla train` loads: for the AV a
PEFT adapter dir (+ tokenizer), which `av_ckpt` continues and keeps as the KL reference (av_lora=false: a
plain HF model dir, on which `nla train` starts a fresh LoRA, the SFT'd weights its KL reference);
for the AR an ARModel dir (`ar_ckpt`). Both also hold `nla_meta.yaml` (kind nla_model,
with the FVE baselines of the training activations), the optimizer/RNG/data-cursor state
and the config, so an interrupted run resumes where it stopped (`resume: auto`). The settings (SFTConfig, and
the keys a resumed run may change) live in nla_shell.pipeline.sft_config.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

import nla_core
from nla_shell import families
from nla_shell.training import checkpoint as ckpt
from nla_shell.training import run_identity
from nla_shell.io.config import ConfigError, config_defaults, config_to_dict
from nla_shell.training.config import TrainConfig
from nla_shell.io.data import DataError, build_prompt_ids, check_tokenizer, stream_rows
from nla_shell.io.sidecars import (
    MODEL_SIDECAR, Injection, injection_settings, load_sidecar, model_sidecar, write_sidecar,
)
from nla_shell.io.logging import make_logger
from nla_shell.io.paths import require_file, require_model
from nla_shell.io.progress import progress_bar, say_line
from nla_shell.models import ARModel, Injector, load_actor, load_base_lm, require_injection_block, trainable_parameters
from nla_shell.pipeline import sft_eval
from nla_shell.pipeline.sft_config import SFT_RESUME_MUTABLE_KEYS, SFTConfig
from nla_shell.pipeline.sft_loss import AVExample, av_response_nll
from nla_shell.quant import require_quant
from nla_shell.training.scoring import critic_step
from nla_shell.training.preemption import StopSignals, boundary_save_due
from nla_shell.training.runlock import RunDirLock
from nla_shell.training.runtime import DataOrder, make_optimizer, resolve_device, seed_everything


def lr_factor(step: int, *, num_steps: int, warmup_steps: int, schedule: str) -> float:
    """Multiplier of the peak lr at `step` (0-based): linear warmup, then constant or cosine to 0."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, num_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


HELDOUT_SCORE = "heldout/score"
"""The checkpoint manifest's held-out figure, signed so that higher is better (keep_best, keep_last)."""


# --------------------------------------------------------------------------- the run


def sft(cfg: SFTConfig) -> Path:
    """Run (or resume) AV or AR warm-start training; returns the run's result checkpoint dir.

    The result is the last checkpoint, or, with eval_parquet and keep_best, the one with the best
    held-out figure. Holds save_dir's lock throughout; raises preemption.RunStopped when a signal
    stops it (after saving, if save_on_signal).
    """
    with RunDirLock(cfg.save_dir), StopSignals(cfg.save_dir) as stop:
        return _run_sft(cfg, stop)


@dataclass
class _Run:
    """What one SFT run holds while it trains (built by `_setup`, advanced by `_train`)."""

    cfg: SFTConfig
    save_dir: Path
    tokenizer: Any
    nla: nla_core.NLAConfig
    examples: list[Any]
    num_steps: int
    model: torch.nn.Module
    injector: Injector | None
    optimizer: torch.optim.Optimizer
    order: DataOrder
    start_step: int
    save: Callable[[int, sft_eval.EarlyStopping, float | None], Path]
    """save(steps_done, stopping state to carry, held-out score or None) -> the checkpoint dir."""
    heldout: sft_eval.HeldOut | None
    eval_ar: ARModel | None
    stopping: sft_eval.EarlyStopping
    mse_scale: float | None
    baselines: nla_core.Baselines
    """Predict-the-mean baselines of the training activations (the training FVE's, and the sidecar's)."""
    selection: tuple[str, bool]
    """The held-out figure the run selects its checkpoint on, and whether higher is better (sft_eval.selection_key)."""


def _run_sft(cfg: SFTConfig, stop: StopSignals) -> Path:
    run = _setup(cfg)
    if run.stopping.should_stop:  # a resumed run that had already stopped on its held-out plateau
        say_line(f"[sft {cfg.mode}] stopped early at an earlier run's plateau; nothing to train")
    else:
        _train(run, stop)
    return _finish(run)


def _setup(cfg: SFTConfig) -> _Run:
    """Validate every input, load the examples and held-out rows, claim save_dir, build or restore the model."""
    # --- inputs, before anything is written ----------------------------------------------
    require_model("model", cfg.model)
    require_file("parquet", cfg.parquet)
    require_file("sidecar", cfg.sidecar)
    require_file("eval_parquet", cfg.eval_parquet)
    require_model("eval_ar", cfg.eval_ar, hub_ok=False)
    device, dtype = resolve_device(cfg.device, cfg.dtype)
    require_quant(cfg.quant, device, trains_ar_backbone=cfg.mode == "ar" and not cfg.ar_lora)
    model_dir = Path(cfg.model).resolve()
    if (model_dir / "adapter_config.json").exists():
        raise ConfigError(
            f"config key 'model' = {cfg.model!r} is a LoRA adapter dir; give the full target LM it was trained on "
            "(SFT starts the adapter itself; to continue a run, rerun it with the same save_dir)"
        )
    families.require_lora_targets(model_dir, cfg.lora_targets)
    tokenizer = families.load_tokenizer(model_dir)
    nla = load_sidecar(cfg.sidecar or cfg.parquet)
    check_tokenizer(nla, tokenizer)
    mse_scale = nla_core.resolve_target_scale(nla.mse_scale, nla.d_model)
    injection = Injection("residual_add", None, nla.injection_layer)  # the AR injects nothing
    if cfg.mode == "av":
        injection = injection_settings(nla, style=cfg.injection_style, scale=cfg.injection_scale,
                                       layer=cfg.injection_layer)
        require_injection_block(model_dir, injection)
    rows, examples = _load_examples(cfg, nla, tokenizer)
    baselines = nla_core.predict_mean_baselines(torch.stack([r.activation for r in rows]), scale=mse_scale)
    heldout = None if cfg.eval_parquet is None else sft_eval.load_heldout(
        cfg.eval_parquet, nla, tokenizer, n_rows=cfg.eval_rows, docs=cfg.heldout_docs, seed=cfg.seed,
        mse_scale=mse_scale, need_response=cfg.mode == "av")
    num_steps = cfg.num_steps if cfg.epochs is None else max(1, math.ceil(cfg.epochs * len(examples) / cfg.batch_size))

    save_dir = Path(cfg.save_dir)
    config_dict = config_to_dict(cfg)
    run_identity.claim_save_dir(save_dir, config_dict, overwrite=cfg.overwrite, resume=cfg.resume,
                                mutable_keys=SFT_RESUME_MUTABLE_KEYS, defaults=config_defaults(SFTConfig),
                                num_steps=num_steps)
    ckpt.remove_stale_entries(save_dir)  # under the lock: no other run's save is in flight
    resume_from = ckpt.latest_verified_checkpoint(save_dir) if cfg.resume == "auto" else None

    # --- model, optimizer, and a resumed run's state -----------------------------------------
    seed_everything(cfg.seed)
    model, injector = _build_model(cfg, model_dir, nla, resume_from, injection=injection, mse_scale=mse_scale,
                                   dtype=dtype, device=device)
    model.train()
    optimizer = make_optimizer(trainable_parameters(model), cfg.lr, device=device, label=f"sft {cfg.mode}")
    order = DataOrder(len(examples), cfg.seed)
    stopping = sft_eval.EarlyStopping(patience=cfg.patience, min_delta=cfg.min_delta)
    start_step = 0
    if resume_from is not None:
        state = ckpt.load_training_state(resume_from)
        start_step = state.step
        order.epoch, order.offset = state.data_cursor["epoch"], state.data_cursor["offset"]
        optimizer.load_state_dict(state.optimizer_states["model"])
        ckpt.set_rng_state(state.rng)
        stopping = stopping.restored(state.extra.get("early_stop"))
        print(f"[resume] sft {cfg.mode} from {resume_from} at step {start_step}", flush=True)
    sidecar_out = model_sidecar(
        nla, role=cfg.mode, stage="sft", base_checkpoint=str(model_dir), injection=injection,
        trained_on=[str(Path(cfg.parquet).resolve())], baselines=baselines,
        provenance={"sft": {"mode": cfg.mode, "parquet": str(Path(cfg.parquet).resolve()), "base_model": str(model_dir)}},
    )

    def save(step_done: int, stopping: sft_eval.EarlyStopping, score: float | None) -> Path:
        def write(tmp: Path) -> None:
            # AV: adapter_config.json + weights (av_lora=false: the whole LM); AR: backbone + value head
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            write_sidecar(sidecar_out, tmp / MODEL_SIDECAR)
            ckpt.save_training_state(tmp, step=step_done, data_cursor=order.state(),
                                     optimizer_states={"model": optimizer.state_dict()}, rng=ckpt.rng_state(),
                                     extra={"early_stop": stopping.state()})
            (tmp / ckpt.CONFIG_NAME).write_text((save_dir / ckpt.CONFIG_NAME).read_text())

        # keep_last and keep_best find the best checkpoint by this score (higher is better).
        path = ckpt.save_checkpoint(save_dir, step_done, write=write, metrics={HELDOUT_SCORE: score})
        if cfg.keep_last is not None:
            ckpt.prune_checkpoints(save_dir, keep_last=cfg.keep_last, best_by=HELDOUT_SCORE)
        return path

    eval_ar = sft_eval.round_trip_ar(cfg.eval_ar, mse_scale=mse_scale, dtype=dtype, device=device, mode=cfg.mode)
    return _Run(cfg=cfg, save_dir=save_dir, tokenizer=tokenizer, nla=nla, examples=examples, num_steps=num_steps,
                model=model, injector=injector, optimizer=optimizer, order=order, start_step=start_step, save=save,
                heldout=heldout, eval_ar=eval_ar, stopping=stopping, mse_scale=mse_scale, baselines=baselines,
                selection=sft_eval.selection_key(cfg.mode, has_ar=eval_ar is not None))


def _load_examples(cfg: SFTConfig, nla: nla_core.NLAConfig, tokenizer) -> tuple[list[Any], list[Any]]:
    """The parquet's rows and the training examples made of them (rows longer than max_tokens dropped, counted)."""
    if cfg.mode == "av":
        rows = list(stream_rows(cfg.parquet, nla, stop=cfg.max_rows, extra_columns=("response",), key="parquet"))
        eos = (tokenizer.eos_token_id,)
        examples: list[Any] = [
            AVExample(tuple(build_prompt_ids(r.prompt, nla, tokenizer, row=r.index)),
                      tuple(tokenizer.encode(r.extras["response"], add_special_tokens=False)) + eos, r.activation)
            for r in rows
        ]
        examples = [e for e in examples if len(e.response_ids) <= cfg.max_tokens]
    else:
        if nla.extraction_layer_index is None:
            raise DataError(f"sidecar of {cfg.parquet}: names no extraction layer (extraction.layer_index); add it")
        rows = list(stream_rows(cfg.parquet, nla, stop=cfg.max_rows, text_prompt=True, key="parquet"))
        encoded = [(tokenizer.encode(r.prompt, add_special_tokens=False), r.activation) for r in rows]
        examples = [e for e in encoded if 0 < len(e[0]) <= cfg.max_tokens]
    if len(rows) > len(examples):
        print(f"[sft {cfg.mode}] dropped {len(rows) - len(examples)} rows longer than max_tokens={cfg.max_tokens}",
              flush=True)
    if len(examples) < cfg.batch_size:
        raise DataError(
            f"parquet: {cfg.parquet} yields {len(examples)} usable rows, fewer than batch_size={cfg.batch_size}; "
            "use more data or a smaller batch_size"
        )
    return rows, examples


def _build_model(cfg: SFTConfig, model_dir: Path, nla: nla_core.NLAConfig, resume_from: Path | None, *,
                 injection: Injection, mse_scale: float | None, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.nn.Module, Injector | None]:
    """The AV (actor + LoRA, or the whole LM with av_lora=false; with its injector) or the AR, new or from the
    checkpoint a resumed run continues."""
    if cfg.mode == "av":
        if cfg.av_lora:
            model = load_actor(
                model_dir, lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha, use_rslora=cfg.use_rslora,
                resume_adapter=resume_from, dtype=dtype, device=device, quant=cfg.quant,
                lora_targets=cfg.lora_targets,
            )
        else:  # every parameter trains; a resumed run continues the checkpoint's full weights
            model = load_base_lm(resume_from or model_dir, dtype=dtype, device=device).requires_grad_(True)
        return model, Injector.for_sidecar(model, nla, injection)
    if resume_from is not None:  # an AR-LoRA checkpoint rebuilds its LoRA around the (quantised) base itself
        return ARModel.from_pretrained(resume_from, mse_scale=mse_scale, dtype=dtype, device=device), None
    model = ARModel.from_pretrained(model_dir, mse_scale=mse_scale, extraction_layer_index=nla.extraction_layer_index,
                                    create_head=True, dtype=dtype, device=device, quant=cfg.quant)
    if cfg.ar_lora:
        model.add_lora(r=cfg.lora_r, alpha=cfg.lora_alpha, use_rslora=cfg.use_rslora, base_model=model_dir,
                       quant=cfg.quant, targets=cfg.lora_targets)
    return model, None


def _train(run: _Run, stop: StopSignals) -> None:
    """The steps from run.start_step: update, log, evaluate on the held-out rows, checkpoint, stop on a plateau."""
    cfg = run.cfg
    logger = make_logger(
        [n for n in cfg.logger if n != "console"], save_dir=run.save_dir, config_dict=config_to_dict(cfg),
        project=cfg.wandb_project, start_step=run.start_step,
    )
    bar = progress_bar(total=run.num_steps, initial=run.start_step, desc=f"sft {cfg.mode}", unit="step")
    for step in range(run.start_step, run.num_steps):
        # --- preemption: a signal ends the run here, between steps -----------------------------
        if stop.should_stop(step):
            if boundary_save_due(step, start_step=run.start_step, save_every=cfg.save_every,
                                 save_on_signal=cfg.save_on_signal):
                run.save(step, run.stopping, None)
            logger.close()
            raise stop.stopped(ckpt.latest_checkpoint(run.save_dir), command="sft")

        record = _update(run, step)
        steps_done = step + 1
        evaluated = run.heldout is not None and (steps_done % cfg.eval_every == 0 or steps_done == run.num_steps)
        score = _evaluate(run, steps_done, record) if evaluated else None
        logger.log(step, record)
        if step % cfg.log_every == 0 or steps_done == run.num_steps or evaluated:
            _progress_line(run, step, record)
        bar.update()

        # --- checkpoint: on the schedule, at a new best, and where the run stops ---------------
        stopping_now = run.stopping.should_stop
        if (steps_done % cfg.save_every == 0 or steps_done == run.num_steps or stopping_now
                or (evaluated and cfg.keep_best and run.stopping.improved)):
            # Only a new best carries its score: the highest score on disk is then the rule's best (min_delta too).
            run.save(steps_done, run.stopping, score if evaluated and run.stopping.improved else None)
        if stopping_now:
            say_line(f"[sft {cfg.mode}] held-out plateau: no new best in {cfg.patience} evaluations; stopped at step "
                     f"{steps_done} of {run.num_steps}")
            break
    bar.close()
    logger.close()


def _update(run: _Run, step: int) -> dict[str, float]:
    """One optimizer step at its scheduled learning rate; its record for metrics.jsonl."""
    cfg = run.cfg
    t0 = time.perf_counter()
    lr = cfg.lr * lr_factor(step, num_steps=run.num_steps, warmup_steps=cfg.warmup_steps, schedule=cfg.lr_schedule)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    batch = [run.examples[i] for i in run.order.next_batch(cfg.batch_size)]
    if cfg.mode == "av":
        loss, grad_norm = _av_step(run.model, run.injector, run.optimizer, batch, cfg,
                                   pad_id=run.tokenizer.pad_token_id)
        record = {"loss": loss}
    else:
        loss, grad_norm = critic_step(
            run.model, run.optimizer, [ids for ids, _ in batch], torch.stack([a for _, a in batch]),
            pad_id=run.tokenizer.pad_token_id, micro_batch=cfg.micro_batch, max_grad_norm=cfg.max_grad_norm,
        )
        record = {"loss": loss, "mse_mean": loss, "fve": nla_core.fve(loss, float(run.baselines.rawvar)),
                  "fve_meannorm": nla_core.fve(loss, float(run.baselines.meannorm))}
    if not math.isfinite(grad_norm):
        say_line(f"[warn] sft {cfg.mode} step {step}: grad norm {grad_norm} is not finite; optimizer step skipped",
                 error=True)
    record.update(grad_norm=grad_norm, lr=lr, time_step=time.perf_counter() - t0)
    return record


def _evaluate(run: _Run, steps_done: int, record: dict[str, float]) -> float:
    """Score the held-out rows, add the figures to `record`, advance the stopping rule; returns the signed score."""
    cfg = run.cfg
    t0 = time.perf_counter()
    template = run.nla.critic_prompt_template
    if cfg.mode == "ar":
        held = sft_eval.evaluate_ar(run.model, run.tokenizer, run.heldout, template=template, mse_scale=run.mse_scale,
                                    max_tokens=cfg.max_tokens, micro_batch=cfg.micro_batch)
    else:
        held = sft_eval.evaluate_av(run.model, run.injector, run.tokenizer, run.heldout, micro_batch=cfg.micro_batch,
                                    ar=run.eval_ar, template=template, mse_scale=run.mse_scale,
                                    max_new_tokens=cfg.eval_max_new_tokens,
                                    max_tokens=TrainConfig.max_explanation_tokens, seed=cfg.seed)
    key, higher = run.selection
    score = held[key] if higher else -held[key]
    run.stopping = run.stopping.update(score, steps_done)
    record.update(held, time_eval=time.perf_counter() - t0)
    return score


def _progress_line(run: _Run, step: int, record: dict[str, float]) -> None:
    cfg = run.cfg
    fve = f" | FVE {record['fve']:.1%}" if "fve" in record else ""
    line = (f"[sft {cfg.mode}] step {step:04d}/{run.num_steps} | loss {record['loss']:.4f}{fve} | "
            f"grad {record['grad_norm']:.3f} | lr {record['lr']:.2e} | {record['time_step']:.2f}s")
    if any(k.startswith("heldout/") for k in record):
        line += " | " + sft_eval.describe(record, run.stopping, *run.selection)
    say_line(line)


def _finish(run: _Run) -> Path:
    """The run's result: the best held-out checkpoint (keep_best with an eval) or the newest; says which."""
    cfg = run.cfg
    newest = ckpt.latest_checkpoint(run.save_dir)
    best = ckpt.best_checkpoint(run.save_dir, by=HELDOUT_SCORE) if run.heldout is not None and cfg.keep_best else None
    final = best or newest
    role = "av_ckpt" if cfg.mode == "av" else "ar_ckpt"
    which = "best held-out checkpoint" if best is not None else "checkpoint"
    say_line(f"[sft {cfg.mode}] done: {which} {final} (nla train {role}={final}); metrics "
             f"{run.save_dir / 'metrics.jsonl'}")
    return final


def _av_step(actor, injector: Injector, optimizer, batch: Sequence[AVExample], cfg: SFTConfig, *, pad_id: int) -> tuple[float, float]:
    """One optimizer step on the token-mean response NLL of `batch`, micro-batched; returns (loss, grad norm).

    Every micro-batch divides by the whole batch's token count, so the accumulated
    gradient is the full batch's. A non-finite grad norm skips the step.
    """
    optimizer.zero_grad(set_to_none=True)
    n_tokens = sum(len(e.response_ids) for e in batch)
    total = 0.0
    for start in range(0, len(batch), cfg.micro_batch):
        nll, _ = av_response_nll(actor, injector, batch[start : start + cfg.micro_batch], pad_id=pad_id)
        loss = nll / n_tokens
        loss.backward()
        total += float(loss.detach())
    grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable_parameters(actor), cfg.max_grad_norm))
    if math.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, grad_norm
