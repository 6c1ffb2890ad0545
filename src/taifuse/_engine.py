"""The autograd engine: grad mode, the graph node :class:`Function`, and the backward walk.

A Tensor (taifuse/tensor.py) that came out of a differentiable op keeps the :class:`Function`
node that made it; each node keeps what its backward needs of its arguments (NOTE [ The graph
keeps no data ]). :func:`run_backward` walks the nodes in reverse topological order (iteratively:
a deep MLP is a long chain), calls each node's backward (its backend's hand-written backward
kernels) and accumulates the gradients into the ``.grad`` of the leaves that require grad, in a
leaf's optimizer slot when it has one (taifuse/_grad_slots.py). The Tensor's fields are reached
through taifuse/_internal.py. The Functions of the Tensor methods are in
taifuse/_tensor_functions.py, those of the functional ops in taifuse/_autograd_ops.py.
"""

from __future__ import annotations

import functools
import numbers
import threading
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from taifuse import _profile_hook, backends
from taifuse._internal import (
    INPLACE_EPOCH,
    TensorCore,
    backend,
    base,
    changes_since,
    common_backend,
    data,
    extents_overlap,
    grad_data,
    grad_slot,
    memory_extent,
    node,
    post_accumulate_hooks,
    requires_grad,
    set_grad,
    set_post_accumulate_hooks,
    share_version,
    wrap,
)
from taifuse._tensor_math import math_for, shares_storage

__all__ = [
    "Function",
    "backward_pass",
    "enable_grad",
    "graph_node",
    "is_grad_enabled",
    "no_grad",
    "queue_callback",
    "register_post_accumulate_grad_hook",
    "run_backward",
    "set_grad_enabled",
]


def _strided(a: Any) -> bool:
    """A host array a kernel cannot take as it is (NOTE [ Views ] in _tensor_functions.py)."""
    return isinstance(a, np.ndarray) and not a.flags.c_contiguous


# ----------------------------------------------------------------------------- grad mode


class _GradMode(threading.local):
    enabled = True  # a class attribute: a thread that never set it reads True without a lookup miss


_grad_mode = _GradMode()


def is_grad_enabled() -> bool:
    """Whether ops record the graph in this thread (False inside :class:`no_grad`)."""
    return _grad_mode.enabled


def set_grad_enabled(enabled: bool) -> None:
    """Turn graph recording on or off in this thread (what :class:`no_grad` does on entry)."""
    _grad_mode.enabled = enabled


class _GradModeGuard:
    _enabled: bool

    def __enter__(self) -> None:
        # A stack, not one saved flag, so that one instance can be entered re-entrantly.
        self.__dict__.setdefault("_saved", []).append(is_grad_enabled())
        set_grad_enabled(self._enabled)

    def __exit__(self, *exc: object) -> None:
        set_grad_enabled(self._saved.pop())

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with type(self)():
                return fn(*args, **kwargs)

        return wrapper


class no_grad(_GradModeGuard):
    """Context manager and decorator: ops inside record no graph (per thread), as ``torch.no_grad``.

    Example::

        >>> import taifuse
        >>> taifuse.set_backend("numpy")
        >>> w = taifuse.tensor([1.0], requires_grad=True)
        >>> with taifuse.no_grad():
        ...     y = w * 2
        >>> y.requires_grad
        False
    """

    _enabled = False


class enable_grad(_GradModeGuard):
    """Context manager and decorator that turns graph recording back on inside :class:`no_grad`."""

    _enabled = True


# ----------------------------------------------------------------------------- graph nodes


class _NoGrads(dict):
    """``needs_grad`` of a node that records nothing, by argument count: all False."""

    def __missing__(self, n: int) -> tuple[bool, ...]:
        self[n] = value = (False,) * n
        return value


class _FirstNeeds(dict):
    """``needs_grad`` of a node whose first argument alone can require grad, by argument count."""

    def __missing__(self, n: int) -> tuple[bool, ...]:
        self[n] = value = (True,) + (False,) * (n - 1)
        return value


