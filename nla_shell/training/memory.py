"""The memory model: what a step holds on a GPU, part by part, and the micro-batches `auto` chooses from it.

One home for the arithmetic (pure; no torch, no GPU): `logp_micro_batch=auto` sizes micro-batches
from it, bench/memory_model.py prints its tables and checks it against every measured peak in
bench/results, and docs/training.md's FSDP2 table comes from it.

**auto.** At the reference's fixed micro-batch of 2 a small model on a large GPU spends most of its
update in host overhead (issue 28's trial, a 135M model on an H200, 32 x 8: the update took
27-31 s of a 30-37 s step at 2; the whole step 2.5-3.8 s at 64 with bf16_autocast). `auto` sizes each
micro-batch from the device memory free once the models and the rollout engine are loaded, by
`sequence_bytes`, the activation memory a sequence needs. On a CPU there is no such limit to read,
and `auto` is the reference's 2 (and the reference pass's 4 x 2) as before.

`sequence_bytes` counts, per token of a decoder block, the tensors autograd keeps for the backward
of a Qwen-style block with LoRA on q, k, v, o (norm inputs and outputs, the projections'
outputs, attention's q/k/v/output, the MLP's gate/up/activation/product): about 10 hidden,
4 KV and 4 intermediate widths in the model's dtype, plus PEFT's float32 copies of the four
LoRA inputs (bf16 with bf16_autocast). `auto` ignores prompt sharing (a group's prompt counts once
per sample) and takes half the free memory, so it errs towards smaller micro-batches by design: a
too-small micro-batch is slow, a too-large one is an out-of-memory error. The line `nla train`
prints says what it chose, and the keys override it.

**A step on one GPU** (`estimate`, `fitting`): the parts of one GRPO step of `nla train engine=vllm
train_critic=true` (and bench_step's), from a shape's geometry and the settings:

  resident (the whole step): the AV's frozen bf16 base (quant=8bit/4bit: its block matrices in 1 or
    0.5 bytes), the LoRA (float32, PEFT's) with its AdamW moments, the AR (embeddings, the blocks up to
    the extraction layer, the unused LM head unless tied, a float32 value head) and, co-trained, its
    AdamW moments over the whole backbone (ARModel.requires_grad_: a full fine-tune; torch AdamW's
    moments take the bf16 parameter's dtype, 2 x 2 bytes, AdamW8bit's 2 x 1), the step's rollouts, and
    vLLM's share when it never sleeps (vllm_sleep=0).
  rollout: vLLM's share of the GPU (vllm_gpu_mem x the GPU) while it is awake (vllm_sleep 1, 2), or its
    need (its bf16 weights + the KV cache of min(N, vllm_max_seqs) sequences) when larger; and one more
    bf16 copy of the AV's weights plus 1 GiB, a term FITTED to run AA (2026-12-01, one H200: the rollout
    phase held 3.5, 8.4 and 16.2 GiB above the rest of this estimate at 0.6B, 4B and 8B, where the AV's
    weights are 1.1, 7.5 and 15.3 GiB): blocks in torch's cache which vLLM cannot map its KV cache into.
    Run AB read 4.0 GiB of them at 1.7B, 15.2 at 8B, but 4.7 at 14B; run AC (2026-12-02) 15.2 at 8B, so
    the term is an upper bound. `bench/memory_model.py --check` reports the runs it was fitted to apart
    from the held-out ones.
  update: the LoRA's float32 gradients and one micro-batch's activations (`sequence_bytes`, a group's
    prompt counted once, as `training.prefix` computes it).
  critic: the AR's bf16 gradients and one critic micro-batch's activations.
  fp8 (`nla train fp8=`): e4m3 copies of the block matrices beside the bf16 ones (with `backward`, a
    transposed copy of each too), 1 byte per weight and a float32 scale per row, resident.

The step's peak is the resident parts plus its largest phase.

**Per GPU under sharding=fsdp2** (`fsdp2_estimate`): the same parts on each of N GPUs as nla shards
them (nla_shell.training.sharding): the actor's blocks and LoRA (with their float32 torch AdamW
moments and gradients) 1/N each, the embedding and head whole, the critic's weights, torch AdamW
moments and gradients 1/N, two gathered blocks in flight (the one running and the one prefetched),
rollouts by HF generate (its KV cache and the float32 logits it keeps) of the rank's 1/N of the batch.
vLLM with vllm_tp=N is given beside it (weights and KV cache 1/N each), not served with fsdp2 yet.
Not yet measured on a GPU.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

AUTO_CAP = 64
"""The largest micro-batch `auto` chooses: the one measured fast (issue 28), where host overhead is amortised."""
FREE_SHARE = 0.5
"""Share of the free memory the micro-batch's activations may take (the rest: allocator slack, optimizer
moments allocated at the first step, the critic's step, the logits of the log-prob head)."""
CPU_MICRO_BATCH = 2
"""`auto` on a CPU: the reference's logp_micro_batch."""
REFERENCE_FACTOR = 4
"""`ref_micro_batch=auto` where memory is not read: this many training micro-batches (no autograd state to keep)."""


