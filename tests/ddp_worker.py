"""One rank of the data-parallel tests (tests/test_distributed.py launches it under ``mpiexec -n 2``).

``python ddp_worker.py train BACKEND``: DistributedDataParallel training checked on every rank
(bit-identical parameters and AdamW state across ranks) and, on rank 0, against one process that
trains the same model on the whole batch (both ranks' shares together), plain, under autocast with
a GradScaler and gradient clipping, and with ``no_sync()`` accumulation; on the numpy backend also
the order of events that shows the overlap. ``raise``: rank 1 raises after init. ``mismatch``: the
ranks wrap different models. ``threads``: every rank's Numba and BLAS thread counts after init. Rank 0 prints one JSON line of results; any failure exits non-zero.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import taifuse
from taifuse import distributed as dist
from taifuse import nn
from taifuse.amp import GradScaler, autocast
from taifuse.nn import parallel
from taifuse.nn.parallel import DistributedDataParallel
from taifuse.optim import AdamW, clip_grad_norm_

B, D_IN, D_OUT, STEPS = 4, 8, 4, 3


def make_model(width: int = 16) -> nn.Module:
    taifuse.manual_seed(0)
    return nn.Sequential(
        nn.Linear(D_IN, width, activation="gelu"),
        nn.Linear(width, width, activation="gelu"),
        nn.Linear(width, D_OUT),
    )


def batches(step: int, micro: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    """The whole batch of one step: ``world * micro * B`` rows, rank r's micro-batch m at
    ``(r * micro + m) * B``."""
    rng = np.random.default_rng(100 + step)
    n = world * micro * B
    return rng.standard_normal((n, D_IN)).astype(np.float32), rng.standard_normal((n, D_OUT)).astype(
        np.float32
    )


def host(t: taifuse.Tensor) -> np.ndarray:
    return np.array(t.numpy(), copy=True)


def train(
    model: nn.Module, ddp: nn.Module | None, mode: str, rank: int, world: int
) -> tuple[AdamW, GradScaler | None]:
    """STEPS steps; with ``ddp`` on this rank's share, else (the reference) on the whole batch."""
    runner = ddp if ddp is not None else model
    # Two groups, as GPT.configure_optimizer: two flat gradient buffers, the weights' and the biases'.
    params = list(runner.parameters())
    groups = [
        {"params": [p for p in params if p.ndim == 2]},
        {"params": [p for p in params if p.ndim == 1], "weight_decay": 0.0},
    ]
    opt = AdamW(groups, lr=1e-2, weight_decay=0.1)
    scaler = GradScaler(init_scale=2.0**10) if mode == "autocast" else None
    loss_fn = nn.MSELoss()
    micro = 2 if mode == "nosync" else 1
    for step in range(STEPS):
        x, y = batches(step, micro, world)
        opt.zero_grad()
        shares = (
            [
                (
                    x[(rank * micro + m) * B : (rank * micro + m + 1) * B],
                    y[(rank * micro + m) * B : (rank * micro + m + 1) * B],
                )
                for m in range(micro)
            ]
            if ddp is not None
            else [(x, y)]
        )
        for m, (xs, ys) in enumerate(shares):
            last = m == len(shares) - 1
            sync = ddp.no_sync() if ddp is not None and not last else _nothing()
            with sync:
                if mode == "autocast":
                    with autocast():
                        out = runner(taifuse.tensor(xs))
                    loss = loss_fn(out.float(), taifuse.tensor(ys))
                    scaler.scale(loss / len(shares)).backward()
                else:
                    loss = loss_fn(runner(taifuse.tensor(xs)), taifuse.tensor(ys))
                    (loss / len(shares)).backward()
        if scaler is not None:
            scaler.unscale_(opt)
            clip_grad_norm_(runner.parameters(), 0.5)
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return opt, scaler


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _counting(stage_in, staged: list[int]):
    def counted(bucket):
        staged.append(bucket.index)
        return stage_in(bucket)

    return counted


def gathered(arr: np.ndarray, world: int) -> list[np.ndarray]:
    outs = [np.empty_like(arr) for _ in range(world)]
    dist.all_gather(outs, arr)
    return outs


