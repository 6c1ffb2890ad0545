"""Issue 16's goals for attention and the GPT, measured with the ``taifuse.bench`` harness (the
``transformer`` suite; no measuring code of its own).

* Attention forward+backward, float32, B=8, H=8, L=S=512, E=64, causal: taifuse's fused
  ``F.scaled_dot_product_attention`` on Tensors (forward, then backward of a fixed gradient) at
  least 1.5x as fast as PyTorch CPU's (its own flash kernel on CPU), each timed in fresh processes
  of its own (NOTE [ Isolated baselines ] in taifuse.bench.harness). The forward alone and the
  naive attention in NumPy are printed beside it.
* Attention peak memory above the inputs at L=S=4096, one head (B=1, H=1, E=64, no mask), for a
  forward and for a forward and backward: the fused kernels' at most 1/8 of the naive
  softmax(QK^T)V's in NumPy, i.e. naive peak / fused peak >= 8 (each variant in fresh processes,
  peak RSS, as ``suites/memory.py`` measures; the naive attention in taifuse Tensor ops is printed
  beside it).
* One GPT training step (forward, cross entropy, backward, ``clip_grad_norm_``, AdamW) of
  ``examples/gpt.py``'s model at ``examples/train_gpt.py``'s default size and batch: at least as fast as
  the same model in PyTorch (fused AdamW), judged like the MLP step of ``bench_training.py``: "met"
  when the whole 95% interval of the speedup is at or above ``1 / (1 + 5%)``.

Each goal is judged on the 95% interval: "met" when all of it satisfies the goal, "not met" when
none of it does, "undecided" otherwise. Nothing here forces a pass. Run GEMM-bound benchmarks with
both OpenBLAS variables unset (docs/benchmarks.md, "BLAS"):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/bench_transformer.py [--quick] [--out DIR]

(needs torch for the speed goals: the ``compare`` extra; ``--backend`` picks the taifuse backend,
numba by default).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import taifuse
import taifuse.bench
from taifuse.bench import report, stats
from taifuse.bench.suites import load_cases, transformer

ATTENTION_GOAL = 1.5  # at least this many times PyTorch's speed
MEMORY_GOAL = 8.0  # the naive attention's peak over the fused one's, at least


def _missing(name: str, row: dict | None) -> dict:
    return {
        "goal": name,
        "status": "not met",
        "value": None,
        "low": None,
        "high": None,
        "detail": "no such row in this run" if row is None else row["verdict"],
    }


def _times(row: dict) -> str:
    if not (row.get("candidate_ms") and row.get("baseline_ms")):
        return ""
    return f"; taifuse {row['candidate_ms']['median']:.1f} ms, torch {row['baseline_ms']['median']:.1f} ms"


def goals(result: dict) -> list[dict]:
    """The attention speed, attention memory and GPT step goals, judged from a run's rows."""
    rows = {r["id"]: r for r in result["rows"]}
    out = []

    attention = transformer.attention_case(True, backward=True)
    name = f"attention forward+backward: taifuse >= {ATTENTION_GOAL}x torch"
    row = rows.get(f"{attention.id}/torch")
    if row is None or row["value"] is None:
        out.append(_missing(name, row))
    else:
        out.append(
            {
                "goal": name,
                "status": report.judge(row["low"], row["high"], at_least=ATTENTION_GOAL),
                "value": row["value"],
                "low": row["low"],
                "high": row["high"],
                "detail": f"speedup over torch; verdict: {row['verdict']}{_times(row)}",
            }
        )

    memory = transformer.attention_memory_case()
    for fused, naive in memory.pairs:
        if not naive.startswith("numpy"):
            continue  # the naive attention in taifuse Tensor ops is shown, not a goal
        name = (
            f"attention peak memory, {fused.removeprefix('taifuse fused ')}: naive / fused >= {MEMORY_GOAL:g}"
        )
        row = rows.get(f"{memory.id}/{fused} vs {naive}")
        if row is None or row["value"] is None:
            out.append(_missing(name, row))
            continue
        out.append(
            {
                "goal": name,
                "status": report.judge(row["low"], row["high"], at_least=MEMORY_GOAL),
                "value": row["value"],
                "low": row["low"],
                "high": row["high"],
                "detail": f"{naive} peak / {fused} peak, from peak RSS above the inputs",
            }
        )

    # The case's name carries the example's config as it was when the run was made: find it.
    name = "GPT training step: taifuse no slower than torch"
    prefix = f"{transformer.SUITE}/gpt step("
    gpt = [r for r in result["rows"] if r["id"].startswith(prefix)]
    row = next((r for r in gpt if r["id"].endswith("/torch")), None)
    row = row or next((r for r in gpt if r.get("kind") == "skipped"), None)
    if row is None or row["value"] is None:
        out.append(_missing(name, row))
    else:
        # The smallest slowdown the harness ever calls one (as bench_training.py's goal).
        floor = 1.0 / (1.0 + stats.MIN_EFFECT)
        out.append(
            {
                "goal": name,
                "status": report.judge(row["low"], row["high"], at_least=floor),
                "value": row["value"],
                "low": row["low"],
                "high": row["high"],
                "detail": f"speedup over torch, floor {floor:.2f}; verdict: {row['verdict']}{_times(row)}",
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
    cases = load_cases(["transformer"], quick=args.quick, compare_torch=compare_torch)
    plan = taifuse.bench.QUICK if args.quick else taifuse.bench.GOALS
    command = "python benchmarks/bench_transformer.py" + (" --quick" if args.quick else "")
    if args.backend != "numba":
        command += f" --backend {args.backend}"
    result = taifuse.bench.run(
        cases=cases, plan=plan, quick=args.quick, compare_torch=compare_torch, out=args.out, command=command
    )
    print(report.summary(result))
    print(f"\n{report.run_line(result)}\n")
    for r in result["rows"]:
        if r["kind"] == "memory" and r.get("suite") == transformer.SUITE and r.get("note"):
            print(f"{r['label']}: {r['note']}")
    print()
    for g in goals(result):
        print(report.goal_line(g))
    if not compare_torch:
        print("PyTorch is not installed: no torch rows (pip install 'taifuse[compare]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
