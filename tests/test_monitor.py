"""taifuse.monitor.TrainingMonitor: what it logs (CSV, JSONL, history) is what was passed and what
its clock measured, the plot is a PNG, non-finite losses and throughput drops are flagged by the
documented rule (time driven by an injected clock, so every figure is exact), the memory figures
follow the pool and the process, and bad arguments raise before anything is written."""

from __future__ import annotations

import csv
import io
import json
import math
import mmap
import sys
import warnings

import numpy as np
import pytest

import taifuse
from taifuse import backends, pool
from taifuse.monitor import Flag, TrainingMonitor, process_memory


class FakeClock:
    """Seconds that move only when the test says: ``clock.t += dt``."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _monitor(**kwargs) -> TrainingMonitor:
    kwargs.setdefault("disable", True)
    kwargs.setdefault("clock", FakeClock())
    return TrainingMonitor(**kwargs)


def _run(monitor: TrainingMonitor, dts, n=10, **extra) -> None:
    for dt in dts:
        monitor._clock.t += dt
        monitor.step(1.0, n=n, **extra)


# ----------------------------------------------------------------------------- what is logged


STEPS = [  # (seconds since the previous step, loss, n, extras)
    (0.5, 2.5, 32, {"lr": 0.1, "grad_norm": 3.25, "phase": "warm"}),
    (0.25, 2.0, 32, {"lr": 0.05, "grad_norm": np.float32(1.5), "phase": "main"}),
    (0.25, 1.75, 16, {"lr": 0.025, "phase": None}),  # grad_norm left out: logged as None
    (1.0, 1.5, 32, {"lr": 0.0125, "grad_norm": 7, "phase": "main"}),
]


def _logged(path) -> TrainingMonitor:
    clock = FakeClock()
    monitor = TrainingMonitor(
        total_steps=4, unit="tokens", log_path=path, window=2, disable=True, clock=clock
    )
    with monitor:
        for dt, loss, n, extra in STEPS:
            clock.t += dt
            monitor.step(taifuse.tensor(np.array(loss, np.float32)), n=n, **extra)
    return monitor


def _expected_rows() -> list[dict]:
    """Each step's record written out by hand from STEPS (window of 2 steps)."""
    rows, elapsed = [], 0.0
    for i, (dt, loss, n, extra) in enumerate(STEPS):
        elapsed += dt
        recent = STEPS[max(0, i - 1) : i + 1]
        seconds = sum(s[0] for s in recent)
        rows.append(
            {
                "step": i + 1,
                "time_s": elapsed,
                "step_time_s": dt,
                "loss": loss,
                "n": n,
                "steps_per_s": len(recent) / seconds,
                "tokens_per_s": sum(s[2] for s in recent) / seconds,
                "lr": extra["lr"],
                "grad_norm": float(extra["grad_norm"]) if "grad_norm" in extra else None,
                "phase": extra["phase"],
            }
        )
    return rows


MEMORY = ("pool_in_use_bytes", "pool_peak_bytes", "rss_bytes", "rss_peak_bytes")


def test_history_holds_the_values_and_the_clocks_rates():
    monitor = _logged(None)
    columns = ["step", "time_s", "step_time_s", "loss", "n", "steps_per_s", "tokens_per_s", *MEMORY]
    assert list(monitor.history[0]) == [*columns, "lr", "grad_norm", "phase"]
    for got, want in zip(monitor.history, _expected_rows(), strict=True):
        for key, value in want.items():
            if isinstance(value, float):
                assert got[key] == pytest.approx(value, rel=1e-12), key
            else:
                assert got[key] == value, key
    assert type(monitor.history[1]["grad_norm"]) is float and type(monitor.history[3]["grad_norm"]) is int
    assert monitor.flags == []


