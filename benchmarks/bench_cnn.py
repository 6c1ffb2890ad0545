"""Issue 28's goals for convolutional networks, measured with the ``taifuse.bench`` harness (the
``cnn`` suite; no measuring code of its own).

* conv2d forward+backward at the CIFAR-like shapes (N=64, 3->32 and 32->64 channels, 32x32, 3x3,
  padding 1): at least 0.8x PyTorch CPU's speed.
* The folded evaluation block (``nn.utils.fuse_conv_bn_eval``, the ReLU fused): at least 1.2x
  PyTorch's unfused Conv2d -> BatchNorm2d -> ReLU in eval.
* One training step (forward, cross entropy, backward, AdamW) of examples/train_cnn.py's CNN at a
  CIFAR-like input: at least as fast as the same model in PyTorch CPU ("met" when the whole 95%
  interval of the speedup is at or above ``1 / (1 + 5%)``, as bench_training.py's goal). The same
  step under ``taifuse.compile`` is judged beside it on its own line (the goal is the eager step's).
* The training-mode Conv-BN-ReLU block reads and writes the activation fewer times than the
  unfused one: the bytes ``taifuse._costs`` counts for both (the profiler's "MB moved" column),
  printed beside the block's timed rows against taifuse's unfused modules and PyTorch's.

Each timed goal is judged on the 95% interval: "met" when all of it satisfies the goal, "not met"
when none of it does, "undecided" otherwise. Nothing here forces a pass. Run with both OpenBLAS
variables unset (docs/benchmarks.md, "BLAS") on a quiet machine:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/bench_cnn.py [--quick] [--out DIR]

``--batch N --size S`` shrinks the inputs for a smoke run (its rows are not the goals' sizes and
are judged as such: every goal reads "not met" with the reason). Needs torch for the speed goals
(the ``compare`` extra); ``--backend`` picks the taifuse backend, numba by default.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import taifuse
import taifuse.bench
from taifuse import _costs
from taifuse.bench import report, stats
from taifuse.bench.suites import cnn, load_cases

CONV_GOAL = 0.8  # at least this fraction of PyTorch's speed
EVAL_GOAL = 1.2  # the folded block, at least this many times PyTorch's unfused three modules


def _row(rows: dict, case_prefix: str, label: str) -> dict | None:
    """The row of the case whose id starts with ``case_prefix``, against ``label``."""
    return next(
        (r for r in rows.values() if r["id"].startswith(case_prefix) and r["id"].endswith(f"/{label}")), None
    )


def _goal(name: str, row: dict | None, at_least: float, what: str, smoke: str = "") -> dict:
    if smoke or row is None or row["value"] is None:
        detail = smoke or ("no such row in this run" if row is None else row["verdict"])
        return {"goal": name, "status": "not met", "value": None, "low": None, "high": None, "detail": detail}
    times = ""
    if row.get("candidate_ms") and row.get("baseline_ms"):
        times = (
            f"; taifuse {row['candidate_ms']['median']:.1f} ms, torch {row['baseline_ms']['median']:.1f} ms"
        )
    return {
        "goal": name,
        "status": report.judge(row["low"], row["high"], at_least=at_least),
        "value": row["value"],
        "low": row["low"],
        "high": row["high"],
        "detail": f"{what}; verdict: {row['verdict']}{times}",
    }


def goals(result: dict, n: int = cnn.BATCH, size: int = cnn.SIZE) -> list[dict]:
    """The conv2d, folded block and CNN step goals, judged from a run's rows (at ``n``, ``size``)."""
    rows = {r["id"]: r for r in result["rows"]}
    smoke = ""
    if (n, size) != (cnn.BATCH, cnn.SIZE):
        smoke = f"a smoke run at batch {n}, size {size}: judged at batch {cnn.BATCH}, size {cnn.SIZE} only"
    out = []
    for cin, cout in cnn.LAYERS:
        name = f"conv2d fwd+bwd {cin}->{cout}: taifuse >= {CONV_GOAL}x torch"
        row = _row(rows, f"{cnn.SUITE}/conv2d fwd+bwd({n}, {cin}->{cout},", "torch")
        out.append(_goal(name, row, CONV_GOAL, "speedup over torch", smoke))
    name = f"folded eval Conv-BN-ReLU: taifuse >= {EVAL_GOAL}x torch's unfused modules"
    row = _row(rows, f"{cnn.SUITE}/conv-bn-relu eval folded({n},", "torch")
    out.append(_goal(name, row, EVAL_GOAL, "speedup over torch", smoke))
    floor = 1.0 / (1.0 + stats.MIN_EFFECT)
    name = "CNN training step: taifuse no slower than torch"
    row = _row(rows, f"{cnn.SUITE}/cnn step(", "torch")
    out.append(_goal(name, row, floor, f"speedup over torch, floor {floor:.2f}", smoke))
    if cnn.has_compile():  # the same step under taifuse.compile, beside the goal (which is eager's)
        name = "CNN training step under taifuse.compile: no slower than torch"
        row = _row(rows, f"{cnn.SUITE}/cnn step compiled(", "torch")
        out.append(_goal(name, row, floor, f"speedup over torch, floor {floor:.2f}", smoke))
    return out


