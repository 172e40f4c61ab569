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
