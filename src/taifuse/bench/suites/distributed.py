"""Distributed suite: data-parallel training of the GPT example over MPI ranks (issue 30).

One case, :class:`DistributedCase`, at examples/train_gpt.py's default model and batch (read as
the transformer suite reads them, NOTE [ The GPT example from the checkout ] there). Its rows:

* the GPT step's tokens/s in 1 process of 1 thread (the whole batch ``B``), and in 2 processes of
  1 thread each under ``DistributedDataParallel`` (``B / 2`` sequences each, as ``mpiexec -n 2
  python examples/train_gpt.py --ddp`` splits it), and their ratio: the scaling (issue 30's goal:
  at least 1.8x);
* where the rest of 2x goes (NOTE [ Where the scaling goes ]): the one process's step at ``B / 2``
  against half its step at ``B``, the 2 ranks' step without communication (``no_sync()``) against
  one process's at ``B / 2``, and the DDP step against the ``no_sync()`` one;
* the overlap: how long the DDP step waits for communication after the backward has ended,
  against the same all-reduces run alone;
* the all-reduce of the example's flat gradients (one buffer per parameter group, the buckets DDP
  reduces) in GB/s, against a plain memory copy of the same bytes timed the same way.

NOTE [ MPI jobs in the bench harness ]
The harness runs each job in a fresh ``taifuse.bench.worker`` process (harness.is_custom): here
that process is only a launcher. It starts the ranks, ``mpiexec -n 2 python -m
taifuse.bench.suites.distributed JOB RESULT`` (the ``mpiexec`` installed next to the Python
executable, as tests/test_distributed.py finds it; a clear error without it), or the one process
``python -m taifuse.bench.suites.distributed JOB RESULT`` without MPI, as a user runs the example
without ``--ddp``. Every rank runs with one thread (``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS``,
``MKL_NUM_THREADS``, ``NUMBA_NUM_THREADS`` = 1, checked inside through threadpoolctl and Numba)
and reports its thread counts, the CPUs it may run on and the MPI library's own version string.
Rank 0 gathers every rank's timings and writes the result; the launcher returns it to the harness.
Per process index ``p`` the one-process job and the two-rank job run one after the other, in an
order that reverses from one index to the next (as NOTE [ Isolated baselines ] in
taifuse.bench.harness alternates), and a ratio across them pairs the samples of the two jobs of
one index, as the harness's isolated rows do.

NOTE [ Where the scaling goes ]
With a batch of ``B`` sequences split over 2 ranks, the scaling is
``S = 2 * t1(B) / t2(B / 2)`` (tokens/s of 2 ranks over 1 process), and it factors exactly as

    S = 2 * [t1(B) / (2 t1(B/2))] * [t1(B/2) / t2_nosync(B/2)] * [t2_nosync(B/2) / t2(B/2)]

* batch efficiency ``2 t1(B/2) / t1(B)``: what a half batch costs one process against half of a
  whole one (per-call overheads that do not shrink with the batch);
* contention ``t2_nosync(B/2) / t1(B/2)``: the same half-batch step, one rank on each core at
  once, against one process alone (shared caches and memory bandwidth, a loaded machine's other
  work, the launcher);
* communication ``t2(B/2) / t2_nosync(B/2)``: the DDP step against the same step under
  ``no_sync()`` (gradient all-reduces, the hooks, the wait at the end of the backward).

The one-process job times ``B`` and ``B / 2`` steps alternately, the two-rank job DDP and
``no_sync()`` steps alternately (ABBA order), each step after a barrier so that both ranks start
it together; a two-rank step's time is the slower rank's.

NOTE [ CPU time on a loaded machine ]
On a machine shared with other work a rank is off its core part of the time, and a two-rank step
waits for the rank that was: the wall-clock rows then measure the machine's load as much as the
code. So every step also records the CPU time its process used (``time.process_time_ns``), which
the time spent off the core does not count, while what slows the code on its core (a shared cache,
memory bandwidth, a hyperthread sibling) does. The "(CPU time)" rows use it: on a quiet machine,
where each rank has a core of its own, they and the wall-clock rows agree; on a loaded one, the CPU
time rows say what the code would reach there. A two-rank step's CPU time is the rank's that used
least: MPI waits by spinning, so a rank that waited for one that was off its core used CPU time
for nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from taifuse.bench import stats
from taifuse.bench.row import NO_DATA, NOT_A_COMPARISON, NOT_MEASURED, Row, RowHeader
from taifuse.bench.suites.transformer import (
    GPT_PATH,
    GPTSettings,
    SkippedCase,
    example_settings,
    gpt_case,
    gpt_module,
    gpt_parameter_shapes,
)

SUITE = "distributed"
RANKS = 2
# Issue 30's goal: tokens/s of 2 processes of 1 thread over 1 process of 1 thread.
SCALING_GOAL = 1.8
# taifuse.distributed.THREAD_VARIABLES (not imported from there: it needs mpi4py).
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
# Inside the harness's worker timeout (harness.Plan.worker_timeout_s, 300 s), so that the launcher
# ends the ranks itself rather than being killed with them left running.
JOB_TIMEOUT_S = 240.0

# Steps per job: warm-up (of each kind) and timed (of each kind).
QUICK_STEPS, FULL_STEPS = (2, 8), (3, 20)
COPY_BLOCKS_QUICK, COPY_BLOCKS_FULL = 8, 20
MIN_SAMPLE_NS = 2_000_000


def launcher() -> Path:
    """The ``mpiexec`` next to the running Python (the one the ``distributed`` extra's ``mpich``
    wheel installs); ``RuntimeError`` saying what to install when it or mpi4py is missing."""
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        raise RuntimeError("the distributed suite needs mpi4py and MPICH: pip install 'taifuse[distributed]'")
    name = "mpiexec.exe" if sys.platform == "win32" else "mpiexec"
    path = Path(sys.executable).parent / name
    if not path.is_file():
        raise RuntimeError(
            f"the distributed suite launches its ranks with the mpiexec next to {sys.executable}, and "
            f"there is none ({path}): pip install 'taifuse[distributed]' into that environment"
        )
    return path


def rank_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """``environ`` (this process's by default) with one thread per rank in every library."""
    env = dict(os.environ if environ is None else environ)
    env.update({k: "1" for k in THREAD_VARS})
    return env


def launch(job: dict, ranks: int, timeout_s: float = JOB_TIMEOUT_S) -> dict:
    """Run ``job`` in ``ranks`` fresh processes (under ``mpiexec`` when more than one; NOTE [ MPI
    jobs in the bench harness ]) and return rank 0's result.

    ``RuntimeError`` (with the end of the ranks' output) when they fail or run past ``timeout_s``;
    the launcher and the ranks are then ended (their own process group, nothing else)."""
    command = [sys.executable, "-m", "taifuse.bench.suites.distributed"]
    if ranks > 1:
        command = [str(launcher()), "-n", str(ranks), *command]
    what = f"{ranks} rank(s) of the {job['mode']} job"
    with tempfile.TemporaryDirectory(prefix="taifuse-bench-mpi-") as tmp:
        job_path, result_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "result.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        proc = subprocess.Popen(
            [*command, job_path, result_path],
            env=rank_environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # one process group: a timeout ends the launcher and its ranks
        )
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise RuntimeError(f"{what} ran past {timeout_s:.0f} s") from None
        if proc.returncode != 0 or not os.path.exists(result_path):
            tail = "\n".join(output.strip().splitlines()[-12:])
            raise RuntimeError(f"{what} exited {proc.returncode}: {tail}")
        with open(result_path) as f:
            return json.load(f)


