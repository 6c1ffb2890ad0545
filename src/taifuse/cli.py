"""The ``taifuse`` command: ``taifuse info``, ``taifuse bench`` and ``taifuse profile``."""

from __future__ import annotations

import argparse
import os
import platform
import sys


def _info(args: argparse.Namespace) -> int:
    import numpy as np

    import taifuse
    from taifuse import backends

    print(f"taifuse {taifuse.__version__}")
    print(f"python {platform.python_version()} on {platform.system()} {platform.machine()} ({os.cpu_count()} CPUs)")
    print(f"numpy {np.__version__}")
    versions = backends.versions()  # every backend's, not only the active one's: nothing is started
    print(f"backends installed: {', '.join(f'{name} {version}' for name, version in versions.items())}")
    print(f"TAIFUSE_BACKEND={os.environ.get('TAIFUSE_BACKEND', '(unset: auto)')}")
    arch = os.environ.get("TAIFUSE_TAICHI_ARCH")
    if arch is None:  # the arch Taichi would start on, asked of the drivers (Taichi is not started)
        arch = f"(unset: the best arch here, {backends.best_taichi_arch()})" if "taichi" in versions else "(unset)"
    print(f"TAIFUSE_TAICHI_ARCH={arch}")
    try:
        active = backends.active()
    except ValueError as exc:
        # A bad TAIFUSE_BACKEND / TAIFUSE_TAICHI_ARCH: the lines above still help to diagnose it,
        # then one line (naming the variable and its value) instead of a traceback.
        print(f"taifuse info: error: {exc}", file=sys.stderr)
        return 2
    print(f"active backend: {backends.get_backend()}")
    for key, value in active.describe().items():
        print(f"  {key}: {value}")
    return 0


def _add_bench_parser(sub) -> None:
    from taifuse.bench.suites import suite_names

    bench = sub.add_parser(
        "bench",
        help="measure the benchmark suites and write BENCHMARKS.md and results.json",
        description="Measure taifuse against the strongest NumPy (and PyTorch) baselines, with 95% intervals.",
    )
    bench.add_argument("--suite", action="append", choices=suite_names(), metavar="NAME",
                       help=f"run only this suite (repeatable); one of {', '.join(suite_names())}")
    bench.add_argument("--case", action="append", metavar="PATTERN",
                       help="run only the cases whose id (as in results.json, e.g. 'elementwise/silu', "
                            "'cnn/*') matches this shell-style pattern (repeatable)")
    bench.add_argument("--quick", action="store_true", help="fewer processes and samples (same sizes), for CI")
    bench.add_argument("--out", default="bench-results", help="output directory (default: bench-results)")
    bench.add_argument("--baseline", metavar="FILE",
                       help="an earlier results.json to compare with; exits 1 on a regression, 2 if FILE is "
                            "missing or not a taifuse bench result (checked before measuring)")
    bench.add_argument("--compare-torch", action="store_true", help="add PyTorch baselines (needs torch)")
    bench.add_argument("--torch-device", metavar="DEVICE",
                       help="PyTorch's device (cpu, cuda, mps) with --compare-torch: times the device-resident "
                            "cases of elementwise, linear, optim and transformer, both sides synchronised")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument("--processes", type=int, metavar="N",
                       help="fresh processes per case (at least 2; default 3 with --quick, else 5)")
    bench.add_argument("--blocks", type=int, metavar="N",
                       help="ABBA blocks per process and comparison (default 8 with --quick, else 25)")


def _bench(args: argparse.Namespace, argv: list[str]) -> int:
    import dataclasses

    import taifuse.bench
    from taifuse.bench import report

    plan = taifuse.bench.QUICK if args.quick else taifuse.bench.FULL
    if args.processes is not None:
        if args.processes < 2:
            print("taifuse bench: --processes should be at least 2 (the interval resamples processes)",
                  file=sys.stderr)
            return 2
        plan = dataclasses.replace(plan, processes=args.processes)
    if args.blocks is not None:
        if args.blocks < 2:
            print("taifuse bench: --blocks should be at least 2", file=sys.stderr)
            return 2
        plan = dataclasses.replace(plan, blocks=args.blocks)
    try:
        result = taifuse.bench.run(
            args.suite, quick=args.quick, out=args.out, baseline=args.baseline, compare_torch=args.compare_torch,
            torch_device=args.torch_device, progress=not args.no_progress, command=" ".join(["taifuse", *argv]), plan=plan,
            case_patterns=args.case,
        )
    except taifuse.bench.BenchArgumentError as e:  # raised before anything is measured
        print(f"taifuse bench: error: {e}", file=sys.stderr)
        return 2
    print(report.summary(result))
    for path in result.get("files", []):
        print(f"wrote {path}")
    cmp = result.get("baseline")
    if cmp is not None:
        if cmp["status"] == "not comparable":
            print("baseline: not comparable (environment fingerprint differs: " + "; ".join(cmp["differences"]) + ")")
            return 0
        print(
            f"baseline: {cmp['regressions']} regression(s) in {cmp['compared_rows']} compared row(s), "
            f"{cmp['inconclusive']} inconclusive (run-to-run spread {cmp['run_to_run']:.0%}, "
            f"minimum effect {cmp['threshold']:.0%})"
        )
        # Only a regression fails: an inconclusive row is noise these two runs cannot resolve.
        return 1 if cmp["regressions"] else 0
    return 0


