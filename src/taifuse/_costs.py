"""What an op must move and compute: the byte and FLOP counts that ``taifuse bench`` and
``taifuse.profiler`` both judge against the machine's ceilings, written once.

Each function returns a :class:`Cost`: ``bytes_moved`` counts every input read and every output
written once (the least an op can move), ``bytes_written`` the part of it that is written, and
``flops`` the floating-point operations of the op's matrix products (0 for an op whose elementwise
work is not counted, which is then judged as memory-bound). The traffic the memory system sees is
``traffic_bytes(bytes_moved, bytes_written)`` (NOTE [ Traffic model ] in taifuse/_ceilings.py).
This module imports nothing of taifuse, so that every layer may use it.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "ConvShape",
    "Cost",
    "attention",
    "attention_flops",
    "attention_pairs",
    "batch_norm",
    "conv2d",
    "conv2d_batch_norm",
    "elementwise",
    "linear",
    "matmul",
    "optimizer_step",
    "pool2d",
    "traffic_bytes",
]


class Cost(NamedTuple):
    bytes_moved: int
    bytes_written: int = 0
    flops: int = 0


def traffic_bytes(bytes_moved: int, bytes_written: int) -> int:
    """Bytes the memory system moves for a kernel (NOTE [ Traffic model ] in taifuse/_ceilings.py).

    Args:
        bytes_moved: inputs read plus outputs written, each counted once.
        bytes_written: the part of ``bytes_moved`` that is written (with ordinary stores).

    Every written byte counts twice (write-allocate reads the line before the store replaces it).
    For a copy of ``a`` bytes: ``traffic_bytes(2 * a, a) == 3 * a``.

    Example::

        >>> traffic_bytes(2 * 1024, 1024)
        3072
    """
    if not 0 <= bytes_written <= bytes_moved:
        raise ValueError(f"bytes_written should lie in [0, bytes_moved={bytes_moved}], got {bytes_written}")
    return bytes_moved + bytes_written


def elementwise(read_bytes: int, written_bytes: int) -> Cost:
    """An op that reads ``read_bytes`` and writes ``written_bytes``, its arithmetic not counted."""
    return Cost(read_bytes + written_bytes, written_bytes, 0)


def linear(
    batch: int,
    in_features: int,
    out_features: int,
    *,
    bias: bool = True,
    itemsize: int = 4,
    backward: bool = False,
    activation: bool = False,
    input_grad: bool = True,
) -> Cost:
    """``y = act(x @ w.T + b)`` with ``x (batch, in)``, ``w (out, in)``, or its backward.

    Forward: reads x, w (and b), writes y; ``2 * batch * in * out`` flops. Backward (the fused
    kernel autograd's Linear calls): reads x, w and the output gradient (and, with an
    ``activation``, the pre-activation, writing its gradient too), writes the gradients of w (and
    b, and x when ``input_grad``); one product for the weight gradient and one for the input's.

    Example::

        >>> linear(64, 784, 256)
        Cost(bytes_moved=1070080, bytes_written=65536, flops=25690112)
    """
    b, k, n = batch, in_features, out_features
    if not backward:
        written = b * n
        moved = b * k + n * k + (n if bias else 0) + written
        return Cost(itemsize * moved, itemsize * written, 2 * b * k * n)
    gx = b * k if input_grad else 0
    per_output = 3 if activation else 1  # grad out (+ pre-activation read, its gradient written)
    written = gx + n * k + (n if bias else 0) + (b * n if activation else 0)
    moved = b * k + gx + 2 * n * k + per_output * b * n + (n if bias else 0)
    flops = 2 * b * k * n * (2 if input_grad else 1)
    return Cost(itemsize * moved, itemsize * written, flops)


def matmul(batch: int, m: int, k: int, n: int, *, itemsize: int = 4, backward: bool = False) -> Cost:
    """``batch`` products ``(m, k) @ (k, n)``; the backward computes both operands' gradients
    (two products) from the output's gradient."""
    a, b, out = batch * m * k, batch * k * n, batch * m * n
    if not backward:
        return Cost(itemsize * (a + b + out), itemsize * out, 2 * batch * m * k * n)
    return Cost(itemsize * (2 * a + 2 * b + out), itemsize * (a + b), 4 * batch * m * k * n)


