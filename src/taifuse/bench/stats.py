"""Statistics of a benchmark comparison: pure functions over arrays of timing samples.

Within one run, a row's interval comes from a hierarchical bootstrap over its processes
(NOTE [ How a comparison is judged ]). Between two runs (``--baseline``), a row's change gets a
Student-t interval over per-process medians whose variance adds a run-to-run term, and a verdict
that needs both that interval and a minimum effect (NOTE [ Comparing two runs ]).

NOTE [ How a comparison is judged ]
Each fresh process ``p`` yields pairs ``(t_candidate, t_baseline)`` timed back to back (ABBA), and
each pair a ratio ``r = t_baseline / t_candidate`` (a speedup: above 1 the candidate is faster).
Pairs share a process's JIT, allocator and frequency state, so processes are the independent unit:
the 95% interval of the median ratio comes from a hierarchical bootstrap that first resamples
processes, then pairs within each chosen process. The verdict compares that interval with a
threshold ``max(5%, A/A spread)``, where the A/A spread is how far the interval of a control row
(the candidate against itself, measured in the same run) strays from 1. Nothing here says
"verified": a verdict only says what the interval allows.

NOTE [ Comparing two runs ]
Two runs of the same commit differ by more than either run's interval says. A second
``taifuse bench --quick`` of an unchanged commit moved silu's speedup 8.7x -> 5.45x, a change of
0.627x whose bootstrap interval [0.482, 0.725] excluded 1. Two things were wrong:

* With 3 processes a percentile bootstrap over processes is far too narrow (it can only
  reshuffle three numbers). The interval here is Student's t over the per-process medians instead:
  ``d = mean(log m_new) - mean(log m_old)``, the variance of the per-process log medians pooled
  over both runs, ``v = s^2 (1/P_new + 1/P_old)``, and ``P_new + P_old - 2`` degrees of freedom.
* A run's processes share the minutes they ran in: a neighbour's load, the frequency the machine
  held, where the pages landed. So a row's processes move together within a run and differently
  in the next (10-20% between runs has been seen, against ~10% between processes), and no number
  of processes in one run averages that away. The interval therefore adds a run-to-run variance
  ``tau^2``: ``d +- t(df) * sqrt(v + tau^2)``.

``tau`` is the larger of a floor, RUN_TO_RUN_FLOOR (0.15 in log units, inside the 10-20% seen
between runs), and what this comparison shows: the robust spread (1.4826 MAD) of the log changes
of all rows compared, A/A controls included, less their typical process variance. A machine-state
shift moves many rows at once and shows up in that spread; a real regression of a few rows does
not, since the MAD ignores them. The spread is taken about the rows' median change, so a slowdown
of every row counts as a change, not as noise: ABBA pairing cancels what the machine does to both
sides of a pair alike. With fewer than MIN_ROWS_FOR_SPREAD rows the floor alone is used; it is
also what keeps a lone row's transient (the silu change above) from reading as a regression when
the other rows happen to be quiet.

The verdicts (applied in :mod:`taifuse.bench.baseline`) also need a minimum effect,
``max(MIN_RUN_EFFECT, each run's A/A threshold)``: slower when the interval lies wholly below
``1 / (1 + effect)``, faster when wholly above ``1 + effect``, no measurable change when the
interval holds 1 or lies within those bounds, and inconclusive otherwise (the row moved, but these
two runs cannot say by more than the minimum effect). Unlike a verdict within one run, "no
measurable change" does not need the whole interval inside the bounds: with ``tau >= 0.15`` no two
runs could show that. Only "slower" fails a ``--baseline`` run.

What that buys and costs, on simulated quick runs (tests/test_bench_baseline.py): of rows of one
commit with 10-20% run-to-run and 10% process noise, the bootstrap rule called 12-30% regressions,
this rule at most the nominal 2.5%; a 2x slowdown with 5% noise is still called (48 of 50 trials).
Even with tight processes and ``tau`` at its floor, a change is called a regression only below
about 0.60x with 3 processes a run (``--quick``), 0.64x with 5 and 0.48x with 2: smaller slowdowns
read as inconclusive or no measurable change until more processes or a quieter machine narrow it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache

import numpy as np

MIN_EFFECT = 0.05  # the smallest speedup or slowdown ever called a difference
# NOTE [ Comparing two runs ]: the smallest change between two runs ever called one, the least
# run-to-run log spread assumed, and the fewest rows whose spread is trusted to say more.
MIN_RUN_EFFECT = 0.10
RUN_TO_RUN_FLOOR = 0.15
MIN_ROWS_FOR_SPREAD = 5
UNSTABLE_DISPERSION = 0.25  # robust relative spread of the pair ratios above which a row is "unstable"
RESAMPLES = 4000
CONFIDENCE = 0.95

FASTER = "faster"
SLOWER = "slower"
NO_DIFFERENCE = "no measurable difference"
INCONCLUSIVE = "inconclusive"
UNSTABLE = "unstable"
FAILED = "failed: outputs differ"
VERDICTS = (FASTER, SLOWER, NO_DIFFERENCE, INCONCLUSIVE, UNSTABLE, FAILED)


@dataclass(frozen=True)
class Estimate:
    """A median with its bootstrap interval, over samples grouped by process."""

    median: float
    low: float
    high: float
    n_processes: int
    n_samples: int
    dispersion: float

    def as_dict(self) -> dict:
        return asdict(self)


def _as_groups(groups: Sequence[Sequence[float]]) -> list[np.ndarray]:
    arrays = [np.asarray(g, dtype=np.float64).ravel() for g in groups]
    arrays = [a for a in arrays if a.size]
    if not arrays:
        raise ValueError("need at least one process with at least one sample")
    for a in arrays:
        if not np.all(np.isfinite(a)):
            raise ValueError("samples should be finite")
    return arrays


def bootstrap_distribution(
    groups: Sequence[Sequence[float]],
    statistic: Callable[..., np.ndarray] = np.median,
    *,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> np.ndarray:
    """``statistic`` of ``resamples`` hierarchical resamples: processes first, then samples within each.

    Args:
        groups: one array of samples per process (lengths may differ).
        statistic: a reduction called as ``statistic(matrix, axis=1)`` that ignores NaN padding
            (``np.median`` is mapped to ``np.nanmedian``).
        resamples: number of bootstrap resamples.
        seed: seed of the ``numpy.random.Generator``; equal inputs and seed give equal output.

    Returns an array of shape ``(resamples,)``.
    """
    arrays = _as_groups(groups)
    rng = np.random.default_rng(seed)
    sizes = np.array([a.size for a in arrays])
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    flat = np.concatenate(arrays)
    n_groups, longest = len(arrays), int(sizes.max())
    chosen = rng.integers(0, n_groups, size=(resamples, n_groups))
    chosen_sizes = sizes[chosen][..., None]
    # Each chosen process gets as many draws as it has samples; shorter ones are padded with NaN.
    within = np.floor(rng.random((resamples, n_groups, longest)) * chosen_sizes).astype(np.int64)
    values = flat[offsets[chosen][..., None] + within]
    values[np.arange(longest)[None, None, :] >= chosen_sizes] = np.nan
    reduce = np.nanmedian if statistic is np.median else statistic
    return np.asarray(reduce(values.reshape(resamples, -1), axis=1))


def dispersion(groups: Sequence[Sequence[float]]) -> float:
    """Robust relative spread of positive samples: 1.4826 * MAD of their logarithms (about a CV).

    Each process's samples are centred on their own median first, so a steady offset between
    processes (which the bootstrap interval accounts for) does not count as noise here.
    """
    arrays = _as_groups(groups)
    if any(np.any(a <= 0) for a in arrays):
        raise ValueError("dispersion needs positive samples (times or ratios)")
    centred = np.concatenate([np.log(a) - np.median(np.log(a)) for a in arrays])
    return float(1.4826 * np.median(np.abs(centred - np.median(centred))))


def estimate(
    groups: Sequence[Sequence[float]],
    *,
    resamples: int = RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> Estimate:
    """Median of all samples with a hierarchical-bootstrap interval at ``confidence``.

    Example::

        >>> est = estimate([[1.0, 1.1, 0.9], [1.0, 1.05, 0.95]])
        >>> est.low <= est.median <= est.high
        True
    """
    arrays = _as_groups(groups)
    dist = bootstrap_distribution(arrays, resamples=resamples, seed=seed)
    tail = 100.0 * (1.0 - confidence) / 2.0
    low, high = np.percentile(dist, [tail, 100.0 - tail])
    return Estimate(
        median=float(np.median(np.concatenate(arrays))),
        low=float(low),
        high=float(high),
        n_processes=len(arrays),
        n_samples=int(sum(a.size for a in arrays)),
        dispersion=dispersion(arrays),
    )


def pair_ratios(candidate_ns: Sequence[float], baseline_ns: Sequence[float]) -> np.ndarray:
    """Speedup of each ABBA pair: ``baseline / candidate`` (above 1: the candidate is faster)."""
    a = np.asarray(candidate_ns, dtype=np.float64)
    b = np.asarray(baseline_ns, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"candidate and baseline need one sample per pair, got {a.shape} and {b.shape}")
    if np.any(a <= 0) or np.any(b <= 0):
        raise ValueError("times should be positive")
    return b / a


def speedup(
    candidate_ns: Sequence[Sequence[float]], baseline_ns: Sequence[Sequence[float]], *, seed: int = 0
) -> Estimate:
    """Median speedup of the candidate over the baseline, per-process pairs in, interval out."""
    return estimate([pair_ratios(a, b) for a, b in zip(candidate_ns, baseline_ns)], seed=seed)


@lru_cache(maxsize=256)
def t_quantile(p: float, df: float) -> float:
    """Quantile ``p`` (above 0.5) of Student's t with ``df`` degrees of freedom.

    NumPy has no t distribution and taifuse does not depend on SciPy: this bisects the CDF,
    integrating the density by Simpson's rule on a grid fine enough for 4 significant digits.

    Example::

        >>> round(t_quantile(0.975, 4), 3)
        2.776
    """
    if not 0.5 < p < 1.0 or not df > 0:
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and df > 0, got p={p}, df={df}")
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def upper_half(x: float) -> float:  # P(0 <= T <= x)
        grid = np.linspace(0.0, x, 4001)
        f = np.exp(log_norm - (df + 1) / 2 * np.log1p(grid**2 / df))
        return float((grid[1] - grid[0]) / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum()))

    low, high = 0.0, 1.0
    while upper_half(high) < p - 0.5:
        high *= 2.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if upper_half(mid) < p - 0.5 else (low, mid)
    return (low + high) / 2


@dataclass(frozen=True)
class RunChange:
    """A row's log change between two runs and what its processes say of its noise.

    ``log_change`` is the difference of the mean log per-process medians (new minus old),
    ``variance`` its variance from the process-to-process spread alone (pooled over both runs),
    ``df`` the degrees of freedom of that variance (NOTE [ Comparing two runs ]).
    """

    log_change: float
    variance: float
    df: int
    n_processes: int
    n_samples: int
    dispersion: float


def run_change(new_groups: Sequence[Sequence[float]], old_groups: Sequence[Sequence[float]]) -> RunChange:
    """The change of a row's positive samples (speedups) between two runs, per process.

    Each process counts once, through the median of its samples; the two runs' log medians give
    the change and a pooled variance. Needs at least three processes over both runs.

    Example::

        >>> c = run_change([[2.0, 2.1], [1.9, 2.0]], [[4.0, 4.2], [3.8, 4.0]])
        >>> round(math.exp(c.log_change), 3), c.df
        (0.5, 2)
    """
    new, old = _as_groups(new_groups), _as_groups(old_groups)
    if any(np.any(a <= 0) for a in new + old):
        raise ValueError("a change between runs needs positive samples (speedups)")
    a = np.log([np.median(g) for g in new])
    b = np.log([np.median(g) for g in old])
    df = a.size + b.size - 2
    if df < 1:
        raise ValueError("a change between runs needs at least three processes over both runs")
    pooled = (np.sum((a - a.mean()) ** 2) + np.sum((b - b.mean()) ** 2)) / df
    return RunChange(
        log_change=float(a.mean() - b.mean()),
        variance=float(pooled * (1.0 / a.size + 1.0 / b.size)),
        df=int(df),
        n_processes=int(min(a.size, b.size)),
        n_samples=int(min(sum(g.size for g in new), sum(g.size for g in old))),
        dispersion=max(dispersion(new), dispersion(old)),
    )


def run_to_run(
    changes: Sequence[RunChange], *, floor: float = RUN_TO_RUN_FLOOR, min_rows: int = MIN_ROWS_FOR_SPREAD
) -> float:
    """The run-to-run log spread ``tau`` of one comparison's rows (NOTE [ Comparing two runs ]).

    ``max(floor, sqrt(S^2 - median variance))`` where ``S`` is 1.4826 x the MAD of the rows' log
    changes about their median; ``floor`` alone when fewer than ``min_rows`` rows are given.
    """
    if not floor >= 0:
        raise ValueError(f"floor should be a non-negative log spread, got {floor}")
    if len(changes) < min_rows:
        return float(floor)
    d = np.array([c.log_change for c in changes])
    spread = 1.4826 * np.median(np.abs(d - np.median(d)))
    within = np.median([c.variance for c in changes])
    return float(max(floor, math.sqrt(max(0.0, spread**2 - within))))


def change_estimate(c: RunChange, tau: float, *, confidence: float = CONFIDENCE) -> Estimate:
    """The change as a ratio (new / old) with its t interval ``d +- t(df) sqrt(v + tau^2)``."""
    if not tau >= 0:
        raise ValueError(f"tau should be a non-negative log spread, got {tau}")
    half = t_quantile(0.5 + confidence / 2.0, c.df) * math.sqrt(c.variance + tau**2)
    return Estimate(
        median=math.exp(c.log_change),
        low=math.exp(c.log_change - half),
        high=math.exp(c.log_change + half),
        n_processes=c.n_processes,
        n_samples=c.n_samples,
        dispersion=c.dispersion,
    )


def change(
    new_groups: Sequence[Sequence[float]],
    old_groups: Sequence[Sequence[float]],
    *,
    tau: float = 0.0,
    confidence: float = CONFIDENCE,
) -> Estimate:
    """Ratio of a row's speedups in two runs (new / old), with a t interval over per-process medians.

    Args:
        new_groups, old_groups: the row's per-process speedup samples in each run.
        tau: run-to-run log spread to add (:func:`run_to_run`); 0 counts the processes' spread
            only, as if both runs had been measured together, which two runs never are.
        confidence: of the interval.

    Used by ``--baseline`` (NOTE [ Comparing two runs ]).

    Example::

        >>> new, old = [[1.9, 2.0], [2.0, 2.1], [2.0, 2.0]], [[3.9, 4.0], [4.0, 4.1], [4.0, 4.0]]
        >>> est = change(new, old, tau=RUN_TO_RUN_FLOOR)
        >>> round(est.median, 2), change_verdict(est, MIN_RUN_EFFECT)
        (0.5, 'slower')
        >>> change_verdict(change(new[:2], old[:2], tau=RUN_TO_RUN_FLOOR))  # 2 processes a run: too few
        'inconclusive'
    """
    return change_estimate(run_change(new_groups, old_groups), tau, confidence=confidence)


def change_verdict(
    est: Estimate, min_effect: float = MIN_RUN_EFFECT, *, unstable_dispersion: float = UNSTABLE_DISPERSION
) -> str:
    """Judge a change between runs (NOTE [ Comparing two runs ]).

    * ``"unstable"``: either run's pairs are too dispersed (as in :func:`verdict`);
    * ``"slower"`` / ``"faster"``: the interval lies wholly below ``1 / (1 + min_effect)`` /
      above ``1 + min_effect``;
    * ``"no measurable difference"``: the interval holds 1, or lies within those bounds;
    * ``"inconclusive"``: the row moved (1 is outside) but not provably by ``min_effect``.
    """
    if not min_effect >= 0:
        raise ValueError(f"min_effect should be a non-negative fraction, got {min_effect}")
    if est.dispersion > unstable_dispersion:
        return UNSTABLE
    up, down = 1.0 + min_effect, 1.0 / (1.0 + min_effect)
    if est.high < down:
        return SLOWER
    if est.low > up:
        return FASTER
    if est.low <= 1.0 <= est.high or (est.low >= down and est.high <= up):
        return NO_DIFFERENCE
    return INCONCLUSIVE


def control_spread(control: Estimate) -> float:
    """How far the A/A control's interval strays from 1, as a fraction (0.03 = 3%)."""
    return max(control.high - 1.0, 1.0 - control.low, 0.0)


