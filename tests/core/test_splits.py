"""doc_disjoint_rows: the first n candidate rows whose document is not in training; spread_rows: held-out rows
spread over documents, in halves that share none."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from nla_core import doc_disjoint_rows, spread_rows

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


# ---------------------------------------------------------------- spread_rows

def by_doc(doc_ids, picked):
    counts = {}
    for i in picked:
        counts[doc_ids[i]] = counts.get(doc_ids[i], 0) + 1
    return counts


def test_spread_rows_hand_worked():
    # Three documents of 4, 1 and 2 rows, each kept together as datagen writes them.
    doc_ids = ["a"] * 4 + ["b"] + ["c"] * 2
    assert spread_rows(doc_ids, 3) == [0, 4, 5]  # one row of each document before any second
    assert spread_rows(doc_ids, 5) == [0, 1, 4, 5, 6]  # b is spent; a and c give their second rows
    assert spread_rows(doc_ids, 100) == list(range(7))
    assert spread_rows(doc_ids, 0) == []
    assert spread_rows([], 5) == []
    # the first rows of the file, by contrast, are one document
    assert len(by_doc(doc_ids, range(3))) == 1


doc_lists = st.lists(st.sampled_from([f"doc-{k}" for k in range(9)]), max_size=40)


@FAST
@given(doc_lists, st.integers(0, 45), st.sampled_from(["all", "select", "report"]))
def test_spread_rows_takes_a_row_of_every_document_before_a_second(doc_ids, n, docs):
    out = spread_rows(doc_ids, n, docs=docs)
    assert out == sorted(set(out)) and all(0 <= i < len(doc_ids) for i in out)
    part = {doc_ids[i] for i in spread_rows(doc_ids, len(doc_ids), docs=docs)}  # the documents of this half
    assert len(out) == min(n, sum(d in part for d in doc_ids))
    counts, available = by_doc(doc_ids, out), {d: doc_ids.count(d) for d in part}
    # balanced: a document gives fewer rows than another, less one, only when it has none left
    for d in part:
        for e in part:
            assert counts.get(d, 0) >= counts.get(e, 0) - 1 or counts.get(d, 0) == available[d]
    # each document's rows are its first ones in file order
    for d, k in counts.items():
        assert [i for i in out if doc_ids[i] == d] == [i for i, x in enumerate(doc_ids) if x == d][:k]


@FAST
@given(doc_lists)
def test_spread_rows_select_and_report_share_no_document_and_cover_the_file(doc_ids):
    select = {doc_ids[i] for i in spread_rows(doc_ids, len(doc_ids), docs="select")}
    report = {doc_ids[i] for i in spread_rows(doc_ids, len(doc_ids), docs="report")}
    if len(set(doc_ids)) > 1:
        assert not select & report
        assert select | report == set(doc_ids)
        assert abs(len(select) - len(report)) <= 1
    else:  # one document (or none) serves both
        assert select == report == set(doc_ids)


@FAST
@given(doc_lists, st.integers(0, 45), st.sampled_from(["all", "select", "report"]), st.randoms(use_true_random=False))
def test_spread_rows_picks_the_same_documents_whatever_the_file_order(doc_ids, n, docs, rnd):
    shuffled = list(doc_ids)
    rnd.shuffle(shuffled)
    assert by_doc(doc_ids, spread_rows(doc_ids, n, docs=docs)) == by_doc(shuffled, spread_rows(shuffled, n, docs=docs))


def test_spread_rows_refuses_bad_arguments():
    with pytest.raises(ValueError, match="n must be >= 0"):
        spread_rows(["a"], -1)
    with pytest.raises(ValueError, match="docs must be one of"):
        spread_rows(["a"], 1, docs="test")
