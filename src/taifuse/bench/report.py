"""Writes a run's results: ``BENCHMARKS.md``, ``results.json``, ``SUMMARY.md`` and, with matplotlib,
``speedups.png`` and one chart per suite."""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

from taifuse._ceilings import COPY_ROWS
from taifuse.bench.roofline import MIXED_MARGIN

METHOD = """\
Every comparison row times a candidate (taifuse on the active backend) against a baseline whose exact
code is listed under the row. Before anything is timed, the two outputs are compared with
`numpy.allclose` at the row's stated tolerance; a mismatch fails the row and it is never timed.
Rows marked as bounds (a bare matrix product, a copy of the same bytes) compute something else on
purpose and are not checked: they show how close the candidate comes to a floor.
Each case runs in {processes} fresh worker processes, one after another. In each process every
variant is called once (the first-call row: imports, JIT compile or cache load), warmed up until two
calls in a row run within 1.5x of the fastest, and calibrated so one timed sample lasts at least
{min_sample_ms:g} ms (`time.perf_counter_ns`), or longer where a case sets a floor of calls per
sample (a call of a few microseconds: the step suite's per-op rows; a row's times are still per
call). Then candidate A and baseline B are timed in {blocks} A-B-B-A blocks per process, each block
giving one pair of mean times and one ratio B/A (the speedup; above 1 the candidate is faster). The
value is the median ratio over all pairs; the 95% interval comes from a hierarchical bootstrap
({resamples} resamples, processes first, then pairs within each).
The first case also times its candidate against itself (the A/A control row, same run). Verdicts:
"faster" when the interval's lower bound clears 1 + t, "slower" when its upper bound is below
1/(1 + t), "no measurable difference" when the whole interval lies between those, "inconclusive"
otherwise, and "unstable" when the ratios' dispersion (1.4826 x MAD of log ratios within each
process) exceeds {unstable:.0%}; t = max({min_effect:.0%}, A/A spread) = {threshold:.1%} in this run.
Rows marked "(isolated processes)" compare with a peer whose thread pools and ours slow each other
when called back to back in one process (PyTorch's OpenMP runtime beside Numba's and OpenBLAS's
threads): the peer is still checked against the candidate in the case's processes, but each side is
timed alone in fresh processes, alternating, and a ratio pairs samples of two processes of the same
index. The case's "A/A control, isolated processes" row, the candidate against itself timed the same
way, sets those rows' t (cross-process noise is larger than within one process).
Cache level is where the bytes one call moves (inputs + output) fit, by nominal cache size added up
over the CPUs (a private L2 per core counts once per core, a shared L3 once); bytes past a level but
within {margin}x its size are mixed (`L3/DRAM`), and judged against the faster level's ceiling.
The roofline column divides the candidate's achieved rate by the ceiling of its own kind and level,
measured in worker processes of this same run: a compute-bound row by the GEMM rate (float32
`np.matmul`), a memory-bound row by the copy bandwidth of its cache level ({ceilings}). That copy is
`np.add(src, 0.0, out=dst)` split over every CPU, one thread each, on a working set sized from the
measured caches to sit in that level; a ceiling's value is each process's fastest pass (other work
only ever slows one), the median over processes. Bytes are counted as the memory system moves them, the same
way for the ceilings and the rows: {traffic}. A row at 100% moves its bytes as fast as that copy;
it can pass 100% only by noise or by reading more than it writes (reads stream a little faster than
write-backs). Rows that move no data to speak of (allocations, first calls) have no roofline (—)."""


