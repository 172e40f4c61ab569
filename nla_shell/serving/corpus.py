"""`nla explain --corpus FILE` / `--parquet FILE`: every site of a corpus explained in batches, resumably.

The sites come in a fixed order: a corpus's documents (datagen's formats) with every position
or datagen's seeded sample of them (`sites=sample`: with datagen's seed, positions_per_doc and
min_context these are exactly the sites datagen wrote), or a parquet's rows with their
`activation_vector`. They are cut into batches of `batch_size`; each batch's activations are
captured (corpus) and explained through the engine, `samples` explanations per site, and its
rows written at once as one part file, `OUT.parts/part-NNNNNNNN.parquet`, moved into place
whole (and appended to the JSONL, if asked). A killed run leaves its finished parts; run the
same command again and it skips them: each batch is seeded by its index, so the resumed run
writes what an uninterrupted one would, with no site twice and none missing. The last batch
merges the parts into OUT and removes `OUT.parts/`. Ctrl-C (SIGINT) or SIGTERM stops the run at
once (the batch in progress is dropped) with one line, "interrupted (or stopped) with N batches
written; rerun the same command to resume from OUT.parts", and exit status 130 (or 143), as
`nla train` does.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from nla_shell.io.config import ConfigError
from nla_shell.io.data import DataError
from nla_shell.io.files import write_text_atomically
from nla_shell.io.progress import format_duration, say_line
from nla_shell.pipeline.documents import count_documents, document_positions, read_documents
from nla_shell.serving.config import ExplainConfig
from nla_shell.serving.reader import NLAReader, SiteExplanation
from nla_shell.training.stopped import RunStopped

RESULT_SCHEMA = pa.schema([
    ("site", pa.int64()), ("doc_id", pa.string()), ("position", pa.int64()), ("token", pa.string()),
    ("context", pa.string()), ("short_context", pa.bool_()), ("explanation", pa.string()), ("mse", pa.float64()),
    ("fve", pa.float64()), ("explanations", pa.list_(pa.string())), ("mses", pa.list_(pa.float64())),
    ("generated_tokens", pa.int64()),
])
"""One row per site: the kept (best-of-k) explanation, its MSE and FVE, and all k with their MSEs."""

RESUME_KEYS = ("av", "ar", "model", "sidecar", "corpus", "parquet", "text_column", "id_column", "sites",
               "positions_per_doc", "min_context", "max_seq_len", "max_docs", "samples", "greedy", "seed",
               "max_new_tokens", "batch_size", "engine")
"""The settings a resumed run must share with the killed one (they fix the sites, batches and samples)."""


@dataclass(frozen=True)
class Site:
    """One activation to explain, in the run's site order."""

    site: int
    """Index in the run's site order (0, 1, ...)."""
    units: int
    """Progress once this site is done: documents begun (corpus) or rows (parquet)."""
    doc_id: str
    position: int | None
    """Token index in the document (None for a parquet row without a position column)."""
    token: str | None
    context: str | None
    tokens: tuple[int, ...] | None = None
    """The document's token ids up to max_seq_len (corpus sites: captured per batch)."""
    vector: torch.Tensor | None = None
    """[D] float32 (parquet sites: stored)."""


# --------------------------------------------------------------------------- sites


def corpus_sites(cfg: ExplainConfig, reader: NLAReader, min_context: int) -> Iterator[Site]:
    """The corpus's sites in order: every position of each document, or datagen's sample of them."""
    tokenizer = reader.target_tokenizer
    index = 0
    documents = read_documents(cfg.corpus, text_column=cfg.text_column, id_column=cfg.id_column)
    for n_docs, doc in enumerate(documents):
        if cfg.max_docs is not None and n_docs >= cfg.max_docs:
            return
        ids = tokenizer.encode(doc.text, add_special_tokens=False)[: cfg.max_seq_len]
        if cfg.sites == "all":
            positions = list(range(len(ids)))
        else:
            positions = document_positions(doc.doc_id, len(ids), seed=cfg.seed, k=cfg.positions_per_doc,
                                           min_context=min_context)
        for p in positions:
            yield Site(index, n_docs + 1, doc.doc_id, p, tokenizer.decode([ids[p]]), tokenizer.decode(ids[: p + 1]),
                       tokens=tuple(ids))
            index += 1