_NO_GRADS = _NoGrads()
_FIRST_NEEDS = _FirstNeeds()
_NO_GRADS_ONE, _NEEDS_ONE = _NO_GRADS[1], _FIRST_NEEDS[1]  # Function.apply_one's


class _NoParents(dict):
    """``parents`` of ``n`` arguments that are not Tensors (apply_one's after its first)."""

    def __missing__(self, n: int) -> tuple[None, ...]:
        self[n] = value = (None,) * n
        return value


_NO_PARENTS = _NoParents()


class Function:
    """One differentiable op: ``forward`` on arrays, ``backward`` from the output's gradient.

    Subclasses implement ``forward(*args)`` (Tensor arguments arrive as their arrays, everything
    else unchanged; returns the output array) and ``backward(grad)`` (returns one gradient per
    positional argument, ``None`` where there is none or ``self.needs_grad[i]`` is False). They keep
    what the backward needs on ``self``; :meth:`release` drops the saved data after a backward pass
    (NOTE [ Released nodes ]).
    """

    be: ModuleType  # the backend the forward ran on; the backward runs there too
    m: Any  # its tensor math (taifuse._tensor_math)
    needs_grad: tuple[bool, ...]
    # True when backward returns freshly allocated arrays, none of them shared with another
    # input, an output or saved state: a leaf's first gradient then takes the array, not a copy.
    owns_grads: bool = False
    # True when backward can add its one input's gradient into a buffer the engine hands it in
    # ``accumulate_into`` (NOTE [ Gradients summed in place ]).
    accumulates: bool = False
    accumulate_into: Any = None
    # What the profiler records of the forward's arguments (shapes, dtypes), for the backward's
    # row: written by taifuse/profiler.py while a profile is active, kept on release.
    profile_signature: Any = ()
    # True when forward and backward take host arrays of any strides (the Tensor methods' NumPy
    # math); otherwise they get C-contiguous ones, copied from the pool where a view is not
    # (NOTE [ Views ] in _tensor_functions.py). Kernels need them contiguous.
    strided: bool = False
    # True for a view op: when its result shares its first argument's memory, the output is a
    # view of that Tensor (its version counter and ``_base``; NOTE [ Views ]).
    view: bool = False
    # The count of in-place changes (INPLACE_EPOCH) when the forward ran, recorded with the
    # graph (NOTE [ Version counters ]); None outside it.
    epoch: int | None = None

    # Per argument: a leaf Tensor that requires grad, the creator of a non-leaf one, or None
    # (NOTE [ The graph keeps no data ]). Class attributes, so that making a node sets nothing.
    parents: tuple[TensorCore | Function | None, ...] = ()
    # True for a node whose ``parents`` are its argument Tensors themselves (a checkpoint's), not
    # what graph_node makes of them: release() then keeps their nodes, not their arrays.
    tensor_parents: bool = False
    released = False
    # The fields this op's forward saves for its backward, when the subclass declares them:
    # release() then drops exactly those, whatever they hold, instead of deciding field by field
    # over the node's __dict__ (NOTE [ Released nodes ]). None: decided by value.
    saved: tuple[str, ...] | None = None
    # True for the ops that compute on the active backend (the functional ops): ``apply`` checks
    # that the tensors live there and calls :meth:`wrong_backend` when they do not.
    on_active_backend = False

    @classmethod
    def wrong_backend(cls, be: ModuleType, active: ModuleType) -> None:
        """Raise the error for tensors of backend ``be`` when ``active`` is the active one."""
        raise TypeError(
            f"{cls.__name__}: the tensors live on backend {be.NAME!r}, not on the active {active.NAME!r}"
        )

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        """Run the op on ``args`` and, if a Tensor argument requires grad, record it in the graph."""
        # NOTE [ The lean apply ]
        # Every op and Tensor method passes here, so it is written for the per-op fixed cost
        # (the ``step`` bench suite's first rows): one pass over the arguments finds the
        # backend, whether to record, whether a view is among them, the arrays and what the node
        # keeps of each (NOTE [ The graph keeps no data ]); the node's tensor math comes from a
        # dict; the grad mode and the profiler's switch are one attribute read each; the output
        # is made with its creator in one call.
        grad_mode = _grad_mode.enabled
        be = None
        record = viewed = False
        arrays = []
        needs = []
        parents = []
        for a in args:
            if isinstance(a, TensorCore):
                tb = backend(a)
                if be is None:
                    be = tb
                elif tb is not be:
                    common_backend([a for a in args if isinstance(a, TensorCore)], cls.__name__)
                if base(a) is not None:  # only a view may be strided
                    viewed = True
                arrays.append(data(a))
                if grad_mode and requires_grad(a):
                    record = True
                    creator = node(a)
                    parents.append(a if creator is None else creator)  # graph_node(a)
                    needs.append(True)
                    continue
            else:
                arrays.append(a)
            parents.append(None)
            needs.append(False)
        if be is None:
            be = common_backend((), cls.__name__)
        if cls.on_active_backend:
            active = backends.active()
            if active is not be:
                cls.wrong_backend(be, active)
        ctx = cls()
        ctx.be = be
        ctx.m = math_for(be)
        ctx.needs_grad = tuple(needs) if record else _NO_GRADS[len(args)]
        if viewed and not cls.strided:
            # through the math object, which taifuse.compile records (a bare copy it would not)
            arrays = [ctx.m.contiguous(x) if _strided(x) else x for x in arrays]
        rec = _profile_hook.ACTIVE  # NOTE [ Profiler hooks ]
        result = ctx.forward(*arrays, **kwargs) if rec is None else rec.forward(ctx, tuple(arrays), kwargs)
        if record:
            out = wrap(result, be, ctx)
            ctx.parents = tuple(parents)
            ctx.epoch = INPLACE_EPOCH[0]
        else:
            out = wrap(result, be)
        if cls.view and shares_storage(result, arrays[0]):
            share_version(out, args[0], record)
        return out

    @classmethod
    def apply_one(cls, a: Any, *rest: Any) -> Any:
        """:meth:`apply` of one Tensor argument ``a`` and no keywords, without its loop over the
        arguments and their lists: the unary activations' and the reductions' call (NOTE [ The
        lean apply ]). ``rest``: the op's further positional arguments, none of them a Tensor (a
        reduction's dims and flags). The same steps in the same order: the backend check, the
        node, a contiguous copy of a strided view, the profiler's hook, the output with its
        creator, a view's version counter."""
        if not isinstance(a, TensorCore):
            return cls.apply(a, *rest)
        be = backend(a)
        if cls.on_active_backend:
            active = backends.active()
            if active is not be:
                cls.wrong_backend(be, active)
        record = _grad_mode.enabled and requires_grad(a)
        ctx = cls()
        ctx.be = be
        ctx.m = math_for(be)
        if rest:
            ctx.needs_grad = _FIRST_NEEDS[len(rest) + 1] if record else _NO_GRADS[len(rest) + 1]
        else:
            ctx.needs_grad = _NEEDS_ONE if record else _NO_GRADS_ONE
        x = data(a)
        if not cls.strided and base(a) is not None and _strided(x):
            x = ctx.m.contiguous(x)  # through the math object, as apply's
        rec = _profile_hook.ACTIVE  # NOTE [ Profiler hooks ]
        if rec is not None:
            result = rec.forward(ctx, (x, *rest), {})
        elif rest:
            result = ctx.forward(x, *rest)
        else:
            # A plain call: ``f(x, *())`` goes through CPython's generic call with a new argument
            # tuple, ~100 ns of a unary op's ~3 us (F.relu on (8, 16), thread time, 15 alternating
            # rounds in one process, loaded 2-core EPYC: 3132 -> 3001 ns median).
            result = ctx.forward(x)
        if record:
            out = wrap(result, be, ctx)
            creator = node(a)
            ctx.parents = (a if creator is None else creator,) + _NO_PARENTS[len(rest)]  # graph_node(a)
            ctx.epoch = INPLACE_EPOCH[0]
        else:
            out = wrap(result, be)
        if cls.view and shares_storage(result, x):
            share_version(out, a, record)
        return out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def backward(self, grad: Any) -> tuple[Any, ...]:
        raise NotImplementedError

    def release(self) -> None:
        """Drop the data the forward saved (after this node's backward ran without
        ``retain_graph``), so that the intermediates are freed while the output lives on; keep
        the shapes, dims and dtypes, and the links to the inputs (NOTE [ Released nodes ])."""
        state = self.__dict__
        saved = self.saved
        # Declared fields: no scan (NOTE [ Released nodes ]); a checkpoint's node keeps its own way.
        if saved is not None and not self.tensor_parents:
            for k in saved:
                state.pop(k, None)
            self.released = True
            return
        freed = []
        for k, v in state.items():
            kind = type(v)  # the exact types first: most fields are arrays, floats, ints, flags, None
            if kind in _PLAIN_DATA:
                freed.append(k)  # no kept field (_KEPT_ON_RELEASE) is an array or a float
            elif kind not in _PLAIN_METADATA and k not in _KEPT_ON_RELEASE and not _is_metadata(v):
                freed.append(k)
        for k in freed:
            del state[k]
        before = state.get("_freed")
        state["_freed"] = frozenset(freed) if before is None else before.union(freed)
        if self.tensor_parents:
            # A checkpoint's parents are its argument Tensors: keep their nodes, not their arrays
            # (any other node's parents are what graph_node made of its arguments already).
            parents = self.parents
            for p in parents:
                # graph_node(p) is not p: a non-leaf, or a leaf that does not require grad
                if isinstance(p, TensorCore) and (node(p) is not None or not requires_grad(p)):
                    self.parents = tuple([graph_node(q) if isinstance(q, TensorCore) else q for q in parents])
                    break
        self.released = True

    def __getattr__(self, name: str) -> Any:
        # Only called for a name the instance lacks: one that release() dropped is needed again.
        if name in self.__dict__.get("_freed", ()) or (self.released and name in (self.saved or ())):
            raise RuntimeError(_SECOND_BACKWARD)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"


