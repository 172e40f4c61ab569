"""One full GRPO step at the Qwen3-8B shape: seconds and peak memory per phase.

The trainer's own functions on random bf16 weights: the actor (PEFT LoRA r128 on q, k, v, o,
rsLoRA alpha 16, with the injection hook), rollouts from the chosen engine, scoring by an AR
truncated after layer 24 (25 blocks, identity value head), group advantages,
`policy_update` (policy + reference forward, reference GRPO loss), and `critic_step`
when the critic is co-trained. Hyper-parameters are TrainConfig's defaults (the
reference's), except the shapes and micro-batches swept here.

A random model writes no <explanation> tags, so each rollout's explanation is stood in by
text of as many tokens as it generated (its ids folded into the toy vocabulary): the AR
then reads inputs of realistic length. Prompts: random tokens with one marker.

Order: every critic-off step runs before the first critic step, so critic-off peaks do not
include the critic's optimizer state. Each shape and critic mode is warmed up untimed first
(its rollout graphs; a one-prompt step for every phase's first-use costs). Each shape runs
at the reference's micro-batch (2) and at 8, which the lean log-prob path leaves room for.
Then the lean log-prob path of the update
(`models.response_logprobs`: fused lm_head + log-prob, no [T, V] logits) against a plain
full-logits float32 `log_softmax`, forward + backward over the largest shape's rollouts,
per micro-batch: seconds and peak memory.

    python bench/bench_step.py --out bench/step_h200.json                  # H200, ~4 min
    python bench/bench_step.py --cases 256x8 --critic on --micro-batches 8 \
        --lean-micro-batches '' --out bench/step_256x8.json                 # EasyNLA's default, ~4 min
    .venv/bin/python bench/bench_step.py --tiny --out /tmp/step.json         # CPU smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402

import synthetic as syn  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/step.json", help="JSON written after every case")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny models, float32, short rollouts")
    parser.add_argument("--cases", default=None, help="prompts x samples per step (default 8x4,32x8; tiny 2x2,4x2)")
    parser.add_argument("--critic", default="off,on", help="critic co-training modes to run: off,on")
    parser.add_argument("--micro-batches", default=None,
                        help="logp_micro_batch values of the update (default: TrainConfig's 2, and 8; tiny 2)")
    parser.add_argument("--lean-micro-batches", default=None, help="micro-batches of the log-prob path comparison "
                        "(default 2,8,16; tiny 2,4; '' skips it)")
    parser.add_argument("--engine", default="native", choices=["native", "hf"])
    parser.add_argument("--merge-lora", action="store_true", help="native engine: LoRA merged for the rollout")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 96 (tiny 24)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default TrainConfig's 160 (tiny 8)")
    args = parser.parse_args()
    tiny = args.tiny
    args.cases = [tuple(int(x) for x in c.split("x")) for c in (args.cases or ("2x2,4x2" if tiny else "8x4,32x8")).split(",")]
    args.critic = [mode == "on" for mode in args.critic.split(",")]
    lean = args.lean_micro_batches if args.lean_micro_batches is not None else ("2,4" if tiny else "2,8,16")
    args.lean_micro_batches = [int(m) for m in lean.split(",") if m]
    args.prompt_len = args.prompt_len or (24 if tiny else 96)
    return args


class Context:
    """The models, optimisers and engine of one benchmark run, built as the trainer builds them."""

    def __init__(self, args, device: torch.device, dtype: torch.dtype, defaults: dict) -> None:
        from nla_core import resolve_target_scale
        from nla_shell.engines.hf import HFRolloutEngine
        from nla_shell.engines.native import NativeRolloutEngine
        from nla_shell.models import ARModel, trainable_parameters
        from nla_shell.training.train import make_optimizer

        self.device, self.defaults = device, defaults
        self.tokenizer, tokens = syn.toy_tokenizer()
        shape = syn.TINY if args.tiny else syn.QWEN3_8B
        self.config = syn.qwen3_config(shape, vocab_size=len(self.tokenizer))
        self.tokens = tokens
        base = syn.random_qwen3(self.config, device=device, dtype=dtype, seed=0)
        self.actor = syn.attach_lora(base, r=defaults["lora_r"], alpha=defaults["lora_alpha"],
                                     use_rslora=defaults["use_rslora"])
        self.injector = syn.make_injector(self.actor, tokens)
        extraction_layer = 1 if args.tiny else 24
        critic_lm = syn.random_qwen3(syn.qwen3_config(shape, vocab_size=len(self.tokenizer),
                                                      num_layers=extraction_layer + 1), device=device, dtype=dtype, seed=1)
        d = self.config.hidden_size
        head = torch.nn.Linear(d, d, bias=False, dtype=torch.float32, device=device)
        torch.nn.init.eye_(head.weight)
        self.critic = ARModel(critic_lm, head, mse_scale=resolve_target_scale("sqrt_d_model", d))
        self.critic.eval()  # Qwen3 has no dropout: eval mode serves the gradient steps too (as train.py)
        self.optimizer = make_optimizer(trainable_parameters(self.actor), defaults["lr"], device=device, label="actor")
        self.make_critic_optimizer = lambda: make_optimizer(
            trainable_parameters(self.critic), defaults["critic_lr"], device=device, label="critic")
        self.critic_optimizer = None
        if args.engine == "native":
            self.engine = NativeRolloutEngine(self.actor, self.injector, self.tokenizer, merge_lora=args.merge_lora)
        else:
            self.engine = HFRolloutEngine(self.actor, self.injector, self.tokenizer)

    def stand_in_explanation(self, rollout) -> str:
        """Text of as many tokens as the rollout generated, in the toy vocabulary (ids 3 ..)."""
        vocab = len(self.tokenizer)
        gen = rollout.full_ids[rollout.prompt_len :]
        return self.tokenizer.decode((3 + gen % (vocab - 3)).tolist())


def grpo_step(ctx: Context, requests, group: int, new_tokens: int, *, critic_on: bool, micro_batch: int):
    """One step as train.py runs it. Returns ({phase: {"s", "peak_gib"}}, rollouts, extra)."""
    import nla_core
    from nla_shell.training.scoring import critic_step, score_explanations
    from nla_shell.training.update import LossOptions, policy_update

    d, device, pad = ctx.defaults, ctx.device, ctx.tokenizer.pad_token_id
    phases: dict[str, dict[str, float]] = {}

    def phase(name, fn):
        syn.reset_peak(device)
        seconds, out = syn.timed(fn, device)
        phases[name] = {"s": seconds, "peak_gib": syn.peak_gib(device)}
        return out

    rollouts = phase("rollout", lambda: ctx.engine.generate(requests, group_size=group, max_new_tokens=new_tokens))
    golds = torch.stack([requests[r.prompt_index].activation for r in rollouts])

    def score():
        extracted = [nla_core.extract_explanation(r.text) for r in rollouts]
        explanations = [e if e else ctx.stand_in_explanation(r) for e, r in zip(extracted, rollouts)]
        scores = score_explanations(ctx.critic, ctx.tokenizer, explanations, golds, template="Text: {explanation}",
                                    mse_scale=ctx.critic.mse_scale, reward_kind=d["reward"],
                                    max_tokens=d["max_explanation_tokens"], micro_batch=d["critic_micro_batch"])
        groups = torch.tensor([r.prompt_index for r in rollouts])
        return scores, nla_core.group_advantages(scores.reward, groups, scale=d["advantage_scale"])

    scores, advantages = phase("score", score)
    ctx.actor.train()
    update = phase("update", lambda: policy_update(
        ctx.actor, ctx.injector, ctx.optimizer, rollouts, advantages, golds, loss=LossOptions(),
        micro_batch=micro_batch, max_grad_norm=d["max_grad_norm"], pad_id=pad))
    if critic_on:
        kept = [i for i, ids in enumerate(scores.ar_inputs) if ids is not None]
        phase("critic", lambda: critic_step(
            ctx.critic, ctx.critic_optimizer, [scores.ar_inputs[i] for i in kept], golds[kept], pad_id=pad,
            micro_batch=d["critic_micro_batch"], max_grad_norm=d["max_grad_norm"]))
    extra = {
        "generated_tokens": sum(r.full_ids.numel() - r.prompt_len for r in rollouts),
        "ar_input_tokens_mean": sum(len(ids) for ids in scores.ar_inputs if ids) / max(1, int(scores.valid.sum())),
        "logp_diff_mean": update.logp_diff_mean, "logp_diff_max": update.logp_diff_max,
        "engine_stats": dict(getattr(ctx.engine, "last_stats", {})),
    }
    return phases, rollouts, extra


def logprob_paths(ctx: Context, requests, rollouts, micro_batches: list[int], record: syn.Record) -> None:
    """Forward + backward of the update's log-probs: lean (fused, chunked) vs plain full logits."""
    from nla_shell.models import inner_lm, response_logprobs
    from nla_shell.training.update import response_batch

    device, pad = ctx.device, ctx.tokenizer.pad_token_id
    lm = inner_lm(ctx.actor)

    def plain(batch):
        logits = lm(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # [n, S, V]
        logp_all = torch.log_softmax(logits.float(), dim=-1)
        rows = torch.arange(batch.input_ids.shape[0], device=device)[:, None]
        return logp_all[rows, batch.positions].gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)

    def lean(batch):
        return response_logprobs(ctx.actor, batch.input_ids, batch.attention_mask, batch.positions, batch.targets)

    ctx.actor.train()
    for micro in micro_batches:
        chunk = rollouts[:micro]
        if len(chunk) < micro:
            continue
        batch = response_batch(chunk, pad_id=pad, device=device)
        vectors = torch.stack([requests[r.prompt_index].activation for r in chunk]).to(device)
        for name, path in (("lean", lean), ("plain", plain)):
            label = f"logprob path {name}, micro-batch {micro}"

            def run():
                with ctx.injector.inject(batch.input_ids, vectors):
                    logp = path(batch)
                (logp * batch.mask).sum().backward()
                return logp.detach()

            try:
                run()  # warm-up
                ctx.optimizer.zero_grad(set_to_none=True)
                syn.free_memory(device)
                resident = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else math.nan
                syn.reset_peak(device)
                seconds, logp = syn.timed(run, device)
                ctx.optimizer.zero_grad(set_to_none=True)
                case = {"case": "logprob_path", "path": name, "micro_batch": micro,
                        "tokens": int(batch.input_ids.numel()), "s": seconds, "peak_gib": syn.peak_gib(device),
                        "resident_gib": resident}
                record.add(case)
                print(f"[{label}] {seconds:.3f}s, peak {case['peak_gib']:.1f} GiB (resident {resident:.1f})", flush=True)
            except Exception as err:  # noqa: BLE001 - an OOM here is a result: report, free, go on
                record.error(label, err)
                ctx.optimizer.zero_grad(set_to_none=True)
                syn.free_memory(device)


