"""The GRPO policy update: fused micro-batched forward / reference forward / loss / backward."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

import nla_core
from nla_shell.training import distributed, prefix
from nla_shell.engines.base import Rollout
from nla_shell.models import FP8Linears, Injector, fp8_matmuls, pad_right, reference_policy, response_logprobs


@dataclass(frozen=True)
class LossOptions:
    """The `nla_core.policy_loss` keywords, unpacked from the run config, and which diagnostics are measured."""

    policy_loss: str = "grpo"
    """nla_core.policy_loss's kind: grpo, gspo, cispo or onpolicy."""
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    kl_beta: float = 0.04
    kl_clamp: float | None = None
    tis: str | None = "ratio_cap"
    tis_cap: float = 2.0
    aggregation: str = "sequence_mean"
    max_len: int | None = None
    """Dr. GRPO's constant normaliser (the longest allowed response), for aggregation seq_mean_token_sum_norm."""
    token_mask: tuple[float, float] | None = None
    """The band [low, high] on the trainer/engine ratio outside which a token's surrogate is dropped."""
    kl_metric: bool = True
    """Run the reference forward at kl_beta = 0 too, so kl_mean is measured (NaN when it is not run)."""
    entropy_metric: bool = True
    """Measure the policy's entropy at the response tokens in the policy forward (NaN when off)."""
    top_entropy_quantile: float = 1.0
    """TRL's top_entropy_quantile: keep the surrogate only at the top `quantile` share of each micro-batch's
    loss tokens by (detached) policy entropy, `nla_core.top_entropy_mask`; 1.0 keeps every token (off).

    The threshold is a statistic of one micro-batch on one rank, not of the whole batch: the entropy
    comes from the micro-batch's own policy forward, and a batch-wide threshold would need a second
    policy forward. TRL's is the same scope (huggingface/trl d2b69d7: `get_high_entropy_mask` in
    `_compute_loss`, over one gradient-accumulation micro-batch's non-pad tokens on one process; later
    versions gather them over processes). With one micro-batch (micro_batch >= N) it is the batch's;
    otherwise the gradient depends on `micro_batch` (and on the plan's grouping) unless quantile = 1."""

    @property
    def masks_entropy(self) -> bool:
        return self.top_entropy_quantile < 1.0

    @property
    def needs_entropy(self) -> bool:
        """Whether the policy forward computes the entropy: for entropy_mean, or for the top-entropy mask."""
        return self.entropy_metric or self.masks_entropy

    @property
    def runs_reference(self) -> bool:
        """Whether the update needs the reference log-probs: for the KL term, or for kl_mean alone at kl_beta = 0."""
        return self.kl_beta != 0 or self.kl_metric


@dataclass(frozen=True)
class ResponseBatch:
    """Right-padded rollouts with their response positions, ready for a forward."""

    input_ids: torch.Tensor  # [n, S]
    attention_mask: torch.Tensor  # [n, S]
    positions: torch.Tensor  # [n, T] position whose output predicts response token t
    targets: torch.Tensor  # [n, T] response token ids
    mask: torch.Tensor  # [n, T] bool, True on real response tokens
    behavior_logp: torch.Tensor  # [n, T] float32, 0 at padding


def response_batch(rollouts: Sequence[Rollout], *, pad_id: int, device: torch.device) -> ResponseBatch:
    ids, attn = pad_right([r.full_ids for r in rollouts], pad_id, device)
    lengths = torch.tensor([r.response_len for r in rollouts])
    width = max(1, int(lengths.max()))
    t = torch.arange(width)
    starts = torch.tensor([r.prompt_len for r in rollouts])
    mask = t[None, :] < lengths[:, None]
    last = torch.tensor([r.full_ids.numel() - 1 for r in rollouts])
    # Positions past a row's end are clamped onto its last token; the mask drops them.
    token_pos = torch.minimum(starts[:, None] + t[None, :], last[:, None])
    behavior = torch.zeros(len(rollouts), width)
    for row, r in enumerate(rollouts):
        behavior[row, : r.behavior_logp.numel()] = r.behavior_logp
    token_pos = token_pos.to(device)
    return ResponseBatch(
        input_ids=ids,
        attention_mask=attn,
        positions=token_pos - 1,
        targets=ids.gather(1, token_pos),
        mask=mask.to(device),
        behavior_logp=behavior.to(device),
    )


