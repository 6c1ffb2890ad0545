"""Kernels that must FAIL ``metal_check``: they prove the check can fail (used by its self-tests only)."""

# NOTE: no `from __future__ import annotations`: Taichi reads kernel annotations as objects.
import taichi as ti

A = ti.types.ndarray(dtype=ti.f32, ndim=1)


@ti.kernel
def f64_kernel(x: ti.types.ndarray(dtype=ti.f64, ndim=1), n: ti.i32):
    """Uses float64, which Metal lacks."""
    for i in range(n):
        x[i] = ti.sqrt(x[i])


@ti.kernel
def wide_kernel(
    a0: A,
    a1: A,
    a2: A,
    a3: A,
    a4: A,
    a5: A,
    a6: A,
    a7: A,
    a8: A,
    a9: A,
    a10: A,
    a11: A,
    a12: A,
    a13: A,
    a14: A,
    a15: A,
    a16: A,
    a17: A,
    a18: A,
    a19: A,
    a20: A,
    a21: A,
    a22: A,
    a23: A,
    a24: A,
    a25: A,
    a26: A,
    a27: A,
    a28: A,
    a29: A,
    a30: A,
    a31: A,
    n: ti.i32,
):
    """Binds 32 ndarrays (plus Taichi's own buffers): more than Metal's 31 buffer bindings."""
    for i in range(n):
        a0[i] += a1[i]
        a0[i] += a2[i]
        a0[i] += a3[i]
        a0[i] += a4[i]
        a0[i] += a5[i]
        a0[i] += a6[i]
        a0[i] += a7[i]
        a0[i] += a8[i]
        a0[i] += a9[i]
        a0[i] += a10[i]
        a0[i] += a11[i]
        a0[i] += a12[i]
        a0[i] += a13[i]
        a0[i] += a14[i]
        a0[i] += a15[i]
        a0[i] += a16[i]
        a0[i] += a17[i]
        a0[i] += a18[i]
        a0[i] += a19[i]
        a0[i] += a20[i]
        a0[i] += a21[i]
        a0[i] += a22[i]
        a0[i] += a23[i]
        a0[i] += a24[i]
        a0[i] += a25[i]
        a0[i] += a26[i]
        a0[i] += a27[i]
        a0[i] += a28[i]
        a0[i] += a29[i]
        a0[i] += a30[i]
        a0[i] += a31[i]
