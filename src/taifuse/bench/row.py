"""One row of a benchmark report, as a dataclass, and the header every row of a case starts with.

The harness, the roofline and the suites build :class:`Row` objects; ``results.json`` and the
report read the plain dicts :meth:`Row.as_dict` makes of them, whose keys are the file's format
(``bench/baseline.py`` reads ``id``, ``kind``, ``label``, ``value``, ``verdict`` and
``samples.ratios`` of earlier runs). A row that was not measured (a failed check, a worker that
died) is a :class:`Row` left at its defaults: no value, no interval, nothing counted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

NOT_A_COMPARISON = "not a comparison"
NOT_MEASURED = "not measured"
NO_DATA = "—"  # the cache level of a row that moves no data (an allocation)


@dataclass(frozen=True)
class RowHeader:
    """What was run, on what, where: the fields every row of one case starts with."""

    suite: str
    case: str
    dtype: str
    shape: str
    seed: int
    setup_code: str
    size: str
    bytes_moved: int | None
    cache_level: str
    threads: dict
    backend: str | None
    tolerance: dict | None

    @classmethod
    def of(
        cls, case: Any, runs: list[dict], *, bytes_moved: int | None, cache: str, tolerance: dict | None
    ) -> RowHeader:
        """The header of ``case``'s rows.

        Args:
            case: anything with a case's ``suite``, ``name``, ``dtype``, ``shape``, ``seed`` and
                ``setup_code`` (a :class:`~taifuse.bench.case.Case`, or the memory suite's cases).
            runs: its processes' results, whose thread counts and backend the rows report.
            bytes_moved: bytes one call reads and writes at least (None where that means nothing).
            cache: the cache level those bytes fit in.
            tolerance: the correctness check's ``{"rtol", "atol"}``, None where nothing is checked.
        """
        threads: dict = {}
        for run in runs:
            threads.update(run.get("threads", {}))
        return cls(
            suite=case.suite,
            case=case.name,
            dtype=case.dtype,
            shape=case.shape,
            seed=case.seed,
            setup_code=case.setup_code,
            size=case.shape,
            bytes_moved=bytes_moved,
            cache_level=cache,
            threads=threads,
            backend=runs[0].get("backend") if runs else None,
            tolerance=tolerance,
        )


@dataclass
class Row:
    """One row: an identity, a value with its 95% interval and sample counts, a verdict.

    Attributes:
        id, kind, label, unit: identity; ``kind`` is ``"roofline"``, ``"first_call"``,
            ``"control"``, ``"compare"``, ``"memory"`` or ``"memory_compare"``.
        verdict: what the interval allows (``taifuse.bench.stats``), or why nothing was measured.
        value, low, high, n_processes, n_samples, dispersion: the estimate; None and 0 when
            nothing was measured.
        roofline: the achieved rate against the ceiling of the row's level, or None
            (:func:`taifuse.bench.roofline.judge`).
        header: the case's :class:`RowHeader` (None for the roofline's own rows).
        candidate, baseline: ``{"label", "code", ...}`` of the two sides (case rows only).
        note: one more sentence for the report, or None.
        extra: the fields only some kinds carry (a comparison's check and samples, a roofline
            row's code, a memory row's peaks), written as top-level keys.
    """

    id: str
    kind: str
    label: str
    unit: str
    verdict: str = NOT_MEASURED
    value: float | None = None
    low: float | None = None
    high: float | None = None
    n_processes: int = 0
    n_samples: int = 0
    dispersion: float | None = None
    roofline: dict | None = None
    header: RowHeader | None = None
    candidate: dict | None = None
    baseline: dict | None = None
    note: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def estimated(self, est: Any, scale: float = 1.0) -> Row:
        """This row with its value, interval and counts from a ``stats.Estimate`` (divided by ``scale``)."""
        return dataclasses.replace(
            self,
            value=est.median / scale,
            low=est.low / scale,
            high=est.high / scale,
            n_processes=est.n_processes,
            n_samples=est.n_samples,
            dispersion=est.dispersion,
        )

    def as_dict(self) -> dict[str, Any]:
        """The row as ``results.json`` holds it: header fields first, then the row's own."""
        out: dict[str, Any] = dataclasses.asdict(self.header) if self.header is not None else {}
        out.update(
            id=self.id,
            kind=self.kind,
            label=self.label,
            unit=self.unit,
            value=self.value,
            low=self.low,
            high=self.high,
            n_processes=self.n_processes,
            n_samples=self.n_samples,
            dispersion=self.dispersion,
            roofline=self.roofline,
        )
        if self.header is not None:  # a case's row names both sides, even when it has one
            out.update(candidate=self.candidate, baseline=self.baseline)
        if self.note is not None:
            out["note"] = self.note
        out.update(self.extra)
        out["verdict"] = self.verdict
        return out