def threshold(control: Estimate | None = None, *, min_effect: float = MIN_EFFECT) -> float:
    """The smallest effect a verdict may call a difference: ``max(min_effect, A/A spread)``."""
    return max(min_effect, control_spread(control) if control is not None else 0.0)


def verdict(est: Estimate, limit: float, *, unstable_dispersion: float = UNSTABLE_DISPERSION) -> str:
    """Judge a speedup interval against ``limit`` (a fraction, from :func:`threshold`).

    * ``"unstable"``: the samples' dispersion exceeds ``unstable_dispersion``;
    * ``"faster"``: the lower bound clears ``1 + limit``;
    * ``"slower"``: the upper bound is below ``1 / (1 + limit)`` (symmetric in log scale);
    * ``"no measurable difference"``: the whole interval lies within those two bounds;
    * ``"inconclusive"``: anything else (the interval straddles a bound).

    Example::

        >>> verdict(Estimate(2.0, 1.9, 2.1, 5, 100, 0.02), 0.05)
        'faster'
    """
    if not limit >= 0:
        raise ValueError(f"limit should be a non-negative fraction, got {limit}")
    if est.dispersion > unstable_dispersion:
        return UNSTABLE
    up, down = 1.0 + limit, 1.0 / (1.0 + limit)
    if est.low > up:
        return FASTER
    if est.high < down:
        return SLOWER
    if est.low >= down and est.high <= up:
        return NO_DIFFERENCE
    return INCONCLUSIVE
