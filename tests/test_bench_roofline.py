"""The roofline's ceilings and how rows are judged against them, on synthetic timings and fake caches.

NOTE [ Traffic model ] in taifuse._ceilings and NOTE [ One ceiling per cache level ] in
taifuse.bench.roofline say what is pinned here: rows and ceilings count bytes alike, each row
meets the ceiling of its own level, and a row that moves no data meets none.
"""

from __future__ import annotations

import numpy as np
import pytest

from taifuse.bench import harness, roofline
from taifuse.bench.case import Case, Variant
from taifuse.bench.env import cache_level
from taifuse.bench.roofline import Ceilings
from taifuse.bench.suites import elementwise

MIB = 2**20
AMD = [  # the 2-core AMD EPYC: 32 KiB L1 and 1 MiB L2 per core, one 32 MiB L3
    {"level": 1, "type": "Data", "bytes": 32 * 1024, "shared_cpus": 1},
    {"level": 2, "type": "Unified", "bytes": MIB, "shared_cpus": 1},
    {"level": 3, "type": "Unified", "bytes": 32 * MIB, "shared_cpus": 2},
]
# For rows (whose level case_rows judges over this machine's CPUs): every level one instance,
# whatever the CPU count, so the levels below hold on any test machine.
FLAT = [dict(c, shared_cpus=1 << 16) for c in AMD]
XEON = [  # the 2-core Xeon VM: 48 KiB L1 and 2 MiB L2 per core, 260 MiB L3
    {"level": 1, "type": "Data", "bytes": 48 * 1024, "shared_cpus": 1},
    {"level": 2, "type": "Unified", "bytes": 2 * MIB, "shared_cpus": 1},
    {"level": 3, "type": "Unified", "bytes": 260 * MIB, "shared_cpus": 2},
]


def test_a_written_byte_counts_twice():
    a = 4 * MIB
    assert roofline.traffic_bytes(2 * a, a) == 3 * a  # a copy: read src, read dst's lines, write dst
    assert roofline.traffic_bytes(3 * a, a) == 4 * a  # add: two inputs, one output
    assert roofline.traffic_bytes(a, 0) == a  # a reduction writes nothing
    with pytest.raises(ValueError, match="bytes_written"):
        roofline.traffic_bytes(a, 2 * a)


@pytest.mark.parametrize(("caches", "cpus"), [(AMD, 2), (XEON, 2), (XEON, 1)])
@pytest.mark.parametrize("quick", [False, True])
def test_each_ceiling_sits_in_its_own_level_sized_from_the_caches(caches, cpus, quick):
    for level in ("L1", "L2", "L3", "DRAM"):
        size = roofline.working_set(level, caches, cpus, quick)
        assert cache_level(size, caches, cpus) == level, (level, size)
    largest = max(c["bytes"] for c in caches)
    assert roofline.working_set("DRAM", caches, cpus, quick) >= 4 * largest


def test_ceiling_sizes_follow_the_machine():
    # In-cache ceilings well past the level below, well inside their own: a 32 MiB L3 gets a
    # 16 MiB working set, the 260 MiB one 8x its two 2 MiB L2s; DRAM is always measured.
    assert roofline.ceiling_sizes({"L3"}, AMD, 2) == {"L3": 16 * MIB, "DRAM": 2 * 256 * MIB}
    xeon = roofline.ceiling_sizes({"L3"}, XEON, 2)
    assert xeon["L3"] == 32 * MIB and xeon["DRAM"] == 2 * 4 * 260 * MIB
    assert set(roofline.ceiling_sizes(set(), AMD, 2)) == {"DRAM"}
    assert set(roofline.ceiling_sizes({"unknown (no cache sizes)"}, [], 2)) == {"DRAM"}


# ----------------------------------------------------------------------------- synthetic runs


def _roofline_results(ns_per_level: dict[str, float], array_bytes: dict[str, int], processes: int = 3):
    """Roofline worker results whose copy passes take exactly ``ns_per_level`` (no noise)."""
    return [
        {
            "copy": {
                level: {
                    "ns": [ns] * 6,
                    "array_bytes": array_bytes[level],
                    "bytes_moved": 2 * array_bytes[level],
                    "bytes_written": array_bytes[level],
                    "threads": 2,
                    "reps": 1,
                    "code": roofline.COPY_CODE.format(reps=1),
                }
                for level, ns in ns_per_level.items()
            },
            "gemm": {
                "ns": [1e7] * 6,
                "shape": roofline.GEMM_SHAPE,
                "flops": 3e12,
                "code": roofline.GEMM_CODE,
            },
        }
        for _ in range(processes)
    ]


