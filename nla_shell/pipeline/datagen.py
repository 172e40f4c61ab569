"""`nla datagen`: documents -> sampled token positions -> residual activations -> NLA datasets.

For each document (JSONL / text / parquet) the target LM runs once; the residual stream
at the output of block K is read at a few seeded positions (each with at least
`min_context` tokens before it). Each document goes to exactly one split, chosen by a
seeded hash of its id, so no document is in two splits:

    rl.parquet       prompt (chat messages with <INJECT>), activation_vector, doc_id,
                     n_raw_tokens, activation_layer, position, context
    av_sft.parquet   ... + explanation, response ("<explanation>\n…\n</explanation>")
    ar_sft.parquet   the same, but prompt is the AR template filled in (a string)
    eval.parquet     ... + explanation, response (held-out documents for `nla eval`)

each with its sidecar `<file>.nla_meta.yaml`. Column names, types and sidecar keys are
upstream's (kitft nla/datagen/stage3_build.py, docs/sidecar.md); position and context are
nla's additions: `position` is the 0-based index of the site's token in the document's
token ids (`tokenizer.encode(text, add_special_tokens=False)`, cut to max_seq_len) and
`context` the text up to and including it. Gold explanations come from the `explainer` the
user chose (nla_shell.explainers: an LLM API, a local model, a JSONL file keyed by
(doc_id, position), or the toy language's rule); `write_sites=FILE` instead writes the
sites that need one, to be labelled by hand. Outputs are written to a temp dir and moved
into place at the end, so an interrupted run leaves nothing half-written and can simply be
run again (the api/local explainers' reply cache makes the rerun free up to where it stopped).

The settings (DatagenConfig, each key's docstring and checks) live in nla_shell.pipeline.datagen_config.
Reading the corpus, the seeded positions and the split assignment live in
nla_shell.pipeline.documents; the split schemas and the parquet writer in
nla_shell.pipeline.dataset_writer (both re-exported here).
"""

from __future__ import annotations

import os
import shutil
from itertools import islice
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import torch

from nla_core import actor_content, marker_content, parse_sidecar
from nla_shell.explainers import Site, make_explainer
from nla_shell.explainers.jsonl import write_sites
from nla_shell.io.config import ConfigError
from nla_shell import families
from nla_shell.io.data import DataError, av_prompt_messages, check_tokenizer
from nla_shell.io.injection_chars import remember_injection_char
from nla_shell.io.paths import require_file, require_model
from nla_shell.io.progress import progress_bar, say_line
from nla_shell.pipeline.datagen_config import DatagenConfig, _sidecar_scale
from nla_shell.pipeline.dataset_writer import EXTRA_COLUMNS, SPLITS, _SplitWriter
from nla_shell.pipeline.documents import (
    Document, assign_split, count_documents, document_positions, read_documents,
)
from nla_shell.pipeline.markers import choose_injection_char, injection_char_candidates
from nla_shell.io.sidecars import dataset_sidecar, write_sidecar
from nla_shell.models.common import pad_right
from nla_shell.training.runtime import resolve_device, seed_everything

__all__ = [
    "TMP_DIR_NAME",
    "DatagenResult",
    "capture_activations",
    "datagen",
    "datagen_sites",
    "dataset_marker",
    "document_sites",
    "split_fractions",
    "tokenized_documents",
]

TMP_DIR_NAME = ".datagen_tmp"
"""Where a run writes under out_dir before moving its complete outputs into place."""


# --------------------------------------------------------------------------- activations


class _Captured(Exception):
    """Raised by the capture hook to stop the forward after block K (the later blocks are not needed)."""


