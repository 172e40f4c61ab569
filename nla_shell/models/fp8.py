"""FP8 copies of a backbone's Linear layers, swapped in for a block of work (`fp8=` of `nla train`).

`FP8Linears(backbone)` holds, per Linear layer of the backbone (peft's frozen `base_layer`s
included, the LoRA factors `lora_A` / `lora_B` never), the weight quantised per output row to
e4m3 (`nla_core.quantize_rowwise`); `with fp8_matmuls(copies):` routes those layers' forwards
through `nla_core.fp8_linear` (x quantised per row, `torch._scaled_mm`, bf16 out) and puts the
eager forwards back on exit. A frozen layer is differentiable in its input (`nla_core.fp8_linear_frozen`:
the backward is g @ W in the weight's own dtype, nothing for W), so a LoRA trains through it (the
policy update's base layers); a layer whose weight trains runs in FP8 only under no_grad. The bf16
weights stay where they are: weight pushes, the update's backward and the critic's step read them.

Memory: +1 byte per converted weight and 4 bytes per output row (the scale), held for the run by
frozen layers (quantised once, here); a layer whose weight trains (a co-trained AR's backbone) is
re-quantised from its current weight at the start of every block and its copy freed at the end,
so a stale copy cannot exist: a block after the critic's optimizer step reads the new weights
(and, with critic_ema, the EMA weights swapped in before the block).

Shape rule: a layer converts only when its in- and out-features are multiples of 16
(`SCALED_MM_MULTIPLE`, what `_scaled_mm` needs on Hopper); the others stay in the model's
dtype, and `summary()` says how many. The rule applies on every device, so a CPU run converts
the layers a GPU run would. Not measured on a GPU as of 2026-12-01 (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch import nn

import nla_core

SCALED_MM_MULTIPLE = 16
"""`torch._scaled_mm` on SM90 needs K (in-features) and M (out-features) multiples of 16."""
OUT_DTYPE = torch.bfloat16
"""The kernel's output dtype: rowwise-scaled `_scaled_mm` on Hopper writes bf16 only; the result is cast
to the input's dtype (a float32 model's layers then carry bf16 rounding too)."""
MIN_CAPABILITY = (9, 0)
"""Rowwise-scaled FP8 `_scaled_mm`: Hopper (9.0) or later (Ada's FP8 kernels take one scale per tensor only)."""


def require_fp8(device: torch.device, *, what: str = "config key 'fp8'") -> None:
    """ValueError naming the cause and the fix when `device` has no FP8 matrix products (the CPU has them)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < MIN_CAPABILITY:
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"{what} needs rowwise-scaled FP8 matmuls (compute capability >= 9.0, Hopper or later), "
                         f"but {device} is {major}.{minor}; leave fp8 empty on this GPU")


@dataclass
class _Quantised:
    weight: torch.Tensor
    """[M, K] float8_e4m3fn."""
    scale: torch.Tensor
    """[M, 1] float32."""


def _quantised(layer: nn.Linear) -> _Quantised:
    with torch.no_grad():
        return _Quantised(*nla_core.quantize_rowwise(layer.weight))


class FP8Linears:
    """The FP8 copies of `backbone`'s eligible Linear layers (see the module docstring).

    Args: backbone: the modules whose Linear layers convert (the AR's truncated backbone, the
      actor's decoder); label: the phase, for messages.
    """

    def __init__(self, backbone: nn.Module, *, label: str) -> None:
        self.label = label
        linears = [m for name, m in backbone.named_modules() if type(m) is nn.Linear and ".lora_" not in f".{name}"]
        self.layers = [m for m in linears
                       if m.in_features % SCALED_MM_MULTIPLE == 0 and m.out_features % SCALED_MM_MULTIPLE == 0]
        self.total = len(linears)
        self._frozen = {id(m): _quantised(m) for m in self.layers if not m.weight.requires_grad}
        self._active: dict[int, _Quantised] | None = None

    @property
    def refreshed(self) -> int:
        """Converted layers whose weights train: re-quantised at every block."""
        return len(self.layers) - len(self._frozen)

    def summary(self) -> str:
        """One start-up line: how many layers convert, why the others do not, what it holds."""
        skipped = self.total - len(self.layers)
        held = sum(m.weight.numel() + m.out_features * 4 for m in self.layers if id(m) in self._frozen)
        line = f"[fp8] {self.label}: {len(self.layers)} of {self.total} Linear layers in FP8"
        if skipped:
            line += f" ({skipped} not multiples of {SCALED_MM_MULTIPLE}: left in the model's dtype)"
        if self._frozen:
            line += f"; {len(self._frozen)} frozen, quantised once (+{held / 2**20:.1f} MiB)"
        if self.refreshed:
            line += f"; {self.refreshed} trained, re-quantised from the current weights at each block"
        return line

    def __enter__(self) -> FP8Linears:
        if self._active is not None:
            raise RuntimeError(f"[fp8] {self.label}: the FP8 matmuls are already active (no nesting)")
        for layer in self.layers:
            if "forward" in vars(layer):
                raise RuntimeError(f"[fp8] {self.label}: a Linear layer already has a forward of its own "
                                   "(compiled parts?); FP8 cannot be swapped in over it")
        # Trained weights are quantised here, from what they are now: after the latest optimizer step.
        self._active = {id(m): self._frozen[id(m)] if id(m) in self._frozen and not m.weight.requires_grad
                        else _quantised(m) for m in self.layers}
        for layer in self.layers:
            layer.forward = functools.partial(self._forward, layer, self._active[id(layer)])
        return self

    def __exit__(self, *exc: object) -> None:
        for layer in self.layers:
            del layer.forward
        self._active = None  # the trained layers' copies are freed

    def _forward(self, layer: nn.Linear, quantised: _Quantised, x: torch.Tensor) -> torch.Tensor:
        if not layer.weight.requires_grad:  # frozen: the gradient reaches x (g @ W in W's dtype), none W
            y = nla_core.fp8_linear_frozen(x, layer.weight, quantised.weight, quantised.scale, bias=layer.bias,
                                           out_dtype=OUT_DTYPE)
        elif torch.is_grad_enabled():
            raise RuntimeError(f"[fp8] {self.label}: an FP8 matmul gives a trained weight no gradient; "
                               "use it under torch.no_grad()")
        else:
            y = nla_core.fp8_linear(x, quantised.weight, quantised.scale, bias=layer.bias, out_dtype=OUT_DTYPE)
        return y.to(x.dtype)


def fp8_matmuls(copies: FP8Linears | None) -> contextlib.AbstractContextManager:
    """`copies` active for a `with` block; nothing when None (the phase runs in the model's dtype)."""
    return contextlib.nullcontext() if copies is None else copies