def _case(bytes_moved: int, bytes_written: int, flops: int = 0) -> Case:
    return Case(
        suite="test",
        name=f"op {bytes_moved}",
        setup=lambda seed: {},
        setup_code="(none)",
        candidate=Variant("taifuse", "pass", result="None"),
        baselines=(Variant("numpy", "pass", result="None"),),
        dtype="float32",
        shape="(n,)",
        bytes_moved=bytes_moved,
        bytes_written=bytes_written,
        flops=flops,
    )


def _runs(case: Case, candidate_ns: float, processes: int = 3) -> list[dict]:
    """Worker results in which the candidate takes ``candidate_ns`` per call and the baseline twice that."""
    rng = np.random.default_rng(0)
    runs = []
    for _ in range(processes):
        a = list(candidate_ns * np.exp(rng.normal(0.0, 1e-3, 8)))
        runs.append(
            {
                "first_call_ns": {"taifuse": 1e8},
                "checks": {"numpy": {"ok": True}},
                "failed": [],
                "samples": {"taifuse|numpy": {"a": a, "b": [2 * t for t in a]}},
                "loops": {"taifuse": 1, "numpy": 1},
                "threads": {"numba": 2},
                "backend": "numba",
            }
        )
    return runs


def _compare_row(case: Case, candidate_ns: float, ceilings, caches=FLAT) -> dict:
    rows = harness.case_rows(case, _runs(case, candidate_ns), ceilings, 0.05, control=False, caches=caches)
    return next(r for r in rows if r["kind"] == "compare")


def _ceilings(l3_gbps: float = 100.0, dram_gbps: float = 40.0) -> Ceilings:
    return Ceilings.coerce({"copy_gbps": {"L3": l3_gbps, "DRAM": dram_gbps}, "gemm_gflops": 300.0})


def test_each_row_meets_the_ceiling_of_its_own_level():
    # An in-L3 row at 90 GB/s of traffic is 90% of the L3 ceiling, not 225% of DRAM's (the old bug).
    in_l3 = _case(16 * MIB, 8 * MIB)  # 24 MiB of traffic
    row = _compare_row(in_l3, roofline.traffic_bytes(16 * MIB, 8 * MIB) / 90.0, _ceilings())
    assert row["cache_level"] == "L3"
    r = row["roofline"]
    assert r["ceiling"] == "roofline/copy-L3" and r["of"] == "L3 copy bandwidth" and r["level"] == "L3"
    assert r["achieved"] == pytest.approx(90.0, rel=1e-2) and r["fraction"] == pytest.approx(0.9, rel=1e-2)
    assert r["low"] <= r["fraction"] <= r["high"]

    in_dram = _case(256 * MIB, 128 * MIB)
    row = _compare_row(in_dram, roofline.traffic_bytes(256 * MIB, 128 * MIB) / 30.0, _ceilings())
    assert row["cache_level"] == "DRAM" and row["roofline"]["ceiling"] == "roofline/copy-DRAM"
    assert row["roofline"]["fraction"] == pytest.approx(0.75, rel=1e-2)
    # The baseline side is judged against the same level's ceiling.
    assert row["baseline_roofline"]["ceiling"] == "roofline/copy-DRAM"


@pytest.mark.parametrize(
    ("working_set", "cpus", "level"),
    [
        (16 * MIB, 2, "L3"),
        (32 * MIB, 2, "L3"),  # exactly the L3: still fits
        (32 * MIB + 8 * 1024, 2, "L3/DRAM"),  # the elementwise suite's affine on the AMD EPYC
        (48 * MIB, 2, "L3/DRAM"),  # add_relu there
        (64 * MIB, 2, "L3/DRAM"),
        (64 * MIB + 4096, 2, "DRAM"),  # clearly past: over MIXED_MARGIN times the L3
        (1536 * 1024, 1, "L2/L3"),  # past one core's 1 MiB L2
        (1536 * 1024, 2, "L2"),  # two cores' L2s hold it
        (3 * MIB, 2, "L2/L3"),
        (5 * MIB, 2, "L3"),
    ],
)
def test_a_working_set_just_past_a_level_is_mixed(working_set, cpus, level):
    assert roofline.MIXED_MARGIN == 2
    assert roofline.row_level(working_set, AMD, cpus) == level
    assert roofline.ceiling_level(level) == level.split("/")[0]
    assert roofline.row_level(1024, [], cpus) == roofline.UNKNOWN_LEVEL


