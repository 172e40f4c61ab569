"""`nla eval`: held-out FVE, reward and extraction rate of an AV+AR pair (and of the AR on gold text).

The AV writes one explanation per held-out row (temperature 1, seeded, so two checkpoints
evaluated with the same seed see the same random stream); the AR reconstructs the
activation from it; FVE = 1 - mean MSE / the predict-the-mean MSE of these rows' own
activations ("rawvar", the paper's baseline; "meannorm" the older one). When the parquet
has an `explanation` column (datagen's eval split), the AR is also scored on those gold
explanations: the ceiling the AV is chasing. Writes `eval_samples.jsonl` (one object per
row), `eval_table.md` (the first rows as a markdown table) and `eval_summary.json`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

import pyarrow.parquet as pq
import torch

import nla_core
from nla_shell.io.config import ConfigError, normalize_fields
from nla_shell.io.data import DataError, RLRow, build_prompt_ids, check_tokenizer, stream_rows
from nla_shell.io.sidecars import injection_settings, load_sidecar
from nla_shell.engines.hf import HFRolloutEngine
from nla_shell.io.paths import require_file, require_model
from nla_shell.io.progress import progress_bar
from nla_shell.metrics import finite_mean
from nla_shell.models import ARModel, Injector, base_model_dir, load_actor
from nla_shell.training.scoring import score_explanations
from nla_shell.training.train import evaluate_rows, resolve_device

OPTIONAL_COLUMNS = ("position", "context", "explanation")
"""Read when present: they label the samples, and `explanation` enables the gold-AR score."""


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Settings of `nla eval`."""

    ar: str
    """AR dir (from `nla sft --mode ar`, or a co-trained critic)."""
    parquet: str
    """Held-out rows (e.g. datagen's eval.parquet); the first n_rows are used."""
    out_dir: str
    """Where eval_samples.jsonl, eval_table.md and eval_summary.json go."""
    av: str | None = None
    """AV: an adapter dir (SFT or an RL checkpoint's adapter/) or a full checkpoint; None scores gold text only."""
    sidecar: str | None = None
    """Dataset sidecar; None finds `<parquet>.nla_meta.yaml`."""
    tokenizer: str | None = None
    """Tokenizer dir; None takes the AV's, its base model's, or the AR's, the first that has one."""
    n_rows: int = 256
    """Held-out rows to evaluate."""
    max_new_tokens: int = 64
    """Longest AV explanation, in tokens."""
    max_explanation_tokens: int = 1024
    """AR inputs longer than this count as failed extractions (as in training)."""
    micro_batch: int = 64
    """Explanations per AR forward."""
    reward: Literal["neg_log", "neg"] = "neg_log"
    """Reward from MSE, as in training."""
    seed: int = 0
    """Seed of the AV's sampling."""
    table_rows: int = 12
    """Rows shown in eval_table.md."""
    device: str = "auto"
    """"auto", "cpu", "cuda" or "cuda:N"."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Model dtype ("auto": bf16 on cuda, fp32 on cpu)."""

    def __post_init__(self) -> None:
        normalize_fields(self)
        for key in ("n_rows", "max_new_tokens", "max_explanation_tokens", "micro_batch"):
            if getattr(self, key) < 1:
                raise ConfigError(f"config key '{key}' = {getattr(self, key)!r} is invalid: use an integer >= 1")
        if self.table_rows < 0:
            raise ConfigError(f"config key 'table_rows' = {self.table_rows} is invalid: use an integer >= 0")


@dataclass(frozen=True)
class EvalResult:
    metrics: dict[str, float]
    """"av/…" (when an AV was given), "gold/…" (when the parquet has explanations), baselines, n_rows."""
    samples: list[dict[str, Any]]
    """One object per row, as in eval_samples.jsonl."""
    out_dir: Path


def tokenizer_dir(*candidates: str | Path | None) -> Path:
    """The first candidate dir holding a tokenizer; an adapter dir without one points to its base model."""
    tried = []
    for candidate in candidates:
        if candidate is None:
            continue
        for option in dict.fromkeys((Path(candidate), base_model_dir(candidate))):
            tried.append(str(option))
            if (option / "tokenizer_config.json").is_file():
                return option
    raise FileNotFoundError(f"no tokenizer_config.json in {tried}; pass tokenizer=DIR")


