"""Explanations -> AR inputs -> reconstruction MSE -> reward, and the AR's regression step."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

import nla_core
from nla_shell.training import distributed, sharding
from nla_shell.engines.base import Rollout
from nla_shell.models import ARModel, ar_predict, pad_right, trainable_parameters


@dataclass(frozen=True)
class Scores:
    """Per-sample results of scoring N explanations."""

    mse: torch.Tensor
    """[N] float32 normalised reconstruction MSE; NaN where the sample failed."""
    reward: torch.Tensor
    """[N] float32; FAILED_EXTRACTION_REWARD where the sample failed."""
    valid: torch.Tensor
    """[N] bool: an explanation was extracted, fit the AR and scored finitely."""
    ar_inputs: list[list[int] | None]
    """AR token ids per sample (None where failed), reused by the critic step."""


def ar_token_ids(explanation: str | None, template: str, tokenizer, *, max_tokens: int) -> list[int] | None:
    """The AR's input ids for one explanation, or None when absent, empty-encoded or too long."""
    if explanation is None:
        return None
    ids = tokenizer.encode(template.format(explanation=explanation), add_special_tokens=False)
    return ids if 0 < len(ids) <= max_tokens else None


def ar_predictions(ar: ARModel, inputs: Sequence[list[int] | None], *, pad_id: int, micro_batch: int) -> torch.Tensor:
    """[N, D] float32 AR predictions on the CPU for N AR inputs (`ar_token_ids`); NaN rows where an input is None."""
    keep = [i for i, ids in enumerate(inputs) if ids is not None]
    out = torch.full((len(inputs), ar.value_head.in_features), math.nan)
    spare = sharding.spare_forwards(ar, math.ceil(len(keep) / micro_batch))  # sharding=fsdp2: ranks in lockstep
    if keep:
        out[keep] = ar_predict(ar, [inputs[i] for i in keep], pad_id=pad_id, micro_batch=micro_batch,
                               device=ar.value_head.weight.device).cpu()
    sharding.idle_forwards(ar, spare, pad_id=pad_id, grad=False)
    return out


class Reconstructions(NamedTuple):
    """The AR's reading of N explanations."""

    inputs: list[list[int] | None]
    """AR token ids per sample (None: absent, empty-encoded or too long for the AR)."""
    predictions: torch.Tensor
    """[N, D] float32 on the CPU; NaN rows where inputs is None."""
    mse: torch.Tensor
    """[N] float32 normalised reconstruction MSE against the golds; NaN where inputs is None."""


def reconstruct_explanations(
    ar: ARModel,
    tokenizer,
    explanations: Sequence[str | None],
    golds: torch.Tensor,
    *,
    template: str,
    mse_scale: float | None,
    max_tokens: int,
    micro_batch: int,
) -> Reconstructions:
    """One micro-batched AR pass over N explanations: each one's prediction and its MSE to its gold.

    Args: explanations: N texts (None = extraction failed); golds: [N, D].
    """
    inputs = [ar_token_ids(e, template, tokenizer, max_tokens=max_tokens) for e in explanations]
    pred = ar_predictions(ar, inputs, pad_id=tokenizer.pad_token_id, micro_batch=micro_batch)
    keep = torch.tensor([ids is not None for ids in inputs], dtype=torch.bool)
    mse = torch.full((len(inputs),), math.nan)
    if keep.any():
        mse[keep] = nla_core.reconstruction_mse(pred[keep], golds[keep].float(), scale=mse_scale)
    return Reconstructions(inputs, pred, mse)


def score_explanations(
    ar: ARModel,
    tokenizer,
    explanations: Sequence[str | None],
    golds: torch.Tensor,
    *,
    template: str,
    mse_scale: float | None,
    reward_kind: str,
    max_tokens: int,
    micro_batch: int,
) -> Scores:
    """Reconstruct each gold activation from its explanation with the AR, in micro-batches, and reward it.

    Args: explanations: N texts (None = extraction failed); golds: [N, D].
    """
    read = reconstruct_explanations(ar, tokenizer, explanations, golds, template=template, mse_scale=mse_scale,
                                    max_tokens=max_tokens, micro_batch=micro_batch)
    return _scores(read.inputs, read.mse, reward_kind)


def _scores(inputs: list[list[int] | None], mse: torch.Tensor, reward_kind: str) -> Scores:
    """Scores of N samples from their AR inputs and [N] MSE (NaN where not scored)."""
    valid = torch.isfinite(mse)
    reward = torch.where(
        valid,
        nla_core.reward_from_mse(torch.nan_to_num(mse, nan=1.0), kind=reward_kind),
        torch.tensor(nla_core.FAILED_EXTRACTION_REWARD),
    )
    ar_inputs = [ids if bool(valid[i]) else None for i, ids in enumerate(inputs)]
    return Scores(mse=mse, reward=reward.float(), valid=valid, ar_inputs=ar_inputs)


