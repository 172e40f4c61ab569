"""The actor's current weights, LoRA merged out of place, named and bucketed for an engine.

The actor's base weights are never written: each adapted weight is merged into a new
tensor with `nla_core.merge_lora_weight` (float32 accumulate, one rounding), so repeated
syncs cannot drift them the way an in-place bf16 merge/unmerge does.

An actor sharded by FSDP2 (sharding=fsdp2) streams the same way: each bucket (one decoder
block) is gathered whole as it is handed out, merged, and freed once the engine has it, so
the push never holds more than one block whole. The gathers are collectives: every rank
iterates the buckets together.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

import nla_core

Bucket = tuple[str, list[tuple[str, torch.Tensor]]]


def _lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Module name -> PEFT LoRA layer, for every LoRA-wrapped module."""
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def merged_weight(module: nn.Module) -> torch.Tensor:
    """A PEFT LoraLayer's base weight with its active adapters merged in, as a new tensor.

    Returns:
      [O, I] in the base weight's dtype and device.
    Raises:
      ValueError when the adapter is already merged into the base (it would count twice);
      NotImplementedError for LoRA variants this merge does not reproduce (DoRA, LoRA bias,
      fan_in_fan_out, embedding LoRA).
    """
    if module.merged:
        raise ValueError(
            "the actor's adapter is merged into its base weights; unmerge it before a sync "
            "(the sync merges out of place itself)"
        )
    weight = _whole(module.get_base_layer().weight)
    if module.disable_adapters:
        return weight
    merged = weight
    for adapter in module.active_adapters:
        if adapter in getattr(module, "lora_embedding_A", {}):
            raise NotImplementedError(f"embedding LoRA ({adapter!r}) is not supported by the weight sync")
        if adapter not in module.lora_A:
            continue
        if adapter in getattr(module, "lora_variant", {}) or module.lora_bias.get(adapter, False):
            raise NotImplementedError(f"adapter {adapter!r} is a LoRA variant (DoRA or LoRA bias); merge unsupported")
        if getattr(module, "fan_in_fan_out", False):
            raise NotImplementedError("fan_in_fan_out LoRA layers are not supported by the weight sync")
        merged = nla_core.merge_lora_weight(
            merged,
            _whole(module.lora_A[adapter].weight),
            _whole(module.lora_B[adapter].weight),
            scaling=float(module.scaling[adapter]),
        )
    return merged


def iter_merged_weight_buckets(peft_model: nn.Module, *, device: torch.device | str | None = "cpu") -> Iterator[Bucket]:
    """Like `merged_weight_buckets`, one bucket at a time, so at most one bucket of merged
    copies exists at once. device=None leaves every tensor where the actor holds it
    (unadapted weights are then the actor's own tensors, detached, not copies).
    """
    lora = _lora_layers(peft_model)
    named: list[tuple[str, torch.Tensor]] = []
    adapted: dict[str, nn.Module] = {}  # hf name -> the LoRA layer whose merge replaces it
    for name, tensor in peft_model.state_dict().items():
        if "original_module" in name:
            raise NotImplementedError(f"modules_to_save ({name}) is not supported by the weight sync")
        hf_name = nla_core.hf_param_name(name)
        if hf_name is None:
            continue
        named.append((hf_name, tensor))
        owner = name.removesuffix(".base_layer.weight")
        if owner != name and owner in lora:
            adapted[hf_name] = lora[owner]
    # Bucketed on the base tensors; merges happen only as each bucket is handed out.
    for bucket, entries in nla_core.layer_buckets(named):
        yield bucket, [(name, _materialise(adapted.get(name), tensor, device)) for name, tensor in entries]


def merged_weight_buckets(peft_model: nn.Module, *, device: torch.device | str | None = "cpu") -> list[Bucket]:
    """[(bucket, [(hf_name, tensor)])]: the LoRA-merged weights under HF/vLLM names.

    Buckets follow `nla_core.layer_buckets` ("other" first, then "layers.<i>" in numeric
    order); names follow `nla_core.hf_param_name` (adapter tensors dropped). Tensors are
    detached copies on `device` (CPU by default, what a multiprocess engine can receive).
    The model's own parameters are left bit-identical.
    """
    return list(iter_merged_weight_buckets(peft_model, device=device))


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor detached; a DTensor (an FSDP2 shard) gathered whole first (a collective)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor().detach() if isinstance(tensor, DTensor) else tensor.detach()


def _materialise(layer: nn.Module | None, tensor: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """The value to push for one state-dict tensor: merged when `layer` adapts it."""
    from torch.distributed.tensor import DTensor

    value = merged_weight(layer) if layer is not None else _whole(tensor)
    if device is None:
        return value
    moved = value.to(device)
    # .to() hands back the model's own storage when it is already on `device` (a one-rank gather too): copy it.
    own = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return moved.clone() if moved.data_ptr() == own.data_ptr() else moved
