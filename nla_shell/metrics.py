"""Small text metrics logged per step."""

from __future__ import annotations

import functools
import math
import unicodedata

import torch


@functools.lru_cache(maxsize=65536)
def _is_cjk(char: str) -> bool:
    # The reference's definition, kept so curves stay comparable: characters whose Unicode
    # name mentions CJK (ideographs, radicals, strokes). Kana, Hangul and ideographic
    # punctuation such as "。" do not count.
    return "CJK" in unicodedata.name(char, "")


def cjk_fraction(text: str) -> float:
    """Fraction of the characters of `text` that are CJK (0.0 for empty text).

    Tracks the drift of a Qwen actor into Chinese during RL.
    """
    if not text:
        return 0.0
    return sum(map(_is_cjk, text)) / len(text)


def finite_mean(x: torch.Tensor) -> float:
    """Mean of the finite entries of x (NaN marks failed samples); NaN when there are none."""
    finite = x[torch.isfinite(x)]
    return float(finite.mean()) if finite.numel() else math.nan