@dataclass(frozen=True)
class ShapedRewards:
    """Scores after the optional anti-runaway shaping, and the reward the advantages see."""

    scores: Scores
    """The input scores; with truncated_as_failed, truncated rollouts marked failed (their AR inputs kept)."""
    reward: torch.Tensor
    """[N] float32: scores.reward - length_penalty."""
    truncated: torch.Tensor
    """[N] bool: the rollout ran to max_new_tokens without ending on an eos id."""
    length_penalty: torch.Tensor
    """[N] float32 hinged length penalty (0 when length_penalty is 0)."""


def truncated_rollouts(rollouts: Sequence[Rollout], *, max_new_tokens: int, eos_ids: Sequence[int]) -> torch.Tensor:
    """[N] bool: rollouts cut by the max_new_tokens cap (vLLM's finish_reason "length")."""
    return torch.tensor([
        r.response_len >= max_new_tokens and int(r.full_ids[-1]) not in eos_ids for r in rollouts
    ], dtype=torch.bool)


def shape_rewards(
    scores: Scores,
    rollouts: Sequence[Rollout],
    *,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    length_penalty: float,
    length_margin: int,
    truncated_as_failed: bool,
) -> ShapedRewards:
    """EasyNLA's anti-runaway measure (asherps/EasyNLA nla/train_rl_vllm.py, --length-penalty).

    reward_i = r_i - length_penalty * max(0, L_i - max(1, max_new_tokens - length_margin)), and
    with truncated_as_failed a cap-truncated rollout gets FAILED_EXTRACTION_REWARD (and counts
    as failed in FVE and the extraction rate) but stays in the loss: its negative advantage is
    the gradient against never-ending answers. The critic still trains on its text.
    """
    truncated = truncated_rollouts(rollouts, max_new_tokens=max_new_tokens, eos_ids=eos_ids)
    if truncated_as_failed:
        scores = Scores(
            mse=torch.where(truncated, torch.tensor(math.nan), scores.mse),
            reward=torch.where(truncated, torch.tensor(nla_core.FAILED_EXTRACTION_REWARD), scores.reward),
            valid=scores.valid & ~truncated,
            ar_inputs=scores.ar_inputs,
        )
    lengths = torch.tensor([r.response_len for r in rollouts], dtype=torch.long)
    penalty = nla_core.hinged_length_penalty(
        lengths, threshold=max(1, max_new_tokens - length_margin), coef=length_penalty
    )
    return ShapedRewards(scores=scores, reward=scores.reward - penalty, truncated=truncated, length_penalty=penalty)


def critic_step(
    ar: ARModel,
    optimizer: torch.optim.Optimizer,
    ar_inputs: Sequence[Sequence[int]],
    golds: torch.Tensor,
    *,
    pad_id: int,
    micro_batch: int,
    max_grad_norm: float,
) -> tuple[float, float]:
    """One optimizer step on mean_i reconstruction_mse(AR(z_i), h_i), micro-batched.

    Each micro-batch's loss is weighted by its share of the batch, so the accumulated
    gradient is the full batch's. Returns (loss, grad_norm); a non-finite loss or grad norm
    skips the step (NaN returned) rather than corrupting Adam's moments, and so does a
    batch with no pairs at all.

    Under torchrun every rank calls this, even with no pairs of its own: the mean is over
    the global batch, gradients are summed over ranks, and the skip decision is global,
    so no rank leaves a collective unmatched.
    """
    (n_global,) = distributed.all_reduce_sum([len(ar_inputs)])
    n = int(n_global)
    if n == 0:
        return math.nan, math.nan
    optimizer.zero_grad(set_to_none=True)
    device = ar.value_head.weight.device
    total = 0.0
    spare = sharding.spare_forwards(ar, math.ceil(len(ar_inputs) / micro_batch))
    for start in range(0, len(ar_inputs), micro_batch):
        ids, mask = pad_right(ar_inputs[start : start + micro_batch], pad_id, device)
        gold = golds[start : start + micro_batch].to(device)
        loss = nla_core.reconstruction_mse(ar(ids, mask, right_padded=True), gold.float(), scale=ar.mse_scale).sum() / n
        loss.backward()
        total += float(loss.detach())
    sharding.idle_forwards(ar, spare, pad_id=pad_id, grad=True)
    params = trainable_parameters(ar)
    distributed.all_reduce_grads(params)
    (total,) = distributed.all_reduce_sum([total])
    return _clip_and_step(params, optimizer, total, max_grad_norm)


