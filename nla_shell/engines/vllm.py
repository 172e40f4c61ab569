"""vLLM rollout engine: steered generation with the AV's weights in vLLM, synced from the actor.

One vLLM request per prompt with n = group_size, so each activation is sent and applied
once per prompt. Two steering backends put the activation at the marker (norm-matched, at
the output of decoder block `injection_layer`):
  "nla"       our plugin (nla_shell.engines.vllm_steering): applied inside the compiled
              graph, only in the forward that computes the marker; CUDA graphs stay on.
  "vllm_lens" vllm-lens SteeringVectors, as the reference does (forces eager mode and runs
              a Python hook on every layer at every step: slow, kept for comparison).
Every steered prompt carries a cache salt derived from its vector, so with prefix caching
on, a request can only reuse KV computed under the same vector (or, for unsteered
requests, under none): steered KV never serves another request.

The pure parts (request specs, log-prob extraction, outputs -> rollouts, mismatch stats)
need neither vLLM nor a GPU; vLLM is imported only when the engine is constructed.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

import torch

import nla_core
from nla_shell.engines import vllm_steering
from nla_shell.engines.base import Rollout, RolloutRequest
from nla_shell.engines.weight_sync import iter_merged_weight_buckets
from nla_shell.models.actor import eos_token_ids, load_generation_config

STEERING_BACKENDS = ("nla", "vllm_lens")
SLEEP_LEVELS = (0, 1, 2)
"""0: vLLM keeps its memory; 1 and 2: vLLM's sleep levels (see VLLMRolloutEngine)."""

INSTALL_HINT = (
    "engine=vllm needs vLLM, which is not installed: pip install 'nla[vllm]' (vllm==0.24.0, vllm-lens==1.2.1), "
    "or choose engine=native (one GPU) or engine=hf"
)


# --------------------------------------------------------------------------- request specs


@dataclass(frozen=True)
class RequestSpec:
    """Everything one vLLM request (one prompt, `n` samples) is built from."""

    prompt_index: int
    prompt_ids: tuple[int, ...]
    marker_position: int
    vector: torch.Tensor
    """[1, 1, D] float32 on CPU: one layer, one position (a 2-D vector would broadcast in vllm-lens)."""
    cache_salt: str
    n: int
    max_tokens: int
    stop_token_ids: tuple[int, ...]
    seed: int | None = None
    ignore_eos: bool = False


def marker_position(prompt_ids: Sequence[int], *, marker_id: int, left_id: int, right_id: int) -> int:
    """Position of the prompt's single well-formed marker; ValueError when there is not exactly one."""
    if not nla_core.marker_well_formed(prompt_ids, marker_id=marker_id, left_id=left_id, right_id=right_id):
        raise ValueError(
            f"prompt of {len(prompt_ids)} tokens lacks exactly one marker {marker_id} between "
            f"{left_id} and {right_id}"
        )
    sites = nla_core.find_injection_sites(
        torch.tensor([list(prompt_ids)], dtype=torch.long), marker_id=marker_id, left_id=left_id, right_id=right_id
    )
    return int(sites[0, 1])


def cache_salt(vector: torch.Tensor, position: int, layer: int) -> str:
    """Prefix-cache salt of a steered prompt: equal iff the injection (vector, place) is."""
    digest = hashlib.sha256(vllm_steering.encode_vector(vector))
    digest.update(f"|{position}|{layer}".encode())
    return "nla-steer-" + digest.hexdigest()


