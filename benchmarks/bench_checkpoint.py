"""Issue 5's goals for gradient checkpointing, measured with the ``taifuse.bench`` harness (the
``memory`` suite; no measuring code of its own).

One forward + backward of a 32-layer, width-1024 GELU MLP at batch 512, f32, plain against
``checkpoint_sequential`` at round(sqrt(32)) = 6 segments, with PyTorch's
``torch.utils.checkpoint.checkpoint_sequential`` (``use_reentrant=False``) on the same weights:

* peak activation memory (the peak during the step above what the process held before it, with
  weights and gradients allocated and the buffer pool emptied; each variant in fresh processes,
  peak RSS and tracemalloc) at least 70% below the plain run's, i.e. plain / checkpointed >= 3.33;
* step time at most 1.4x the plain run's, i.e. a "speedup" (plain time / checkpointed time) of
  at least 1/1.4 (ABBA pairs in fresh processes; skipped with ``--memory-only``).

Each goal is judged on the 95% interval: "met" when the whole interval satisfies it, "not met"
when none of it does, "undecided" otherwise. PyTorch's rows are printed beside ours.

Run: ``python benchmarks/bench_checkpoint.py [--memory-only] [--processes N] [--blocks N] [--out DIR]``
(PyTorch rows need torch: the ``compare`` extra).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import taifuse.bench
from taifuse.bench import report
from taifuse.bench.suites import memory

MEMORY_GOAL = 0.70  # at least this fraction lower
TIME_GOAL = 1.4  # at most this many times the plain step


def goals(result: dict) -> list[dict]:
    """The memory and time goals, judged from the rows of a run of the memory suite."""
    rows = {r["id"]: r for r in result["rows"]}
    mem_case, time_case = memory.memory_case(False), memory.time_case(False)
    out = []
    mem = rows.get(f"{mem_case.id}/{memory.CHECKPOINTED.label} vs {memory.PLAIN.label}")
    if mem is not None and mem["value"] is not None:
        red = mem["reduction"]
        out.append(
            {
                "goal": f"peak activation memory >= {MEMORY_GOAL:.0%} lower than plain",
                "value": red["median"],
                "low": red["low"],
                "high": red["high"],
                "status": report.judge(red["low"], red["high"], at_least=MEMORY_GOAL),
                "detail": f"plain / checkpointed peak = {mem['value']:.3g} [{mem['low']:.3g}, {mem['high']:.3g}]",
            }
        )
    step = rows.get(f"{time_case.id}/{memory.PLAIN.label}")
    if step is not None and step["value"] is not None:
        # The row's value is plain time / checkpointed time; the goal is on its inverse.
        ratio, low, high = 1 / step["value"], 1 / step["high"], 1 / step["low"]
        out.append(
            {
                "goal": f"step time <= {TIME_GOAL}x plain",
                "value": ratio,
                "low": low,
                "high": high,
                "status": report.judge(low, high, at_most=TIME_GOAL),
                "detail": f"checkpointed time / plain time; verdict of the row: {step['verdict']}",
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-only", action="store_true", help="only the memory rows (no step timing)")
    parser.add_argument("--processes", type=int, default=3, help="fresh processes per variant (default 3)")
    parser.add_argument("--blocks", type=int, default=6, help="ABBA blocks per process for the step time")
    parser.add_argument("--out", help="also write BENCHMARKS.md and results.json here")
    args = parser.parse_args(argv)
    if args.processes < 2 or args.blocks < 2:
        parser.error("--processes and --blocks should be at least 2 (the intervals resample them)")

    compare_torch = importlib.util.find_spec("torch") is not None
    cases = memory.cases(quick=args.memory_only, compare_torch=compare_torch)
    plan = taifuse.bench.Plan(processes=args.processes, blocks=args.blocks, roofline_samples=6)
    result = taifuse.bench.run(
        cases=cases,
        plan=plan,
        compare_torch=compare_torch,
        out=args.out,
        command="python benchmarks/bench_checkpoint.py " + " ".join(sys.argv[1:] if argv is None else argv),
    )
    print(report.summary(result))
    print(f"\n{report.run_line(result)}\n")
    for r in result["rows"]:
        if r["kind"] == "memory" and r.get("note"):
            print(f"{r['label']}: {r['note']}")
    print()
    for g in goals(result):
        print(report.goal_line(g))
    if not compare_torch:
        print("PyTorch is not installed: no torch rows (pip install 'taifuse[compare]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
