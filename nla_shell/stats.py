"""Statistics over seeds: mean ± standard error, and the parity rule that every "parity shown" claim rests on.

The rule: a candidate (an engine, a dtype, a loss) learns as well as a baseline when, paired by
seed (d_s = FVE_candidate(s) - FVE_baseline(s)), the one-sided 95 % lower confidence bound of the
mean difference lies above -FVE_MARGIN. A true loss of FVE_MARGIN then fails 19 times in 20
whatever the number of seeds. tests/parity.py (engine legs), tests/gpu and bench/ all judge by it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

FVE_MARGIN = 0.01
"""The loss of held-out FVE (one point) that the parity rule must catch."""

_T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761, 1.753,
        1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697)
"""One-sided 95 % quantiles of Student's t for 1..30 degrees of freedom (1.645, the normal's, beyond)."""


def t95(df: int) -> float:
    """The one-sided 95 % quantile of Student's t with df >= 1 degrees of freedom."""
    if df < 1:
        raise ValueError(f"t95 needs df >= 1, got {df}")
    return _T95[df - 1] if df <= len(_T95) else 1.645


class MeanSE(NamedTuple):
    """Values over seeds: their count, mean and sample standard deviation (n - 1 denominator)."""

    n: int
    mean: float
    sd: float
    """NaN for fewer than 2 values."""

    @property
    def se(self) -> float:
        """Standard error of the mean, sd / sqrt(n) (NaN for fewer than 2 values)."""
        return self.sd / math.sqrt(self.n) if self.n > 1 else math.nan

    def text(self, spec: str = ".3f") -> str:
        """"mean ± se"; the mean alone for one value; "—" for none."""
        if self.n == 0:
            return "—"
        return f"{self.mean:{spec}}" if self.n == 1 else f"{self.mean:{spec}} ± {self.se:{spec}}"


def mean_se(values: Sequence[float]) -> MeanSE:
    """The mean ± standard error of values (NaN among them spoils the mean, visibly)."""
    values = list(values)
    return MeanSE(n=len(values), mean=statistics.fmean(values) if values else math.nan,
                  sd=statistics.stdev(values) if len(values) > 1 else math.nan)


@dataclass(frozen=True)
class PairedShortfall:
    """A candidate's held-out FVE against the baseline's, paired by seed: d_s = FVE_candidate(s) - FVE_base(s).

    Runs of one seed share the SFT start and the data order, so d_s carries neither the SFT's nor
    the data's seed noise: its spread is far smaller than either run's own.
    """

    n: int
    mean: float
    sd: float
    """Sample standard deviation of d_s (n - 1 denominator)."""

    @property
    def lower_bound(self) -> float:
        """One-sided 95 % lower confidence bound of the mean difference: mean - t95(n - 1) sd / sqrt(n)
        (NaN for fewer than 2 seeds)."""
        if self.n < 2:
            return math.nan
        return self.mean - t95(self.n - 1) * self.sd / math.sqrt(self.n)

    def shown(self, margin: float = FVE_MARGIN) -> bool:
        """Parity shown: at least 2 seeds and the lower bound above -margin."""
        return self.n >= 2 and self.lower_bound > -margin

    def seeds_needed(self, margin: float = FVE_MARGIN) -> int:
        """The fewest seeds whose bound, at this spread and a true difference of 0, sits margin / 2 above -margin:
        t95(n - 1) sd / sqrt(n) <= margin / 2, so that equal candidates pass about 19 times in 20."""
        n = 2
        while t95(n - 1) * self.sd / math.sqrt(n) > margin / 2 and n < 10_000:
            n += 1
        return n

    def verdict(self, margin: float = FVE_MARGIN) -> str:
        """One line: the paired mean, sd, bound and whether parity is shown."""
        return (f"paired by seed over {self.n} seeds: mean {self.mean:+.4f}, sd {self.sd:.4f}, one-sided 95 % lower "
                f"bound {self.lower_bound:+.4f} ({'above' if self.shown(margin) else 'not above'} -{margin:g}: parity "
                f"{'shown' if self.shown(margin) else 'not shown'})")


def paired_shortfall(candidate: Mapping[int, float], baseline: Mapping[int, float]) -> PairedShortfall:
    """The paired differences candidate[s] - baseline[s] over the seeds s both hold."""
    diffs = [candidate[s] - baseline[s] for s in candidate if s in baseline]
    summary = mean_se(diffs)
    return PairedShortfall(n=summary.n, mean=summary.mean, sd=summary.sd)


__all__ = ["FVE_MARGIN", "MeanSE", "PairedShortfall", "mean_se", "paired_shortfall", "t95"]