def build_request_specs(
    requests: Sequence[RolloutRequest],
    *,
    group_size: int,
    max_new_tokens: int,
    marker_id: int,
    left_id: int,
    right_id: int,
    d_model: int,
    injection_layer: int,
    stop_token_ids: Sequence[int],
    seeds: Sequence[int] | None = None,
    ignore_eos: bool = False,
) -> list[RequestSpec]:
    """One spec per request, in request order. ValueError naming the request on bad input."""
    if group_size < 1 or max_new_tokens < 1:
        raise ValueError(f"group_size ({group_size}) and max_new_tokens ({max_new_tokens}) must be >= 1")
    if seeds is not None and len(seeds) != len(requests):
        raise ValueError(f"{len(seeds)} seeds for {len(requests)} requests")
    specs = []
    for index, request in enumerate(requests):
        activation = request.activation
        if activation.dim() != 1 or activation.shape[0] != d_model:
            raise ValueError(f"request {index}: activation must be [D] = [{d_model}], got {tuple(activation.shape)}")
        try:
            position = marker_position(request.prompt_ids, marker_id=marker_id, left_id=left_id, right_id=right_id)
        except ValueError as err:
            raise ValueError(f"request {index}: {err}") from None
        vector = activation.detach().to("cpu", torch.float32).reshape(1, 1, d_model).clone()
        specs.append(
            RequestSpec(
                prompt_index=index,
                prompt_ids=tuple(int(t) for t in request.prompt_ids),
                marker_position=position,
                vector=vector,
                cache_salt=cache_salt(vector, position, injection_layer),
                n=group_size,
                max_tokens=max_new_tokens,
                stop_token_ids=tuple(int(t) for t in stop_token_ids),
                seed=None if seeds is None else int(seeds[index]),
                ignore_eos=ignore_eos,
            )
        )
    return specs


def sampling_kwargs(spec: RequestSpec, *, extra_args: dict[str, Any] | None, logprobs: int = 0,
                    greedy: bool = False) -> dict[str, Any]:
    """A fresh SamplingParams keyword dict: plain softmax at temperature 1 over the full vocabulary
    (greedy: temperature 0, vLLM's argmax, for reading explanations; never for training).

    Every knob that could reshape the distribution is spelled out, because the behaviour
    log-probs feed an importance ratio against the trainer's plain softmax. logprobs=0
    returns just the sampled token's log-prob; vLLM never detokenises (we decode).
    """
    return {
        "n": spec.n,
        "temperature": 0.0 if greedy else 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": spec.max_tokens,
        "stop_token_ids": list(spec.stop_token_ids),
        "ignore_eos": spec.ignore_eos,
        "seed": spec.seed,
        "logprobs": logprobs,
        "flat_logprobs": True,
        "detokenize": False,
        "extra_args": extra_args,
    }


def nla_extra_args(spec: RequestSpec) -> dict[str, Any]:
    """Fresh extra_args for the "nla" backend (plain msgpack types: survive any engine IPC)."""
    return {
        vllm_steering.EXTRA_ARGS_KEY: {
            "position": spec.marker_position,
            "vector": vllm_steering.encode_vector(spec.vector),
        }
    }


def lens_steering_kwargs(spec: RequestSpec, *, layer: int) -> dict[str, Any]:
    """Keyword arguments of the vllm-lens SteeringVector for one prompt.

    3-D activations, because vllm-lens honours position_indices only for [layers, positions,
    D] and adds a 2-D vector at every prompt and decode token.
    """
    return {
        "activations": spec.vector.clone(),
        "layer_indices": [layer],
        "scale": 1.0,
        "norm_match": True,
        "position_indices": [spec.marker_position],
    }


# --------------------------------------------------------------------------- outputs


def sampled_logprobs(token_ids: Sequence[int], logprobs: Any, *, where: str) -> torch.Tensor:
    """The log-prob vLLM recorded for each sampled token.

    Args:
      token_ids: [L] the generated ids.
      logprobs: vLLM's per-step log-probs: FlatLogprobs (start_indices / end_indices /
        token_ids / logprobs lists) or a list of {token_id: Logprob} dicts.
      where: names the sample in error messages.
    Returns:
      [L] float32.
    Raises:
      RuntimeError naming the step when a log-prob is missing or not finite: a substitute
      value would silently corrupt the importance ratio.
    """
    if logprobs is None:
        raise RuntimeError(f"{where}: vLLM returned no log-probs (SamplingParams.logprobs unset?)")
    if len(logprobs) != len(token_ids):
        raise RuntimeError(
            f"{where}: vLLM returned log-probs for {len(logprobs)} steps but {len(token_ids)} tokens; "
            f"generated step {min(len(logprobs), len(token_ids))} is unaccounted for"
        )
    flat = all(hasattr(logprobs, name) for name in ("start_indices", "end_indices", "token_ids", "logprobs"))
    values = []
    for step, token in enumerate(token_ids):
        value = None
        if flat:
            for j in range(logprobs.start_indices[step], logprobs.end_indices[step]):
                if logprobs.token_ids[j] == token:
                    value = logprobs.logprobs[j]
                    break
        else:
            entry = logprobs[step] or {}
            if token in entry:
                value = entry[token].logprob
        if value is None:
            raise RuntimeError(f"{where}: no log-prob for the sampled token {token} at generated step {step}")
        if not math.isfinite(value):
            raise RuntimeError(f"{where}: log-prob {value} for the sampled token {token} at generated step {step}")
        values.append(float(value))
    return torch.tensor(values, dtype=torch.float32)


