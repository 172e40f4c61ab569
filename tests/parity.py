"""Learning parity across rollout engines: short RL runs from one SFT checkpoint, then held-out FVE.

Used by tests/gpu/test_learning_parity.py (the toy NLA of `nla demo`, three engines, several
seeds, on a GPU) and, with tiny settings, by a CPU test of the same logic. Each run is
`nla train` with the demo's RL settings and one engine, followed by `nla eval` of its final
adapter on the held-out rows; the step-0 record of the run carries the engine's behaviour
log-probs against the trainer's (`logp_diff_mean`, `logp_diff_max`).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch


@dataclass(frozen=True)
class ParityInputs:
    """One SFT starting point: AV adapter, AR, RL and held-out parquets."""

    av: Path
    ar: Path
    rl_parquet: Path
    eval_parquet: Path
    rl_rows: int


@dataclass(frozen=True)
class ParityRun:
    engine: str
    seed: int
    fve: float
    """Held-out FVE (rawvar baseline) of the final adapter, scored by `nla eval`."""
    step0_logp_diff_mean: float
    step0_logp_diff_max: float


def demo_inputs(run_dir: Path, *, seed: int = 0) -> ParityInputs:
    """The toy NLA's SFT checkpoints, built by `nla demo` with a one-step RL stage (its RL is not used)."""
    import pyarrow.parquet as pq

    from nla_shell.pipeline.demo import DemoConfig, demo

    cfg = DemoConfig(run_dir=str(run_dir), seed=seed, rl_steps=1, eval_rows=64)
    demo(cfg)
    data = run_dir / "data"
    rl_rows = pq.ParquetFile(data / "rl.parquet").metadata.num_rows
    return ParityInputs(av=run_dir / "av_sft" / f"step_{cfg.av_steps:06d}", ar=run_dir / "ar_sft" / f"step_{cfg.ar_steps:06d}",
                        rl_parquet=data / "rl.parquet", eval_parquet=data / "eval.parquet", rl_rows=rl_rows)


def run_one(inputs: ParityInputs, out_dir: Path, *, engine: str, seed: int, steps: int, device: str, dtype: str,
            batch_prompts: int = 16, group_size: int = 8, max_new_tokens: int = 16, lr: float = 1e-3,
            eval_rows: int = 1024) -> ParityRun:
    """`nla train` (the demo's RL settings, this engine and seed), then `nla eval` of the final adapter.

    Each command runs in a process of its own: an in-process vLLM engine does not hand all of its
    GPU memory back when closed, so a second engine in the same process finds the GPU full.
    """
    run = out_dir / f"{engine}_seed{seed}"
    train_rows = max(batch_prompts, int(0.8 * inputs.rl_rows))
    _nla("train", av_ckpt=inputs.av, ar_ckpt=inputs.ar, rl_parquet=inputs.rl_parquet, save_dir=run / "rl",
         num_steps=steps, batch_prompts=batch_prompts, group_size=group_size, max_new_tokens=max_new_tokens, lr=lr,
         logp_micro_batch=256, critic_micro_batch=256, max_rows=train_rows, eval_every=0, save_every=steps,
         logger="jsonl", seed=seed, device=device, dtype=dtype, engine=engine)
    first = json.loads((run / "rl" / "metrics.jsonl").read_text().splitlines()[0])
    _nla("eval", av=run / "rl" / f"step_{steps:06d}" / "adapter", ar=inputs.ar, parquet=inputs.eval_parquet,
         out_dir=run / "eval", n_rows=eval_rows, max_new_tokens=max_new_tokens, seed=0, device=device, dtype="float32")
    summary = json.loads((run / "eval" / "eval_summary.json").read_text())
    fve = summary["av/fve"]  # null in the summary when not finite (e.g. nothing extracted)
    return ParityRun(engine=engine, seed=seed, fve=float("nan") if fve is None else float(fve),
                     step0_logp_diff_mean=float(first["logp_diff_mean"]),
                     step0_logp_diff_max=float(first["logp_diff_max"]))


def _nla(command: str, **settings: object) -> None:
    """One `nla` command as `key=value` overrides, in a fresh Python process; its output passes through."""
    argv = [sys.executable, "-m", "nla_shell.cli", command, *(f"{k}={v}" for k, v in settings.items())]
    subprocess.run(argv, check=True)


def format_table(runs: Sequence[ParityRun]) -> str:
    """Markdown: held-out FVE per engine and seed, the mean, and the step-0 log-prob gap."""
    seeds = sorted({r.seed for r in runs})
    engines = list(dict.fromkeys(r.engine for r in runs))
    lines = ["| engine | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | step-0 logp diff mean / max |",
             "|---" * (len(seeds) + 3) + "|"]
    for engine in engines:
        mine = {r.seed: r for r in runs if r.engine == engine}
        cells = [f"{mine[s].fve:.3f}" if s in mine else "—" for s in seeds]
        gap = " ".join(f"{r.step0_logp_diff_mean:.2g}/{r.step0_logp_diff_max:.2g}" for r in mine.values())
        lines.append(f"| {engine} | " + " | ".join(cells) + f" | {engine_mean(runs, engine):.3f} | {gap} |")
    return "\n".join(lines)


