"""The vLLM process around the engine: importing vLLM, the `vllm.LLM` arguments, the worker
functions a weight push runs (bf16 loads, and the check inside a quantised reload), torchrun's
store, and which steering plugin is active."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch

from nla_shell.engines import vllm_steering

INSTALL_HINT = (
    "engine=vllm needs vLLM, which is not installed: pip install 'nla[vllm]' (vllm==0.24.0, vllm-lens==1.2.1), "
    "or choose engine=native (one GPU) or engine=hf"
)


def llm_kwargs_for(
    model_dir: str | os.PathLike,
    *,
    dtype: str,
    seed: int,
    gpu_memory_utilization: float,
    max_model_len: int,
    tensor_parallel_size: int,
    enforce_eager: bool,
    enable_prefix_caching: bool,
    load_format: str,
    quantization: str | None = None,
) -> dict[str, Any]:
    """The `vllm.LLM` keyword arguments every engine here uses (benchmarks reuse them for baselines)."""
    return {
        "model": str(model_dir),
        # Prompts go in as token ids and text comes out through our tokenizer.
        "skip_tokenizer_init": True,
        # The checkpoint's generation_config must not add stop ids or sampling defaults.
        "generation_config": "vllm",
        "dtype": dtype,
        "seed": seed,
        "gpu_memory_utilization": gpu_memory_utilization,
        "max_model_len": max_model_len,
        "tensor_parallel_size": tensor_parallel_size,
        "enforce_eager": enforce_eager,
        "enable_prefix_caching": enable_prefix_caching,
        "load_format": load_format,
        # None: the checkpoint's bf16. A method name (e.g. "fp8") on a bf16 checkpoint is vLLM's online
        # quantisation: each linear layer is quantised once its weights are loaded.
        "quantization": quantization,
    }


def require_vllm():
    try:
        import vllm
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    return vllm


def _load_weights(model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Run in each worker by apply_model (module level so it pickles): names it loaded."""
    return sorted(model.load_weights(iter(weights)))


def _unloaded_parameters(model: torch.nn.Module, loaded: list[str]) -> list[str]:
    done = set(loaded)
    return sorted(name for name, _ in model.named_parameters() if name not in done)


def _unset_while_reloading(model: torch.nn.Module) -> list[str]:
    """Run in the worker by apply_model inside a layerwise reload, after its last weight arrived and before
    vLLM finalises it: the checkpoint-format parameters whose storage the push did not write.

    A layer whose weights all arrived has been re-quantised and reset already (its info no longer loads, and
    its parameters are the kernel tensors again, written); a layer still waiting names the parameters it was
    given in `loaded_weights`. vLLM's finalisation would put the old tensors back into a layer that received
    nothing, with only a log warning: stale weights. Not unset: a parameter whose kernel tensor another layer
    wrote (an lm_head tied to the embeddings by sharing their parameter, which the checkpoint lists once);
    attention layers, finalised after the stream by design (their KV-cache scales are not pushed); layers
    whose only tensors are buffers (rotary tables).
    """
    from vllm.model_executor.layers.attention import Attention, MLAAttention
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    written: set[int] = set()  # ids of the kernel tensors this push writes
    missing: list[tuple[str, torch.Tensor | None]] = []
    for prefix, layer in model.named_modules():
        info = get_layerwise_info(layer)
        if not info.can_load():
            written.update(id(p) for p in layer._parameters.values() if p is not None)
            continue
        if isinstance(layer, (Attention, MLAAttention)):
            continue
        arrived = {name for name, _ in info.loaded_weights}
        kernel = info.kernel_tensors[0] if info.kernel_tensors is not None else {}
        written.update(id(kernel[name]) for name in arrived if name in kernel)
        missing += [(f"{prefix}.{name}".lstrip("."), kernel.get(name))
                    for name in info.restore_metadata[0] if name not in arrived]
    return sorted(name for name, tensor in missing if tensor is None or id(tensor) not in written)


AGENT_STORE_VARIABLE = "TORCHELASTIC_USE_AGENT_STORE"
"""Set by torchrun in its workers: every process group's store is then the agent's."""


@contextlib.contextmanager
def _own_store_under_torchrun() -> Iterator[None]:
    """torchrun's environment hidden from a vLLM that sets up its own process group.

    A process torchrun starts (one rank, say, where nla's trainer forms no group) carries
    TORCHELASTIC_USE_AGENT_STORE: torch then connects every process group's store to the
    agent's, as a client, whatever address it is given, and vLLM's own group (world 1 at a free
    port, or its tensor-parallel workers, spawned with this environment) waits on a store server
    nobody starts (seen: a 1-rank torchrun step hung 9 minutes in vLLM's start-up).
    """
    value = os.environ.pop(AGENT_STORE_VARIABLE, None)
    try:
        yield
    finally:
        if value is not None:
            os.environ[AGENT_STORE_VARIABLE] = value


def _lens_active(llm_class) -> bool:
    """vllm-lens adds LLM.register_hooks when its plugin registers (and patches generate)."""
    return hasattr(llm_class, "register_hooks")


def _entry_point_installed() -> bool:
    from importlib.metadata import entry_points

    target = f"{vllm_steering.__name__}:register"
    return any(ep.value == target for ep in entry_points(group="vllm.general_plugins"))
