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
need neither vLLM nor a GPU (nla_shell.engines.vllm_requests); the process around vLLM (its
import, `vllm.LLM`'s arguments, the weight-push worker functions, torchrun's store) is
nla_shell.engines.vllm_process; both are re-exported here. How a push reaches vLLM's weights
(bf16 load, or the re-quantising reload of an FP8 engine) is nla_shell.engines.vllm_push. vLLM is
imported only when the engine is constructed.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

from nla_shell.engines import vllm_steering
from nla_shell.engines.base import Rollout, RolloutRequest
from nla_shell.engines.vllm_process import (
    INSTALL_HINT, _entry_point_installed, _lens_active, _own_store_under_torchrun, llm_kwargs_for, require_vllm,
)
from nla_shell.engines.vllm_push import load_buckets, reload_buckets
from nla_shell.engines.vllm_requests import (
    LogprobMismatch, RequestSpec, build_request_specs, cache_salt, canary_reading, lens_steering_kwargs,
    logprob_mismatch, marker_position, nla_extra_args, rollouts_from_outputs, sampled_logprobs, sampling_kwargs,
)
from nla_shell.engines.weight_sync import iter_merged_weight_buckets
from nla_shell.models.actor import eos_token_ids, load_generation_config

__all__ = [
    "INSTALL_HINT",
    "SLEEP_LEVELS",
    "STEERING_BACKENDS",
    "VLLM_CAPTURE_CAP",
    "LogprobMismatch",
    "RequestSpec",
    "VLLMRolloutEngine",
    "build_request_specs",
    "cache_salt",
    "canary_reading",
    "lens_steering_kwargs",
    "llm_kwargs_for",
    "logprob_mismatch",
    "marker_position",
    "nla_extra_args",
    "require_vllm",
    "rollouts_from_outputs",
    "sampled_logprobs",
    "sampling_kwargs",
]

STEERING_BACKENDS = ("nla", "vllm_lens")
SLEEP_LEVELS = (0, 1, 2)
"""0: vLLM keeps its memory; 1 and 2: vLLM's sleep levels (see VLLMRolloutEngine)."""


# --------------------------------------------------------------------------- engine


VLLM_CAPTURE_CAP = 512
"""vLLM's largest decode batch captured as a CUDA graph unless told otherwise."""