def test_csv_holds_exactly_what_was_logged(tmp_path):
    path = tmp_path / "run.csv"
    monitor = _logged(path)
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == list(monitor.history[0])
    assert len(rows) == len(STEPS)
    for row, record in zip(rows, monitor.history, strict=True):
        for key, value in record.items():
            if value is None:
                assert row[key] == ""
            elif isinstance(value, str):
                assert row[key] == value
            else:  # floats are written with repr: they read back bit-equal
                assert type(value)(row[key]) == value, (key, row[key], value)


def test_jsonl_holds_exactly_what_was_logged(tmp_path):
    path = tmp_path / "run.jsonl"
    monitor = _logged(path)
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == monitor.history
    assert all(list(json.loads(line)) == list(monitor.history[0]) for line in lines)


def test_nonfinite_values_round_trip_through_jsonl_and_csv(tmp_path):
    for suffix in (".jsonl", ".csv"):
        path = tmp_path / f"nan{suffix}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            with _monitor(log_path=path) as monitor:
                monitor.step(float("nan"), n=1)
                monitor.step(float("inf"), n=1)
        if suffix == ".jsonl":
            losses = [json.loads(line)["loss"] for line in path.read_text().splitlines()]
        else:
            with open(path, newline="") as f:
                losses = [float(row["loss"]) for row in csv.DictReader(f)]
        assert math.isnan(losses[0]) and losses[1] == math.inf


def test_log_is_flushed_every_flush_every_steps(tmp_path):
    path = tmp_path / "run.csv"
    monitor = _monitor(log_path=path, flush_every=2)
    monitor.step(1.0, n=1)
    assert path.read_text() == ""  # header and row still buffered
    monitor.step(1.0, n=1)
    assert len(path.read_text().splitlines()) == 3  # header + 2 rows
    monitor.close()
    monitor.close()  # again: nothing


def test_extra_columns_are_fixed_by_the_first_step(tmp_path):
    path = tmp_path / "run.csv"
    monitor = _monitor(log_path=path)
    monitor.step(1.0, n=4, lr=0.1)
    with pytest.raises(ValueError, match="grad_norm"):
        monitor.step(1.0, n=4, lr=0.1, grad_norm=2.0)
    monitor.close()
    assert len(monitor.history) == 1 and len(path.read_text().splitlines()) == 2  # nothing of it written


def test_paused_time_is_left_out_of_the_step():
    monitor = _monitor()
    clock = monitor._clock
    clock.t += 0.25
    with monitor.paused():  # an evaluation
        clock.t += 10.0
    clock.t += 0.25
    record = monitor.step(1.0, n=8)
    assert record["step_time_s"] == 0.5 and record["time_s"] == 10.5 and record["samples_per_s"] == 16.0


def test_nested_paused_blocks_are_left_out_once():
    # Made at 100 s; paused 100 -> 102 with an inner pause 101 -> 102 (a checkpoint save inside an
    # evaluation); the step at 102.5 took 0.5 s of training (it read 0.0: the inner second twice).
    monitor = _monitor()
    clock = monitor._clock
    with monitor.paused():
        clock.t += 1.0
        with monitor.paused():
            clock.t += 1.0
    clock.t += 0.5
    record = monitor.step(1.0, n=8)
    assert record["step_time_s"] == 0.5 and record["time_s"] == 2.5
    # Two blocks one after the other both count, and the next step starts afresh.
    for _ in range(2):
        with monitor.paused():
            clock.t += 3.0
    clock.t += 0.25
    assert monitor.step(1.0, n=8)["step_time_s"] == 0.25
    clock.t += 0.125
    assert monitor.step(1.0, n=8)["step_time_s"] == 0.125


def test_without_n_the_unit_rate_is_none_and_steps_count():
    monitor = _monitor(unit="tokens", track_memory=False, initial_step=7)
    _run(monitor, [0.5, 0.5], n=None)
    assert [r["step"] for r in monitor.history] == [8, 9]
    assert monitor.history[-1]["tokens_per_s"] is None and monitor.history[-1]["steps_per_s"] == 2.0
    assert not any(key in monitor.history[0] for key in MEMORY)
    summary = monitor.summary()
    assert summary["steps"] == 2 and summary["tokens_per_s"] is None


