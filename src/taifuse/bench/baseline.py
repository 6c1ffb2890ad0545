"""``--baseline``: compare a run with an earlier ``results.json`` by the same interval rule.

For each comparison row present in both runs, the change is the ratio of the two speedups
(new / old), its interval from resampling each run's processes and pairs independently. The row
regressed when that interval lies wholly below ``1 / (1 + threshold)``, the threshold being the
larger of the two runs' (see NOTE [ How a comparison is judged ] in stats.py). A row that passed its
correctness check before and fails it now is a regression too. First-call and roofline rows are
shown for context only: they measure the machine and the cache state more than the code.
"""

from __future__ import annotations

import json
from pathlib import Path

from taifuse.bench import stats
from taifuse.bench.env import fingerprint_differences

REGRESSION = "regression"
IMPROVEMENT = "improvement"
NO_CHANGE = "no measurable change"
NOT_COMPARABLE = "not comparable"
_BY_VERDICT = {stats.SLOWER: REGRESSION, stats.FASTER: IMPROVEMENT, stats.NO_DIFFERENCE: NO_CHANGE}


def load(path: str | Path) -> dict:
    """Read an earlier ``results.json`` (a directory holding one is accepted too)."""
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    with open(path) as f:
        return json.load(f)


def compare(new: dict, old: dict) -> dict:
    """Row-by-row comparison of two results.

    ``status`` is ``"not comparable"`` (fingerprints differ), ``"regression"`` or ``"ok"``.
    """
    differences = fingerprint_differences(old["environment"], new["environment"])
    if old["environment"].get("fingerprint") != new["environment"].get("fingerprint"):
        return {
            "status": NOT_COMPARABLE,
            "differences": differences or ["fingerprint"],
            "rows": [],
            "regressions": 0,
        }
    limit = max(new["method"]["threshold"], old["method"]["threshold"])
    old_rows = {r["id"]: r for r in old["rows"] if r["kind"] == "compare"}
    rows = []
    for row in new["rows"]:
        if row["kind"] != "compare" or row["id"] not in old_rows:
            continue
        before = old_rows[row["id"]]
        entry = {
            "id": row["id"],
            "label": row["label"],
            "old": before.get("value"),
            "new": row.get("value"),
            "low": None,
            "high": None,
        }
        old_failed = before["verdict"].startswith("failed")
        new_failed = row["verdict"].startswith("failed")
        if new_failed or old_failed:
            entry["verdict"] = (
                REGRESSION
                if new_failed and not old_failed
                else (IMPROVEMENT if old_failed and not new_failed else "failed in both runs")
            )
        else:
            est = stats.change(row["samples"]["ratios"], before["samples"]["ratios"])
            entry.update({"value": est.median, "low": est.low, "high": est.high})
            entry["verdict"] = _BY_VERDICT.get(stats.verdict(est, limit), stats.verdict(est, limit))
        rows.append(entry)
    regressions = sum(1 for r in rows if r["verdict"] == REGRESSION)
    return {
        "status": REGRESSION if regressions else "ok",
        "threshold": limit,
        "rows": rows,
        "regressions": regressions,
        "differences": differences,
        "compared_rows": len(rows),
    }
