"""Data sets: ``Dataset``, ``TensorDataset``, ``Subset``, ``random_split`` (``torch.utils.data``'s),
and ``ArrayDataset`` over memory-mapped ``.npy`` files with :func:`save_arrays` to write them.

# NOTE [ Batched gathering ]
# A data set that holds arrays (TensorDataset, ArrayDataset, a Subset of one) has
# ``get_batch(indices)``: the whole batch as one tuple of arrays, one fancy index per array, not
# one ``__getitem__`` call per sample. The DataLoader uses it when it collates with its default
# (a user's ``collate_fn`` gets the list of samples, as PyTorch's does). A memory-mapped array is
# read at the batch's indices in increasing order (sorted, then put back in the sampler's order
# in memory), so a shuffled batch reads the file forwards instead of seeking back and forth.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from taifuse.tensor import Tensor

_FAULT_AROUND = 64 << 10

__all__ = ["ArrayDataset", "Dataset", "Subset", "TensorDataset", "random_split", "save_arrays"]


class Dataset:
    """A map-style data set, as ``torch.utils.data.Dataset``: ``dataset[i]`` is sample ``i`` and
    ``len(dataset)`` the number of samples. Subclasses define ``__getitem__`` and ``__len__``, and
    may define ``get_batch(indices)`` (NOTE [ Batched gathering ])."""

    def __getitem__(self, index: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} should define __getitem__")

    def __len__(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} should define __len__")


def _host(value: Any, name: str) -> np.ndarray:
    if isinstance(value, Tensor):
        return value.numpy()
    if isinstance(value, np.ndarray):
        return value
    raise TypeError(f"{name} should be a Tensor or numpy.ndarray, got {type(value).__name__}")


def _gather(array: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """``array[indices]`` in one fancy index; from a memory map, read in increasing index order."""
    if isinstance(array, np.memmap) and len(indices) > 1:
        order = np.argsort(indices, kind="stable")
        rows = np.asarray(array[indices[order]])
        out = np.empty_like(rows)
        out[order] = rows
        return out
    return np.asarray(array[indices])


class TensorDataset(Dataset):
    """Samples are the rows of equally long arrays, as ``torch.utils.data.TensorDataset``:
    ``dataset[i] == (a[i], b[i], ...)``.

    Args:
        *tensors: NumPy arrays or Tensors (kept as host arrays), the same length along dim 0.

    Example::

        >>> import numpy as np
        >>> from taifuse.data import TensorDataset
        >>> ds = TensorDataset(np.arange(6).reshape(3, 2), np.array([7, 8, 9]))
        >>> len(ds), ds[1]
        (3, (array([2, 3]), np.int64(8)))
    """

    def __init__(self, *tensors: Any) -> None:
        arrays = tuple(_host(t, f"tensors[{i}]") for i, t in enumerate(tensors))
        if not arrays:
            raise ValueError("TensorDataset needs at least one array")
        if any(a.ndim == 0 for a in arrays):
            raise ValueError("TensorDataset: every array should have a first dimension (no 0-d arrays)")
        if any(len(a) != len(arrays[0]) for a in arrays):
            raise ValueError(f"Size mismatch between tensors: first dimensions {[len(a) for a in arrays]}")
        self.tensors = arrays

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        return tuple(a[index] for a in self.tensors)

    def __len__(self) -> int:
        return len(self.tensors[0])

    def get_batch(self, indices: np.ndarray) -> tuple[np.ndarray, ...]:
        """The samples at ``indices`` stacked: one fancy index per array (NOTE [ Batched gathering ])."""
        return tuple(_gather(a, indices) for a in self.tensors)


class ArrayDataset(TensorDataset):
    """A :class:`TensorDataset` over ``.npy`` files opened with ``np.load(mmap_mode="r")``: only
    the rows a batch reads are brought into memory, so a data set larger than memory trains with
    resident memory bounded by the loader's prefetch queue.

    Args:
        *paths: ``.npy`` files (as :func:`save_arrays` writes) of arrays with the same length.
        max_resident_bytes: after batches have read this many bytes, the mapped pages are given
            back to the system, so the file's share of resident memory stays about this size
            (None: left to the kernel, which keeps them until it needs the memory).

    Example::

        >>> import numpy as np, tempfile
        >>> from taifuse.data import ArrayDataset, save_arrays
        >>> paths = save_arrays(tempfile.mkdtemp(), x=np.ones((4, 3), np.float32), y=np.arange(4))
        >>> ds = ArrayDataset(paths["x"], paths["y"])
        >>> len(ds), ds.get_batch(np.array([3, 0]))[1]
        (4, array([3, 0]))
    """

    def __init__(self, *paths: str | os.PathLike, max_resident_bytes: int | None = 64 << 20) -> None:
        if max_resident_bytes is not None and (
            isinstance(max_resident_bytes, bool)
            or not isinstance(max_resident_bytes, int)
            or max_resident_bytes <= 0
        ):
            raise ValueError(
                f"ArrayDataset: max_resident_bytes should be a positive int or None, got {max_resident_bytes!r}"
            )
        self.max_resident_bytes = max_resident_bytes
        self._read_since_release = 0
        if not paths:
            raise ValueError("ArrayDataset needs at least one .npy path")
        arrays = []
        for i, path in enumerate(paths):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"ArrayDataset: paths[{i}] {os.fspath(path)!r} is not a file")
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
            if not isinstance(arr, np.memmap):
                raise ValueError(  # noqa: TRY004 (a wrong file, not a wrong argument type)
                    f"ArrayDataset: paths[{i}] {os.fspath(path)!r} is not a .npy array file"
                )
            arrays.append(arr)
        self.paths = tuple(os.fspath(p) for p in paths)
        super().__init__(*arrays)

    def get_batch(self, indices: np.ndarray) -> tuple[np.ndarray, ...]:
        batch = super().get_batch(indices)
        if self.max_resident_bytes is not None:
            # A page fault on a file mapping maps the pages around it too (Linux's fault-around,
            # 64 KiB by default): count at least that much per row read.
            self._read_since_release += sum(len(indices) * max(a[:1].nbytes, _FAULT_AROUND) for a in batch)
            if self._read_since_release > self.max_resident_bytes:
                self._read_since_release = 0
                self._release()
        return batch

    def _release(self) -> None:
        # NOTE: the pages of a file mapping a batch touched stay in this process's resident set
        # until the kernel needs the memory; dropping them (MADV_DONTNEED: clean file pages, read
        # again from the page cache or the file on the next touch) keeps the resident set bounded
        # by max_resident_bytes plus the batches in flight. numpy.memmap keeps its mmap in _mmap.
        for arr in self.tensors:
            mapping = getattr(arr, "_mmap", None)
            if mapping is not None and hasattr(mapping, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
                mapping.madvise(mmap.MADV_DONTNEED)


def save_arrays(directory: str | os.PathLike, **arrays: Any) -> dict[str, str]:
    """Write each array to ``directory/<name>.npy`` (for :class:`ArrayDataset`); returns the paths.

    An array may be a NumPy array, a Tensor, or an iterable of chunks (arrays with the same
    trailing shape and dtype, concatenated along dim 0) so that a data set larger than memory can
    be written a chunk at a time: the chunks are written as they come and the header is fixed at
    the end.
    """
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"save_arrays: directory {os.fspath(directory)!r} does not exist")
    paths = {}
    for name, value in arrays.items():
        path = os.path.join(os.fspath(directory), f"{name}.npy")
        if isinstance(value, (np.ndarray, Tensor)):
            np.save(path, _host(value, name), allow_pickle=False)
        else:
            _save_chunks(path, name, value)
        paths[name] = path
    return paths


def _save_chunks(path: str, name: str, chunks: Any) -> None:
    first = None
    rows = 0
    # The header is written with a generous fixed size, then rewritten in place with the real shape.
    header_len = 128
    with open(path, "wb") as f:
        f.write(b"\0" * header_len)
        for chunk in chunks:
            chunk = np.ascontiguousarray(_host(chunk, f"a chunk of {name}"))
            if first is None:
                first = chunk
            elif chunk.dtype != first.dtype or chunk.shape[1:] != first.shape[1:]:
                raise ValueError(
                    f"save_arrays: chunks of {name} should share dtype and trailing shape: "
                    f"{first.dtype}{first.shape[1:]} then {chunk.dtype}{chunk.shape[1:]}"
                )
            f.write(chunk.tobytes())
            rows += len(chunk)
        if first is None:
            raise ValueError(f"save_arrays: {name} has no chunks")
        header = {"descr": np.lib.format.dtype_to_descr(first.dtype), "fortran_order": False,
                  "shape": (rows, *first.shape[1:])}  # fmt: skip
        text = repr(header).encode("latin1")
        prefix = b"\x93NUMPY\x01\x00"
        pad = header_len - len(prefix) - 2 - len(text) - 1
        if pad < 0:
            raise ValueError(f"save_arrays: the shape of {name} does not fit the header")
        f.seek(0)
        f.write(prefix + (header_len - len(prefix) - 2).to_bytes(2, "little") + text + b" " * pad + b"\n")


class Subset(Dataset):
    """The samples of ``dataset`` at ``indices``, as ``torch.utils.data.Subset``."""

    def __init__(self, dataset: Any, indices: Sequence[int]) -> None:
        self.dataset = dataset
        self.indices = indices

    def __getitem__(self, index: int) -> Any:
        return self.dataset[self.indices[index]]

    def __len__(self) -> int:
        return len(self.indices)

    def get_batch(self, indices: np.ndarray) -> Any:
        """The wrapped data set's batch at these positions of ``indices`` (where it has ``get_batch``)."""
        return self.dataset.get_batch(np.asarray(self.indices, dtype=np.int64)[indices])