def main() -> None:
    from nla_shell.io.config import TrainConfig

    args = parse_args()
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    new_tokens = args.new_tokens or (8 if args.tiny else defaults["max_new_tokens"])
    default_micro = f"{defaults['logp_micro_batch']}" + ("" if args.tiny else ",8")
    micro_batches = [int(m) for m in (args.micro_batches or default_micro).split(",")]
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    settings = {**vars(args), "new_tokens": new_tokens, "micro_batches": micro_batches,
                "defaults": {k: v for k, v in defaults.items() if isinstance(v, (int, float, str, bool, type(None)))}}
    record = syn.Record(args.out, {**syn.environment(device), "settings": settings})

    t0 = time.perf_counter()
    ctx = Context(args, device, dtype, defaults)
    record.data["setup_s"] = time.perf_counter() - t0
    record.save()
    print(f"[setup] actor + critic + engine on {device} in {record.data['setup_s']:.1f}s", flush=True)

    largest: tuple | None = None
    requests_by_case = {
        (b, g): syn.make_requests(b, args.prompt_len, ctx.config.hidden_size, ctx.tokens,
                                  vocab=min(ctx.config.vocab_size, len(ctx.tokenizer)), seed=b * g)
        for b, g in args.cases
    }
    warmed: set[tuple[int, int, bool]] = set()
    for critic_on in sorted(set(args.critic)):  # False first: critic-off peaks exclude the critic's Adam state
        ctx.critic.requires_grad_(critic_on)
        if critic_on and ctx.critic_optimizer is None:
            ctx.critic_optimizer = ctx.make_critic_optimizer()
        for (prompts, group), requests in requests_by_case.items():
            for micro in micro_batches:
                label = f"{prompts}x{group} critic {'on' if critic_on else 'off'} micro-batch {micro}"
                syn.free_memory(device)
                try:
                    if (prompts, group, critic_on) not in warmed:
                        # This shape's graphs, then every phase's first-use costs on one prompt's group.
                        print(f"[warm-up] {label}", flush=True)
                        ctx.engine.generate(requests, group_size=group, max_new_tokens=new_tokens)
                        grpo_step(ctx, requests[:1], group, new_tokens, critic_on=critic_on, micro_batch=micro)
                        warmed.add((prompts, group, critic_on))
                    phases, rollouts, extra = grpo_step(ctx, requests, group, new_tokens,
                                                        critic_on=critic_on, micro_batch=micro)
                except Exception as err:  # noqa: BLE001 - report, free, go on
                    record.error(label, err)
                    continue
                case = {"case": "step", "prompts": prompts, "group": group, "critic": critic_on,
                        "micro_batch": micro, "phases": phases, "step_s": sum(p["s"] for p in phases.values()),
                        "peak_gib": max(p["peak_gib"] for p in phases.values()), **extra}
                record.add(case)
                print(f"[step] {label}: {case['step_s']:.2f}s, peak {case['peak_gib']:.1f} GiB, "
                      + ", ".join(f"{k} {v['s']:.2f}s" for k, v in phases.items()), flush=True)
                if not critic_on and (largest is None or prompts * group > largest[0] * largest[1]):
                    largest = (prompts, group, rollouts)
        if not critic_on and largest is not None and args.lean_micro_batches:
            logprob_paths(ctx, requests_by_case[largest[:2]], largest[2], args.lean_micro_batches, record)
    table = summary(record.data["cases"])
    record.data["table"] = table
    record.save()
    print(table)
    print(f"saved {args.out}")


def summary(cases: list[dict]) -> str:
    lines = [f"{'step':8} {'critic':6} {'mb':>3} {'rollout':>8} {'score':>7} {'update':>7} {'critic':>7} "
             f"{'step s':>7} {'peak GiB':>8}"]
    for c in (c for c in cases if c["case"] == "step"):
        p = c["phases"]
        get = lambda k: p[k]["s"] if k in p else float("nan")  # noqa: E731
        lines.append(f"{c['prompts']}x{c['group']:<6} {'on' if c['critic'] else 'off':6} {c['micro_batch']:>3} "
                     f"{get('rollout'):8.2f} {get('score'):7.2f} {get('update'):7.2f} {get('critic'):7.2f} "
                     f"{c['step_s']:7.2f} {c['peak_gib']:8.1f}")
    paths = [c for c in cases if c["case"] == "logprob_path"]
    if paths:
        lines.append(f"{'log-prob path':14} {'mb':>3} {'tokens':>7} {'fwd+bwd s':>9} {'peak GiB':>8}")
        for c in paths:
            lines.append(f"{c['path']:14} {c['micro_batch']:>3} {c['tokens']:>7} {c['s']:9.3f} {c['peak_gib']:8.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
