"""examples/train_gpt.py in-process with a tiny config for a few steps (seconds, never the default
config): the corpus and vocabulary, the schedule, the printed losses, the checkpoint and --resume."""

from __future__ import annotations

import csv
import importlib.util
import itertools
import json
import math
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import taifuse

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _load(name: str):
    # Registered under the names the script uses (it imports "gpt"; the dataclasses need their
    # module in sys.modules); a module already loaded from the same file is reused.
    path = EXAMPLES / f"{name}.py"
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", "")).resolve() == path:
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gpt = _load("gpt")
train_gpt = _load("train_gpt")

BACKEND = "numba" if "numba" in taifuse.available_backends() else "numpy"
TINY = [
    "--batch-size", "4", "--block-size", "16", "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
    "--lr", "1e-2", "--warmup", "2", "--eval-interval", "4", "--eval-batches", "2", "--sample-tokens", "12",
]  # fmt: skip
LOSS_LINE = re.compile(r"step +(\d+) +train loss (\S+) +val loss (\S+)")


def _run(argv: list[str]):
    with taifuse.backends.preserved_choice(), taifuse.use_backend(BACKEND):
        return train_gpt.main(TINY + argv)


def test_vocabulary_is_fixed_and_maps_the_rest_to_unknown():
    assert train_gpt.VOCAB_SIZE == 97 and train_gpt.UNKNOWN == 96
    ids = train_gpt.encode("a\tb\né")
    assert ids.tolist() == [train_gpt.VOCAB.index("a"), 96, train_gpt.VOCAB.index("b"), 95, 96]
    assert train_gpt.decode(ids) == "a\ufffdb\n\ufffd"
    text = "def f(x):\n    return x + 1  # ~\n"
    assert train_gpt.decode(train_gpt.encode(text)) == text


def test_corpus_is_the_sorted_stdlib_prefix():
    files = train_gpt.corpus_files()
    assert [p.name for p in files] == sorted(p.name for p in files) and len(files) > 10
    corpus = train_gpt.load_corpus(50_000)
    assert len(corpus) == 50_000
    first = files[0].read_bytes().decode("utf-8", errors="replace")
    assert corpus.startswith(first[:1000])
    entropy = train_gpt.unigram_entropy(train_gpt.encode(corpus))
    assert 1.0 < entropy < math.log(train_gpt.VOCAB_SIZE)
    ids = train_gpt.encode(corpus)
    bigram = train_gpt.bigram_cross_entropy(ids[:40_000], ids[40_000:])
    assert 1.0 < bigram < entropy  # one character of context helps on code


def test_warmup_cosine_schedule():
    p = taifuse.tensor(np.zeros(1, np.float32), requires_grad=True)
    opt = taifuse.optim.AdamW([p], lr=1.0)
    sched = train_gpt.WarmupCosineLR(opt, warmup_steps=4, total_steps=12, min_lr_ratio=0.1)
    lrs = []
    for _ in range(14):
        lrs.append(sched.get_last_lr()[0])
        sched.step()
    np.testing.assert_allclose(lrs[:5], [0.2, 0.4, 0.6, 0.8, 1.0])  # the peak when the warm-up ends
    assert all(a > b for a, b in itertools.pairwise(lrs[4:13]))  # then decays
    np.testing.assert_allclose(lrs[12:], [0.1, 0.1])  # the floor from total_steps on
    # Resumed at step 7 (as --resume does, from an optimizer state that holds initial_lr):
    opt2 = taifuse.optim.AdamW([p], lr=1.0)
    opt2.load_state_dict(opt.state_dict())
    resumed = train_gpt.WarmupCosineLR(opt2, 4, 12, 0.1, last_epoch=6)
    assert resumed.get_last_lr()[0] == pytest.approx(lrs[7])