# NOTE [ Version counters ]
# As PyTorch's, every Tensor has a version (``Tensor._version``), shared by the views of one
# memory (a view's output takes its input's counter: NOTE [ Views ] in _tensor_functions.py) and
# by ``detach()``, which every in-place change through a Tensor (``+=``, ``add_``, ``copy_``,
# ``zero_``, index assignment, an optimizer's step) bumps. A backward that would read values the
# forward did not see raises PyTorch's RuntimeError ("one of the variables needed for gradient
# computation has been modified by an inplace operation"). How that is found costs the forward
# one integer: a node in the graph notes ``INPLACE_EPOCH`` (the count of in-place changes so far,
# _internal.py); before its backward runs, the engine compares it with the count now, and only
# when changes happened since looks at them (the log of changed memory extents, the last few
# thousand) and raises where one overlaps an array the node kept for its backward (its forward's
# input or output, or a view of one). A node that kept nothing (an addition, a view, a reshape)
# never raises, as in PyTorch.
# Differences from PyTorch, both where the gradient is right: a change to another part of the same
# memory than the node kept (``y = w * x[0]``, then ``x[1] += 1``) does not raise, and neither does
# a change to a strided view that a functional op got as a contiguous copy (NOTE [ Views ]).


def _check_versions(ctx: Function) -> None:
    changed = changes_since(ctx.epoch)
    if not changed:
        return
    for kept in _kept_arrays(ctx):
        extent = memory_extent(kept)
        for where in changed:
            if extents_overlap(extent, where):
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an "
                    f"inplace operation: an array of shape {tuple(kept.shape)} and dtype {kept.dtype} "
                    f"that {type(ctx).__name__} saved for its backward was changed in place after its "
                    "forward. Hint: the change (+=, add_, copy_, zero_, an index assignment, an "
                    "optimizer step, or one on a view of the same memory) must come after backward(), "
                    "or clone() the tensor before it"
                )