@torch.no_grad()
def capture_activations(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer: int) -> torch.Tensor:
    """The residual stream at the output of block `layer`, for every position.

    Equals HF `hidden_states[layer + 1]` of a plain forward, except for the last block,
    where HF applies the final norm and this returns the raw residual (what the AR reads).
    Blocks after `layer` are not run.

    Args: input_ids, attention_mask: [B, S], right-padded. Returns: [B, S, D] float32.
    """
    layers = families.decoder_blocks(model)
    if not 0 <= layer < len(layers):
        raise ValueError(f"layer={layer} but the model has {len(layers)} blocks (0..{len(layers) - 1}); choose a smaller layer")
    out: list[torch.Tensor] = []

    def hook(module, args, output):
        out.append(output[0] if isinstance(output, tuple) else output)
        raise _Captured

    handle = layers[layer].register_forward_hook(hook)
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    except _Captured:
        pass
    finally:
        handle.remove()
    return out[0].float()


@dataclass(frozen=True)
class DatagenResult:
    paths: dict[str, Path]
    """split -> parquet path (splits with a share > 0 only)."""
    rows: dict[str, int]
    """split -> row count."""
    documents: int
    """Documents read."""
    skipped_short: int
    """Documents skipped for having no position with min_context tokens before it."""
    injection_char: str
    """The character the sidecars name for <INJECT>."""
    d_model: int
    """Width of the activations."""


# --------------------------------------------------------------------------- sites


def split_fractions(cfg: DatagenConfig) -> dict[str, float]:
    """split -> share of documents, rl taking what the other three leave."""
    shares = {"av_sft": cfg.av_sft_fraction, "ar_sft": cfg.ar_sft_fraction, "eval": cfg.eval_fraction}
    return {"rl": 1.0 - sum(shares.values()), **shares}



def document_sites(doc: Document, tokens: list[int], cfg: DatagenConfig, tokenizer: Any,
                   fractions: Mapping[str, float]) -> tuple[str, list[Site]]:
    """The document's split and its sampled sites; depends only on (doc_id, tokens, seed, settings)."""
    split = assign_split(doc.doc_id, cfg.seed, fractions)
    positions = document_positions(doc.doc_id, len(tokens), seed=cfg.seed, k=cfg.positions_per_doc,
                                   min_context=cfg.min_context)
    return split, [Site(doc.doc_id, p, tuple(tokens[: p + 1]), tokenizer.decode(tokens[: p + 1]),
                        tokenizer.decode([tokens[p]]), doc.topic) for p in positions]


def tokenized_documents(cfg: DatagenConfig, tokenizer: Any) -> Iterator[tuple[Document, list[int]]]:
    """The corpus's documents (at most max_docs) with their first max_seq_len token ids."""
    docs = read_documents(cfg.corpus, text_column=cfg.text_column, id_column=cfg.id_column)
    for n_docs, doc in enumerate(docs):
        if cfg.max_docs is not None and n_docs >= cfg.max_docs:
            return
        yield doc, tokenizer.encode(doc.text, add_special_tokens=False)[: cfg.max_seq_len]


def dataset_marker(cfg: DatagenConfig, tokenizer: Any, model_config: Any) -> str:
    """The injection char of this run: cfg.injection_char when it can serve, else the first usable candidate.

    It must be absent from the corpus's documents (the first max_docs, one cheap read of the
    texts, untokenized) and the templates. The sites pass (write_sites) and the labelled run
    both call it before anything is written, so they agree or fail alike, and a run that would
    be refused writes nothing. A marker that carries its leading space (" X") is stored with
    the AV template through nla_core.marker_content.
    """
    corpus_chars = set().union(*(doc.text for doc in islice(
        read_documents(cfg.corpus, text_column=cfg.text_column, id_column=cfg.id_column), cfg.max_docs)))
    av_content = actor_content(cfg.av_template)
    return choose_injection_char(tokenizer, corpus_chars | set(cfg.av_template) | set(cfg.ar_template),
                                 av_content=av_content,
                                 candidates=injection_char_candidates(model_config, tokenizer, av_content=av_content),
                                 requested=cfg.injection_char)


