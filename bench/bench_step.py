"""One full GRPO step at a Qwen3 shape (--shape, default 8b): seconds, TFLOP/s and peak memory per phase,
of the trainer's step and of trainer options on the same rollouts.

The trainer's own step on random bf16 weights: a RunState (`trainer_state`) holds the actor (PEFT LoRA r128
on q, k, v, o, rsLoRA alpha 16, with the injection hook), an AR truncated after two thirds of the depth (8B:
layer 24, 25 blocks; identity value head), and the engine and optimisers of the trainer's setup
(`setup.make_engine`, vLLM's with dummy weights; `setup.make_optimizers`); each phase is the trainer's function
(`nla_shell.training.step`): `rollout_phase`, `score_phase` (scoring, group advantages, the critic step when
co-trained) and `update_phase`; tests/shell/test_bench_step.py checks that `train_step` gives the same numbers.
Hyper-parameters are TrainConfig's defaults except the shapes, micro-batches and engine set here.

Paths (trainer options), each on the same rollouts:
  after            the trainer's defaults: each group's prompt once (`training.prefix`), the reference at
                   --reference-micro-batch, scoring and the critic step on one AR forward at --critic-micro-batch
  after_bf16       + bf16_autocast (bf16 LoRA products, float32 master weights)
  after_compile    + compile_blocks on the actor's and the AR's blocks (compiled in the path's warm-up)
  after_all        + both: the fast settings
  after_fp8        + fp8= --fp8's phases (score, reference, update; copies made as the trainer's setup makes them)
  after_all_fp8    after_all + fp8=
  after_all_fp8_backward  after_all_fp8 with `backward` added to --fp8 (the input gradients from FP8 copies)
  PATH+best        PATH with critic_rollouts=best (the critic steps on each group's best-rewarded rollout)
The rollouts are sampled once in the base arithmetic (with engine=vllm, the fast settings', the paths' options
do not touch the rollout); every path but the last runs with lr-0 SGDs (milliseconds for the LoRA, ~0.1 s less
than AdamW for the AR), so each sees the same weights. Each [step] line and each case's `numbers` give the path's
loss, grad norm, KL and critic loss.

Retired, their numbers in bench/RESULTS.md: the hand-replayed pre-issue-12 step "before" (made by this file at
74a810e); after_tf32 (no recorded numbers, last at 86fb46f); last at d13c92a: the fast-accumulation paths
after_all_fp8_fast and _fastfwd (runs AH, AI), --repeats (run AF), an autocast path's own rollout and its
own_logp_gap (runs R1, R3), the printed "[same numbers]" comparison, --merge-lora (the native engine's merged
rollouts: run B, bench_rollout.py), and --ranks (the step as a torchrun job: runs C, U, W5, W6; `torchrun ... -m
nla_shell.cli train` on make_8b_run.py's inputs logs every phase's seconds, the maximum over ranks, in
metrics.jsonl).

A random model writes no <explanation> tags, so each rollout's text is made an <explanation> (`StandInEngine`)
that the AR reads as exactly as many tokens as were generated (`stand_in_explanation`). Prompts: random
tokens with one marker. TFLOP/s counts the matrix arithmetic each path executes (`path_flops`); % of peak is
against 790 TFLOP/s (bf16 dense, measured on the H200); decoding is bound by memory bandwidth, not arithmetic.

--engine vllm runs vLLM beside the trainer in sleep mode (--vllm-sleep, default 2: weights and KV cache freed
after each rollout, the actor pushed at each wake-up); the rollout's time is wake + push + generate + sleep.
Each phase's "in use" is the device's memory taken by everything (`synthetic.DeviceMemoryPeak`): torch's peak
counter also counts sleeping vLLM's unmapped memory (103.9 GiB in use against 145 GiB by torch's counter at
256 x 8 with the fast settings). --vllm-quantization fp8 has vLLM sample with its online FP8; logp_diff_mean
is then the FP8 behaviour/trainer gap.

    python bench/bench_step.py --out bench/step.json                                   # H200, 32x8
    python bench/bench_step.py --engine vllm --paths after_all,after_all_fp8 --out bench/step_fp8.json
    .venv/bin/python bench/bench_step.py --tiny --out /tmp/step.json                    # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import os
import re
import sys
import tempfile
import time
import traceback
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402

import synthetic as syn  # noqa: E402

PATHS = ("after", "after_bf16", "after_compile", "after_all", "after_fp8", "after_all_fp8", "after_all_fp8_backward")
FP8_PATHS = ("after_fp8", "after_all_fp8", "after_all_fp8_backward")
AUTOCAST_PATHS = ("after_bf16", "after_all", "after_all_fp8", "after_all_fp8_backward")
COMPILE_PATHS = ("after_compile", "after_all", "after_all_fp8", "after_all_fp8_backward")
CRITIC_ROLLOUTS_SUFFIX = "+best"
"""A path name ending in this runs with critic_rollouts=best (TrainConfig's key)."""
PEAK_TFLOPS = 790.0
"""bf16 dense matrix peak measured on the H200 (the issue's % of peak is against it)."""


def path_kind(path: str) -> str:
    """The arithmetic a --paths entry runs: the name without its +best."""
    return path.removesuffix(CRITIC_ROLLOUTS_SUFFIX)


def parse_args() -> argparse.Namespace:
    from nla_shell.training.config import VLLMQuantization

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/step.json", help="JSON written after every case")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU smoke run: tiny models, float32 (bf16 with an autocast path), short rollouts")
    parser.add_argument("--shape", default="8b", choices=list(syn.QWEN3_SHAPES),
                        help="the Qwen3 geometry (with --tiny: the tiny one, tied as this shape ties its embeddings)")
    parser.add_argument("--cases", default=None, help="prompts x samples per step (default 32x8; tiny 2x2,3x2)")
    parser.add_argument("--critic", default="on", choices=["on", "off"], help="co-train the critic")
    parser.add_argument("--ar-lora", action="store_true",
                        help="the critic as an AR-LoRA (nla sft --mode ar ar_lora=true): only its LoRA and value head "
                             "train, so no optimiser moments over its backbone")
    parser.add_argument("--paths", default="after",
                        help=f"any of {','.join(PATHS)}, each also as PATH{CRITIC_ROLLOUTS_SUFFIX} (see above)")
    parser.add_argument("--micro-batch", type=int, default=16, help="after: logp_micro_batch of the policy update")
    parser.add_argument("--reference-micro-batch", type=int, default=None,
                        help="after: samples per reference forward (default 4 x --micro-batch)")
    parser.add_argument("--critic-micro-batch", type=int, default=32, help="after: AR inputs per critic forward")
    parser.add_argument("--prompt-block", type=int, default=None,
                        help="after: micro-batches per prompt forward (default TrainConfig.logp_prompt_block)")
    parser.add_argument("--engine", default="native", choices=["native", "hf", "vllm"])
    parser.add_argument("--vllm-gpu-mem", type=float, default=0.35,
                        help="vLLM's share of GPU memory: at the 8B shape on an H200 0.35 is 49 GiB, a KV cache of "
                             "233k tokens after the weights (measured 2026-11-30)")
    parser.add_argument("--vllm-max-seqs", type=int, default=None,
                        help="vLLM's max_num_seqs (default TrainConfig.vllm_max_seqs; 0: vLLM's own default)")
    parser.add_argument("--vllm-prefix-caching", default="on", choices=["on", "off"],
                        help="TrainConfig.vllm_prefix_caching: a group's samples share their prompt's prefill")
    parser.add_argument("--vllm-sleep", type=int, default=2, choices=[0, 1, 2],
                        help="vLLM's sleep level between rollouts (TrainConfig.vllm_sleep); 0 keeps it resident")
    parser.add_argument("--vllm-quantization", default="none", choices=typing.get_args(VLLMQuantization),
                        help="TrainConfig.vllm_quantization: vLLM's online FP8, each push re-quantised")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 96 (tiny 24)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default TrainConfig's 160 (tiny 8)")
    parser.add_argument("--fp8", default="score,reference,update",
                        help="after_fp8, after_all_fp8: the phases whose matmuls run in FP8, of score,reference,update "
                             "and backward (their backwards' input gradients too) "
                             "(nla train's fp8=)")
    parser.add_argument("--profile", default=None, help="directory for torch.profiler tables of each path's "
                        "score and update phases: one more step on the first case's warm-up prompts, "
                        "after its measured step")
    args = parser.parse_args()
    tiny = args.tiny
    args.cases = [tuple(int(x) for x in c.split("x")) for c in (args.cases or ("2x2,3x2" if tiny else "32x8")).split(",")]
    args.critic = args.critic == "on"
    args.paths = [p for p in args.paths.split(",") if p]
    kinds = {path_kind(p) for p in args.paths}
    if not args.paths or kinds - set(PATHS):
        parser.error(f"--paths must name some of {PATHS} (each also as PATH{CRITIC_ROLLOUTS_SUFFIX}), "
                     f"got {args.paths}")
    if any(p.endswith(CRITIC_ROLLOUTS_SUFFIX) for p in args.paths) and not args.critic:
        parser.error(f"--paths ...{CRITIC_ROLLOUTS_SUFFIX}: the critic steps on the best rollouts; leave --critic on")
    args.fp8 = fp8_phases(parser, args.fp8, needed=bool(set(FP8_PATHS) & kinds))
    args.prompt_len = args.prompt_len or (24 if tiny else 96)
    return args


