#!/usr/bin/env bash
# The GPU benchmark matrix, one stage per topic of bench/RESULTS.md. Each stage fits one `device`
# call (10 minutes); the machine, and /tmp with it, is kept only between quick calls.
#
#   bash bench/gpu_session.sh STAGE          # from the repository root; logs and JSON land in $OUT
#
# Setup, once per fresh machine: stages part1, part2, part3, each run with `carry
# .device-carry/vllm/pK`, bring the vLLM bundle into /tmp/parts. A stage that needs vLLM then runs
# with `carry .device-carry/vllm/p4` and installs it (once per machine); a stage that needs
# bitsandbytes (AdamW8bit, the quantised bases) carries `.bnb` (`bash bench/prepare_bnb.sh`: bitsandbytes 0.50.2 unzipped with
# only its CUDA 13 libraries, so that it fits beside p4 in one call's 64 MiB). Stages marked x2 use
# two GPUs (`nvidia-h200-x2`), the others one (GPU0).
#
#   stage          needs           measures (RESULTS.md section)
#   install-vllm   p4              nothing: installs vLLM for the next calls (real_nla.sh's vllm-smoke)
#   vllm-tests     p4, x2          tests/gpu/test_vllm.py; PYTEST_K= selects (Rollout engines: vLLM engine GPU tests;
#                                  Multi-GPU: Per-rank vLLM engines)
#   gpu-tests      -               the native engine's GPU tests, its CUDA-graph sampler, tests/gpu/test_fp8_gpu.py
#                                  (Rollout engines: Native CUDA-graph sampler)
#   step           p4, .bnb        one GRPO step at 256 x 8, critic on, the fastest settings; STEP_ARGS= replaces
#                                  them (Step time: W3, W4; docs/performance.md)
#   fp8-step       p4, .bnb        the step with FP8 (after_all, after_all_fp8 on the same rollouts); QUANT=fp8: vLLM's
#                                  FP8 rollouts too; FP8_STEP_PATHS=, FP8_PHASES= (FP8; docs/performance.md)
#   profile        p4, .bnb        torch.profiler tables of the score and update phases, bf16 and FP8, 64 x 8
#                                  (PROFILE_CASES=, PROFILE_PATHS=) (FP8: where the update's time goes)
#   fp8-learning   p4              the toy NLA, SEEDS (0 1 2), paired RL variants from each seed's SFT: LANE_PAIRS=
#                                  trainer (fp8=), rollout (vllm_quantization=, ROLLOUT_QUANT=), critic
#                                  (critic_rollouts=best) (FP8: Learning ... (Z, AE2); The critic on ... best (AG))
#   scaling        p4, .bnb        one step per Qwen3 shape and batch, settings from memory_model.py --bench-args;
#                                  SHAPES=, CASES=, SHARED_FIT=1, SCALING_ARGS= (Step time: Scaling across Qwen3 sizes)
#   train8b        p4, x2          `nla train` at the 8B shape, 3 steps per engine (Step time: nla train at the 8B shape)
#   train8b-fast   p4, .bnb        `nla train` at 256 x 8 with the fast settings, 3 steps; TRAIN_ARGS= adds keys
#   explain8b      serve wheels    the slot decoder's CUDA test; bench_explain at the 8B shape, AR at work, continuous
#                                  server beside the corpus rate; EXPLAIN_ENCODINGS=, EXPLAIN_BASELINE=1 (Explanation throughput)
#   quant          .bnb            tests/gpu/test_quant_ar_gpu.py (Quantisation: The quantised AR; bench_quant.py,
#                                  which made the numbers, is retired, last at f40f446)
#   families       p4              tests/gpu/test_families_gpu.py, native then vLLM (Model families on the GPU)
#   parity         p4, .bnb, x2    learning parity on the toy: hf 6 seeds on GPU1, vLLM 6 in 3 lanes on GPU0
#                                  (PARITY_ENGINES=hf,native: R2's legs) (Learning parity across engines)
# Retired, last at d13c92a (their numbers stay in RESULTS.md): decode, prefix-cache, max-seqs, rollout-fp8,
# fp8-kernels, update, critic, step-ranks1, step-ranks2, ddp, and fp8-learning's pairs fast, trainer_fast and
# trainer_fastfwd.
set -uo pipefail
stage=$1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
QUIET='^INFO\|^WARNING\|^(EngineCore\|Capturing'
lane_pair() { [[ " ${LANE_PAIRS:-trainer rollout} " == *" $1 "* ]]; }  # fp8-learning: LANE_PAIRS names pair $1
pack() { tar -C "$OUT" -czf "/tmp/$1.tgz" . && rm -rf "${OUT:?}"/* && mv "/tmp/$1.tgz" "$OUT/"; }  # one file back, not > 8
need_vllm() {  # the bundle's install.sh (once per machine), then nla's vLLM plugin entry point (TP workers are spawned)
  if [ ! -f /tmp/vllm_env.sh ]; then
    mkdir -p /tmp/parts && cp .device-carry/vllm/p4/* /tmp/parts/ || return 1
    bash /tmp/parts/install.sh > "$OUT/install.log" 2>&1 || return 1
    local dist=/tmp/site/nla-0.1.0.dist-info; mkdir -p $dist
    printf 'Metadata-Version: 2.1\nName: nla\nVersion: 0.1.0\n' > $dist/METADATA
    printf '[vllm.general_plugins]\nnla_steering = nla_shell.engines.vllm_steering:register\n' > $dist/entry_points.txt
  fi
  source /tmp/vllm_env.sh; export VLLM_LOGGING_LEVEL=WARNING
}
need_bnb() {  # bitsandbytes beside the code: .bnb (unzipped) or a wheel in .whl/
  if [ -d .bnb ]; then mkdir -p /tmp/bnb && cp -r .bnb/. /tmp/bnb/
  elif ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/bnb .whl/*.whl
  fi
  export PYTHONPATH=$PYTHONPATH:/tmp/bnb
}
train8b() {  # engine, extra overrides...
  local engine=$1; shift
  timeout -k 10 "${T:-240}" python3 -m nla_shell.cli train av_ckpt=/tmp/nla8b/av ar_ckpt=/tmp/nla8b/ar \
    rl_parquet=/tmp/nla8b/data/rl.parquet save_dir=/tmp/run_$engine engine=$engine num_steps=3 \
    eval_every=0 save_every=100 logger=console,jsonl "$@" 2>&1 | grep -v "Loading weights\|Writing model"
  cp /tmp/run_$engine/metrics.jsonl "$OUT/train_$engine.jsonl" 2>/dev/null
}
# The fastest step measured (docs/performance.md); earlier rows of RESULTS.md used critic micro-batch 24,
# no prompt blocks and max_num_seqs 512 (T3: `STEP_ARGS="... --vllm-max-seqs 512"`), or --micro-batch 16.
STEP_ARGS=${STEP_ARGS:-"--engine vllm --cases 256x8 --paths after_all --micro-batch 64 --critic-micro-batch 64 \
  --reference-micro-batch 64 --prompt-block 4 --vllm-max-seqs 1024"}
step_lines() { grep -h "^\[vllm\]\|^\[engine\]\|^\[step\]\|^\[path\]\|scaling\|rror" "$@" | grep -v "^INFO\|^WARNING"; tail -n 3 "$@"; }
case $stage in
  part1|part2|part3)
    mkdir -p /tmp/parts && cp .device-carry/vllm/p${stage#part}/* /tmp/parts/ && ls /tmp/parts ;;
  install-vllm)  # p4: the install alone, for stages of other scripts on the same machine (bench/real_nla.sh)
    need_vllm && python3 -c "import vllm; print('vllm', vllm.__version__)" ;;
  vllm-tests)
    need_vllm || exit 1
    timeout -k 10 560 python3 -m pytest tests/gpu/test_vllm.py -q -s -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 \
      | grep -v "$QUIET" > "$OUT/vllm_gpu_test.log"
    tail -n 25 "$OUT/vllm_gpu_test.log" ;;
  gpu-tests)
    timeout -k 10 150 python3 -m pytest tests/gpu/test_native_gpu.py -q -p no:cacheprovider > "$OUT/native_gpu_test.log" 2>&1
    timeout -k 10 90 python3 -m pytest tests/gpu/test_learning_parity.py -q -s -p no:cacheprovider -k cuda_graph_sampler \
      > "$OUT/sampler_test.log" 2>&1
    timeout -k 10 90 python3 -m pytest tests/gpu/test_fp8_gpu.py -q -p no:cacheprovider > "$OUT/fp8_gpu_test.log" 2>&1
    tail -n 3 "$OUT/native_gpu_test.log" "$OUT/sampler_test.log" "$OUT/fp8_gpu_test.log" ;;
  step)
    need_vllm || exit 1; need_bnb
    timeout -k 10 580 python3 bench/bench_step.py $STEP_ARGS --out "$OUT/step.json" > "$OUT/step.log" 2>&1
    step_lines "$OUT/step.log"; pack step ;;
  fp8-step)
    # FP8 on top of the fastest step, on and off in one run. QUANT=none: the trainer's FP8 (score: the co-trained
    # critic's forward, reference, update) against the same settings in bf16 on the same rollouts; QUANT=fp8: vLLM's
    # online FP8 too (every push re-quantised), so the rollout phase's time and logp_diff_mean (the update's mean
    # |behaviour - trainer| log-prob) are FP8's. The device's FP8 checks run first, under their own timeouts.
    need_vllm || exit 1; need_bnb
    q=${QUANT:-none}
    if [ $q = none ]; then
      timeout -k 10 60 python3 -m pytest tests/gpu/test_fp8_gpu.py -q -p no:cacheprovider > "$OUT/fp8_gpu_test.log" 2>&1
      tail -n 2 "$OUT/fp8_gpu_test.log"; paths=after_all,after_all_fp8
    else
      timeout -k 10 120 python3 -m pytest "tests/gpu/test_vllm.py::test_fp8_engine_holds_fp8_linears_and_follows_every_push[$q]" \
        -q -s -p no:cacheprovider 2>&1 \
        | grep -v "$QUIET" > "$OUT/vllm_fp8_test.log"
      tail -n 3 "$OUT/vllm_fp8_test.log"; paths=after_all_fp8
    fi
    timeout -k 10 $((585 - SECONDS)) python3 bench/bench_step.py $STEP_ARGS --paths ${FP8_STEP_PATHS:-$paths} \
      --fp8 "${FP8_PHASES:-score,reference,update}" --vllm-quantization $q --out "$OUT/fp8_step_$q.json" \
      > "$OUT/fp8_step_$q.log" 2>&1
    echo "[fp8-step] QUANT=$q: exit $?"; step_lines "$OUT/fp8_step_$q.log"; pack fp8-step-$q ;;
  profile)
    need_vllm || exit 1; need_bnb
    timeout -k 10 575 python3 bench/bench_step.py $STEP_ARGS --cases "${PROFILE_CASES:-64x8}" \
      --paths "${PROFILE_PATHS:-after_all,after_all_fp8}" --fp8 score,reference,update --profile "$OUT/profile" \
      --out "$OUT/profile.json" > "$OUT/profile.log" 2>&1
    step_lines "$OUT/profile.log"; head -n 14 "$OUT"/profile/*update.txt; pack profile ;;
  fp8-learning)
    # Learning parity of both FP8 options on the toy NLA: per seed its demo (fp32 SFT and RL), then four RL
    # variants from its SFT, one lane per seed (fp8-lane); held-out FVE paired with the same engine in bf16.
    # LANE_PAIRS=critic: critic_rollouts=best against all, critic co-trained, native engine (no vLLM needed).
    # ROLLOUT_QUANT= the rollout pair's vLLM quantisation. (The fast-accumulation pairs, fast, trainer_fast and
    # trainer_fastfwd, are retired: runs AH and AI are in RESULTS.md; the stage is in git history at d13c92a.)
    ! lane_pair rollout || need_vllm || exit 1
    # LIMIT: the seconds this stage may take, vLLM's install included; the lanes stop 45 s before it, so the tables
    # and the log tarball are written (run AI's call reached its limit while writing them: its logs did not come back).
    place=0
    for seed in ${SEEDS:-0 1 2}; do
      timeout -k 10 $((${LIMIT:-560} - 45 - SECONDS)) bash bench/gpu_session.sh fp8-lane $seed $place & place=$((place + 1))
    done; wait
    python3 bench/rl_variants.py table /tmp/fp8toy/seed*/ --out "$OUT/trainer" --against bf16 > "$OUT/trainer.md" 2>&1
    python3 bench/rl_variants.py table /tmp/fp8toy/seed*/ --out "$OUT/rollout" --against vllm > "$OUT/rollout.md" 2>&1
    python3 bench/rl_variants.py table /tmp/fp8toy/seed*/ --out "$OUT/critic" --against bf16_critic > "$OUT/critic.md" 2>&1
    python3 bench/rl_variants.py table /tmp/fp8toy/seed*/ --out "$OUT/best" --against bf16_critic_best > "$OUT/best.md" 2>&1
    tail -n 8 "$OUT"/{trainer,rollout,critic,best}.md; tail -n 3 /tmp/fp8toy/*.log | grep -i "rror"
    # Logs and reports only (run AE2's tarball with the checkpoints, 70 MB, was over what comes back).
    tar -czf "$OUT/lane_logs.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' --exclude='*.parquet' \
      --exclude='*.npy' --exclude='*.png' -C /tmp fp8toy ;;
  fp8-lane)  # one seed of fp8-learning (run by it, under its timeout)
    [ ! -f /tmp/vllm_env.sh ] || source /tmp/vllm_env.sh; export VLLM_LOGGING_LEVEL=WARNING
    d=/tmp/fp8toy/seed$2; mkdir -p /tmp/fp8toy
    [ -f $d/report.json ] || python3 -m nla_shell.cli demo --run-dir $d --seed $2 --device cuda > $d.log 2>&1 || exit 1
    variant() { local name=$1; shift; [ -f $d/variants/$name/report.json ] ||
      python3 bench/rl_variants.py variant $d $name "$@" > $d.$name.log 2>&1; }
    # LANE_PAIRS: which pairs each lane runs (trainer: bf16 and bf16_fp8; rollout: vllm and vllm_fp8;
    # critic: bf16_critic and bf16_critic_best, the critic co-trained on every rollout or each group's best).
    if lane_pair critic; then
      variant bf16_critic dtype=bfloat16 engine=native train_critic=true
      variant bf16_critic_best dtype=bfloat16 engine=native train_critic=true critic_rollouts=best
    fi
    if lane_pair trainer; then
      variant bf16 dtype=bfloat16 engine=native
      variant bf16_fp8 dtype=bfloat16 engine=native fp8=score,reference,update
    fi
    lane_pair rollout || exit 0
    # The lanes reach their vLLM variants together: starting three engines at once lost seed 1's vllm_fp8 in
    # run Z ("No available memory for the cache blocks" at vllm_gpu_mem 0.05), so each lane waits its turn
    # (its place in SEEDS, not its seed).
    sleep $((${STAGGER:-15} * ${3:-$2}))
    # A fixed KV cache (vllm_kv_cache_gib) skips vLLM's start-up memory profiling, which another lane's memory
    # changes break ("Error in memory profiling", run AE); 1 GiB holds the toy's batch many times over.
    # ROLLOUT_QUANT: the FP8 variant's vllm_quantization (fp8, fp8_per_channel, fp8_per_block), named vllm_$ROLLOUT_QUANT.
    q=${ROLLOUT_QUANT:-fp8}
    variant vllm engine=vllm vllm_gpu_mem=0.05 vllm_kv_cache_gib=1
    variant vllm_$q engine=vllm vllm_gpu_mem=0.05 vllm_kv_cache_gib=1 vllm_quantization=$q ;;
  scaling)
    need_vllm || exit 1; need_bnb
    for shape in ${SHAPES:-0.6b 1.7b 4b 8b 14b}; do
      # Cases whose settings memory_model gives alike share one process: a case's setup (the models, vLLM's
      # start) took 74-76 s at 0.6B in run Z, before its compiled warm-up step.
      declare -A together=(); order=()
      # SHARED_FIT=1: the first case's fit (list the largest first) serves all, so they share one process.
      first=${CASES:-256x8}; first=${first%% *}
      for case in ${CASES:-256x8 64x8}; do
        fit=$(python3 bench/memory_model.py --shapes $shape --cases $([ -n "${SHARED_FIT:-}" ] && echo $first || echo $case) --bench-args)
        [ -n "${together[$fit]+x}" ] && together[$fit]+=",$case" || { together[$fit]=$case; order+=("$fit"); }
      done
      for fit in "${order[@]}"; do
        cases=${together[$fit]}; name=scaling_${shape}_${cases//,/_}
        left=$((585 - SECONDS))  # the call's 10 minutes; cases that cannot finish in time are left for the next call
        [ $left -gt 200 ] || { echo "[scaling] no time left for $shape $cases"; continue; }
        # Its own process under a timeout: an OOM or a hang ends these cases only; the JSON keeps the error.
        timeout -k 10 $(( left < ${CASE_T:-400} ? left : ${CASE_T:-400} )) python3 bench/bench_step.py --shape $shape \
          --cases $cases $fit ${SCALING_ARGS:---engine vllm --paths after_all --prompt-block 4} \
          --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
        echo "[scaling] $shape $cases: exit $? ($fit)"; step_lines "$OUT/$name.log" | tail -n 4
      done
      unset together
    done
    python3 bench/scaling_table.py "$OUT"/scaling_*.json | tee "$OUT/scaling_table.md"; pack scaling ;;
  train8b)
    need_vllm || exit 1
    python3 bench/make_8b_run.py /tmp/nla8b > "$OUT/make_8b.log" 2>&1
    ( export CUDA_VISIBLE_DEVICES=1; T=200 train8b hf && T=200 train8b native ) > "$OUT/train_8b.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=0 T=270 train8b vllm > "$OUT/train_vllm.log" 2>&1
    wait; tail -n 4 "$OUT/train_8b.log" "$OUT/train_vllm.log" ;;
  train8b-fast)
    # One GPU: `nla train` itself at the 8B shape, 256 prompts x 8, the fast settings of docs/performance.md
    # (TRAIN_ARGS= adds keys, e.g. vllm_quantization=fp8), 3 steps; its per-step phase times in train_vllm.jsonl.
    need_vllm || exit 1; need_bnb
    [ -f /tmp/nla8b/data/rl.parquet ] || python3 bench/make_8b_run.py /tmp/nla8b --rows 1024 > "$OUT/make_8b.log" 2>&1
    T=$((${LIMIT:-585} - SECONDS)) train8b vllm batch_prompts=256 group_size=8 train_critic=true vllm_sleep=2 \
      logp_micro_batch=64 ref_micro_batch=64 critic_micro_batch=64 logp_prompt_block=4 vllm_max_seqs=1024 \
      compile_blocks=true bf16_autocast=true dtype=bfloat16 fp8=score,reference,update,backward ${TRAIN_ARGS:-} \
      > "$OUT/train_fast.log" 2>&1
    grep -v "^INFO\|^WARNING\|^(EngineCore" "$OUT/train_fast.log" | tail -n 30; pack train8b-fast ;;
  explain8b)
    # One GPU, no carry: the slot decoder's CUDA-graph test, then bench_explain at the 8B shape with the AR at work
    # (--close-explanations) and the server's continuous batching beside the corpus rate, once per body encoding of
    # EXPLAIN_ENCODINGS (default json; e.g. "base64 json"), EXPLAIN_REPEATS rounds (default 3) of corpus and server
    # legs; EXPLAIN_BASELINE=1 adds the server without it (JSON).
    # The server's libraries travel as wheels (carry .device-carry/serve: fastapi, uvicorn, pydantic, opentelemetry-api
    # and their needs, for the image's Python 3.12; 3.5 MB), fetched here by
    #   python3 -m pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
    #     --implementation cp -d .device-carry/serve fastapi==0.165.0 uvicorn==0.55.0 opentelemetry-api==1.45.2
    if ls .device-carry/serve/*.whl > /dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/serve .device-carry/serve/*.whl
      export PYTHONPATH=/tmp/serve:$PYTHONPATH
    fi
    timeout -k 10 150 python3 -m pytest tests/gpu/test_native_stream_gpu.py -q -p no:cacheprovider \
      > "$OUT/stream_gpu_test.log" 2>&1; tail -n 3 "$OUT/stream_gpu_test.log"
    [ -f /tmp/nla8b/data/rl.parquet ] || python3 bench/make_8b_run.py /tmp/nla8b > "$OUT/make_8b.log" 2>&1
    explain() { timeout -k 10 420 python3 bench/bench_explain.py --run /tmp/nla8b --label qwen3-8b-random-closed \
      --engines native --server-engine native --close-explanations --sites 1024 --batch 256 --clients 16,32 \
      --repeats "${EXPLAIN_REPEATS:-3}" "$@"; }
    for encoding in ${EXPLAIN_ENCODINGS:-json}; do
      explain --continuous --server-encoding "$encoding" --out "$OUT/explain_8b_native_closed_continuous_$encoding.json" \
        > "$OUT/explain_continuous_$encoding.log" 2>&1
    done
    [ -z "${EXPLAIN_BASELINE:-}" ] || explain --out "$OUT/explain_8b_native_closed.json" > "$OUT/explain.log" 2>&1
    tail -n 8 "$OUT"/explain*.log ;;
  quant)
    need_bnb
    timeout -k 10 120 python3 -m pytest tests/gpu/test_quant_ar_gpu.py -q -p no:cacheprovider > "$OUT/quant_ar_gpu.log" 2>&1
    tail -n 3 "$OUT/quant_ar_gpu.log" ;;
  families)
    timeout -k 10 90 python3 -m pytest tests/gpu/test_families_gpu.py -q -p no:cacheprovider -k native > "$OUT/families_native.log" 2>&1
    need_vllm || exit 1
    timeout -k 10 $((580 - SECONDS)) python3 -m pytest tests/gpu/test_families_gpu.py -q -s -p no:cacheprovider -k vllm 2>&1 \
      | grep -v "$QUIET" > "$OUT/families_vllm.log"
    tail -n 3 "$OUT/families_native.log"; grep -E "mean\|dlogp|passed|failed" "$OUT/families_vllm.log" ;;
  parity)
    need_vllm || exit 1; need_bnb
    # The test's own fixture builds the toy's SFT checkpoints in NLA_PARITY_DIR/demo (nothing here imports tests/).
    export OMP_NUM_THREADS=2 NLA_PARITY_DIR=/tmp/parity
    NLA_PARITY_JSON=$OUT/parity.json NLA_PARITY_SEEDS=6 NLA_PARITY_ENGINES=${PARITY_ENGINES:-hf,vllm} \
      NLA_PARITY_LANES=1,1,1,1,1,1 NLA_PARITY_VLLM_LANES=0,0,0 timeout -k 10 $((${PARITY_LIMIT:-585} - SECONDS)) \
      python3 -m pytest tests/gpu/test_learning_parity.py -q -s -p no:cacheprovider -k reaches 2>&1 | grep -v "$QUIET" > "$OUT/parity.log"
    grep "^\[parity\]\|^|\|passed\|failed" "$OUT/parity.log" ;;
  *)
    echo "unknown stage '$stage'; see the table at the top of $0" >&2; exit 2 ;;
esac
ls -la "$OUT"
