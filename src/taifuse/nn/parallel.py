"""Data-parallel training: :class:`DistributedDataParallel`, as ``torch.nn.parallel``'s.

Every process (rank, taifuse/distributed.py) holds the whole model and runs it on its share of
each batch; the wrapper averages the gradients over the ranks during ``backward()``, so that every
rank's optimizer takes the same step and the models stay identical.

NOTE [ Gradient buckets ]
At wrap time the parameters that require grad are split into *buckets*: runs of parameters of one
backend and dtype, in reverse registration order (the order in which a backward completes their
gradients, roughly: the last layer's first), each at most ``bucket_cap_mb`` megabytes (a parameter
larger than that is a bucket of its own). A post-accumulate gradient hook on every parameter
(NOTE [ Gradient hooks ] in taifuse/_engine.py) counts a bucket's parameters in; when the last of
them is complete, the bucket's non-blocking all-reduce (``MPI_Iallreduce``, summed, then divided by
the world size) starts while the backward goes on. Buckets start in index order on every rank (a
bucket complete before an earlier one waits for it), because MPI matches collectives by order.
At the end of the backward (a callback queued on the engine) the buckets that no hook completed
(parameters this rank did not use) start too, and then the wrapper waits for what is still in
flight, so that ``clip_grad_norm_``, ``GradScaler.unscale_`` and the step see averaged gradients.

Where a bucket's numbers live: an optimizer keeps its parameters' gradients side by side in one
flat buffer per parameter group and dtype, and autograd writes them there (NOTE [ Gradient slots ]
in taifuse/_grad_slots.py). The optimizer is usually made after the wrapper (``opt =
AdamW(ddp.parameters())``), so the buckets made at wrap time cannot know those buffers; and its
buffers may move (a gradient the user kept across ``zero_grad()``). So at the start of each synced
backward the wrapper reads where the parameters' gradient slots are, and when that changed (the
first backward after the optimizer was made, as PyTorch rebuilds its buckets after the first
iteration) it rebuilds the buckets along the flat buffers: per buffer from its end, cut at the
cap, so that each bucket *is* one slice of an optimizer's flat gradient buffer and its all-reduce
works on that slice in place, no copy (GPT's optimizer has two groups, matrices and vectors: two
buffers, so buckets of matrices and buckets of vectors). The buckets start in the order their
gradients complete: by the earliest-registered parameter each holds, latest first (the vectors'
bucket, which holds the first LayerNorm, goes last). The layout read is the same on every rank
running the same program, so every rank rebuilds alike. When a bucket's gradients are not one
slice after all (no optimizer, gradients assigned by hand, the taichi backend whose gradients live
on the device, float16, which MPI has no type for) the bucket is staged: copied into a host buffer
the wrapper keeps per bucket (made once, at its first staged start), reduced there and copied back.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np

from taifuse import pool
from taifuse._engine import backward_pass, no_grad, queue_callback
from taifuse._internal import backend, data, grad_data, grad_slot, set_grad, wrap
from taifuse.nn.module import Module

__all__ = ["DistributedDataParallel"]

_MPI_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _distributed() -> ModuleType:
    from taifuse import distributed  # NOTE: lazily: importing taifuse.nn must not import mpi4py

    return distributed


class _Bucket:
    """Parameters whose gradients are all-reduced together (NOTE [ Gradient buckets ])."""

    def __init__(self, index: int, params: list[Any]) -> None:
        self.index = index
        self.params = params  # reverse registration order
        self.be: ModuleType = backend(params[0])
        self.dtype = params[0].dtype
        self.size = sum(p.size for p in params)
        self.ready = 0
        self.work: Any = None
        self.staged: np.ndarray | None = None  # the host buffer when the bucket is staged
        self.buffer: np.ndarray | None = None  # kept across steps for staging

    def in_place_view(self) -> np.ndarray | None:
        """The bucket's gradients as one slice of an optimizer's flat gradient buffer, if they are."""
        if self.dtype not in _MPI_FLOATS:
            return None
        root = None
        lo = hi = None
        for p in self.params:
            g, slot = grad_data(p), grad_slot(p)
            if g is None or slot is None or not slot.holds(g):
                return None
            base = slot.array.base if slot.array.base is not None else slot.array
            if root is None:
                root = base
            elif base is not root:
                return None
            start = (g.__array_interface__["data"][0] - root.__array_interface__["data"][0]) // g.itemsize
            # Reversed neighbours: this one ends where the last one began.
            if hi is not None and start + g.size != lo:
                return None
            lo, hi = start, (start + g.size if hi is None else hi)
        assert root is not None and lo is not None
        return root[lo:hi]

    def stage_in(self) -> np.ndarray:
        """Copy the gradients into the bucket's host buffer (reverse order, packed)."""
        if self.buffer is None:
            work = self.dtype if self.dtype in _MPI_FLOATS else np.dtype(np.float32)
            self.buffer = np.empty(self.size, work)
        offset = 0
        for p in self.params:
            part = self.buffer[offset : offset + p.size]
            g = grad_data(p)
            if isinstance(g, np.ndarray):
                np.copyto(part, g.reshape(-1), casting="unsafe")
            elif part.dtype == g.dtype:
                self.be.copy_to_host(g, part)
            else:
                np.copyto(part, self.be.to_numpy(g).reshape(-1), casting="unsafe")
            offset += p.size
        return self.buffer

    def stage_out(self) -> None:
        offset = 0
        assert self.buffer is not None
        for p in self.params:
            part = self.buffer[offset : offset + p.size]
            g = grad_data(p)
            if isinstance(g, np.ndarray):
                np.copyto(g, part.reshape(g.shape), casting="unsafe")
            else:
                self.be.copy_from_host(g, part if part.dtype == g.dtype else part.astype(g.dtype))
            offset += p.size


