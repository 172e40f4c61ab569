"""Weight pushes into a running vLLM engine, one function per kind of engine.

`load_buckets`: a bf16 engine takes each bucket by `LLM.apply_model` (`model.load_weights` in the
worker), its parameters written in place. `reload_buckets`: an online-quantised engine (vLLM's
`quantization="fp8"` and kin on a bf16 checkpoint) holds fp8 parameters that a plain load would
write bf16 values into, so the whole push streams through one `reload_weights` of the worker
(vLLM 0.24, v1/worker/gpu_model_runner.py): its layerwise reload takes checkpoint-format weights,
re-quantises each layer as soon as all of its weights have arrived, and copies the result into
the tensors the CUDA graphs read. Both return the parameters the push left unset; the engine
refuses to go on with any.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Iterator

import torch

from nla_shell.engines.vllm_process import _load_weights, _unloaded_parameters, _unset_while_reloading
from nla_shell.engines.weight_sync import Bucket


def load_buckets(llm: Any, buckets: Iterable[Bucket]) -> list[str]:
    """One apply_model load per bucket; the vLLM parameters no bucket reached."""
    loaded: set[str] = set()
    for _, bucket in buckets:
        for names in llm.apply_model(functools.partial(_load_weights, weights=bucket)):
            loaded.update(names)
    unloaded = llm.apply_model(functools.partial(_unloaded_parameters, loaded=sorted(loaded)))
    return sorted(set().union(*unloaded))


def reload_buckets(llm: Any, buckets: Iterable[Bucket]) -> list[str]:
    """Every bucket's pairs, in order, through one reload_weights call; the checkpoint parameters left unset.

    reload_weights returns nothing, and once it has finalised, a layer that received nothing holds
    its old weights again (vLLM only logs a warning). So the stream itself looks, after its last
    pair and before vLLM finalises, at which layers still wait for weights (`_unset_while_reloading`,
    through a nested apply_model: the in-process executor calls the worker directly, which is also
    why the generator needs no pickling; the engine refuses quantisation with tensor parallelism).
    """
    unset: list[str] | None = None

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal unset
        for _, bucket in buckets:
            yield from bucket
        unset = sorted(set().union(*llm.apply_model(_unset_while_reloading)))

    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream(), "is_checkpoint_format": True})
    if unset is None:
        raise RuntimeError("vLLM's reload_weights returned before reading the whole weight push: its weights "
                           "are partly stale")
    return unset
