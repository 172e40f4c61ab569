"""The memory model's tables and its check against every measured peak (CPU; the model is
nla_shell.training.memory, the one `logp_micro_batch=auto` uses).

    python bench/memory_model.py                       # one GPU: the scaling matrix, markdown
    python bench/memory_model.py --shapes 14b --cases 256x8 --micro-batch 16
    python bench/memory_model.py --shapes 14b --cases 256x8 --bench-args   # bench_step flags that fit
    python bench/memory_model.py --fsdp2               # per GPU under sharding=fsdp2 on 1, 2, 4, 8 GPUs
    python bench/memory_model.py --check               # estimate vs every measured phase in bench/results

--check reads every bench_step JSON under bench/results (a case's device memory in use at most in
its rollout, score and update phases, from cudaMemGetInfo) and prints each beside the estimate of
the same phase at the run's settings, the runs the model's rollout term was fitted to (run AA's)
apart from the held-out ones, with each group's largest error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from scaling_table import MEMORY_PHASES, settings_of  # noqa: E402

from nla_shell.training.memory import QWEN3_SHAPES, Settings, estimate, fitting, fsdp2_estimate  # noqa: E402

RESULTS = ROOT / "bench" / "results"
FITTED = ("scaling_2026-12-01", "rollout")
"""(run directory, phase) the model's rollout term (one more bf16 copy of the AV + 1 GiB) was fitted to: run AA."""
FSDP2_SHAPES = ("8b", "14b", "32b", "llama-3.3-70b")
FSDP2_GPUS = (1, 2, 4, 8)


# --------------------------------------------------------------------------- the check


class Comparison(NamedTuple):
    run: str
    shape: str
    case: str
    path: str
    phase: str
    measured_gib: float
    estimated_gib: float
    fitted: bool

    @property
    def error_gib(self) -> float:
        return self.estimated_gib - self.measured_gib


def comparisons(results: Path = RESULTS) -> list[Comparison]:
    """Every measured phase of every bench_step case under `results` beside the estimate at its settings."""
    found = []
    for path in sorted(results.rglob("*.json")):
        try:
            run = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not (isinstance(run, dict) and isinstance(run.get("settings"), dict) and run["settings"].get("shape")):
            continue
        run_name = str(path.parent.relative_to(results))
        for case in run.get("cases", []):
            est = estimate(run["settings"]["shape"], settings_of(run, case["prompts"], case["group"], case["path"]))
            for phase, model_phase in MEMORY_PHASES.items():
                if phase in case.get("phases", {}):
                    found.append(Comparison(
                        run_name, run["settings"]["shape"], f"{case['prompts']}x{case['group']}", case["path"], phase,
                        case["phases"][phase]["in_use_gib"], est.phase_total(model_phase),
                        (run_name.split("/")[0], phase) == FITTED))
    return found


def check_table(found: list[Comparison]) -> str:
    """Markdown: the fitted comparisons, then the held-out ones, each group with its largest errors."""
    lines = []
    for fitted, title in ((True, "fitted (run AA's rollout phase: the term was fitted to these)"),
                          (False, "held out")):
        group = [c for c in found if c.fitted == fitted]
        lines += [f"**{title}**: {len(group)} phases; estimate - measured from "
                  f"{min(c.error_gib for c in group):+.1f} to {max(c.error_gib for c in group):+.1f} GiB", "",
                  "| run | shape | case | path | phase | measured GiB | estimated GiB | error GiB |",
                  "| --- | --- | --- | --- | --- | ---: | ---: | ---: |"]
        lines += [f"| {c.run} | {c.shape} | {c.case} | {c.path} | {c.phase} | {c.measured_gib:.1f} | "
                  f"{c.estimated_gib:.1f} | {c.error_gib:+.1f} |" for c in group]
        lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the tables


def bench_args(settings: Settings) -> str:
    """bench_step's flags for the settings' micro-batches and vLLM settings."""
    s = settings
    return (f"--micro-batch {s.micro_batch} --critic-micro-batch {s.critic_micro_batch} --reference-micro-batch "
            f"{max(s.micro_batch, 16)} --vllm-gpu-mem {s.vllm_gpu_mem} --vllm-sleep {s.vllm_sleep} "
            f"--vllm-max-seqs {s.vllm_max_seqs}" + (" --ar-lora" if s.ar_lora else ""))


