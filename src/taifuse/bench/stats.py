"""Statistics of a benchmark comparison: pure functions over arrays of timing samples.

NOTE [ How a comparison is judged ]
Each fresh process ``p`` yields pairs ``(t_candidate, t_baseline)`` timed back to back (ABBA), and
each pair a ratio ``r = t_baseline / t_candidate`` (a speedup: above 1 the candidate is faster).
Pairs share a process's JIT, allocator and frequency state, so processes are the independent unit:
the 95% interval of the median ratio comes from a hierarchical bootstrap that first resamples
processes, then pairs within each chosen process. The verdict compares that interval with a
threshold ``max(5%, A/A spread)``, where the A/A spread is how far the interval of a control row
(the candidate against itself, measured in the same run) strays from 1. Nothing here says
"verified": a verdict only says what the interval allows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

MIN_EFFECT = 0.05  # the smallest speedup or slowdown ever called a difference
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


def change(
    new_groups: Sequence[Sequence[float]],
    old_groups: Sequence[Sequence[float]],
    *,
    resamples: int = RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> Estimate:
    """Ratio of the medians of two independent runs (new / old), each resampled hierarchically.

    Used to compare a row's speedup samples with those of an earlier run (``--baseline``).
    """
    new = bootstrap_distribution(new_groups, resamples=resamples, seed=seed)
    old = bootstrap_distribution(old_groups, resamples=resamples, seed=seed + 1)
    ratio = new / old
    tail = 100.0 * (1.0 - confidence) / 2.0
    low, high = np.percentile(ratio, [tail, 100.0 - tail])
    new_arrays, old_arrays = _as_groups(new_groups), _as_groups(old_groups)
    return Estimate(
        median=float(np.median(np.concatenate(new_arrays)) / np.median(np.concatenate(old_arrays))),
        low=float(low),
        high=float(high),
        n_processes=min(len(new_arrays), len(old_arrays)),
        n_samples=min(sum(a.size for a in new_arrays), sum(a.size for a in old_arrays)),
        dispersion=max(dispersion(new_arrays), dispersion(old_arrays)),
    )


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
