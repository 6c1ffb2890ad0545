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
# One suite's small cases (--case: its past-the-cache cases, 150M elements on a 300 MiB L3, took 151
# of a run's 189 s), two processes per case, five ABBA blocks: both runs stay well under a minute
# each on 2 cores.
SMALL_CASES = ("elementwise/gelu(approximate='tanh')", "elementwise/silu", "elementwise/add_relu", "elementwise/affine")
SMALL_RUN = (
    "--quick", "--suite", "elementwise", *(a for c in SMALL_CASES for a in ("--case", c)),
    "--processes", "2", "--blocks", "5", "--no-progress",
)  # fmt: skip
ALLOWED = set(stats.VERDICTS) | {"not a comparison"}


# NOTE: one thread per library. This test checks the machinery (files, rows, the --baseline path
# on unchanged code), not speed; on a shared 2-core machine a 2-thread parallel region waits for
# whichever thread was descheduled, which makes run-to-run ratios swing far more than one thread.
SINGLE_THREAD = {"NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def _bench(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "taifuse.cli", "bench", *SMALL_RUN, *args]
    env = {**os.environ, **SINGLE_THREAD}
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600, env=env)


def test_quick_run_writes_json_and_markdown_and_a_rerun_finds_no_regression(tmp_path):
    """One test, not three over a shared fixture: under pytest-xdist each worker that ran one of
    them ran its own minute-long bench (xdist_group is ignored under pytest 9.2: xdist 3.8 renames
    ``item._nodeid``, which pytest 9.2 no longer reads)."""
    out = tmp_path / "bench"
    done = _bench("--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    _check_json(out)
    _check_markdown(out, done)
    _check_rerun(out)


def _check_json(out) -> None:
    result = json.loads((out / "results.json").read_text())
    rows = result["rows"]
    assert {r["kind"] for r in rows} >= {"roofline", "first_call", "control", "compare"}
    assert {f"{r['suite']}/{r['case']}" for r in rows if r["kind"] == "compare"} == set(SMALL_CASES)
    for row in rows:
        for key in ROW_KEYS:
            assert row.get(key) is not None, (row["id"], key)
        assert math.isfinite(row["value"]) and row["low"] <= row["value"] <= row["high"], row["id"]
        assert row["n_processes"] == 2 and row["n_samples"] >= row["n_processes"]
        assert row["verdict"] in ALLOWED, row["verdict"]
    for row in rows:
        if row["kind"] == "compare":
            assert row["baseline"]["code"] and row["seed"] is not None
            assert row["dtype"] in ("float32", "float16")  # float16: the float16-storage rows
            assert row["threads"] and row["roofline"]["fraction"] > 0
            if row["baseline"]["same_result"]:
                assert row["check"]["ok"]
    env = result["environment"]
    for key in ENV_KEYS:
        assert key in env, key
    assert result["method"]["threshold"] >= stats.MIN_EFFECT


def _check_markdown(out, done) -> None:
    text = (out / "BENCHMARKS.md").read_text()
    result = json.loads((out / "results.json").read_text())
    for row in result["rows"]:
        assert row["label"].replace("|", "\\|") in text
    for heading in ("## Roofline", "## Suite: elementwise", "## Method", "## Environment"):
        assert heading in text
    assert "verified" not in text.lower()
    assert "A/A control" in text
    assert "wrote" in done.stdout


def _check_rerun(out) -> None:
    again = out / "again"
    done = _bench("--out", str(again), "--baseline", str(out / "results.json"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    cmp = json.loads((again / "results.json").read_text())["baseline"]
    assert cmp["status"] == "ok", cmp
    assert cmp["regressions"] == 0 and cmp["compared_rows"] > 0
    assert "0 regression(s)" in done.stdout


# ------------------------------------------- bad --out / --baseline: refused before any measuring


@pytest.fixture
def no_measuring(monkeypatch):
    """Fail the test if ``taifuse bench`` reaches the measuring (which a bad argument must not)."""
    from taifuse.bench import harness

    def refuse(*args, **kwargs):
        raise AssertionError("measuring started before --out and --baseline were checked")

    monkeypatch.setattr(harness, "measure", refuse)
    monkeypatch.setattr(harness, "spawn", refuse)


def _refused(capsys, tmp_path, *args: str) -> str:
    from taifuse import cli

    code = cli.main(["bench", "--quick", "--suite", "elementwise", "--no-progress", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("taifuse bench: error: ") and "\n" not in err and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (None, "no such file"),
        ("{\"rows\": [", "not valid JSON"),
        ('{"environment": {"fingerprint": "x"}, "rows": []}', "no 'method' key"),
    ],
    ids=["missing", "corrupt", "lacking-keys"],
)
def test_bad_baseline_is_refused_before_measuring(no_measuring, capsys, tmp_path, content, reason):
    path = tmp_path / "old.json"
    if content is not None:
        path.write_text(content)
    out = tmp_path / "out"
    err = _refused(capsys, tmp_path, "--out", str(out), "--baseline", str(path))
    assert "--baseline" in err and str(path) in err and reason in err
    assert not out.exists()


@pytest.mark.parametrize("under", [False, True], ids=["is-a-file", "under-a-file"])
def test_out_that_cannot_be_a_directory_is_refused_before_measuring(no_measuring, capsys, tmp_path, under):
    a_file = tmp_path / "results"
    a_file.write_text("not a directory")
    out = a_file / "sub" if under else a_file
    err = _refused(capsys, tmp_path, "--out", str(out))
    assert "--out" in err and "not a directory" in err


def test_a_case_pattern_that_matches_nothing_is_refused_before_measuring(no_measuring, capsys, tmp_path):
    out = tmp_path / "out"
    err = _refused(capsys, tmp_path, "--out", str(out), "--case", "elementwise/silu", "--case", "elementwise/nope*")
    assert "--case 'elementwise/nope*' matches no case" in err and "elementwise/silu" in err


def test_case_patterns_select_by_shell_pattern_in_suite_order():
    import taifuse.bench
    from taifuse.bench.suites import load_cases
    from taifuse.bench.suites.elementwise import dram_elements

    cases = load_cases(["elementwise"], quick=True, compare_torch=False)
    # The past-the-cache cases' size follows the machine's last-level cache (150M elements on a
    # 300 MiB L3, 16M on a 32 MiB one).
    big = f"{dram_elements() // 2**20}M elements"
    ids = [c.id for c in taifuse.bench.select_cases(cases, [f"*{big}", "elementwise/silu"])]
    assert ids == [c.id for c in cases if c.id.endswith(big) or c.id == "elementwise/silu"]
    assert "elementwise/silu" in ids and len(ids) == 1 + sum(c.id.endswith(big) for c in cases) > 2
    exact = taifuse.bench.select_cases(cases, ["elementwise/gelu(approximate='tanh')"])
    assert [c.id for c in exact] == ["elementwise/gelu(approximate='tanh')"]  # not its big twin


def _fake_measuring(monkeypatch):
    from taifuse.bench import harness

    # No cases: the run's rows and method come from the real build_rows over nothing measured.
    monkeypatch.setattr(harness, "measure", lambda *a, **k: {"cases": {}, "roofline": [], "errors": {}})


def test_results_are_written_before_they_are_compared(monkeypatch, tmp_path):
    import taifuse.bench
    from taifuse.bench import baseline

    _fake_measuring(monkeypatch)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"environment": {}, "method": {"threshold": 0.05}, "rows": []}))

    def broken(new, earlier):
        raise RuntimeError("comparison failed")

    monkeypatch.setattr(baseline, "compare", broken)
    with pytest.raises(RuntimeError, match="comparison failed"):
        taifuse.bench.run(cases=[], out=tmp_path / "out", baseline=old, progress=False)
    assert json.loads((tmp_path / "out" / "results.json").read_text())["rows"] == []


