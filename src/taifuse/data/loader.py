"""``DataLoader``: batches of a data set, gathered ahead in background threads, as
``torch.utils.data.DataLoader`` iterates them.

# NOTE [ Loader threads ]
# With ``num_workers > 0`` the batches are gathered (and collated, and on the Taichi backend
# copied to the device) in threads: NumPy's fancy indexing, a memory map's reads and Taichi's
# copies release the GIL or are short, so the training step in the main thread runs while the next
# batches are made. The main thread hands out index batches in the sampler's order, at most
# ``num_workers * prefetch_factor`` ahead of the batch it is waiting for (PyTorch's bound), and
# yields results in that order whichever thread finishes first; so the batches are those of
# ``num_workers=0``, and at most that many batches exist beyond the one the step holds. A worker
# never touches the backend dispatcher (whose choice is per thread): the backend module is taken
# in the thread that starts the epoch and handed to the workers. On the Taichi backend the copy
# kernels are compiled in that thread before any worker starts (Taichi compiles one kernel at a
# time), and each batch lands in a device buffer from the pool, which the step hands back when it
# drops the batch, so nothing grows across epochs. An exception in a worker is raised in the
# training loop with the worker's traceback; leaving the loop early (``break``, an exception)
# drops the iterator, which stops and joins its threads.
"""

from __future__ import annotations

import collections.abc
import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any

import numpy as np

from taifuse import backends
from taifuse._internal import wrap
from taifuse.data.dataset import Subset
from taifuse.data.sampler import BatchSampler, RandomSampler, SequentialSampler
from taifuse.tensor import Tensor

__all__ = ["DataLoader", "default_collate"]


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"DataLoader: {name} should be a positive integer value, but got {name}={value!r}")
    return int(value)