# ----------------------------------------------------------------------------- in the ranks


def _mpi_version() -> dict:
    import mpi4py
    from mpi4py import MPI

    return {
        "mpi4py": mpi4py.__version__,
        "library": " ".join(MPI.Get_library_version().split()),
        "standard": "{}.{}".format(*MPI.Get_version()),
    }


def _rank_facts() -> dict:
    from taifuse.bench.env import thread_settings

    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"threads": thread_settings(), "cpus": affinity, "pid": os.getpid()}


class _GPTStep:
    """examples/gpt.py's GPT, its optimizer and the step the transformer suite's gpt case times
    (forward with the loss, backward, clip_grad_norm_, AdamW), at ``settings``, seed ``seed``."""

    def __init__(self, settings: dict, seed: int) -> None:
        from taifuse import optim

        g = GPTSettings(**{**settings, "betas": tuple(settings["betas"])})
        inputs = gpt_case(False, g).setup(seed)  # the transformer suite's weights and batch
        gpt = gpt_module()
        self.model = gpt.GPT(gpt.GPTConfig(**g.config))
        self.model.load_state_dict(inputs["weights"])
        self.opt = self.model.configure_optimizer(weight_decay=g.weight_decay, lr=g.lr, betas=g.betas)
        self.x, self.y = inputs["x"], inputs["y"]
        self.clip = optim.clip_grad_norm_
        self.grad_clip = g.grad_clip
        self.runner: Any = self.model
        # When each step's backward returned, and when its last gradient was complete (every
        # parameter's post-accumulate gradient hook stamps it): between the two, a DDP backward
        # waits for its all-reduces (the wrapper's end-of-backward callback).
        self.backward_end_ns = self.last_grad_ns = 0
        for p in self.model.parameters():
            p.register_post_accumulate_grad_hook(self._stamp)

    def _stamp(self, _param: Any) -> None:
        self.last_grad_ns = time.perf_counter_ns()

    def __call__(self, x: np.ndarray, y: np.ndarray) -> tuple[int, int]:
        """One step; its wall-clock and CPU time (of this process: NOTE [ CPU time on a loaded
        machine ]), in ns."""
        t0, c0 = time.perf_counter_ns(), time.process_time_ns()
        self.opt.zero_grad()
        _, loss = self.runner(x, y)
        loss.backward()
        self.backward_end_ns = time.perf_counter_ns()
        self.clip(self.model.parameters(), self.grad_clip)
        self.opt.step()
        return time.perf_counter_ns() - t0, time.process_time_ns() - c0