def engine_mean(runs: Sequence[ParityRun], engine: str) -> float:
    return statistics.fmean(r.fve for r in runs if r.engine == engine)


def parity_failures(runs: Sequence[ParityRun], *, baseline: str = "hf", step0_tolerance: dict[str, float]) -> list[str]:
    """What breaks parity: an engine whose mean FVE is below the baseline engine's lowest seed,
    or whose step-0 mean |behaviour - trainer| log-prob gap exceeds its tolerance."""
    floor = min(r.fve for r in runs if r.engine == baseline)
    failures = []
    for engine in dict.fromkeys(r.engine for r in runs):
        if engine != baseline and engine_mean(runs, engine) < floor:
            failures.append(f"{engine}: mean held-out FVE {engine_mean(runs, engine):.3f} is below {baseline}'s "
                            f"seed spread (lowest {floor:.3f})")
    for r in runs:
        if not r.step0_logp_diff_mean <= step0_tolerance[r.engine]:
            failures.append(f"{r.engine} seed {r.seed}: step-0 mean |behaviour - trainer| log-prob "
                            f"{r.step0_logp_diff_mean:.3g} > {step0_tolerance[r.engine]:g}")
    return failures


# --------------------------------------------------------------------------- does an engine sample its policy?


def randomized_pit(logits: torch.Tensor, tokens: torch.Tensor, *, generator: torch.Generator) -> torch.Tensor:
    """Randomised probability integral transform of sampled tokens under the policy's softmax.

    With the vocabulary ordered by descending probability p_(1) >= p_(2) >= ..., a token t of
    rank r gets u = sum_{j<r} p_(j) + V * p_t, V ~ U(0, 1). If t ~ softmax(logits), u ~ U(0, 1)
    exactly, whatever the distribution; and the u of successive tokens of one sequence, each
    taken under its own prefix's conditional, are independent uniforms (chain rule). A sampler
    that favours likely tokens (temperature < 1, top-k, top-p) puts too many u near 0, one
    that flattens puts too many near 1. Computed in float64.

    Args: logits: [N, V]; tokens: [N] int64.
    Returns: [N] float64 in [0, 1].
    """
    probs = torch.softmax(logits.double(), dim=-1)
    order = probs.argsort(dim=-1, descending=True, stable=True)
    sorted_probs = probs.gather(-1, order)
    rank = order.argsort(dim=-1).gather(-1, tokens[:, None])  # [N, 1] position of t in the order
    mass_before = (sorted_probs.cumsum(-1) - sorted_probs).gather(-1, rank).squeeze(-1)
    jitter = torch.rand(tokens.shape, generator=generator, dtype=torch.float64)
    return mass_before + jitter * probs.gather(-1, tokens[:, None]).squeeze(-1)


@dataclass(frozen=True)
class UniformityTest:
    statistic: float
    """Pearson's chi-square of the values' histogram over `bins` equal bins of [0, 1]."""
    critical: float
    """The chi-square(bins - 1) quantile at 1 - alpha (Wilson-Hilferty approximation)."""
    n: int

    @property
    def passed(self) -> bool:
        return self.statistic <= self.critical


def uniformity_chi_square(values: torch.Tensor, *, bins: int = 20, alpha: float = 1e-3) -> UniformityTest:
    """Chi-square test of values [N] in [0, 1] against U(0, 1): X = sum_k (O_k - N/K)^2 / (N/K).

    Under U(0, 1), X ~ chi-square(K - 1); the critical value is its 1 - alpha quantile by
    Wilson-Hilferty, k (1 - 2/(9k) + z sqrt(2/(9k)))^3 with k = K - 1 and z the normal
    1 - alpha quantile (within 1 % of the exact quantile for k >= 10). Tests run it at fixed
    seeds, so a pass or a fail is reproducible; alpha bounds how often a fresh seed would fail
    an exact sampler.
    """
    n = values.numel()
    counts = torch.histc(values.double().clamp(0, 1), bins=bins, min=0.0, max=1.0)
    expected = n / bins
    k = bins - 1
    z = statistics.NormalDist().inv_cdf(1 - alpha)
    critical = k * (1 - 2 / (9 * k) + z * (2 / (9 * k)) ** 0.5) ** 3
    return UniformityTest(statistic=float(((counts - expected) ** 2).sum() / expected), critical=critical, n=n)
