"""The environment block's BLAS and cache facts, on fake threadpoolctl data and fake cache tables.

NOTE: no test here sets, unsets or changes an ``OPENBLAS_*`` variable (docs/benchmarks.md,
"BLAS"): the functions take the environment as an argument, and the probe's subprocess is faked.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from taifuse.bench import env

OPENBLAS = {
    "user_api": "blas",
    "internal_api": "openblas",
    "num_threads": 2,
    "prefix": "libscipy_openblas",
    "filepath": "/site-packages/numpy.libs/libscipy_openblas64_-abc.so",
    "version": "0.3.31",
    "threading_layer": "pthreads",
    "architecture": "Haswell",
}
MKL = {
    "user_api": "blas",
    "internal_api": "mkl",
    "num_threads": 8,
    "prefix": "libmkl_rt",
    "filepath": "/site-packages/torch/lib/libmkl_rt.so.2",
    "version": "2024.1",
    "threading_layer": "gnu",
}
OPENMP = {"user_api": "openmp", "internal_api": "openmp", "num_threads": 2, "filepath": "/x/libgomp.so.1"}


def _libraries(kernel: str = "Haswell") -> list[dict]:
    return env.blas_libraries([{**OPENBLAS, "architecture": kernel}])


def test_blas_libraries_come_from_threadpoolctl_with_kernel_and_threads():
    libraries = env.blas_libraries([OPENBLAS, OPENMP, MKL])
    assert [lib["library"] for lib in libraries] == ["openblas", "mkl"]  # OpenMP is not a BLAS
    assert libraries[0] == {
        "library": "openblas",
        "version": "0.3.31",
        "kernel": "Haswell",
        "threads": 2,
        "threading_layer": "pthreads",
        "file": "libscipy_openblas64_-abc.so",
    }
    assert libraries[1]["kernel"] is None  # threadpoolctl reports no architecture for MKL


def test_numpy_blas_is_the_one_numpy_was_built_with(monkeypatch):
    monkeypatch.setattr(env, "_blas_info", lambda: {"blas": {"name": "scipy-openblas"}})
    libraries = env.blas_libraries([MKL, OPENBLAS])  # torch's MKL loaded first
    assert env.numpy_blas(libraries)["library"] == "openblas"
    monkeypatch.setattr(env, "_threadpool_info", lambda: [MKL, OPENBLAS])
    assert env.blas_threads() == 2
    assert env.numpy_blas([]) is None


def test_without_threadpoolctl_the_blas_is_unknown_not_guessed(monkeypatch):
    monkeypatch.setattr(env, "_threadpool_info", lambda: None)
    assert env.blas_libraries() is None
    assert env.blas_threads() is None
    assert env.thread_settings()["blas"] is None
    collected = env.collect("numpy", {})
    assert "threadpoolctl is not installed" in collected["blas_libraries"]
    assert collected["blas_kernel"] is None and collected["blas_note"] is None


def test_blas_environment_keeps_only_openblas_variables():
    environ = {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "1048576", "OMP_NUM_THREADS": "2"}
    assert env.blas_environment(environ) == {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "1048576"}
    assert env.blas_environment({}) == {}


def test_a_forced_kernel_is_said_with_the_one_the_library_would_pick():
    blas_env = {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "1048576"}
    default = {"unset": list(blas_env), "libraries": _libraries("SkylakeX"), "error": None}
    note = env.blas_note(_libraries("Haswell"), blas_env, default)
    assert note.startswith(
        "OPENBLAS_CORETYPE=Haswell forces OpenBLAS's Haswell kernel; without it this machine runs SkylakeX."
    )
    assert "L2_SIZE" not in note  # the kernel is forced by CORETYPE alone


def test_no_note_when_nothing_is_forced():
    same = {"unset": ["OPENBLAS_CORETYPE"], "libraries": _libraries("Haswell"), "error": None}
    assert env.blas_note(_libraries("Haswell"), {"OPENBLAS_CORETYPE": "Haswell"}, same) is None
    nothing = {"unset": [], "libraries": None, "error": None}
    assert env.blas_note(_libraries("SkylakeX"), {}, nothing) is None
    assert env.blas_note(None, {"OPENBLAS_CORETYPE": "Haswell"}, same) is None


def test_a_failed_probe_is_reported_not_hidden():
    failed = {"unset": ["OPENBLAS_CORETYPE"], "libraries": None, "error": "the probe exited -11"}
    note = env.blas_note(_libraries("Haswell"), {"OPENBLAS_CORETYPE": "Haswell"}, failed)
    assert "could not be probed" in note and "-11" in note and "Haswell kernel" in note


def test_the_probe_runs_once_per_run_in_a_subprocess_without_the_variables(monkeypatch):
    calls = []

    def fake_run(cmd, env, **kwargs):
        calls.append(env)
        out = json.dumps([{**OPENBLAS, "architecture": "SkylakeX"}])
        return subprocess.CompletedProcess(cmd, 0, stdout=out + "\n", stderr="")

    monkeypatch.setattr(env.subprocess, "run", fake_run)
    env._probe_without.cache_clear()
    try:
        fake = {"OPENBLAS_TAIFUSE_TEST_ONLY": "1"}  # a name no library reads; os.environ is untouched
        first = env.default_blas(fake)
        second = env.default_blas(fake)
    finally:
        env._probe_without.cache_clear()
    assert len(calls) == 1, "probed again within one run"
    assert "OPENBLAS_TAIFUSE_TEST_ONLY" not in calls[0]
    assert first == second and first["libraries"][0]["kernel"] == "SkylakeX"
    assert first["unset"] == ["OPENBLAS_TAIFUSE_TEST_ONLY"]
    assert env.default_blas({}) == {"unset": [], "libraries": None, "error": None}  # nothing set: no probe


def test_collect_records_the_kernel_the_variables_and_the_note(monkeypatch):
    blas_env = {"OPENBLAS_CORETYPE": "Haswell"}
    monkeypatch.setattr(env, "_threadpool_info", lambda: [OPENBLAS])
    monkeypatch.setattr(env, "blas_environment", lambda environ=None: dict(blas_env))
    monkeypatch.setattr(
        env,
        "default_blas",
        lambda environ=None: {"unset": list(blas_env), "libraries": _libraries("SkylakeX"), "error": None},
    )
    collected = env.collect("numpy", {})
    assert collected["blas_kernel"] == "Haswell" and collected["blas_env"] == blas_env
    assert collected["blas_libraries"][0]["threads"] == 2
    assert "forces OpenBLAS's Haswell kernel" in collected["blas_note"]
    # The kernel is part of what makes two runs comparable.
    other = dict(collected, blas_kernel="SkylakeX")
    assert "blas_kernel" in env.FINGERPRINT_KEYS and env.fingerprint(other) != collected["fingerprint"]


# ----------------------------------------------------------------------------- caches

# A 2-CPU machine: private 32 KiB L1 and 1 MiB L2 per CPU, one shared 32 MiB L3.
CACHES = [
    {"level": 1, "type": "Data", "bytes": 32 * 1024, "shared_cpus": 1},
    {"level": 2, "type": "Unified", "bytes": 2**20, "shared_cpus": 1},
    {"level": 3, "type": "Unified", "bytes": 32 * 2**20, "shared_cpus": 2},
]


@pytest.mark.parametrize(
    ("working_set", "cpus", "level"),
    [
        (48 * 1024, 2, "L1"),  # two private L1s hold it together
        (48 * 1024, 1, "L2"),
        (int(1.5 * 2**20), 2, "L2"),
        (int(1.5 * 2**20), 1, "L3"),
        (32 * 2**20, 2, "L3"),  # the shared L3 counts once
        (32 * 2**20 + 1, 2, "DRAM"),
    ],
)
def test_cache_level_adds_private_caches_over_the_threads(working_set, cpus, level):
    assert env.cache_level(working_set, CACHES, cpus) == level


def test_unknown_caches_give_an_unknown_level():
    assert env.cache_level(1024, [], 2) == env.UNKNOWN_LEVEL


def test_cpu_lists_count():
    assert env._cpu_count("0-1") == 2 and env._cpu_count("0") == 1 and env._cpu_count("0-3,8-11") == 8
    assert env._cpu_count("") is None


def test_macos_caches_from_sysctl(monkeypatch):
    values = {
        "hw.perflevel0.logicalcpu": 4,
        "hw.perflevel0.l1dcachesize": 128 * 1024,
        "hw.perflevel0.l2cachesize": 16 * 2**20,
        "hw.perflevel0.cpusperl2": 4,
    }
    monkeypatch.setattr(env, "_sysctl", values.get)
    caches = env._sysctl_caches()
    assert [(c["level"], c["bytes"], c["shared_cpus"]) for c in caches] == [
        (1, 128 * 1024, 1),
        (2, 16 * 2**20, 4),
    ]
    assert env.cache_level(8 * 2**20, caches, 4) == "L2" and env.cache_level(64 * 2**20, caches, 4) == "DRAM"
