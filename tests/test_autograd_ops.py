"""Gradients of every differentiable functional op and Tensor operation.

Three independent checks, each over every backend that has backward kernels:

* float64 central finite differences of a random projection of the output (``gradcheck``);
* PyTorch autograd in float64 on the same inputs (skipped when torch is absent);
* float32 gradients against the float64 gradients of the reference backend.

Plus each backward kernel of a fast backend against the reference kernel, per dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import taifuse
import taifuse.functional as F
from taifuse import backends
from taifuse.backends import reference as R

try:
    import torch
    import torch.nn.functional as TF
except ImportError:  # the torch comparisons skip
    torch = None

# grad_backend: the fixture in conftest.py (every backend). The taichi backend refuses float64 by
# design (Metal has none): its gradients are checked in float32, against the float64 reference and
# PyTorch, with float32 tolerances.


def _skip_without_f64(spec) -> None:
    if not spec.supports_f64:
        pytest.skip(f"{spec.param} has no float64 (by design); its float32 gradients are checked below")


# ----------------------------------------------------------------------------- the op table


def _away_from_zero(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    # Kinks (relu at 0) break finite differences: keep |x| >= 0.1.
    return rng.choice([-1.0, 1.0], size=shape) * rng.uniform(0.1, 2.0, size=shape)


@dataclass
class Case:
    """One differentiable computation: ``fn`` on taifuse Tensors, ``torch_fn`` on torch tensors."""

    name: str
    fn: Callable[..., Any]
    inputs: Callable[[np.random.Generator], list[np.ndarray]]
    torch_fn: Callable[..., Any] | None = None
    constants: dict[int, Any] = field(default_factory=dict)  # input index -> non-differentiable value
    reseed: bool = False  # dropout: the same mask on every evaluation


def _targets(n: int, c: int) -> np.ndarray:
    return (np.arange(n) * 7 + 3) % c


def _cases() -> list[Case]:
    act_torch = {
        None: lambda y: y,
        "relu": TF.relu if torch else None,
        "gelu": TF.gelu if torch else None,
        "gelu_tanh": (lambda y: TF.gelu(y, approximate="tanh")) if torch else None,
        "silu": TF.silu if torch else None,
    }
    cases = [
        Case("gelu", lambda x: F.gelu(x), lambda r: [r.standard_normal((3, 5))], lambda x: TF.gelu(x)),
        Case(
            "gelu_tanh",
            lambda x: F.gelu(x, "tanh"),
            lambda r: [r.standard_normal((3, 5))],
            lambda x: TF.gelu(x, approximate="tanh"),
        ),
        Case("relu", F.relu, lambda r: [_away_from_zero(r, (4, 5))], lambda x: TF.relu(x)),
        Case(
            "leaky_relu",
            lambda x: F.leaky_relu(x, 0.2),
            lambda r: [_away_from_zero(r, (4, 5))],
            lambda x: TF.leaky_relu(x, 0.2),
        ),
        Case("silu", F.silu, lambda r: [r.standard_normal((3, 5)) * 3], lambda x: TF.silu(x)),
        Case("sigmoid", F.sigmoid, lambda r: [r.standard_normal((3, 5)) * 3], lambda x: torch.sigmoid(x)),
        Case("tanh", F.tanh, lambda r: [r.standard_normal((3, 5))], lambda x: torch.tanh(x)),
        Case(
            "add_relu_broadcast",
            F.add_relu,
            lambda r: [_away_from_zero(r, (4, 5)), _away_from_zero(r, (5,)) * 0.01],
            lambda a, b: TF.relu(a + b),
        ),
        Case(
            "mul_relu_broadcast",
            F.mul_relu,
            lambda r: [_away_from_zero(r, (3, 1, 4)), _away_from_zero(r, (2, 4))],
            lambda a, b: TF.relu(a * b),
        ),
        Case(
            "affine",
            F.affine,
            lambda r: [r.standard_normal((2, 3, 4)), r.standard_normal(4), r.standard_normal(4)],
            lambda x, s, b: x * s + b,
        ),
        Case(
            "affine_scalar_scale",
            lambda x, b: F.affine(x, 1.5, b),
            lambda r: [r.standard_normal((3, 4)), r.standard_normal(4)],
            lambda x, b: x * 1.5 + b,
        ),
        Case(
            "softmax",
            lambda x: F.softmax(x, -1),
            lambda r: [r.standard_normal((3, 6))],
            lambda x: TF.softmax(x, -1),
        ),
        Case(
            "softmax_dim1_of_3d",
            lambda x: F.softmax(x, 1),
            lambda r: [r.standard_normal((2, 4, 3))],
            lambda x: TF.softmax(x, 1),
        ),
        Case(
            "log_softmax",
            lambda x: F.log_softmax(x, -1),
            lambda r: [r.standard_normal((3, 6))],
            lambda x: TF.log_softmax(x, -1),
        ),
        Case(
            "log_softmax_dim0",
            lambda x: F.log_softmax(x, 0),
            lambda r: [r.standard_normal((4, 3))],
            lambda x: TF.log_softmax(x, 0),
        ),
        Case(
            "layer_norm",
            lambda x, w, b: F.layer_norm(x, 6, w, b),
            lambda r: [r.standard_normal((4, 6)), r.standard_normal(6), r.standard_normal(6)],
            lambda x, w, b: TF.layer_norm(x, (6,), w, b),
        ),
        Case(
            "layer_norm_2d_no_affine",
            lambda x: F.layer_norm(x, (2, 3)),
            lambda r: [r.standard_normal((3, 2, 3)) * 2 + 1],
            lambda x: TF.layer_norm(x, (2, 3)),
        ),
        Case(
            "rms_norm",
            lambda x, w: F.rms_norm(x, 6, w, 1e-5),
            lambda r: [r.standard_normal((4, 6)), r.standard_normal(6)],
            lambda x, w: TF.rms_norm(x, (6,), w, 1e-5),
        ),
        Case(
            "rms_norm_2d_no_weight",
            lambda x: F.rms_norm(x, (2, 3)),
            lambda r: [r.standard_normal((3, 2, 3)) * 2 + 1],
            lambda x: TF.rms_norm(x, (2, 3)),
        ),
        Case(
            # Repeated indices; padding_idx (whose row's zero gradient finite differences cannot
            # see) is checked against torch in test_rms_norm_embedding.py.
            "embedding_repeated",
            lambda i, w: F.embedding(i, w),
            lambda r: [r.standard_normal((7, 3))],
            lambda i, w: TF.embedding(i, w),
            constants={0: np.array([[1, 5, 1, 0], [5, 5, 2, 1]])},
        ),
        Case(
            "dropout",
            lambda x: F.dropout(x, 0.4),
            lambda r: [r.standard_normal((5, 7))],
            None,
            reseed=True,
        ),
        Case(
            "mse_loss_mean",
            lambda x, t: F.mse_loss(x, t),
            lambda r: [r.standard_normal((3, 4)), r.standard_normal((3, 4))],
            lambda x, t: TF.mse_loss(x, t),
        ),
        Case(
            "mse_loss_sum",
            lambda x, t: F.mse_loss(x, t, "sum"),
            lambda r: [r.standard_normal(5), r.standard_normal(5)],
            lambda x, t: TF.mse_loss(x, t, reduction="sum"),
        ),
        Case(
            "mse_loss_none",
            lambda x, t: F.mse_loss(x, t, "none"),
            lambda r: [r.standard_normal((2, 3)), r.standard_normal((2, 3))],
            lambda x, t: TF.mse_loss(x, t, reduction="none"),
        ),
    ]
    for reduction in ("mean", "sum", "none"):
        cases.append(
            Case(
                f"cross_entropy_{reduction}",
                lambda x, t, red=reduction: F.cross_entropy(x, t, red),
                lambda r: [r.standard_normal((5, 4)) * 2],
                lambda x, t, red=reduction: TF.cross_entropy(x, t, reduction=red),
                constants={1: _targets(5, 4)},
            )
        )
    cases.append(
        Case(
            "cross_entropy_vector",
            lambda x, t: F.cross_entropy(x, t),
            lambda r: [r.standard_normal(6)],
            lambda x, t: TF.cross_entropy(x, t),
            constants={1: np.array(2)},
        )
    )
    for activation in (None, "relu", "gelu", "gelu_tanh", "silu"):
        cases.append(
            Case(
                f"linear_{activation}",
                lambda x, w, b, act=activation: F.linear(x, w, b, act),
                lambda r: [r.standard_normal((4, 3)), r.standard_normal((5, 3)), r.standard_normal(5)],
                lambda x, w, b, act=activation: act_torch[act](TF.linear(x, w, b)),
            )
        )
    cases.append(
        Case(
            "linear_3d_no_bias",
            lambda x, w: F.linear(x, w, None, "gelu"),
            lambda r: [r.standard_normal((2, 3, 4)), r.standard_normal((2, 4))],
            lambda x, w: TF.gelu(TF.linear(x, w)),
        )
    )
    # Tensor arithmetic.
    cases += [
        Case(
            "add_broadcast",
            lambda a, b: a + b,
            lambda r: [r.standard_normal((3, 4)), r.standard_normal((4,))],
            lambda a, b: a + b,
        ),
        Case(
            "sub_broadcast",
            lambda a, b: a - b,
            lambda r: [r.standard_normal((2, 1, 3)), r.standard_normal((4, 1))],
            lambda a, b: a - b,
        ),
        Case(
            "mul_broadcast",
            lambda a, b: a * b,
            lambda r: [r.standard_normal((3, 1)), r.standard_normal((1, 4))],
            lambda a, b: a * b,
        ),
        Case(
            "div_broadcast",
            lambda a, b: a / b,
            lambda r: [r.standard_normal((3, 4)), r.uniform(0.5, 2.0, (3, 1))],
            lambda a, b: a / b,
        ),
        Case(
            "scalar_ops",
            lambda a: (2.0 - a) * 3.0 / (a * a + 1.0) + 1.0 / (a + 3.0) - a / 4.0,
            lambda r: [r.uniform(-1, 1, (3, 2))],
            lambda a: (2.0 - a) * 3.0 / (a * a + 1.0) + 1.0 / (a + 3.0) - a / 4.0,
        ),
        Case(
            "neg_pow",
            lambda a: -(a**3) + a**2 + a**0.5,
            lambda r: [r.uniform(0.5, 2.0, (4,))],
            lambda a: -(a**3) + a**2 + a**0.5,
        ),
        Case(
            "matmul_2d",
            lambda a, b: a @ b,
            lambda r: [r.standard_normal((3, 4)), r.standard_normal((4, 2))],
            lambda a, b: a @ b,
        ),
        Case(
            "matmul_vec_mat",
            lambda a, b: a @ b,
            lambda r: [r.standard_normal(4), r.standard_normal((4, 3))],
            lambda a, b: a @ b,
        ),
        Case(
            "matmul_mat_vec",
            lambda a, b: a @ b,
            lambda r: [r.standard_normal((3, 4)), r.standard_normal(4)],
            lambda a, b: a @ b,
        ),
        Case(
            "matmul_batched_broadcast",
            lambda a, b: a @ b,
            lambda r: [r.standard_normal((2, 3, 4)), r.standard_normal((4, 2))],
            lambda a, b: a @ b,
        ),
        Case(
            "sum_dim_keepdim",
            lambda a: a.sum(1, keepdim=True) * a,
            lambda r: [r.standard_normal((2, 3, 2))],
            lambda a: a.sum(1, keepdim=True) * a,
        ),
        Case(
            "mean_dims",
            lambda a: a.mean((0, 2)),
            lambda r: [r.standard_normal((2, 3, 2))],
            lambda a: a.mean((0, 2)),
        ),
        Case(
            "reshape_T",
            lambda a: a.reshape(3, -1).T @ a.reshape(3, 4),
            lambda r: [r.standard_normal((2, 6))],
            lambda a: a.reshape(3, -1).T @ a.reshape(3, 4),
        ),
        Case(
            "transpose",
            lambda a: a.transpose(0, 2) * 2.0,
            lambda r: [r.standard_normal((2, 3, 4))],
            lambda a: a.transpose(0, 2) * 2.0,
        ),
    ]
    return cases


CASES = _cases()
CASE_IDS = [c.name for c in CASES]


def _run(case: Case, arrays: list[np.ndarray], dtype: Any, requires_grad: bool = True):
    """Run ``case`` on fresh Tensors; returns (output Tensor, input Tensors or None for constants)."""
    if case.reseed:
        taifuse.manual_seed(1234)
    args, tensors = [], []
    values = iter(arrays)
    for i in range(len(arrays) + len(case.constants)):
        if i in case.constants:
            args.append(case.constants[i])
            tensors.append(None)
        else:
            t = taifuse.tensor(next(values), requires_grad=requires_grad, dtype=dtype)
            args.append(t)
            tensors.append(t)
    return case.fn(*args), tensors


def _grads(case: Case, arrays: list[np.ndarray], dtype: Any, weights_rng_seed: int = 7):
    out, tensors = _run(case, arrays, dtype)
    w = np.random.default_rng(weights_rng_seed).standard_normal(out.shape).astype(dtype)
    (out * taifuse.tensor(w, dtype=dtype)).sum().backward()
    return [t.grad.numpy().astype(np.float64) for t in tensors if t is not None], w.astype(np.float64)


# ----------------------------------------------------------------------------- finite differences

FD_EPS = 1e-6
# Central differences in float64: truncation ~eps^2 * f''' and rounding ~1e-16 * |f| / eps, both
# far below these for the O(1) values used here.
FD_RTOL, FD_ATOL = 1e-6, 1e-7


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_gradients_match_finite_differences(grad_backend, case):
    _skip_without_f64(grad_backend)
    rng = np.random.default_rng(0)
    arrays = case.inputs(rng)
    analytic, w = _grads(case, [a.copy() for a in arrays], np.float64)

    def objective(values: list[np.ndarray]) -> float:
        with taifuse.no_grad():
            out, _ = _run(case, [v.copy() for v in values], np.float64, requires_grad=False)
        return float(np.sum(out.numpy() * w))

    for k, a in enumerate(arrays):
        numeric = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            plus = [v.copy() for v in arrays]
            minus = [v.copy() for v in arrays]
            plus[k][idx] += FD_EPS
            minus[k][idx] -= FD_EPS
            numeric[idx] = (objective(plus) - objective(minus)) / (2 * FD_EPS)
        np.testing.assert_allclose(
            analytic[k],
            numeric,
            rtol=FD_RTOL,
            atol=FD_ATOL,
            err_msg=f"{case.name}: gradient of input {k} on {grad_backend.param}",
        )


# ----------------------------------------------------------------------------- PyTorch


@pytest.mark.skipif(torch is None, reason="torch is not installed")
@pytest.mark.parametrize(
    "case",
    [c for c in CASES if c.torch_fn is not None],
    ids=[c.name for c in CASES if c.torch_fn is not None],
)
def test_gradients_match_torch_float64(grad_backend, case):
    arrays = case.inputs(np.random.default_rng(1))
    dtype = np.float64 if grad_backend.supports_f64 else np.float32
    # Both sides see the same (rounded) inputs; torch always differentiates in float64.
    arrays = [a.astype(dtype).astype(np.float64) for a in arrays]
    got, w = _grads(case, [a.astype(dtype) for a in arrays], dtype)
    targs, leaves = [], []
    for i in range(len(arrays) + len(case.constants)):
        if i in case.constants:
            targs.append(torch.from_numpy(np.asarray(case.constants[i], dtype=np.int64)))
        else:
            leaf = torch.tensor(arrays[len(leaves)], dtype=torch.float64, requires_grad=True)
            leaves.append(leaf)
            targs.append(leaf)
    (case.torch_fn(*targs) * torch.from_numpy(w)).sum().backward()
    for k, leaf in enumerate(leaves):
        expected = leaf.grad.numpy()
        if dtype == np.float64:  # float64 on both sides: only summation order and libm differ.
            rtol, atol = 1e-9, 1e-12
        else:
            rtol, atol = F32_RTOL, F32_ATOL * max(1.0, float(np.abs(expected).max()))
        np.testing.assert_allclose(
            got[k], expected, rtol=rtol, atol=atol, err_msg=f"{case.name}: input {k} on {grad_backend.param}"
        )


def test_dropout_gradient_is_the_forward_mask(grad_backend):
    dtype = np.float64 if grad_backend.supports_f64 else np.float32
    x = taifuse.tensor(np.ones((64, 33)), requires_grad=True, dtype=dtype)
    y = F.dropout(x, 0.3)
    y.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), y.numpy())  # d y / d x = mask / (1 - p) = y for x = 1
    kept = (y.numpy() != 0).mean()
    assert 0.6 < kept < 0.8, f"kept fraction {kept} for p = 0.3"


# ----------------------------------------------------------------------------- float32 vs the reference

F32_RTOL, F32_ATOL = 1e-4, 2e-5  # float32 rounding through a few ops, relative to max |grad|


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_float32_gradients_match_float64_reference(grad_backend, case):
    arrays = case.inputs(np.random.default_rng(2))
    arrays32 = [a.astype(np.float32) for a in arrays]
    got, _ = _grads(case, [a.copy() for a in arrays32], np.float32)
    with taifuse.use_backend("numpy"):
        ref, _ = _grads(case, [a.astype(np.float64) for a in arrays32], np.float64)
    for k, (g, r) in enumerate(zip(got, ref)):
        scale = max(1.0, float(np.abs(r).max()))
        np.testing.assert_allclose(
            g,
            r,
            rtol=F32_RTOL,
            atol=F32_ATOL * scale,
            err_msg=f"{case.name}: input {k} on {grad_backend.param}",
        )


# ----------------------------------------------------------------------------- kernels vs the reference

KERNEL_TOL = {  # (rtol, atol relative to max |reference|)
    np.dtype(np.float64): (1e-12, 1e-13),
    np.dtype(np.float32): (1e-5, 2e-6),
    np.dtype(np.float16): (2e-3, 1e-3),  # float16 storage: one rounding of a float32 result
}


def _kernel_calls(rng: np.random.Generator, dtype: np.dtype, rows: int, cols: int):
    """(kernel name, args builder) pairs; builders return (inputs, outputs) with fresh buffers."""
    stats = np.float64 if dtype == np.float64 else np.float32

    def arr(*shape):
        return rng.standard_normal(shape).astype(dtype)

    def out(*shape, dt=dtype):
        return np.full(shape, np.nan, dt)

    x, g = arr(rows, cols), arr(rows, cols)
    calls = []
    for name, extra in [
        ("gelu_backward", ("none",)),
        ("gelu_backward", ("tanh",)),
        ("relu_backward", ()),
        ("leaky_relu_backward", (0.05,)),
        ("silu_backward", ()),
        ("sigmoid_backward", ()),
        ("tanh_backward", ()),
        ("add_relu_backward", ()),
    ]:
        calls.append((name, lambda e=extra: ((x, g), (out(rows, cols),), e)))
    calls.append(
        ("mul_relu_backward", lambda: ((x, arr(rows, cols), g), (out(rows, cols), out(rows, cols)), ()))
    )
    calls.append(
        ("affine_backward", lambda: ((x, arr(cols), g), (out(rows, cols), out(cols), out(cols)), ()))
    )
    m_out = max(5, rows // 2)
    w, pre, go = arr(m_out, cols), arr(rows, m_out), arr(rows, m_out)
    for act in (None, "relu", "gelu", "gelu_tanh", "silu"):
        calls.append(
            (
                "linear_act_backward",
                lambda a=act: (
                    (x, w, pre, go, a, out(rows, m_out)),
                    (out(rows, cols), out(m_out, cols), out(m_out)),
                    (),
                ),
            )
        )
    mean, rstd = np.empty(rows, stats), np.empty(rows, stats)
    R.layer_norm(x, None, None, 1e-5, np.empty_like(x), mean, rstd)
    calls.append(
        (
            "layer_norm_backward",
            lambda: ((x, arr(cols), mean, rstd, g), (out(rows, cols), out(cols), out(cols)), ()),
        )
    )
    rms = np.empty(rows, stats)
    R.rms_norm(x, None, 1e-5, np.empty_like(x), rms)
    calls.append(("rms_norm_backward", lambda: ((x, arr(cols), rms, g), (out(rows, cols), out(cols)), ())))
    # batch_norm: x as (N, C, 1), the statistics from the reference, with the fused ReLU.
    x3, g3 = x.reshape(rows, cols, 1), g.reshape(rows, cols, 1)
    bn_mean, bn_var, bn_inv = (np.empty(cols, stats) for _ in range(3))
    R.batch_norm_stats(x3, bn_mean, bn_var)
    R.batch_norm_update(bn_mean, bn_var, rows, 1e-5, 0.1, None, None, bn_inv)
    calls.append(
        (
            "batch_norm_backward",
            lambda: (
                (x3, g3, bn_mean, bn_inv, arr(cols), arr(cols), "relu", True),
                (out(rows, cols, 1), out(cols), out(cols)),
                (),
            ),
        )
    )
    # Convolution and pooling (their own tests run odd geometries: tests/test_conv.py,
    # test_pool2d.py): one geometry each, on a (2, 3, 5, 6) image.
    xc, wc = arr(2, 3, 5, 6), arr(4, 3, 3, 3)
    calls.append(
        (
            "conv2d_backward",
            lambda: (
                (xc, wc, None, arr(2, 4, 5, 6), (1, 1), (1, 1), (1, 1), 1, None),
                (out(2, 3, 5, 6), out(4, 3, 3, 3), out(4)),
                (),
            ),
        )
    )
    # The fused Conv-BN-ReLU block: y and its statistics from the reference (tests/test_conv_bn.py
    # runs the geometries).
    yc = np.empty((2, 4, 5, 6), dtype)
    cb_mean, cb_var, cb_inv = (np.empty(4, stats) for _ in range(3))
    R.conv2d_stats(xc, wc, None, (1, 1), (1, 1), (1, 1), 1, yc, cb_mean, cb_var)
    R.batch_norm_update(cb_mean, cb_var, 60, 1e-5, 0.1, None, None, cb_inv)
    calls.append(
        (
            "conv2d_batch_norm_backward",
            lambda: (
                (
                    xc,
                    wc,
                    yc,
                    arr(2, 4, 5, 6),
                    cb_mean,
                    cb_inv,
                    arr(4),
                    arr(4),
                    "relu",
                    (1, 1),
                    (1, 1),
                    (1, 1),
                    1,
                ),
                (out(2, 3, 5, 6), out(4, 3, 3, 3), out(4), out(4), out(4)),
                (),
            ),
        )
    )
    pooled, flat_max = np.empty((2, 3, 3, 3), dtype), np.empty((2, 3, 3, 3), np.int64)
    R.max_pool2d(xc, (3, 3), (2, 2), (1, 1), (1, 1), pooled, flat_max)

    flat_max = flat_max.astype(np.int32)  # taichi's index dtype; the others take it too
    calls.append(
        (
            "max_pool2d_backward",
            lambda: ((flat_max, arr(2, 3, 3, 3), (3, 3), (2, 2), (1, 1), (1, 1)), (out(2, 3, 5, 6),), ()),
        )
    )
    calls.append(
        (
            "avg_pool2d_backward",
            lambda: ((arr(2, 3, 3, 3), (3, 3), (2, 2), (1, 1), False, 0), (out(2, 3, 5, 6),), ()),
        )
    )
    calls.append(("adaptive_avg_pool2d_backward", lambda: ((arr(2, 3, 2, 4),), (out(2, 3, 5, 6),), ())))
    idx = rng.integers(0, max(1, cols // 3), rows)  # repeated indices, some rows never seen
    calls.append(("embedding_backward", lambda: ((idx, g), (out(cols, cols),), (int(idx[0]),))))
    # attention: q (BH, L, E), k (BH, S, E), v (BH, S, Ev); causal without a mask, and an additive
    # mask (M = 1) with dropout.
    bh, n_q, n_k = 2, rows // 4 + 1, cols // 4 + 1
    q, k, v, g_att = arr(bh, n_q, 24), arr(bh, n_k, 24), arr(bh, n_k, 16), arr(bh, n_q, 16)
    additive = np.where(rng.random((1, n_q, n_k)) < 0.2, -np.inf, 0.0).astype(dtype)
    for mask, causal, p_drop in ((None, True, 0.0), (additive, False, 0.25)):
        o, lse = np.empty((bh, n_q, 16), dtype), np.empty((bh, n_q), stats)
        R.attention(q, k, v, mask, causal, 0.2, p_drop, 7, o, lse)
        calls.append(
            (
                "attention_backward",
                lambda m=mask, c=causal, p=p_drop, o=o, lse=lse: (
                    (q, k, v, m, c, 0.2, p, 7, o, lse, g_att),
                    (out(bh, n_q, 24), out(bh, n_k, 24), out(bh, n_k, 16)),
                    (),
                ),
            )
        )
    for name in ("softmax", "log_softmax"):
        for shape in ((rows, cols, 1), (3, 5, 4), (rows // 8 + 1, 5, cols)):
            xs = arr(*shape)
            y = np.empty_like(xs)
            getattr(R, name)(xs, y)
            calls.append((name + "_backward", lambda y=y, s=shape: ((y, arr(*s)), (out(*s),), ())))
    calls.append(("dropout_backward", lambda: ((g,), (out(rows, cols),), (0.3, 99))))
    t = _targets(rows, cols)
    for red in ("none", "mean", "sum"):
        n = (rows, cols) if red == "none" else (1,)
        calls.append(("mse_loss", lambda n=n, r=red: ((x, g), (out(*n),), (r,))))
        calls.append(("mse_loss_backward", lambda n=n, r=red: ((x, g, arr(*n)), (out(rows, cols),), (r,))))
        m = (rows,) if red == "none" else (1,)
        calls.append(("cross_entropy", lambda m=m, r=red: ((x, t), (out(*m), out(rows, dt=stats)), (r,))))
        lse = np.empty(rows, stats)
        R.cross_entropy(x, t, np.empty(m, dtype), red, lse)
        calls.append(
            (
                "cross_entropy_backward",
                lambda m=m, r=red, lse=lse: ((x, t, lse, arr(*m)), (out(rows, cols),), (r,)),
            )
        )
    return calls


def _on_backend(module, value: Any) -> Any:
    """A host array as ``module``'s array (a DeviceArray on taichi); other values unchanged."""
    if isinstance(value, np.ndarray) and not module.is_array(value):
        return module.from_numpy(value)
    return value


