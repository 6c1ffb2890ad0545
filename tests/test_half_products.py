"""float16 on the host backends: matrix products in float32 BLAS on blocks converted in cache, never
on a float32 copy of a whole operand (NOTE [ float16 products in blocks ] in
backends/_host.py; ``linear_act``'s blocks are tested in test_numba_kernels.py), the block
conversions themselves, and Tensor arithmetic on float32 blocks (NOTE [ float16 arithmetic on the
host ] in _tensor_math.py)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from taifuse import _tensor_math as tm
from taifuse import pool
from taifuse.backends import _host

SHAPES = [
    ((8, 32, 16), (8, 16, 24)),  # a stack of small products, grouped per BLAS call
    ((3, 40, 70), (70, 50)),  # a shared right operand: the batch's rows are one matrix's
    ((2, 1, 30, 20), (1, 3, 20, 25)),  # broadcast batch dimensions
    ((90, 33), (33, 70)),
    ((2, 0, 3), (2, 3, 4)),
    ((2, 3, 0), (2, 0, 4)),
]


def _half(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float16)


@pytest.mark.parametrize("budget", [None, 1024])
@pytest.mark.parametrize(("sa", "sb"), SHAPES)
def test_float16_matmul_matches_the_float32_product(sa, sb, budget, monkeypatch):
    # With a 1 KiB budget every product goes through row chunks of a and column blocks of b.
    if budget is not None:
        monkeypatch.setattr(_host, "F16_BLOCK_BYTES", budget)
        monkeypatch.setattr(_host, "F16_MIN_ROWS", 4)
    a, b = _half(sa, 0), _half(sb, 1)
    got = tm.HostMath.matmul(a, b)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    assert got.dtype == np.float16 and got.shape == exact.shape
    # float16's rounding of each result (2**-11 relative) plus float32 summation, which BLAS
    # orders by block shape, so a result may sit one float16 step from the unblocked one.
    atol = 2.0**-12 * np.abs(exact).max(initial=0.0)
    np.testing.assert_allclose(got.astype(np.float64), exact, rtol=2.0**-10, atol=atol)


def test_float16_matmul_converts_blocks_not_whole_operands(monkeypatch):
    # (1024, 512) @ (512, 1024) with a 64 KiB budget: what the call allocates beside its float16
    # result (the pool bypassed, so tracemalloc sees every buffer) stays under half of one
    # operand's float32 form (2 MiB); converting either operand whole would exceed it.
    monkeypatch.setattr(_host, "F16_BLOCK_BYTES", 64 * 1024)
    monkeypatch.setattr(_host, "F16_MIN_ROWS", 8)
    a, b = _half((1024, 512), 0), _half((512, 1024), 1)
    with pool.host_pool().disabled():
        tracemalloc.start()
        try:
            out = tm.HostMath.matmul(a, b)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak - out.nbytes < 1024 * 1024, peak
    want = (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float64)
    np.testing.assert_allclose(out, want, rtol=2.0**-10, atol=2.0**-12 * np.abs(want).max())


def test_batched_matmul_and_the_numba_kernels_share_one_float16_budget():
    # Batched @ once kept a 4 MiB budget of its own while the numba kernels' went to 1 MiB (issue
    # 27). Both read backends/_host.py's now: at the default 1 MiB, (2048, 512) @ (512, 512)
    # converts 512-row chunks, so the call's scratch (1 MiB of a's rows, b whole in 1 MiB, 1 MiB
    # of results) stays under 4 MiB; at 4 MiB a's and the result's float32 forms were whole (9 MiB).
    assert _host.F16_BLOCK_BYTES == 1024 * 1024
    assert _host.f16_rows(2048, 512) == 512 and _host.f16_weight_rows(512, 512) == 512
    a, b = _half((2048, 512), 0), _half((512, 512), 1)
    tm.HostMath.matmul(a[:64], b)  # any compilation of the block conversions happens here
    with pool.host_pool().disabled():
        tracemalloc.start()
        try:
            out = tm.HostMath.matmul(a, b)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak - out.nbytes < 4 * 1024 * 1024, peak
    want = (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float64)
    np.testing.assert_allclose(out, want, rtol=2.0**-10, atol=2.0**-12 * np.abs(want).max())


def test_numba_block_conversion_rounds_as_numpy():
    # The blocks are converted by Numba's F16C loops (_jit._convert), not NumPy's software casts:
    # every float16 bit pattern widens exactly (NaN to NaN: the hardware quiets a signalling NaN,
    # NumPy keeps its payload), and float32 values (ties, overflow, subnormals, NaN) narrow as
    # astype does, from contiguous and strided blocks alike.
    jit = pytest.importorskip("taifuse.backends.numba._jit")
    half = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).reshape(256, 256)
    wide = np.empty((256, 128), np.float32)
    jit._convert(wide, half[:, ::2])
    want = half[:, ::2].astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(wide), nan)
    np.testing.assert_array_equal(wide.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
    rng = np.random.default_rng(5)
    values = (rng.standard_normal((64, 300)) * 10.0 ** rng.integers(-9, 6, (64, 300))).astype(np.float32)
    values[0, :4] = [np.inf, -np.inf, np.nan, 65520.0]  # 65520 rounds to inf
    back = np.zeros((64, 600), np.float16)
    jit._convert(back[:, 1::2], values)
    with np.errstate(over="ignore"):
        want = values.astype(np.float16)
    np.testing.assert_array_equal(back[:, 1::2].view(np.uint16), want.view(np.uint16))


_BINARY_SHAPES = [
    ((1000,), (1000,)),
    ((300_001,), (300_001,)),
    ((4, 5, 6), (6,)),
    ((4, 1, 6), (1, 5, 1)),
    ((7,), ()),
]


@pytest.mark.parametrize("ufunc", sorted(tm._HALF_UFUNCS, key=lambda u: u.__name__), ids=lambda u: u.__name__)
def test_float16_arithmetic_on_float32_blocks_is_numpys_bit_for_bit(ufunc):
    # NOTE [ float16 arithmetic on the host ]: with the Numba backend loaded, float16 (and mixed
    # float16/float32) Tensor arithmetic runs on float32 blocks (the second shape is larger than
    # one block) and gives NumPy's float16 loops' result to the bit, NaN, inf, broadcasting and
    # Python scalars (cast to float16 first, as NumPy does) included.
    pytest.importorskip("taifuse.backends.numba._jit")
    rng = np.random.default_rng(7)

    def draw(shape, dtype):
        a = (rng.standard_normal(shape) * 300).astype(dtype)
        a.reshape(-1)[:3] = [np.inf, np.nan, 0.0][: a.size]
        return a

    pairs = [(np.float16, np.float16), (np.float16, np.float32), (np.float32, np.float16)]
    cases = [(draw(sa, da), draw(sb, db)) for (sa, sb) in _BINARY_SHAPES for (da, db) in pairs]
    half = draw((1000,), np.float16)
    cases += [(half, s) for s in (0.1, 3, 1e-8, 70000.0)] + [(-2.5, half)]
    with np.errstate(all="ignore"):
        for a, b in cases:
            got, want = tm._binary(ufunc, a, b), ufunc(a, b)
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)
