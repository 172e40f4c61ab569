"""A labeller for real text that runs offline: `explainer=context`, a documented heuristic.

For a site whose text so far is `context`, in a document whose corpus row has a `topic`:

    {topic}; {SPEAKER} speaking; it ends "{the last WORDS words}"

(the parts in the order of `parts`, PARTS by default). Each part is left out when absent: the
topic when the corpus has none; the speaker unless a line of the context opens with a name and
a colon, as in plays, transcripts and chat logs, the last such line naming who speaks at the site.
A name is capitalised words, joined by `&` or `of` (`HAMLET:`, `First Lord:`, `CONRADE & BORACHIO:`,
`FIRST CITIZEN of CALAIS:`); a verse line that opens with one capitalised word and a colon
(`Adieu: `) is read as a name too, which in the shipped plays is about one tag in a thousand.
The last words carry the token at the site and what precedes it, which is most of what a
middle layer's residual holds; topic and speaker carry the document-level part. The ending
comes last because the AR reads a label from its final token: on SmolLM2 (block 20, seed 0,
bench/RESULTS.md 2026-12-04) the gold AR scored 0.692 held-out FVE with the ending last and
0.605 with it first, while the AV's round trip was the same either way. It is a
stand-in for a person or an LLM explaining each site (`explainer=local` or `api`), with no
model in the loop, so datagen on a real corpus needs nothing but the target LM.
"""

from __future__ import annotations

import re
from typing import NamedTuple, Sequence

from nla_shell.explainers.base import Site

WORDS = 6
"""Words of the context quoted in the explanation."""
PARTS = ("topic", "speaker", "ending")
"""Every part a label can hold, in `describe`'s default order: the document's topic, the speaker, the quoted
last words."""
_SPEAKER = re.compile(r"^([A-Z][A-Za-z'.-]*(?: (?:[A-Z][A-Za-z'.-]*|&|of))*): ", re.MULTILINE)


def describe(site: Site, *, words: int = WORDS, parts: Sequence[str] = PARTS) -> str:
    """The explanation of one site: `parts` (names from PARTS) in order, "; "-joined (module docstring)."""
    speakers = _SPEAKER.findall(site.context)
    written = {
        "ending": f'it ends "{" ".join(site.context.split()[-words:])}"',
        "topic": site.topic or None,
        "speaker": f"{speakers[-1]} speaking" if speakers else None,
    }
    return "; ".join(text for text in (written[name] for name in parts) if text)


class ContextLabel(NamedTuple):
    """The parts of a `describe` label (None where left out)."""

    topic: str | None
    speaker: str | None
    ending: str


_ENDING_FIRST = re.compile(r'it ends "(?P<ending>.*)"(?:; (?P<rest>[^"]*))?', re.DOTALL)
_ENDING_LAST = re.compile(r'(?:(?P<rest>[^"]*?); )?it ends "(?P<ending>.*)"', re.DOTALL)


def parse(text: str | None) -> ContextLabel | None:
    """A label of `describe` (in either order of PARTS: the ending first or last) split back into its parts;
    None for text not in that layout (e.g. an AV's free text, or a topic or speaker part given twice)."""
    match = None if text is None else (_ENDING_FIRST.fullmatch(text.strip()) or _ENDING_LAST.fullmatch(text.strip()))
    if match is None:
        return None
    topic = speaker = None
    for part in match["rest"].split("; ") if match["rest"] else ():
        if part.endswith(" speaking") and speaker is None:
            speaker = part.removesuffix(" speaking")
        elif not part.endswith(" speaking") and topic is None and part:
            topic = part
        else:
            return None
    return ContextLabel(topic, speaker, match["ending"])


class ContextExplainer:
    """`describe` for every site, with the given parts; it never drops one."""

    def __init__(self, parts: Sequence[str] = PARTS) -> None:
        self.parts = tuple(parts)

    def explain(self, sites: Sequence[Site]) -> list[str | None]:
        return [describe(site, parts=self.parts) for site in sites]

    def finish(self) -> None:
        return None

    def sidecar_summary(self) -> None:
        return None