def attention_pairs(L: int, S: int, causal: bool) -> int:
    """The (query, key) pairs one head attends: ``L * S``, or with ``causal`` (top-left aligned)
    ``sum(min(i + 1, S) for i in range(L))``, which is ``L * (L + 1) / 2`` when ``L == S``.

    Example::

        >>> attention_pairs(4, 4, causal=True), attention_pairs(4, 4, causal=False)
        (10, 16)
    """
    if not causal:
        return L * S
    full = max(L - S, 0)  # queries past the last key see all S keys
    seen = min(L, S)
    return seen * (seen + 1) // 2 + full * S


def attention_flops(batch: int, heads: int, L: int, S: int, E: int, causal: bool, backward: bool) -> int:
    """Flops of attention's products (NOTE [ Attention FLOPs ] in taifuse/bench/suites/transformer.py):
    ``4 * E * P`` per head forward, ``14 * E * P`` forward and backward, with ``P`` from
    :func:`attention_pairs`."""
    per_pair = 14 if backward else 4
    return per_pair * E * attention_pairs(L, S, causal) * batch * heads


def attention(
    batch: int, heads: int, L: int, S: int, E: int, causal: bool, *, phase: str = "forward", itemsize: int = 4
) -> Cost:
    """Scaled dot-product attention over ``q (batch, heads, L, E)``, ``k, v (batch, heads, S, E)``.

    ``phase`` is ``"forward"`` (reads q, k, v, writes out), ``"backward"`` (reads q, k, v and the
    output's gradient, writes the three gradients) or ``"both"`` (forward and backward as one call:
    out and the three gradients written). Flops from :func:`attention_flops` (the backward alone:
    ``10 * E * P``).

    Example::

        >>> attention(1, 1, 4, 4, 8, causal=True)
        Cost(bytes_moved=512, bytes_written=128, flops=320)
    """
    q, kv = batch * heads * L * E, batch * heads * S * E
    forward_flops = attention_flops(batch, heads, L, S, E, causal, backward=False)
    both_flops = attention_flops(batch, heads, L, S, E, causal, backward=True)
    if phase == "forward":
        return Cost(itemsize * (2 * q + 2 * kv), itemsize * q, forward_flops)
    if phase == "backward":
        return Cost(itemsize * (3 * q + 4 * kv), itemsize * (q + 2 * kv), both_flops - forward_flops)
    if phase == "both":
        return Cost(itemsize * (4 * q + 4 * kv), itemsize * (2 * q + 2 * kv), both_flops)
    raise ValueError(f"attention: phase should be 'forward', 'backward' or 'both', got {phase!r}")


def optimizer_step(param_bytes: int, grad_bytes: int, state_bytes: int) -> Cost:
    """A fused optimizer update: reads parameters, gradients and state, writes parameters and state.

    Example (AdamW over 1000 float32 values: two float32 moments)::

        >>> optimizer_step(4000, 4000, 8000)
        Cost(bytes_moved=28000, bytes_written=12000, flops=0)
    """
    return Cost(2 * param_bytes + grad_bytes + 2 * state_bytes, param_bytes + state_bytes, 0)


# ----------------------------------------------------------------------------- convolutional networks


class ConvShape(NamedTuple):
    """A convolution's sizes: input ``(n, c, h, w)``, ``oc`` output channels of ``pixels`` each
    (OH * OW), and ``k`` multiply-adds per output element (``C / groups * KH * KW``)."""

    n: int
    c: int
    h: int
    w: int
    oc: int
    k: int
    pixels: int

    def flops(self) -> int:
        """``2 * N * OC * OH * OW * (C / groups) * KH * KW``: one product's."""
        return 2 * self.n * self.oc * self.pixels * self.k


def conv2d(
    shape: ConvShape,
    *,
    bias: bool = True,
    itemsize: int = 4,
    backward: bool = False,
    activation: bool = False,
    input_grad: bool = True,
) -> Cost:
    """``y = act(conv2d(x, w) + b)``, or its backward, as :func:`linear` counts a linear layer.

    Forward: reads x, w (and b), writes y; ``shape.flops()``. Backward: reads x, w and the
    output's gradient (and, with an ``activation``, the pre-activation), writes the gradients of w
    (and b, and x when ``input_grad``); one product for the weight's gradient and one for the
    input's. The columns of an im2col are the kernel's own scratch, not counted.

    Example (the CIFAR-like first layer: 64 images of 3 x 32 x 32, 32 channels of 3 x 3)::

        >>> s = ConvShape(64, 3, 32, 32, 32, 27, 1024)
        >>> conv2d(s, bias=False).flops, conv2d(s, bias=False).bytes_moved
        (113246208, 9178496)
    """
    x = shape.n * shape.c * shape.h * shape.w
    wt = shape.oc * shape.k  # OC * (C / groups) * KH * KW
    y = shape.n * shape.oc * shape.pixels
    b = shape.oc if bias else 0
    if not backward:
        return Cost(itemsize * (x + wt + b + y), itemsize * y, shape.flops())
    gx = x if input_grad else 0
    per_output = 2 if activation else 1  # the output's gradient (and the pre-activation)
    written = gx + wt + b
    moved = x + wt + per_output * y + written
    return Cost(itemsize * moved, itemsize * written, shape.flops() * (2 if input_grad else 1))


