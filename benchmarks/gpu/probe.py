# Where the Taichi backend's time goes on a GPU: the leads of the first GPU run (docs/benchmarks.md,
# "On a GPU"), measured in one short process so that one device call answers them all.
#
#   1. Launch cost: a kernel over 1 element, timed with a sync after every launch (latency) and
#      with one sync after 200 launches (what the host pays per launch when launches queue).
#   2. The memory-bound ops at 16M float32 elements (copy, gelu(tanh), add_relu) the same two
#      ways: if the queued figure is near the device copy and the synced one is not, the gap of
#      the first run's "vs device copy" rows is launch cost, not the kernels' code.
#   3. The elementwise loop's thread-block size (ti.loop_config(block_dim=...)) on a gelu-like
#      kernel: Taichi's default against 256, 512 and 1024.
#   4. The AdamW step (7.2 ms for 16M parameters in the first run, against 0.21 ms for PyTorch's
#      fused one): the optimizer's step, the bare kernel on the same buffers, the host-device
#      transfers per step, and a cProfile of ten steps.
#   5. PyTorch's copy and gelu on the same device, synced each call, as the yardstick.
#
# Run on the GPU machine after benchmarks/gpu/run.sh installed taichi (PYTHONPATH as it sets it):
#   PYTHONPATH=/tmp/taifuse-site:src python3 benchmarks/gpu/probe.py
# Dry run here: ARCH=cpu N=1048576 PYTHONPATH=src .venv/bin/python benchmarks/gpu/probe.py
import cProfile
import functools
import os
import pstats
import time
import traceback

import numpy as np

import taifuse

ARCH = os.environ.get("ARCH", "cuda")
N = int(os.environ.get("N", str(16 * 2**20)))
taifuse.set_backend("taichi", arch=ARCH)
import taichi as ti

import taifuse.functional as F
from taifuse import nn, optim
from taifuse.backends import taichi as tb


def per_call_us(fn, n=50, sync_each=True):
    """Median over 5 rounds of the time per call in us: a sync after every call, or one per round."""
    fn()
    tb.sync()
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
            if sync_each:
                tb.sync()
        tb.sync()
        rounds.append((time.perf_counter() - t) / n * 1e6)
    return float(np.median(rounds))


def section(title, body):
    print(f"\n## {title}", flush=True)
    try:
        body()
    except Exception:  # noqa: BLE001 (one failing section must not lose the others)
        traceback.print_exc()


def launches():
    one = tb.from_numpy(np.ones(1, np.float32))

    @ti.kernel
    def tiny(x: ti.types.ndarray(dtype=ti.f32, ndim=1), n: ti.i32):
        for i in range(n):
            x[i] = x[i] + 1.0

    print(
        f"1-element kernel: {per_call_us(lambda: tiny(one._ndarray(), 1), 200):.1f} us synced, "
        f"{per_call_us(lambda: tiny(one._ndarray(), 1), 200, False):.1f} us queued"
    )
    print(f"ti.sync alone: {per_call_us(lambda: None, 200):.1f} us")


def memory_bound():
    rng = np.random.default_rng(0)
    x = tb.from_numpy(rng.standard_normal(N, dtype=np.float32))
    y = tb.from_numpy(rng.standard_normal(N, dtype=np.float32))
    o = tb.empty((N,), np.dtype(np.float32))
    T = ti.types.ndarray(dtype=ti.f32, ndim=1)

    @ti.kernel
    def copy(src: T, dst: T, n: ti.i32):
        for i in range(n):
            dst[i] = src[i]

    ops = {
        "taichi copy kernel": (lambda: copy(x._ndarray(), o._ndarray(), N), 8),
        "F.gelu(tanh)": (lambda: F.gelu(x, approximate="tanh", out=o), 8),
        "F.gelu(erf)": (lambda: F.gelu(x, out=o), 8),
        "F.add_relu": (lambda: F.add_relu(x, y, out=o), 12),
    }
    for name, (fn, bytes_per) in ops.items():
        s, q = per_call_us(fn, 20), per_call_us(fn, 20, False)
        print(
            f"{name}, {N} float32: {s:.1f} us synced ({bytes_per * N / s / 1e6:.2f} TB/s), "
            f"{q:.1f} us queued ({bytes_per * N / q / 1e6:.2f} TB/s)"
        )


