"""Text metrics."""

from __future__ import annotations

import pytest

from nla_shell.metrics import cjk_fraction


# The reference's definition: kana and ideographic punctuation are not "CJK" by name.
@pytest.mark.parametrize(
    ("text", "fraction"),
    [("", 0.0), ("hello", 0.0), ("中文ab", 0.5), ("漢字", 1.0), ("ひら。", 0.0)],
)
def test_cjk_fraction(text, fraction):
    assert cjk_fraction(text) == fraction
