"""taifuse.distributed and nn.parallel.DistributedDataParallel (issue 30), and the engine's gradient
hooks they stand on.

The multi-process cases launch tests/ddp_worker.py under ``mpiexec -n 2`` (the launcher the
``distributed`` extra installs next to the Python executable), each with a timeout, so that a hang
fails instead of blocking the suite. The world-of-one cases run in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import taifuse
from taifuse import _engine

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "ddp_worker.py"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
TIMEOUT = 240


ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}


def _mpiexec(
    *argv: str, timeout: float = TIMEOUT, script: Path = WORKER, cwd: Path | None = None, env: dict = ENV
):
    pytest.importorskip("mpi4py")
    if not MPIEXEC.exists():
        pytest.skip(f"no mpiexec next to {sys.executable} (pip install 'taifuse[distributed]')")
    return subprocess.run(
        [str(MPIEXEC), "-n", "2", sys.executable, str(script), *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
        cwd=cwd,
    )


def _results(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- two processes


@pytest.mark.parametrize("backend", ["numpy", "numba", "taichi-cpu"])
def test_ddp_matches_one_process_with_the_whole_batch(backend):
    """Under mpiexec -n 2 (tests/ddp_worker.py): after AdamW steps both ranks hold bit-identical
    parameters and optimizer state, equal (float32 tolerance) to one process trained on both ranks'
    batches together: plain, with no_sync() accumulation and under autocast + GradScaler +
    clip_grad_norm_ (host backends); on numpy also the overlap: two buckets' all-reduces start
    before the backward reaches the first layer."""
    results = _results(_mpiexec("train", backend))
    modes = ["plain"] if backend.startswith("taichi") else ["plain", "nosync", "autocast"]
    assert sorted(k for k in results if k != "overlap") == sorted(modes)
    if backend == "numpy":
        for events in results["overlap"]:  # without and with the optimizer's flat buffers
            assert "grad 0.weight" in events and sum(e.startswith("all_reduce") for e in events) >= 3


def test_a_rank_that_raises_ends_the_job_non_zero():
    proc = _mpiexec("raise", timeout=120)  # rank 0 waits in a barrier: only the abort ends it
    assert proc.returncode != 0
    assert "rank 1 fails on purpose" in proc.stderr


def test_mismatched_models_are_an_error_naming_the_parameter():
    error = _results(_mpiexec("mismatch"))["error"]
    assert "'0.weight' of shape (16, 8)" in error and "rank 1 has '0.weight' of shape (12, 8)" in error


def test_train_gpt_ddp_gives_the_one_process_model(tmp_path):
    """examples/train_gpt.py --ddp under mpiexec -n 2 (a tiny config) saves the model that one
    process training on the whole batches saves, and only rank 0 reports."""
    tiny = ["--backend", "numpy", "--steps", "3", "--n-layer", "1", "--n-embd", "16", "--n-head", "2"]
    tiny += [
        "--block-size",
        "16",
        "--batch-size",
        "4",
        "--eval-batches",
        "1",
        "--sample-tokens",
        "4",
        "--quiet",
    ]
    script = ROOT / "examples" / "train_gpt.py"
    one = subprocess.run(
        [sys.executable, str(script), *tiny, "--out", str(tmp_path / "one.safetensors")],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=TIMEOUT,
        check=False,
        cwd=ROOT / "examples",
    )
    assert one.returncode == 0, one.stderr[-3000:]
    two = _mpiexec(
        *tiny, "--ddp", "--out", str(tmp_path / "two.safetensors"), script=script, cwd=ROOT / "examples"
    )
    assert two.returncode == 0, two.stderr[-3000:]
    import taifuse

    states = [taifuse.load(tmp_path / f"{n}.safetensors")["model"] for n in ("one", "two")]
    assert states[0].keys() == states[1].keys()
    for name in states[0]:
        one_value, two_value = (np.asarray(getattr(s[name], "numpy", lambda v=s[name]: v)()) for s in states)
        np.testing.assert_allclose(two_value, one_value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_train_mlp_ddp_reaches_the_one_process_result():
    """examples/train_mlp.py --ddp under mpiexec -n 2 trains the one-process model (its held-out loss
    and accuracy, printed to 4 and 3 digits, the same), and only rank 0 reports them."""
    import re

    script = ROOT / "examples" / "train_mlp.py"
    args = ["--epochs", "2", "--backend", "numpy"]
    one = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=TIMEOUT,
        check=False,
    )
    two = _mpiexec(*args, "--ddp", script=script)
    held_out = re.compile(r"held-out loss ([0-9.]+), accuracy ([0-9.]+)")
    results = []
    for proc in (one, two):
        assert proc.returncode == 0, proc.stderr[-3000:]
        found = held_out.findall(proc.stdout + proc.stderr)
        assert len(found) == 1, proc.stdout[-2000:]  # one report: rank 0's
        results.append(found[0])
    assert results[0] == results[1]
    assert "data-parallel over 2 processes" in two.stdout + two.stderr


@pytest.mark.parametrize("chosen", [False, True])
def test_ranks_share_the_cores_unless_the_user_chose(chosen):
    """NOTE [ Threads per rank ]: with no thread variable set, init_process_group gives each of the
    2 ranks on this host max(1, CPUs // 2) Numba and BLAS threads (their pools default to every CPU:
    2 ranks on 2 cores ran ~6x slower), and sets the thread variables for the libraries loaded later;
    with NUMBA_NUM_THREADS set, nothing is changed."""
    from taifuse.distributed import THREAD_VARIABLES

    env = {k: v for k, v in ENV.items() if k not in THREAD_VARIABLES}
    cpus = len(os.sched_getaffinity(0))
    if chosen:
        env["NUMBA_NUM_THREADS"] = str(cpus)
    ranks = _results(_mpiexec("threads", env=env))["ranks"]
    assert len(ranks) == 2
    for r in ranks:
        share = max(1, r["cpus"] // 2)
        if chosen:
            assert r["numba"] == r["cpus"] and r["env"]["OMP_NUM_THREADS"] is None, ranks
        else:
            assert r["numba"] == share and r["blas"] and all(n == share for n in r["blas"]), ranks
            assert r["env"] == dict.fromkeys(THREAD_VARIABLES, str(share)), ranks


# ----------------------------------------------------------------------------- one process


def test_import_without_mpi4py_names_the_extra():
    code = "import sys; sys.modules['mpi4py'] = None\nimport taifuse.distributed"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0 and "pip install 'taifuse[distributed]'" in proc.stderr


@pytest.fixture
def world_of_one():
    pytest.importorskip("mpi4py")
    from taifuse import distributed as dist

    taifuse.set_backend("numpy")
    dist.init_process_group()
    yield dist
    dist.destroy_process_group()


def test_a_world_of_one(world_of_one):
    dist = world_of_one
    assert dist.is_initialized() and dist.get_rank() == 0 and dist.get_world_size() == 1
    with pytest.raises(RuntimeError, match="twice"):
        dist.init_process_group()
    x = np.arange(6, dtype=np.float32).reshape(2, 3)[:, ::2]  # strided: staged through the pool
    t = taifuse.tensor(np.ones(3, np.float16))
    for op in ("sum", "avg", "max"):
        dist.all_reduce(x, op=op)
        dist.all_reduce(t, op=op)
    np.testing.assert_array_equal(x, [[0, 2], [3, 5]])
    np.testing.assert_array_equal(t.numpy(), np.ones(3))
    outs = [np.zeros(2, np.float32)]
    dist.all_gather(outs, np.array([1.0, 2.0], np.float32))
    np.testing.assert_array_equal(outs[0], [1, 2])
    with pytest.raises(ValueError, match="op should be one of"):
        dist.all_reduce(x, op="prod")
    with pytest.raises(ValueError, match="src should be a rank"):
        dist.broadcast(x, src=1)
    with pytest.raises(TypeError, match="array should be a NumPy array"):
        dist.all_reduce([1.0, 2.0])


def test_ddp_in_a_world_of_one_leaves_gradients_and_names(world_of_one):
    from taifuse import nn
    from taifuse.nn.parallel import DistributedDataParallel

    taifuse.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    x = taifuse.tensor(np.ones((2, 3), np.float32))
    model(x).sum().backward()
    expected = [p.grad.numpy().copy() for p in model.parameters()]
    model.zero_grad()
    ddp = DistributedDataParallel(model, bucket_cap_mb=1e-5)
    assert next(n for n, _ in ddp.named_parameters()) == "module.0.weight"
    ddp(x).sum().backward()
    for p, g in zip(model.parameters(), expected):
        np.testing.assert_allclose(p.grad.numpy(), g, rtol=0, atol=0)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DistributedDataParallel(model, bucket_cap_mb=0)
    with pytest.raises(TypeError, match="module should be"):
        DistributedDataParallel(lambda x: x)


# ----------------------------------------------------------------------------- the engine's hooks


def test_post_accumulate_grad_hook_runs_once_after_the_last_contribution():
    taifuse.set_backend("numpy")
    w = taifuse.tensor(np.ones(3, np.float32), requires_grad=True)
    unused = taifuse.tensor(np.ones(3, np.float32), requires_grad=True)
    seen = []
    handle = w.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.numpy().tolist()))
    unused.register_post_accumulate_grad_hook(lambda t: seen.append("unused"))
    (w * 2 + w * w).sum().backward()  # two contributions: one call, with their sum
    assert seen == [[4.0, 4.0, 4.0]]
    w.sum().backward()  # added into the existing gradient: the hook sees the sum
    assert seen[-1] == [5.0, 5.0, 5.0] and len(seen) == 2
    handle.remove()
    (w * 3).sum().backward()
    assert len(seen) == 2
    with pytest.raises(RuntimeError, match="non-leaf"):
        (w * 2).register_post_accumulate_grad_hook(print)
    with pytest.raises(TypeError, match="callable"):
        unused.register_post_accumulate_grad_hook(3)
    with pytest.raises(RuntimeError, match="no backward is running"):
        _engine.queue_callback(print)


def test_queue_callback_runs_once_after_the_outermost_backward():
    from taifuse.checkpoint import checkpoint

    taifuse.set_backend("numpy")
    w = taifuse.tensor(np.ones(3, np.float32), requires_grad=True)
    v = taifuse.tensor(np.ones(3, np.float32), requires_grad=True)
    events = []

    def hook(t):
        events.append("w")
        _engine.queue_callback(lambda: events.append("end"))

    w.register_post_accumulate_grad_hook(hook)
    v.register_post_accumulate_grad_hook(lambda t: events.append("v"))
    y = checkpoint(lambda a: a * w, v)  # w's gradient comes from the backward inside the backward
    (y * 2).sum().backward()
    assert events == ["w", "v", "end"]


def test_hooks_stop_counting_once_their_tensors_are_gone():
    taifuse.set_backend("numpy")
    before = _engine._hooks.live
    w = taifuse.tensor(np.ones(3, np.float32), requires_grad=True)
    handle = w.register_post_accumulate_grad_hook(lambda t: None)
    w.register_post_accumulate_grad_hook(lambda t: None)
    assert _engine._hooks.live == before + 1
    handle.remove()
    assert _engine._hooks.live == before + 1
    del w, handle
    assert _engine._hooks.live == before  # the backward walks without counting again


def test_ddp_recovers_from_a_backward_that_raised(world_of_one):
    """A backward that raised after some buckets started (its end-of-backward callback dropped)
    leaves no stale state: the next backward syncs every bucket afresh."""
    from taifuse import nn
    from taifuse.nn.parallel import DistributedDataParallel

    taifuse.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    ddp = DistributedDataParallel(model, bucket_cap_mb=1e-5)  # a bucket per parameter
    x = taifuse.tensor(np.ones((2, 3), np.float32))

    def fail(p):
        raise KeyError("fails on purpose")

    handle = model[0].weight.register_post_accumulate_grad_hook(fail)
    with pytest.raises(KeyError, match="on purpose"):
        ddp(x).sum().backward()
    handle.remove()
    started = []
    ddp_start = ddp._start
    ddp._start = lambda bucket: started.append(bucket.index) or ddp_start(bucket)
    model.zero_grad()
    ddp(x).sum().backward()
    assert sorted(started) == list(range(len(ddp._buckets)))
    assert ddp._armed is None and all(b.ready == 0 and b.work is None for b in ddp._buckets)
