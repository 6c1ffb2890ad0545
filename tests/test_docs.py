"""What the docs show a user runs: docstring examples, the README's example and commands'
building blocks (``taifuse info``), and ``examples/``."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import os
import pkgutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import taifuse
from taifuse import backends, cli

ROOT = Path(__file__).resolve().parents[1]
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _modules_with_examples() -> list[str]:
    names = ["taifuse"] + [
        m.name for m in pkgutil.walk_packages(taifuse.__path__, prefix="taifuse.") if not m.name.endswith("__main__")
    ]
    found = []
    for name in sorted(names):
        try:
            module = importlib.import_module(name)
        except ImportError:  # a backend whose package is not installed
            continue
        if any(t.examples for t in doctest.DocTestFinder().find(module)):
            found.append(name)
    return found


# The public op docs run on every backend: their outputs are the same everywhere.
PER_BACKEND = ("taifuse", "taifuse.functional")
MODULES = _modules_with_examples()


def _run_doctests(module_name: str) -> None:
    module = importlib.import_module(module_name)
    # Examples may switch backends (set_backend's does): hand the next test what it had.
    with backends.preserved_choice():
        result = doctest.testmod(module, optionflags=FLAGS, report=True)
    assert result.attempted > 0
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {module_name} (see stdout)"


@pytest.mark.parametrize("module_name", PER_BACKEND)
def test_public_docstring_examples_on_every_backend(backend, module_name):
    backend.activate()
    _run_doctests(module_name)


@pytest.mark.parametrize("module_name", [m for m in MODULES if m not in PER_BACKEND])
def test_docstring_examples(module_name):
    _run_doctests(module_name)


def test_readme_example_runs(backend):
    backend.activate()
    with backends.preserved_choice():
        result = doctest.testfile(str(ROOT / "README.md"), module_relative=False, optionflags=FLAGS)
    assert result.attempted > 0, "the README should have a runnable >>> example"
    assert result.failed == 0, "the README example failed (see stdout)"


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TAIFUSE_")}
    env.update(extra)
    return env


def test_quickstart_example_runs():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        env=_clean_env(), capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "backend:" in proc.stdout


# ----------------------------------------------------------------------------- taifuse info


def test_info_prints_the_active_backend(backend, capsys):
    backend.activate()
    assert cli.main(["info"]) == 0
    printed = capsys.readouterr().out
    assert f"active backend: {backend.name}" in printed
    versions = ", ".join(f"{name} {metadata.version(name)}" for name in taifuse.available_backends())
    assert f"backends installed: {versions}" in printed  # every backend's version, active or not
    assert f"taifuse {taifuse.__version__}" in printed
    if backend.arch is not None:
        described = backends.active().describe()
        assert f"arch: {described['arch']}" in printed


def test_info_command_in_a_fresh_process():
    script = Path(sys.executable).with_name("taifuse")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "taifuse.cli"]
    proc = subprocess.run(
        command + ["info"], env=_clean_env(TAIFUSE_BACKEND="numpy"),
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "active backend: numpy" in proc.stdout
    assert "TAIFUSE_BACKEND=numpy" in proc.stdout


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["frobnicate"])
    assert excinfo.value.code == 2
    assert "frobnicate" in capsys.readouterr().err
