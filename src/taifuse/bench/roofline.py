"""The machine's ceilings, measured in the same run as the rows they judge: a copy bandwidth per
cache level the rows use, and the GEMM rate. The kernels, the row ids and :class:`Ceilings` are
``taifuse._ceilings``'s, which the profiler shares (NOTE [ Traffic model ] there); this module
sizes the ceilings from the caches, times them and judges rows against them.

NOTE [ One ceiling per cache level ]
A working set that stays in the last-level cache streams several times faster than DRAM, so a
single DRAM ceiling made in-cache rows read "269% of copy bandwidth". Each row is compared with
the ceiling of its own level (``cache_level`` of its bytes, the same function that sizes the
ceilings): for a cache level, a working set of half its capacity, at most 8x the level below
(mostly missing that one); for DRAM, 4x the largest cache (2x in quick mode), at least 256 MiB per
array (128 MiB). The sizes come from the measured caches, which differ between machines (a 32 MiB
L3 AMD EPYC, a 260 MiB L3 Xeon). A ceiling's value is each process's fastest pass, the median over
processes: other work on the machine only ever slows a pass, and a ceiling timed in a busy moment
would not bound a row timed in a calm one. A row with no memory traffic to speak of (an
allocation, a first call) is compared with nothing.

NOTE [ Mixed levels ]
A level's capacity is no wall: a working set a little past it still finds much of itself there
on the next call (how much depends on the replacement policy, the page mapping and whatever else
runs), so it streams at some speed between the two levels' ceilings, and a row judged against
the slower one can pass it ("98% of DRAM copy bandwidth" for a 32 MiB affine on a 32 MiB L3,
while PyTorch ran the same bytes 1.5x faster). So :func:`row_level` calls a working set past a
level's capacity but within ``MIXED_MARGIN`` times it mixed (``"L3/DRAM"``), and such a row is
held to the faster level's ceiling (:func:`ceiling_level`), the only one it cannot pass; only a
working set clearly past the level (over ``MIXED_MARGIN`` times its capacity) is judged at the
next level. The ceilings themselves are sized well inside their levels (the NOTE above).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from taifuse import _ceilings
from taifuse._ceilings import (  # re-exported: the bench's suites and tests read them here
    COPY_CODE,
    DRAM,
    GEMM_CODE,
    GEMM_LABEL,
    GEMM_ROW,
    GEMM_SHAPE,
    TRAFFIC_MODEL,
    Ceilings,
    Rate,
    ThreadedCopy,
    copy_label,
    copy_row,
)
from taifuse._costs import traffic_bytes  # written once, shared with taifuse.profiler
from taifuse.bench import stats, timing
from taifuse.bench.env import (
    UNKNOWN_LEVEL,
    cache_capacity,
    cache_level,
    cpu_caches,
    largest_cache_bytes,
    usable_cpus,
)
from taifuse.bench.row import NOT_A_COMPARISON, Row

__all__ = [
    "COPY_CODE",
    "DRAM",
    "GEMM_CODE",
    "GEMM_SHAPE",
    "MIXED_MARGIN",
    "TRAFFIC_MODEL",
    "Ceilings",
    "Rate",
    "ThreadedCopy",
    "ceiling_level",
    "ceiling_sizes",
    "copy_array_bytes",
    "copy_label",
    "judge",
    "measure",
    "row_level",
    "rows",
    "traffic_bytes",
    "working_set",
]

# A working set past a level's capacity by at most this factor is mixed (NOTE [ Mixed levels ]).
MIXED_MARGIN = 2
_MIB = 2**20
_PAGE = 4096


# ----------------------------------------------------------------------------- sizes


def copy_array_bytes(quick: bool = False, caches: list[dict] | None = None) -> int:
    """Bytes of each array of the DRAM ceiling: 4x the largest cache (2x quick), at least 256 (128) MiB."""
    factor, floor = (2, 128 * _MIB) if quick else (4, 256 * _MIB)
    largest = largest_cache_bytes(caches)
    return max(factor * largest, floor) if largest else 2 * floor


def _round(n: float) -> int:
    return max(_PAGE, int(n) // _PAGE * _PAGE)


def working_set(level: str, caches: list[dict], cpus: int, quick: bool = False) -> int:
    """Working-set bytes (source + destination) of the ceiling for ``level`` (NOTE [ One ceiling
    per cache level ]); ``cache_level`` of the result is ``level`` (else ValueError), except for
    DRAM on a machine that reports no caches."""
    if level == DRAM:
        size = 2 * copy_array_bytes(quick, caches)
    else:
        by_level = {f"L{c['level']}": cache_capacity(c, cpus) for c in caches}
        if level not in by_level:
            raise ValueError(f"no cache level {level!r} on this machine (caches: {sorted(by_level)})")
        capacity = by_level[level]
        below = by_level.get(f"L{int(level[1:]) - 1}")
        size = _round(min(capacity / 2, 8 * below) if below else capacity / 2)
        if below and size <= below:  # a level barely larger than the one below: take the middle
            size = _round((capacity + below) / 2)
    # Without cache sizes DRAM is still measured (arrays of 256 MiB or more), its level unverified.
    if caches and cache_level(size, caches, cpus) != level:
        raise ValueError(f"cannot size a {level} working set from caches {caches}")
    return size


def row_level(working_set_bytes: int, caches: list[dict] | None = None, cpus: int | None = None) -> str:
    """The level a row of this working set is reported at (NOTE [ Mixed levels ]): its cache level
    (``env.cache_level``), or ``"<faster>/<level>"`` when it is past the faster level's capacity by
    no more than ``MIXED_MARGIN`` times, e.g. ``"L3/DRAM"`` for 40 MiB on a 32 MiB L3.

    Example::

        >>> l3 = [{"level": 3, "type": "Unified", "bytes": 32 * 2**20, "shared_cpus": 2}]
        >>> [row_level(n * 2**20, l3, 2) for n in (16, 40, 64, 65)]
        ['L3', 'L3/DRAM', 'L3/DRAM', 'DRAM']
    """
    caches = cpu_caches() if caches is None else caches
    cpus = usable_cpus() if cpus is None else cpus
    level = cache_level(working_set_bytes, caches, cpus)
    for cache in sorted(caches, key=lambda c: c["level"]):
        capacity = cache_capacity(cache, cpus)
        if working_set_bytes <= capacity:
            break
        if working_set_bytes <= MIXED_MARGIN * capacity:
            return f"L{cache['level']}/{level}"
    return level


def ceiling_level(level: str) -> str:
    """The level whose copy ceiling a row at ``level`` (:func:`row_level`) is held to: a mixed
    level's faster part, any other level itself."""
    return level.split("/", 1)[0]


