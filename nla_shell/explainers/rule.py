"""The toy language's rule explainer: "{class}: {token}, after {previous token}".

Only meaningful on the toy corpus (nla_shell.toy.corpus): on other text nearly every
word is class "other", so `finish` refuses a run where most words before the sites are
not toy words.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from nla_shell.explainers.base import Site
from nla_shell.io.data import DataError
from nla_shell.toy.corpus import describe, word_classes

TOY_WORD_SHARE = 0.5
"""A rule-labelled run needs at least this share of toy-language words in the sites' contexts."""


class RuleExplainer:
    """The toy rule (see toy.corpus.describe); refuses corpora that are not the toy language."""

    def __init__(self, tokenizer: Any, classes: Mapping[str, str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.classes = word_classes() if classes is None else classes
        self.words = self.toy_words = 0

    def explain(self, sites: Sequence[Site]) -> list[str | None]:
        for site in sites:
            whole_words = site.context.split()[:-1]  # the last one may be cut inside a word
            self.words += len(whole_words)
            self.toy_words += sum(word in self.classes for word in whole_words)
        return [describe(self._word(s.token_ids[-1]), self._word(s.token_ids[-2]), self.classes) for s in sites]

    def finish(self) -> None:
        if self.words and self.toy_words < TOY_WORD_SHARE * self.words:
            raise DataError(
                f"explainer: 'rule' labels the toy language only, but {self.words - self.toy_words} of the "
                f"{self.words} words before the sites are not toy words; choose explainer=api, local or jsonl for "
                "real text"
            )

    def sidecar_summary(self) -> None:
        return None

    def _word(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]).strip()