def check_train(backend: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    modes = ("plain",) if backend.startswith("taichi") else ("plain", "nosync", "autocast")
    for mode in modes:
        model = make_model()
        if rank == 1:  # a different start: the wrapper must broadcast rank 0's
            with taifuse.no_grad():
                for p in model.parameters():
                    p += 1.0
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.001)  # ~262 floats: several buckets
        staged: list[int] = []
        stage_in = parallel._Bucket.stage_in
        parallel._Bucket.stage_in = _counting(stage_in, staged)
        try:
            opt, scaler = train(model, ddp, mode, rank, world)
        finally:
            parallel._Bucket.stage_in = stage_in
        # With the optimizer's flat gradient buffers, the host backends reduce in place, no copy.
        assert (len(staged) == 0) == (not backend.startswith("taichi")), f"{mode}: staged buckets {staged}"
        # Bit-identical across ranks: every parameter and every AdamW state array.
        for i, p in enumerate(model.parameters()):
            arrays = [host(p)] + [host(v) for k, v in sorted(opt.state[p].items()) if k != "step"]
            for a in arrays:
                copies = gathered(a, world)
                assert all(np.array_equal(copies[0], c) for c in copies[1:]), (
                    f"{mode}: parameter {i} differs across ranks"
                )
        if scaler is not None:
            scales = gathered(np.array([scaler.get_scale()], np.float64), world)
            assert scales[0] == scales[1], f"scales differ: {scales}"
        if rank == 0:
            ref = make_model()
            train(ref, None, mode, 0, world)
            err = max(
                float(np.max(np.abs(host(p) - host(q)))) for p, q in zip(model.parameters(), ref.parameters())
            )
            tol = 2e-3 if mode == "autocast" else 2e-5
            assert err <= tol, (
                f"{mode}: DDP against one process with the whole batch: max |diff| {err} > {tol}"
            )
            results[mode] = err
    if backend == "numpy":
        results["overlap"] = check_overlap()
    return results


def check_overlap() -> list[str]:
    """The first buckets' all-reduces start before the backward reaches the first layer: without an
    optimizer and with one of two parameter groups (the events of both runs)."""
    events: list[str] = []
    model = make_model()
    layers = list(model.children())
    layers[0].weight.register_post_accumulate_grad_hook(lambda p: events.append("grad 0.weight"))
    ddp = DistributedDataParallel(model, bucket_cap_mb=16 * 16 * 4 / 2**20)  # about one layer per bucket
    real = dist.all_reduce

    def recording(array, *args, **kwargs):
        events.append(f"all_reduce {array.size}")
        return real(array, *args, **kwargs)

    x, y = batches(0, 1, dist.get_world_size())
    runs = []
    for with_optimizer in (False, True):
        if with_optimizer:  # the buckets are rebuilt along its two flat gradient buffers
            params = list(ddp.parameters())
            AdamW(
                [
                    {"params": [p for p in params if p.ndim == 2]},
                    {"params": [p for p in params if p.ndim == 1]},
                ]
            )
            ddp.zero_grad()
        events.clear()
        dist.all_reduce = recording
        try:
            nn.MSELoss()(ddp(taifuse.tensor(x[:B])), taifuse.tensor(y[:B])).backward()
        finally:
            dist.all_reduce = real
        # The first layer's gradient is the backward's last: two buckets were in flight before it.
        started = [i for i, e in enumerate(events) if e.startswith("all_reduce")]
        assert started[1] < events.index("grad 0.weight"), events
        assert len(started) == len(ddp._buckets), events
        runs.append(list(events))
    return runs


def main() -> None:
    case = sys.argv[1]
    backend = sys.argv[2] if len(sys.argv) > 2 else "numpy"
    name, _, arch = backend.partition("-")
    taifuse.set_backend(name, arch=arch or None)
    dist.init_process_group()
    rank = dist.get_rank()
    if case == "train":
        results = check_train(backend)
    elif case == "raise":
        if rank == 1:
            raise RuntimeError("rank 1 fails on purpose")
        dist.barrier()  # rank 0 waits here for a rank that never comes: the abort must end it
        results = {}
    elif case == "mismatch":
        model = make_model(width=16 if rank == 0 else 12)
        try:
            DistributedDataParallel(model)
        except RuntimeError as error:
            results = {"error": str(error)}
        else:
            raise AssertionError("mismatched models wrapped without an error")
    elif case == "threads":
        import numba
        from threadpoolctl import threadpool_info

        mine = {
            "numba": numba.get_num_threads(),
            "blas": [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"],
            "cpus": len(os.sched_getaffinity(0)),
            "env": {k: os.environ.get(k) for k in dist.THREAD_VARIABLES},
        }
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        results = {"ranks": everyone}
    else:
        raise ValueError(case)
    if rank == 0:
        print(json.dumps(results), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
