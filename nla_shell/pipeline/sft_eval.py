"""`nla sft`'s held-out evaluation and stopping rule: what says that a warm start has learned to read.

The training loss says when the AV writes the format; it does not say when the AV reads the vector
(a verbaliser stopped "once the format is learned" writes fluent explanations of nothing). So SFT
scores document-disjoint held-out rows (datagen's eval.parquet) every `eval_every` steps:

- AR: `heldout/fve` = 1 - mean_i mse_i / rawvar, the AR on the gold explanations (rawvar: the
  held-out activations' predict-the-mean baseline, as `nla eval` computes it).
- AV: the teacher-forced token-mean NLL of the gold responses with each row's own vector
  (`heldout/nll`) and with another row's (`heldout/nll_shuffled`); `heldout/nll_gap` =
  nll_shuffled - nll is what the vector tells the AV (kitft's verbaliser watches this gap, ~0.21 at
  the end of its SFT). Given an AR (`eval_ar`), also `heldout/fve`: the AV's sampled explanations
  (temperature 1, a fixed seed, as `nla eval`) through that AR, the round trip RL starts from.

The run selects on one figure (`selection_key`): heldout/fve where there is one, else heldout/nll
(lower is better). `EarlyStopping` counts evaluations without a new best and says when to stop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

import nla_core
from nla_shell.engines.base import sample_explanations
from nla_shell.engines.hf import HFRolloutEngine
from nla_shell.io.data import DataError, build_prompt_ids, load_heldout_rows
from nla_shell.metrics import finite_mean
from nla_shell.models import ARModel, Injector
from nla_shell.pipeline.sft_loss import AVExample, av_response_nll
from nla_shell.training.scoring import score_explanations

__all__ = ["EarlyStopping", "HeldOut", "describe", "evaluate_ar", "evaluate_av", "load_heldout", "round_trip_ar",
           "selection_key"]


@dataclass(frozen=True)
class HeldOut:
    """The held-out rows one SFT run scores at every evaluation."""

    prompt_ids: list[list[int]]
    """N chat-templated AV prompts, each with one marker."""
    response_ids: list[tuple[int, ...]]
    """N gold responses' tokens (EOS included); empty for the AR, which reads the explanations."""
    explanations: list[str]
    """N gold explanations (the AR's held-out input)."""
    golds: torch.Tensor
    """[N, D] float32 activations."""
    shuffled: torch.Tensor
    """[N] long: the row whose vector row i gets in the shuffled control (a derangement when N > 1)."""
    rawvar: float
    """The held-out predict-the-mean baseline that FVE divides by."""


def load_heldout(path: str, nla: nla_core.NLAConfig, tokenizer, *, n_rows: int, docs: nla_core.HeldoutDocs, seed: int,
                 mse_scale: float | None, need_response: bool) -> HeldOut:
    """n_rows rows of `path` (datagen's eval.parquet: prompt, activation, explanation, response), spread over the
    documents of its `docs` half (io.data.load_heldout_rows).

    Raises DataError, naming the file and the column, when `explanation` (or, for the AV, `response`) is missing.
    """
    import pyarrow.parquet as pq

    present = set(pq.ParquetFile(path).schema_arrow.names)
    needed = ("explanation", "response") if need_response else ("explanation",)
    for column in needed:
        if column not in present:
            raise DataError(f"eval_parquet: {path} has no '{column}' column; give held-out rows with gold "
                            "explanations (datagen's eval.parquet)")
    rows = load_heldout_rows(path, nla, n=n_rows, docs=docs, extra_columns=needed, key="eval_parquet")
    if len(rows) < 2:
        raise DataError(f"eval_parquet: {path} yields {len(rows)} rows; the held-out evaluation needs at least 2")
    eos = (tokenizer.eos_token_id,)
    golds = torch.stack([r.activation for r in rows])
    generator = torch.Generator().manual_seed(seed)
    shift = torch.randint(1, len(rows), (), generator=generator)  # a rotation: no row keeps its own vector
    return HeldOut(
        prompt_ids=[build_prompt_ids(r.prompt, nla, tokenizer, row=r.index) for r in rows],
        response_ids=[tuple(tokenizer.encode(r.extras["response"], add_special_tokens=False)) + eos
                      for r in rows] if need_response else [],
        explanations=[r.extras["explanation"] for r in rows],
        golds=golds,
        shuffled=(torch.arange(len(rows)) + shift) % len(rows),
        rawvar=float(nla_core.predict_mean_baselines(golds, scale=mse_scale).rawvar),
    )


def selection_key(mode: str, *, has_ar: bool) -> tuple[str, bool]:
    """The figure an SFT run selects its checkpoint on, and whether higher is better."""
    return ("heldout/fve", True) if mode == "ar" or has_ar else ("heldout/nll", False)


@torch.no_grad()
def evaluate_ar(ar: ARModel, tokenizer, heldout: HeldOut, *, template: str, mse_scale: float | None,
                max_tokens: int, micro_batch: int) -> dict[str, float]:
    """heldout/fve (and mse_mean, extraction_rate) of the AR on the gold explanations."""
    was_training = ar.training
    ar.eval()
    metrics = reconstruction_metrics(ar, tokenizer, heldout, heldout.explanations, template=template,
                                     mse_scale=mse_scale, max_tokens=max_tokens, micro_batch=micro_batch)
    ar.train(was_training)
    return metrics