def parquet_sites(path: str, d_model: int, *, chunk: int) -> Iterator[Site]:
    """A parquet's rows as sites: `activation_vector` [D] each, with doc_id, position and context when present."""
    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if "activation_vector" not in names:
        raise DataError(f"parquet: {path} has no column 'activation_vector' (columns: {names}); give rows of vectors")
    columns = [c for c in ("activation_vector", "doc_id", "position", "context") if c in names]
    index = 0
    for batch in pf.iter_batches(batch_size=chunk, columns=columns):
        data = batch.to_pydict()
        for row in range(batch.num_rows):
            vector = torch.tensor(data["activation_vector"][row], dtype=torch.float32)
            if vector.shape != (d_model,):
                raise DataError(f"parquet: {path} row {index}: activation_vector has {vector.numel()} numbers, the "
                                f"sidecar's d_model is {d_model}; give activations of this NLA's model and layer")
            if not bool(torch.isfinite(vector).all()):
                raise DataError(f"parquet: {path} row {index}: activation_vector is not finite (NaN or inf); "
                                "drop or recapture that row")
            doc_id = data["doc_id"][row] if "doc_id" in data else f"row{index:08d}"
            yield Site(index, index + 1, str(doc_id), data.get("position", [None] * batch.num_rows)[row], None,
                       data.get("context", [None] * batch.num_rows)[row], vector=vector)
            index += 1


def batches(sites: Iterator[Site], size: int) -> Iterator[tuple[int, list[Site]]]:
    """(batch index, its sites): consecutive chunks of `size`."""
    batch: list[Site] = []
    index = 0
    for site in sites:
        batch.append(site)
        if len(batch) == size:
            yield index, batch
            batch, index = [], index + 1
    if batch:
        yield index, batch


# --------------------------------------------------------------------------- one batch


def batch_vectors(reader: NLAReader, batch: Sequence[Site]) -> torch.Tensor:
    """[len(batch), D]: the stored vectors, or the captured residuals (one forward per document of the batch)."""
    if batch[0].vector is not None:
        return torch.stack([s.vector for s in batch])
    by_doc: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for i, site in enumerate(batch):
        by_doc.setdefault((site.doc_id, site.tokens), []).append(i)
    docs = list(by_doc)
    acts = reader.capture([tokens for _, tokens in docs], [[batch[i].position for i in by_doc[d]] for d in docs])
    out = torch.empty(len(batch), reader.d_model)
    for doc, doc_acts in zip(docs, acts):
        out[by_doc[doc]] = doc_acts
    return out


def result_rows(batch: Sequence[Site], results: Sequence[SiteExplanation], min_context: int) -> list[dict[str, Any]]:
    """The output rows of a batch (RESULT_SCHEMA)."""
    return [{
        "site": s.site, "doc_id": s.doc_id, "position": s.position, "token": s.token, "context": s.context,
        "short_context": s.position is not None and s.position < min_context, "explanation": r.explanation,
        "mse": r.mse, "fve": r.fve, "explanations": r.explanations, "mses": r.mses,
        "generated_tokens": r.generated_tokens,
    } for s, r in zip(batch, results, strict=True)]


# --------------------------------------------------------------------------- output and resume


