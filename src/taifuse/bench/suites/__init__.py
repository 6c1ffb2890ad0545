"""The suite registry: a suite is one module here with ``cases(quick, compare_torch) -> list[Case]``.

Adding a suite is a file in this package and one line in :data:`SUITES`. A user adds suites of
their own without editing the package: ``TAIFUSE_BENCH_SUITES="name=module,..."`` names modules
with the same ``cases()`` function (the worker processes inherit the variable; docs/custom_ops.md).
"""

from __future__ import annotations

import dataclasses
import importlib
import os

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
    "cnn": "taifuse.bench.suites.cnn",
    "distributed": "taifuse.bench.suites.distributed",
    "step": "taifuse.bench.suites.step",
}


def all_suites() -> dict[str, str]:
    """:data:`SUITES`, then the user's from ``TAIFUSE_BENCH_SUITES`` (``name=module`` pairs,
    comma-separated); ``ValueError`` for a malformed entry or a name that is taken."""
    suites = dict(SUITES)
    for entry in filter(None, (e.strip() for e in os.environ.get("TAIFUSE_BENCH_SUITES", "").split(","))):
        name, sep, module = (part.strip() for part in entry.partition("="))
        if not sep or not name or not module or name in suites:
            raise ValueError(
                f"TAIFUSE_BENCH_SUITES: each entry should be name=module with a new name, got {entry!r}"
            )
        suites[name] = module
    return suites


def suite_names() -> list[str]:
    """Names of the registered suites (and the user's), in report order."""
    return list(all_suites())


def load_cases(
    names: list[str] | None = None, *, quick: bool = False, compare_torch: bool = False
) -> list[Case]:
    """The cases of the named suites (all suites when ``names`` is empty), in registry order.

    With ``--torch-device`` (:func:`taifuse.bench.device.resident`) the suites that have
    device-resident cases build those (:mod:`taifuse.bench.suites.resident`), all of them when
    ``names`` is empty; naming another suite is a ``ValueError``.
    """
    from taifuse.bench import device

    suites = all_suites()
    resident_mode = device.resident()
    if resident_mode:
        from taifuse.bench.suites import resident

        wanted = list(resident.SUITES) if not names else list(names)
        others = [n for n in wanted if n not in resident.SUITES]
        if others:
            raise ValueError(
                f"--torch-device: suite(s) {others} have no device-resident cases; "
                f"the suites that do are {list(resident.SUITES)}"
            )
    else:
        wanted = list(suites) if not names else list(names)
    unknown = [n for n in wanted if n not in suites]
    if unknown:
        raise ValueError(f"unknown suite(s) {unknown}; the suites are {list(suites)}")
    cases: list[Case] = []
    for name, module in suites.items():
        if name not in wanted:
            continue
        if resident_mode:
            cases.extend(resident.cases(name, compare_torch=compare_torch))
        else:
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