def ceiling_sizes(
    levels: Iterable[str], caches: list[dict] | None = None, cpus: int | None = None, quick: bool = False
) -> dict[str, int]:
    """Working set per level to measure: the ceilings of the given levels (those the rows use,
    :func:`ceiling_level` of a mixed one) and DRAM always; levels this machine does not report
    (unknown cache sizes) are left out."""
    caches = cpu_caches() if caches is None else caches
    cpus = usable_cpus() if cpus is None else cpus
    wanted = {ceiling_level(level) for level in levels if level != UNKNOWN_LEVEL} | {DRAM}
    sizes = {}
    for level in sorted(wanted, key=lambda name: (name == DRAM, name)):
        try:
            sizes[level] = working_set(level, caches, cpus, quick)
        except ValueError:
            continue
    return sizes


# ----------------------------------------------------------------------------- measuring


def measure(levels: Mapping[str, int], samples: int, seed: int = 0) -> dict:
    """Time ``samples`` copies per level (``{level: working-set bytes}``, from :func:`ceiling_sizes`)
    and ``samples`` GEMMs in this process; nanoseconds per pass or call."""
    copies = {
        level: _ceilings.time_copy(size, samples, warm_up=timing.warm_up) for level, size in levels.items()
    }
    return {
        "copy": copies,
        "gemm": {
            "ns": _ceilings.time_gemm(samples, seed + 1, warm_up=timing.warm_up),
            "shape": GEMM_SHAPE,
            "flops": _ceilings.GEMM_FLOPS,
            "code": GEMM_CODE,
        },
    }


# ----------------------------------------------------------------------------- rows


