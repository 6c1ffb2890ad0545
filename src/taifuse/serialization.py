"""``taifuse.save`` and ``taifuse.load``: checkpoints that cannot run code.

``save(obj, path)`` writes nested dicts, lists and tuples of NumPy arrays, Tensors, numbers,
strings and None (a model's and an optimizer's ``state_dict``, a GradScaler's, the step and the
config) in the `safetensors <https://huggingface.co/docs/safetensors>`_ format: the arrays as the
file's tensors, the structure that holds them as JSON in the header's metadata. ``load(path)``
reads it back with ``json`` and the ``safetensors`` parser; nothing is unpickled, so opening a
checkpoint someone sent you runs none of its content. ``safetensors`` (the ``safetensors`` extra)
is imported on first use.

# NOTE [ Checkpoint format ]
# The header's ``__metadata__`` holds three strings: "format" ("taifuse"), "taifuse.structure"
# (the object as JSON, below) and "taifuse.sha256" (a digest of the structure and of every
# tensor's name, dtype, shape and bytes). JSON keeps None, bools, ints of any size, strings and
# finite floats as themselves (a float keeps its exact value through repr); everything else is
# an object with one tag key: {"float": "nan"|"inf"|"-inf"}, {"list": [...]}, {"tuple": [...]},
# {"dict": [[key, value], ...]} (keys of any scalar kind, in order: an optimizer's state is keyed
# by int), {"array": name}, {"scalar": name} (a NumPy scalar, stored 0-d) and
# {"tensor": name, "requires_grad": bool}. Arrays are stored in their own dtype, so every dtype
# round-trips bit for bit (the bfloat16 optimizer state is its uint16 bit patterns, stored U16).
# The digest makes an edited file (a flipped byte in a tensor, a changed number in the structure)
# fail to load instead of loading other values; safetensors' own parser refuses a truncated file.

Example::

    >>> import numpy as np, os, tempfile, taifuse
    >>> path = os.path.join(tempfile.mkdtemp(), "run.safetensors")
    >>> taifuse.save({"step": 3, "w": np.arange(4, dtype=np.float32)}, path)
    >>> state = taifuse.load(path)
    >>> state["step"], state["w"]
    (3, array([0., 1., 2., 3.], dtype=float32))
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from taifuse.tensor import Tensor

__all__ = ["load", "save"]

FORMAT = "taifuse"
_STRUCTURE_KEY = "taifuse.structure"
_DIGEST_KEY = "taifuse.sha256"
# The dtypes safetensors stores (its numpy loader's table, bfloat16 aside: NumPy has none).
_DTYPES = frozenset(
    np.dtype(t)
    for t in (np.float64, np.float32, np.float16, np.int64, np.uint64, np.int32, np.uint32, np.int16)
    + (np.uint16, np.int8, np.uint8, np.bool_)
)


class _Writer:
    """Turns an object into its JSON structure, collecting its arrays under unique names."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}
        self._open: set[int] = set()  # the containers on the path being encoded (a cycle check)

    def encode(self, value: Any, where: str) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return int(value)  # an IntEnum or bool subclass aside, a plain int
        if isinstance(value, float):
            return float(value) if math.isfinite(value) else {"float": repr(float(value))}
        if isinstance(value, Tensor):
            return {"tensor": self._array(value.numpy(), where), "requires_grad": value.requires_grad}
        if isinstance(value, np.ndarray):
            return {"array": self._array(value, where)}
        if isinstance(value, np.generic):
            return {"scalar": self._array(np.asarray(value), where)}
        if isinstance(value, (Mapping, list, tuple)):
            if id(value) in self._open:
                raise ValueError(f"save: obj{where} contains itself")
            self._open.add(id(value))
            try:
                if isinstance(value, Mapping):
                    return {
                        "dict": [
                            [self._key(k, where), self.encode(v, f"{where}[{k!r}]")] for k, v in value.items()
                        ]
                    }
                items = [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
                return {"tuple" if isinstance(value, tuple) else "list": items}
            finally:
                self._open.discard(id(value))
        raise TypeError(
            f"save: obj{where} is a {type(value).__module__}.{type(value).__qualname__}; a checkpoint holds "
            "dicts, lists and tuples of arrays, Tensors, numbers, strings and None"
        )

    def _key(self, key: Any, where: str) -> Any:
        if key is None or isinstance(key, (bool, int, float, str)):
            return self.encode(key, where)
        raise TypeError(
            f"save: a key of obj{where} is a {type(key).__qualname__} ({key!r}); keys should be str, int, "
            "float, bool or None"
        )

    def _array(self, arr: np.ndarray, where: str) -> str:
        if arr.dtype.newbyteorder("=") not in _DTYPES:
            raise TypeError(
                f"save: obj{where} has dtype {arr.dtype}, which safetensors cannot store "
                f"(it takes {', '.join(sorted(str(d) for d in _DTYPES))})"
            )
        name = where.lstrip("[").replace("][", ".").rstrip("]").replace("'", "") or "obj"
        unique, n = name, 1
        while unique in self.arrays:
            unique, n = f"{name}#{n}", n + 1
        # NOTE: not np.ascontiguousarray, which turns a 0-d array (a NumPy scalar) into a 1-d one.
        self.arrays[unique] = np.require(
            arr.astype(arr.dtype.newbyteorder("<"), copy=False), requirements="C"
        )
        return unique


def _digest(structure: str, arrays: Mapping[str, np.ndarray]) -> str:
    h = hashlib.sha256(structure.encode())
    for name in sorted(arrays):
        arr = arrays[name]
        h.update(json.dumps([name, arr.dtype.str, list(arr.shape)]).encode())
        h.update(np.require(arr, requirements="C").reshape(-1).view(np.uint8).data)
    return h.hexdigest()


def save(obj: Any, path: str | os.PathLike) -> None:
    """Write ``obj`` to ``path`` in the safetensors format (NOTE [ Checkpoint format ]).

    Args:
        obj: nested dicts, lists and tuples of NumPy arrays, Tensors (stored as their values and
            ``requires_grad``), NumPy scalars, Python numbers, strings and None. Dict keys may be
            str, int, float, bool or None.
        path: the file to write. It is written to ``path + '.tmp'`` and then renamed, so an
            interrupted save leaves the previous file whole.

    Anything else in ``obj`` (an object, a set, an array of strings) raises ``TypeError`` naming
    where it sits, before anything is written.
    """
    from safetensors.numpy import save_file

    target = _path(path, "save")
    writer = _Writer()
    structure = json.dumps(writer.encode(obj, ""), allow_nan=False, separators=(",", ":"))
    metadata = {"format": FORMAT, _STRUCTURE_KEY: structure, _DIGEST_KEY: _digest(structure, writer.arrays)}
    tmp = target + ".tmp"
    try:
        save_file(writer.arrays, tmp, metadata=metadata)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(path: str | os.PathLike) -> Any:
    """Read what :func:`save` wrote to ``path``; nothing is unpickled or executed.

    Arrays come back as NumPy arrays (copies, not views of the file), Tensors as Tensors on the
    active backend with their ``requires_grad``, tuples as tuples, dicts with their keys' types and
    order. A safetensors file that another program wrote (no taifuse structure) loads as
    ``{name: array}``.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: naming ``path``, when the file is not safetensors (a pickle, say), is
            truncated, or was edited after it was saved (its digest does not match). The whole file
            is read and checked before any Tensor is made, so nothing is returned half-loaded.
    """
    import safetensors

    target = _path(path, "load")
    if not os.path.isfile(target):
        raise FileNotFoundError(f"load: no file {target!r}")
    try:
        with safetensors.safe_open(target, framework="np") as f:
            metadata = f.metadata() or {}
            arrays = {name: np.array(f.get_tensor(name)) for name in f.keys()}  # noqa: SIM118 (a safe_open is not iterable); copies, not file views
    except (safetensors.SafetensorError, ValueError, KeyError, TypeError, OverflowError, OSError) as exc:
        raise ValueError(f"load: {target!r} is not a readable safetensors file ({exc})") from None
    if _STRUCTURE_KEY not in metadata:
        return arrays
    structure = metadata[_STRUCTURE_KEY]
    if metadata.get(_DIGEST_KEY) != _digest(structure, arrays):
        raise ValueError(
            f"load: {target!r} does not match the digest saved with it: the file was changed after it was saved"
        )
    try:
        tree = json.loads(structure)
        used: set[str] = set()
        decoded = _decode(tree, arrays, used)
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise ValueError(f"load: {target!r} has a structure this version cannot read ({exc})") from None
    if used != set(arrays):
        raise ValueError(
            f"load: {target!r} holds arrays its structure does not use: {sorted(set(arrays) - used)}"
        )
    return _make_tensors(decoded)


class _TensorValue:
    """A Tensor to be made once the whole file has been read and checked."""

    def __init__(self, array: np.ndarray, requires_grad: bool) -> None:
        self.array, self.requires_grad = array, requires_grad


def _decode(node: Any, arrays: Mapping[str, np.ndarray], used: set[str]) -> Any:
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, dict) and len(node) in (1, 2):
        tag = next(iter(node))
        body = node[tag]
        if tag == "float" and len(node) == 1 and body in ("nan", "inf", "-inf"):
            return float(body)
        if tag in ("list", "tuple") and len(node) == 1 and isinstance(body, list):
            items = [_decode(v, arrays, used) for v in body]
            return items if tag == "list" else tuple(items)
        if tag == "dict" and len(node) == 1 and isinstance(body, list):
            out = {}
            for pair in body:
                key, value = pair  # ValueError unless a pair
                key = _decode(key, arrays, used)
                if isinstance(key, (np.ndarray, list, tuple, dict, _TensorValue)):
                    raise TypeError(f"a dict key is a {type(key).__name__}")
                out[key] = _decode(value, arrays, used)
            return out
        if tag in ("array", "scalar") and len(node) == 1:
            used.add(body)
            return arrays[body] if tag == "array" else arrays[body][()]
        if tag == "tensor" and node.keys() == {"tensor", "requires_grad"}:
            used.add(body)
            return _TensorValue(arrays[body], bool(node["requires_grad"]))
    raise ValueError(f"unknown node {str(node)[:80]}")


def _make_tensors(value: Any) -> Any:
    if isinstance(value, _TensorValue):
        return Tensor(value.array, requires_grad=value.requires_grad)
    if isinstance(value, dict):
        return {k: _make_tensors(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_make_tensors(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_make_tensors(v) for v in value)
    return value


def _path(path: Any, op: str) -> str:
    try:
        target = os.fspath(path)
    except TypeError:
        raise TypeError(f"{op}: path should be a str or os.PathLike, got {type(path).__name__}") from None
    if not isinstance(target, str):
        raise TypeError(f"{op}: path should be a str or os.PathLike of str, got {type(target).__name__}")
    return target