def _fmt(value: float | None, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    if unit == "x speedup":
        return f"{value:.3g}x"
    if unit == "ms":
        return f"{value:.4g} ms"
    return f"{value:.4g} {unit}".strip()


def _interval(row: dict) -> str:
    if row.get("low") is None:
        return "—"
    unit = "x" if row["unit"] == "x speedup" else ""
    return f"[{row['low']:.3g}{unit}, {row['high']:.3g}{unit}]"


def _n(row: dict) -> str:
    if not row.get("n_processes"):
        return "0"
    per = row["n_samples"] / row["n_processes"]
    return (
        f"{row['n_processes']}x{per:g}" if per == int(per) else f"{row['n_samples']} in {row['n_processes']}"
    )


def _bytes(n: int | None) -> str:
    if not n:
        return "—"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def _roofline(row: dict) -> str:
    r = row.get("roofline")
    if not r:
        return "—"
    return f"{r['achieved']:.3g} {r['unit']} = {r['fraction']:.0%} of {r['of']}"


def _table(rows: list[tuple], headers: list[str]) -> str:
    try:
        from tabulate import tabulate
    except ImportError as exc:
        raise RuntimeError(
            "taifuse bench writes its tables with tabulate: pip install 'taifuse[bench]'"
        ) from exc

    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _code_block(code: str) -> str:
    return "```python\n" + code + "\n```"


def markdown(result: dict, charts: Sequence[str] = (), *, matplotlib: bool = True) -> str:
    """The whole ``BENCHMARKS.md`` text for a run's result dict.

    ``charts``: the chart files written beside it, listed under the introduction;
    ``matplotlib=False`` puts one line there instead, saying why none was drawn.
    """
    env, method, rows = result["environment"], result["method"], result["rows"]
    lines = [
        "# taifuse benchmarks",
        "",
        (
            f"Produced by `{result['command']}` on {result['date']} (taifuse {env.get('taifuse')}, backend "
            f"`{env.get('backend')}`, commit {str(env.get('git_commit'))[:12]}"
            f"{', with uncommitted changes' if env.get('git_dirty') else ''}). Every number below was "
            "measured in this run; the method and the environment follow the tables."
        ),
        "",
    ]
    lines += _warnings(env)
    if not matplotlib:
        lines += [NO_MATPLOTLIB, ""]
    elif charts:
        lines += [
            f"Summary of the comparisons with peers: [{SUMMARY}]({SUMMARY}). Charts: "
            + ", ".join(f"[{name}]({name})" for name in charts)
            + ".",
            "",
        ]
    number = {row["id"]: i + 1 for i, row in enumerate(rows)}
    roof = [r for r in rows if r["kind"] == "roofline"]
    if roof:
        lines += ["## Roofline (measured in this run)", ""]
        lines.append(
            _table(
                [
                    (
                        number[r["id"]],
                        r["label"],
                        _fmt(r["value"], r["unit"]),
                        _interval(r),
                        _n(r),
                        r["size"],
                        r["cache_level"],
                        "—",
                        r["verdict"],
                        f"`{r['code']}`",
                    )
                    for r in roof
                ],
                ["#", "row", "value", "95% CI", "n", "size", "cache", "roofline", "verdict", "code"],
            )
        )
        lines.append("")
    suites = list(dict.fromkeys(r["suite"] for r in rows if r["kind"] != "roofline"))
    for suite in suites:
        srows = [r for r in rows if r.get("suite") == suite]
        lines += [f"## Suite: {suite}", ""]
        table = []
        for r in srows:
            cand_ms = r.get("candidate_ms", {}).get("median") if r.get("candidate_ms") else None
            base_ms = r.get("baseline_ms", {}).get("median") if r.get("baseline_ms") else None
            bound = " (bound)" if is_bound(r) else ""
            table.append(
                (
                    number[r["id"]],
                    _cell(r["label"] + bound),
                    _fmt(r["value"], r["unit"]),
                    _interval(r),
                    _n(r),
                    _fmt(cand_ms, "ms"),
                    _fmt(base_ms, "ms"),
                    _cell(r["size"]),
                    _bytes(r.get("bytes_moved")),
                    r["cache_level"],
                    _roofline(r),
                    r["verdict"],
                )
            )
        lines.append(
            _table(
                table,
                [
                    "#",
                    "row",
                    "value",
                    "95% CI",
                    "n (procs x pairs)",
                    "taifuse time",
                    "baseline time",
                    "size",
                    "bytes/call",
                    "cache",
                    "roofline",
                    "verdict",
                ],
            )
        )
        lines += ["", "### Row details", ""]
        for case in dict.fromkeys(r["case"] for r in srows):
            crows = [r for r in srows if r["case"] == case]
            lines += _case_details(crows[0])
            for r in crows:
                lines += _row_details(number[r["id"]], r)
    if result.get("baseline"):
        lines += _baseline_section(result["baseline"])
    lines += [
        "## Method",
        "",
        METHOD.format(
            processes=result["plan"]["processes"],
            blocks=result["plan"]["blocks"],
            min_sample_ms=result["plan"]["min_sample_ns"] / 1e6,
            resamples=method["resamples"],
            unstable=method["unstable_dispersion"],
            min_effect=method["min_effect"],
            threshold=method["threshold"],
            ceilings=_ceiling_sizes(rows),
            margin=MIXED_MARGIN,
            traffic=(method.get("ceilings") or {}).get("traffic_model", "bytes read + bytes written"),
        ),
        "",
    ]
    lines += ["## Environment", "", _table(_env_rows(env), ["key", "value"]), ""]
    return "\n".join(lines)


def _ceiling_sizes(rows: list[dict]) -> str:
    copies = [r for r in rows if r["kind"] == "roofline" and r["id"] in COPY_ROWS]
    return "; ".join(f"{r['cache_level']}: {r['size']}" for r in copies) or "none measured"


def _warnings(env: dict) -> list[str]:
    """What a reader must know before the tables: a busy machine, a BLAS kernel forced by a variable."""
    lines = []
    load = (env.get("load_average") or {}).get("before")
    cpus = env.get("cpus_usable") or 1
    if load and load[0] > 0.5 * cpus:
        lines += [
            (
                f"**Warning:** the 1-minute load average was {load[0]} on {cpus} CPUs when the run started: "
                "other work shared the machine, which skews these timings."
            ),
            "",
        ]
    if env.get("blas_note"):
        lines += [f"**BLAS:** {env['blas_note']}", ""]
    return lines


def _blas_rows(env: dict) -> list[tuple[str, str]]:
    libraries = env.get("blas_libraries")
    if isinstance(libraries, list):
        runtime = (
            "; ".join(
                f"{lib['library']} {lib['version']} ({lib['file']}): kernel {lib['kernel']}, "
                f"{lib['threads']} threads ({lib['threading_layer']})"
                for lib in libraries
            )
            or "none loaded that threadpoolctl recognises"
        )
    else:
        runtime = str(libraries)
    blas_env = env.get("blas_env") or {}
    default = env.get("blas_default") or {}
    if default.get("libraries"):
        own = ", ".join(f"{lib['library']} {lib['kernel']}" for lib in default["libraries"])
        unset = f"; with {', '.join(default['unset'])} unset: {own}"
    elif default.get("error"):
        unset = f"; with {', '.join(default['unset'])} unset: {default['error']}"
    else:
        unset = ""
    return [
        ("BLAS at run time (threadpoolctl)", runtime),
        ("OPENBLAS_* variables", (", ".join(f"{k}={v}" for k, v in blas_env.items()) or "none set") + unset),
    ]


def _case_details(r: dict) -> list[str]:
    return [
        f"#### {r['case']}",
        "",
        (
            f"dtype {r['dtype']}, shape {r['shape']}, seed {r['seed']}, backend {r.get('backend')}, "
            f"threads {json.dumps(r.get('threads', {}))}, {_bytes(r.get('bytes_moved'))} moved per call "
            f"({r['cache_level']})."
        ),
        "",
        f"Inputs: `{r['setup_code']}` with seed={r['seed']}.",
        "",
        "Candidate:",
        "",
        _code_block(r["candidate"]["code"]),
        "",
    ]


def _row_details(num: int, r: dict) -> list[str]:
    out = [
        f"**{num}. {r['label']}**: {_fmt(r['value'], r['unit'])} {_interval(r)}, n={_n(r)}, {r['verdict']}."
    ]
    if r.get("note"):
        out.append(f"{r['note']}.")
    check = r.get("check")
    if is_bound(r):
        out.append(f"Bound, not checked: {r['baseline']['note']}.")
    elif check:
        errs = (
            f"max abs err {check['max_abs_err']:.3g}, max rel err {check['max_rel_err']:.3g}"
            if check.get("max_abs_err") is not None
            else check.get("reason", "")
        )
        status = "outputs allclose" if check["ok"] else f"OUTPUTS DIFFER ({check['reason']})"
        out.append(f"Correctness: {status} at rtol={check['rtol']:g}, atol={check['atol']:g}; {errs}.")
    if r.get("loops"):
        out.append(f"Calls per timed sample, per process: {json.dumps(r['loops'])}.")
    out.append("")
    if r.get("baseline") and r["kind"] == "compare":
        out += [f"Baseline ({r['baseline']['label']}):", "", _code_block(r["baseline"]["code"]), ""]
    elif r["kind"] == "memory":  # one row per measured variant (suites/memory.py): show its code
        out += [f"Code ({r['candidate']['label']}):", "", _code_block(r["candidate"]["code"]), ""]
    return out


def _baseline_section(cmp: dict) -> list[str]:
    lines = ["## Against the baseline run", ""]
    if cmp["status"] == "not comparable":
        lines += [
            "**Not comparable**: the environment fingerprint differs: " + "; ".join(cmp["differences"]),
            "",
        ]
        return lines
    lines += [
        (
            f"Threshold {cmp['threshold']:.1%}; {cmp['regressions']} regression(s) in "
            f"{cmp['compared_rows']} compared row(s). Change = new speedup / old speedup."
        ),
        "",
    ]
    lines.append(
        _table(
            [
                (
                    _cell(r["label"]),
                    _fmt(r["old"], "x speedup"),
                    _fmt(r["new"], "x speedup"),
                    _fmt(r.get("value"), "x speedup"),
                    "—" if r["low"] is None else f"[{r['low']:.3g}, {r['high']:.3g}]",
                    r["verdict"],
                )
                for r in cmp["rows"]
            ],
            ["row", "old", "new", "change", "95% CI", "verdict"],
        )
    )
    return lines + [""]


def _device_rows(env: dict) -> list[tuple[str, str]]:
    """PyTorch's device of a ``--torch-device`` run: the GPU, its driver, CUDA (taifuse.bench.device)."""
    from taifuse.bench import device

    line = device.line(env.get("torch_device"))
    return [("device", line)] if line else []


def _env_rows(env: dict) -> list[tuple[str, str]]:
    caches = ", ".join(
        f"L{c['level']} {c['type'].lower()} {_bytes(c['bytes'])}" for c in env.get("caches", [])
    )
    timer = env.get("timer", {})
    rows = [
        ("CPU", env.get("cpu_model")),
        ("cores (logical / usable)", f"{env.get('logical_cpus')} / {env.get('cpus_usable')}"),
        ("caches (cpu0)", caches or "unknown"),
        ("memory", f"{env.get('memory_gib')} GiB"),
        ("OS / kernel", f"{env.get('os')} / {env.get('kernel')}"),
        ("Python", f"{env.get('python')} ({env.get('python_implementation')})"),
        ("NumPy", env.get("numpy")),
        ("NumPy BLAS (build)", env.get("blas")),
        *_blas_rows(env),
        ("numba", env.get("numba")),
        ("taichi", env.get("taichi")),
        ("torch", env.get("torch")),
        *_mpi_rows(env),
        ("taifuse backend", f"{env.get('backend')} {json.dumps(env.get('backend_info'))}"),
        ("Taichi arch", env.get("taichi_arch")),
        *_device_rows(env),
        ("threads", json.dumps(env.get("threads"))),
        ("thread environment", json.dumps(env.get("thread_env"))),
        ("git", f"{env.get('git_commit')} ({'dirty' if env.get('git_dirty') else 'clean'})"),
        (
            "timer",
            (
                f"{timer.get('clock')} ({timer.get('implementation')}), advertised "
                f"{timer.get('advertised_resolution_ns', 0):g} ns, "
                f"smallest step {timer.get('smallest_step_ns')} ns"
            ),
        ),
        (
            "load average (1/5/15 min) before / after",
            (
                f"{(env.get('load_average') or {}).get('before')} / "
                f"{(env.get('load_average') or {}).get('after')}"
            ),
        ),
        ("fingerprint", env.get("fingerprint")),
    ]
    return [(k, _cell(str(v))) for k, v in rows]


def _mpi_rows(env: dict) -> list[tuple[str, str]]:
    """The MPI line: mpi4py, the MPI wheel, the library's own version (when a rank reported it)."""
    mpi = env.get("mpi")
    if not mpi:
        return []
    wheels = ", ".join(f"{k} {v}" for k, v in mpi.get("wheels", {}).items()) or "no MPI wheel"
    library = mpi.get("library") or "library not started in this run"
    return [("MPI", f"mpi4py {mpi.get('mpi4py')}, {wheels}; {library}; mpiexec {mpi.get('mpiexec')}")]


BENCHMARKS = "BENCHMARKS.md"
RESULTS = "results.json"
SUMMARY = "SUMMARY.md"
CHART = "speedups.png"
NO_MATPLOTLIB = "Charts not drawn: matplotlib is not installed (`pip install 'taifuse[plot]'`)."


def write(result: dict, out_dir: str | Path) -> list[Path]:
    """Write a run's files into ``out_dir`` and return their paths.

    ``BENCHMARKS.md`` (every row, the method, the environment), ``results.json`` (everything,
    samples included), ``SUMMARY.md`` (one line per comparison with a peer, for a README) and, when
    matplotlib is importable (the ``plot`` extra), ``speedups.png`` (those comparisons' speedups
    with their 95% intervals) and one ``<suite>.png`` per suite; without it, the two markdown files
    say in one line that the charts were skipped.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    charts: list[Path] = []
    if plt is not None:
        chart = draw_chart(result, out / CHART, plt)
        charts = ([chart] if chart else []) + _plots(result, out, plt)
    paths = [out / BENCHMARKS, out / RESULTS, out / SUMMARY]
    paths[0].write_text(markdown(result, [c.name for c in charts], matplotlib=plt is not None))
    paths[1].write_text(json.dumps(result, indent=1, default=_json_default, allow_nan=False))
    summary_chart = CHART if any(c.name == CHART for c in charts) else None
    paths[2].write_text(summary_markdown(result, chart=summary_chart, drawn=plt is not None))
    return paths + charts


def _json_default(value):
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _plots(result: dict, out: Path, plt) -> list[Path]:
    """One ``<suite>.png`` per suite: its timed rows (comparisons, controls, bounds) in table order."""
    paths = []
    for suite in dict.fromkeys(r["suite"] for r in result["rows"] if r["kind"] != "roofline"):
        rows = [
            r
            for r in result["rows"]
            if r.get("suite") == suite and r["kind"] in ("compare", "control") and r["value"] is not None
        ]
        if not rows:
            continue
        fig = _ratio_figure(
            plt,
            rows,
            title=f"Suite {suite}: each candidate against its baselines",
            subtitle=_run_line(result),
            xlabel="baseline's time / candidate's time (above 1: candidate faster)",
        )
        path = out / f"{suite}.png"
        fig.savefig(path, dpi=CHART_DPI)
        plt.close(fig)
        paths.append(path)
    return paths


def is_bound(row: dict) -> bool:
    """Whether a row's baseline is a bound: it computes something else on purpose (a bare product, a
    copy of the same bytes), so the ratio is the distance to a floor, not a speedup."""
    return bool(row.get("baseline")) and not row["baseline"]["same_result"]


# NOTE [ Chart layout ]
# The charts are read at their drawn size (README shows speedups.png 1080 px wide): a row's label is
# the operation and the two sides only, at most LABEL_WIDTH characters a line, with the size on a
# smaller grey line under it, so the data keeps most of the width. The layout engine
# ("constrained") fits the labels, title, axis label and legend inside the figure; nothing is cut.
# The verdict is the marker's colour, the kind of row its shape (a bound hollow: not a speedup), and
# the rows run top to bottom in the table's order.
CHART_WIDTH_IN = 9.0
CHART_DPI = 120
LABEL_WIDTH = 50
DETAIL_WIDTH = 60
VERDICT_COLOURS = {
    "faster": "tab:green",
    "slower": "tab:red",
    "no measurable difference": "tab:blue",
    "inconclusive": "tab:gray",
    "unstable": "tab:orange",
}
_MARKERS = {  # kind of row: (marker, filled, legend text)
    "compare": ("o", True, "comparison"),
    "control": ("D", True, "A/A control"),
    "bound": ("s", False, "bound: a floor, not a speedup"),
}


def _split_case(name: str) -> tuple[str, str]:
    """A case name as (operation, detail): the detail is what follows the first top-level ", " and any
    parenthesised arguments holding numbers (sizes: ``mlp_step(784-1024-1024-10, ...)``); arguments
    without numbers name the operation and stay (``gelu(approximate='tanh')``). What follows a
    top-level ": " names the two sides (``pool on vs off``), which the label says anyway: dropped."""
    cuts, depth = {}, 0
    for i, ch in enumerate(name):
        depth += (ch in "([") - (ch in ")]")
        if depth == 0 and name.startswith((", ", ": "), i):
            cuts.setdefault(ch, i)
    name = name[: cuts.get(":", len(name))]
    comma = cuts.get(",", len(name))
    head, rest = name[:comma], name[comma + 2 :]
    op, paren, args = head.partition("(")
    if paren and head.endswith(")") and any(ch.isdigit() for ch in args):
        head, rest = op.rstrip(), "; ".join(part for part in (args[:-1], rest) if part)
    return head, rest


def chart_label(row: dict) -> tuple[str, str]:
    """A row's label on a chart, as (operation and sides, size): ``("silu vs torch", "(4194304,)")``.

    Rows that do not name their case and sides (written by something else) keep their whole label."""
    case = row.get("case")
    cand = (row.get("candidate") or {}).get("label")
    base = (row.get("baseline") or {}).get("label")
    if not (case and cand and base):
        return row["label"], ""
    op, detail = _split_case(case)
    if row["kind"] == "control":
        isolated = str(row["id"]).endswith("-isolated")
        line = f"{op}: A/A control{' (isolated processes)' if isolated else ''}"
    elif cand == "taifuse":
        line = f"{op} vs {base}"
    else:
        line = f"{op}: {cand} vs {base}"
    return line + (" (bound)" if is_bound(row) else ""), detail or str(row.get("size") or "")


def log_ticks(low: float, high: float, most: int = 9) -> list[float]:
    """Round ratios to mark on a log axis from ``low`` to ``high``: at most about ``most``, spaced
    evenly enough that their labels cannot overlap; 1 first, then 2 and 5 of each decade, then finer
    steps (0.9, 1.1, 1.2) where there is room, and 0.95 and 1.05 only when too few fit otherwise."""
    gap = (math.log10(high) - math.log10(low)) / most
    decades = range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
    ticks: list[float] = []
    for ranks in (_TICK_STEPS, {**_TICK_STEPS, 1.05: 5, 9.5: 5}):
        ticks = []
        for _rank, _distance, v in sorted(
            (rank, abs(e + math.log10(m)), float(f"{m * 10.0**e:.3g}"))
            for e in decades
            for m, rank in ranks.items()
        ):
            if low <= v <= high and all(abs(math.log10(v / t)) >= gap for t in ticks):
                ticks.append(v)
        if len(ticks) >= 3:
            break
    return sorted(ticks)


# The mantissas a tick may have, by preference (lower first).
_TICK_STEPS = {1: 0, 2: 1, 5: 1, 1.5: 2, 3: 2, 1.2: 3, 4: 3, 7: 3, 1.1: 4, 1.3: 4, 2.5: 4, 6: 4, 8: 4, 9: 4}


def _run_line(result: dict) -> str:
    env = result["environment"]
    return f"{env.get('backend')} backend, {env.get('cpu_model')}, {result['date']}"


def _ratio_figure(plt, rows: list[dict], *, title: str, subtitle: str, xlabel: str):
    """A figure of ``rows``' ratios with their 95% intervals (NOTE [ Chart layout ])."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, NullFormatter

    labels = [chart_label(r) for r in rows]
    heads = [textwrap.wrap(head, LABEL_WIDTH) or [""] for head, _ in labels]
    details = [textwrap.wrap(d, DETAIL_WIDTH, max_lines=2, placeholder=" ...") for _, d in labels]
    # Each row as tall as its label (a line of 8 pt, a detail line of 6.5 pt, 0.5 line between rows).
    spans = [max(1.6, len(h) + 0.8 * len(d)) + 0.5 for h, d in zip(heads, details)]
    ys = [sum(spans[:i]) + span / 2 for i, span in enumerate(spans)]
    fig, ax = plt.subplots(figsize=(CHART_WIDTH_IN, 0.15 * sum(spans) + 1.9), layout="constrained")
    kinds = {}
    for y, r in zip(ys, rows):
        kind = "bound" if is_bound(r) else r["kind"]
        marker, filled, _ = kinds.setdefault(kind, _MARKERS.get(kind, _MARKERS["compare"]))
        colour = VERDICT_COLOURS.get(r["verdict"], "tab:gray")
        ax.errorbar(
            r["value"],
            y,
            xerr=[[r["value"] - r["low"]], [r["high"] - r["value"]]],
            fmt=marker,
            color=colour,
            mfc=colour if filled else "white",
            ms=5,
            capsize=3,
        )
    ax.set_ylim(sum(spans), 0)  # first row on top, as in the table
    ax.set_yticks(ys)
    ax.tick_params(axis="y", labelleft=False, length=0)
    to_the_left = ax.get_yaxis_transform()  # x in axes fractions, y in rows
    for y, head, detail in zip(ys, heads, details):
        common = {"xy": (0, y), "xycoords": to_the_left, "textcoords": "offset points", "ha": "right"}
        ax.annotate(
            "\n".join(head),
            xytext=(-6, 1 if detail else 0),
            va="bottom" if detail else "center",
            fontsize=8,
            annotation_clip=False,
            **common,
        )
        if detail:
            ax.annotate(
                "\n".join(detail),
                xytext=(-6, -1),
                va="top",
                fontsize=6.5,
                color="dimgray",
                annotation_clip=False,
                **common,
            )

    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xscale("log")
    low = min(min(r["low"] for r in rows), 1.0)
    high = max(max(r["high"] for r in rows), 1.0)
    pad = max(1.08, (high / low) ** 0.06)
    ax.set_xlim(low / pad, high * pad)
    ax.xaxis.set_major_locator(FixedLocator(log_ticks(low / pad, high * pad)))
    ax.xaxis.set_major_formatter(lambda v, _pos: f"{v:g}x")
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", which="major", lw=0.5, alpha=0.6)
    ax.grid(axis="x", which="minor", lw=0.3, alpha=0.3)
    ax.set_xlabel(xlabel + ", 95% interval", fontsize=8.5)
    width = int(CHART_WIDTH_IN * 72 / (9 * 0.6))  # characters of a 9 pt line across the figure
    fig.suptitle(
        "\n".join([*textwrap.wrap(title, width), *textwrap.wrap(subtitle, int(width * 1.2))]), fontsize=9
    )
    verdicts = [
        Line2D([], [], ls="", marker="o", color=colour, label=verdict)
        for verdict, colour in VERDICT_COLOURS.items()
        if any(r["verdict"] == verdict for r in rows)
    ]
    shapes = [
        Line2D([], [], ls="", marker=marker, color="black", mfc="black" if filled else "white", label=text)
        for marker, filled, text in kinds.values()
    ]
    if set(kinds) == {"compare"}:  # the marker's shape says something only where it varies
        shapes = []
    # One line of verdicts over one line of shapes: the legend fills its columns top to bottom.
    columns = max(len(verdicts), len(shapes))
    blank = Line2D([], [], ls="", label=" ")
    lines = [verdicts + [blank] * (columns - len(verdicts)), shapes + [blank] * (columns - len(shapes))]
    handles = [h for pair in zip(*lines) for h in pair if shapes or h is not blank]
    fig.legend(handles=handles, loc="outside lower center", ncols=columns, fontsize=7, frameon=False)
    return fig