class PartStore:
    """`OUT.parts/`: one parquet per finished batch, the run's settings, and the final merge into OUT."""

    def __init__(self, out: Path, jsonl: Path | None) -> None:
        self.out, self.jsonl = out, jsonl
        self.dir = out.with_name(out.name + ".parts")

    def part(self, index: int) -> Path:
        return self.dir / f"part-{index:08d}.parquet"

    def done(self) -> set[int]:
        return {int(p.stem.split("-")[1]) for p in self.dir.glob("part-*.parquet")} if self.dir.is_dir() else set()

    def open(self, settings: dict[str, Any], *, overwrite: bool) -> set[int]:
        """Start a run or resume the killed one; returns the finished batch indices."""
        if overwrite:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.out.unlink(missing_ok=True)
        elif self.out.exists():
            raise ConfigError(f"config key 'out' = {str(self.out)!r} already holds a finished run; choose another "
                              "out or set overwrite=true")
        recorded = self.dir / "settings.json"
        if recorded.is_file():
            old = json.loads(recorded.read_text(encoding="utf-8"))
            for key in RESUME_KEYS:
                if old.get(key) != settings.get(key):
                    raise ConfigError(
                        f"config key '{key}' = {settings.get(key)!r} differs from the killed run's {old.get(key)!r} "
                        f"({recorded}); rerun with its settings to resume, or set overwrite=true to start over")
        else:
            self.dir.mkdir(parents=True, exist_ok=True)
            write_text_atomically(recorded, json.dumps(settings, indent=1, sort_keys=True))
        done = self.done()
        if self.jsonl is not None:
            self._rewrite_jsonl(sorted(done))
        return done

    def write(self, index: int, rows: list[dict[str, Any]]) -> None:
        """A batch's rows, moved into place whole; then appended to the JSONL."""
        tmp = self.part(index).with_suffix(".tmp")
        pq.write_table(pa.Table.from_pylist(rows, schema=RESULT_SCHEMA), tmp)
        os.replace(tmp, self.part(index))
        if self.jsonl is not None:
            with self.jsonl.open("a", encoding="utf-8") as f:
                f.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))

    def finish(self) -> int:
        """Merge the parts into OUT (in site order) and remove OUT.parts/; returns the row count."""
        tmp, rows = self.out.with_name(self.out.name + ".tmp"), 0
        with pq.ParquetWriter(tmp, RESULT_SCHEMA) as writer:
            for index in sorted(self.done()):
                table = pq.read_table(self.part(index), schema=RESULT_SCHEMA)
                writer.write_table(table)
                rows += table.num_rows
        os.replace(tmp, self.out)
        shutil.rmtree(self.dir)
        return rows

    def _rewrite_jsonl(self, done: Sequence[int]) -> None:
        """The JSONL as the finished parts say (a kill may have cut it mid-batch)."""
        lines = [json.dumps(row, ensure_ascii=False) + "\n" for index in done
                 for row in pq.read_table(self.part(index)).to_pylist()]
        write_text_atomically(self.jsonl, "".join(lines))


# --------------------------------------------------------------------------- progress


class Progress:
    """A line with sites done, rate and ETA at most every `every_s` seconds (and after the first batch)."""

    def __init__(self, *, total: int | None, unit: str, every_s: float) -> None:
        self.total, self.unit, self.every_s = total, unit, every_s
        self.start = time.perf_counter()
        self.sites = self.tokens = 0
        self._first_units: int | None = None
        self._last: float | None = None

    def update(self, *, sites: int, tokens: int, units_before: int, units_done: int) -> None:
        """A batch of `sites` is done, which took the run from units_before to units_done (of total)."""
        self.sites += sites
        self.tokens += tokens
        if self._first_units is None:
            self._first_units = units_before  # a resumed run's rate counts this run's work only
        now = time.perf_counter()
        if self._last is not None and now - self._last < self.every_s:
            return
        self._last = now
        line = f"[explain] {self.sites} sites, {self.sites / max(now - self.start, 1e-9):.2f} sites/s"
        if self.total:
            per_unit = (now - self.start) / max(units_done - self._first_units, 1)
            eta = max(self.total - units_done, 0) * per_unit
            line += f"; {units_done}/{self.total} {self.unit} ({units_done / self.total:.0%}), ETA {format_duration(eta)}"
        say_line(line)

    def summary(self) -> str:
        seconds = max(time.perf_counter() - self.start, 1e-9)
        return (f"[explain] explained {self.sites} sites in {seconds:.1f} s: {self.sites / seconds:.2f} sites/s, "
                f"{self.tokens / seconds:.1f} generated tokens/s")


