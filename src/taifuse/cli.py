"""The ``taifuse`` command: ``taifuse info`` and ``taifuse bench``."""

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
    print(f"backends installed: {', '.join(backends.available_backends())}")
    print(f"TAIFUSE_BACKEND={os.environ.get('TAIFUSE_BACKEND', '(unset: auto)')}")
    print(f"TAIFUSE_TAICHI_ARCH={os.environ.get('TAIFUSE_TAICHI_ARCH', '(unset: metal)')}")
    active = backends.active()
    print(f"active backend: {backends.get_backend()}")
    for key, value in active.describe().items():
        print(f"  {key}: {value}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="taifuse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="print the backends available, the active one, versions and threads")
    args = parser.parse_args(argv)
    if args.command == "info":
        return _info(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
