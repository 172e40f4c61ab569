"""doc_disjoint_rows: the first n candidate rows whose document is not in training."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from nla_core import doc_disjoint_rows

FAST = settings(max_examples=60, deadline=None)

doc_ids = st.one_of(st.integers(0, 15), st.sampled_from(["a", "b", "doc-7", "doc-8"]))


def reference(train, candidates, n):
    seen = set(train)
    return [i for i, d in enumerate(candidates) if d not in seen][:n]


def test_hand_worked():
    train = ["d1", "d2", "d3"]
    cands = ["d2", "d4", "d1", "d5", "d4", "d6", "d7"]
    assert doc_disjoint_rows(train, cands, 3) == [1, 3, 4]  # a repeated unseen doc counts each time
    assert doc_disjoint_rows(train, cands, 0) == []
    assert doc_disjoint_rows(train, cands, 100) == [1, 3, 4, 5, 6]
    assert doc_disjoint_rows([], cands, 2) == [0, 1]
    assert doc_disjoint_rows(cands, cands, 5) == []


@FAST
@given(st.lists(doc_ids, max_size=12), st.lists(doc_ids, max_size=20), st.integers(0, 25))
@example([], [], 3)
@example([1, 2], [1, 2, 1, 2], 2)
def test_matches_definition(train, candidates, n):
    out = doc_disjoint_rows(train, candidates, n)
    assert out == reference(train, candidates, n)
    assert len(out) <= n
    assert out == sorted(set(out))  # strictly increasing indices
    train_set = set(train)
    assert all(candidates[i] not in train_set for i in out)
    # maximal: if fewer than n were picked, no other eligible candidate was left out
    if len(out) < n:
        assert len(out) == sum(1 for d in candidates if d not in train_set)


@FAST
@given(st.lists(st.integers(0, 9), max_size=10), st.lists(st.integers(0, 9), max_size=15), st.integers(0, 15))
def test_train_ids_any_iterable(train, candidates, n):
    # a set, a generator, or a list of training ids give the same answer
    a = doc_disjoint_rows(train, candidates, n)
    assert doc_disjoint_rows(set(train), candidates, n) == a
    assert doc_disjoint_rows((t for t in train), candidates, n) == a
