"""Splice-KL: run the target LM with a vector put in its residual stream, compare next-token distributions.

For each context (token ids ending at the explained position), the LM runs once as is and
once per replacement: at the output of block `layer`, the residual of the last token is
replaced by the given vector, the remaining blocks run, and the next-token distribution is
compared with the unmodified run's: KL(clean || spliced) (nla_core.kl_categorical). All
variants of a micro-batch go through one batched forward, left-padded with explicit
position ids, so every row's last token sits at the same column.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

import torch

import nla_core
from nla_shell.engines.hf import left_pad
from nla_shell import families


class SpliceKL(NamedTuple):
    kl: dict[str, torch.Tensor]
    """Replacement name -> [N] float32 KL(clean || spliced) in nats."""
    resid: torch.Tensor
    """[N, D] float32: the unmodified residual at each splice site (what the replacements stand in for)."""


@torch.no_grad()
def splice_kl(
    model: torch.nn.Module,
    token_lists: Sequence[Sequence[int]],
    replacements: Mapping[str, torch.Tensor],
    *,
    layer: int,
    pad_id: int,
    micro_batch: int,
) -> SpliceKL:
    """KL of the next token after each context when its last residual at `layer` is replaced.

    Args: token_lists: N contexts (the splice site is each one's last token);
      replacements: name -> [N, D] vectors in the residual stream's units.
    """
    n = len(token_lists)
    for name, vectors in replacements.items():
        if vectors.dim() != 2 or vectors.shape[0] != n:
            raise ValueError(f"replacement {name!r} has shape {tuple(vectors.shape)}, expected [{n}, D]")
    names = list(replacements)
    device = next(model.parameters()).device
    kl: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    resid: list[torch.Tensor] = []
    for start in range(0, n, micro_batch):
        rows = token_lists[start : start + micro_batch]
        b = len(rows)
        ids, mask = left_pad(rows, pad_id, device)
        ids, mask = ids.repeat(1 + len(names), 1), mask.repeat(1 + len(names), 1)
        vectors = torch.cat([replacements[name][start : start + b] for name in names]).to(device)
        seen: list[torch.Tensor] = []

        # Copies 1.. of the batch get their last position replaced; copy 0 runs clean.
        sites = torch.stack([torch.arange(b, ids.shape[0], device=device),
                             torch.full((ids.shape[0] - b,), ids.shape[1] - 1, device=device)], dim=1)

        def replace_last(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            seen.append(hidden[:b, -1].float())
            hidden = nla_core.replace_at_sites(hidden, sites, vectors, norm=None)
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

        handle = families.decoder_blocks(model)[layer].register_forward_hook(replace_last)
        try:
            logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
                           logits_to_keep=1, use_cache=False).logits[:, -1]
        finally:
            handle.remove()
        clean = logits[:b]
        for i, name in enumerate(names, start=1):
            kl[name].append(nla_core.kl_categorical(clean, logits[i * b : (i + 1) * b]).float().cpu())
        resid.append(seen[0].cpu())
    width = next(iter(replacements.values())).shape[1] if replacements else 0
    return SpliceKL(
        kl={name: torch.cat(parts) if parts else torch.zeros(0) for name, parts in kl.items()},
        resid=torch.cat(resid) if resid else torch.zeros(0, width),
    )