def test_a_mixed_row_is_held_to_the_faster_ceiling():
    # The affine row (x (4096, 1024) -> out, scale and bias) on a 32 MiB L3 read "98% of DRAM copy
    # bandwidth" while PyTorch ran the same bytes 1.5x faster: it is mixed, judged against L3.
    affine = elementwise.cases()[[c.name for c in elementwise.cases()].index("affine")]
    assert affine.bytes_moved == 32 * MIB + 8 * 1024
    traffic = roofline.traffic_bytes(affine.bytes_moved, affine.bytes_written)
    row = _compare_row(affine, traffic / 50.0, _ceilings(l3_gbps=100.0, dram_gbps=40.0))
    assert row["cache_level"] == "L3/DRAM"
    r = row["roofline"]
    assert r["ceiling"] == "roofline/copy-L3" and r["of"] == "L3 copy bandwidth" and r["level"] == "L3/DRAM"
    assert r["fraction"] == pytest.approx(0.5, rel=1e-2)  # not 125% of DRAM's
    assert row["baseline_roofline"]["ceiling"] == "roofline/copy-L3"
    # The run measures the L3 ceiling for it, and DRAM as always.
    assert harness.bandwidth_levels([affine], FLAT) == {"L3"}
    assert set(roofline.ceiling_sizes({"L3/DRAM"}, AMD, 2)) == {"L3", "DRAM"}


def test_compute_bound_rows_meet_the_gemm_rate():
    row = _compare_row(_case(32 * MIB, 8 * MIB, flops=3 * 10**9), 2e7, _ceilings())
    assert row["roofline"]["ceiling"] == "roofline/gemm" and row["roofline"]["unit"] == "GFLOP/s"
    assert row["roofline"]["fraction"] == pytest.approx(150.0 / 300.0, rel=1e-2)


def test_a_level_without_a_ceiling_gets_no_roofline():
    row = _compare_row(_case(16 * MIB, 8 * MIB), 1e6, Ceilings.coerce({"copy_gbps": {"DRAM": 40.0}}))
    assert row["cache_level"] == "L3" and row["roofline"] is None


@pytest.mark.parametrize(
    ("reads", "writes"),
    [
        (1, 1),
        (2, 1),
        (1, 0),
        (4, 3),
    ],  # copy/GELU, add_relu, a reduction, an Adam step (p, g, m, v -> p, m, v)
)
@pytest.mark.parametrize("level", ["L3", "DRAM"])
def test_a_row_moving_its_traffic_as_fast_as_the_ceiling_is_at_100_percent(reads, writes, level):
    # By construction of the traffic model: the ceiling and the row count bytes with the same
    # function, so a row that moves its traffic at the ceiling's rate is at exactly 100%, and a
    # slower one below. The old model (ceiling counted read+write, rows inputs+output, one DRAM
    # ceiling) put in-cache rows at 269%.
    array = {"L3": 8 * MIB, "DRAM": 256 * MIB}
    copy_ns = {"L3": 2.0e5, "DRAM": 2.4e7}
    rows = roofline.rows(_roofline_results(copy_ns, array))
    ceilings = Ceilings.from_rows(rows)
    assert set(ceilings.copy) == {"L3", "DRAM"}
    ceiling_rate = roofline.traffic_bytes(2 * array[level], array[level]) / copy_ns[level]
    assert ceilings.copy[level].value == pytest.approx(ceiling_rate)

    # DRAM rows clearly past the 32 MiB L3 (a reduction reads one unit): NOTE [ Mixed levels ].
    unit = {"L3": 4 * MIB, "DRAM": 96 * MIB}[level]
    case = _case((reads + writes) * unit, writes * unit)
    traffic = roofline.traffic_bytes(case.bytes_moved, case.bytes_written)
    at_ceiling = _compare_row(case, traffic / ceiling_rate, ceilings)
    assert at_ceiling["cache_level"] == level
    assert at_ceiling["roofline"]["fraction"] == pytest.approx(1.0, rel=2e-3)
    slower = _compare_row(case, 1.25 * traffic / ceiling_rate, ceilings)
    assert slower["roofline"]["fraction"] == pytest.approx(0.8, rel=2e-3)


