"""Gradient checkpointing: peak activation memory and step time of one training step of a
32-layer, width-1024 GELU MLP at batch 512 (float32), plain against ``checkpoint_sequential`` at
``round(sqrt(32))`` segments, with PyTorch's ``torch.utils.checkpoint.checkpoint_sequential``
(``use_reentrant=False``) on the same weights beside them.

Two kinds of case:

* ``memory/...: peak activation memory`` (a :class:`MemoryCase`): each variant runs in fresh
  worker processes of its own (see :func:`measure_memory`); its rows give the peak memory of one
  step above what the process held before it, and the plain/checkpointed ratios.
* ``memory/...: step time`` (a regular :class:`~taifuse.bench.case.Case`): the checkpointed
  step against the plain one in ABBA pairs, and against PyTorch's in processes of their own.
  One step is a ~100 GFLOP forward + backward, so the quick run leaves it out.

NOTE [ Measuring peak memory ]
Peak activation memory is the most the process holds during one step beyond what it held just
before (weights, gradients, inputs already allocated by a warm-up step, buffer pool emptied). It
is read two ways: tracemalloc (NumPy reports every array allocation to it; PyTorch does not, so
PyTorch rows show ``None``) and the kernel's peak resident set, VmHWM, reset by writing 5 to
``/proc/self/clear_refs`` (Linux). For RSS to follow the arrays, glibc is told to serve every block
above 128 KiB with its own mmap (``mallopt(M_MMAP_THRESHOLD)``): a freed array then goes back to
the kernel at once instead of staying in a heap that a later step would reuse unseen.

Memory that a step allocates once and holds between calls, such as a compiled step's arena
(docs/compile.md, "Buffers"), is already in the pre-step level and so in neither reading: such a
variant names it (``held``, an expression over its namespace giving bytes), and both peaks count
it, as the memory the step needs beyond the model's state.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import gc
import math
import sys
import time
import tracemalloc
from typing import Any

import numpy as np

from taifuse.bench import stats
from taifuse.bench.case import Case, Variant
from taifuse.bench.row import NOT_A_COMPARISON, NOT_MEASURED, Row, RowHeader

SUITE = "memory"
LAYERS, WIDTH, BATCH = 32, 1024, 512
SEGMENTS = round(math.sqrt(LAYERS))
MIB = 2**20

_TAIFUSE_IMPORTS = ("numpy as np", "taifuse", "taifuse.nn as nn", "taifuse.checkpoint as ckpt")
_TORCH_IMPORTS = ("numpy as np", "torch", "torch.utils.checkpoint as tckpt")

_TAIFUSE_PREPARE = f"""\
model = nn.Sequential(*[nn.Linear({WIDTH}, {WIDTH}, activation='gelu') for _ in range({LAYERS})])
model.load_state_dict({{f'{{i}}.weight': w for i, w in enumerate(weights)}}
                      | {{f'{{i}}.bias': b for i, b in enumerate(biases)}})
params = list(model.parameters())
for p in params:  # gradients allocated up front, as after a first training step
    p.grad = taifuse.tensor(np.zeros(p.shape, np.float32))
xt = taifuse.tensor(x)"""

_TORCH_PREPARE = f"""\
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear({WIDTH}, {WIDTH}), torch.nn.GELU())
                              for _ in range({LAYERS})])
with torch.no_grad():
    for block, w, b in zip(model, weights, biases):
        block[0].weight.copy_(torch.from_numpy(w))
        block[0].bias.copy_(torch.from_numpy(b))
params = list(model.parameters())
for p in params:
    p.grad = torch.zeros_like(p)
