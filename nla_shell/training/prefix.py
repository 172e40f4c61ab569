"""Micro-batches of GRPO rollouts, and their response log-probs with each prompt computed once.

The G samples of a group share their prompt (ids and injected activation). Prefix sharing
runs the prompt once per micro-batch (one row per distinct prompt), gathers its keys and
values to the samples, and lets the responses attend to them:

    prefix:    h_p, KV_p   = LM(prompt_p)                      [k prompts, P]
    responses: h_r         = LM(response_r | KV_owner(r))       [n samples, R]
    logp[r, 0]             = log_softmax(lm_head(h_owner(r)[P_owner(r) - 1]))[response_r[0]]
    logp[r, t > 0]         = log_softmax(lm_head(h_r[t - 1]))[response_r[t]]

Every token sees exactly the tokens and positions it sees in the full-sequence forward, so
the log-probs are the same up to float rounding; the gather sums the samples' gradients
into the shared prompt, so the gradient is the same too. A 96-token prompt with G = 8
responses of 160 tokens saves 84 of every 256 token-forwards (a third of the update).

Prompts are right-padded (a left pad would be a query with nothing to attend to); positions
are explicit, so a response token sits at its true position P_i + t whatever the padding.

Several micro-batches can share one prompt forward (`prompt_forward(defer_gradient=True)`):
the responses gather from detached leaves, each micro-batch's backward sums into them, and one
backward of the prompt forward follows the last. A prompt forward is little arithmetic (k x P
tokens) but a whole pass of host work through every layer, during which the GPU idles.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, fields, replace
from typing import Sequence

import torch

import nla_core
from nla_shell import families
from nla_shell.engines.base import Rollout
from nla_shell.models import Injector, attention, hidden_logprobs, inner_lm, pad_right


@dataclass(frozen=True)
class PrefixBatch:
    """A micro-batch of rollouts as k distinct right-padded prompts and n right-padded responses."""

    rows: torch.Tensor
    """[n] int64: each sample's index in the rollouts list."""
    prompt_ids: torch.Tensor
    """[k, P] the distinct prompts, right-padded."""
    prompt_mask: torch.Tensor
    """[k, P] int64, 1 on real prompt tokens."""
    prompt_lengths: torch.Tensor
    """[k] int64 real prompt lengths."""
    sites: torch.Tensor
    """[k, 2] (row, position) of each prompt's injection marker."""
    prompt_sources: torch.Tensor
    """[k] int64: the index of one sample of each prompt (its activation is the group's)."""
    owner: torch.Tensor
    """[n] int64: the prompt row of each sample."""
    response_ids: torch.Tensor
    """[n, R] generated ids, right-padded (R = the longest response)."""
    response_mask: torch.Tensor
    """[n, R] int64, 1 on generated tokens."""
    mask: torch.Tensor
    """[n, R] bool, the same as response_mask: where a log-prob counts."""
    behavior_logp: torch.Tensor
    """[n, R] float32 engine log-probs, 0 at padding."""
    prompts_padded: bool
    """Whether any prompt row is padded (known on the host: the prompt forward then needs its mask)."""
    response_lengths: tuple[int, ...]
    """Each sample's response length, on the host (widths of sub-batches without reading the device)."""

    def split(self, sizes: Sequence[int]) -> list["PrefixBatch"]:
        """Consecutive sub-batches of `sizes` samples, each with all of this batch's prompts (so
        `owner` keeps indexing them) and its responses trimmed to its own longest: views, so no copy
        and, on a device, no host synchronisation (the widths come from `response_lengths`)."""
        if sum(sizes) != len(self.response_lengths):
            raise ValueError(f"sizes {list(sizes)} do not add up to the batch's {len(self.response_lengths)} samples")
        parts, start = [], 0
        for size in sizes:
            samples = slice(start, start + size)
            width = max(1, max(self.response_lengths[samples], default=1))
            parts.append(replace(
                self, rows=self.rows[samples], owner=self.owner[samples],
                response_ids=self.response_ids[samples, :width], response_mask=self.response_mask[samples, :width],
                mask=self.mask[samples, :width], behavior_logp=self.behavior_logp[samples, :width],
                response_lengths=self.response_lengths[samples],
            ))
            start += size
        return parts

    def to(self, device: torch.device) -> "PrefixBatch":
        """On `device`, copied without a host synchronisation.

        A copy from pageable host memory waits for the device's queue (CUDA's API
        synchronisation rules), so the tensors are pinned first on a CUDA device.
        """
        def moved(value):
            if not isinstance(value, torch.Tensor):
                return value
            return (value.pin_memory() if device.type == "cuda" else value).to(device, non_blocking=True)

        return PrefixBatch(**{f.name: moved(getattr(self, f.name)) for f in fields(self)})


