"""Small statistics for summaries: mean, sample std and a confidence interval across repeats.

Two intervals: Student's t (the default), and a percentile bootstrap over the repeats for
bounded or skewed metrics (it never leaves the range of the values). Either is clipped to a
metric's declared `bounds`. `ExperimentResult.summary` and `lab.inspect.summary` both call
`spread`, so they give the same numbers.

The t quantile is computed here (regularized incomplete beta by continued fraction, then
bisection) so that summaries need no scipy; the tests check it against scipy.

Races (`lab.sweeps.racing`) compare arms over paired repeats with the tests below, pure
Python as well: the chi-square survival function (regularized upper incomplete gamma), the
Friedman test with ties averaged, Conover's post-hoc comparison of each arm with the best by
rank sum, the paired t test, and Holm's correction for the number of comparisons. Their
values are oriented so that lower is better; a missing value (None) ranks worst in its block.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from lab.errors import ConfigError

Interval = Literal["t", "bootstrap"]
INTERVALS = ("t", "bootstrap")
# Up to this many distinct resamples (n <= 8 repeats) the bootstrap is computed exactly, over
# every resample with its multinomial weight; beyond it, from this many seeded resamples.
BOOTSTRAP_EXACT_LIMIT = 20_000
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_two_sided(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with `df` degrees of freedom: a two-sided p-value,
    computed from the tail itself so that tiny p-values keep their digits."""
    if math.isnan(t):
        return math.nan
    if math.isinf(t):
        return 0.0
    return _betainc(df / 2.0, 0.5, df / (df + t * t))