def _denominator(
    rollouts: Sequence[Rollout], aggregation: str, *, n_samples: int, n_tokens: int, device: torch.device
) -> tuple[int, torch.Tensor | None]:
    """The global batch's D of `nla_core.aggregate_loss`, and for prompt_mean each sample's group token count.

    D counts samples (sequence_mean, seq_mean_token_sum_norm), response tokens (token_mean) or prompt
    groups (prompt_mean) over every rank; a group never spans ranks, so its token count is local.
    """
    if aggregation == "token_mean":
        return max(1, n_tokens), None
    if aggregation != "prompt_mean":
        return n_samples, None
    tokens: dict[int, int] = {}
    for r in rollouts:
        tokens[r.prompt_index] = tokens.get(r.prompt_index, 0) + r.response_len
    (n_groups,) = distributed.all_reduce_sum([len(tokens)])
    group_tokens = torch.tensor([tokens[r.prompt_index] for r in rollouts], dtype=torch.float32, device=device)
    return max(1, int(n_groups)), group_tokens


@dataclass(frozen=True)
class UpdateStats:
    loss: float
    grad_norm: float
    stepped: bool
    kl_mean: float
    entropy_mean: float
    """Mean policy entropy (nats) over the response tokens, in the policy forward before the step."""
    clip_frac: float
    """Share of response tokens where the PPO clip is active (verl / TRL meaning)."""
    outside_clip_frac: float
    """Share of response tokens whose ratio lies outside the clip range, any advantage."""
    tis_frac: float
    token_mask_frac: float
    """Share of response tokens whose surrogate the two-sided ratio mask dropped."""
    entropy_mask_frac: float
    """Share of response tokens whose surrogate the top-entropy mask (top_entropy_quantile) dropped."""
    logp_diff_mean: float
    logp_diff_max: float
    mismatch_masked_frac: float
    time_allreduce: float
    """Seconds spent summing gradients over ranks (0 in one process)."""


