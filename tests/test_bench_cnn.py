"""The ``cnn`` benchmark suite and benchmarks/bench_cnn.py: every variant of every case computes
what its candidate computes (checked as the harness checks before timing, at a smoke size), the
sizes are issue 28's unless ``TAIFUSE_BENCH_CNN_SHAPE`` says otherwise, and the goals script
judges its rows and counts the block's bytes from ``taifuse._costs``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

import taifuse
from taifuse import _costs
from taifuse.bench.case import check_outputs
from taifuse.bench.suites import cnn, load_cases

ROOT = Path(__file__).resolve().parents[1]


def _bench_cnn():
    spec = importlib.util.spec_from_file_location("bench_cnn", ROOT / "benchmarks" / "bench_cnn.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_cnn"] = module
    spec.loader.exec_module(module)
    return module


def test_registered_at_issue_28s_sizes(monkeypatch):
    monkeypatch.delenv(cnn.SHAPE_ENV, raising=False)
    cases = load_cases(["cnn"], quick=True, compare_torch=True)
    assert [c.name for c in cases] == [
        "conv2d fwd+bwd(64, 3->32, 32x32, 3x3, padding=1)",
        "conv2d fwd+bwd(64, 32->64, 32x32, 3x3, padding=1)",
        "conv-bn-relu train(64, 32->64, 32x32, 3x3)",
        "conv-bn-relu eval folded(64, 32->64, 32x32, 3x3)",
        "cnn step(3x32x32, batch=64)",
        "cnn step compiled(3x32x32, batch=64)",
    ]
    assert [v.label for v in cases[-1].baselines] == ["taifuse eager", "torch"]
    for case in cases:
        torch_variant = case.variant("torch")
        assert torch_variant.isolated and torch_variant.peer
    train = cases[2]
    shape = _costs.ConvShape(64, 32, 32, 32, 64, 288, 1024)
    assert train.flops == 3 * shape.flops()
    assert train.bytes_moved == sum(
        _costs.conv2d_batch_norm(shape, backward=b).bytes_moved for b in (False, True)
    )


@pytest.mark.parametrize("text", ["4", "a,b", "1,8", "4,7"])
def test_a_bad_smoke_shape_is_refused(monkeypatch, text):
    monkeypatch.setenv(cnn.SHAPE_ENV, text)
    with pytest.raises(ValueError, match=cnn.SHAPE_ENV):
        cnn.cases()


@pytest.mark.parametrize("backend_name", ["numpy", "numba"])
def test_every_variant_computes_the_candidates_result(monkeypatch, backend_name):
    pytest.importorskip("torch")
    monkeypatch.setenv(cnn.SHAPE_ENV, "3,6")
    with taifuse.use_backend(backend_name):
        for case in cnn.cases(compare_torch=True):
            inputs = case.setup(0)
            expected = case.candidate.build(dict(inputs))().numpy()
            assert expected.size and np.isfinite(expected).all(), case.name
            for variant in case.baselines:
                got = variant.build(dict(inputs))().numpy()
                report = check_outputs(expected, got, case.rtol, case.atol)
                assert report["ok"], f"{case.name} vs {variant.label}: {report}"


def test_goals_read_the_torch_rows_and_a_smoke_run_meets_none():
    bench = _bench_cnn()
    rows = [
        {"id": f"cnn/{c.name}/torch", "value": 1.5, "low": 1.3, "high": 1.7, "verdict": "faster"}
        for c in cnn.cases(compare_torch=True)
    ]
    goals = bench.goals({"rows": rows})
    assert [g["status"] for g in goals] == ["met"] * 5
    assert goals[-1]["goal"].startswith("CNN training step under taifuse.compile")
    assert [g["status"] for g in bench.goals({"rows": rows}, 4, 8)] == ["not met"] * 5
    line = bench.block_bytes()
    assert "fused 142.8 MB" in line and "277.0 MB" in line  # docs/cnn.md quotes these counts


@pytest.mark.parametrize("backend_name", ["numpy", "numba"])
def test_the_compiled_step_replays_the_eager_step(backend_name):
    """The compiled row's step (the suite's CNN with its nn.ConvBnReLU2d blocks under
    taifuse.compile) gives the eager step's losses, parameters and running statistics over
    several replays, not only the first call the harness checks (which is the trace)."""
    with taifuse.use_backend(backend_name):
        arrays = cnn.cnn_inputs(0, 4, 6)
        runs = []
        for compiled in (False, True):
            model = cnn.taifuse_cnn(arrays)
            opt = taifuse.optim.AdamW(model.parameters(), lr=1e-2)

            def step(x, y, model=model, opt=opt):
                opt.zero_grad()
                loss = taifuse.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                return loss

            fn = taifuse.compile(step) if compiled else step
            x = taifuse.tensor(arrays["x"])
            losses = [fn(x, arrays["y"]).numpy().copy() for _ in range(5)]
            state = {k: v.numpy().copy() for k, v in model.state_dict().items()}
            runs.append((losses, state, fn))
        (eager_losses, eager_state, _), (losses, state, fn) = runs
        assert (fn.traces, fn.replays) == (1, 4)
        np.testing.assert_array_equal(losses, eager_losses)
        assert list(state) == list(eager_state)
        for key, value in eager_state.items():  # the running statistics and num_batches_tracked too
            np.testing.assert_array_equal(state[key], value, err_msg=key)