def t_ppf(q: float, df: float) -> float:
    """The `q` quantile of Student's t with `df` degrees of freedom."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile {q} must lie strictly between 0 and 1")
    if q < 0.5:
        return -t_ppf(1.0 - q, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < q:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if t_cdf(mid, df) < q:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return (lo + hi) / 2.0


@dataclass(frozen=True)
class Spread:
    """The mean of some values across repeats, with its spread and 95% CI."""

    n: int
    mean: float
    std: float
    ci_low: float
    ci_high: float

    @property
    def half_width(self) -> float:
        """Half the width of the confidence interval."""
        return (self.ci_high - self.ci_low) / 2.0


def check_interval(interval: Any) -> Interval:
    """`interval` if it names a known interval, else a `ConfigError` naming the choices."""
    if not isinstance(interval, str) or interval not in INTERVALS:
        raise ConfigError(
            f"interval={interval!r}: use 't' (Student's t) or 'bootstrap' (percentile "
            "bootstrap over repeats, for bounded metrics such as accuracies)"
        )
    return cast(Interval, interval)


def check_bounds(bounds: Any, metric: str | None = None) -> tuple[float, float] | None:
    """`bounds` as ``(low, high)`` floats, or None; anything else is a `ConfigError`."""
    if bounds is None:
        return None
    ok = (
        isinstance(bounds, tuple | list)
        and len(bounds) == 2
        and all(isinstance(b, int | float) and not isinstance(b, bool) for b in bounds)
        and bounds[0] < bounds[1]  # False for NaN too
    )
    if not ok:
        which = f" of {metric!r}" if metric is not None else ""
        raise ConfigError(
            f"bounds{which}={bounds!r}: give (low, high) with low < high, e.g. (0, 1) for an "
            "accuracy or (0, inf) for a loss"
        )
    return float(bounds[0]), float(bounds[1])


def spread(
    values: Sequence[float],
    confidence: float = 0.95,
    *,
    interval: Interval = "t",
    bounds: tuple[float, float] | None = None,
    metric: str | None = None,
) -> Spread:
    """Mean, sample std (n-1) and a CI of the mean of `values`; NaN where undefined.

    ``interval="t"``: mean ± t(q, n-1)·std/√n with q = (1 + confidence)/2.
    ``interval="bootstrap"``: the (1 - confidence)/2 and (1 + confidence)/2 quantiles
    (inverted CDF) of the means of resamples of `values` with replacement;
    exact (every resample, weighted) up to `BOOTSTRAP_EXACT_LIMIT` distinct resamples, else
    `BOOTSTRAP_RESAMPLES` seeded ones, so the same values always give the same interval.
    With `bounds` (a metric's known range, e.g. ``(0, 1)``) the interval is clipped to it,
    and a value outside it is a `ConfigError` (the bounds, or the metric, are wrong; NaN is
    data and passes). `metric` names the values in that message.
    """
    check_interval(interval)
    bounds = check_bounds(bounds, metric)
    if bounds is not None:
        outside = [v for v in values if v < bounds[0] or v > bounds[1]]
        if outside:
            raise ConfigError(outside_text(metric, outside[0], bounds))
    n = len(values)
    if n == 0:
        return Spread(0, math.nan, math.nan, math.nan, math.nan)
    mean = math.fsum(values) / n
    if n == 1:
        return Spread(1, mean, math.nan, math.nan, math.nan)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    if interval == "bootstrap":
        if all(math.isfinite(v) for v in values):
            low, high = bootstrap_interval(values, confidence)
        else:  # a NaN or an infinity: no interval, as with t (its std is NaN)
            low = high = math.nan
    else:
        half = t_ppf(0.5 + confidence / 2.0, n - 1) * std / math.sqrt(n)
        low, high = mean - half, mean + half
    if bounds is not None:
        low, high = clip(low, bounds), clip(high, bounds)
    return Spread(n, mean, std, low, high)


def outside_text(metric: str | None, value: float, bounds: tuple[float, float]) -> str:
    """The error of a value outside its metric's declared range: the bounds, or the metric,
    are wrong."""
    which = f"metric {metric!r}" if metric is not None else "a value"
    return (
        f"{which} has {value!r} outside bounds=({bounds[0]:g}, {bounds[1]:g}); declare the "
        "metric's real range, or leave bounds out"
    )


def clip(value: float, bounds: tuple[float, float] | None) -> float:
    """`value` limited to `bounds`; NaN stays NaN."""
    if bounds is None or math.isnan(value):
        return value
    return min(max(value, bounds[0]), bounds[1])


def bootstrap_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """The percentile-bootstrap interval of the mean of `values` (finite, at least two).

    Each resample draws len(values) values with replacement; the interval's ends are the
    (1-confidence)/2 and (1+confidence)/2 quantiles of the resample means, each the smallest
    mean whose cumulative share reaches it (numpy's ``method="inverted_cdf"``).
    """
    values = sorted(values)  # the same interval whatever order the runs ended in
    n = len(values)
    lo_q, hi_q = (1.0 - confidence) / 2.0, (1.0 + confidence) / 2.0
    if math.comb(2 * n - 1, n) <= BOOTSTRAP_EXACT_LIMIT:
        weighted = sorted(
            (math.fsum(c * v for c, v in zip(counts, values, strict=True)) / n, weight)
            for counts, weight in _resamples(n)
        )
        total = n**n
    else:
        rng = random.Random(BOOTSTRAP_SEED)  # its own generator: the caller's stays as it was
        weighted = sorted(
            (math.fsum(rng.choices(values, k=n)) / n, 1) for _ in range(BOOTSTRAP_RESAMPLES)
        )
        total = BOOTSTRAP_RESAMPLES
    return _quantile(weighted, total, lo_q), _quantile(weighted, total, hi_q)


def _resamples(n: int) -> Iterator[tuple[tuple[int, ...], int]]:
    """Every distinct resample of n values as (how often each value is drawn, how many of
    the n**n ordered draws give it)."""
    fact = [math.factorial(k) for k in range(n + 1)]

    def compositions(left: int, slots: int) -> Iterator[tuple[int, ...]]:
        if slots == 1:
            yield (left,)
            return
        for first in range(left, -1, -1):
            for rest in compositions(left - first, slots - 1):
                yield (first, *rest)

    for counts in compositions(n, n):
        weight = fact[n]
        for c in counts:
            weight //= fact[c]
        yield counts, weight


def _quantile(weighted: list[tuple[float, int]], total: int, q: float) -> float:
    """The smallest value whose cumulative weight reaches q * total."""
    need = q * total
    cumulative = 0
    for value, weight in weighted:
        cumulative += weight
        if cumulative >= need:
            return value
    return weighted[-1][0]


def _gamma_q(a: float, x: float) -> float:
    """Q(a, x), the regularized upper incomplete gamma function: a series for x < a + 1,
    else a continued fraction (modified Lentz), each to full double precision."""
    if x <= 0.0:
        return 1.0
    if math.isinf(x):
        return 0.0
    front = math.exp(-x + a * math.log(x) - math.lgamma(a))
    if x < a + 1.0:
        term = total = 1.0 / a
        ap = a
        for _ in range(10_000):
            ap += 1.0
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return max(0.0, 1.0 - total * front)
    tiny = 1e-300
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = b + an / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return front * h


def chi2_sf(x: float, df: float) -> float:
    """P(X >= x) for a chi-square variable with `df` degrees of freedom: the p-value of the
    Friedman statistic."""
    if math.isnan(x):
        return math.nan
    return _gamma_q(df / 2.0, x / 2.0)


def ranks(block: Sequence[float | None]) -> list[float]:
    """The ranks of one block's values, 1 for the lowest, ties given their average rank; a
    None (a failed or pruned run) ranks below every value, Nones tied with each other."""
    order = sorted(range(len(block)), key=lambda i: (block[i] is None, block[i] or 0.0))
    out = [0.0] * len(block)
    start = 0
    while start < len(order):
        end = start
        first = block[order[start]]
        while end + 1 < len(order) and block[order[end + 1]] == first:
            end += 1  # None == None too: failed runs tie with each other
        for i in order[start : end + 1]:
            out[i] = (start + end) / 2.0 + 1.0
        start = end + 1
    return out


@dataclass(frozen=True)
class Friedman:
    """The Friedman test over n blocks (rows) of k arms (columns), with its rank sums."""

    statistic: float  # chi-square on k - 1 df, ties averaged (Conover's form)
    p_value: float
    rank_sums: list[float]  # per arm: the sum of its ranks over the blocks
    rank_squares: float  # the sum of every squared rank (Conover's A)
    blocks: int


def friedman(rows: Sequence[Sequence[float | None]]) -> Friedman:
    """Friedman's test that k arms rank alike over n paired blocks, ties averaged.

    Conover's form, as F-race and irace use: with R_j the rank sums, A the sum of all
    squared ranks and C = n·k·(k+1)²/4, T = (k-1)·Σ(R_j - n(k+1)/2)² / (A - C), on k-1
    degrees of freedom (the same as scipy's ``friedmanchisquare`` with its tie correction,
    and defined for k = 2 as well, where it is the sign test's chi-square). Blocks in which
    every value ties carry no information: when all do, T = 0 and p = 1.
    """
    ranked = [ranks(row) for row in rows]
    n, k = len(ranked), len(ranked[0])
    sums = [math.fsum(row[j] for row in ranked) for j in range(k)]
    squares = math.fsum(r * r for row in ranked for r in row)
    spread_ = squares - n * k * (k + 1) ** 2 / 4.0
    if spread_ <= 1e-9 * squares:
        return Friedman(0.0, 1.0, sums, squares, n)
    deviation = math.fsum((s - n * (k + 1) / 2.0) ** 2 for s in sums)
    statistic = (k - 1) * deviation / spread_
    return Friedman(statistic, chi2_sf(statistic, k - 1), sums, squares, n)


def conover_against_best(test: Friedman) -> tuple[int, list[tuple[float, float]]]:
    """Conover's post-hoc comparison of each arm with the best (the lowest rank sum, the
    first on a tie), after a Friedman test: (the best's column, per arm (t, two-sided p)).

    t_j = (R_j - R_best) / sqrt(2(n·A - ΣR²) / ((n-1)(k-1))), on (n-1)(k-1) degrees of
    freedom (Conover, Practical Nonparametric Statistics, 1999, pp. 369-371; irace's
    elimination rule). When every block ranks the arms alike the denominator is 0: an arm
    with the best's rank sum gets (0, 1), any other (inf, 0). The best gets (0, 1).
    """
    sums, n, k = test.rank_sums, test.blocks, len(test.rank_sums)
    best = min(range(k), key=lambda j: sums[j])
    variance = 2.0 * (n * test.rank_squares - math.fsum(s * s for s in sums))
    variance /= (n - 1) * (k - 1)
    out = []
    for s in sums:
        gap = s - sums[best]
        if gap <= 0.0:
            out.append((0.0, 1.0))
        elif variance <= 1e-12 * n * test.rank_squares:
            out.append((math.inf, 0.0))
        else:
            t = gap / math.sqrt(variance)
            out.append((t, t_two_sided(t, (n - 1) * (k - 1))))
    return best, out


def paired_t(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """The paired t test of x against y (at least two pairs): (t of x - y, two-sided p),
    as scipy's ``ttest_rel``. Differences that are all equal: (0, 1) when they are 0, else
    (±inf, 0)."""
    d = [a - b for a, b in zip(x, y, strict=True)]
    n = len(d)
    mean = math.fsum(d) / n
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in d) / (n - 1))
    if sd <= 1e-12 * max(1.0, max(abs(v) for v in d)):
        return (0.0, 1.0) if mean == 0.0 else (math.copysign(math.inf, mean), 0.0)
    t = mean / (sd / math.sqrt(n))
    return t, t_two_sided(t, n - 1)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down correction of m p-values, in their order: the i-th smallest becomes
    max over j <= i of min(1, (m - j + 1)·p_(j)). Rejecting where it is below alpha keeps
    the chance of any false rejection at most alpha, for any dependence between the tests."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    out = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        out[i] = running
    return out
