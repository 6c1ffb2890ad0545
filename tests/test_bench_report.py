"""What ``taifuse bench`` writes, on a synthetic run built by the harness (no processes started):
the summary of comparisons with peers, the chart (with and without matplotlib), the BLAS note
above the tables, the roofline column, and the results.json keys that ``--baseline`` reads."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest

from taifuse.bench import harness, report, roofline
from taifuse.bench.case import Case, Variant

MIB = 2**20
FLAT = [  # each level one instance whatever the CPU count: the levels hold on any test machine
    {"level": 1, "type": "Data", "bytes": 32 * 1024, "shared_cpus": 1 << 16},
    {"level": 2, "type": "Unified", "bytes": MIB, "shared_cpus": 1 << 16},
    {"level": 3, "type": "Unified", "bytes": 32 * MIB, "shared_cpus": 1 << 16},
]
BLAS_NOTE = (
    "OPENBLAS_CORETYPE=Haswell forces OpenBLAS's Haswell kernel; without it this machine runs SkylakeX."
)


def _variant(
    label: str, *, imports=("numpy as np",), same_result: bool = True, isolated: bool = False
) -> Variant:
    return Variant(label, "pass", result="None", imports=imports, same_result=same_result, isolated=isolated)


def _case(name: str, baselines: tuple[Variant, ...], bytes_moved: int, bytes_written: int) -> Case:
    return Case(
        suite="synthetic",
        name=name,
        setup=lambda seed: {},
        setup_code="(none)",
        candidate=_variant("taifuse", imports=("numpy as np", "taifuse.functional as F")),
        baselines=baselines,
        dtype="float32",
        shape="(n,)",
        bytes_moved=bytes_moved,
        bytes_written=bytes_written,
    )


GELU = _case(
    "gelu",
    (
        _variant("numpy"),
        _variant(
            "copy bound", imports=("numpy as np", "taifuse.bench.roofline as roofline"), same_result=False
        ),
        _variant("torch", imports=("numpy as np", "torch"), isolated=True),
    ),
    16 * MIB,
    8 * MIB,
)
STEP = _case(
    "step", (_variant("pool off", imports=("numpy as np", "taifuse.pool as pool")),), 256 * MIB, 96 * MIB
)
SCRATCH = _case("scratch", (_variant("np.empty", same_result=False),), 0, 0)
SPEEDUPS = {"numpy": 3.0, "copy bound": 0.8, "torch": 1.5, "pool off": 1.0, "np.empty": 4.0, "taifuse": 1.0}


def _runs(case: Case, pairs: list[tuple[str, str]], processes: int = 3, ns: float = 1e6) -> list[dict]:
    rng = np.random.default_rng(0)
    runs = []
    for _ in range(processes):
        samples = {}
        for a, b in pairs:
            ta = list(ns * np.exp(rng.normal(0.0, 0.01, 8)))
            samples[f"{a}|{b}"] = {"a": ta, "b": [SPEEDUPS[b] * t for t in ta]}
        runs.append(
            {
                "first_call_ns": {"taifuse": 3e8},
                "checks": {
                    b.label: {
                        "ok": True,
                        "rtol": 1e-5,
                        "atol": 1e-6,
                        "max_abs_err": 0.0,
                        "max_rel_err": 0.0,
                        "reason": "",
                    }
                    for b in case.baselines
                    if b.same_result
                },
                "failed": [],
                "samples": samples,
                "loops": {label: 1 for label in ("taifuse", *(b.label for b in case.baselines))},
                "threads": {"numba": 2, "blas": 2},
                "backend": "numba",
            }
        )
    return runs


def _solo(case: Case, processes: int = 3) -> list[dict]:
    rng = np.random.default_rng(1)
    out = []
    for _ in range(processes):
        t = {
            label: list(1e6 * np.exp(rng.normal(0.0, 0.01, 8)))
            for label in ("taifuse", harness.CANDIDATE_AGAIN)
        }
        t["torch"] = [SPEEDUPS["torch"] * x for x in t["taifuse"]]
        out.append({label: {"samples": s, "loops": 1} for label, s in t.items()})
    return out


def _roofline_results(processes: int = 3) -> list[dict]:
    copy = {
        "L3": {"array_bytes": 8 * MIB, "ns": 2.5e5},
        "DRAM": {"array_bytes": 256 * MIB, "ns": 2.5e7},
    }
    return [
        {
            "copy": {
                level: {
                    "ns": [c["ns"]] * 4,
                    "array_bytes": c["array_bytes"],
                    "bytes_moved": 2 * c["array_bytes"],
                    "bytes_written": c["array_bytes"],
                    "threads": 2,
                    "reps": 1,
                    "code": roofline.COPY_CODE.format(reps=1),
                }
                for level, c in copy.items()
            },
            "gemm": {
                "ns": [1e7] * 4,
                "shape": roofline.GEMM_SHAPE,
                "flops": 3e12,
                "code": roofline.GEMM_CODE,
            },
        }
        for _ in range(processes)
    ]


def _memory_peer_row() -> dict:
    from taifuse.bench.suites import memory

    (case,) = memory.cases(quick=True, compare_torch=True)[:1]
    runs = [
        {"variant": v.label, "process": p, "rss_peak_bytes": (40 + 10 * i) * MIB, "step_ns": 1e8}
        for p in range(3)
        for i, v in enumerate(case.variants)
    ]
    return next(r for r in case.rows(runs) if r["id"].endswith(" vs torch checkpoint"))


@pytest.fixture
def result(monkeypatch) -> dict:
    monkeypatch.setattr(harness, "cpu_caches", lambda: FLAT)
    cases = [GELU, STEP, SCRATCH]
    raw = {
        "roofline": _roofline_results(),
        "cases": {
            GELU.id: _runs(GELU, [("taifuse", "taifuse"), ("taifuse", "numpy"), ("taifuse", "copy bound")]),
            STEP.id: _runs(STEP, [("taifuse", "pool off")], ns=4e7),
            SCRATCH.id: _runs(SCRATCH, [("taifuse", "np.empty")]),
        },
        "solo": {GELU.id: _solo(GELU)},
        "errors": {},
    }
    rows, method = harness.build_rows(cases, raw)
    rows.append(_memory_peer_row())
    return {
        "command": "taifuse bench --quick --out bench-out",
        "date": "2026-01-01 00:00 UTC",
        "plan": {
            "processes": 3,
            "blocks": 8,
            "min_sample_ns": 1_000_000,
            "roofline_samples": 4,
            "quick": True,
        },
        "suites": ["synthetic"],
        "environment": {
            "cpu_model": "Test CPU",
            "cpus_usable": 2,
            "backend": "numba",
            "numpy": "2.0",
            "blas": "scipy-openblas 0.3.31",
            "blas_kernel": "Haswell",
            "blas_libraries": [
                {
                    "library": "openblas",
                    "version": "0.3.31",
                    "kernel": "Haswell",
                    "threads": 2,
                    "threading_layer": "pthreads",
                    "file": "libscipy_openblas64_.so",
                }
            ],
            "blas_env": {"OPENBLAS_CORETYPE": "Haswell"},
            "blas_default": {"unset": ["OPENBLAS_CORETYPE"], "libraries": None, "error": None},
            "blas_note": BLAS_NOTE,
            "git_commit": "0123456789abcdef",
            "git_dirty": False,
            "load_average": {"before": [0.1, 0.1, 0.1], "after": [0.1, 0.1, 0.1]},
            "fingerprint": "f",
        },
        "method": method,
        "errors": {},
        "rows": rows,
    }


def _by_id(result: dict) -> dict[str, dict]:
    return {r["id"]: r for r in result["rows"]}


def test_summary_has_one_line_per_comparison_with_a_peer(result):
    peers = [r["id"] for r in report.peer_rows(result)]
    assert peers[:2] == ["synthetic/gelu/numpy", "synthetic/gelu/torch"]
    assert len(peers) == 3 and peers[2].endswith("vs torch checkpoint")  # memory, against PyTorch's
    text = report.summary_markdown(result, chart=report.CHART)
    table = [line for line in text.splitlines() if line.startswith("| ") and "taifuse vs" in line]
    assert len(table) == 2  # the memory row's label reads "taifuse checkpoint vs torch checkpoint"
    numpy_row = _by_id(result)["synthetic/gelu/numpy"]
    line = next(line for line in text.splitlines() if "taifuse vs numpy" in line)
    assert f"{numpy_row['value']:.3g}x" in line and report._interval(numpy_row) in line
    assert numpy_row["verdict"] in line
    for absent in ("copy bound", "pool off", "A/A control", "np.empty", "first call"):
        assert absent not in text, absent
    assert "x less memory" in text
    assert f"]({report.CHART})" in text and f"]({report.BENCHMARKS})" in text
    assert BLAS_NOTE in text.split("| row")[0]  # above the table


def test_peers_are_other_libraries_with_the_same_result(result):
    rows = _by_id(result)
    assert rows["synthetic/gelu/numpy"]["baseline"]["peer"] is True
    assert rows["synthetic/gelu/copy bound"]["baseline"]["peer"] is False  # a bound
    assert rows["synthetic/step/pool off"]["baseline"]["peer"] is False  # taifuse itself
    # Rows from before baselines said so: judged from the baseline's imports.
    old = {"baseline": {"same_result": True, "code": "import numpy as np\nimport torch\n# timed:\ny = f(x)"}}
    assert report.is_peer(old)
    old["baseline"]["code"] = "import numpy as np\nimport taifuse.pool as pool\npass"
    assert not report.is_peer(old)


def test_write_draws_the_chart_with_matplotlib(result, tmp_path):
    pytest.importorskip("matplotlib")
    paths = {p.name for p in report.write(result, tmp_path)}
    assert {report.BENCHMARKS, report.RESULTS, report.SUMMARY, report.CHART, "synthetic.png"} <= paths
    assert (tmp_path / report.CHART).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![taifuse's speedup over each peer" in (tmp_path / report.SUMMARY).read_text()
    text = (tmp_path / report.BENCHMARKS).read_text()
    assert f"[{report.CHART}]({report.CHART})" in text and report.NO_MATPLOTLIB not in text


def test_write_without_matplotlib_says_so_in_one_line(result, tmp_path, monkeypatch):
    # A None entry in sys.modules makes `import matplotlib` raise ImportError, as when absent.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    paths = {p.name for p in report.write(result, tmp_path)}
    assert paths == {report.BENCHMARKS, report.RESULTS, report.SUMMARY}
    assert not list(tmp_path.glob("*.png"))
    for name in (report.BENCHMARKS, report.SUMMARY):
        text = (tmp_path / name).read_text()
        assert text.count(report.NO_MATPLOTLIB) == 1, name
    assert "](speedups.png)" not in (tmp_path / report.SUMMARY).read_text()


def test_blas_note_sits_above_the_tables(result):
    text = report.markdown(result)
    assert f"**BLAS:** {BLAS_NOTE}" in text
    assert text.index(BLAS_NOTE) < text.index("## Roofline") < text.index("## Suite: synthetic")
    assert (
        "kernel Haswell, 2 threads" in text and "OPENBLAS_CORETYPE=Haswell" in text.split("## Environment")[1]
    )
    assert report.summary(result).startswith(f"BLAS: {BLAS_NOTE}")
    quiet = dict(result, environment=dict(result["environment"], blas_note=None))
    assert "**BLAS:**" not in report.markdown(quiet) and not report.summary(quiet).startswith("BLAS")


def test_roofline_column_names_the_level_and_allocations_show_none(result):
    rows = _by_id(result)
    gelu = rows["synthetic/gelu/numpy"]
    assert gelu["cache_level"] == "L3" and gelu["roofline"]["ceiling"] == "roofline/copy-L3"
    assert report._roofline(gelu).endswith("of L3 copy bandwidth")
    assert rows["synthetic/step/pool off"]["roofline"]["ceiling"] == "roofline/copy-DRAM"
    alloc = rows["synthetic/scratch/np.empty"]
    assert alloc["roofline"] is None and report._roofline(alloc) == "—"
    text = report.markdown(result)
    line = next(
        line for line in text.splitlines() if "scratch: taifuse vs np.empty" in line and line.startswith("|")
    )
    assert "GB/s" not in line and "—" in line
    assert not re.search(r"(?<![\d.])0 GB/s", text)
    # The method names the ceilings' sizes and the traffic model.
    assert "L3: 2 x 8 MiB float32" in text and "write-allocate" in text


def test_results_json_keeps_the_keys_baseline_reads(result, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    report.write(result, tmp_path)
    saved = json.loads((tmp_path / report.RESULTS).read_text())
    assert saved["environment"]["fingerprint"] == "f" and saved["method"]["threshold"] >= 0.05
    timed = [r for r in saved["rows"] if r["kind"] in ("compare", "control") and r["value"] is not None]
    assert timed
    for row in saved["rows"]:
        for key in (
            "id",
            "kind",
            "label",
            "value",
            "verdict",
            "low",
            "high",
            "n_processes",
            "unit",
            "roofline",
        ):
            assert key in row, (row["id"], key)
    for row in timed:
        assert row["samples"]["ratios"] and all(len(g) == 8 for g in row["samples"]["ratios"])
    ceilings = saved["method"]["ceilings"]
    assert set(ceilings["copy_gbps"]) == {"L3", "DRAM"} and "write-allocate" in ceilings["traffic_model"]


def test_peers_and_the_optimizer_candidate_in_the_real_suites():
    # PyTorch's training step imports a harness helper (taifuse.bench.suites.training): still a
    # peer, so the summary shows it. The optimizer suite's candidate is the default step
    # (check_finite=False, as torch.optim); the checked step is the taifuse-variant baseline.
    from taifuse.bench.suites import load_cases

    cases = {c.id: c for c in load_cases(["training", "optim"], quick=True, compare_torch=True)}
    mlp = next(c for i, c in cases.items() if i.startswith("training/mlp_step"))
    assert next(b for b in mlp.baselines if b.label == "torch").peer
    adamw = cases["optim/AdamW step, 10x(1000, 512)"]
    assert "check_finite=False" in adamw.candidate.prepare
    checked = next(b for b in adamw.baselines if b.label == "taifuse, finite check")
    assert "check_finite=True" in checked.prepare and not checked.peer
    assert next(b for b in adamw.baselines if b.label == "torch fused").peer
