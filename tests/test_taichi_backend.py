"""The taichi backend's own behaviour: DeviceArray semantics, transfer counting, dtype refusal, arch switches.

Kernel correctness against the reference across dtypes and shapes lives in the generic backend suite;
the few kernel checks here are the ones only this backend has (its erf, the f16 storage path).
"""

from __future__ import annotations

import gc
import math
import sys

import numpy as np
import pytest

pytest.importorskip("taichi")

import taifuse
import taifuse.functional as F
from taifuse.backends import reference
from taifuse.backends import taichi as tg


@pytest.fixture
def cpu():
    """Taichi on ti.cpu (re-initialised if another test switched arch)."""
    tg.init("cpu")
    tg.reset_transfer_stats()
    yield tg


@pytest.fixture
def taichi_active(cpu):
    """The dispatcher's active backend is taichi on ti.cpu for the test."""
    with taifuse.use_backend("taichi", arch="cpu"):
        tg.reset_transfer_stats()
        yield tg


def _vulkan_or_skip():
    try:
        tg.init("vulkan")
    except RuntimeError as exc:
        pytest.skip(f"Taichi's Vulkan backend is unavailable: {exc}")


# ----------------------------------------------------------------------------- DeviceArray


def test_roundtrip_preserves_values_shape_and_dtype(cpu):
    for dtype in (np.float32, np.float16):
        host = np.arange(24, dtype=dtype).reshape(2, 3, 4) / 7
        arr = tg.from_numpy(host)
        assert tg.is_array(arr) and not tg.is_array(host)
        assert (arr.shape, arr.dtype, arr.size, arr.ndim) == ((2, 3, 4), np.dtype(dtype), 24, 3)
        back = arr.numpy()
        assert back.dtype == dtype and back.shape == (2, 3, 4)
        np.testing.assert_array_equal(back, host)


def test_from_numpy_accepts_non_contiguous_input(cpu):
    host = np.arange(12, dtype=np.float32).reshape(3, 4).T  # Fortran-ordered view
    np.testing.assert_array_equal(tg.from_numpy(host).numpy(), host)


def test_reshape_is_a_view_sharing_storage_without_copies(cpu):
    x = tg.from_numpy(np.array([-1.0, 2.0, -3.0, 4.0, -5.0, 6.0], dtype=np.float32))
    out = tg.empty((6,), np.float32)
    tg.reset_transfer_stats()
    view = out.reshape((2, 3))
    assert view.shape == (2, 3) and out.reshape(3, -1).shape == (3, 2)
    tg.relu(x.reshape(2, 3), view)  # writes through the view
    assert tg.transfer_stats()["host_to_device"] == 0 and tg.transfer_stats()["device_to_host"] == 0
    np.testing.assert_array_equal(out.numpy(), [0.0, 2.0, 0.0, 4.0, 0.0, 6.0])


def test_reshape_rejects_a_wrong_size(cpu):
    arr = tg.empty((2, 3), np.float32)
    with pytest.raises(ValueError, match="reshape"):
        arr.reshape(4, 2)
    with pytest.raises(ValueError, match="-1"):
        arr.reshape(-1, -1)


def test_size_zero_arrays_work_without_touching_taichi(cpu):
    arr = tg.empty((0, 5), np.float32)
    assert arr.size == 0 and arr.numpy().shape == (0, 5)
    back = tg.from_numpy(np.zeros((3, 0), np.float16)).numpy()
    assert back.shape == (3, 0) and back.dtype == np.float16
    assert "shape=(0, 5)" in repr(arr)


def test_repr_names_shape_dtype_and_arch(cpu):
    text = repr(tg.empty((2, 2), np.float16))
    assert "DeviceArray" in text and "(2, 2)" in text and "float16" in text and "x64" in text


# ----------------------------------------------------------------------------- transfers


def test_each_host_device_copy_is_counted_with_its_bytes(cpu):
    host = np.ones((4, 8), np.float32)
    arr = tg.from_numpy(host)
    arr.numpy()
    tg.to_numpy(arr)
    stats = tg.transfer_stats()
    assert stats["host_to_device"] == 1 and stats["bytes_host_to_device"] == host.nbytes
    assert stats["device_to_host"] == 2 and stats["bytes_device_to_host"] == 2 * host.nbytes
    tg.reset_transfer_stats()
    assert set(tg.transfer_stats().values()) == {0}