def fp8_phases(parser: argparse.ArgumentParser, text: str, *, needed: bool) -> tuple[str, ...]:
    """--fp8 as TrainConfig's fp8 (checked as `nla train` checks it); where `needed` (an FP8 path runs), at least
    one phase beside backward."""
    from nla_shell.io.config import ConfigError, load_dataclass
    from nla_shell.training.config import TrainConfig

    required = {"av_ckpt": "-", "ar_ckpt": "-", "rl_parquet": "-", "save_dir": "-"}
    try:
        phases = load_dataclass(TrainConfig, required, [f"fp8={text}"]).fp8
    except ConfigError as err:
        parser.error(f"--fp8: {err}")
    if needed and not set(phases) - {"backward"}:
        parser.error(f"--fp8 {text!r}: an FP8 path needs a phase of score, reference, update")
    return phases


class Context:
    """The models, optimisers and engine of one benchmark run, built as the trainer builds them."""

    def __init__(self, args, device: torch.device, dtype: torch.dtype) -> None:
        from nla_shell.training.config import TrainConfig
        from nla_shell.training import setup

        self.device = device
        # TrainConfig's defaults (the reference's) but the shapes, micro-batches and engine set here; each case
        # sets its batch (`trainer_state`).
        self.cfg = TrainConfig(
            av_ckpt="<random weights>", ar_ckpt="<random weights>", rl_parquet="<synthetic>", save_dir=os.devnull,
            max_new_tokens=args.new_tokens, train_critic=args.critic, logp_micro_batch=args.micro_batch,
            ref_micro_batch=args.reference_micro_batch or 4 * args.micro_batch, critic_micro_batch=args.critic_micro_batch,
            logp_prompt_block=args.prompt_block or TrainConfig.logp_prompt_block, engine=args.engine,
            vllm_canary="warn",  # random weights: a canary is read (its cost is the trainer's), never a reason to stop
        )
        self.tokenizer, tokens = syn.toy_tokenizer()
        self.shape = syn.bench_shape(args.shape, tiny=args.tiny)
        self.config = syn.qwen3_config(self.shape, vocab_size=len(self.tokenizer))
        self.tokens = tokens
        base = syn.random_qwen3(self.config, device=device, dtype=dtype, seed=0)
        cfg = self.cfg
        self.actor = syn.attach_lora(base, r=cfg.lora_r, alpha=cfg.lora_alpha, use_rslora=cfg.use_rslora)
        self.injector = syn.make_injector(self.actor, tokens)
        self.extraction_layer = syn.ar_extraction_layer(args.shape, tiny=args.tiny)
        self.critic = syn.random_ar(self.shape, extraction_layer=self.extraction_layer,
                                    vocab_size=len(self.tokenizer), device=device, dtype=dtype)
        if args.ar_lora:  # as an AR-LoRA ar_ckpt trains: the backbone frozen, a LoRA (and the value head) trained
            self.critic.add_lora(r=cfg.lora_r, alpha=cfg.lora_alpha, use_rslora=cfg.use_rslora,
                                 base_model=f"random {args.shape}")
        self.critic.requires_grad_(args.critic)
        self.optimizer, self.critic_optimizer, self.critic_ema = setup.make_optimizers(self.cfg, self.actor, self.critic,
                                                                                       None, device=device)
        self.engine = make_engine(args, self)
        self.profile_dir: str | None = None


