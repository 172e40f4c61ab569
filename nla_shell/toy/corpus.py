"""The toy language of `nla demo`: a template grammar, its lexicon, and the rule that explains a token.

Documents are a few sentences drawn from templates whose slots take a word of one class
("the red cat chases the bread ."). Every word is one token of a tokenizer trained on
this text, so "the token at a position" and "the word at a position" agree.

The gold explanation of a token names its class, the word, and the word before it:
"animal: cat, after red". In a small LM the residual stream at an early block is mostly
a function of the current token and the one before it, so this explanation is
predictable from the activation (an AV can learn to say it) and the activation is
largely predictable from it (an AR can learn to rebuild it).

`describe_phrase_chats` are the toy's stand-in for instruction tuning: chats in which the
user quotes a phrase where the AV prompt has its marker, and the assistant explains the
phrase's last word. A real AV starts from a chat model that can already talk about
text; these chats give the tiny LM that ability, so that AV SFT only has to teach it to
read the same content from an injected activation.
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

import numpy as np

__all__ = [
    "CONTENT_WORDS",
    "FUNCTION_WORDS",
    "TEMPLATES",
    "describe",
    "describe_phrase_chats",
    "generate_documents",
    "word_classes",
]

CONTENT_WORDS: Mapping[str, tuple[str, ...]] = {
    "animal": ("cat", "dog", "bird", "fish", "horse", "mouse"),
    "food": ("apple", "bread", "cheese", "soup", "cake", "rice"),
    "place": ("park", "river", "house", "garden", "city", "forest"),
    "color": ("red", "blue", "green", "yellow", "black", "white"),
    "person": ("man", "woman", "child", "farmer", "teacher", "king"),
    "verb": ("sees", "eats", "likes", "finds", "chases", "wants"),
}
"""Slot classes and the words that fill them."""

FUNCTION_WORDS: Mapping[str, str] = {
    "the": "article",
    "a": "article",
    "in": "preposition",
    "near": "preposition",
    "and": "conjunction",
    "is": "verb",
    ".": "punctuation",
}
"""The fixed words of the templates, with their classes."""

TEMPLATES: tuple[str, ...] = (
    "the {color} {animal} {verb} the {food} .",
    "a {person} {verb} a {color} {animal} in the {place} .",
    "the {animal} {verb} the {person} near the {place} .",
    "a {color} {food} is in the {place} .",
    "the {person} and the {animal} {verb} the {color} {food} .",
)
"""Sentence templates; each `{class}` slot takes a word of CONTENT_WORDS[class]."""

_SLOT = re.compile(r"\{(\w+)\}")


def word_classes() -> dict[str, str]:
    """word -> class for every word of the toy language."""
    return {**{w: c for c, words in CONTENT_WORDS.items() for w in words}, **FUNCTION_WORDS}


def describe(word: str, previous: str, classes: Mapping[str, str]) -> str:
    """The rule explanation of `word` preceded by `previous`: "animal: cat, after red".

    Words outside `classes` get the class "other", so the rule runs on any text.
    """
    return f"{classes.get(word, 'other')}: {word}, after {previous}"


def generate_documents(n_docs: int, seed: int, *, sentences: tuple[int, int] = (3, 6)) -> list[str]:
    """n_docs documents of sentences[0]..sentences[1] template sentences, words space-separated.

    Deterministic for a seed; every slot draws its word independently and uniformly.
    """
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n_docs):
        n_sentences = int(rng.integers(sentences[0], sentences[1] + 1))
        picked = (TEMPLATES[int(rng.integers(len(TEMPLATES)))] for _ in range(n_sentences))
        docs.append(" ".join(
            _SLOT.sub(lambda m: CONTENT_WORDS[m.group(1)][int(rng.integers(len(CONTENT_WORDS[m.group(1)])))], t)
            for t in picked
        ))
    return docs


def describe_phrase_chats(
    docs: Sequence[str], n_chats: int, seed: int, *, av_template: str, phrase_words: int = 3, min_context: int = 2
) -> list[list[dict[str, str]]]:
    """Chats where the user quotes a phrase at the AV template's `<INJECT>` and the assistant explains its last word.

    Each chat picks a random document and a word at index >= min_context; the phrase is
    the `phrase_words` words ending there ("Explain the activation at the red cat."),
    and the answer is `<explanation>{describe(cat, red)}</explanation>`.
    """
    rng = np.random.default_rng(seed)
    classes = word_classes()
    chats = []
    for _ in range(n_chats):
        words = docs[int(rng.integers(len(docs)))].split()
        p = int(rng.integers(min_context, len(words)))
        phrase = " ".join(words[max(0, p - phrase_words + 1) : p + 1])
        chats.append([
            {"role": "user", "content": av_template.replace("<INJECT>", phrase)},
            {"role": "assistant", "content": f"<explanation>{describe(words[p], words[p - 1], classes)}</explanation>"},
        ])
    return chats