def fitting_bench_args(shape: str, settings: Settings) -> str:
    """bench_step's flags for `shape` at `settings`: vLLM's share up to its need, the micro-batches halved while
    that lowers the estimate, until it fits, then an AR-LoRA if it still does not (bench_step has no switch for
    the other options)."""
    e = estimate(shape, settings)
    share = max(e.settings.vllm_gpu_mem, math.ceil(20 * e.vllm_need_gib / e.settings.gpu_gib) / 20)
    e = estimate(shape, dataclasses.replace(e.settings, vllm_gpu_mem=share))
    while not e.fits and max(e.settings.micro_batch, e.settings.critic_micro_batch) > 1:
        s = e.settings
        bigger = "micro_batch" if s.micro_batch >= s.critic_micro_batch else "critic_micro_batch"
        smaller = estimate(shape, dataclasses.replace(s, **{bigger: max(1, getattr(s, bigger) // 2)}))
        if smaller.total >= e.total:  # the peak is elsewhere (the rollout): smaller micro-batches only cost time
            break
        e = smaller
    if not e.fits and e.settings.critic and not e.settings.ar_lora:
        e = estimate(shape, dataclasses.replace(e.settings, ar_lora=True))
    return bench_args(e.settings)


def _to_fit(e, fixed, applied: list[str]) -> str:
    if e.fits:
        return "-"
    if fixed.fits:
        return f"{', '.join(applied)} ({fixed.total:.1f} GiB)"
    return f"nothing nla serves fits ({', '.join(applied) or 'no option helps'}: {fixed.total:.1f} GiB)"


def table(shapes: list[str], cases: list[tuple[int, int]], settings: Settings) -> str:
    """Markdown, one GPU: per shape and case, the parts, the peak, and the options that make it fit."""
    lines = ["| shape | case | AV weights | LoRA + moments | AR weights + moments | rollout (vLLM awake) | update | critic "
             "| peak phase | estimated GiB | fits 139 GiB | what does not fit | to fit (estimate after) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- | --- | --- |"]
    for shape in shapes:
        for prompts, group in cases:
            e = estimate(shape, dataclasses.replace(settings, prompts=prompts, group=group))
            fixed, applied = fitting(shape, e.settings)
            ar = e.resident["AR weights"] + e.resident.get("AR moments", 0.0)
            phase = {k: sum(v.values()) for k, v in e.phases.items()}
            vllm_note = (f"; vLLM's share {e.vllm_share_gib:.0f} GiB < its need {e.vllm_need_gib:.0f}"
                         if e.vllm_need_gib > e.vllm_share_gib else "")
            lines.append(
                f"| {shape} | {prompts}x{group} | {e.resident['AV weights']:.1f} | {e.resident['LoRA + moments']:.1f} "
                f"| {ar:.1f} | {phase['rollout']:.1f} | {phase['update']:.1f} | {phase['critic']:.1f} | {e.peak_phase} "
                f"| {e.total:.1f} | {'yes' if e.fits else 'no'} | {(e.what_does_not_fit() or '-') + vllm_note} "
                f"| {_to_fit(e, fixed, applied)} |")
    return "\n".join(lines)


def fsdp2_table(shapes: list[str], gpus: list[int], settings: Settings) -> str:
    """Markdown, per GPU under sharding=fsdp2: actor, critic, optimiser, activations, rollout, and what fits."""
    lines = ["| shape | GPUs | actor (blocks 1/N + embedding, head) | LoRA + moments | critic weights + moments (1/N) "
             "| rollout (HF generate) | update activations + gathered blocks | critic step | peak phase "
             "| per GPU GiB | fits 139 GiB | to fit (estimate after) | vLLM, vllm_tp=N (not served yet) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- | --- | ---: |"]
    for shape in shapes:
        for n in gpus:
            e = fsdp2_estimate(shape, n, settings)
            fixed, applied = fitting(shape, settings, gpus=n)
            r, phase = e.resident, {k: sum(v.values()) for k, v in e.phases.items()}
            actor = r["actor blocks (1/N)"] + r["actor embedding + head (whole)"]
            critic = r["AR weights (1/N)"] + r.get("AR moments (1/N)", 0.0)
            lines.append(
                f"| {shape} | {n} | {actor:.1f} | {r['LoRA + moments (1/N)']:.1f} | {critic:.1f} | {phase['rollout']:.1f} "
                f"| {phase['update']:.1f} | {phase['critic']:.1f} | {e.peak_phase} | {e.total:.1f} "
                f"| {'yes' if e.fits else 'no'} | {_to_fit(e, fixed, applied)} | {e.vllm_need_gib:.1f} |")
    return "\n".join(lines)


def parse_cases(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in case.split("x")) for case in text.split(",") if case]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=None, help="default: the Qwen3 shapes (with --fsdp2: 8b,14b,32b,llama-3.3-70b)")
    parser.add_argument("--cases", default="256x8,64x8")
    parser.add_argument("--bench-args", action="store_true",
                        help="print bench_step's flags for the first shape and case that fit (one line, for "
                             "bench/gpu_session.sh's scaling stage)")
    parser.add_argument("--fsdp2", action="store_true", help="per GPU under sharding=fsdp2, for the first case")
    parser.add_argument("--gpus", default=",".join(map(str, FSDP2_GPUS)))
    parser.add_argument("--check", action="store_true", help="the estimate beside every measured phase in bench/results")
    for field in dataclasses.fields(Settings):
        if field.name in ("prompts", "group") or field.type not in ("int", "float", "bool", "str"):
            continue
        flag = "--" + field.name.replace("_", "-")
        if field.type == "bool":
            parser.add_argument(flag, type=lambda v: v.lower() in ("1", "true", "on", "yes"), default=field.default)
        else:
            parser.add_argument(flag, type={"int": int, "float": float, "str": str}[field.type], default=field.default)
    args = parser.parse_args()
    settings = Settings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Settings) if hasattr(args, f.name)})
    cases = parse_cases(args.cases)
    if args.check:
        print(check_table(comparisons()))
    elif args.fsdp2:
        shapes = args.shapes.split(",") if args.shapes else list(FSDP2_SHAPES)
        (prompts, group), gpus = cases[0], [int(n) for n in args.gpus.split(",")]
        print(fsdp2_table(shapes, gpus, dataclasses.replace(settings, prompts=prompts, group=group)))
    elif args.bench_args:
        (prompts, group), shape = cases[0], (args.shapes or next(iter(QWEN3_SHAPES))).split(",")[0]
        print(fitting_bench_args(shape, dataclasses.replace(settings, prompts=prompts, group=group)))
    else:
        print(table(args.shapes.split(",") if args.shapes else list(QWEN3_SHAPES), cases, settings))


if __name__ == "__main__":
    main()