def pool2d(input_bytes: int, output_bytes: int, *, index_bytes: int = 0, backward: bool = False) -> Cost:
    """A pooling: forward reads the input and writes the output (and max pooling's indices, in
    ``output_bytes``); backward reads the output's gradient (and the indices) and writes the
    input's gradient. Its arithmetic is not counted (memory-bound)."""
    if not backward:
        return elementwise(input_bytes, output_bytes)
    return elementwise(output_bytes + index_bytes, input_bytes)


def batch_norm(
    elements: int,
    channels: int,
    *,
    itemsize: int = 4,
    param_itemsize: int = 4,
    training: bool = True,
    backward: bool = False,
    running: bool = True,
) -> Cost:
    """Batch norm over ``elements`` values of ``channels`` channels: the passes over the
    activation its math needs.

    Forward in training: the statistics must be complete before any value is normalized, so x
    is read twice (the statistics' pass and the normalize pass) and the output written once; in
    evaluation x is read once. Backward: per-channel sums of (x, grad_out) must be complete before
    any input gradient, so both are read twice and the input's gradient written once. The
    per-channel arrays (weight, bias, the running statistics, read and written in training when
    ``running``; the parameters' gradients) are counted once each.

    Example::

        >>> batch_norm(1000, 10).bytes_moved  # x read twice, out written: 3 * 4000; weight, bias, running stats
        12240
    """
    act = elements * itemsize
    per_channel = channels * param_itemsize
    if backward:
        return Cost(4 * act + act + 4 * per_channel, act + 2 * per_channel)
    reads = 2 if training else 1
    stats = 2 * per_channel if running else 0
    written = act + (stats if training else 0)
    return Cost(reads * act + written + 2 * per_channel + stats, written)


def conv2d_batch_norm(
    shape: ConvShape,
    *,
    bias: bool = False,
    itemsize: int = 4,
    param_itemsize: int = 4,
    backward: bool = False,
    input_grad: bool = True,
    running: bool = True,
) -> Cost:
    """The training-mode Conv2d -> BatchNorm -> ReLU block as taifuse fuses it (NOTE [ The fused
    Conv-BN-ReLU block in training ] in backends/reference/conv.py), against which the three ops'
    costs add up to more activation traffic:

    forward: the convolution writes y (its statistics accumulated as it stores), then one pass
    reads y and writes the output: y is written once and read once, the output written once (the
    ops: y written, read twice by batch norm, its output written, read and written by the ReLU).
    Backward: y and the output's gradient are read twice (the per-channel sums, then the pass that
    forms the convolution's gradient), then the convolution's two products (the ops also write
    and read the ReLU's gradient and batch norm's input gradient). The ReLU's mask is recomputed.

    Example (the CIFAR-like second layer: 32 -> 64 channels over 64 images of 32 x 32)::

        >>> s = ConvShape(64, 32, 32, 32, 64, 288, 1024)
        >>> fused = conv2d_batch_norm(s).bytes_moved
        >>> ops = conv2d(s, bias=False).bytes_moved + batch_norm(64 * 64 * 1024, 64).bytes_moved
        >>> ops += elementwise(4 * 64 * 64 * 1024, 4 * 64 * 64 * 1024).bytes_moved  # the ReLU
        >>> round(ops / fused, 2)
        1.86
    """
    y = shape.n * shape.oc * shape.pixels * itemsize
    per_channel = shape.oc * param_itemsize
    conv = conv2d(shape, bias=bias, itemsize=itemsize, backward=backward, input_grad=input_grad)
    if not backward:
        stats = 2 * per_channel if running else 0
        return Cost(
            conv.bytes_moved + 2 * y + 2 * per_channel + 2 * stats, conv.bytes_written + y + stats, conv.flops
        )
    # conv's backward read the output's gradient once; the block reads y and it twice each.
    return Cost(conv.bytes_moved + 3 * y + 4 * per_channel, conv.bytes_written + 2 * per_channel, conv.flops)