def _rate_row(
    row_id: str, label: str, groups_ns: list[list[float]], amount: float, unit: str, extra: dict
) -> Row:
    # A ceiling is what the machine can do, and other work on it only ever slows a pass: the value
    # is each process's fastest pass, the median over processes (the interval over processes too).
    # The spread of all samples still decides whether the row is "unstable".
    spread = stats.estimate(groups_ns)
    t = stats.estimate([[min(g)] for g in groups_ns])
    row = Row(
        id=row_id,
        kind=_ceilings.ROOFLINE,
        label=label,
        unit=unit,
        verdict=stats.UNSTABLE if spread.dispersion > stats.UNSTABLE_DISPERSION else NOT_A_COMPARISON,
        n_processes=spread.n_processes,
        n_samples=spread.n_samples,
        dispersion=spread.dispersion,
        extra={"time_ms": t.median / 1e6, "dtype": "float32", **extra},
    )
    # A rate's interval is the time's upside down: amount / time (bytes or flops per ns = G.../s).
    row.value, row.low, row.high = amount / t.median, amount / t.high, amount / t.low
    return row


def rows(results: list[dict]) -> list[dict]:
    """A copy-bandwidth row per measured level (GB/s of traffic, NOTE [ Traffic model ] in
    taifuse._ceilings) and the GEMM rate (GFLOP/s), each with a bootstrap interval over the
    roofline's processes; their ids are ``taifuse._ceilings``'s (``copy_row(level)``, ``GEMM_ROW``)."""
    if not results:
        return []
    out = []
    for level, first in results[0]["copy"].items():
        traffic = traffic_bytes(first["bytes_moved"], first["bytes_written"])
        array = first["array_bytes"]
        extra = {
            "size": f"2 x {array / _MIB:.4g} MiB float32, {first['threads']} threads",
            "bytes_moved": first["bytes_moved"],
            "traffic_bytes": traffic,
            "cache_level": level,
            "code": first["code"],
        }
        groups = [r["copy"][level]["ns"] for r in results]
        out.append(_rate_row(copy_row(level), copy_label(level), groups, traffic, "GB/s", extra))
    gemm = results[0]["gemm"]
    m, k, n = gemm["shape"]
    extra = {
        "size": f"x ({m}, {k}) @ w ({n}, {k}).T",
        "bytes_moved": None,
        "cache_level": cache_level(4 * (m * k + n * k + m * n)),
        "code": gemm["code"],
    }
    out.append(
        _rate_row(GEMM_ROW, GEMM_LABEL, [r["gemm"]["ns"] for r in results], gemm["flops"], "GFLOP/s", extra)
    )
    return [r.as_dict() for r in out]


def judge(
    *,
    flops: int,
    bytes_moved: int,
    bytes_written: int,
    level: str,
    time_ns: tuple[float, float, float],
    ceilings: Ceilings,
) -> dict | None:
    """A row's achieved rate against the ceiling of its own kind and level, or None.

    Args:
        flops: floating-point operations per call; when nonzero the row is compared with the GEMM rate.
        bytes_moved, bytes_written: per call, as in :func:`traffic_bytes`; otherwise the row is
            compared with the copy bandwidth of ``level``.
        level: the level of the row's working set (:func:`row_level`); a mixed level is held to
            the ceiling of its faster part (NOTE [ Mixed levels ]).
        time_ns: the call's time, ``(median, low, high)`` in nanoseconds.
        ceilings: the run's :class:`Ceilings`.

    Returns ``{"achieved", "unit", "fraction", "low", "high", "of", "ceiling", ...}`` (``low`` and
    ``high`` bound the fraction from both intervals), or None when the row moves no data to speak
    of (an allocation) or its level has no ceiling.
    """
    median, low, high = time_ns
    if flops:
        ceiling, amount, unit, extra = ceilings.gemm, flops, "GFLOP/s", {"flops": flops}
    elif bytes_moved:
        amount = traffic_bytes(bytes_moved, bytes_written)
        ceiling, unit = ceilings.copy.get(ceiling_level(level)), "GB/s"
        extra = {"level": level, "traffic_bytes": amount}
    else:
        return None
    if ceiling is None:
        return None
    achieved = amount / median  # per ns == G.../s
    return {
        "achieved": achieved,
        "unit": unit,
        "fraction": achieved / ceiling.value,
        "low": amount / high / ceiling.high,
        "high": amount / low / ceiling.low,
        "of": ceiling.label,
        "ceiling": ceiling.row_id,
        **extra,
    }