def test_a_few_steps_learn_save_a_checkpoint_and_resume(tmp_path, capsys):
    ckpt, log, plot = tmp_path / "ckpt.pkl", tmp_path / "run.csv", tmp_path / "run.png"
    result = _run(["--steps", "12", "--out", str(ckpt), "--log", str(log), "--plot", str(plot)])
    printed = [tuple(map(float, m.groups())) for m in LOSS_LINE.finditer(capsys.readouterr().out)]
    assert [int(s) for s, _, _ in printed] == [0, 4, 8, 12]
    assert all(math.isfinite(v) for _, train, val in printed for v in (train, val))
    first, last = printed[0], printed[-1]
    assert first[1] == pytest.approx(math.log(97), abs=0.2)  # near-uniform at initialization
    assert last[1] < first[1] - 0.3 and last[2] < first[2] - 0.3, printed  # the loss falls
    assert result.val_loss == pytest.approx(last[2], abs=1e-4) and result.step == 12
    assert math.isfinite(result.tokens_per_s) and result.tokens_per_s > 0
    assert len(result.sample) == len(train_gpt.SAMPLE_PROMPT) + 12

    # The monitor's log: a row per step with its tokens, the lr it used and a finite gradient norm.
    with open(log, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, 13))
    assert {int(r["n"]) for r in rows} == {4 * 16}  # --batch-size x --block-size tokens
    lrs = [float(r["lr"]) for r in rows]
    assert lrs[:3] == pytest.approx([1e-2 / 3, 2e-2 / 3, 1e-2])  # warm-up over 2 steps to the peak
    assert all(math.isfinite(float(r["grad_norm"])) and float(r["grad_norm"]) > 0 for r in rows)
    assert float(rows[0]["loss"]) == pytest.approx(math.log(97), abs=0.3)
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The checkpoint: model, optimizer, config and step, loadable into a fresh model and optimizer.
    state = train_gpt.load_checkpoint(ckpt)
    assert state["step"] == 12
    config = gpt.GPTConfig(**state["config"])
    assert (config.n_layer, config.n_embd, config.block_size, config.vocab_size) == (1, 16, 16, 97)
    with taifuse.backends.preserved_choice(), taifuse.use_backend(BACKEND):
        model = gpt.GPT(config)
        model.load_state_dict(state["model"])
        opt = model.configure_optimizer(weight_decay=0.1, lr=1e-2, betas=(0.9, 0.99))
        opt.load_state_dict(state["optimizer"])
        assert {s["step"] for s in opt.state_dict()["state"].values()} == {12.0}
        for name, value in model.state_dict().items():
            np.testing.assert_array_equal(value.numpy(), state["model"][name])
    assert set(state["model"]) == set(model.state_dict())

    # --resume continues from it: the first estimate is the saved run's last (same fixed batches).
    resumed = _run(["--steps", "16", "--out", str(ckpt), "--resume", "--log", str(tmp_path / "more.jsonl")])
    assert [s for s, _, _ in resumed.history] == [12, 16]
    more = [json.loads(line) for line in (tmp_path / "more.jsonl").read_text().splitlines()]
    assert [r["step"] for r in more] == [13, 14, 15, 16]  # numbered on from the checkpoint's step
    assert resumed.history[0][2] == pytest.approx(last[2], rel=1e-5)
    assert train_gpt.load_checkpoint(ckpt)["step"] == 16


def test_resume_needs_the_same_vocabulary(tmp_path):
    ckpt = tmp_path / "other.safetensors"
    taifuse.save({"model": {}, "optimizer": {}, "config": {}, "step": 0, "vocab": "abc"}, ckpt)
    with pytest.raises(ValueError, match="vocabulary"):
        train_gpt.load_checkpoint(ckpt)


