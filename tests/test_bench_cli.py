"""``taifuse bench --quick`` end to end in a subprocess: valid JSON and Markdown, then a --baseline rerun.

Kept small (see SMALL_RUN) so the test stays within a couple of minutes on a 2-core machine.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from taifuse.bench import stats

ROW_KEYS = ("value", "low", "high", "n_processes", "n_samples", "size", "verdict", "cache_level")
ENV_KEYS = (
    "cpu_model",
    "logical_cpus",
    "caches",
    "memory_bytes",
    "os",
    "kernel",
    "python",
    "numpy",
    "blas",
    "numba",
    "taichi",
    "torch",
    "threads",
    "taichi_arch",
    "git_commit",
    "git_dirty",
    "timer",
    "fingerprint",
    "load_average",
)
# One suite, two processes per case, five ABBA blocks: both runs stay near a minute each on 2 cores.
SMALL_RUN = ("--quick", "--suite", "elementwise", "--processes", "2", "--blocks", "5", "--no-progress")
ALLOWED = set(stats.VERDICTS) | {"not a comparison"}


# NOTE: one thread per library. This test checks the machinery (files, rows, the --baseline path
# on unchanged code), not speed; on a shared 2-core machine a 2-thread parallel region waits for
# whichever thread was descheduled, which makes run-to-run ratios swing far more than one thread.
SINGLE_THREAD = {"NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def _bench(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "taifuse.cli", "bench", *SMALL_RUN, *args]
    env = {**os.environ, **SINGLE_THREAD}
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    done = _bench("--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    return out, done


def test_quick_run_writes_valid_json_with_complete_rows(first_run):
    out, _ = first_run
    result = json.loads((out / "results.json").read_text())
    rows = result["rows"]
    assert {r["kind"] for r in rows} >= {"roofline", "first_call", "control", "compare"}
    for row in rows:
        for key in ROW_KEYS:
            assert row.get(key) is not None, (row["id"], key)
        assert math.isfinite(row["value"]) and row["low"] <= row["value"] <= row["high"], row["id"]
        assert row["n_processes"] == 2 and row["n_samples"] >= row["n_processes"]
        assert row["verdict"] in ALLOWED, row["verdict"]
    for row in rows:
        if row["kind"] == "compare":
            assert row["baseline"]["code"] and row["dtype"] == "float32" and row["seed"] is not None
            assert row["threads"] and row["roofline"]["fraction"] > 0
            if row["baseline"]["same_result"]:
                assert row["check"]["ok"]
    env = result["environment"]
    for key in ENV_KEYS:
        assert key in env, key
    assert result["method"]["threshold"] >= stats.MIN_EFFECT


def test_quick_run_writes_markdown_with_every_row_and_the_environment(first_run):
    out, done = first_run
    text = (out / "BENCHMARKS.md").read_text()
    result = json.loads((out / "results.json").read_text())
    for row in result["rows"]:
        assert row["label"].replace("|", "\\|") in text
    for heading in ("## Roofline", "## Suite: elementwise", "## Method", "## Environment"):
        assert heading in text
    assert "verified" not in text.lower()
    assert "A/A control" in text
    assert "wrote" in done.stdout


def test_rerun_against_baseline_reports_no_regression(first_run):
    out, _ = first_run
    again = out / "again"
    done = _bench("--out", str(again), "--baseline", str(out / "results.json"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    cmp = json.loads((again / "results.json").read_text())["baseline"]
    assert cmp["status"] == "ok", cmp
    assert cmp["regressions"] == 0 and cmp["compared_rows"] > 0
    assert "0 regression(s)" in done.stdout
