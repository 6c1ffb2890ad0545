"""Issue 32's goals for the whole training step, measured with the ``taifuse.bench`` harness (the
``step`` suite; no measuring code of its own). PyTorch CPU eager is timed in fresh processes of
its own (NOTE [ Isolated baselines ] in taifuse.bench.harness).

* Per-op fixed cost, eager: ``F.relu`` forward on an (8, 16) Tensor that requires grad, and
  ``F.linear`` + ``.sum()`` + ``backward()`` at (8, 16) x (16, 16), each at most 2x PyTorch's
  time: a speedup over torch of at least 0.5.
* examples/train_mlp.py's step (2-64-64-3, batch 64, AdamW) under ``taifuse.compile`` at least as
  fast as PyTorch's eager step ("met" when the whole 95% interval is at or above
  ``1 / (1 + 5%)``, as bench_training.py judges). Without ``taifuse.compile`` the eager row is
  printed and this goal says so.
* The GPT step at 4 layers, width 256, 4 heads, context 128, batch 16 at >= 70% MFU (nanoGPT's
  model FLOPs over the GEMM ceiling this run measures: NOTE [ Model FLOPs ] in the suite), which
  is >= 1.9x PyTorch; PyTorch's MFU is printed beside it (taifuse's over the speedup).
* The step examples/train_gpt.py trains with by default (its ``parse_args([])``) at >= 1.5x
  PyTorch, eager; the compiled step's speed-up is judged against the same goal.
* Peak memory of that step: eager (compare with an earlier run's row: "not above today's"), and
  compiled at most eager's (the pair row's value, eager's peak over compiled's, at least 1).

Each goal is judged on the 95% interval: "met" when all of it satisfies the goal, "not met" when
none of it does, "undecided" otherwise. Nothing here forces a pass. Run GEMM-bound benchmarks with
both OpenBLAS variables unset (docs/benchmarks.md, "BLAS"), on a quiet machine:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/bench_step.py [--quick] [--out DIR]

(needs torch for the comparisons: the ``compare`` extra; ``--backend`` picks the taifuse backend,
numba by default).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import taifuse
import taifuse.bench
from taifuse.bench import report, stats
from taifuse.bench.suites import load_cases, step

PER_OP_GOAL = 0.5  # speedup over torch, at least: taifuse's time at most 2x torch's
MFU_GOAL = 0.70
EXAMPLE_GOAL = 1.5  # the example's default GPT step: speedup over torch, at least


def _missing(name: str, row: dict | None) -> dict:
    return {
        "goal": name,
        "status": "not met",
        "value": None,
        "low": None,
        "high": None,
        "detail": "no such row in this run" if row is None else row["verdict"],
    }


def _times(row: dict, unit: str = "ms") -> str:
    if not (row.get("candidate_ms") and row.get("baseline_ms")):
        return ""
    scale, fmt = (1e3, ".2f") if unit == "us" else (1.0, ".1f")
    c, b = row["candidate_ms"]["median"] * scale, row["baseline_ms"]["median"] * scale
    return f"; taifuse {c:{fmt}} {unit}, {row['baseline']['label']} {b:{fmt}} {unit}"


def _row(rows: list[dict], prefix: str, suffix: str) -> dict | None:
    """The row whose id starts with ``step/prefix(`` and ends with ``/suffix``."""
    start = f"{step.SUITE}/{prefix}("
    return next((r for r in rows if r["id"].startswith(start) and r["id"].endswith(f"/{suffix}")), None)


def _speed_goal(rows: list[dict], name: str, prefix: str, at_least: float, unit: str = "ms") -> dict:
    row = _row(rows, prefix, "torch")
    if row is None or row["value"] is None:
        return _missing(name, row)
    return {
        "goal": name,
        "status": report.judge(row["low"], row["high"], at_least=at_least),
        "value": row["value"],
        "low": row["low"],
        "high": row["high"],
        "detail": f"speedup over torch, at least {at_least:.2f}; verdict: {row['verdict']}{_times(row, unit)}",
    }


def _mfu(rows: list[dict], prefix: str) -> tuple[dict | None, dict | None]:
    """The candidate's roofline (MFU) of the GPT case ``prefix`` and its torch row."""
    torch_row = _row(rows, prefix, "torch")
    start = f"{step.SUITE}/{prefix}("
    roof = next((r.get("roofline") for r in rows if r["id"].startswith(start) and r.get("roofline")), None)
    return roof, torch_row


def goals(result: dict) -> list[dict]:
    """The per-op, MLP, GPT (MFU), example GPT step and memory goals, judged from a run's rows."""
    rows = result["rows"]
    out = [
        _speed_goal(rows, "per-op F.relu: at most 2x torch's time", "per-op relu", PER_OP_GOAL, "us"),
        _speed_goal(
            rows, "per-op F.linear + sum + backward: at most 2x torch's time", "per-op linear+sum+backward",
            PER_OP_GOAL, "us",
        ),
    ]  # fmt: skip
    floor = 1.0 / (1.0 + stats.MIN_EFFECT)
    name = "MLP step under taifuse.compile: no slower than torch eager"
    if step.has_compile():
        out.append(_speed_goal(rows, name, "mlp step compiled", floor))
    else:
        eager = _row(rows, "mlp step", "torch")
        detail = "taifuse.compile does not exist in this build"
        if eager is not None and eager["value"] is not None:
            detail += f"; eager: {eager['value']:.3g}x torch [{eager['low']:.3g}, {eager['high']:.3g}]{_times(eager)}"
        out.append(
            {"goal": name, "status": "not met", "value": None, "low": None, "high": None, "detail": detail}
        )

    for prefix in ("gpt step", "gpt step compiled") if step.has_compile() else ("gpt step",):
        name = f"{prefix}: >= {MFU_GOAL:.0%} MFU (GEMM ceiling of this run)"
        roof, torch_row = _mfu(rows, prefix)
        if roof is None:
            out.append(_missing(name, torch_row))
            continue
        detail = f"{roof['achieved']:.1f} GFLOP/s of {roof['of']}"
        if torch_row is not None and torch_row["value"]:
            detail += (
                f"; torch {roof['fraction'] / torch_row['value']:.0%} MFU; {torch_row['value']:.3g}x torch"
            )
            detail += f" [{torch_row['low']:.3g}, {torch_row['high']:.3g}]{_times(torch_row)}"
        out.append(
            {
                "goal": name,
                "status": report.judge(roof["low"], roof["high"], at_least=MFU_GOAL),
                "value": roof["fraction"],
                "low": roof["low"],
                "high": roof["high"],
                "detail": detail,
            }
        )

    for prefix in (
        ("example gpt step", "example gpt step compiled") if step.has_compile() else ("example gpt step",)
    ):
        out.append(
            _speed_goal(
                rows,
                f"{prefix} (examples/train_gpt.py's defaults): >= {EXAMPLE_GOAL}x torch",
                prefix,
                EXAMPLE_GOAL,
            )
        )

    memory = [r for r in rows if r["id"].startswith(f"{step.SUITE}/gpt step peak memory(")]
    pair = next((r for r in memory if r.get("kind") == "memory_compare"), None)
    if pair is not None:
        name = "GPT step peak memory: compiled at most eager's"
        if pair["value"] is None:
            out.append(_missing(name, pair))
        else:
            out.append(
                {
                    "goal": name,
                    "status": report.judge(pair["low"], pair["high"], at_least=1.0),
                    "value": pair["value"],
                    "low": pair["low"],
                    "high": pair["high"],
                    "detail": "eager's peak over compiled's",
                }
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer processes and samples")
    parser.add_argument("--out", help="also write BENCHMARKS.md and results.json here")
    parser.add_argument("--backend", default="numba", help="taifuse backend to measure (default: numba)")
    args = parser.parse_args(argv)

    taifuse.set_backend(args.backend)
    compare_torch = importlib.util.find_spec("torch") is not None
    cases = load_cases([step.SUITE], quick=args.quick, compare_torch=compare_torch)
    plan = taifuse.bench.QUICK if args.quick else taifuse.bench.GOALS
    command = "python benchmarks/bench_step.py" + (" --quick" if args.quick else "")
    if args.backend != "numba":
        command += f" --backend {args.backend}"
    result = taifuse.bench.run(
        cases=cases, plan=plan, quick=args.quick, compare_torch=compare_torch, out=args.out, command=command
    )
    print(report.summary(result))
    print(f"\n{report.run_line(result)}\n")
    for r in result["rows"]:
        if r.get("suite") == step.SUITE and r["kind"].startswith("memory") and r.get("note"):
            print(f"{r['label']}: {r['note']}")
    print()
    for g in goals(result):
        print(report.goal_line(g))
    if not compare_torch:
        print("PyTorch is not installed: no torch rows (pip install 'taifuse[compare]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