def test_summary_means_are_over_the_steps_after_warmup():
    monitor = _monitor(warmup=2)
    assert monitor.summary()["steps"] == 0 and monitor.summary()["samples_per_s"] is None
    _run(monitor, [0.5, 1.0])
    assert monitor.summary()["steps_per_s"] == 2 / 1.5  # no step past the warm-up yet: all of them
    _run(monitor, [0.5, 0.25, 0.75, 0.5])
    summary = monitor.summary()
    assert summary["steps"] == 6 and summary["wall_s"] == 3.5 and summary["flags"] == 0
    assert summary["steps_per_s"] == 4 / 2.0 and summary["samples_per_s"] == 40 / 2.0
    assert summary["pool_peak_bytes"] == max(r["pool_peak_bytes"] for r in monitor.history)
    assert summary["rss_peak_bytes"] == max(r["rss_peak_bytes"] for r in monitor.history)


def test_keep_history_false_holds_memory_that_does_not_grow_with_the_steps():
    """No record kept, and the throughput check's running median in bounded memory: the second
    10,000 steps add (next to) nothing. Before, each step kept its rate in a sorted list (33 bytes a
    step, 330 KB here) and inserting into it cost O(steps)."""
    import tracemalloc

    monitor = _monitor(keep_history=False, track_memory=False, window=5, warmup=0)
    rng = np.random.default_rng(0)
    dts = 0.01 * rng.uniform(0.8, 1.25, 20_000)  # rates over a 1.56x range: about 165 bins
    _run(monitor, dts[:10_000])
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        _run(monitor, dts[10_000:])
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert monitor.summary()["steps"] == 20_000 and monitor.flags == []
    assert grown < 8_000, grown


