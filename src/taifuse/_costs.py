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
    "Cost",
    "attention",
    "attention_flops",
    "attention_pairs",
    "elementwise",
    "linear",
    "matmul",
    "optimizer_step",
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
