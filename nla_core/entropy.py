"""Per-token policy entropy without a float32 copy of the logits, and the top-entropy token mask.

The fused lm_head path gives the entropy beside the log-probs in the same pass:
`token_logprobs_from_hidden(..., with_entropy=True)`. `token_entropy` is the same arithmetic
from logits that already exist, chunk by chunk over tokens.
"""

from __future__ import annotations

import torch

from nla_core._checks import require_bool, require_floating, require_ndim, require_same_shape
from nla_core.logprobs import _rows_per_chunk, chunk_entropy


def token_entropy(logits: torch.Tensor, *, chunk_size: int | None = None) -> torch.Tensor:
    """H[..., t] = -sum_v p_v log p_v, log p = z - logsumexp(z), z = float32(logits[..., t, :]).

    A diagnostic: computed without gradient, chunk by chunk over tokens, so no float32 copy of
    the whole [..., T, V] logits is made (verl's entropy_from_logits, TRL's, in nats).

    Args:
      logits: [..., T, V] floating (bf16/fp16/fp32/fp64).
      chunk_size: tokens per chunk; default keeps a chunk near 4M elements.
    Returns:
      [..., T] float32 (float64 for float64 logits), detached, >= 0.
    """
    require_floating("logits", logits)
    if logits.dim() < 2:
        raise ValueError(f"logits must be [..., T, V], got shape {tuple(logits.shape)}")
    vocab = logits.shape[-1]
    flat = logits.detach().reshape(-1, vocab)
    out = torch.empty(flat.shape[0], dtype=torch.promote_types(logits.dtype, torch.float32), device=logits.device)
    step = _rows_per_chunk(chunk_size, vocab)
    with torch.no_grad():
        for start in range(0, flat.shape[0], step):
            part = flat[start : start + step]
            lse = torch.logsumexp(part.to(out.dtype), dim=-1)
            out[start : start + step] = chunk_entropy(part, lse, None)
    return out.reshape(logits.shape[:-1])


def top_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, *, quantile: float) -> torch.Tensor:
    """The tokens among the top `quantile` share by entropy (Wang et al. 2025, "80/20"; TRL's top_entropy_quantile).

      tau = Quantile_{1 - quantile}({H_it : m_it}),   keep_it = m_it and H_it >= tau

    torch.quantile's linear interpolation, as TRL. quantile = 1 keeps every token; a batch
    with no token keeps none. Pass the whole batch's entropies (or gather them over ranks):
    the threshold is a statistic of all of them.

    Args:
      entropy: [N, T] floating, >= 0 at unmasked positions (values elsewhere are ignored, even NaN).
      mask: [N, T] bool.
      quantile: 0 < quantile <= 1, the share of tokens kept.
    Returns:
      [N, T] bool, False wherever mask is False.
    """
    require_floating("entropy", entropy)
    require_bool("mask", mask)
    require_ndim("entropy", entropy, 2, "[N, T]")
    require_same_shape("mask", mask, "entropy", entropy)
    if not 0 < quantile <= 1:
        raise ValueError(f"quantile must satisfy 0 < quantile <= 1, got {quantile!r}")
    values = entropy.detach()[mask]
    if values.numel() == 0:
        return torch.zeros_like(mask)
    tau = torch.quantile(values.to(torch.promote_types(values.dtype, torch.float32)), 1.0 - quantile)
    return mask & (torch.where(mask, entropy.detach(), torch.zeros_like(entropy)) >= tau)


__all__ = ["token_entropy", "top_entropy_mask"]
