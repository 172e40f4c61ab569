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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from nla_shell.io.config import ConfigError, normalize_fields, require
from nla_shell.io.paths import require_file
from nla_shell.serving.reader import NLAReader, ReaderSettings, load_reader


@dataclass(frozen=True, kw_only=True)
class ExplainConfig(ReaderSettings):
    """Settings of `nla explain`."""

    model: str | None = None
    """Target LM whose activations are explained (HF checkpoint dir with tokenizer); not needed with parquet."""
    text: str | None = None
    """One text to read (give one of text, corpus, parquet)."""
    corpus: str | None = None
    """Documents to read, in datagen's formats (.jsonl, .txt, .parquet with a text column); needs out."""
    parquet: str | None = None
    """Rows with an `activation_vector` column (an eval split, or activations captured elsewhere); needs out."""
    out: str | None = None
    """corpus/parquet: the output parquet; OUT.parts/ holds a running (or killed) run's batches."""
    jsonl: str | None = None
    """corpus/parquet: also write the rows as JSON lines to this file, as they are explained."""
    sites: Literal["all", "sample"] = "all"
    """corpus: every position of each document, or datagen's seeded sample (with datagen's seed, positions_per_doc
    and min_context: exactly the sites datagen wrote)."""
    positions_per_doc: int = 4
    """sites=sample: positions sampled per document."""
    min_context: int | None = None
    """sites=sample: tokens before a sampled position (and the short_context flag's bound); None: the AV's training
    data's value (its sidecar provenance), else datagen's default."""
    max_seq_len: int = 512
    """corpus: documents are cut to their first max_seq_len tokens (as datagen cuts them)."""
    max_docs: int | None = None
    """corpus: read at most this many documents; None reads them all."""
    text_column: str = "text"
    """corpus: JSONL key / parquet column holding a document's text."""
    id_column: str = "id"
    """corpus: JSONL key / parquet column holding a document's id; absent -> "doc{index:06d}"."""
    position: int | None = None
    """text: token index to explain (negative counts from the end); None with all=false explains the last token."""
    all: bool = False
    """text: explain every position."""
    samples: int = 1
    """Explanations sampled per site; the one the AR reconstructs best is kept (best-of-k), all k are written."""
    batch_size: int = 64
    """corpus/parquet: sites per engine call (and per part file)."""
    max_new_tokens: int = 64
    """Longest explanation, in tokens."""
    greedy: bool = False
    """Argmax decoding instead of sampling at temperature 1 (then seed does not matter)."""
    seed: int = 0
    """Seed of the AV's sampling (and of sites=sample)."""
    overwrite: bool = False
    """corpus/parquet: start over, deleting a finished out or a killed run's OUT.parts/."""
    progress_every_s: float = 10.0
    """corpus/parquet: seconds between progress lines (sites, rate, ETA)."""

    def __post_init__(self) -> None:
        normalize_fields(self)
        sources = [key for key in ("text", "corpus", "parquet") if getattr(self, key) is not None]
        if len(sources) != 1:
            raise ConfigError(f"config keys text, corpus and parquet: give exactly one (got {sources or 'none'})")
        if self.all and self.position is not None:
            raise ConfigError("config keys 'position' and 'all' exclude each other; give one")
        if self.text is None:
            require(self.out is not None, "out", None, f"give the output parquet path ({sources[0]} mode)")
            require(self.position is None and not self.all, "position", self.position,
                    "position and all apply to text= only; corpus/parquet explain every site")
        if self.parquet is None:
            require(self.model is not None, "model", None, "give the target LM whose activations are read")
        for key in ("samples", "batch_size", "max_new_tokens", "positions_per_doc", "max_seq_len"):
            require(getattr(self, key) >= 1, key, getattr(self, key), "use an integer >= 1")
        require(not (self.greedy and self.samples > 1), "samples", self.samples,
                "greedy decoding gives the same explanation every time; use samples=1 or drop greedy")
        require(self.min_context is None or self.min_context >= 0, "min_context", self.min_context, "use >= 0 or null")
        require(self.max_docs is None or self.max_docs >= 1, "max_docs", self.max_docs, "use an integer >= 1 or null")


def explain(cfg: ExplainConfig) -> list[dict[str, Any]] | Path:
    """Explain cfg.text's asked positions (printed, and returned as dicts) or every site of a corpus/parquet
    (written to cfg.out, whose path is returned)."""
    for key in ("corpus", "parquet"):
        require_file(key, getattr(cfg, key))
    # Stored vectors need no target LM: it is loaded only to capture a text's or corpus's residuals.
    reader = load_reader(cfg, model=None if cfg.parquet else cfg.model, max_batch=cfg.batch_size * cfg.samples)
    if cfg.text is None:
        from nla_shell.serving.corpus import explain_corpus

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