def test_ceiling_rows_report_traffic_level_and_size():
    rows = {
        r["id"]: r
        for r in roofline.rows(
            _roofline_results({"L3": 2e5, "DRAM": 2.4e7}, {"L3": 8 * MIB, "DRAM": 256 * MIB})
        )
    }
    l3 = rows["roofline/copy-L3"]
    assert l3["kind"] == "roofline" and l3["cache_level"] == "L3" and l3["unit"] == "GB/s"
    assert l3["traffic_bytes"] == 3 * 8 * MIB and l3["bytes_moved"] == 2 * 8 * MIB
    assert l3["value"] == pytest.approx(3 * 8 * MIB / 2e5) and "2 threads" in l3["size"]
    assert rows["roofline/gemm"]["value"] == pytest.approx(3e12 / 1e7)
    assert Ceilings.from_rows(list(rows.values())).as_dict()["traffic_model"] == roofline.TRAFFIC_MODEL


def test_allocation_and_first_call_rows_show_no_bandwidth():
    # An allocation moves no data to speak of: no bandwidth, not "0 GB/s = 0% of copy bandwidth".
    alloc = _case(0, 0)
    rows = harness.case_rows(alloc, _runs(alloc, 1e4), _ceilings(), 0.05, control=False, caches=FLAT)
    assert {r["kind"] for r in rows} == {"first_call", "compare"}
    for row in rows:
        assert row["roofline"] is None, row["id"]
    compare = next(r for r in rows if r["kind"] == "compare")
    assert compare["baseline_roofline"] is None and compare["value"] == pytest.approx(2.0, rel=1e-2)
    # The first call of a memory-bound case has no bandwidth either.
    first = harness.case_rows(
        _case(16 * MIB, 8 * MIB), _runs(alloc, 1e4), _ceilings(), 0.05, control=False, caches=FLAT
    )
    assert next(r for r in first if r["kind"] == "first_call")["roofline"] is None


def test_plain_ceilings_mapping_still_reads():
    legacy = Ceilings.coerce({"copy_gbps": 10.0, "gemm_gflops": 100.0})  # one number: the DRAM copy
    assert set(legacy.copy) == {"DRAM"} and legacy.gemm.value == 100.0
    assert Ceilings.coerce({"copy_gbps": float("nan"), "gemm_gflops": float("nan")}) == Ceilings()


def test_bandwidth_levels_are_those_of_memory_bound_cases():
    cases = [_case(16 * MIB, 8 * MIB), _case(256 * MIB, 128 * MIB), _case(0, 0), _case(64 * MIB, 0, flops=10)]
    assert harness.bandwidth_levels(cases, FLAT) == {"L3", "DRAM"}


def test_the_ceiling_kernel_copies_on_every_thread():
    src = np.arange(1001, dtype=np.float32)
    dst = np.zeros_like(src)
    copy = roofline.ThreadedCopy(src, dst, workers=3)
    copy(reps=2)
    copy.pool.shutdown()
    assert len(copy.chunks) == 3 and np.array_equal(dst, src)


def test_the_copy_bound_row_runs_the_ceiling_kernel():
    x = np.random.default_rng(0).standard_normal(4096, dtype=np.float32)
    bound = elementwise.copy_bound("L3")
    assert not bound.same_result and not bound.peer and "ThreadedCopy" in bound.full_code()
    out = bound.build({"x": x})()
    assert np.array_equal(out, x)


def test_measure_in_process_on_small_working_sets():
    result = roofline.measure({"L2": 256 * 1024}, samples=2)
    copy = result["copy"]["L2"]
    assert len(copy["ns"]) == 2 and all(t > 0 for t in copy["ns"])
    assert (
        copy["bytes_moved"] == 2 * copy["array_bytes"] == 256 * 1024 and copy["bytes_written"] == 128 * 1024
    )
    assert copy["reps"] >= 1 and result["gemm"]["flops"] == 2 * 4096 * 1024 * 768


def test_a_busy_machine_does_not_lower_the_ceiling():
    # Other work only ever slows a pass: each process's fastest pass sets the ceiling, so a row
    # timed in a calm moment is not judged against a ceiling timed in a busy one.
    results = _roofline_results({"L3": 2e5}, {"L3": 8 * MIB})
    for r in results:
        r["copy"]["L3"]["ns"] = [2e5, 5e5, 9e5, 4e5, 3e5, 8e5]
    row = next(r for r in roofline.rows(results) if r["id"] == "roofline/copy-L3")
    assert row["value"] == pytest.approx(3 * 8 * MIB / 2e5)
    assert row["verdict"] == "unstable"  # the spread of all passes still shows


def test_an_allocation_has_no_cache_level():
    alloc = _case(0, 0)
    rows = harness.case_rows(alloc, _runs(alloc, 1e4), _ceilings(), 0.05, control=False, caches=FLAT)
    assert {r["cache_level"] for r in rows} == {"—"}
