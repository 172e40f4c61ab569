"""`nla sft --mode av|ar`: the supervised warm starts that `nla train` starts from.

AV: the target LM plus an rsLoRA adapter learns to write the gold response
(`<explanation>…</explanation>` + EOS) after the AV prompt, with the activation injected
at the marker; the loss is the token-mean NLL of the response tokens only.
AR: an `ARModel` (the LM truncated after the extraction layer + a float32 value head)
regresses the normalised activation from the AR prompt; the loss is `critic_step`'s MSE.

Each checkpoint `save_dir/step_NNNNNN/` is directly what `nla train` loads: for the AV a
PEFT adapter dir (+ tokenizer), which `av_ckpt` continues and keeps as the KL reference;
for the AR an ARModel dir (`ar_ckpt`). Both also hold `nla_meta.yaml` (kind nla_model,
with the FVE baselines of the training activations), the optimizer/RNG/data-cursor state
and the config, so an interrupted run resumes where it stopped (`resume: auto`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

import torch

import nla_core
from nla_shell import families
from nla_shell.training import checkpoint as ckpt
from nla_shell.io.config import ConfigError, config_to_dict, normalize_fields
from nla_shell.io.data import DataError, build_prompt_ids, check_tokenizer, stream_rows
from nla_shell.io.sidecars import MODEL_SIDECAR, injection_settings, load_sidecar, model_sidecar, write_sidecar
from nla_shell.engines.base import Rollout
from nla_shell.io.logging import make_logger
from nla_shell.io.paths import require_file, require_model
from nla_shell.io.progress import progress_bar, say_line
from nla_shell.models import ARModel, Injector, load_actor, response_logprobs, trainable_parameters
from nla_shell.quant import require_quant
from nla_shell.training.scoring import critic_step
from nla_shell.training.preemption import StopSignals, boundary_save_due
from nla_shell.training.runlock import RunDirLock
from nla_shell.training.runtime import DataOrder, make_optimizer, resolve_device, seed_everything
from nla_shell.training.update import response_batch


@dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """Settings of `nla sft`."""

    mode: Literal["av", "ar"]
    """"av": LoRA warm start of the verbaliser; "ar": warm start of the reconstructor."""
    model: str
    """The target LM (HF checkpoint dir with tokenizer): the AV's base, or the AR's source before truncation."""
    parquet: str
    """av_sft.parquet (needs a `response` column) or ar_sft.parquet (`prompt` the filled AR template, a string), nla's or upstream's."""
    sidecar: str | None = None
    """Dataset sidecar (or the parquet or checkpoint dir it belongs to); None finds `<parquet>.nla_meta.yaml`."""
    injection_style: Literal["residual_add", "embedding_replace"] | None = None
    """AV only: "residual_add" (the reference's add at block 1's output) or "embedding_replace" (kitft's); None: the sidecar's."""
    injection_scale: str | None = None
    """AV, embedding_replace only: the injected L2 norm ("sqrt_d_model", "raw" or a number); None: the sidecar's."""
    save_dir: str
    """Run directory: config.yaml, metrics.jsonl, step_NNNNNN/ checkpoints."""
    num_steps: int = 500
    """Optimizer steps."""
    batch_size: int = 32
    """Examples per optimizer step."""
    micro_batch: int = 8
    """Examples per forward/backward; the gradient is the whole batch's whatever this is."""
    lr: float = 1e-4
    """Peak learning rate."""
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    """After warmup: constant, or cosine decay to 0 at num_steps."""
    warmup_steps: int = 0
    """Linear warmup steps from lr/warmup_steps to lr."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip; a non-finite norm skips the step."""
    lora_r: int = 64
    """LoRA rank (the AV's; the AR's with ar_lora) on families.lora_targets."""
    lora_alpha: int = 64
    """LoRA alpha (the AV's; the AR's with ar_lora)."""
    use_rslora: bool = True
    """rsLoRA scaling alpha/sqrt(r) (the AV's LoRA; the AR's with ar_lora)."""
    max_tokens: int = 256
    """Longest AV response / AR input in tokens; longer rows are dropped (and counted)."""
    max_rows: int | None = None
    """Use at most the first max_rows rows; None uses all."""
    save_every: int = 100
    """Checkpoint every N steps (and at the end)."""
    log_every: int = 10
    """Console line every N steps (metrics.jsonl gets every step)."""
    logger: tuple[Literal["console", "jsonl", "wandb", "tensorboard"], ...] = ("console",)
    """Metric sinks (comma-separated); save_dir/metrics.jsonl is always written; the progress bar shows on a terminal."""
    wandb_project: str = "nla"
    """wandb project when logger includes wandb."""
    resume: Literal["auto", "never"] = "auto"
    """"auto" continues from the newest complete checkpoint in save_dir."""
    overwrite: bool = False
    """Allow deleting a save_dir that holds a different run."""
    save_on_signal: bool = True
    """On SIGTERM / SIGINT, finish the current step and save a checkpoint before exiting (143 / 130)."""
    seed: int = 0
    """Seed of the data order, the LoRA init, and python's, numpy's and torch's RNGs."""
    device: str = "auto"
    """"auto", "cpu", "cuda" or "cuda:N"."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Model dtype ("auto": bf16 on cuda, fp32 on cpu); the AR value head stays float32."""
    quant: Literal["none", "4bit", "8bit"] = "none"
    """Load the frozen base quantised with bitsandbytes (CUDA, pip install 'nla[bnb]'); the LoRA trains in `dtype`.
    mode=ar needs ar_lora=true (a fully fine-tuned backbone cannot be quantised)."""
    ar_lora: bool = False
    """mode=ar: freeze the truncated backbone and train a LoRA on it (lora_r, lora_alpha, use_rslora) plus the
    float32 value head, as EasyNLA's `--use-lora`; saved in EasyNLA's AR-LoRA layout (ar_meta.json +
    ar_lora_value_head.safetensors, not the backbone). False fine-tunes the whole backbone."""

    def __post_init__(self) -> None:
        normalize_fields(self)
        for key in ("num_steps", "batch_size", "micro_batch", "lora_r", "lora_alpha", "max_tokens", "save_every",
                    "log_every"):
            if getattr(self, key) < 1:
                raise ConfigError(f"config key '{key}' = {getattr(self, key)!r} is invalid: use an integer >= 1")
        for key in ("lr", "max_grad_norm"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"config key '{key}' = {getattr(self, key)!r} is invalid: use a number > 0")
        if self.warmup_steps < 0:
            raise ConfigError(f"config key 'warmup_steps' = {self.warmup_steps} is invalid: use an integer >= 0")
        if self.max_rows is not None and self.max_rows < 1:
            raise ConfigError(f"config key 'max_rows' = {self.max_rows} is invalid: use an integer >= 1 or null")
        if self.ar_lora and self.mode != "ar":
            raise ConfigError("config key 'ar_lora' = true applies to mode=ar only (the AV always trains a LoRA); "
                              "drop it or set mode=ar")


SFT_RESUME_MUTABLE_KEYS = frozenset(
    {"num_steps", "save_every", "log_every", "save_dir", "resume", "overwrite", "logger", "wandb_project", "device",
     "micro_batch", "save_on_signal"}
)
"""SFTConfig keys a resumed run may change (with cosine, a new num_steps reshapes the rest of the decay)."""


def lr_factor(step: int, *, num_steps: int, warmup_steps: int, schedule: str) -> float:
    """Multiplier of the peak lr at `step` (0-based): linear warmup, then constant or cosine to 0."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, num_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


# --------------------------------------------------------------------------- AV loss


@dataclass(frozen=True)
class AVExample:
    prompt_ids: tuple[int, ...]
    """Chat-templated AV prompt with one well-formed marker."""
    response_ids: tuple[int, ...]
    """The gold response's tokens, ending with EOS."""
    activation: torch.Tensor
    """[D] injected at the marker."""


def av_response_nll(
    actor: torch.nn.Module, injector: Injector, examples: Sequence[AVExample], *, pad_id: int
) -> tuple[torch.Tensor, int]:
    """Summed NLL of the response tokens of `examples` (prompt tokens carry no loss), and their count.

    One forward with the activations injected at the markers, through the same response
    batching and fused log-prob path as the GRPO update.
    Returns: (0-d float32 tensor with grad, number of response tokens).
    """
    device = next(actor.parameters()).device
    rollouts = [
        Rollout(torch.tensor(e.prompt_ids + e.response_ids), len(e.prompt_ids), torch.zeros(len(e.response_ids)), "", i)
        for i, e in enumerate(examples)
    ]
    batch = response_batch(rollouts, pad_id=pad_id, device=device)
    vectors = torch.stack([e.activation for e in examples]).to(device, torch.float32)
    with injector.inject(batch.input_ids, vectors):
        logp = response_logprobs(actor, batch.input_ids, batch.attention_mask, batch.positions, batch.targets)
    return -(logp * batch.mask).sum(), int(batch.mask.sum())


# --------------------------------------------------------------------------- the run


def sft(cfg: SFTConfig) -> Path:
    """Run (or resume) AV or AR warm-start training; returns the final checkpoint dir.

    Holds save_dir's lock throughout; raises preemption.RunStopped when a signal stops it
    (after saving, if save_on_signal).
    """
    with RunDirLock(cfg.save_dir), StopSignals(cfg.save_dir) as stop:
        return _run_sft(cfg, stop)


def _run_sft(cfg: SFTConfig, stop: StopSignals) -> Path:
    # --- validate every input before anything is written ---------------------------------
    require_model("model", cfg.model)
    require_file("parquet", cfg.parquet)
    require_file("sidecar", cfg.sidecar)
    device, dtype = resolve_device(cfg.device, cfg.dtype)
    require_quant(cfg.quant, device, trains_ar_backbone=cfg.mode == "ar" and not cfg.ar_lora)
    model_dir = Path(cfg.model).resolve()
    if (model_dir / "adapter_config.json").exists():
        raise ConfigError(
            f"config key 'model' = {cfg.model!r} is a LoRA adapter dir; give the full target LM it was trained on "
            "(SFT starts the adapter itself; to continue a run, rerun it with the same save_dir)"
        )
    tokenizer = families.load_tokenizer(model_dir)
    nla = load_sidecar(cfg.sidecar or cfg.parquet)
    check_tokenizer(nla, tokenizer)
    mse_scale = nla_core.resolve_target_scale(nla.mse_scale, nla.d_model)
    if cfg.mode == "av":
        style, injection_norm = injection_settings(nla, style=cfg.injection_style, scale=cfg.injection_scale)
        rows = list(stream_rows(cfg.parquet, nla, stop=cfg.max_rows, extra_columns=("response",), key="parquet"))
        eos = (tokenizer.eos_token_id,)
        examples: list[Any] = [
            AVExample(tuple(build_prompt_ids(r.prompt, nla, tokenizer, row=r.index)),
                      tuple(tokenizer.encode(r.extras["response"], add_special_tokens=False)) + eos, r.activation)
            for r in rows
        ]
        examples = [e for e in examples if len(e.response_ids) <= cfg.max_tokens]
    else:
        style, injection_norm = "residual_add", None  # the AR injects nothing
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
    baselines = nla_core.predict_mean_baselines(torch.stack([r.activation for r in rows]), scale=mse_scale)

    save_dir = Path(cfg.save_dir)
    config_dict = config_to_dict(cfg)
    ckpt.claim_save_dir(save_dir, config_dict, overwrite=cfg.overwrite, resume=cfg.resume,
                        mutable_keys=SFT_RESUME_MUTABLE_KEYS, num_steps=cfg.num_steps)
    ckpt.remove_stale_entries(save_dir)  # under the lock: no other run's save is in flight
    resume_from = ckpt.latest_verified_checkpoint(save_dir) if cfg.resume == "auto" else None

    # --- model and optimizer ---------------------------------------------------------------
    seed_everything(cfg.seed)
    if cfg.mode == "av":
        model = load_actor(
            model_dir, lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha, use_rslora=cfg.use_rslora,
            resume_adapter=resume_from, dtype=dtype, device=device, quant=cfg.quant,
        )
        injector = Injector(
            model, marker_id=nla.injection_token_id, left_id=nla.injection_left_neighbor_id,
            right_id=nla.injection_right_neighbor_id, style=style, injection_norm=injection_norm,
        )
    elif resume_from is not None:  # an AR-LoRA checkpoint rebuilds its LoRA around the (quantised) base itself
        model = ARModel.from_pretrained(resume_from, mse_scale=mse_scale, dtype=dtype, device=device)
    else:
        model = ARModel.from_pretrained(model_dir, mse_scale=mse_scale, extraction_layer_index=nla.extraction_layer_index,
                                        create_head=True, dtype=dtype, device=device, quant=cfg.quant)
        if cfg.ar_lora:
            model.add_lora(r=cfg.lora_r, alpha=cfg.lora_alpha, use_rslora=cfg.use_rslora, base_model=model_dir,
                           quant=cfg.quant)
    model.train()
    optimizer = make_optimizer(trainable_parameters(model), cfg.lr, device=device, label=f"sft {cfg.mode}")
    order = DataOrder(len(examples), cfg.seed)
    start_step = 0
    if resume_from is not None:
        state = ckpt.load_training_state(resume_from)
        start_step = state.step
        order.epoch, order.offset = state.data_cursor["epoch"], state.data_cursor["offset"]
        optimizer.load_state_dict(state.optimizer_states["model"])
        ckpt.set_rng_state(state.rng)
        print(f"[resume] sft {cfg.mode} from {resume_from} at step {start_step}", flush=True)
    logger = make_logger(
        [n for n in cfg.logger if n != "console"], save_dir=save_dir, config_dict=config_dict,
        project=cfg.wandb_project, start_step=start_step,
    )
    sidecar_out = model_sidecar(
        nla, role=cfg.mode, stage="sft", base_checkpoint=str(model_dir), injection_style=style,
        injection_norm=injection_norm, trained_on=[str(Path(cfg.parquet).resolve())], baselines=baselines,
        provenance={"sft": {"mode": cfg.mode, "parquet": str(Path(cfg.parquet).resolve()), "base_model": str(model_dir)}},
    )

    def save(step_done: int) -> Path:
        def write(tmp: Path) -> None:
            model.save_pretrained(tmp)  # AV: adapter_config.json + weights; AR: backbone + value head
            tokenizer.save_pretrained(tmp)
            write_sidecar(sidecar_out, tmp / MODEL_SIDECAR)
            ckpt.save_training_state(tmp, step=step_done, data_cursor=order.state(),
                                     optimizer_states={"model": optimizer.state_dict()}, rng=ckpt.rng_state())
            (tmp / ckpt.CONFIG_NAME).write_text((save_dir / ckpt.CONFIG_NAME).read_text())

        return ckpt.save_checkpoint(save_dir, step_done, write=write)

    # --- steps -------------------------------------------------------------------------------
    final = resume_from
    bar = progress_bar(total=cfg.num_steps, initial=start_step, desc=f"sft {cfg.mode}", unit="step")
    for step in range(start_step, cfg.num_steps):
        # --- preemption: a signal ends the run here, between steps -----------------------------
        if stop.should_stop(step):
            if boundary_save_due(step, start_step=start_step, save_every=cfg.save_every,
                                 save_on_signal=cfg.save_on_signal):
                save(step)
            logger.close()
            raise stop.stopped(ckpt.latest_checkpoint(save_dir), command="sft")

        t0 = time.perf_counter()
        lr = cfg.lr * lr_factor(step, num_steps=cfg.num_steps, warmup_steps=cfg.warmup_steps, schedule=cfg.lr_schedule)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = [examples[i] for i in order.next_batch(cfg.batch_size)]
        if cfg.mode == "av":
            loss, grad_norm = _av_step(model, injector, optimizer, batch, cfg, pad_id=tokenizer.pad_token_id)
            record = {"loss": loss}
        else:
            loss, grad_norm = critic_step(
                model, optimizer, [ids for ids, _ in batch], torch.stack([a for _, a in batch]),
                pad_id=tokenizer.pad_token_id, micro_batch=cfg.micro_batch, max_grad_norm=cfg.max_grad_norm,
            )
            record = {"loss": loss, "mse_mean": loss, "fve": nla_core.fve(loss, float(baselines.rawvar)),
                      "fve_meannorm": nla_core.fve(loss, float(baselines.meannorm))}
        if not math.isfinite(grad_norm):
            say_line(f"[warn] sft {cfg.mode} step {step}: grad norm {grad_norm} is not finite; optimizer step skipped",
                     error=True)
        record.update(grad_norm=grad_norm, lr=lr, time_step=time.perf_counter() - t0)
        logger.log(step, record)
        if step % cfg.log_every == 0 or step + 1 == cfg.num_steps:
            fve = f" | FVE {record['fve']:.1%}" if "fve" in record else ""
            say_line(f"[sft {cfg.mode}] step {step:04d}/{cfg.num_steps} | loss {loss:.4f}{fve} | grad {grad_norm:.3f} "
                     f"| lr {lr:.2e} | {record['time_step']:.2f}s")
        bar.update()

        # --- checkpoint ------------------------------------------------------------------------
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.num_steps:
            final = save(step + 1)
    bar.close()
    logger.close()
    role = "av_ckpt" if cfg.mode == "av" else "ar_ckpt"
    say_line(f"[sft {cfg.mode}] done: checkpoint {final} (nla train {role}={final}); metrics {save_dir / 'metrics.jsonl'}")
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