def datagen_sites(cfg: DatagenConfig, tokenizer: Any) -> Path:
    """Write the sites of the splits that need explanations to cfg.write_sites (no model, no datasets)."""
    if Path(cfg.write_sites).exists() and not cfg.overwrite:
        raise ConfigError(
            f"config key 'write_sites' = {cfg.write_sites!r} already exists (labels added to it would be lost); "
            "choose another file or set overwrite=true (--overwrite)"
        )
    from transformers import AutoConfig

    char = dataset_marker(cfg, tokenizer, AutoConfig.from_pretrained(cfg.model))
    fractions = split_fractions(cfg)

    def to_label() -> Iterator[tuple[str, Site]]:
        for doc, tokens in tokenized_documents(cfg, tokenizer):
            if len(tokens) > cfg.min_context:
                split, sites = document_sites(doc, tokens, cfg, tokenizer, fractions)
                if EXTRA_COLUMNS[split]:
                    yield from ((split, site) for site in sites)

    count = write_sites(to_label(), cfg.write_sites)
    print(f"[datagen] wrote {count} sites to label to {cfg.write_sites} (injection char {char!r}); add an \"explanation\" to each line, then "
          "run datagen with the same settings and explainer=jsonl explanations=THAT_FILE", flush=True)
    return Path(cfg.write_sites)


# --------------------------------------------------------------------------- the run


def datagen(cfg: DatagenConfig) -> DatagenResult | Path:
    """Write the NLA datasets configured by cfg (or, with write_sites, the sites to label); see the module docstring.

    A failed or interrupted run leaves nothing behind: no `.datagen_tmp/`, and no out_dir
    if it made one that is still empty.
    """
    out_dir = Path(cfg.out_dir)
    created_out_dir = not out_dir.exists()
    try:
        return _write_datasets(cfg)
    except BaseException:
        shutil.rmtree(out_dir / TMP_DIR_NAME, ignore_errors=True)
        if created_out_dir and out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        raise


def _write_datasets(cfg: DatagenConfig) -> DatagenResult | Path:
    """Validate, stream the corpus into per-split parquet files in a temp dir, check them, then move them in."""
    require_model("model", cfg.model)
    require_file("corpus", cfg.corpus)
    require_file("explanations", cfg.explanations if cfg.explainer == "jsonl" else None)
    seed_everything(cfg.seed)
    tokenizer = families.load_tokenizer(cfg.model)
    if cfg.write_sites is not None:
        return datagen_sites(cfg, tokenizer)
    model, device = _load_target_model(cfg)
    d_model = model.config.hidden_size
    char = dataset_marker(cfg, tokenizer, model.config)  # before the forward passes, as the sites pass does
    av_content = marker_content(actor_content(cfg.av_template), char)
    explainer = make_explainer(cfg, tokenizer)
    fractions = split_fractions(cfg)
    active = [s for s in SPLITS if fractions[s] > 0]
    existing = _claim_out_dir(cfg)
    tmp_dir = Path(cfg.out_dir) / TMP_DIR_NAME
    writers = {s: _SplitWriter(tmp_dir / f"{s}.parquet", s, d_model, cfg.row_group_size) for s in active}
    rows = _RowStream(cfg, tokenizer, model, device, fractions, writers, explainer, av_prompt_messages(av_content))
    n_docs, skipped = rows.run()
    for writer in writers.values():
        writer.close()
    _check_splits(cfg, explainer, writers, active, n_docs=n_docs, skipped=skipped)
    sidecar = dict(
        base_model=str(Path(cfg.model).resolve()), d_model=d_model, layer_index=cfg.layer,
        corpus=str(Path(cfg.corpus).resolve()), positions_per_doc=cfg.positions_per_doc, av_content=av_content,
        ar_template=cfg.ar_template, mse_scale=_sidecar_scale(cfg.mse_scale), injection_char=char,
    )
    counts = {"documents_read": n_docs, "documents_skipped_short": skipped, "positions_per_doc": cfg.positions_per_doc,
              "min_context": cfg.min_context, "explainer": cfg.explainer}
    for split in active:
        mapping = dataset_sidecar(
            tokenizer, stage="av_sft" if split == "eval" else split, row_count=writers[split].rows, **sidecar,
            provenance={"split": split, "model": sidecar["base_model"], "corpus": sidecar["corpus"], "seed": cfg.seed,
                        "rows": writers[split].rows, **counts},
            api_summaries=explainer.sidecar_summary() if EXTRA_COLUMNS[split] and explainer is not None else None,
        )
        check_tokenizer(parse_sidecar(mapping), tokenizer)
        write_sidecar(mapping, tmp_dir / f"{split}.parquet.nla_meta.yaml")
    final_paths = _move_into_place(Path(cfg.out_dir), active, existing)
    remember_injection_char(tokenizer, char)
    rows_by_split = {s: writers[s].rows for s in active}
    say_line(f"[datagen] {n_docs} documents -> " + ", ".join(f"{s} {n} rows" for s, n in rows_by_split.items())
             + f"; injection char {char!r}; d_model {d_model}, layer {cfg.layer}")
    say_line(f"[datagen] wrote {', '.join(str(p) for p in final_paths.values())} (+ .nla_meta.yaml sidecars)")
    return DatagenResult(final_paths, rows_by_split, n_docs, skipped, char, d_model)