# ----------------------------------------------------------------------------- summary


def is_peer(row: dict) -> bool:
    """Whether a row compares taifuse with a peer: another library's same function (NumPy's,
    PyTorch's), checked to give the same result; not a bound, an A/A control or a taifuse variant.

    Rows written before baselines said so themselves are judged from the baseline's imports.
    """
    base = row.get("baseline") or {}
    if "peer" in base:
        return bool(base["peer"])
    imports = [line for line in str(base.get("code", "")).splitlines() if line.startswith("import ")]
    return bool(base.get("same_result")) and not any(
        line.split()[1].startswith("taifuse") and not line.split()[1].startswith("taifuse.bench")
        for line in imports
    )


def peer_rows(result: dict) -> list[dict]:
    """The summary's rows, in report order: every comparison (speed, memory) with a peer."""
    return [r for r in result["rows"] if r["kind"] in ("compare", "memory_compare") and is_peer(r)]


def _ratio(row: dict) -> str:
    if row["value"] is None:
        return "—"
    return (
        _fmt(row["value"], row["unit"]) if row["unit"] == "x speedup" else f"{row['value']:.3g}x less memory"
    )


def summary_markdown(result: dict, *, chart: str | None = None, drawn: bool = True) -> str:
    """``SUMMARY.md``: one line per comparison with a peer (row, ratio, 95% interval, verdict), the
    run's provenance and warnings above it, the chart (``chart``, a file name) or why it is missing
    (``drawn=False``: matplotlib absent) below it."""
    env = result["environment"]
    blas = env.get("blas_kernel")
    lines = [
        "# taifuse benchmark summary",
        "",
        (
            f"`{result['command']}` on {result['date']}, commit {str(env.get('git_commit'))[:12]}"
            f"{' (with uncommitted changes)' if env.get('git_dirty') else ''}, backend `{env.get('backend')}`, "
            f"{env.get('cpu_model')} ({env.get('cpus_usable')} CPUs), NumPy {env.get('numpy')} with "
            f"{env.get('blas')}{f' ({blas} kernel)' if blas else ''}"
            f"{'; ' + _device_rows(env)[0][1] if _device_rows(env) else ''}. Each line compares taifuse with a peer "
            "library computing the same result, checked before timing; a ratio above 1 means taifuse is "
            "faster (or, for memory, needs less). The 95% interval, the verdict and every other row, with "
            f"its code, are explained in [{BENCHMARKS}]({BENCHMARKS})."
        ),
        "",
        *_warnings(env),
    ]
    rows = peer_rows(result)
    if not rows:
        return "\n".join([*lines, "No comparison with a peer was measured in this run.", ""])
    lines.append(
        _table(
            [(_cell(r["label"]), _ratio(r), _interval(r), r["verdict"]) for r in rows],
            ["row", "ratio", "95% CI", "verdict"],
        )
    )
    lines.append("")
    if chart:
        lines += [f"![taifuse's speedup over each peer, with 95% intervals]({chart})", ""]
    elif not drawn:
        lines += [NO_MATPLOTLIB, ""]
    return "\n".join(lines)


