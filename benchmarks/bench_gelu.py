"""Issue 14's goals, measured with the ``taifuse.bench`` harness (no timing code of its own).

f32, each row a ratio measured side by side, PyTorch timed in processes of its own:

* exact GELU (``approximate='none'``) over 4M elements at least as fast as PyTorch CPU's
  ``torch.nn.functional.gelu``;
* ``linear(x, w, b, activation='gelu')`` at 4096x1024 by 768x1024 at most 1.10x the time of the
  bare ``np.matmul(x, w.T, out=out)``, and faster than PyTorch's ``gelu(linear(x))``;
* beside them, not a goal: the fused linear backward (exact GELU) against its two bare products
  and against what PyTorch's autograd runs for it.

Each goal is judged on the 95% interval: "met" when the whole interval satisfies it, "not met" when
none of it does, "undecided" otherwise. Nothing here forces a pass. The linear rows are GEMM-bound:
run them with the machine's OpenBLAS settings of a user (this repository's machines set
``OPENBLAS_CORETYPE`` and ``OPENBLAS_L2_SIZE``, which force a slower kernel; unset both for the
command only: ``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/bench_gelu.py``).
The run line names the BLAS kernel that ran.

Run: ``python benchmarks/bench_gelu.py [--quick] [--out DIR]`` (needs torch: the ``compare`` extra).
"""

from __future__ import annotations

import argparse
import sys

import taifuse.bench
from taifuse.bench import report
from taifuse.bench.suites import load_cases, pick

GELU_CASE = "elementwise/gelu(approximate='none')"
LINEAR_CASE = "linear/linear(activation='gelu')"
BACKWARD_CASE = "linear/linear backward(activation='gelu')"



def _ms(row: dict) -> str:
    parts = []
    if row.get("candidate_ms"):
        parts.append(f"taifuse {row['candidate_ms']['median']:.3g} ms")
    if row.get("baseline_ms"):
        parts.append(f"{row['label'].split(' vs ')[-1]} {row['baseline_ms']['median']:.3g} ms")
    return "; " + ", ".join(parts) if parts else ""


def _faster(name: str, row: dict, *, strictly: bool) -> dict:
    """A "faster than" goal from a speedup row (its verdict when strictly, else its interval >= 1)."""
    if row["value"] is None:
        return {
            "goal": name,
            "value": None,
            "low": None,
            "high": None,
            "status": "not met",
            "detail": row["verdict"],
        }
    if strictly:
        verdict = row["verdict"]
        status = (
            "met"
            if verdict == "faster"
            else "not met"
            if verdict in ("slower", "no measurable difference")
            else "undecided"
        )
    else:
        status = report.judge(row["low"], row["high"], at_least=1.0)
    return {
        "goal": name,
        "value": row["value"],
        "low": row["low"],
        "high": row["high"],
        "status": status,
        "detail": f"speedup; verdict: {row['verdict']}{_ms(row)}",
    }


def goals(result: dict) -> list[dict]:
    """Issue 14's three goals and the backward's two rows (status "measured"), from a run's rows."""
    rows = {r["id"]: r for r in result["rows"]}
    out = [_faster("gelu(none): at least as fast as torch", rows[f"{GELU_CASE}/torch"], strictly=False)]
    bare = rows[f"{LINEAR_CASE}/bare matmul"]
    if bare["value"] is not None:
        ratio, low, high = 1 / bare["value"], 1 / bare["high"], 1 / bare["low"]
        out.append(
            {
                "goal": "linear+gelu: <= 1.10x the bare matmul's time",
                "value": ratio,
                "low": low,
                "high": high,
                "status": report.judge(low, high, at_most=1.10),
                "detail": "time ratio = 1 / speedup" + _ms(bare),
            }
        )
    else:
        out.append(
            {
                "goal": "linear+gelu: <= 1.10x the bare matmul's time",
                "value": None,
                "low": None,
                "high": None,
                "status": "not met",
                "detail": bare["verdict"],
            }
        )
    out.append(
        _faster("linear+gelu: faster than torch gelu(linear(x))", rows[f"{LINEAR_CASE}/torch"], strictly=True)
    )
    for label, name in (("bare products", "its two bare products"), ("torch", "torch's autograd ops")):
        row = rows[f"{BACKWARD_CASE}/{label}"]
        measured = _faster(f"linear backward (gelu) against {name}", row, strictly=False)
        measured["status"] = "measured"
        out.append(measured)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer processes and samples")
    parser.add_argument("--out", help="also write BENCHMARKS.md and results.json here")
    args = parser.parse_args(argv)

    cases = load_cases(["elementwise", "linear"], quick=True, compare_torch=True)
    chosen = [
        pick(cases, GELU_CASE, {"torch"}),
        pick(cases, LINEAR_CASE, {"bare matmul", "torch"}),
        pick(cases, BACKWARD_CASE, {"bare products", "torch"}),
    ]
    plan = taifuse.bench.QUICK if args.quick else taifuse.bench.GOALS
    result = taifuse.bench.run(
        cases=chosen,
        plan=plan,
        compare_torch=True,
        out=args.out,
        command="python benchmarks/bench_gelu.py" + (" --quick" if args.quick else ""),
    )
    print(report.summary(result))
    print(f"\n{report.run_line(result)}; BLAS kernel {result['environment'].get('blas_kernel')}\n")
    for g in goals(result):
        print(report.goal_line(g))
    return 0


if __name__ == "__main__":
    sys.exit(main())
