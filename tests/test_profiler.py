"""taifuse.profiler: it sees every op of a training step, its times add up, its byte and FLOP
counts are the hand-computed ones, the trace is valid Trace Event JSON, ranges nest, and the
``taifuse profile`` command runs a script."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest

import taifuse
import taifuse.functional as F
from taifuse import _costs, _profile_hook, backends, nn, optim
from taifuse.profiler import Ceilings, profile, record_function
from taifuse.tensor import Function, Tensor

# Fixed ceilings so that no test measures the machine (the bound column is tested on its own rule).
CEILINGS = Ceilings(
    copy=((2**20, 50.0), (2**28, 20.0)), gemm_gflops=100.0, call_overhead_ns=5e3, source="test"
)


@pytest.fixture(autouse=True)
def _keep_backend_choice():
    # The tests below pick the numpy backend; hand the next test what it had.
    with backends.preserved_choice():
        yield


def _mlp(rng: np.random.Generator) -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32, activation="gelu"), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _graph_nodes(root: Tensor) -> list:
    """Every Function node of root's graph (each once). A node's parents hold the creators of its
    non-leaf inputs (NOTE [ The graph keeps no data ] in taifuse/_engine.py)."""
    seen, stack, nodes = set(), [root._ctx], []
    while stack:
        ctx = stack.pop()
        if not isinstance(ctx, Function) or id(ctx) in seen:
            continue
        seen.add(id(ctx))
        nodes.append(ctx)
        stack.extend(ctx.parents)
    return nodes


def _step(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    nodes = _graph_nodes(loss)
    loss.backward()
    opt.step()
    return nodes


def test_profiler_sees_every_op_of_a_training_step(backend):
    rng = np.random.default_rng(0)
    model = _mlp(rng)
    opt = optim.AdamW(model.parameters(), lr=1e-3)
    x = taifuse.tensor(rng.standard_normal((8, 16), dtype=np.float32))
    y = rng.integers(0, 4, 8)
    _step(model, opt, x, y)  # the optimizer's state exists from here on
    with profile(ceilings=CEILINGS) as prof:
        nodes = _step(model, opt, x, y)
    events = prof.events()
    names = sorted(type(n).__name__ for n in nodes)
    forward = [e for e in events if e.kind == "op"]
    backward = [e for e in events if e.kind == "backward"]
    # Every node of the graph is one forward event and one backward event; the step is one fused
    # update per run of its buckets (one flat run on the host backends, one per parameter on taichi).
    assert len(forward) == len(nodes) == len(backward), (names, [e.name for e in forward])
    assert sorted(e.name for e in backward) == sorted(e.name + "_backward" for e in forward)
    runs = sum(len(bucket.runs()) for buckets in opt._buckets for bucket in buckets)
    assert runs >= 1
    assert [e.name for e in events if e.kind == "optimizer"] == ["AdamW.step"] * runs
    assert {e.backend for e in forward} == {taifuse.get_backend()}
    assert any(e.kind == "pool" for e in events)


def test_disabled_profiler_records_nothing():
    taifuse.set_backend("numpy")
    x = np.ones(512, np.float32)  # 2 KiB: a pooled output (NOTE [ Small host buffers ] in pool.py)
    with profile(ceilings=CEILINGS) as prof:
        F.relu(x)
    assert _profile_hook.ACTIVE is None
    before = len(prof.events())
    F.relu(x)
    F.gelu(taifuse.tensor(x, requires_grad=True)).sum().backward()
    assert len(prof.events()) == before == 2  # the relu and its output buffer's acquisition


def test_times_add_up_to_the_wall_time():
    taifuse.set_backend("numpy")
    rng = np.random.default_rng(1)
    w = taifuse.tensor(rng.standard_normal((256, 256), dtype=np.float32), requires_grad=True)
    x = taifuse.tensor(rng.standard_normal((512, 256), dtype=np.float32))
    with profile(ceilings=CEILINGS) as prof, record_function("step"):
        h = F.linear(x, w, activation="gelu")
        F.linear(h, w).sum().backward()
    timed = [e for e in prof.events() if e.kind != "pool"]
    top = [e for e in timed if e.depth == 0]
    assert [e.name for e in top] == ["step"]
    # Self times partition the outermost events' time exactly (integer nanoseconds).
    assert sum(e.self_ns for e in timed) == sum(e.duration_ns for e in top)
    # The region is one range around the ops: everything but the profile's own entry and exit is
    # inside it. Slack: at most 20% of the wall time outside it (measured: well under 1%).
    assert 0.8 * prof.wall_ns <= top[0].duration_ns <= prof.wall_ns
    ops = sum(e.duration_ns for e in timed if e.kind in ("op", "backward"))
    assert 0.5 * top[0].duration_ns <= ops <= top[0].duration_ns


def test_linear_cost_is_hand_computed():
    taifuse.set_backend("numpy")
    rng = np.random.default_rng(2)
    x = taifuse.tensor(rng.standard_normal((8, 16), dtype=np.float32), requires_grad=True)
    w = taifuse.tensor(rng.standard_normal((4, 16), dtype=np.float32), requires_grad=True)
    b = taifuse.tensor(np.zeros(4, np.float32), requires_grad=True)
    with profile(ceilings=CEILINGS) as prof:
        F.linear(x, w, b).sum().backward()
    fwd = next(e for e in prof.events() if e.name == "linear")
    bwd = next(e for e in prof.events() if e.name == "linear_backward")
    # Forward: read x (8x16), w (4x16), b (4), write y (8x4), float32; 2*8*16*4 flops.
    assert fwd.cost == (4 * (128 + 64 + 4 + 32), 4 * 32, 2 * 8 * 16 * 4)
    # Backward: read x, w, grad_out; write gx, gw, gb; two products.
    assert bwd.cost == (4 * (128 + 64 + 32 + 128 + 64 + 4), 4 * (128 + 64 + 4), 2 * 2 * 8 * 16 * 4)
    # The array path counts the same as the Tensor path.
    with profile(ceilings=CEILINGS) as prof2:
        F.linear(x.numpy(), w.numpy(), b.numpy())
    assert next(e for e in prof2.events() if e.name == "linear").cost == fwd.cost


def test_a_passed_through_gradient_costs_nothing():
    taifuse.set_backend("numpy")
    a = taifuse.tensor(np.ones((4, 8), np.float32), requires_grad=True)
    b = taifuse.tensor(np.ones((4, 8), np.float32), requires_grad=True)
    with profile(ceilings=CEILINGS) as prof:
        (a * b + a).sum().backward()
    costs = {e.name: e.cost for e in prof.events() if e.kind == "backward"}
    assert costs["add_backward"] == (0, 0, 0)  # add hands its gradient on as it came
    # mul reads the gradient and both inputs, writes both gradients.
    assert costs["mul_backward"] == (4 * 32 * 5, 4 * 32 * 2, 0)


def test_views_move_nothing_and_a_splits_backward_moves_its_slices():
    # NOTE [ Views move no bytes ] in taifuse/profiler.py: a host view and a view of the
    # gradient ran no kernel; a split's backward reads its slice's gradient (not the forward's
    # input) and writes a zeroed gradient of the input's shape, or adds into the sum so far.
    taifuse.set_backend("numpy")
    x = taifuse.tensor(np.ones((8, 16), np.float32), requires_grad=True)
    with profile(ceilings=CEILINGS) as prof:
        h = x * 2.0  # not a leaf: the engine sums its gradient in place (as c_attn's output's)
        q, k = h.split(4, dim=0)  # two (4, 16) row slices of 256 bytes; h is 512
        ((q.reshape(64) * k.reshape(64)).sum() + k.t().sum()).backward()
    costs = {}
    for e in prof.events():
        if e.kind in ("op", "backward"):
            costs.setdefault(e.name, []).append(e.cost)
    # The split's slices, the reshapes of contiguous slices, the transpose, and the backwards that
    # hand back a view of the gradient (the reshapes' of mul's fresh gradients, the transpose's).
    for name in ("strided", "reshape", "transpose", "reshape_backward", "transpose_backward"):
        assert costs[name] and all(c == (0, 0, 0) for c in costs[name]), (name, costs[name])
    assert costs["mul"][-1] == (3 * 256, 256, 0)  # a kernel that ran is counted as before
    slice_bytes = 4 * 64  # bytes of a (4, 16) float32 slice
    # The first slice's backward: read its gradient, write h's whole gradient (zeros and the slice);
    # the second adds into that sum: read its gradient and the slice of the sum, write the slice.
    assert sorted(costs["strided_backward"]) == sorted(
        [(slice_bytes + 2 * slice_bytes, 2 * slice_bytes, 0), (3 * slice_bytes, slice_bytes, 0)]
    )
    grad = x.grad.numpy()
    expected = np.full((8, 16), 4.0, np.float32)  # d/dx through h = 2x: q's rows 2 * k = 2 * 2
    expected[4:] = 6.0  # k's rows: 2 * (q + 1), from the product and the transpose's sum
    np.testing.assert_array_equal(grad, expected)  # the counting changed nothing


def test_attention_cost_is_hand_computed():
    taifuse.set_backend("numpy")
    rng = np.random.default_rng(3)
    q, k, v = (taifuse.tensor(rng.standard_normal((2, 3, 5, 4), dtype=np.float32)) for _ in range(3))
    with profile(ceilings=CEILINGS) as prof:
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ev = next(e for e in prof.events() if e.kind == "op")
    assert ev.name == "attention"
    elements = 2 * 3 * 5 * 4
    pairs = 5 * 6 // 2  # causal: query i sees keys 0..i
    # Read q, k, v, write out; QK^T and PV: 2 products of 2*E flops per pair, per head.
    assert ev.cost == (4 * 4 * elements, 4 * elements, 2 * 3 * 2 * 2 * 4 * pairs)


def test_adamw_cost_is_hand_computed():
    taifuse.set_backend("numpy")
    p = nn.Parameter(taifuse.tensor(np.ones((10, 10), np.float32)))
    opt = optim.AdamW([p], lr=1e-3)
    p.grad = taifuse.tensor(np.ones((10, 10), np.float32))
    with profile(ceilings=CEILINGS) as prof:
        opt.step()
    [ev] = [e for e in prof.events() if e.kind == "optimizer"]
    # Read parameter, gradient, two float32 moments; write parameter and moments.
    assert ev.cost == (400 * (1 + 1 + 2 + 1 + 2), 400 * (1 + 2), 0)


def test_table_shares_rates_and_bound():
    taifuse.set_backend("numpy")
    x = np.ones((256, 256), np.float32)
    with profile(ceilings=CEILINGS) as prof:
        F.linear(x, x)
        F.relu(np.ones(4, np.float32))
    rows = {r.name: r for r in prof.key_averages()}
    lin = rows["linear"]
    assert lin.gflops == pytest.approx(2 * 256**3 / lin.total_ns)
    # 2*256^3 flops over 4*4*65536 bytes of traffic: 32 flops/byte, past the ridge 100/50 = 2.
    assert lin.judge(CEILINGS) == (pytest.approx(lin.gflops / 100.0), "compute")
    # 32 bytes at 50 GB/s take 0.6 ns, under the 5 us call: overhead.
    assert rows["relu"].judge(CEILINGS)[1] == "overhead"
    table = prof.key_averages().table(row_limit=2)
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["Name", "Calls", "Self", "ms"]
    assert len([line for line in lines[2:] if line and not line.startswith("-")]) == 2 + 2  # rows, footer
    share = 100 * lin.self_ns / prof.wall_ns
    assert f"{share:.1f}" in next(line for line in lines if line.startswith("linear"))
    with pytest.raises(ValueError, match="sort_by"):
        prof.key_averages().table(sort_by="nope")
    with pytest.raises(ValueError, match="row_limit"):
        prof.key_averages().table(row_limit=0)


def test_group_by_input_shape():
    taifuse.set_backend("numpy")
    with profile(ceilings=CEILINGS) as prof:
        F.relu(np.ones(4, np.float32))
        F.relu(np.ones(8, np.float32))
        F.relu(np.ones(8, np.float32))
    counts = sorted(r.count for r in prof.key_averages(group_by_input_shape=True) if r.name == "relu")
    assert counts == [1, 2]
    assert [r.count for r in prof.key_averages() if r.name == "relu"] == [3]


def test_chrome_trace_is_valid_with_a_counter_track(tmp_path):
    taifuse.set_backend("numpy")
    model = _mlp(np.random.default_rng(4))
    x = taifuse.tensor(np.ones((4, 16), np.float32))
    with profile(ceilings=CEILINGS) as prof:
        model(x).sum().backward()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(path)
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    counters = [e for e in events if e["ph"] == "C"]
    assert {"linear", "linear_backward", "model", "model.0", "model.3"} <= {e["name"] for e in complete}
    for e in complete:
        assert {"name", "ts", "dur", "pid", "tid", "args"} <= set(e)
        assert e["dur"] >= 0
    lin = next(e for e in complete if e["name"] == "linear")
    assert lin["args"]["shapes"][0] == [4, 16] and lin["args"]["flops"] == 2 * 4 * 16 * 32
    assert counters and all(isinstance(e["args"]["bytes"], int) for e in counters)
    assert len(counters) == sum(1 for e in prof.events() if e.kind == "pool")


def test_module_ranges_enclose_their_ops():
    taifuse.set_backend("numpy")
    model = _mlp(np.random.default_rng(5))
    x = taifuse.tensor(np.ones((4, 16), np.float32))
    with profile(ceilings=CEILINGS) as prof:
        model(x)
    events = prof.events()
    ranges = {e.name: e for e in events if e.kind == "range"}
    assert list(ranges) == ["model", "model.0", "model.1", "model.2", "model.3"]
    ops = [e for e in events if e.kind == "op"]
    assert [e.name for e in ops] == ["linear", "linear", "relu", "linear"]
    for op, layer in zip(ops, ["model.0", "model.1", "model.2", "model.3"]):
        r = ranges[layer]
        assert r.start_ns <= op.start_ns and op.end_ns <= r.end_ns
        assert ranges["model"].start_ns <= r.start_ns and r.end_ns <= ranges["model"].end_ns
        assert op.depth == r.depth + 1 == 2
    # A range's self time excludes the ops inside it.
    assert ranges["model.0"].self_ns == ranges["model.0"].duration_ns - ops[0].duration_ns


def test_record_function_as_decorator_and_context_manager():
    taifuse.set_backend("numpy")

    @record_function("helper")
    def helper(a):
        return F.relu(a)

    helper(np.ones(2, np.float32))  # no profiler: nothing recorded, nothing raised
    with profile(ceilings=CEILINGS) as prof, record_function("outer"):
        helper(np.ones(2, np.float32))
        helper(np.ones(2, np.float32))
    events = [e for e in prof.events() if e.kind != "pool"]
    assert [(e.name, e.depth) for e in events] == [
        ("outer", 0),
        ("helper", 1),
        ("relu", 2),
        ("helper", 1),
        ("relu", 2),
    ]
    with pytest.raises(TypeError, match="name"):
        record_function(3)


def test_a_failing_op_is_recorded_and_nesting_recovers():
    taifuse.set_backend("numpy")
    x = np.ones((2, 3), np.float32)
    with profile(ceilings=CEILINGS) as prof, record_function("outer"):
        with pytest.raises(ValueError):
            F.linear(x, np.ones((4, 5), np.float32))  # in_features mismatch: raises in the op
        F.relu(x)
    events = [e for e in prof.events() if e.kind != "pool"]
    assert [(e.name, e.depth) for e in events] == [("outer", 0), ("linear", 1), ("relu", 1)]
    outer, failed, relu = events
    assert failed.cost is None and relu.cost is not None
    assert outer.self_ns == outer.duration_ns - failed.duration_ns - relu.duration_ns


def test_other_threads_are_not_recorded():
    import threading

    taifuse.set_backend("numpy")
    x = np.ones(8, np.float32)
    with profile(ceilings=CEILINGS) as prof:
        worker = threading.Thread(target=lambda: [F.gelu(x), F.gelu(taifuse.tensor(x, requires_grad=True))])
        worker.start()
        worker.join()
        F.relu(x)
    assert [e.name for e in prof.events() if e.kind != "pool"] == ["relu"]


def test_events_read_inside_an_open_range_then_after():
    taifuse.set_backend("numpy")
    x = np.ones(8, np.float32)
    with profile(ceilings=CEILINGS) as prof:
        F.relu(x)  # a closed top-level event before the open range
        with record_function("outer"):
            F.gelu(x)
            inside = [(e.name, e.depth, e.self_ns == e.duration_ns) for e in prof.events() if e.kind == "op"]
        F.gelu(x)
    assert inside == [("relu", 0, True), ("gelu", 1, True)]  # the gelu is not taken off the relu
    events = {(e.name, e.depth): e for e in prof.events() if e.kind != "pool"}
    outer, relu = events[("outer", 0)], events[("relu", 0)]
    assert outer.self_ns == outer.duration_ns - events[("gelu", 1)].duration_ns
    assert relu.self_ns == relu.duration_ns


def test_a_restarted_profile_times_each_run_from_its_own_start():
    taifuse.set_backend("numpy")
    x = np.ones(8, np.float32)
    prof = profile(ceilings=CEILINGS)
    for _ in range(2):
        prof.start()
        F.relu(x)
        prof.stop()
    ops = [e for e in prof.events() if e.kind == "op"]
    assert len(ops) == 2
    # Each from its own run's start: the first is not timed from the second run's start (negative).
    assert all(0 <= e.start_ns <= e.end_ns for e in ops)


def test_profiles_do_not_nest():
    taifuse.set_backend("numpy")
    with profile(ceilings=CEILINGS), pytest.raises(RuntimeError, match="already active"):
        profile().start()
    assert _profile_hook.ACTIVE is None


def test_ceilings_from_bench_results(tmp_path):
    rows = [
        {"kind": "roofline", "id": "roofline/copy-L2", "value": 80.0, "bytes_moved": 2**20},
        {"kind": "roofline", "id": "roofline/copy-DRAM", "value": 20.0, "bytes_moved": 2**29},
        {"kind": "roofline", "id": "roofline/gemm", "value": 300.0, "bytes_moved": None},
    ]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"rows": rows}))
    prof = profile(ceilings=path)
    c = prof.ceilings
    assert c.gemm_gflops == 300.0 and c.bandwidth(1000) == (80.0, 2**20) and c.bandwidth(2**25)[0] == 20.0
    (tmp_path / "empty.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="empty.json"):
        _ = profile(ceilings=tmp_path / "empty.json").ceilings
    with pytest.raises(TypeError, match="ceilings"):
        profile(ceilings=3)


def test_costs_match_the_bench_formulas():
    # The bench's attention case counts forward+backward as 8 arrays and 14*E flops per pair.
    both = _costs.attention(8, 8, 512, 512, 64, causal=True, phase="both")
    elements = 8 * 8 * 512 * 64
    assert both == (4 * 8 * elements, 4 * 4 * elements, 14 * 64 * (512 * 513 // 2) * 64)
    fwd, bwd = (_costs.attention(2, 2, 16, 16, 8, False, phase=p) for p in ("forward", "backward"))
    assert fwd.flops + bwd.flops == _costs.attention_flops(2, 2, 16, 16, 8, False, backward=True)
    assert math.isclose(_costs.traffic_bytes(*_costs.elementwise(4, 4)[:2]), 12)


def test_cli_profiles_a_script(tmp_path, capsys):
    from taifuse.cli import main

    script = tmp_path / "tiny.py"
    script.write_text(
        "import sys, numpy as np, taifuse, taifuse.functional as F\n"
        "taifuse.set_backend('numpy')\n"
        "assert sys.argv[1:] == ['--n', '3'], sys.argv\n"
        "assert __name__ == '__main__'\n"
        "for _ in range(3):\n"
        "    F.gelu(np.ones(64, np.float32))\n"
    )
    trace = tmp_path / "t.json"
    saved = list(sys.argv)
    code = main(["profile", "--trace", str(trace), "--row-limit", "5", str(script), "--n", "3"])
    assert sys.argv == saved
    out = capsys.readouterr().out
    assert code == 0
    gelu = next(line for line in out.splitlines() if line.startswith("gelu"))
    assert gelu.split()[1] == "3"  # calls
    assert "Profiled wall time" in out and f"wrote {trace}" in out
    assert any(e["name"] == "gelu" for e in json.loads(trace.read_text())["traceEvents"])
    with pytest.raises(SystemExit) as exit_:
        main(["profile", str(tmp_path / "missing.py")])
    assert exit_.value.code == 2


def test_a_restarted_profile_sums_the_wall_time_of_its_runs():
    # Issue 26 #3: stop() kept only the last run's wall time, so 20 gelus then one relu read as
    # ops' self time 351.8% of the wall time.
    taifuse.set_backend("numpy")
    x = np.ones(4096, np.float32)
    prof = profile(ceilings=CEILINGS)
    prof.start()
    for _ in range(20):
        F.gelu(x)
    prof.stop()
    first = prof.wall_ns
    prof.start()
    F.relu(x)
    prof.stop()
    assert prof.wall_ns > first
    ops_self = sum(r.self_ns for r in prof.key_averages() if r.is_op)
    assert ops_self <= prof.wall_ns  # the ops ran inside the runs: their self time fits the sum
    footer = prof.key_averages().table().splitlines()[-2]
    share = float(footer.split("(")[1].split("%")[0])
    assert 0 < share <= 100.0, footer


def test_a_range_open_at_stop_ends_at_the_stop_and_not_in_the_next_profile():
    # Issue 26 #9: a record_function left open across two profiles landed in the second at a
    # negative time. As torch.profiler: it ends at the first profile's stop; the second never sees it.
    taifuse.set_backend("numpy")
    x = np.ones(8, np.float32)
    rf = record_function("left open")
    first = profile(ceilings=CEILINGS)
    first.start()
    rf.__enter__()
    F.relu(x)
    first.stop()
    second = profile(ceilings=CEILINGS)
    with second:
        F.gelu(x)
        rf.__exit__(None, None, None)
        F.relu(x)
    [left] = [e for e in first.events() if e.name == "left open"]
    relu = next(e for e in first.events() if e.name == "relu")
    assert left.start_ns <= relu.start_ns and relu.end_ns <= left.end_ns <= first.wall_ns
    assert left.self_ns == left.duration_ns - relu.duration_ns
    events = [e for e in second.events() if e.kind != "pool"]
    assert [(e.name, e.depth) for e in events] == [("gelu", 0), ("relu", 0)]
    assert all(0 <= e.start_ns <= e.end_ns <= second.wall_ns for e in events)


def test_record_function_exit_without_enter_is_a_clear_error():
    # Issue 26 #9: it raised IndexError (pop from an empty list); torch's raises too.
    taifuse.set_backend("numpy")
    with pytest.raises(RuntimeError, match="without a matching __enter__"):
        record_function("never entered").__exit__(None, None, None)
    with profile(ceilings=CEILINGS) as prof:
        with pytest.raises(RuntimeError, match="without a matching __enter__"):
            record_function("never entered").__exit__(None, None, None)
        F.relu(np.ones(2, np.float32))
    assert [(e.name, e.depth) for e in prof.events() if e.kind != "pool"] == [("relu", 0)]


def _script(tmp_path, body: str):
    path = tmp_path / "script.py"
    path.write_text(
        "import numpy as np, taifuse, taifuse.functional as F\n"
        "taifuse.set_backend('numpy')\n"
        "open(__file__ + '.ran', 'w').close()\n" + body
    )
    return path


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--ceilings", "{missing}"], "cannot read"),
        (["--ceilings", "{not_json}"], "not JSON"),
        (["--ceilings", "{no_rows}"], "no roofline rows"),
        (["--trace", "{no_dir}/t.json"], "no such directory"),
        (["--row-limit", "0"], "--row-limit"),
        (["--wait", "2"], "need --active"),
        (["--active", "0"], "--active should be at least 1"),
        (["--warmup", "-1", "--active", "1"], "--warmup should be at least 0"),
        (["--sort", "nope"], "--sort"),
    ],
)
def test_cli_checks_its_arguments_before_the_script_runs(tmp_path, capsys, flags, message):
    # Issue 26 #6: --ceilings of a missing or non-JSON file ran the whole script, then printed a
    # traceback; --trace into a missing directory printed the table, then a traceback.
    from taifuse.cli import main

    (tmp_path / "not.json").write_text("{not json")
    (tmp_path / "rows.json").write_text(json.dumps({"rows": []}))
    names = {"missing": tmp_path / "missing.json", "not_json": tmp_path / "not.json",
             "no_rows": tmp_path / "rows.json", "no_dir": tmp_path / "no-such-dir"}  # fmt: skip
    script = _script(tmp_path, "F.relu(np.ones(4, np.float32))\n")
    with pytest.raises(SystemExit) as exit_:
        main(["profile", *(f.format(**names) for f in flags), str(script)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "script.py.ran").exists()  # the script never ran


def test_cli_without_a_script_names_what_is_missing(capsys):
    # Issue 26 #9: it said "the following arguments are required: script, args".
    from taifuse.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["profile"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "a SCRIPT to run is required" in err and "script, args" not in err


def test_cli_keeps_the_scripts_exit_status_and_message(tmp_path, capsys):
    # Issue 26 #6: sys.exit("message") lost its message.
    from taifuse.cli import main

    script = _script(tmp_path, "F.relu(np.ones(4, np.float32))\nimport sys\nsys.exit('target missed')\n")
    assert main(["profile", str(script)]) == 1
    captured = capsys.readouterr()
    assert "target missed" in captured.err and "relu" in captured.out  # the table is still printed
    script.write_text(script.read_text().replace("sys.exit('target missed')", "sys.exit(3)"))
    assert main(["profile", str(script)]) == 3


def test_cli_schedule_counts_optimizer_steps(tmp_path, capsys):
    # Issue 25 #5: --wait/--warmup/--active record only some steps; a step ends at each optimizer step.
    from taifuse.cli import main

    script = _script(
        tmp_path,
        "from taifuse import nn, optim\n"
        "p = nn.Parameter(taifuse.tensor(np.ones(8, np.float32)))\n"
        "opt = optim.SGD([p], lr=0.1)\n"
        "for i in range(6):\n"
        "    opt.zero_grad()\n"
        "    F.gelu(np.ones(i + 1, np.float32))\n"
        "    (p * p).sum().backward()\n"
        "    opt.step()\n",
    )
    trace = tmp_path / "t.json"
    code = main(["profile", "--group-by-shape", "--wait", "1", "--warmup", "1", "--active", "2",
                 "--trace", str(trace), str(script)])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    gelu = sorted(line.split()[1] for line in out.splitlines() if line.startswith("gelu"))
    assert gelu == ["[(3,),", "[(4,),"]  # steps 2 and 3 of 0..5 (shapes (i + 1,), then the approximate arg)
    steps = [
        e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e["name"].startswith("Profiler")
    ]
    assert steps == ["ProfilerStep#2", "ProfilerStep#3"]
    code = main(["profile", "--wait", "10", "--active", "2", str(script)])
    assert code == 0 and "nothing recorded" in capsys.readouterr().err


def test_array_paths_of_conv_pool_and_batch_norm_are_recorded_with_their_costs():
    # Regression: the ops of _conv_ops (above _array_ops, which cannot import them) were not
    # wrapped, so a convolution or pooling on NumPy arrays left no event.
    taifuse.set_backend("numpy")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    with profile(ceilings=CEILINGS) as prof:
        y = F.conv2d(x, w, padding=1)
        F.max_pool2d(y, 2)
        F.avg_pool2d(y, 2)
        F.adaptive_avg_pool2d(y, 1)
        F.batch_norm(y, np.zeros(4, np.float32), np.ones(4, np.float32), training=True)
    costs = {e.name: e.cost for e in prof.events() if e.kind == "op"}
    assert set(costs) == {"conv2d", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "batch_norm"}
    assert costs["conv2d"] == _costs.conv2d(_costs.ConvShape(2, 3, 8, 8, 4, 27, 64), bias=False)
    assert costs["avg_pool2d"] == _costs.pool2d(4 * 2 * 4 * 64, 4 * 2 * 4 * 16)
    assert costs["batch_norm"] == _costs.batch_norm(2 * 4 * 64, 4)