def stand_in_explanation(tokenizer, rollout) -> str:
    """Text the AR reads as exactly as many tokens as the rollout generated (a real explanation is
    part of the response, so at most that long): its ids mapped onto the toy vocabulary's words.

    Decoding the ids themselves gives text that re-encodes about 1.6x longer (263 tokens for 160
    ids, which the benchmarks before the fourth session of 2026-11-30 fed the AR). A word token
    (" cat": a space and letters, encoding back to itself) stays one token beside any other, as
    the pre-tokenizer splits at each space.
    """
    return word_text(tokenizer, rollout.full_ids[rollout.prompt_len :].tolist())


def word_text(tokenizer, ids: list[int]) -> str:
    """Text of len(ids) word tokens (id i mapped onto the vocabulary's i-th word, cyclically) that
    encodes back to exactly len(ids) tokens."""
    words = _word_tokens(tokenizer)
    return tokenizer.decode([words[i % len(words)] for i in ids])


@functools.lru_cache(maxsize=4)
def _word_tokens(tokenizer) -> tuple[int, ...]:
    words = tuple(i for i in range(len(tokenizer)) if re.fullmatch(r" [A-Za-z]+", tokenizer.decode([i]))
                  and tokenizer.encode(tokenizer.decode([i]), add_special_tokens=False) == [i])
    if not words:
        raise ValueError("the tokenizer has no word tokens (a space and letters) to stand in explanations with")
    return words


