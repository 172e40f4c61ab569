"""`nla train`'s settings: the TrainConfig schema (one field per key, each with its docstring), the keys a resumed
run may change, and the range and consistency checks the types cannot express. How any config is read (YAML,
flags, key=value overrides, coercion, one-line errors) is nla_shell.io.config's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from nla_core import HeldoutDocs
from nla_shell.io.config import normalize_fields, require

VLLMQuantization = Literal["none", "fp8", "fp8_per_channel", "fp8_per_block"]
"""vLLM's online quantisation methods of a bf16 checkpoint that a rollout engine may use ("none": bf16)."""
FP8FastAccum = Literal["off", "forward", "all"]
"""Which FP8 products use the kernel's fast accumulation: none, the forward products, every product."""



# --------------------------------------------------------------------------- the schema


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Settings of `nla train`: the reference trainer's flags, plus engine/loss/logging choices.

    Defaults are those of the reference trainer (train_rl_vllm.py) except where a field's
    docstring says otherwise.
    """

    # Inputs and outputs.
    av_ckpt: str
    """Activation-verbaliser (actor) checkpoint dir: HF model + tokenizer from AV SFT."""
    ar_ckpt: str
    """Activation-reconstructor (critic) dir: truncated backbone + value_head.safetensors."""
    rl_parquet: str
    """RL dataset parquet (columns prompt, activation_vector, doc_id)."""
    sidecar: str | None = None
    """Sidecar YAML (or a parquet or checkpoint dir it belongs to); None finds `<rl_parquet>.nla_meta.yaml`."""
    injection_style: Literal["residual_add", "embedding_replace"] | None = None
    """How the AV receives the activation (nla_core.injection): "residual_add", the reference's add at block 1's
    output, or "embedding_replace", kitft's; None takes the AV checkpoint's sidecar, else the dataset's (residual_add)."""
    injection_scale: str | None = None
    """embedding_replace only: the injected vector's L2 norm ("sqrt_d_model", "raw" or a number, upstream's
    extraction.injection_scale); None takes the sidecar's."""
    injection_layer: int | None = None
    """residual_add only (an nla addition): the decoder block at whose output the vector is added; None takes the AV
    checkpoint's sidecar, else the dataset's, else block 1 (the reference's)."""
    save_dir: str
    """Run directory: config.yaml, metrics.jsonl, samples.jsonl, step_NNNNNN/ checkpoints."""

    # Schedule and batch shape.
    num_steps: int = 100
    """Number of optimizer steps (the run's total, counting steps done before a resume)."""
    batch_prompts: int = 8
    """Prompts per step (B)."""
    group_size: int = 4
    """Samples per prompt (G), the GRPO group; at least 2 for a group baseline."""
    max_new_tokens: int = 160
    """Longest rollout, in generated tokens."""
    temperature: float = 1.0
    """Sampling temperature; must be 1.0 (behaviour log-probs are taken at temperature 1)."""

    # Actor optimisation.
    lr: float = 5e-6
    """Actor (LoRA) learning rate."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip for the actor; a non-finite norm skips the optimizer step."""
    lora_r: int = 128
    """LoRA rank on q, k, v, o projections (of a fresh LoRA: unused when an SFT adapter is continued)."""
    lora_alpha: int = 16
    """LoRA alpha (of a fresh LoRA)."""
    use_rslora: bool = True
    """rsLoRA scaling alpha/sqrt(r) instead of alpha/r (at r=128 plain LoRA scales by 0.125; of a fresh LoRA)."""
    lora_targets: tuple[str, ...] = ()
    """Module names a fresh LoRA adapts (PEFT's target_modules; an nla addition); empty: the family's q, k, v, o,
    as the reference's. A continued SFT adapter keeps its own."""
    sft_adapter: Literal["continue", "merge"] = "continue"
    """When av_ckpt is an `nla sft` adapter dir: "continue" trains that adapter on (its own r and
    alpha and targets; lora_r/lora_alpha/use_rslora/lora_targets are then unused and not part of the run identity; the KL
    reference is the SFT policy); "merge" merges it into the base and trains a fresh
    lora_r/lora_alpha/use_rslora/lora_targets LoRA on top (the reference's path, which starts RL from a merged
    SFT checkpoint; KL reference: the merged SFT model). nla's default deviates from the reference
    on purpose: EasyNLA measured ~12 pp FVE lost by a fresh zero-init LoRA. Ignored for a full checkpoint."""
    gradient_checkpointing: bool = False
    """Recompute actor activations in backward (less memory, about 30% more compute)."""
    sharding: Literal["ddp", "fsdp2"] = "ddp"
    """How `nla train --nproc N` lays the models out over the ranks. "ddp": every rank holds the whole actor and
    critic and the ranks sum their gradients. "fsdp2": torch FSDP2 shards each decoder block of the actor (frozen
    base and LoRA) and of the critic over the ranks and gathers one block at a time, forward and backward
    (nla_shell.training.sharding). Same arithmetic: one rank of fsdp2 gives the unsharded run's numbers; a ddp run
    may resume under fsdp2 (an fsdp2 checkpoint's optimiser moments are sharded: it resumes under fsdp2 only).
    fsdp2 serves engine=hf without quant, fp8, compile_blocks or critic_ema, and with several ranks no dynamic
    sampling; other settings are refused at start (docs/training.md). An nla addition (kitft's trainer shards with
    FSDP2)."""
    bf16_autocast: bool = False
    """Run the actor's decoder blocks under torch.autocast(bfloat16) in every forward (update,
    reference, native/HF rollouts): the float32 LoRA factors then enter bf16 matrix products
    (float32 master weights and gradients) instead of PEFT's float32 ones; the log-prob head
    stays outside. Needs dtype bfloat16 (the base's products are bf16 already). Not in the
    reference (its LoRA products are float32)."""
    compile_blocks: bool = False
    """torch.compile (dynamic shapes) the norms, MLPs, LoRA layers and rotary embedding of the actor's and
    the AR's decoder blocks, and the actor's log-prob head's per-chunk arithmetic, fusing their element-wise
    kernels; the rest of the attention modules stays eager. Costs a compilation (tens of seconds) in the
    first step; same arithmetic up to float rounding."""
    logp_micro_batch: int | Literal["auto"] = "auto"
    """Sequences per micro-batch in the training forward (memory grows with it; same arithmetic up to summation
    order). "auto" chooses it at start-up: on a GPU from the memory free once the models and the engine are
    loaded (the largest power of two, at most 64, whose activations fit in half of it; nla_shell.training.memory),
    on a CPU the reference's 2. The value is printed, saved in config.yaml, and kept by a resumed run. A
    deviation from the reference's fixed 2, which leaves a small model on a large GPU waiting on the host."""
    ref_micro_batch: int | Literal["auto"] = "auto"
    """Sequences per micro-batch in the reference forward (adapter off, no grad; with kl_beta > 0 or kl_metric).
    It keeps no autograd state: its memory is one block's activations of its sequences at a time plus every
    block's K and V of their prompts (a few percent of a training micro-batch's, by nla_shell.training.memory's
    estimate; not measured), so it can be much larger.
    "auto": chosen from free memory like logp_micro_batch (at most 64), or 4 x logp_micro_batch on a CPU (the
    trainer's rule before this key); printed, saved in config.yaml and kept on resume. Not in the reference."""
    logp_prompt_block: int = 4
    """Micro-batches whose groups' shared prompts run in one forward, and one backward after the
    block's last micro-batch (an nla addition, like the prompt sharing itself; 1: one prompt forward
    per micro-batch). A prompt forward is little arithmetic but a whole pass of host work, while the
    GPU waits; a larger block keeps its prompts' activations alive longer."""
    resume_from_lora: str | None = None
    """PEFT adapter dir to start the actor from (a fresh run only; checkpoints resume themselves)."""
    start_step: int = 0
    """Step counter of a fresh run's first step (ignored when resuming from a checkpoint)."""

    # Critic.
    train_critic: bool = False
    """Co-train the AR critic: one supervised MSE step per RL step on that step's pairs."""
    critic_lr: float = 1e-5
    """Critic learning rate (when train_critic)."""
    critic_micro_batch: int = 4
    """Explanations per critic forward (scoring and training)."""
    critic_rollouts: Literal["all", "best"] = "all"
    """Pairs the co-trained critic learns from each step: every scored rollout (reference), or each prompt
    group's best-rewarded one (the EasyNLA fork's); with best the rollouts are scored first (no-grad), then the
    critic steps on the B best. At 256 x 8 on an H200 (8B shape) best took the score + critic phase from 15.6
    to 7.3 s (docs/performance.md). Not in the reference."""
    critic_ema: float | None = None
    """With train_critic: score rewards with an exponential moving average of the critic's trained weights,
    ema = critic_ema * ema + (1 - critic_ema) * weights after each critic step (e.g. 0.99; the EasyNLA fork's);
    null scores with the critic itself (reference). Held-out evals score with the EMA too."""

    # GRPO loss.
    clip_eps: float = 0.2
    """PPO ratio clip: ratios are clipped to [1 - clip_eps, 1 + clip_eps_high]."""
    clip_eps_high: float | None = None
    """Upper clip (DAPO clip-higher); None uses clip_eps. Not in the reference."""
    kl_beta: float = 0.04
    """Weight of the k3 KL penalty against the adapter-off reference policy. 0 drops the term from the loss;
    the reference forward then runs only for the kl_mean metric (kl_metric), and not at all with kl_metric=false."""
    kl_metric: bool = True
    """At kl_beta = 0, still run the reference forward (no grad) so kl_mean is measured; false skips
    it (one forward per micro-batch saved), logs kl_mean as NaN and says so at start-up. The loss is
    the same either way. Not in the reference (which logs 0)."""
    entropy_metric: bool = True
    """Log entropy_mean, the policy's mean entropy (nats) over the response tokens, from the update's own
    log-prob head pass (no second lm_head product; the logits are never whole). false logs NaN. Not in the reference."""
    kl_clamp: float | None = None
    """Clamp on the per-token log-ratio inside the KL estimator; None leaves it unclamped. Not in the reference."""
    tis: Literal[
        "ratio_cap", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none"
    ] = "ratio_cap"
    """Truncated-importance-sampling mode of nla_core.grpo_loss ("ratio_cap" is the reference's)."""
    tis_cap: float = 2.0
    """TIS cap C on the trainer/behaviour importance ratio; with tis=ratio_cap at least 1 + clip_eps_high."""
    aggregation: Literal["sequence_mean", "token_mean", "seq_mean_token_sum_norm", "prompt_mean"] = "sequence_mean"
    """Loss aggregation (nla_core.aggregate_loss): mean over each sequence then over sequences (reference);
    token_mean over all tokens (TRL's dapo/bnpo); seq_mean_token_sum_norm, each sequence's token sum over
    max_new_tokens, averaged over sequences (Dr. GRPO, TRL's dr_grpo); prompt_mean, each prompt group's token
    mean averaged over prompts (ScaleRL)."""
    advantage_scale: Literal["std", "none", "batch"] = "std"
    """Group advantage: (r - mean) / std (reference), r - mean (Dr. GRPO), or (r - mean) / the whole batch's std
    (TRL's scale_rewards=batch, ScaleRL). A constant group gets 0 in each."""
    policy_loss: Literal["grpo", "gspo", "cispo", "onpolicy"] = "grpo"
    """Policy surrogate (nla_core.policy_loss): grpo, PPO's clipped token ratio (reference); gspo, the clipped
    length-normalised sequence ratio (GSPO); cispo, the clipped, detached IS weight times log p (MiniMax-M1;
    ScaleRL: clip_eps=1 clip_eps_high=4, i.e. weights capped at 5 with no lower clip, and tis_cap=5 or tis=none); onpolicy, A * log p with
    no ratio (EasyNLA, with tis=none and kl_clamp=12). Not in the reference beyond grpo."""
    token_mask: tuple[float, ...] | None = None
    """Two-sided token mask on the trainer/engine probability ratio, "low,high" with 0 < low <= 1 <= high
    (IcePop: 0.5,2): a token whose ratio leaves the band loses its surrogate (its KL term stays); null: off.
    Logged as token_mask_frac. Not in the reference."""
    top_entropy_quantile: float = 1.0
    """TRL's top_entropy_quantile (Wang et al. 2025, "80/20"): keep the policy-gradient term only at the top
    `quantile` share of response tokens by policy entropy (the rest keep their KL term); 1.0 keeps every token
    (off). The threshold is each update micro-batch's, as in TRL. Logged as entropy_mask_frac. Not in the reference."""
    reward: Literal["neg_log", "neg"] = "neg_log"
    """Reward from normalised MSE: -log(mse) (reference) or -mse."""
    max_explanation_tokens: int = 1024
    """Explanations longer than this (critic tokens) get the failed-extraction reward."""
    mismatch_threshold: float | None = None
    """Mask rollouts whose mean |behaviour - trainer log-prob| exceeds this; None masks none."""
    length_penalty: float = 0.0
    """Hinged length penalty per response token past max_new_tokens - length_margin, subtracted from
    the reward before the advantages; 0 disables. EasyNLA's anti-runaway measure (it uses 0.01,
    with truncated_as_failed). Not in the reference."""
    length_margin: int = 64
    """Free tokens end at max(1, max_new_tokens - length_margin) (EasyNLA: 64)."""
    truncated_as_failed: bool = False
    """Score rollouts cut by max_new_tokens (no eos) as failed extractions (-2) and keep them in the
    loss: their negative advantage is the gradient against runaway length (EasyNLA: on). Not in the reference."""

    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a step draws more prompts (G rollouts each) until it holds batch_prompts groups
    whose rewards are not all equal, at most dynamic_sampling_max_draws extra batches; short of that it trains
    on the varied groups plus the first constant ones (zero advantage); a co-trained critic learns from those
    kept groups only. Logged as dynamic_sampling_draws and varied_groups. Under torchrun every rank draws together while any rank lacks varied groups, and each
    keeps its own share. Not in the reference."""
    dynamic_sampling_max_draws: int = 2
    """Bound on the extra batches of batch_prompts prompts that dynamic_sampling draws in one step."""

    # Held-out evaluation.
    eval_every: int = 10
    """Run the held-out eval every N steps; 0 disables it."""
    eval_n_prompts: int = 20
    """Fixed held-out prompts per eval; 0 disables eval."""
    eval_parquet: str | None = None
    """Held-out parquet for the eval, e.g. datagen's eval.parquet (its rows from documents seen in training are
    dropped); None holds rows of rl_parquet out (see eval_skip_rows). An nla addition."""
    heldout_docs: HeldoutDocs = "select"
    """With eval_parquet (an nla addition): which of its documents the eval_n_prompts rows are spread over, a row
    of each before a second (nla_core.spread_rows): "select", the half a hash of doc_id gives checkpoint
    selection; "report", the other half, which `nla eval` scores by default; "all". The training curve then
    shares no document with the reported result."""
    eval_skip_rows: int | None = None
    """Without eval_parquet: eval rows come from rl_parquet rows at or past this index (the reference's window,
    30000 there); None holds out the last tenth of the rows (at least eval_n_prompts, at most half), for any size."""
    eval_max_new_tokens: int | None = None
    """Longest eval rollout; None uses max_new_tokens."""
    max_rows: int | None = None
    """Cap on training rows read from rl_parquet; None reads every row before the held-out ones (all of them
    with eval_parquet or without eval)."""

    # Rollout engine.
    engine: Literal["hf", "vllm", "native"] = "hf"
    """Rollout engine: the HF actor itself, vLLM, or the native fast engine."""
    vllm_gpu_mem: float = 0.35
    """vLLM gpu_memory_utilization (fraction of GPU memory, 0 < x <= 1)."""
    vllm_max_len: int = 1024
    """vLLM max_model_len (prompt + generation tokens)."""
    vllm_tp: int = 1
    """vLLM tensor_parallel_size (one trainer process). Under torchrun it must be 1: each rank runs a vLLM
    engine of its own on its own GPU."""
    vllm_max_seqs: int = 1024
    """vLLM max_num_seqs: sequences decoded together. The engine has vLLM capture decode CUDA graphs up to this
    many sequences (vLLM's own cap is 512: larger batches would decode without graphs). Rolling out 2048
    sequences on an H200 (8B shape, prefix caching on, 0.35 of the memory) took 13.6 s at 1024 and 14.4 s at
    512 (one machine, one run each); 1024 without graphs above 512 took 20.8 s in a step. An nla addition."""
    vllm_kv_cache_gib: float | None = None
    """vLLM's KV cache per GPU in GiB (its kv_cache_memory_bytes); None sizes it from vllm_gpu_mem. When set,
    vLLM skips its start-up memory profiling, which fails when another process on the GPU allocates or frees
    memory meanwhile ("Error in memory profiling"): for GPUs shared with other jobs. vllm_gpu_mem must then
    still be free at start-up; vLLM does not check that the weights, the cache and the trainer fit. An nla
    addition."""
    vllm_prefix_caching: bool = True
    """vLLM's prefix caching, salted per injection (vector, marker position, layer): the G samples of a
    group share their prompt's prefill (computed once, its KV blocks shared), and no two injections share
    a block. Prefill is about a third of a 96 + 160-token rollout's tokens. An nla addition (the reference
    leaves vLLM's default)."""
    vllm_sleep: int = 0
    """vLLM's sleep mode, for colocation beside the trainer on one GPU: 0 keeps vLLM's weights and KV cache
    resident (vllm_gpu_mem of the GPU for the whole run); 1 and 2 free both after each rollout and take them back
    before the next (torch's cache is emptied first), so vllm_gpu_mem can be large (room for 2048 sequences)
    while the update still gets the GPU. 1 parks the weights in pinned CPU memory (a host copy each way per
    step); 2 discards them and pushes the actor's at every wake-up instead (one push, 0.06 s at 8B; needs
    vllm_sync_every=1). Either re-maps the KV cache per step (no prefix cache survives) and adds its wake-up
    and sleep to time_rollout (the push made at a wake-up counts in time_sync). An nla addition (TRL's
    vllm_enable_sleep_mode)."""
    vllm_quantization: VLLMQuantization = "none"
    """vLLM's online FP8 for the rollouts (engine=vllm): vLLM quantises its linear layers' bf16 weights as they load,
    and every push re-quantises the actor's merged weights on the way in (one vLLM reload_weights per push;
    embeddings, lm_head and norms stay bf16). "fp8": per-tensor weight scales, activations quantised per token
    at run time on Hopper (vLLM's --quantization fp8); "fp8_per_channel": per-output-channel weight scales,
    per-token activations; "fp8_per_block": 128 x 128 weight blocks, activations per 128-wide group; "none":
    bf16. The trainer still computes its log-probs in its own dtype, so the behaviour policy differs from it by
    the quantisation: TIS (`tis`) corrects for it, and logp_diff_mean, logp_diff_max and tis_frac in
    metrics.jsonl are that gap to watch. Needs vllm_tp=1 (the push streams into the in-process worker). An nla
    addition, not in the reference. Measured on one H200 (docs/engines.md): the 8B shape's 256 x 8 rollout
    2.4-18 % faster than bf16 (runs Z, AC); on the toy NLA "fp8" lowered held-out FVE by 0.013 +- 0.005 (5 seeds,
    run AE2) and "fp8_per_channel" by 0.015 +- 0.004 (8 seeds, run AI), so the fast settings leave it out."""
    vllm_canary: Literal["stop", "warn"] = "stop"
    """What a failed steering canary does (engine=vllm): each step compares the first-token log-probs of one
    prompt with and without its vector, and reading no difference (or no number) means the rollouts came from
    an unsteered model. "stop" ends the run with an error after 3 failed steps in a row (one can be a fluke of
    a vector that barely moves the first token), "warn" only warns. An nla addition."""
    vllm_sync_every: int = 1
    """Push the actor's merged weights to an engine with its own copy every N steps; 0 never pushes
    after the initial one. A deliberate deviation from the reference's 20: measured on an H200 on
    2026-11-30 (toy NLA, 60 RL steps, 16x8; issue #13) vLLM reached held-out FVE 0.812 with 1 (three
    seeds) vs 0.779 with 20 (two seeds; HF engine 0.804; SFT alone 0.762), stale weights drove
    logp_diff_max to 3-9, and a push costs 0.06 s at the 8B shape. EasyNLA also pushes every step."""

    # Bookkeeping.
    save_every: int = 50
    """Checkpoint every N steps (and always at the end)."""
    keep_last: int | None = None
    """Keep only the newest N checkpoints, plus the one with the best held-out eval/fve (EasyNLA's
    advice for the volatile co-trained AR); older ones are deleted once a new checkpoint is saved
    and verified. None keeps every checkpoint. Not in the reference."""
    save_on_signal: bool = True
    """On SIGTERM / SIGINT, finish the current step and save a checkpoint before exiting (143 / 130).
    Not in the reference."""
    resume: Literal["auto", "never"] = "auto"
    """"auto" continues from the newest complete checkpoint in save_dir; "never" starts fresh."""
    overwrite: bool = False
    """Allow deleting a save_dir that holds a different run (or any run, with resume=never)."""
    logger: tuple[Literal["console", "jsonl", "wandb", "tensorboard"], ...] = ("console",)
    """Metric sinks (comma-separated); save_dir/metrics.jsonl is written whatever this says. wandb runs offline
    unless WANDB_API_KEY is set; tensorboard writes save_dir/tensorboard. The progress bar shows on a terminal,
    whatever this says."""
    wandb_project: str = "nla"
    """wandb project (reference: nla-qwen3-8b)."""
    wandb_name: str | None = None
    """wandb run name; None lets wandb choose."""
    seed: int = 0
    """Seed of python, numpy and torch RNGs (0 <= seed < 2**32)."""
    device: str = "auto"
    """"auto" (cuda if available, else cpu), "cpu", "cuda" or "cuda:N"."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Model dtype; "auto" is bfloat16 on cuda and float32 on cpu."""
    quant: Literal["none", "4bit", "8bit"] = "none"
    """Load the AV's frozen base and the (frozen) AR quantised with bitsandbytes (CUDA, engine=hf, pip install
    'nla[bnb]'); the LoRA trains in `dtype` on top."""
    fp8: tuple[Literal["score", "reference", "update", "backward"], ...] = ()
    """Phases whose matrix products with model weights run in FP8 (comma-separated; empty: none): e4m3 with
    one scale per row of each operand, by torch._scaled_mm (nla_core.fp8, nla_shell.models.fp8). "score":
    the AR's scoring forward (its backbone's Linear layers; a co-trained AR's weights are re-quantised from
    the current ones at every scoring block, and its step's backward runs in `dtype`; an AR-LoRA's frozen
    base is quantised once; the LoRA and the float32 value head stay as they are); "reference": the KL
    reference pass (the actor's frozen base layers, quantised once; an SFT reference adapter stays as it
    is); "update": the policy update's forwards through those base layers (same copies). Every backward is
    the linear map's in `dtype` (straight-through: g @ W to the input, g^T @ x to a trained weight), so
    the trainer's log-probs are FP8 ones beside the engine's (logp_diff_* measure the gap). "backward"
    (with update and/or score): those phases' input gradients g @ W in FP8 too, from a transposed copy
    quantised per input feature (+1 byte per weight again); g^T @ x to a trained weight stays in `dtype`.
    Layers whose in- or out-features are not multiples of 16 stay in `dtype` (start-up says how many convert). Memory:
    +1 byte per converted weight, held for the run (the actor's once for reference and update). Each
    operand's element is off by up to 2^-4 of itself. The rollouts and the held-out eval run as before.
    Works with compile_blocks and bf16_autocast; needs a Hopper GPU or later (or the CPU); not with quant.
    An nla addition, not in the reference; speed measured on one H200 (the 8B step 8.4 % faster on 2026-12-01,
    13.6 % with backward on 2026-12-02), learning parity on the toy on 2026-12-02: docs/performance.md."""
    fp8_fast_accum: FP8FastAccum = "off"
    """With fp8: which FP8 products accumulate in the tensor cores' own precision along K (cuBLAS's fast
    accumulation, `_scaled_mm(use_fast_accum=True)`), not promoted to float32 as they go: "forward" the forward
    products (policy, reference and AR scoring; the FP8 input gradients of `backward` not, as torchao's float8
    training does), "all" every product, "off" none. An entry then errs by about 4e-4 of its sum of absolute
    terms on the H200 instead of 3e-5, both far below FP8's own 2^-3 (run AC in bench/RESULTS.md). With "all" the
    8B step at 256 x 8 took 47.12 s against 49.88 s (2026-12-03, one H200), but learning parity on the toy was
    not shown (held-out FVE -0.015 over 6 GPU seeds, lower bound -0.031); docs/performance.md says what
    "forward" measured. The CPU ignores it. An nla addition."""

    @property
    def critic_steps_after_scoring(self) -> bool:
        """A co-trained critic steps in the scoring forward (reference), unless it learns from chosen pairs,
        scores with an EMA or the step may draw again: then the scoring is no-grad and the step follows it."""
        return self.critic_rollouts != "all" or self.critic_ema is not None or self.dynamic_sampling

    def __post_init__(self) -> None:
        normalize_fields(self)
        _check_train_config(self)


RESUME_MUTABLE_KEYS: frozenset[str] = frozenset(
    {
        # How long and how often: extending a run or changing its cadence is a resume.
        "num_steps", "save_every", "eval_every", "keep_last", "save_on_signal",
        # Where it runs and where it reports, not what it computes.
        "save_dir", "resume", "overwrite", "logger", "wandb_project", "wandb_name", "device",
        # Memory/speed knobs: mathematically neutral (not bit-exact: summation order moves).
        "logp_micro_batch", "logp_prompt_block", "critic_micro_batch", "gradient_checkpointing", "compile_blocks",
        "vllm_gpu_mem", "vllm_max_len", "vllm_tp", "vllm_sleep", "vllm_prefix_caching", "vllm_max_seqs",
        "vllm_kv_cache_gib", "ref_micro_batch", "sharding",
        # A safety policy, not arithmetic.
        "vllm_canary",
    }
)
"""TrainConfig keys a resumed run may change. Every other key is part of the run's identity:
it decides what is learned (data, models, loss, optimiser, seed, engine, dtype) or what is
measured (the eval set), so a save_dir whose config.yaml differs in one refuses to resume."""

FRESH_LORA_KEYS: tuple[str, ...] = ("lora_r", "lora_alpha", "use_rslora", "lora_targets")
"""The keys of a fresh LoRA: unused, and out of the run identity, when RL continues an SFT adapter (it keeps its
own rank, alpha, scaling and modules)."""

_DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _check_train_config(cfg: TrainConfig) -> None:
    """Range and consistency checks that the types alone cannot express."""
    for key in ("av_ckpt", "ar_ckpt", "rl_parquet", "save_dir"):
        require(getattr(cfg, key) != "", key, "", "give a path")
    require(
        cfg.temperature == 1.0, "temperature", cfg.temperature,
        "set it to 1.0: old_logp semantics require temperature 1.0",
    )
    for key in (
        "num_steps", "batch_prompts", "max_new_tokens", "lora_r", "lora_alpha",
        "logp_prompt_block", "critic_micro_batch", "max_explanation_tokens",
        "vllm_max_len", "vllm_tp", "vllm_max_seqs", "save_every",
    ):
        require(getattr(cfg, key) >= 1, key, getattr(cfg, key), "use an integer >= 1")
    for key in ("logp_micro_batch", "ref_micro_batch"):
        value = getattr(cfg, key)
        require(value == "auto" or value >= 1, key, value, "use an integer >= 1, or auto")
    for key in ("max_rows", "eval_max_new_tokens", "keep_last"):
        value = getattr(cfg, key)
        require(value is None or value >= 1, key, value, "use an integer >= 1 or null")
    for key in ("start_step", "eval_every", "eval_n_prompts", "vllm_sync_every", "length_margin"):
        require(getattr(cfg, key) >= 0, key, getattr(cfg, key), "use an integer >= 0")
    require(cfg.eval_skip_rows is None or cfg.eval_skip_rows >= 0, "eval_skip_rows", cfg.eval_skip_rows,
             "use an integer >= 0 or null")
    if cfg.eval_parquet is not None:
        require(cfg.eval_skip_rows is None, "eval_skip_rows", cfg.eval_skip_rows,
                 "leave it unset with eval_parquet (held-out rows then come from that file)")
    require(
        cfg.group_size >= 2, "group_size", cfg.group_size,
        "use an integer >= 2: a group of one has no baseline to compare against",
    )
    require(0 <= cfg.seed < 2**32, "seed", cfg.seed, "use 0 <= seed < 2**32 (numpy's range)")
    for key in ("lr", "critic_lr", "max_grad_norm", "tis_cap"):
        require(getattr(cfg, key) > 0, key, getattr(cfg, key), "use a number > 0")
    for key in ("clip_eps_high", "kl_clamp", "mismatch_threshold"):
        value = getattr(cfg, key)
        require(value is None or value > 0, key, value, "use a number > 0 or null")
    require(0 < cfg.clip_eps < 1 or (cfg.policy_loss == "cispo" and cfg.clip_eps >= 1), "clip_eps", cfg.clip_eps,
            "use 0 < clip_eps < 1 (with policy_loss=cispo, clip_eps >= 1 removes the lower clip)")
    _check_loss_choices(cfg)
    _check_fp8(cfg)
    require(cfg.kl_beta >= 0, "kl_beta", cfg.kl_beta, "use a number >= 0 (0 disables the KL term)")
    require(cfg.length_penalty >= 0, "length_penalty", cfg.length_penalty, "use a number >= 0 (0 disables it)")
    upper_clip = 1.0 + (cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high)
    require(
        cfg.tis != "ratio_cap" or cfg.tis_cap >= upper_clip, "tis_cap", cfg.tis_cap,
        f"with tis=ratio_cap use tis_cap >= 1 + clip_eps_high = {upper_clip:g}: a lower cap binds before the "
        "PPO clip on positive-advantage tokens",
    )
    require(0 < cfg.vllm_gpu_mem <= 1, "vllm_gpu_mem", cfg.vllm_gpu_mem, "use 0 < vllm_gpu_mem <= 1")
    require(cfg.vllm_kv_cache_gib is None or cfg.vllm_kv_cache_gib > 0, "vllm_kv_cache_gib", cfg.vllm_kv_cache_gib,
            "use a number of GiB > 0, or null to size the cache from vllm_gpu_mem")
    require(cfg.vllm_sleep in (0, 1, 2), "vllm_sleep", cfg.vllm_sleep, "use 0 (off), 1 or 2")
    require(
        cfg.vllm_sleep != 2 or cfg.vllm_sync_every == 1, "vllm_sleep", cfg.vllm_sleep,
        f"level 2 discards vLLM's weights and restores them by a push at every wake-up, which vllm_sync_every="
        f"{cfg.vllm_sync_every} does not allow: use vllm_sync_every=1, or vllm_sleep=1",
    )
    if cfg.vllm_quantization != "none":
        require(cfg.engine == "vllm", "vllm_quantization", cfg.vllm_quantization,
                f"it quantises vLLM's copy of the weights, and engine={cfg.engine} has none: set engine=vllm, or "
                "vllm_quantization=none")
        require(cfg.vllm_tp == 1, "vllm_quantization", cfg.vllm_quantization,
                f"a quantised push streams the weights into vLLM's in-process worker, and vllm_tp={cfg.vllm_tp} "
                "runs the workers in other processes: use vllm_tp=1, or vllm_quantization=none")
    require(
        _DEVICE_RE.fullmatch(cfg.device) is not None, "device", cfg.device,
        "use one of 'auto', 'cpu', 'cuda', 'cuda:N'",
    )
    # Only the window the config itself fixes is checked here; with max_rows unset the
    # data loader checks the parquet's length against eval_skip_rows.
    if cfg.eval_every > 0 and cfg.eval_n_prompts > 0 and None not in (cfg.max_rows, cfg.eval_skip_rows):
        require(
            cfg.max_rows <= cfg.eval_skip_rows, "max_rows", cfg.max_rows,
            f"training rows would overlap the eval rows starting at eval_skip_rows="
            f"{cfg.eval_skip_rows}; lower max_rows, raise eval_skip_rows, or set eval_every=0",
        )


def _check_loss_choices(cfg: TrainConfig) -> None:
    """The policy-loss, token-mask, sampling and critic keys of issue 30."""
    require(
        cfg.policy_loss != "onpolicy" or cfg.tis != "ratio_cap", "tis", cfg.tis,
        "policy_loss=onpolicy has no ratio for tis=ratio_cap to cap: use tis=none (EasyNLA) or a decoupled mode",
    )
    if cfg.token_mask is not None:
        band = cfg.token_mask
        require(len(band) == 2 and 0 < band[0] <= 1 <= band[1], "token_mask", list(band),
                "use low,high with 0 < low <= 1 <= high (IcePop: 0.5,2), or null")
    require(0 < cfg.top_entropy_quantile <= 1, "top_entropy_quantile", cfg.top_entropy_quantile,
            "use 0 < top_entropy_quantile <= 1 (1 keeps every token; the 80/20 paper's 0.2)")
    require(cfg.dynamic_sampling_max_draws >= 0, "dynamic_sampling_max_draws", cfg.dynamic_sampling_max_draws,
            "use an integer >= 0")
    if cfg.critic_ema is not None:
        require(0 < cfg.critic_ema < 1, "critic_ema", cfg.critic_ema, "use 0 < critic_ema < 1, or null")
        require(cfg.train_critic, "critic_ema", cfg.critic_ema, "it averages a co-trained critic: set train_critic=true")
    require(cfg.critic_rollouts == "all" or cfg.train_critic, "critic_rollouts", cfg.critic_rollouts,
            "it chooses the co-trained critic's pairs: set train_critic=true, or leave it at all")


def _check_fp8(cfg: TrainConfig) -> None:
    """fp8's phases against the keys that rule them out."""
    if not cfg.fp8:
        require(cfg.fp8_fast_accum == "off", "fp8_fast_accum", cfg.fp8_fast_accum,
                "it changes the FP8 products' accumulation: name fp8's phases, or leave it off")
        return
    phases = list(cfg.fp8)
    require(len(set(phases)) == len(phases), "fp8", phases,
            "name each phase once: a comma list of score, reference, update (and backward)")
    require("backward" not in phases or {"update", "score"} & set(phases), "fp8", phases,
            "backward puts the backwards of update and score in FP8: name update or score beside it")
    require(cfg.quant == "none", "fp8", phases, f"FP8 copies are made of full-precision weights, not quant={cfg.quant}: "
            "use quant=none, or leave fp8 empty")