def test_the_running_median_is_within_its_bin_width_of_the_exact_one():
    import statistics

    from taifuse.monitor import _RunningMedian

    rng = np.random.default_rng(1)
    draws = {
        "lognormal": lambda k: rng.lognormal(3.0, 1.0, k),
        "two speeds": lambda k: rng.choice([50.0, 100.0, 100.0], k),
        "with zeros": lambda k: np.where(rng.random(k) < 0.3, 0.0, rng.exponential(1.0, k)),
        "a slowdown": lambda k: np.concatenate(
            [rng.uniform(90, 110, k // 2), rng.uniform(20, 30, k - k // 2)]
        ),
    }
    for name, draw in draws.items():
        values = draw(2001)
        median = _RunningMedian()
        for i, value in enumerate(values.tolist()):
            median.add(value)
            exact = statistics.median(values[: i + 1].tolist())
            assert abs(median.median() - exact) <= 0.0028 * exact, (name, i)
        assert (
            median.count == 2001
            and len(median._keys) <= 256 * math.log2(values.max() / values[values > 0].min()) + 2
        )
    same = _RunningMedian()
    for _ in range(5):
        same.add(100.0)
    assert same.median() == 100.0  # equal values: exact
    with pytest.raises(ValueError, match="no values"):
        _RunningMedian().median()


def test_keep_history_false_keeps_no_records_but_logs_and_sums(tmp_path):
    path = tmp_path / "run.jsonl"
    with _monitor(log_path=path, keep_history=False, warmup=0) as monitor:
        _run(monitor, [0.5] * 4, lr=0.1)
    assert monitor.history == []
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]
    assert monitor.summary()["steps"] == 4 and monitor.summary()["samples_per_s"] == 20.0
    with pytest.raises(ValueError, match="keep_history=False"):
        monitor.plot(tmp_path / "run.png")


# ----------------------------------------------------------------------------- display


def test_plain_lines_every_print_every_steps_and_at_the_end():
    out = io.StringIO()
    monitor = _monitor(total_steps=5, disable=False, use_tqdm=False, print_every=2, file=out, desc="fit")
    _run(monitor, [0.1] * 5, lr=0.5)
    lines = out.getvalue().splitlines()
    assert [line.split()[:3] for line in lines] == [["fit", "step", f"{k}/5"] for k in (1, 2, 4, 5)]
    assert "lr 0.5" in lines[-1] and "samples/s 100" in lines[-1]


def test_tqdm_bar_shows_the_postfix_and_falls_back_without_tqdm(monkeypatch):
    pytest.importorskip("tqdm")
    out = io.StringIO()
    with _monitor(total_steps=3, disable=False, file=out) as monitor:
        _run(monitor, [0.1] * 3, lr=0.5)
    assert "loss=1" in out.getvalue() and "lr=0.5" in out.getvalue()

    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if tqdm were not installed
    with pytest.raises(ImportError, match="tqdm"):
        _monitor(disable=False, use_tqdm=True)
    out = io.StringIO()
    with _monitor(total_steps=2, disable=False, file=out) as monitor:
        _run(monitor, [0.1] * 2)
    assert out.getvalue().startswith("train step 1/2")


def test_disable_prints_nothing_but_still_logs(capsys):
    with _monitor(total_steps=3, disable=True) as monitor:
        _run(monitor, [0.1] * 3)
    captured = capsys.readouterr()
    assert captured.out == captured.err == "" and len(monitor.history) == 3


# ----------------------------------------------------------------------------- plot


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    monitor = _monitor()
    _run(monitor, [0.1] * 30, lr=0.01)
    path = monitor.plot(tmp_path / "run.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000  # three panels of curves, not an empty canvas


def test_every_plotted_line_is_inside_its_axis(monkeypatch, tmp_path):
    """Each axis from 0 to above its highest line (the pool's 1.1x, the RSS's 1.3x, so that the two
    highest lines do not coincide): the process RSS, flat at some hundred MiB, sat on the right
    axis's top edge (its autoscaled range was its own few KiB), hidden by the frame."""
    figure = pytest.importorskip("matplotlib.figure")
    drawn = []
    monkeypatch.setattr(figure.Figure, "savefig", lambda fig, *args, **kwargs: drawn.append(fig))
    with backends.preserved_choice():
        taifuse.set_backend("numpy")
        monitor = _monitor()
        block = pool.host_pool().acquire((1 << 16,), np.float32)  # the pool's lines above 0 too
        _run(monitor, [0.1] * 30, lr=0.01)
        del block
    monitor.plot(tmp_path / "run.png")
    (fig,) = drawn
    memory = fig.axes[2]
    rss_axis = next(ax for ax in fig.axes if ax is not memory and ax.bbox.bounds == memory.bbox.bounds)
    labels = {line.get_label() for ax in (memory, rss_axis) for line in ax.get_lines()}
    if sys.platform.startswith("linux"):
        assert {"process RSS (right)", "process RSS peak (right)"} <= labels
    for ax, headroom in ((memory, 1.1), (rss_axis, 1.3)):
        bottom, top = ax.get_ylim()
        highest = max(np.nanmax(line.get_ydata()) for line in ax.get_lines())
        assert bottom == 0 and top == pytest.approx(headroom * highest) and highest > 0


def test_the_plotted_loss_mean_leaves_out_nonfinite_steps():
    from taifuse.monitor import _trailing_mean

    got = _trailing_mean([1.0, math.nan, 3.0, 5.0, math.nan, math.nan, math.nan], 2)
    assert got[:5] == [1.0, 1.0, 3.0, 4.0, 5.0] and math.isnan(got[5]) and math.isnan(got[6])


def test_plot_names_the_extra_without_matplotlib(monkeypatch, tmp_path):
    monitor = _monitor()
    _run(monitor, [0.1])
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"taifuse\[plot\]"):
        monitor.plot(tmp_path / "run.png")
    assert not (tmp_path / "run.png").exists()


def test_plot_needs_a_step(tmp_path):
    with pytest.raises(ValueError, match="no step"):
        _monitor().plot(tmp_path / "run.png")


# ----------------------------------------------------------------------------- flags


def test_a_nonfinite_loss_is_flagged():
    monitor = _monitor()
    monitor.step(1.0, n=1)
    with pytest.warns(RuntimeWarning, match="step 2: the loss is nan") as caught:
        monitor.step(float("nan"), n=1)
    assert caught[0].filename == __file__  # the warning names the caller's line
    with pytest.warns(RuntimeWarning, match="step 3: the loss is -inf"):
        monitor.step(np.float32(-np.inf), n=1)
    monitor.step(0.5, n=1)
    assert [(f.step, f.kind) for f in monitor.flags] == [(2, "nonfinite_loss"), (3, "nonfinite_loss")]
    assert math.isnan(monitor.flags[0].value) and monitor.flags[1].value == -math.inf


def test_raise_on_nonfinite_records_the_step_then_raises():
    monitor = _monitor(raise_on_nonfinite=True)
    with pytest.warns(RuntimeWarning), pytest.raises(FloatingPointError, match="step 1"):
        monitor.step(float("inf"), n=1)
    assert len(monitor.history) == 1 and monitor.flags[0].kind == "nonfinite_loss"


def test_a_throughput_drop_is_flagged_once_by_the_documented_rule():
    # window 5, warm-up 2: checks from step 8 on (the window then holds no warm-up step), flags
    # from step 13 (5 earlier checked rates for the median). 40 steps of 10 samples at 0.1 s
    # (100 samples/s), then 0.5 s steps: with k slow steps in the window the rate is
    # 50 / (0.5 + 0.4 k), below 0.5 x 100 from k = 2, at step 42.
    monitor = _monitor(window=5, warmup=2, drop_fraction=0.5, drop_patience_s=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run(monitor, [5.0] + [0.1] * 39)  # a slow first step (compilation) is warm-up: no flag
        assert monitor.flags == []
        _run(monitor, [0.5] * 30)  # stays slow: flagged once, when it starts
        _run(monitor, [0.1] * 10)  # back to speed
    assert monitor.flags == [Flag(42, "throughput_drop", pytest.approx(50 / 1.3), monitor.flags[0].message)]
    assert "below 0.5 x its running median 100" in monitor.flags[0].message
    assert [str(w.message) for w in caught] == [monitor.flags[0].message]
    assert caught[0].filename == __file__
    # A second drop after the recovery is flagged again.
    with pytest.warns(RuntimeWarning, match="throughput"):
        _run(monitor, [0.5] * 5)
    assert [f.step for f in monitor.flags] == [42, 82]


def test_a_drop_is_flagged_once_it_has_lasted_drop_patience_s():
    # As above: below the threshold from step 42 (k = 2 slow steps of 0.5 s in the window of 5).
    # Five slow steps, then fast ones: below at steps 42-45 (0.5 s each) and 46-48 (0.1 s each,
    # while 3, 2 slow steps are still in the window: 50 / 1.7, 50 / 1.3 < 50), 2.3 s in all.
    slowdown = [0.1] * 40 + [0.5] * 5 + [0.1] * 20
    lasting = _monitor(window=5, warmup=2, drop_patience_s=1.0)
    with pytest.warns(RuntimeWarning, match=r"for 1 s of steps"):
        _run(lasting, slowdown)
    assert [f.step for f in lasting.flags] == [43]  # 0.5 s at step 42, 1.0 s at step 43
    brief = _monitor(window=5, warmup=2, drop_patience_s=2.35)
    _run(brief, slowdown)
    assert brief.flags == []
    edge = _monitor(window=5, warmup=2, drop_patience_s=2.25)  # reached at the last step below
    with pytest.warns(RuntimeWarning):
        _run(edge, slowdown)
    assert [f.step for f in edge.flags] == [48]


def test_jitter_and_a_short_stall_are_not_drops():
    monitor = _monitor(window=10, warmup=5)
    rng = np.random.default_rng(0)
    dts = list(0.1 * rng.uniform(0.8, 1.25, 200))
    dts[120] = 0.6  # one stall of six steps' time: the window's rate falls to 10/1.5 of normal
    _run(monitor, dts)
    assert monitor.flags == []


def test_the_drop_check_follows_steps_per_s_without_n():
    monitor = _monitor(window=2, warmup=0)
    _run(monitor, [0.1] * 6, n=None)
    with pytest.warns(RuntimeWarning, match="steps/s"):
        _run(monitor, [1.0] * 2, n=None)
    assert [f.kind for f in monitor.flags] == ["throughput_drop"]


# ----------------------------------------------------------------------------- memory


def test_pool_and_rss_figures_follow_a_known_allocation():
    with backends.preserved_choice():
        taifuse.set_backend("numpy")
        monitor = _monitor()
        before = monitor.step(1.0, n=1)
        block = pool.host_pool().acquire((1 << 20,), np.float32)  # 4 MiB, held
        # 64 MiB of fresh pages, touched: an anonymous map, since an allocator that keeps freed memory
        # (a test process that held much before this test) may serve np.ones from pages already resident.
        big = mmap.mmap(-1, 64 << 20)
        np.frombuffer(big, np.uint8).fill(1)
        after = monitor.step(1.0, n=1)
        for record in (before, after):
            assert record["pool_peak_bytes"] >= record["pool_in_use_bytes"] >= 0
        assert after["pool_in_use_bytes"] - before["pool_in_use_bytes"] >= 4 << 20
        assert after["pool_peak_bytes"] >= before["pool_in_use_bytes"] + (4 << 20)
        current, peak = process_memory()
        if sys.platform.startswith("linux"):
            assert after["rss_bytes"] - before["rss_bytes"] >= 60 << 20
            assert after["rss_peak_bytes"] >= after["rss_bytes"] and current > 0
        if peak is not None:
            assert after["rss_peak_bytes"] >= 64 << 20 and peak >= after["rss_peak_bytes"]
        del block
        big.close()
        monitor.close()


def test_the_rss_peak_is_never_below_the_current_rss():
    """Both from one snapshot: before, the peak came from getrusage's ru_maxrss (the kernel's
    approximate, per-CPU batched counters) and the current figure from statm (summed exactly), and the
    peak read below the current RSS in every row of train_mlp.py's log."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the current RSS is read on Linux only")
    monitor = _monitor(track_memory=True)
    held = []
    for i in range(200):
        held.append(np.ones(((i % 7 + 1) << 18) + (i % 29) * 4096, np.uint8))  # 0.25-1.9 MiB, touched
        if i % 3 == 2:
            del held[:2]
        record = monitor.step(1.0, n=1)
        assert record["rss_peak_bytes"] >= record["rss_bytes"] > 0, record
    current, peak = process_memory()
    assert peak >= current >= max(r["rss_bytes"] for r in monitor.history) // 2
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    assert int(status["VmHWM"].split()[0]) * 1024 >= monitor.history[-1]["rss_peak_bytes"]
    monitor.close()


def test_pool_figures_are_the_active_backends_pool(backend):
    backend.activate()
    monitor = _monitor()
    block = pool.empty(backends.active(), (1 << 18,), np.float32)  # 1 MiB on the backend's memory
    record = monitor.step(1.0, n=1)
    stats = pool.get_pool().stats()
    assert record["pool_in_use_bytes"] >= 1 << 20 and record["pool_peak_bytes"] >= record["pool_in_use_bytes"]
    assert record["pool_in_use_bytes"] <= stats.peak_bytes
    del block
    monitor.close()


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"total_steps": 0}, ValueError, "total_steps"),
        ({"total_steps": 2.5}, TypeError, "total_steps"),
        ({"unit": ""}, ValueError, "unit"),
        ({"unit": 3}, TypeError, "unit"),
        ({"log_path": "run.txt"}, ValueError, "log_path"),
        ({"log_path": 5}, TypeError, "log_path"),
        ({"window": 0}, ValueError, "window"),
        ({"warmup": -1}, ValueError, "warmup"),
        ({"drop_fraction": 1.0}, ValueError, "drop_fraction"),
        ({"drop_fraction": "half"}, TypeError, "drop_fraction"),
        ({"drop_patience_s": -1.0}, ValueError, "drop_patience_s"),
        ({"drop_patience_s": "1s"}, TypeError, "drop_patience_s"),
        ({"desc": 3}, TypeError, "desc"),
        ({"disable": 1}, TypeError, "disable"),
        ({"use_tqdm": "yes"}, TypeError, "use_tqdm"),
        ({"print_every": 0}, ValueError, "print_every"),
        ({"flush_every": True}, TypeError, "flush_every"),
        ({"raise_on_nonfinite": None}, TypeError, "raise_on_nonfinite"),
        ({"track_memory": "no"}, TypeError, "track_memory"),
        ({"keep_history": 0}, TypeError, "keep_history"),
        ({"initial_step": -1}, ValueError, "initial_step"),
        ({"clock": 1.0}, TypeError, "clock"),
    ],
)
def test_bad_constructor_arguments_raise_naming_them(kwargs, error, match, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error, match=match):
        TrainingMonitor(**kwargs)
    assert list(tmp_path.iterdir()) == []  # no log file was created


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (("1.0",), {}, TypeError, "loss"),
        ((np.ones(2),), {}, ValueError, "loss"),
        ((1.0,), {"n": -1}, ValueError, "n should"),
        ((1.0,), {"n": 1.5}, TypeError, "n should"),
        ((1.0,), {"n": True}, TypeError, "n should"),
        ((1.0,), {"lr": [0.1]}, TypeError, "lr"),
        ((1.0,), {"steps_per_s": 3.0}, ValueError, "steps_per_s"),
        ((1.0,), {"samples_per_s": 3.0}, ValueError, "samples_per_s"),
    ],
)
def test_bad_step_arguments_raise_before_anything_is_recorded(args, kwargs, error, match, tmp_path):
    path = tmp_path / "run.jsonl"
    monitor = _monitor(log_path=path)
    with pytest.raises(error, match=match):
        monitor.step(*args, **kwargs)
    monitor.close()
    assert monitor.history == [] and path.read_text() == ""


INT_ARGUMENTS = {
    "total_steps": 5,
    "window": 3,
    "warmup": 0,
    "print_every": 2,
    "flush_every": 2,
    "initial_step": 4,
}


@pytest.mark.parametrize("name", sorted(INT_ARGUMENTS))
def test_integer_arguments_take_numpy_integers_and_refuse_bools_and_floats(name, tmp_path):
    value = INT_ARGUMENTS[name]
    for kind in (np.int64, np.int32, np.uint8):
        monitor = _monitor(**{name: kind(value)})
        assert type(getattr(monitor, name)) is int and getattr(monitor, name) == value
        monitor.step(1.0, n=kind(3))
        assert type(monitor.history[0]["n"]) is int and monitor.history[0]["n"] == 3
        monitor.close()
    for bad in (True, np.True_, float(value), np.float64(value), "5"):
        with pytest.raises(TypeError, match=f"{name} should be an int"):
            _monitor(**{name: bad})
    for bad in (True, np.True_, 3.0, np.float32(3)):
        with pytest.raises(TypeError, match="n should be an int"):
            _monitor().step(1.0, n=bad)


def test_float_arguments_take_numpy_numbers():
    monitor = _monitor(drop_fraction=np.float32(0.25), drop_patience_s=np.int64(2))
    assert (monitor.drop_fraction, monitor.drop_patience_s) == (0.25, 2.0)
    for name in ("drop_fraction", "drop_patience_s"):
        with pytest.raises(TypeError, match=name):
            _monitor(**{name: np.True_})


def test_step_after_close_raises():
    monitor = _monitor()
    monitor.close()
    with pytest.raises(RuntimeError, match="close"):
        monitor.step(1.0)