def make_engine(args, ctx: Context):
    """The trainer's engine (`setup.make_engine`); vLLM's gets random weights ("dummy", no checkpoint to load)
    and then the actor's, as the trainer pushes them."""
    if args.engine != "vllm":
        from nla_shell.training import setup

        return setup.make_engine(ctx.cfg, ctx.actor, ctx.injector, ctx.tokenizer, eos_ids=(ctx.tokenizer.eos_token_id,))
    from nla_shell.engines.vllm import VLLMRolloutEngine, require_vllm

    require_vllm()  # says how to install it when it is missing
    model_dir = Path(tempfile.mkdtemp(prefix="bench_step_vllm_"))
    config = syn.qwen3_config(ctx.shape, vocab_size=len(ctx.tokenizer))
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(model_dir)
    largest = max(p * g for p, g in args.cases)
    engine = VLLMRolloutEngine(
        model_dir, ctx.tokenizer, **ctx.injector.vllm_kwargs(), gpu_memory_utilization=args.vllm_gpu_mem,
        max_model_len=args.prompt_len + args.new_tokens + 16, load_format="dummy",
        enable_prefix_caching=args.vllm_prefix_caching == "on",
        max_num_seqs=(ctx.cfg.vllm_max_seqs if args.vllm_max_seqs is None else args.vllm_max_seqs) or None,
        sleep_level=args.vllm_sleep,
        quantization=None if args.vllm_quantization == "none" else args.vllm_quantization,
    )
    config = engine.llm.llm_engine.vllm_config
    cache, max_seqs = config.cache_config, config.scheduler_config.max_num_seqs
    blocks = getattr(cache, "num_gpu_blocks", None)
    concurrent = min(largest, max_seqs)
    # With prefix caching the G samples of a group hold one copy of their prompt's blocks.
    group = max(g for _, g in args.cases)
    prompt_share = args.prompt_len / group if args.vllm_prefix_caching == "on" else args.prompt_len
    needed = int(concurrent * (prompt_share + args.new_tokens))
    print(f"[vllm] gpu_memory_utilization {args.vllm_gpu_mem}, sleep level {args.vllm_sleep}, quantization "
          f"{args.vllm_quantization}, prefix caching {args.vllm_prefix_caching}, max_num_seqs {max_seqs}, KV cache "
          f"{blocks * cache.block_size if blocks else 'unknown'} tokens; {concurrent} concurrent sequences of "
          f"{largest} need ~{needed}", flush=True)
    if blocks and blocks * cache.block_size < needed:
        print("[vllm] warning: the KV cache cannot hold every concurrent sequence at full length: vLLM will "
              "preempt and recompute (raise --vllm-gpu-mem or lower --vllm-max-seqs)", flush=True)
    # The initial push; with sleep mode every rollout's wake-up pushes the actor again, as a trainer
    # with vllm_sync_every=1 does after each update.
    print(f"[vllm] weight push {engine.sync_weights(ctx.actor):.2f}s", flush=True)
    return engine


# --------------------------------------------------------------------------- arithmetic


def forward_flops(config, *, layers: int, tokens: int, attention_pairs: int, logit_rows: int) -> float:
    """Matrix FLOPs of a decoder forward: 2 * (block weights) per token, 4 * heads * head_dim per
    (query, key) pair attended, 2 * V * D per position whose logits are formed."""
    d, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    block = d * (2 * q + 2 * kv) + 3 * d * inter
    return (2.0 * block * layers * tokens + 4.0 * q * layers * attention_pairs
            + 2.0 * config.vocab_size * d * logit_rows)