def draw_chart(result: dict, path: Path, plt=None) -> Path | None:
    """Draw each peer comparison's speedup with its 95% interval (log x axis, a line at 1, colour by
    verdict, NOTE [ Chart layout ]) into ``path``; None when no such row has a value.
    ``plt``: pyplot (imported when None)."""
    rows = [r for r in peer_rows(result) if r["unit"] == "x speedup" and r["value"] is not None]
    if not rows:
        return None
    plt = plt or _pyplot()
    fig = _ratio_figure(
        plt,
        rows,
        title="taifuse against peer libraries computing the same result",
        subtitle=_run_line(result),
        xlabel="speedup = peer's time / taifuse's time (above 1: taifuse faster)",
    )
    fig.savefig(path, dpi=CHART_DPI)
    plt.close(fig)
    return path


def summary(result: dict) -> str:
    """A compact console table: each row's value, interval, n and verdict."""
    table = [
        (
            r["label"],
            _fmt(r["value"], r["unit"]),
            _interval(r),
            _n(r),
            r["cache_level"],
            _roofline(r),
            r["verdict"],
        )
        for r in result["rows"]
    ]
    text = _table(table, ["row", "value", "95% CI", "n", "cache", "roofline", "verdict"])
    note = result.get("environment", {}).get("blas_note")
    if note:  # above the table, as in BENCHMARKS.md
        text = f"BLAS: {note}\n\n{text}"
    if result.get("errors"):
        text += "\n" + "\n".join(f"error in {case}: {msg}" for case, msg in result["errors"].items())
    return text


