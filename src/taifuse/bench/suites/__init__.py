"""The suite registry: a suite is one module here with ``cases(quick, compare_torch) -> list[Case]``.

Adding a suite is a file in this package and one line in :data:`SUITES`.
"""

from __future__ import annotations

import dataclasses
import importlib

from taifuse.bench.case import Case

# name -> module; the order is the order of the report.
SUITES = {
    "elementwise": "taifuse.bench.suites.elementwise",
    "linear": "taifuse.bench.suites.linear",
    "optim": "taifuse.bench.suites.optim",
    "memory": "taifuse.bench.suites.memory",
    "training": "taifuse.bench.suites.training",
    "pool": "taifuse.bench.suites.pool",
    "transformer": "taifuse.bench.suites.transformer",
    "profiler": "taifuse.bench.suites.profiler",
}


def suite_names() -> list[str]:
    """Names of the registered suites, in report order."""
    return list(SUITES)


def load_cases(
    names: list[str] | None = None, *, quick: bool = False, compare_torch: bool = False
) -> list[Case]:
    """The cases of the named suites (all suites when ``names`` is empty), in registry order."""
    wanted = list(SUITES) if not names else list(names)
    unknown = [n for n in wanted if n not in SUITES]
    if unknown:
        raise ValueError(f"unknown suite(s) {unknown}; the suites are {list(SUITES)}")
    cases: list[Case] = []
    for name, module in SUITES.items():
        if name in wanted:
            cases.extend(importlib.import_module(module).cases(quick=quick, compare_torch=compare_torch))
    return cases


def pick(cases: list[Case], case_id: str, labels: set[str]) -> Case:
    """The case ``case_id`` of ``cases`` with only the baselines labelled ``labels`` (for the goal scripts)."""
    case = next(c for c in cases if c.id == case_id)
    return dataclasses.replace(case, baselines=tuple(b for b in case.baselines if b.label in labels))


def find_case(case_id: str, *, quick: bool, compare_torch: bool) -> Case:
    """Rebuild one case by id (``"suite/name"``) in a worker process."""
    suite = case_id.split("/", 1)[0]
    for case in load_cases([suite], quick=quick, compare_torch=compare_torch):
        if case.id == case_id:
            return case
    raise KeyError(f"no case {case_id!r}")
