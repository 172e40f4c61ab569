"""The injection marker: the one token of the AV prompt whose position receives the activation.

A marker character must be one token on its own (the sidecar's `tokens.injection_token_id`
is that token, upstream's contract), occur exactly once in the chat-templated AV prompt, sit
on a clean token boundary there (the prompt's ids are the ids of the text before it, the
marker, and the ids of the text after it: no merge with a neighbour), and be absent from the
corpus and the templates. Byte-level BPEs (SmolLM2, Llama 3, GPT-2, OLMo, Qwen) fuse most
symbols with the space before them, so the bare one-token check is not enough.

Candidates are tried in this order: the tokenizer's cached character (nla_shell.io.
injection_chars), a short list of symbols (`㈎` first for Qwen, upstream's choice), then the
tokenizer's own vocabulary: every token that decodes to one printable non-ASCII character,
upstream's range U+3200–U+9FFF first (kitft nla/datagen/injection_tokens.py scans it in
codepoint order), then the rest in codepoint order. When the template puts a space before
<INJECT> ("...below: <INJECT>"), a byte-level BPE fuses that space with every bare character,
so the vocabulary's tokens that carry their leading space (" X", GPT-2's 'Ġ' + X) come last:
such a marker covers the space too, and the stored template drops the space before <INJECT>
(nla_core.marker_content), so upstream's plain replacement rebuilds the text as written.
`datagen --write-sites` and the labelled run choose with the same function on the same corpus,
so both name one marker.
"""

from __future__ import annotations

import unicodedata
from typing import Any, Iterable, Iterator

from nla_shell import families
from nla_shell.io.data import INJECT_PLACEHOLDER, DataError, av_prompt_messages, chat_prompt_text
from nla_shell.io.injection_chars import cached_injection_char
from nla_core import canonical_neighbors, marker_char, marker_content

__all__ = [
    "INJECTION_CHAR_CANDIDATES",
    "QWEN_INJECTION_CHAR",
    "UPSTREAM_RANGE",
    "choose_injection_char",
    "injection_char_candidates",
    "injection_char_problem",
    "vocabulary_markers",
]

INJECTION_CHAR_CANDIDATES = "§¶※†‡¤¦¬µ°±×÷©®~^|@㊗㊙㊚㊛㊜"
"""Tried in order, before the vocabulary search, when the injection char is chosen automatically."""
QWEN_INJECTION_CHAR = "㈎"
"""Qwen2/3's injection character upstream (token 149705), tried first for the Qwen family."""
UPSTREAM_RANGE = (0x3200, 0x9FFF)
"""The codepoints upstream's find_injection_token scans (CJK enclosed letters to unified ideographs)."""


def injection_char_problem(tokenizer: Any, char: str, av_content: str) -> str | None:
    """Why `char` cannot mark the injection site with this tokenizer, or None when it can.

    `char` is one character, or a space and one (a token that carries its leading space, which
    takes the space before <INJECT> into itself: nla_core.marker_content). `av_content` is the
    AV user message with <INJECT> at the marker (nla_core.actor_content), as the user wrote it.
    """
    if marker_char(char) is None:
        return "is not one non-space character, nor a space and one"
    try:
        content = marker_content(av_content, char)
    except ValueError:
        return f"carries a leading space, but the AV template has none before {INJECT_PLACEHOLDER}"
    ids = tokenizer.encode(char, add_special_tokens=False)
    if len(ids) != 1 or tokenizer.decode(ids) != char:
        return f"is {len(ids)} tokens on its own"
    text = chat_prompt_text(av_prompt_messages(content), char, tokenizer)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    if prompt_ids.count(ids[0]) != 1:
        return f"merges with its neighbours in the chat-templated AV prompt (token {ids[0]} occurs {prompt_ids.count(ids[0])} times)"
    try:
        canonical_neighbors(prompt_ids, ids[0])
    except ValueError as err:
        return f"does not sit inside the chat-templated AV prompt ({err})"
    if text.count(char) != 1:
        return f"occurs {text.count(char)} times in the chat-templated AV prompt"
    before, after = text.split(char)
    if tokenizer.encode(before, add_special_tokens=False) + ids + tokenizer.encode(after, add_special_tokens=False) != prompt_ids:
        return "changes how its neighbours tokenize in the chat-templated AV prompt"
    return None


