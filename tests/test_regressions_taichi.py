"""Regression tests for defects found on the taichi backend.

Most tests run on every backend (the ``backend`` fixture in conftest.py): the numpy and numba
backends already behaved, and the taichi params (taichi-cpu and the GPU param) are held to them.
Each test failed on taichi-cpu and taichi-vulkan before its fix.
"""

from __future__ import annotations

import numpy as np
import pytest

import taifuse
import taifuse.functional as F


def _rng() -> np.random.Generator:
    return np.random.default_rng(20240611)


def _skip_host(backend) -> None:
    if backend.name != "taichi":
        pytest.skip(f"{backend.param} keeps its data in NumPy: the defect is the taichi backend's")


# ----------------------------------------------------------------------------- bad operands are named

# (op, its array arguments, the position of the bad one). The first operand sets the dtype, so a bad
# first operand only fails on a backend that refuses float64 outright.
_NAMED_OPERANDS = {
    "mse_loss": (F.mse_loss, [("input", (3, 4)), ("target", (3, 4))]),
    "add_relu": (F.add_relu, [("a", (3, 4)), ("b", (3, 4))]),
    "mul_relu": (F.mul_relu, [("a", (3, 4)), ("b", (3, 4))]),
    "affine": (F.affine, [("x", (3, 4)), ("scale", (4,)), ("bias", (4,))]),
    "linear": (F.linear, [("x", (3, 5)), ("weight", (4, 5)), ("bias", (4,))]),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, 4, w, b), [("x", (3, 4)), ("weight", (4,)), ("bias", (4,))]),
}
_BAD_OPERAND_CASES = [
    pytest.param(op, k, mode, id=f"{op}-{argname}-{mode}")
    for op, (_, params) in _NAMED_OPERANDS.items()
    for k, (argname, _) in enumerate(params)
    for mode in ("numpy", "tensors")
]


@pytest.mark.parametrize("bad_dtype", [np.float64, np.int32], ids=["float64", "int32"])
@pytest.mark.parametrize("op, bad_at, mode", _BAD_OPERAND_CASES)
def test_a_bad_operand_dtype_is_named_with_its_value(backend, op, bad_at, mode, bad_dtype):
    """A float64 or integer operand among float32 ones: a TypeError that names the argument and its
    dtype (NumPy arguments, or NumPy among Tensors), never an internal helper such as from_numpy."""
    fn, params = _NAMED_OPERANDS[op]
    argname = params[bad_at][0]
    if bad_at == 0 and bad_dtype == np.float64 and backend.supports_f64:
        pytest.skip("the first operand sets the dtype: the message names the other operand")
    rng = _rng()
    args = []
    for k, (_, shape) in enumerate(params):
        a = rng.standard_normal(shape)
        a = (a * 3).astype(bad_dtype) if k == bad_at else a.astype(np.float32)
        if mode == "tensors" and k != bad_at:
            a = taifuse.tensor(a, requires_grad=True)
        args.append(a)
    with pytest.raises(TypeError) as info:
        fn(*args)
    message = str(info.value)
    dtype_name = np.dtype(bad_dtype).name
    assert message.startswith(f"{op}: {argname} "), message
    assert dtype_name in message and "from_numpy" not in message, message


@pytest.mark.parametrize("mode", ["numpy", "tensors"])
def test_cross_entropy_names_its_bad_operands(backend, mode):
    rng = _rng()
    logits = rng.standard_normal((4, 3)).astype(np.float32)
    wrap = (lambda a: taifuse.tensor(a, requires_grad=True)) if mode == "tensors" else (lambda a: a)
    with pytest.raises(TypeError, match=r"^cross_entropy: target .*float32"):
        F.cross_entropy(wrap(logits), np.zeros(4, np.float32))
    with pytest.raises(TypeError, match=r"^cross_entropy: logits .*int32"):
        F.cross_entropy(np.zeros((4, 3), np.int32), np.zeros(4, np.int64))
    if not backend.supports_f64:
        with pytest.raises(TypeError, match=r"^cross_entropy: logits .*float64") as info:
            F.cross_entropy(logits.astype(np.float64), np.zeros(4, np.int64))
        assert "from_numpy" not in str(info.value)