def path_flops(config, rollouts, *, ar_tokens: list[int], critic_layers: int,
               critic_trains_backbone: bool = True, critic_ar_tokens: list[int] | None = None) -> dict[str, float]:
    """FLOPs each phase of a path executes.

    update: policy forward + reference forward + policy backward. The base weights are frozen,
    so the backward forms activation gradients only (about one forward, LoRA's own gradients
    are < 2 %), attention's backward costs two of its forwards, and the fused log-prob's
    backward recomputes the logits (two lm_head products). So 3 x blocks, 4 x attention,
    4 x lm_head. score: one AR forward over ar_tokens (each input's length); critic: AR forward +
    backward over critic_ar_tokens (default ar_tokens: every scored input), 3 x forward with the
    backbone trained, 2 x for an AR-LoRA (critic_trains_backbone=False: activation gradients only).
    """
    layers = config.num_hidden_layers
    tokens = pairs = rows = 0
    prompts = {}
    for r in rollouts:  # each group's prompt once (`training.prefix`), then every sample's response
        p, n = r.prompt_len, r.response_len
        rows += n
        prompts[r.prompt_index] = p
        tokens += n - 1
        pairs += (n - 1) * p + (n - 1) * n // 2
    tokens += sum(prompts.values())
    pairs += sum(p * (p + 1) // 2 for p in prompts.values())
    blocks = forward_flops(config, layers=layers, tokens=tokens, attention_pairs=0, logit_rows=0)
    attention = forward_flops(config, layers=layers, tokens=0, attention_pairs=pairs, logit_rows=0)
    logits = forward_flops(config, layers=layers, tokens=0, attention_pairs=0, logit_rows=rows)

    def ar_forward(lengths: list[int]) -> float:
        return forward_flops(config, layers=critic_layers, tokens=sum(lengths),
                             attention_pairs=sum(t * (t + 1) // 2 for t in lengths), logit_rows=0)

    ar = ar_forward(ar_tokens)
    trained = ar if critic_ar_tokens is None else ar_forward(critic_ar_tokens)
    generated = sum(r.response_len for r in rollouts)
    return {"rollout": forward_flops(config, layers=layers, tokens=generated, attention_pairs=0, logit_rows=generated),
            "update": 3 * blocks + 4 * attention + 4 * logits, "score": ar,
            "critic": (3 if critic_trains_backbone else 2) * trained}


# --------------------------------------------------------------------------- one step


def trainer_state(ctx: Context, requests, group: int):
    """The trainer's run state (`nla_shell.training.run_state.RunState`) over one case's synthetic prompts:
    the context's models, engine and optimisers, TrainConfig's defaults but the shapes and micro-batches
    set here; a step's phases are then the trainer's own functions (`nla_shell.training.step`)."""
    import nla_core
    from nla_shell.io.data import RLRow
    from nla_shell.io.logging import NullLogger
    from nla_shell.training import distributed
    from nla_shell.training.canary import CanaryWatch
    from nla_shell.training.run_state import EvalEngine, RunState
    from nla_shell.training.runtime import DataOrder

    cfg = dataclasses.replace(ctx.cfg, batch_prompts=len(requests), group_size=group)
    t = ctx.tokens
    nla = nla_core.NLAConfig(
        kind="synthetic", d_model=ctx.config.hidden_size, injection_char="", injection_token_id=t["injection_token_id"],
        injection_left_neighbor_id=t["injection_left_neighbor_id"], injection_right_neighbor_id=t["injection_right_neighbor_id"],
        actor_prompt_template="", critic_prompt_template="Text: {explanation}", extraction_layer_index=ctx.extraction_layer,
        mse_scale=ctx.critic.mse_scale,
    )
    rows = [RLRow(prompt="", activation=r.activation, doc_id=str(i), index=i) for i, r in enumerate(requests)]
    engine = StandInEngine(ctx)
    return RunState(
        cfg=cfg, rank=distributed.rank_info(), device=ctx.device, nla=nla, tokenizer=ctx.tokenizer, rows=rows,
        prompt_ids=[list(r.prompt_ids) for r in requests], eval_rows=[], eval_prompt_ids=[], actor=ctx.actor,
        injector=ctx.injector, critic=ctx.critic, engine=engine,
        eval_engine=EvalEngine(engine, ctx.actor, ctx.injector, ctx.tokenizer), optimizer=ctx.optimizer,
        critic_optimizer=ctx.critic_optimizer, critic_ema=ctx.critic_ema, eos_ids=(ctx.tokenizer.eos_token_id,),
        mse_scale=ctx.critic.mse_scale, rawvar=1.0, meannorm=1.0, order=DataOrder(len(rows), cfg.seed), start_step=0,
        skipped_steps=0, logger=NullLogger(), save_dir=Path(os.devnull), canary_watch=CanaryWatch(stop=False),
    )


class StandInEngine:
    """The context's engine, each rollout's text an <explanation> of its stand-in, so that the trainer's own
    extraction reads it."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def __getattr__(self, name: str):
        return getattr(self.ctx.engine, name)

    def generate(self, requests, *, group_size: int, max_new_tokens: int):
        rollouts = self.ctx.engine.generate(requests, group_size=group_size, max_new_tokens=max_new_tokens)
        return [dataclasses.replace(r, text=f"<explanation>{stand_in_explanation(self.ctx.tokenizer, r)}</explanation>")
                for r in rollouts]


def run_path(ctx: Context, path: str, state, rolled, args, *, keep_weights: bool):
    """One path's score / update / critic phases. Returns ({phase: {"s", "peak_gib"}}, numbers, ar_tokens), the
    AR input lengths scored and those the critic trained on ({"scored", "trained"}).

    Every path runs the trainer's own phases (`step.score_phase`, `step.update_phase`).
    """
    from nla_shell.training import step

    phases: dict[str, dict[str, float]] = {}
    profile_dir, ctx.profile_dir = ctx.profile_dir, None  # one profiled step per path

    def phase(name, fn):
        with profiled(profile_dir, f"{path}_{name}", ctx.device):
            seconds, out, memory = syn.measured(fn, ctx.device)
        phases[name] = {"s": seconds, **memory}
        return out

    from nla_shell.training import sampling

    kind = path_kind(path)
    if path != kind:
        state = dataclasses.replace(state, cfg=dataclasses.replace(state.cfg, critic_rollouts="best"))
    if kind in FP8_PATHS:  # the FP8 copies of --fp8's phases, made as the trainer's setup makes them
        from nla_shell.training.setup import make_fp8_copies

        backward = kind == "after_all_fp8_backward" and "backward" not in args.fp8
        cfg = dataclasses.replace(state.cfg, fp8=args.fp8 + ("backward",) * backward, compile_blocks=kind in COMPILE_PATHS)
        fp8_score, fp8_reference, fp8_update = make_fp8_copies(cfg, ctx.actor, ctx.critic, device=ctx.device)
        state = dataclasses.replace(state, cfg=cfg, fp8_score=fp8_score, fp8_reference=fp8_reference,
                                    fp8_update=fp8_update)
    if keep_weights:  # another path follows on the same rollouts: leave every weight as it was
        state = dataclasses.replace(state, optimizer=lr0_sgd(ctx.actor),
                                    critic_optimizer=lr0_sgd(ctx.critic) if args.critic else None)
    scored = phase("score", lambda: step.score_phase(state, rolled))
    update = phase("update", lambda: step.update_phase(state, 0, scored))
    critic_loss, critic_norm, scores = scored.critic_loss, scored.critic_grad_norm, scored.scores
    ctx.optimizer.zero_grad(set_to_none=True)
    for copies in {id(c): c for c in (state.fp8_score, state.fp8_reference, state.fp8_update) if c}.values():
        copies.remove()  # the next path runs without them
    numbers = {"loss": update.loss, "grad_norm": update.grad_norm, "kl_mean": update.kl_mean,
               "clip_frac": update.clip_frac, "logp_diff_mean": update.logp_diff_mean,
               "allreduce_s": update.time_allreduce,
               "critic_loss": critic_loss, "critic_grad_norm": critic_norm,
               "reward": scores.reward.tolist()}
    group_ids = torch.tensor([r.prompt_index for r in rolled.rollouts])
    trained = sampling.critic_pairs(scores, group_ids, rollouts=state.cfg.critic_rollouts) if args.critic else []
    ar_tokens = {"scored": [len(ids) for ids in scores.ar_inputs if ids is not None],
                 "trained": [len(scores.ar_inputs[i]) for i in trained]}
    return phases, numbers, ar_tokens


def lr0_sgd(model) -> torch.optim.Optimizer:
    """An optimiser whose steps change nothing (lr 0): a path's update and critic step run, its weights stay."""
    from nla_shell.models import trainable_parameters

    return torch.optim.SGD(trainable_parameters(model), lr=0.0)


def grpo_step(ctx: Context, requests, group: int, args, *, paths: list[str]):
    """The trainer's rollout phase once, then each path on those rollouts.
    Returns {path: (phases, numbers, flops)}, extra."""
    device = ctx.device
    state = trainer_state(ctx, requests, group)
    resident = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else math.nan
    rollout, rolled = timed_rollout(ctx, state)
    results = {}
    for position, path in enumerate(paths):
        kind = path_kind(path)
        with path_arithmetic(ctx, kind):
            phases, numbers, ar_tokens = run_path(ctx, path, state, rolled, args,
                                                  keep_weights=position < len(paths) - 1)
        flops = path_flops(ctx.config, rolled.rollouts, ar_tokens=ar_tokens["scored"],
                           critic_layers=ctx.extraction_layer + 1, critic_trains_backbone=not args.ar_lora,
                           critic_ar_tokens=ar_tokens["trained"])
        critic_flops = flops.pop("critic")
        if "critic" in phases:
            flops["critic"] = critic_flops
        elif args.critic and path != kind:
            flops["score"] += critic_flops  # a no-grad AR forward scored; the best pairs' forward + backward trained
        elif args.critic:
            flops["score"] = critic_flops  # one AR forward + backward scored and trained
        results[path] = ({"rollout": rollout, **phases}, numbers, flops)
        print(f"[path] {path}: " + ", ".join(f"{k} {v['s']:.2f}s" for k, v in results[path][0].items()), flush=True)
    extra = {"generated_tokens": sum(r.response_len for r in rolled.rollouts),
             "resident_gib_before_rollout": resident,
             "engine_stats": dict(getattr(ctx.engine, "last_stats", {}))}
    return results, extra


def timed_rollout(ctx: Context, state):
    """({"s", "capture_s", "peak_gib", "in_use_gib"}, the trainer's rollout phase's output): seconds without
    the CUDA-graph captures (the native engine captures on first use of a shape)."""
    from nla_shell.training import step

    seconds, rolled, memory = syn.measured(lambda: step.rollout_phase(state, 0), ctx.device)
    capture = getattr(ctx.engine, "last_stats", {}).get("capture_s", 0.0)
    return {"s": seconds - capture, "capture_s": capture, **memory}, rolled


@contextlib.contextmanager
def path_arithmetic(ctx: Context, path: str):
    """The path's trainer options while its phases run: bf16 autocast, compiled block parts."""
    compiled = (ctx.actor, ctx.critic.lm) if path in COMPILE_PATHS else ()
    with syn.trainer_options(ctx.actor, bf16_autocast=path in AUTOCAST_PATHS, compiled=compiled):
        yield


@contextlib.contextmanager
def profiled(directory: str | None, name: str, device: torch.device):
    """torch.profiler over the block; its top-40 table by device time written to directory/name.txt."""
    if directory is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        yield
    write_profile_table(prof, Path(directory) / f"{name}.txt", device)


def write_profile_table(prof, path: Path, device: torch.device, *, rows: int = 30) -> None:
    """A torch.profiler's ops by their own device time (CPU time on the CPU), the top `rows`."""
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=90))


def main() -> None:
    """The context (models, optimisers, engine), then every case (`measure_case`); the JSON after each."""
    from nla_shell.training.config import TrainConfig
    from nla_shell.models import trainable_parameters

    args = parse_args()
    device = torch.device("cpu") if args.tiny else torch.device("cuda")

    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    new_tokens = args.new_tokens = args.new_tokens or (8 if args.tiny else defaults["max_new_tokens"])  # the engine reads it
    # bf16 autocast needs a bf16 base: the tiny run is then bf16 too.
    dtype = torch.float32 if args.tiny and not {path_kind(p) for p in args.paths} & set(AUTOCAST_PATHS) else torch.bfloat16
    settings = {**vars(args), "new_tokens": new_tokens,
                "defaults": {k: v for k, v in defaults.items() if isinstance(v, (int, float, str, bool, type(None)))}}
    record = syn.Record(args.out, {**syn.environment(device), "settings": settings, "peak_tflops": PEAK_TFLOPS})

    t0 = time.perf_counter()
    ctx = Context(args, device, dtype)
    record.data["setup_s"] = time.perf_counter() - t0
    # Which AdamW make_optimizer picked (AdamW8bit needs bitsandbytes): the memory estimate depends on it.
    record.data["optimizers"] = {"actor": type(ctx.optimizer).__name__,
                                 "critic": type(ctx.critic_optimizer).__name__ if ctx.critic_optimizer else None}
    # What each optimiser steps (--ar-lora: the critic's LoRA and value head only), against the whole model.
    record.data["parameters"] = {name: {"trained": sum(p.numel() for p in trainable_parameters(model)),
                                        "all": sum(p.numel() for p in model.parameters())}
                                 for name, model in (("actor", ctx.actor), ("critic", ctx.critic))}
    record.save()
    print(f"[setup] actor + critic + engine on {device} in {record.data['setup_s']:.1f}s", flush=True)

    for index, (prompts, group) in enumerate(args.cases):
        measure_case(ctx, args, record, prompts, group, profile=index == 0)
    if hasattr(ctx.engine, "close"):
        ctx.engine.close()
    table = summary(record.data["cases"])
    record.data["table"] = table
    record.save()
    print(table)
    print(f"saved {record.path}")


def measure_case(ctx: Context, args, record: syn.Record, prompts: int, group: int, *, profile: bool) -> None:
    """One case: the warm-up (the shape's rollout graphs, every path's first-use costs on one micro-batch's
    prompts), the measured step of every path on the same rollouts, and with --profile (first case only) one
    more step per path on the warm-up's prompts under the profiler. A failure is recorded and the run goes on."""
    requests = syn.make_requests(prompts, args.prompt_len, ctx.config.hidden_size, ctx.tokens,
                                 vocab=min(ctx.config.vocab_size, len(ctx.tokenizer)), seed=prompts * group)
    label = f"{prompts}x{group} critic {'on' if args.critic else 'off'}"
    syn.free_memory(ctx.device)
    try:
        print(f"[warm-up] {label}", flush=True)
        ctx.engine.generate(requests, group_size=group, max_new_tokens=args.new_tokens)
        warm_prompts = min(prompts, max(1, args.micro_batch // group))
        paths = []
        for path in args.paths:
            try:
                grpo_step(ctx, requests[:warm_prompts], group, args, paths=[path])
                paths.append(path)
            except Exception as err:  # noqa: BLE001 - a path that fails its warm-up is left out of the step
                traceback.print_exc()
                record.error(f"{label} {path} warm-up", err)
        results, extra = grpo_step(ctx, requests, group, args, paths=paths)
        if args.profile and profile:
            # Warm now: the warm-up's prompts again under the profiler (the warm-up itself is mostly
            # compilation: run AC's tables of it held 14-19 % of its wall time in kernels).
            for path in paths:
                ctx.profile_dir = args.profile
                grpo_step(ctx, requests[:warm_prompts], group, args, paths=[path])
    except Exception as err:  # noqa: BLE001 - report, free, go on
        traceback.print_exc()
        record.error(label, err)
        return
    print(f"[engine] {label} {args.engine}: resident before the rollout {extra['resident_gib_before_rollout']:.1f} "
          "GiB (torch.cuda.memory_allocated); own split: "
          + (", ".join(f"{k} {v:.2f}" for k, v in extra["engine_stats"].items()) or "none"), flush=True)
    for path, (phases, numbers, flops) in results.items():
        for name, p in phases.items():
            p["tflops"] = flops.get(name, math.nan) / p["s"] / 1e12
            p["pct_peak"] = 100.0 * p["tflops"] / PEAK_TFLOPS
        case = {"case": "step", "shape": args.shape, "path": path, "prompts": prompts, "group": group,
                "critic": args.critic, "micro_batch": args.micro_batch, "phases": phases, "flops": flops,
                "step_s": sum(p["s"] for p in phases.values()),
                "peak_gib": max(p["peak_gib"] for p in phases.values()),
                "in_use_gib": max(p["in_use_gib"] for p in phases.values()),
                "numbers": {k: v for k, v in numbers.items() if k != "reward"}, **extra}
        record.add(case)
        print(f"[step] {label} {path}: {case['step_s']:.2f}s, peak {case['peak_gib']:.1f} GiB "
              f"(device in use {case['in_use_gib']:.1f} GiB), "
              + ", ".join(f"{k} {v['s']:.2f}s ({v['pct_peak']:.0f}%)" for k, v in phases.items())
              + f"; loss {numbers['loss']:+.6e} grad_norm {numbers['grad_norm']:.6e} kl {numbers['kl_mean']:.6e} "
              f"critic_loss {numbers['critic_loss']:.6e} logp_diff_mean {numbers['logp_diff_mean']:.3e}", flush=True)


def summary(cases: list[dict]) -> str:
    phases = ("rollout", "score", "update", "critic")
    lines = [f"{'step':8} {'path':13} {'mb':>3} " + " ".join(f"{p + ' s (TF/s, %pk)':>24}" for p in phases)
             + f" {'step s':>7} {'peak GiB':>8}"]
    for c in (c for c in cases if c["case"] == "step"):
        cells = []
        for name in phases:
            p = c["phases"].get(name)
            cells.append(f"{'-':>24}" if p is None else f"{p['s']:8.2f} ({p['tflops']:6.1f}, {p['pct_peak']:3.0f}%)")
        lines.append(f"{c['prompts']}x{c['group']:<6} {c['path']:13} {c['micro_batch']:>3} " + " ".join(cells)
                     + f" {c['step_s']:7.2f} {c['peak_gib']:8.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