def _rounds(steps: int, kinds: int) -> list[int]:
    """The kinds of ``steps`` rounds of interleaved steps: each round runs every kind once, in
    order on even rounds and reversed on odd ones (ABBA for two kinds), so a drift spreads alike."""
    order = list(range(kinds))
    return [k for i in range(steps) for k in (order if i % 2 == 0 else order[::-1])]


def run_single(job: dict) -> dict:
    """One process without MPI: steps of the whole batch and of one rank's share, interleaved."""
    step = _GPTStep(job["settings"], job["seed"])
    shares = [(step.x, step.y), (step.x[0::RANKS], step.y[0::RANKS])]
    warmup, steps = job["steps"]
    for k in _rounds(warmup, 2):
        step(*shares[k])
    times: list[list[tuple[int, int]]] = [[], []]
    for k in _rounds(steps, 2):
        times[k].append(step(*shares[k]))
    return {
        "whole_ns": [t for t, _ in times[0]],
        "half_ns": [t for t, _ in times[1]],
        "whole_cpu_ns": [c for _, c in times[0]],
        "half_cpu_ns": [c for _, c in times[1]],
        "ranks": [_rank_facts()],
        **_backend(),
    }


# The two-rank job's kinds of step: DDP on the rank's share of the batch (as the example splits
# it), the same under no_sync(), and DDP on the whole batch on every rank (twice the tokens).
DDP, NO_SYNC, DDP_WHOLE = 0, 1, 2


