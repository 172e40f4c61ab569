"""The scaling table: bench_step JSONs (bench/gpu_session.sh's `scaling` stage) beside the memory estimate.

One markdown row per measured case: shape, case, step seconds, each phase's seconds, the device
memory in use at most in each phase (`in_use_gib`, from cudaMemGetInfo: vLLM's memory and torch's
cache included) beside `memory_model`'s estimate of the same phase at the run's settings (resident
parts + the phase; bench_step's score phase is the model's critic phase), and those settings. torch's
own peak counter is left out: it counts vLLM's sleep-mode pool, which is unmapped while vLLM sleeps,
so it reads above the GPU's memory (145.5 GiB at 8B in run AA). A JSON without a case (an OOM, a timeout) gives a row with
its error, so a size that does not fit is in the table too.

    python bench/scaling_table.py $OUT/scaling_*.json > bench/results/scaling.md
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nla_shell.training import memory as memory_model  # noqa: E402

PHASES = ("rollout", "score", "update", "critic")
MEMORY_PHASES = {"rollout": "rollout", "score": "critic", "update": "update"}
"""bench_step's phases whose memory the table shows -> memory_model's phase of the same work."""


def settings_of(run: dict, prompts: int, group: int, path: str | None = None) -> memory_model.Settings:
    """memory_model's settings for a bench_step run's case on `path` (default: the run's first; its flags,
    AdamW8bit when it used it, the FP8 copies of an FP8 path)."""
    s = run["settings"]
    path = path or s["paths"][0]
    # A path names its switches: after_all[_fp8[_backward]][+best], after_bf16, after_fp8 (bench_step's --paths).
    fp8 = s.get("fp8", []) if "_fp8" in path else []
    return dataclasses.replace(
        memory_model.Settings(), prompts=prompts, group=group, prompt_len=s["prompt_len"], new_tokens=s["new_tokens"],
        micro_batch=s["micro_batch"], critic_micro_batch=s["critic_micro_batch"], critic=s["critic"],
        adamw8bit=run.get("optimizers", {}).get("actor") == "AdamW8bit",
        bf16_autocast=path.startswith(("after_bf16", "after_all")),
        fp8_actor=bool({"reference", "update"} & set(fp8)), fp8_score="score" in fp8,
        fp8_backward="_backward" in path,
        ar_lora=s.get("ar_lora", False), vllm_gpu_mem=s["vllm_gpu_mem"], vllm_sleep=s["vllm_sleep"],
        vllm_max_seqs=s["vllm_max_seqs"] or memory_model.Settings.vllm_max_seqs)


def settings_text(run: dict, path: str) -> str:
    s = run["settings"]
    return (f"{s['engine']}, {path}, mb {s['micro_batch']}, critic mb {s['critic_micro_batch']}, "
            f"vllm_gpu_mem {s['vllm_gpu_mem']}, sleep {s['vllm_sleep']}, max_seqs {s['vllm_max_seqs']}, "
            f"{run.get('optimizers', {}).get('actor', '?')}" + (", AR-LoRA" if s.get("ar_lora") else ""))


def rows(runs: list[dict]) -> list[str]:
    lines = []
    for run in runs:
        shape = run["settings"].get("shape", "8b")
        for c in run.get("cases", []):
            path = c.get("path", run["settings"]["paths"][0])
            est = memory_model.estimate(shape, settings_of(run, c["prompts"], c["group"], path))
            phases = ", ".join(f"{p} {c['phases'][p]['s']:.1f}" for p in PHASES if p in c["phases"])
            shown = [p for p in MEMORY_PHASES if p in c["phases"]]
            in_use = " / ".join(f"{c['phases'][p]['in_use_gib']:.1f}" for p in shown)
            estimated = " / ".join(f"{est.phase_total(MEMORY_PHASES[p]):.1f}" for p in shown)
            lines.append(f"| {shape} | {c['prompts']}x{c['group']} | {c['step_s']:.1f} | {phases} | "
                         f"{in_use} | {estimated} | {settings_text(run, path)} |")
        finished = {(c["prompts"], c["group"]) for c in run.get("cases", [])}
        for prompts, group in run["settings"]["cases"]:  # a case that did not finish: an OOM, a timeout
            if (prompts, group) in finished:
                continue
            error = "; ".join(e for e in run.get("errors", []) if f"{prompts}x{group}" in e) or \
                "no step finished (timed out?)"
            est = memory_model.estimate(shape, settings_of(run, prompts, group))
            estimated = " / ".join(f"{est.phase_total(m):.1f}" for m in MEMORY_PHASES.values())
            lines.append(f"| {shape} | {prompts}x{group} | - | {error[:160]} | - | {estimated} | "
                         f"{settings_text(run, run['settings']['paths'][0])} |")
    return lines


def table(runs: list[dict]) -> str:
    header = ["| shape | case | step s | phases (s) | in use GiB: rollout / score / update | estimated GiB, same phases "
              "| settings |",
              "| --- | --- | ---: | --- | ---: | ---: | --- |"]
    return "\n".join(header + rows(runs))


if __name__ == "__main__":
    print(table([json.loads(Path(p).read_text()) for p in sys.argv[1:]]))
