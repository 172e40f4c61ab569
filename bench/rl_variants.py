"""RL variants from one demo's SFT checkpoints: other policy losses or engines, paired by seed.

An `nla demo` run dir holds its data, its AR and AV SFT checkpoints and its own RL (GRPO at the
demo's settings). `variant` trains RL again from the same SFT checkpoints with `nla train` keys
changed (`policy_loss=gspo`, `engine=vllm`, ...) and evaluates it on the same held-out rows with
the same sampling seed and controls as the demo's eval after RL; `table` gathers every variant
of several seeds beside the demo's own RL, as mean ± se over seeds and paired differences
against it, and plots the KL and length curves.

    python3 bench/rl_variants.py variant RUN_DIR gspo policy_loss=gspo
    python3 bench/rl_variants.py variant RUN_DIR vllm engine=vllm vllm_gpu_mem=0.08
    python3 bench/rl_variants.py table RUN_DIR_SEED0 RUN_DIR_SEED1 ... --out DIR

Each variant writes RUN_DIR/variants/NAME/{rl/, eval/after_rl/, report.json}. (The demo's AV after SFT and
after RL decoded greedily is the demo's own `greedy_eval`, on in the real-model presets.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nla_shell.pipeline import demo as demo_mod  # noqa: E402
from nla_shell.pipeline import demo_report  # noqa: E402
from nla_shell.pipeline.demo_config import DemoConfig  # noqa: E402
from nla_shell.stats import MeanSE, mean_se  # noqa: E402

BASE = "demo"
"""The name the table gives the demo's own RL (its TrainConfig, no overrides)."""
SUMMARY_KEYS = {
    "fve": "av/fve", "shuffled_fve": "shuffled/fve", "splice_kl": "splice/kl_av",
    "extraction_rate": "av/extraction_rate", "tokens": "length/tokens_mean",
}
"""Report field -> the after-RL eval metric it copies."""
DYNAMICS = {"clip_frac": "clip_frac", "outside_band": "outside_clip_frac", "logp_gap": "logp_diff_mean"}
"""Table column -> the per-step metric averaged over every RL step: how often the surrogate clipped, how
often the ratio left the clip band at all, and the mean |behaviour - trainer| log-prob per token."""
LAST_STEPS = 10
"""The KL and entropy columns average the last this-many logged steps."""
CURVES = (("kl_mean", "KL to the reference (k3)"), ("response_len_mean", "response tokens"),
          ("entropy_mean", "policy entropy (nats / token)"), ("eval/fve", "held-out FVE (trainer's eval)"),
          ("reward_mean", "reward"))


def demo_inputs(run_dir: Path) -> dict[str, Any]:
    """What a finished demo left: its config, target LM, data splits and SFT checkpoints."""
    import pyarrow.parquet as pq

    cfg = DemoConfig(**json.loads((run_dir / demo_mod.RUN_MARKER).read_text()))
    target = run_dir / "target_lm" if cfg.model is None else demo_mod.real_target(cfg.model)
    paths = {p.stem: p for p in sorted((run_dir / "data").glob("*.parquet"))}
    rows = {split: pq.ParquetFile(path).metadata.num_rows for split, path in paths.items()}
    used = json.loads((run_dir / demo_mod.SFT_CHECKPOINTS).read_text())  # the held-out stop picks their steps
    return dict(cfg=cfg, target=target, paths=paths, rows=rows, av=Path(used["av"]), ar=Path(used["ar"]))


def summary(metrics: dict[str, Any], rl_dir: Path) -> dict[str, Any]:
    """The after-RL numbers the table compares, and the seconds per RL step."""
    out = {key: metrics.get(metric) for key, metric in SUMMARY_KEYS.items()}
    out["seconds_per_rl_step"] = demo_report.rl_step_seconds(rl_dir)
    return out


