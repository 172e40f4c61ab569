"""`nla eval`: held-out FVE of an AV+AR pair, with the controls, length curve and splice-KL that keep it honest.

The AV writes one explanation per held-out row (temperature 1, seeded, so two checkpoints
evaluated with the same seed see the same random stream; or greedy); the AR reconstructs the
activation from it. The numbers (docs/eval.md defines each key):

- FVE = 1 - mean MSE / the predict-the-mean MSE of these rows' own normalised activations
  ("rawvar", the headline) and / the MSE of the mean put back at the norm ("meannorm",
  looser, beside it). Failed extractions are excluded from the MSE and counted in the
  extraction rate.
- Controls, in one table (eval_controls.md): the AV given another row's vector, scored
  against the true row (FVE should collapse); the AR on the gold explanation (the ceiling,
  when the parquet has an `explanation` column); the dataset mean (the floor, FVE 0).
- Length: the AV's explanation lengths in tokens, and FVE(k) with each explanation cut to
  its first k tokens before the AR.
- Splice-KL (needs `model`, the target LM): the reconstruction, put back at the
  activation's norm into the LM's residual stream at the extraction layer and position,
  moves the next-token distribution by KL(clean || spliced); beside it the same for a
  random vector with exactly the AV's error, and for the dataset mean.

Writes eval_samples.jsonl (one object per row), eval_table.md (the first rows),
eval_controls.md and eval_summary.json (every number, and the AV, AR, parquet, sidecar and
model it scored). An out_dir that holds anything is refused unless overwrite.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import numpy as np
import pyarrow.parquet as pq
import torch

import nla_core
from nla_shell import families
from nla_shell.engines.base import sample_explanations
from nla_shell.engines.hf import HFRolloutEngine
from nla_shell.io.config import ConfigError, normalize_fields
from nla_shell.io.data import DataError, RLRow, build_prompt_ids, check_tokenizer, load_heldout_rows
from nla_shell.io.paths import require_file, require_model
from nla_shell.io.progress import progress_bar
from nla_shell.io.sidecars import MODEL_SIDECAR, find_sidecar, injection_settings, load_sidecar, read_sidecar
from nla_shell.metrics import finite_mean, finite_or_none, fve_metrics, token_lengths
from nla_shell.models import ARModel, Injector, base_model_dir, load_actor
from nla_shell.pipeline.splice import splice_kl_metrics
from nla_shell.training.scoring import Scores, ar_predictions, score_explanations
from nla_shell.training.checkpoint import file_sha256
from nla_shell.training.runtime import resolve_device

OPTIONAL_COLUMNS = ("position", "context", "explanation")
"""Read when present: they label the samples; `explanation` enables the gold-AR score, `context` splice-KL."""
OUTPUT_FILES = ("eval_samples.jsonl", "eval_table.md", "eval_controls.md", "eval_summary.json")
"""What `nla eval` writes into out_dir (and, with overwrite, replaces)."""


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Settings of `nla eval`."""

    ar: str
    """AR dir (from `nla sft --mode ar`, or a co-trained critic)."""
    parquet: str
    """Held-out rows (e.g. datagen's eval.parquet); n_rows of them, spread over its documents (heldout_docs)."""
    out_dir: str
    """Where eval_samples.jsonl, eval_table.md, eval_controls.md and eval_summary.json go; must be new or empty."""
    overwrite: bool = False
    """Write into an out_dir that already holds files (eval's own files there are replaced)."""
    av: str | None = None
    """AV: an adapter dir (SFT or an RL checkpoint's adapter/) or a full checkpoint; None scores gold text only."""
    model: str | None = None
    """Target LM (HF checkpoint dir) for splice-KL; None skips splice-KL. Needs the parquet's `context` column."""
    sidecar: str | None = None
    """Dataset sidecar; None finds `<parquet>.nla_meta.yaml`."""
    tokenizer: str | None = None
    """Tokenizer dir; None takes the AV's, its base model's, or the AR's, the first that has one."""
    n_rows: int = 256
    """Held-out rows to evaluate."""
    heldout_docs: nla_core.HeldoutDocs = "report"
    """Which of the parquet's documents the n_rows are spread over, a row of each before a second
    (nla_core.spread_rows; an nla addition): "report", the half a hash of doc_id keeps for results, which `nla sft`'s
    and `nla train`'s held-out evals ("select", their default) never see; "select"; or "all"."""
    max_new_tokens: int = 64
    """Longest AV explanation, in tokens."""
    max_explanation_tokens: int = 1024
    """AR inputs longer than this count as failed extractions (as in training)."""
    micro_batch: int = 64
    """Explanations per AR forward, and contexts per splice-KL forward."""
    reward: Literal["neg_log", "neg"] = "neg_log"
    """Reward from MSE, as in training."""
    shuffled_control: bool = True
    """Also run the AV on a shuffled vector (another row's), scored against the true row (one more AV pass)."""
    length_ks: tuple[int, ...] = (8, 16, 32)
    """FVE(k): each AV explanation cut to its first k tokens before the AR; empty skips the curve."""
    greedy: bool = False
    """Argmax decoding instead of sampling at temperature 1 (the RL samples' distribution)."""
    seed: int = 0
    """Seed of the AV's sampling, the shuffle and splice-KL's random reference."""
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
        if any(k < 1 for k in self.length_ks):
            raise ConfigError(f"config key 'length_ks' = {list(self.length_ks)} is invalid: use token counts >= 1")