def rollouts_from_outputs(
    outputs: Sequence[Any],
    specs: Sequence[RequestSpec],
    *,
    decode: Callable[[list[int]], str],
) -> list[Rollout]:
    """vLLM RequestOutputs (one per spec, in spec order) -> rollouts, prompt-major.

    Each output's completions are taken in their `index` order; full_ids are the prompt
    ids as sent plus the generated ids (EOS included when sampled).
    """
    if len(outputs) != len(specs):
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(specs)} requests")
    rollouts = []
    for output, spec in zip(outputs, specs):
        if tuple(output.prompt_token_ids) != spec.prompt_ids:
            raise RuntimeError(
                f"prompt {spec.prompt_index}: vLLM ran {len(output.prompt_token_ids)} prompt tokens, not the "
                f"{len(spec.prompt_ids)} sent (a tokenizer-added BOS?)"
            )
        completions = sorted(output.outputs, key=lambda c: c.index)
        if len(completions) != spec.n:
            raise RuntimeError(f"prompt {spec.prompt_index}: {len(completions)} samples instead of {spec.n}")
        prompt = torch.tensor(spec.prompt_ids, dtype=torch.long)
        for completion in completions:
            generated = [int(t) for t in completion.token_ids]
            where = f"prompt {spec.prompt_index}, sample {completion.index}"
            rollouts.append(
                Rollout(
                    full_ids=torch.cat([prompt, torch.tensor(generated, dtype=torch.long)]),
                    prompt_len=len(spec.prompt_ids),
                    behavior_logp=sampled_logprobs(generated, completion.logprobs, where=where),
                    text=decode(generated),
                    prompt_index=spec.prompt_index,
                )
            )
    return rollouts


class LogprobMismatch(NamedTuple):
    mean_abs: float
    """Mean |behaviour - trainer| over all unmasked tokens (0 when there are none)."""
    max_abs: float
    over: torch.Tensor
    """[N] bool: rollouts whose own mean |difference| exceeds the threshold."""
    frac_over: float


def logprob_mismatch(
    behavior: torch.Tensor,
    trainer: torch.Tensor,
    mask: torch.Tensor,
    *,
    threshold: float,
) -> LogprobMismatch:
    """Engine-vs-trainer log-prob gap over generated tokens.

    Args:
      behavior, trainer: [N, T] log-probs (masked entries may hold anything, even NaN).
      mask: [N, T] bool, True at generated tokens.
    """
    if behavior.shape != trainer.shape or behavior.shape != mask.shape or behavior.dim() != 2:
        raise ValueError(
            f"behavior {tuple(behavior.shape)}, trainer {tuple(trainer.shape)} and mask {tuple(mask.shape)} "
            "must all be [N, T]"
        )
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool, got {mask.dtype}")
    diff = torch.where(mask, (behavior.float() - trainer.float()).abs(), torch.zeros((), dtype=torch.float32))
    counts = mask.sum(dim=1)
    per_rollout = diff.sum(dim=1) / counts.clamp_min(1)
    over = per_rollout > threshold
    total = int(counts.sum())
    return LogprobMismatch(
        mean_abs=float(diff.sum() / total) if total else 0.0,
        max_abs=float(diff.max()) if total else 0.0,
        over=over,
        frac_over=float(over.float().mean()) if over.numel() else 0.0,
    )


# --------------------------------------------------------------------------- engine


VLLM_CAPTURE_CAP = 512
"""vLLM's largest decode batch captured as a CUDA graph unless told otherwise."""