def run_ddp(job: dict) -> dict | None:
    """Every rank: DDP, ``no_sync()`` and whole-batch DDP steps interleaved (a barrier before
    each), with the time each DDP step waits at the end of its backward; then the all-reduce of
    the flat gradients against a copy of the same bytes. Rank 0 returns what every rank measured
    (per step the slowest rank's time); the other ranks None."""
    from taifuse import distributed as dist
    from taifuse.nn.parallel import DistributedDataParallel

    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    step = _GPTStep(job["settings"], job["seed"])
    ddp = DistributedDataParallel(step.model)
    step.runner = ddp
    shares = [(step.x[rank::world], step.y[rank::world])] * 2 + [(step.x, step.y)]

    def one(kind: int) -> tuple[int, int, int]:
        dist.barrier()
        with ddp.no_sync() if kind == NO_SYNC else contextlib.nullcontext():
            ns, cpu = step(*shares[kind])
        return ns, cpu, step.backward_end_ns - step.last_grad_ns

    warmup, steps = job["steps"]
    for k in _rounds(warmup, 3):
        one(k)
    times: list[list[int]] = [[], [], []]
    cpu: list[list[int]] = [[], [], []]
    wait: list[list[int]] = [[], [], []]
    for k in _rounds(steps, 3):
        ns, used, waited = one(k)
        times[k].append(ns)
        cpu[k].append(used)
        wait[k].append(waited)
    flat = _flat_gradients(step.opt)
    reduce_ns, copy_ns, loops = _reduce_against_copy(dist, flat, job["blocks"])
    mine = {
        "times": times,
        "cpu": cpu,
        "wait": wait,
        "reduce_ns": reduce_ns,
        "copy_ns": copy_ns,
        **_rank_facts(),
    }
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    dist.destroy_process_group()
    if rank != 0:
        return None

    def across(values: list[list[float]], pick: Any = max) -> list[float]:
        return [pick(v[i] for v in values) for i in range(len(values[0]))]

    return {
        "ddp_ns": across([r["times"][DDP] for r in everyone]),
        "nosync_ns": across([r["times"][NO_SYNC] for r in everyone]),
        "ddp_whole_ns": across([r["times"][DDP_WHOLE] for r in everyone]),
        # NOTE [ CPU time on a loaded machine ]: the rank that used least (the others may have
        # spun in MPI, waiting for it, while it was off its core).
        "ddp_cpu_ns": across([r["cpu"][DDP] for r in everyone], min),
        "nosync_cpu_ns": across([r["cpu"][NO_SYNC] for r in everyone], min),
        # The last rank to end its backward waits for the all-reduces alone; the others also for it.
        "wait_ns": across([r["wait"][DDP] for r in everyone], min),
        "nosync_wait_ns": across([r["wait"][NO_SYNC] for r in everyone], min),
        "reduce_ns": across([r["reduce_ns"] for r in everyone]),
        "copy_ns": across([r["copy_ns"] for r in everyone]),
        "loops": loops,
        "flat_sizes": [int(a.size) for a in flat],
        "world": world,
        "mpi": _mpi_version(),
        "ranks": [{k: r[k] for k in ("threads", "cpus", "pid")} for r in everyone],
        "per_rank": [{k: r[k] for k in ("times", "cpu", "wait")} for r in everyone],
        **_backend(),
    }


def _backend() -> dict:
    import taifuse

    return {"backend": taifuse.get_backend()}


def _flat_gradients(opt: Any) -> list[np.ndarray]:
    """Buffers the size of the optimizer's flat gradient buffers (one per parameter group: the
    buckets DDP all-reduces, whole, when they fit its cap), float32."""
    return [
        np.zeros(sum(int(p.size) for p in group["params"]), np.float32)
        for group in opt.param_groups
        if group["params"]
    ]