def plan_micro_batches(rollouts: Sequence[Rollout], micro_batch: int) -> list[list[int]]:
    """Rollout indices per micro-batch: groups kept whole and in a row, longest groups first.

    Ordering groups by (prompt length, longest response) puts sequences of like length in
    the same micro-batch, so little of a forward is spent on padding. A group larger than
    `micro_batch` spans several micro-batches (each computes the shared prompt once).
    """
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(rollouts):
        groups.setdefault(r.prompt_index, []).append(i)

    def length(i: int) -> int:
        return rollouts[i].response_len

    ordered = sorted(groups.values(), key=lambda g: (rollouts[g[0]].prompt_len, max(map(length, g))), reverse=True)
    flat = [i for g in ordered for i in g]
    return [flat[start : start + micro_batch] for start in range(0, len(flat), micro_batch)]


def prefix_batch(rollouts: Sequence[Rollout], rows: Sequence[int], injector: Injector, *, pad_id: int) -> PrefixBatch:
    """The CPU tensors of one micro-batch; samples with the same prompt_index share one prompt row.

    Raises ValueError when samples of one group hold different prompts (an engine bug: a
    group is G samples of one request).
    """
    prompts: dict[int, torch.Tensor] = {}
    sources: dict[int, int] = {}
    for i in rows:
        r = rollouts[i]
        prompt = r.full_ids[: r.prompt_len]
        known = prompts.setdefault(r.prompt_index, prompt)
        sources.setdefault(r.prompt_index, i)
        if not torch.equal(known, prompt):
            raise ValueError(f"rollouts of group {r.prompt_index} hold different prompts; a group shares one prompt")
    prompt_row = {index: row for row, index in enumerate(prompts)}
    owner = [prompt_row[rollouts[i].prompt_index] for i in rows]
    prompt_ids, prompt_mask = pad_right(list(prompts.values()), pad_id, torch.device("cpu"))
    responses = [rollouts[i].full_ids[rollouts[i].prompt_len :] for i in rows]
    response_ids, response_mask = pad_right(responses, pad_id, torch.device("cpu"), min_width=1)
    behavior = torch.zeros(response_ids.shape, dtype=torch.float32)
    for row, i in enumerate(rows):
        behavior[row, : rollouts[i].behavior_logp.numel()] = rollouts[i].behavior_logp
    sites, _ = injector.prompt_sites(prompt_ids)
    return PrefixBatch(
        rows=torch.tensor(list(rows), dtype=torch.long),
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        prompt_lengths=prompt_mask.sum(-1),
        sites=sites,
        prompt_sources=torch.tensor(list(sources.values()), dtype=torch.long),
        owner=torch.tensor(owner, dtype=torch.long),
        response_ids=response_ids,
        response_mask=response_mask,
        mask=response_mask.bool(),
        behavior_logp=behavior,
        prompts_padded=bool((prompt_mask == 0).any()),
        response_lengths=tuple(rollouts[i].response_len for i in rows),
    )


def supports_prefix_sharing(actor: torch.nn.Module) -> bool:
    """False where the shared-prefix forward would not be the full forward's arithmetic.

    Gradient checkpointing drops the KV cache in training forwards, and a sliding-window
    layer trims it; both then take the full-sequence path.
    """
    lm = inner_lm(actor)
    layer_types = getattr(lm.config, "layer_types", None) or ()
    checkpointing = getattr(lm, "is_activation_checkpointing", None)  # transformers >= 5.2x
    if checkpointing is None:
        checkpointing = getattr(lm, "is_gradient_checkpointing", False)
    return not checkpointing and all(t == "full_attention" for t in layer_types)


@dataclass(frozen=True)
class PromptStates:
    """The prompt forward of a PrefixBatch: each prompt's keys and values per layer and its last
    hidden state (which predicts the first response token).

    With a deferred gradient they are leaves detached from the prompt forward's graph: the
    response forwards of several micro-batches gather from them and their backwards sum into the
    leaves' .grad; `backward()` then runs the prompt forward's backward once for all of them.
    """

    keys: list[torch.Tensor]
    """Per layer [k, H_kv, P, Dh]."""
    values: list[torch.Tensor]
    """Per layer [k, H_kv, P, Dh]."""
    last_hidden: torch.Tensor
    """[k, D] the output at each prompt's last real token."""
    graph_outputs: list[torch.Tensor]
    """The prompt graph's tensors the leaves were detached from (keys, values, last_hidden); empty
    when the gradient is not deferred."""

    def backward(self) -> None:
        """The gradient the leaves collected, through the prompt forward (a no-op without deferral)."""
        leaves = [*self.keys, *self.values, self.last_hidden]
        pairs = [(out, leaf.grad) for out, leaf in zip(self.graph_outputs, leaves)
                 if out.requires_grad and leaf.grad is not None]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])