@dataclass(frozen=True)
class EvalResult:
    metrics: dict[str, float]
    """Flat numbers: "av/…", "gold/…", "shuffled/…", "length/…", "splice/…", baselines, n_rows, n_docs."""
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


def evaluate(cfg: EvalConfig) -> EvalResult:
    """Score the AV+AR, its controls, its length curve and splice-KL on held-out rows; write the reports."""
    # --- inputs (the out_dir first: a refused run loads nothing) -----------------------------
    out_dir = check_out_dir(cfg.out_dir, overwrite=cfg.overwrite)
    require_model("ar", cfg.ar, hub_ok=False)
    require_model("av", cfg.av)
    require_model("tokenizer", cfg.tokenizer, files=("tokenizer_config.json",))
    require_model("model", cfg.model)
    require_file("parquet", cfg.parquet)
    require_file("sidecar", cfg.sidecar)
    device, dtype = resolve_device(cfg.device, cfg.dtype)
    tokenizer = families.load_tokenizer(cfg.tokenizer or tokenizer_dir(cfg.av, cfg.ar))
    sidecar_path = find_sidecar(cfg.sidecar or cfg.parquet)
    nla = load_sidecar(sidecar_path)
    check_tokenizer(nla, tokenizer)
    mse_scale = nla_core.resolve_target_scale(nla.mse_scale, nla.d_model)
    present = set(pq.ParquetFile(cfg.parquet).schema_arrow.names)
    if cfg.model is not None and "context" not in present:
        raise DataError(f"parquet: {cfg.parquet} has no 'context' column, which splice-KL (model=) needs to rerun "
                        "the LM; use a datagen parquet, or leave model unset")
    rows: list[RLRow] = load_heldout_rows(cfg.parquet, nla, n=cfg.n_rows, docs=cfg.heldout_docs,
                                          extra_columns=[c for c in OPTIONAL_COLUMNS if c in present], key="parquet")
    if not rows:
        raise DataError(f"parquet: {cfg.parquet} has no rows to evaluate")
    golds = torch.stack([r.activation for r in rows])
    baselines = nla_core.predict_mean_baselines(golds, scale=mse_scale)
    rawvar, meannorm = float(baselines.rawvar), float(baselines.meannorm)
    critic = ARModel.from_pretrained(cfg.ar, mse_scale=mse_scale, dtype=dtype, device=device).eval()
    score_kwargs = dict(template=nla.critic_prompt_template, mse_scale=mse_scale, reward_kind=cfg.reward,
                        max_tokens=cfg.max_explanation_tokens, micro_batch=cfg.micro_batch)
    metrics: dict[str, float] = {"n_rows": len(rows), "n_docs": len({r.doc_id for r in rows}),
                                 "baseline_rawvar": rawvar, "baseline_meannorm": meannorm}
    samples = [
        {"idx": i, "doc_id": r.doc_id, "position": r.extras.get("position"), "context": r.extras.get("context"),
         "gold_explanation": r.extras.get("explanation")}
        for i, r in enumerate(rows)
    ]
    scored: dict[str, Scores] = {}  # "av", "gold": the reconstructions splice-KL puts back

    # --- the AR on gold explanations (the ceiling) --------------------------------------------
    if "explanation" in present:
        scored["gold"] = gold = score_explanations(critic, tokenizer, [r.extras["explanation"] for r in rows], golds,
                                                   **score_kwargs)
        metrics.update(fve_metrics(gold.mse, gold.reward, gold.valid, rawvar=rawvar, meannorm=meannorm, prefix="gold/"))
        for sample, mse in zip(samples, gold.mse.tolist()):
            sample.update(gold_mse=finite_or_none(mse), gold_fve=finite_or_none(nla_core.fve(mse, rawvar)))

    # --- the AV's explanations (their lengths, FVE(k)) and the shuffled-vector control -------
    if cfg.av is not None:
        av_metrics, scored["av"] = score_av(cfg, nla, rows, golds, critic, tokenizer, samples, rawvar=rawvar,
                                            meannorm=meannorm, score_kwargs=score_kwargs, dtype=dtype, device=device)
        metrics.update(av_metrics)

    # --- kitft's fve_nrm beside ours: the same MSE over the AR's training activations' baseline --
    metrics.update(fve_nrm_metrics(metrics, training_rawvar(cfg.ar)))

    # --- splice-KL: the reconstructions back in the target LM ---------------------------------
    if cfg.model is not None:
        predictions = {name: ar_predictions(critic, s.ar_inputs, pad_id=tokenizer.pad_token_id,
                                            micro_batch=cfg.micro_batch) for name, s in scored.items()}
        splice_metrics, per_row = splice_kl_metrics(
            rows, golds, predictions, model=cfg.model, source=cfg.parquet, seed=cfg.seed, micro_batch=cfg.micro_batch,
            mean_u=nla_core.normalize_activation(golds.double(), mse_scale).mean(0),
            layer=nla.extraction_layer_index, d_model=nla.d_model, mse_scale=mse_scale, device=device, dtype=dtype,
        )
        metrics.update(splice_metrics)
        for sample, kls in zip(samples, per_row):
            sample.update({f"splice_kl_{name}": value for name, value in kls.items()})

    # --- reports ----------------------------------------------------------------------------
    controls = controls_table(metrics)
    write_reports(out_dir, samples, metrics, controls, table_rows=cfg.table_rows,
                  provenance=provenance(cfg, sidecar_path, nla))
    # Named, so that several evals in one output (the demo's) say which table is whose.
    print(f"[eval] AV {cfg.av or 'none: the AR on the gold explanations'}, AR {cfg.ar}:\n{controls}", flush=True)
    if "length/tokens_mean" in metrics:
        print(length_line(metrics, cfg.length_ks), flush=True)
    return EvalResult(metrics, samples, out_dir)


