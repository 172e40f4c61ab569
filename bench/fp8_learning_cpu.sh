#!/usr/bin/env bash
# The trainer's FP8 (fp8=score,reference,update) against bf16 on the toy NLA, on the CPU, paired by seed:
# per seed its demo (fp32 SFT and RL), then 60 RL steps from that SFT in bf16 with and without FP8
# (bench/rl_variants.py), as the GPU's fp8-learning stage does (bench/gpu_session.sh fp8-lane).
#
#   bash bench/fp8_learning_cpu.sh lane SEED...      # one lane (one core): the seeds one after another
#   bash bench/fp8_learning_cpu.sh table             # the variants' table, then the parity rule's bound
#
# RUNS (default /tmp/fp8cpu) holds the seeds' run dirs. Run one lane per core, then the table.
# FP8 (default score,reference,update) is the variant's fp8= value and NAME (default bf16_fp8) its name, e.g.
# FP8=score,reference,update,backward NAME=bf16_fp8bw for the FP8 backwards too. EXTRA (default none) adds keys to
# both variants and BASE (default bf16) names the bf16 one, e.g. EXTRA=train_critic=true BASE=bf16_critic.
# KEYS (default fp8=$FP8) are the variant's own keys, for an option other than FP8, e.g.
# EXTRA=train_critic=true BASE=bf16_critic KEYS=critic_rollouts=best NAME=bf16_critic_best.
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-/tmp/fp8cpu}; mkdir -p "$runs"
fp8=${FP8:-score,reference,update}; name=${NAME:-bf16_fp8}; base=${BASE:-bf16}; extra=${EXTRA:-}
keys=${KEYS:-fp8=$fp8}
py=${PYTHON:-.venv/bin/python}
case $1 in
  lane)
    shift; export OMP_NUM_THREADS=1
    for seed in "$@"; do
      d=$runs/seed$seed; start=$SECONDS
      [ -f $d/report.json ] || $py -m nla_shell.cli demo --run-dir $d --seed $seed --device cpu > $d.log 2>&1 ||
        { echo "seed $seed: the demo failed ($d.log)"; continue; }
      demo=$((SECONDS - start))
      [ -f $d/variants/$base/report.json ] ||
        $py bench/rl_variants.py variant $d $base dtype=bfloat16 engine=native $extra > $d.$base.log 2>&1
      [ -f $d/variants/$name/report.json ] ||
        $py bench/rl_variants.py variant $d $name dtype=bfloat16 engine=native $extra $keys > $d.$name.log 2>&1
      echo "seed $seed: demo $demo s, both variants $((SECONDS - start - demo)) s"
    done ;;
  table)
    $py bench/rl_variants.py table "$runs"/seed*/ --out "$runs/table" --against $base
    # The parity rule (nla_shell.stats) on the paired held-out FVE differences (NAME - BASE).
    $py - "$runs" "$name" "$base" <<'PY'
import json, sys
from pathlib import Path
from nla_shell.stats import paired_shortfall
name, base, fves = sys.argv[2], sys.argv[3], {}
for d in sorted(Path(sys.argv[1]).glob("seed*/variants")):
    try:
        fves[int(d.parent.name[4:])] = {v: json.loads((d / v / "report.json").read_text())["fve"] for v in (base, name)}
    except FileNotFoundError:
        continue
if len(fves) < 2:
    sys.exit(f"fewer than 2 seeds with both variants in {sys.argv[1]}")
s = paired_shortfall({k: f[name] for k, f in fves.items()}, {k: f[base] for k, f in fves.items()})
print(f"{name} - {base}, seeds {sorted(fves)}: {s.verdict()}")
PY
    ;;
  *) echo "usage: bash bench/fp8_learning_cpu.sh lane SEED... | table" >&2; exit 2 ;;
esac
