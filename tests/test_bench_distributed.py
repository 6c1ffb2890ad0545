"""The distributed benchmark suite (issue 30): its jobs, the rows it builds from the ranks' results
(checked against figures computed by hand from synthetic timings), the launcher's error without
mpiexec, the MPI line of the environment, and one tiny real run of each job under mpiexec."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from taifuse.bench import env, report
from taifuse.bench.suites import distributed, load_cases, suite_names
from taifuse.bench.suites.transformer import GPTSettings

TINY = GPTSettings(
    config={"vocab_size": 11, "block_size": 8, "n_layer": 1, "n_head": 2, "n_embd": 8},
    batch=4,
    lr=1e-3,
    weight_decay=0.1,
    grad_clip=1.0,
    source="a tiny test config",
)
needs_mpi = pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None or not (Path(sys.executable).parent / "mpiexec").is_file(),
    reason="needs mpi4py and the mpiexec of the distributed extra",
)


def _case(**kw) -> distributed.DistributedCase:
    return distributed.DistributedCase(TINY, steps=(1, 4), blocks=2, **kw)


@needs_mpi
def test_registered_with_the_example_settings():
    assert "distributed" in suite_names()
    (case,) = load_cases(["distributed"], quick=True)
    assert case.settings.batch == 32 and case.settings.config["block_size"] == 64  # train_gpt.py's
    assert case.steps == distributed.QUICK_STEPS
    assert load_cases(["distributed"])[0].steps == distributed.FULL_STEPS


def test_jobs_alternate_one_process_and_two_ranks():
    jobs = _case().jobs(3)
    assert [(j["process"], j["mode"]) for j in jobs] == [
        (0, "single"),
        (0, "ddp"),
        (1, "ddp"),
        (1, "single"),
        (2, "single"),
        (2, "ddp"),
    ]
    assert all(j["steps"] == [1, 4] and j["settings"]["batch"] == 4 for j in jobs)


def _synthetic(process: int) -> list[dict]:
    """One process index's results, times in ns: the one process steps its whole batch in 100 ms
    (CPU 90 ms) and half in 55 ms (CPU 50 ms); the two ranks step DDP in 62.5 ms (CPU 52), no_sync
    in 60 ms (CPU 50) and the whole batch per rank in 110 ms; wait 2 ms; all-reduce 1 ms, copy 0.25 ms."""
    ranks = [{"threads": {"blas": 1, "numba": 1}, "cpus": [0, 1], "pid": 1}]
    single = {
        "mode": "single",
        "process": process,
        "whole_ns": [100e6] * 4,
        "half_ns": [55e6] * 4,
        "whole_cpu_ns": [90e6] * 4,
        "half_cpu_ns": [50e6] * 4,
        "ranks": ranks,
        "backend": "numba",
    }
    ddp = {
        "mode": "ddp",
        "process": process,
        "ddp_ns": [62.5e6] * 4,
        "nosync_ns": [60e6] * 4,
        "ddp_whole_ns": [110e6] * 4,
        "ddp_cpu_ns": [52e6] * 4,
        "nosync_cpu_ns": [50e6] * 4,
        "wait_ns": [2e6] * 4,
        "nosync_wait_ns": [0.01e6] * 4,
        "reduce_ns": [1e6] * 2,
        "copy_ns": [0.25e6] * 2,
        "flat_sizes": [1000, 250],
        "mpi": {"mpi4py": "4", "library": "MPICH Version: 5", "standard": "5.0"},
        "ranks": ranks * 2,
        "backend": "numba",
    }
    return [single, ddp]


def test_rows_from_the_ranks_results():
    case = _case()
    rows = {r["id"].rsplit("/", 1)[1]: r for r in case.rows(_synthetic(0) + _synthetic(1))}
    tokens = TINY.batch * TINY.config["block_size"]
    expected = {
        "tokens-1": tokens / 0.1,
        "tokens-2": tokens / 0.0625,
        "scaling": 100 / 62.5,
        "batch-efficiency": 100 / 110,
        "contention": 55 / 60,
        "communication": 60 / 62.5,
        "scaling-whole": 200 / 110,
        "scaling-cpu": 90 / 52,
        "batch-efficiency-cpu": 90 / 100,
        "contention-cpu": 50 / 50,
        "communication-cpu": 50 / 52,
        "wait": 2.0,
        "exposed": 2.0,
        "all-reduce": 5000 / 1e6,  # GB/s: bytes per ns
        "copy": 5000 / 0.25e6,
        "all-reduce-vs-copy": 0.25,
    }
    assert set(rows) == set(expected)
    for key, value in expected.items():
        assert rows[key]["value"] == pytest.approx(value, rel=1e-12), key
        assert rows[key]["n_processes"] == 2
    # The factors of NOTE [ Where the scaling goes ] multiply back to the scaling.
    factors = rows["batch-efficiency"]["value"] * rows["contention"]["value"] * rows["communication"]["value"]
    assert 2 * factors == pytest.approx(rows["scaling"]["value"], rel=1e-12)
    assert rows["scaling"]["verdict"] == "goal (at least 1.8x) not met"
    assert rows["tokens-1"]["threads"] == {"blas": 1, "numba": 1}  # the ranks', not the launcher's
    assert rows["tokens-1"]["backend"] == "numba"


def test_rows_say_why_nothing_was_measured():
    rows = _case().rows([], "the ranks exited 1: boom")
    assert rows and all(
        r["value"] is None and r["verdict"] == "failed: the ranks exited 1: boom" for r in rows
    )
    partial = _case().rows(_synthetic(0)[:1], "the ranks exited 1: boom")
    by_key = {r["id"].rsplit("/", 1)[1]: r for r in partial}
    assert by_key["tokens-1"]["value"] == pytest.approx(TINY.batch * TINY.config["block_size"] / 0.1)
    assert "only 1 process(es) finished" in by_key["tokens-1"]["note"]
    assert by_key["scaling"]["value"] is None


def test_launcher_names_the_extra_without_mpiexec(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    if importlib.util.find_spec("mpi4py") is None:
        match = "pip install 'taifuse\\[distributed\\]'"
    else:
        match = f"mpiexec next to {tmp_path / 'python'}.*pip install 'taifuse\\[distributed\\]'"
    with pytest.raises(RuntimeError, match=match):
        distributed.launcher()
    (case,) = distributed.cases(quick=True)
    assert "pip install 'taifuse[distributed]'" in case.rows([])[0]["verdict"]


def test_the_environment_names_mpi():
    block = env.mpi_environment("MPICH Version: 5.0.2")
    if importlib.util.find_spec("mpi4py") is None:
        assert block is None
        return
    assert block["mpi4py"] and block["library"] == "MPICH Version: 5.0.2"
    ((key, value),) = report._mpi_rows({"mpi": block})
    assert key == "MPI" and f"mpi4py {block['mpi4py']}" in value and "MPICH Version: 5.0.2" in value
    assert report._mpi_rows({}) == []


@needs_mpi
def test_a_tiny_run_of_both_jobs(monkeypatch):
    """Each job really launched: one process without MPI, two ranks under mpiexec, one thread each."""
    monkeypatch.setenv("TAIFUSE_BACKEND", "numba")  # the ranks inherit it
    case = _case()
    runs = [case.run_job({**job, "kind": "custom"}) for job in case.jobs(1)]
    single, ddp = runs
    assert single["rank_count"] == 1 and len(single["whole_ns"]) == len(single["half_ns"]) == 4
    assert single["threads"] == single["ranks"][0]["threads"]  # the environment block reads these
    assert ddp["rank_count"] == 2 and ddp["world"] == 2 and len(ddp["ranks"]) == 2
    assert len(ddp["ddp_ns"]) == len(ddp["nosync_ns"]) == len(ddp["wait_ns"]) == 4
    assert all(0 <= w < t for w, t in zip(ddp["wait_ns"], ddp["ddp_ns"]))
    assert len(ddp["reduce_ns"]) == len(ddp["copy_ns"]) == 2
    n_params = case.n_params
    assert sum(ddp["flat_sizes"]) == n_params  # the optimizer's two groups hold every parameter
    assert ddp["mpi"]["library"]
    for rank in single["ranks"] + ddp["ranks"]:
        assert rank["threads"]["blas"] == 1 and rank["threads"]["numba"] == 1
    rows = case.rows(runs)
    assert all(r["value"] is not None and np.isfinite(r["value"]) and r["value"] > 0 for r in rows)


def _goal_script():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_distributed.py"
    spec = importlib.util.spec_from_file_location("bench_distributed", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("low", "high", "status"), [(1.81, 1.9, "met"), (1.5, 1.79, "not met"), (1.7, 1.85, "undecided")]
)
def test_goal_is_judged_on_the_scaling_rows_interval(low, high, status):
    script = _goal_script()
    rows = [
        {
            "suite": "distributed",
            "id": f"distributed/gpt ddp(...)/{key}",
            "value": 1.0,
            "low": 0.9,
            "high": 1.1,
        }
        for key in ("batch-efficiency", "contention")
    ]
    rows.append(
        {
            "suite": "distributed",
            "id": "distributed/gpt ddp(...)/scaling",
            "value": (low + high) / 2,
            "low": low,
            "high": high,
        }
    )
    goal = script.goal({"rows": rows})
    assert goal["status"] == status and goal["low"] == low
    assert "batch-efficiency 1 [0.9, 1.1]" in goal["detail"]
    assert script.goal({"rows": []})["status"] == "not met"
