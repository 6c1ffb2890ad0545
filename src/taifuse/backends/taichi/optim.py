"""The Taichi backend's fused optimizer kernels (``taifuse.backends.OPTIM_KERNEL_NAMES``).

Same signatures and semantics as ``reference/optim.py``, on :class:`~taifuse.backends.taichi.DeviceArray`
flat buffers: parameters, gradients and optimizer state stay on the device, and one step is one
kernel launch over the whole run, with no host copy. The only value that comes back to the host
is the 4-byte answer of :func:`all_finite`, one per step (counted in ``transfer_stats``).

bfloat16 state (NOTE [ bfloat16 optimizer state ] in ``reference/optim.py``) is a u16 ndarray of
bit patterns: ``load_state`` widens it with a shift and ``store_state`` rounds it to nearest even
with integer operations, inside the same kernels (built once more for it, float32 parameters only).

float32 and float16 storage (float16 computes in float32); float64 is refused by the backend's
``check_dtype`` before any kernel runs. Like the forward kernels, every kernel takes flat 1-D
ndarrays and plain scalars, so each compiles once per arch, and none binds more than five
buffers (Metal allows 31). ``python -m taifuse.backends.metal_check`` compiles them with Metal's
capabilities only.

Taichi is imported when a kernel is first needed (the package must not import Taichi at import
time).
"""

# NOTE: no `from __future__ import annotations`: Taichi reads kernel annotations as objects.

import functools
from types import SimpleNamespace

import numpy as np

from taifuse.backends.reference.optim import AdamHyper, adam_bf16_coefficients, adam_coefficients
from taifuse.backends.taichi._runtime import (
    BITS_DTYPE,
    FLOAT_DTYPES,
    _count_transfer,
    _fill_kernel,
    _import_taichi,
    _make_storage,
    _nd,
    _optional,
    _state,
    _ti_dtype,
)

__all__ = ["adam_step", "all_finite", "all_kernels", "lion_step", "sgd_step", "unscale_check"]


