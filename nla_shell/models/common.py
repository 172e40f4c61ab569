"""What the actor and the critic share: checkpoint layouts, the LoRA config, padding, the HF LM under PEFT."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from nla_shell import families

VALUE_HEAD_FILE = "value_head.safetensors"
AR_LORA_FILE = "ar_lora_value_head.safetensors"
"""An AR-LoRA's trained tensors: its LoRA and value head (EasyNLA nla/train_sft.py, AR --use-lora save)."""
AR_META_FILE = "ar_meta.json"
"""How to rebuild an AR-LoRA around its frozen backbone (EasyNLA nla/train_sft.py, AR --use-lora save)."""


inner_lm = families.causal_lm
"""The HF *ForCausalLM under any PEFT wrapping (the name the trainer, engines and tests use)."""


def is_adapter_dir(path: str | Path) -> bool:
    """True for a PEFT LoRA adapter dir (e.g. `nla sft --mode av` output), False for a full checkpoint."""
    return (Path(path) / "adapter_config.json").exists()


def is_ar_lora_dir(path: str | Path) -> bool:
    """True for an AR-LoRA dir (EasyNLA's layout: `nla sft --mode ar ar_lora=true` output), False otherwise."""
    return (Path(path) / AR_META_FILE).exists()


def base_model_dir(ckpt: str | Path) -> Path:
    """The full model under a checkpoint: itself, the base of a LoRA adapter dir (an AV), or the
    base an AR-LoRA dir names (where its tokenizer also is)."""
    ckpt = Path(ckpt)
    if is_adapter_dir(ckpt):
        return Path(json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"])
    if is_ar_lora_dir(ckpt):
        return Path(json.loads((ckpt / AR_META_FILE).read_text()).get("base_model_name_or_path", ckpt))
    return ckpt


def lora_config(r: int, alpha: int, *, use_rslora: bool, targets: Sequence[str]):
    """The actor's adapter: LoRA on `targets` (families.lora_targets), no dropout (rsLoRA scaling
    alpha/sqrt(r) by default)."""
    from peft import LoraConfig

    return LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none",
        task_type="CAUSAL_LM", use_rslora=use_rslora,
    )



def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def sharded_over_ranks(model: nn.Module) -> bool:
    """True when FSDP2 shards `model` (sharding=fsdp2) over more than one rank: each of its forwards is then a
    collective, which every rank must run."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) and p.device_mesh.size() > 1 for p in model.parameters())

def pad_right(
    sequences: Sequence[Sequence[int] | torch.Tensor], pad_id: int, device: torch.device, *, min_width: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists or 1-D id tensors -> ([n, S] ids, [n, S] attention mask), padded on the right
    to S = max(min_width, longest)."""
    width = max(min_width, max(len(s) for s in sequences))
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = 1
    return ids.to(device), mask.to(device)


