"""Processes that train together, on MPI (through ``mpi4py``): torch.distributed's names.

Launch one process per share of the work with the MPI launcher (``mpiexec -n 2 python train.py``;
on several machines ``mpiexec -hosts a,b -n 4 python train.py``, docs/distributed.md); each calls
:func:`init_process_group` and reads its :func:`get_rank` and :func:`get_world_size` from the
launcher. Run without a launcher, the world is one process, and every collective is a no-op
(``"avg"`` divides by one), so the same script runs alone.

The collectives work in place on a host array (NumPy, or a Tensor of the numpy or numba backend)
or a Taichi device array (or Tensor), which is staged through a pooled host buffer (no new buffer
per call once the pool holds one of that size). ``mpi4py`` is an optional dependency
(``pip install 'taifuse[distributed]'``, which brings MPICH too); ``import taifuse`` never imports
it. :class:`taifuse.nn.parallel.DistributedDataParallel` builds data-parallel training on this.

NOTE [ A rank that raises ]
A collective waits for every rank: a rank that dies with an exception would leave the others
waiting forever. So :func:`init_process_group` (in a world of more than one) installs an exception
hook that prints the traceback and calls ``MPI_Abort`` on the world, which ends every rank, and the
launcher exits non-zero. :func:`destroy_process_group` restores the previous hook.

NOTE [ Threads per rank ]
Each library sizes its thread pool to the machine's cores (Numba, OpenBLAS), so N ranks on one
host each start as many threads as there are cores: N times too many, and spinning OpenMP and
OpenBLAS workers then take the cores from the ranks' own work. Measured on a 2-core machine (loaded,
shared), 2 ranks of the GPT example took ~1.8-2.1 s per DDP step with the pools at their defaults
against ~0.23-0.36 s with one thread each, and ~5x the CPU time. ``torchrun`` sets
``OMP_NUM_THREADS=1`` for the same reason; the MPI launcher does nothing of the kind. So
:func:`init_process_group`, when the world has more than one rank and none of the thread variables
(:data:`THREAD_VARIABLES`) is set, gives each rank ``max(1, usable CPUs // ranks on this host)``
threads: it sets the variables (for the libraries loaded later, as torchrun does), limits the
Numba and BLAS pools already loaded (threadpoolctl), and says so in a ``RuntimeWarning`` on rank 0.
Set any of the variables to choose for yourself: then nothing is changed.
"""

from __future__ import annotations

import os
import sys
import warnings
from types import ModuleType
from typing import Any

import numpy as np

try:
    import mpi4py
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "taifuse.distributed needs mpi4py and an MPI library: pip install 'taifuse[distributed]' "
        "(mpi4py and mpich)"
    ) from error

from taifuse import pool
from taifuse._internal import data, is_tensor

__all__ = [
    "ReduceOp",
    "Work",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "broadcast",
    "destroy_process_group",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_initialized",
]