def memory_awake_gib() -> dict[str, float]:
    """GiB of the device in use while vLLM is awake, and torch's share of it (allocated, reserved), for the
    step's engine stats: run AA measured about one bf16 copy of the AV's weights in use beyond vLLM's share
    and the trainer's tensors during the rollout (bench/RESULTS.md, "Scaling"); these say whose it is."""
    if not torch.cuda.is_initialized():  # no CUDA work has run (a CPU test's stand-in engine)
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"awake_in_use_gib": (total - free) / 2**30, "awake_torch_allocated_gib": torch.cuda.memory_allocated() / 2**30,
            "awake_torch_reserved_gib": torch.cuda.memory_reserved() / 2**30}


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
    the device first) -> wake the weights -> push the actor if a push is due ->
    torch.cuda.empty_cache() again (the push's freed buckets) -> wake the KV cache -> generate ->
    sleep. `sync_weights` while asleep only marks the push due.
      level 1  copies the weights to pinned CPU memory at sleep and back at wake (2 x the
               weights over PCIe per step, and that much pinned host memory); any
               vllm_sync_every works.
      level 2  discards the weights (and the steering buffers, re-zeroed at wake): every
               wake pushes the last synced module's weights as they are then, so use it
               with a push every step (vllm_sync_every=1, which `nla train` requires). No
               host copy: costs one push (0.06 s at the 8B shape) per wake.
    Both drop the KV cache (no prefix cache survives a sleep) and keep the CUDA graphs. One
    sleep-mode engine per process (vLLM's allocator is a process singleton).

    quantization (e.g. "fp8", vLLM's online FP8 on the bf16 checkpoint): vLLM samples with
    quantised linear layers, and every push, the ones made at a wake-up included, goes through
    one re-quantising reload (nla_shell.engines.vllm_push). Needs tensor_parallel_size 1.

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
        quantization: str | None = None,
    ) -> None:
        if sleep_level not in SLEEP_LEVELS:
            raise ValueError(f"sleep_level must be one of {SLEEP_LEVELS}, got {sleep_level!r}")
        if per_rank and (tensor_parallel_size != 1 or not torch.distributed.is_initialized()):
            raise ValueError("per_rank needs tensor_parallel_size 1 and the torchrun job's process group set up")
        if quantization is not None and tensor_parallel_size != 1:
            raise ValueError(f"quantization {quantization!r} needs tensor_parallel_size 1: its pushes stream the "
                             "weights into the in-process worker")
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
        self.quantization = quantization
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
            quantization=quantization,
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
        inputs = [self.request_inputs(spec, steered=steered, logprobs=logprobs) for spec in specs]
        with self.awake():
            start = time.perf_counter()
            outputs = self.llm.generate([prompt for prompt, _ in inputs], [params for _, params in inputs],
                                        use_tqdm=False)
            self.last_stats["generate_s"] += time.perf_counter() - start
        return outputs

    def request_inputs(self, spec: RequestSpec, *, steered: bool = True, logprobs: int = 0,
                       greedy: bool | None = None) -> tuple[Any, Any]:
        """(TokensPrompt, SamplingParams) of one spec: what `run_specs` hands to LLM.generate, and the continuous
        stream (nla_shell.engines.vllm_stream) to LLMEngine.add_request. greedy None: the engine's `greedy`.

        output_kind FINAL_ONLY, which LLM.generate sets on every request itself (vLLM 0.24,
        vllm/entrypoints/offline_utils.py `_add_request`): one RequestOutput per request, carrying all its n samples,
        once the last has ended (vllm/v1/engine/parallel_sampling.py).
        """
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        prompt = TokensPrompt(prompt_token_ids=list(spec.prompt_ids))
        if steered:
            prompt["cache_salt"] = spec.cache_salt
        kwargs = sampling_kwargs(spec, extra_args=self._extra_args(spec) if steered else None, logprobs=logprobs,
                                 greedy=self.greedy if greedy is None else greedy)
        return prompt, SamplingParams(**kwargs, output_kind=RequestOutputKind.FINAL_ONLY)

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
        return rollouts_from_outputs(self.run_specs(specs), specs, decode=self.decode)

    def decode(self, ids: list[int]) -> str:
        """Generated ids as text, special tokens skipped (vLLM never detokenises: sampling_kwargs)."""
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
                self.last_stats.update(memory_awake_gib())
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
        if torch.cuda.is_available():
            # What the push freed (its merged buckets) stays in torch's cache, which vLLM cannot map
            # its KV cache into: run AA's 14B ran out of memory here. Hand it back first. (At 8B, run AC's
            # counters while awake were the same with it: what else torch holds then is not known.)
            torch.cuda.empty_cache()
        self.llm.wake_up(tags=["kv_cache"])
        self.last_stats["wake_s"] = woke + time.perf_counter() - start

    def push_buckets(self, buckets: Iterable[tuple[str, list[tuple[str, torch.Tensor]]]]) -> float:
        """Load (hf_name, tensor) buckets into vLLM (bf16: one apply_model call each; quantised: all
        of them through one re-quantising reload), then drop the prefix cache (its KV came from the
        old weights). Raises when a vLLM parameter received nothing. Returns seconds spent,
        including producing the buckets.
        """
        if self._asleep:
            raise RuntimeError("vLLM is asleep: push with sync_weights, which makes the push at the next wake-up")
        start = time.perf_counter()
        missing = (reload_buckets if self.quantization else load_buckets)(self.llm, buckets)
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
