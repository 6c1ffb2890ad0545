"""``taifuse.data``: data sets and a prefetching ``DataLoader``, with ``torch.utils.data``'s names
and iteration semantics.

``Dataset``, ``TensorDataset``, ``Subset``, ``random_split``; ``ArrayDataset`` over memory-mapped
``.npy`` files (written by ``save_arrays``); ``Sampler``, ``SequentialSampler``,
``RandomSampler``, ``BatchSampler``, ``DistributedSampler``; ``DataLoader`` and ``default_collate``. docs/data.md is the
guide.
"""

from taifuse.data.dataset import ArrayDataset, Dataset, Subset, TensorDataset, random_split, save_arrays
from taifuse.data.loader import DataLoader, default_collate
from taifuse.data.sampler import BatchSampler, DistributedSampler, RandomSampler, Sampler, SequentialSampler

__all__ = [
    "ArrayDataset",
    "BatchSampler",
    "DataLoader",
    "Dataset",
    "DistributedSampler",
    "RandomSampler",
    "Sampler",
    "SequentialSampler",
    "Subset",
    "TensorDataset",
    "default_collate",
    "random_split",
    "save_arrays",
]