def training_rawvar(ar: str | Path) -> float | None:
    """The predict-the-mean baseline of the activations the AR was trained on (its sidecar's `baselines`, an nla
    addition); None for an AR whose sidecar has none (e.g. upstream's)."""
    _, mapping = read_sidecar(ar)
    value = (mapping.get("baselines") or {}).get("rawvar")
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def fve_nrm_metrics(metrics: Mapping[str, float], rawvar_train: float | None) -> dict[str, float]:
    """kitft's fve_nrm for each scored source: 1 - mse_mean / rawvar_train.

    Upstream (kitft/natural_language_autoencoders at 047eb8e, nla/loss.py `nla_critic_loss`) logs
    fve_nrm = 1 - mean_i mse_nrm_i / nla_baseline_rawvar, with mse_nrm the MSE of pred and gold both
    normalised to mse_scale (= sqrt(d)) and the baseline from nla/schema.py
    `compute_predict_mean_baselines` over the training data's activations. That is `{source}/mse_mean`
    here (the same normalised MSE, failed extractions excluded) over the AR's training baseline,
    where nla's `fve` divides by the held-out rows' own.
    """
    if rawvar_train is None:
        return {}
    out = {"baseline_rawvar_train": rawvar_train}
    for source in ("gold", "av", "shuffled"):
        if f"{source}/mse_mean" in metrics:
            out[f"{source}/fve_nrm"] = nla_core.fve(metrics[f"{source}/mse_mean"], rawvar_train)
    return out