def sequence_bytes(model_config: Any, tokens: int, *, grad: bool, dtype_bytes: int, lora_bytes: int,
                   gradient_checkpointing: bool = False) -> int:
    """Estimated peak activation bytes of one sequence of `tokens` in a forward (with backward when `grad`).

    Without grad only one block's transient tensors are alive at a time, plus each block's K and V of
    the shared prompt (counted over the whole sequence: an upper bound). With gradient checkpointing
    each block keeps only its input, and one block's full set is rebuilt at a time.
    """
    h = model_config.hidden_size
    layers = model_config.num_hidden_layers
    inter = getattr(model_config, "intermediate_size", 4 * h)
    heads = model_config.num_attention_heads
    kv = getattr(model_config, "num_key_value_heads", heads) * getattr(model_config, "head_dim", h // heads)
    block = dtype_bytes * (10 * h + 4 * kv + 4 * inter) + lora_bytes * 4 * h
    if not grad:
        return tokens * (block + layers * 2 * kv * dtype_bytes)
    if gradient_checkpointing:
        return tokens * (layers * h * dtype_bytes + block)
    return tokens * layers * block


def fit_micro_batch(free_bytes: int, per_sequence: int, *, cap: int = AUTO_CAP) -> int:
    """The largest power of two <= cap whose sequences fit in FREE_SHARE of `free_bytes`; at least 1."""
    fits = int(free_bytes * FREE_SHARE) // max(per_sequence, 1)
    size = 1
    while size * 2 <= min(fits, cap):
        size *= 2
    return size


def resolve_micro_batches(cfg: Any, model_config: Any, *, free_bytes: int | None, tokens: int, dtype_bytes: int,
                          resumed: Mapping[str, Any] | None = None) -> tuple[Any, str | None]:
    """`cfg` with logp_micro_batch and ref_micro_batch as numbers, and a line saying what `auto` chose (None
    when neither key was `auto`).

    A resumed run takes the numbers its checkpoint's config.yaml recorded, so the resumed steps sum their
    micro-batches in the order the first run did (exact resume); a new run reads `free_bytes` (None on a
    CPU: the reference's values). `tokens` is the longest sequence a micro-batch holds.
    """
    auto = [k for k in ("logp_micro_batch", "ref_micro_batch") if getattr(cfg, k) == "auto"]
    if not auto:
        return cfg, None
    lora_bytes = 2 if cfg.bf16_autocast else 4
    chosen: dict[str, int] = {}
    for key in auto:
        recorded = (resumed or {}).get(key)
        if isinstance(recorded, int):
            chosen[key] = recorded
        elif free_bytes is not None and not (resumed is not None and key not in resumed):
            # (A run saved before ref_micro_batch existed ran its reference pass by the 4x rule below.)
            chosen[key] = fit_micro_batch(free_bytes, sequence_bytes(
                model_config, tokens, grad=key == "logp_micro_batch", dtype_bytes=dtype_bytes, lora_bytes=lora_bytes,
                gradient_checkpointing=cfg.gradient_checkpointing))
    # On a CPU (no memory to read): the reference's micro-batch, and the reference pass's old 4x rule.
    if "logp_micro_batch" in auto:
        chosen.setdefault("logp_micro_batch", CPU_MICRO_BATCH)
    if "ref_micro_batch" in auto:
        chosen.setdefault("ref_micro_batch", REFERENCE_FACTOR * chosen.get("logp_micro_batch", cfg.logp_micro_batch))
    source = ("recorded by the run resumed" if resumed and all(isinstance(resumed.get(k), int) for k in auto)
              else "the reference's, on a CPU" if free_bytes is None
              else f"{free_bytes / 2**30:.1f} GiB free, sequences of {tokens} tokens")
    line = (f"[memory] {', '.join(f'{k}=auto -> {v}' for k, v in chosen.items())} ({source}); "
            "saved in config.yaml, set the keys to override")
    return dataclasses.replace(cfg, **chosen), line


# --------------------------------------------------------------------------- shapes

# The Qwen3 dense models' geometries, as their published Hugging Face config.json files give them
# (Qwen/Qwen3-*/config.json; the 4B, 8B, 14B and 32B files verbatim in citsjtu2020/LLM-Prof,
# sglang/Model_Config.md; 0.6B's verbatim in a stored copy of its model page; 0.6B and 1.7B's
# widths and depths also in marin-community/marin, experiments/qwen3.py). All share the vocabulary,
# head_dim 128 and 8 KV heads; the three smallest tie the LM head to the embeddings.
_QWEN3 = dict(vocab_size=151936, head_dim=128, num_key_value_heads=8)
QWEN3_SHAPES: dict[str, dict[str, Any]] = {
    "0.6b": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 tie_word_embeddings=True),
    "1.7b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 tie_word_embeddings=True),
    "4b": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               tie_word_embeddings=True),
    "8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               tie_word_embeddings=False),
    "14b": dict(_QWEN3, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                tie_word_embeddings=False),
    "32b": dict(_QWEN3, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                tie_word_embeddings=False),
}
SHAPES: dict[str, dict[str, Any]] = {
    **QWEN3_SHAPES,
    # Llama-3.3-70B's geometry as oumi's configs/recipes/llama3_3/README.md tables it (vulkomilev/oumi, a stored
    # copy); no q/k norms (their few parameters are counted anyway).
    "llama-3.3-70b": dict(vocab_size=128256, head_dim=128, num_key_value_heads=8, hidden_size=8192,
                          intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                          tie_word_embeddings=False),
}
"""Every shape the model knows: the Qwen3 dense models and Llama-3.3-70B."""
GIB = 2**30
H200_GIB = 139.0
"""The H200's memory as torch reports it (139.8 GiB total; the rest is the CUDA context's)."""
CRITIC_TEMPLATE_TOKENS = 8
"""Tokens the critic's prompt template adds to an explanation ("Text: {explanation}")."""
QUANT_BYTES = {"none": 2.0, "8bit": 1.0, "4bit": 0.5}
"""Bytes a block matrix takes under TrainConfig.quant (bitsandbytes keeps embeddings and norms in bf16)."""
HF_MAX_BATCH = 256
"""Sequences the HF engine generates together (HFRolloutEngine's max_batch)."""


