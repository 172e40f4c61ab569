"""bench/real_nla.py label-parts: which parts of the context label the AV writes right, counted by hand."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import real_nla  # noqa: E402

GOLD = ['Hamlet; HAMLET speaking; it ends "to be or not to be"', 'Hamlet; it ends "the rest is silence."',
        'King Lear; LEAR speaking; it ends "blow, winds, and crack"']


def _run(tmp_path: Path, name: str, written: list[str | None]) -> Path:
    run = tmp_path / name
    for stage in ("after_sft", "after_rl"):
        (run / "eval" / stage).mkdir(parents=True)
        lines = [json.dumps({"gold_explanation": g, "explanation": w}) for g, w in zip(GOLD, written)]
        (run / "eval" / stage / "eval_samples.jsonl").write_text("\n".join(lines) + "\n")
    return run


def test_label_parts_counts_each_part_over_every_run(tmp_path):
    one = _run(tmp_path, "s0", ['Hamlet; OPHELIA speaking; it ends "not to BE"', None,
                                'Macbeth; LEAR speaking; it ends "winds and crack!"'])
    two = _run(tmp_path, "s1", ["free text, no label", 'Hamlet; it ends "silence"', 'King Lear; it ends "x"'])
    out = real_nla.label_parts([str(one), str(two)], str(tmp_path / "parts.json"))
    stage = out["after_rl"]
    assert stage["rows"] == 6 and stage["parsed"] == pytest.approx(4 / 6)
    # Parsed pairs: (Hamlet/Hamlet, King Lear/Macbeth, Hamlet/Hamlet, King Lear/King Lear).
    assert stage["play"] == pytest.approx(3 / 4)
    assert stage["speaker"] == pytest.approx(1 / 3)  # gold names a speaker on rows 1 and 3 (LEAR twice)
    assert stage["last_word"] == pytest.approx(3 / 4)  # be/be, crack/crack!, silence./silence; not crack/x
    assert out["plays_among_gold"] == 2
    assert json.loads((tmp_path / "parts.json").read_text()) == out