def test_numpy_op_copies_each_input_in_once_and_the_result_out_once(taichi_active):
    a = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)
    b = np.full((3, 4), 0.5, np.float32)
    result = F.add_relu(a, b)
    assert isinstance(result, np.ndarray)
    np.testing.assert_allclose(result, np.maximum(a + b, 0))
    stats = tg.transfer_stats()
    assert (stats["host_to_device"], stats["device_to_host"]) == (2, 1)

    tg.reset_transfer_stats()
    weight = np.ones(4, np.float32)
    F.layer_norm(a, 4, weight=weight)  # mean/rstd stay on the device
    stats = tg.transfer_stats()
    assert (stats["host_to_device"], stats["device_to_host"]) == (2, 1)


def test_device_array_inputs_make_no_copies_and_return_device_arrays(taichi_active):
    x = tg.from_numpy(np.linspace(-3, 3, 64, dtype=np.float32).reshape(8, 8))
    w = tg.from_numpy(np.eye(8, dtype=np.float32))
    tg.reset_transfer_stats()
    y = F.linear(F.gelu(x), w, activation="relu")
    z = F.softmax(y, dim=0)
    assert tg.is_array(y) and tg.is_array(z)
    assert tg.transfer_stats()["host_to_device"] == 0 and tg.transfer_stats()["device_to_host"] == 0
    np.testing.assert_allclose(z.numpy().sum(axis=0), np.ones(8), rtol=1e-6)


# ----------------------------------------------------------------------------- dtypes


def test_check_dtype_refuses_float64_naming_metal(cpu):
    with pytest.raises(TypeError, match="float64.*Metal"):
        tg.check_dtype(np.float64, "x")
    for bad in (np.int32, np.int64, np.bool_, np.complex64):
        with pytest.raises(TypeError, match="float16 or float32"):
            tg.check_dtype(bad, "x")
    tg.check_dtype(np.float32, "x")
    tg.check_dtype(np.float16, "x")


def test_float64_never_reaches_the_device(cpu):
    with pytest.raises(TypeError, match="float64"):
        tg.from_numpy(np.zeros(3))
    with pytest.raises(TypeError, match="float64"):
        tg.empty((3,), np.float64)
    assert tg.transfer_stats()["host_to_device"] == 0


def test_functional_op_refuses_float64_on_the_taichi_backend(taichi_active):
    with pytest.raises(TypeError, match="gelu: x.*float64"):
        F.gelu(np.zeros(4))


def test_float16_storage_computes_in_float32(cpu):
    # A large-ish f16 linear: accumulating in f16 would be far off the float64 reference.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 512)).astype(np.float16)
    w = rng.standard_normal((4, 512)).astype(np.float16)
    out = tg.empty((8, 4), np.float16)
    tg.linear_act(tg.from_numpy(x), tg.from_numpy(w), None, None, out)
    expected = np.empty((8, 4), np.float16)
    reference.linear_act(x, w, None, None, expected)
    np.testing.assert_allclose(
        out.numpy().astype(np.float32), expected.astype(np.float32), rtol=2e-3, atol=2e-2
    )


def _every_float16(rng, n):
    """n float16 values drawn from every bit pattern: subnormals, huge values, +-0, inf and NaN."""
    bits = rng.integers(0, 2**16, n, dtype=np.uint32).astype(np.uint16)
    return bits.view(np.float16)


@pytest.mark.parametrize("arch", ["cpu", pytest.param("vulkan", marks=pytest.mark.vulkan)])
def test_float16_arithmetic_kernels_equal_the_reference_bit_for_bit(arch):
    # NOTE [ float16 arithmetic in the elementwise kernels ]: the float16 paths (on vulkan; ti.cpu
    # keeps float32 arithmetic, which must give the same bits) must be exactly the float64
    # reference rounded once, over every bit pattern; the float32 fallbacks (slope 0.01, p = 0.1)
    # are held to the float16 tolerance.
    from taifuse.backends.taichi.forward import _math16

    if arch == "vulkan":
        _vulkan_or_skip()
    else:
        tg.init("cpu")
    on_gpu = arch in ("vulkan", "metal")  # not CUDA: forward._half_arithmetic
    assert _math16(np.dtype(np.float16), 0.25) == on_gpu and _math16(np.dtype(np.float16)) == on_gpu
    assert _math16(np.dtype(np.float16), 0.01) == 0 and _math16(np.dtype(np.float32)) == 0
    rng = np.random.default_rng(16)
    a, b = _every_float16(rng, 200_003), _every_float16(rng, 200_003)
    cases = [
        ("relu", (a,), {}, True),
        ("add_relu", (a, b), {}, True),
        ("mul_relu", (a, b), {}, True),
        ("leaky_relu", (a,), {"negative_slope": 0.25}, True),
        ("leaky_relu", (a,), {"negative_slope": -3.0}, True),
        ("leaky_relu", (a,), {"negative_slope": 0.01}, False),
        ("dropout", (a,), {"p": 0.5, "seed": 3}, True),
        ("dropout", (a,), {"p": 0.75, "seed": 4}, True),
        ("dropout", (a,), {"p": 0.1, "seed": 5}, False),
    ]
    try:
        for name, args, kwargs, exact in cases:
            out = tg.empty(a.shape, np.float16)
            getattr(tg, name)(*(tg.from_numpy(x) for x in args), out=out, **kwargs)
            expected = np.empty(a.shape, np.float16)
            with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 and overflow, on purpose
                getattr(reference, name)(*args, out=expected, **kwargs)
            got = out.numpy()
            what = f"{name} {kwargs} on {arch}"
            if exact:
                np.testing.assert_array_equal(got, expected, err_msg=what)
            else:
                finite = np.isfinite(expected)
                np.testing.assert_array_equal(np.isnan(got), np.isnan(expected), err_msg=what)
                np.testing.assert_array_equal(got[~finite], expected[~finite], err_msg=what)
                np.testing.assert_allclose(
                    got[finite].astype(np.float64), expected[finite].astype(np.float64),
                    rtol=1e-3, atol=float(np.finfo(np.float16).smallest_subnormal), err_msg=what,
                )  # fmt: skip
    finally:
        tg.init("cpu")