def _clip_and_step(
    params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, loss: float, max_grad_norm: float
) -> tuple[float, float]:
    """Clip the (rank-summed) gradient and step; skip with (NaN, NaN) when loss or norm is not finite."""
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        return math.nan, math.nan
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # the AR's gradients would otherwise stay allocated all step
    return loss, grad_norm


class DeviceTimer:
    """Seconds of the spans timed with `with timer:`. On a GPU by CUDA events, read once in `seconds()`: the
    host does not wait on the device at each span (a wall clock there would time kernel launches only)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._host_seconds = 0.0

    def __enter__(self) -> DeviceTimer:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._start, end))
        else:
            self._host_seconds += time.perf_counter() - self._t0

    def seconds(self) -> float:
        if self._events:
            self._events[-1][1].synchronize()
        return self._host_seconds + sum(start.elapsed_time(end) for start, end in self._events) / 1000.0


class CriticScores(NamedTuple):
    """What `score_and_train_critic` returns."""

    scores: Scores
    loss: float
    """The critic's loss (NaN when it did not step), as `critic_step` returns it."""
    grad_norm: float
    seconds: float
    """Seconds of the critic's own work: its backward passes and its optimizer step (the forward also scores)."""


def score_and_train_critic(
    ar: ARModel,
    optimizer: torch.optim.Optimizer,
    tokenizer,
    explanations: Sequence[str | None],
    golds: torch.Tensor,
    *,
    template: str,
    mse_scale: float | None,
    reward_kind: str,
    max_tokens: int,
    micro_batch: int,
    max_grad_norm: float,
) -> CriticScores:
    """`score_explanations` then `critic_step` on the valid pairs, with ONE AR forward per pair.

    The reward needs the pre-update prediction, and so does the critic's loss
    mean_i mse_i over the valid pairs: each micro-batch's forward serves both, and its
    backward of sum_i mse_i accumulates the gradient, scaled by 1/n once n (the global
    count of valid pairs) is known. Inputs are sorted by length so micro-batches carry
    little padding. Should any prediction be non-finite, its NaN would reach the gradient
    of the whole micro-batch: the accumulated gradient is then dropped and `critic_step`
    runs on the valid pairs alone, which is today's arithmetic.

    Under torchrun every rank calls this (see `critic_step`).
    """
    inputs = [ar_token_ids(e, template, tokenizer, max_tokens=max_tokens) for e in explanations]
    keep = sorted((i for i, ids in enumerate(inputs) if ids is not None), key=lambda i: len(inputs[i]), reverse=True)
    device = ar.value_head.weight.device
    timer = DeviceTimer(device)
    optimizer.zero_grad(set_to_none=True)
    mse_kept = torch.zeros(len(keep), device=device)
    spare = sharding.spare_forwards(ar, math.ceil(len(keep) / micro_batch))
    for start in range(0, len(keep), micro_batch):
        rows = keep[start : start + micro_batch]
        ids, mask = pad_right([inputs[i] for i in rows], tokenizer.pad_token_id, device)
        gold = golds[rows].to(device, torch.float32, non_blocking=True)
        mse = nla_core.reconstruction_mse(ar(ids, mask, right_padded=True), gold, scale=mse_scale)
        with timer:
            mse.sum().backward()
        mse_kept[start : start + len(rows)] = mse.detach()
    with timer:
        sharding.idle_forwards(ar, spare, pad_id=tokenizer.pad_token_id, grad=True)
    mse_all = torch.full((len(inputs),), math.nan)
    mse_all[keep] = mse_kept.cpu()
    scores = _scores(inputs, mse_all, reward_kind)
    pairs = [i for i, ids in enumerate(scores.ar_inputs) if ids is not None]
    (unscored,) = distributed.all_reduce_sum([len(keep) - len(pairs)])
    with timer:
        if unscored:
            loss, grad_norm = critic_step(
                ar, optimizer, [scores.ar_inputs[i] for i in pairs], golds[pairs], pad_id=tokenizer.pad_token_id,
                micro_batch=micro_batch, max_grad_norm=max_grad_norm,
            )
        elif (n_global := distributed.all_reduce_sum([len(pairs)])[0]) == 0:
            loss, grad_norm = math.nan, math.nan
        else:
            params = trainable_parameters(ar)
            distributed.all_reduce_grads(params)
            for p in params:
                if p.grad is not None:
                    p.grad.div_(n_global)
            (total,) = distributed.all_reduce_sum([float(mse_kept.sum()) / n_global])
            loss, grad_norm = _clip_and_step(params, optimizer, total, max_grad_norm)
    return CriticScores(scores, loss, grad_norm, timer.seconds())
