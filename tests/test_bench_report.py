"""What ``taifuse bench`` writes, on a synthetic run built by the harness (no processes started):
the summary of comparisons with peers, the chart (with and without matplotlib), the BLAS note
above the tables, the roofline column, and the results.json keys that ``--baseline`` reads."""

from __future__ import annotations

import itertools
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


# ----------------------------------------------------------------------------- charts


class _KeepFigures:
    """pyplot, except that ``close`` keeps each figure for the test to inspect."""

    def __init__(self):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        self.plt, self.figures = plt, []

    def __getattr__(self, name):
        return getattr(self.plt, name)

    def close(self, fig):
        self.figures.append(fig)


# The longest case name of the real suites, and a CPU name of the usual length.
LONG_CASE = "attention forward+backward(B=8, H=8, L=S=512, E=64, causal)"
LONG_CPU = "AMD EPYC 7B13 64-Core Processor"


def _renamed(result: dict) -> dict:
    """``result`` with the gelu case under the real suites' longest name, as a run would label it."""

    def rename(row: dict) -> dict:
        if not row["id"].startswith("synthetic/gelu/"):
            return row
        return dict(
            row,
            id=row["id"].replace("gelu", LONG_CASE, 1),
            case=LONG_CASE,
            label=row["label"].replace("gelu", LONG_CASE, 1),
        )

    env = dict(result["environment"], cpu_model=LONG_CPU)
    return dict(result, environment=env, rows=[rename(r) for r in result["rows"]])


def _figures(result: dict, tmp_path) -> dict[str, object]:
    """Every chart ``write`` draws for ``result``, by file name, left open."""
    keep = _KeepFigures()
    report.draw_chart(result, tmp_path / report.CHART, keep)
    names = [p.name for p in report._plots(result, tmp_path, keep)]
    return dict(zip([report.CHART, *names], keep.figures))


def _points(ax) -> list[tuple[float, str, str]]:
    """Each plotted point as (value, colour, face colour), top row first."""
    from matplotlib.colors import to_hex

    points = []
    for container in ax.containers:
        line = container.lines[0]
        for x, y in zip(line.get_xdata(), line.get_ydata()):
            top = ax.transData.transform((x, y))[1]
            points.append((top, float(x), to_hex(line.get_color()), to_hex(line.get_markerfacecolor())))
    return [p[1:] for p in sorted(points, key=lambda p: -p[0])]


def _tick_labels(ax) -> list:
    """The x tick labels drawn inside the axis' view, major and minor, that show any text."""
    low, high = ax.get_xlim()
    out = []
    for minor in (False, True):
        for loc, label in zip(ax.get_xticks(minor=minor), ax.get_xticklabels(minor=minor)):
            if low <= loc <= high and label.get_visible() and label.get_text():
                out.append(label)
    return out


def _check_ticks(fig, ax):
    renderer = fig.canvas.get_renderer()
    labels = _tick_labels(ax)
    assert len(labels) >= 3, [t.get_text() for t in labels]
    for label in labels:
        assert re.fullmatch(r"\d+(\.\d+)?x", label.get_text()), label.get_text()
    boxes = sorted((t.get_window_extent(renderer) for t in labels), key=lambda b: b.x0)
    for left, right in itertools.pairwise(boxes):
        assert left.x1 < right.x0, "tick labels overlap"


def test_charts_fit_their_figure_and_leave_the_data_most_of_the_width(result, tmp_path):
    # speedups.png was drawn with each row's whole label (the case name, both sides, the method):
    # the longest pushed the axes right until the title and x label ran off the figure's edge.
    pytest.importorskip("matplotlib")
    figures = _figures(_renamed(result), tmp_path)
    assert set(figures) == {report.CHART, "synthetic.png"}
    for name, fig in figures.items():
        fig.canvas.draw()
        width, height = fig.get_size_inches()
        drawn = fig.get_tightbbox(fig.canvas.get_renderer())  # inches, everything drawn
        assert drawn.x0 >= -0.01 and drawn.y0 >= -0.01, (name, drawn)
        assert drawn.x1 <= width + 0.01 and drawn.y1 <= height + 0.01, (name, drawn)
        (ax,) = fig.axes
        assert ax.get_position().width >= 0.55, name  # the data, not the labels, has the width
        for text in ax.texts:
            assert all(len(line) <= report.DETAIL_WIDTH for line in text.get_text().splitlines()), name
    (ax,) = figures[report.CHART].axes
    labels = [t.get_text() for t in ax.texts]
    assert "attention forward+backward vs numpy" in labels
    assert "B=8, H=8, L=S=512, E=64, causal" in labels  # the size on its own line