def block_bytes(n: int = cnn.BATCH, size: int = cnn.SIZE) -> str:
    """The training block's bytes moved (forward + backward) fused and unfused, from ``_costs``."""
    cin, cout = cnn.LAYERS[1]
    shape = _costs.ConvShape(n, cin, size, size, cout, cin * 9, size * size)
    act = n * cout * size * size * 4
    fused = sum(_costs.conv2d_batch_norm(shape, backward=b).bytes_moved for b in (False, True))
    ops = sum(_costs.conv2d(shape, bias=False, backward=b).bytes_moved for b in (False, True))
    ops += sum(_costs.batch_norm(act // 4, cout, backward=b).bytes_moved for b in (False, True))
    ops += _costs.elementwise(act, act).bytes_moved + _costs.elementwise(2 * act, act).bytes_moved  # ReLU
    return (
        f"Conv-BN-ReLU training block ({n}, {cin}->{cout}, {size}x{size}), forward + backward, bytes moved "
        f"(taifuse._costs): fused {fused / 1e6:.1f} MB, unfused Conv2d/BatchNorm2d/ReLU {ops / 1e6:.1f} MB "
        f"({ops / fused:.2f}x; the activation is {act / 1e6:.1f} MB)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer processes and samples")
    parser.add_argument("--out", help="also write BENCHMARKS.md and results.json here")
    parser.add_argument("--backend", default="numba", help="taifuse backend to measure (default: numba)")
    parser.add_argument("--batch", type=int, default=cnn.BATCH, help="images per batch (smoke runs only)")
    parser.add_argument("--size", type=int, default=cnn.SIZE, help="image height and width (smoke runs only)")
    args = parser.parse_args(argv)

    os.environ[cnn.SHAPE_ENV] = f"{args.batch},{args.size}"  # the workers rebuild the cases from it
    cnn.batch_and_size()  # a bad --batch/--size fails here, before anything runs
    taifuse.set_backend(args.backend)
    compare_torch = importlib.util.find_spec("torch") is not None
    cases = load_cases([cnn.SUITE], quick=args.quick, compare_torch=compare_torch)
    plan = taifuse.bench.QUICK if args.quick else taifuse.bench.GOALS
    command = "python benchmarks/bench_cnn.py" + (" --quick" if args.quick else "")
    for flag, value, default in (("--backend", args.backend, "numba"), ("--batch", args.batch, cnn.BATCH),
                                 ("--size", args.size, cnn.SIZE)):  # fmt: skip
        if value != default:
            command += f" {flag} {value}"
    result = taifuse.bench.run(
        cases=cases, plan=plan, quick=args.quick, compare_torch=compare_torch, out=args.out, command=command
    )
    print(report.summary(result))
    print(f"\n{report.run_line(result)}\n")
    print(block_bytes(args.batch, args.size))
    print()
    for g in goals(result, args.batch, args.size):
        print(report.goal_line(g))
    if not compare_torch:
        print("PyTorch is not installed: no torch rows (pip install 'taifuse[compare]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
