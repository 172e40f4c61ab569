"""`sharding=fsdp2`: the actor and the critic sharded over the ranks with torch FSDP2.

Under `sharding=ddp` (the default) every rank holds both models whole (nla_shell.training.distributed).
Under `sharding=fsdp2` each decoder block is one `fully_shard` unit (the actor's frozen base with its
LoRA; the critic's trained block), then the actor's backbone and the whole critic (its float32 value
head a unit of its own) are the roots: a rank keeps 1/N of every unit and gathers a block only while
it runs, forward or backward. The reference pass is the same sharded actor with the adapter off.
Parameters keep their own dtypes, and gradients are reduced in float32 and summed, not averaged:
every rank's loss is already divided by the global count, as under ddp, so the sharded run steps on
the single-process gradient. The actor's input embedding stays whole on every rank (the log-prob
head reads the output embedding's weight directly, and a tied model shares it).

Every forward of a sharded unit is a collective: every rank must run the same forwards. The HF
engine keeps generation in lockstep (`synced_gpus`); the update's micro-batches match because every
rank holds the same number of whole groups; the critic's scoring and step add idle forwards where a
rank has fewer micro-batches (`spare_forwards`, `idle_forwards`). What would break that lockstep (or
needs a whole model in one place) is refused up front by `check_supported`.

Checkpoints: the LoRA and the critic are gathered whole for the save, so they export as an unsharded
run's do; the Adam moments (twice the trained weights) stay sharded, every rank writing its shard
through torch Distributed Checkpoint (`save_optimizer_shards`), which a resumed run reads back in
shards, with any number of ranks. A run of sharding=ddp resumed under fsdp2 cuts the whole moments it
loads (`shard_optimizer_state`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from nla_shell import families
from nla_shell.io.config import ConfigError
from nla_shell.models.common import AR_META_FILE, is_ar_lora_dir, sharded_over_ranks
from nla_shell.training import distributed

# --------------------------------------------------------------------------- what it can serve


def unservable(cfg: Any, world_size: int) -> list[str]:
    """The settings `sharding=fsdp2` cannot serve with `world_size` ranks, each as "key=value (why)"."""
    if cfg.sharding != "fsdp2":
        return []
    found = []
    if cfg.engine != "hf":
        found.append(f"engine={cfg.engine} (the native engine reads the whole actor directly; no vLLM engine has "
                     "received a sharded actor's streamed push; use engine=hf)")
    if cfg.quant != "none":
        found.append(f"quant={cfg.quant} (FSDP2 does not shard bitsandbytes' packed weights)")
    if is_ar_lora_dir(cfg.ar_ckpt) and (ar_quant := json.loads((Path(cfg.ar_ckpt) / AR_META_FILE).read_text())
                                        .get("quant", "none")) != "none":
        found.append(f"ar_ckpt={cfg.ar_ckpt} (an AR-LoRA trained on a {ar_quant} backbone, which it reloads "
                     "quantised; FSDP2 does not shard bitsandbytes' packed weights)")
    if cfg.fp8:
        found.append(f"fp8={','.join(cfg.fp8)} (the FP8 copies are made of whole weights)")
    if cfg.compile_blocks:
        found.append("compile_blocks=true (not tested with sharded blocks)")
    if cfg.critic_ema is not None:
        found.append(f"critic_ema={cfg.critic_ema} (the EMA swaps the critic's sharded weights; not built)")
    if world_size > 1:
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


# --------------------------------------------------------------------------- sharding the models


def _fully_shard(modules: list[torch.nn.Module], *, ignored: set[torch.nn.Parameter] | None = None) -> None:
    """fully_shard each module in order (children before their parent), in place.

    Parameters keep their own dtypes (param_dtype None: one rank's numbers are the unsharded run's);
    gradients are reduced in float32 and summed over ranks (SUM, not AVG: the losses carry the global
    denominator), which gloo serves too. The last module is the root; `ignored` stay whole on every rank.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for index, module in enumerate(modules):
        last = index == len(modules) - 1
        unit = fully_shard(module, mp_policy=policy, **({"ignored_params": ignored} if last and ignored else {}))
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)