def _add_profile_parser(sub) -> None:
    prof = sub.add_parser(
        "profile",
        help="run a Python script under taifuse.profiler and print its op table (like python -m cProfile)",
        description="Run SCRIPT as __main__ (with ARGS as its sys.argv[1:]) under taifuse.profiler.profile, "
        "then print the table of its ops and optionally write a Chrome trace. Options go before SCRIPT. "
        "With --wait/--warmup/--active only some steps are recorded (torch.profiler.schedule): a step "
        "ends at each optimizer step() the script makes.",
    )
    prof.add_argument("--trace", metavar="PATH", help="write Trace Event JSON (Perfetto, chrome://tracing)")
    prof.add_argument("--sort", default="self_time_total", metavar="KEY",
                      help="table order: self_time_total (default), total_time, count, mean, gbps, gflops")
    prof.add_argument("--row-limit", type=int, default=30, metavar="N", help="rows in the table (default 30)")
    prof.add_argument("--group-by-shape", action="store_true", help="one row per op and input shapes")
    prof.add_argument("--ceilings", metavar="FILE", help="a taifuse bench results.json to take the ceilings from")
    prof.add_argument("--skip-first", type=int, metavar="N",
                      help="steps before the schedule's wait (default 0; needs --active)")
    prof.add_argument("--wait", type=int, metavar="N", help="steps not recorded first (default 0; needs --active)")
    prof.add_argument("--warmup", type=int, metavar="N",
                      help="steps then recorded and dropped (default 0; needs --active)")
    prof.add_argument("--active", type=int, metavar="N",
                      help="steps then recorded, once; the table and trace are theirs (default: the whole run)")
    prof.add_argument("script", nargs="?", help="the Python script to run")
    prof.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")


def _check_profile_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every argument of ``taifuse profile``, before the script runs (argparse errors, exit 2)."""
    from taifuse.profiler import SORT_KEYS, roofline_from_results

    if args.script is None:
        parser.error("profile: a SCRIPT to run is required (taifuse profile [options] SCRIPT [ARGS...])")
    if not os.path.isfile(args.script):
        parser.error(f"profile: no such script {args.script!r}")
    if args.sort not in SORT_KEYS:
        parser.error(f"profile: --sort should be one of {', '.join(SORT_KEYS)}, got {args.sort!r}")
    if args.row_limit < 1:
        parser.error(f"profile: --row-limit should be at least 1, got {args.row_limit}")
    if args.ceilings is not None:
        try:
            roofline_from_results(args.ceilings)
        except ValueError as exc:
            parser.error(f"profile: --ceilings: {exc}")
    if args.trace is not None:
        folder = os.path.dirname(os.path.abspath(args.trace))
        if os.path.isdir(args.trace):
            parser.error(f"profile: --trace {args.trace!r} is a directory; give a file path")
        if not os.path.isdir(folder):
            parser.error(f"profile: --trace {args.trace!r}: no such directory {folder!r}")
        if not os.access(folder, os.W_OK):
            parser.error(f"profile: --trace {args.trace!r}: directory {folder!r} is not writable")
    counts = {"--skip-first": args.skip_first, "--wait": args.wait, "--warmup": args.warmup}
    for flag, value in counts.items():
        if value is not None and value < 0:
            parser.error(f"profile: {flag} should be at least 0, got {value}")
    if args.active is not None and args.active < 1:
        parser.error(f"profile: --active should be at least 1, got {args.active}")
    given = [flag for flag, value in counts.items() if value is not None]
    if given and args.active is None:
        parser.error(f"profile: {', '.join(given)} need --active (how many steps to record)")


def _profile(args: argparse.Namespace) -> int:
    import runpy

    from taifuse import profiler
    from taifuse.optim.optimizer import Optimizer

    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [args.script, *args.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    code = 0
    scheduled = args.active is not None
    plan = (args.skip_first or 0, args.wait or 0, args.warmup or 0, args.active)
    prof = profiler.profile(
        ceilings=args.ceilings,
        schedule=profiler.schedule(
            skip_first=plan[0], wait=plan[1], warmup=plan[2], active=plan[3], repeat=1
        ) if scheduled else None,
    )  # fmt: skip
    optimizer_step = Optimizer.step
    if scheduled:
        # A step ends at each optimizer step (where a torch user calls prof.step()).
        def step(self, *a, **kw):
            out = optimizer_step(self, *a, **kw)
            prof.step()
            return out

        Optimizer.step = step
    try:
        with prof:
            runpy.run_path(args.script, run_name="__main__")
    except SystemExit as exc:  # the script's own exit: still print what was recorded, then exit as it did
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:  # sys.exit("message"): Python prints the message to stderr and exits 1
            print(exc.code, file=sys.stderr)
            code = 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        Optimizer.step = optimizer_step
    if scheduled and not prof.events():
        first = plan[0] + plan[1] + plan[2]
        print(
            f"taifuse profile: nothing recorded: the script made {prof.step_num} optimizer step(s) and the "
            f"schedule records steps {first} to {first + plan[3] - 1} (counting from 0)",
            file=sys.stderr,
        )
        return code
    averages = prof.key_averages(group_by_input_shape=args.group_by_shape)
    print(averages.table(sort_by=args.sort, row_limit=args.row_limit))
    if args.trace:
        prof.export_chrome_trace(args.trace)
        print(f"wrote {args.trace}")
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="taifuse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="print the backends available, the active one, versions and threads")
    _add_bench_parser(sub)
    _add_profile_parser(sub)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.command == "info":
        return _info(args)
    if args.command == "bench":
        return _bench(args, argv)
    if args.command == "profile":
        _check_profile_args(parser, args)  # before the script runs
        return _profile(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