def _kept_arrays(ctx: Function) -> list:
    """The arrays ``ctx`` keeps (itself, or in a tuple or list it keeps)."""
    out = []
    for value in ctx.__dict__.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(v, "shape") and hasattr(v, "dtype") and not isinstance(v, (np.dtype, type)):
                out.append(v)
    return out


# NOTE [ Released nodes ]
# As PyTorch frees a node's saved tensors once its backward ran (unless ``retain_graph``), and
# nothing else: the node, its edges and what it keeps besides tensors (sizes, dims, dtypes) live on
# as long as an output refers to them. A node that saved no data (an addition, a reshape, a sum, a
# cast: autocast's cached weight casts among them) can therefore run again, so that a second loss
# sharing part of the graph (``l1 = y.sum(); l2 = (2 * y).sum()``) or gradient accumulation under
# one autocast region backpropagates as in PyTorch; a node whose backward reads freed data raises
# PyTorch's "second time" error when, and only when, it is reached again. What counts as kept is
# decided by value (_is_metadata), not per subclass: ints, strings, dtypes, flags and tuples of
# them; arrays, Tensors, floats (a scalar operand: PyTorch saves it as a tensor too) and callables
# go. A subclass that declares its ``saved`` fields (the ops of the smallest steps: linear, sum)
# has exactly those dropped, without that scan of its fields (about 1.4 us a node); a test checks
# that each declaration names every field the scan would drop (tests/test_lean_dispatch.py).
_KEPT_ON_RELEASE = frozenset({"be", "m", "needs_grad", "parents", "released", "_freed", "profile_signature"})