class DataLoader:
    """Iterate over ``dataset`` in batches, as ``torch.utils.data.DataLoader``.

    Args:
        dataset: a map-style data set (``__getitem__`` and ``__len__``); one with ``get_batch``
            (:class:`TensorDataset`, :class:`ArrayDataset`) is gathered a batch at a time (NOTE
            [ Batched gathering ]).
        batch_size: samples per batch; None yields single samples (no batching).
        shuffle: a new random order each epoch (a :class:`RandomSampler` over ``generator``).
        sampler: the indices of an epoch, in order (exclusive with ``shuffle``).
        batch_sampler: the index batches of an epoch (exclusive with ``batch_size``, ``shuffle``,
            ``sampler`` and ``drop_last``).
        drop_last: drop the last batch when it is shorter than ``batch_size``.
        collate_fn: merges a list of samples into a batch. The default stacks arrays, numbers and
            Tensors into Tensors on the active backend (integers as int64, Python floats as
            float32), recursing into dicts, lists and tuples (a tuple becomes a list, as in PyTorch).
        num_workers: threads that gather batches ahead of the loop (0: in the loop's thread).
        prefetch_factor: batches each worker may hold ready ahead of the loop.
        generator: the shuffle's ``numpy.random.Generator`` or int seed (None: seeded from
            ``taifuse.manual_seed``'s generator each epoch).

    ``len(loader)`` is the number of batches of an epoch. Example::

        >>> import numpy as np, taifuse
        >>> from taifuse.data import DataLoader, TensorDataset
        >>> taifuse.set_backend("numpy")
        >>> ds = TensorDataset(np.arange(10, dtype=np.float32), np.arange(10))
        >>> loader = DataLoader(ds, batch_size=4)
        >>> len(loader), [y.numpy().tolist() for _, y in loader]
        (3, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]])
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool = False,
        sampler: Any = None,
        *,
        batch_sampler: Any = None,
        drop_last: bool = False,
        collate_fn: Callable[[list], Any] | None = None,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        generator: Any = None,
    ) -> None:
        if not isinstance(shuffle, bool):
            raise TypeError(f"DataLoader: shuffle should be a bool, got {shuffle!r}")
        if not isinstance(drop_last, bool):
            raise TypeError(f"DataLoader: drop_last should be a bool, got {drop_last!r}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, (int, np.integer)) or num_workers < 0:
            raise ValueError(
                "num_workers option should be non-negative; use num_workers=0 to disable worker threads, "
                f"got {num_workers!r}"
            )
        prefetch_factor = _positive_int(prefetch_factor, "prefetch_factor")
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"DataLoader: collate_fn should be callable, got {type(collate_fn).__name__}")
        if sampler is not None and shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ValueError(
                    "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last"
                )
            batch_size, drop_last = None, False
        elif batch_size is None:
            if drop_last:
                raise ValueError(
                    "batch_size=None option disables auto-batching and is mutually exclusive with drop_last"
                )
        else:
            batch_size = _positive_int(batch_size, "batch_size")
        if sampler is None:
            sampler = RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
        if batch_size is not None and batch_sampler is None:
            batch_sampler = BatchSampler(sampler, batch_size, drop_last)
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.collate_fn = collate_fn
        self.num_workers = int(num_workers)
        self.prefetch_factor = prefetch_factor
        self.generator = generator

    def __len__(self) -> int:
        return len(self.batch_sampler if self.batch_sampler is not None else self.sampler)

    def __iter__(self) -> Iterator[Any]:
        fetch = _Fetcher(self.dataset, self.batch_sampler is not None, self.collate_fn, backends.active())
        batches = iter(self.batch_sampler if self.batch_sampler is not None else self.sampler)
        if self.num_workers == 0:
            return (fetch(indices) for indices in batches)
        return _ThreadedIterator(fetch, batches, self.num_workers, self.prefetch_factor)


class _Fetcher:
    """Makes the batch of an index list: gathered, collated and put on the backend ``be``.

    Holds no reference to the iterator, so that dropping the iterator stops its threads."""

    def __init__(self, dataset: Any, batched: bool, collate_fn: Callable | None, be: ModuleType) -> None:
        self.dataset, self.batched, self.collate_fn, self.be = dataset, batched, collate_fn, be
        self.gather = collate_fn is None and batched and _has_get_batch(dataset)

    def __call__(self, indices: Any) -> Any:
        if not self.batched:
            sample = self.dataset[indices]
            return (
                _to_backend(_convert(sample), self.be) if self.collate_fn is None else self.collate_fn(sample)
            )
        if self.gather:
            got = self.dataset.get_batch(np.asarray(indices, dtype=np.int64))
            host = list(got) if isinstance(got, tuple) else got
            return _to_backend(host, self.be)
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(list(indices)) if getitems is not None else [self.dataset[i] for i in indices]
        if self.collate_fn is not None:
            return self.collate_fn(samples)
        return _to_backend(_collate(samples), self.be)

    def warm_up(self) -> None:
        """Compile the device copies in this thread before workers use them (NOTE [ Loader threads ])."""
        if self.be.NAME == "taichi":
            for dtype in (np.float32, np.float16, np.int64):
                _upload(np.zeros(1, dtype), self.be)


def _has_get_batch(dataset: Any) -> bool:
    if isinstance(dataset, Subset):
        return _has_get_batch(dataset.dataset)
    return callable(getattr(dataset, "get_batch", None))


# ----------------------------------------------------------------------------- collation


def _collate(batch: list) -> Any:
    """PyTorch's ``default_collate`` on host arrays (before they go to the backend)."""
    elem = batch[0]
    if isinstance(elem, Tensor):
        return np.stack([t.numpy() for t in batch])
    if isinstance(elem, np.ndarray):
        return np.stack(batch)
    if isinstance(elem, (bool, np.bool_)):
        return np.array(batch, dtype=np.int64)
    if isinstance(elem, np.generic):
        return np.array(batch, dtype=elem.dtype)
    if isinstance(elem, int):
        return np.array(batch, dtype=np.int64)
    if isinstance(elem, float):
        return np.array(batch, dtype=np.float32)
    if isinstance(elem, (str, bytes)):
        return batch
    if isinstance(elem, Mapping):
        return {key: _collate([d[key] for d in batch]) for key in elem}
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):  # a namedtuple keeps its type
        return type(elem)(*(_collate(list(samples)) for samples in zip(*batch)))
    if isinstance(elem, collections.abc.Sequence):
        if any(len(s) != len(elem) for s in batch):
            raise RuntimeError("each element in list of batch should be of equal size")
        return [_collate(list(samples)) for samples in zip(*batch)]
    raise TypeError(
        "default_collate: batch must contain Tensors, numpy arrays, numbers, dicts or lists; "
        f"found {type(elem).__name__}"
    )


def _convert(sample: Any) -> Any:
    """A single sample (``batch_size=None``) with its arrays as they are, Tensors on the host."""
    if isinstance(sample, Tensor):
        return sample.numpy()
    if isinstance(sample, Mapping):
        return {k: _convert(v) for k, v in sample.items()}
    if isinstance(sample, tuple) and not hasattr(sample, "_fields"):
        return [_convert(v) for v in sample]
    if isinstance(sample, list):
        return [_convert(v) for v in sample]
    return sample


