"""Small text metrics logged per step."""

from __future__ import annotations

import functools
import math
import unicodedata
from typing import Any

import torch

import nla_core


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


def finite_or_none(value: Any) -> Any:
    """JSON-safe: ints stay, non-finite floats become None."""
    if isinstance(value, int):
        return value
    value = float(value)
    return value if math.isfinite(value) else None


def fve_metrics(mse: torch.Tensor, reward: torch.Tensor, valid: torch.Tensor, *, rawvar: float, meannorm: float,
                prefix: str) -> dict[str, float]:
    """The held-out numbers of N scored explanations, one definition for `nla train` and `nla eval`.

    mse_mean = mean of the finite mse (failed extractions excluded); fve = 1 - mse_mean / rawvar
    (the headline); fve_meannorm = 1 - mse_mean / meannorm (the older, looser baseline, beside
    it); reward_mean over all N (failures at FAILED_EXTRACTION_REWARD); extraction_rate = mean(valid).

    Args: mse, reward: [N] float; valid: [N] bool. Returns: {prefix + key: float}.
    """
    mse_mean = finite_mean(mse)
    values = {"reward_mean": float(reward.mean()), "mse_mean": mse_mean, "fve": nla_core.fve(mse_mean, rawvar),
              "fve_meannorm": nla_core.fve(mse_mean, meannorm), "extraction_rate": float(valid.float().mean())}
    return {prefix + key: value for key, value in values.items()}


def token_lengths(texts, tokenizer) -> list[int | None]:
    """Tokens of each text (no special tokens); None stays None (a failed extraction)."""
    return [None if t is None else len(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
