"""Gradient checkpointing: trade compute for memory by recomputing activations in the backward.

``checkpoint(fn, *args)`` returns what ``fn(*args)`` returns, but the graph keeps only the
arguments (and the random-generator state), not the activations inside ``fn``; the backward runs
``fn`` again on the saved arguments and backpropagates through that recomputation.
``checkpoint_sequential`` does this for consecutive slices of a ``Sequential`` (or a list of
modules), and ``taifuse.nn.Checkpoint(module)`` wraps one module of a model.

Example::

    >>> import numpy as np, taifuse, taifuse.nn as nn
    >>> from taifuse.checkpoint import checkpoint, checkpoint_sequential
    >>> taifuse.set_backend("numpy")
    >>> taifuse.manual_seed(0)
    >>> model = nn.Sequential(*[nn.Linear(8, 8, activation="gelu") for _ in range(4)])
    >>> x = taifuse.tensor(np.ones((2, 8), np.float32))
    >>> checkpoint_sequential(model, 2, x).sum().backward()
    >>> model[0].weight.grad.shape
    (8, 8)

# NOTE [ What a checkpoint keeps ]
# The forward runs ``fn`` with grad mode on, exactly as an unchecked call would, takes the output
# array and drops the graph that ``fn`` built: every activation inside ``fn`` is freed when the
# forward returns, and what stays is one ``_Checkpoint`` node holding the arguments and the RNG
# state. Recording (rather than running under ``no_grad``) costs no memory beyond one segment at a
# time, and buys two things: the forward takes the same kernel paths as the recomputation and as an
# unchecked run (``Linear`` fuses its activation only when no gradient is needed, and the fused and
# split paths may round differently), so values and gradients are bitwise those of the unchecked
# model; and it tells exactly whether anything inside ``fn`` (a parameter, a captured leaf) needs a
# gradient, so a checkpoint over inputs that do not require grad still trains the parameters.
# The backward restores the RNG state of the forward (dropout then draws the same masks, see
# NOTE [ Counter-based dropout ] in ``_random``), reruns ``fn`` on detached copies of the
# arguments, and calls the engine on that subgraph: parameters are leaves, so their ``.grad``
# accumulates there as it would in an unchecked backward, and the arguments' gradients are handed
# back to the outer graph. The engine releases each recomputed node after its backward, and the rest
# goes when this backward returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from taifuse import _autocast_state, _engine, _random
from taifuse._engine import Function, enable_grad, is_grad_enabled
from taifuse._internal import attach, backend, data, grad_data, wrap
from taifuse._tensor_math import math_for
from taifuse.tensor import Tensor

__all__ = ["checkpoint", "checkpoint_sequential"]


class _Checkpoint(Function):
    """The graph node of one checkpointed call: the arguments and RNG state in, a recomputation out."""

    tensor_parents = True  # its parents are the argument Tensors (Function.release)
    fn: Callable[..., Tensor]
    args: tuple[Any, ...]
    rng_state: dict | None
    autocast: dict[str, Any]  # the forward's autocast settings, which the recomputation runs under
    # The gradients handed back are the .grad arrays of leaves made for this backward alone (one
    # per argument), which die with it: the engine may keep them without copying.
    owns_grads = True

    def backward(self, grad: Any) -> tuple[Any, ...]:
        inputs = _detached(self.args, self.needs_grad)
        out = [_recompute(self.fn, inputs, self.rng_state, self.autocast)]
        if out[0].requires_grad:
            # Handed over, not kept: the engine frees the recomputed output once its node has run.
            _engine.run_backward(out.pop(), grad, retain_graph=False)
        return tuple(
            grad_data(a) if needed and isinstance(a, Tensor) else None
            for a, needed in zip(inputs, self.needs_grad)
        )


def _detached(args: Sequence[Any], needs_grad: Sequence[bool]) -> tuple[Any, ...]:
    """The arguments with each Tensor replaced by a fresh leaf on the same data, so that a backward
    through ``fn`` stops at them (their gradients land in the leaves' ``.grad``)."""
    out = []
    for a, needed in zip(args, needs_grad):
        if isinstance(a, Tensor):
            leaf = wrap(data(a), backend(a))
            leaf.requires_grad = needed
            a = leaf
        out.append(a)
    return tuple(out)


def _call(fn: Callable[..., Any], inputs: tuple[Any, ...]) -> Tensor:
    with enable_grad():
        out = fn(*inputs)
    if not isinstance(out, Tensor):
        raise TypeError(f"checkpoint: the function should return one Tensor, got {type(out).__name__}")
    return out


def _recompute(
    fn: Callable[..., Any], inputs: tuple[Any, ...], rng_state: dict | None, autocast_kwargs: dict[str, Any]
) -> Tensor:
    """``fn(*inputs)`` with the generator set to ``rng_state`` for the call and restored afterwards
    (also when ``fn`` raises), so that the recomputation draws the forward's random numbers and the
    caller's stream continues as if nothing had run; and under the forward's autocast settings, so
    that it computes in the forward's dtypes (as PyTorch's checkpoint does)."""
    with _autocast_state.region(**autocast_kwargs):
        if rng_state is None:
            return _call(fn, inputs)
        current = _random.get_rng_state()
        _random.set_rng_state(rng_state)
        try:
            return _call(fn, inputs)
        finally:
            _random.set_rng_state(current)


def checkpoint(fn: Callable[..., Tensor], *args: Any, preserve_rng_state: bool = True) -> Tensor:
    """``fn(*args)``, keeping only ``args`` for the backward and recomputing the rest there.

    Args:
        fn: a callable (a module, a function) returning one Tensor. Parameters and other leaf
            tensors it uses get their gradients; a non-leaf Tensor computed outside ``fn`` should
            be passed in ``args`` rather than captured, so that the recomputation stops at it.
        args: its positional arguments; Tensors among them get gradients when they require grad,
            anything else is passed through unchanged.
        preserve_rng_state: save the random generator's state before the forward and restore it for
            the recomputation, so that dropout draws the same masks (set False to skip that when
            ``fn`` draws no random numbers; the recomputation then draws fresh ones).

    Returns:
        A Tensor with the value of ``fn(*args)``. With grad mode off, or when nothing inside ``fn``
        requires grad, this is just ``fn(*args)``.

    The memory held between forward and backward is the arguments, not the activations inside
    ``fn``; the cost is one more forward of ``fn`` during the backward (see NOTE [ What a
    checkpoint keeps ]). If ``fn`` raises, grad mode and the random generator are left as they were
    before the call.

    Example::

        >>> import numpy as np, taifuse, taifuse.nn as nn
        >>> from taifuse.checkpoint import checkpoint
        >>> taifuse.set_backend("numpy")
        >>> taifuse.manual_seed(0)
        >>> block = nn.Sequential(nn.Linear(4, 4, activation="gelu"), nn.Dropout(0.5), nn.Linear(4, 1))
        >>> x = taifuse.tensor(np.ones((3, 4), np.float32), requires_grad=True)
        >>> y = checkpoint(block, x)
        >>> y.shape, y.grad_fn
        ((3, 1), <_Checkpoint>)
        >>> y.sum().backward()
        >>> x.grad.shape, block[0].weight.grad.shape
        ((3, 4), (4, 4))
    """
    if not callable(fn):
        raise TypeError(f"checkpoint: fn should be callable, got {type(fn).__name__}")
    if not is_grad_enabled():
        return fn(*args)
    needs_grad = tuple(isinstance(a, Tensor) and a.requires_grad for a in args)
    rng_state = _random.get_rng_state() if preserve_rng_state else None
    try:
        out = _call(fn, _detached(args, needs_grad))
    except BaseException:
        if rng_state is not None:
            _random.set_rng_state(rng_state)
        raise
    if not out.requires_grad:
        return out
    ctx = _Checkpoint()
    ctx.be = backend(out)
    ctx.m = math_for(ctx.be)
    ctx.fn, ctx.args, ctx.rng_state = fn, tuple(args), rng_state
    ctx.autocast = _autocast_state.autocast_kwargs()
    ctx.needs_grad = needs_grad
    ctx.parents = tuple(a if isinstance(a, Tensor) else None for a in args)
    # A new Tensor on the output's array: dropping `out` drops the graph fn built (nothing else
    # refers to it), which frees the forward's activations now.
    result = wrap(data(out), backend(out))
    attach(result, ctx)
    return result


def _segments(n: int, segments: int) -> list[tuple[int, int]]:
    """``segments`` consecutive ``(start, stop)`` ranges over ``n`` items, sizes differing by at most one."""
    size, extra = divmod(n, segments)
    bounds, start = [], 0
    for i in range(segments):
        stop = start + size + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


class _Run:
    """Calls a slice of functions one after another (one checkpointed segment)."""

    def __init__(self, functions: Sequence[Callable[[Any], Any]]) -> None:
        self.functions = tuple(functions)

    def __call__(self, x: Any) -> Any:
        for f in self.functions:
            x = f(x)
        return x


def checkpoint_sequential(
    functions: Sequence[Callable[[Any], Any]],
    segments: int,
    input: Tensor,
    preserve_rng_state: bool = True,
) -> Tensor:
    """Run ``functions`` in order on ``input``, checkpointing each of ``segments`` consecutive slices.

    Args:
        functions: a :class:`taifuse.nn.Sequential`, or a list of modules or one-argument callables.
        segments: how many slices (1 to ``len(functions)``); their sizes differ by at most one,
            the larger ones first. About ``sqrt(len(functions))`` minimises the memory held: the
            slice boundaries plus one slice's activations during its recomputation.
        input: the first function's input.
        preserve_rng_state: as in :func:`checkpoint`.

    Unlike ``torch.utils.checkpoint.checkpoint_sequential``, the last slice is checkpointed too:
    the engine keeps every tensor of the outer graph until its backward ends, so the last slice's
    outputs, left unchecked, would stay in memory while every other slice is recomputed.

    Example::

        >>> import numpy as np, taifuse, taifuse.nn as nn
        >>> from taifuse.checkpoint import checkpoint_sequential
        >>> taifuse.set_backend("numpy")
        >>> taifuse.manual_seed(0)
        >>> model = nn.Sequential(*[nn.Linear(4, 4, activation="relu") for _ in range(9)])
        >>> x = taifuse.tensor(np.ones((2, 4), np.float32))
        >>> y = checkpoint_sequential(model, 3, x)
        >>> bool(np.array_equal(y.numpy(), model(x).numpy()))
        True
    """
    functions = list(functions)
    if not functions:
        raise ValueError("checkpoint_sequential: functions is empty")
    for i, f in enumerate(functions):
        if not callable(f):
            raise TypeError(f"checkpoint_sequential: functions[{i}] is not callable ({type(f).__name__})")
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= len(functions):
        raise ValueError(
            f"checkpoint_sequential: segments should be an int in [1, {len(functions)}], got {segments!r}"
        )
    x = input
    for start, stop in _segments(len(functions), segments):
        x = checkpoint(_Run(functions[start:stop]), x, preserve_rng_state=preserve_rng_state)
    return x
