#!/usr/bin/env bash
# Toy NLA loss comparison on this CPU: the toy demo per seed (GRPO), then gspo/cispo/onpolicy from its SFT.
cd /work/main
source .venv/bin/activate
cp -r /work/main/nla_shell /work/main/nla_core /work/main/bench /tmp/toyloss/src/ 2>/dev/null
export PYTHONPATH=/tmp/toyloss/src
for seed in 0 1 2; do
  d=/tmp/toyloss/seed$seed
  [ -f $d/report.json ] || python -m nla_shell.cli demo --run-dir $d --seed $seed --overwrite > /tmp/toyloss/demo$seed.log 2>&1
  v() { local name=$1; shift; [ -f $d/variants/$name/report.json ] || python /tmp/toyloss/src/bench/rl_variants.py variant $d $name "$@" > /tmp/toyloss/$name$seed.log 2>&1; }
  v gspo policy_loss=gspo clip_eps=0.0003 clip_eps_high=0.0004
  v cispo policy_loss=cispo clip_eps=1.0 clip_eps_high=4.0 tis=none
  v onpolicy policy_loss=onpolicy tis=none kl_clamp=12
done
echo done > /tmp/toyloss/DONE
