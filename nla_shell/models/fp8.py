"""FP8 copies of a backbone's Linear layers, swapped in for a block of work (`fp8=` of `nla train`).

`FP8Linears(backbone)` holds, per Linear layer of the backbone (peft's frozen `base_layer`s
included, the LoRA factors `lora_A` / `lora_B` never), the weight quantised per output row to
e4m3 (`nla_core.quantize_rowwise`); `with fp8_matmuls(copies):` routes those layers' forwards
through `nla_core.fp8_linear_ste` (x quantised per row, `torch._scaled_mm`, bf16 out) and puts the
eager forwards back on exit. The backward is the linear map's, in the weight's own dtype
(straight-through): g @ W to the input, and g^T @ x to a weight that trains (a co-trained AR's
backbone, which scores and takes its step on one forward), nothing to a frozen one (a LoRA's base
layers); with backward=True the input's g @ W is an FP8 product too (W^T quantised per input
feature). The bf16 weights stay where they are: weight pushes, the backwards and the optimizers read them.

Memory: +1 byte per converted weight and 4 bytes per output row (the scale), held for the run;
with backward=True (`fp8=...,backward`) as much again for the transposed copy the input gradients use.
A frozen layer is quantised once, here; a layer whose weight trains is re-quantised from its
current weight, in place, at the start of every block, so a stale copy cannot exist: a block
after the critic's optimizer step reads the new weights (and, with critic_ema, the EMA weights
swapped in before the block).

Where the copies live: on each converted layer, as non-persistent buffers `fp8_weight` [M, K] e4m3 and
`fp8_scale` [M, 1] float32, so they follow the layer's `.to(device)` and stay out of `state_dict()`
(the weight pushes and checkpoints) and `named_parameters()` (the optimizers, vLLM's weight loads).
`Module.to(dtype)` would cast them too (e4m3 is a floating dtype): entering the block refuses a copy
that is no longer e4m3. For the block each layer's class is `_FP8Linear` (an `nn.Linear` whose
forward reads those buffers), and `nn.Linear` again on exit.

Compiled blocks (`compile_blocks`): a compiled MLP or LoRA layer that calls a converted layer guards
on the layer's class, and reads the copies as graph inputs like the weight, so the layers share its
graphs: FP8 on adds one set of variants to FP8 off's, whatever the number of layers (checked on the
CPU with the "aot_eager" backend, tests/shell/test_fp8_trainer.py). (A per-layer forward, an
instance attribute, was guarded on by identity: one recompile per layer, past dynamo's recompile
limit at 36 blocks, and the rest ran eager.)

Shape rule: a layer converts only when its in- and out-features are multiples of 16
(`SCALED_MM_MULTIPLE`, what `_scaled_mm` needs on Hopper); the others stay in the model's
dtype, and `summary()` says how many. The rule applies on every device, so a CPU run converts
the layers a GPU run would.
"""

from __future__ import annotations

import contextlib
import functools
import typing

import torch
from torch import nn

import nla_core
from nla_shell.training.config import FP8FastAccum

SCALED_MM_MULTIPLE = 16
"""`torch._scaled_mm` on SM90 needs K (in-features) and M (out-features) multiples of 16."""
OUT_DTYPE = torch.bfloat16
"""The kernel's output dtype: rowwise-scaled `_scaled_mm` on Hopper writes bf16 only; the result is cast
to the input's dtype (a float32 model's layers then carry bf16 rounding too)."""
MIN_CAPABILITY = (9, 0)
"""Rowwise-scaled FP8 `_scaled_mm`: Hopper (9.0) or later (Ada's FP8 kernels take one scale per tensor only)."""
FAST_ACCUM = typing.get_args(FP8FastAccum)
"""FP8Linears' fast_accum values, TrainConfig's fp8_fast_accum's."""