xt = torch.from_numpy(x)"""


def _taifuse(label: str, forward: str) -> Variant:
    code = f"for p in params:\n    p.grad *= 0.0\nloss = {forward}.mean()\nloss.backward()"
    return Variant(
        label, code, result="model[0].weight.grad.numpy()", prepare=_TAIFUSE_PREPARE, imports=_TAIFUSE_IMPORTS
    )


def _torch(label: str, forward: str, note: str) -> Variant:
    code = f"for p in params:\n    p.grad.zero_()\nloss = {forward}.mean()\nloss.backward()"
    return Variant(
        label,
        code,
        result="model[0][0].weight.grad",
        prepare=_TORCH_PREPARE,
        imports=_TORCH_IMPORTS,
        note=note,
        isolated=True,  # timed apart from taifuse: NOTE [ Isolated baselines ] in bench.harness
    )


PLAIN = _taifuse("taifuse plain", "model(xt)")
CHECKPOINTED = _taifuse("taifuse checkpoint", f"ckpt.checkpoint_sequential(model, {SEGMENTS}, xt)")
TORCH_PLAIN = _torch("torch plain", "model(xt)", "PyTorch CPU, the same weights, no checkpointing")
TORCH_CHECKPOINTED = _torch(
    "torch checkpoint",
    f"tckpt.checkpoint_sequential(model, {SEGMENTS}, xt, use_reentrant=False)",
    "PyTorch CPU torch.utils.checkpoint.checkpoint_sequential, non-reentrant, on the same weights",
)


def _inputs(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    # Weights of std 1.6/sqrt(1024): GELU shrinks the variance at each layer, and at torch's
    # 1/sqrt(1024) the first layer's gradients after 32 layers are ~1e-14, which would make the
    # correctness check against PyTorch vacuous; with 1.6 they are ~1e-3 to 4e-2 (seed 0).
    scale = np.float32(1.6 / math.sqrt(WIDTH))
    bias_scale = np.float32(1.0 / math.sqrt(WIDTH))
    return {
        "weights": [rng.standard_normal((WIDTH, WIDTH), dtype=np.float32) * scale for _ in range(LAYERS)],
        "biases": [rng.standard_normal(WIDTH, dtype=np.float32) * bias_scale for _ in range(LAYERS)],
        "x": rng.standard_normal((BATCH, WIDTH), dtype=np.float32),
    }


_SETUP = (
    "rng = np.random.default_rng(seed); "
    "weights = [rng.standard_normal((1024, 1024), dtype=np.float32) * np.float32(1.6 / sqrt(1024)) for _ in range(32)]; "
    "biases = [rng.standard_normal(1024, dtype=np.float32) * np.float32(1 / sqrt(1024)) for _ in range(32)]; "
    "x = rng.standard_normal((512, 1024), dtype=np.float32)"
)
_SHAPE = f"{LAYERS} x Linear({WIDTH}, {WIDTH}) + GELU, x ({BATCH}, {WIDTH}), loss = mean(output)"
_ACTIVATION_BYTES = 4 * BATCH * WIDTH
# Useful work of one step: the forward product and the two backward products per layer (the
# recomputation is overhead, not counted).
_FLOPS = 3 * 2 * BATCH * WIDTH * WIDTH * LAYERS
# The same weights through 32 layers in two libraries: float32 rounding differs per layer and
# compounds; gradients of the first layer agree to this tolerance (taifuse plain and checkpointed
# are bitwise equal, tests/test_checkpoint.py).
_RTOL, _ATOL = 2e-3, 1e-6


def time_case(compare_torch: bool) -> Case:
    """The checkpointed step timed against the plain step in ABBA pairs (and PyTorch's, isolated)."""
    baselines = [PLAIN]
    if compare_torch:
        baselines += [TORCH_CHECKPOINTED, TORCH_PLAIN]
    return Case(
        suite=SUITE,
        name=f"checkpoint_sequential({SEGMENTS} segments): step time",
        setup=_inputs,
        setup_code=_SETUP,
        candidate=CHECKPOINTED,
        baselines=tuple(baselines),
        dtype="float32",
        shape=_SHAPE,
        bytes_moved=4 * LAYERS * (WIDTH * WIDTH + WIDTH) * 2 + _ACTIVATION_BYTES,
        flops=_FLOPS,
        rtol=_RTOL,
        atol=_ATOL,
    )


# ----------------------------------------------------------------------------- memory


def _glibc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt  # noqa: B018 (glibc only)
        libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _proc_status(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _empty_pools() -> int | None:
    """Free every pooled buffer (when taifuse has a pool) and restart its statistics; the bytes held."""
    try:
        from taifuse import pool
    except ImportError:
        return None
    p = pool.get_pool()
    p.clear()
    p.reset_stats()
    s = p.stats()
    return s.bytes_in_use + s.bytes_pooled


def measure_memory(variant: Variant, inputs: dict[str, Any], held: str | None = None) -> dict[str, Any]:
    """One step's peak memory above what the process held before it (NOTE [ Measuring peak memory ]).

    Runs a warm-up step first (JIT compilation, BLAS buffers), then the measured step. Call it in a
    fresh process: allocator and pool state from other work would blur the numbers. ``held``: an
    expression over the variant's namespace, evaluated after the measured step, for the bytes the
    step holds between calls (a compiled step's arena); both peaks count them (``held_bytes``).
    """
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
        libc.mallopt(_M_TRIM_THRESHOLD, 128 * 1024)
    call = variant.build(inputs)
    call()
    gc.collect()
    pool_before = _empty_pools()
    if libc is not None:
        libc.malloc_trim(0)
    rss_before = _proc_status("VmRSS")
    rss_ok = rss_before is not None and _reset_peak_rss()
    tracemalloc.start()
    try:
        traced_before = tracemalloc.get_traced_memory()[0]
        start = time.perf_counter_ns()
        call()
        step_ns = time.perf_counter_ns() - start
        traced_peak = tracemalloc.get_traced_memory()[1] - traced_before
    finally:
        tracemalloc.stop()
    rss_peak = _proc_status("VmHWM") if rss_ok else None
    rss_step = None if rss_peak is None or rss_before is None else rss_peak - rss_before
    held_bytes = 0
    if held is not None:  # the suite's own text, over the namespace the variant's code ran in
        held_bytes = int(eval(compile(held, f"<held {variant.label}>", "eval"), call.__globals__))
    pool_peak = None
    if pool_before is not None:
        from taifuse import pool

        pool_peak = pool.get_pool().stats().peak_bytes - pool_before
    return {
        "variant": variant.label,
        "rss_peak_bytes": None if rss_step is None else rss_step + held_bytes,
        # PyTorch allocates outside Python's allocator: tracemalloc sees nothing of its tensors.
        "traced_peak_bytes": traced_peak + held_bytes if variant.label.startswith("taifuse") else None,
        "held_bytes": held_bytes if held is not None else None,
        "pool_peak_bytes": pool_peak if variant.label.startswith("taifuse") else None,
        "step_ns": step_ns,
        "rss_before_bytes": rss_before,
        "malloc": "glibc, mmap threshold 128 KiB" if libc is not None else "platform default",
    }


@dataclasses.dataclass(frozen=True)
class MemoryCase:
    """Peak activation memory of a plain and a checkpointed step, each variant in its own processes.

    The harness calls :meth:`jobs` for the worker jobs, the worker calls :meth:`run_job` in each
    fresh process, and :meth:`rows` turns their results into report rows.
    """

    suite: str
    name: str
    variants: tuple[Variant, ...]
    # (candidate, baseline) label pairs whose ratio of peaks is a comparison row
    pairs: tuple[tuple[str, str], ...]
    setup_code: str = _SETUP
    shape: str = _SHAPE
    dtype: str = "float32"
    seed: int = 0

    @property
    def id(self) -> str:
        return f"{self.suite}/{self.name}"

    def variant(self, label: str) -> Variant:
        return next(v for v in self.variants if v.label == label)

    def jobs(self, processes: int) -> list[dict]:
        """One job per variant per process, variants interleaved so that drift spreads alike."""
        return [{"variant": v.label, "process": p} for p in range(processes) for v in self.variants]

    def run_job(self, job: dict) -> dict:
        return measure_memory(self.variant(job["variant"]), _inputs(self.seed))

    def rows(self, runs: list[dict], error: str | None = None) -> list[dict]:
        """A row per variant (peak RSS above the pre-step level, MiB) and one per pair (ratio)."""
        by_variant: dict[str, list[dict]] = {v.label: [] for v in self.variants}
        for r in runs:
            by_variant.setdefault(r["variant"], []).append(r)
        rows = [self._variant_row(v, by_variant[v.label], error) for v in self.variants]
        rows += [self._pair_row(a, b, by_variant[a], by_variant[b], error) for a, b in self.pairs]
        return [r.as_dict() for r in rows]

    def _header(self, runs: list[dict]) -> RowHeader:
        # Peak memory has no byte count, roofline or tolerance; the model's arrays live in DRAM.
        return RowHeader.of(self, runs, bytes_moved=None, cache="DRAM", tolerance=None)

    def _variant_row(self, v: Variant, runs: list[dict], error: str | None) -> Row:
        values = [r["rss_peak_bytes"] / MIB for r in runs if r.get("rss_peak_bytes") is not None]
        traced = [r["traced_peak_bytes"] / MIB for r in runs if r.get("traced_peak_bytes") is not None]
        pooled = [r["pool_peak_bytes"] / MIB for r in runs if r.get("pool_peak_bytes") is not None]
        steps = [r["step_ns"] / 1e9 for r in runs]
        row = Row(
            id=f"{self.id}/{v.label}",
            kind="memory",
            label=f"{self.name}: {v.label}",
            unit="MiB",
            verdict=NOT_A_COMPARISON,
            header=self._header(runs),
            candidate={"label": v.label, "code": v.full_code()},
            extra={
                "peak_rss_mib": values,
                "peak_traced_mib": traced,
                "peak_pool_mib": pooled,
                "step_s": steps,
            },
        )
        if not values and traced:  # no /proc: tracemalloc is the measurement
            values = traced
        if not values:
            return dataclasses.replace(row, verdict=f"failed: {error}" if error else NOT_MEASURED)
        notes = [f"peak RSS above the pre-step level, MiB per process: {_list(values)}"]
        if traced:
            notes.append(f"tracemalloc peak: {_list(traced)}")
        else:
            notes.append("tracemalloc: not seen (PyTorch allocates outside Python's allocator)")
        if pooled:
            notes.append(f"taifuse pool peak: {_list(pooled)}")
        held = [r["held_bytes"] / MIB for r in runs if r.get("held_bytes") is not None]
        if held:
            notes.append(f"of each peak, held between calls (counted in both readings): {_list(held)}")
        notes.append(f"the measured step took {_list(steps, 'g')} s (tracemalloc on; not a timing row)")
        if error:
            notes.append(f"only {len(runs)} process(es) finished: {error}")
        row.note = "; ".join(notes)
        return row.estimated(stats.estimate([[x] for x in values]))

    def _pair_row(self, a: str, b: str, runs_a: list[dict], runs_b: list[dict], error: str | None) -> Row:
        va, vb = self.variant(a), self.variant(b)
        row = Row(
            id=f"{self.id}/{a} vs {b}",
            kind="memory_compare",
            label=f"{self.name}: {a} vs {b}",
            unit="x less memory",
            header=self._header(runs_a + runs_b),
            candidate={"label": a, "code": va.full_code()},
            baseline={
                "label": b,
                "code": vb.full_code(),
                "same_result": True,
                "note": vb.note,
                "peer": vb.peer,
            },
        )
        pa = [r["rss_peak_bytes"] for r in runs_a if r.get("rss_peak_bytes")]
        pb = [r["rss_peak_bytes"] for r in runs_b if r.get("rss_peak_bytes")]
        if not pa or not pb:
            return dataclasses.replace(row, verdict=f"failed: {error}" if error else NOT_MEASURED)
        n = min(len(pa), len(pb))
        # Process i of each variant ran back to back: pair them, as the timing rows pair A and B.
        ratios = [pb[i] / pa[i] for i in range(n)]
        est = stats.estimate([[r] for r in ratios])
        verdict = {stats.FASTER: "less memory", stats.SLOWER: "more memory"}.get(
            stats.verdict(est, stats.MIN_EFFECT), stats.verdict(est, stats.MIN_EFFECT)
        )
        reduction = [1.0 - 1.0 / r for r in ratios]
        row.extra["reduction"] = {
            "median": 1.0 - 1.0 / est.median,
            "low": 1.0 - 1.0 / est.low,
            "high": 1.0 - 1.0 / est.high,
        }
        row.note = (
            f"{b} peak / {a} peak, from peak RSS; the peak is "
            f"{_list([100 * x for x in reduction], '.1f')} % lower per process pair "
            f"(threshold {stats.MIN_EFFECT:.0%})"
        )
        return dataclasses.replace(row.estimated(est), verdict=verdict)


def _list(values: list[float], fmt: str = ".1f") -> str:
    return "[" + ", ".join(format(v, fmt) for v in values) + "]"


def memory_case(compare_torch: bool) -> MemoryCase:
    """Plain and checkpointed steps (and PyTorch's): peak activation memory, each in fresh processes."""
    variants = [PLAIN, CHECKPOINTED]
    pairs = [(CHECKPOINTED.label, PLAIN.label)]
    if compare_torch:
        variants += [TORCH_PLAIN, TORCH_CHECKPOINTED]
        pairs += [
            (TORCH_CHECKPOINTED.label, TORCH_PLAIN.label),
            (CHECKPOINTED.label, TORCH_CHECKPOINTED.label),
        ]
    return MemoryCase(
        suite=SUITE,
        name=f"checkpoint_sequential({SEGMENTS} segments): peak activation memory",
        variants=tuple(variants),
        pairs=tuple(pairs),
    )


def cases(quick: bool = False, compare_torch: bool = False) -> list:
    """The memory case; the step-time case too unless ``quick`` (one step is ~100 GFLOP)."""
    out: list = [memory_case(compare_torch)]
    if not quick:
        out.append(time_case(compare_torch))
    return out
