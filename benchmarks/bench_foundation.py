"""Issue 2's performance goals, measured with the ``taifuse.bench`` harness (no timing code of its own).

f32, 4M elements and a 4096x1024 by 1024x768 linear, each row a ratio measured side by side:

* GELU (tanh) on the active backend at least 5x faster than PyTorch CPU's, and at least 60% of the
  copy bandwidth measured in the same run;
* ``linear(x, w, b, activation='gelu')`` at most 1.10x the time of the bare ``np.matmul(x, w.T,
  out=out)``, and faster than PyTorch's ``gelu(linear(x))``.

Each goal is judged on the 95% interval: "met" when the whole interval satisfies it, "not met" when
none of it does, "undecided" otherwise. Nothing here forces a pass.

Beside the goals, the linear suite's row that is not the same function: PyTorch's bare product
``torch.mm(x, w.T)`` (MKL), timed in processes of its own like PyTorch's ``gelu(linear(x))``.
With the bare NumPy product's row it separates the two products from the epilogues.

Run: ``python benchmarks/bench_foundation.py [--quick] [--out DIR]`` (needs torch: the ``compare`` extra).
"""

from __future__ import annotations

import argparse
import sys

import taifuse.bench
from taifuse.bench import report
from taifuse.bench.suites import load_cases, pick

GELU_CASE = "elementwise/gelu(approximate='tanh')"
LINEAR_CASE = "linear/linear(activation='gelu')"



def _linear_times(lin_mm: dict, lin_torch: dict, lin_torch_mm: dict | None) -> str:
    """Medians of the linear case's rows: ours, the two bare products and PyTorch's gelu(linear)."""
    if not lin_torch.get("candidate_ms"):
        return ""
    parts = [f"taifuse {lin_torch['candidate_ms']['median']:.1f} ms"]
    if lin_mm.get("baseline_ms"):
        parts.append(f"np.matmul {lin_mm['baseline_ms']['median']:.1f} ms")
    if lin_torch_mm and lin_torch_mm.get("baseline_ms"):
        parts.append(f"torch.mm {lin_torch_mm['baseline_ms']['median']:.1f} ms")
    if lin_torch.get("baseline_ms"):
        parts.append(f"torch gelu(linear) {lin_torch['baseline_ms']['median']:.1f} ms")
    return "; " + ", ".join(parts)


def goals(result: dict) -> list[dict]:
    """Issue 2's four goals, judged from the rows of a run over the two cases."""
    rows = {r["id"]: r for r in result["rows"]}
    gelu_torch = rows[f"{GELU_CASE}/torch"]
    gelu_copy = rows[f"{GELU_CASE}/copy bound"]
    lin_mm = rows[f"{LINEAR_CASE}/bare matmul"]
    lin_torch = rows[f"{LINEAR_CASE}/torch"]
    lin_torch_mm = rows.get(f"{LINEAR_CASE}/torch bare matmul")
    out = []

    def add(name, value, low, high, verdict, detail):
        out.append(
            {"goal": name, "value": value, "low": low, "high": high, "status": verdict, "detail": detail}
        )

    if gelu_torch["value"] is not None:
        add(
            "gelu(tanh): speedup over torch >= 5x",
            gelu_torch["value"],
            gelu_torch["low"],
            gelu_torch["high"],
            report.judge(gelu_torch["low"], gelu_torch["high"], at_least=5.0),
            f"verdict: {gelu_torch['verdict']}",
        )
    else:
        add("gelu(tanh): speedup over torch >= 5x", None, None, None, "not met", gelu_torch["verdict"])
    if gelu_torch.get("roofline"):
        # The row's own roofline: traffic against the copy ceiling of its cache level (roofline.py).
        r = gelu_torch["roofline"]
        add(
            "gelu(tanh): >= 60% of copy bandwidth",
            r["fraction"],
            r["low"],
            r["high"],
            report.judge(r["low"], r["high"], at_least=0.60),
            f"{r['achieved']:.3g} GB/s of traffic against the {r['of']} ({r['ceiling']}); against the "
            f"same copy at the same size: {gelu_copy['value']:.2f} [{gelu_copy['low']:.2f}, "
            f"{gelu_copy['high']:.2f}] of its rate",
        )
    if lin_mm["value"] is not None:
        ratio, low, high = 1 / lin_mm["value"], 1 / lin_mm["high"], 1 / lin_mm["low"]
        add(
            "linear+gelu: <= 1.10x the bare matmul's time",
            ratio,
            low,
            high,
            report.judge(low, high, at_most=1.10),
            "time ratio = 1 / speedup",
        )
    if lin_torch["value"] is not None:
        add(
            "linear+gelu: faster than torch gelu(linear(x))",
            lin_torch["value"],
            lin_torch["low"],
            lin_torch["high"],
            "met"
            if lin_torch["verdict"] == "faster"
            else "not met"
            if lin_torch["verdict"] in ("slower", "no measurable difference")
            else "undecided",
            f"verdict: {lin_torch['verdict']}" + _linear_times(lin_mm, lin_torch, lin_torch_mm),
        )
    else:
        add(
            "linear+gelu: faster than torch gelu(linear(x))",
            None,
            None,
            None,
            "not met",
            lin_torch["verdict"],
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer processes and samples")
    parser.add_argument("--out", help="also write BENCHMARKS.md and results.json here")
    args = parser.parse_args(argv)

    cases = load_cases(["elementwise", "linear"], quick=True, compare_torch=True)
    chosen = [
        pick(cases, GELU_CASE, {"torch", "copy bound"}),
        pick(cases, LINEAR_CASE, {"bare matmul", "torch", "torch bare matmul"}),
    ]
    plan = taifuse.bench.QUICK if args.quick else taifuse.bench.GOALS
    result = taifuse.bench.run(
        cases=chosen,
        plan=plan,
        compare_torch=True,
        out=args.out,
        command="python benchmarks/bench_foundation.py" + (" --quick" if args.quick else ""),
    )
    print(report.summary(result))
    print(f"\n{report.run_line(result)}\n")
    for g in goals(result):
        print(report.goal_line(g))
    return 0


if __name__ == "__main__":
    sys.exit(main())
