"""The AV's supervised loss: the NLL of a gold response after the AV prompt, the activation injected at the marker.

`nla sft --mode av` trains on it and its held-out evaluation scores with it (`sft_eval`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from nla_shell.engines.base import Rollout
from nla_shell.models import Injector, response_logprobs
from nla_shell.training.update import response_batch

__all__ = ["AVExample", "av_response_nll"]


@dataclass(frozen=True)
class AVExample:
    prompt_ids: tuple[int, ...]
    """Chat-templated AV prompt with one well-formed marker."""
    response_ids: tuple[int, ...]
    """The gold response's tokens, ending with EOS."""
    activation: torch.Tensor
    """[D] injected at the marker."""


def av_response_nll(
    actor: torch.nn.Module, injector: Injector, examples: Sequence[AVExample], *, pad_id: int
) -> tuple[torch.Tensor, int]:
    """Summed NLL of the response tokens of `examples` (prompt tokens carry no loss), and their count.

    One forward with the activations injected at the markers, through the same response
    batching and fused log-prob path as the GRPO update.
    Returns: (0-d float32 tensor with grad, number of response tokens).
    """
    device = next(actor.parameters()).device
    rollouts = [
        Rollout(torch.tensor(e.prompt_ids + e.response_ids), len(e.prompt_ids), torch.zeros(len(e.response_ids)), "", i)
        for i, e in enumerate(examples)
    ]
    batch = response_batch(rollouts, pad_id=pad_id, device=device)
    vectors = torch.stack([e.activation for e in examples]).to(device, torch.float32)
    with injector.inject(batch.input_ids, vectors):
        logp = response_logprobs(actor, batch.input_ids, batch.attention_mask, batch.positions, batch.targets)
    return -(logp * batch.mask).sum(), int(batch.mask.sum())
