"""taifuse._ceilings: one copy kernel, one GEMM, one set of row ids for the bench and the profiler.

The bench writes the roofline rows and the profiler reads them back; both go through the names
here, so a results.json the bench writes gives the profiler the bench's figures, level by level.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from taifuse import _ceilings, _costs, profiler
from taifuse.bench import roofline

MIB = 2**20


def test_every_level_has_one_named_copy_row():
    for level in _ceilings.LEVELS:
        assert _ceilings.COPY_ROWS[_ceilings.copy_row(level)] == level
    assert _ceilings.copy_row("L3") == "roofline/copy-L3" and _ceilings.GEMM_ROW == "roofline/gemm"
    assert _ceilings.GEMM_ROW not in _ceilings.COPY_ROWS
    with pytest.raises(ValueError, match="'L9'"):
        _ceilings.copy_row("L9")


def _bench_rows() -> list[dict]:
    # Two processes of synthetic timings: an L2 and a DRAM copy, and the GEMM.
    sizes = {"L2": 1 * MIB, "DRAM": 512 * MIB}
    results = []
    for p in range(2):
        copy = {
            level: {
                "ns": [(1 + p) * size / 40.0, (1.5 + p) * size / 40.0],
                "array_bytes": size // 2,
                "bytes_moved": size,
                "bytes_written": size // 2,
                "threads": 2,
                "reps": 1,
                "code": _ceilings.COPY_CODE.format(reps=1),
            }
            for level, size in sizes.items()
        }
        gemm = {"ns": [2e7 * (1 + p), 3e7], "shape": _ceilings.GEMM_SHAPE, "flops": _ceilings.GEMM_FLOPS}
        results.append({"copy": copy, "gemm": {**gemm, "code": _ceilings.GEMM_CODE}})
    return roofline.rows(results)


def test_the_profiler_reads_the_bench_rows_as_the_bench_does(tmp_path):
    rows = _bench_rows()
    assert {r["id"] for r in rows} == {"roofline/copy-L2", "roofline/copy-DRAM", "roofline/gemm"}
    bench = _ceilings.Ceilings.from_rows(rows)
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"rows": rows}))
    copy, gemm = profiler.roofline_from_results(path)
    # The same value per level, at the working set the bench measured it on.
    assert sorted(copy) == sorted((r.working_set, r.value) for r in bench.copy.values())
    assert dict(copy) == pytest.approx({1 * MIB: bench.copy["L2"].value, 512 * MIB: bench.copy["DRAM"].value})
    assert gemm == bench.gemm.value == pytest.approx(_ceilings.GEMM_FLOPS / 2.5e7)  # median of the fastest
    assert bench.copy["L2"].value == next(r["value"] for r in rows if r["id"] == "roofline/copy-L2")


def test_rows_of_unknown_ids_or_no_value_are_passed_over():
    rows = [
        {"kind": "roofline", "id": "roofline/copy-X", "value": 1.0, "bytes_moved": 8},
        {"kind": "roofline", "id": "roofline/copy-L1", "value": None, "bytes_moved": 8},
        {"kind": "roofline", "id": ["not", "an", "id"], "value": 1.0},
        {"kind": "compare", "id": "roofline/gemm", "value": 1.0},
        {"kind": "roofline", "id": "roofline/copy-L1", "value": 9.0, "bytes_moved": 8},
    ]
    c = _ceilings.Ceilings.from_rows(rows)
    assert c.gemm is None and list(c.copy) == ["L1"]
    assert c.copy["L1"] == _ceilings.Rate(9.0, 9.0, 9.0, "roofline/copy-L1", "L1 copy bandwidth", 8)


def test_time_copy_and_its_rate():
    copy = _ceilings.time_copy(256 * 1024, 3, pass_bytes=MIB)
    assert len(copy["ns"]) == 3 and all(t > 0 for t in copy["ns"])
    assert copy["bytes_moved"] == 256 * 1024 == 2 * copy["array_bytes"] and copy["reps"] == 4
    expected = _costs.traffic_bytes(256 * 1024, 128 * 1024) / min(copy["ns"])
    assert _ceilings.copy_gbps(copy) == pytest.approx(expected, rel=1e-12)
    gemm = _ceilings.time_gemm(2, seed=1)
    assert len(gemm) == 2 and all(t > 0 for t in gemm)


def test_the_profiler_measures_with_the_shared_module(monkeypatch):
    fixed = (((256 * 1024, 70.0), (256 * MIB, 12.0)), 250.0)
    monkeypatch.setattr(_ceilings, "measured", lambda: fixed)
    c = profiler.measure_ceilings.__wrapped__()
    assert c.copy == fixed[0] and c.gemm_gflops == 250.0 and c.call_overhead_ns > 0
    assert c.bandwidth(MIB) == (12.0, 256 * MIB)


def test_the_kernel_is_the_bench_s():
    assert roofline.ThreadedCopy is _ceilings.ThreadedCopy and roofline.Ceilings is _ceilings.Ceilings
    src = np.arange(10, dtype=np.float32)
    dst = np.zeros_like(src)
    copy = _ceilings.ThreadedCopy(src, dst, workers=2)
    copy(reps=3)
    copy.pool.shutdown()
    np.testing.assert_array_equal(dst, src)