def shard_actor(actor: torch.nn.Module) -> int:
    """fully_shard each decoder block of `actor` (base and LoRA), then the backbone as the root, in place;
    returns the number of blocks. Needs a process group (one rank will do) and the actor on its device."""
    blocks = list(families.decoder_blocks(actor))
    backbone = families.backbone(actor)
    # The embedding stays whole: a tied output embedding is the same tensor, read directly by the log-prob head.
    _fully_shard([*blocks, backbone], ignored=set(backbone.get_input_embeddings().parameters()))
    return len(blocks)


def shard_critic(critic: torch.nn.Module) -> int:
    """fully_shard each decoder block of the AR `critic`, its float32 value head, then the whole AR as the root
    (embedding, bypassed final norm, unused LM head), in place; returns the number of blocks."""
    blocks = list(families.decoder_blocks(critic.lm))
    # The value head is a unit of its own: FSDP2 reduces one dtype per unit, and it is float32 beside a bf16 embedding.
    _fully_shard([*blocks, critic.value_head, critic])
    return len(blocks)


# --------------------------------------------------------------------------- forwards in lockstep


def spare_forwards(model: torch.nn.Module, needed: int) -> int:
    """How many forwards this rank must add to its `needed` so that it runs as many as the busiest rank: every
    forward of a model sharded over ranks is a collective. 0 for a model that is not (a collective only then)."""
    if not sharded_over_ranks(model):
        return 0
    (most,) = distributed.all_reduce_max([needed])
    return int(most) - needed


def idle_forwards(ar: torch.nn.Module, count: int, *, pad_id: int, grad: bool) -> None:
    """`count` forwards of the AR on one pad token (and with `grad` the backward of zero times it): this rank's
    part in the collectives of forwards other ranks run on their inputs; they add nothing to any gradient."""
    device = ar.value_head.weight.device
    ids = torch.full((1, 1), pad_id, device=device)
    for _ in range(count):
        with torch.set_grad_enabled(grad):
            out = ar(ids, torch.ones_like(ids), right_padded=True)
        if grad:
            (out.sum() * 0.0).backward()


def _full(tensor: torch.Tensor) -> torch.Tensor | None:
    """The whole tensor of a DTensor (a collective), detached on rank 0's CPU (None on the other ranks, which
    save nothing: no host holds more than one copy); a plain tensor as it is, on the CPU."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().cpu() if distributed.is_main() else None


def full_trainable_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter, whole, on rank 0's CPU, by its state_dict name: PEFT's
    `save_pretrained(state_dict=)`. A collective under FSDP2: every rank calls it, in the same order."""
    return {name: _full(p) for name, p in module.named_parameters() if p.requires_grad}


def full_critic_state(critic: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The AR's `saved_tensors`, whole, on rank 0's CPU: `ARModel.save_pretrained(tensors=)`. A collective under
    FSDP2 (every rank calls it)."""
    return {name: _full(tensor) for name, tensor in critic.saved_tensors().items()}


Optimized = dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]
"""The optimisers a checkpoint holds, by name ("actor", "critic"), each with the model whose parameters it steps."""


def save_optimizer_shards(optimized: Optimized, directory: Path) -> None:
    """Every rank's shard of each optimiser's moments into `directory`, through torch Distributed Checkpoint (a
    collective: every rank calls it; nothing is gathered). Keys: the name, then DCP's (parameter names)."""
    from torch.distributed.checkpoint import FileSystemWriter, save
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = {name: get_optimizer_state_dict(model, optimizer) for name, (model, optimizer) in optimized.items()}
    save(state, storage_writer=FileSystemWriter(str(directory), sync_files=True))


def load_optimizer_shards(optimized: Optimized, directory: Path) -> None:
    """Each optimiser's moments from `save_optimizer_shards`' `directory`, this rank's shard of each (a collective;
    DCP re-cuts the shards when the number of ranks changed)."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {name: get_optimizer_state_dict(model, optimizer) for name, (model, optimizer) in optimized.items()}
    load(state, storage_reader=FileSystemReader(str(directory)))
    for name, (model, optimizer) in optimized.items():
        set_optimizer_state_dict(model, optimizer, state[name])


def shard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """After `load_state_dict` of a whole state (a checkpoint of sharding=ddp) into an optimizer of sharded
    parameters: each moment cut to this rank's shard, in place (no communication: every rank loaded the same
    whole state)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for param, moments in optimizer.state.items():
        if not isinstance(param, DTensor):
            continue
        for key, value in moments.items():
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == param.shape:
                moments[key] = distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                                                 src_data_rank=None)