def random_split(dataset: Any, lengths: Sequence[int | float], generator: Any = None) -> list[Subset]:
    """Split ``dataset`` into non-overlapping random :class:`Subset` s of ``lengths``, as
    ``torch.utils.data.random_split``: counts that sum to ``len(dataset)``, or fractions that sum
    to 1 (each floored, the remainder given out one by one from the first).

    ``generator`` is a ``numpy.random.Generator`` or an int seed (the split is then the same on
    every machine); None draws the seed from taifuse's generator (``taifuse.manual_seed``).
    """
    n = len(dataset)
    lengths = list(lengths)
    if all(isinstance(x, float) for x in lengths) and math.isclose(sum(lengths), 1.0) and sum(lengths) <= 1:
        counts = [math.floor(n * frac) for frac in lengths]
        for i in range(n - sum(counts)):
            counts[i % len(counts)] += 1
        lengths = counts
    if any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 0 for x in lengths):
        raise ValueError(
            f"random_split: lengths should be non-negative ints or fractions summing to 1, got {lengths}"
        )
    if sum(lengths) != n:
        raise ValueError(
            f"random_split: sum of input lengths {sum(lengths)} does not equal the dataset's length {n}"
        )
    order = as_generator(generator, "random_split").permutation(n)
    out, start = [], 0
    for length in lengths:
        out.append(Subset(dataset, order[start : start + length].tolist()))
        start += length
    return out


def as_generator(generator: Any, where: str) -> np.random.Generator:
    """``generator`` as a NumPy Generator: itself, one seeded by an int, or one seeded from taifuse's."""
    if generator is None:
        from taifuse._random import next_seed

        return np.random.default_rng(next_seed())
    if isinstance(generator, np.random.Generator):
        return generator
    if isinstance(generator, (int, np.integer)) and not isinstance(generator, bool) and generator >= 0:
        return np.random.default_rng(int(generator))
    raise TypeError(
        f"{where}: generator should be a numpy.random.Generator or an int seed, got {generator!r}"
    )