def require_fp8(device: torch.device, *, what: str = "config key 'fp8'") -> None:
    """ValueError naming the cause and the fix when `device` has no FP8 matrix products (the CPU has them)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < MIN_CAPABILITY:
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"{what} needs rowwise-scaled FP8 matmuls (compute capability >= 9.0, Hopper or later), "
                         f"but {device} is {major}.{minor}; leave fp8 empty on this GPU")


class FP8Linears:
    """The FP8 copies of `backbone`'s eligible Linear layers (see the module docstring).

    Args: backbone: the modules whose Linear layers convert (the AR's truncated backbone, the
      actor's decoder); label: the phase, for messages; compile_backend: with compile_blocks, the
      torch.compile backend that fuses each layer's FP8 product where no compiled block part
      contains it (the attention's bare q/k/v/o projections): its input's quantisation, eager,
      is several passes over the input per layer. None: eager there.
      backward: the backward's input gradients in FP8 too (`fp8_linear_ste` with the transposed copy,
      `quantize_rowwise(weight.T)`, held as the buffers `fp8_weight_t` [K, M] and `fp8_scale_t` [K, 1]:
      another byte per weight); False: in the weight's dtype, and those buffers are None.
      fast_accum: which products use the kernel's fast accumulation (`nla_core.fp8_linear`'s `fast_accum`):
        "off", "forward" (the forward products; the FP8 input gradients not), or "all".
    """

    def __init__(self, backbone: nn.Module, *, label: str, compile_backend: str | None = None,
                 backward: bool = False, fast_accum: FP8FastAccum = "off") -> None:
        if fast_accum not in FAST_ACCUM:
            raise ValueError(f"fast_accum {fast_accum!r}: one of {', '.join(FAST_ACCUM)}")
        self.label, self.backward, self.fast_accum = label, backward, fast_accum
        swap_class = _FP8Linear if compile_backend is None else _compiled_fp8_linear_class(compile_backend)
        self._swap_class = swap_class if fast_accum == "off" else _fast_accumulating(swap_class, fast_accum == "all")
        linears = [m for name, m in backbone.named_modules() if type(m) is nn.Linear and ".lora_" not in f".{name}"]
        self.layers = [m for m in linears
                       if m.in_features % SCALED_MM_MULTIPLE == 0 and m.out_features % SCALED_MM_MULTIPLE == 0]
        self.total = len(linears)
        for layer in self.layers:  # a second set over the same layers replaces the first's copies
            for name, copy in self._quantised(layer.weight).items():
                layer.register_buffer(name, copy, persistent=False)
        self._active = False

    def _quantised(self, weight: torch.Tensor) -> dict[str, torch.Tensor | None]:
        """A layer's copies by buffer name: `quantize_rowwise` of the weight and, with backward, of its
        transpose (None without)."""
        with torch.no_grad():
            weight_fp8, scale = nla_core.quantize_rowwise(weight)
            transposed, transposed_scale = nla_core.quantize_rowwise(weight.t()) if self.backward else (None, None)
        return {"fp8_weight": weight_fp8, "fp8_scale": scale,
                "fp8_weight_t": transposed, "fp8_scale_t": transposed_scale}

    @property
    def refreshed(self) -> int:
        """Converted layers whose weights train: re-quantised at every block."""
        return sum(m.weight.requires_grad for m in self.layers)

    def summary(self) -> str:
        """One start-up line: how many layers convert, why the others do not, what it holds."""
        skipped = self.total - len(self.layers)
        held = sum(m.weight.numel() + m.out_features * 4 for m in self.layers)
        if self.backward:
            held += sum(m.weight.numel() + m.in_features * 4 for m in self.layers)
        line = f"[fp8] {self.label}: {len(self.layers)} of {self.total} Linear layers in FP8"
        if skipped:
            line += f" ({skipped} not multiples of {SCALED_MM_MULTIPLE}: left in the model's dtype)"
        if frozen := len(self.layers) - self.refreshed:
            line += f"; {frozen} frozen, quantised once"
        if self.refreshed:
            line += f"; {self.refreshed} trained, re-quantised from the current weights at each block"
        if self.backward:
            line += "; input gradients in FP8 too (a transposed copy)"
        if self.fast_accum != "off":
            line += "; fast accumulation" + (" (forward products)" if self.fast_accum == "forward" else "")
        line += f"; +{held / 2**20:.1f} MiB held"
        return line

    def __enter__(self) -> FP8Linears:
        if self._active:
            raise RuntimeError(f"[fp8] {self.label}: the FP8 matmuls are already active (no nesting)")
        for layer in self.layers:
            if "forward" in vars(layer):
                raise RuntimeError(f"[fp8] {self.label}: a Linear layer already has a forward of its own "
                                   "(compiled on its own?); FP8 cannot be swapped in over it")
            cast = [c.dtype for c in (layer.fp8_weight, layer.fp8_weight_t)
                    if c is not None and c.dtype != nla_core.FP8_DTYPE]
            if cast:
                raise RuntimeError(f"[fp8] {self.label}: a layer's FP8 copy was cast to {cast[0]} "
                                   "(Module.to(dtype) after the copies were made?); make the FP8Linears after the cast")
        for layer in self.layers:  # a trained weight, from what it is now: after the latest optimizer step
            if layer.weight.requires_grad:
                for name, copy in self._quantised(layer.weight).items():
                    if copy is not None:
                        getattr(layer, name).copy_(copy)
        for layer in self.layers:
            layer.__class__ = self._swap_class
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        for layer in self.layers:
            layer.__class__ = nn.Linear
        self._active = False

    def remove(self) -> None:
        """The copies off the layers (their memory freed): for a benchmark path that ends while the models live on."""
        if self._active:
            raise RuntimeError(f"[fp8] {self.label}: remove() inside the FP8 block")
        for layer in self.layers:
            del layer.fp8_weight, layer.fp8_scale, layer.fp8_weight_t, layer.fp8_scale_t


class _FP8Linear(nn.Linear):
    """A converted layer inside an FP8 block: the same module (weight, bias, the `fp8_weight` / `fp8_scale`
    buffers FP8Linears registered), its product in FP8. x [..., K] -> [..., M] in x's dtype."""

    fp8_weight: torch.Tensor
    fp8_scale: torch.Tensor
    fp8_weight_t: torch.Tensor | None
    fp8_scale_t: torch.Tensor | None
    fast_accum = False
    """The forward products' fast accumulation: a class attribute, so compiled code guards on the class alone."""
    grad_fast_accum = False
    """The FP8 input gradients' fast accumulation (with backward), a class attribute as well."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(nla_core.fp8_linear_ste, x)

    def _product(self, product, x: torch.Tensor) -> torch.Tensor:
        """`product` (nla_core.fp8_linear_ste or a compiled one) of x with this layer's weight and copies."""
        y = product(x, self.weight, self.fp8_weight, self.fp8_scale, bias=self.bias, out_dtype=OUT_DTYPE,
                    wt_fp8=self.fp8_weight_t, wt_scale=self.fp8_scale_t, fast_accum=self.fast_accum,
                    grad_fast_accum=self.grad_fast_accum)
        return y.to(x.dtype)


@functools.cache
def _compiled_fp8_linear_class(backend: str) -> type[_FP8Linear]:
    """_FP8Linear whose product, outside compiled code, runs one compiled graph (dynamic shapes: every layer's
    width and micro-batch); inside compiled code (a compiled MLP or LoRA layer) dynamo inlines it as it is."""
    compiled = torch.compile(nla_core.fp8_linear_ste, dynamic=True, backend=backend)

    class _CompiledFP8Linear(_FP8Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self._product(nla_core.fp8_linear_ste if torch.compiler.is_compiling() else compiled, x)

    return _CompiledFP8Linear


@functools.cache
def _fast_accumulating(swap_class: type[_FP8Linear], gradients: bool) -> type[_FP8Linear]:
    """`swap_class` with its forward products' fast accumulation on, and its input gradients' with `gradients`."""
    return type(f"{swap_class.__name__}FastAccum{'All' if gradients else 'Forward'}", (swap_class,),
                {"fast_accum": True, "grad_fast_accum": gradients})


def fp8_matmuls(copies: FP8Linears | None) -> contextlib.AbstractContextManager:
    """`copies` active for a `with` block; nothing when None (the phase runs in the model's dtype)."""
    return contextlib.nullcontext() if copies is None else copies