def block_dims():
    rng = np.random.default_rng(1)
    x = tb.from_numpy(rng.standard_normal(N, dtype=np.float32))
    o = tb.empty((N,), np.dtype(np.float32))
    T = ti.types.ndarray(dtype=ti.f32, ndim=1)

    def build(block):
        @ti.kernel
        def gelu_like(src: T, dst: T, n: ti.i32):
            if ti.static(block):
                ti.loop_config(block_dim=block)
            for i in range(n):
                v = src[i]
                dst[i] = 0.5 * v * (1.0 + ti.tanh(0.7978845608 * (v + 0.044715 * v * v * v)))

        return gelu_like

    for block in (0, 128, 256, 512, 1024):
        launch = functools.partial(build(block), x._ndarray(), o._ndarray(), N)
        q = per_call_us(launch, 20, False)
        s = per_call_us(launch, 20)
        print(
            f"gelu-like, block_dim {block or 'default'}: {q:.1f} us queued ({8 * N / q / 1e6:.2f} TB/s), "
            f"{s:.1f} us synced"
        )


def adamw():
    rng = np.random.default_rng(0)
    from taifuse.backends.taichi import optim as kernels

    for count, shape in ((4, (2048, 2048)), (1, (4096, 4096)), (64, (256, 256))):
        ps = [nn.Parameter(rng.standard_normal(shape, dtype=np.float32)) for _ in range(count)]
        opt = optim.AdamW(ps, lr=1e-3)
        sum((p * taifuse.tensor(rng.standard_normal(shape, dtype=np.float32))).sum() for p in ps).backward()
        step = per_call_us(opt.step, 10)
        print(
            f"AdamW {count}x{shape}: optimizer.step {step:.0f} us synced, "
            f"{per_call_us(opt.step, 10, False):.0f} us queued"
        )
    bufs = [tb.from_numpy(rng.standard_normal(N, dtype=np.float32)) for _ in range(4)]

    def bare():
        kernels.adam_step(*bufs, None, 1, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, False, False)

    print(
        f"bare adam kernel over {N}: {per_call_us(bare, 10):.0f} us synced, "
        f"{per_call_us(bare, 10, False):.0f} us queued"
    )
    small = [tb.from_numpy(np.ones(1, np.float32)) for _ in range(4)]

    def bare_small():
        kernels.adam_step(*small, None, 1, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, False, False)

    print(
        f"bare adam kernel over 1 element (20 arguments): {per_call_us(bare_small, 100):.1f} us synced, "
        f"{per_call_us(bare_small, 100, False):.1f} us queued"
    )
    tb.reset_transfer_stats()
    opt.step()
    tb.sync()
    print("transfers per step (64 parameters):", tb.transfer_stats())
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(10):
        opt.step()
    tb.sync()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(12)


def torch_side():
    import torch

    dev = "cuda" if ARCH == "cuda" else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    x = torch.randn(N, device=dev)
    o = torch.empty_like(x)

    def timed(fn, n=20):
        fn()
        sync()
        rounds = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(n):
                fn()
                sync()
            rounds.append((time.perf_counter() - t) / n * 1e6)
        return float(np.median(rounds))

    c = timed(lambda: o.copy_(x))
    g = timed(lambda: torch.nn.functional.gelu(x, approximate="tanh"))
    print(f"torch {dev} copy {N}: {c:.1f} us ({8 * N / c / 1e6:.2f} TB/s); gelu(tanh) {g:.1f} us, synced")


print(f"probe: arch {ARCH}, N {N}, taichi {ti.__version__}", flush=True)
section("1. launch cost", launches)
section("2. memory-bound ops, synced vs queued", memory_bound)
section("3. block_dim of the elementwise loop", block_dims)
section("4. AdamW", adamw)
section("5. PyTorch on the same device", torch_side)
