"""What goes to vLLM and what comes back: request specs, sampling and steering arguments, the
outputs as rollouts, the engine-vs-trainer log-prob gap, the steering canary's reading.

Every steered prompt carries a cache salt derived from its vector (`cache_salt`), so with prefix
caching on, a request can only reuse KV computed under the same vector. These parts need
neither vLLM nor a GPU (nla_shell.engines.vllm runs them through vLLM).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch

import nla_core
from nla_shell.engines import vllm_steering
from nla_shell.engines.base import Rollout, RolloutRequest


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
