"""Text metrics and the held-out FVE numbers."""

from __future__ import annotations

import pytest
import torch

from nla_shell.metrics import cjk_fraction, fve_metrics


# The reference's definition: kana and ideographic punctuation are not "CJK" by name.
@pytest.mark.parametrize(
    ("text", "fraction"),
    [("", 0.0), ("hello", 0.0), ("中文ab", 0.5), ("漢字", 1.0), ("ひら。", 0.0)],
)
def test_cjk_fraction(text, fraction):
    assert cjk_fraction(text) == fraction


def test_fve_metrics_hand_worked():
    # Two scored rows (mse 0.5, 0.3) and a failed one: the MSE averages the scored rows only,
    # the reward and extraction rate count all three.
    mse = torch.tensor([0.5, float("nan"), 0.3])
    reward = torch.tensor([1.0, -2.0, 1.0])
    valid = torch.tensor([True, False, True])
    got = fve_metrics(mse, reward, valid, rawvar=0.8, meannorm=1.6, prefix="av/")
    assert got == pytest.approx({"av/reward_mean": 0.0, "av/mse_mean": 0.4, "av/fve": 0.5, "av/fve_meannorm": 0.75,
                                 "av/extraction_rate": 2 / 3})
