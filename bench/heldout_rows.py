"""Which documents stand behind a run's held-out rows: the file's first rows against rows spread over documents.

    python bench/heldout_rows.py CORPUS MODEL_DIR [--positions-per-doc 32] [--eval-fraction 0.1]
        [--seeds 0,1,2] [--rows 128,256,512] [--out FILE]

Datagen's own functions (the split of each document, its sampled sites, in corpus order) lay out eval.parquet's rows
as `nla datagen --corpus CORPUS --model MODEL_DIR --seed S` writes them, without running the model: MODEL_DIR gives
only the tokenizer, which sets each document's length. For each seed and row count N it reports how many documents
and plays (the part of `doc_id` before its first '/', as `nla corpus shakespeare` names them) the first N rows hold,
which is what `nla eval`'s `n_rows` and `nla sft`'s `eval_rows` read until heldout_docs (2026-12-05), and how many
nla_core.spread_rows's "select" and "report" halves hold, and whether those share a document.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nla_core import spread_rows  # noqa: E402
from nla_shell.pipeline.datagen import document_sites, split_fractions, tokenized_documents  # noqa: E402
from nla_shell.pipeline.datagen_config import DatagenConfig  # noqa: E402


def eval_doc_ids(corpus: str, model_dir: str, *, seed: int, positions_per_doc: int, eval_fraction: float,
                 tokenizer) -> list[str]:
    """Each row of eval.parquet as datagen writes it (corpus order, a document's sites together): its doc_id."""
    cfg = DatagenConfig(model=model_dir, corpus=corpus, layer=1, out_dir="-", explainer="context",
                        positions_per_doc=positions_per_doc, eval_fraction=eval_fraction, seed=seed)
    fractions = split_fractions(cfg)
    rows: list[str] = []
    for doc, tokens in tokenized_documents(cfg, tokenizer):
        split, sites = document_sites(doc, tokens, cfg, tokenizer, fractions)
        if split == "eval":
            rows += [doc.doc_id] * len(sites)
    return rows


def describe(doc_ids: list[str], picked: list[int]) -> dict[str, object]:
    docs = {doc_ids[i] for i in picked}
    return {"rows": len(picked), "docs": len(docs), "plays": sorted({d.split("/")[0] for d in docs})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("corpus")
    parser.add_argument("model_dir")
    parser.add_argument("--positions-per-doc", type=int, default=32)
    parser.add_argument("--eval-fraction", type=float, default=0.1)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rows", default="128,256,512")
    parser.add_argument("--out", help="a JSON file")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    cases = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        doc_ids = eval_doc_ids(args.corpus, args.model_dir, seed=seed, positions_per_doc=args.positions_per_doc,
                               eval_fraction=args.eval_fraction, tokenizer=tokenizer)
        halves = {part: {doc_ids[i] for i in spread_rows(doc_ids, len(doc_ids), docs=part)}
                  for part in ("select", "report")}
        for n in [int(r) for r in args.rows.split(",")]:
            case = {"seed": seed, "n": n, "eval_rows": len(doc_ids), "eval_docs": len(set(doc_ids)),
                    "first": describe(doc_ids, list(range(min(n, len(doc_ids))))),
                    **{part: describe(doc_ids, spread_rows(doc_ids, n, docs=part)) for part in ("select", "report")},
                    "halves_share_docs": len(halves["select"] & halves["report"])}
            cases.append(case)
            print(f"seed {seed} n {n}: first rows {case['first']['docs']} docs / {len(case['first']['plays'])} plays; "
                  f"spread: select {case['select']['docs']} docs / {len(case['select']['plays'])} plays, report "
                  f"{case['report']['docs']} docs / {len(case['report']['plays'])} plays (of {case['eval_docs']} "
                  f"eval docs, {case['eval_rows']} rows); halves share {case['halves_share_docs']} docs", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "cases": cases}, indent=1) + "\n")


if __name__ == "__main__":
    main()