# The exact types that are metadata, for a set look-up before the isinstance chain (a released
# node's fields are mostly these: shapes are tuples of ints), and the exact types that are data
# (what most nodes save: host arrays and Python floats).
_PLAIN_METADATA = frozenset({type(None), bool, int, str})
_PLAIN_DATA = frozenset({np.ndarray, float})


def _is_metadata(value: Any) -> bool:
    """Whether a node keeps ``value`` after its backward ran (NOTE [ Released nodes ])."""
    kind = type(value)
    if kind in _PLAIN_METADATA:
        return True
    if kind is tuple:
        for v in value:
            if type(v) not in _PLAIN_METADATA and not _is_metadata(v):
                return False
        return True
    if isinstance(value, (numbers.Integral, str, np.dtype, type, ModuleType)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_is_metadata(v) for v in value)
    return False


# ----------------------------------------------------------------------------- the graph walk


# NOTE [ The graph keeps no data ]
# A node's ``parents`` hold what the backward needs of each argument, as PyTorch's edges do: a
# leaf that requires grad (its ``.grad`` is written), the creator (``Function``) of a non-leaf
# tensor, None for anything else. Never a non-leaf Tensor: that would keep its array alive as long
# as the graph, although only the arrays a node saves for its backward need to live that long.
# An intermediate that no backward reads (a residual branch's output, the float32 input of an
# autocast cast to float16, a cast's float32 copy that an addition consumed) is then freed as soon
# as the forward drops it, not at the end of the backward. A Tensor that is a non-leaf (a
# checkpoint's arguments) stands for its creator.


def graph_node(a: Any) -> TensorCore | Function | None:
    """What a node keeps of argument ``a``: NOTE [ The graph keeps no data ]."""
    if not isinstance(a, TensorCore) or not requires_grad(a):
        return None
    creator = node(a)
    return a if creator is None else creator


def _creator(parent: TensorCore | Function | None) -> Function | None:
    return parent if isinstance(parent, Function) else None if parent is None else node(parent)


def _graph_order(root: Function) -> list[Function]:
    """Nodes reachable from ``root``, each after every node that computed one of its inputs.

    An iterative depth-first post-order: recursion would overflow on long chains. A chain (each
    node with at most one creator among its inputs, once: a small step's graph) is its own
    order, found without the search's stack and set.
    """
    chain = [root]
    fn: Function | None = root
    while fn is not None:
        after = None
        for p in fn.parents:
            if p is None:
                continue
            creator = p if isinstance(p, Function) else node(p)  # _creator(p)
            if creator is None:
                continue
            if after is not None:  # a second creator: not a chain
                return _searched_order(root)
            after = creator
        if after is not None:
            chain.append(after)
        fn = after
    chain.reverse()
    return chain