def policy_update(
    actor: torch.nn.Module,
    injector: Injector,
    optimizer: torch.optim.Optimizer,
    rollouts: Sequence[Rollout],
    advantages: torch.Tensor,
    activations: torch.Tensor,
    *,
    loss: LossOptions,
    micro_batch: int,
    max_grad_norm: float,
    pad_id: int,
    mismatch_threshold: float | None = None,
    step_optimizer: bool = True,
    share_prefix: bool = True,
    reference_micro_batch: int | None = None,
    prompt_block: int = 4,
    fp8_reference: FP8Linears | None = None,
    fp8_update: FP8Linears | None = None,
) -> UpdateStats:
    """One GRPO step over all rollouts, one micro-batch graph alive at a time.

    Each micro-batch's loss uses the whole batch's denominator (N samples, or all response
    tokens for token_mean), so the summed micro-batch gradients equal the full-batch
    gradient whatever `micro_batch` is. A non-finite grad norm skips the optimizer step.

    The reference log-probs come first, in their own no-grad pass at `reference_micro_batch`
    (no autograd state is alive, so it can be larger). Micro-batches keep groups whole and
    group sequences of like length (`prefix.plan_micro_batches`); with `share_prefix` each
    group's prompt is computed once per `prompt_block` micro-batches (`prefix.prompt_forward`,
    `prefix.response_logprobs`), else every sample runs its full sequence. Statistics stay on
    the device until the end: the loop never waits for the GPU.

    Under torchrun every rank passes its own slice of the batch: the denominator counts the
    global batch and the gradients are summed over ranks before clipping, so every rank
    holds the single-process gradient, sees the same grad norm, and steps (or skips) in
    lockstep. The returned statistics are the global batch's.

    Args:
      rollouts: N rollouts; advantages: [N]; activations: [N, D] (each rollout's prompt vector).
      step_optimizer: False leaves the accumulated (rank-summed) gradient in place (tests).
      share_prefix: compute each group's prompt once (ignored where `supports_prefix_sharing`
        says the model cannot: gradient checkpointing, sliding-window attention).
      reference_micro_batch: samples per reference forward (default 4 * micro_batch).
      prompt_block: micro-batches whose prompts run in one forward (and one backward). A prompt
        forward is little arithmetic but a full pass of host work, when the GPU waits; the
        block's prompt activations stay alive until its last micro-batch's backward.
      fp8_reference: the actor base's FP8 copies, active in the reference pass (fp8=reference); None runs
        it in the model's dtype.
      fp8_update: the same, active in the policy forwards and their backwards (fp8=update): the base layers'
        forwards in FP8, their input gradients g @ W in the weights' dtype.
    """
    if prompt_block < 1:
        raise ValueError(f"prompt_block must be >= 1, got {prompt_block}")
    n_local = len(rollouts)
    if advantages.shape != (n_local,) or activations.shape[0] != n_local:
        raise ValueError(
            f"{n_local} rollouts but advantages {tuple(advantages.shape)}, activations {tuple(activations.shape)}"
        )
    device = next(actor.parameters()).device
    n, n_tokens = (int(c) for c in distributed.all_reduce_sum(
        [n_local, sum(r.response_len for r in rollouts)]
    ))
    denominator, group_tokens = _denominator(rollouts, loss.aggregation, n_samples=n, n_tokens=n_tokens, device=device)
    forward = _Forward(actor, injector, rollouts, activations.to(device, torch.float32, non_blocking=True),
                       pad_id=pad_id, device=device, prompt_block=prompt_block,
                       share_prefix=share_prefix and prefix.supports_prefix_sharing(actor))
    reference = None
    if loss.runs_reference:
        reference = _reference_logprobs(forward, reference_micro_batch or 4 * micro_batch, fp8_reference)
    loss_inputs = _LossInputs(
        advantages=advantages.to(device, torch.float32, non_blocking=True), reference=reference,
        denominator=denominator, group_tokens=group_tokens,
        group_ids=torch.tensor([r.prompt_index for r in rollouts], device=device),
    )
    optimizer.zero_grad(set_to_none=True)
    with fp8_matmuls(fp8_update):  # the backwards run inside too: a checkpointed block recomputes in FP8
        sums, diff_max = _policy_backward(forward, micro_batch, loss, loss_inputs, mismatch_threshold)
    params = [p for p in actor.parameters() if p.requires_grad]
    time_allreduce = distributed.all_reduce_grads(params)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    stepped = math.isfinite(grad_norm)
    if step_optimizer:
        if stepped:
            optimizer.step()
        # Clip does not sanitise NaN/inf: stepping on them would corrupt the moments and weights.
        optimizer.zero_grad(set_to_none=True)
    sums = dict(zip(sums, distributed.all_reduce_sum(torch.stack(list(sums.values())).tolist())))
    (diff_max,) = distributed.all_reduce_max([float(diff_max)])
    tokens = max(sums["tokens"], 1.0)
    return UpdateStats(
        loss=sums["loss"],
        grad_norm=grad_norm,
        stepped=stepped,
        kl_mean=sums["kl"] / tokens if loss.runs_reference else math.nan,
        entropy_mean=sums["entropy"] / max(n_tokens, 1) if loss.entropy_metric else math.nan,
        clip_frac=sums["clip"] / tokens,
        outside_clip_frac=sums["outside"] / tokens,
        tis_frac=sums["tis"] / tokens,
        token_mask_frac=sums["band"] / tokens,
        entropy_mask_frac=sums["entropy_drop"] / tokens,
        logp_diff_mean=sums["diff"] / max(n_tokens, 1),
        logp_diff_max=diff_max,
        mismatch_masked_frac=sums["masked"] / max(n, 1),
        time_allreduce=time_allreduce,
    )