def _reduce_against_copy(
    dist: Any, flat: list[np.ndarray], blocks: int
) -> tuple[list[float], list[float], dict]:
    """ABBA blocks of ``all_reduce(op="avg")`` of every buffer against ``np.copyto`` of the same
    bytes, on every rank at once (a barrier before each timed run); ns per call of each, per block."""
    copies = [np.empty_like(a) for a in flat]

    def reduce() -> None:
        for a in flat:
            dist.all_reduce(a, op="avg")

    def copy() -> None:
        for dst, src in zip(copies, flat):
            np.copyto(dst, src)

    def run(fn: Any, loops: int) -> float:
        dist.barrier()
        t0 = time.perf_counter_ns()
        for _ in range(loops):
            fn()
        return (time.perf_counter_ns() - t0) / loops

    loops = {}
    for name, fn in (("all_reduce", reduce), ("copy", copy)):
        for _ in range(3):  # warm up
            fn()
        once = np.array([run(fn, 1)], np.float64)
        dist.all_reduce(once, op="max")  # the same loop count on every rank: the calls are collective
        loops[name] = max(1, math.ceil(MIN_SAMPLE_NS / once[0]))
    reduce_ns, copy_ns = [], []
    for _ in range(blocks):
        a1 = run(reduce, loops["all_reduce"])
        b1 = run(copy, loops["copy"])
        b2 = run(copy, loops["copy"])
        a2 = run(reduce, loops["all_reduce"])
        reduce_ns.append((a1 + a2) / 2)
        copy_ns.append((b1 + b2) / 2)
    return reduce_ns, copy_ns, loops


# ----------------------------------------------------------------------------- the case


def _tokens_per_s(tokens: int, times_ns: list[float]) -> list[float]:
    return [tokens * 1e9 / t for t in times_ns]