def _searched_order(root: Function) -> list[Function]:
    """:func:`_graph_order` of any graph: the depth-first search."""
    order: list[Function] = []
    seen: set[int] = set()
    stack: list[tuple[Function, bool]] = [(root, False)]
    while stack:
        fn, finished = stack.pop()
        if finished:
            order.append(fn)
            continue
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        stack.append((fn, True))
        for p in fn.parents:
            if p is None:
                continue
            creator = p if isinstance(p, Function) else node(p)  # _creator(p)
            if creator is not None and id(creator) not in seen:
                stack.append((creator, False))
    return order


_SECOND_BACKWARD = (
    "backward: trying to backward through the graph a second time (or after its saved values were "
    "freed); pass retain_graph=True to the first backward() if you need to do that"
)


def _accumulate_leaf(leaf: TensorCore, grad: Any, m: Any, owned: bool = False) -> None:
    # owned: ``grad`` is a fresh array nothing else refers to (Function.owns_grads), so a leaf
    # without a gradient may keep it as is.
    if tuple(grad.shape) != tuple(data(leaf).shape):
        raise RuntimeError(
            f"internal error: gradient of shape {tuple(grad.shape)} for a leaf of shape {leaf.shape}"
        )
    so_far = grad_data(leaf)
    if so_far is None:
        # A copy: backward functions may hand the same array to several inputs, and .grad is
        # accumulated in place afterwards. An optimizer may have given the leaf a slot in its
        # flat gradient buffer: copy there when it is free (NOTE [ Gradient slots ]).
        slot = grad_slot(leaf)
        lent = slot.lend() if slot is not None and isinstance(grad, np.ndarray) else None
        if lent is not None:
            m.copy_(lent, grad)  # through the tensor math: a compiled step records it (taifuse/compiler.py)
            set_grad(leaf, wrap(lent, backend(leaf)))
        else:
            # A leaf's .grad is contiguous (NOTE [ Views ]): a strided gradient is copied.
            keep = owned and (not isinstance(grad, np.ndarray) or grad.flags.c_contiguous)
            set_grad(leaf, wrap(grad if keep else m.copy(grad), backend(leaf)))
    else:
        m.add_(so_far, grad)


def run_backward(root: TensorCore, grad: Any, retain_graph: bool) -> None:
    """Backpropagate ``grad`` (an array of ``root``'s shape, dtype and backend) from ``root``
    through the graph into the ``.grad`` of the leaves that require grad: ``Tensor.backward``
    after its argument checks, and a checkpoint's recomputation. The walk itself is
    :func:`_walk`, called through this module's globals: the profiler suite swaps it for a copy
    without the profiler hook (taifuse/bench/suites/profiler.py)."""
    if _hooks.live:  # NOTE [ Gradient hooks ]
        _run_backward_hooked(root, grad, retain_graph)
    else:
        _walk(root, grad, retain_graph, None)