def _load_target_model(cfg: DatagenConfig) -> tuple[torch.nn.Module, torch.device]:
    """The target LM in eval mode on its device, once `layer` is known to be one of its blocks."""
    device, dtype = resolve_device(cfg.device, cfg.dtype)
    model = families.load_causal_lm(cfg.model, dtype=dtype).to(device).eval()
    n_layers = model.config.num_hidden_layers
    if cfg.layer >= n_layers:
        raise ConfigError(
            f"config key 'layer' = {cfg.layer} is invalid: {cfg.model} has {n_layers} blocks, so layer must be "
            f"0..{n_layers - 1}"
        )
    return model, device


def _claim_out_dir(cfg: DatagenConfig) -> list[Path]:
    """Refuse an out_dir holding datasets unless overwrite; start a fresh temp dir. Returns the files to replace."""
    out_dir = Path(cfg.out_dir)
    existing = [p for s in SPLITS for p in (out_dir / f"{s}.parquet", out_dir / f"{s}.parquet.nla_meta.yaml") if p.exists()]
    if existing and not cfg.overwrite:
        raise ConfigError(
            f"config key 'out_dir' = {str(out_dir)!r} already holds datasets ({', '.join(p.name for p in existing)}); "
            "choose another out_dir or set overwrite=true (--overwrite)"
        )
    tmp_dir = out_dir / TMP_DIR_NAME
    if tmp_dir.exists():  # left by an interrupted run: start over
        shutil.rmtree(tmp_dir)
    tmp_dir.mkdir(parents=True)
    return existing


