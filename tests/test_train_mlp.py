"""examples/train_mlp.py's command line: every flag checked before the training (usage errors,
status 2, no traceback), the result printed before the plot is drawn, and a verdict only for the
run the target is stated for. Subprocesses on the numpy backend, with one epoch at most."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import taifuse

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_mlp.py"


def _load():
    spec = importlib.util.spec_from_file_location("train_mlp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _load()


def _python(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *argv],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--epochs", "0"], "argument --epochs: should be an integer >= 1, got 0"),
        (["--epochs", "-3"], "argument --epochs: should be an integer >= 1, got -3"),
        (["--epochs", "2.5"], "argument --epochs: should be an integer, got '2.5'"),
        (["--log", "run.txt"], "--log should end in .csv or .jsonl, got 'run.txt'"),
        (
            ["--log", "{tmp}/missing/run.csv"],
            "--log '{tmp}/missing/run.csv': the directory '{tmp}/missing' does not exist",
        ),
        (
            ["--plot", "{tmp}/missing/run.png"],
            "--plot '{tmp}/missing/run.png': the directory '{tmp}/missing' does not exist",
        ),
        (["--plot", "{tmp}"], "--plot '{tmp}' is a directory"),
        (["--log", "{tmp}/a.csv", "--plot", "{tmp}/a.csv"], "--log and --plot name the same file"),
        (["--optimizer", "sgd", "--amp"], "--amp needs --optimizer adamw"),
        (["--grad-accum", "3"], "--grad-accum should divide the batch size 64, got 3"),
        (["--workers", "-1"], "--workers should be >= 0, got -1"),
    ],
)
def test_every_flag_is_checked_before_the_training(argv, message, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        example.parse_args(argv)
    assert exit_.value.code == 2
    assert "error: " + message.replace("{tmp}", str(tmp_path)) in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_bad_flags_from_the_shell_are_usage_errors_without_a_traceback(tmp_path):
    """--epochs 0 named CosineAnnealingLR's T_max in a traceback; --plot into a missing directory
    failed after the whole run, before the result was printed."""
    for argv in (["--epochs", "0"], ["--plot", str(tmp_path / "missing" / "run.png")]):
        done = _python(*argv, cwd=tmp_path)
        assert done.returncode == 2 and "Traceback" not in done.stderr and "T_max" not in done.stderr, (
            done.stderr
        )
        assert "train_mlp.py: error:" in done.stderr and done.stdout == ""


def test_train_refuses_a_bad_epoch_count_naming_it():
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="epochs should be a positive int"):
            example.train(epochs=bad, quiet=True)
    with pytest.raises(ValueError, match="batch_size should be a positive int"):
        example.train(epochs=1, batch_size=0, quiet=True)


def test_the_result_is_printed_before_the_plot(tmp_path, capsys, monkeypatch):
    from taifuse.monitor import TrainingMonitor

    def failing_plot(self, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(TrainingMonitor, "plot", failing_plot)
    with taifuse.backends.preserved_choice(), taifuse.use_backend("numpy"), pytest.raises(OSError):
        example.train(epochs=1, log_path=str(tmp_path / "run.csv"), plot_path=str(tmp_path / "run.png"))
    assert "held-out loss" in capsys.readouterr().out
    assert len((tmp_path / "run.csv").read_text().splitlines()) == 1 + 22  # the header and 22 steps


def test_help_shows_the_defaults_and_what_the_target_is_for(capsys):
    with pytest.raises(SystemExit):
        example.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 30)" in text and "(default: adamw)" in text
    assert "at least 0.93 after the default 30 epochs" in text


def test_only_the_default_epochs_get_a_verdict(tmp_path):
    """A 1-epoch run ended "FAILED: accuracy ... is below the stated 0.93" with status 1."""
    done = _python("--epochs", "1", "--backend", "numpy", cwd=tmp_path)
    assert done.returncode == 0 and "FAILED" not in done.stderr, done.stderr
    assert "no verdict: the 0.93 target is stated for the default 30 epochs" in done.stdout
    with taifuse.backends.preserved_choice(), taifuse.use_backend("numpy"):
        assert not example.train(epochs=1, quiet=True).target_applies
        assert not example.train(epochs=1, quiet=True, optimizer="sgd", lr=0.1).target_applies