def _walk(root: TensorCore, grad: Any, retain_graph: bool, counts: dict[int, list] | None) -> None:
    m = math_for(backend(root))
    top = node(root)
    if top is None:
        _accumulate_leaf(root, grad, m)
        if counts is not None:
            _leaf_done(root)
        return
    order = _graph_order(top)
    if counts is not None:
        _count_leaf_edges(order, counts)
    pending: dict[int, Any] = {id(top): grad}
    # The ids in `pending` whose gradient is an array the engine may add into in place (NOTE
    # [ Gradients summed in place ]).
    summable: set[int] = set()
    del root, grad, top
    for i in range(len(order) - 1, -1, -1):
        # NOTE: each node leaves `order` as it runs, and no local outlives its iteration, so that
        # arrays are freed as the backward goes (a checkpoint's segment boundaries and recomputed
        # activations, say), not when it ends. `pending` only ever holds the ids of nodes still in
        # `order`, so ids stay unique.
        ctx, order[i] = order[i], None
        g = pending.pop(id(ctx), None)
        summable.discard(id(ctx))
        if g is None:
            if counts is not None:  # no gradient reaches this node: nor its leaves through it
                for parent, needed in zip(ctx.parents, ctx.needs_grad):
                    if needed:
                        _edge_done(parent, counts)
            continue
        if ctx.epoch is not None and ctx.epoch != INPLACE_EPOCH[0]:
            _check_versions(ctx)
        if not ctx.strided and isinstance(g, np.ndarray) and not g.flags.c_contiguous:  # _strided(g)
            g = ctx.m.contiguous(g)
        if ctx.accumulates:
            ctx.accumulate_into = _summed_so_far(ctx, g, pending, summable)
        rec = _profile_hook.ACTIVE  # NOTE [ Profiler hooks ]
        grads = ctx.backward(g) if rec is None else rec.backward(ctx, g)
        if ctx.accumulates:
            ctx.accumulate_into = None
        parents = ctx.parents
        if not retain_graph:
            ctx.release()
        for parent, pg, needed in zip(parents, grads, ctx.needs_grad):
            if parent is None or pg is None or not needed:
                if counts is not None and needed:
                    _edge_done(parent, counts)
                continue
            creator = parent if isinstance(parent, Function) else node(parent)  # _creator(parent)
            if creator is None:
                _accumulate_leaf(parent, pg, m, owned=ctx.owns_grads)  # type: ignore[arg-type]
                if counts is not None:
                    _edge_done(parent, counts)
            elif id(creator) in pending:
                so_far = pending[id(creator)]
                if pg is so_far:  # added in place by ctx.backward (acc)
                    continue
                if id(creator) in summable and _same_layout(so_far, pg):
                    m.add_(so_far, pg)
                else:
                    pending[id(creator)] = m.add(so_far, pg)
                    summable.add(id(creator))
            else:
                pending[id(creator)] = pg
                if ctx.accumulates:  # a fresh array of the input's shape (owns_grads)
                    summable.add(id(creator))
        g = grads = parents = parent = creator = pg = ctx = so_far = None


# ----------------------------------------------------------------------------- gradient hooks

# NOTE [ Gradient hooks ]
# Two hook points, as PyTorch's, for code that acts on gradients while the backward runs (data
# parallelism: taifuse/nn/parallel.py starts the all-reduce of a bucket of gradients as soon as
# its last gradient is in, so that communication overlaps the rest of the backward):
# * ``register_post_accumulate_grad_hook(leaf, fn)`` (``Tensor.register_post_accumulate_grad_hook``):
#   ``fn(leaf)`` runs once per backward pass, after the last gradient that pass adds into the
#   leaf's ``.grad`` (a leaf used by several ops gets one call, after the sum), and not at all when
#   the pass gives the leaf no gradient. The walk knows "last" by counting, before it starts, the
#   graph's edges into each hooked leaf, and counting them down as the nodes run (a node that gets
#   no gradient counts its edges down too).
# * ``queue_callback(fn)``: from inside a backward (a hook), run ``fn()`` once the outermost
#   backward ends (a checkpoint's recomputation runs a backward inside the backward), as
#   ``Variable._execution_engine.queue_callback``. Callbacks queued by a backward that raised are
#   dropped, not run.
# Zero cost when unused: while no live tensor has a hook (``_hooks.live == 0``) ``run_backward``
# walks exactly as before, without the counting.


class _Hooks(threading.local):
    live = 0  # leaves that have hooks, over all threads (a class attribute: see _HookTable)
    depth = 0  # backwards running in this thread (nested: a checkpoint's recomputation)
    passes = 0  # outermost hooked backwards begun in this thread

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []


_hooks = _Hooks()


class _HookTable(dict):
    """One leaf's hooks, {handle id: hook}. Counted in ``_Hooks.live`` from its making until it
    is freed (its last hook removed, or its leaf freed), so that the count goes back to zero."""

    def __init__(self) -> None:
        super().__init__()
        _Hooks.live += 1
        weakref.finalize(self, _one_table_less)


def _one_table_less() -> None:
    _Hooks.live -= 1