def vocabulary_markers(tokenizer: Any, *, leading_space: bool = False) -> Iterator[str]:
    """The vocabulary's one-character tokens that could mark a site, in the order they are tried.

    Kept: tokens that decode to one non-ASCII letter, symbol or punctuation mark (no
    control, format, combining or space characters) and encode back to themselves; with
    `leading_space`, instead the tokens that decode to a space and such a character (" X").
    Upstream's range comes first, in codepoint order, then every other codepoint in order.
    """
    texts = {}
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        char = text[1:] if leading_space and text[:1] == " " else (None if leading_space else text)
        if (char is not None and len(char) == 1 and ord(char) > 127 and unicodedata.category(char)[0] in "LSP"
                and tokenizer.encode(text, add_special_tokens=False) == [token_id]):
            texts[char] = text
    lo, hi = UPSTREAM_RANGE
    yield from (texts[c] for c in sorted(texts, key=lambda c: (not lo <= ord(c) <= hi, ord(c))))


def injection_char_candidates(model_config: Any, tokenizer: Any, *, av_content: str | None = None) -> Iterator[str]:
    """Every marker tried, in order: cached, listed (`㈎` first for Qwen), then the vocabulary's;
    last, when `av_content` puts a space before <INJECT>, the vocabulary's tokens that carry it."""
    listed = (QWEN_INJECTION_CHAR + INJECTION_CHAR_CANDIDATES
              if families.family_of(model_config).name.startswith("Qwen")
              else INJECTION_CHAR_CANDIDATES + QWEN_INJECTION_CHAR)
    cached = cached_injection_char(tokenizer)
    seen = set()
    for char in ([cached] if cached else []) + list(listed):
        seen.add(char)
        yield char
    yield from (char for char in vocabulary_markers(tokenizer) if char not in seen)
    if av_content is not None and " " + INJECT_PLACEHOLDER in av_content:
        yield from (text for text in vocabulary_markers(tokenizer, leading_space=True) if text not in seen)


def choose_injection_char(
    tokenizer: Any, forbidden: set[str], *, av_content: str, candidates: Iterable[str], requested: str | None = None
) -> str:
    """`requested` when given (DataError naming why it cannot serve), else the first usable candidate.

    Usable: no injection_char_problem, and its character (marker_char) not in `forbidden` (the
    corpus and the templates, where the marker token would also appear). When none fits, the DataError names each
    cause with a few of the candidates it ruled out.
    """
    def problem(char: str) -> str | None:
        return "occurs in the corpus or the templates" if marker_char(char) in forbidden else injection_char_problem(
            tokenizer, char, av_content
        )

    if requested is not None:
        why = problem(requested)
        if why is not None:
            raise DataError(f"injection_char: {requested!r} {why}; choose another character, or leave injection_char "
                            "unset to let datagen choose")
        return requested
    causes: dict[str, list[str]] = {}
    for char in candidates:
        why = problem(char)
        if why is None:
            return char
        causes.setdefault(why.split(" (")[0], []).append(char)
    summary = "; ".join(f"{len(chars)} ({''.join(chars[:8])!r}{'…' if len(chars) > 8 else ''}) {why}"
                        for why, chars in causes.items())
    raise DataError(
        f"injection_char: no character of the candidates or of the tokenizer's vocabulary marks the injection site "
        f"({summary}); put a newline before <INJECT> in av_template, or pass injection_char= a character that is "
        "one token on its own and in the templated AV prompt (a space and one character for a token that carries "
        "its leading space)"
    )
