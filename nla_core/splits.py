"""Document-disjoint held-out rows, and held-out rows spread over documents."""

from __future__ import annotations

import hashlib
from typing import Hashable, Iterable, Literal, Sequence, get_args

__all__ = [
    "HELDOUT_DOCS",
    "HeldoutDocs",
    "doc_disjoint_rows",
    "spread_rows",
]

HeldoutDocs = Literal["all", "select", "report"]
"""Which of a held-out file's documents spread_rows draws on: every one, the half that selects checkpoints, or the
other half, which reports the result (the type of every command's `heldout_docs`)."""
HELDOUT_DOCS: tuple[str, ...] = get_args(HeldoutDocs)
"""HeldoutDocs' choices."""


def doc_disjoint_rows(train_doc_ids: Iterable[Hashable], candidate_doc_ids: Sequence[Hashable], n: int) -> list[int]:
    """Indices of the first n candidates whose document never appears in training.

    Rows of a shuffled activation dataset share documents; a held-out row from a training
    document leaks its context, so eval keeps only unseen documents.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    seen = set(train_doc_ids)
    picked: list[int] = []
    for i, doc in enumerate(candidate_doc_ids):
        if len(picked) >= n:
            break
        if doc not in seen:
            picked.append(i)
    return picked


def spread_rows(doc_ids: Sequence[str], n: int, *, docs: HeldoutDocs = "all") -> list[int]:
    """Indices (ascending) of up to n rows spread over as many documents as the rows hold.

    A datagen file keeps each document's sites together (32 a passage in the real demo), so its first 512 rows
    come from 16 documents. Here documents are ranked by a hash of their id, independent of the file's order, and
    rows are taken one per document per round, in rank order, each document's in file order, until n are taken:
    a document gives its (k+1)-th row only once every document still holding rows has given its k-th.

    docs="select" keeps the documents of even rank, "report" those of odd rank, "all" every one: rows that select
    a checkpoint ("select") and rows that report its result ("report") then share no document. With a single
    document, both halves are that document.

    doc_ids: [rows] each row's document id; n >= 0.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if docs not in HELDOUT_DOCS:
        raise ValueError(f"docs must be one of {HELDOUT_DOCS}, got {docs!r}")
    rows_of: dict[str, list[int]] = {}
    for i, doc in enumerate(doc_ids):
        rows_of.setdefault(doc, []).append(i)
    ranked = sorted(rows_of, key=lambda doc: (hashlib.blake2b(doc.encode(), digest_size=8).digest(), doc))
    if docs != "all" and len(ranked) > 1:
        ranked = ranked[docs == "report" :: 2]
    picked: list[int] = []
    for depth in range(max((len(rows_of[doc]) for doc in ranked), default=0)):
        for doc in ranked:
            if len(picked) == n:
                return sorted(picked)
            if depth < len(rows_of[doc]):
                picked.append(rows_of[doc][depth])
    return sorted(picked)