class _RowStream:
    """Documents in batches -> activations at their sites -> rows in the split writers; rows that need an
    explanation wait for a full explainer batch."""

    def __init__(self, cfg: DatagenConfig, tokenizer: Any, model: torch.nn.Module, device: torch.device,
                 fractions: dict[str, float], writers: dict[str, _SplitWriter], explainer: Any, prompt: Any):
        self.cfg, self.tokenizer, self.model, self.device = cfg, tokenizer, model, device
        self.fractions, self.writers, self.explainer, self.prompt = fractions, writers, explainer, prompt
        self.unlabelled: list[tuple[str, dict[str, Any], Site]] = []

    def run(self) -> tuple[int, int]:
        """Stream the whole corpus; (documents read, documents too short)."""
        cfg = self.cfg
        n_docs = skipped = 0
        bar = progress_bar(total=count_documents(cfg.corpus, limit=cfg.max_docs), desc="datagen", unit="doc",
                           enabled=cfg.progress)
        batch: list[tuple[Document, list[int]]] = []
        for doc, tokens in tokenized_documents(cfg, self.tokenizer):
            n_docs += 1
            bar.update()
            if len(tokens) <= cfg.min_context:
                skipped += 1
                continue
            batch.append((doc, tokens))
            if len(batch) == cfg.batch_size:
                self.process(batch)
                batch = []
        if batch:
            self.process(batch)
        self.label(final=True)
        bar.close()
        return n_docs, skipped

    def process(self, batch: list[tuple[Document, list[int]]]) -> None:
        cfg = self.cfg
        ids, mask = pad_right([tokens for _, tokens in batch], self.tokenizer.pad_token_id, self.device)
        acts = capture_activations(self.model, ids, mask, cfg.layer).cpu()
        for b, (doc, tokens) in enumerate(batch):
            split, sites = document_sites(doc, tokens, cfg, self.tokenizer, self.fractions)
            for site in sites:
                vector = acts[b, site.position].numpy()
                if not (np.isfinite(vector).all() and vector.any()):
                    raise DataError(
                        f"activation at doc_id {doc.doc_id!r} position {site.position} is not finite or all zero; "
                        "check the model and dtype"
                    )
                row = {"prompt": self.prompt, "activation_vector": vector, "doc_id": doc.doc_id,
                       "n_raw_tokens": site.position + 1, "activation_layer": cfg.layer,
                       "position": site.position, "context": site.context}
                if EXTRA_COLUMNS[split]:
                    self.unlabelled.append((split, row, site))
                else:
                    self.writers[split].add(row)
        self.label(final=False)

    def label(self, final: bool) -> None:
        size = self.cfg.explainer_batch_size
        while len(self.unlabelled) >= size or (final and self.unlabelled):
            chunk = self.unlabelled[:size]
            del self.unlabelled[:size]
            for (split, row, _), text in zip(chunk, self.explainer.explain([site for _, _, site in chunk])):
                if text is None:  # no explanation: the explainer counts and reports it
                    continue
                # Stripped, as extract_explanation returns it (upstream nla/schema.py): the AR then
                # reads the same text in SFT and in RL. wrap_explanation's layout for the response.
                text = text.strip()
                row.update(explanation=text, response=f"<explanation>\n{text}\n</explanation>")
                if split == "ar_sft":
                    row["prompt"] = self.cfg.ar_template.format(explanation=text)
                self.writers[split].add({k: row[k] for k in self.writers[split].schema.names})


def _check_splits(cfg: DatagenConfig, explainer: Any, writers: dict[str, _SplitWriter], active: list[str], *,
                  n_docs: int, skipped: int) -> None:
    """Say what was skipped; refuse (temp dir removed) an explainer failure or a split left empty."""
    tmp_dir = Path(cfg.out_dir) / TMP_DIR_NAME
    if skipped:
        say_line(f"[datagen] skipped {skipped} of {n_docs} documents shorter than min_context + 1 = "
                 f"{cfg.min_context + 1} tokens")
    try:
        if explainer is not None:
            explainer.finish()
    except DataError:
        shutil.rmtree(tmp_dir)
        raise
    empty = [s for s in active if writers[s].rows == 0]
    if empty:
        shutil.rmtree(tmp_dir)
        raise DataError(
            f"split(s) {empty} received no rows ({n_docs} documents read, {skipped} too short); "
            "add documents, or set " + " ".join(f"{s}_fraction=0" for s in empty if s != "rl")
            + (" (rl takes the rest: lower the other fractions)" if "rl" in empty else "")
        )


def _move_into_place(out_dir: Path, active: list[str], existing: list[Path]) -> dict[str, Path]:
    """Replace the old datasets with the temp dir's parquet files and sidecars; the final parquet paths."""
    tmp_dir = out_dir / TMP_DIR_NAME
    for path in existing:
        path.unlink()
    final_paths = {s: out_dir / f"{s}.parquet" for s in active}
    for split in active:
        os.replace(tmp_dir / f"{split}.parquet", final_paths[split])
        os.replace(tmp_dir / f"{split}.parquet.nla_meta.yaml", out_dir / f"{split}.parquet.nla_meta.yaml")
    shutil.rmtree(tmp_dir)
    return final_paths
