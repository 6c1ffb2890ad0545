"""``--baseline`` logic and report rendering on synthetic results (no processes started)."""

from __future__ import annotations

import json

import numpy as np

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