def ar_extraction_layer(name: str) -> int:
    """The AR's extraction layer for shape `name`: two thirds of the depth (8B: 24 of 36, the layer every
    8B benchmark so far used)."""
    return round(2 * SHAPES[name]["num_hidden_layers"] / 3)


def block_params(shape: dict) -> tuple[int, int]:
    """(matrix, norm) parameters of one decoder block: q, k, v, o, gate, up, down; two norms and q/k norms."""
    h, inter, hd = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    return 2 * h * q + 2 * h * kv + 3 * h * inter, 2 * h + 2 * hd


def lora_params(shape: dict, r: int) -> int:
    """Parameters of the LoRA on q, k, v, o (families.lora_targets) over every block."""
    h, hd = shape["hidden_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    return shape["num_hidden_layers"] * r * ((h + q) * 2 + (h + kv) * 2)


def fp8_copy_bytes(shape: dict, layers: int, *, transposed: bool = False) -> float:
    """Bytes of FP8 copies of `layers` blocks' matrices: 1 per weight and a float32 scale per output row
    (transposed: per input column, the copy fp8=...,backward's input gradients read)."""
    h, inter, hd = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    rows = q + 2 * kv + h + 2 * inter + h  # q, k, v, o, gate, up, down
    columns = 3 * h + q + 2 * h + inter
    return layers * (block_params(shape)[0] + 4 * (columns if transposed else rows))


def outer_bytes(shape: dict, *, lm_head: bool) -> float:
    """Bytes of an LM's parameters outside its blocks: bf16 embeddings, final norm (and an untied LM head)."""
    embed = shape["vocab_size"] * shape["hidden_size"]
    head = embed if lm_head and not shape["tie_word_embeddings"] else 0
    return 2 * (embed + head + shape["hidden_size"])


def model_bytes(shape: dict, layers: int, *, matrix_bytes: float, lm_head: bool) -> float:
    """Bytes of an LM of `layers` blocks: bf16 embeddings, norms (and an untied LM head), blocks at matrix_bytes."""
    matrices, norms = block_params(shape)
    return layers * (matrices * matrix_bytes + norms * 2) + outer_bytes(shape, lm_head=lm_head)


# --------------------------------------------------------------------------- a step, part by part


@dataclasses.dataclass(frozen=True)
class Settings:
    """One step's settings; names follow bench_step's flags (TrainConfig's keys in the comments)."""

    prompts: int = 256
    group: int = 8
    prompt_len: int = 96
    new_tokens: int = 160  # max_new_tokens
    micro_batch: int = 64  # logp_micro_batch
    critic_micro_batch: int = 64  # critic_micro_batch
    lora_r: int = 128
    adamw8bit: bool = True  # bitsandbytes installed: runtime.make_optimizer picks AdamW8bit
    bf16_autocast: bool = True
    gradient_checkpointing: bool = False
    critic: bool = True  # train_critic
    ar_lora: bool = False  # an AR-LoRA checkpoint (nla sft --mode ar ar_lora=true): only its LoRA trains
    quant: str = "none"  # the AV's frozen base and a frozen or LoRA AR
    fp8_actor: bool = False  # fp8=reference and/or update: FP8 copies of the actor's base matrices
    fp8_score: bool = False  # fp8=score: FP8 copies of the AR backbone's matrices
    fp8_backward: bool = False  # fp8=...,backward: a transposed copy beside each (the actor's counted as with update)
    vllm_gpu_mem: float = 0.35
    vllm_sleep: int = 2
    vllm_max_seqs: int = 1024
    gpu_gib: float = H200_GIB


@dataclasses.dataclass
class Estimate:
    shape: str
    settings: Settings
    resident: dict[str, float]
    """GiB held through the whole step, by part."""
    phases: dict[str, dict[str, float]]
    """GiB each phase adds on top of the resident parts, by part."""
    vllm_need_gib: float
    """vLLM's weights + the KV cache of its concurrent sequences (its share should hold both); under fsdp2,
    per GPU with vllm_tp = the number of GPUs."""
    gpus: int | None = None
    """None: the one-GPU step; N: per GPU under sharding=fsdp2 over N GPUs (engine=hf: no vLLM share)."""

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda name: sum(self.phases[name].values()))

    def phase_total(self, phase: str) -> float:
        """GiB held during `phase`: the resident parts and the phase's own."""
        return sum(self.resident.values()) + sum(self.phases[phase].values())

    @property
    def total(self) -> float:
        return self.phase_total(self.peak_phase)

    @property
    def fits(self) -> bool:
        return self.total <= self.settings.gpu_gib

    @property
    def vllm_share_gib(self) -> float:
        return self.settings.vllm_gpu_mem * self.settings.gpu_gib

    @property
    def short_share(self) -> bool:
        """vLLM's share is below its need (it would preempt, or not start); never under fsdp2 (engine=hf)."""
        return self.gpus is None and self.settings.quant == "none" and self.vllm_need_gib > self.vllm_share_gib

    def what_does_not_fit(self) -> str:
        """'' when it fits; else the peak phase's parts, largest first, and by how much it is over."""
        if self.fits:
            return ""
        parts = {**self.resident, **self.phases[self.peak_phase]}
        largest = ", ".join(f"{k} {v:.1f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])[:3])
        return f"over by {self.total - self.settings.gpu_gib:.1f} GiB in the {self.peak_phase} phase ({largest} GiB)"


def _geometry(shape_name: str) -> tuple[dict, SimpleNamespace, SimpleNamespace, int]:
    """(shape, the actor's config, the AR's config, the AR's blocks) of a shape."""
    shape = SHAPES[shape_name]
    ar_layers = ar_extraction_layer(shape_name) + 1
    return shape, SimpleNamespace(**shape), SimpleNamespace(**dict(shape, num_hidden_layers=ar_layers)), ar_layers


def _critic_parts(shape_name: str, s: Settings) -> tuple[dict[str, float], dict[str, float]]:
    """The AR's (resident parts, critic-phase parts) in bytes: weights and, co-trained, moments; grads, activations."""
    shape, _, ar_config, ar_layers = _geometry(shape_name)
    h = shape["hidden_size"]
    # A frozen or LoRA AR may be quantised; a fully fine-tuned one stays bf16 (quant.require_quant).
    ar_matrix_bytes = QUANT_BYTES[s.quant] if (not s.critic or s.ar_lora) else 2.0
    ar_trained = (lora_params(ar_config.__dict__, s.lora_r) if s.ar_lora else
                  ar_layers * sum(block_params(shape)) + shape["vocab_size"] * h)
    resident = {"AR weights": model_bytes(shape, ar_layers, matrix_bytes=ar_matrix_bytes, lm_head=True) + 4 * h * h}
    if s.critic:
        # LoRA factors are float32 (moments 8 bytes under torch AdamW); the backbone bf16 (4 bytes, AdamW8bit 2).
        per_param = (2 if s.adamw8bit else 8) if s.ar_lora else (2 if s.adamw8bit else 4)
        resident["AR moments"] = ar_trained * per_param + h * h * (2 if s.adamw8bit else 8)
    activations = sequence_bytes(ar_config, s.new_tokens + CRITIC_TEMPLATE_TOKENS, grad=s.critic, dtype_bytes=2,
                                 lora_bytes=4 if s.ar_lora else 0)
    phase = {"AR grads": ((4 if s.ar_lora else 2) * ar_trained + 4 * h * h) * s.critic,
             "AR activations": min(s.critic_micro_batch, s.prompts * s.group) * activations}
    return resident, phase


def _policy_sequence_bytes(config: SimpleNamespace, s: Settings) -> int:
    """One training sequence's activations: its response and its share of the group's prompt (training.prefix)."""
    tokens = s.new_tokens + math.ceil(s.prompt_len / s.group)
    return sequence_bytes(config, tokens, grad=True, dtype_bytes=2, lora_bytes=2 if s.bf16_autocast else 4,
                          gradient_checkpointing=s.gradient_checkpointing)


def _kv_bytes_per_token(shape: dict) -> int:
    return shape["num_hidden_layers"] * 2 * shape["num_key_value_heads"] * shape["head_dim"] * 2


def estimate(shape_name: str, settings: Settings = Settings()) -> Estimate:
    """One step's memory on one GPU, part by part (GiB)."""
    s = settings
    shape, config, ar_config, ar_layers = _geometry(shape_name)
    layers = shape["num_hidden_layers"]
    lora = lora_params(shape, s.lora_r)
    critic_resident, critic_phase = _critic_parts(shape_name, s)
    resident = {
        "AV weights": model_bytes(shape, layers, matrix_bytes=QUANT_BYTES[s.quant], lm_head=True),
        # float32 LoRA factors; their moments float32 under torch AdamW, 1 byte each under AdamW8bit
        "LoRA + moments": lora * (4 + (2 if s.adamw8bit else 8)),
        **critic_resident,
    }
    concurrent = min(s.prompts * s.group, s.vllm_max_seqs or s.prompts * s.group)
    # With prefix caching a group's samples share their prompt's blocks.
    kv_tokens = concurrent * (s.new_tokens + s.prompt_len / s.group)
    vllm_weights = model_bytes(shape, layers, matrix_bytes=2.0, lm_head=True)
    vllm_need = vllm_weights + kv_tokens * _kv_bytes_per_token(shape)
    # vLLM takes its share; a share below its need preempts (or, below its weights, does not start), so
    # the need is what a step without preemption takes (`fitting` raises vllm_gpu_mem to it).
    share = max(s.vllm_gpu_mem * s.gpu_gib * GIB, vllm_need)
    # While vLLM is awake: its share, and (fitted to run AA: the module docstring) about one more bf16 copy of
    # the AV's weights in torch's cache. A quantised base rolls out with engine=hf: no vLLM.
    vllm_awake = {"vLLM share": share,
                  "torch's cache of the push (fitted to run AA, an upper bound)": vllm_weights + GIB}
    with_vllm = s.quant == "none"
    # The step's rollouts (ids, behaviour and reference log-probs, masks) kept until the update ends.
    resident["rollouts"] = s.prompts * s.group * (s.prompt_len + s.new_tokens) * 24
    if with_vllm and s.vllm_sleep == 0:
        resident.update(vllm_awake)
    if s.fp8_actor:
        resident["FP8 copies (actor)"] = fp8_copy_bytes(shape, layers)
        if s.fp8_backward:
            resident["FP8 transposed copies (actor)"] = fp8_copy_bytes(shape, layers, transposed=True)
    if s.fp8_score:
        resident["FP8 copies (AR)"] = fp8_copy_bytes(shape, ar_layers)
        if s.fp8_backward:
            resident["FP8 transposed copies (AR)"] = fp8_copy_bytes(shape, ar_layers, transposed=True)
    rollout = ((vllm_awake if s.vllm_sleep else {}) if with_vllm
               else {"generate's KV cache (engine=hf)": kv_tokens * _kv_bytes_per_token(shape)})
    phases = {
        "rollout": rollout,
        "update": {"LoRA grads": 4 * lora,
                   "policy activations": min(s.micro_batch, s.prompts * s.group) * _policy_sequence_bytes(config, s)},
        "critic": critic_phase,
    }
    return Estimate(shape_name, s, _gib(resident), {k: _gib(v) for k, v in phases.items()}, vllm_need / GIB)


def fsdp2_estimate(shape_name: str, gpus: int, settings: Settings = Settings()) -> Estimate:
    """One step's memory per GPU under sharding=fsdp2 over `gpus` GPUs, part by part (GiB), as nla shards it: the
    actor's blocks and LoRA 1/N (embedding and head whole), the critic 1/N, two gathered blocks in flight,
    rollouts by HF generate of the rank's 1/N of the batch."""
    s = settings
    shape, config, _, _ = _geometry(shape_name)
    layers, vocab = shape["num_hidden_layers"], shape["vocab_size"]
    matrices, norms = block_params(shape)
    block = matrices * QUANT_BYTES["none"] + norms * 2
    lora = lora_params(shape, s.lora_r)
    samples = math.ceil(s.prompts * s.group / gpus)
    # torch AdamW on sharded parameters (bitsandbytes takes no DTensor): the LoRA's moments float32, a trained
    # AR backbone's in its bf16. The AR's weights, moments and gradients are sharded 1/N like the actor's.
    critic_resident, critic_phase = _critic_parts(shape_name, dataclasses.replace(s, prompts=samples, group=1,
                                                                                   adamw8bit=False))
    critic_resident = {f"{k} (1/N)": v / gpus for k, v in critic_resident.items()}
    critic_phase = {"AR grads (1/N)": critic_phase["AR grads"] / gpus, "AR activations": critic_phase["AR activations"],
                    "gathered AR blocks (running + prefetched)": 2 * block}
    resident = {
        "actor blocks (1/N)": layers * block / gpus,
        "actor embedding + head (whole)": outer_bytes(shape, lm_head=True),
        "LoRA + moments (1/N)": lora * (4 + 8) / gpus,
        **critic_resident,
        "rollouts": samples * (s.prompt_len + s.new_tokens) * 24,
    }
    in_flight = {"gathered blocks (running + prefetched)": 2 * block}
    concurrent = min(samples, HF_MAX_BATCH)
    # HF generate: no prefix caching (each sample its own prompt), and it keeps each step's float32 logits.
    hf_kv = concurrent * (s.prompt_len + s.new_tokens) * _kv_bytes_per_token(shape)
    phases = {
        "rollout": {**in_flight, "generate's KV cache": hf_kv,
                    "generate's kept logits (float32)": concurrent * s.new_tokens * vocab * 4},
        "update": {**in_flight, "LoRA grads (1/N)": 4 * lora / gpus,
                   "policy activations": min(s.micro_batch, samples) * _policy_sequence_bytes(config, s)},
        "critic": critic_phase,
    }
    kv_tokens = min(samples * gpus, s.vllm_max_seqs) * (s.new_tokens + s.prompt_len / s.group)
    vllm_tp = (model_bytes(shape, layers, matrix_bytes=2.0, lm_head=True)
               + kv_tokens * _kv_bytes_per_token(shape)) / gpus
    return Estimate(shape_name, s, _gib(resident), {k: _gib(v) for k, v in phases.items()}, vllm_tp / GIB, gpus=gpus)


def _gib(parts: dict[str, float]) -> dict[str, float]:
    return {k: v / GIB for k, v in parts.items()}


# --------------------------------------------------------------------------- what makes a case fit


_OPTIONS = (
    # (applies to the settings, the settings after it, the TrainConfig key it names, served under fsdp2)
    (lambda s, e: s.quant == "none" and s.vllm_gpu_mem * s.gpu_gib < e.vllm_need_gib,
     lambda s, e: dataclasses.replace(s, vllm_gpu_mem=math.ceil(20 * e.vllm_need_gib / s.gpu_gib) / 20),
     "vllm_gpu_mem={vllm_gpu_mem}", False),
    (lambda s, e: not s.adamw8bit, lambda s, e: dataclasses.replace(s, adamw8bit=True),
     "AdamW8bit (pip install 'nla[bnb]')", False),
    (lambda s, e: s.quant == "none" and s.vllm_sleep == 0, lambda s, e: dataclasses.replace(s, vllm_sleep=2),
     "vllm_sleep=2", False),
    (lambda s, e: s.micro_batch > 8, lambda s, e: dataclasses.replace(s, micro_batch=s.micro_batch // 2),
     "logp_micro_batch={micro_batch}", True),
    (lambda s, e: s.critic_micro_batch > 8,
     lambda s, e: dataclasses.replace(s, critic_micro_batch=s.critic_micro_batch // 2),
     "critic_micro_batch={critic_micro_batch}", True),
    (lambda s, e: not s.gradient_checkpointing, lambda s, e: dataclasses.replace(s, gradient_checkpointing=True),
     "gradient_checkpointing=true", True),
    (lambda s, e: s.critic and not s.ar_lora, lambda s, e: dataclasses.replace(s, ar_lora=True),
     "an AR-LoRA ar_ckpt (nla sft --mode ar ar_lora=true)", True),
    (lambda s, e: s.quant == "none", lambda s, e: dataclasses.replace(s, quant="8bit"), "quant=8bit (engine=hf)", False),
    (lambda s, e: s.quant == "8bit", lambda s, e: dataclasses.replace(s, quant="4bit"), "quant=4bit (engine=hf)", False),
)
"""The options `fitting` tries, cheapest first."""


def fitting(shape_name: str, settings: Settings = Settings(), *, gpus: int | None = None) -> tuple[Estimate, list[str]]:
    """The estimate with the existing options that make it fit, and those options as TrainConfig keys.

    Greedy, cheapest first (vLLM's share up to its need, AdamW8bit, sleeping vLLM, halved micro-batches
    down to 8, gradient checkpointing, an AR-LoRA, quant=8bit then 4bit; under fsdp2 (`gpus`) only the
    micro-batches, gradient checkpointing and the AR-LoRA, the options it serves): each round takes the first option that lowers the
    peak (a smaller micro-batch does not help a step whose peak is the rollout, and helps again once quant=
    drops vLLM), until the estimate fits or no option helps; then the last estimate.
    """
    def run(s: Settings) -> Estimate:
        return estimate(shape_name, s) if gpus is None else fsdp2_estimate(shape_name, gpus, s)

    current, applied = run(settings), []
    while not current.fits or current.short_share:
        for applies, apply, label, under_fsdp2 in _OPTIONS:
            if (gpus is not None and not under_fsdp2) or not applies(current.settings, current):
                continue
            candidate = run(apply(current.settings, current))
            # vLLM's share raised to its need adds memory, and is kept: below it vLLM preempts or does not start.
            if candidate.total < current.total or current.short_share and not candidate.short_share:
                current = candidate
                applied.append(label.format(**dataclasses.asdict(current.settings)))
                break
        else:
            break
    # A micro-batch halved twice reads as its last value only; vLLM's settings go with quant= (engine=hf).
    with_vllm = current.settings.quant == "none"
    latest = {label.split("=")[0]: label for label in applied if with_vllm or not label.startswith("vllm_")}
    return current, list(latest.values())
