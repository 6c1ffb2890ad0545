"""``--baseline`` logic and report rendering on synthetic results (no processes started)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from taifuse.bench import baseline, report, stats


def _result(speedup: float, *, fingerprint: str = "abc", verdict: str = stats.FASTER, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    ratios = [list(speedup * np.exp(rng.normal(0.0, 0.02, 10))) for _ in range(3)]
    est = stats.estimate(ratios)
    row = {
        "id": "s/c/numpy",
        "kind": "compare",
        "suite": "s",
        "case": "c",
        "label": "c: taifuse vs numpy",
        "unit": "x speedup",
        "value": est.median,
        "low": est.low,
        "high": est.high,
        "n_processes": 3,
        "n_samples": 30,
        "dispersion": est.dispersion,
        "verdict": verdict,
        "samples": {"ratios": ratios},
        "size": "(8,)",
        "bytes_moved": 64,
        "cache_level": "L1",
        "dtype": "float32",
        "shape": "(8,)",
        "seed": 0,
        "setup_code": "x = ...",
        "threads": {"numba": 2},
        "backend": "numba",
        "candidate": {"label": "taifuse", "code": "F.relu(x, out=out)"},
        "baseline": {"label": "numpy", "code": "np.maximum(x, 0, out=out)", "same_result": True, "note": ""},
        "check": {
            "ok": True,
            "rtol": 1e-6,
            "atol": 1e-6,
            "max_abs_err": 0.0,
            "max_rel_err": 0.0,
            "reason": "",
        },
        "candidate_ms": {"median": 1.0, "low": 0.9, "high": 1.1},
        "baseline_ms": {"median": speedup, "low": speedup, "high": speedup},
        "roofline": {"achieved": 1.0, "unit": "GB/s", "fraction": 0.1, "of": "copy bandwidth"},
        "loops": {"taifuse": [1, 1, 1], "numpy": [1, 1, 1]},
    }
    return {
        "command": "taifuse bench",
        "date": "today",
        "rows": [row],
        "errors": {},
        "plan": {"processes": 3, "blocks": 10, "min_sample_ns": 1_000_000},
        "method": {"threshold": 0.05, "min_effect": 0.05, "resamples": 4000, "unstable_dispersion": 0.25},
        "environment": {"fingerprint": fingerprint, "cpu_model": fingerprint, "backend": "numba"},
    }


def test_same_numbers_are_no_regression():
    cmp = baseline.compare(_result(2.0, seed=1), _result(2.0, seed=2))
    assert cmp["status"] == "ok" and cmp["regressions"] == 0 and cmp["compared_rows"] == 1
    assert cmp["rows"][0]["verdict"] == baseline.NO_CHANGE


def test_halved_speedup_is_a_regression_and_doubled_an_improvement():
    assert baseline.compare(_result(1.0), _result(2.0))["status"] == baseline.REGRESSION
    assert baseline.compare(_result(4.0), _result(2.0))["rows"][0]["verdict"] == baseline.IMPROVEMENT


def test_newly_failed_row_is_a_regression():
    new = _result(2.0)
    new["rows"][0]["verdict"] = stats.FAILED
    assert baseline.compare(new, _result(2.0))["regressions"] == 1


def test_different_fingerprint_is_not_comparable():
    cmp = baseline.compare(_result(2.0, fingerprint="new"), _result(2.0, fingerprint="old"))
    assert cmp["status"] == baseline.NOT_COMPARABLE
    assert any("cpu_model" in d for d in cmp["differences"])


def test_markdown_shows_value_interval_code_and_baseline_section(tmp_path):
    result = _result(2.0)
    result["baseline"] = baseline.compare(result, _result(2.0, seed=5))
    paths = report.write(result, tmp_path)
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "np.maximum(x, 0, out=out)" in text and "## Against the baseline run" in text
    assert f"{result['rows'][0]['value']:.3g}x" in text
    assert json.loads((tmp_path / "results.json").read_text())["rows"][0]["id"] == "s/c/numpy"
    assert {p.name for p in paths} >= {"BENCHMARKS.md", "results.json"}


# ------------------------------------------------- two runs of one commit (NOTE [ Comparing two runs ])

QUICK_PROCESSES, QUICK_PAIRS = 3, 8  # what `taifuse bench --quick` measures per row


def _simulated_run(
    speedups, rng, *, run_noise: float, process_noise: float, pair_noise: float = 0.05,
    processes: int = QUICK_PROCESSES, pairs: int = QUICK_PAIRS,
) -> dict:
    """One run's compare rows: each row's speedup moved by a run-level factor (shared by the row's
    processes, as the minutes a row ran in are), each process by its own factor, each pair by noise."""
    rows = []
    for k, speedup in enumerate(speedups):
        run_factor = np.exp(rng.normal(0.0, run_noise))
        ratios = [
            list(speedup * run_factor * np.exp(rng.normal(0.0, process_noise)) * np.exp(rng.normal(0.0, pair_noise, pairs)))
            for _ in range(processes)
        ]
        rows.append(
            {
                "id": f"s/c{k}/numpy",
                "kind": "compare",
                "label": f"c{k}: taifuse vs numpy",
                "value": float(np.median(np.concatenate(ratios))),
                "verdict": stats.FASTER,
                "samples": {"ratios": ratios},
            }
        )
    return {"environment": {"fingerprint": "f"}, "method": {"threshold": 0.05}, "rows": rows}


@pytest.mark.parametrize(("run_noise", "rows"), [(0.10, 8), (0.20, 8), (0.20, 1)])
def test_unchanged_commit_rarely_reads_as_a_regression(run_noise, rows):
    # 200 pairs of quick runs of one commit, with the noise seen between runs (10-20% per row and
    # run) and between processes (10%). The old rule (a bootstrap of each run's 3 processes) called
    # 12-30% of these rows a regression; this one must stay near its nominal one-sided 2.5%.
    # One row alone leaves the run-to-run spread to the floor.
    rng = np.random.default_rng(20261124 + rows + int(100 * run_noise))
    verdicts = []
    for _ in range(200):
        speedups = np.exp(rng.normal(1.0, 0.8, rows))
        old = _simulated_run(speedups, rng, run_noise=run_noise, process_noise=0.10)
        new = _simulated_run(speedups, rng, run_noise=run_noise, process_noise=0.10)
        verdicts += [r["verdict"] for r in baseline.compare(new, old)["rows"]]
    assert len(verdicts) == 200 * rows
    assert verdicts.count(baseline.REGRESSION) / len(verdicts) <= 0.05
    assert set(verdicts) <= {baseline.NO_CHANGE, baseline.INCONCLUSIVE, baseline.IMPROVEMENT, baseline.REGRESSION}


def test_true_2x_slowdown_is_still_a_regression():
    # Moderate noise (5% per process and per run): one row's speedup halves, seven stay.
    rng = np.random.default_rng(7)
    called = 0
    for _ in range(50):
        speedups = np.exp(rng.normal(1.0, 0.8, 8))
        old = _simulated_run(speedups, rng, run_noise=0.05, process_noise=0.05)
        new = _simulated_run(speedups * np.r_[0.5, np.ones(7)], rng, run_noise=0.05, process_noise=0.05)
        cmp = baseline.compare(new, old)
        called += cmp["rows"][0]["verdict"] == baseline.REGRESSION
        assert cmp["rows"][0]["high"] < 1.0
        assert all(r["verdict"] != baseline.REGRESSION for r in cmp["rows"][1:])
    assert called >= 45


def test_slowdown_of_every_row_is_a_regression_not_noise():
    # The run-to-run spread is taken about the rows' median change: a shift of all rows is a change.
    rng = np.random.default_rng(8)
    speedups = np.exp(rng.normal(1.0, 0.8, 12))
    old = _simulated_run(speedups, rng, run_noise=0.05, process_noise=0.05)
    new = _simulated_run(speedups / 2, rng, run_noise=0.05, process_noise=0.05)
    cmp = baseline.compare(new, old)
    assert cmp["status"] == baseline.REGRESSION and cmp["regressions"] == 12


def _silu(medians: tuple[float, float, float], seed: int) -> list[list[float]]:
    rng = np.random.default_rng(seed)
    return [list(m * np.exp(rng.normal(0.0, 0.05, QUICK_PAIRS))) for m in medians]


def test_the_silu_false_alarm_is_not_a_regression():
    # An unchanged commit's second quick run: silu 8.7x -> 5.45x. Rebuilt from 3 processes per run.
    old, new = _silu((8.55, 9.54, 11.39), 1), _silu((6.36, 5.04, 6.04), 2)
    # What the old rule saw: a percentile bootstrap over 3 processes, change ~0.63x [~0.48, ~0.72].
    tail = 100 * (1 - stats.CONFIDENCE) / 2
    boot = stats.bootstrap_distribution(new, seed=0) / stats.bootstrap_distribution(old, seed=1)
    low, high = np.percentile(boot, [tail, 100 - tail])
    assert 0.45 < low < 0.5 and 0.7 < high < 0.75
    alone = baseline.compare(_one_row_result(new), _one_row_result(old))
    assert alone["rows"][0]["verdict"] in (baseline.INCONCLUSIVE, baseline.NO_CHANGE)
    assert alone["rows"][0]["low"] < 0.627 < alone["rows"][0]["high"]
    assert alone["status"] == "ok"
    # Among quiet rows (5% between runs) the floor still holds: silu is not called a regression.
    rng = np.random.default_rng(3)
    speedups = np.exp(rng.normal(1.0, 0.8, 7))
    old_run = _simulated_run(speedups, rng, run_noise=0.05, process_noise=0.05)
    new_run = _simulated_run(speedups, rng, run_noise=0.05, process_noise=0.05)
    old_run["rows"].append(_one_row_result(old)["rows"][0])
    new_run["rows"].append(_one_row_result(new)["rows"][0])
    cmp = baseline.compare(new_run, old_run)
    assert cmp["status"] == "ok" and cmp["run_to_run"] == pytest.approx(stats.RUN_TO_RUN_FLOOR)


def _one_row_result(ratios: list[list[float]]) -> dict:
    return {
        "environment": {"fingerprint": "f"},
        "method": {"threshold": 0.05},
        "rows": [
            {
                "id": "elementwise/silu/numpy",
                "kind": "compare",
                "label": "silu: taifuse vs numpy",
                "value": float(np.median(np.concatenate(ratios))),
                "verdict": stats.FASTER,
                "samples": {"ratios": ratios},
            }
        ],
    }


def test_spread_of_many_rows_widens_every_interval_and_controls_count():
    # Rows that all wander by ~30% between runs: the spread, not the floor, sets the width,
    # and the A/A control rows (not reported) count among them.
    rng = np.random.default_rng(11)
    speedups = np.exp(rng.normal(1.0, 0.8, 10))
    old = _simulated_run(speedups, rng, run_noise=0.3, process_noise=0.05)
    new = _simulated_run(speedups, rng, run_noise=0.3, process_noise=0.05)
    for run in (old, new):
        for row in run["rows"][:4]:
            row["kind"], row["id"] = "control", row["id"] + "/control"
    cmp = baseline.compare(new, old)
    assert cmp["compared_rows"] == 6 and cmp["run_to_run"] > 0.25


def test_only_the_rows_verdict_words_are_used():
    cmp = baseline.compare(_result(2.0, seed=1), _result(2.0, seed=2))
    assert set(cmp) >= {"status", "threshold", "run_to_run", "rows", "regressions", "inconclusive", "compared_rows"}
    assert cmp["threshold"] >= stats.MIN_RUN_EFFECT


# ------------------------------------------------------------------ a baseline file checked up front


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (None, "no such file"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "not a taifuse bench result"),
        ('{"rows": [], "method": {"threshold": 0.05}}', "no 'environment' key"),
        ('{"rows": [], "environment": {}, "method": {}}', "'threshold'"),
        (
            '{"rows": [{"id": "a", "kind": "compare", "verdict": "faster"}], "environment": {}, "method": {"threshold": 0.05}}',
            "samples.ratios",
        ),
    ],
)
def test_bad_baseline_file_is_a_baseline_error(tmp_path, content, reason):
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(baseline.BaselineError, match=reason):
        baseline.load(path)


def test_a_written_result_loads_back(tmp_path):
    result = _result(2.0)
    report.write(result, tmp_path)
    assert baseline.load(tmp_path)["rows"][0]["id"] == "s/c/numpy"
