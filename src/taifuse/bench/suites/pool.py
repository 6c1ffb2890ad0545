"""Buffer pool suite: an MLP training step with the pool on against the same step with it off, and
the cost of getting a 16 MiB scratch buffer from the pool against a fresh one.

The allocation count per step (steady state) is not a timing; :func:`steady_state` measures it and
``benchmarks/bench_pool.py`` prints it beside the timed rows.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
from typing import Any

import numpy as np

from taifuse.bench.case import Case, Variant

SUITE = "pool"
BATCH, SIZES = 256, (784, 1024, 1024, 10)
LR = 1e-3
SCRATCH_ELEMENTS = 4 * 1024 * 1024  # 16 MiB of float32
PAGE = 4096

_TRAIN_IMPORTS = (
    "numpy as np",
    "taifuse",
    "taifuse.functional as F",
    "taifuse.nn as nn",
    "taifuse.pool as pool",
)
# One model per variant, built from the same seed: both sides start from identical weights, so the
# first step's losses (the correctness check) must be equal.
_MODEL = f"""taifuse.manual_seed(0)
model = nn.Sequential(
    nn.Linear({SIZES[0]}, {SIZES[1]}, activation="gelu"),
    nn.Linear({SIZES[1]}, {SIZES[2]}, activation="gelu"),
    nn.Linear({SIZES[2]}, {SIZES[3]}),
)
params = list(model.parameters())
xt = taifuse.tensor(x)"""
_STEP = f"""model.zero_grad()
loss = F.cross_entropy(model(xt), y)
loss.backward()
with taifuse.no_grad():
    for p in params:
        p -= {LR} * p.grad
