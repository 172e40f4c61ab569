"""Policy-gradient losses: GRPO (PPO clip), GSPO, CISPO and the on-policy A log p surrogate, with a
k3 KL to a reference, truncated importance sampling, token masks and four aggregations."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from nla_core._checks import (
    require_bool,
    require_choice,
    require_floating,
    require_integer,
    require_ndim,
    require_same_shape,
    require_tensor,
)
from nla_core.kl import kl_k3
from nla_core.ratios import _check_ratio_band, gspo_token_log_ratio, ratio_band_mask
from nla_core.surrogates import Surrogate, cispo_surrogate, clip_range, onpolicy_surrogate, ppo_clip_surrogate
from nla_core.tis import capped_ratio, tis_weights

AGGREGATIONS = ("sequence_mean", "token_mean", "seq_mean_token_sum_norm", "prompt_mean")


class PolicyLossOutput(NamedTuple):
    loss: torch.Tensor
    """Scalar loss, differentiable w.r.t. `logp` only."""
    per_token: torch.Tensor
    """[N, T] float32 per-token loss; 0 where the mask is False."""
    kl: torch.Tensor
    """[N, T] float32 detached k3(logp, ref_logp) (also at kl_beta = 0); 0 where masked or without a reference."""
    ratio: torch.Tensor
    """[N, T] float32 detached policy ratio as used in the surrogate (after a ratio_cap; GSPO: the
    sequence ratio s_i on each of its tokens)."""
    tis_weight: torch.Tensor
    """[N, T] float32 detached importance weight w (1 for ratio_cap and tis=None), after the token masks."""
    clip_frac: torch.Tensor
    """Scalar: fraction of unmasked tokens where the clip is active. grpo/gspo: the clipped term is
    the minimum and the token gets no surrogate gradient: r > 1 + clip_eps_high with A > 0,
    or r < 1 - clip_eps with A < 0 (verl's pg_clipfrac, TRL's clip_ratio/region_mean).
    cispo: the IS weight was clipped (verl's pg_clipfrac for CISPO). onpolicy: 0."""
    outside_clip_frac: torch.Tensor
    """Scalar: fraction of unmasked tokens whose ratio lies outside [1 - clip_eps, 1 + clip_eps_high],
    whatever their advantage (what the reference logs as clip_frac); >= clip_frac."""
    kl_mean: torch.Tensor
    """Scalar: mean k3 over unmasked tokens."""
    tis_frac: torch.Tensor
    """Scalar: fraction of unmasked tokens where truncation/masking changed the weight or ratio."""
    token_mask_frac: torch.Tensor
    """Scalar: fraction of unmasked tokens whose surrogate the token masks dropped (the ratio band
    `token_mask`, the caller's `keep`); 0 without them."""


GRPOLossOutput = PolicyLossOutput
"""The output of `grpo_loss`: the same NamedTuple as `policy_loss`'s."""


def aggregate_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str = "sequence_mean",
    denominator: float | torch.Tensor | None = None,
    max_len: int | None = None,
    group_ids: torch.Tensor | None = None,
    group_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    sequence_mean: sum_i (sum_t m_it l_it / max(1, sum_t m_it)) / D, D = N by default
                   (a sample with no tokens adds 0 but still counts in N: the reference's arithmetic).
    token_mean:    sum_it m_it l_it / D, D = max(1, sum_it m_it) by default (TRL's bnpo/dapo, verl's token-mean).
    seq_mean_token_sum_norm: sum_it m_it l_it / (D * L), L = max_len (Dr. GRPO's constant: the longest
                   allowed response), D = N by default (TRL's dr_grpo; verl's seq-mean-token-sum-norm
                   with loss_scale_factor = L is D = 1).
    prompt_mean:   sum_i (sum_t m_it l_it) / T_g(i) / D, T_g the tokens of all samples of i's group,
                   D = the number of groups by default (ScaleRL's prompt-level average: each prompt
                   weighs the same, its tokens equally).
    Pass the full batch's D when this is one micro-batch (or one rank) of a larger batch,
    so that the parts' losses and gradients add up to the whole batch's (for prompt_mean also
    group_tokens, when a group spans parts).

    Args:
      per_token: [N, T] floating; values at masked positions are ignored even if NaN/inf.
      mask: [N, T] bool.
      max_len: seq_mean_token_sum_norm only: L >= 1.
      group_ids: prompt_mean only: [N] integer, equal ids form a group.
      group_tokens: prompt_mean only, optional: [N] each sample's T_g (default: counted from mask).
    Returns: scalar float32 (or float64 for float64 input).
    """
    require_floating("per_token", per_token)
    require_bool("mask", mask)
    require_ndim("per_token", per_token, 2, "[N, T]")
    require_same_shape("mask", mask, "per_token", per_token)
    _check_aggregation(per_token.shape[0], mode, max_len=max_len, group_ids=group_ids, group_tokens=group_tokens)
    kept = torch.where(mask, per_token, torch.zeros_like(per_token))
    if mode == "sequence_mean":
        per_seq = kept.sum(-1) / mask.sum(-1).clamp_min(1)
        return per_seq.sum() / (per_token.shape[0] if denominator is None else denominator)
    if mode == "token_mean":
        total = kept.sum()
        return total / (mask.sum().clamp_min(1) if denominator is None else denominator)
    if mode == "seq_mean_token_sum_norm":
        return kept.sum() / ((per_token.shape[0] if denominator is None else denominator) * max_len)
    ids, group = torch.unique(group_ids, return_inverse=True)
    n_groups = ids.numel()
    if group_tokens is None:
        counts = torch.zeros(n_groups, dtype=per_token.dtype, device=per_token.device)
        group_tokens = counts.index_add(0, group, mask.sum(-1).to(per_token.dtype))[group]
    per_seq = kept.sum(-1) / group_tokens.to(per_token.dtype).clamp_min(1)
    return per_seq.sum() / (n_groups if denominator is None else denominator)


def _check_aggregation(
    n: int, mode: str, *, max_len: int | None, group_ids: torch.Tensor | None, group_tokens: torch.Tensor | None
) -> None:
    """`aggregate_loss`'s mode and its extra arguments, for N samples."""
    require_choice("mode", mode, AGGREGATIONS)
    if (max_len is not None) != (mode == "seq_mean_token_sum_norm"):
        raise ValueError(f"max_len is needed by mode='seq_mean_token_sum_norm' and only by it; mode={mode!r}, "
                         f"max_len={max_len!r}")
    if mode == "seq_mean_token_sum_norm" and not (isinstance(max_len, int) and max_len >= 1):
        raise ValueError(f"max_len must be an integer >= 1 (the longest allowed response), got {max_len!r}")
    if mode != "prompt_mean":
        if group_ids is not None or group_tokens is not None:
            raise ValueError(f"group_ids / group_tokens are for mode='prompt_mean' only, not {mode!r}")
        return
    if group_ids is None:
        raise ValueError("mode='prompt_mean' needs group_ids ([N] integer, one group per prompt)")
    require_integer("group_ids", group_ids)
    if group_ids.shape != (n,):
        raise ValueError(f"group_ids must be [N] = [{n}], got shape {tuple(group_ids.shape)}")
    if group_tokens is not None:
        require_tensor("group_tokens", group_tokens)
        if group_tokens.shape != (n,):
            raise ValueError(f"group_tokens must be [N] = [{n}], got shape {tuple(group_tokens.shape)}")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros_like(x)).sum() / mask.sum().clamp_min(1)


def _masked_f32(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # Padding is zeroed *before* any exp, so NaN/inf there cannot leak into values or grads.
    return torch.where(mask, x.float(), torch.zeros((), dtype=torch.float32, device=x.device))


def _token_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return logp - old_logp


def _ppo(ratio: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, **clip: Any) -> Surrogate:
    return ppo_clip_surrogate(ratio, adv, **clip)


def _onpolicy(ratio: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, **clip: Any) -> Surrogate:
    return onpolicy_surrogate(logp, adv)


class _Objective(NamedTuple):
    log_ratio: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    """(logp, old_logp, mask) -> [N, T] log-ratio."""
    surrogate: Callable[..., Surrogate]
    """(ratio, logp, advantages, clip_eps=, clip_eps_high=) -> Surrogate."""


# Each kind is a choice of functions; the math below never branches on the name.
_OBJECTIVES = {
    "grpo": _Objective(_token_log_ratio, _ppo),
    "gspo": _Objective(gspo_token_log_ratio, _ppo),
    "cispo": _Objective(_token_log_ratio, cispo_surrogate),
    "onpolicy": _Objective(_token_log_ratio, _onpolicy),
}
POLICY_LOSSES = tuple(_OBJECTIVES)


class _Weighted(NamedTuple):
    ratio: torch.Tensor  # [N, T] the ratio the surrogate sees
    weight: torch.Tensor  # [N, T] detached importance weight
    capped: torch.Tensor  # [N, T] bool, where TIS changed the ratio or the weight


def _tis_ratio_cap(log_ratio, log_rho, mask, *, cap, max_log_ratio) -> _Weighted:
    r = capped_ratio(log_ratio, cap=cap)
    return _Weighted(r.ratio, torch.ones_like(r.ratio), r.capped)


def _tis_none(log_ratio, log_rho, mask, *, cap, max_log_ratio) -> _Weighted:
    ratio = torch.exp(log_ratio.clamp(max=max_log_ratio))
    return _Weighted(ratio, torch.ones_like(ratio), torch.zeros_like(mask))


def _tis_decoupled(*, truncate: bool, per_sequence: bool) -> Callable[..., _Weighted]:
    def weigh(log_ratio, log_rho, mask, *, cap, max_log_ratio) -> _Weighted:
        # A ratio beyond e^max_log_ratio carries no gradient; bounding it keeps exp finite.
        w = tis_weights(log_rho, mask, cap=cap, truncate=truncate, per_sequence=per_sequence)
        return _Weighted(torch.exp(log_ratio.clamp(max=max_log_ratio)), w.weight, w.capped)
    return weigh


# Each mode maps (log_ratio, log_rho = the engine/trainer log-ratio, mask, *, cap, max_log_ratio) to the ratio the
# surrogate sees, the importance weight and where TIS acted.
_TIS = {
    "ratio_cap": _tis_ratio_cap,
    "token_truncate": _tis_decoupled(truncate=True, per_sequence=False),
    "token_mask": _tis_decoupled(truncate=False, per_sequence=False),
    "sequence_truncate": _tis_decoupled(truncate=True, per_sequence=True),
    "sequence_mask": _tis_decoupled(truncate=False, per_sequence=True),
    None: _tis_none,
}
TIS_MODES = tuple(_TIS)


class _Unset:
    def __repr__(self) -> str:
        return "'ratio_cap' (the default)"


_DEFAULT_TIS: Any = _Unset()


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    kind: str = "grpo",
    ref_logp: torch.Tensor | None = None,
    behavior_logp: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    kl_beta: float = 0.04,
    kl_clamp: float | None = None,
    tis: str | None = _DEFAULT_TIS,
    tis_cap: float = 2.0,
    token_mask: tuple[float, float] | None = None,
    keep: torch.Tensor | None = None,
    aggregation: str = "sequence_mean",
    denominator: float | torch.Tensor | None = None,
    max_len: int | None = None,
    group_ids: torch.Tensor | None = None,
    group_tokens: torch.Tensor | None = None,
    max_log_ratio: float = 20.0,
) -> PolicyLossOutput:
    """A policy-gradient loss over sampled tokens, with k3 KL and truncated importance sampling:
    the composition of `gspo_token_log_ratio`, `capped_ratio` / `tis_weights`, a surrogate
    (`ppo_clip_surrogate`, `cispo_surrogate`, `onpolicy_surrogate`), `kl_k3` and `aggregate_loss`.

      r_it  = exp(logp_it - old_logp_it)                      (grpo, cispo, onpolicy)
            = exp(logp_it - sg[logp_it] + sg[log s_i])        (gspo; log s_i = mean_t (logp_it - old_logp_it))
      s_it  = min(r_it A_i, clip(r_it, 1 - clip_eps, 1 + clip_eps_high) A_i)    grpo (PPO clip), gspo (GSPO)
            = sg[clip(r_it, 1 - clip_eps, 1 + clip_eps_high)] A_i logp_it       cispo (MiniMax-M1's CISPO)
            = A_i logp_it                                                       onpolicy (EasyNLA; no ratio)
      l_it  = -(w_it k_it s_it - kl_beta k3(logp_it, ref_logp_it))
      loss  = aggregate_loss(l, mask, mode=aggregation, ...)

    k_it = 1[keep_it] 1[token_mask[0] <= rho_it <= token_mask[1]] drops a token's surrogate (its
    KL term stays; the aggregation's counts do not change), rho_it the engine/trainer ratio:
    exp(old - behavior) in the decoupled TIS modes, exp(sg[logp] - old) otherwise (there old_logp
    are the engine's). token_mask = (0.5, 2) is IcePop's band (verl / prime-rl: masked IS).
    `keep` is any caller's token mask, e.g. `top_entropy_mask`.

    TIS (engine/trainer mismatch):
      "ratio_cap" (the reference; the default except for gspo): old_logp are the engine's log-probs;
        r = min(r, tis_cap); w = 1 (gspo caps s_i; onpolicy, which has no ratio, refuses it).
      "token_*" / "sequence_*" (decoupled): old_logp are the trainer's (logp.detach() for a
        single update per batch), behavior_logp the engine's; w from `tis_weights`
        (truncate: min(rho, tis_cap); mask: rho 1[rho <= tis_cap]), detached.
      None: w = 1 and no cap.
    kind="gspo" must name its tis: GSPO's clip (about 3e-4) is far below the engine/trainer gap
    that "ratio_cap" and None put inside its ratio (old_logp = the engine's); "sequence_truncate"
    takes the ratio against the trainer's. With "ratio_cap", tis_cap must be >= 1 + clip_eps_high.
    behavior_logp is refused where it would be ignored (tis "ratio_cap" or None).
    kl_beta != 0 needs ref_logp (pass kl_beta=0 for no KL term); with a reference, kl is measured
    at kl_beta = 0 too. kl_clamp bounds the log-ratio inside k3 (EasyNLA: 12). Outside ratio_cap
    the log-ratio is clamped at max_log_ratio before exp, so no token overflows to inf.

    Args (N = B prompts x G samples each, T response tokens):
      logp: [N, T] trainer log-probs of the sampled tokens (the only input with gradient).
      old_logp: [N, T] log-probs the ratio is taken against (see TIS above).
      advantages: [N] one advantage per sample.
      mask: [N, T] bool, True on generated tokens. Masked positions never reach the loss or
        the gradients, even if they hold NaN or inf.
      kind: "grpo", "gspo", "cispo" or "onpolicy" (POLICY_LOSSES).
      ref_logp: [N, T] reference-policy log-probs (adapter off), or None (then kl_beta must be 0).
      behavior_logp: [N, T] engine log-probs, required by the decoupled TIS modes.
      token_mask: (low, high) with 0 < low <= 1 <= high, or None.
      keep: [N, T] bool, or None.
      aggregation, denominator, max_len, group_ids, group_tokens: see `aggregate_loss`.
    Returns:
      PolicyLossOutput; every tensor but `loss` is detached.
    """
    tis = _check_policy_arguments(
        logp, old_logp, advantages, mask, kind=kind, ref_logp=ref_logp, behavior_logp=behavior_logp,
        clip_eps=clip_eps, clip_eps_high=clip_eps_high, kl_beta=kl_beta, tis=tis, tis_cap=tis_cap,
        token_mask=token_mask, keep=keep, aggregation=aggregation, max_len=max_len, group_ids=group_ids,
        group_tokens=group_tokens)
    objective = _OBJECTIVES[kind]
    lp, old = _masked_f32(logp, mask), _masked_f32(old_logp, mask).detach()
    engine = None if behavior_logp is None else _masked_f32(behavior_logp, mask).detach()
    # The engine/trainer log-ratio: decoupled, old_logp are the trainer's; else they are the engine's.
    engine_gap = lp.detach() - old if engine is None else old - engine
    tis_out = _TIS[tis](objective.log_ratio(lp, old, mask), engine_gap, mask, cap=tis_cap,
                        max_log_ratio=max_log_ratio)
    kept = _surrogate_mask(mask, keep, token_mask, engine_gap)
    weight = torch.where(kept, tis_out.weight, torch.zeros_like(tis_out.weight))
    surrogate = objective.surrogate(tis_out.ratio, lp, advantages.float(), clip_eps=clip_eps,
                                    clip_eps_high=clip_eps_high)
    per_token = -(weight * surrogate.value)
    kl = torch.zeros_like(lp) if ref_logp is None else kl_k3(lp, _masked_f32(ref_logp, mask).detach(), clamp=kl_clamp)
    if kl_beta != 0:
        per_token = per_token + kl_beta * kl
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    loss = aggregate_loss(per_token, mask, mode=aggregation, denominator=denominator, max_len=max_len,
                          group_ids=group_ids, group_tokens=group_tokens)
    low, high = clip_range(clip_eps, clip_eps_high)
    ratio = tis_out.ratio.detach()
    zero = torch.zeros_like(lp)
    return PolicyLossOutput(
        loss=loss,
        per_token=per_token.detach(),
        kl=torch.where(mask, kl, zero).detach(),
        ratio=torch.where(mask, ratio, zero),
        tis_weight=torch.where(mask, weight, zero).detach(),
        clip_frac=_masked_mean(surrogate.clipped.float(), mask),
        outside_clip_frac=_masked_mean(((ratio < low) | (ratio > high)).float(), mask),
        kl_mean=_masked_mean(kl.detach(), mask),
        tis_frac=_masked_mean(tis_out.capped.float(), mask),
        token_mask_frac=_masked_mean((mask & ~kept).float(), mask),
    )


def _surrogate_mask(
    mask: torch.Tensor, keep: torch.Tensor | None, token_mask: tuple[float, float] | None, engine_gap: torch.Tensor
) -> torch.Tensor:
    """The tokens whose surrogate counts: mask, the caller's keep, and the ratio band on the engine gap."""
    kept = mask if keep is None else mask & keep
    if token_mask is None:
        return kept
    return kept & ratio_band_mask(engine_gap, mask, low=token_mask[0], high=token_mask[1])


def _check_policy_arguments(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, kind: str,
    ref_logp: torch.Tensor | None, behavior_logp: torch.Tensor | None, clip_eps: float,
    clip_eps_high: float | None, kl_beta: float, tis: Any, tis_cap: float, token_mask: tuple[float, float] | None,
    keep: torch.Tensor | None, aggregation: str, max_len: int | None, group_ids: torch.Tensor | None,
    group_tokens: torch.Tensor | None,
) -> str | None:
    """`policy_loss`'s checks, up front with one line each; returns tis with its default resolved."""
    for name, x in (("logp", logp), ("old_logp", old_logp), ("advantages", advantages)):
        require_floating(name, x)
    require_bool("mask", mask)
    require_ndim("logp", logp, 2, "[N, T]")
    require_same_shape("old_logp", old_logp, "logp", logp)
    require_same_shape("mask", mask, "logp", logp)
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be [N] = [{logp.shape[0]}] (one per row of logp {tuple(logp.shape)}), "
                         f"got shape {tuple(advantages.shape)}")
    for name, x in (("ref_logp", ref_logp), ("behavior_logp", behavior_logp)):
        if x is not None:
            require_floating(name, x)
            require_same_shape(name, x, "logp", logp)
    if keep is not None:
        require_bool("keep", keep)
        require_same_shape("keep", keep, "logp", logp)
    require_choice("kind", kind, POLICY_LOSSES)
    if tis is _DEFAULT_TIS and kind == "gspo":
        raise ValueError("kind='gspo' needs tis stated: 'ratio_cap' and None take GSPO's sequence ratio against "
                         "old_logp (the engine's), whose gap to the trainer exceeds GSPO's ~3e-4 clip; "
                         "tis='sequence_truncate' with behavior_logp takes it against the trainer's")
    tis = "ratio_cap" if tis is _DEFAULT_TIS else tis
    require_choice("tis", tis, TIS_MODES)
    require_choice("aggregation", aggregation, AGGREGATIONS)
    _check_aggregation(logp.shape[0], aggregation, max_len=max_len, group_ids=group_ids, group_tokens=group_tokens)
    if kind == "onpolicy" and tis == "ratio_cap":
        raise ValueError("kind='onpolicy' has no ratio for tis='ratio_cap' to cap: use tis=None (EasyNLA) "
                         "or a decoupled mode (token_/sequence_ truncate or mask) with behavior_logp")
    decoupled = tis not in ("ratio_cap", None)
    if decoupled and behavior_logp is None:
        raise ValueError(f"tis={tis!r} needs behavior_logp (the rollout engine's log-probs)")
    if not decoupled and behavior_logp is not None:
        raise ValueError(f"behavior_logp would be ignored with tis={tis!r}: pass the engine's log-probs as "
                         "old_logp, or choose a decoupled tis mode (token_/sequence_ truncate or mask)")
    _, high = clip_range(clip_eps, clip_eps_high)
    if tis is not None and not tis_cap > 0:
        raise ValueError(f"tis_cap must be > 0, got {tis_cap!r}")
    if tis == "ratio_cap" and tis_cap < high:
        raise ValueError(
            f"tis_cap = {tis_cap!r} is below 1 + clip_eps_high = {high!r}: with tis='ratio_cap' it would "
            "cap positive-advantage ratios inside the PPO clip range; use tis_cap >= 1 + clip_eps_high")
    if token_mask is not None:
        _check_ratio_band(*token_mask)
    if kl_beta != 0 and ref_logp is None:
        raise ValueError(f"kl_beta={kl_beta!r} weighs a KL to the reference, but ref_logp is None: "
                         "pass ref_logp, or kl_beta=0 for no KL term")
    return tis


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    **options: Any,
) -> PolicyLossOutput:
    """GRPO loss with PPO clipping, k3 KL and truncated importance sampling: `policy_loss(kind="grpo")`.

      r_it  = exp(logp_it - old_logp_it)
      s_it  = min(r_it A_i, clip(r_it, 1 - clip_eps, 1 + clip_eps_high) A_i)
      l_it  = -(w_it s_it - kl_beta k3(logp_it, ref_logp_it))
      loss  = aggregate_loss(l, mask, mode=aggregation, denominator=denominator)

    TIS modes, shapes and every keyword option (ref_logp, behavior_logp, clip_eps, clip_eps_high,
    kl_beta, kl_clamp, tis, tis_cap, aggregation, denominator, max_log_ratio, ...) with their
    defaults as in `policy_loss`.

    Args:
      logp: [N, T] (the only input with gradient); old_logp: [N, T]; advantages: [N]; mask: [N, T] bool.
    Returns:
      PolicyLossOutput (GRPOLossOutput); every tensor but `loss` is detached.
    """
    if "kind" in options:
        raise ValueError(f"grpo_loss is policy_loss(kind='grpo'); call policy_loss for kind={options['kind']!r}")
    return policy_loss(logp, old_logp, advantages, mask, kind="grpo", **options)


__all__ = [
    "AGGREGATIONS", "GRPOLossOutput", "POLICY_LOSSES", "PolicyLossOutput", "TIS_MODES",
    "aggregate_loss", "grpo_loss", "policy_loss",
]
