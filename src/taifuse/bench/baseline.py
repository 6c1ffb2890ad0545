"""``--baseline``: compare a run with an earlier ``results.json``, row by row.

For each comparison row present in both runs, the change is the ratio of the two speedups
(new / old), taken over per-process medians. Its 95% interval is Student's t over those medians,
widened by a run-to-run spread, because two runs of one commit differ by more than either run's
processes show: the larger of RUN_TO_RUN_FLOOR and the robust spread of all compared rows' changes
(NOTE [ Comparing two runs ] in stats.py). A row is a "regression" only when that whole interval
lies below ``1 / (1 + effect)``, the effect being the larger of ``stats.MIN_RUN_EFFECT`` and the two
runs' own thresholds; "improvement" mirrors it; "no measurable change" when the interval holds 1
or lies within the effect's bounds; "inconclusive" when the row moved but not provably by the
effect. A row that passed its correctness check before and fails it now is a regression too.
Only regressions fail the run (``taifuse bench`` exits 1). First-call and roofline rows are not
compared: they measure the machine and the cache state more than the code.

:func:`load` checks a baseline file before anything is measured, so a bad ``--baseline`` fails at
once with :class:`BaselineError` instead of after minutes of measuring.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from taifuse.bench import stats
from taifuse.bench.env import fingerprint_differences

REGRESSION = "regression"
IMPROVEMENT = "improvement"
NO_CHANGE = "no measurable change"
INCONCLUSIVE = stats.INCONCLUSIVE
NOT_COMPARABLE = "not comparable"
_BY_VERDICT = {
    stats.SLOWER: REGRESSION,
    stats.FASTER: IMPROVEMENT,
    stats.NO_DIFFERENCE: NO_CHANGE,
    stats.INCONCLUSIVE: INCONCLUSIVE,
}
_TIMED_KINDS = ("compare", "control")  # rows with speedup samples; controls only inform the spread


class BaselineError(ValueError):
    """A ``--baseline`` that cannot be compared with: missing, unreadable, not JSON, or lacking keys."""


def load(path: str | Path) -> dict:
    """Read and check an earlier ``results.json`` (a directory holding one is accepted too).

    Raises :class:`BaselineError` with a one-line reason when the file is missing, unreadable,
    not JSON, or lacks what :func:`compare` needs (see :func:`check`).
    """
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise BaselineError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BaselineError(f"{path}: cannot read it ({e})") from None
    try:
        result = json.loads(text)
    except json.JSONDecodeError as e:
        raise BaselineError(f"{path}: not valid JSON ({e})") from None
    try:
        check(result)
    except BaselineError as e:
        raise BaselineError(f"{path}: {e}") from None
    return result


def check(result: object) -> None:
    """Raise :class:`BaselineError` unless ``result`` holds every key :func:`compare` reads."""
    if not isinstance(result, dict):
        raise BaselineError(f"not a taifuse bench result (a JSON {type(result).__name__}, not an object)")
    for key in ("environment", "method", "rows"):
        if key not in result:
            raise BaselineError(f"not a taifuse bench result: no {key!r} key")
    if not isinstance(result["environment"], dict):
        raise BaselineError("'environment' should be an object")
    threshold = result["method"].get("threshold") if isinstance(result["method"], dict) else None
    if not isinstance(threshold, (int, float)) or not math.isfinite(threshold) or threshold < 0:
        raise BaselineError("'method' should hold a non-negative number 'threshold'")
    if not isinstance(result["rows"], list):
        raise BaselineError("'rows' should be a list")
    for i, row in enumerate(result["rows"]):
        if not isinstance(row, dict) or "id" not in row or "kind" not in row:
            raise BaselineError(f"row {i} lacks 'id' or 'kind'")
        if row["kind"] not in _TIMED_KINDS:
            continue
        if not isinstance(row.get("verdict"), str):
            raise BaselineError(f"row {row['id']!r} lacks 'verdict'")
        if _failed(row):
            continue
        ratios = row.get("samples", {}).get("ratios") if isinstance(row.get("samples"), dict) else None
        if not _positive_groups(ratios):
            raise BaselineError(
                f"row {row['id']!r} lacks 'samples.ratios' (a list of per-process lists of positive numbers)"
            )


def _positive_groups(groups: object) -> bool:
    if not isinstance(groups, list) or not groups:
        return False
    for g in groups:
        if not isinstance(g, list) or not g:
            return False
        for x in g:
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not (math.isfinite(x) and x > 0):
                return False
    return True


def _failed(row: dict) -> bool:
    return row["verdict"].startswith("failed")


def compare(new: dict, old: dict) -> dict:
    """Row-by-row comparison of two results (NOTE [ Comparing two runs ] in stats.py).

    Returns ``status`` (``"not comparable"`` when the fingerprints differ, ``"regression"`` or
    ``"ok"``), ``threshold`` (the minimum effect), ``run_to_run`` (the log spread added to every
    interval), ``rows`` (``id``, ``label``, ``old``, ``new``, ``value``, ``low``, ``high``, ``verdict``),
    ``regressions``, ``inconclusive``, ``compared_rows`` and ``differences``.
    """
    differences = fingerprint_differences(old["environment"], new["environment"])
    if old["environment"].get("fingerprint") != new["environment"].get("fingerprint"):
        return {
            "status": NOT_COMPARABLE,
            "differences": differences or ["fingerprint"],
            "rows": [],
            "regressions": 0,
        }
    effect = max(stats.MIN_RUN_EFFECT, new["method"]["threshold"], old["method"]["threshold"])
    old_rows = {r["id"]: r for r in old["rows"] if r["kind"] in _TIMED_KINDS}
    pairs = [
        (row, old_rows[row["id"]])
        for row in new["rows"]
        if row["kind"] in _TIMED_KINDS and row["id"] in old_rows and old_rows[row["id"]]["kind"] == row["kind"]
    ]
    # Every row timed in both runs, A/A controls included, says how far rows move between runs.
    changes: dict[str, stats.RunChange | None] = {}
    for row, before in pairs:
        if _failed(row) or _failed(before):
            continue
        try:
            changes[row["id"]] = stats.run_change(row["samples"]["ratios"], before["samples"]["ratios"])
        except ValueError:  # fewer than three processes in all: no interval to give
            changes[row["id"]] = None
    tau = stats.run_to_run([c for c in changes.values() if c is not None])
    rows = []
    for row, before in pairs:
        if row["kind"] != "compare":
            continue
        entry = {
            "id": row["id"],
            "label": row["label"],
            "old": before.get("value"),
            "new": row.get("value"),
            "low": None,
            "high": None,
        }
        if _failed(row) or _failed(before):
            entry["verdict"] = (
                REGRESSION
                if _failed(row) and not _failed(before)
                else (IMPROVEMENT if _failed(before) and not _failed(row) else "failed in both runs")
            )
        elif changes[row["id"]] is None:
            entry["verdict"] = INCONCLUSIVE
        else:
            est = stats.change_estimate(changes[row["id"]], tau)
            entry.update({"value": est.median, "low": est.low, "high": est.high})
            judged = stats.change_verdict(est, effect)
            entry["verdict"] = _BY_VERDICT.get(judged, judged)
        rows.append(entry)
    regressions = sum(1 for r in rows if r["verdict"] == REGRESSION)
    return {
        "status": REGRESSION if regressions else "ok",
        "threshold": effect,
        "run_to_run": tau,
        "rows": rows,
        "regressions": regressions,
        "inconclusive": sum(1 for r in rows if r["verdict"] == INCONCLUSIVE),
        "differences": differences,
        "compared_rows": len(rows),
    }