value = loss.item()"""


def _indent(code: str) -> str:
    return "\n".join("    " + line for line in code.splitlines())


def _train_inputs(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((BATCH, SIZES[0]), dtype=np.float32),
        "y": rng.integers(0, SIZES[-1], size=BATCH),
    }


def _training_case() -> Case:
    flops = 3 * 2 * BATCH * sum(a * b for a, b in itertools.pairwise(SIZES))  # forward + two backward GEMMs
    weights = sum(a * b + b for a, b in itertools.pairwise(SIZES))
    return Case(
        suite=SUITE,
        name="mlp training step: pool on vs off",
        setup=_train_inputs,
        setup_code=(
            f"rng = np.random.default_rng(seed); x = rng.standard_normal(({BATCH}, {SIZES[0]}), dtype=np.float32); "
            f"y = rng.integers(0, {SIZES[-1]}, size={BATCH})"
        ),
        candidate=Variant("pool on", _STEP, result="value", prepare=_MODEL, imports=_TRAIN_IMPORTS),
        baselines=(
            Variant(
                "pool off",
                "with pool.get_pool().disabled():\n" + _indent(_STEP),
                result="value",
                prepare=_MODEL,
                imports=_TRAIN_IMPORTS,
                note="the same step with every buffer from the backend's own empty (np.empty on the host)",
            ),
        ),
        dtype="float32",
        shape=f"MLP {'-'.join(map(str, SIZES))}, GELU, batch {BATCH}, cross entropy, plain SGD (lr {LR})",
        bytes_moved=4 * (3 * weights + BATCH * sum(SIZES)),
        flops=flops,
        rtol=0.0,
        atol=0.0,
    )


def _no_inputs(seed: int) -> dict[str, Any]:
    return {}


_TOUCH = f"buf.view(np.uint8)[::{PAGE}] = 1  # first touch of every page"


def _host_scratch_case(quick: bool) -> Case:
    baselines = [
        Variant(
            "np.empty + first touch",
            f"buf = np.empty({SCRATCH_ELEMENTS}, np.float32)\n{_TOUCH}\ndel buf",
            result="None",
            same_result=False,
            note="a fresh buffer: the allocator's pages are faulted in on first write",
        )
    ]
    if importlib.util.find_spec("taichi") is not None:
        baselines.append(
            Variant(
                "fresh ti.ndarray (ti.cpu)",
                f"buf = tg.empty(({SCRATCH_ELEMENTS},), np.float32)\ndel buf",
                result="None",
                prepare='tg.init("cpu")',
                imports=("numpy as np", "taifuse.backends.taichi as tg"),
                same_result=False,
                note="Taichi allocates and zero-fills a new ndarray (what the taichi backend's empty does on a pool miss)",
            )
        )
    return Case(
        suite=SUITE,
        name="16 MiB host scratch",
        setup=_no_inputs,
        setup_code="(no inputs)",
        candidate=Variant(
            "pool",
            f"buf = host.acquire(({SCRATCH_ELEMENTS},), np.float32)\n{_TOUCH}\ndel buf",
            result="None",
            prepare="host = pool.host_pool()",
            imports=("numpy as np", "taifuse.pool as pool"),
        ),
        baselines=tuple(baselines),
        dtype="float32",
        shape=f"({SCRATCH_ELEMENTS},) float32 = 16 MiB, released after each call",
        bytes_moved=0,
    )


def _device_scratch_case(arch: str) -> Case:
    imports = ("numpy as np", "taifuse.pool as pool", "taifuse.backends.taichi as tg")
    return Case(
        suite=SUITE,
        name=f"16 MiB device scratch (ti.{arch})",
        setup=_no_inputs,
        setup_code="(no inputs)",
        candidate=Variant(
            "pool",
            f"buf = dev.acquire(({SCRATCH_ELEMENTS},), np.float32)\ndel buf",
            result="None",
            prepare=f'tg.init("{arch}")\ndev = pool.get_pool(tg)',
            imports=imports,
        ),
        baselines=(
            Variant(
                "fresh ti.ndarray",
                f"buf = tg.empty(({SCRATCH_ELEMENTS},), np.float32)\ndel buf",
                result="None",
                prepare=f'tg.init("{arch}")',
                imports=imports,
                same_result=False,
                note="a new ti.ndarray, allocated and zero-filled by Taichi, freed after each call",
            ),
        ),
        dtype="float32",
        shape=f"({SCRATCH_ELEMENTS},) float32 = 16 MiB on ti.{arch}, released after each call",
        bytes_moved=0,
    )


def cases(quick: bool = False, compare_torch: bool = False) -> list[Case]:
    """The training step and the host scratch; device scratch on ti.cpu (and ti.vulkan in a full run)."""
    out = [_training_case(), _host_scratch_case(quick)]
    if importlib.util.find_spec("taichi") is not None:
        arches = ("cpu",) if quick else ("cpu", "vulkan")
        out.extend(_device_scratch_case(a) for a in arches)
    return out


def steady_state(steps: int = 5, backend: str | None = None) -> dict[str, Any]:
    """Allocations and hit rate per step of the suite's training step (the same code as timed).

    Runs in this process on ``backend`` (default: the active one). Returns the per-step counts and
    their totals over the steps after the first (the steady state).
    """
    import taifuse
    import taifuse.functional as F
    from taifuse import nn, pool

    namespace: dict[str, Any] = {"np": np, "taifuse": taifuse, "F": F, "nn": nn, "pool": pool}
    namespace.update(_train_inputs(0))
    per_step = []
    with taifuse.use_backend(backend) if backend else contextlib.nullcontext():
        p = pool.get_pool()
        exec(compile(_MODEL, "<pool model>", "exec"), namespace)  # noqa: S102
        step = compile(_STEP, "<pool step>", "exec")
        p.reset_stats()
        for _ in range(steps):
            exec(step, namespace)  # noqa: S102
            s = p.stats()
            per_step.append({"allocations": s.allocations, "reuses": s.reuses, "hit_rate": s.hit_rate})
            p.reset_stats()
        final = p.stats()
        name = taifuse.get_backend()
    later = per_step[1:]
    allocations = sum(s["allocations"] for s in later)
    reuses = sum(s["reuses"] for s in later)
    return {
        "backend": name,
        "per_step": per_step,
        "allocations_after_first_step": allocations,
        "hit_rate_after_first_step": reuses / (allocations + reuses) if allocations + reuses else 0.0,
        "bytes_pooled": final.bytes_pooled,
        "bytes_in_use": final.bytes_in_use,
        "peak_bytes": final.peak_bytes,
    }
