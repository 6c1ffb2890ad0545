"""``Module`` and ``Parameter``: the container and the trainable tensor, as in ``torch.nn``."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from taifuse import _profile_hook
from taifuse.tensor import Tensor, no_grad


class Parameter(Tensor):
    """A Tensor that a :class:`Module` registers as trainable (``requires_grad=True`` by default)."""

    def __init__(self, data: Any, requires_grad: bool = True, dtype: Any = None) -> None:
        super().__init__(data, requires_grad=requires_grad, dtype=dtype)

    def __repr__(self) -> str:
        return "Parameter containing:\n" + super().__repr__()


class IncompatibleKeys(NamedTuple):
    """What :meth:`Module.load_state_dict` did not match (empty lists when everything did)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class Module:
    """Base class of layers and models.

    Assigning a :class:`Parameter` or a ``Module`` to an attribute registers it, in assignment
    order; ``named_parameters`` and ``state_dict`` name parameters by their dotted attribute path
    (``'0.weight'``), as PyTorch does, so names and layouts port. :meth:`register_buffer` adds
    state that is not trained (batch norm's running statistics): in ``state_dict`` after the
    module's parameters unless registered with ``persistent=False``.
    """

    training: bool

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_non_persistent_buffers", set())
        object.__setattr__(self, "training", True)

    # -- registration

    def __setattr__(self, name: str, value: Any) -> None:
        if "_parameters" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__}.__init__ should call super().__init__() first")
        params, modules = self.__dict__["_parameters"], self.__dict__["_modules"]
        buffers = self.__dict__["_buffers"]
        if name in buffers and (
            value is None or (isinstance(value, Tensor) and not isinstance(value, Parameter))
        ):
            buffers[name] = value  # assigning to a buffer's name replaces the buffer, as in PyTorch
            return
        buffers.pop(name, None)
        self._non_persistent_buffers.discard(name)
        params.pop(name, None)
        modules.pop(name, None)
        if isinstance(value, Parameter):
            params[name] = value
        elif isinstance(value, Module):
            modules[name] = value
        elif value is None and name in ("bias", "weight"):
            params[name] = None  # an absent optional parameter, as torch.nn.Linear(bias=False)
        else:
            object.__setattr__(self, name, value)
            return
        self.__dict__.pop(name, None)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: registered parameters and submodules.
        d = self.__dict__
        if name in d.get("_parameters", {}):
            return d["_parameters"][name]
        if name in d.get("_modules", {}):
            return d["_modules"][name]
        if name in d.get("_buffers", {}):
            return d["_buffers"][name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __delattr__(self, name: str) -> None:
        if name in self._parameters:
            del self._parameters[name]
        elif name in self._modules:
            del self._modules[name]
        elif name in self._buffers:
            del self._buffers[name]
            self._non_persistent_buffers.discard(name)
        else:
            object.__delattr__(self, name)

    def register_buffer(self, name: str, tensor: Tensor | None, persistent: bool = True) -> None:
        """Add a buffer: a Tensor that is module state but not a parameter (batch norm's running
        statistics), as ``torch.nn.Module.register_buffer``.

        It is reachable as an attribute, listed by :meth:`named_buffers`, and (when ``persistent``)
        saved and loaded by :meth:`state_dict` / :meth:`load_state_dict`. ``None`` registers an
        absent buffer. Assigning a Tensor to the name later replaces the buffer.

        Example::

            >>> import numpy as np, taifuse, taifuse.nn as nn
            >>> taifuse.set_backend("numpy")
            >>> m = nn.Linear(2, 2)
            >>> m.register_buffer("steps", taifuse.tensor(np.zeros(1, np.float32)))
            >>> m.register_buffer("cache", taifuse.tensor(np.zeros(2, np.float32)), persistent=False)
            >>> list(m.state_dict()), [name for name, _ in m.named_buffers()]
            (['weight', 'bias', 'steps'], ['steps', 'cache'])
        """
        if "_buffers" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__}.__init__ should call super().__init__() first")
        if not isinstance(name, str):
            raise TypeError(f"register_buffer: name should be a str, got {type(name).__name__}")
        if not name or "." in name:
            raise ValueError(f"register_buffer: name should be a non-empty str without '.', got {name!r}")
        if (
            name in self.__dict__ or name in self._parameters or name in self._modules
        ) and name not in self._buffers:
            raise KeyError(f"register_buffer: attribute {name!r} already exists")
        if tensor is not None and (not isinstance(tensor, Tensor) or isinstance(tensor, Parameter)):
            raise TypeError(
                f"register_buffer: buffer {name!r} should be a taifuse Tensor (not a Parameter) or None, "
                f"got {type(tensor).__name__}"
            )
        self._buffers[name] = tensor
        if persistent:
            self._non_persistent_buffers.discard(name)
        else:
            self._non_persistent_buffers.add(name)

    # -- traversal

    def named_children(self) -> Iterator[tuple[str, Module]]:
        """Direct submodules with their attribute names."""
        yield from self._modules.items()

    def children_by_name(self) -> Mapping[str, Module]:
        """Direct submodules by attribute name, the module's own mapping (read it, don't change
        it): :meth:`named_children` without a generator, for the profiler's per-call lookup."""
        return self._modules

    def children(self) -> Iterator[Module]:
        """Direct submodules."""
        for _, module in self.named_children():
            yield module

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        """This module and every submodule, depth first, with dotted names (``''`` for this one)."""
        stack = [(prefix, self)]
        seen: set[int] = set()
        while stack:
            name, module = stack.pop()
            if id(module) in seen:
                continue
            seen.add(id(module))
            yield name, module
            children = [(f"{name}.{n}" if name else n, m) for n, m in module._modules.items()]
            stack.extend(reversed(children))

    def modules(self) -> Iterator[Module]:
        """This module and every submodule."""
        for _, module in self.named_modules():
            yield module

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, Parameter]]:
        """Parameters with dotted names; a parameter shared by two modules is listed once."""
        seen: set[int] = set()
        modules = self.named_modules(prefix) if recurse else iter([(prefix, self)])
        for mod_name, module in modules:
            for name, param in module._parameters.items():
                if param is None or id(param) in seen:
                    continue
                seen.add(id(param))
                yield (f"{mod_name}.{name}" if mod_name else name), param

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        """Every parameter (each once)."""
        for _, param in self.named_parameters(recurse=recurse):
            yield param

    def named_buffers(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, Tensor]]:
        """Buffers with dotted names (persistent or not; absent ones skipped), each once."""
        seen: set[int] = set()
        modules = self.named_modules(prefix) if recurse else iter([(prefix, self)])
        for mod_name, module in modules:
            for name, buf in module._buffers.items():
                if buf is None or id(buf) in seen:
                    continue
                seen.add(id(buf))
                yield (f"{mod_name}.{name}" if mod_name else name), buf

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]:
        """Every buffer (each once)."""
        for _, buf in self.named_buffers(recurse=recurse):
            yield buf

    def _state_items(self) -> Iterator[tuple[str, Tensor, bool]]:
        # (name, tensor, is a buffer) in PyTorch's state_dict order: per module, depth first, its
        # parameters then its persistent buffers; a parameter shared by two modules once.
        seen: set[int] = set()
        for mod_name, module in self.named_modules():
            prefix = f"{mod_name}." if mod_name else ""
            for name, param in module._parameters.items():
                if param is None or id(param) in seen:
                    continue
                seen.add(id(param))
                yield prefix + name, param, False
            for name, buf in module._buffers.items():
                if buf is not None and name not in module._non_persistent_buffers:
                    yield prefix + name, buf, True

    # -- modes and gradients

    def train(self, mode: bool = True) -> Module:
        """Set training mode (dropout active, batch norm on batch statistics) on this module and its
        submodules; returns self."""
        for module in self.modules():
            object.__setattr__(module, "training", bool(mode))
        return self

    def eval(self) -> Module:
        """Evaluation mode: ``train(False)``."""
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of every parameter: drop them (``set_to_none=True``), or zero the
        existing ones in place and leave missing ones missing, as ``torch.nn.Module.zero_grad``."""
        for param in self.parameters():
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()

    # -- calling

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} should implement forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        rec = _profile_hook.ACTIVE  # NOTE [ Profiler hooks ]: a range named by the module's path
        return self.forward(*args, **kwargs) if rec is None else rec.module(self, args, kwargs)

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        # PyTorch's layout: the extra_repr alone on one line, else it and the children one per line.
        extra = self.extra_repr().split("\n") if self.extra_repr() else []
        children = [
            f"({name}): " + repr(module).replace("\n", "\n  ") for name, module in self._modules.items()
        ]
        head = f"{type(self).__name__}("
        if not children:
            return head + "\n".join(extra) + ")"
        return head + "\n  " + "\n  ".join(extra + children) + "\n)"

    # -- state

    def state_dict(self) -> OrderedDict[str, Tensor]:
        """``{name: Tensor}`` of every parameter and persistent buffer, detached (sharing their
        data), in PyTorch's order: per module its parameters, then its buffers."""
        return OrderedDict((name, t.detach()) for name, t, _ in self._state_items())

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> IncompatibleKeys:
        """Copy values into the parameters and persistent buffers, by name.

        Args:
            state_dict: ``{name: Tensor or numpy.ndarray}``, as :meth:`state_dict` returns, or a
                PyTorch twin's ``state_dict()``: any value with ``.numpy()`` (a ``torch.Tensor``)
                is taken through ``.detach().cpu().numpy()``.
            strict: raise ``ValueError`` on missing or unexpected names; otherwise report them.

        Every value is checked (names, shapes) before any parameter changes, so a failed load
        leaves the module as it was. Values are converted to each parameter's (buffer's) dtype.
        A floating-point buffer is updated in place; an integer one (``num_batches_tracked``) is
        replaced by a new Tensor, as integer Tensors on the taichi backend have no arithmetic.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"load_state_dict: expected a mapping of names to arrays, got {type(state_dict).__name__}"
            )
        params = {name: t for name, t, _ in self._state_items()}
        owners = {name: (module, local) for name, module, local in self._buffer_slots()}
        missing = [name for name in params if name not in state_dict]
        unexpected = [name for name in state_dict if name not in params]
        if strict and (missing or unexpected):
            raise ValueError(
                f"load_state_dict: missing keys {missing}, unexpected keys {unexpected} for {type(self).__name__}"
            )
        updates = []
        for name, param in params.items():
            if name not in state_dict:
                continue
            value = _state_array(name, state_dict[name])
            if tuple(value.shape) != param.shape:
                raise ValueError(
                    f"load_state_dict: {name!r} has shape {tuple(value.shape)} but the "
                    f"{'buffer' if name in owners else 'parameter'} has shape {param.shape}"
                )
            if value.dtype.kind not in "fiu":
                raise TypeError(f"load_state_dict: {name!r} should hold numbers, got dtype {value.dtype}")
            updates.append((name, param, value))
        # In place, as torch's load_state_dict: a parameter an optimizer placed in its flat
        # buffer stays there, so the next step needs no copy back.
        with no_grad():
            for name, param, value in updates:
                if param.dtype.kind == "f":
                    param.copy_(value)
                else:
                    module, local = owners[name]
                    module._buffers[local] = Tensor(np.asarray(value).astype(param.dtype))
        return IncompatibleKeys(missing, unexpected)

    def _buffer_slots(self) -> Iterator[tuple[str, Module, str]]:
        # (state_dict name, owning module, its local name) of every persistent buffer.
        for mod_name, module in self.named_modules():
            prefix = f"{mod_name}." if mod_name else ""
            for name, buf in module._buffers.items():
                if buf is not None and name not in module._non_persistent_buffers:
                    yield prefix + name, module, name

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`state_dict` to a NumPy ``.npz`` file (one array per parameter name).

        As ``numpy.savez``, ``.npz`` is appended to a path that does not end with it:
        ``save("model")`` writes ``model.npz``, which ``load("model")`` reads.
        """
        np.savez(_npz_path(path), **{name: t.numpy() for name, t in self.state_dict().items()})

    def load(self, path: str | os.PathLike, strict: bool = True) -> IncompatibleKeys:
        """Load parameters from a ``.npz`` file written by :meth:`save` (see :meth:`load_state_dict`).

        ``path`` is the one given to :meth:`save`: this reads the file :meth:`save` wrote for it
        (``path`` with ``.npz`` appended where it lacks it). Where that file does not exist but
        ``path`` itself does (an ``.npz`` written under another name), that is read.
        """
        target = _npz_path(path)
        if not os.path.exists(target) and os.path.exists(path):
            target = os.fspath(path)
        if not os.path.exists(target):
            raise FileNotFoundError(f"load: no file {target!r}, the one save({os.fspath(path)!r}) writes")
        with np.load(target, allow_pickle=False) as data:
            state = {name: data[name] for name in data.files}
        return self.load_state_dict(state, strict=strict)


