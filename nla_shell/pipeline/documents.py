"""A corpus's documents, and where datagen samples them: reading (.jsonl / .txt / .parquet), counting,
the seeded positions of each document and its split (a seeded hash of its id: no document in two splits)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from nla_shell.explainers.jsonl import jsonl_objects
from nla_shell.io.data import DataError


@dataclass(frozen=True)
class Document:
    doc_id: str
    text: str
    topic: str | None = None
    """The corpus's `topic` field (jsonl key or parquet column) when it has one; the context explainer names it."""


def read_documents(path: str | Path, *, text_column: str = "text", id_column: str = "id") -> Iterator[Document]:
    """Stream documents from .jsonl/.json lines, .txt (blank-line separated) or .parquet.

    A missing or non-string text is a DataError naming the line or row; ids default to
    "doc{index:06d}" when the id key/column is absent.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"corpus: {path} does not exist")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        for line_no, obj in jsonl_objects(path, field="corpus"):
            text = obj.get(text_column) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise DataError(f"corpus: {path} line {line_no} has no string {text_column!r} (text_column)")
            topic = obj.get("topic")
            yield Document(str(obj.get(id_column, f"doc{line_no - 1:06d}")), text,
                           topic if isinstance(topic, str) else None)
    elif suffix == ".txt":
        paragraph: list[str] = []
        index = 0
        with path.open(encoding="utf-8") as f:
            for line in [*f, ""]:  # the sentinel flushes the last paragraph
                if line.strip():
                    paragraph.append(line.rstrip("\n"))
                elif paragraph:
                    yield Document(f"doc{index:06d}", "\n".join(paragraph))
                    index, paragraph = index + 1, []
    elif suffix == ".parquet":
        pf = pq.ParquetFile(path)
        if text_column not in pf.schema_arrow.names:
            raise DataError(f"corpus: {path} has no column {text_column!r} (columns: {pf.schema_arrow.names}); set text_column")
        columns = [c for c in (text_column, id_column, "topic") if c in pf.schema_arrow.names]
        index = 0
        for batch in pf.iter_batches(columns=columns):
            texts = batch.column(text_column).to_pylist()
            absent = [None] * len(texts)
            ids, topics = (batch.column(c).to_pylist() if c in columns else absent for c in (id_column, "topic"))
            for text, doc_id, topic in zip(texts, ids, topics):
                if not isinstance(text, str):
                    raise DataError(f"corpus: {path} row {index} has a non-string {text_column!r}")
                yield Document(f"doc{index:06d}" if doc_id is None else str(doc_id), text,
                               topic if isinstance(topic, str) else None)
                index += 1
    else:
        raise DataError(f"corpus: {path} must end in .jsonl, .json, .txt or .parquet")


def count_documents(path: str | Path, *, limit: int | None = None) -> int | None:
    """How many documents read_documents will yield, counting stopped at `limit` (parquet: its
    footer; text: one streaming pass that reads no further than the limit); None if unknown."""
    path = Path(path)
    if path.suffix.lower() == ".parquet":
        try:
            rows = pq.ParquetFile(path).metadata.num_rows
        except (OSError, pa.ArrowException):
            return None  # read_documents says what is wrong with it
        return rows if limit is None else min(rows, limit)
    if path.suffix.lower() not in (".jsonl", ".json", ".txt"):
        return None
    count, previous_filled = 0, False
    with path.open(encoding="utf-8") as f:
        for line in f:
            filled = bool(line.strip())
            # A .txt document is a run of non-blank lines; a JSON-lines document is one non-blank line.
            count += filled and (path.suffix.lower() != ".txt" or not previous_filled)
            previous_filled = filled
            if limit is not None and count >= limit:
                break
    return count


def sample_positions(n_tokens: int, k: int, min_context: int, rng: np.random.Generator) -> list[int]:
    """Up to k distinct sorted positions in [min_context, n_tokens); [] when there are none."""
    eligible = n_tokens - min_context
    if eligible <= 0:
        return []
    return sorted(int(p) for p in rng.choice(eligible, size=min(k, eligible), replace=False) + min_context)


def _stable_hash(*parts: object) -> int:
    """A 64-bit hash that, unlike hash(), is the same in every process."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def assign_split(doc_id: str, seed: int, fractions: Mapping[str, float]) -> str:
    """The split of a document: a seeded hash of its id mapped onto the cumulative fractions.

    Depends on nothing but (doc_id, seed, fractions), so the split is document-disjoint
    and stable under reordering, batching and restarts. The last split takes the rest.
    """
    u = _stable_hash("split", seed, doc_id) / 2**64
    total = 0.0
    for name, share in fractions.items():
        total += share
        if u < total:
            return name
    return [name for name, share in fractions.items() if share > 0][-1]


def document_positions(doc_id: str, n_tokens: int, *, seed: int, k: int, min_context: int) -> list[int]:
    """The positions datagen samples in a document: a function of (doc_id, n_tokens, seed, k, min_context) only."""
    rng = np.random.default_rng([seed, _stable_hash("positions", doc_id)])
    return sample_positions(n_tokens, k, min_context, rng)
