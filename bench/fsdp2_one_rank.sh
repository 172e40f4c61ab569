#!/usr/bin/env bash
# `nla train` at one rank, sharding=ddp (the plain run) against sharding=fsdp2, at the Qwen3-8B shape with
# random weights (bench/make_8b_run.py), engine=hf; prints step time, peak memory, loss, grad norm and reward
# side by side (random weights write no explanation: the policy's entropy and the
# engine/trainer log-prob gap are the numbers to compare). Both runs go through torchrun --nproc_per_node 1. About 4 minutes on one H200 (the inputs
# ~1-2 min, each run ~1 min); the critic is not co-trained (it is whole in both layouts, and saving an 8B-shape
# critic would double the time).
#
#   bash bench/fsdp2_one_rank.sh                    # one H200: OUT=/tmp/fsdp2 by default
#   INPUTS=/tmp/nla8b bash bench/fsdp2_one_rank.sh  # reuse make_8b_run.py's inputs (gpu_session.sh's train8b)
#   TINY=1 bash bench/fsdp2_one_rank.sh             # CPU smoke: the tiny geometry
set -euo pipefail
OUT=${OUT:-/tmp/fsdp2}
INPUTS=${INPUTS:-$OUT/inputs}
mkdir -p "$OUT"
if [ -n "${TINY:-}" ]; then
  python3 bench/make_8b_run.py "$INPUTS" --tiny > "$OUT/make.log" 2>&1
  extra=(device=cpu dtype=float32)
else
  [ -f "$INPUTS/data/rl.parquet" ] || python3 bench/make_8b_run.py "$INPUTS" > "$OUT/make.log" 2>&1
  extra=(dtype=bfloat16)
fi
for sharding in ddp fsdp2; do
  timeout -k 10 "${T:-150}" python3 -m torch.distributed.run --standalone --nproc_per_node 1 -m nla_shell.cli train \
    av_ckpt="$INPUTS/av" ar_ckpt="$INPUTS/ar" rl_parquet="$INPUTS/data/rl.parquet" \
    save_dir="$OUT/run_$sharding" overwrite=true sharding=$sharding engine=hf num_steps=3 batch_prompts=8 group_size=4 \
    max_new_tokens=32 train_critic=false logp_micro_batch=16 ref_micro_batch=16 eval_every=0 save_every=100 \
    logger=jsonl "${extra[@]}" ${TRAIN_ARGS:-} > "$OUT/train_$sharding.log" 2>&1 \
    || { echo "[fsdp2] sharding=$sharding failed:"; grep -v "^ \|^Traceback" "$OUT/train_$sharding.log" | tail -n 20; exit 1; }
done
python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
runs = {s: [json.loads(line) for line in (out / f"run_{s}" / "metrics.jsonl").read_text().splitlines()] for s in ("ddp", "fsdp2")}
# Random weights write no explanation: reward and loss are empty, the policy's entropy and the engine/trainer
# log-prob gap are the numbers the two layouts must share.
keys = ("time_step", "time_rollout", "time_update", "peak_mem_gb", "entropy_mean", "logp_diff_mean", "response_len_mean")
show = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
print("step | " + " | ".join(f"{k} ddp / fsdp2" for k in keys))
for plain, sharded in zip(runs["ddp"], runs["fsdp2"]):
    print(f"{plain['step']} | " + " | ".join(f"{show(plain[k])} / {show(sharded[k])}" for k in keys))
EOF
