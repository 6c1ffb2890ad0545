"""taifuse.amp.autocast: the dtype every listed op computes in (one table, on every backend, with
torch.autocast("cpu", dtype=torch.float16) beside it), float32 gradients on float32 parameters,
gradients of an autocast MLP and GPT against their float32 ones, the weight-cast cache (counted),
nesting, enabled=False, threads, the decorator form, and bad arguments."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from helpers import load_gpt_example

import taifuse
import taifuse.functional as F
from taifuse import _autocast_state, backends, nn
from taifuse._tensor_functions import _Cast
from taifuse.amp import autocast, clear_autocast_cache, get_autocast_dtype, is_autocast_enabled

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)


def _amp_state():
    return _autocast_state.state()


# ----------------------------------------------------------------------------- the op table


@dataclass(frozen=True)
class Case:
    """One op under autocast: its inputs' shapes and dtypes, what it returns, and torch's twin."""

    name: str
    inputs: tuple[tuple[tuple[int, ...], np.dtype], ...]
    run: Callable[..., Any]  # taifuse: (*tensors) -> Tensor
    expected: np.dtype
    torch_run: Callable[..., Any] | None = None  # (F, torch, *tensors) -> torch.Tensor
    torch_expected: np.dtype | None = None  # where torch's CPU autocast differs (docs/amp.md)


def _mask_f32(shape):
    return np.where(np.tril(np.ones(shape, bool)), 0.0, -1e4).astype(np.float32)


CASES = [
    # float16 list: float32 in, float16 out
    Case("linear", (((4, 8), F32), ((3, 8), F32), ((3,), F32)), lambda x, w, b: F.linear(x, w, b), F16,
         lambda tf, torch, x, w, b: tf.linear(x, w, b)),
    Case("linear_gelu", (((4, 8), F32), ((3, 8), F32), ((3,), F32)),
         lambda x, w, b: F.linear(x, w, b, activation="gelu"), F16,
         lambda tf, torch, x, w, b: tf.gelu(tf.linear(x, w, b))),
    Case("linear_f16_input", (((4, 8), F16), ((3, 8), F32)), lambda x, w: F.linear(x, w), F16,
         lambda tf, torch, x, w: tf.linear(x, w)),
    Case("conv2d", (((2, 3, 6, 5), F32), ((4, 3, 3, 3), F32), ((4,), F32)),
         lambda x, w, b: F.conv2d(x, w, b, padding=1), F16,
         lambda tf, torch, x, w, b: tf.conv2d(x, w, b, padding=1)),
    Case("conv1d", (((2, 3, 7), F32), ((4, 3, 3), F32)), lambda x, w: F.conv1d(x, w), F16,
         lambda tf, torch, x, w: tf.conv1d(x, w)),
    Case("matmul_batched", (((2, 4, 8), F32), ((2, 8, 3), F32)), lambda a, b: a @ b, F16,
         lambda tf, torch, a, b: a @ b),
    Case("matmul_f16_f32", (((2, 4, 8), F16), ((8, 3), F32)), lambda a, b: a @ b, F16,
         lambda tf, torch, a, b: a @ b),
    Case("rmatmul_numpy", (((8, 3), F32),), lambda b: np.ones((4, 8), np.float32) @ b, F16,
         lambda tf, torch, b: torch.ones(4, 8) @ b),
    Case("sdpa", (((1, 2, 5, 8), F32),) * 3,
         lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), F16,
         lambda tf, torch, q, k, v: tf.scaled_dot_product_attention(q, k, v, is_causal=True)),
    Case("sdpa_float_mask", (((1, 2, 5, 8), F32),) * 3,
         lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=_mask_f32((5, 5))), F16,
         lambda tf, torch, q, k, v: tf.scaled_dot_product_attention(
             q, k, v, attn_mask=torch.from_numpy(_mask_f32((5, 5))))),
    # float32 list: float16 in, float32 out
    Case("softmax", (((4, 8), F16),), lambda x: F.softmax(x, -1), F32,
         lambda tf, torch, x: tf.softmax(x, -1), F16),
    Case("log_softmax", (((4, 8), F16),), lambda x: F.log_softmax(x, -1), F32,
         lambda tf, torch, x: tf.log_softmax(x, -1), F16),
    Case("layer_norm", (((4, 8), F16), ((8,), F32), ((8,), F32)), lambda x, w, b: F.layer_norm(x, 8, w, b), F32,
         lambda tf, torch, x, w, b: tf.layer_norm(x, (8,), w, b), F16),
    Case("rms_norm", (((4, 8), F16), ((8,), F32)), lambda x, w: F.rms_norm(x, 8, w), F32,
         lambda tf, torch, x, w: tf.rms_norm(x, (8,), w), F16),
    Case("cross_entropy", (((4, 8), F16),), lambda x: F.cross_entropy(x, np.array([0, 3, 7, 1])), F32,
         lambda tf, torch, x: tf.cross_entropy(x, torch.tensor([0, 3, 7, 1]))),
    Case("mse_loss", (((4, 8), F16), ((4, 8), F32)), lambda x, t: F.mse_loss(x, t), F32,
         lambda tf, torch, x, t: tf.mse_loss(x, t)),
    Case("sum", (((4, 8), F16),), lambda x: x.sum(), F32, lambda tf, torch, x: x.sum(), F16),
    Case("mean_dim", (((4, 8), F16),), lambda x: x.mean(1), F32, lambda tf, torch, x: x.mean(1), F16),
    # promote: the widest input dtype
    Case("add", (((4, 8), F16), ((4, 8), F32)), lambda a, b: a + b, F32, lambda tf, torch, a, b: a + b),
    Case("mul", (((4, 8), F16), ((8,), F32)), lambda a, b: a * b, F32, lambda tf, torch, a, b: a * b),
    Case("cat", (((2, 8), F16), ((3, 8), F32)), lambda a, b: taifuse.cat([a, b]), F32,
         lambda tf, torch, a, b: torch.cat([a, b])),
    Case("stack", (((2, 8), F16), ((2, 8), F32)), lambda a, b: taifuse.stack([a, b]), F32,
         lambda tf, torch, a, b: torch.stack([a, b])),
    Case("add_relu", (((4, 8), F16), ((4, 8), F32)), lambda a, b: F.add_relu(a, b), F32,
         lambda tf, torch, a, b: tf.relu(a + b)),
    Case("mul_relu", (((4, 8), F32), ((4, 8), F16)), lambda a, b: F.mul_relu(a, b), F32,
         lambda tf, torch, a, b: tf.relu(a * b)),
    Case("affine", (((4, 8), F16), ((8,), F32), ((8,), F32)), lambda x, s, b: F.affine(x, s, b), F32,
         lambda tf, torch, x, s, b: x * s + b),
    # everything else: the input's dtype
    Case("gelu_f16", (((4, 8), F16),), lambda x: F.gelu(x), F16, lambda tf, torch, x: tf.gelu(x)),
    Case("gelu_f32", (((4, 8), F32),), lambda x: F.gelu(x), F32, lambda tf, torch, x: tf.gelu(x)),
    Case("max_pool2d", (((1, 2, 6, 6), F32),), lambda x: F.max_pool2d(x, 2), F32,
         lambda tf, torch, x: tf.max_pool2d(x, 2)),
    Case("avg_pool2d_f16", (((1, 2, 6, 6), F16),), lambda x: F.avg_pool2d(x, 2), F16,
         lambda tf, torch, x: tf.avg_pool2d(x, 2)),
    Case("adaptive_avg_pool2d", (((1, 2, 6, 6), F32),), lambda x: F.adaptive_avg_pool2d(x, 1), F32,
         lambda tf, torch, x: tf.adaptive_avg_pool2d(x, 1)),
    Case("silu_f16", (((4, 8), F16),), lambda x: F.silu(x), F16, lambda tf, torch, x: tf.silu(x)),
    Case("dropout_f16", (((4, 8), F16),), lambda x: F.dropout(x, 0.25), F16,
         lambda tf, torch, x: tf.dropout(x, 0.25)),
    Case("exp_f16", (((4, 8), F16),), lambda x: x.exp(), F16, lambda tf, torch, x: x.exp()),
    Case("transpose_f16", (((4, 8), F16),), lambda x: x.transpose(0, 1) * 2.0, F16,
         lambda tf, torch, x: x.transpose(0, 1) * 2.0),
    Case("embedding", (((6, 8), F32),), lambda w: F.embedding(np.array([[0, 5], [2, 2]]), w), F32,
         lambda tf, torch, w: tf.embedding(torch.tensor([[0, 5], [2, 2]]), w)),
]  # fmt: skip


def _inputs(case: Case, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, shape).astype(dtype) for shape, dtype in case.inputs]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_output_dtype_per_op_and_gradients_in_each_inputs_dtype(backend, case):
    backend.activate()
    params = [taifuse.tensor(a, requires_grad=True) for a in _inputs(case)]
    taifuse.manual_seed(0)  # dropout's mask, the same in both runs
    with autocast():
        out = case.run(*params)
    assert out.dtype == case.expected, f"{case.name} under autocast gave {out.dtype}"
    # The float32 reference: same values without autocast, in float32 (as PyTorch's float32 run).
    ref_inputs = [taifuse.tensor(a.astype(np.float32)) for a in _inputs(case)]
    taifuse.manual_seed(0)
    ref = case.run(*ref_inputs).numpy()
    tol = 2e-2 if F16 in (case.expected, *(d for _, d in case.inputs)) else 1e-6
    np.testing.assert_allclose(out.numpy().astype(np.float32), ref, rtol=tol, atol=tol, err_msg=case.name)
    (out * 1.0).sum().backward()
    for p, (_, dtype) in zip(params, case.inputs):
        assert p.grad is not None and p.grad.dtype == dtype, (case.name, p.grad)
        assert np.isfinite(p.grad.numpy()).all()


def test_float64_is_never_cast(backend):
    """float64 inputs run in float64 on every op list (as PyTorch's ``is_eligible``); the taichi
    backend has no float64 and refuses it with or without autocast."""
    backend.activate()
    rng = np.random.default_rng(1)
    x = taifuse.tensor(rng.standard_normal((4, 8)), dtype=np.float64) if backend.supports_f64 else None
    if x is None:
        with pytest.raises(TypeError), autocast():
            taifuse.tensor(rng.standard_normal((4, 8)), dtype=np.float64)
        return
    w = taifuse.tensor(rng.standard_normal((3, 8)), dtype=np.float64)
    with autocast():
        assert F.linear(x, w).dtype == F64
        assert (x @ w.T).dtype == F64
        assert F.softmax(x).dtype == F64
        assert x.sum().dtype == F64


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's rms_norm
def test_torch_cpu_autocast_gives_the_same_dtypes_except_where_documented():
    """The table against ``torch.autocast("cpu", dtype=torch.float16)``: the same output dtype on
    every op, except the reductions and normalizations that taifuse runs in float32 as PyTorch's
    CUDA list does and its CPU list does not (``torch_expected``, listed in docs/amp.md); those
    differences are asserted, so the list stays true for the torch installed."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as tf

    differs = []
    for case in CASES:
        args = [torch.from_numpy(a).requires_grad_() for a in _inputs(case)]
        with torch.autocast("cpu", dtype=torch.float16):
            out = case.torch_run(tf, torch, *args)
        got = np.dtype(str(out.dtype).removeprefix("torch."))
        want = case.expected if case.torch_expected is None else case.torch_expected
        assert got == want, f"{case.name}: torch CPU autocast gives {got}, the table says {want}"
        if case.torch_expected is not None:
            differs.append(case.name)
    assert differs == ["softmax", "log_softmax", "layer_norm", "rms_norm", "sum", "mean_dim"]


# ----------------------------------------------------------------------------- gradients of models

# NOTE [ Autocast gradient tolerance ]
# A float16 forward rounds every product's inputs and outputs to 11 significant bits (unit
# roundoff 2^-11 ~ 4.9e-4); through a few layers and their backward, each gradient's error
# against the float32 run stays a small multiple of that relative to the gradient's largest entry.
# The bound is 1e-2 of each parameter's max |grad| (about 20 roundoffs); measured on numpy, numba
# and taichi-cpu, the worst parameter was 7.7e-4 for the MLP and 1.3e-3 to 2.0e-3 for the GPT.
GRAD_RTOL = 1e-2


def _assert_grads_close(named, ref_grads: dict[str, np.ndarray], what: str) -> None:
    for name, p in named:
        assert p.grad.dtype == F32, (what, name, p.grad.dtype)
        got, ref = p.grad.numpy(), ref_grads[name]
        scale = float(np.abs(ref).max())
        err = float(np.abs(got - ref).max())
        assert err <= GRAD_RTOL * scale, f"{what} {name}: max error {err:.3g} vs max |grad| {scale:.3g}"


def _mlp() -> nn.Module:
    taifuse.manual_seed(3)
    return nn.Sequential(
        nn.Linear(16, 64, activation="gelu"),
        nn.LayerNorm(64),
        nn.Linear(64, 64, activation="relu"),
        nn.Linear(64, 5),
    )


def _grads(model, loss_fn, amp: bool) -> tuple[float, dict[str, np.ndarray]]:
    model.zero_grad()
    with autocast(enabled=amp):
        loss = loss_fn(model)
    assert loss.dtype == F32
    loss.backward()
    return loss.item(), {n: p.grad.numpy().copy() for n, p in model.named_parameters()}


def test_mlp_gradients_under_autocast_match_float32(backend):
    backend.activate()
    model = _mlp()
    rng = np.random.default_rng(4)
    x = taifuse.tensor(rng.standard_normal((32, 16)).astype(np.float32))
    target = rng.integers(0, 5, 32)

    def loss_fn(m):
        return F.cross_entropy(m(x), target)

    loss32, ref = _grads(model, loss_fn, amp=False)
    loss16, _ = _grads(model, loss_fn, amp=True)
    assert abs(loss16 - loss32) <= 1e-2 * abs(loss32)
    _assert_grads_close(model.named_parameters(), ref, f"MLP on {backend.param}")
    assert all(p.dtype == F32 for p in model.parameters())


def test_gpt_gradients_under_autocast_match_float32(backend):
    backend.activate()
    gpt = load_gpt_example()
    config = gpt.GPTConfig(
        vocab_size=11, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0, bias=True
    )
    taifuse.manual_seed(0)
    model = gpt.GPT(config)
    start = np.random.default_rng(7).integers(0, config.vocab_size, (4, 1))
    seq = (start + 3 * np.arange(config.block_size + 1)) % config.vocab_size
    idx, targets = seq[:, :-1], seq[:, 1:]

    def loss_fn(m):
        logits, loss = m(idx, targets)
        assert logits.dtype == (F16 if is_autocast_enabled() else F32)
        return loss

    loss32, ref = _grads(model, loss_fn, amp=False)
    loss16, _ = _grads(model, loss_fn, amp=True)
    assert abs(loss16 - loss32) <= 1e-2 * abs(loss32)
    _assert_grads_close(model.named_parameters(), ref, f"GPT on {backend.param}")


# ----------------------------------------------------------------------------- the cast cache


class _CastCounter:
    """Counts the casts (``_Cast`` forwards) of each array by identity."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: dict[int, int] = {}
        original = _Cast.forward

        def counting(ctx, a, dtype):
            self.counts[id(a)] = self.counts.get(id(a), 0) + 1
            return original(ctx, a, dtype)

        monkeypatch.setattr(_Cast, "forward", counting)

    def of(self, t) -> int:
        return self.counts.get(id(t._data), 0)


def test_each_parameter_is_cast_once_per_region_and_the_cache_clears_on_exit(backend, monkeypatch):
    backend.activate()
    counter = _CastCounter(monkeypatch)
    taifuse.manual_seed(5)
    layer = nn.Linear(8, 8)
    x = taifuse.tensor(np.ones((2, 8), np.float32))
    with autocast():
        y = layer(layer(x))  # the weight and bias used twice
        z = x @ layer.weight  # and a third time, by another op
        assert counter.of(layer.weight) == 1 and counter.of(layer.bias) == 1
        assert len(_amp_state().cache) == 2
        with autocast():  # a nested region shares the outer one's cache
            layer(x)
        assert counter.of(layer.weight) == 1
        assert len(_amp_state().cache) == 2  # not cleared by the inner exit
    assert len(_amp_state().cache) == 0
    (y.sum() + z.sum()).backward()
    assert layer.weight.grad.dtype == F32
    with autocast():  # the next region casts afresh (the weights may have changed)
        layer(x)
    assert counter.of(layer.weight) == 2


def test_cached_and_uncached_casts_give_the_same_gradients(backend, monkeypatch):
    backend.activate()
    counter = _CastCounter(monkeypatch)
    taifuse.manual_seed(6)
    layer = nn.Linear(8, 8)
    x = taifuse.tensor(np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32))
    grads = []
    for cache_enabled in (True, False):
        layer.zero_grad()
        with autocast(cache_enabled=cache_enabled):
            loss = layer(layer(x)).sum()
        loss.backward()
        grads.append(layer.weight.grad.numpy().copy())
    assert counter.of(layer.weight) == 1 + 2  # once cached, then once per use
    # Cached: the two uses' float16 gradients add in float16 before the cast back; uncached, in float32.
    np.testing.assert_allclose(grads[0], grads[1], rtol=2e-3, atol=2e-3 * np.abs(grads[1]).max())


def test_inputs_and_non_leaves_are_not_cached(backend, monkeypatch):
    backend.activate()
    counter = _CastCounter(monkeypatch)
    w = taifuse.tensor(np.ones((4, 4), np.float32), requires_grad=True)
    x = taifuse.tensor(np.ones((2, 4), np.float32))  # no grad: an input, cast at every use
    with autocast():
        F.linear(x, w)
        F.linear(x, w)
        h = w * 2.0  # not a leaf
        F.linear(x, h)
        F.linear(x, h)
        assert counter.of(x) == 4 and counter.of(w) == 1 and counter.of(h) == 2


def test_a_cast_cached_under_no_grad_does_not_cut_the_gradient(backend):
    backend.activate()
    w = taifuse.tensor(np.ones((4, 4), np.float32), requires_grad=True)
    x = taifuse.tensor(np.ones((2, 4), np.float32))
    with autocast():
        with taifuse.no_grad():
            F.linear(x, w)
        loss = F.linear(x, w).sum()
    loss.backward()
    np.testing.assert_array_equal(w.grad.numpy(), np.full((4, 4), 2.0, np.float32))


def test_clear_autocast_cache(backend, monkeypatch):
    backend.activate()
    counter = _CastCounter(monkeypatch)
    w = taifuse.tensor(np.ones((4, 4), np.float32), requires_grad=True)
    x = taifuse.tensor(np.ones((2, 4), np.float32))
    with autocast():
        F.linear(x, w)
        clear_autocast_cache()
        F.linear(x, w)
    assert counter.of(w) == 2


# ----------------------------------------------------------------------------- regions


def test_nesting_and_enabled_false(backend):
    backend.activate()
    x = taifuse.tensor(np.ones((2, 4), np.float32))
    w = taifuse.tensor(np.ones((3, 4), np.float32), requires_grad=True)
    assert not is_autocast_enabled()
    with autocast():
        assert is_autocast_enabled() and get_autocast_dtype() == F16
        assert F.linear(x, w).dtype == F16
        with autocast(enabled=False):
            assert not is_autocast_enabled()
            assert F.linear(x, w).dtype == F32
            assert F.softmax(taifuse.tensor(np.ones(3, np.float16))).dtype == F16  # the input's dtype
            with autocast():
                assert F.linear(x, w).dtype == F16
            assert F.linear(x, w).dtype == F32
        assert F.linear(x, w).dtype == F16
    assert not is_autocast_enabled()
    assert F.linear(x, w).dtype == F32


def test_an_exception_inside_restores_the_state(backend):
    backend.activate()
    with pytest.raises(RuntimeError), autocast():
        raise RuntimeError("inside")
    assert not is_autocast_enabled()
    assert _amp_state().nesting == 0 and not _amp_state().cache


def test_the_state_is_per_thread(backend):
    backend.activate()
    seen = []
    entered, release = threading.Event(), threading.Event()

    def other():
        entered.wait()
        seen.append(is_autocast_enabled())
        release.set()

    thread = threading.Thread(target=other)
    thread.start()
    with autocast():
        entered.set()
        release.wait(10)
        assert is_autocast_enabled()
    thread.join()
    assert seen == [False]


def test_decorator_form(backend):
    backend.activate()
    w = taifuse.tensor(np.ones((3, 4), np.float32), requires_grad=True)

    @autocast()
    def forward(x):
        return F.linear(x, w)

    @autocast(enabled=False)
    def forward_off(x):
        return F.linear(x, w)

    x = taifuse.tensor(np.ones((2, 4), np.float32))
    assert forward(x).dtype == F16
    assert F.linear(x, w).dtype == F32
    with autocast():
        assert forward_off(x).dtype == F32
        assert forward(x).dtype == F16
    assert forward.__name__ == "forward"
    assert not is_autocast_enabled()


def test_numpy_arrays_to_functional_ops_are_not_autocast():
    with backends.use_backend("numpy"), autocast():
        out = F.linear(np.ones((2, 4), np.float32), np.ones((3, 4), np.float32))
    assert out.dtype == F32


# ----------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("dtype", [np.float32, np.float64, "float32", "bfloat16", np.int8, "nonsense"])
def test_a_dtype_other_than_float16_is_a_value_error_naming_dtype(dtype):
    with pytest.raises(ValueError, match="dtype") as info:
        autocast(dtype=dtype)
    if dtype == "bfloat16":
        assert "not a compute dtype" in str(info.value)
    assert not is_autocast_enabled()


@pytest.mark.parametrize("dtype", [np.float16, "float16", np.dtype("float16")])
def test_float16_spellings(dtype):
    with autocast(dtype=dtype):
        assert get_autocast_dtype() == F16


@pytest.mark.parametrize("kwargs", [{"enabled": "yes"}, {"enabled": 1}, {"cache_enabled": None}])
def test_enabled_flags_should_be_bool(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(TypeError, match=name):
        autocast(**kwargs)


def test_a_checkpoint_recomputes_under_the_forwards_autocast(backend):
    """As PyTorch's checkpoint: the backward (run after the region) recomputes the segment in the
    forward's dtypes, so its gradients are those of the unchecked autocast run, not of a float32
    recomputation (which would differ by float16 rounding)."""
    from taifuse.checkpoint import checkpoint

    backend.activate()
    taifuse.manual_seed(8)
    block = nn.Sequential(nn.Linear(8, 16, activation="gelu"), nn.Linear(16, 8))
    x_data = np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32)
    grads = []
    for checked in (False, True):
        block.zero_grad()
        x = taifuse.tensor(x_data, requires_grad=True)
        with autocast():
            y = checkpoint(block, x) if checked else block(x)
            assert y.dtype == F16
            loss = F.mse_loss(y, np.zeros((4, 8), np.float32))
        loss.backward()
        grads.append([x.grad.numpy().copy()] + [p.grad.numpy().copy() for p in block.parameters()])
    for unchecked, checked in zip(*grads):
        np.testing.assert_array_equal(checked, unchecked)