def load_av(av: str | Path, *, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The AV for inference: an adapter dir on its base model, or a full checkpoint (a zero LoRA on top)."""
    actor = load_actor(av, lora_r=1, lora_alpha=1, use_rslora=True, resume_adapter=None, dtype=dtype, device=device)
    return actor.eval()


class _TableCollector:
    """A Logger that keeps the tables logged to it (evaluate_rows reports samples that way)."""

    def __init__(self) -> None:
        self.tables: dict[str, list[dict[str, Any]]] = {}

    def log(self, step: int, record) -> None:
        pass

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self.tables.setdefault(name, []).extend(dict(zip(columns, row)) for row in rows)

    def close(self) -> None:
        pass


def evaluate(cfg: EvalConfig) -> EvalResult:
    """Score the AV+AR (and the AR on gold explanations) on held-out rows; write the reports."""
    from transformers import AutoTokenizer

    # --- inputs ----------------------------------------------------------------------------
    require_model("ar", cfg.ar, hub_ok=False)
    require_model("av", cfg.av)
    require_model("tokenizer", cfg.tokenizer)
    require_file("parquet", cfg.parquet)
    require_file("sidecar", cfg.sidecar)
    device, dtype = resolve_device(cfg.device, cfg.dtype)
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer or tokenizer_dir(cfg.av, cfg.ar))
    nla = load_sidecar(cfg.sidecar or cfg.parquet)
    check_tokenizer(nla, tokenizer)
    mse_scale = nla_core.resolve_target_scale(nla.mse_scale, nla.d_model)
    present = set(pq.ParquetFile(cfg.parquet).schema_arrow.names)
    rows: list[RLRow] = list(stream_rows(
        cfg.parquet, nla, stop=cfg.n_rows, extra_columns=[c for c in OPTIONAL_COLUMNS if c in present], key="parquet",
    ))
    if not rows:
        raise DataError(f"parquet: {cfg.parquet} has no rows to evaluate")
    golds = torch.stack([r.activation for r in rows])
    baselines = nla_core.predict_mean_baselines(golds, scale=mse_scale)
    rawvar, meannorm = float(baselines.rawvar), float(baselines.meannorm)
    critic = ARModel.from_pretrained(cfg.ar, mse_scale=mse_scale, dtype=dtype, device=device).eval()
    score_kwargs = dict(template=nla.critic_prompt_template, mse_scale=mse_scale, reward_kind=cfg.reward,
                        max_tokens=cfg.max_explanation_tokens, micro_batch=cfg.micro_batch)
    metrics: dict[str, float] = {"n_rows": len(rows), "baseline_rawvar": rawvar, "baseline_meannorm": meannorm}
    samples = [
        {"idx": i, "doc_id": r.doc_id, "position": r.extras.get("position"), "context": r.extras.get("context"),
         "gold_explanation": r.extras.get("explanation")}
        for i, r in enumerate(rows)
    ]

    # --- the AR on gold explanations --------------------------------------------------------
    if "explanation" in present:
        gold = score_explanations(critic, tokenizer, [r.extras["explanation"] for r in rows], golds, **score_kwargs)
        gold_mse = finite_mean(gold.mse)
        metrics.update({"gold/mse_mean": gold_mse, "gold/fve": nla_core.fve(gold_mse, rawvar),
                        "gold/fve_meannorm": nla_core.fve(gold_mse, meannorm),
                        "gold/reward_mean": float(gold.reward.mean())})
        for sample, mse in zip(samples, gold.mse.tolist()):
            sample.update(gold_mse=_finite_or_none(mse), gold_fve=_finite_or_none(nla_core.fve(mse, rawvar)))

    # --- the AV's explanations, scored by the AR --------------------------------------------
    if cfg.av is not None:
        actor = load_av(cfg.av, dtype=dtype, device=device)
        style, injection_norm = injection_settings(nla, av_dir=cfg.av)
        injector = Injector(actor, marker_id=nla.injection_token_id, left_id=nla.injection_left_neighbor_id,
                            right_id=nla.injection_right_neighbor_id, style=style, injection_norm=injection_norm)
        prompt_ids = [build_prompt_ids(r.prompt, nla, tokenizer, row=r.index) for r in rows]
        collector = _TableCollector()
        torch.manual_seed(cfg.seed)
        with progress_bar(total=len(rows), desc="eval", unit="row") as bar:
            result = evaluate_rows(
                HFRolloutEngine(actor, injector, tokenizer), critic, tokenizer, rows, prompt_ids, logger=collector,
                step=0, max_new_tokens=cfg.max_new_tokens, rawvar=rawvar, meannorm=meannorm,
                score_kwargs=score_kwargs, chunk=cfg.micro_batch, bar=bar,
            )
        metrics.update({k.replace("eval/", "av/"): v for k, v in result.items()})
        for sample, scored in zip(samples, collector.tables["eval_samples"]):
            sample.update(explanation=scored["explanation"] if scored["extracted"] else None,
                          reward=scored["reward"], mse=_finite_or_none(scored["mse"]),
                          fve=_finite_or_none(scored["fve"]))

    # --- reports ----------------------------------------------------------------------------
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "eval_samples.jsonl").open("w", encoding="utf-8") as f:
        for sample in samples:
            f.write(json.dumps(sample, ensure_ascii=False) + "\n")
    (out_dir / "eval_table.md").write_text(markdown_table(samples[: cfg.table_rows]), encoding="utf-8")
    summary = {k: _finite_or_none(v) for k, v in metrics.items()}
    (out_dir / "eval_summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    print("[eval] " + " | ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()),
          flush=True)
    return EvalResult(metrics, samples, out_dir)


def markdown_table(samples: Sequence[dict[str, Any]], *, context_chars: int = 40) -> str:
    """Samples as a markdown table: the context's tail, the gold and the AV explanation, their FVEs."""
    columns = [("context", "context (tail)"), ("gold_explanation", "gold"), ("gold_fve", "gold FVE"),
               ("explanation", "AV explanation"), ("fve", "AV FVE")]
    present = [(key, title) for key, title in columns if any(key in s for s in samples)]
    lines = ["| " + " | ".join(title for _, title in present) + " |", "|" + "---|" * len(present)]
    for s in samples:
        cells = []
        for key, _ in present:
            value = s.get(key)
            if isinstance(value, float):
                cells.append(f"{value:.2f}")
            elif key == "context" and isinstance(value, str):
                # A context decoded from a token prefix can end inside a multi-byte character (the
                # sampled token is its first byte): decoders then end it in U+FFFD. Cut on characters.
                value = value.rstrip("\ufffd")
                cells.append(("…" if len(value) > context_chars else "") + value[-context_chars:])
            else:
                cells.append("—" if value is None else str(value))
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _finite_or_none(value: Any) -> Any:
    """JSON-safe: ints stay, non-finite floats become None."""
    if isinstance(value, int):
        return value
    value = float(value)
    return value if math.isfinite(value) else None