def test_amp_trains_and_its_checkpoint_saves_and_restores_the_grad_scaler(tmp_path, capsys):
    """--amp: autocast forward, GradScaler backward; finite falling losses, the scale on the log
    lines, and the scaler's state_dict in the checkpoint, restored by --resume --amp."""
    ckpt = tmp_path / "amp.pkl"
    result = _run(["--steps", "8", "--out", str(ckpt), "--amp"])
    out = capsys.readouterr().out
    assert "amp (float16 autocast)" in out and "loss scale" in out
    printed = [tuple(map(float, m.groups())) for m in LOSS_LINE.finditer(out)]
    assert [int(s) for s, _, _ in printed] == [0, 4, 8]
    assert all(math.isfinite(v) for _, train, val in printed for v in (train, val))
    assert printed[-1][1] < printed[0][1] - 0.3  # it learns
    assert result.loss_scale is not None and result.loss_scale in {2.0**k for k in range(17)}

    saved = train_gpt.load_checkpoint(ckpt)
    assert saved["scaler"]["scale"] == result.loss_scale and saved["step"] == 8
    assert set(saved["scaler"]) == {
        "scale",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "_growth_tracker",
    }
    # A distinctive scale and growth tracker written into the checkpoint come back on resume: with
    # nothing left to train the scaler is what was loaded, and it is saved again as it was.
    saved["scaler"].update(scale=512.0, _growth_tracker=3)
    taifuse.save(saved, ckpt)
    resumed = _run(["--steps", "8", "--out", str(ckpt), "--resume", "--amp", "--quiet"])
    assert resumed.loss_scale == 512.0
    assert train_gpt.load_checkpoint(ckpt)["scaler"]["_growth_tracker"] == 3
    # Two more steps from there: the scale grows only after growth_interval (2000) good steps, so it
    # stays 512 unless a step overflowed (then it halves); the tracker counts on or restarts.
    further = _run(["--steps", "10", "--out", str(ckpt), "--resume", "--amp", "--quiet"])
    scaler = train_gpt.load_checkpoint(ckpt)["scaler"]
    assert further.step == 10 and further.loss_scale == scaler["scale"]
    assert (scaler["scale"], scaler["_growth_tracker"]) in {(512.0, 5), (256.0, 0), (256.0, 1), (128.0, 0)}


def test_float32_checkpoint_has_an_empty_scaler_state_and_resumes_under_amp(tmp_path):
    """A float32 run saves the disabled scaler's empty state (PyTorch's); --resume --amp from it
    starts a fresh scale rather than failing on the empty state."""
    ckpt = tmp_path / "f32.pkl"
    _run(["--steps", "4", "--out", str(ckpt), "--quiet"])
    assert train_gpt.load_checkpoint(ckpt)["scaler"] == {}
    resumed = _run(["--steps", "6", "--out", str(ckpt), "--resume", "--amp", "--quiet"])
    assert resumed.step == 6 and resumed.loss_scale in {2.0**16, 2.0**15, 2.0**14}


def test_log_and_plot_options_are_checked_before_training(capsys):
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--log", "run.txt"])
    assert "--log should end in .csv or .jsonl" in capsys.readouterr().err
    assert train_gpt.parse_args(["--log", "run.JSONL"]).log == Path("run.JSONL")


