"""Samplers, as ``torch.utils.data``'s: which indices an epoch visits and in which order.

A sampler is an iterable of indices with ``__len__``; ``set_epoch(epoch)`` is the hook a sampler
whose order depends on the epoch (a distributed one) uses, and a no-op here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import numpy as np

from taifuse.data.dataset import as_generator

__all__ = ["BatchSampler", "RandomSampler", "Sampler", "SequentialSampler"]


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
