"""Compile helpers for the actor's and the AR's forwards: the backbone under autocast, and
torch.compile of each decoder block's cache-free parts, rotary embedding and log-prob head."""

from __future__ import annotations

import functools
import sys
import types
import weakref
from typing import Callable, Iterator

import torch
from torch import nn

import nla_core
from nla_shell import families
from nla_shell.models.common import inner_lm


class BackboneAutocast:
    """From construction until `remove()`, the actor's decoder backbone runs under torch.autocast(dtype).

    Every forward of the backbone (training, reference, engine prefill and decode steps, CUDA-graph
    captures) then forms its matrix products in `dtype`: on a bf16 base the float32 LoRA factors
    A [r, D], B [D', r] are cast to bf16 for x @ A.T @ B.T (float32 accumulation, float32 master
    weights and gradients), where PEFT would cast x to float32 and run float32 products. The
    log-prob head (`nla_core.token_logprobs_from_hidden`, the engines' `final_logits`) runs
    after the backbone, outside the region, in the model's dtype as before.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        lm = inner_lm(model)
        if lm.dtype != dtype:
            # The KV caches and residual stream stay in the base's dtype; autocast's keys and values would not fit them.
            raise ValueError(f"autocast to {dtype} needs a {dtype} base model; this one is {lm.dtype}")
        backbone = families.backbone(lm)
        self.device_type, self.dtype = next(model.parameters()).device.type, dtype
        self._regions: list[torch.autocast] = []
        # PEFT would cast each LoRA input to the factors' float32, only for autocast to cast it back.
        self._tuner_layers = [m for m in model.modules() if hasattr(m, "cast_input_dtype_enabled")]
        for layer in self._tuner_layers:
            layer.cast_input_dtype_enabled = False
        self._handles = (
            backbone.register_forward_pre_hook(self._enter),
            backbone.register_forward_hook(self._leave, always_call=True),
        )

    def _enter(self, module: nn.Module, args: tuple) -> None:
        # No cast cache: a CUDA graph must not capture a pointer to a cached cast (torch.cuda.graph docs).
        region = torch.autocast(self.device_type, dtype=self.dtype, cache_enabled=False)
        region.__enter__()
        self._regions.append(region)

    def _leave(self, module: nn.Module, args: tuple, output):
        self._regions.pop().__exit__(None, None, None)
        return output

    def remove(self) -> None:
        """The backbone's and PEFT's arithmetic as they were."""
        for handle in self._handles:
            handle.remove()
        for layer in self._tuner_layers:
            layer.cast_input_dtype_enabled = True


class CompiledBlockParts:
    """From construction until `remove()`, the cache-free parts of each decoder block run compiled.

    torch.compile (dynamic shapes, so micro-batches of other lengths reuse the graphs) of every
    block's largest sub-modules that see no KV cache: the norms and the MLP (Qwen3: input /
    post-attention RMSNorm, q / k RMSNorm, SwiGLU MLP), where the eager forward launches one
    kernel per element-wise op, PEFT's LoRA layers (base product + LoRA product, scaled and added:
    the scale and the sum fuse), and with `rotary` the rotary
    embedding the attention applies to queries and keys (eager, `rotate_half`'s cat and neg and
    four products and two sums over q and k, in the forward and again in the backward). The
    attention module itself (the cache's Python bookkeeping) stays eager: compiling whole blocks
    recompiled on every cache state. Identical layers share one compiled graph. While a CUDA graph
    is being captured (the native engine's decode) the eager forward runs, so no compilation
    happens in a capture.

    The rotary embedding is a module-level function of the model's HF modeling file
    (`apply_rotary_pos_emb`, called by name from the attention's forward), so it is swapped in
    that module, for every model of the family in the process, until the last instance that
    swapped it is removed.

    The model's fused lm_head + log-prob (`hidden_logprobs`) runs each chunk's float32 arithmetic
    compiled (`nla_core.ChunkKernels`), fused into few passes over a chunk's
    [1024, V] logits where the eager ops (cast, log-sum-exp, exp, product, scatter, cast) each make one.

    Args: model: the actor (PEFT or not) or the AR's truncated LM; backend: torch.compile's;
      rotary: compile the rotary embedding too (False: for A/B tests).
    """

    def __init__(self, model: nn.Module, *, backend: str = "inductor", rotary: bool = True) -> None:
        blocks = families.decoder_blocks(model)
        self.modules = [m for block in blocks for m in _cache_free_parts(block)]
        """The compiled sub-modules."""
        if any("forward" in vars(m) for m in self.modules):
            raise ValueError("the model's blocks already run compiled parts: remove() the earlier CompiledBlockParts first")
        self.rotary_homes = sorted({home for block in blocks for home in _rotary_homes(block)}, key=lambda m: m.__name__) if rotary else []
        """The modeling modules whose `apply_rotary_pos_emb` runs compiled."""
        # One forward (the RMSNorm's) serves hidden and per-head inputs, with and without grad and
        # autocast, in the actor and the AR; a LoRA layer's, projections of three shapes with the
        # adapter on and off (the reference pass): more variants than dynamo's default 8 graphs per code.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        for module in self.modules:
            module.forward = _compiled_unless_capturing(module.forward, backend=backend)
        for home in self.rotary_homes:
            eager, installs = _compiled_rotaries.get(home, (getattr(home, ROTARY_FUNCTION), 0))
            if not installs:
                setattr(home, ROTARY_FUNCTION, _compiled_unless_capturing(eager, backend=backend))
            _compiled_rotaries[home] = (eager, installs + 1)
        self.head_lm = inner_lm(model)
        """The LM whose log-prob head (`hidden_logprobs`) runs compiled chunk kernels (None once removed)."""
        _compiled_heads[self.head_lm] = _compiled_chunk_kernels(backend)

    def remove(self) -> None:
        """The eager forwards back (the instance attribute hid the class's forward), and the eager
        rotary embedding once no other instance compiles it."""
        for module in self.modules:
            del module.forward
        for home in self.rotary_homes:
            eager, installs = _compiled_rotaries.pop(home)
            if installs > 1:
                _compiled_rotaries[home] = (eager, installs - 1)
            else:
                setattr(home, ROTARY_FUNCTION, eager)
        self.rotary_homes = []
        if self.head_lm is not None:
            del _compiled_heads[self.head_lm]
            self.head_lm = None


ROTARY_FUNCTION = "apply_rotary_pos_emb"
"""The rotary embedding's name in HF's modeling files (Llama, Mistral, Qwen2/3, Gemma 2/3)."""

_compiled_rotaries: dict[types.ModuleType, tuple[Callable, int]] = {}
"""Modeling module -> (its eager rotary function, CompiledBlockParts instances compiling it)."""


_compiled_heads: "weakref.WeakKeyDictionary[nn.Module, nla_core.ChunkKernels]" = weakref.WeakKeyDictionary()
"""LM -> the compiled chunk kernels its `hidden_logprobs` runs, while a CompiledBlockParts holds it."""


@functools.cache
def _compiled_chunk_kernels(backend: str) -> nla_core.ChunkKernels:
    """The core's per-chunk log-prob arithmetic, compiled (one instance per backend, shared by all models)."""
    return nla_core.ChunkKernels(
        logprobs=_compiled_unless_capturing(nla_core.chunk_logprobs, backend=backend),
        logit_grads=_compiled_unless_capturing(nla_core.chunk_logit_grads, backend=backend),
        entropy=_compiled_unless_capturing(nla_core.chunk_entropy, backend=backend),
    )


def _rotary_homes(block: nn.Module) -> Iterator[types.ModuleType]:
    """The modeling modules of `block`'s attention modules (they carry a `layer_idx`) that define the
    rotary function (GPT-2's, with learned positions, does not)."""
    for module in block.modules():
        home = sys.modules.get(type(module).__module__)
        if hasattr(module, "layer_idx") and home is not None and callable(getattr(home, ROTARY_FUNCTION, None)):
            yield home


def _cache_free_parts(module: nn.Module) -> Iterator[nn.Module]:
    """The largest sub-modules of `module` with no KV-cache access and no LoRA layer inside, bare
    linears aside, and the LoRA layers themselves.

    HF attention modules (the ones that update the cache) carry a `layer_idx`; PEFT's LoRA layers
    a `cast_input_dtype_enabled`. Modules holding either are searched, never compiled whole.
    """
    for child in module.children():
        if hasattr(child, "cast_input_dtype_enabled"):
            yield child
            continue
        if hasattr(child, "layer_idx") or any(hasattr(m, "cast_input_dtype_enabled") for m in child.modules()):
            yield from _cache_free_parts(child)
        elif not isinstance(child, (nn.Linear, nn.Dropout, nn.Identity)):
            yield child


def _compiled_unless_capturing(forward, *, backend: str):
    compiled = torch.compile(forward, dynamic=True, backend=backend)

    @functools.wraps(forward)
    def run(*args, **kwargs):
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        return forward(*args, **kwargs) if capturing else compiled(*args, **kwargs)

    return run
