"""The contract every rollout engine keeps with the trainer.

An engine turns B prompts (token ids holding one injection marker, and the activation
to inject there) into B x G sampled continuations, returned prompt-major: prompt 0's G
samples first, then prompt 1's, and so on. Each carries the behaviour log-probs of the
policy that actually sampled it, one per generated token, so the trainer can correct
for engine/trainer mismatch (TIS).

A `StreamDecoder` is the other contract, the one `nla serve`'s continuous batching
(nla_shell.serving.continuous) drives: requests join between decode steps and come back row
by row as each ends (native: nla_shell.engines.native_stream; vLLM: nla_shell.engines.vllm_stream).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Hashable, NamedTuple, Protocol, Sequence, runtime_checkable

import torch

import nla_core


@dataclass(frozen=True)
class RolloutRequest:
    """One prompt to sample from."""

    prompt_ids: tuple[int, ...]
    """Chat-templated prompt token ids, exactly one well-formed injection marker."""
    activation: torch.Tensor
    """[D] float32 activation injected (norm-matched) at the marker, at the output of block 1."""


@dataclass(frozen=True)
class Rollout:
    """One sampled continuation."""

    full_ids: torch.Tensor
    """[L] int64: prompt ids followed by the generated ids (EOS kept when sampled, nothing after)."""
    prompt_len: int
    """Number of prompt tokens at the front of `full_ids`."""
    behavior_logp: torch.Tensor
    """[L - prompt_len] float32: log-prob of each generated token under the sampling policy."""
    text: str
    """The generated tokens decoded, special tokens skipped."""
    prompt_index: int
    """Index of the request this sample belongs to (its GRPO group)."""

    @classmethod
    def from_ids(cls, prompt_ids: Sequence[int], gen_ids: torch.Tensor, behavior_logp: torch.Tensor, *, tokenizer: Any,
                 prompt_index: int) -> "Rollout":
        """A rollout from its prompt's ids and its generated ids [n] (EOS kept, nothing after) with their log-probs
        [n]; the text is the generated ids decoded, special tokens skipped."""
        return cls(full_ids=torch.cat([torch.as_tensor(prompt_ids, dtype=torch.long), gen_ids]),
                   prompt_len=len(prompt_ids), behavior_logp=behavior_logp,
                   text=tokenizer.decode(gen_ids, skip_special_tokens=True), prompt_index=prompt_index)

    @property
    def response_len(self) -> int:
        """Number of generated tokens (EOS included when sampled)."""
        return self.full_ids.numel() - self.prompt_len


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates rollouts; engines with their own weight copy take weight pushes."""

    shares_actor_weights: bool
    """True when the engine samples with the trainer's actor itself (no sync needed)."""

    def generate(
        self,
        requests: Sequence[RolloutRequest],
        *,
        group_size: int,
        max_new_tokens: int,
        generator: torch.Generator | None = None,
    ) -> list[Rollout]:
        """B requests -> B * group_size rollouts, prompt-major, temperature 1, full vocabulary."""
        ...

    def sync_weights(self, actor: torch.nn.Module) -> float:
        """Push the actor's current (LoRA-merged) weights; returns seconds spent (0 when shared)."""
        ...

    def close(self) -> None:
        """Release the engine's resources."""
        ...


class FinishedRow(NamedTuple):
    """A row that ended: the `key` its request was admitted with, its `sample` index (0 .. rows - 1) and its
    Rollout (prompt_index 0: the key says which request it answers)."""

    key: Hashable
    sample: int
    rollout: Rollout


class StreamDecoder(Protocol):
    """Rows decoded in `n_slots` slots that requests join between steps (continuous batching).

    A request admitted with `rows` samples takes `rows` slots until each of its rows has ended
    and come back, from `admit` or a later `step`, as a FinishedRow with the request's key.
    """

    n_slots: int

    @property
    def free(self) -> int:
        """Slots no admitted row holds."""
        ...

    @property
    def busy(self) -> bool:
        """Some admitted row has not come back yet."""
        ...

    def running(self) -> contextlib.AbstractContextManager[None]:
        """The engine's state for a run of admit/step calls (call both inside it)."""
        ...

    def admit(self, requests: Sequence[RolloutRequest], *, keys: Sequence[Hashable], rows: int = 1,
              max_new_tokens: int | Sequence[int] | None = None,
              greedy: bool | Sequence[bool] = False) -> list[FinishedRow]:
        """Start `requests`, `rows` samples each, each with its own max_new_tokens (None: the decoder's longest) and
        greedy flag; needs len(requests) * rows free slots. Returns the rows that already ended."""
        ...

    def step(self) -> list[FinishedRow]:
        """One decode step (call while busy); the rows that ended."""
        ...

    def drop_all(self) -> None:
        """Free every slot, discarding its row (after a failure: the next admissions start clean)."""
        ...


def admission_settings(n_requests: int, *, keys: Sequence[Hashable], rows: int, free: int,
                       max_new_tokens: int | Sequence[int], greedy: bool | Sequence[bool],
                       longest: int) -> tuple[list[int], list[bool]]:
    """A StreamDecoder admission's (max_new_tokens, greedy) per request, each given once or per request; ValueError
    when keys do not match the requests, the rows do not fit the `free` slots, or a max_new_tokens is outside
    1..longest."""
    budgets = _per_request(max_new_tokens, n_requests)
    greedies = _per_request(greedy, n_requests)
    if len(keys) != n_requests or n_requests * rows > free:
        raise ValueError(f"admit: {n_requests} requests x {rows} rows, {len(keys)} keys, {free} free slots")
    if not 1 <= min(budgets) <= max(budgets) <= longest:
        raise ValueError(f"admit: max_new_tokens {budgets} outside 1..{longest}")
    return budgets, greedies


def _per_request(value, n: int) -> list:
    """A setting given once or per request, as a list of n."""
    values = list(value) if isinstance(value, Sequence) else [value] * n
    if len(values) != n:
        raise ValueError(f"admit: {len(values)} per-request settings for {n} requests")
    return values


def held_awake(engine: RolloutEngine) -> contextlib.AbstractContextManager:
    """One wake-up for a block of generation calls on an engine that sleeps between them
    (vLLM's sleep mode: `awake()`); nothing for the others."""
    awake = getattr(engine, "awake", None)
    return awake() if awake is not None else contextlib.nullcontext()


def sample_explanations(
    engine: RolloutEngine, prompt_ids: Sequence[Sequence[int]], vectors: torch.Tensor, *, max_new_tokens: int,
    chunk: int | None = None, bar: Any = None,
) -> list[str | None]:
    """One explanation per (prompt, vector): the engine's sample, <explanation> extracted (None when absent).

    Args: prompt_ids: N prompts; vectors: [N, D] injected at each prompt's marker. The engine
    samples `chunk` prompts per call (all N at once when None), advancing the progress `bar`
    (anything with `update(n)`) by each.
    """
    requests = [RolloutRequest(tuple(ids), v) for ids, v in zip(prompt_ids, vectors, strict=True)]
    step = chunk or max(len(requests), 1)
    rollouts = []
    for start in range(0, len(requests), step):
        part = requests[start : start + step]
        rollouts.extend(engine.generate(part, group_size=1, max_new_tokens=max_new_tokens))
        if bar is not None:
            bar.update(len(part))
    return [nla_core.extract_explanation(r.text) for r in rollouts]
