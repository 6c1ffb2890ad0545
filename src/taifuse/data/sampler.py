"""Samplers, as ``torch.utils.data``'s: which indices an epoch visits and in which order.

A sampler is an iterable of indices with ``__len__``; ``set_epoch(epoch)`` is the hook a sampler
whose order depends on the epoch (a distributed one) uses, and a no-op here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import numpy as np

from taifuse.data.dataset import as_generator

__all__ = ["BatchSampler", "DistributedSampler", "RandomSampler", "Sampler", "SequentialSampler"]


class Sampler:
    """Base class: ``__iter__`` yields indices, ``__len__`` counts them."""

    def __iter__(self) -> Iterator[int]:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def set_epoch(self, epoch: int) -> None:
        """Tell the sampler which epoch starts (for samplers whose order depends on it)."""
        self.epoch = epoch


class SequentialSampler(Sampler):
    """0, 1, ..., len(data_source) - 1."""

    def __init__(self, data_source: Sized) -> None:
        self.data_source = data_source

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.data_source)))

    def __len__(self) -> int:
        return len(self.data_source)


class RandomSampler(Sampler):
    """A random permutation of the indices each epoch (or ``num_samples`` draws with replacement).

    ``generator``: a ``numpy.random.Generator`` (each epoch continues its stream), an int seed, or
    None, in which case each epoch's permutation is seeded by a draw from taifuse's generator
    (``taifuse.manual_seed``), as PyTorch seeds from its default generator. NumPy's PCG64 gives the
    same permutation on every machine and backend.
    """

    def __init__(
        self,
        data_source: Sized,
        replacement: bool = False,
        num_samples: int | None = None,
        generator: Any = None,
    ) -> None:
        if not isinstance(replacement, bool):
            raise TypeError(f"replacement should be a boolean value, but got replacement={replacement!r}")
        if num_samples is not None and (
            isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples <= 0
        ):
            raise ValueError(
                f"num_samples should be a positive integer value, but got num_samples={num_samples!r}"
            )
        self.data_source, self.replacement, self._num_samples = data_source, replacement, num_samples
        self.generator = None if generator is None else as_generator(generator, "RandomSampler")

    @property
    def num_samples(self) -> int:
        return len(self.data_source) if self._num_samples is None else self._num_samples

    def indices(self) -> np.ndarray:
        """This epoch's indices as one int64 array (what ``__iter__`` yields)."""
        rng = as_generator(self.generator, "RandomSampler")
        n = len(self.data_source)
        if self.replacement:
            return rng.integers(0, n, size=self.num_samples, dtype=np.int64)
        reps = -(-self.num_samples // n) if n else 0
        return np.concatenate([rng.permutation(n) for _ in range(reps)] or [np.empty(0, np.int64)])[
            : self.num_samples
        ].astype(np.int64)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.num_samples


class BatchSampler(Sampler):
    """Groups ``sampler``'s indices into lists of ``batch_size``; the last, shorter one is dropped
    with ``drop_last``."""

    def __init__(self, sampler: Any, batch_size: int, drop_last: bool) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(
                f"batch_size should be a positive integer value, but got batch_size={batch_size!r}"
            )
        if not isinstance(drop_last, bool):
            raise TypeError(f"drop_last should be a boolean value, but got drop_last={drop_last!r}")
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        for index in self.sampler:
            batch.append(index)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def __len__(self) -> int:
        if self.drop_last:
            return len(self.sampler) // self.batch_size
        return (len(self.sampler) + self.batch_size - 1) // self.batch_size

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


class DistributedSampler(Sampler):
    """Each rank's share of an epoch, as ``torch.utils.data.DistributedSampler``.

    The epoch's indices (shuffled from ``(seed, epoch)`` when ``shuffle``: call :meth:`set_epoch`
    before each epoch, as with torch) are padded by repeating the first ones until they divide
    evenly (or, with ``drop_last``, cut to the largest multiple of ``num_replicas``); rank ``r``
    takes every ``num_replicas``-th from ``r``. The ranks' shares are disjoint and together cover
    the data set. Without shuffle the order is torch's exactly; with it the permutation is NumPy
    PCG64's, the same on every backend and machine (not torch's ``randperm``).

    ``num_replicas`` and ``rank`` default to ``taifuse.distributed``'s world size and rank (its
    process group must be initialized, as torch's).
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas is None or rank is None:
            from taifuse import distributed

            num_replicas = distributed.get_world_size() if num_replicas is None else num_replicas
            rank = distributed.get_rank() if rank is None else rank
        for name, value in (("num_replicas", num_replicas), ("rank", rank), ("seed", seed)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"DistributedSampler: {name} should be an int, got {value!r}")
        if num_replicas < 1:
            raise ValueError(f"DistributedSampler: num_replicas should be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"DistributedSampler: invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]"
            )
        self.dataset = dataset
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.epoch = 0
        n = len(dataset)
        if self.drop_last and n % self.num_replicas:
            self.num_samples = -(-(n - self.num_replicas) // self.num_replicas)
        else:
            self.num_samples = -(-n // self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        if self.shuffle:
            indices = np.random.Generator(np.random.PCG64([self.seed, self.epoch])).permutation(n)
        else:
            indices = np.arange(n)
        if not self.drop_last:
            padding = self.total_size - n
            if padding and n:
                indices = np.concatenate([indices, np.resize(indices, padding)])
        else:
            indices = indices[: self.total_size]
        return iter(indices[self.rank : self.total_size : self.num_replicas].tolist())

    def __len__(self) -> int:
        return self.num_samples
