"""Splice-KL: run the target LM with a vector put in its residual stream, compare next-token distributions;
and the check that a model reproduces the activations of the data it is to splice or explain.

For each context (token ids ending at the explained position), the LM runs once as is and
once per replacement: at the output of block `layer`, the residual of the last token is
replaced by the given vector, the remaining blocks run, and the next-token distribution is
compared with the unmodified run's: KL(clean || spliced) (nla_core.kl_categorical). All
variants of a micro-batch go through one batched forward, left-padded with explicit
position ids, so every row's last token sits at the same column.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

import torch

import nla_core
from nla_shell import families
from nla_shell.engines.hf import left_pad
from nla_shell.io.data import DataError, RLRow, stream_rows
from nla_shell.metrics import finite_mean, finite_or_none
from nla_shell.models import pad_right
from nla_shell.pipeline.datagen import capture_activations

MIN_RESIDUAL_COSINE = 0.99
"""Splice-KL (and `nla explain`) refuse a model whose residuals at the data's sites differ more than this from
the parquet's: a different LM of the same width would otherwise be explained and scored without a word."""
RESIDUAL_CHECK_ROWS = 8
"""Training rows `nla explain` re-reads with its --model to check it is the LM they came from."""


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


def splice_kl_metrics(
    rows: Sequence[RLRow],
    golds: torch.Tensor,
    predictions: dict[str, torch.Tensor],
    *,
    model: str,
    source: str | Path,
    seed: int,
    micro_batch: int,
    mean_u: torch.Tensor,
    layer: int,
    d_model: int,
    mse_scale: float | None,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """Splice-KL of each reconstruction and of its two references, on rows whose context re-encodes to the site.

    Spliced: denormalize(normalize(pred)) for "av" and "gold"; "random": random_at_same_error
    of the AV's (else the gold's) reconstruction; "mean": denormalize(mean_u). splice/kl_{name}
    is the mean KL in nats over the rows whose context re-encodes to the site and whose AV (else
    gold) explanation scored (splice/n_rows of them); splice/kl_av_over_random
    how many times the AV's error hurts more than a random one of the same size.
    `model` is the target LM (its residuals at the sites must match the data's, read from `source`), `seed` the
    random reference's, `micro_batch` the contexts per forward.
    Returns (metrics, per-row {name: kl} for every row, empty where not spliced).
    """
    target_tokenizer = families.load_tokenizer(model)
    lm = families.load_causal_lm(model, dtype=dtype).to(device).eval()
    if lm.config.hidden_size != d_model or layer >= lm.config.num_hidden_layers:
        raise DataError(f"model: {model} (hidden size {lm.config.hidden_size}, {lm.config.num_hidden_layers} "
                        f"blocks) cannot be the LM of this data (d_model {d_model}, layer {layer}); pass the datagen model")
    contexts = [target_tokenizer.encode(r.extras["context"], add_special_tokens=False) for r in rows]
    primary = "av" if "av" in predictions else "gold" if "gold" in predictions else None
    keep = [i for i, (r, ids) in enumerate(zip(rows, contexts))
            if reencodes_to_site(r, ids) and (primary is None or bool(torch.isfinite(predictions[primary][i]).all()))]
    if not keep:
        return {"splice/n_rows": 0}, [{} for _ in rows]
    gold = golds[keep].double()
    # A reconstruction that failed where the primary one scored (gold text too long, say) splices gold itself
    # and is reported as NaN for that row.
    failed = {name: ~torch.isfinite(p[keep]).all(-1) for name, p in predictions.items()}
    replacements = {name: nla_core.denormalize_activation(
        nla_core.normalize_activation(torch.where(failed[name].unsqueeze(-1), gold, p[keep].double()), mse_scale),
        gold, scale=mse_scale) for name, p in predictions.items()}
    noise = torch.randn(gold.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    if primary is not None:
        replacements["random"] = nla_core.random_at_same_error(gold, replacements[primary], noise, scale=mse_scale)
    replacements["mean"] = nla_core.denormalize_activation(mean_u.expand_as(gold), gold, scale=mse_scale)
    pad_id = target_tokenizer.pad_token_id if target_tokenizer.pad_token_id is not None else 0  # masked: any id
    result = splice_kl(lm, [contexts[i] for i in keep], {k: v.float() for k, v in replacements.items()},
                       layer=layer, pad_id=pad_id, micro_batch=micro_batch)
    cosine = require_residuals_match(result.resid, gold, model=model, source=source, layer=layer)
    kls = {name: torch.where(failed[name], math.nan, kl) if name in failed else kl for name, kl in result.kl.items()}
    metrics = {"splice/n_rows": len(keep), "splice/resid_cosine_min": float(cosine.min()),
               **{f"splice/kl_{name}": finite_mean(kl) for name, kl in kls.items()}}
    if "av" in result.kl:
        metrics["splice/kl_av_over_random"] = metrics["splice/kl_av"] / max(metrics["splice/kl_random"], 1e-12)
    per_row: list[dict[str, float]] = [{} for _ in rows]
    for j, i in enumerate(keep):
        per_row[i] = {name: finite_or_none(float(kl[j])) for name, kl in kls.items()}
    return metrics, per_row


def reencodes_to_site(row: RLRow, context_ids: Sequence[int]) -> bool:
    """Whether a row's context, encoded again, ends at its site (its `position`, where the row has one): any other
    context would splice, or compare residuals, at another token than the one datagen read."""
    return bool(context_ids) and row.extras.get("position") in (None, len(context_ids) - 1)


def require_residuals_match(resid: torch.Tensor, gold: torch.Tensor, *, model: str, source: str | Path,
                            layer: int) -> torch.Tensor:
    """The cosine of each residual the model computes at a site ([N, D]) with the data's activation there;
    a DataError when their median is below MIN_RESIDUAL_COSINE: `model` is not the LM `source` was read from."""
    cosine = torch.nn.functional.cosine_similarity(resid.double(), gold.double(), dim=-1)
    if float(cosine.median()) < MIN_RESIDUAL_COSINE:
        raise DataError(f"model: {model} does not reproduce the activations of {source} at layer {layer} "
                        f"(median cosine {float(cosine.median()):.3f}); pass the model datagen read")
    return cosine


def check_model_reads_training_data(model: torch.nn.Module, tokenizer, sidecar: Mapping[str, Any],
                                    nla: nla_core.NLAConfig, *, model_name: str, device: torch.device) -> str | None:
    """A DataError (require_residuals_match) unless `model` reproduces the activations of the first parquet
    the model `sidecar` lists under `trained_on` that is still there; returns that parquet, or None when no
    listed parquet is left to check against."""
    for parquet in sidecar.get("trained_on") or []:
        if not Path(parquet).is_file():
            continue
        rows = list(stream_rows(parquet, nla, stop=RESIDUAL_CHECK_ROWS, extra_columns=["position", "context"],
                                key="trained_on"))
        contexts = [tokenizer.encode(r.extras["context"], add_special_tokens=False) for r in rows]
        keep = [i for i, ids in enumerate(contexts) if reencodes_to_site(rows[i], ids)]
        if not keep:
            continue
        ids, mask = pad_right([contexts[i] for i in keep], tokenizer.pad_token_id or 0, device)
        resid = capture_activations(model, ids, mask, nla.extraction_layer_index)
        sites = resid[torch.arange(len(keep), device=resid.device), mask.sum(1) - 1].cpu()
        require_residuals_match(sites, torch.stack([rows[i].activation for i in keep]), model=model_name,
                                source=parquet, layer=nla.extraction_layer_index)
        return parquet
    return None