def _cli_with_comparison(monkeypatch, tmp_path, capsys, verdicts: list[str]) -> int:
    import taifuse.bench
    from taifuse import cli

    rows = [{"id": f"r{i}", "label": f"r{i}", "verdict": v} for i, v in enumerate(verdicts)]
    cmp = {
        "status": "regression" if "regression" in verdicts else "ok",
        "threshold": 0.1,
        "run_to_run": 0.15,
        "rows": rows,
        "regressions": verdicts.count("regression"),
        "inconclusive": verdicts.count("inconclusive"),
        "compared_rows": len(rows),
        "differences": [],
    }
    monkeypatch.setattr(taifuse.bench, "run", lambda *a, **k: {"rows": [], "errors": {}, "baseline": cmp})
    code = cli.main(["bench", "--quick", "--no-progress", "--out", str(tmp_path / "out")])
    capsys.readouterr()
    return code


def test_only_a_regression_fails_the_run(monkeypatch, tmp_path, capsys):
    assert _cli_with_comparison(monkeypatch, tmp_path, capsys, ["inconclusive", "no measurable change"]) == 0
    assert _cli_with_comparison(monkeypatch, tmp_path, capsys, ["improvement", "unstable"]) == 0
    assert _cli_with_comparison(monkeypatch, tmp_path, capsys, ["inconclusive", "regression"]) == 1