class DistributedDataParallel(Module):
    """Wrap ``module`` for data-parallel training over the ranks of ``taifuse.distributed``.

    On wrapping, rank 0's parameters (and buffers, for a module that has ``named_buffers``) are
    broadcast to every rank, after a check that every rank's model has the same parameters
    (names, shapes and dtypes: ``RuntimeError`` naming the first that differs, on every rank).
    Calling the wrapper calls ``module``; its ``backward()`` averages the gradients over the
    ranks, overlapped with the rest of the backward (NOTE [ Gradient buckets ]). Inside
    :meth:`no_sync` backwards only accumulate locally; the first backward after it averages the
    accumulated gradients. Parameter names get the prefix ``module.``, as in PyTorch: save
    ``ddp.module.state_dict()`` for a checkpoint that loads without the wrapper.

    Args:
        module: the model (the same on every rank).
        bucket_cap_mb: the most megabytes (MiB, as PyTorch) of gradients per all-reduce.
    """

    def __init__(self, module: Module, bucket_cap_mb: float = 25) -> None:
        super().__init__()
        if not isinstance(module, Module):
            raise TypeError(
                f"DistributedDataParallel: module should be a taifuse.nn.Module, got {type(module).__name__}"
            )
        if (
            isinstance(bucket_cap_mb, bool)
            or not isinstance(bucket_cap_mb, numbers.Real)
            or not math.isfinite(bucket_cap_mb)
            or bucket_cap_mb <= 0
        ):
            raise ValueError(
                f"DistributedDataParallel: bucket_cap_mb should be a number > 0, got {bucket_cap_mb!r}"
            )
        dist = _distributed()
        if not dist.is_initialized():
            raise RuntimeError(
                "DistributedDataParallel: the default process group has not been initialized: call "
                "taifuse.distributed.init_process_group() first"
            )
        self.module = module
        object.__setattr__(self, "bucket_cap_mb", float(bucket_cap_mb))
        object.__setattr__(self, "require_backward_grad_sync", True)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        _check_same_model(dist, module)
        with no_grad():
            for _, p in module.named_parameters():
                dist.broadcast(p, src=0)
            for _, b in getattr(module, "named_buffers", lambda: iter(()))():
                dist.broadcast(b, src=0)
        params = [p for _, p in named]
        object.__setattr__(self, "_params", params)
        object.__setattr__(self, "_layout", None)  # the gradient slots the buckets were made for
        self._set_buckets(_make_buckets(params, self._cap_bytes(), [None] * len(params)))
        object.__setattr__(self, "_next", 0)  # the first bucket not started in this backward
        object.__setattr__(self, "_armed", None)  # the backward pass (_engine.backward_pass) being synced
        object.__setattr__(
            self, "_handles", [p.register_post_accumulate_grad_hook(self._grad_ready) for _, p in named]
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _cap_bytes(self) -> int:
        return max(1, int(self.bucket_cap_mb * 2**20))

    def _set_buckets(self, buckets: list[_Bucket]) -> None:
        object.__setattr__(self, "_buckets", buckets)
        object.__setattr__(self, "_bucket_of", {id(p): b for b in buckets for p in b.params})

    def _check_layout(self) -> None:
        """Rebuild the buckets along the optimizer's flat gradient buffers when those appeared or
        moved since (NOTE [ Gradient buckets ]); the same on every rank running the same program."""
        layout = _slot_layout(self._params)
        if layout != self._layout:
            object.__setattr__(self, "_layout", layout)
            self._set_buckets(_make_buckets(self._params, self._cap_bytes(), layout))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate gradients on this rank only, without communication (as
        PyTorch's): the first backward after the block averages what was accumulated."""
        saved = self.require_backward_grad_sync
        object.__setattr__(self, "require_backward_grad_sync", False)
        try:
            yield
        finally:
            object.__setattr__(self, "require_backward_grad_sync", saved)

    # -- during the backward

    def _grad_ready(self, param: Any) -> None:
        if not self.require_backward_grad_sync:
            return
        if self._armed != backward_pass():
            if self._armed is not None:  # that backward raised before its end: drop what it left
                self._reset(wait=True)
            object.__setattr__(self, "_armed", backward_pass())
            queue_callback(self._finish)
            self._check_layout()
        bucket = self._bucket_of[id(param)]
        bucket.ready += 1
        for b in self._buckets[: self._next]:  # lets MPI progress what is in flight (no progress thread)
            if b.work is not None:
                b.work.is_completed()
        buckets = self._buckets
        while self._next < len(buckets) and buckets[self._next].ready == len(buckets[self._next].params):
            self._start(buckets[self._next])
            object.__setattr__(self, "_next", self._next + 1)

    def _start(self, bucket: _Bucket) -> None:
        dist = _distributed()
        for p in bucket.params:
            if grad_data(p) is None:  # unused on this rank: a zero gradient, so that every rank steps it
                _zero_grad_of(p)
        view = bucket.in_place_view()
        if view is None:
            view = bucket.stage_in()
            bucket.staged = view
        bucket.work = dist.all_reduce(view, op="avg", async_op=True)

    def _finish(self) -> None:
        """At the end of the backward: start what did not start, wait for everything."""
        buckets = self._buckets
        try:
            for bucket in buckets[self._next :]:
                self._start(bucket)
            for bucket in buckets:
                bucket.work.wait()
                if bucket.staged is not None:
                    bucket.stage_out()
        finally:
            self._reset(wait=False)

    def _reset(self, wait: bool) -> None:
        for bucket in self._buckets:
            if wait and bucket.work is not None:
                bucket.work.wait()
            bucket.ready, bucket.work, bucket.staged = 0, None, None
        object.__setattr__(self, "_next", 0)
        object.__setattr__(self, "_armed", None)

    def extra_repr(self) -> str:
        return f"buckets={len(self._buckets)}, bucket_cap_mb={self.bucket_cap_mb:g}"


def _zero_grad_of(p: Any) -> None:
    be = backend(p)
    slot = grad_slot(p)
    lent = slot.lend() if slot is not None and isinstance(data(p), np.ndarray) else None
    if lent is not None:
        lent.fill(0)
        set_grad(p, wrap(lent, be))
    else:
        set_grad(p, wrap(pool.zeros(be, p.shape, p.dtype), be))


def _root(array: np.ndarray) -> np.ndarray:
    return array.base if isinstance(array.base, np.ndarray) else array


def _slot_layout(params: list[Any]) -> tuple:
    """Per parameter, (which flat buffer, element offset) of its gradient slot, or None: the
    buffers numbered in order of first appearance, so that every rank computes the same tuple."""
    roots: dict[int, int] = {}
    layout = []
    for p in params:
        slot = grad_slot(p)
        if slot is None or slot.array.dtype not in _MPI_FLOATS:
            layout.append(None)
            continue
        root = _root(slot.array)
        offset = slot.array.__array_interface__["data"][0] - root.__array_interface__["data"][0]
        layout.append((roots.setdefault(id(root), len(roots)), offset // slot.array.itemsize))
    return tuple(layout)


def _make_buckets(params: list[Any], cap_bytes: int, layout: tuple | list) -> list[_Bucket]:
    """The buckets of NOTE [ Gradient buckets ]: the parameters with a gradient slot, per flat
    buffer from its end (its last parameter's gradient comes first), the others in reverse
    registration order per backend and dtype; cut at ``cap_bytes``; started in the order their
    gradients complete, which is by the earliest-registered parameter each holds, latest first."""
    runs: dict[Any, list[int]] = {}
    for i in range(len(params) - 1, -1, -1):
        where = layout[i]
        key = ("slot", where[0]) if where is not None else ("own", id(backend(params[i])), params[i].dtype)
        runs.setdefault(key, []).append(i)
    for key, members in runs.items():
        if key[0] == "slot":
            members.sort(key=lambda i: -layout[i][1])
    groups: list[list[int]] = []
    for members in runs.values():
        size = cap_bytes + 1
        for i in members:
            nbytes = params[i].size * params[i].dtype.itemsize
            if size + nbytes > cap_bytes:
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += nbytes
    groups.sort(key=lambda g: -min(g))
    return [_Bucket(k, [params[i] for i in g]) for k, g in enumerate(groups)]


def _check_same_model(dist: ModuleType, module: Module) -> None:
    """``RuntimeError`` on every rank naming the first parameter that differs from rank 0's."""
    mine = [(n, tuple(p.shape), str(p.dtype), bool(p.requires_grad)) for n, p in module.named_parameters()]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs == reference:
            continue
        for i in range(max(len(theirs), len(reference))):
            a = reference[i] if i < len(reference) else None
            b = theirs[i] if i < len(theirs) else None
            if a != b:
                raise RuntimeError(
                    f"DistributedDataParallel: the ranks' models differ at parameter {i}: rank 0 has "
                    f"{_describe(a)}, rank {rank} has {_describe(b)} (rank 0 has {len(reference)} "
                    f"parameters, rank {rank} {len(theirs)}); every rank must wrap the same model"
                )


def _describe(entry: tuple | None) -> str:
    if entry is None:
        return "no parameter there"
    name, shape, dtype, req = entry
    return f"{name!r} of shape {shape} and dtype {dtype}" + ("" if req else " (not requiring grad)")
