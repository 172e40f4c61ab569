"""`nla demo`'s report: each stage's held-out figures beside the gold AR's, the controls, the SFT curves, the
wall times and the machine, as report.json (`build_report`) and report.md (`format_report`)."""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from nla_shell.training.checkpoint import checkpoint_step

SAMPLES_SHOWN = 12
"""Held-out explanations the report prints verbatim, after SFT and after RL."""


def rl_step_seconds(rl_dir: Path) -> float | None:
    """Median wall time of one RL step (time_step in metrics.jsonl)."""
    path = rl_dir / "metrics.jsonl"
    steps = [r["time_step"] for r in map(json.loads, path.read_text().splitlines()) if "time_step" in r] \
        if path.is_file() else []
    return float(np.median(steps)) if steps else None


def held_out_samples(after_sft: list[dict[str, Any]], after_rl: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first SAMPLES_SHOWN held-out rows: context, gold, and the explanation after SFT and after RL."""
    return [{"context": a["context"], "gold": a["gold_explanation"], "after_sft": a["explanation"],
             "after_rl": b["explanation"], "fve_after_sft": a["fve"], "fve_after_rl": b["fve"]}
            for a, b in zip(after_sft[:SAMPLES_SHOWN], after_rl[:SAMPLES_SHOWN])]


def sft_summary(checkpoint: Path) -> dict[str, Any]:
    """One SFT stage: steps run, the step handed on, and its held-out curve ([steps done, figure] pairs)."""
    records = [json.loads(line) for line in (checkpoint.parent / "metrics.jsonl").read_text().splitlines()]
    curve = {key: [[r["step"] + 1, r[key]] for r in records if r.get(key) is not None]
             for key in ("heldout/fve", "heldout/nll", "heldout/nll_gap")}
    return {"steps_run": len(records), "step_used": checkpoint_step(checkpoint),
            "heldout": {key: points for key, points in curve.items() if points}}


GREEDY_STAGES = {"after_sft": "after SFT", "after_rl": "after RL"}
"""The stages the greedy evals score again, as the report names them."""


def build_report(run_dir: Path, evals: Mapping[str, Any], *, environment: Mapping[str, Any],
                 length_ks: Sequence[int], times: Mapping[str, float], rl_dir: Path, curves: Path | None,
                 checkpoints: Mapping[str, Path], explain: str) -> dict[str, Any]:
    """report.json: each stage's held-out figures beside the gold AR's, the controls, SFT's curves, wall times.

    evals: the EvalResults of "gold", "before_sft", "after_sft" and "after_rl" (and, with greedy_eval, of
    "after_sft_greedy" and "after_rl_greedy": the same AVs decoded by argmax); checkpoints: the AR and AV after
    SFT, and after RL the AV ("rl") and the AR that scored it ("ar_after_rl"); explain: the command the report
    ends with."""
    gold, zero_shot = evals["gold"].metrics, evals["before_sft"].metrics
    after_sft, after_rl = evals["after_sft"].metrics, evals["after_rl"].metrics
    greedy = {stage: evals[f"{stage}_greedy"].metrics["av/fve"] for stage in GREEDY_STAGES
              if f"{stage}_greedy" in evals}
    return {
        "run_dir": str(run_dir),
        "environment": dict(environment),
        "eval_rows": int(gold["n_rows"]),
        "fve": {
            "AR on gold explanations": gold["gold/fve"],
            "AV+AR before SFT (LM zero-shot)": zero_shot["av/fve"],
            "AV+AR after SFT": after_sft["av/fve"],
            "AV+AR after RL": after_rl["av/fve"],
            **{f"AV+AR {GREEDY_STAGES[stage]}, greedy decoding": fve for stage, fve in greedy.items()},
            "AV+AR after SFT, AV given a shuffled vector (control)": after_sft.get("shuffled/fve"),
            "AV+AR after RL, AV given a shuffled vector (control)": after_rl.get("shuffled/fve"),
        },
        "fraction_of_gold": {"after SFT": _ratio(after_sft["av/fve"], gold["gold/fve"]),
                             "after RL": _ratio(after_rl["av/fve"], gold["gold/fve"]),
                             **{f"{GREEDY_STAGES[stage]}, greedy": _ratio(fve, gold["gold/fve"])
                                for stage, fve in greedy.items()}},
        "fve_nrm": {"AR on gold explanations": gold.get("gold/fve_nrm"), "AV+AR after SFT": after_sft.get("av/fve_nrm"),
                    "AV+AR after RL": after_rl.get("av/fve_nrm")},
        "splice_kl": {
            "AR on gold explanations": after_rl.get("splice/kl_gold"),
            "AV+AR after SFT": after_sft.get("splice/kl_av"),
            "AV+AR after RL": after_rl.get("splice/kl_av"),
            "random vector at the AV+AR's error (after RL)": after_rl.get("splice/kl_random"),
            "dataset mean": after_rl.get("splice/kl_mean"),
        },
        "fve_by_length": {**{f"first {k} tokens": after_rl.get(f"length/fve_k{k}") for k in length_ks},
                          "whole explanation": after_rl["av/fve"]},
        "explanation_tokens": {"after SFT": after_sft.get("length/tokens_mean"),
                               "after RL": after_rl.get("length/tokens_mean")},
        "extraction_rate": {"before SFT": zero_shot["av/extraction_rate"], "after SFT": after_sft["av/extraction_rate"],
                            "after RL": after_rl["av/extraction_rate"]},
        "sft": {"AR": sft_summary(checkpoints["ar"]), "AV": sft_summary(checkpoints["av"])},
        "checkpoints": {name: str(path) for name, path in checkpoints.items()},
        "seconds": dict(times),
        "seconds_per_rl_step": rl_step_seconds(rl_dir),
        "curves": None if curves is None else str(curves),
        "samples": held_out_samples(evals["after_sft"].samples, evals["after_rl"].samples),
        "explain": explain,
    }


def _ratio(value: float, gold: float) -> float | None:
    return value / gold if math.isfinite(value) and math.isfinite(gold) and gold > 0 else None


REPORTED_PACKAGES = ("torch", "transformers", "peft", "tokenizers", "safetensors", "numpy", "pyarrow")
"""The packages whose versions the report records (those that compute or read its numbers)."""


def environment(*, threads: int, device: str) -> dict[str, Any]:
    """What the numbers depend on beyond the config: the machine, the CPU kernels torch dispatches to (float-level
    results differ between AVX2 and AVX-512 builds of a kernel), the platform and the package versions."""
    import importlib.metadata

    cpuinfo = Path("/proc/cpuinfo")
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                if line.startswith("model name")), None) if cpuinfo.is_file() else None
    return {
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, {threads} thread(s)",
        "cpu": cpu or platform.processor() or "unknown", "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "gpu": torch.cuda.get_device_name() if device != "cpu" and torch.cuda.is_available() else None,
        "platform": platform.platform(), "python": platform.python_version(),
        "packages": {name: importlib.metadata.version(name) for name in REPORTED_PACKAGES},
    }


def format_report(report: Mapping[str, Any]) -> str:
    """The report as markdown: held-out FVE per stage and controls, extraction rates, splice-KL, FVE by length, times."""
    env = report["environment"]
    lines = ["# nla demo report", "", f"run dir: `{report['run_dir']}`  ",
             f"machine: {env['machine']}; CPU {env['cpu']}, torch's kernels {env['cpu_capability']}"
             + (f"; GPU {env['gpu']}" if env["gpu"] else "") + "  ",
             f"software: {env['platform']}, Python {env['python']}, "
             + ", ".join(f"{name} {version}" for name, version in env["packages"].items()), "",
             f"Held-out FVE on {report['eval_rows']} rows of documents no stage trained on (rawvar baseline; "
             "failed extractions excluded, see the extraction rate):", "", "| stage | FVE |", "|---|---|"]
    lines += [f"| {name} | {_number(value, '.3f')} |" for name, value in report["fve"].items()]
    if report.get("fraction_of_gold"):
        lines += ["", "Share of the gold AR's FVE: " + ", ".join(
            f"{k} {_number(v, '.1%')}" for k, v in report["fraction_of_gold"].items())]
    if report.get("fve_nrm"):
        lines += ["", "kitft's fve_nrm (the AR's training baseline): " + ", ".join(
            f"{k} {_number(v, '.3f')}" for k, v in report["fve_nrm"].items())]
    for stage, summary in (report.get("sft") or {}).items():
        lines += [f"{stage} SFT: {summary['steps_run']} steps, checkpoint of step {summary['step_used']} used"
                  + "".join(f"; {key} " + ", ".join(f"{s}: {_number(v, '.3f')}" for s, v in points)
                            for key, points in summary["heldout"].items() if key != "heldout/nll_gap")]
    lines += ["", "Extraction rate: " + ", ".join(f"{k} {v:.0%}" for k, v in report["extraction_rate"].items()), "",
              "Splice-KL (nats): the reconstruction put back into the LM at the extraction layer, KL of the next "
              "token against the unmodified run (lower is better):", "", "| reconstruction | splice-KL |", "|---|---|"]
    lines += [f"| {name} | {_number(value, '.4f')} |" for name, value in report["splice_kl"].items()]
    lines += ["", "Held-out FVE after RL with each explanation cut to its first k tokens "
              "(mean length: " + ", ".join(f"{k} {_number(v, '.1f')}" for k, v in report["explanation_tokens"].items())
              + " tokens):", "", "| explanation | FVE |", "|---|---|"]
    lines += [f"| {name} | {_number(value, '.3f')} |" for name, value in report["fve_by_length"].items()]
    lines += ["", "| stage | wall time (s) |", "|---|---|"]
    lines += [f"| {name} | {seconds:.1f} |" for name, seconds in report["seconds"].items()]
    if report.get("curves"):
        lines += ["", f"curves: `{report['curves']}`"]
    if report.get("seconds_per_rl_step") is not None:
        lines += ["", f"RL step (median): {report['seconds_per_rl_step']:.2f} s"]
    if report.get("samples"):
        lines += ["", "Held-out explanations (the first rows, verbatim): gold, after SFT, after RL", ""]
        for i, sample in enumerate(report["samples"]):
            lines += [f"{i + 1}. context: …{sample['context'][-120:]!r}", f"   - gold: {sample['gold']!r}",
                      f"   - after SFT: {sample['after_sft']!r} (FVE {_number(sample['fve_after_sft'], '.3f')})",
                      f"   - after RL: {sample['after_rl']!r} (FVE {_number(sample['fve_after_rl'], '.3f')})"]
    lines += ["", "Read your own sentence:", "", f"    {report['explain']}"]
    return "\n".join(lines) + "\n"


def _number(value: float | None, spec: str) -> str:
    """A report cell: the number, or "n/a" where the stage produced none (e.g. nothing extracted)."""
    return "n/a" if value is None or not math.isfinite(value) else format(value, spec)
