"""taifuse.compile: a compiled training step gives the eager step's results, bit for bit.

The steps are the examples' (tests/compile_cases.py): the MLP's with AdamW and clipping, with
dropout, and under autocast with a GradScaler; the GPT's with dropout and clipping; the CNN's with
batch norm. Each runs several steps eagerly and compiled from the same seeds and batches; the
replay calls the same kernels on the same values, so losses and parameters must be equal exactly
(tolerance 0). Then the compiler's own behaviour: a new signature traces again, a value read
inside the step is refused (or falls back with a warning), host arrays made from the inputs are
refused, and the plan holds no more than the eager step.
"""

from __future__ import annotations

import warnings

import compile_cases as cases
import numpy as np
import pytest
from helpers import SUBSET

import taifuse
import taifuse.functional as F
from taifuse import nn, optim, pool
from taifuse._internal import data, set_data
from taifuse.compiler import CompileError

STEPS = 5


def _assert_same(eager, compiled) -> None:
    (le, pe, _), (lc, pc, _) = eager, compiled
    for i, (a, b) in enumerate(zip(le, lc)):
        np.testing.assert_array_equal(b, a, err_msg=f"loss of step {i}")
    for i, (a, b) in enumerate(zip(pe, pc)):
        np.testing.assert_array_equal(b, a, err_msg=f"parameter or buffer {i} after {STEPS} steps")


MLP_VARIANTS = {
    "clip": {},
    "dropout": {"dropout": 0.2},
    "amp_scaler": {"amp": True},
}


@pytest.mark.parametrize("variant", list(MLP_VARIANTS))
def test_compiled_mlp_step_equals_eager(backend, variant):
    if backend.arch in ("vulkan", "metal") and variant != "clip":
        pytest.skip(SUBSET + "lavapipe runs the small case only (the others run on taichi-cpu)")
    backend.activate()
    batches = cases.mlp_batches(STEPS)
    kwargs = MLP_VARIANTS[variant]
    eager = cases.run(cases.mlp_step, batches, False, **kwargs)
    compiled = cases.run(cases.mlp_step, batches, True, **kwargs)
    _assert_same(eager, compiled)
    fn = compiled[2]
    # The scaler's growth_interval of 3 grows the scale once in 5 steps: one more trace.
    assert (fn.traces, fn.replays) == ((2, 3) if variant == "amp_scaler" else (1, 4))


def test_compiled_gpt_step_equals_eager(backend):
    if backend.arch in ("vulkan", "metal"):
        pytest.skip(SUBSET + "lavapipe runs the MLP's small case only")
    backend.activate()
    batches = cases.gpt_batches(STEPS)
    eager = cases.run(cases.gpt_step, batches, False)
    compiled = cases.run(cases.gpt_step, batches, True)
    _assert_same(eager, compiled)
    # Two traces: the positions (np.arange in the forward) are a host array, confirmed constant
    # by the second (NOTE [ Constants made by host code ]).
    assert (compiled[2].traces, compiled[2].replays) == (2, STEPS - 2)


def test_compiled_cnn_step_equals_eager(backend):
    if backend.arch in ("vulkan", "metal"):
        pytest.skip(SUBSET + "lavapipe runs the MLP's small case only")
    backend.activate()
    batches = cases.cnn_batches(STEPS)
    eager = cases.run(cases.cnn_step, batches, False)
    compiled = cases.run(cases.cnn_step, batches, True)
    _assert_same(eager, compiled)  # the buffers too: running statistics and num_batches_tracked
    assert (compiled[2].traces, compiled[2].replays) == (1, STEPS - 1)


def test_a_new_shape_traces_again_and_each_signature_replays(grad_backend):
    grad_backend.activate()
    short, long = cases.mlp_batches(3, batch=32), cases.mlp_batches(3, batch=64, seed=2)
    batches = [short[0], long[0], short[1], long[1], short[2], long[2]]
    eager = cases.run(cases.mlp_step, batches, False)
    compiled = cases.run(cases.mlp_step, batches, True)
    _assert_same(eager, compiled)
    assert (compiled[2].traces, compiled[2].replays) == (2, 4)


def _model_and_step(read):
    taifuse.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = optim.SGD(model.parameters(), lr=0.1)

    def step(x, y):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        if read(loss) > 1e9:  # control flow on a value
            return loss
        loss.backward()
        opt.step()
        return loss

    return model, step