@dataclasses.dataclass(frozen=True)
class DistributedCase:
    """The GPT example's step in 1 process and over 2 ranks (NOTE [ MPI jobs in the bench
    harness ]): the harness calls :meth:`jobs`, a worker process runs each through
    :meth:`run_job` (which launches the ranks), and :meth:`rows` turns their results into rows."""

    settings: GPTSettings
    steps: tuple[int, int]  # warm-up rounds, timed rounds (each round: one step of each kind)
    blocks: int  # ABBA blocks of the all-reduce against the copy
    suite: str = SUITE
    dtype: str = "float32"
    seed: int = 0

    @property
    def name(self) -> str:
        config = ", ".join(f"{k}={v}" for k, v in self.settings.config.items())
        return f"gpt ddp({config}, batch={self.settings.batch}, {RANKS} ranks)"

    @property
    def id(self) -> str:
        return f"{self.suite}/{self.name}"

    @property
    def tokens(self) -> int:
        return self.settings.batch * self.settings.config["block_size"]

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for s in gpt_parameter_shapes(self.settings.config).values())

    @property
    def shape(self) -> str:
        return (
            f"examples/gpt.py's GPT of {self.n_params:,} parameters ({self.settings.source}), "
            f"{self.tokens:,} tokens per step (batch {self.settings.batch}); {RANKS} ranks take "
            f"{self.settings.batch // RANKS} sequences each ([rank::{RANKS}], as train_gpt.py --ddp), "
            "one thread per process"
        )

    @property
    def setup_code(self) -> str:
        return gpt_case(False, self.settings).setup_code

    def jobs(self, processes: int) -> list[dict]:
        """Per process index the one-process job and the two-rank job, their order reversed on odd
        indices (NOTE [ MPI jobs in the bench harness ])."""
        common = {
            "settings": dataclasses.asdict(self.settings),
            "seed": self.seed,
            "steps": list(self.steps),
            "blocks": self.blocks,
        }
        out = []
        for p in range(processes):
            modes = ["single", "ddp"] if p % 2 == 0 else ["ddp", "single"]
            out += [{"mode": mode, "process": p, **common} for mode in modes]
        return out

    def run_job(self, job: dict) -> dict:
        ranks = RANKS if job["mode"] == "ddp" else 1
        result = launch({k: job[k] for k in ("mode", "settings", "seed", "steps", "blocks")}, ranks)
        # The ranks' threads, for the run's environment block (this launcher's own are not the ones timed).
        threads = result["ranks"][0]["threads"]
        return {
            **result,
            "mode": job["mode"],
            "process": job["process"],
            "rank_count": ranks,
            "threads": threads,
        }

    # -- rows

    def rows(self, runs: list[dict], error: str | None = None) -> list[dict]:
        """The rows of the module docstring, from the jobs' results (NOTE [ Where the scaling goes ])."""
        by_process: dict[int, dict[str, dict]] = {}
        for r in runs:
            by_process.setdefault(r["process"], {})[r["mode"]] = r
        single = [p["single"] for p in by_process.values() if "single" in p]
        ddp = [p["ddp"] for p in by_process.values() if "ddp" in p]
        pairs = [(p["single"], p["ddp"]) for p in by_process.values() if len(p) == 2]
        header = self._header(single + ddp)
        b, half = self.settings.batch, self.settings.batch // RANKS
        flat_bytes = 4 * sum(ddp[0]["flat_sizes"]) if ddp else 4 * self.n_params
        out: list[Row] = []

        def value_row(key: str, label: str, unit: str, groups: list[list[float]], note: str) -> None:
            row = Row(
                id=f"{self.id}/{key}",
                kind="measured",
                label=f"{self.name}: {label}",
                unit=unit,
                verdict=NOT_A_COMPARISON,
                header=header,
                candidate=self._code(),
                note=note,
            )
            out.append(self._estimated(row, groups, error))

        def ratio_row(
            key: str, label: str, unit: str, groups: list[list[float]], note: str, goal: float | None = None
        ) -> None:
            row = Row(
                id=f"{self.id}/{key}",
                kind="ratio",
                label=f"{self.name}: {label}",
                unit=unit,
                verdict=NOT_A_COMPARISON,
                header=header,
                candidate=self._code(),
                note=note,
            )
            row = self._estimated(row, groups, error)
            if goal is not None and row.value is not None:
                from taifuse.bench.report import judge

                row.verdict = f"goal (at least {goal:g}x) {judge(row.low, row.high, at_least=goal)}"
            out.append(row)

        one_thread = "1 process x 1 thread"
        value_row(
            "tokens-1",
            f"tokens/s, {one_thread}, batch {b}",
            "tokens/s",
            [_tokens_per_s(self.tokens, r["whole_ns"]) for r in single],
            f"python -m taifuse.bench.suites.distributed without MPI (as train_gpt.py without --ddp); "
            f"{self.tokens} tokens per step over each step's time",
        )
        value_row(
            "tokens-2",
            f"tokens/s, {RANKS} processes x 1 thread (DDP), batch {half} each",
            "tokens/s",
            [_tokens_per_s(self.tokens, r["ddp_ns"]) for r in ddp],
            f"mpiexec -n {RANKS}: DistributedDataParallel, each rank {half} sequences; {self.tokens} tokens "
            "per step over the slower rank's step time",
        )
        cross = (
            "pairs step i of the one-process job with step i of the two-rank job of the same process index"
        )
        ratio_row(
            "scaling",
            f"scaling: tokens/s of {RANKS} processes over 1 (batch {b} split)",
            "x",
            [list(np.asarray(s["whole_ns"]) / np.asarray(d["ddp_ns"])) for s, d in pairs],
            f"t1(batch {b}) / t2(batch {half} per rank), {cross}; issue 30's goal is {SCALING_GOAL}x; "
            "NOTE [ Where the scaling goes ] in suites/distributed.py factors it into the three rows below",
            goal=SCALING_GOAL,
        )
        ratio_row(
            "batch-efficiency",
            f"batch efficiency: 2 steps of {half} against 1 of {b}, 1 process",
            "x",
            [list(np.asarray(r["whole_ns"]) / (2 * np.asarray(r["half_ns"]))) for r in single],
            f"t1({b}) / (2 t1({half})), interleaved in one process; below 1, a half batch costs more than "
            "half a whole one (per-step work that does not shrink with the batch: the optimizer, the clip, "
            "the calls)",
        )
        ratio_row(
            "contention",
            f"contention: 1 process against {RANKS} ranks at once (no_sync), batch {half}",
            "x",
            [list(np.asarray(s["half_ns"]) / np.asarray(d["nosync_ns"])) for s, d in pairs],
            f"t1({half}) / t2_no_sync({half}): the same step alone and with a rank on the other core, no "
            f"communication; {cross}",
        )
        ratio_row(
            "communication",
            f"communication: DDP step against its no_sync step, batch {half}",
            "x",
            [list(np.asarray(r["nosync_ns"]) / np.asarray(r["ddp_ns"])) for r in ddp],
            "t2_no_sync / t2_DDP, interleaved in the two-rank job: the gradient all-reduces, the hooks and "
            "the wait at the end of the backward",
        )
        ratio_row(
            "scaling-whole",
            f"scaling at batch {b} per rank: tokens/s of {RANKS} processes over 1",
            "x",
            [list(RANKS * np.asarray(s["whole_ns"]) / np.asarray(d["ddp_whole_ns"])) for s, d in pairs],
            f"{RANKS} t1({b}) / t2({b} per rank, {RANKS * b} in all): the per-process batch held, as "
            f"torch's DDP examples count it (not train_gpt.py's split); {cross}",
        )
        ratio_row(
            "scaling-cpu",
            f"scaling in CPU time: {RANKS} processes over 1 (batch {b} split)",
            "x",
            [list(np.asarray(s["whole_cpu_ns"]) / np.asarray(d["ddp_cpu_ns"])) for s, d in pairs],
            f"the scaling row with each step's CPU time instead of its wall-clock time (NOTE [ CPU time on "
            f"a loaded machine ]): what {RANKS} ranks with a core each would reach; {cross}",
        )
        ratio_row(
            "batch-efficiency-cpu",
            f"batch efficiency in CPU time: 2 steps of {half} against 1 of {b}, 1 process",
            "x",
            [list(np.asarray(r["whole_cpu_ns"]) / (2 * np.asarray(r["half_cpu_ns"]))) for r in single],
            "the batch efficiency row in CPU time",
        )
        ratio_row(
            "contention-cpu",
            f"contention in CPU time: 1 process against {RANKS} ranks at once (no_sync), batch {half}",
            "x",
            [list(np.asarray(s["half_cpu_ns"]) / np.asarray(d["nosync_cpu_ns"])) for s, d in pairs],
            "the contention row in CPU time: what a rank on the other core costs this one's work, without "
            f"the time off the core; {cross}",
        )
        ratio_row(
            "communication-cpu",
            f"communication in CPU time: DDP step against its no_sync step, batch {half}",
            "x",
            [list(np.asarray(r["nosync_cpu_ns"]) / np.asarray(r["ddp_cpu_ns"])) for r in ddp],
            "the communication row in CPU time",
        )
        value_row(
            "wait",
            "communication left after the backward (DDP wait)",
            "ms",
            [[t / 1e6 for t in r["wait_ns"]] for r in ddp],
            "per DDP step, from the moment its last gradient was complete (a post-accumulate gradient "
            "hook on every parameter) to the return of backward(): the wrapper starts the buckets not yet "
            "started and waits for every all-reduce; on the rank that waited least (the last to end its "
            "backward); the same interval in the no_sync() steps, with nothing to wait for: "
            + (
                f"{np.median([t for r in ddp for t in r['nosync_wait_ns']]) / 1e6:.3f} ms (median)"
                if ddp
                else "—"
            ),
        )
        ratio_row(
            "exposed",
            "exposed communication: DDP wait over the all-reduces alone",
            "x",
            [list(np.asarray(r["wait_ns"]) / np.median(r["reduce_ns"])) for r in ddp],
            "the wait above over the process's median all-reduce of the flat gradients alone (below): 1 "
            "means none of it overlapped the backward, 0 all of it",
        )
        value_row(
            "all-reduce",
            f"all_reduce(avg) of the flat gradients ({_mb(flat_bytes)})",
            "GB/s",
            [[flat_bytes / t for t in r["reduce_ns"]] for r in ddp],
            "taifuse.distributed.all_reduce(op='avg') of one float32 buffer per parameter group, the sizes "
            f"of the optimizer's flat gradient buffers ({ddp[0]['flat_sizes'] if ddp else '?'} elements), "
            "both ranks at once after a barrier; bytes of the buffers over the time (algorithm bandwidth: a "
            "ring moves 2(N-1)/N of them per rank)",
        )
        value_row(
            "copy",
            f"np.copyto of the same bytes ({_mb(flat_bytes)})",
            "GB/s",
            [[flat_bytes / t for t in r["copy_ns"]] for r in ddp],
            "np.copyto of each buffer into another of its size, on both ranks at once, timed as the "
            "all-reduce in ABBA blocks against it; bytes over the time",
        )
        ratio_row(
            "all-reduce-vs-copy",
            "all-reduce against a copy of the same bytes",
            "x",
            [list(np.asarray(r["copy_ns"]) / np.asarray(r["reduce_ns"])) for r in ddp],
            "copy time / all-reduce time per ABBA block: the fraction of a plain memory copy's speed the "
            "all-reduce reaches (a bound, not the same function)",
        )
        return [r.as_dict() for r in out]

    def _header(self, runs: list[dict]) -> RowHeader:
        # The ranks' own thread counts and backend (the worker that launched them reports its own).
        seen = [
            {"threads": rank["threads"], "backend": r.get("backend")} for r in runs for rank in r["ranks"]
        ]
        return RowHeader.of(self, seen, bytes_moved=None, cache=NO_DATA, tolerance=None)

    def _code(self) -> dict:
        return {"label": "taifuse", "code": _STEP_CODE}

    @staticmethod
    def _estimated(row: Row, groups: list[list[float]], error: str | None) -> Row:
        groups = [g for g in groups if len(g)]
        if not groups:
            return dataclasses.replace(row, verdict=f"failed: {error}" if error else NOT_MEASURED)
        if error:
            row.note = f"{row.note}; only {len(groups)} process(es) finished: {error}"
        return row.estimated(stats.estimate(groups))


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


