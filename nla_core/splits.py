"""Document-disjoint held-out rows."""

from __future__ import annotations

from typing import Hashable, Iterable, Sequence

__all__ = [
    "doc_disjoint_rows",
]


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
