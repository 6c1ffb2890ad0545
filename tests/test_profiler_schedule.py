"""taifuse.profiler's schedule: torch.profiler.schedule's actions, step(), on_trace_ready, and what
a scheduled profile's results hold."""

from __future__ import annotations

import numpy as np
import pytest

import taifuse
import taifuse.functional as F
from taifuse import _profile_hook, backends, nn, optim
from taifuse.profiler import Ceilings, ProfilerAction, profile, record_function, schedule

CEILINGS = Ceilings(copy=((2**20, 50.0),), gemm_gflops=100.0, call_overhead_ns=5e3, source="test")

ARGS = [
    {"wait": 0, "warmup": 0, "active": 1},
    {"wait": 1, "warmup": 1, "active": 2},
    {"wait": 2, "warmup": 1, "active": 3, "repeat": 2},
    {"wait": 0, "warmup": 2, "active": 1, "repeat": 3, "skip_first": 4},
    {"wait": 3, "warmup": 0, "active": 2, "repeat": 1, "skip_first": 1},
]


@pytest.fixture(autouse=True)
def _keep_backend_choice():
    with backends.preserved_choice():
        taifuse.set_backend("numpy")
        yield


@pytest.mark.parametrize("kwargs", ARGS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_schedule_gives_torch_profilers_actions(kwargs):
    torch_profiler = pytest.importorskip("torch.profiler")
    with pytest.warns(UserWarning) if kwargs["warmup"] == 0 else _nothing():
        want = torch_profiler.schedule(**kwargs)
    got = schedule(**kwargs)
    assert [got(s).name for s in range(40)] == [want(s).name for s in range(40)]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_schedule_refuses_bad_arguments():
    with pytest.raises(ValueError, match="active"):
        schedule(wait=0, warmup=0, active=0)
    with pytest.raises(ValueError, match="wait"):
        schedule(wait=-1, warmup=0, active=1)
    with pytest.raises(TypeError, match="repeat"):
        schedule(wait=0, warmup=0, active=1, repeat=1.5)
    with pytest.raises(TypeError, match="schedule"):
        profile(schedule=3)


def _run(prof, steps, log):
    """`steps` steps, step i one relu on an array of i + 1 elements; log the actions."""
    with prof:
        for i in range(steps):
            log.append(prof.current_action)
            F.relu(np.ones(i + 1, np.float32))
            prof.step()


def test_a_scheduled_profile_records_only_the_active_steps():
    # wait 2, warmup 1, active 3, once: steps 3, 4, 5 are recorded; step 2 (warmup) is dropped.
    ready = []
    prof = profile(
        ceilings=CEILINGS,
        schedule=schedule(wait=2, warmup=1, active=3, repeat=1),
        on_trace_ready=lambda p: ready.append(sorted(e.shapes[0] for e in p.events() if e.kind == "op")),
    )
    log = []
    _run(prof, 8, log)
    A = ProfilerAction
    assert log == [A.NONE, A.NONE, A.WARMUP, A.RECORD, A.RECORD, A.RECORD_AND_SAVE, A.NONE, A.NONE]
    assert ready == [[(4,), (5,), (6,)]]  # called once, at the end of the active cycle
    ops = [e for e in prof.events() if e.kind == "op"]
    assert [e.shapes[0] for e in ops] == [(4,), (5,), (6,)]
    steps = [e for e in prof.events() if e.kind == "range"]
    assert [e.name for e in steps] == ["ProfilerStep#3", "ProfilerStep#4", "ProfilerStep#5"]
    for op, st in zip(ops, steps):  # each step's range encloses its op
        assert st.start_ns <= op.start_ns and op.end_ns <= st.end_ns and op.depth == st.depth + 1
    # The wall time is the active steps': it holds their ranges and little else.
    assert sum(e.duration_ns for e in steps) <= prof.wall_ns
    assert [r.count for r in prof.key_averages() if r.name == "relu"] == [3]
    assert _profile_hook.ACTIVE is None


def test_each_cycle_is_delivered_and_starts_afresh():
    ready = []
    prof = profile(
        ceilings=CEILINGS,
        schedule=schedule(wait=1, warmup=0, active=2, repeat=2),
        on_trace_ready=lambda p: ready.append([e.shapes[0][0] for e in p.events() if e.kind == "op"]),
    )
    _run(prof, 9, [])
    assert ready == [[2, 3], [5, 6]]
    assert [e.shapes[0][0] for e in prof.events() if e.kind == "op"] == [5, 6]  # the last cycle


def test_stop_while_recording_delivers_the_partial_cycle():
    ready = []
    prof = profile(
        ceilings=CEILINGS, schedule=schedule(wait=0, warmup=1, active=5), on_trace_ready=ready.append
    )
    _run(prof, 3, [])  # warmup step 0, then steps 1 and 2 recorded, then stop
    assert ready == [prof]
    assert [e.shapes[0][0] for e in prof.events() if e.kind == "op"] == [2, 3]


def test_a_schedule_drops_the_first_optimizer_steps_bucket_build():
    # Issue 25 #5: the first AdamW step builds its buckets; a schedule that waits a step leaves it out.
    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = optim.AdamW(model.parameters(), lr=1e-3)
    x = taifuse.tensor(rng.standard_normal((4, 4), dtype=np.float32))
    with profile(ceilings=CEILINGS, schedule=schedule(wait=1, warmup=1, active=2)) as prof:
        for _ in range(4):
            with record_function("train step"):
                opt.zero_grad()
                model(x).sum().backward()
                opt.step()
            prof.step()
    names = [e.name for e in prof.events() if e.kind != "pool"]
    assert names.count("ProfilerStep#2") == names.count("ProfilerStep#3") == 1
    assert names.count("train step") == 2 and names.count("AdamW.step") >= 2
    assert "ProfilerStep#0" not in names and "ProfilerStep#1" not in names


def test_step_needs_a_running_profile():
    with pytest.raises(RuntimeError, match="not running"):
        profile(schedule=schedule(wait=0, warmup=0, active=1)).step()


def test_a_range_opened_in_the_warmup_is_dropped_with_it():
    prof = profile(ceilings=CEILINGS, schedule=schedule(wait=0, warmup=1, active=2))
    outer = record_function("across the warmup")
    with prof:
        outer.__enter__()
        F.relu(np.ones(1, np.float32))
        prof.step()  # warmup -> record
        F.relu(np.ones(2, np.float32))
        outer.__exit__(None, None, None)
        prof.step()
    events = [e for e in prof.events() if e.kind != "pool"]
    assert [(e.name, e.depth) for e in events] == [("ProfilerStep#1", 0), ("relu", 1), ("ProfilerStep#2", 0)]
    assert all(0 <= e.start_ns <= e.end_ns <= prof.wall_ns for e in events)