def run_line(result: dict) -> str:
    """Backend, threads, load average before/after and date of a run, in one line."""
    env = result["environment"]
    where = f" (Taichi arch {(env.get('backend_info') or {}).get('arch')})" if env.get("backend") == "taichi" else ""
    rows = _device_rows(env)
    return (
        f"backend {env['backend']}{where}{', ' + rows[0][1] if rows else ''}, threads {env['threads']}, "
        "load average before/after "
        f"{env['load_average']['before']} / {env['load_average']['after']}, {result['date']}"
    )


def judge(low: float, high: float, *, at_least: float | None = None, at_most: float | None = None) -> str:
    """A goal's status from a 95% interval: "met" when all of ``[low, high]`` satisfies the bound
    (``at_least`` or ``at_most``, exactly one), "not met" when none of it does, else "undecided"."""
    if (at_least is None) == (at_most is None):
        raise ValueError("judge: pass exactly one of at_least and at_most")
    if at_least is not None:
        return "met" if low >= at_least else "not met" if high < at_least else "undecided"
    return "met" if high <= at_most else "not met" if low > at_most else "undecided"


def goal_line(goal: dict) -> str:
    """``status  goal: value [low, high]  (detail)`` for a goal judged from a run's rows
    (the benchmark scripts in ``benchmarks/``); ``value``, ``low`` and ``high`` may be None."""
    value = "—" if goal["value"] is None else f"{goal['value']:.3g}"
    interval = "" if goal.get("low") is None else f" [{goal['low']:.3g}, {goal['high']:.3g}]"
    return f"{goal['status']:>9}  {goal['goal']}: {value}{interval}  ({goal['detail']})"
