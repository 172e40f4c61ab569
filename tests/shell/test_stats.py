"""nla_shell.stats: mean ± se and the parity rule, against float64 formulas and Student's t."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nla_shell.stats import FVE_MARGIN, MeanSE, PairedShortfall, mean_se, paired_shortfall, t95

VALUES = st.lists(st.floats(-1, 1, allow_nan=False), min_size=2, max_size=12)


@settings(max_examples=60, deadline=None)
@given(VALUES)
def test_mean_se_is_the_sample_formula(values):
    m = mean_se(values)
    n = len(values)
    mean = math.fsum(values) / n
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    assert m.n == n and m.mean == pytest.approx(mean, abs=1e-12)
    assert m.sd == pytest.approx(sd, abs=1e-9) and m.se == pytest.approx(sd / math.sqrt(n), abs=1e-9)


def test_mean_se_text_and_small_counts():
    assert mean_se([0.5, 0.7]).text() == "0.600 ± 0.100"
    assert mean_se([0.5]).text() == "0.500" and math.isnan(mean_se([0.5]).se)
    assert mean_se([]).text() == "—" and mean_se([]).n == 0
    assert mean_se([1.0, 2.0, 3.0]).text(".1f") == "2.0 ± 0.6"
    assert isinstance(mean_se([1.0]), MeanSE)


def test_t95_is_students_one_sided_quantile():
    assert t95(1) == 6.314 and t95(4) == 2.132 and t95(7) == 1.895 and t95(30) == 1.697 and t95(31) == 1.645
    with pytest.raises(ValueError, match="df >= 1"):
        t95(0)


def test_paired_rule_on_recorded_numbers():
    # bench/RESULTS.md's 5-seed rule check: mean -0.0134, sd 0.0106 -> bound -0.0134 - 2.132 * 0.0106 / sqrt(5).
    s = PairedShortfall(n=5, mean=-0.0134, sd=0.0106)
    assert s.lower_bound == pytest.approx(-0.0134 - 2.132 * 0.0106 / math.sqrt(5))
    assert not s.shown() and "parity not shown" in s.verdict()
    assert PairedShortfall(n=6, mean=0.0, sd=0.004).shown()
    assert not PairedShortfall(n=1, mean=0.5, sd=math.nan).shown()  # one seed shows nothing
    assert math.isnan(PairedShortfall(n=1, mean=0.5, sd=math.nan).lower_bound)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.integers(0, 20), st.floats(0, 1, allow_nan=False), min_size=2, max_size=10),
       st.dictionaries(st.integers(0, 20), st.floats(0, 1, allow_nan=False), min_size=2, max_size=10))
def test_paired_shortfall_pairs_shared_seeds_only(candidate, baseline):
    s = paired_shortfall(candidate, baseline)
    diffs = [candidate[k] - baseline[k] for k in candidate if k in baseline]
    assert s.n == len(diffs)
    if len(diffs) >= 2:
        assert s.mean == pytest.approx(statistics.fmean(diffs)) and s.sd == pytest.approx(statistics.stdev(diffs))
        assert s.shown() == (s.lower_bound > -FVE_MARGIN)
