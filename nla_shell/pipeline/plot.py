"""`nla plot RUN_DIR`: reward, FVE, KL and clip fraction against step, from a run's metrics.jsonl.

matplotlib is an optional extra (`pip install 'nla[plot]'`). The figure is drawn on an
Agg canvas without pyplot, so plotting never touches a display or pyplot's global state.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

PANELS: tuple[tuple[str, str | None, str], ...] = (
    ("reward_mean", "eval/reward_mean", "reward"),
    ("fve", "eval/fve", "FVE (rawvar baseline)"),
    ("kl_mean", None, "KL to reference"),
    ("clip_frac", None, "clip fraction"),
)
"""(training key, held-out key or None, panel title)."""


def read_metrics(path: str | Path) -> list[dict]:
    """The JSON objects of a metrics.jsonl (a line torn by a crash is skipped)."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [s for s, _ in points], [v for _, v in points]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw run_dir/metrics.jsonl into a PNG (default run_dir/curves.png); returns its path."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics} does not exist; pass the save_dir of an `nla train` run")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ModuleNotFoundError("nla plot needs matplotlib: pip install 'nla[plot]'") from None
    records = read_metrics(metrics)
    fig = Figure(figsize=(10, 7), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, (key, eval_key, title) in zip(fig.subplots(2, 2).flat, PANELS):
        steps, values = _series(records, key)
        ax.plot(steps, values, label="train", color="tab:blue")
        if eval_key is not None:
            steps, values = _series(records, eval_key)
            if steps:
                ax.plot(steps, values, "o--", label="held-out", color="tab:orange")
                ax.legend()
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(str(run_dir))
    out = Path(out) if out is not None else run_dir / "curves.png"
    fig.savefig(out, dpi=100)
    return out