def test_erf_matches_math_erf_to_float32_accuracy(cpu):
    from taifuse.backends.taichi._math import erf_probe

    z = np.linspace(-6, 6, 200_001, dtype=np.float32)
    out = tg.empty(z.shape, np.float32)
    erf_probe(tg.from_numpy(z)._ndarray(), out._ndarray(), z.size)
    exact = np.array([math.erf(v) for v in z.astype(np.float64)])
    err = np.abs(out.numpy().astype(np.float64) - exact)
    assert err.max() < 4e-7  # a few float32 ulps of 1.0
    small = np.abs(z) < 0.5
    assert np.max(err[small] / np.maximum(np.abs(exact[small]), 1e-30)) < 4e-7  # relative near 0


def test_dropout_mask_is_bit_identical_to_the_reference(cpu):
    x = np.ones(10_007, np.float32)
    for p, seed in ((0.5, 0), (0.1, 2**32 - 1), (0.9, 123_456_789)):
        out = tg.empty(x.shape, np.float32)
        tg.dropout(tg.from_numpy(x), out, p, seed)
        expected = np.empty_like(x)
        reference.dropout(x, expected, p, seed)
        np.testing.assert_array_equal(out.numpy() == 0, expected == 0)


# ----------------------------------------------------------------------------- runtime


def test_init_is_idempotent_for_the_same_arch(cpu):
    arr = tg.from_numpy(np.ones(3, np.float32))
    tg.init("cpu")
    np.testing.assert_array_equal(arr.numpy(), np.ones(3))  # still valid: no re-initialisation


def test_describe_reports_versions_and_arches(cpu):
    info = tg.describe()
    assert (
        info["backend"] == "taichi" and info["requested_arch"] == "cpu" and info["arch"] in ("x64", "arm64")
    )
    assert info["taichi"].count(".") == 2


def test_unknown_arch_is_a_value_error():
    with pytest.raises(ValueError, match="arch"):
        tg.init("tpu")


@pytest.mark.skipif(sys.platform == "darwin", reason="Metal may exist here")
def test_unavailable_arch_raises_instead_of_silently_running_on_cpu(cpu):
    with pytest.raises(RuntimeError):
        tg.init("metal")
    assert tg.describe()["arch"] is None
    with pytest.raises(RuntimeError, match="not initialised"):
        tg.empty((2,), np.float32)


@pytest.mark.vulkan
def test_arch_switch_invalidates_old_arrays_and_new_ones_work(cpu):
    old = tg.from_numpy(np.arange(4, dtype=np.float32))
    _vulkan_or_skip()
    try:
        assert tg.describe()["arch"] == "vulkan"
        with pytest.raises(RuntimeError, match="re-initialised"):
            old.numpy()
        assert "invalid" in repr(old)
        x = tg.from_numpy(np.array([-1.0, 1.0], np.float32))
        del old  # collected after the switch: must not free anything of the new runtime
        gc.collect()
        out = tg.empty((2,), np.float32)
        tg.relu(x, out)
        np.testing.assert_array_equal(out.numpy(), [0.0, 1.0])
    finally:
        tg.init("cpu")
    again = tg.from_numpy(np.ones(2, np.float32))
    np.testing.assert_array_equal(again.numpy(), [1.0, 1.0])