def reconstruction_metrics(ar: ARModel, tokenizer, heldout: HeldOut, explanations: Sequence[str | None], *,
                           template: str, mse_scale: float | None, max_tokens: int,
                           micro_batch: int) -> dict[str, float]:
    """heldout/fve, mse_mean and extraction_rate of the AR's reconstructions from `explanations` (one per row)."""
    scores = score_explanations(ar, tokenizer, explanations, heldout.golds, template=template,
                                mse_scale=mse_scale, reward_kind="neg_log", max_tokens=max_tokens,
                                micro_batch=micro_batch)
    mse_mean = finite_mean(scores.mse)
    return {"heldout/fve": nla_core.fve(mse_mean, heldout.rawvar), "heldout/mse_mean": mse_mean,
            "heldout/extraction_rate": float(scores.valid.float().mean())}


@torch.no_grad()
def evaluate_av(actor: torch.nn.Module, injector: Injector, tokenizer, heldout: HeldOut, *, micro_batch: int,
                ar: ARModel | None, template: str, mse_scale: float | None, max_new_tokens: int,
                max_tokens: int, seed: int) -> dict[str, float]:
    """heldout/nll, nll_shuffled and nll_gap of the AV; with an AR, heldout/fve of its round trip.

    Sampling draws from a forked RNG seeded with `seed`, so every evaluation samples alike and the
    training run's own RNG stream (and so an exact resume) is untouched.
    """
    was_training = actor.training
    actor.eval()
    pad_id = tokenizer.pad_token_id

    def token_mean_nll(vectors: torch.Tensor) -> float:
        total, count = 0.0, 0
        for start in range(0, len(heldout.prompt_ids), micro_batch):
            part = range(start, min(start + micro_batch, len(heldout.prompt_ids)))
            examples = [AVExample(tuple(heldout.prompt_ids[i]), heldout.response_ids[i], vectors[i]) for i in part]
            nll, n = av_response_nll(actor, injector, examples, pad_id=pad_id)
            total, count = total + float(nll), count + n
        return total / count

    nll = token_mean_nll(heldout.golds)
    nll_shuffled = token_mean_nll(heldout.golds[heldout.shuffled])
    metrics = {"heldout/nll": nll, "heldout/nll_shuffled": nll_shuffled, "heldout/nll_gap": nll_shuffled - nll}
    if ar is not None:
        device = next(actor.parameters()).device
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            engine = HFRolloutEngine(actor, injector, tokenizer)
            explanations = sample_explanations(engine, heldout.prompt_ids, heldout.golds,
                                               max_new_tokens=max_new_tokens, chunk=max(micro_batch, 64))
        metrics.update(reconstruction_metrics(ar, tokenizer, heldout, explanations, template=template,
                                              mse_scale=mse_scale, max_tokens=max_tokens,
                                              micro_batch=max(micro_batch, 64)))
    actor.train(was_training)
    return metrics


@dataclass(frozen=True)
class EarlyStopping:
    """The best held-out figure so far and the evaluations since it (state that a checkpoint carries).

    `patience` evaluations in a row without improving on the best by more than `min_delta` stop the
    run (patience 0: never); evaluations before the first finite figure do not count. `score` is the figure
    signed so that higher is better.
    """

    patience: int
    min_delta: float
    best_score: float = -math.inf
    best_step: int | None = None
    evals_since_best: int = 0

    def update(self, score: float, step: int) -> "EarlyStopping":
        """The state after an evaluation at `step` (steps done) scored `score`; a NaN score never improves."""
        if math.isfinite(score) and score > self.best_score + self.min_delta:
            return replace(self, best_score=score, best_step=step, evals_since_best=0)
        if self.best_step is None:  # nothing scored yet (an AV not yet writing the format): no plateau to count
            return self
        return replace(self, evals_since_best=self.evals_since_best + 1)

    @property
    def improved(self) -> bool:
        """The last evaluation set a new best."""
        return self.best_step is not None and self.evals_since_best == 0

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.evals_since_best >= self.patience

    def state(self) -> dict[str, Any]:
        return {"best_score": self.best_score, "best_step": self.best_step, "evals_since_best": self.evals_since_best}

    def restored(self, state: dict[str, Any] | None) -> "EarlyStopping":
        """This rule (its patience and min_delta, which a resume may change) with a checkpoint's counters."""
        return self if not state else replace(self, **state)


def round_trip_ar(path: str | None, *, mse_scale: float | None, dtype: torch.dtype, device: torch.device,
                  mode: str) -> ARModel | None:
    """The AR an AV run scores its round trip through (eval_ar), loaded once and kept in eval mode."""
    if path is None or mode != "av":
        return None
    return ARModel.from_pretrained(path, mse_scale=mse_scale, dtype=dtype, device=device).eval()


def describe(metrics: dict[str, float], stopping: EarlyStopping, key: str, higher_is_better: bool) -> str:
    """The progress line's held-out part, e.g. `held-out FVE 0.312 | held-out nll 1.23, shuffled 1.65, gap 0.42 |
    best fve 0.312 at step 400`."""
    parts = []
    if "heldout/fve" in metrics:
        parts.append(f"held-out FVE {metrics['heldout/fve']:.3f}")
    if "heldout/nll" in metrics:
        parts.append(f"held-out nll {metrics['heldout/nll']:.3f}, shuffled {metrics['heldout/nll_shuffled']:.3f}, "
                     f"gap {metrics['heldout/nll_gap']:.3f}")
    if stopping.best_step is None:
        parts.append("no best yet")
    else:
        best = stopping.best_score if higher_is_better else -stopping.best_score
        parts.append(f"best {key.split('/')[1]} {best:.3f} at step {stopping.best_step}")
    return " | ".join(parts)
