"""Issue 4's performance goals, measured with the ``taifuse.bench`` harness (no timing code of its own).

One optimizer step on 10 parameters of 1000x512 float32 (5.12M values) with gradients set, per
optimizer, side by side with PyTorch CPU's ``fused=True`` variant, and the same on 200 parameters
of 64x64 (per-parameter overhead). Goals, each judged on the 95% interval of a ratio measured in
the same run ("met" when the whole interval satisfies it, "not met" when none of it does,
"undecided" otherwise; nothing here forces a pass):

* AdamW and Lion at least as fast as PyTorch's fused AdamW;
* AdamW and Lion at least 75% of the copy bandwidth measured in the same run (from the bytes a
  step must move: parameters, gradients and state read, parameters and state written).

Both are reported for the default step (``check_finite=False``, as torch.optim) and, as their own
rows, for the optional checked step (``check_finite=True``: one more read of every gradient).

Run: ``python benchmarks/bench_optim.py [--quick] [--out DIR]`` (needs torch: the ``compare`` extra).
"""

from __future__ import annotations

import argparse
import sys

import taifuse.bench
from taifuse.bench import report
from taifuse.bench.suites import load_cases

LARGE = "10x(1000, 512)"
SMALL = "200x(64, 64)"


def goals(result: dict) -> list[dict]:
    """The speed and bandwidth goals of AdamW and Lion, judged from a run's rows."""
    rows = {r["id"]: r for r in result["rows"]}
    out = []
    for name, yardstick in (("AdamW", "torch fused"), ("Lion", "torch fused AdamW")):
        case = f"optim/{name} step, {LARGE}"
        row = rows.get(f"{case}/{yardstick}")
        if row is None or row["value"] is None:
            out.append(
                {
                    "goal": f"{name}: >= torch fused AdamW",
                    "status": "not met",
                    "value": None,
                    "low": None,
                    "high": None,
                    "detail": "no measurement (is torch installed?)",
                }
            )
            continue
        out.append(
            {
                "goal": f"{name}: speed >= torch fused AdamW",
                "value": row["value"],
                "low": row["low"],
                "high": row["high"],
                "status": report.judge(row["low"], row["high"], at_least=1.0),
                "detail": f"speedup, verdict: {row['verdict']}",
            }
        )
        for label, variant_row in (
            ("default", row),
            ("finite check", rows.get(f"{case}/taifuse, finite check")),
        ):
            if variant_row is None:
                continue
            # The candidate of the "finite check" row is still the default step; its baseline is
            # the checked step, so take the baseline's roofline there. Each is traffic against the
            # copy ceiling of the step's cache level (roofline.py).
            r = variant_row.get("roofline") if label == "default" else variant_row.get("baseline_roofline")
            if not r:
                continue
            out.append(
                {
                    "goal": f"{name} ({label}): >= 75% of copy bandwidth",
                    "value": r["fraction"],
                    "low": r["low"],
                    "high": r["high"],
                    "status": report.judge(r["low"], r["high"], at_least=0.75),
                    "detail": f"{r['achieved']:.3g} GB/s of traffic against the {r['of']} ({r['ceiling']})",
                }
            )
    for name in ("AdamW", "Lion"):
        case = f"optim/{name} step, {SMALL}"
        row = rows.get(f"{case}/torch fused") or rows.get(f"{case}/torch fused AdamW")
        if row is not None and row["value"] is not None:
            out.append(
                {
                    "goal": f"{name}, {SMALL}: speedup over torch fused (AdamW) (reported, no target)",
                    "value": row["value"],
                    "low": row["low"],
                    "high": row["high"],
                    "status": "report",
                    "detail": f"taifuse {row['candidate_ms']['median']:.3g} ms per step, verdict: {row['verdict']}",
                }
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer processes and samples, fewer small-model cases"
    )
    parser.add_argument("--out", help="also write BENCHMARKS.md and results.json here")
    args = parser.parse_args(argv)

    cases = load_cases(["optim"], quick=args.quick, compare_torch=True)
    plan = taifuse.bench.QUICK if args.quick else taifuse.bench.GOALS
    result = taifuse.bench.run(
        cases=cases,
        plan=plan,
        quick=args.quick,
        compare_torch=True,
        out=args.out,
        command="python benchmarks/bench_optim.py" + (" --quick" if args.quick else ""),
    )
    print(report.summary(result))
    print(f"\n{report.run_line(result)}\n")
    for g in goals(result):
        print(report.goal_line(g))
    return 0


if __name__ == "__main__":
    sys.exit(main())
