"""pytest configuration: the ``backend`` fixture, the hypothesis profile, and the CI guard that a
required GPU backend (Vulkan on Linux CI, Metal on the macOS job) really ran.

Every test that takes ``backend`` runs once per param in ``helpers.BACKEND_PARAMS``. The fixture is
session-scoped, so pytest groups the tests by backend and Taichi switches arch a few times per run
instead of once per test. A backend that is absent (its package not installed, or for the GPU
params the Vulkan/Metal runtime) is skipped (taichi-cuda without an NVIDIA driver is deselected at
collection instead), and one that is installed but fails to start fails;
an absent backend fails too when it is required: ``TAIFUSE_REQUIRE_VULKAN=1`` / ``TAIFUSE_REQUIRE_METAL=1``
/ ``TAIFUSE_REQUIRE_CUDA=1`` or ``--require-backend=taichi-vulkan``, which CI sets (and
``--require-backend=taichi-cuda``, which benchmarks/gpu/run.sh sets on the GPU machine), turn that skip
into a failure.

``TAIFUSE_CPU_DURATIONS=path`` appends one line per test to ``path``: its node id, the CPU seconds
of the test process and of the processes it waited for, the wall seconds, and the CPU seconds Numba
spent compiling (cache misses) during it. Under pytest-xdist, ``--durations`` reports wall time,
which two workers on two cores (or a shared machine) inflate; CPU time says where the suite's time
goes (README's Tests section).
"""

from __future__ import annotations

import gc
import os
import resource
import time
from collections import Counter

import pytest
from helpers import BACKEND_PARAMS, CUDA_PARAM, DESIGN_SKIPS, BackendSpec, cuda_absent, start
from hypothesis import HealthCheck, settings

REQUIRE_ENV = {
    "taichi-vulkan": "TAIFUSE_REQUIRE_VULKAN",
    "taichi-metal": "TAIFUSE_REQUIRE_METAL",
    "taichi-cuda": "TAIFUSE_REQUIRE_CUDA",
}