class ReduceOp:
    """The reductions :func:`all_reduce` knows, as strings (torch's ``ReduceOp`` names, lower case)."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"


_OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX)
# What MPI reduces natively; float16 is reduced in float32 (MPI has no standard float16 type).
_MPI_DTYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64))

# The variables that say the user chose the thread counts (NOTE [ Threads per rank ]).
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")

_group: dict[str, Any] = {}  # "comm", "rank", "world", "hook": while initialized


def is_initialized() -> bool:
    """Whether :func:`init_process_group` ran (and :func:`destroy_process_group` did not since)."""
    return bool(_group)


def init_process_group(backend: str | None = None) -> None:
    """Join the processes the MPI launcher started (or a world of one without it).

    ``backend`` is ``None`` or ``"mpi"``, the one this module speaks (torch's argument name).
    ``RuntimeError`` when already initialized, as torch.
    """
    if backend not in (None, "mpi"):
        raise ValueError(f"init_process_group: backend should be None or 'mpi', got {backend!r}")
    if _group:
        raise RuntimeError("init_process_group: trying to initialize the default process group twice")
    mpi4py.rc.threads = False  # one thread calls MPI: no thread-level locking in the library
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    _group.update(comm=comm, rank=comm.Get_rank(), world=comm.Get_size(), hook=sys.excepthook, mpi=MPI)
    if _group["world"] > 1:
        sys.excepthook = _abort_on_exception  # NOTE [ A rank that raises ]
        _share_cores(comm, MPI)


def _share_cores(comm: Any, MPI: Any) -> None:
    """Cap each rank's threads at its share of the host's CPUs (NOTE [ Threads per rank ])."""
    if any(name in os.environ for name in THREAD_VARIABLES):
        return
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    ranks_here = local.Get_size()
    local.Free()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cpus // ranks_here)
    # The libraries loaded from now on (Numba, a second OpenBLAS that another package brings)
    # read the variables when they load; those already loaded are limited in place.
    os.environ.update({name: str(threads) for name in THREAD_VARIABLES})
    numba = sys.modules.get("numba")
    if numba is not None and numba.get_num_threads() > threads:
        numba.set_num_threads(threads)
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=threads, user_api="blas")
    if comm.Get_rank() == 0:
        warnings.warn(
            f"taifuse.distributed: {ranks_here} ranks share this host's {cpus} CPUs and no thread count "
            f"is set ({', '.join(THREAD_VARIABLES)}): each rank runs Numba and the BLAS on {threads} "
            "thread(s); set one of those variables to choose",
            RuntimeWarning,
            stacklevel=3,
        )


def _abort_on_exception(kind: type, value: BaseException, tb: Any) -> None:
    hook = _group.get("hook", sys.__excepthook__)
    hook(kind, value, tb)
    sys.stderr.flush()
    comm = _group.get("comm")
    if comm is not None:
        comm.Abort(1)


def destroy_process_group() -> None:
    """Leave the group: free its communicator and restore the exception hook (MPI itself is
    finalized when the process exits)."""
    _require("destroy_process_group")
    if sys.excepthook is _abort_on_exception:
        sys.excepthook = _group["hook"]
    _group["comm"].Free()
    _group.clear()


def _require(what: str) -> dict[str, Any]:
    if not _group:
        raise RuntimeError(
            f"{what}: the default process group has not been initialized: call init_process_group()"
        )
    return _group


def get_rank() -> int:
    """This process's rank, 0 to ``get_world_size() - 1``."""
    return _require("get_rank")["rank"]


def get_world_size() -> int:
    """The number of processes in the group."""
    return _require("get_world_size")["world"]


def barrier() -> None:
    """Wait until every rank has called ``barrier()``."""
    _require("barrier")["comm"].Barrier()


def _comm() -> Any:
    return _group["comm"]


def _mpi() -> ModuleType:
    return _group["mpi"]


# ----------------------------------------------------------------------------- staging


def _taichi_backend() -> ModuleType | None:
    """The taichi backend module when it was imported (a device array can only exist then)."""
    return sys.modules.get("taifuse.backends.taichi")


class _Staged:
    """The host buffer a collective works on for one array, and the way back into the array.

    A C-contiguous host array of an MPI dtype is used as it is; anything else (a strided NumPy
    array, float16, a Taichi device array) is copied into a pooled host buffer first and back
    afterwards (:meth:`finish`).
    """

    def __init__(self, array: Any, argname: str) -> None:
        if is_tensor(array):
            array = data(array)
        self.target = array
        if isinstance(array, np.ndarray):
            self.device = None
        else:
            taichi = _taichi_backend()
            if taichi is None or not taichi.is_array(array):
                raise TypeError(
                    f"{argname} should be a NumPy array, a Taichi device array or a Tensor, got {type(array).__name__}"
                )
            self.device = taichi
        if array.dtype.kind not in "fiu":
            raise TypeError(f"{argname} should hold numbers, got dtype {array.dtype}")
        work = np.dtype(np.float32) if array.dtype == np.float16 else array.dtype
        direct = self.device is None and work == array.dtype and array.flags.c_contiguous
        if direct:
            self.buf = array.reshape(-1)
            self.copied = False
            return
        self.buf = pool.host_pool().acquire((array.size,), work)
        self.copied = True
        if self.device is not None:
            if work == array.dtype:
                self.device.copy_to_host(array, self.buf)
            else:
                staged = pool.host_pool().acquire((array.size,), array.dtype)
                self.device.copy_to_host(array, staged)
                np.copyto(self.buf, staged)
        else:
            np.copyto(self.buf.reshape(array.shape), array, casting="unsafe")

    def finish(self) -> None:
        """Write the buffer back into the array (when it was staged)."""
        if not self.copied:
            return
        array = self.target
        if self.device is not None:
            src = self.buf if self.buf.dtype == array.dtype else self.buf.astype(array.dtype)
            self.device.copy_from_host(array, src)
        else:
            np.copyto(array, self.buf.reshape(array.shape), casting="unsafe")


def _mpi_op(op: str) -> Any:
    if op not in _OPS:
        raise ValueError(f"all_reduce: op should be one of {_OPS}, got {op!r}")
    MPI = _mpi()
    return MPI.MAX if op == ReduceOp.MAX else MPI.SUM


class Work:
    """A collective in flight (``all_reduce(..., async_op=True)``): :meth:`wait` completes it."""

    def __init__(self, request: Any, staged: _Staged, scale: float | None) -> None:
        self._request, self._staged, self._scale = request, staged, scale

    def is_completed(self) -> bool:
        return self._request is None or bool(self._request.Test())

    def wait(self) -> None:
        """Wait for the reduction and write the result into the array (idempotent)."""
        if self._request is None:
            return
        self._request.Wait()
        self._request = None
        if self._scale is not None:
            np.multiply(self._staged.buf, self._scale, out=self._staged.buf, casting="unsafe")
        self._staged.finish()


def all_reduce(array: Any, op: str = ReduceOp.SUM, async_op: bool = False) -> Work | None:
    """Reduce ``array`` over every rank, in place: each rank ends with the sum (``"sum"``), the
    mean (``"avg"``: the sum divided by the world size) or the elementwise maximum (``"max"``).

    ``array`` is a Tensor, a NumPy array or a Taichi device array of the same shape and dtype on
    every rank. With ``async_op=True`` returns a :class:`Work` whose ``wait()`` finishes it (the
    array must not be touched until then); else None. Integer arrays take ``"sum"`` and ``"max"``.
    """
    _require("all_reduce")
    mpi_op = _mpi_op(op)
    staged = _Staged(array, "all_reduce: array")
    if op == ReduceOp.AVG and staged.buf.dtype.kind != "f":
        raise TypeError(f"all_reduce: op='avg' needs a floating-point array, got {staged.buf.dtype}")
    scale = 1.0 / _group["world"] if op == ReduceOp.AVG else None
    MPI = _mpi()
    if _group["world"] == 1:
        request = None
    else:
        request = _comm().Iallreduce(MPI.IN_PLACE, staged.buf, mpi_op)
    work = Work(request, staged, scale)
    if request is None:
        if scale is not None and scale != 1.0:
            np.multiply(staged.buf, scale, out=staged.buf, casting="unsafe")
        staged.finish()
        return work if async_op else None
    if async_op:
        return work
    work.wait()
    return None


def broadcast(array: Any, src: int = 0) -> None:
    """Overwrite ``array`` on every rank with rank ``src``'s, in place."""
    world = _require("broadcast")["world"]
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world:
        raise ValueError(f"broadcast: src should be a rank in [0, {world}), got {src!r}")
    staged = _Staged(array, "broadcast: array")
    if world > 1:
        _comm().Bcast(staged.buf, root=src)
    staged.finish()


def all_gather(array_list: list[Any], array: Any) -> None:
    """Gather ``array`` of every rank into ``array_list`` (one array of ``array``'s shape and dtype
    per rank, written in place), as ``torch.distributed.all_gather``."""
    world = _require("all_gather")["world"]
    if not isinstance(array_list, (list, tuple)) or len(array_list) != world:
        raise ValueError(f"all_gather: array_list should be a list of {world} arrays (one per rank)")
    src = _Staged(array, "all_gather: array")
    n = src.buf.size
    outs = [_Staged(a, f"all_gather: array_list[{i}]") for i, a in enumerate(array_list)]
    for i, out in enumerate(outs):
        if out.buf.size != n or out.buf.dtype != src.buf.dtype:
            raise ValueError(
                f"all_gather: array_list[{i}] should have {n} elements of dtype {src.buf.dtype}, "
                f"got {out.buf.size} of {out.buf.dtype}"
            )
    gathered = pool.host_pool().acquire((world * n,), src.buf.dtype)
    if world > 1:
        _comm().Allgather(src.buf, gathered)
    else:
        np.copyto(gathered, src.buf)
    for i, out in enumerate(outs):
        np.copyto(out.buf, gathered[i * n : (i + 1) * n])
        out.finish()


def all_gather_object(object_list: list[Any], obj: Any) -> None:
    """Gather every rank's ``obj`` (a picklable object) into ``object_list`` (a list of
    ``get_world_size()`` entries, replaced in rank order), as ``torch.distributed.all_gather_object``."""
    world = _require("all_gather_object")["world"]
    if not isinstance(object_list, list) or len(object_list) != world:
        raise ValueError(f"all_gather_object: object_list should be a list of {world} entries (one per rank)")
    object_list[:] = _comm().allgather(obj)
