"""Hand-written labels: a JSONL file keyed by (doc_id, position), and the sites file to label.

`write_sites` writes one line per site that needs a gold explanation,

    {"doc_id": str, "position": int, "split": str, "token": str, "context": str}

(`token` is the text of the token at `position`; `context` the document's text up to and
including it). Add an "explanation" to each line and pass the file back as
`explanations=` with `explainer=jsonl`: `JsonlExplainer` reads exactly that format.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from nla_shell.explainers.base import Site
from nla_shell.io.data import DataError


def jsonl_objects(path: Path, *, field: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of each non-blank line; a DataError naming `field` on bad JSON."""
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{field}: {path} line {line_no} is not JSON: {err}") from None


class JsonlExplainer:
    """Explanations read from JSONL lines {"doc_id": str, "position": int, "explanation": str}.

    A site without a line is collected; `finish` names every missing key at once.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"explanations: {self.path} does not exist")
        self.table: dict[tuple[str, int], str] = {}
        self.missing: list[tuple[str, int]] = []
        for line_no, obj in jsonl_objects(self.path, field="explanations"):
            try:
                key = (str(obj["doc_id"]), int(obj["position"]))
                text = obj["explanation"]
            except (KeyError, TypeError, ValueError):
                raise DataError(
                    f"explanations: {self.path} line {line_no} is not an object with doc_id, position (int) and "
                    "explanation"
                ) from None
            if not isinstance(text, str):
                raise DataError(f"explanations: {self.path} line {line_no}: explanation must be a string")
            self.table[key] = text

    def explain(self, sites: Sequence[Site]) -> list[str | None]:
        texts = [self.table.get((s.doc_id, s.position)) for s in sites]
        self.missing += [(s.doc_id, s.position) for s, text in zip(sites, texts) if text is None]
        return texts

    def finish(self) -> None:
        if self.missing:
            shown = ", ".join(f"({d!r}, {p})" for d, p in self.missing[:10])
            raise DataError(
                f"explanations: {self.path} has no explanation for {len(self.missing)} (doc_id, position) key(s) "
                f"needed by the sft/eval splits: {shown}{' ...' if len(self.missing) > 10 else ''}; add them to "
                "the file (write_sites=FILE lists every site to label)"
            )

    def sidecar_summary(self) -> None:
        return None


def write_sites(sites: Iterable[tuple[str, Site]], path: str | Path) -> int:
    """Write (split, site) pairs as the JSONL to label; atomic (temp file + rename). Returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    count = 0
    with tmp.open("w", encoding="utf-8") as f:
        for split, site in sites:
            record = {"doc_id": site.doc_id, "position": site.position, "split": split, "token": site.token,
                      "context": site.context}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    os.replace(tmp, path)
    return count
