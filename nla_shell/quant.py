"""Quantised frozen weights (bitsandbytes): EasyNLA's single-GPU path.

`quant=4bit` (NF4, double-quantised, compute in the run's dtype) or `quant=8bit`
(LLM.int8) loads the AV's base weights quantised, with the LoRA trained on top in full
precision (QLoRA), and the AR's backbone quantised: frozen, or with a LoRA trained on it
and the float32 value head (EasyNLA's AR-LoRA: `nla sft --mode ar ar_lora=true`, then
`train_critic` trains that LoRA and head). bitsandbytes is an optional extra that runs on
CUDA only: every refusal happens before anything is loaded or written.
"""

from __future__ import annotations

from typing import Any

import torch

INSTALL_HINT = "pip install 'nla[bnb]' (bitsandbytes)"


def require_quant(
    quant: str,
    device: torch.device,
    *,
    engine: str = "hf",
    trains_ar_backbone: bool = False,
    what: str = "config key 'quant'",
) -> None:
    """ValueError naming the cause and the fix when `quant` cannot run here; nothing for quant=none.

    Args:
      device: where the models will live (bitsandbytes kernels are CUDA only).
      engine: the rollout engine (the native and vLLM engines read full-precision weights).
      trains_ar_backbone: the run fine-tunes the AR's whole backbone (no AR-LoRA), which a
        quantised load freezes.
      what: where `quant` was set, for the message.
    """
    if quant == "none":
        return
    if device.type != "cuda":
        raise ValueError(f"{what} = {quant!r} needs a CUDA device (bitsandbytes), but device is "
                         f"{device}; use quant=none on CPU")
    if engine != "hf":
        raise ValueError(f"{what} = {quant!r} works with engine=hf only (engine={engine} reads "
                         "full-precision weights); set engine=hf or quant=none")
    if trains_ar_backbone:
        raise ValueError(f"{what} = {quant!r} freezes the AR's quantised backbone, so only a LoRA on it can train: "
                         "use sft --mode ar ar_lora=true (and that AR as ar_ckpt for train_critic), or quant=none")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ValueError(f"{what} = {quant!r} needs bitsandbytes: {INSTALL_HINT}") from None


def load_kwargs(quant: str, *, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """Extra `from_pretrained` keyword arguments that load the weights quantised onto `device`."""
    if quant == "none":
        return {}
    from transformers import BitsAndBytesConfig

    if quant == "4bit":
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                    bnb_4bit_compute_dtype=dtype)
    elif quant == "8bit":
        config = BitsAndBytesConfig(load_in_8bit=True)
    else:
        raise ValueError(f"config key 'quant' = {quant!r} is invalid: use none, 4bit or 8bit")
    return {"quantization_config": config, "device_map": {"": device}}
