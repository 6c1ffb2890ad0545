"""The elementwise suite's PyTorch baselines: same answers as taifuse, and outputs like taifuse's
(NOTE [ Like outputs ] in taifuse.bench.suites.elementwise)."""

from __future__ import annotations

import numpy as np
import pytest

from taifuse.bench.suites import elementwise

torch = pytest.importorskip("torch")


@pytest.mark.parametrize(
    "name", ["affine", "add_relu", "gelu(approximate='tanh')", "gelu(approximate='none')", "silu"]
)
def test_torch_writes_into_a_numpy_allocation_as_taifuse_does(name):
    case = next(c for c in elementwise.cases(compare_torch=True) if c.name == name)
    peer = case.variant("torch")
    assert "torch.from_numpy(np.empty_like(" in peer.prepare and "torch.empty_like" not in peer.prepare
    inputs = case.setup(0)
    got_torch = peer.build(inputs)()
    got = case.candidate.build(inputs)()
    assert isinstance(got_torch, torch.Tensor)
    np.testing.assert_allclose(got_torch.numpy(), got, rtol=case.rtol, atol=case.atol)
