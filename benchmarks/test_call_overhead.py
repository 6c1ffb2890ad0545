"""Per-call overhead of small operations, timed with pytest-benchmark.

These are single operations timed alone, with no baseline and no goal: the fixed cost a user pays
per call (dispatch, validation, pool, launch) when tensors are too small for the kernel to matter.
That is pytest-benchmark's natural fit; comparisons with a peer, which need interleaving, fresh
processes and an A/A control, are ``taifuse bench``'s job.

Run: ``python -m pytest benchmarks/test_call_overhead.py --benchmark-only`` (the ``test`` extra).
The test suite does not collect this folder (``testpaths = ["tests"]``).
"""

from __future__ import annotations

import numpy as np
import pytest

import taifuse
import taifuse.functional as F
from taifuse import nn, optim, pool

# The host backends: numpy (the reference) and numba (the CPU fast path), where installed.
HOST_BACKENDS = [name for name in ("numpy", "numba") if name in taifuse.available_backends()]


@pytest.fixture(params=HOST_BACKENDS)
def backend(request):
    with taifuse.use_backend(request.param):
        yield request.param


def test_gelu_on_16_elements(benchmark, backend):
    x = np.linspace(-3, 3, 16, dtype=np.float32)
    out = np.empty_like(x)
    F.gelu(x, out=out)  # compile (numba) before timing
    benchmark(F.gelu, x, out=out)
    np.testing.assert_allclose(out, F.gelu(x), rtol=1e-6)


def test_training_step_of_a_tiny_mlp(benchmark, backend):
    taifuse.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, activation="gelu"), nn.Linear(16, 2))
    x = taifuse.tensor(np.ones((4, 8), np.float32))
    y = np.array([0, 1, 0, 1])

    def step():
        model.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    step()
    loss = benchmark(step)
    assert np.isfinite(loss.numpy())


def test_adamw_step_on_one_small_parameter(benchmark, backend):
    p = nn.Parameter(np.ones((16, 16), np.float32))
    opt = optim.AdamW([p], lr=1e-3)
    (p * np.full((16, 16), 0.5, np.float32)).sum().backward()  # the gradient lands in the optimizer's slot
    opt.step()
    benchmark(opt.step)
    assert np.all(p.numpy() < 1.0)


def test_pool_acquire_and_release_of_a_1_mib_buffer(benchmark):
    host = pool.host_pool()

    def acquire_release():
        host.acquire((262144,), np.float32)  # dropped at once: back to the pool

    acquire_release()
    host.reset_stats()
    benchmark(acquire_release)
    stats = host.stats()
    assert stats.allocations == 0 and stats.reuses > 0