def test_suite_chart_has_a_title_colours_by_verdict_and_keeps_the_table_order(result, tmp_path):
    pytest.importorskip("matplotlib")
    fig = _figures(result, tmp_path)["synthetic.png"]
    fig.canvas.draw()
    (ax,) = fig.axes
    assert "synthetic" in fig.get_suptitle()
    rows = [
        r for r in result["rows"] if r.get("suite") == "synthetic" and r["kind"] in ("compare", "control")
    ]
    points = _points(ax)
    assert [p[0] for p in points] == pytest.approx([r["value"] for r in rows])  # top to bottom
    verdicts = [r["verdict"] for r in rows]
    assert len(set(verdicts)) >= 2
    for (_, colour_a, _), a in zip(points, verdicts):
        for (_, colour_b, _), b in zip(points, verdicts):
            assert (colour_a == colour_b) == (a == b), (a, b)
    (legend,) = fig.legends
    shown = {t.get_text() for t in legend.get_texts()}
    assert set(verdicts) <= shown
    # Bounds say so in their label, with a hollow marker the legend explains.
    bounds = [r for r in rows if not r["baseline"]["same_result"]]
    assert {r["baseline"]["label"] for r in bounds} == {"copy bound", "np.empty"}
    labels = [t.get_text() for t in ax.texts]
    for r in rows:
        head = report.chart_label(r)[0]
        assert head in labels and head.endswith(" (bound)") == (r in bounds)
    for (_, colour, face), r in zip(points, rows):
        assert (face == "#ffffff") == (r in bounds)
    assert any("not a speedup" in text for text in shown)
    _check_ticks(fig, ax)


def test_chart_ticks_are_plain_and_apart_over_a_narrow_range(result, tmp_path):
    # Over less than a decade matplotlib's log axis labels minor ticks as 1.2x10^0, on top of each other.
    pytest.importorskip("matplotlib")
    narrow = [
        dict(r, value=1.0 + 0.02 * i, low=0.95 + 0.02 * i, high=1.1 + 0.02 * i)
        if r["kind"] in ("compare", "control") and r["value"] is not None
        else r
        for i, r in enumerate(result["rows"])
    ]
    for fig in _figures(dict(result, rows=narrow), tmp_path).values():
        fig.canvas.draw()
        _check_ticks(fig, fig.axes[0])


def test_log_ticks_are_round_and_few():
    assert report.log_ticks(0.9, 1.2) == [0.9, 1.0, 1.1, 1.2]
    assert report.log_ticks(0.5, 2500) == [1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0]
    assert report.log_ticks(0.4, 50) == [0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0]
    assert report.log_ticks(0.93, 1.08) == [0.95, 1.0, 1.05]  # finer steps only when needed


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("silu", ("silu", "")),
        ("gelu(approximate='tanh')", ("gelu(approximate='tanh')", "")),
        ("SGD step, 10x(1000, 512)", ("SGD step", "10x(1000, 512)")),
        ("mlp_step(784-1024-1024-10, gelu, batch=256)", ("mlp_step", "784-1024-1024-10, gelu, batch=256")),
        ("mlp training step: pool on vs off", ("mlp training step", "")),
        (
            "mlp_step(2-64-64-3, batch=64), profiler off: hooks vs hooks stripped",
            ("mlp_step", "2-64-64-3, batch=64; profiler off"),
        ),
    ],
)
def test_chart_labels_name_the_operation_and_put_the_size_apart(case, expected):
    assert report._split_case(case) == expected


def test_chart_label_of_each_kind_of_row(result):
    rows = _by_id(result)
    assert report.chart_label(rows["synthetic/gelu/numpy"]) == ("gelu vs numpy", "(n,)")
    assert report.chart_label(rows["synthetic/gelu/copy bound"])[0] == "gelu vs copy bound (bound)"
    assert report.chart_label(rows["synthetic/gelu/control"])[0] == "gelu: A/A control"
    isolated = report.chart_label(rows["synthetic/gelu/control-isolated"])[0]
    assert isolated == "gelu: A/A control (isolated processes)"
    assert report.chart_label({"label": "a row from elsewhere", "kind": "compare"}) == (
        "a row from elsewhere",
        "",
    )
