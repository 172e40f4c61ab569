#!/usr/bin/env bash
# The whole GPU matrix on a 2xH200 machine, as a few back-to-back `device` runs (each under
# the 10-minute call limit; the machine, and /tmp with it, is kept only between quick calls).
#   part K    (K = 1..3)  carry .device-carry/vllm/pK: bring one part of the vLLM bundle
#   A         carry .device-carry/vllm/p4: install vLLM; GPU0: vLLM tests + bench_vllm 8B;
#             GPU1: native GPU tests + bench_step
#   B         GPU0: bench_rollout (HF, native, vLLM baseline); GPU1: nla train at 8B, hf + native
#   C         GPU0: nla train at 8B with vLLM; then both GPUs: bench_ddp
#   V         (instead of A, on a fresh machine after the parts) install vLLM, register nla's
#             vLLM plugin entry point, run every vLLM GPU test (TP=2 included)
# Logs and JSON land in $OUT (at most 8 files a run come back).
# Second session (2026-11-30, issues 11-13), after parts 1-3:
#   R1        carry .device-carry/vllm/p4: install vLLM + plugin entry point; GPU0: bench_step
#             256x8 with vLLM and the after_all options; GPU1: the native CUDA-graph sampler test,
#             then the family and sleep-mode GPU tests
#   R2        carry .whl (bitsandbytes): GPU0: the quantised-AR GPU test, then the vLLM parity legs;
#             GPU1: the toy's SFT checkpoints, then hf + native parity legs
#   R3        both GPUs: bench_step 256x8 under torchrun, 2 ranks
#   R4        (one GPU, after parts 1-3 on a fresh machine; carry p4) the family GPU tests again
#             (pytest prints a failure's cause only at the end: to see why vLLM fails Qwen2/3, run
#             `-k "vllm and qwen"` alone first)
# Third session (2026-11-30), after parts 1-3 on an x2 machine:
#   S1        carry .device-carry/vllm/p4: GPU0: install vLLM, the vLLM family cases for Qwen2/3 alone
#             (full pytest report), then Gemma 2/3 and embedding_replace; GPU1: bench_update variants
#   S2        carry p4 and .bnb (bitsandbytes 0.50.2 unzipped, only its CUDA 13 libraries: the wheel and
#             p4 together exceed a call's 64 MiB): GPU0: bench_step 256x8 with vLLM at micro-batch 64,
#             nvidia-smi sampling memory; GPU1: the same step with the native engine as a 1-rank
#             torchrun job (kept in /tmp/ranks.json for S3), then the vLLM Gemma 2 family case
#   S3        both GPUs: the 2-rank job (speed-up against S2's 1 rank), then bench_update variants
#   S4        carry .bnb: GPU0: bench_quant --role ar (bf16 full / LoRA, 8-bit, 4-bit AR); GPU1:
#             bench_update with and without the prefix batches' host synchronisations, same process
# Fourth session (2026-11-30, issue 12), after parts 1-3 on an x2 machine:
#   T1        carry p4 and .bnb: GPU0: install vLLM, bench_step 256x8 with vLLM (salted prefix caching on,
#             vLLM's default max_num_seqs, LoRA layers compiled); GPU1: bench_update with compile_blocks
#             without / with the LoRA layers (profile tables), the prefix-caching GPU tests, then
#             bench_vllm's rollout of 2048 sequences without / with prefix caching at the trainer's 0.35
#   T4        (a fresh x2 machine, after parts 1-3) carry p4 and .bnb: the trainer's defaults now (prefix
#             caching, max_num_seqs 512, LoRA layers compiled) and AR inputs of the generated length:
#             GPU0: bench_step 256x8 with vLLM (GPU1 idle: the native step would not end in the budget left)
#   T2        carry .bnb: both GPUs: bench_step 256x8 under torchrun, 2 ranks (native engine)
#   T3        (a fresh x2 machine, after parts 1-3) carry p4 and .bnb: GPU0: bench_vllm's rollout of 2048
#             sequences without / with prefix caching at max_num_seqs 512 (vLLM captures CUDA graphs up
#             to 512); GPU1: bench_step 256x8 with vLLM, prefix caching on, max_num_seqs 512
# Fifth session (2026-11-30, issue 12), after parts 1-3 on an x2 machine:
#   U1        carry p4 and .bnb: GPU1: bench_update with the rotary embedding eager / compiled, the reference
#             pass at 64 / 256, and without it; GPU0: install vLLM, bench_vllm's rollout of 2048 sequences at
#             max_num_seqs 512 and 1024 (graphs captured up to max_num_seqs); then both GPUs: the per-rank
#             vLLM engines' GPU test (torchrun, 2 ranks)
#   U2        GPU0: bench_step 256x8 with vLLM as a 1-rank torchrun job, at the max_num_seqs whose rollout
#             U1 measured faster (read from U1's JSON kept in /tmp/keep)
#   U3        both GPUs: the same with 2 ranks, each with its own vLLM engine; speed-up against U2's 1 rank
#             (U2 hung in vLLM's start-up: torchrun's agent store, fixed since in the engine; the session ran
#             the 1-GPU step as a plain process and the 2-rank step with --ranks 2 instead, see RESULTS.md)
# Sixth session (2026-11-30, issue 12), one H200:
#   W1        carry .bnb: bench_update of 32x8 at micro-batch 64, its whole update profiled (idle gaps and the
#             host ops behind them), then bench_critic's score + critic step at micro-batches 24, 48, 64
#   W2        carry .bnb: bench_update with the log-prob head eager / compiled, the GPU's lag behind the host
#             (HostLead) and the idle gaps with driver launches attributed; bench_critic at 64 and 96
#   W3        (after parts 1-3) carry p4 and .bnb: install vLLM; bench_step 256x8 with vLLM as a plain process,
#             critic micro-batch 64, prompt blocks of 4 micro-batches, the device's memory in use sampled;
#             then bench_update with one prompt forward per micro-batch (pb1) against blocks of 4
#   W4        (after parts 1-3) carry p4 and .bnb: W3's step again (a second sample; W3 lost the device's memory
#             in use to bench_step's rank reduction, fixed since)
#   W5        (an x2 machine, after parts 1-3) carry p4 and .bnb: W3's step as a 2-rank torchrun job, each rank
#             with its own vLLM engine (the sixth session gave it ~290 s and it did not end; the seventh ~540 s).
#             The job's JSON stays in /tmp/keep for W6
# Seventh session (2026-11-30, issue 12), on W5's machine:
#   W6        GPU0: the same step as a 1-rank torchrun job (--keep-runs: bench_step prints the speed-up of W5's
#             2 ranks against it; also the first GPU run of the 1-rank vLLM start-up fix); GPU1: W3's step as a
#             plain process (a third one-GPU sample)
#   (then, on the same machine, by hand: R2's parity legs without the quantised test, hf + native 6 seeds on
#   GPU1 and vLLM 6 seeds all on GPU0; then W7's legs before vllm_kv_cache_gib existed. A vLLM leg failed
#   in vLLM's start-up profiling each time, see RESULTS.md)
#   W7        (a fresh x2 machine, after parts 1-3) carry p4 and .bnb: install vLLM; learning parity at the trainer's
#             vLLM defaults (prefix caching, max_num_seqs): hf 6 seeds on GPU1, vLLM 6 seeds in 3 lanes on GPU0,
#             each vLLM leg with a fixed KV cache (vllm_kv_cache_gib: no start-up profiling to clash)
set -uo pipefail
stage=$1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
lane() { local gpu=$1; shift; CUDA_VISIBLE_DEVICES=$gpu bash -c "$*"; }
pack() { tar -C "$OUT" -czf "/tmp/$1.tgz" . && rm -rf "${OUT:?}"/* && mv "/tmp/$1.tgz" "$OUT/"; }  # one file back, not > 8
train8b() {  # engine, extra overrides...
  local engine=$1; shift
  timeout -k 10 "${T:-240}" python3 -m nla_shell.cli train av_ckpt=/tmp/nla8b/av ar_ckpt=/tmp/nla8b/ar \
    rl_parquet=/tmp/nla8b/data/rl.parquet save_dir=/tmp/run_$engine engine=$engine num_steps=3 \
    eval_every=0 save_every=100 logger=console,jsonl "$@" 2>&1 | grep -v "Loading weights\|Writing model"
  cp /tmp/run_$engine/metrics.jsonl "$OUT/train_$engine.jsonl" 2>/dev/null
}
STEP_ARGS="--micro-batch 16 --critic-micro-batch 24 --reference-micro-batch 64"
MB64_ARGS="--micro-batch 64 --critic-micro-batch 24 --reference-micro-batch 64"
vllm_install() {  # the bundle's install.sh, then nla's vLLM plugin entry point (TP workers are spawned processes)
  bash /tmp/parts/install.sh && source /tmp/vllm_env.sh || return 1
  local dist=/tmp/site/nla-0.1.0.dist-info; mkdir -p $dist
  printf 'Metadata-Version: 2.1\nName: nla\nVersion: 0.1.0\n' > $dist/METADATA
  printf '[vllm.general_plugins]\nnla_steering = nla_shell.engines.vllm_steering:register\n' > $dist/entry_points.txt
}
case $stage in
  R1)
    mkdir -p /tmp/parts && cp .device-carry/vllm/p4/* /tmp/parts/
    nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpus.txt"
    lane 1 "timeout -k 10 90 python3 -m pytest tests/gpu/test_learning_parity.py -q -s -p no:cacheprovider \
            -k cuda_graph_sampler > $OUT/gpu_tests.log 2>&1" & sampler=$!
    vllm_install > "$OUT/install.log" 2>&1; source /tmp/vllm_env.sh
    lane 0 "timeout -k 10 $((560 - SECONDS)) python3 bench/bench_step.py --engine vllm --cases 256x8 --paths after_all \
            $STEP_ARGS --out $OUT/step_256x8_vllm.json 2>&1 | grep -v '^INFO\|^WARNING\|^(EngineCore' > $OUT/step_vllm.log" &
    wait $sampler
    lane 1 "timeout -k 10 330 python3 -m pytest tests/gpu/test_families_gpu.py -q -p no:cacheprovider 2>&1 \
              | grep -v '^INFO\|^WARNING\|^(EngineCore' >> $OUT/gpu_tests.log
            timeout -k 10 120 python3 -m pytest tests/gpu/test_vllm.py -q -p no:cacheprovider -k sleep 2>&1 \
              | grep -v '^INFO\|^WARNING\|^(EngineCore' >> $OUT/gpu_tests.log"
    wait; tail -5 "$OUT/step_vllm.log"; grep -E "passed|failed|error" "$OUT/gpu_tests.log" ;;
  R2)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/bnb .whl/*.whl
    source /tmp/vllm_env.sh; export PYTHONPATH=$PYTHONPATH:/tmp/bnb OMP_NUM_THREADS=2 NLA_PARITY_DIR=/tmp/parity
    ( export CUDA_VISIBLE_DEVICES=1
      python3 -c "import sys; from pathlib import Path; sys.path.insert(0, 'tests'); import parity; parity.demo_inputs(Path('/tmp/parity/demo'))" \
        > "$OUT/parity_demo.log" 2>&1; touch /tmp/parity/ready
      NLA_PARITY_JSON=$OUT/parity_hf_native.json NLA_PARITY_SEEDS=8 NLA_PARITY_ENGINES=hf,native \
        NLA_PARITY_LANES=1,1,1,1,1,1,1,1 timeout -k 10 $((550 - SECONDS)) python3 -m pytest tests/gpu/test_learning_parity.py \
        -q -s -p no:cacheprovider -k reaches > "$OUT/parity_a.log" 2>&1 ) &
    ( export CUDA_VISIBLE_DEVICES=0
      timeout -k 10 120 python3 -m pytest tests/gpu/test_quant_ar_gpu.py -q -p no:cacheprovider > "$OUT/quant_ar_gpu.log" 2>&1
      until [ -f /tmp/parity/ready ]; do sleep 5; done
      NLA_PARITY_JSON=$OUT/parity_vllm.json NLA_PARITY_SEEDS=6 NLA_PARITY_ENGINES=vllm NLA_PARITY_VLLM_LANES=0,0,0,0,0,0 \
        timeout -k 10 $((550 - SECONDS)) python3 -m pytest tests/gpu/test_learning_parity.py -q -s -p no:cacheprovider \
        -k reaches > "$OUT/parity_b.log" 2>&1 ) &
    wait; tail -3 "$OUT/quant_ar_gpu.log"; tail -12 "$OUT/parity_a.log" "$OUT/parity_b.log" ;;
  R4)
    mkdir -p /tmp/parts && cp .device-carry/vllm/p4/* /tmp/parts/
    python3 -c "import transformers as t; c = t.Gemma2Config(); print('transformers', t.__version__, 'Gemma2 default attention:', t.AutoModelForCausalLM.from_config(t.Gemma2Config(num_hidden_layers=1, hidden_size=64, intermediate_size=64, num_attention_heads=1, num_key_value_heads=1, head_dim=64, vocab_size=64)).config._attn_implementation)" 2>&1 | tail -1
    timeout -k 10 60 python3 -m pytest tests/gpu/test_families_gpu.py -q -p no:cacheprovider -k "native" > "$OUT/families_native.log" 2>&1 &
    vllm_install > "$OUT/install.log" 2>&1; source /tmp/vllm_env.sh; wait
    timeout -k 10 170 python3 -m pytest tests/gpu/test_families_gpu.py -q -s -p no:cacheprovider -k vllm 2>&1 \
      | grep -v '^INFO\|^WARNING\|^(EngineCore\|Capturing' > "$OUT/families_vllm.log"
    tail -3 "$OUT/families_native.log"; grep -E "mean\|dlogp|passed|failed" "$OUT/families_vllm.log" ;;
  S1)
    mkdir -p /tmp/parts && cp .device-carry/vllm/p4/* /tmp/parts/
    lane 1 "timeout -k 10 400 python3 bench/bench_update.py --cases 32x8 --variants ${VARIANTS:-16,32,64,16:bf16,32:bf16,64:bf16,32:bf16+compile} \
            --tables $OUT/update_tables --out $OUT/update.json > $OUT/update.log 2>&1" &
    vllm_install > "$OUT/install.log" 2>&1; source /tmp/vllm_env.sh
    timeout -k 10 200 python3 -m pytest tests/gpu/test_families_gpu.py -q -s -p no:cacheprovider -k "vllm and qwen" 2>&1 \
      | grep -v '^INFO\|^WARNING\|^(EngineCore\|Capturing' > "$OUT/families_vllm_qwen.log"
    timeout -k 10 $((560 - SECONDS)) python3 -m pytest tests/gpu/test_families_gpu.py -q -s -p no:cacheprovider \
      -k "vllm and (gemma or embedding)" 2>&1 | grep -v '^INFO\|^WARNING\|^(EngineCore\|Capturing' > "$OUT/families_vllm_rest.log"
    wait; grep "^\[update\]" "$OUT/update.log"; tail -40 "$OUT/families_vllm_qwen.log"; grep -E "mean\|dlogp|passed|failed" "$OUT/families_vllm_rest.log" ;;
  S2)
    mkdir -p /tmp/parts && cp .device-carry/vllm/p4/* /tmp/parts/ && cp -r .bnb /tmp/bnb
    nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv,noheader -lms 1000 > "$OUT/smi.csv" & smi=$!
    ( export PYTHONPATH=$PYTHONPATH:/tmp/bnb CUDA_VISIBLE_DEVICES=1
      timeout -k 10 420 python3 bench/bench_step.py --cases 256x8 --paths after_all $MB64_ARGS --ranks 1 \
        --case-timeout 400 --out /tmp/ranks.json > "$OUT/rank1.log" 2>&1
      source /tmp/vllm_env.sh
      timeout -k 10 $((580 - SECONDS)) python3 -m pytest tests/gpu/test_families_gpu.py -q -s -p no:cacheprovider \
        -k "vllm and gemma2" 2>&1 | grep -v '^INFO\|^WARNING\|^(EngineCore\|Capturing' > "$OUT/families_gemma2.log" ) & gpu1=$!
    vllm_install > "$OUT/install.log" 2>&1; source /tmp/vllm_env.sh; export PYTHONPATH=$PYTHONPATH:/tmp/bnb
    lane 0 "timeout -k 10 $((580 - SECONDS)) python3 bench/bench_step.py --engine vllm --cases 256x8 --paths after_all \
            $MB64_ARGS --out $OUT/step_256x8_vllm.json 2>&1 | grep -v '^INFO\|^WARNING\|^(EngineCore' > $OUT/step_vllm.log"
    wait $gpu1; kill $smi; cp /tmp/ranks.json "$OUT/ranks1.json" 2>/dev/null
    tail -4 "$OUT/step_vllm.log"; grep "^\[step\]\|optim\|error" "$OUT/rank1.log" "$OUT/step_vllm.log"; grep -E "dlogp|passed|failed" "$OUT/families_gemma2.log"
    awk -F, '{m[$2]=($3+0>m[$2]?$3+0:m[$2])} END {for (g in m) print "gpu" g " max MiB used", m[g]}' "$OUT/smi.csv" ;;
  S3)
    export PYTHONPATH=$PYTHONPATH:/tmp/bnb
    timeout -k 10 400 python3 bench/bench_step.py --cases 256x8 --paths after_all $MB64_ARGS --ranks 2 --keep-runs \
      --case-timeout 380 --out /tmp/ranks.json > "$OUT/ranks2.log" 2>&1; cp /tmp/ranks.json "$OUT/ranks.json"
    lane 0 "timeout -k 10 $((580 - SECONDS)) python3 bench/bench_update.py --cases 32x8 --variants 16,64:bf16 \
            --out $OUT/update_a.json > $OUT/update_a.log 2>&1" &
    lane 1 "timeout -k 10 $((580 - SECONDS)) python3 bench/bench_update.py --cases 32x8 --variants 64:bf16+compile,128:bf16+compile \
            --out $OUT/update_b.json > $OUT/update_b.log 2>&1" &
    wait; grep "scaling\|^\[step\]\|error" "$OUT/ranks2.log"; grep -h "^\[update\]\|error" "$OUT"/update_*.log ;;
  S4)
    mkdir -p /tmp/bnb && cp -r .bnb/. /tmp/bnb/
    lane 0 "PYTHONPATH=$PYTHONPATH:/tmp/bnb timeout -k 10 540 python3 bench/bench_quant.py --role ar --modes none,full,8bit,4bit \
            --work /tmp/quant --out $OUT/quant_ar.json > $OUT/quant_ar.log 2>&1" &
    lane 1 "timeout -k 10 540 python3 bench/bench_update.py --cases 32x8 \
            --variants 16:synced,16,64:bf16+compile+synced,64:bf16+compile --out $OUT/update_sync.json > $OUT/update_sync.log 2>&1" &
    wait; grep -h "^{\|error\|Error" "$OUT/quant_ar.log" | tail -8; grep -h "^\[update\]\|error" "$OUT/update_sync.log" ;;
  T1)
    mkdir -p /tmp/parts && cp .device-carry/vllm/p4/* /tmp/parts/ && cp -r .bnb /tmp/bnb
    lane 1 "timeout -k 10 300 python3 bench/bench_update.py --cases 32x8 --variants 64:bf16+mlpcompile,64:bf16+compile \
            --tables $OUT/update_tables --out $OUT/update.json > $OUT/update.log 2>&1" & update=$!
    vllm_install > "$OUT/install.log" 2>&1; source /tmp/vllm_env.sh; export PYTHONPATH=$PYTHONPATH:/tmp/bnb
    lane 0 "timeout -k 10 $((585 - SECONDS)) python3 bench/bench_step.py --engine vllm --cases 256x8 --paths after_all \
            $MB64_ARGS --out $OUT/step_256x8_vllm.json 2>&1 | grep -v '^INFO\|^WARNING\|^(EngineCore' > $OUT/step_vllm.log" &
    wait $update
    lane 1 "timeout -k 10 100 python3 -m pytest tests/gpu/test_vllm.py -q -p no:cacheprovider -k 'prefix or leak' 2>&1 \
              | grep -v '^INFO\|^WARNING\|^(EngineCore\|Capturing' > $OUT/vllm_prefix_tests.log
            timeout -k 10 $((580 - SECONDS)) python3 bench/bench_vllm.py --shapes 8b --configs nla,nla_cached --seqs 2048 \
              --repeats 1 --gpu-memory-utilization 0.35 --max-num-seqs 0 --out $OUT/vllm_cache.json 2>&1 \
              | grep -v '^INFO\|^WARNING\|^(EngineCore\|Capturing' > $OUT/vllm_cache.log"
    wait; grep -h "^\[update\]\|error" "$OUT/update.log"; tail -3 "$OUT/vllm_prefix_tests.log"; tail -6 "$OUT/vllm_cache.log"
    grep "^\[vllm\]\|^\[step\]\|^\[path\]\|rror" "$OUT/step_vllm.log"; tail -4 "$OUT/step_vllm.log"; pack T1 ;;
  T3)
    mkdir -p /tmp/parts && cp .device-carry/vllm/p4/* /tmp/parts/ && cp -r .bnb /tmp/bnb
    vllm_install > "$OUT/install.log" 2>&1; source /tmp/vllm_env.sh; export PYTHONPATH=$PYTHONPATH:/tmp/bnb
    lane 1 "timeout -k 10 $((585 - SECONDS)) python3 bench/bench_step.py --engine vllm --cases 256x8 --paths after_all \
            $MB64_ARGS --vllm-max-seqs 512 --out $OUT/step_256x8_vllm512.json 2>&1 \
            | grep -v '^INFO\|^WARNING\|^(EngineCore' > $OUT/step_vllm512.log" &
    lane 0 "timeout -k 10 $((580 - SECONDS)) python3 bench/bench_vllm.py --shapes 8b --configs nla,nla_cached --seqs 2048 \
            --repeats 1 --gpu-memory-utilization 0.35 --max-num-seqs 512 --out $OUT/vllm_cache.json 2>&1 \
            | grep -v '^INFO\|^WARNING\|^(EngineCore\|Capturing' > $OUT/vllm_cache.log"
    wait; tail -8 "$OUT/vllm_cache.log"
    grep "^\[vllm\]\|^\[engine\]\|^\[step\]\|^\[path\]\|rror" "$OUT/step_vllm512.log"; tail -3 "$OUT/step_vllm512.log" ;;
  T4)
    mkdir -p /tmp/parts && cp .device-carry/vllm/p4/* /tmp/parts/ && cp -r .bnb /tmp/bnb
    vllm_install > "$OUT/install.log" 2>&1; source /tmp/vllm_env.sh; export PYTHONPATH=$PYTHONPATH:/tmp/bnb
    lane 0 "timeout -k 5 $((${T4_LIMIT:-400} - SECONDS)) python3 bench/bench_step.py --engine vllm --cases 256x8 \
            --paths after_all $MB64_ARGS --out $OUT/step_256x8_vllm.json 2>&1 \
            | grep -v '^INFO\|^WARNING\|^(EngineCore' > $OUT/step_vllm.log"
    grep -h "^\[vllm\]\|^\[engine\]\|^\[step\]\|^\[path\]\|rror" "$OUT/step_vllm.log"; tail -3 "$OUT/step_vllm.log" ;;
  U1)
    mkdir -p /tmp/parts /tmp/keep && cp .device-carry/vllm/p4/* /tmp/parts/ && cp -r .bnb /tmp/bnb
    lane 1 "timeout -k 10 400 python3 bench/bench_update.py --cases 32x8 --variants \
            64:bf16+compile+norotary,64:bf16+compile,64:bf16+compile+ref256,64:bf16+compile+noref \
            --tables $OUT/update_tables --out $OUT/update.json > $OUT/update.log 2>&1" & update=$!
    vllm_install > "$OUT/install.log" 2>&1; source /tmp/vllm_env.sh
    for seqs in 512 1024; do
      lane 0 "timeout -k 10 200 python3 bench/bench_vllm.py --shapes 8b --configs nla_cached --seqs 2048 --repeats 1 \
              --gpu-memory-utilization 0.35 --max-num-seqs $seqs --out /tmp/keep/vllm$seqs.json 2>&1 \
              | grep -v '^INFO\|^WARNING\|^(EngineCore\|Capturing' > $OUT/vllm$seqs.log"
      cp /tmp/keep/vllm$seqs.json "$OUT/" 2>/dev/null
    done
    wait $update
    timeout -k 10 $((585 - SECONDS)) python3 -m pytest tests/gpu/test_vllm.py -q -s -p no:cacheprovider -k per_rank 2>&1 \
      | grep -v '^INFO\|^WARNING\|^(EngineCore\|Capturing' > "$OUT/per_rank_test.log"
    grep -h "^\[update\]\|rror" "$OUT/update.log"; tail -4 "$OUT/vllm512.log" "$OUT/vllm1024.log"; tail -5 "$OUT/per_rank_test.log"
    pack U1 ;;
  W1)
    cp -r .bnb /tmp/bnb; export PYTHONPATH=$PYTHONPATH:/tmp/bnb
    timeout -k 10 260 python3 bench/bench_update.py --cases 32x8 --variants 64:bf16+compile --profile-micro-batches 4 \
      --tables $OUT/tables --out $OUT/update.json > $OUT/update.log 2>&1
    timeout -k 10 $((570 - SECONDS)) python3 bench/bench_critic.py --inputs 512 --variants 24:compile,48:compile,64:compile \
      --out $OUT/critic.json > $OUT/critic.log 2>&1
    grep -h "^\[update\]\|^\[critic\]\|^\[idle\]\|^\[setup\]\|rror" $OUT/update.log $OUT/critic.log
    pack W1 ;;
  W2)
    cp -r .bnb /tmp/bnb; export PYTHONPATH=$PYTHONPATH:/tmp/bnb
    timeout -k 10 300 python3 bench/bench_update.py --cases 32x8 --variants 64:bf16+compile+nohead,64:bf16+compile \
      --lead --profile-micro-batches 2 --out $OUT/update.json > $OUT/update.log 2>&1
    timeout -k 10 $((570 - SECONDS)) python3 bench/bench_critic.py --inputs 512 --variants 64:compile,96:compile \
      --profile-micro-batches 0 --out $OUT/critic.json > $OUT/critic.log 2>&1
    grep -h "^\[update\]\|^\[critic\]\|^\[idle\]\|^\[lead\]\|^\[setup\]\|rror" $OUT/update.log $OUT/critic.log
    pack W2 ;;
  W3|W4)
    mkdir -p /tmp/parts && cp .device-carry/vllm/p4/* /tmp/parts/ && cp -r .bnb /tmp/bnb
    vllm_install > "$OUT/install.log" 2>&1; source /tmp/vllm_env.sh
    export PYTHONPATH=$PYTHONPATH:/tmp/bnb VLLM_LOGGING_LEVEL=WARNING
    timeout -k 10 430 python3 bench/bench_step.py --engine vllm --cases 256x8 --paths after_all --micro-batch 64 \
      --critic-micro-batch 64 --reference-micro-batch 64 --prompt-block 4 --vllm-max-seqs 1024 \
      --out $OUT/step.json > $OUT/step.log 2>&1
    grep -h "^\[vllm\]\|^\[engine\]\|^\[step\]\|^\[path\]\|rror" $OUT/step.log | grep -v "^INFO\|^WARNING"
    [ "$stage" = W4 ] && { pack W4; exit 0; }
    timeout -k 10 $((585 - SECONDS)) python3 bench/bench_update.py --cases 32x8 --variants 64:bf16+compile+pb1,64:bf16+compile \
      --lead --profile-micro-batches 0 --out $OUT/update.json > $OUT/update.log 2>&1
    grep -h "^\[update\]\|^\[lead\]\|rror" $OUT/update.log
    pack W3 ;;
  W5|W6)
    [ "$stage" = W5 ] && { mkdir -p /tmp/parts /tmp/keep && cp .device-carry/vllm/p4/* /tmp/parts/ && cp -r .bnb /tmp/bnb
                           vllm_install > "$OUT/install.log" 2>&1; }
    source /tmp/vllm_env.sh; export PYTHONPATH=$PYTHONPATH:/tmp/bnb VLLM_LOGGING_LEVEL=WARNING
    W_ARGS="--engine vllm --cases 256x8 --paths after_all --micro-batch 64 --critic-micro-batch 64 \
            --reference-micro-batch 64 --prompt-block 4 --vllm-max-seqs 1024"
    if [ "$stage" = W5 ]; then
      timeout -k 5 $((585 - SECONDS)) python3 bench/bench_step.py $W_ARGS --ranks 2 --case-timeout $((570 - SECONDS)) \
        --out /tmp/keep/ranks.json > $OUT/step_ranks2.log 2>&1
    else
      lane 1 "timeout -k 10 560 python3 bench/bench_step.py $W_ARGS --out $OUT/step_plain.json > $OUT/step_plain.log 2>&1" &
      lane 0 "timeout -k 5 575 python3 bench/bench_step.py $W_ARGS --ranks 1 --keep-runs --case-timeout 560 \
              --out /tmp/keep/ranks.json > $OUT/step_ranks1.log 2>&1"
      wait
    fi
    cp /tmp/keep/ranks.json "$OUT/" 2>/dev/null
    grep -h "^\[vllm\]\|^\[engine\]\|^\[step\]\|^\[path\]\|scaling\|rror" $OUT/step_*.log | grep -v "^INFO\|^WARNING"
    tail -n 3 $OUT/step_*.log; pack $stage ;;
  W7)
    mkdir -p /tmp/parts && cp .device-carry/vllm/p4/* /tmp/parts/ && cp -r .bnb /tmp/bnb
    vllm_install > "$OUT/install.log" 2>&1; source /tmp/vllm_env.sh
    export PYTHONPATH=$PYTHONPATH:/tmp/bnb OMP_NUM_THREADS=2 NLA_PARITY_DIR=/tmp/parity
    CUDA_VISIBLE_DEVICES=1 python3 -c "import sys; from pathlib import Path; sys.path.insert(0, 'tests'); import parity; \
      parity.demo_inputs(Path('/tmp/parity/demo'))" > "$OUT/parity_demo.log" 2>&1
    NLA_PARITY_JSON=$OUT/parity.json NLA_PARITY_SEEDS=6 NLA_PARITY_ENGINES=hf,vllm NLA_PARITY_LANES=1,1,1,1,1,1 \
      NLA_PARITY_VLLM_LANES=0,0,0 timeout -k 10 $((${W7_LIMIT:-585} - SECONDS)) python3 -m pytest tests/gpu/test_learning_parity.py \
      -q -s -p no:cacheprovider -k reaches 2>&1 | grep -v '^INFO\|^WARNING\|^(EngineCore\|Capturing' > "$OUT/parity.log"
    grep "^\[parity\]\|^|\|passed\|failed" "$OUT/parity.log" ;;
  U2|U3)
    source /tmp/vllm_env.sh; export PYTHONPATH=$PYTHONPATH:/tmp/bnb VLLM_LOGGING_LEVEL=WARNING
    seqs=$(python3 -c "import json; r={n: json.load(open(f'/tmp/keep/vllm{n}.json'))['results'][0]['timings']['2048']['rollout_s'] for n in (512, 1024)}; print(min(r, key=r.get))" 2>/dev/null || echo 512)
    ranks=1; keep=""; [ "$stage" = U3 ] && ranks=2 && keep=--keep-runs
    echo "max_num_seqs $seqs, $ranks rank(s)"
    timeout -k 10 585 python3 bench/bench_step.py --engine vllm --cases 256x8 --paths after_all $MB64_ARGS \
      --vllm-max-seqs "$seqs" --ranks $ranks $keep --case-timeout 570 --out /tmp/keep/step_vllm_ranks.json \
      > "$OUT/step_ranks$ranks.log" 2>&1
    cp /tmp/keep/step_vllm_ranks.json "$OUT/"
    grep -h "^\[vllm\]\|^\[engine\]\|^\[step\]\|^\[path\]\|scaling\|rror" "$OUT/step_ranks$ranks.log" | grep -v "^INFO\|^WARNING"
    tail -4 "$OUT/step_ranks$ranks.log" ;;
  T2)
    export PYTHONPATH=$PYTHONPATH:/tmp/bnb
    timeout -k 10 580 python3 bench/bench_step.py --cases 256x8 --paths after_all $MB64_ARGS --ranks 2 \
      --case-timeout 560 --out $OUT/step_256x8_ranks2.json > "$OUT/ranks2.log" 2>&1
    grep "scaling\|^\[step\]\|^\[path\]\|rror" "$OUT/ranks2.log"; tail -12 "$OUT/ranks2.log" ;;
  R3)
    timeout -k 10 560 python3 bench/bench_step.py --cases 256x8 --paths after_all $STEP_ARGS --ranks 2 \
      --case-timeout 540 --out $OUT/step_256x8_ranks2.json > "$OUT/ranks2.log" 2>&1; tail -30 "$OUT/ranks2.log" ;;
  part1|part2|part3)
    mkdir -p /tmp/parts && cp .device-carry/vllm/p${stage#part}/* /tmp/parts/ && ls /tmp/parts ;;
  A)
    mkdir -p /tmp/parts && cp .device-carry/vllm/p4/* /tmp/parts/
    nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpus.txt"
    lane 1 "timeout -k 10 150 python3 -m pytest tests/gpu/test_native_gpu.py -q -p no:cacheprovider > $OUT/native_gpu_test.log 2>&1;
            timeout -k 10 400 python3 bench/bench_step.py --out $OUT/step.json > $OUT/step.log 2>&1" &
    bash /tmp/parts/install.sh > "$OUT/vllm_gpu_test.log" 2>&1 && source /tmp/vllm_env.sh &&
      lane 0 "timeout -k 10 200 python3 -m pytest tests/gpu/test_vllm.py -q -x -p no:cacheprovider >> $OUT/vllm_gpu_test.log 2>&1;
              timeout -k 10 300 python3 bench/bench_vllm.py --shapes 8b --configs baseline,nla --out $OUT/vllm_8b.json > $OUT/vllm_8b.log 2>&1"
    wait ;;
  V)
    mkdir -p /tmp/parts && cp .device-carry/vllm/p4/* /tmp/parts/
    vllm_install > "$OUT/install.log" 2>&1 && source /tmp/vllm_env.sh
    timeout -k 10 540 python3 -m pytest tests/gpu/test_vllm.py -q -s -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 \
      | grep -v "^INFO\|^WARNING\|^(EngineCore\|Capturing CUDA" > "$OUT/vllm_gpu_test.log"
    tail -25 "$OUT/vllm_gpu_test.log" ;;
  B)
    source /tmp/vllm_env.sh
    lane 0 "timeout -k 10 540 python3 bench/bench_rollout.py --out $OUT/rollout.json > $OUT/rollout.log 2>&1" &
    ( export CUDA_VISIBLE_DEVICES=1
      python3 bench/make_8b_run.py /tmp/nla8b && T=200 train8b hf && T=200 train8b native ) > "$OUT/train_8b.log" 2>&1 &
    wait ;;
  C)
    source /tmp/vllm_env.sh
    CUDA_VISIBLE_DEVICES=0 T=270 train8b vllm > "$OUT/train_vllm.log" 2>&1
    timeout -k 10 300 python3 bench/bench_ddp.py --engine native --out "$OUT/ddp.json" --timeout 140 > "$OUT/ddp.log" 2>&1 ;;
esac
ls -la "$OUT"
