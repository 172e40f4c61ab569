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


def _run(tmp_path: Path, name: str, written: list[str | None], mse: list[float | None] = (None,) * 3) -> Path:
    run = tmp_path / name
    for stage in ("after_sft", "after_rl"):
        (run / "eval" / stage).mkdir(parents=True)
        lines = [json.dumps({"gold_explanation": g, "explanation": w, "mse": m, "gold_mse": 0.1})
                 for g, w, m in zip(GOLD, written, mse)]
        (run / "eval" / stage / "eval_samples.jsonl").write_text("\n".join(lines) + "\n")
    return run


def test_label_parts_counts_each_part_over_every_run(tmp_path):
    one = _run(tmp_path, "s0", ['Hamlet; OPHELIA speaking; it ends "not to BE"', None,
                                'Macbeth; LEAR speaking; it ends "winds and crack!"'], mse=[0.2, None, 0.4])
    two = _run(tmp_path, "s1", ["free text, no label", 'Hamlet; it ends "silence"', 'King Lear; it ends "x"'],
               mse=[None, None, 0.9])
    out = real_nla.label_parts([str(one), str(two)], str(tmp_path / "parts.json"))
    stage = out["after_rl"]
    assert stage["rows"] == 6 and stage["parsed"] == pytest.approx(4 / 6)
    # Parsed pairs: (Hamlet/Hamlet, King Lear/Macbeth, Hamlet/Hamlet, King Lear/King Lear).
    assert stage["play"] == pytest.approx(3 / 4)
    assert stage["speaker"] == pytest.approx(1 / 3)  # gold names a speaker on rows 1 and 3 (LEAR twice)
    assert stage["last_word"] == pytest.approx(3 / 4)  # be/be, crack/crack!, silence./silence; not crack/x
    assert out["plays_among_gold"] == 2
    # Scored parsed rows: be/be 0.2 and crack/crack! 0.4 right, crack/x 0.9 wrong; silence (no mse) left out.
    assert stage["mse_by_last_word"] == {"right": {"rows": 2, "av": pytest.approx(0.3), "gold": pytest.approx(0.1)},
                                         "wrong": {"rows": 1, "av": 0.9, "gold": 0.1}}
    assert json.loads((tmp_path / "parts.json").read_text()) == out


def _split(path: Path, rng, words: list[str], plays: list[str], basis, n: int, parts: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows_words, rows_plays = rng.integers(len(words), size=n), rng.integers(len(plays), size=n)
    vectors = basis[rows_words] + 0.05 * rng.standard_normal((n, basis.shape[1]))
    label = {"all": lambda w, p: f'{plays[p]}; it ends "so it ends {words[w]}"',
             "ending": lambda w, p: f'it ends "so it ends {words[w]}"'}[parts]
    pq.write_table(pa.table({"activation_vector": vectors.astype("float32").tolist(),
                             "explanation": [label(w, p) for w, p in zip(rows_words, rows_plays)]}), path)


@pytest.mark.parametrize("parts", ["all", "ending"])
def test_linear_parts_finds_the_part_the_vector_holds(tmp_path, parts):
    """Vectors made from the last word alone (plus noise), the play drawn independently: the last word's class
    means explain nearly all the held-out variance and a probe reads it; the play explains none."""
    import numpy as np

    rng = np.random.default_rng(0)
    words, plays = [f"w{i}" for i in range(12)], ["Hamlet", "King Lear", "Macbeth"]
    basis = rng.standard_normal((len(words), 16))
    (tmp_path / "data").mkdir()
    for split, n in (("ar_sft", 600), ("av_sft", 600), ("eval", 300)):
        _split(tmp_path / "data" / f"{split}.parquet", rng, words, plays, basis, n, parts)
    out = real_nla.linear_parts(str(tmp_path), str(tmp_path / "linear.json"))
    assert out["rows"] == {"train": 1200, "eval": 300}
    assert out["class_mean_fve"]["last word"] > 0.95
    assert abs(out["class_mean_fve"]["play"]) < 0.02
    assert out["probe"]["last word"]["accuracy"] > 0.95 and out["probe"]["speaker"] is None
    if parts == "all":
        assert out["probe"]["play"]["accuracy"] < 0.5 and out["probe"]["play"]["classes"] == 3
    else:
        assert out["probe"]["play"] is None
    assert json.loads((tmp_path / "linear.json").read_text()) == out