def dynamics(metrics: Path) -> dict[str, float | None]:
    """Means over one RL run's steps of DYNAMICS, and of kl_mean and entropy_mean over its last steps."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]

    def mean(key: str, picked: list[dict[str, Any]]) -> float | None:
        vals = [r[key] for r in picked if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    out = {name: mean(key, rows) for name, key in DYNAMICS.items()}
    return out | {"kl_end": mean("kl_mean", rows[-LAST_STEPS:]), "entropy_end": mean("entropy_mean", rows[-LAST_STEPS:])}


def run_variant(run_dir: Path, name: str, overrides: list[str]) -> dict[str, Any]:
    """Train RL from run_dir's SFT checkpoints with overrides, evaluate it, write its report.json."""
    from nla_shell.pipeline.evaluate import evaluate
    from nla_shell.training.train import train

    import torch

    inputs = demo_inputs(run_dir)
    cfg, out = inputs["cfg"], run_dir / "variants" / name
    torch.set_num_threads(cfg.threads)  # the demo's: several variants share the machine's cores
    t0 = time.perf_counter()
    rl_cfg = demo_mod.rl_config(cfg, inputs["paths"], inputs["rows"], inputs["av"], inputs["ar"], out / "rl",
                                overrides)
    rl_dir = train(rl_cfg)
    t_rl = time.perf_counter() - t0
    ar = demo_mod.after_rl_ar(rl_cfg, inputs["ar"])
    adapter = demo_mod.after_rl_adapter(rl_cfg)
    metrics = evaluate(demo_mod.eval_config(cfg, inputs["target"], inputs["paths"], ar,
                                            out / "eval" / "after_rl", adapter, controls=True)).metrics
    report = {"name": name, "overrides": overrides, "seed": cfg.seed, "ar": str(ar), **summary(metrics, rl_dir),
              "seconds": {"RL": t_rl, "eval after RL": time.perf_counter() - t0 - t_rl}}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report), flush=True)
    return report


def base_report(run_dir: Path) -> dict[str, Any]:
    """The demo's own RL in the variants' terms, read from its eval after RL."""
    metrics = json.loads((run_dir / "eval" / "after_rl" / "eval_summary.json").read_text())
    cfg = json.loads((run_dir / demo_mod.RUN_MARKER).read_text())
    return {"name": BASE, "overrides": [], "seed": cfg["seed"], **summary(metrics, run_dir / "rl")}


def after_sft_fve(run_dir: Path) -> float:
    return _number(json.loads((run_dir / "eval" / "after_sft" / "eval_summary.json").read_text())["av/fve"])


def _number(value: float | None) -> float:
    """A metric as a float; a missing one (no explanation extracted) is NaN, so it spoils its mean visibly."""
    return float("nan") if value is None else float(value)


def table(run_dirs: list[Path], out: Path, *, against: str | None = None) -> dict[str, Any]:
    """Every variant over seeds: mean ± se, and the paired difference against the demo's RL and its SFT
    (and against the variant named `against`, when given: say, GRPO in the same dtype)."""
    reports: dict[str, dict[int, dict[str, Any]]] = {}
    sft: dict[int, float] = {}
    for run_dir in run_dirs:
        base = base_report(run_dir)
        sft[base["seed"]] = after_sft_fve(run_dir)
        reports.setdefault(BASE, {})[base["seed"]] = base | {"rl_dir": str(run_dir / "rl")}
        for path in sorted((run_dir / "variants").glob("*/report.json")):
            r = json.loads(path.read_text())
            reports.setdefault(r["name"], {})[r["seed"]] = r | {"rl_dir": str(path.parent / "rl")}
    rows = []
    for name, by_seed in reports.items():
        seeds = sorted(by_seed)
        row: dict[str, Any] = {"name": name, "overrides": by_seed[seeds[0]]["overrides"], "seeds": seeds}
        runs = {s: by_seed[s] | dynamics(Path(by_seed[s]["rl_dir"]) / "metrics.jsonl") for s in seeds}
        for key in (*SUMMARY_KEYS, "seconds_per_rl_step", *DYNAMICS, "kl_end", "entropy_end"):
            vals = [runs[s][key] for s in seeds if runs[s].get(key) is not None]
            row[key] = mean_se(vals) if vals else None
        fve = {s: _number(by_seed[s]["fve"]) for s in seeds}
        row["fve_per_seed"] = [fve[s] for s in seeds]
        row["minus_sft"] = mean_se([fve[s] - sft[s] for s in seeds])
        row["rl_beats_sft_in"] = f"{sum(fve[s] > sft[s] for s in seeds)}/{len(seeds)}"
        paired = [s for s in seeds if s in reports[BASE]]
        if name != BASE and paired:
            row["minus_demo_rl"] = mean_se([fve[s] - _number(reports[BASE][s]["fve"]) for s in paired])
        if against is not None and name != against and (both := [s for s in seeds if s in reports.get(against, {})]):
            row[f"minus_{against}"] = mean_se([fve[s] - _number(reports[against][s]["fve"]) for s in both])
        rows.append(row)
    result = {"after_sft_fve": sft, "variants": rows}
    out.mkdir(parents=True, exist_ok=True)
    # Each mean ± se as [mean, se], the layout of the recorded tables.
    rows_json = [{k: [v.mean, v.se] if isinstance(v, MeanSE) else v for k, v in row.items()} for row in rows]
    (out / "rl_variants.json").write_text(json.dumps({**result, "variants": rows_json}, indent=2))
    text = markdown(rows, against=against)
    (out / "rl_variants.md").write_text(text)
    print(text)
    plot_curves(reports, out / "rl_variants_curves.png")
    return result


