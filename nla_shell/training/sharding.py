"""`sharding=fsdp2`: the actor's decoder blocks sharded over the ranks with torch FSDP2.

Under `sharding=ddp` (the default) every rank holds the whole actor (nla_shell.training.distributed).
Under `sharding=fsdp2` each decoder block of the actor (its frozen base and its LoRA) is one
`fully_shard` unit and the backbone is the root: a rank keeps 1/N of every block and gathers a
block only while that block runs, forward or backward. The reference pass is the same sharded
model with the adapter off. Parameters keep their own dtypes (the base in the run's dtype, bf16
on a GPU; the LoRA in float32) and gradients are reduced in float32, summed, not averaged:
every rank's loss is already divided by the global count, as under ddp, so the sharded run
steps on the single-process gradient.

What stays whole on every rank: the input embedding (the log-prob head reads the output
embedding's weight directly, and a tied model shares it with the input embedding) and the
log-prob head; the critic (this module does not shard it yet).

Every forward of a sharded block is a collective: every rank must run the same forwards. The
HF engine keeps generation in lockstep (`synced_gpus`); the update's micro-batches match because
every rank holds the same number of whole groups. What would break that lockstep (or needs the
whole actor in one place) is refused up front by `check_supported`.

Checkpoints stay in the unsharded format: the trainable state (the LoRA and its Adam moments, a
few percent of the base) is gathered to every rank for the save, and a resumed run shards the
full moments it loads (`shard_optimizer_state`). A run may therefore switch between ddp and
fsdp2 on resume.
"""

from __future__ import annotations

from typing import Any

import torch

from nla_shell import families
from nla_shell.io.config import ConfigError

# --------------------------------------------------------------------------- what it can serve


def unservable(cfg: Any, world_size: int) -> list[str]:
    """The settings `sharding=fsdp2` cannot serve with `world_size` ranks, each as "key=value (why)"."""
    if cfg.sharding != "fsdp2":
        return []
    found = []
    if cfg.engine != "hf":
        found.append(f"engine={cfg.engine} (needs the whole actor: the native engine reads it directly, vLLM's push "
                     "of a sharded actor is not built; use engine=hf)")
    if cfg.quant != "none":
        found.append(f"quant={cfg.quant} (FSDP2 does not shard bitsandbytes' packed weights)")
    if cfg.fp8:
        found.append(f"fp8={','.join(cfg.fp8)} (the FP8 copies are made of whole weights)")
    if cfg.compile_blocks:
        found.append("compile_blocks=true (not tested with sharded blocks)")
    if cfg.gradient_checkpointing:
        found.append("gradient_checkpointing=true (not tested with sharded blocks)")
    if world_size > 1:
        if cfg.eval_every > 0 and cfg.eval_n_prompts > 0:
            found.append(f"eval_every={cfg.eval_every} (the held-out eval runs on rank 0 alone, and a sharded "
                         "forward needs every rank; set eval_every=0)")
        if cfg.dynamic_sampling:
            found.append("dynamic_sampling=true (ranks would keep different numbers of groups, so different "
                         "numbers of sharded forwards)")
    return found


def check_supported(cfg: Any, world_size: int) -> None:
    """ConfigError, one line naming every key `sharding=fsdp2` cannot serve here; nothing when it can."""
    found = unservable(cfg, world_size)
    if found:
        raise ConfigError(
            f"config key 'sharding' = 'fsdp2' cannot serve {'; '.join(found)}: change those keys, or use sharding=ddp"
        )


# --------------------------------------------------------------------------- sharding the actor


def shard_actor(actor: torch.nn.Module) -> int:
    """fully_shard each decoder block of `actor` (base and LoRA), then the backbone as the root, in place;
    returns the number of blocks.

    Needs a process group (one rank will do) and the actor on its device. Gradients of the
    trainable parameters are summed over ranks in float32 (SUM, not AVG: the losses carry the
    global denominator), which gloo serves too.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # param_dtype None: each parameter computes in its own dtype, so one rank's numbers are the unsharded run's.
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    blocks = list(families.decoder_blocks(actor))
    backbone = families.backbone(actor)
    units = []
    for block in blocks:
        units.append(fully_shard(block, mp_policy=policy))
    # The embedding stays whole: a tied output embedding is the same tensor, read directly by the log-prob head.
    embedding = backbone.get_input_embeddings()
    units.append(fully_shard(backbone, mp_policy=policy, ignored_params=set(embedding.parameters())))
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return len(blocks)


def is_sharded(module: torch.nn.Module) -> bool:
    """True when some parameter of `module` is a DTensor (FSDP2 sharded it)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective), detached on the CPU; a plain tensor as it is, on the CPU."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().cpu()


def full_trainable_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter, whole, on the CPU, by its state_dict name: PEFT's `save_pretrained(state_dict=)`.

    A collective under FSDP2: every rank calls it, in the same order (named_parameters').
    """
    return {name: _full(p) for name, p in module.named_parameters() if p.requires_grad}


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer.state_dict()` with every sharded moment gathered whole: the unsharded run's format.

    A collective under FSDP2 (every rank calls it). The optimizer's own state is left as it is.
    """
    saved = optimizer.state_dict()
    state = {index: {key: _full(value) if isinstance(value, torch.Tensor) and value.dim() else value
                     for key, value in moments.items()}
             for index, moments in saved["state"].items()}
    return {**saved, "state": state}


def shard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """After `load_state_dict` of a whole state into an optimizer of sharded parameters: each moment cut to
    this rank's shard, in place (no communication: every rank loaded the same whole state)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for param, moments in optimizer.state.items():
        if not isinstance(param, DTensor):
            continue
        for key, value in moments.items():
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == param.shape:
                moments[key] = distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                                                 src_data_rank=None)