def length_line(metrics: Mapping[str, float], length_ks: Sequence[int]) -> str:
    """`[eval] explanation tokens: mean …, p10 …, …; FVE(k=4) …, …` (the FVE(k) part only when ks were asked)."""
    parts = ["explanation tokens: mean {:.1f}, p10 {:.0f}, p50 {:.0f}, p90 {:.0f}, max {:.0f}".format(
        *(metrics[f"length/tokens_{q}"] for q in ("mean", "p10", "p50", "p90", "max")))]
    if length_ks:
        parts.append(", ".join(f"FVE(k={k}) {metrics[f'length/fve_k{k}']:.4f}" for k in length_ks))
    return "[eval] " + "; ".join(parts)


def score_av(
    cfg: EvalConfig,
    nla: nla_core.NLAConfig,
    rows: Sequence[RLRow],
    golds: torch.Tensor,
    critic: ARModel,
    tokenizer,
    samples: list[dict[str, Any]],
    *,
    rawvar: float,
    meannorm: float,
    score_kwargs: dict[str, Any],
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[dict[str, float], Scores]:
    """The AV's explanations scored by the AR ("av/…", "length/…") and, unless disabled, the AV given a
    shuffled vector scored against the true row ("shuffled/…"). Adds each row's results to its sample."""
    actor = load_av(cfg.av, dtype=dtype, device=device)
    injector = Injector.for_sidecar(actor, nla, injection_settings(nla, av_dir=cfg.av))
    engine = HFRolloutEngine(actor, injector, tokenizer, greedy=cfg.greedy)
    prompt_ids = [build_prompt_ids(r.prompt, nla, tokenizer, row=r.index) for r in rows]
    torch.manual_seed(cfg.seed)
    with progress_bar(total=len(rows), desc="eval: AV", unit="row") as bar:
        explanations = sample_explanations(engine, prompt_ids, golds, max_new_tokens=cfg.max_new_tokens,
                                           chunk=cfg.micro_batch, bar=bar)
    av = score_explanations(critic, tokenizer, explanations, golds, **score_kwargs)
    metrics = fve_metrics(av.mse, av.reward, av.valid, rawvar=rawvar, meannorm=meannorm, prefix="av/")
    lengths = token_lengths(explanations, tokenizer)
    metrics.update(length_curve(critic, tokenizer, explanations, lengths, golds, ks=cfg.length_ks, rawvar=rawvar,
                                score_kwargs=score_kwargs))
    for sample, text, n, reward, mse in zip(samples, explanations, lengths, av.reward.tolist(), av.mse.tolist()):
        sample.update(explanation=text, explanation_tokens=n, reward=reward, mse=finite_or_none(mse),
                      fve=finite_or_none(nla_core.fve(mse, rawvar)))

    # --- control: the AV reads another row's vector; scored against the true row ------------
    if cfg.shuffled_control and len(rows) > 1:
        source = shuffled_sources(len(rows), seed=cfg.seed)
        with progress_bar(total=len(rows), desc="eval: shuffled control", unit="row") as bar:
            shuffled_texts = sample_explanations(engine, prompt_ids, golds[source], max_new_tokens=cfg.max_new_tokens,
                                                 chunk=cfg.micro_batch, bar=bar)
        shuffled = score_explanations(critic, tokenizer, shuffled_texts, golds, **score_kwargs)
        metrics.update(fve_metrics(shuffled.mse, shuffled.reward, shuffled.valid, rawvar=rawvar, meannorm=meannorm,
                                   prefix="shuffled/"))
        for sample, j, text, mse in zip(samples, source.tolist(), shuffled_texts, shuffled.mse.tolist()):
            sample.update(shuffled_from=j, shuffled_explanation=text,
                          shuffled_fve=finite_or_none(nla_core.fve(mse, rawvar)))
    injector.remove()
    return metrics, av


# --------------------------------------------------------------------------- pieces


def check_out_dir(out_dir: str | Path, *, overwrite: bool) -> Path:
    """out_dir when it is new, empty, or overwrite is set; a ConfigError naming the fix otherwise."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"config key 'out_dir' = {str(out_dir)!r} is a file; choose a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ConfigError(f"config key 'out_dir' = {str(out_dir)!r} already exists and is not empty; choose another "
                          "out_dir or set overwrite=true (--overwrite)")
    return out_dir


def shuffled_sources(n: int, *, seed: int) -> torch.Tensor:
    """[n] int64: row i reads row source[i]'s vector, never its own (a seeded cyclic derangement, n >= 2)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    source = torch.empty(n, dtype=torch.long)
    source[order] = order.roll(-1)
    return source


def truncate_tokens(text: str | None, tokenizer, k: int) -> str | None:
    """text cut to its first k tokens (decoded); text itself when it has k or fewer, None stays None."""
    if text is None:
        return None
    ids = tokenizer.encode(text, add_special_tokens=False)
    return text if len(ids) <= k else tokenizer.decode(ids[:k])


def length_curve(critic: ARModel, tokenizer, explanations: Sequence[str | None], lengths: Sequence[int | None],
                 golds: torch.Tensor, *, ks: Sequence[int], rawvar: float, score_kwargs: dict[str, Any]) -> dict[str, float]:
    """Length distribution of the extracted explanations and FVE(k) of each cut to k tokens.

    length/tokens_{mean,p10,p50,p90,max}; length/fve_k{k} = 1 - mean MSE(AR(cut_k(e)), h) / rawvar
    (failed extractions excluded, as in av/fve, so k >= every length gives av/fve);
    length/truncated_frac_k{k}: share of the extracted explanations longer than k.
    """
    known = np.array([n for n in lengths if n is not None], dtype=np.float64)
    if known.size == 0:
        return {}
    metrics = {"length/tokens_mean": float(known.mean()), "length/tokens_max": float(known.max()),
               **{f"length/tokens_p{q}": float(np.percentile(known, q)) for q in (10, 50, 90)}}
    for k in ks:
        cut = score_explanations(critic, tokenizer, [truncate_tokens(e, tokenizer, k) for e in explanations], golds,
                                 **score_kwargs)
        metrics[f"length/fve_k{k}"] = nla_core.fve(finite_mean(cut.mse), rawvar)
        metrics[f"length/truncated_frac_k{k}"] = float((known > k).mean())
    return metrics


CONTROL_ROWS: tuple[tuple[str, str | None], ...] = (
    ("AV+AR", "av"),
    ("AV on a shuffled vector, scored against the true row (control)", "shuffled"),
    ("random vector at the AV+AR's error (splice reference)", None),
    ("AR on the gold explanation (ceiling)", "gold"),
    ("dataset mean (floor)", None),
)
"""(row title, metrics prefix or None) of eval_controls.md."""


def controls_table(metrics: dict[str, float]) -> str:
    """The controls in one markdown table: FVE under both baselines, MSE, extraction rate, splice-KL."""
    def cell(key: str | None, fmt: str = "{:.4f}") -> str:
        value = metrics.get(key) if key is not None else None
        return "—" if value is None or (isinstance(value, float) and not math.isfinite(value)) else fmt.format(value)

    rawvar, meannorm = metrics["baseline_rawvar"], metrics["baseline_meannorm"]
    docs = f" of {metrics['n_docs']} documents" if "n_docs" in metrics else ""
    lines = [f"Held-out controls on {metrics['n_rows']} rows{docs} (FVE: 1 - MSE / baseline; rawvar {rawvar:.4g} is "
             f"the headline, meannorm {meannorm:.4g} beside it; splice-KL in nats):", "",
             "| | FVE (rawvar) | FVE (meannorm) | MSE | extraction rate | splice-KL |", "|---|---|---|---|---|---|"]
    for title, prefix in CONTROL_ROWS:
        if prefix is not None:
            if f"{prefix}/fve" not in metrics:
                continue
            row = [cell(f"{prefix}/fve"), cell(f"{prefix}/fve_meannorm"), cell(f"{prefix}/mse_mean"),
                   cell(f"{prefix}/extraction_rate", "{:.0%}"), cell(f"splice/kl_{prefix}")]
        elif title.startswith("random"):
            if "splice/kl_random" not in metrics:
                continue
            source = "av" if "splice/kl_av" in metrics else "gold"
            row = [cell(f"{source}/fve"), cell(f"{source}/fve_meannorm"), cell(f"{source}/mse_mean"), "—",
                   cell("splice/kl_random")]
        else:
            # Predicting the mean scores the rawvar baseline by definition: FVE 0 against it.
            row = ["0.0000", f"{1.0 - rawvar / meannorm:.4f}", f"{rawvar:.4f}", "—", cell("splice/kl_mean")]
        lines.append(f"| {title} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def provenance(cfg: EvalConfig, sidecar_path: Path, nla: nla_core.NLAConfig) -> dict[str, Any]:
    """What was scored: resolved paths of the AV, AR, parquet and model; sidecar hashes and identity; the config."""
    def artefact(path: str | None) -> dict[str, Any] | None:
        if path is None:
            return None
        meta = Path(path) / MODEL_SIDECAR
        return {"path": str(Path(path).resolve()), "sidecar": str(meta.resolve()) if meta.is_file() else None,
                "sidecar_sha256": file_sha256(meta) if meta.is_file() else None}

    parquet = Path(cfg.parquet)
    return {
        "av": artefact(cfg.av),
        "ar": artefact(cfg.ar),
        "model": None if cfg.model is None else str(Path(cfg.model).resolve()),
        "parquet": {"path": str(parquet.resolve()), "bytes": parquet.stat().st_size,
                    "rows": pq.ParquetFile(parquet).metadata.num_rows},
        "sidecar": {"path": str(sidecar_path.resolve()), "sha256": file_sha256(sidecar_path), "d_model": nla.d_model,
                    "extraction_layer_index": nla.extraction_layer_index, "injection_char": nla.injection_char,
                    "injection_token_id": nla.injection_token_id, "mse_scale": nla.mse_scale},
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()},
    }


def write_reports(out_dir: Path, samples: Sequence[dict[str, Any]], metrics: dict[str, float], controls: str, *,
                  table_rows: int, provenance: dict[str, Any]) -> None:
    """eval_samples.jsonl, eval_table.md, eval_controls.md, eval_summary.json (earlier ones replaced)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in OUTPUT_FILES:
        (out_dir / name).unlink(missing_ok=True)
    with (out_dir / "eval_samples.jsonl").open("w", encoding="utf-8") as f:
        for sample in samples:
            f.write(json.dumps(sample, ensure_ascii=False) + "\n")
    (out_dir / "eval_table.md").write_text(markdown_table(samples[:table_rows]), encoding="utf-8")
    (out_dir / "eval_controls.md").write_text(controls, encoding="utf-8")
    summary = {**{k: finite_or_none(v) for k, v in metrics.items()}, "provenance": provenance}
    (out_dir / "eval_summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False), encoding="utf-8")


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