# ----------------------------------------------------------------------------- the command line


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lr", "-1"], "argument --lr: should be a finite number >= 0, got -1"),
        (["--lr", "nan"], "argument --lr: should be a finite number >= 0"),
        (["--dropout", "1.5"], "argument --dropout: should be a finite number in [0, 1], got 1.5"),
        (["--warmup", "-5"], "argument --warmup: should be an integer >= 0, got -5"),
        (["--weight-decay", "-1"], "argument --weight-decay: should be a finite number >= 0"),
        (["--grad-clip", "-1"], "argument --grad-clip: should be a finite number > 0"),
        (["--grad-clip", "0"], "argument --grad-clip: should be a finite number > 0"),
        (["--seed", "-1"], "argument --seed: should be an integer >= 0, got -1"),
        (["--sample-tokens", "-1"], "argument --sample-tokens: should be an integer >= 0"),
        (["--min-lr-ratio", "-1"], "argument --min-lr-ratio: should be a finite number in [0, 1]"),
        (["--min-lr-ratio", "1.5"], "argument --min-lr-ratio: should be a finite number in [0, 1]"),
        (["--block-size", "300000"], "argument --block-size: should be an integer in [1, 199,999]"),
        (["--steps", "0"], "argument --steps: should be an integer >= 1, got 0"),
        (["--steps", "2.5"], "argument --steps: should be an integer, got '2.5'"),
        (["--eval-batches", "0"], "argument --eval-batches: should be an integer >= 1"),
        (["--n-embd", "30", "--n-head", "4"], "--n-embd (30) should be a multiple of --n-head (4)"),
        (["--log", "run.txt"], "--log should end in .csv or .jsonl"),
        (
            ["--plot", "{tmp}/missing/run.png"],
            "--plot '{tmp}/missing/run.png': the directory '{tmp}/missing' does not exist",
        ),
        (
            ["--log", "{tmp}/missing/run.csv"],
            "--log '{tmp}/missing/run.csv': the directory '{tmp}/missing' does not exist",
        ),
        (
            ["--out", "{tmp}/missing/ckpt.pkl"],
            "--out '{tmp}/missing/ckpt.pkl': the directory '{tmp}/missing' does not exist",
        ),
        (["--out", "{tmp}"], "--out '{tmp}' is a directory"),
        (["--log", "{tmp}/a.csv", "--plot", "{tmp}/a.csv"], "--log and --plot name the same file"),
        (["--resume", "--out", "{tmp}/none.pkl"], "--resume: no checkpoint at --out '{tmp}/none.pkl'"),
    ],
)
def test_every_flag_is_checked_before_any_work(argv, message, tmp_path, capsys):
    """Each was a traceback (some mid-run, --min-lr-ratio -1 at the first step below 0; --plot and
    --log into a missing directory after the whole run, losing it); now a usage error, status 2."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        train_gpt.parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "error: " + message.replace("{tmp}", str(tmp_path)) in err, err
    assert list(tmp_path.iterdir()) == []


def test_flags_at_their_limits_are_accepted(tmp_path):
    args = train_gpt.parse_args(
        ["--lr", "0", "--dropout", "1", "--warmup", "0", "--weight-decay", "0", "--seed", "0",
         "--sample-tokens", "0", "--min-lr-ratio", "1", "--block-size", "199999", "--out", str(tmp_path / "c.pkl")]
    )  # fmt: skip
    assert (args.lr, args.dropout, args.min_lr_ratio, args.block_size) == (0.0, 1.0, 1.0, 199_999)


def _python(script: str, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *argv],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (None, "no checkpoint at --out"),
        (b"", "(the file is empty)"),
        (b"not a checkpoint", "is not a readable safetensors file"),
        (pickle.dumps({"model": {}}), "is not a readable safetensors file"),  # the old format
        ("truncated", "is not a readable safetensors file"),
        ([1, 2], "(it has no model, optimizer, config, step, vocab)"),
    ],
    ids=["missing", "empty", "corrupt", "pickle", "truncated", "not-a-checkpoint"],
)
def test_resume_of_a_bad_file_is_one_line_naming_it(content, why, tmp_path):
    """FileNotFoundError, "invalid literal for int()" and EOFError tracebacks before; now one line
    naming the file, status 2, before the corpus is read. Checkpoints are safetensors since issue
    29: a pickle (the old format) is refused, not unpickled."""
    ckpt = tmp_path / "run.safetensors"
    if content == "truncated":
        taifuse.save({"model": {"w": np.ones(100, np.float32)}}, ckpt)
        ckpt.write_bytes(ckpt.read_bytes()[:-10])
    elif isinstance(content, list):
        taifuse.save(content, ckpt)
    elif content is not None:
        ckpt.write_bytes(content)
    done = _python("train_gpt.py", "--resume", "--out", str(ckpt), "--backend", "numpy", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.strip().splitlines()[-1:]
    assert line.startswith("train_gpt.py: error: --resume") and str(ckpt) in line and why in line, line
    assert done.stdout == ""  # nothing was trained or printed


def test_bad_flags_from_the_shell_are_usage_errors_without_a_traceback(tmp_path):
    for argv in (
        ["--lr", "-1"],
        ["--plot", str(tmp_path / "missing" / "run.png")],
        ["--block-size", "300000"],
    ):
        done = _python("train_gpt.py", *argv, cwd=tmp_path)
        assert done.returncode == 2 and "Traceback" not in done.stderr, (argv, done.stderr)
        assert "train_gpt.py: error:" in done.stderr and done.stdout == ""
    assert list(tmp_path.iterdir()) == []  # no checkpoint: nothing ran


def test_the_checkpoint_and_the_report_come_before_the_plot(tmp_path, capsys, monkeypatch):
    """A plot that fails at the end (a full disk, a matplotlib error) no longer loses the run: the
    checkpoint is saved and the result printed first."""
    from taifuse.monitor import TrainingMonitor

    def failing_plot(self, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(TrainingMonitor, "plot", failing_plot)
    ckpt = tmp_path / "ckpt.pkl"
    with pytest.raises(OSError, match="No space left"):
        _run(["--steps", "2", "--out", str(ckpt), "--plot", str(tmp_path / "run.png")])
    assert train_gpt.load_checkpoint(ckpt)["step"] == 2
    assert "final validation loss" in capsys.readouterr().out


def test_help_shows_the_defaults_and_what_the_target_is_for(capsys):
    with pytest.raises(SystemExit) as exit_:
        train_gpt.parse_args(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 300)", "(default: 32)", "(default: 64)", "(default: 0.004)", "(default: 30)"):
        assert default in text, default
    assert f"a final validation loss below {train_gpt.TARGET_VAL_LOSS} nats/char" in text
    assert "default config (--steps 300, --batch-size 32," in text and "without one and exits 0" in text


def test_only_the_default_config_gets_a_verdict(tmp_path):
    """A short run ended "FAILED ... not below the stated 2.2" with status 1: the target is for the
    default config. Now it reports its loss without a verdict and exits 0."""
    defaults = train_gpt.parse_args([])
    config = gpt.GPTConfig(vocab_size=train_gpt.VOCAB_SIZE, **train_gpt.GPT_DEFAULTS)
    assert train_gpt.differs_from_target_config(defaults, config) == []
    amp = train_gpt.parse_args(["--amp", "--seed", "3", "--backend", "numpy", "--eval-interval", "50"])
    assert train_gpt.differs_from_target_config(amp, config) == []
    short = train_gpt.parse_args(["--steps", "4", "--lr", "0.01"])
    assert train_gpt.differs_from_target_config(short, config) == ["--steps", "--lr"]
    small = gpt.GPTConfig(vocab_size=train_gpt.VOCAB_SIZE, **{**train_gpt.GPT_DEFAULTS, "n_layer": 1})
    assert train_gpt.differs_from_target_config(defaults, small) == ["--n-layer"]  # a resumed run's model

    done = _python(
        "train_gpt.py", *TINY, "--steps", "2", "--backend", "numpy", "--out", "c.pkl", cwd=tmp_path
    )
    assert done.returncode == 0 and "FAILED" not in done.stderr, done.stderr
    assert (
        "no verdict: the target < 2.2 is stated for the default config, and this run's --steps, "
        in done.stdout
    )
    assert (tmp_path / "c.pkl").is_file()


def test_the_loader_workers_and_grad_accum_train_on_the_same_batches(tmp_path):
    """The batches come through taifuse.data's loader from the memory-mapped token file: worker
    threads give the run of no workers exactly; --grad-accum 2 splits each step's batch into two
    micro-batches of the same windows, so the losses agree to float32 summation order."""
    runs = {}
    for name, extra in {"workers": [], "inline": ["--workers", "0"], "accum": ["--grad-accum", "2"]}.items():
        out = tmp_path / name / "c.safetensors"
        out.parent.mkdir()
        runs[name] = _run(["--steps", "4", "--quiet", "--out", str(out), *extra])
        tokens = np.load(out.with_name("train_gpt.tokens.npy"), mmap_mode="r")
        assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint8
    assert runs["workers"].history == runs["inline"].history
    for (s1, t1, v1), (s2, t2, v2) in zip(runs["accum"].history, runs["inline"].history):
        assert s1 == s2 and t1 == pytest.approx(t2, rel=1e-4) and v1 == pytest.approx(v2, rel=1e-4)


def test_find_batch_size_prints_the_table_and_trains_nothing(tmp_path, capsys):
    out, plot = tmp_path / "c.safetensors", tmp_path / "sizes.png"
    found = _run(["--find-batch-size", "--max-batch", "16", "--out", str(out), "--plot", str(plot)])
    assert [t.batch_size for t in found.table][:1] == [8] and found.batch_size in (8, 16)
    assert "chosen batch size" in capsys.readouterr().out
    assert not out.exists()  # no training, no checkpoint
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_grad_accum_should_divide_the_batch(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--batch-size", "4", "--grad-accum", "3", "--out", str(tmp_path / "c")])
    assert "--batch-size (4) should be a multiple of --grad-accum (3)" in capsys.readouterr().err
