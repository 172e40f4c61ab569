"""`nla explain`: read activations with the target LM, explain them with the AV, rebuild them with the AR.

Three sources: one `text` (the positions asked are printed, one block each), a `corpus`
(datagen's formats: every position, or datagen's seeded sample) or a `parquet` of
`activation_vector` rows; the last two are explained in batches through the chosen engine
into a parquet (and optional JSONL) that a killed run resumes (nla_shell.serving.corpus).
For each site the residual at the sidecar's extraction layer is captured exactly as datagen
does, the AV writes `samples` explanations (temperature 1, seeded, or greedy), and the AR's
reconstruction from each gives the MSE; the best is kept, with its FVE against the
predict-the-mean baseline stored by `nla sft` in the AR's `nla_meta.yaml`. A position with
fewer tokens before it than datagen's `min_context` (from the provenance of the datasets the
AV was trained on) is flagged: the AV was never trained on one.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from nla_shell.io.paths import require_file
from nla_shell.serving.config import ExplainConfig
from nla_shell.serving.corpus import explain_corpus
from nla_shell.serving.reader import NLAReader, load_reader

__all__ = ["ExplainConfig", "explain", "explain_text", "text_positions"]


def explain(cfg: ExplainConfig) -> list[dict[str, Any]] | Path:
    """Explain cfg.text's asked positions (printed, and returned as dicts) or every site of a corpus/parquet
    (written to cfg.out, whose path is returned)."""
    for key in ("corpus", "parquet"):
        require_file(key, getattr(cfg, key))
    # Stored vectors need no target LM: it is loaded only to capture a text's or corpus's residuals.
    reader = load_reader(cfg, model=None if cfg.parquet else cfg.model, max_batch=cfg.batch_size * cfg.samples)
    if cfg.text is None:
        return explain_corpus(cfg, reader)
    return explain_text(cfg, reader)


def text_positions(n_tokens: int, *, position: int | None, every: bool) -> list[int]:
    """The positions asked of a text of n_tokens: all, or the one given (negative from the end; default the last)."""
    if n_tokens == 0:
        raise ValueError("text encodes to no tokens; give some text")
    if every:
        return list(range(n_tokens))
    position = -1 if position is None else position
    if not -n_tokens <= position < n_tokens:
        raise ValueError(f"position {position} is outside the text's {n_tokens} tokens (0..{n_tokens - 1})")
    return [position % n_tokens]


def explain_text(cfg: ExplainConfig, reader: NLAReader) -> list[dict[str, Any]]:
    """Explain the asked positions of cfg.text; prints one block per position and returns them as dicts."""
    tokenizer = reader.target_tokenizer
    ids = tokenizer.encode(cfg.text, add_special_tokens=False)
    positions = text_positions(len(ids), position=cfg.position, every=cfg.all)
    (acts,) = reader.capture([ids], [positions])
    torch.manual_seed(cfg.seed)
    explained = reader.explain(acts, samples=cfg.samples, greedy=cfg.greedy, max_new_tokens=cfg.max_new_tokens)
    results = []
    for p, site in zip(positions, explained):
        result = {"position": p, "token": tokenizer.decode([ids[p]]), "context": tokenizer.decode(ids[: p + 1]),
                  "explanation": site.explanation, "raw": site.raw[site.best], "mse": site.mse, "fve": site.fve,
                  "explanations": site.explanations, "mses": site.mses, "short_context": p < reader.min_context}
        results.append(result)
        print_site(result, reader)
    return results


def print_site(result: dict[str, Any], reader: NLAReader) -> None:
    """One position's block: token and context, the kept explanation, its MSE and FVE, a short-context note."""
    p, mse, fve = result["position"], result["mse"], result["fve"]
    shown = result["explanation"] if result["explanation"] is not None else \
        f"<no explanation extracted from {result['raw']!r}>"
    if mse is None or not math.isfinite(mse):
        score = "no reconstruction: nothing extracted for the AR"
    else:
        score = f"mse {mse:.4f} | " + (f"FVE {fve:.1%}" if fve is not None else "FVE n/a (no baselines in the sidecars)")
    print(f"[{p}] token {result['token']!r} | context …{result['context'][-60:]!r}\n    {shown}\n    {score}", flush=True)
    if result["short_context"]:
        print(f"    note: only {p} token(s) before this position; datagen sampled positions with >= {reader.min_context}"
              f"{'' if reader.min_context_recorded else ' (its default; the sidecar records none)'}, so the AV never "
              "trained on one this short", flush=True)
