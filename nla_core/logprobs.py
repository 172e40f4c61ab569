"""Log-probs of chosen tokens without a float32 copy of the whole [.., T, V] logits.

At V = 151,936 a float32 log_softmax of a micro-batch's logits is the largest tensor of a
GRPO step. These functions work on row chunks: the forward keeps only the log-sum-exp
per row ([rows] float32), and a hand-written backward recomputes each chunk's softmax.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from nla_core._checks import float32_or_wider, require_floating, require_integer, require_ndim

__all__ = [
    "ChunkKernels",
    "LogprobsAndEntropy",
    "SampledTokens",
    "chunk_entropy",
    "chunk_logit_grads",
    "chunk_logprobs",
    "sample_tokens",
    "token_logprobs",
    "token_logprobs_from_hidden",
]

_DEFAULT_CHUNK_ELEMENTS = 1 << 22  # ~16 MB of float32 per chunk


def _rows_per_chunk(chunk_size: int | None, vocab: int) -> int:
    if chunk_size is None:
        return max(1, _DEFAULT_CHUNK_ELEMENTS // max(vocab, 1))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    return chunk_size


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, rows_per_chunk):  # logits [R, V], targets [R]
        acc = torch.promote_types(logits.dtype, torch.float32)
        out = torch.empty(logits.shape[0], dtype=acc, device=logits.device)
        lse = torch.empty_like(out)
        for start in range(0, logits.shape[0], rows_per_chunk):
            part = float32_or_wider(logits[start : start + rows_per_chunk])
            tgt = targets[start : start + rows_per_chunk]
            lse[start : start + rows_per_chunk] = torch.logsumexp(part, dim=-1)
            out[start : start + rows_per_chunk] = (
                part.gather(-1, tgt.unsqueeze(-1)).squeeze(-1) - lse[start : start + rows_per_chunk]
            )
        ctx.save_for_backward(logits, targets, lse)
        ctx.rows_per_chunk = rows_per_chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):  # d out_r / d logits_rv = 1[v = t_r] - softmax_rv
        logits, targets, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        step = ctx.rows_per_chunk
        for start in range(0, logits.shape[0], step):
            g = grad_out[start : start + step].to(lse.dtype).unsqueeze(-1)
            probs = torch.exp(float32_or_wider(logits[start : start + step]) - lse[start : start + step, None])
            part = -g * probs
            part.scatter_add_(-1, targets[start : start + step].unsqueeze(-1), g)
            grad[start : start + step] = part.to(grad.dtype)
        return grad, None, None


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """logp[..., t] = log_softmax(float32(logits[..., t, :]))[targets[..., t]].

    Computed chunk by chunk over tokens so no float32 copy of the whole logits tensor is
    made, in the forward or the backward (which recomputes each chunk's softmax).

    Args:
      logits: [..., T, V] floating (bf16/fp16/fp32/fp64).
      targets: [..., T] integer token ids in [0, V).
      chunk_size: tokens per chunk; default keeps a chunk near 4M elements.
    Returns:
      [..., T] float32 log-probs (float64 for float64 logits), differentiable w.r.t. logits.
    """
    require_floating("logits", logits)
    require_integer("targets", targets)
    if logits.dim() < 2 or logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits must be [..., T, V] and targets [..., T]; got logits {tuple(logits.shape)} "
            f"and targets {tuple(targets.shape)}"
        )
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    flat_targets = targets.reshape(-1).long()
    out = _TokenLogprobs.apply(flat_logits, flat_targets, _rows_per_chunk(chunk_size, vocab))
    return out.reshape(targets.shape)


def _capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """float32_or_wider(logits), soft-capped to c * tanh(z / c) when softcap = c is given."""
    z = float32_or_wider(logits)
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def chunk_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, lse) of one chunk: z = cap(float32(logits)), lse = logsumexp(z), logp = z[target] - lse.

    Args: logits: [R, V] in the matmul's dtype; targets: [R] int64. Returns two [R] float32 (or wider).
    Row-wise over the chunk, so a compiler fuses it into a few passes over the logits.
    """
    z = _capped(logits, softcap)
    lse = torch.logsumexp(z, dim=-1)
    return z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse, lse


def chunk_logit_grads(
    logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, softcap: float | None
) -> torch.Tensor:
    """d(sum_r grad_r logp_r) / d logits of one chunk, in logits' dtype.

    d logp_r / d z_rv = 1[v = t_r] - softmax(z_r)_v, times d z / d logits = 1 - (z / c)^2 under a cap c.
    Args: logits: [R, V]; targets, lse, grad: [R]. Returns [R, V].
    """
    z = _capped(logits, softcap)
    g = grad.to(lse.dtype).unsqueeze(-1)
    d_z = -g * torch.exp(z - lse.unsqueeze(-1))
    d_z.scatter_add_(-1, targets.unsqueeze(-1), g)
    if softcap is not None:  # d(c tanh(x / c))/dx = 1 - tanh^2 = 1 - (z / c)^2
        d_z *= 1 - (z / softcap) ** 2
    return d_z.to(logits.dtype)


def chunk_entropy(logits: torch.Tensor, lse: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Entropy of one chunk's rows: H_r = -sum_v p_rv log p_rv, log p_rv = z_rv - lse_r, z = cap(float32(logits)).

    Summed as p log p rather than lse - sum p z, which cancels in float32 at large logits.
    Args: logits: [R, V]; lse: [R] (`chunk_logprobs`'s). Returns [R] float32 (or wider), >= 0.
    """
    logp = _capped(logits, softcap) - lse.unsqueeze(-1)
    return -(torch.exp(logp) * logp).sum(-1).clamp_max(0.0)


class ChunkKernels(NamedTuple):
    """The per-chunk arithmetic of `token_logprobs_from_hidden`, replaceable by compiled versions
    of the same functions (the shell's `compile_blocks`): same arithmetic, fewer passes over memory."""

    logprobs: Callable[..., tuple[torch.Tensor, torch.Tensor]] = chunk_logprobs
    logit_grads: Callable[..., torch.Tensor] = chunk_logit_grads
    entropy: Callable[..., torch.Tensor] = chunk_entropy


class _HiddenTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, rows_per_chunk, softcap, kernels, entropy=None):  # hidden [R, D], weight [V, D]
        acc = torch.promote_types(hidden.dtype, torch.float32)
        out = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
        lse = torch.empty_like(out)
        for start in range(0, hidden.shape[0], rows_per_chunk):
            sl = slice(start, start + rows_per_chunk)
            logits = torch.nn.functional.linear(hidden[sl], weight)
            out[sl], lse[sl] = kernels.logprobs(logits, targets[sl], softcap)
            if entropy is not None:  # a diagnostic buffer [R], filled from the same chunk's logits
                entropy[sl] = kernels.entropy(logits, lse[sl], softcap)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.rows_per_chunk, ctx.softcap, ctx.kernels = rows_per_chunk, softcap, kernels
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if need_w else None
        step, softcap = ctx.rows_per_chunk, ctx.softcap
        for start in range(0, hidden.shape[0], step):
            sl = slice(start, start + step)
            logits = torch.nn.functional.linear(hidden[sl], weight)
            d_logits = ctx.kernels.logit_grads(logits, targets[sl], lse[sl], grad_out[sl], softcap)
            if need_h:
                grad_h[sl] = d_logits @ weight
            if need_w:
                grad_w += d_logits.to(lse.dtype).T @ hidden[sl].to(lse.dtype)
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None, None


class LogprobsAndEntropy(NamedTuple):
    logp: torch.Tensor
    """[..., T] log-probs of the targets, differentiable."""
    entropy: torch.Tensor
    """[..., T] detached entropy of the policy's next-token distribution at each position, in nats."""


def token_logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    softcap: float | None = None,
    chunk_size: int | None = None,
    kernels: ChunkKernels = ChunkKernels(),
    with_entropy: bool = False,
) -> torch.Tensor | LogprobsAndEntropy:
    """logp[..., t] = log_softmax(z[..., t, :])[targets[..., t]], z = float32(hidden[..., t, :] @ weight.T),
    or z = c * tanh(z / c) with softcap = c (Gemma 2/3's final-logit soft-capping).

    The fused lm_head + log-prob: the [..., T, V] logits never exist at once, in the forward
    or the backward. The matmul runs in the inputs' dtype (as the model's lm_head would),
    the cap and the softmax in float32.

    Args:
      hidden: [..., T, D] final hidden states (after the model's last norm).
      weight: [V, D] lm_head weight (same dtype as hidden).
      targets: [..., T] integer token ids.
      softcap: c > 0 of the final-logit soft-capping, or None for plain logits.
      chunk_size: tokens per chunk; default keeps a chunk's logits near 4M elements.
      kernels: each chunk's arithmetic (`chunk_logprobs`, `chunk_logit_grads`, `chunk_entropy`, or compiled copies).
      with_entropy: also return each position's policy entropy H = -sum_v p_v log p_v, p = softmax(z),
        computed from the same chunk's logits in the same pass (no extra matmul, no [..., T, V] tensor).
    Returns:
      [..., T] float32 (float64 for float64 inputs), differentiable w.r.t. hidden (and
      weight when it requires grad); with_entropy: LogprobsAndEntropy(logp, entropy), the
      entropy [..., T] detached.
    """
    require_floating("hidden", hidden)
    require_floating("weight", weight)
    require_integer("targets", targets)
    require_ndim("weight", weight, 2, "[V, D]")
    if hidden.dim() < 2 or hidden.shape[:-1] != targets.shape or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [..., T, D], weight [V, D] and targets [..., T]; got hidden "
            f"{tuple(hidden.shape)}, weight {tuple(weight.shape)}, targets {tuple(targets.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden has dtype {hidden.dtype} but weight has {weight.dtype}; cast one")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None, got {softcap}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    rows = _rows_per_chunk(chunk_size, weight.shape[0])
    if not with_entropy:
        out = _HiddenTokenLogprobs.apply(flat, weight, targets.reshape(-1).long(), rows, softcap, kernels)
        return out.reshape(targets.shape)
    entropy = torch.empty(flat.shape[0], dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
    out = _HiddenTokenLogprobs.apply(flat, weight, targets.reshape(-1).long(), rows, softcap, kernels, entropy)
    return LogprobsAndEntropy(out.reshape(targets.shape), entropy.reshape(targets.shape))


class SampledTokens(NamedTuple):
    tokens: torch.Tensor
    """[B] int64 sampled token ids."""
    logp: torch.Tensor
    """[B] float32 log-prob of each sampled token under the sampling distribution."""


def sample_tokens(logits: torch.Tensor, *, generator: torch.Generator | None = None) -> SampledTokens:
    """Sample one token per row from softmax(float32(logits)) at temperature 1, full vocabulary.

    Args:
      logits: [B, V] floating.
      generator: optional torch.Generator on logits' device, for reproducible draws.
    Returns:
      SampledTokens(tokens [B] int64, logp [B] float32) — logp is exactly the behaviour
      log-prob an importance ratio needs.
    """
    require_floating("logits", logits)
    require_ndim("logits", logits, 2, "[B, V]")
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    tokens = torch.multinomial(logp_all.exp(), 1, generator=generator).squeeze(-1)
    return SampledTokens(tokens, logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))
