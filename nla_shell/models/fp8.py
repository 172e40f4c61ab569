"""FP8 copies of a backbone's Linear layers, swapped in for a block of work (`fp8=` of `nla train`).

`FP8Linears(backbone)` holds, per Linear layer of the backbone (peft's frozen `base_layer`s
included, the LoRA factors `lora_A` / `lora_B` never), the weight quantised per output row to
e4m3 (`nla_core.quantize_rowwise`); `with fp8_matmuls(copies):` routes those layers' forwards
through `nla_core.fp8_linear_ste` (x quantised per row, `torch._scaled_mm`, bf16 out) and puts the
eager forwards back on exit. The backward is the linear map's, in the weight's own dtype
(straight-through): g @ W to the input, and g^T @ x to a weight that trains (a co-trained AR's
backbone, which scores and takes its step on one forward), nothing to a frozen one (a LoRA's base
layers). The bf16 weights stay where they are: weight pushes, the backwards and the optimizers read them.

Memory: +1 byte per converted weight and 4 bytes per output row (the scale), held for the run.
A frozen layer is quantised once, here; a layer whose weight trains is re-quantised from its
current weight, in place, at the start of every block, so a stale copy cannot exist: a block
after the critic's optimizer step reads the new weights (and, with critic_ema, the EMA weights
swapped in before the block).

Compiled blocks (`compile_blocks`): each layer's FP8 forward is made once, and its copies are
updated in place, so a compiled MLP or LoRA layer that calls it sees the same function and tensors
at every block: dynamo keeps two graphs (FP8 on and off) instead of tracing the swap again.

Shape rule: a layer converts only when its in- and out-features are multiples of 16
(`SCALED_MM_MULTIPLE`, what `_scaled_mm` needs on Hopper); the others stay in the model's
dtype, and `summary()` says how many. The rule applies on every device, so a CPU run converts
the layers a GPU run would.
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

    @classmethod
    def of(cls, layer: nn.Linear) -> _Quantised:
        with torch.no_grad():
            return cls(*nla_core.quantize_rowwise(layer.weight))

    def refresh(self, layer: nn.Linear) -> None:
        """Re-quantised from the layer's current weight, into the same tensors."""
        with torch.no_grad():
            weight, scale = nla_core.quantize_rowwise(layer.weight)
            self.weight.copy_(weight)
            self.scale.copy_(scale)


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
        self._copies = {id(m): _Quantised.of(m) for m in self.layers}
        # One forward per layer for the run: compiled callers then see the same function at every block.
        self._forwards = {id(m): functools.partial(_fp8_forward, m, self._copies[id(m)]) for m in self.layers}
        self._active = False

    @property
    def refreshed(self) -> int:
        """Converted layers whose weights train: re-quantised at every block."""
        return sum(m.weight.requires_grad for m in self.layers)

    def summary(self) -> str:
        """One start-up line: how many layers convert, why the others do not, what it holds."""
        skipped = self.total - len(self.layers)
        held = sum(m.weight.numel() + m.out_features * 4 for m in self.layers)
        line = f"[fp8] {self.label}: {len(self.layers)} of {self.total} Linear layers in FP8"
        if skipped:
            line += f" ({skipped} not multiples of {SCALED_MM_MULTIPLE}: left in the model's dtype)"
        if frozen := len(self.layers) - self.refreshed:
            line += f"; {frozen} frozen, quantised once"
        if self.refreshed:
            line += f"; {self.refreshed} trained, re-quantised from the current weights at each block"
        line += f"; +{held / 2**20:.1f} MiB held"
        return line

    def __enter__(self) -> FP8Linears:
        if self._active:
            raise RuntimeError(f"[fp8] {self.label}: the FP8 matmuls are already active (no nesting)")
        for layer in self.layers:
            if "forward" in vars(layer):
                raise RuntimeError(f"[fp8] {self.label}: a Linear layer already has a forward of its own "
                                   "(compiled on its own?); FP8 cannot be swapped in over it")
        for layer in self.layers:  # a trained weight, from what it is now: after the latest optimizer step
            if layer.weight.requires_grad:
                self._copies[id(layer)].refresh(layer)
        for layer in self.layers:
            layer.forward = self._forwards[id(layer)]
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        for layer in self.layers:
            del layer.forward
        self._active = False


def _fp8_forward(layer: nn.Linear, quantised: _Quantised, x: torch.Tensor) -> torch.Tensor:
    y = nla_core.fp8_linear_ste(x, layer.weight, quantised.weight, quantised.scale, bias=layer.bias,
                                out_dtype=OUT_DTYPE)
    return y.to(x.dtype)


def fp8_matmuls(copies: FP8Linears | None) -> contextlib.AbstractContextManager:
    """`copies` active for a `with` block; nothing when None (the phase runs in the model's dtype)."""
    return contextlib.nullcontext() if copies is None else copies