_STEP_CODE = inspect.getsource(_GPTStep.__call__).replace("\n    ", "\n").strip() + (
    "\n# ranks: step.runner = DistributedDataParallel(model); each step after dist.barrier(); "
    "no_sync() steps inside `with ddp.no_sync():`"
)


def cases(quick: bool = False, compare_torch: bool = False) -> list:
    """The GPT example's data-parallel case; a skipped row without examples/gpt.py, mpi4py or the
    ``mpiexec`` next to the Python (``compare_torch`` adds nothing: PyTorch has no row here)."""
    reason = None
    if not GPT_PATH.is_file():
        reason = f"examples/gpt.py not found (looked for {GPT_PATH})"
    else:
        try:
            launcher()
        except RuntimeError as exc:
            reason = str(exc)
    settings = example_settings() if GPT_PATH.is_file() else None
    if reason is not None or settings is None:
        return [SkippedCase(SUITE, f"gpt ddp({RANKS} ranks)", reason or "no settings", shape="not run")]
    return [
        DistributedCase(
            settings,
            steps=QUICK_STEPS if quick else FULL_STEPS,
            blocks=COPY_BLOCKS_QUICK if quick else COPY_BLOCKS_FULL,
        )
    ]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m taifuse.bench.suites.distributed JOB.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        job = json.load(f)
    result = run_single(job) if job["mode"] == "single" else run_ddp(job)
    if result is not None:
        with open(argv[1], "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