def _npz_path(path: str | os.PathLike) -> str:
    """The file ``numpy.savez`` writes for ``path``: ``path`` itself if it ends with ``.npz``."""
    path = os.fspath(path)
    if not isinstance(path, str):
        raise TypeError(f"path should be a str or os.PathLike of str, got {type(path).__name__}")
    return path if path.endswith(".npz") else path + ".npz"


def _type_name(value: Any) -> str:
    """``value``'s type with its module (``torch.Tensor``), so that a foreign type reads as one."""
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _state_array(name: str, value: Any) -> np.ndarray:
    """A ``load_state_dict`` value as a host array: a Tensor, a NumPy array, or an array of another
    library that has ``.numpy()`` (a ``torch.Tensor``: detached and moved to the CPU first, as
    ``t.detach().cpu().numpy()``)."""
    if isinstance(value, Tensor):
        return value.numpy()
    if isinstance(value, np.ndarray):
        return value
    if callable(getattr(value, "numpy", None)):
        host = value
        for step in ("detach", "cpu"):
            if callable(getattr(host, step, None)):
                host = getattr(host, step)()
        try:
            arr = host.numpy()
        except Exception as e:  # a dtype NumPy lacks (torch.bfloat16), say
            raise TypeError(
                f"load_state_dict: {name!r} ({_type_name(value)}) could not be converted to a numpy.ndarray: {e}"
            ) from e
        if isinstance(arr, np.ndarray):
            return arr
    raise TypeError(
        f"load_state_dict: {name!r} should be a Tensor, a numpy.ndarray or an array with .numpy() "
        f"(a torch.Tensor), got {_type_name(value)}"
    )
