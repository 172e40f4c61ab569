"""`logp_micro_batch=auto` / `ref_micro_batch=auto`: micro-batches chosen from the memory left free.

At the reference's fixed micro-batch of 2 a small model on a large GPU spends most of its
update in host overhead (issue 28's trial, a 135M model on an H200, 32 x 8: the update took
27-31 s of a 30-37 s step at 2; the whole step 2.5-3.8 s at 64 with bf16_autocast). `auto` sizes each micro-batch from the device memory free once the
models and the rollout engine are loaded, by an estimate of the activation memory a sequence
needs. On a CPU there is no such limit to read, and `auto` is the reference's 2 (and the
reference pass's 4 x 2) as before.

The estimate counts, per token of a decoder block, the tensors autograd keeps for the backward
of a Qwen-style block with LoRA on q, k, v, o (norm inputs and outputs, the projections'
outputs, attention's q/k/v/output, the MLP's gate/up/activation/product): about 10 hidden,
4 KV and 4 intermediate widths in the model's dtype, plus PEFT's float32 copies of the four
LoRA inputs (bf16 with bf16_autocast). It ignores prompt sharing (a group's prompt counts once
per sample) and takes half the free memory, so it errs towards smaller micro-batches by design: a
too-small micro-batch is slow, a too-large one is an out-of-memory error. Not yet checked against
measured peaks on a GPU: the line `nla train` prints says what it chose, and the keys override it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
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