class RemovableHandle:
    """What registering a hook returns: ``remove()`` unregisters it (as ``torch.utils.hooks``)."""

    _next_id = 0

    def __init__(self, leaf: TensorCore) -> None:
        self._leaf = weakref.ref(leaf)
        self.id = RemovableHandle._next_id
        RemovableHandle._next_id += 1

    def remove(self) -> None:
        leaf = self._leaf()
        if leaf is None:
            return
        hooks = post_accumulate_hooks(leaf)
        if hooks is not None:
            hooks.pop(self.id, None)
            if not hooks:
                set_post_accumulate_hooks(leaf, None)


def register_post_accumulate_grad_hook(leaf: TensorCore, hook: Callable[[Any], None]) -> RemovableHandle:
    """Run ``hook(leaf)`` after each backward pass's last gradient into ``leaf`` (NOTE [ Gradient
    hooks ]); the Tensor method checks its arguments first."""
    handle = RemovableHandle(leaf)
    hooks = post_accumulate_hooks(leaf)
    if hooks is None:
        hooks = _HookTable()
        set_post_accumulate_hooks(leaf, hooks)
    hooks[handle.id] = hook
    return handle


def queue_callback(callback: Callable[[], None]) -> None:
    """Run ``callback()`` when the outermost backward running in this thread ends (NOTE [ Gradient
    hooks ]); ``RuntimeError`` outside a backward."""
    if _hooks.depth == 0:
        raise RuntimeError("queue_callback: no backward is running in this thread")
    _hooks.callbacks.append(callback)


def backward_pass() -> int:
    """A number that identifies the outermost backward running in this thread (hooked, NOTE
    [ Gradient hooks ]): a hook can tell a new pass from the one it saw last, even when that one
    raised before its queued callbacks ran."""
    return _hooks.passes


def _run_backward_hooked(root: TensorCore, grad: Any, retain_graph: bool) -> None:
    if _hooks.depth == 0:
        _hooks.passes += 1
    _hooks.depth += 1
    ok = False
    try:
        _walk(root, grad, retain_graph, {})
        ok = True
    finally:
        _hooks.depth -= 1
        if _hooks.depth == 0:
            callbacks, _hooks.callbacks = _hooks.callbacks, []
            if ok:
                for callback in callbacks:
                    callback()


def _count_leaf_edges(order: list[Function], counts: dict[int, list]) -> None:
    """Per hooked leaf, the edges into it in this graph: {id: [leaf, edges not yet run]}."""
    for ctx in order:
        for parent, needed in zip(ctx.parents, ctx.needs_grad):
            if needed and isinstance(parent, TensorCore) and post_accumulate_hooks(parent) is not None:
                entry = counts.setdefault(id(parent), [parent, 0])
                entry[1] += 1


def _edge_done(parent: Any, counts: dict[int, list]) -> None:
    entry = counts.get(id(parent))
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        del counts[id(parent)]
        _leaf_done(entry[0])


def _leaf_done(leaf: TensorCore) -> None:
    hooks = post_accumulate_hooks(leaf)
    if hooks and grad_data(leaf) is not None:
        for hook in list(hooks.values()):
            hook(leaf)


# NOTE [ Gradients summed in place ]
# A tensor read by several ops gets one gradient from each, summed before its creator's backward
# runs. The engine sums into the first array it made itself (a sum, or a Function's fresh
# ``accumulates`` gradient) in place instead of allocating a sum per contribution, and a Function
# that ``accumulates`` (a strided gather: indexing, ``split``) adds its slice's gradient straight
# into that sum instead of scattering into a zeroed array of its input's shape first. So
# CausalSelfAttention's q, k, v split of c_attn's output builds one gradient of that output, not
# three full ones and their sums (the GPT step's peak: the transformer suite's memory row).


def _same_layout(a: Any, b: Any) -> bool:
    return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype


def _summed_so_far(ctx: Function, g: Any, pending: dict[int, Any], summable: set[int]) -> Any:
    """The gradient of ctx's input summed so far, when ctx may add into it in place; else None."""
    if not ctx.accumulates or not ctx.parents or not ctx.needs_grad[0]:
        return None
    creator = _creator(ctx.parents[0])
    if creator is None or id(creator) not in summable:
        return None
    acc = pending[id(creator)]
    return acc if acc.dtype == g.dtype else None