def prompt_forward(
    actor: torch.nn.Module,
    injector: Injector,
    batch: PrefixBatch,
    vectors: torch.Tensor,
    *,
    defer_gradient: bool = False,
) -> PromptStates:
    """The k distinct prompts of `batch`, run once with their injected activations.

    Args:
      batch: a PrefixBatch on the actor's device (k prompts, P the padded prompt width).
      vectors: [k, D] the activation injected into each prompt.
      defer_gradient: return leaves that collect the gradient until `PromptStates.backward()`
        (so several micro-batches share one prompt forward and one prompt backward).
    """
    from transformers import DynamicCache

    lm = inner_lm(actor)
    decoder = families.backbone(lm)
    cache = DynamicCache(config=lm.config)
    k, width = batch.prompt_ids.shape
    positions = torch.arange(width, device=batch.prompt_ids.device).expand(k, width)
    # Unpadded prompts need no mask (plain causal attention, the same arithmetic): given one,
    # transformers reads it on the host to find that out, a device synchronisation per forward.
    mask = batch.prompt_mask if batch.prompts_padded else None
    with injector.inject(batch.prompt_ids, vectors, sites=batch.sites):
        hidden = decoder(
            input_ids=batch.prompt_ids, attention_mask=mask, position_ids=positions,
            use_cache=True, **{_cache_keyword(decoder): cache},
        ).last_hidden_state  # [k, P, D]
    outputs = [layer.keys for layer in cache.layers] + [layer.values for layer in cache.layers]
    outputs.append(hidden[torch.arange(k, device=hidden.device), batch.prompt_lengths - 1])
    graph: list[torch.Tensor] = []
    if defer_gradient and torch.is_grad_enabled():
        graph, outputs = outputs, [out.detach().requires_grad_(out.requires_grad) for out in outputs]
    layers = len(cache.layers)
    return PromptStates(outputs[:layers], outputs[layers : 2 * layers], outputs[-1], graph)


def response_logprobs(
    actor: torch.nn.Module, states: PromptStates, batch: PrefixBatch, *, with_entropy: bool = False
) -> torch.Tensor | nla_core.LogprobsAndEntropy:
    """log pi(response[i, t] | prompt, response[i, :t]), each sample attending to its prompt's states.

    Args:
      states: `prompt_forward` of a batch whose prompts `batch.owner` indexes (the batch itself,
        or the batch that `batch` was split from).
      batch: a PrefixBatch on the actor's device (n samples, R response width).
      with_entropy: also each position's policy entropy, from the same log-prob head pass.
    Returns:
      [n, R] float32 (any value at padding), differentiable w.r.t. the actor's trainable weights
      (or, with a deferred gradient, w.r.t. the states' leaves and the response forward's weights);
      with_entropy: LogprobsAndEntropy(logp, entropy) of two [n, R], the entropy detached.
    """
    from transformers import DynamicCache

    lm = inner_lm(actor)
    decoder = families.backbone(lm)
    hidden = states.last_hidden[batch.owner][:, None]  # the last prompt token predicts the first response token
    if batch.response_ids.shape[1] > 1:
        cache = DynamicCache(config=lm.config)
        for layer, (keys, values) in enumerate(zip(states.keys, states.values)):
            cache.update(keys[batch.owner], values[batch.owner], layer)  # a gather: prompt grads sum over the group
        inputs = batch.response_ids[:, :-1]  # the last token predicts nothing
        positions = batch.prompt_lengths[batch.owner, None] + torch.arange(inputs.shape[1], device=inputs.device)
        # Unpadded prompts: causal attention after the cache is the mask (a response's right padding comes
        # after every real token), run unmasked on the grouped heads (models/attention.py).
        unmasked = not batch.prompts_padded and attention.available(lm)
        mask = None if unmasked else torch.cat([batch.prompt_mask[batch.owner], batch.response_mask[:, :-1]], dim=1)
        with attention.lower_right_causal(lm) if unmasked else contextlib.nullcontext():
            response_hidden = decoder(
                input_ids=inputs, attention_mask=mask, position_ids=positions, use_cache=True,
                **{_cache_keyword(decoder): cache},
            ).last_hidden_state  # [n, R - 1, D]
        hidden = torch.cat([hidden, response_hidden], dim=1)
    return hidden_logprobs(lm, hidden, batch.response_ids, with_entropy=with_entropy)


def prefix_logprobs(
    actor: torch.nn.Module,
    injector: Injector,
    batch: PrefixBatch,
    vectors: torch.Tensor,
) -> torch.Tensor:
    """log pi(response[i, t] | prompt, response[i, :t]) with each prompt's forward run once:
    `prompt_forward` then `response_logprobs`, the gradient flowing straight through.

    Args:
      batch: a PrefixBatch on the actor's device (k prompts, n samples, R response width).
      vectors: [k, D] the activation injected into each prompt.
    Returns:
      [n, R] float32 (any value at padding), differentiable w.r.t. the actor's trainable weights.
    """
    return response_logprobs(actor, prompt_forward(actor, injector, batch, vectors), batch)


def _cache_keyword(decoder: torch.nn.Module) -> str:
    """transformers >= 5.2x calls the KV cache argument `cache`; earlier, `past_key_values`."""
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"