@functools.cache
def _kernels(dtype: np.dtype, bf16_state: bool = False) -> SimpleNamespace:
    """The optimizer kernels for storage dtype ``dtype`` (and bfloat16 state), built once per process."""
    ti = _import_taichi()
    T = _ti_dtype(dtype)
    X = ti.types.ndarray(dtype=T, ndim=1)
    S = ti.types.ndarray(dtype=ti.u16 if bf16_state else T, ndim=1)  # state arrays
    I32 = ti.types.ndarray(dtype=ti.i32, ndim=1)

    @ti.func
    def load(a: ti.template(), i: ti.i32) -> ti.f32:
        return ti.cast(a[i], ti.f32)

    if bf16_state:

        @ti.func
        def load_state(a: ti.template(), i: ti.i32) -> ti.f32:
            return ti.bit_cast(ti.cast(a[i], ti.u32) << ti.u32(16), ti.f32)

        @ti.func
        def store_state(a: ti.template(), i: ti.i32, x: ti.f32):
            # Round to nearest even, as reference.optim.to_bfloat16_bits; a NaN keeps a NaN (quiet).
            b = ti.bit_cast(x, ti.u32)
            upper = b >> ti.u32(16)
            bits = (b + ti.u32(0x7FFF) + (upper & ti.u32(1))) >> ti.u32(16)
            if (b & ti.u32(0x7FFFFFFF)) > ti.u32(0x7F800000):
                bits = upper | ti.u32(0x40)
            a[i] = ti.cast(bits, ti.u16)

    else:
        load_state = load

        @ti.func
        def store_state(a: ti.template(), i: ti.i32, x: ti.f32):
            a[i] = ti.cast(x, T)

    @ti.kernel
    def sgd_plain(p: X, g: X, n: ti.i32, neg_lr: ti.f32, sign: ti.f32, wd: ti.f32, l2: ti.i32):
        for i in range(n):
            pi = load(p, i)
            d = load(g, i) * sign
            if l2:
                d = d + wd * pi
            p[i] = ti.cast(pi + neg_lr * d, T)

    @ti.kernel
    def sgd_momentum(
        p: X, g: X, buf: S, n: ti.i32, neg_lr: ti.f32, sign: ti.f32, wd: ti.f32, l2: ti.i32,
        momentum: ti.f32, one_minus_damp: ti.f32, nesterov: ti.i32, first: ti.i32,
    ):  # fmt: skip
        for i in range(n):
            pi = load(p, i)
            d = load(g, i) * sign
            if l2:
                d = d + wd * pi
            b = d
            if not first:
                b = load_state(buf, i) * momentum + one_minus_damp * d
            store_state(buf, i, b)
            b = load_state(buf, i)  # the stored (for float16 or bfloat16, rounded) value, as the reference
            step = b
            if nesterov:
                step = d + momentum * b
            p[i] = ti.cast(pi + neg_lr * step, T)

    @ti.kernel
    def adam(
        p: X, g: X, m: S, v: S, vmax: S, n: ti.i32, neg_step: ti.f32, bc2: ti.f32, eps: ti.f32,
        wd: ti.f32, decay: ti.f32, w: ti.f32, one_minus_w: ti.f32, small: ti.i32, beta2: ti.f32,
        one_minus_beta2: ti.f32, sign: ti.f32, l2: ti.i32, dec: ti.i32, amsgrad: ti.i32,
    ):  # fmt: skip
        for i in range(n):
            pi = load(p, i)
            gi = load(g, i) * sign
            if l2:
                gi = gi + wd * pi
            if dec:
                pi = pi * decay
            mi = load_state(m, i)
            if small:
                mi = mi + w * (gi - mi)
            else:
                mi = gi - (gi - mi) * one_minus_w
            vi = load_state(v, i) * beta2 + one_minus_beta2 * gi * gi
            store_state(m, i, mi)
            store_state(v, i, vi)
            mi = load_state(m, i)
            vi = load_state(v, i)
            if amsgrad:
                vm = load_state(vmax, i)
                # NaN-propagating max, as np.maximum
                vi = ti.select((vm > vi) or (vm != vm), vm, vi)  # noqa: PLR0124 (a NaN test)
                store_state(vmax, i, vi)
                vi = load_state(vmax, i)
            denom = ti.sqrt(vi) / bc2 + eps
            if ti.static(bf16_state):  # bc2 folded into neg_step and eps: adam_bf16_coefficients
                denom = ti.sqrt(vi) + eps
            p[i] = ti.cast(pi + neg_step * mi / denom, T)

    @ti.kernel
    def lion(
        p: X, g: X, m: S, n: ti.i32, neg_lr: ti.f32, decay: ti.f32, dec: ti.i32, beta1: ti.f32,
        one_minus_beta1: ti.f32, beta2: ti.f32, one_minus_beta2: ti.f32,
    ):  # fmt: skip
        for i in range(n):
            pi = load(p, i)
            gi = load(g, i)
            mi = load_state(m, i)
            if dec:
                pi = pi * decay
            c = mi * beta1 + one_minus_beta1 * gi
            sgn = ti.select(c > 0.0, 1.0, ti.select(c < 0.0, -1.0, c))
            p[i] = ti.cast(pi + neg_lr * sgn, T)
            store_state(m, i, mi * beta2 + one_minus_beta2 * gi)

    @ti.kernel
    def mark_nonfinite(x: X, n: ti.i32, flag: I32):
        for i in range(n):
            # Exponent bits all ones = inf or NaN; a bit test, because fast math may fold v - v to 0.
            bits = ti.bit_cast(ti.cast(x[i], ti.f32), ti.i32)
            if (bits & 0x7F800000) == 0x7F800000:
                ti.atomic_or(flag[0], 1)

    @ti.kernel
    def unscale_mark(x: X, n: ti.i32, inv_scale: ti.f32, flag: I32):
        # GradScaler's unscale: check (as mark_nonfinite, an integer OR: no float atomics) and scale
        # in one read and one write per element.
        for i in range(n):
            v = ti.cast(x[i], ti.f32)
            if (ti.bit_cast(v, ti.i32) & 0x7F800000) == 0x7F800000:
                ti.atomic_or(flag[0], 1)
            x[i] = ti.cast(v * inv_scale, T)

    @ti.kernel
    def take_flag(flag: I32) -> ti.i32:
        value = flag[0]
        flag[0] = 0
        return value

    return SimpleNamespace(
        sgd_plain=sgd_plain,
        sgd_momentum=sgd_momentum,
        adam=adam,
        lion=lion,
        mark_nonfinite=mark_nonfinite,
        unscale_mark=unscale_mark,
        take_flag=take_flag,
    )


def all_kernels() -> list:
    """Every (name, kernel) pair this module may launch, per storage dtype (for ``metal_check``)."""
    pairs = []
    for dtype in FLOAT_DTYPES:
        for name, kernel in vars(_kernels(dtype)).items():
            pairs.append((f"optim_{name}_{dtype.name}", kernel))
    for name in ("sgd_momentum", "adam", "lion"):  # bfloat16 state, float32 parameters
        pairs.append((f"optim_{name}_float32_bf16_state", getattr(_kernels(np.dtype(np.float32), True), name)))
    return pairs