@pytest.mark.vulkan
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_shared_memory_linear_matches_reference_on_vulkan(dtype):
    # The threadgroup-memory kernel runs on GPU archs only; odd shapes hit every edge-tile mask,
    # and 2100 x 1100 outputs need more blocks than one grid-stride pass covers.
    _vulkan_or_skip()
    rng = np.random.default_rng(7)
    rtol, atol = (2e-5, 1e-5) if dtype == np.float32 else (2e-3, 2e-2)
    try:
        for n, k, m in [(1, 1, 1), (5, 1, 3), (67, 33, 130), (3, 17, 65), (2100, 5, 1100)]:
            x = rng.standard_normal((n, k)).astype(dtype)
            w = rng.standard_normal((m, k)).astype(dtype)
            b = rng.standard_normal(m).astype(dtype)
            for bias, act in ((b, "gelu"), (None, None), (b, "silu")):
                out = tg.empty((n, m), dtype)
                tg.linear_act(
                    tg.from_numpy(x),
                    tg.from_numpy(w),
                    None if bias is None else tg.from_numpy(bias),
                    act,
                    out,
                )
                expected = np.empty((n, m), dtype)
                reference.linear_act(x, w, bias, act, expected)
                np.testing.assert_allclose(
                    out.numpy().astype(np.float64),
                    expected.astype(np.float64),
                    rtol=rtol,
                    atol=atol,
                    err_msg=f"shape n={n} k={k} m={m} bias={bias is not None} act={act}",
                )
    finally:
        tg.init("cpu")


@pytest.mark.parametrize("arch", ["cpu", pytest.param("vulkan", marks=pytest.mark.vulkan)])
def test_linear_with_pre_keeps_the_pre_activation(arch):
    # autograd's path (NOTE [ Linear saves the pre-activation ]): pre = x @ w.T + b and out = the
    # activation of pre as stored, for every activation.
    if arch == "vulkan":
        _vulkan_or_skip()
    else:
        tg.init("cpu")
    rng = np.random.default_rng(8)
    x = rng.standard_normal((67, 33)).astype(np.float32)
    w = rng.standard_normal((130, 33)).astype(np.float32)
    b = rng.standard_normal(130).astype(np.float32)
    try:
        for act in (None, "relu", "gelu", "gelu_tanh", "silu"):
            out, pre = tg.empty((67, 130), np.float32), tg.empty((67, 130), np.float32)
            tg.linear_act(tg.from_numpy(x), tg.from_numpy(w), tg.from_numpy(b), act, out, pre=pre)
            want, want_pre = np.empty((67, 130), np.float32), np.empty((67, 130), np.float32)
            reference.linear_act(x, w, b, act, want, pre=want_pre)
            np.testing.assert_allclose(pre.numpy(), want_pre, rtol=2e-5, atol=1e-5, err_msg=f"pre, act={act}")
            np.testing.assert_allclose(out.numpy(), want, rtol=2e-5, atol=1e-5, err_msg=f"out, act={act}")
    finally:
        tg.init("cpu")


@pytest.mark.vulkan
def test_long_rows_reduce_correctly_on_vulkan():
    # GPU archs reduce a row with a block of threads. One thread per row would also be slow on a
    # GPU, and on lavapipe it breaks: llvmpipe stops a shader's loops after ~65535 iterations.
    _vulkan_or_skip()
    rng = np.random.default_rng(11)
    try:
        for shape in [(1, 131_073, 1), (2, 300, 3), (5, 1, 2)]:
            x = rng.standard_normal(shape).astype(np.float32)
            for op in ("softmax", "log_softmax"):
                out = tg.empty(shape, np.float32)
                getattr(tg, op)(tg.from_numpy(x), out)
                expected = np.empty(shape, np.float32)
                getattr(reference, op)(x, expected)
                np.testing.assert_allclose(
                    out.numpy(), expected, rtol=4e-6, atol=1e-6, err_msg=f"{op} {shape}"
                )
        for rows, cols in [(2, 70_001), (300, 7), (1, 1)]:
            x = (rng.standard_normal((rows, cols)) * 3 + 2).astype(np.float32)
            weight = rng.standard_normal(cols).astype(np.float32)
            out, mean, rstd = (
                tg.empty((rows, cols), np.float32),
                tg.empty((rows,), np.float32),
                tg.empty((rows,), np.float32),
            )
            tg.layer_norm(tg.from_numpy(x), tg.from_numpy(weight), None, 1e-5, out, mean, rstd)
            e_out, e_mean, e_rstd = np.empty_like(x), np.empty(rows, np.float32), np.empty(rows, np.float32)
            reference.layer_norm(x, weight, None, 1e-5, e_out, e_mean, e_rstd)
            np.testing.assert_allclose(mean.numpy(), e_mean, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(rstd.numpy(), e_rstd, rtol=1e-5)
            np.testing.assert_allclose(out.numpy(), e_out, rtol=1e-5, atol=1e-5 * np.abs(weight).max())
    finally:
        tg.init("cpu")
