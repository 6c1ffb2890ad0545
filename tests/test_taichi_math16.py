"""Which multipliers the taichi backend's float16 kernels take in float16 (``forward._math16``), and
dropout on float16 with a scale past float16's range (issue 25 section 6)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import taifuse
import taifuse.functional as F

F16 = np.float16


def test_math16_takes_only_multipliers_float16_holds(monkeypatch):
    pytest.importorskip("taichi")
    from taifuse.backends.taichi import forward

    monkeypatch.setattr(forward, "_half_arithmetic", lambda: True)  # Metal, Vulkan
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no cast may overflow on the way to the answer
        held = {m: forward._math16(np.dtype(F16), m) for m in (1.0, 2.0, 0.5, 65504.0, -3.0)}
        not_held = {
            m: forward._math16(np.dtype(F16), m) for m in (0.01, 1 / 0.9, 1e5, 1e7, -1e7, np.inf, np.nan)
        }
    assert held == dict.fromkeys(held, 1)
    assert not_held == dict.fromkeys(not_held, 0)
    assert forward._math16(np.dtype(np.float32), 2.0) == 0
    monkeypatch.setattr(forward, "_half_arithmetic", lambda: False)  # ti.cpu, CUDA: float32 arithmetic
    assert forward._math16(np.dtype(F16), 2.0) == 0


def test_float16_dropout_with_a_scale_past_float16_does_not_warn(backend):
    # Reported on taichi-vulkan: "overflow encountered in cast" from the check whether float16 holds
    # dropout's scale, 1 / (1 - p) = 1e7 here. Every element is dropped at this p (seeded), so no
    # output overflows either: the call is silent on every backend and gives zeros.
    backend.activate()
    x = np.ones(4096, F16)
    taifuse.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        y = np.asarray(F.dropout(x, 1 - 1e-7))
    assert y.dtype == F16
    np.testing.assert_array_equal(y, np.zeros_like(x))
