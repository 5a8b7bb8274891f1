"""The race's statistics in `lab._stats`, pure Python, checked against scipy on hand-chosen
blocks: ties, failed runs (None), two arms, perfect agreement."""

from __future__ import annotations

import math
import random

import pytest
from scipy import stats

from lab._stats import (
    chi2_sf,
    conover_against_best,
    friedman,
    holm,
    paired_t,
    ranks,
    t_two_sided,
)


def _normal_rows(n: int, k: int, seed: int, rounding: int | None = None) -> list[list[float]]:
    rng = random.Random(seed)
    rows = [[rng.gauss(0.3 * j, 1.0) for j in range(k)] for _ in range(n)]
    return [[round(v, rounding) for v in row] for row in rows] if rounding is not None else rows


ROWS = {
    "5x4": _normal_rows(5, 4, 0),
    "10x16": _normal_rows(10, 16, 1),
    "ties": _normal_rows(8, 5, 2, rounding=0),  # rounded to integers: many ties
    "hand": [[1.0, 2.0, 2.0], [3.0, 1.0, 3.0], [1.0, 1.0, 2.0], [0.5, 0.7, 0.6]],
    "2x3": [[0.1, 0.5, 0.3], [0.2, 0.4, 0.9]],
}


@pytest.mark.parametrize(
    ("x", "df"),
    [(0.0, 1), (0.5, 1), (3.84, 1), (30.0, 15), (1e-3, 3), (7.5, 2), (150.0, 9), (12.0, 37),
     (400.0, 15), (2.0, 100)],
)  # fmt: skip
def test_chi2_sf_matches_scipy(x: float, df: int) -> None:
    assert chi2_sf(x, df) == pytest.approx(stats.chi2.sf(x, df), rel=1e-10, abs=1e-300)


@pytest.mark.parametrize(("t", "df"), [(0.0, 1), (1.2, 1), (-2.5, 4), (8.0, 9), (40.0, 135)])
def test_t_two_sided_matches_scipy(t: float, df: int) -> None:
    assert t_two_sided(t, df) == pytest.approx(2 * stats.t.sf(abs(t), df), rel=1e-10)
    assert t_two_sided(math.inf, 3) == 0.0


@pytest.mark.parametrize("name", sorted(ROWS))
def test_ranks_match_scipy_and_a_failed_run_ranks_worst(name: str) -> None:
    for row in ROWS[name]:
        assert ranks(row) == list(stats.rankdata(row))
    assert ranks([2.0, None, 1.0, None, 2.0]) == [2.5, 4.5, 1.0, 4.5, 2.5]
    assert ranks([None, None]) == [1.5, 1.5]


@pytest.mark.parametrize("name", sorted(ROWS))
def test_friedman_matches_scipy(name: str) -> None:
    rows = ROWS[name]
    test = friedman(rows)
    expected = stats.friedmanchisquare(*zip(*rows, strict=True))
    assert test.statistic == pytest.approx(expected.statistic, rel=1e-12)
    assert test.p_value == pytest.approx(expected.pvalue, rel=1e-10)
    assert test.rank_sums == [float(s) for s in stats.rankdata(rows, axis=1).sum(axis=0)]


def test_friedman_of_two_arms_is_the_sign_test_chi_square() -> None:
    """k = 2 (scipy refuses it): T = (wins - losses)² / (wins + losses), tied blocks out."""
    rows = [[0.1, 0.2], [0.3, 0.1], [0.0, 0.5], [0.2, 0.2], [0.4, 0.9], [0.1, 0.3]]
    test = friedman(rows)  # first arm lower in 4 blocks, higher in 1, tied in 1
    assert test.statistic == pytest.approx((4 - 1) ** 2 / 5)
    assert test.p_value == pytest.approx(stats.chi2.sf(9 / 5, 1), rel=1e-12)
    assert test.rank_sums == [7.5, 10.5]


def test_friedman_of_blocks_that_all_tie_says_nothing() -> None:
    test = friedman([[1.0, 1.0, 1.0], [None, None, None]])
    assert (test.statistic, test.p_value) == (0.0, 1.0)


def _conover_with_scipy(rows: list[list[float]]) -> tuple[int, list[tuple[float, float]]]:
    """Conover's post-hoc as Conover (1999) and irace write it, on scipy's ranks and t."""
    r = stats.rankdata(rows, axis=1)
    n, k = r.shape
    sums = r.sum(axis=0)
    best = int(sums.argmin())
    scale = math.sqrt(2 * (n * (r**2).sum() - (sums**2).sum()) / ((n - 1) * (k - 1)))
    ts = [(s - sums[best]) / scale for s in sums]
    return best, [(t, 2 * stats.t.sf(abs(t), (n - 1) * (k - 1))) for t in ts]


@pytest.mark.parametrize("name", sorted(ROWS))
def test_conover_against_the_best_matches_scipy(name: str) -> None:
    best, pairs = conover_against_best(friedman(ROWS[name]))
    expected_best, expected = _conover_with_scipy(ROWS[name])
    assert best == expected_best
    for (t, p), (t_expected, p_expected) in zip(pairs, expected, strict=True):
        assert t == pytest.approx(t_expected, rel=1e-12, abs=1e-15)
        assert p == pytest.approx(p_expected, rel=1e-10)


def test_conover_when_every_block_ranks_alike() -> None:
    rows = [[0.1, 0.3, 0.2], [1.0, 3.0, 2.0], [5.0, 7.0, 6.0]]
    assert conover_against_best(friedman(rows)) == (
        0,
        [(0.0, 1.0), (math.inf, 0.0), (math.inf, 0.0)],
    )


@pytest.mark.parametrize("name", sorted(ROWS))
def test_paired_t_matches_scipy(name: str) -> None:
    columns = list(zip(*ROWS[name], strict=True))
    for other in columns[1:]:
        t, p = paired_t(other, columns[0])
        expected = stats.ttest_rel(other, columns[0])
        assert t == pytest.approx(expected.statistic, rel=1e-12)
        assert p == pytest.approx(expected.pvalue, rel=1e-10)


def test_paired_t_of_constant_differences() -> None:
    assert paired_t([1.0, 2.0], [1.0, 2.0]) == (0.0, 1.0)
    assert paired_t([1.5, 2.5], [1.0, 2.0]) == (math.inf, 0.0)
    assert paired_t([0.5, 1.5], [1.0, 2.0]) == (-math.inf, 0.0)


def test_holm_as_r_p_adjust() -> None:
    # R: p.adjust(c(0.01, 0.02, 0.03, 0.04, 0.05), "holm") -> 0.05 0.08 0.09 0.09 0.09
    assert holm([0.03, 0.01, 0.05, 0.02, 0.04]) == pytest.approx([0.09, 0.05, 0.09, 0.08, 0.09])
    assert holm([0.5, 0.9]) == [1.0, 1.0]
    assert holm([0.9, 0.01]) == [0.9, 0.02]
    assert holm([0.2]) == [0.2]
    assert holm([]) == []
