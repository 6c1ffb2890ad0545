"""The benchmark statistics on synthetic samples, and the correctness gate of the harness."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from taifuse import backends
from taifuse.bench import harness, stats, timing
from taifuse.bench.case import Case, Variant, check_outputs
from taifuse.bench.worker import measure_case, measure_solo

PROCESSES, PAIRS = 5, 30


@pytest.fixture(autouse=True)
def _numpy_backend():
    """measure_case records the active backend, which starts whatever the process chose last (a
    Taichi re-initialisation, or a fallback warning when an earlier test left a bad choice): these
    cases run NumPy code only, so this thread uses the numpy backend, which starts nothing."""
    with backends.use_backend("numpy"):
        yield


def synthetic_times(ratio: float, *, noise: float = 0.03, process_noise: float = 0.10, seed: int = 0):
    """Per-process candidate/baseline times with a true speedup ``ratio`` (baseline = ratio x candidate).

    Each process gets its own speed factor (shared by both sides, as a slow process slows both);
    each sample gets independent lognormal noise.
    """
    rng = np.random.default_rng(seed)
    cand, base = [], []
    for _ in range(PROCESSES):
        speed = np.exp(rng.normal(0.0, process_noise))
        cand.append(1e6 * speed * np.exp(rng.normal(0.0, noise, PAIRS)))
        base.append(1e6 * speed * ratio * np.exp(rng.normal(0.0, noise, PAIRS)))
    return cand, base


@pytest.mark.parametrize("ratio", [0.25, 0.8, 1.0, 1.3, 2.0, 7.5])
def test_known_ratio_lands_inside_interval(ratio):
    cand, base = synthetic_times(ratio, seed=int(ratio * 100))
    est = stats.speedup(cand, base)
    assert est.low <= ratio <= est.high
    assert est.low <= est.median <= est.high
    assert (est.n_processes, est.n_samples) == (PROCESSES, PROCESSES * PAIRS)


def test_interval_covers_true_ratio_in_most_experiments():
    covered = 0
    trials = 40
    for seed in range(trials):
        cand, base = synthetic_times(1.5, noise=0.05, seed=1000 + seed)
        est = stats.speedup(cand, base, seed=seed)
        covered += est.low <= 1.5 <= est.high
    # A 95% interval from 5 processes: allow some under-coverage, but not a broken interval.
    assert covered / trials >= 0.85


def test_a_vs_a_says_no_measurable_difference():
    cand, _ = synthetic_times(1.0, seed=7)
    rng = np.random.default_rng(9)
    # The same code on both sides: same process speed, independent sample noise.
    again = [c * np.exp(rng.normal(0.0, 0.03, c.size)) for c in cand]
    est = stats.speedup(cand, again)
    assert stats.verdict(est, stats.threshold()) == stats.NO_DIFFERENCE
    assert stats.control_spread(est) < stats.MIN_EFFECT


def test_planted_2x_says_faster_and_half_says_slower():
    cand, base = synthetic_times(2.0, seed=3)
    assert stats.verdict(stats.speedup(cand, base), stats.threshold()) == stats.FASTER
    assert stats.verdict(stats.speedup(base, cand), stats.threshold()) == stats.SLOWER


def test_wild_dispersion_says_unstable():
    cand, base = synthetic_times(2.0, noise=0.8, seed=4)
    est = stats.speedup(cand, base)
    assert est.dispersion > stats.UNSTABLE_DISPERSION
    assert stats.verdict(est, stats.threshold()) == stats.UNSTABLE


def test_verdict_boundaries():
    def est(low, high):
        return stats.Estimate(
            median=(low + high) / 2, low=low, high=high, n_processes=5, n_samples=100, dispersion=0.01
        )

    assert stats.verdict(est(1.06, 1.2), 0.05) == stats.FASTER
    assert stats.verdict(est(1.0, 1.1), 0.05) == stats.INCONCLUSIVE
    assert stats.verdict(est(0.97, 1.04), 0.05) == stats.NO_DIFFERENCE
    assert stats.verdict(est(0.5, 0.9), 0.05) == stats.SLOWER
    # A noisy A/A control raises the bar: an 8% speedup is no longer a difference.
    control = est(0.9, 1.12)
    limit = stats.threshold(control)
    assert limit == pytest.approx(0.12)
    assert stats.verdict(est(1.08, 1.1), limit) == stats.NO_DIFFERENCE
    assert "verified" not in " ".join(stats.VERDICTS)


def test_bootstrap_is_seeded_and_handles_unequal_processes():
    groups = [np.arange(1.0, 11.0), np.arange(1.0, 4.0), np.array([5.0])]
    a = stats.bootstrap_distribution(groups, seed=1, resamples=500)
    b = stats.bootstrap_distribution(groups, seed=1, resamples=500)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (500,)
    assert np.all((a >= 1.0) & (a <= 10.0))


def test_resampling_processes_widens_interval_when_processes_disagree():
    # Same pairs noise, but processes that disagree by 20%: the interval must reflect it.
    steady = [np.full(PAIRS, 2.0) * np.exp(np.random.default_rng(s).normal(0, 0.02, PAIRS)) for s in range(5)]
    spread = [g * f for g, f in zip(steady, (0.8, 0.9, 1.0, 1.1, 1.2))]
    assert stats.estimate(spread).high - stats.estimate(spread).low > 3 * (
        stats.estimate(steady).high - stats.estimate(steady).low
    )


def test_change_between_runs():
    cand, base = synthetic_times(2.0, seed=11)
    ratios = [b / a for a, b in zip(cand, base)]
    same = stats.change(ratios, ratios)
    assert same.low <= 1.0 <= same.high
    assert stats.verdict(same, stats.threshold()) == stats.NO_DIFFERENCE
    halved = stats.change([r / 2 for r in ratios], ratios)
    assert stats.verdict(halved, stats.threshold()) == stats.SLOWER


def test_pair_ratios_rejects_bad_input():
    with pytest.raises(ValueError, match="one sample per pair"):
        stats.pair_ratios([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="positive"):
        stats.pair_ratios([0.0], [1.0])
    with pytest.raises(ValueError, match="at least one"):
        stats.estimate([[]])


def _tiny_case(
    baseline_code: str, *, names: tuple[str, str] = ("good", "wrong"), isolated: bool = False
) -> Case:
    """x * 2 against x + x and against ``baseline_code`` (the second baseline, isolated if asked)."""
    return Case(
        suite="test",
        name="double",
        setup=lambda seed: {"x": np.random.default_rng(seed).random(4096)},
        setup_code="x = rng.random(4096)",
        candidate=Variant("candidate", "np.multiply(x, 2.0, out=out)", prepare="out = np.empty_like(x)"),
        baselines=(
            Variant(names[0], "np.add(x, x, out=out)", prepare="out = np.empty_like(x)"),
            Variant(names[1], baseline_code, prepare="out = np.empty_like(x)", isolated=isolated),
        ),
        dtype="float64",
        shape="(4096,)",
        bytes_moved=2 * 8 * 4096,
    )


def test_planted_mismatch_fails_the_row_and_is_never_timed():
    case = _tiny_case("np.multiply(x, 2.001, out=out)")
    pairs = harness.comparisons(case, control=True)
    run = measure_case(case, pairs, blocks=3, min_sample_ns=100_000)
    assert run["failed"] == ["wrong"]
    assert not run["checks"]["wrong"]["ok"] and run["checks"]["good"]["ok"]
    assert "candidate|wrong" not in run["samples"]
    assert len(run["samples"]["candidate|good"]["a"]) == 3
    rows = harness.case_rows(case, [run, run], {"copy_gbps": 10.0, "gemm_gflops": 100.0}, 0.05, control=True)
    by_label = {r["baseline"]["label"]: r for r in rows if r["kind"] in ("compare", "control")}
    assert by_label["wrong"]["verdict"] == stats.FAILED
    assert by_label["wrong"]["value"] is None
    assert by_label["good"]["value"] is not None and by_label["good"]["verdict"] in stats.VERDICTS
    assert by_label["candidate"]["kind"] == "control"


def test_check_outputs_catches_shape_and_dtype():
    x = np.ones(4, dtype=np.float32)
    assert check_outputs(x, x.copy(), 1e-6, 1e-6)["ok"]
    assert "dtype" in check_outputs(x, x.astype(np.float64), 1e-6, 1e-6)["reason"]
    assert "shape" in check_outputs(x, x[:3], 1e-6, 1e-6)["reason"]
    assert not check_outputs(x, x + 1e-3, 1e-6, 1e-6)["ok"]


def test_a_case_floor_of_calls_per_sample_holds_in_both_kinds_of_process():
    # Case.min_loops: each sample is at least that many calls, also when fewer would fill
    # min_sample_ns (the step suite's per-op rows: NOTE [ Per-op timing ]); times stay per call.
    calls = []
    assert timing.calibrate(lambda: calls.append(1), min_sample_ns=1, min_loops=250) == 250
    assert len(calls) == 250  # one try: 250 calls already last longer than 1 ns
    assert timing.calibrate(lambda: None, min_sample_ns=1) == 1
    case = dataclasses.replace(_isolated_case(), min_loops=300)
    run = measure_case(case, harness.comparisons(case, True), 2, 1, check_only=["apart"])
    assert run["loops"] == {"candidate": 300, "near": 300}
    assert len(run["samples"]["candidate|near"]["a"]) == 2
    solo = measure_solo(case, "apart", blocks=2, min_sample_ns=1)
    assert solo["loops"] == 300 and len(solo["samples"]) == 2


# ----------------------------------------------------------------------------- isolated baselines


def _isolated_case(wrong: bool = False) -> Case:
    code = "np.multiply(x, 2.001, out=out)" if wrong else "np.add(x, x, out=out)"
    return _tiny_case(code, names=("near", "apart"), isolated=True)


def _solo(case: Case, ratio: float, seed: int = 0) -> list[dict]:
    """Synthetic solo processes: per index, the candidate twice and the isolated baseline at ``ratio``."""
    cand, base = synthetic_times(ratio, seed=seed)
    again, _ = synthetic_times(1.0, seed=seed + 1)
    return [
        {
            "candidate": {"samples": list(c), "loops": 1},
            harness.CANDIDATE_AGAIN: {"samples": list(a), "loops": 1},
            "apart": {"samples": list(b), "loops": 1},
        }
        for c, b, a in zip(cand, base, again)
    ]


def test_isolated_baselines_are_checked_in_process_but_never_timed_there():
    case = _isolated_case()
    pairs = harness.comparisons(case, control=True)
    assert ("candidate", "apart") not in pairs and ("candidate", "near") in pairs
    run = measure_case(case, pairs, blocks=2, min_sample_ns=100_000, check_only=harness.isolated_labels(case))
    assert run["checks"]["apart"]["ok"]
    assert all("apart" not in key for key in run["samples"]) and "apart" not in run["loops"]


def test_solo_processes_alternate_and_are_counted():
    case = _isolated_case()
    assert harness._solo_order(case, 0) == ["candidate", "apart", harness.CANDIDATE_AGAIN]
    assert harness._solo_order(case, 1) == [harness.CANDIDATE_AGAIN, "apart", "candidate"]
    # per index: one main process, then the candidate twice and the isolated baseline alone
    assert harness.worker_count(case, 5) == 5 * (1 + 3)
    assert harness.worker_count(_tiny_case("np.add(x, x, out=out)"), 5) == 5


@pytest.mark.parametrize(
    ("ratio", "verdict"), [(2.0, stats.FASTER), (1.0, stats.NO_DIFFERENCE), (0.5, stats.SLOWER)]
)
def test_isolated_rows_pair_processes_of_one_index(ratio, verdict):
    case = _isolated_case()
    run = measure_case(case, harness.comparisons(case, False), 2, 100_000, check_only=["apart"])
    rows = harness.case_rows(
        case, [run], {"copy_gbps": 10.0, "gemm_gflops": 100.0}, 0.05, control=False, solo=_solo(case, ratio)
    )
    by_id = {r["id"]: r for r in rows}
    row = by_id["test/double/apart"]
    assert "isolated" in row["label"] and row["check"]["ok"]
    assert row["low"] <= ratio <= row["high"] and row["verdict"] == verdict
    assert row["n_processes"] == PROCESSES
    control = by_id["test/double/control-isolated"]
    assert control["kind"] == "control" and control["low"] <= 1.0 <= control["high"]
    assert by_id["test/double/near"]["kind"] == "compare"  # the in-process baseline keeps its row


def test_an_isolated_baseline_with_wrong_output_fails_and_is_not_timed():
    case = _isolated_case(wrong=True)
    run = measure_case(case, harness.comparisons(case, False), 2, 100_000, check_only=["apart"])
    assert run["failed"] == ["apart"]
    rows = harness.case_rows(
        case, [run], {"copy_gbps": 10.0, "gemm_gflops": 100.0}, 0.05, control=False, solo=_solo(case, 2.0)
    )
    row = {r["id"]: r for r in rows}["test/double/apart"]
    assert row["verdict"] == stats.FAILED and row["value"] is None


def test_memory_rows_from_synthetic_processes():
    # The peak-memory suite's rows: per-variant medians of the measured peaks, the paired ratio,
    # and the same header fields as a timing row (thread counts and backend from the runs).
    from taifuse.bench.suites import memory

    (case,) = memory.cases(quick=True)
    plain, checkpointed = (v.label for v in case.variants[:2])
    runs = []
    for p in range(3):
        for label, mib in ((plain, 150 + p), (checkpointed, 50 + p)):
            runs.append(
                {
                    "variant": label,
                    "process": p,
                    "rss_peak_bytes": mib * memory.MIB,
                    "traced_peak_bytes": (mib - 1) * memory.MIB,
                    "step_ns": 1e8,
                    "threads": {"numba": 2},
                    "backend": "numba",
                }
            )
    rows = {r["id"]: r for r in case.rows(runs)}
    for row in rows.values():
        assert row["suite"] == case.suite and row["seed"] == case.seed and row["cache_level"] == "DRAM"
        assert row["threads"] == {"numba": 2} and row["backend"] == "numba"
        assert row["roofline"] is None and row["tolerance"] is None and row["bytes_moved"] is None
    assert rows[f"{case.id}/{plain}"]["value"] == pytest.approx(151.0)
    assert rows[f"{case.id}/{checkpointed}"]["value"] == pytest.approx(51.0)
    pair = rows[f"{case.id}/{checkpointed} vs {plain}"]
    assert pair["low"] <= 151.0 / 51.0 <= pair["high"] and pair["verdict"] == "less memory"


def test_goal_judgement_on_an_interval():
    # The goal scripts' one rule: met when the whole interval satisfies the bound, not met when
    # none of it does, undecided when it straddles; the bound itself counts as satisfied.
    from taifuse.bench.report import judge

    assert judge(1.0, 1.2, at_least=1.0) == "met"
    assert judge(0.8, 0.99, at_least=1.0) == "not met"
    assert judge(0.9, 1.1, at_least=1.0) == "undecided"
    assert judge(1.0, 1.1, at_most=1.1) == "met"
    assert judge(1.11, 1.3, at_most=1.1) == "not met"
    assert judge(1.05, 1.15, at_most=1.1) == "undecided"
    for bounds in ({}, {"at_least": 1.0, "at_most": 2.0}):
        with pytest.raises(ValueError, match="exactly one"):
            judge(0.9, 1.1, **bounds)


# ------------------------------------------------------ two runs (NOTE [ Comparing two runs ])


@pytest.mark.parametrize(("df", "quantile"), [(1, 12.706), (2, 4.303), (4, 2.776), (8, 2.306), (30, 2.042)])
def test_t_quantile_matches_the_tables(df, quantile):
    assert stats.t_quantile(0.975, df) == pytest.approx(quantile, abs=1e-3)


def test_run_change_counts_processes_not_pairs():
    # Many tight pairs cannot narrow the interval: three processes per run give 4 degrees of freedom.
    rng = np.random.default_rng(0)
    old = [2.0 * f * np.exp(rng.normal(0, 0.01, 500)) for f in (0.9, 1.0, 1.1)]
    new = [1.0 * f * np.exp(rng.normal(0, 0.01, 500)) for f in (1.1, 0.9, 1.0)]
    c = stats.run_change(new, old)
    assert c.df == 4 and np.exp(c.log_change) == pytest.approx(0.5, rel=0.01)
    assert c.variance == pytest.approx(np.var(np.log([0.9, 1.0, 1.1]), ddof=1) * 2 / 3, rel=0.1)
    est = stats.change_estimate(c, 0.0)
    assert est.low < 0.5 < est.high and est.high / est.low > 1.4
    with pytest.raises(ValueError, match="three processes"):
        stats.run_change([[1.0, 1.1]], [[1.0, 1.2]])


def test_run_to_run_spread_floor_few_rows_and_outliers():
    def rows(log_changes, variance=0.0):
        return [stats.RunChange(d, variance, 4, 3, 24, 0.05) for d in log_changes]

    assert stats.run_to_run(rows([0.5, -0.5])) == stats.RUN_TO_RUN_FLOOR  # too few rows to say more
    wide = np.random.default_rng(1).normal(0.0, 0.4, 200)
    assert 0.33 < stats.run_to_run(rows(wide)) < 0.47
    # A few real regressions among quiet rows do not widen everyone's interval ...
    assert stats.run_to_run(rows([0.0] * 10 + [-0.7, -0.7])) == stats.RUN_TO_RUN_FLOOR
    # ... nor does a shift of every row, and the processes' own share is not counted twice.
    assert stats.run_to_run(rows(wide - 0.7)) == pytest.approx(stats.run_to_run(rows(wide)))
    assert stats.run_to_run(rows(wide, variance=0.1)) < stats.run_to_run(rows(wide))


def test_change_verdict_boundaries():
    def est(low, high, dispersion=0.01):
        return stats.Estimate(median=(low * high) ** 0.5, low=low, high=high, n_processes=3, n_samples=24,
                              dispersion=dispersion)

    assert stats.change_verdict(est(0.4, 0.9), 0.1) == stats.SLOWER
    assert stats.change_verdict(est(0.4, 0.95), 0.1) == stats.INCONCLUSIVE  # moved, not provably by 10%
    assert stats.change_verdict(est(0.4, 1.05), 0.1) == stats.NO_DIFFERENCE  # no change measurable
    assert stats.change_verdict(est(0.93, 0.97), 0.1) == stats.NO_DIFFERENCE  # a change under 10%
    assert stats.change_verdict(est(1.05, 1.3), 0.1) == stats.INCONCLUSIVE
    assert stats.change_verdict(est(1.12, 1.3), 0.1) == stats.FASTER
    assert stats.change_verdict(est(0.4, 0.9, dispersion=0.5), 0.1) == stats.UNSTABLE
