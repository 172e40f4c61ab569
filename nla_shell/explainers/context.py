"""A labeller for real text that runs offline: `explainer=context`, a documented heuristic.

For a site whose text so far is `context`, in a document whose corpus row has a `topic`:

    {topic}; {SPEAKER} speaking; it ends "{the last WORDS words}"

Each part is left out when absent: the topic when the corpus has none; the speaker unless a
line of the context opens with a name and a colon, as in plays, transcripts and chat logs, the
last such line naming who speaks at the site. A name is capitalised words, joined by `&` or
`of` (`HAMLET:`, `First Lord:`, `CONRADE & BORACHIO:`, `FIRST CITIZEN of CALAIS:`); a verse line
that opens with one capitalised word and a colon (`Adieu: `) is read as a name too, which in the
shipped plays is about one tag in a thousand.
The last words carry the token at the site and what precedes it, which is most of what a
middle layer's residual holds; topic and speaker carry the document-level part. It is a
stand-in for a person or an LLM explaining each site (`explainer=local` or `api`), with no
model in the loop, so datagen on a real corpus needs nothing but the target LM.
"""

from __future__ import annotations

import re
from typing import NamedTuple, Sequence

from nla_shell.explainers import Site

WORDS = 6
"""Words of the context quoted at the end of the explanation."""
_SPEAKER = re.compile(r"^([A-Z][A-Za-z'.-]*(?: (?:[A-Z][A-Za-z'.-]*|&|of))*): ", re.MULTILINE)


def describe(site: Site, *, words: int = WORDS) -> str:
    """The explanation of one site (see the module docstring)."""
    parts = [site.topic] if site.topic else []
    speakers = _SPEAKER.findall(site.context)
    if speakers:
        parts.append(f"{speakers[-1]} speaking")
    parts.append(f'it ends "{" ".join(site.context.split()[-words:])}"')
    return "; ".join(parts)


class ContextLabel(NamedTuple):
    """The parts of a `describe` label (None where left out)."""

    topic: str | None
    speaker: str | None
    ending: str


_LABEL = re.compile(r'(?:(?P<topic>[^;]*?)(?<! speaking); )?(?:(?P<speaker>[^;]*?) speaking; )?it ends "(?P<ending>.*)"',
                    re.DOTALL)


def parse(text: str | None) -> ContextLabel | None:
    """`describe`'s label split back into its parts; None for text not in its layout (e.g. an AV's free text)."""
    match = None if text is None else _LABEL.fullmatch(text.strip())
    return None if match is None else ContextLabel(match["topic"], match["speaker"], match["ending"])


class ContextExplainer:
    """`describe` for every site; it never drops one."""

    def explain(self, sites: Sequence[Site]) -> list[str | None]:
        return [describe(site) for site in sites]

    def finish(self) -> None:
        return None

    def sidecar_summary(self) -> None:
        return None