READS = {"item": lambda t: t.item(), "numpy": lambda t: float(t.numpy())}


@pytest.mark.parametrize("read", list(READS))
def test_a_value_read_inside_the_step_is_refused(read):
    with taifuse.backends.preserved_choice():
        taifuse.set_backend("numpy")
        _, step = _model_and_step(READS[read])
        x, y = taifuse.tensor(np.ones((4, 3), np.float32)), taifuse.tensor(np.zeros((4, 2), np.float32))
        with pytest.raises(CompileError, match="reads a value back to the host"):
            taifuse.compile(step)(x, y)


def test_fallback_runs_the_step_eagerly_with_a_warning():
    with taifuse.backends.preserved_choice():
        taifuse.set_backend("numpy")
        model, step = _model_and_step(READS["item"])
        ref_model, ref_step = _model_and_step(READS["item"])
        compiled = taifuse.compile(step, fallback=True)
        x, y = taifuse.tensor(np.ones((4, 3), np.float32)), taifuse.tensor(np.zeros((4, 2), np.float32))
        with pytest.warns(UserWarning, match="runs eagerly from now on"):
            compiled(x, y)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once per signature
            for _ in range(2):
                compiled(x, y)
        for _ in range(3):
            ref_step(x, y)
        for p, q in zip(model.parameters(), ref_model.parameters()):
            np.testing.assert_array_equal(p.numpy(), q.numpy())
        assert compiled.replays == 0


def test_a_host_array_made_from_the_inputs_is_refused():
    """A value host code derives from an input inside the step would be frozen by the replay: the
    second trace sees it change (NOTE [ Constants made by host code ])."""
    with taifuse.backends.preserved_choice():
        taifuse.set_backend("numpy")
        taifuse.manual_seed(0)
        model = nn.Linear(3, 2)

        def step(x):
            host = np.asarray(data(x)) * 2.0  # host arithmetic on the input's array
            return model(taifuse.tensor(host)).sum()

        compiled = taifuse.compile(step)
        compiled(taifuse.tensor(np.ones((4, 3), np.float32)))
        with pytest.raises(CompileError, match="from its inputs' values"):
            compiled(taifuse.tensor(np.full((4, 3), 2.0, np.float32)))


def test_a_new_parameter_storage_traces_again():
    with taifuse.backends.preserved_choice():
        taifuse.set_backend("numpy")
        batches = cases.mlp_batches(4)
        results = []
        for compile_it in (False, True):
            params, step = cases.mlp_step(clip=None)
            fn = taifuse.compile(step) if compile_it else step
            for i, (x, y) in enumerate(batches):
                if i == 2:
                    # As load_state_dict may: a new array, so the recorded one is not its storage.
                    set_data(params[0], params[0].numpy().copy())
                fn(taifuse.tensor(x), taifuse.tensor(y))
            results.append([p.numpy().copy() for p in params])
        # The third call's guard fails and it traces; that trace sees the optimizer move the
        # parameter back into its flat buffer, so it is dropped, and the fourth call finds the
        # first trace's storage again: it replays.
        assert (fn.traces, fn.replays) == (2, 2)
        for a, b in zip(*results):
            np.testing.assert_array_equal(b, a)


def test_the_plan_holds_no_more_than_the_eager_step(grad_backend):
    """The plan's buffers (the arena, and the device arrays it shares) never exceed the eager step's
    pool peak, and on the host the arena is the recorded live peak plus alignment."""
    grad_backend.activate()
    batches = cases.gpt_batches(3)
    _, step = cases.gpt_step(dropout=0.0)
    x, y = (taifuse.tensor(a) for a in batches[0])
    step(x, y)  # optimizer state made: the next step is a steady one
    p = pool.get_pool()
    p.clear()
    p.reset_stats()
    step(x, y)
    eager_peak = p.stats().peak_bytes
    compiled = taifuse.compile(step)
    for a, b in batches:
        compiled(taifuse.tensor(a), taifuse.tensor(b))
    plan = compiled.plan(x, y)
    assert plan.arena + plan.kept <= eager_peak, (plan, eager_peak)
    assert plan.live_peak <= plan.arena
    if grad_backend.name != "taichi":
        # One host arena packed by lifetimes: the live peak plus alignment (64 bytes a buffer). On
        # Taichi a buffer shares only a device array of its exact size (its length is visible to
        # kernels), which packs less tightly.
        assert plan.arena <= plan.live_peak + 64 * plan.calls


