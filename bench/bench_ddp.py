"""Data-parallel scaling of one GRPO step at the Qwen3-8B shape: 1 rank against N, same global batch.

One invocation launches every configuration in --ranks (default 1,2) as its own torchrun job
(`--standalone`, so no port is chosen by hand) with a timeout; a failing or hung case is
recorded and the next one still runs. NVLink multicast stays off (NCCL_NVLS_ENABLE=0).

Each rank builds what `nla train` builds on its GPU, with random weights (bench/synthetic.py:
built on the meta device, materialised on the GPU): the actor (bf16 Qwen3-8B geometry + the
trainer's LoRA, r=--lora-r on q, k, v, o, non-zero B), the injection hook, its own rollout
engine, and an AR (the same geometry truncated to --ar-layers, float32 value head). Then it
times the trainer's phases on its share of the global batch, every rank in lockstep:

  rollout   engine.generate (steered prefill, temperature 1), --new-tokens per sample
  score     ar_predict on each sample's first --explanation-tokens generated tokens (a random
            model writes no explanation tags, so the generated ids stand in for the AR input)
            -> reconstruction_mse -> reward -> group_advantages
  update    nla_shell.training.update.policy_update: micro-batched forward + reference forward +
            grpo_loss + backward with the global denominator, the gradient all-reduce
            (reported alone as `allreduce`), clip, optimizer step (the trainer's choice:
            bitsandbytes AdamW8bit when installed, else torch AdamW)

Per case: seconds per step and per phase (the maximum over ranks, median over --steps timed
steps after one warm-up step), all-reduce seconds and bus bandwidth, peak memory. Summary:
speed-up = s/step(1 rank) / s/step(N ranks), scaling efficiency = speed-up / N. Random
weights practically never draw EOS, so every rollout runs the full --new-tokens: the work
per step is fixed.

    NCCL_NVLS_ENABLE=0 python bench/bench_ddp.py --out bench/ddp_h200x2.json     # 2 GPUs, ~4 min
    .venv/bin/python bench/bench_ddp.py --tiny --out /tmp/ddp.json                # CPU smoke run (gloo)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402

import synthetic as syn  # noqa: E402

PHASES = ("rollout", "score", "update", "allreduce", "step")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/ddp.json", help="JSON, rewritten after every case")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, float32, gloo")
    parser.add_argument("--ranks", default="1,2", help="world sizes to run, one torchrun job each")
    parser.add_argument("--engine", choices=("hf", "native"), default="hf", help="each rank's rollout engine")
    parser.add_argument("--prompts", type=int, default=None, help="global batch_prompts (default 16; tiny 4)")
    parser.add_argument("--group", type=int, default=None, help="samples per prompt G (default 8; tiny 2)")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 96 (tiny 24)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 160 (tiny 8)")
    parser.add_argument("--explanation-tokens", type=int, default=64, help="AR input length per sample")
    parser.add_argument("--ar-layers", type=int, default=None, help="AR depth (default 24; tiny 2)")
    parser.add_argument("--lora-r", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8, help="logp_micro_batch of the update")
    parser.add_argument("--critic-micro-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--timeout", type=int, default=420, help="seconds per case before it is stopped")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a rank: where rank 0 writes its part
    args = parser.parse_args(argv)
    tiny = args.tiny
    for key, big, small in (("prompts", 16, 4), ("group", 8, 2), ("prompt_len", 96, 24), ("new_tokens", 160, 8),
                            ("ar_layers", 24, 2)):
        if getattr(args, key) is None:
            setattr(args, key, small if tiny else big)
    return args


# --------------------------------------------------------------------------- one rank


def worker(args: argparse.Namespace) -> None:
    """One rank of one case: build the models, run 1 + --steps steps, rank 0 writes the part."""
    import nla_core
    from nla_shell.training import distributed
    from nla_shell.models import ARModel, ar_predict, trainable_parameters
    from nla_shell.training.runtime import make_optimizer
    from nla_shell.training.update import LossOptions, policy_update

    rank = distributed.rank_info()
    device = torch.device("cpu") if args.tiny else torch.device("cuda", rank.local_rank)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.tiny:
        torch.set_num_threads(1)
    distributed.check_divisible("prompts", args.prompts, rank.world_size)
    with distributed.process_group(rank, device):
        tokenizer, tokens = syn.toy_tokenizer()
        shape = syn.TINY if args.tiny else syn.QWEN3_8B
        config = syn.qwen3_config(shape, vocab_size=len(tokenizer))
        actor = syn.attach_lora(syn.random_qwen3(config, device=device, dtype=dtype), r=args.lora_r, alpha=16)
        distributed.broadcast_parameters(trainable_parameters(actor))
        injector = syn.make_injector(actor, tokens)
        ar_config = syn.qwen3_config(shape, vocab_size=len(tokenizer), num_layers=args.ar_layers)
        d_model = config.hidden_size
        head = torch.nn.Linear(d_model, d_model, bias=False, dtype=torch.float32)
        torch.nn.init.eye_(head.weight)
        critic = ARModel(syn.random_qwen3(ar_config, device=device, dtype=dtype, seed=1), head,
                         mse_scale=math.sqrt(d_model)).to(device)
        engine = make_engine(args.engine, actor, injector, tokenizer)
        optimizer = make_optimizer(trainable_parameters(actor), 1e-6, device=device, label="actor")
        requests = syn.make_requests(args.prompts, args.prompt_len, d_model, tokens, vocab=config.vocab_size)
        mine = distributed.shard(requests, rank)
        pad_id = tokenizer.pad_token_id

        def step() -> dict[str, float]:
            seconds: dict[str, float] = {}
            seconds["rollout"], rollouts = syn.timed(
                lambda: engine.generate(mine, group_size=args.group, max_new_tokens=args.new_tokens), device
            )

            def score():
                golds = torch.stack([mine[r.prompt_index].activation for r in rollouts])
                ar_inputs = [r.full_ids[r.prompt_len :][: args.explanation_tokens].tolist() for r in rollouts]
                pred = ar_predict(critic, ar_inputs, pad_id=pad_id, micro_batch=args.critic_micro_batch, device=device)
                mse = nla_core.reconstruction_mse(pred.cpu(), golds, scale=critic.mse_scale)
                reward = nla_core.reward_from_mse(mse)
                group_ids = torch.tensor([r.prompt_index for r in rollouts])
                return golds, nla_core.group_advantages(reward.float(), group_ids)

            seconds["score"], (golds, advantages) = syn.timed(score, device)
            actor.train()
            seconds["update"], stats = syn.timed(
                lambda: policy_update(actor, injector, optimizer, rollouts, advantages, golds, loss=LossOptions(),
                                      micro_batch=args.micro_batch, max_grad_norm=1.0, pad_id=pad_id),
                device,
            )
            seconds["allreduce"] = stats.time_allreduce
            seconds["step"] = seconds["rollout"] + seconds["score"] + seconds["update"]
            # The slowest rank sets the pace of a lockstep job.
            return dict(zip(PHASES, distributed.all_reduce_max([seconds[p] for p in PHASES])))

        syn.reset_peak(device)
        warmup = step()
        timed_steps = [step() for _ in range(args.steps)]
        (peak,) = distributed.all_reduce_max([syn.peak_gib(device) if device.type == "cuda" else 0.0])
        grad_bytes = sum(p.numel() * p.element_size() for p in trainable_parameters(actor))
        if rank.is_main:
            median = {p: statistics.median(s[p] for s in timed_steps) for p in PHASES}
            n = rank.world_size
            part = {
                "world_size": n,
                "engine": args.engine,
                "samples_per_rank": len(mine) * args.group,
                "median_s": median,
                "steps_per_s": 1.0 / median["step"],
                "steps": timed_steps,
                "warmup": warmup,
                "lora_grad_gib": grad_bytes / 2**30,
                # Ring all-reduce moves 2 (n - 1) / n of the buffer through each rank's link.
                "allreduce_bus_gbps": (2 * (n - 1) / n * grad_bytes / median["allreduce"] / 1e9
                                       if n > 1 and median["allreduce"] > 0 else None),
                "peak_gib": peak if device.type == "cuda" else None,
                **syn.environment(device),
            }
            Path(args.worker).write_text(json.dumps(part, indent=2, default=str))
        engine.close()


def make_engine(name: str, actor, injector, tokenizer):
    """The rollout engine `nla train engine=<name>` would build around the actor."""
    if name == "native":
        from nla_shell.engines.native import NativeRolloutEngine

        return NativeRolloutEngine(actor, injector, tokenizer)
    from nla_shell.engines.hf import HFRolloutEngine

    return HFRolloutEngine(actor, injector, tokenizer)


# --------------------------------------------------------------------------- the cases


def run_case(script: str | Path, world_size: int, argv: list[str], *, timeout: int) -> dict:
    """One torchrun job of `world_size` ranks, each running `script argv --worker PART`: the JSON
    its rank 0 wrote to PART, or {"error": ...} (bench_step.py --nproc runs its ranks here too)."""
    with tempfile.TemporaryDirectory() as tmp:
        part = Path(tmp) / "part.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}",
                   str(script), *argv, "--worker", str(part)]
        env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}  # NVLink multicast off on the lent machines
        print(f"[case] {world_size} rank(s): {' '.join(command[1:])}", flush=True)
        start = time.perf_counter()
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # torchrun stops its ranks on SIGTERM
            try:
                out, _ = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            return {"world_size": world_size, "error": f"timed out after {timeout}s", "log_tail": out[-4000:]}
        print(out[-3000:], flush=True)
        if proc.returncode != 0 or not part.exists():
            return {"world_size": world_size, "error": f"exit status {proc.returncode}", "log_tail": out[-4000:]}
        result = json.loads(part.read_text())
        result["wall_s"] = time.perf_counter() - start
        return result


def summarise(cases: list[dict]) -> dict:
    """Speed-up and scaling efficiency of every case against the 1-rank case."""
    base = next((c for c in cases if c.get("world_size") == 1 and "error" not in c), None)
    summary = {}
    for case in cases:
        if base is None or "error" in case or case is base:
            continue
        n = case["world_size"]
        speedup = base["median_s"]["step"] / case["median_s"]["step"]
        summary[f"{n}_ranks"] = {
            "speedup": speedup,
            "efficiency": speedup / n,
            "phase_speedup": {p: base["median_s"][p] / case["median_s"][p]
                              for p in ("rollout", "score", "update") if case["median_s"][p] > 0},
            "allreduce_share_of_step": case["median_s"]["allreduce"] / case["median_s"]["step"],
        }
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    settings = {k: v for k, v in vars(args).items() if k != "worker"}
    record = {"settings": settings, "cases": [], "summary": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for world_size in [int(n) for n in args.ranks.split(",")]:
        try:
            case = run_case(__file__, world_size, argv, timeout=args.timeout)
        except Exception:  # noqa: BLE001 - recorded, and the next case still runs
            case = {"world_size": world_size, "error": traceback.format_exc()}
        if "error" in case:
            print(f"[error] {world_size} rank(s): {case['error']}", flush=True)
        record["cases"].append(case)
        record["summary"] = summarise(record["cases"])
        out.write_text(json.dumps(record, indent=2, default=str))
    for case in record["cases"]:
        if "error" not in case:
            m = case["median_s"]
            print(f"{case['world_size']} rank(s): {m['step']:.3f} s/step (rollout {m['rollout']:.3f}, score "
                  f"{m['score']:.3f}, update {m['update']:.3f} of which all-reduce {m['allreduce']:.3f})", flush=True)
    for name, s in record["summary"].items():
        print(f"{name}: speed-up {s['speedup']:.2f}x, efficiency {s['efficiency']:.0%}", flush=True)
    print(f"[written] {out}", flush=True)
    return 0 if all("error" not in c for c in record["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