# Hypothesis: a modest number of examples (CI has 2 cores and every example runs on every backend),
# no deadline (the first call of a Taichi or Numba kernel compiles it), and on CI a fixed
# derandomized sequence so a red run can be reproduced.
settings.register_profile(
    "taifuse",
    max_examples=int(os.environ.get("TAIFUSE_HYPOTHESIS_EXAMPLES", "10")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=os.environ.get("CI", "").lower() in ("1", "true", "yes"),
    print_blob=True,
)
settings.load_profile("taifuse")


class CpuDurations:
    """The ``TAIFUSE_CPU_DURATIONS`` report (module docstring): one tab-separated line per test."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the whole session
        self._compiling = 0  # depth of nested Numba compiles (a kernel compiles the helpers it calls)
        self._compile_started = 0.0
        self._compile_cpu = 0.0
        try:
            from numba.core import event
        except ImportError:
            return
        report = self

        class CompileTime(event.Listener):
            def on_start(self, event: object) -> None:
                if report._compiling == 0:
                    report._compile_started = time.process_time()
                report._compiling += 1

            def on_end(self, event: object) -> None:
                report._compiling -= 1
                if report._compiling == 0:
                    report._compile_cpu += time.process_time() - report._compile_started

        event.register("numba:compile", CompileTime())

    @staticmethod
    def _cpu() -> tuple[float, float]:
        own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        (own, children), wall, compile_cpu = self._cpu(), time.perf_counter(), self._compile_cpu
        yield
        own_after, children_after = self._cpu()
        self._file.write(
            f"{item.nodeid}\t{own_after - own:.3f}\t{children_after - children:.3f}"
            f"\t{time.perf_counter() - wall:.3f}\t{self._compile_cpu - compile_cpu:.3f}\n"
        )

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self._file.close()


class HeapFreezer:
    """Every ``every`` tests, one full collection and then ``gc.freeze()``: what survived it (pytest's
    reports, Numba's and Taichi's compiled kernels, hypothesis' strategies: ~90,000 objects per
    1,000 tests) moves to the permanent generation, so later collections (the automatic ones and the
    ``gc.collect()`` that pool and optimizer tests call to return buffers) scan only what was made
    since. Without it a full collection in a worker that had run a few thousand tests took 0.3-0.8 s
    (one test of 15 collections took 12 s in CI). Objects made by a test are never frozen while it
    runs: the freeze happens between tests, after a collection, so only what outlived its test is
    frozen. ``TAIFUSE_TEST_FREEZE_EVERY=0`` turns it off."""

    def __init__(self, every: int) -> None:
        self._every = every
        self._finished = 0

    def pytest_runtest_logfinish(self, nodeid: str, location: tuple) -> None:
        self._finished += 1
        if self._finished % self._every == 0:
            gc.collect()
            gc.freeze()


def pytest_configure(config: pytest.Config) -> None:
    every = int(os.environ.get("TAIFUSE_TEST_FREEZE_EVERY", "200"))
    if every > 0:
        config.pluginmanager.register(HeapFreezer(every), "taifuse-heap-freezer")
    path = os.environ.get("TAIFUSE_CPU_DURATIONS")
    if path:
        config.pluginmanager.register(CpuDurations(path), "taifuse-cpu-durations")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--require-backend",
        action="append",
        default=[],
        choices=BACKEND_PARAMS,
        help="fail (instead of skipping) when this backend is unavailable or none of its tests passed",
    )


def required_backends(config: pytest.Config) -> set[str]:
    required = set(config.getoption("--require-backend"))
    for param, env in REQUIRE_ENV.items():
        if os.environ.get(env, "") == "1":
            required.add(param)
    return required


def _cuda_deselected(config: pytest.Config) -> str | None:
    """Why this run leaves the taichi-cuda params out at collection, or None when it keeps them."""
    if CUDA_PARAM in required_backends(config):
        return None  # kept: an absent CUDA must fail as a skip of a required backend (below)
    return cuda_absent()


def pytest_report_header(config: pytest.Config) -> str | None:
    reason = _cuda_deselected(config)
    return None if reason is None else f"{CUDA_PARAM}: deselected at collection ({reason})"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Without an NVIDIA driver every taichi-cuda test (~3,000 of the suite's params) would only be
    # skipped: each one's setup, report and (under pytest-xdist) trip to the controller cost time
    # and prove nothing. They are deselected instead, unless the run requires taichi-cuda.
    if _cuda_deselected(config) is None:
        return
    kept, dropped = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = callspec.params.values() if callspec is not None else ()
        (dropped if any(isinstance(v, str) and v == CUDA_PARAM for v in params) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(scope="session", params=BACKEND_PARAMS)
def backend(request: pytest.FixtureRequest) -> BackendSpec:
    """The backend under test, started and active (a ``helpers.BackendSpec``)."""
    spec = BackendSpec(request.param)
    reason = start(spec)
    if reason is not None:
        if not spec.may_be_absent:
            # Its package is installed, so failing to start is a bug, not an absence.
            pytest.fail(f"{spec.param} failed to start: {reason}", pytrace=False)
        if spec.param in required_backends(request.config):
            pytest.fail(f"{spec.param} is required on this run but unavailable: {reason}", pytrace=False)
        pytest.skip(f"{spec.param} unavailable: {reason}")
    return spec


_passed: Counter[str] = Counter()
# Tests outside the backend fixture that need a GPU backend say so with a marker (pyproject.toml).
MARKERS = {"taichi-vulkan": "vulkan"}


def _required_for(item: pytest.Item) -> str | None:
    """The required backend this test exercises, if any."""
    required = required_backends(item.config)
    callspec = getattr(item, "callspec", None)
    if callspec is not None and callspec.params.get("backend") in required:
        return callspec.params["backend"]
    for param, marker in MARKERS.items():
        if param in required and item.get_closest_marker(marker) is not None:
            return param
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    param = _required_for(item)
    if param is None:
        return
    if report.skipped:
        # "CI must fail if the Vulkan tests were skipped": a skip of a required backend is a failure,
        # except a sample taifuse refuses by design (tests/test_opinfo.py), which the backend ran.
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if reason.removeprefix("Skipped: ").startswith(DESIGN_SKIPS):
            return
        report.outcome = "failed"
        report.longrepr = f"{param} is required on this run, but this test was skipped: {reason}"
    elif report.when == "call" and report.passed:
        # Counted where the reports are logged (below): under pytest-xdist that is the controller,
        # which sees the workers' reports with their user_properties but runs none of the tests.
        report.user_properties.append((_REQUIRED_PASS, param))


_REQUIRED_PASS = "taifuse-required-backend-passed"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for key, param in report.user_properties:
        if key == _REQUIRED_PASS and report.passed:
            _passed[param] += 1


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Skips of a required backend already fail (above); this catches a run in which none of its
    # tests ran at all (all deselected, or none collected): a required backend must have run.
    if hasattr(session.config, "workerinput"):
        return  # a pytest-xdist worker: the controller, which sees every worker's passes, checks
    missing = [p for p in sorted(required_backends(session.config)) if _passed[p] == 0]
    if missing and session.exitstatus == 0:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"REQUIRED BACKEND DID NOT RUN: no test passed on {', '.join(missing)}"
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(message, red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="module", params=BACKEND_PARAMS)
def grad_backend(request: pytest.FixtureRequest) -> BackendSpec:
    """A backend with autograd kernels, started and active (every backend: numpy, numba, taichi)."""
    spec = BackendSpec(request.param)
    reason = start(spec)
    if reason is not None:
        pytest.skip(f"{spec.param} unavailable: {reason}")
    spec.activate()
    return spec