def canary_reading(steered: Mapping[int, float], plain: Mapping[int, float]) -> float:
    """A lower bound on max_t |steered - unsteered| log-prob of the first token, from two top-k lists.

    A token in both lists counts its exact change. A token in one list only has at most the other
    list's lowest log-prob there, so it counts by how far it lies above that floor: the bound stays
    finite when the lists share no token (the old canary read inf, which passes any check yet cannot
    tell strong steering from a broken model). NaN when either list holds a non-finite log-prob.
    """
    if not steered or not plain:
        return math.nan
    values = [*steered.values(), *plain.values()]
    if not all(math.isfinite(v) for v in values):
        return math.nan
    floor_steered, floor_plain = min(steered.values()), min(plain.values())
    return max(
        abs(steered[t] - plain[t]) if t in steered and t in plain
        else max(0.0, steered[t] - floor_plain) if t in steered
        else max(0.0, plain[t] - floor_steered)
        for t in steered.keys() | plain.keys()
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


class VLLMRolloutEngine:
    """Samples rollouts with vLLM; the actor's LoRA-merged weights are pushed in by `sync_weights`.

    The engine runs vLLM in this process when tensor_parallel_size is 1 (so the steering
    plugin registered here reaches the worker, and weight pushes hand tensors over without
    serialising them). Randomness comes from vLLM's engine seed; with seed_requests each
    prompt instead gets a seed drawn from the `generate` generator (reproducible per
    batch, but vLLM's V1 sampler then loops over requests in Python: slower).

    Colocation beside the trainer (sleep_level 1 or 2, vLLM's sleep mode): vLLM's weights
    and KV cache live in its own pool and are handed back to the GPU after every block of
    work, so the trainer's update can use them. Each block (`awake`, entered by every
    generation call) runs: torch.cuda.empty_cache() (the trainer's cached blocks go back to
    the device first) -> wake the weights -> push the actor if a push is due -> wake the
    KV cache -> generate -> sleep. `sync_weights` while asleep only marks the push due.
      level 1  copies the weights to pinned CPU memory at sleep and back at wake (2 x the
               weights over PCIe per step, and that much pinned host memory); any
               vllm_sync_every works.
      level 2  discards the weights (and the steering buffers, re-zeroed at wake): every
               wake pushes the last synced module's weights as they are then, so use it
               with a push every step (vllm_sync_every=1, which `nla train` requires). No
               host copy: costs one push (0.06 s at the 8B shape) per wake.
    Both drop the KV cache (no prefix cache survives a sleep) and keep the CUDA graphs. One
    sleep-mode engine per process (vLLM's allocator is a process singleton).

    Under torchrun (`per_rank`): every rank runs an engine of its own on its own GPU, sampling
    its own prompts, through vLLM's "external_launcher" executor (in this process, on
    cuda:LOCAL_RANK, in the job's process group). Building it is collective (vLLM forms its
    groups and agrees on the KV size over the world), so every rank builds it at the same
    point; generating is not (tensor_parallel_size 1, no data_parallel_size: no collective per
    step), so ranks may generate different amounts, and rank 0 alone may run the eval.
    """

    shares_actor_weights = False

    def __init__(
        self,
        model_dir: str | os.PathLike,
        tokenizer,
        *,
        marker_id: int,
        left_id: int,
        right_id: int,
        injection_layer: int = 1,
        injection_style: str = "residual_add",
        injection_norm: float | None = None,
        steering: str = "nla",
        gpu_memory_utilization: float = 0.35,
        max_model_len: int = 1024,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
        enable_prefix_caching: bool = False,
        max_num_seqs: int | None = None,
        kv_cache_gib: float | None = None,
        dtype: str = "bfloat16",
        seed: int = 0,
        seed_requests: bool = False,
        load_format: str = "auto",
        llm_kwargs: Mapping[str, Any] | None = None,
        eos_ids: Sequence[int] | None = None,
        sleep_level: int = 0,
        per_rank: bool = False,
        greedy: bool = False,
    ) -> None:
        if sleep_level not in SLEEP_LEVELS:
            raise ValueError(f"sleep_level must be one of {SLEEP_LEVELS}, got {sleep_level!r}")
        if per_rank and (tensor_parallel_size != 1 or not torch.distributed.is_initialized()):
            raise ValueError("per_rank needs tensor_parallel_size 1 and the torchrun job's process group set up")
        if steering not in STEERING_BACKENDS:
            raise ValueError(f"steering must be one of {STEERING_BACKENDS}, got {steering!r}")
        if injection_style != "residual_add" and steering != "nla":
            raise ValueError(f"injection_style {injection_style!r} needs steering='nla' (vllm-lens only adds at a layer)")
        vllm = require_vllm()
        self.tokenizer = tokenizer
        self.marker_id, self.left_id, self.right_id = marker_id, left_id, right_id
        self.injection_layer = injection_layer
        self.steering = steering
        self.seed_requests = seed_requests
        self.greedy = greedy
        """Argmax decoding (temperature 0) for reading explanations; settable between calls; never for training."""
        self.sleep_level = sleep_level
        self._asleep = False
        self._awake_depth = 0
        self._weights_source: torch.nn.Module | None = None
        self._push_due = False
        self.last_stats: dict[str, float] = {}
        """Seconds of the last `awake` block: wake, push, generate (vLLM's own calls), sleep."""
        # Every eos of the checkpoint's generation_config stops a rollout (Qwen3: <|im_end|> and
        # <|endoftext|>), as in the HF engines; llm_kwargs_for keeps vLLM from reading that file itself.
        self.stop_token_ids = tuple(
            int(t) for t in (eos_ids or eos_token_ids(load_generation_config(model_dir), tokenizer))
        )
        self._in_process = tensor_parallel_size == 1
        self.per_rank = per_rank
        self._prepare_process(steering)
        kwargs = llm_kwargs_for(
            model_dir,
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            load_format=load_format,
        )
        if max_num_seqs is not None:
            kwargs["max_num_seqs"] = max_num_seqs
            if max_num_seqs > VLLM_CAPTURE_CAP and not enforce_eager:
                # vLLM captures decode CUDA graphs up to min(2 * max_num_seqs, 512) sequences
                # (vllm/config/vllm.py); a larger decode batch would run eagerly.
                kwargs["compilation_config"] = {"max_cudagraph_capture_size": max_num_seqs}
        if kv_cache_gib is not None:
            # A fixed KV cache: vLLM then skips the start-up profiling that a co-tenant's memory changes break.
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        if per_rank:
            # One vLLM world of tensor_parallel_size 1 per rank of the job (vLLM lays the ranks out as
            # external DP x TP); data_parallel_size would add a collective per step.
            kwargs["distributed_executor_backend"] = "external_launcher"
        if sleep_level:
            kwargs["enable_sleep_mode"] = True
        if steering == "nla":
            kwargs["additional_config"] = {
                vllm_steering.CONFIG_KEY: {"layer": injection_layer, "style": injection_style, "norm": injection_norm}
            }
        kwargs.update(llm_kwargs or {})
        if self._in_process:
            from vllm.compilation.monitor import set_cudagraph_capturing_enabled

            # vLLM switches graph capture off process-wide once an engine has captured its
            # graphs; a later engine in this process (eval, tests) must switch it back on.
            set_cudagraph_capturing_enabled(True)
        with contextlib.nullcontext() if per_rank else _own_store_under_torchrun():
            self.llm = vllm.LLM(**kwargs)
        self._check_backend_active()
        self.d_model = int(self.llm.llm_engine.model_config.get_hidden_size())

    def _prepare_process(self, steering: str) -> None:
        """Environment and plugin registration; vLLM reads both when it builds the engine."""
        from vllm import LLM, envs

        if self._in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if steering == "nla":
            if _lens_active(LLM):
                raise RuntimeError(
                    "vllm-lens was activated earlier in this process (it forces eager mode on every "
                    "engine); run steering='nla' in a fresh process"
                )
            # vllm-lens auto-loads as a vLLM plugin and would force eager mode for every engine.
            os.environ["VLLM_LENS_DISABLE"] = "1"
            vllm_steering.register()
            if not self._in_process and not _entry_point_installed():
                raise RuntimeError(
                    "steering='nla' with tensor parallelism needs the plugin in the spawned workers, which "
                    "find it through nla's `vllm.general_plugins` entry point: install nla "
                    "(`pip install -e .` in the repository), not just put it on PYTHONPATH"
                )
        else:
            if os.environ.get("VLLM_LENS_DISABLE", "").strip().lower() in ("1", "true", "yes", "on"):
                raise RuntimeError("steering='vllm_lens' but VLLM_LENS_DISABLE is set in this process")
            try:
                import vllm_lens  # noqa: F401
            except ImportError as err:
                raise ImportError(INSTALL_HINT) from err
        # vLLM caches environment variables once an engine has started; re-read them.
        envs.disable_envs_cache()

    def _check_backend_active(self) -> None:
        from vllm import LLM

        if self.steering == "nla":
            if not all(self.llm.apply_model(vllm_steering.steering_installed)):
                raise RuntimeError(
                    "the nla steering plugin did not reach the vLLM worker: rollouts would be unsteered"
                )
        elif not _lens_active(LLM):
            raise RuntimeError(
                "vllm-lens is not active in this process (plugins load once per process, and an "
                "earlier engine loaded them with VLLM_LENS_DISABLE set); use a fresh process"
            )

    # ------------------------------------------------------------------ generation

    def build_specs(
        self,
        requests: Sequence[RolloutRequest],
        *,
        group_size: int,
        max_new_tokens: int,
        generator: torch.Generator | None = None,
    ) -> list[RequestSpec]:
        """This engine's specs for `requests` (seeds drawn from `generator` when seed_requests)."""
        seeds = None
        if self.seed_requests:
            seeds = torch.randint(0, 2**31 - 1, (len(requests),), generator=generator).tolist()
        return build_request_specs(
            requests,
            group_size=group_size,
            max_new_tokens=max_new_tokens,
            marker_id=self.marker_id,
            left_id=self.left_id,
            right_id=self.right_id,
            d_model=self.d_model,
            injection_layer=self.injection_layer,
            stop_token_ids=self.stop_token_ids,
            seeds=seeds,
        )

    def run_specs(self, specs: Sequence[RequestSpec], *, steered: bool = True, logprobs: int = 0) -> list[Any]:
        """Submit specs to vLLM in one call; raw RequestOutputs in spec order.

        steered=False sends the same prompts with no vector and no cache salt (probes);
        logprobs is SamplingParams.logprobs (0: the sampled token's only).
        """
        from vllm import SamplingParams, TokensPrompt

        prompts, params = [], []
        for spec in specs:
            prompt = TokensPrompt(prompt_token_ids=list(spec.prompt_ids))
            if steered:
                prompt["cache_salt"] = spec.cache_salt
            prompts.append(prompt)
            extra_args = self._extra_args(spec) if steered else None
            params.append(SamplingParams(**sampling_kwargs(spec, extra_args=extra_args, logprobs=logprobs,
                                                           greedy=self.greedy)))
        with self.awake():
            start = time.perf_counter()
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
            self.last_stats["generate_s"] += time.perf_counter() - start
        return outputs

    def _extra_args(self, spec: RequestSpec) -> dict[str, Any]:
        if self.steering == "nla":
            return nla_extra_args(spec)
        from vllm_lens import SteeringVector

        # vllm-lens pops the vectors out of the dict it receives: never reuse one.
        return {"apply_steering_vectors": [SteeringVector(**lens_steering_kwargs(spec, layer=self.injection_layer))]}

    def generate(
        self,
        requests: Sequence[RolloutRequest],
        *,
        group_size: int,
        max_new_tokens: int,
        generator: torch.Generator | None = None,
    ) -> list[Rollout]:
        """B requests -> B * group_size rollouts, prompt-major, temperature 1, full vocabulary."""
        specs = self.build_specs(requests, group_size=group_size, max_new_tokens=max_new_tokens, generator=generator)
        return rollouts_from_outputs(self.run_specs(specs), specs, decode=self._decode)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def first_token_logprobs(self, request: RolloutRequest, *, steered: bool, top_k: int = 20) -> dict[int, float]:
        """{token: log-prob} of the top_k likeliest first tokens after the prompt (plus the sampled one).

        top_k=-1 returns the whole vocabulary (the engine needs llm_kwargs max_logprobs=-1).
        """
        spec = self.build_specs([request], group_size=1, max_new_tokens=1)[0]
        (output,) = self.run_specs([spec], steered=steered, logprobs=top_k)
        first = output.outputs[0].logprobs[0]
        return {int(token): float(lp.logprob) for token, lp in first.items()}

    def steering_canary(self, request: RolloutRequest, *, top_k: int = 20) -> float:
        """How far the vector moves the first token's log-probs (`canary_reading` of the steered and
        unsteered top-k). Zero (or NaN) means the vector did not reach the model: steering is broken."""
        steered = self.first_token_logprobs(request, steered=True, top_k=top_k)
        plain = self.first_token_logprobs(request, steered=False, top_k=top_k)
        return canary_reading(steered, plain)

    # ------------------------------------------------------------------ weights

    def sync_weights(self, actor: torch.nn.Module) -> float:
        """Push the actor's LoRA-merged weights (merged out of place, bucket by bucket).

        In-process the tensors stay on the actor's device (no host round trip); otherwise
        they go through CPU. Returns seconds spent, merge included. While vLLM sleeps the
        push is only marked due (0.0 returned): the next wake-up makes it, with the actor's
        weights as they are then, and counts it in last_stats["push_s"].
        """
        self._weights_source = actor
        if self._asleep:
            self._push_due = True
            return 0.0
        return self._push(actor)

    def _push(self, actor: torch.nn.Module) -> float:
        device = None if self._in_process else "cpu"
        seconds = self.push_buckets(iter_merged_weight_buckets(actor, device=device))
        self._push_due = False
        return seconds

    # ------------------------------------------------------------------ sleep mode

    @contextlib.contextmanager
    def awake(self) -> Iterator[None]:
        """vLLM's memory held for the block; with sleep_level, woken before and put to sleep
        after (only the outermost of nested blocks does either). Resets last_stats."""
        outermost = self._awake_depth == 0
        if outermost:
            self.last_stats = {"wake_s": 0.0, "push_s": 0.0, "generate_s": 0.0, "sleep_s": 0.0}
            if self._asleep:
                self._wake()
        self._awake_depth += 1
        try:
            yield
        finally:
            self._awake_depth -= 1
            if outermost and self.sleep_level and not self._asleep:
                start = time.perf_counter()
                self.llm.sleep(level=self.sleep_level)
                self._asleep = True
                self.last_stats["sleep_s"] = time.perf_counter() - start

    def _wake(self) -> None:
        """Weights first, then the push they may need, then the KV cache (as TRL's colocate mode)."""
        start = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.llm.wake_up(tags=["weights"])
        self._asleep = False
        if self.sleep_level == 2:
            self.llm.apply_model(vllm_steering.reset_steering)
        woke = time.perf_counter() - start
        if self.sleep_level == 2 or self._push_due:
            if self._weights_source is None:
                raise RuntimeError(
                    "vLLM woke from sleep level 2 with its weights discarded and nothing to restore them from: "
                    "call sync_weights(actor) before the first generation"
                )
            self.last_stats["push_s"] = self._push(self._weights_source)
        start = time.perf_counter()
        self.llm.wake_up(tags=["kv_cache"])
        self.last_stats["wake_s"] = woke + time.perf_counter() - start

    def push_buckets(self, buckets: Iterable[tuple[str, list[tuple[str, torch.Tensor]]]]) -> float:
        """Load (hf_name, tensor) buckets into vLLM one apply_model call each, then drop the
        prefix cache (its KV came from the old weights). Raises when a vLLM parameter
        received nothing. Returns seconds spent, including producing the buckets.
        """
        if self._asleep:
            raise RuntimeError("vLLM is asleep: push with sync_weights, which makes the push at the next wake-up")
        start = time.perf_counter()
        loaded: set[str] = set()
        for _, bucket in buckets:
            for names in self.llm.apply_model(functools.partial(_load_weights, weights=bucket)):
                loaded.update(names)
        unloaded = self.llm.apply_model(functools.partial(_unloaded_parameters, loaded=sorted(loaded)))
        missing = sorted(set().union(*unloaded))
        if missing:
            raise RuntimeError(f"weight push left {len(missing)} vLLM parameters unset, e.g. {missing[:5]}")
        reset = self.llm.reset_prefix_cache()
        if not reset and self.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching:
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight push (requests running?)")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def close(self) -> None:
        """Shut the vLLM engine down and free its GPU memory."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        if not self.per_rank:
            # Under torchrun, vLLM's shutdown would end in cleanup_dist_env_and_memory(), which
            # destroys the default process group: the trainer's, still needed. Its engine then
            # goes with the process.
            llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


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
