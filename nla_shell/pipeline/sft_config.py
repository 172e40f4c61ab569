"""`nla sft`'s settings: the SFTConfig schema (one field per key, each with its docstring), the keys a resumed run
may change, and the checks the types cannot express. How any config is read (YAML, flags, key=value overrides,
coercion, one-line errors) is nla_shell.io.config's; the run is nla_shell.pipeline.sft.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from nla_core import HeldoutDocs
from nla_shell.io.config import ConfigError, normalize_fields

__all__ = ["SFT_RESUME_MUTABLE_KEYS", "SFTConfig"]


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
    injection_layer: int | None = None
    """AV, residual_add only (an nla addition, written to the AV's sidecar): the decoder block at whose output the
    vector is added; None: the sidecar's, else block 1 (the reference's)."""
    save_dir: str
    """Run directory: config.yaml, metrics.jsonl, step_NNNNNN/ checkpoints."""
    num_steps: int = 500
    """Optimizer steps (the most, with a held-out stopping rule); `epochs` replaces it when set."""
    epochs: float | None = None
    """Passes over the training rows: the run takes ceil(epochs * rows / batch_size) steps instead of num_steps."""
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
    lora_targets: tuple[str, ...] = ()
    """Module names the LoRA adapts (PEFT's target_modules; an nla addition to upstream's SFT), e.g.
    q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj for a Llama's attention and MLP. Empty: the
    family's attention projections (q, k, v, o), as upstream's and the reference's LoRA."""
    max_tokens: int = 256
    """Longest AV response / AR input in tokens; longer rows are dropped (and counted)."""
    eval_parquet: str | None = None
    """Held-out rows (datagen's eval.parquet: documents the training rows do not share) scored every eval_every
    steps, on the progress line and in metrics.jsonl as heldout/*: the AR's FVE on the gold explanations; the AV's
    token NLL with each row's vector and with another row's, and their gap (what the vector tells it), and with
    eval_ar its round-trip FVE. None: no held-out evaluation."""
    eval_every: int = 100
    """Steps between held-out evaluations (and one at the last step)."""
    eval_rows: int = 256
    """Held-out rows scored at each evaluation, spread over eval_parquet's documents (heldout_docs)."""
    heldout_docs: HeldoutDocs = "select"
    """Which of eval_parquet's documents the eval_rows are spread over, a row of each before a second
    (nla_core.spread_rows; an nla addition): "select", the half a hash of doc_id gives checkpoint selection;
    "report", the other half, which `nla eval` scores by default; "all". The checkpoint is then chosen on
    documents the reported result never sees."""
    eval_ar: str | None = None
    """AV only: an AR dir (`nla sft --mode ar`) that scores the AV's sampled held-out explanations: the round-trip
    FVE, which the run then selects on (without it, the held-out NLL, lower is better)."""
    eval_max_new_tokens: int = 64
    """Longest explanation the AV samples for the round-trip FVE, in tokens."""
    patience: int = 0
    """Stop after this many held-out evaluations in a row without a new best (0: run every step)."""
    min_delta: float = 0.0
    """How much a held-out figure must beat the best so far to count as a new best."""
    keep_best: bool = True
    """With eval_parquet: save a checkpoint at each new best and make the best one the run's result (what `done`
    names and the demo trains on); False: the last checkpoint."""
    keep_last: int | None = None
    """Keep only the newest keep_last checkpoints, and the best held-out one; None keeps every checkpoint."""
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
    av_lora: bool = True
    """mode=av: train an rsLoRA adapter on the target LM (lora_r, lora_alpha, use_rslora, lora_targets) and save a
    PEFT adapter dir. False (an nla addition) fine-tunes every parameter of the target LM, the tied embedding
    included, in `dtype`, and saves a plain HF model dir: `nla train` then starts a fresh LoRA on it with these
    weights (adapter off) as the KL reference. Needs quant=none. Memory beyond the weights: a gradient and AdamW's
    two moments for every parameter, about 3x the weights (less with bitsandbytes' 8-bit moments, which
    make_optimizer takes on CUDA when installed)."""
    ar_lora: bool = False
    """mode=ar: freeze the truncated backbone and train a LoRA on it (lora_r, lora_alpha, use_rslora) plus the
    float32 value head, as EasyNLA's `--use-lora`; saved in EasyNLA's AR-LoRA layout (ar_meta.json +
    ar_lora_value_head.safetensors, not the backbone). False fine-tunes the whole backbone."""

    def __post_init__(self) -> None:
        normalize_fields(self)
        for key in ("num_steps", "batch_size", "micro_batch", "lora_r", "lora_alpha", "max_tokens", "save_every",
                    "log_every", "eval_every", "eval_rows", "eval_max_new_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(f"config key '{key}' = {getattr(self, key)!r} is invalid: use an integer >= 1")
        for key in ("lr", "max_grad_norm"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"config key '{key}' = {getattr(self, key)!r} is invalid: use a number > 0")
        if self.warmup_steps < 0:
            raise ConfigError(f"config key 'warmup_steps' = {self.warmup_steps} is invalid: use an integer >= 0")
        if self.max_rows is not None and self.max_rows < 1:
            raise ConfigError(f"config key 'max_rows' = {self.max_rows} is invalid: use an integer >= 1 or null")
        for key in ("patience", "min_delta"):
            if getattr(self, key) < 0:
                raise ConfigError(f"config key '{key}' = {getattr(self, key)!r} is invalid: use a number >= 0")
        if self.epochs is not None and not self.epochs > 0:
            raise ConfigError(f"config key 'epochs' = {self.epochs!r} is invalid: use a number > 0, or null for num_steps")
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError(f"config key 'keep_last' = {self.keep_last} is invalid: use an integer >= 1 or null")
        if self.eval_ar is not None and self.mode != "av":
            raise ConfigError("config key 'eval_ar' applies to mode=av only (the AR's held-out FVE needs no other "
                              "model); drop it or set mode=av")
        if self.eval_parquet is None and (self.eval_ar is not None or self.patience > 0):
            key = "eval_ar" if self.eval_ar is not None else "patience"
            raise ConfigError(f"config key '{key}' needs held-out rows: set eval_parquet (datagen's eval.parquet)")
        if not self.av_lora and self.mode != "av":
            raise ConfigError("config key 'av_lora' = false applies to mode=av only (the AR's choice is ar_lora); "
                              "drop it or set mode=av")
        if not self.av_lora and self.quant != "none":
            raise ConfigError(f"config key 'av_lora' = false fine-tunes the whole AV, which cannot be quantised "
                              f"(quant={self.quant}); set quant=none or av_lora=true")
        if self.ar_lora and self.mode != "ar":
            raise ConfigError("config key 'ar_lora' = true applies to mode=ar only (the AV's choice is av_lora); "
                              "drop it or set mode=ar")


SFT_RESUME_MUTABLE_KEYS = frozenset(
    {"num_steps", "epochs", "save_every", "log_every", "save_dir", "resume", "overwrite", "logger", "wandb_project",
     "device", "micro_batch", "save_on_signal", "patience", "min_delta", "keep_last"}
)
"""SFTConfig keys a resumed run may change (with cosine, a new num_steps reshapes the rest of the decay)."""