# --------------------------------------------------------------------------- stopping


class ExplainStopped(RunStopped):
    """A corpus run stopped by SIGINT or SIGTERM: the CLI prints its line and exits with 128 + the signal."""

    def __init__(self, signum: int, *, batches_written: int, parts: Path) -> None:
        super().__init__(signum, steps_done=batches_written, checkpoint=parts)
        verb = "interrupted" if signum == signal.SIGINT else "stopped"
        self.args = (f"{verb} with {batches_written} batches written; rerun the same command to resume from {parts}",)


class _Signalled(BaseException):
    """Raised by the signal handler (a BaseException, so no `except Exception` on the way swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals(store: PartStore) -> Iterator[None]:
    """SIGINT and SIGTERM end the run with ExplainStopped (in the main thread; elsewhere signals are left alone).
    The parts written so far are kept: each was moved into place whole, so the rerun resumes after them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: Any) -> None:
        raise _Signalled(signum)

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except _Signalled as stop:
        raise ExplainStopped(stop.signum, batches_written=len(store.done()), parts=store.dir) from None
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: a handler installed outside Python, which cannot be put back
                signal.signal(sig, handler)


# --------------------------------------------------------------------------- the run


def run_batches(cfg: ExplainConfig, reader: NLAReader, sites: Iterator[Site], done: set[int], store: PartStore,
                progress: Progress, min_context: int) -> None:
    """Explain and write every batch not already done (a resumed run skips the finished ones)."""
    units_before = 0
    for index, batch in batches(sites, cfg.batch_size):
        if index in done:
            units_before = batch[-1].units
            continue
        torch.manual_seed(cfg.seed * 1_000_003 + index)  # the batch's samples do not depend on where a run resumed
        results = reader.explain(batch_vectors(reader, batch), samples=cfg.samples, greedy=cfg.greedy,
                                 max_new_tokens=cfg.max_new_tokens)
        store.write(index, result_rows(batch, results, min_context))
        progress.update(sites=len(batch), tokens=sum(r.generated_tokens for r in results), units_before=units_before,
                        units_done=batch[-1].units)
        units_before = batch[-1].units


def explain_corpus(cfg: ExplainConfig, reader: NLAReader) -> Path:
    """Explain every site of cfg.corpus or cfg.parquet into cfg.out (see the module docstring)."""
    min_context = reader.min_context if cfg.min_context is None else cfg.min_context
    store = PartStore(Path(cfg.out), Path(cfg.jsonl) if cfg.jsonl else None)
    settings = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name in RESUME_KEYS}
    done = store.open(settings, overwrite=cfg.overwrite)
    if cfg.parquet is not None:
        sites = parquet_sites(cfg.parquet, reader.d_model, chunk=cfg.batch_size)
        total, unit = pq.ParquetFile(cfg.parquet).metadata.num_rows, "rows"
    else:
        sites = corpus_sites(cfg, reader, min_context)
        total, unit = count_documents(cfg.corpus, limit=cfg.max_docs), "documents"
    if done:
        say_line(f"[explain] resuming {store.dir}: {len(done)} batches of {cfg.batch_size} already written")
    progress = Progress(total=total, unit=unit, every_s=cfg.progress_every_s)
    with stop_on_signals(store):
        run_batches(cfg, reader, sites, done, store, progress, min_context)
        rows = store.finish()
    say_line(progress.summary())
    say_line(f"[explain] wrote {rows} sites to {cfg.out}" + (f" and {cfg.jsonl}" if cfg.jsonl else ""))
    return Path(cfg.out)
