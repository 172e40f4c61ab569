"""`nla plot RUN_DIR`: reward, FVE, KL and clip fraction (or extraction rate) against step, from metrics.jsonl.

An on-policy run (one update per batch) never clips, so its clip-fraction panel would be a
flat 0: there the fourth panel shows the extraction rate instead. The held-out series ends
with the final step's point that `nla train` writes into summary.json when the last step
was not an eval step.

matplotlib is an optional extra (`pip install 'nla[plot]'`). The figure is drawn on an
Agg canvas without pyplot, so plotting never touches a display or pyplot's global state.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from nla_shell.io.logging import read_metrics

PANELS: tuple[tuple[str, str | None, str], ...] = (
    ("reward_mean", "eval/reward_mean", "reward"),
    ("fve", "eval/fve", "FVE (rawvar baseline)"),
    ("kl_mean", None, "KL to reference"),
    ("clip_frac", None, "clip fraction"),
)
"""(training key, held-out key or None, panel title)."""
ON_POLICY_PANEL = ("extraction_rate", "eval/extraction_rate", "extraction rate (clip fraction is 0: on-policy)")
"""Replaces the clip-fraction panel when no step clipped."""


def heldout_series(run_dir: Path, records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """The held-out points of `key` in metrics.jsonl, then summary.json's final-step point when there is one."""
    try:
        final = json.loads((run_dir / "summary.json").read_text(encoding="utf-8")).get("final_eval")
    except (OSError, json.JSONDecodeError, AttributeError):
        final = None
    return _series(records + ([final] if isinstance(final, dict) else []), key)


def panels(records: list[dict]) -> tuple[tuple[str, str | None, str], ...]:
    """PANELS, with the clip-fraction panel swapped for the extraction rate when every clip fraction is 0."""
    _, clip = _series(records, "clip_frac")
    return PANELS if any(v != 0 for v in clip) else (*PANELS[:3], ON_POLICY_PANEL)


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
    for ax, (key, eval_key, title) in zip(fig.subplots(2, 2).flat, panels(records)):
        steps, values = _series(records, key)
        ax.plot(steps, values, label="train", color="tab:blue")
        if eval_key is not None:
            steps, values = heldout_series(run_dir, records, eval_key)
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