def _upload(arr: np.ndarray, be: ModuleType) -> Tensor:
    """A Tensor on ``be`` holding ``arr`` (integers as int64, as ``taifuse.tensor``); on the
    Taichi backend a counted copy into a pooled device buffer."""
    if arr.dtype.kind in "biu":
        arr = arr.astype(np.int64, copy=False)
    elif arr.dtype.kind == "f":
        be.check_dtype(arr.dtype, "DataLoader batch")
    else:
        raise TypeError(f"DataLoader: a batch array should hold numbers, got dtype {arr.dtype}")
    if be.NAME == "taichi":
        from taifuse.backends.taichi._runtime import from_numpy_pooled

        return wrap(from_numpy_pooled(arr), be)
    return wrap(be.from_numpy(np.ascontiguousarray(arr) if arr.ndim else arr), be)


def _to_backend(tree: Any, be: ModuleType) -> Any:
    if isinstance(tree, np.ndarray):
        return _upload(tree, be)
    if isinstance(tree, dict):
        return {k: _to_backend(v, be) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_to_backend(v, be) for v in tree))
    if isinstance(tree, list):
        return [_to_backend(v, be) for v in tree]
    return tree


def default_collate(batch: list) -> Any:
    """Merge a list of samples into a batch of Tensors on the active backend, as PyTorch's
    ``default_collate``: arrays, Tensors and numbers are stacked (ints as int64, Python floats as
    float32), dicts and sequences collated per key and position (a tuple becomes a list),
    strings kept as lists.

    Example::

        >>> import numpy as np, taifuse
        >>> from taifuse.data import default_collate
        >>> taifuse.set_backend("numpy")
        >>> x, y = default_collate([(np.zeros(2, np.float32), 1), (np.ones(2, np.float32), 0)])
        >>> x.shape, y.numpy().tolist()
        ((2, 2), [1, 0])
    """
    if not isinstance(batch, collections.abc.Sequence) or len(batch) == 0:
        raise ValueError("default_collate: batch should be a non-empty list of samples")
    return _to_backend(_collate(list(batch)), backends.active())


# ----------------------------------------------------------------------------- worker threads


def _work(fetch: _Fetcher, tasks: queue.SimpleQueue, results: queue.SimpleQueue, worker_id: int) -> None:
    while True:
        task = tasks.get()
        if task is None:
            return
        seq, indices = task
        try:
            results.put((seq, True, fetch(indices)))
        except BaseException as exc:  # noqa: BLE001 (handed to the training loop, which raises it)
            if hasattr(exc, "add_note"):
                exc.add_note(
                    f"(raised in DataLoader worker thread {worker_id}; the frames above are the worker's)"
                )
            results.put((seq, False, exc))


class _ThreadedIterator:
    """One epoch over worker threads (NOTE [ Loader threads ])."""

    def __init__(self, fetch: _Fetcher, batches: Iterator, num_workers: int, prefetch_factor: int) -> None:
        fetch.warm_up()
        self._batches = batches
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._ready: dict[int, tuple[bool, Any]] = {}
        self._sent = self._received = 0
        self._exhausted = False
        self._threads = [
            threading.Thread(
                target=_work,
                args=(fetch, self._tasks, self._results, i),
                name=f"taifuse-DataLoader-{i}",
                daemon=True,
            )
            for i in range(num_workers)
        ]
        for thread in self._threads:
            thread.start()
        for _ in range(num_workers * prefetch_factor):
            self._send()

    def _send(self) -> None:
        if self._exhausted:
            return
        try:
            indices = next(self._batches)
        except StopIteration:
            self._exhausted = True
            return
        self._tasks.put((self._sent, indices))
        self._sent += 1

    def __iter__(self) -> _ThreadedIterator:
        return self

    def __next__(self) -> Any:
        if self._received == self._sent:
            self.close()
            raise StopIteration
        while self._received not in self._ready:
            seq, ok, value = self._results.get()
            self._ready[seq] = (ok, value)
        ok, value = self._ready.pop(self._received)
        self._received += 1
        if not ok:
            self.close()
            raise value
        self._send()
        return value

    def close(self) -> None:
        """Stop the workers (after the batch each is making) and join them."""
        if not self._threads:
            return
        self._exhausted = True
        while True:  # the batches not started yet are not made
            try:
                self._tasks.get_nowait()
            except queue.Empty:
                break
        for _ in self._threads:
            self._tasks.put(None)
        for thread in self._threads:
            thread.join()
        self._threads = []
        self._ready.clear()

    def __del__(self) -> None:
        self.close()
