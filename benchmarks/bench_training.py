"""Issue 3's training-step goal, measured with the ``taifuse.bench`` harness (no timing code of its own).

One step (forward, cross-entropy loss, backward) of a 784-1024-1024-10 GELU MLP at batch 256 in
float32: taifuse on the Numba backend against PyTorch CPU eager, with the same weights, data and
thread counts. Each side is timed in fresh processes of its own, alternating: in one process
PyTorch's OpenMP pool and NumPy's OpenBLAS threads slow each other and PyTorch's step doubles
(NOTE [ Isolated baselines ] in taifuse.bench.harness). The loss and every gradient are checked
``allclose`` against PyTorch's before anything is timed.

Goal: taifuse no slower than PyTorch, judged on the 95% interval of the speedup (PyTorch's time
over taifuse's): "met" when the whole interval is at or above ``1 / (1 + 5%)``, the harness's
smallest difference it ever calls a slowdown (``taifuse.bench.stats.MIN_EFFECT``), "not met"
when all of it is below, "undecided" otherwise. The row's own verdict may use a wider threshold
(the spread of the isolated A/A control, when that is larger); the goal does not: a noisy
control makes the verdict say "no measurable difference", but it must not turn a step that is
10% slower into a met goal. Nothing here forces a pass.

Beside the goal, the suite's row that is not the same function: the step's eight matrix products
alone, on the same shapes and data in NumPy (OpenBLAS), timed like PyTorch in processes of their
own. It shows how much of each step is BLAS, and how PyTorch's whole step compares with our
products alone.

Run: ``python benchmarks/bench_training.py [--quick] [--out DIR] [--backend numba]`` (needs torch:
the ``compare`` extra).
"""

from __future__ import annotations

import argparse
import sys

import taifuse
import taifuse.bench
from taifuse.bench import report, stats
from taifuse.bench.suites import load_cases

STEP_CASE = "training/mlp_step(784-1024-1024-10, gelu, batch=256)"


def goal(result: dict) -> dict:
    """The "no slower than PyTorch" goal, judged from the torch row of a run."""
    rows = {r["id"]: r for r in result["rows"]}
    row = rows.get(f"{STEP_CASE}/torch")
    name = "training step: taifuse no slower than torch"
    if row is None or row["value"] is None:
        return {
            "goal": name,
            "status": "not met",
            "value": None,
            "low": None,
            "high": None,
            "detail": "no torch row in this run" if row is None else row["verdict"],
        }
    # The smallest slowdown the harness ever calls one, whatever the row's (possibly wider) threshold.
    floor = 1.0 / (1.0 + stats.MIN_EFFECT)
    status = report.judge(row["low"], row["high"], at_least=floor)
    times = ""
    if row.get("candidate_ms") and row.get("baseline_ms"):
        times = f"; taifuse {row['candidate_ms']['median']:.1f} ms, torch {row['baseline_ms']['median']:.1f} ms per step"
    products = rows.get(f"{STEP_CASE}/products alone")
    if times and products and products.get("baseline_ms"):
        times += f", NumPy's 8 products alone {products['baseline_ms']['median']:.1f} ms"
    return {
        "goal": name,
        "status": status,
        "value": row["value"],
        "low": row["low"],
        "high": row["high"],
        "detail": f"speedup over torch, floor {floor:.2f}; verdict: {row['verdict']}{times}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer processes and samples")
    parser.add_argument("--out", help="also write BENCHMARKS.md and results.json here")
    parser.add_argument("--backend", default="numba", help="taifuse backend to measure (default: numba)")
    args = parser.parse_args(argv)

    taifuse.set_backend(args.backend)
    cases = [c for c in load_cases(["training"], quick=args.quick, compare_torch=True) if c.id == STEP_CASE]
    plan = taifuse.bench.QUICK if args.quick else taifuse.bench.GOALS
    command = "python benchmarks/bench_training.py" + (" --quick" if args.quick else "")
    if args.backend != "numba":
        command += f" --backend {args.backend}"
    result = taifuse.bench.run(cases=cases, plan=plan, compare_torch=True, out=args.out, command=command)
    print(report.summary(result))
    print(f"\n{report.run_line(result)}\n")
    print(report.goal_line(goal(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
