"""The contract every rollout engine keeps with the trainer.

An engine turns B prompts (token ids holding one injection marker, and the activation
to inject there) into B x G sampled continuations, returned prompt-major: prompt 0's G
samples first, then prompt 1's, and so on. Each carries the behaviour log-probs of the
policy that actually sampled it, one per generated token, so the trainer can correct
for engine/trainer mismatch (TIS).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

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