def _invoke(module, name: str, inputs: tuple, outputs: tuple, extra: tuple) -> None:
    kernel = getattr(module, name)
    if name in ("mse_loss", "mse_loss_backward"):
        kernel(*inputs, *outputs, *extra)
    elif name == "cross_entropy":
        kernel(*inputs, outputs[0], *extra, outputs[1])
    elif name == "cross_entropy_backward":
        kernel(*inputs, *outputs, *extra)
    else:
        kernel(*inputs, *outputs, *extra)


# The large size is past the parallel threshold of the Numba kernels, so both variants run.
# float16 sums of the large size overflow to inf (on both sides, compared equal): NumPy warns.
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("rows, cols", [(9, 37), (260, 301)], ids=["small", "large"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=["f16", "f32", "f64"])
def test_backward_kernels_match_reference(grad_backend, dtype, rows, cols):
    if grad_backend.name == "numpy":
        pytest.skip("the reference is the numpy backend itself")
    from taifuse._autograd_ops import kernels

    module = kernels(grad_backend.module())
    missing = [n for n in backends.BACKWARD_KERNEL_NAMES if not hasattr(module, n)]
    assert not missing, f"{grad_backend.param} lacks {missing}"
    dtype = np.dtype(dtype)
    if dtype == np.float64:
        _skip_without_f64(grad_backend)
    rtol, atol = KERNEL_TOL[dtype]
    seen = set()
    for name, build in _kernel_calls(np.random.default_rng(3), dtype, rows, cols):
        seen.add(name)
        inputs, outputs, extra = build()
        expected = tuple(np.full_like(o, np.nan) for o in outputs)
        _invoke(R, name, inputs, expected, extra)
        device_outputs = tuple(_on_backend(module, o) for o in outputs)
        _invoke(module, name, tuple(_on_backend(module, a) for a in inputs), device_outputs, extra)
        outputs = tuple(module.to_numpy(o) for o in device_outputs)
        for got, ref in zip(outputs, expected):
            ref64 = ref.astype(np.float64)
            scale = max(1.0, float(np.abs(ref64).max()))
            np.testing.assert_allclose(
                got.astype(np.float64),
                ref64,
                rtol=rtol,
                atol=atol * scale,
                err_msg=f"{name}{extra} {dtype} on {grad_backend.param}",
            )
    assert seen == set(backends.BACKWARD_KERNEL_NAMES)


def test_reference_exports_every_backward_kernel():
    missing = [n for n in backends.BACKWARD_KERNEL_NAMES if not callable(getattr(R, n, None))]
    assert not missing


# ----------------------------------------------------------------------------- losses on NumPy


def test_losses_accept_numpy_and_return_numpy(grad_backend):
    x = np.array([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]], np.float32)
    loss = F.cross_entropy(x, np.array([2, 0]))
    assert isinstance(loss, np.ndarray) and loss.shape == () and loss.dtype == np.float32
    lse = np.log(np.exp(x.astype(np.float64)).sum(axis=1))
    expected = np.mean(lse - x[[0, 1], [2, 0]])
    assert math.isclose(float(loss), expected, rel_tol=1e-6)
    mse = F.mse_loss(x, np.zeros_like(x), reduction="sum")
    assert math.isclose(float(mse), float((x.astype(np.float64) ** 2).sum()), rel_tol=1e-6)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (
            lambda: F.cross_entropy(np.zeros((2, 3), np.float32), np.array([0, 3])),
            ValueError,
            "class index 3",
        ),
        (lambda: F.cross_entropy(np.zeros((2, 3), np.float32), np.array([0.0, 1.0])), TypeError, "integer"),
        (lambda: F.cross_entropy(np.zeros((2, 3), np.float32), np.array([0])), ValueError, r"shape \(2,\)"),
        (lambda: F.cross_entropy(np.zeros((2, 3, 4), np.float32), np.array([0, 1])), ValueError, "logits"),
        (
            lambda: F.cross_entropy(np.zeros((2, 3), np.float32), np.array([0, 1]), "avg"),
            ValueError,
            "reduction",
        ),
        (lambda: F.mse_loss(np.zeros(3, np.float32), np.zeros(4, np.float32)), ValueError, "same shape"),
        (lambda: F.mse_loss(np.zeros(3, np.float32), np.zeros(3, np.float64)), TypeError, "dtype"),
        (lambda: F.gelu(taifuse.tensor([1.0]), out=np.zeros(1, np.float32)), TypeError, "out="),
        (
            lambda: F.linear(taifuse.tensor(np.ones((2, 3), np.float32)), np.ones((4, 2), np.float32)),
            ValueError,
            "features",
        ),
    ],
)
def test_bad_inputs_raise(grad_backend, call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_float16_storage_gradients(grad_backend):
    """float16 tensors train through every layer kind: gradients within float16 rounding of float32's."""
    rng = np.random.default_rng(4)
    x, w, b = rng.standard_normal((6, 8)), rng.standard_normal((5, 8)) * 0.3, rng.standard_normal(5) * 0.1
    gamma = rng.uniform(0.5, 1.5, 5)
    target = _targets(6, 5)

    def grads(dtype):
        ts = [taifuse.tensor(a, requires_grad=True, dtype=dtype) for a in (x, w, b, gamma)]
        h = F.linear(ts[0], ts[1], ts[2], "gelu_tanh")
        h = F.layer_norm(h, 5, ts[3])
        F.cross_entropy(F.silu(h), target).backward()
        return [t.grad for t in ts]

    for g16, g32 in zip(grads(np.float16), grads(np.float32)):
        assert g16.dtype == np.float16
        ref = g32.numpy().astype(np.float64)
        # A few float16 roundings (2**-11 relative each) of the forward and backward values.
        np.testing.assert_allclose(
            g16.numpy().astype(np.float64), ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max()
        )
