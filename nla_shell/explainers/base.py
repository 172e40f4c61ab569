"""What every explainer shares: the site it explains, its interface, its error (no submodule imported)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

__all__ = ["Site", "Explainer", "ExplainerError"]


@dataclass(frozen=True)
class Site:
    """One sampled position of one document."""

    doc_id: str
    position: int
    """0-based index of the token in the document's token ids (add_special_tokens=False, cut to max_seq_len)."""
    token_ids: tuple[int, ...]
    """The document's tokens up to and including `position`."""
    context: str
    """Those tokens decoded: the text the LM has read when its activation at `position` is taken."""
    token: str
    """The token at `position`, decoded alone."""
    topic: str | None = None
    """The document's `topic` field in the corpus, when it has one."""


class ExplainerError(ValueError):
    """The explainer cannot go on (systemic API failure, refused key); the message says what to fix.

    A ValueError, like the other bad-input errors, so the CLI prints it as one line.
    """


class Explainer(Protocol):
    """Writes the gold explanation of sites (the text inside <explanation> tags)."""

    def explain(self, sites: Sequence[Site]) -> list[str | None]:
        """One explanation per site; None where this explainer has none for it (the row is dropped)."""
        ...

    def finish(self) -> None:
        """Called once after the last site: report, and raise when the labels cannot be used."""
        ...

    def sidecar_summary(self) -> Mapping[str, Any] | None:
        """The dataset sidecar's `api_summaries` (model, max_tokens, temperature, instruction_prompt), if any."""
        ...
