"""Label the sites of `nla datagen --write-sites` for `nla datagen --explainer jsonl`.

`--write-sites FILE` lists every site the av_sft/ar_sft/eval splits need an explanation for,
one {"doc_id", "position", "split", "token", "context"} per line. This script adds an
"explanation" to each line. It is a stand-in for a real labeller (a person, or an LLM reading
each context): it writes "{topic} text; it ends '{last three words}'" from the corpus's
`topic` field.

    python docs/examples/label_sites.py SITES_JSONL CORPUS_JSONL > labels.jsonl
"""

from __future__ import annotations

import json
import sys


def label(topic: str, context: str) -> str:
    """A short explanation of the site whose text so far is `context`."""
    return f"{topic} text; it ends '{' '.join(context.split()[-3:])}'"


def main(sites_jsonl: str, corpus_jsonl: str) -> None:
    with open(corpus_jsonl, encoding="utf-8") as f:
        topics = {doc["id"]: doc["topic"] for doc in map(json.loads, filter(str.strip, f))}
    with open(sites_jsonl, encoding="utf-8") as f:
        for site in map(json.loads, filter(str.strip, f)):
            site["explanation"] = label(topics[site["doc_id"]], site["context"])
            print(json.dumps(site, ensure_ascii=False))


if __name__ == "__main__":
    main(*sys.argv[1:])