@dataclass(frozen=True)
class _Forward:
    """The actor's forwards over one rank's rollouts, micro-batch by micro-batch."""

    actor: torch.nn.Module
    injector: Injector
    rollouts: Sequence[Rollout]
    activations: torch.Tensor  # [n, D] float32 on the device
    pad_id: int
    device: torch.device
    share_prefix: bool
    prompt_block: int

    def micro_batches(
        self, size: int, *, with_entropy: bool = False
    ) -> Iterator[tuple[torch.Tensor | nla_core.LogprobsAndEntropy, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(logp [n, T] (with_entropy: LogprobsAndEntropy), mask [n, T], behaviour logp [n, T], rows [n] on
        the device) per micro-batch of `size` samples, in `plan_micro_batches` order.

        With `share_prefix` the prompts of `prompt_block` consecutive micro-batches run in one
        forward, whose backward runs when the caller asks for the micro-batch after the block's
        last: by then each micro-batch's own backward has summed its gradient into the prompts' states.
        """
        plan = prefix.plan_micro_batches(self.rollouts, size)
        if not self.share_prefix:
            for rows in plan:
                batch = response_batch([self.rollouts[i] for i in rows], pad_id=self.pad_id, device=self.device)
                index = torch.tensor(rows, device=self.device)
                with self.injector.inject(batch.input_ids, self.activations[index]):
                    logprobs = response_logprobs(self.actor, batch.input_ids, batch.attention_mask, batch.positions,
                                                 batch.targets, with_entropy=with_entropy)
                yield logprobs, batch.mask, batch.behavior_logp, index
            return
        for first in range(0, len(plan), self.prompt_block):
            block = plan[first : first + self.prompt_block]
            block_rows = [i for rows in block for i in rows]
            whole = prefix.prefix_batch(self.rollouts, block_rows, self.injector, pad_id=self.pad_id).to(self.device)
            states = prefix.prompt_forward(
                self.actor, self.injector, whole, self.activations[whole.prompt_sources], defer_gradient=True)
            for part in whole.split([len(rows) for rows in block]):
                logprobs = prefix.response_logprobs(self.actor, states, part, with_entropy=with_entropy)
                yield logprobs, part.mask, part.behavior_logp, part.rows
            states.backward()


def _reference_logprobs(forward: _Forward, size: int, fp8: FP8Linears | None) -> torch.Tensor:
    """[n, T] the reference policy's (adapter off) log-probs, in one no-grad pass of `size`-sample micro-batches
    (no autograd state is alive, so they can be larger than the policy's)."""
    width = max((r.response_len for r in forward.rollouts), default=1)
    reference = torch.zeros(len(forward.rollouts), max(1, width), device=forward.device)
    with torch.no_grad(), reference_policy(forward.actor), fp8_matmuls(fp8):
        for ref_logp, _, _, index in forward.micro_batches(size):
            reference[index, : ref_logp.shape[1]] = ref_logp
    return reference


@dataclass(frozen=True)
class _LossInputs:
    """What each micro-batch's `nla_core.policy_loss` takes from the whole (rank's) batch."""

    advantages: torch.Tensor  # [n] float32 on the device
    reference: torch.Tensor | None  # [n, T] reference log-probs, None when the reference pass is skipped
    denominator: int
    group_ids: torch.Tensor  # [n] prompt index
    group_tokens: torch.Tensor | None  # [n] for prompt_mean


def _policy_backward(
    forward: _Forward, micro_batch: int, loss: LossOptions, inputs: _LossInputs, mismatch_threshold: float | None
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Policy forward, loss and backward per micro-batch; the gradients accumulate in the actor.

    Returns the rank's statistic sums (token-weighted, on the device: the loop never waits for the
    GPU) and the largest |behaviour - trainer| log-prob gap.
    """
    zero = torch.zeros((), dtype=torch.float64, device=forward.device)
    sums = dict(loss=zero, kl=zero, clip=zero, outside=zero, tis=zero, band=zero, diff=zero, tokens=zero, masked=zero,
                entropy=zero, entropy_drop=zero)
    diff_max = zero
    for logprobs, mask, behavior, index in forward.micro_batches(micro_batch, with_entropy=loss.needs_entropy):
        logp, entropy = logprobs if loss.needs_entropy else (logprobs, None)
        diff = torch.where(mask, (behavior - logp.detach()).abs(), torch.zeros_like(logp))
        if loss.entropy_metric:  # over every response token, like logp_diff_mean: before the mismatch mask
            sums["entropy"] = sums["entropy"] + torch.where(mask, entropy, torch.zeros_like(entropy)).sum()
        if mismatch_threshold is not None:
            off_policy = diff.sum(-1) / mask.sum(-1).clamp_min(1) > mismatch_threshold
            sums["masked"] = sums["masked"] + off_policy.sum()
            mask = mask & ~off_policy[:, None]
        keep = None
        if loss.masks_entropy:  # over the tokens the loss sees: after the mismatch mask
            keep = nla_core.top_entropy_mask(entropy.detach(), mask, quantile=loss.top_entropy_quantile)
            sums["entropy_drop"] = sums["entropy_drop"] + (mask & ~keep).sum()
        out = _micro_batch_loss(logp, mask, behavior, index, keep, loss, inputs)
        out.loss.backward()
        tokens = mask.sum()
        sums["loss"] = sums["loss"] + out.loss.detach()
        for key, frac in (("kl", out.kl_mean), ("clip", out.clip_frac), ("outside", out.outside_clip_frac),
                          ("tis", out.tis_frac), ("band", out.token_mask_frac)):
            sums[key] = sums[key] + frac * tokens
        sums["diff"] = sums["diff"] + diff.sum()
        sums["tokens"] = sums["tokens"] + tokens
        diff_max = torch.maximum(diff_max, diff.max())
    return sums, diff_max


def _micro_batch_loss(
    logp: torch.Tensor, mask: torch.Tensor, behavior: torch.Tensor, index: torch.Tensor, keep: torch.Tensor | None,
    loss: LossOptions, inputs: _LossInputs,
) -> nla_core.PolicyLossOutput:
    """`nla_core.policy_loss` on one micro-batch, with the whole batch's denominator.

    Decoupled TIS takes the ratio against the trainer's own log-probs (one update per batch) and
    weighs by the engine's; ratio_cap and none take it against the engine's."""
    decoupled = loss.tis not in ("ratio_cap", None)
    prompt_mean = loss.aggregation == "prompt_mean"
    return nla_core.policy_loss(
        logp,
        logp.detach() if decoupled else behavior,
        inputs.advantages[index],
        mask,
        ref_logp=None if inputs.reference is None else inputs.reference[index, : logp.shape[1]],
        behavior_logp=behavior if decoupled else None,
        kind=loss.policy_loss,
        clip_eps=loss.clip_eps,
        clip_eps_high=loss.clip_eps_high,
        kl_beta=loss.kl_beta,
        kl_clamp=loss.kl_clamp,
        tis=loss.tis,
        tis_cap=loss.tis_cap,
        token_mask=loss.token_mask,
        keep=keep,
        aggregation=loss.aggregation,
        denominator=inputs.denominator,
        max_len=loss.max_len if loss.aggregation == "seq_mean_token_sum_norm" else None,
        group_ids=inputs.group_ids[index] if prompt_mean else None,
        group_tokens=inputs.group_tokens[index] if prompt_mean else None,
    )
