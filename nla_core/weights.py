"""Moving trained weights into an inference engine: names, buckets, LoRA merge."""

from __future__ import annotations

import re
from typing import Iterable

import torch

from nla_core._checks import float32_or_wider, require_floating, require_ndim

__all__ = [
    "hf_param_name",
    "layer_buckets",
    "merge_lora_weight",
]

_PEFT_PREFIX = "base_model.model."
_LORA_PART = re.compile(r"(^|\.)lora_")
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def hf_param_name(peft_name: str) -> str | None:
    """The HF/vLLM name of a PEFT-wrapped model's state-dict entry, or None for adapter parts.

    "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
      -> "model.layers.0.self_attn.q_proj.weight";
    lora_* and modules_to_save entries -> None. Idempotent on plain names.
    """
    if _LORA_PART.search(peft_name) or "modules_to_save" in peft_name:
        return None
    name = peft_name[len(_PEFT_PREFIX):] if peft_name.startswith(_PEFT_PREFIX) else peft_name
    return name.replace(".base_layer.weight", ".weight").replace(".base_layer.bias", ".bias")


def layer_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, list[tuple[str, torch.Tensor]]]]:
    """Group tensors for a bucketed weight push: non-layer tensors first, then layer by layer.

    Buckets are ("other", [...]) when any tensor is outside `layers.<i>.`, then
    ("layers.<i>", [...]) in ascending numeric i (layer 10 after layer 9). Every tensor
    appears exactly once, in its input order within its bucket; empty buckets are omitted.
    """
    other: list[tuple[str, torch.Tensor]] = []
    by_layer: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named_tensors:
        match = _LAYER_INDEX.search(name)
        if match is None:
            other.append((name, tensor))
        else:
            by_layer.setdefault(int(match.group(1)), []).append((name, tensor))
    buckets = [("other", other)] if other else []
    buckets += [(f"layers.{i}", by_layer[i]) for i in sorted(by_layer)]
    return buckets


def merge_lora_weight(
    base: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    *,
    scaling: float,
) -> torch.Tensor:
    """W' = W + scaling * B @ A, accumulated in float32 and rounded once to W's dtype.

    Out-of-place: `base` is never modified, so the trainer's weights cannot drift over
    repeated merges (an in-place merge/unmerge in bf16 does not round-trip exactly).

    Args:
      base: [O, I]; lora_A: [r, I]; lora_B: [O, r].
    Returns:
      [O, I] in base's dtype, on base's device.
    """
    for name, x in (("base", base), ("lora_A", lora_A), ("lora_B", lora_B)):
        require_floating(name, x)
        require_ndim(name, x, 2, "a matrix")
    out_f, in_f = base.shape
    rank = lora_A.shape[0]
    if lora_A.shape[1] != in_f or lora_B.shape != (out_f, rank):
        raise ValueError(
            f"expected base [O, I], lora_A [r, I], lora_B [O, r]; got base {tuple(base.shape)}, "
            f"lora_A {tuple(lora_A.shape)}, lora_B {tuple(lora_B.shape)}"
        )
    acc = float32_or_wider(base)
    delta = lora_B.to(device=base.device, dtype=acc.dtype) @ lora_A.to(device=base.device, dtype=acc.dtype)
    return (acc + scaling * delta).to(base.dtype)