def _bf16(state) -> bool:
    """Whether a state array holds bfloat16 bits (NOTE [ bfloat16 optimizer state ])."""
    return state.dtype == BITS_DTYPE


def sgd_step(
    param, grad, momentum_buffer, lr, momentum, dampening, weight_decay, nesterov, maximize, first_step
):
    """SGD with momentum in one kernel launch (see ``reference.optim.sgd_step``)."""
    n = param.size
    if n == 0:
        return
    k = _kernels(param.dtype)
    common = (n, float(-lr), -1.0 if maximize else 1.0, float(weight_decay), int(weight_decay != 0))
    if momentum == 0:
        k.sgd_plain(_nd(param), _nd(grad), *common)
        return
    _kernels(param.dtype, _bf16(momentum_buffer)).sgd_momentum(
        _nd(param), _nd(grad), _nd(momentum_buffer), *common,
        float(momentum), float(1.0 - dampening), int(bool(nesterov)), int(bool(first_step)),
    )  # fmt: skip


def adam_step(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    max_exp_avg_sq,
    step,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    decoupled,
    amsgrad,
    maximize,
):
    """Adam / AdamW in one kernel launch (see ``reference.optim.adam_step``)."""
    n = param.size
    if n == 0:
        return
    hyper = AdamHyper(lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled)
    # Taichi rounds each float to the kernel's f32 argument once, as in_precision does for the host.
    c = (adam_bf16_coefficients if _bf16(exp_avg) else adam_coefficients)(hyper, step)
    vmax = _nd(max_exp_avg_sq) if amsgrad else _optional(None, exp_avg.dtype)
    _kernels(param.dtype, _bf16(exp_avg)).adam(
        _nd(param), _nd(grad), _nd(exp_avg), _nd(exp_avg_sq), vmax, n,
        c.neg_step_size, c.bias_correction2_sqrt, c.eps, c.weight_decay, c.decay,
        c.lerp_weight, c.one_minus_lerp_weight, int(c.lerp_small), c.beta2, c.one_minus_beta2,
        c.sign, int(c.l2), int(c.decoupled_decay), int(bool(amsgrad)),
    )  # fmt: skip


def lion_step(param, grad, exp_avg, lr, beta1, beta2, weight_decay):
    """Lion in one kernel launch (see ``reference.optim.lion_step``)."""
    n = param.size
    if n == 0:
        return
    _kernels(param.dtype, _bf16(exp_avg)).lion(
        _nd(param), _nd(grad), _nd(exp_avg), n, float(-lr), float(1.0 - lr * weight_decay),
        int(weight_decay != 0), float(beta1), float(1.0 - beta1), float(beta2), float(1.0 - beta2),
    )  # fmt: skip


_flags: dict = {}  # runtime generation -> the 1-element int32 ndarray mark_nonfinite ORs into


def all_finite(arrays) -> bool:
    """Whether every element of every array is finite: one marking kernel per array, one 4-byte read-back."""
    arrays = [a for a in arrays if a.size]
    if not arrays:
        return True
    flag = _flag()
    for x in arrays:
        _kernels(x.dtype).mark_nonfinite(_nd(x), x.size, flag)
    bad = _kernels(arrays[0].dtype).take_flag(flag)
    _count_transfer("device_to_host", 4)
    return bad == 0


def _flag():
    """The runtime's 1-element int32 flag that the marking kernels OR into (zero between calls)."""
    generation = _state["generation"]
    if generation not in _flags:
        # Through the runtime's storage class: see NOTE [ Re-initialising Taichi ] in _runtime.py.
        # Zeroed here, not left to the allocation (new device memory is not promised to be zero);
        # take_flag leaves it zeroed again. A 4-byte flag that lives as long as the runtime, not a
        # result: it does not come from the pool.
        _flags.clear()
        flag = _make_storage(_ti_dtype(np.int32), 1)
        _fill_kernel(np.dtype(np.int32))(flag, 1, 0)
        _flags[generation] = flag
    return _flags[generation]


def unscale_check(grads, inv_scale) -> bool:
    """Scale every gradient by ``inv_scale`` in place and report a NaN or infinity: one kernel per
    array, one 4-byte read-back (see ``reference.optim.unscale_check``)."""
    grads = [g for g in grads if g.size]
    if not grads:
        return False
    flag = _flag()
    inv = float(np.float32(inv_scale))
    for g in grads:
        _kernels(g.dtype).unscale_mark(_nd(g), g.size, inv, flag)
    found = _kernels(grads[0].dtype).take_flag(flag)
    _count_transfer("device_to_host", 4)
    return found != 0