def test_a_taichi_replay_makes_no_host_round_trip(grad_backend):
    """On Taichi the replayed kernels launch one after another on device data: no copy to or from
    the host in a step (the optimizer's step, a host segment, reads no flag without check_finite)."""
    if grad_backend.name != "taichi":
        pytest.skip(SUBSET + "host transfers exist on the taichi backend only")
    grad_backend.activate()
    from taifuse.backends.taichi import _runtime

    batches = cases.mlp_batches(3)
    _, step = cases.mlp_step(clip=1.0)
    compiled = taifuse.compile(step)
    inputs = [(taifuse.tensor(x), taifuse.tensor(y)) for x, y in batches]
    compiled(*inputs[0])
    _runtime.reset_transfer_stats()
    compiled(*inputs[1])
    compiled(*inputs[2])
    assert compiled.replays == 2
    assert all(v == 0 for v in _runtime.transfer_stats().values()), _runtime.transfer_stats()


def test_the_docs_examples_run():
    import doctest
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "docs" / "compile.md"
    with taifuse.backends.preserved_choice():
        result = doctest.testfile(str(path), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_another_threads_work_during_a_trace_is_not_recorded():
    """Only the tracing thread's calls are the step's: a thread that computes (and allocates from
    the pool, and draws a seed) while the trace runs is left out, and the replay matches eager."""
    import threading

    def other() -> None:
        t = taifuse.tensor(np.ones((8, 8), np.float32))
        F.relu(F.dropout(t, 0.5) + 1.0)

    with taifuse.backends.preserved_choice():
        taifuse.set_backend("numpy")
        batches = cases.mlp_batches(3)
        results, plans = [], []
        for with_thread in (False, True):
            _, step = cases.mlp_step()

            def stepping(x, y, step=step, with_thread=with_thread):
                if with_thread:
                    worker = threading.Thread(target=other)
                    worker.start()
                    worker.join()
                return step(x, y)

            compiled = taifuse.compile(stepping)
            losses = [compiled(taifuse.tensor(x), taifuse.tensor(y)).numpy().copy() for x, y in batches]
            results.append(losses)
            plans.append(compiled.plan(taifuse.tensor(batches[0][0]), taifuse.tensor(batches[0][1])).calls)
        assert plans[0] == plans[1]
        for a, b in zip(*results):
            np.testing.assert_array_equal(b, a)


def test_a_step_whose_backward_runs_gradient_hooks_is_refused():
    """Hooks (DistributedDataParallel's all-reduce) are Python on the gradients mid-backward,
    which a list of kernel calls would skip."""
    with taifuse.backends.preserved_choice():
        taifuse.set_backend("numpy")
        taifuse.manual_seed(0)
        model = nn.Linear(3, 2)
        seen = []
        model.weight.register_post_accumulate_grad_hook(lambda p: seen.append(1))

        def step(x):
            loss = model(x).sum()
            loss.backward()
            return loss

        with pytest.raises(CompileError, match="gradient hooks"):
            taifuse.compile(step)(taifuse.tensor(np.ones((4, 3), np.float32)))
        assert seen == [1]  # the trace's eager run ran it


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the overflow itself, in eager and in the trace
def test_the_scalers_decision_skips_an_overflowing_step_under_replay(grad_backend):
    """GradScaler's inf check is a host segment: a replayed step whose float16 gradients overflow
    is skipped and the scale backs off (then the step traces again), as in eager."""
    grad_backend.activate()
    batches = cases.mlp_batches(6)
    x, y = batches[3]
    batches[3] = (x * np.float32(1e6), y)  # float16 activations overflow: inf gradients
    eager = cases.run(cases.mlp_step, batches, False, amp=True, clip=None)
    compiled = cases.run(cases.mlp_step, batches, True, amp=True, clip=None)
    _assert_same(eager, compiled)
    assert compiled[2].replays >= 2


def test_keyword_and_nested_inputs_are_bound_anew_each_call():
    with taifuse.backends.preserved_choice():
        taifuse.set_backend("numpy")
        taifuse.manual_seed(0)
        model = nn.Linear(3, 2)

        @taifuse.compile
        def forward(pair, *, scale):
            a, b = pair
            return (model(a) * scale + model(b)).sum()

        rng = np.random.default_rng(0)
        for _ in range(3):
            a, b = (rng.standard_normal((4, 3)).astype(np.float32) for _ in range(2))
            got = forward((taifuse.tensor(a), taifuse.tensor(b)), scale=2.0).numpy()
            with taifuse.no_grad():
                want = (model(taifuse.tensor(a)) * 2.0 + model(taifuse.tensor(b))).sum().numpy()
            np.testing.assert_array_equal(got, want)
        assert (forward.traces, forward.replays) == (1, 2)
        forward((taifuse.tensor(a), taifuse.tensor(b)), scale=3.0)  # another value: another signature
        assert forward.traces == 2


def test_compile_refuses_what_is_not_callable():
    with pytest.raises(TypeError, match="fn should be callable"):
        taifuse.compile(3)


def test_a_view_kept_past_the_step_sees_each_replays_values(grad_backend):
    """A buffer whose only survivor is a view (the step keeps ``y.reshape(-1)``) is still the
    step's output memory: a replay writes it, as the trace's objects hold the replay's values."""
    grad_backend.activate()
    kept = {}

    @taifuse.compile
    def step(x):
        y = F.relu(x)
        kept["v"] = y.reshape(-1)
        return (y * 2.0).sum()

    rng = np.random.default_rng(0)
    for _ in range(3):
        x = rng.standard_normal((4, 8)).astype(np.float32)
        step(taifuse.tensor(x))
        np.testing.assert_array_equal(kept["v"].numpy(), np.maximum(x, 0).reshape(-1))
    assert step.replays == 2


def _wholly_free(p) -> int:
    s = p.stats()
    return s.bytes_pooled - s.bytes_fragmented


def test_a_trace_leaves_the_pool_no_fuller_than_it_found_it(grad_backend):
    """NOTE [ Memory a trace leaves ]: a trace keeps every buffer it sees to its end, so the pool
    serves it a block per buffer; the replays never ask for them, and the pool gives back what the
    trace added (here after an eager step, whose free blocks the pool held already)."""
    grad_backend.activate()
    batches = cases.gpt_batches(3)
    _, step = cases.gpt_step(dropout=0.0)
    step(*(taifuse.tensor(a) for a in batches[0]))  # eager: the pool holds that step's free blocks
    pools = [pool.get_pool(), pool.host_pool()]
    before = [_wholly_free(p) for p in pools]
    compiled = taifuse.compile(step)
    for a, b in batches:
        compiled(taifuse.tensor(a), taifuse.tensor(b))
    assert (compiled.traces, compiled.replays) == (2, 1)
    after = [_wholly_free(p) for p in pools]
    assert all(a <= b for a, b in zip(after, before)), (after, before)


def test_the_confirming_trace_leaves_the_gradients_in_the_optimizers_slots(grad_backend):
    """NOTE [ Memory a trace leaves ]: the trace that confirms the GPT's constants runs with the
    first trace's ``.grad`` bindings dropped, so its backward writes the gradients into the
    optimizer's flat buffer: the plan keeps no gradients of its own (kept bytes 0), and a replay's
    optimizer step copies none in."""
    if grad_backend.name == "taichi":
        pytest.skip(
            SUBSET + "flat gradient buffers are host-only (on Taichi each parameter is its own bucket)"
        )
    grad_backend.activate()
    batches = cases.gpt_batches(3)
    _, step = cases.gpt_step(dropout=0.0)
    compiled = taifuse.compile(step)
    for a, b in batches:
        compiled(taifuse.tensor(a), taifuse.tensor(b))
    assert (compiled.traces, compiled.replays) == (2, 1)
    plan = compiled.plan(*(taifuse.tensor(a) for a in batches[0]))
    assert plan.kept == 0, plan


# ----------------------------------------------------------------------------- NumPy inputs (issue 32)


def _run_numpy(make, batches, compiled: bool, inside: bool = False, **kwargs):
    """``cases.run`` with the batches passed as NumPy arrays, a fresh copy each step, as a data
    loader gives them; ``inside``: the step converts them itself (``taifuse.tensor``)."""
    params, step = make(**kwargs)
    if inside:
        inner = step

        def step(x, y):
            return inner(taifuse.tensor(x), taifuse.tensor(y))

    fn = taifuse.compile(step) if compiled else step
    losses = []
    for x, y in batches:
        losses.append(fn(x.copy(), y.copy()).numpy().copy())
    return losses, [p.numpy().copy() for p in params], fn


@pytest.mark.parametrize("inside", [False, True], ids=["arrays", "tensor_inside"])
def test_fresh_numpy_batches_trace_once_then_replay(grad_backend, inside):
    """NOTE [ Compiled inputs ]: a NumPy argument is keyed by its shape and dtype, not its identity,
    so a new batch each step replays (it traced every call, keeping every plan)."""
    grad_backend.activate()
    batches = cases.mlp_batches(STEPS)
    eager = _run_numpy(cases.mlp_step, batches, False, inside)
    compiled = _run_numpy(cases.mlp_step, batches, True, inside)
    _assert_same(eager, compiled)
    fn = compiled[2]
    assert (fn.traces, fn.replays, len(fn._steps)) == (1, STEPS - 1, 1)


def test_fresh_numpy_token_batches_replay_the_gpt_step(grad_backend):
    """The language-model loop: inputs and targets are the two shifted slices of one token array,
    not C-contiguous; the step sees C-contiguous copies (NOTE [ Compiled inputs ]). Two traces: the
    positions (np.arange in the forward) are confirmed constant."""
    if grad_backend.arch in ("vulkan", "metal"):
        pytest.skip(SUBSET + "lavapipe runs the MLP's small case only")
    grad_backend.activate()
    rng = np.random.default_rng(3)
    chunks = [rng.integers(0, 32, (4, 17)) for _ in range(STEPS)]
    batches = [(c[:, :-1], c[:, 1:]) for c in chunks]
    eager = _run_numpy(cases.gpt_step, batches, False)
    compiled = _run_numpy(cases.gpt_step, batches, True)
    _assert_same(eager, compiled)
    assert (compiled[2].traces, compiled[2].replays) == (2, STEPS - 2)


def test_a_new_numpy_shape_traces_again(grad_backend):
    grad_backend.activate()
    short, long = cases.mlp_batches(3, batch=32), cases.mlp_batches(3, batch=64, seed=2)
    batches = [short[0], long[0], short[1], long[1], short[2], long[2]]
    eager = _run_numpy(cases.mlp_step, batches, False)
    compiled = _run_numpy(cases.mlp_step, batches, True)
    _assert_same(eager, compiled)
    assert (compiled[2].traces, compiled[2].replays) == (2, 4)


def test_past_the_cache_limit_a_new_signature_runs_eagerly_with_a_warning():
    """NOTE [ The signature cache ]: as torch.compile's cache_size_limit, new signatures past the
    limit run eagerly (one warning); the cached ones still replay; results stay eager's."""
    with taifuse.backends.preserved_choice():
        taifuse.set_backend("numpy")
        sizes = [8, 16, 24, 8, 16, 24, 32]
        batches = [cases.mlp_batches(1, batch=n, seed=i)[0] for i, n in enumerate(sizes)]
        eager = _run_numpy(cases.mlp_step, batches, False)
        params, step = cases.mlp_step()
        fn = taifuse.compile(step, cache_size_limit=2)
        losses = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x, y in batches:
                losses.append(fn(x.copy(), y.copy()).numpy().copy())
        warned = [str(w.message) for w in caught if "cache_size_limit" in str(w.message)]
        assert len(warned) == 1, warned  # once, at the third shape
        _assert_same(eager, (losses, [p.numpy().copy() for p in params], fn))
        assert (fn.traces, fn.replays, len(fn._steps)) == (2, 2, 2)
        with pytest.raises(ValueError, match="cache_size_limit"):
            taifuse.compile(step, cache_size_limit=0)


def test_a_non_contiguous_tensor_input_runs_eagerly_with_a_warning(grad_backend):
    """A transposed Tensor argument: the replay bound the recorded views to a contiguous copy of
    the next call's tensor with the trace's strides (wrong values); its signature now runs eagerly."""
    grad_backend.activate()
    if grad_backend.name == "taichi":
        pytest.skip(SUBSET + "device arrays are always contiguous")
    taifuse.manual_seed(0)
    model = nn.Linear(3, 2)
    fn = taifuse.compile(lambda x: model(x).sum())
    rng = np.random.default_rng(0)
    for _ in range(3):
        a = rng.standard_normal((3, 4)).astype(np.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            got = fn(taifuse.tensor(a).t()).numpy()
        with taifuse.no_grad():
            want = model(taifuse.tensor(np.ascontiguousarray(a.T))).sum().numpy()
        np.testing.assert_array_equal(got, want)
    assert fn.replays == 0
