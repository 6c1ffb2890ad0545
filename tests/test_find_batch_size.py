"""``taifuse.utils.find_batch_size`` (issue 29): on a fake step with a known memory and time curve
it stops where it should (the memory limit, an out-of-memory error, throughput that stops
growing, max_batch); on a real MLP it returns a size it measured."""

from __future__ import annotations

import types

import numpy as np
import pytest

import taifuse
import taifuse.functional as F
import taifuse.utils
from taifuse import backends, nn, optim, pool
from taifuse.utils import find_batch_size

ROW_BYTES = 4096  # the fake step's pooled memory per sample


@pytest.fixture(autouse=True)
def _numpy_backend():
    with backends.preserved_choice():
        taifuse.set_backend("numpy")
        yield


@pytest.fixture
def clock(monkeypatch):
    """The finder's clock, advanced only by the fake steps: their timings are exact, whatever the
    machine's load."""
    now = [0.0]
    monkeypatch.setattr(taifuse.utils, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    return now


def _fake_step(clock, seconds_per_step, oom_from: int | None = None):
    """A step that holds batch_size x 4 KiB from the pool and takes ``seconds_per_step(n)``."""
    calls = []

    def step(n: int) -> None:
        calls.append(n)
        if oom_from is not None and n >= oom_from:
            raise RuntimeError(f"device out of memory allocating a batch of {n}")
        buf = pool.empty(backends.active(), (n * ROW_BYTES // 4,), np.float32)
        buf[:] = 0  # touched, as a real step's would be
        clock[0] += seconds_per_step(n)

    return step, calls


def _quick(**kwargs):
    return find_batch_size(repeats=2, min_time=0.0, printer=None, **kwargs)


def test_stops_at_the_memory_limit(clock):
    step, _ = _fake_step(clock, lambda n: 0.002)  # constant time: samples/s doubles with the size
    found = _quick(step=step, start=8, max_batch=1024, memory_limit=300 * 1024)
    sizes = [t.batch_size for t in found.table]
    assert sizes == [8, 16, 32, 64, 128]  # 128 x 4 KiB = 512 KiB > 300 KiB
    assert found.table[-1].stopped == "over the memory limit" and found.batch_size == 64
    assert [t.pool_peak_bytes for t in found.table[:4]] == [n * ROW_BYTES for n in (8, 16, 32, 64)]
    assert "over the limit" in found.reason


def test_stops_at_the_first_out_of_memory_error(clock):
    step, calls = _fake_step(clock, lambda n: 0.002, oom_from=256)
    found = _quick(step=step, start=16, max_batch=4096)
    assert [t.batch_size for t in found.table] == [16, 32, 64, 128, 256]
    assert found.table[-1].stopped == "out of memory" and found.batch_size == 128
    assert calls[-1] == 256 and max(calls) == 256  # nothing larger was tried

    def broken(n):
        raise ValueError("a bug, not memory")

    with pytest.raises(ValueError, match="a bug"):
        _quick(step=broken)


def test_stops_when_throughput_stops_growing(clock):
    # time grows with the size past 32: samples/s flat from there
    step, _ = _fake_step(clock, lambda n: 0.004 * max(1.0, n / 32))
    found = _quick(step=step, start=8, max_batch=4096)
    assert [t.batch_size for t in found.table] == [8, 16, 32, 64]
    assert found.table[-1].stopped == "throughput stopped growing"
    assert found.batch_size == 32  # 64's samples/s only ties it
    assert [t.samples_per_s for t in found.table] == pytest.approx([2000, 4000, 8000, 8000])


def test_stops_at_max_batch_and_formats_the_table(clock, capsys):
    step, _ = _fake_step(clock, lambda n: 0.001)
    found = find_batch_size(step, start=8, max_batch=32, repeats=2)
    assert [t.batch_size for t in found.table] == [8, 16, 32] and found.batch_size == 32
    printed = capsys.readouterr().out
    assert "chosen batch size 32 (max_batch 32 reached)" in printed and "samples/s" in printed


def test_a_real_mlp_returns_a_size_it_measured():
    taifuse.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64, activation="gelu"), nn.Linear(64, 10))
    opt = optim.AdamW(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)

    def step(n):
        x = taifuse.tensor(rng.standard_normal((n, 32)).astype(np.float32))
        loss = F.cross_entropy(model(x), rng.integers(0, 10, n))
        opt.zero_grad()
        loss.backward()
        opt.step()

    found = find_batch_size(step, start=8, max_batch=256, repeats=2, min_time=0.02, printer=None)
    measured = [
        t.batch_size for t in found.table if t.stopped is None or t.stopped == "throughput stopped growing"
    ]
    assert found.batch_size in measured
    chosen = next(t for t in found.table if t.batch_size == found.batch_size)
    assert chosen.samples_per_s > 0 and chosen.pool_peak_bytes > 0
    # The chosen size is the fastest of the sizes kept; a size past it was stopped because it was not
    # min_gain (5%) faster, so it may be a little faster by noise, never 5% faster.
    assert chosen.samples_per_s == max(t.samples_per_s for t in found.table if t.stopped is None)
    assert all(
        t.samples_per_s < 1.05 * chosen.samples_per_s
        for t in found.table
        if t.stopped == "throughput stopped growing"
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"start": 0}, "start should be a positive int"),
        ({"start": 64, "max_batch": 32}, "start .* should be at most max_batch"),
        ({"memory_limit": -1}, "memory_limit should be a positive"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        find_batch_size(lambda n: None, **kwargs)