def _cell(summary: MeanSE | None, spec: str = ".3f") -> str:
    return "–" if summary is None else summary.text(spec)


def markdown(rows: list[dict[str, Any]], *, against: str | None = None) -> str:
    head = ("| variant | keys | seeds | held-out FVE after RL | per seed | RL − SFT (paired) | RL > SFT | "
            f"− {BASE} RL (paired) | {f'− {against} (paired) | ' if against else ''}shuffled control | splice-KL | extraction | tokens | "
            f"clip frac | outside clip band | mean \\|Δ log p\\| | KL, last {LAST_STEPS} steps | entropy, last {LAST_STEPS} | "
            "s / RL step |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        lines.append(" | ".join([
            f"| {r['name']}", " ".join(r["overrides"]) or "(demo's)", str(len(r["seeds"])), _cell(r["fve"]),
            ", ".join(f"{v:.3f}" for v in r["fve_per_seed"]), _cell(r["minus_sft"]), r["rl_beats_sft_in"],
            _cell(r.get("minus_demo_rl")), *([_cell(r.get(f"minus_{against}"))] if against else []),
            _cell(r["shuffled_fve"]), _cell(r["splice_kl"], ".2f"),
            _cell(r["extraction_rate"], ".2f"), _cell(r["tokens"], ".1f"), _cell(r.get("clip_frac")),
            _cell(r.get("outside_band")), _cell(r.get("logp_gap"), ".4f"), _cell(r.get("kl_end")),
            _cell(r.get("entropy_end"), ".2f"), _cell(r["seconds_per_rl_step"], ".2f"),
        ]) + " |")
    return "\n".join(lines) + "\n"


def plot_curves(reports: dict[str, dict[int, dict[str, Any]]], path: Path) -> None:
    """KL, length, trainer-eval FVE and reward against step: one line per variant (mean over seeds)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        print("[rl_variants] matplotlib missing: no curves", flush=True)
        return
    fig, axes = plt.subplots(1, len(CURVES), figsize=(4.2 * len(CURVES), 3.4))
    for name, by_seed in reports.items():
        series = [read_curves(Path(r["rl_dir"]) / "metrics.jsonl") for r in by_seed.values()]
        for ax, (key, title) in zip(axes, CURVES):
            steps = sorted(set.intersection(*(set(s[key]) for s in series))) if series else []
            if steps:
                ax.plot(steps, [sum(s[key][t] for s in series) / len(series) for t in steps], label=name)
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"[rl_variants] curves: {path}", flush=True)


def read_curves(metrics: Path) -> dict[str, dict[int, float]]:
    curves: dict[str, dict[int, float]] = {key: {} for key, _ in CURVES}
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        for key in curves:
            if row.get(key) is not None:
                curves[key][row["step"]] = row[key]
    return curves


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("variant", help="RL from a demo's SFT checkpoints with nla train keys changed")
    v.add_argument("run_dir", type=Path)
    v.add_argument("name")
    v.add_argument("overrides", nargs="*", help="nla train key=value")
    t = sub.add_parser("table", help="every variant over seeds beside the demo's own RL")
    t.add_argument("run_dirs", type=Path, nargs="+")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--against", help="also the paired difference against this variant (say, bf16_grpo)")
    args = parser.parse_args(argv)
    if args.command == "variant":
        run_variant(args.run_dir, args.name, args.overrides)
    else:
        table(args.run_dirs, args.out, against=args.against)


if __name__ == "__main__":
    main()
