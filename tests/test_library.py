"""taifuse.library: custom ops with kernels per backend, autograd, opcheck, the profiler, autocast,
checkpointing, and docs/custom_ops.md's SwiGLU example, which runs here as written."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import taifuse
from taifuse import backends, library
from taifuse.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "custom_ops.md"


def _doc_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


def _bench_block() -> str:
    return next(b for b in _doc_blocks() if "def cases(" in b)


@pytest.fixture(scope="module")
def swiglu_ops(tmp_path_factory):
    """docs/custom_ops.md's first block, saved as swiglu_ops.py and imported (once per process:
    the op's name is registered for the process)."""
    pytest.importorskip("numba")
    pytest.importorskip("taichi")
    if "swiglu_ops" not in sys.modules:
        folder = tmp_path_factory.mktemp("docs_ops")
        (folder / "swiglu_ops.py").write_text(_doc_blocks()[0])
        (folder / "bench_swiglu.py").write_text(_bench_block())
        sys.path.insert(0, str(folder))
    import swiglu_ops

    return swiglu_ops


def _unique(name: str) -> str:
    _unique.count = getattr(_unique, "count", 0) + 1
    return f"test{_unique.count}::{name}"


def _f32(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ----------------------------------------------------------------------------- the docs' example


def test_swiglu_opcheck_on_every_backend(backend, swiglu_ops):
    a, b = _f32(3, 5, 7, seed=1), _f32(3, 5, 7, seed=2)
    report = library.opcheck(swiglu_ops.swiglu, (a, b), backends_to_check=[backend.param])
    assert report.passed
    checked = {row[0] for row in report.rows}
    assert backend.param in checked, report
    # the forward and backward of this backend were compared, and the backward vs finite differences
    assert any(r[0] == backend.param and r[1].startswith("forward") for r in report.rows)
    assert any(r[0] == backend.param and r[1].startswith("backward") for r in report.rows)
    assert any("finite" in r[1] for r in report.rows)
    kernel_backends = {"numba", "taichi"}
    if backend.name in kernel_backends:  # its own kernel ran, not the reference
        assert any(r[0] == backend.param and "kernel" in r[1] for r in report.rows), report


def test_swiglu_float64_on_host_backends(swiglu_ops):
    a, b = np.random.default_rng(3).standard_normal((4, 6)), np.random.default_rng(4).standard_normal((4, 6))
    report = library.opcheck(swiglu_ops.swiglu, (a, b), backends_to_check=["numpy", "numba"])
    assert report.passed and any("float64" in r[1] for r in report.rows)


def test_opcheck_catches_a_wrong_kernel_and_an_unwritten_buffer():
    op = library.custom_op(_unique("twice"), lambda x: 2.0 * x)

    @op.register_kernel("numba")
    def _(x, out):
        out[: x.shape[0] // 2] = 2.0 * x[: x.shape[0] // 2]  # forgets half the output

    with pytest.raises(library.OpCheckError, match="FAIL"):
        library.opcheck(op, (_f32(8),), backends_to_check=["numba"])

    wrong = library.custom_op(_unique("twice"), lambda x: 2.0 * x)

    @wrong.register_kernel("numba")
    def _(x, out):
        np.multiply(x, 2.001, out=out)

    report = library.opcheck(wrong, (_f32(8),), backends_to_check=["numba"], raise_on_failure=False)
    assert not report.passed and "forward kernel" in str(report)


def test_opcheck_catches_a_kernel_that_writes_its_input():
    op = library.custom_op(_unique("inplace"), lambda x: x + 1.0)

    @op.register_kernel("numba")
    def _(x, out):
        x += 1.0
        out[...] = x

    report = library.opcheck(op, (_f32(6),), backends_to_check=["numba"], raise_on_failure=False)
    assert [r for r in report.rows if r[1] == "inputs not written" and not r[2]], report


def test_opcheck_catches_a_wrong_backward():
    op = library.custom_op(_unique("square"), lambda x: x * x)
    op.register_autograd(
        lambda ctx, g: (g * ctx.saved_tensors[0],),
        setup_context=lambda ctx, i, o: ctx.save_for_backward(i[0]),
    )
    report = library.opcheck(op, (_f32(5),), backends_to_check=["numpy"], raise_on_failure=False)
    assert not report.passed
    assert [r for r in report.rows if "finite" in r[1] and not r[2]], report


def test_docs_example_runs(swiglu_ops):
    blocks = _doc_blocks()
    assert len(blocks) >= 3
    with backends.preserved_choice():
        for code in blocks[1:]:
            if code == _bench_block():
                continue  # a module for taifuse bench: test_docs_bench_suite
            exec(compile(code, str(DOC), "exec"), {"__name__": "docs_custom_ops"})  # noqa: S102  the docs' own code


def test_docs_example_model_is_profiled_by_name(swiglu_ops):
    from taifuse import nn
    from taifuse.profiler import profile

    with backends.preserved_choice():
        taifuse.set_backend("numba")
        lin = nn.Linear(8, 16)
        x = taifuse.tensor(_f32(4, 8))
        with profile() as prof:
            swiglu_ops.swiglu(lin(x), lin(x)).sum().backward()
        names = {e.name: e for e in prof.key_averages()}
        assert {"mylib::swiglu", "mylib::swiglu_backward", "mylib::swiglu_grad"} <= set(names), sorted(names)
        # cost= fed the roofline column: 3 arrays of 4 x 16 float32 forward, one written
        ev = next(e for e in prof.events() if e.name == "mylib::swiglu")
        assert (ev.cost.bytes_moved, ev.cost.bytes_written) == (3 * 256, 256)


def test_docs_bench_suite_loads_and_its_variants_agree(swiglu_ops, monkeypatch):
    from taifuse.bench.suites import load_cases, suite_names

    monkeypatch.setenv("TAIFUSE_BENCH_SUITES", "swiglu=bench_swiglu")
    assert suite_names()[-1] == "swiglu"
    (case,) = load_cases(["swiglu"])
    assert case.id == "swiglu/swiglu forward+backward"
    with backends.preserved_choice():
        taifuse.set_backend("numba")
        inputs = case.setup(0)
        fused = case.candidate.build(inputs)()
        unfused = case.baselines[0].build(inputs)()
    np.testing.assert_allclose(fused, unfused, rtol=case.rtol, atol=case.atol)
    monkeypatch.setenv("TAIFUSE_BENCH_SUITES", "elementwise=bench_swiglu")
    with pytest.raises(ValueError, match="TAIFUSE_BENCH_SUITES"):
        suite_names()


def test_user_taichi_kernels_pass_metal_check(swiglu_ops, tmp_path):
    folder = Path(swiglu_ops.__file__).parent
    env = {**__import__("os").environ, "PYTHONPATH": f"{folder}:{ROOT / 'src'}"}
    result = subprocess.run(
        [sys.executable, "-m", "taifuse.backends.metal_check", "--out", str(tmp_path / "aot"), "--module", "swiglu_ops"],
        check=False, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    if result.returncode == 2:
        pytest.skip(f"Vulkan is unavailable: {result.stderr.strip()[-300:]}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "swiglu_ops_swiglu_ti" in result.stdout and "swiglu_ops_swiglu_backward_ti" in result.stdout


# ----------------------------------------------------------------------------- two outputs, non-tensor args


def _split_scale_op():
    def reference(x, alpha: float, shift: float = 0.0):
        return alpha * x + shift, x * x

    op = library.custom_op(_unique("scale_square"), reference, outputs=2)

    @op.register_kernel("numba")
    def _(x, alpha, shift, y, z):
        np.multiply(x, alpha, out=y)
        y += shift
        np.multiply(x, x, out=z)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.alpha = inputs[1]

    def backward(ctx, gy, gz):
        (x,) = ctx.saved_tensors
        return gy * ctx.alpha + gz * x * 2.0, None, None

    op.register_autograd(backward, setup_context=setup_context)
    return op


@pytest.mark.parametrize("name", ["numpy", "numba"])
def test_two_outputs_and_non_tensor_arguments(name):
    op = _split_scale_op()
    x = _f32(3, 4)
    with backends.use_backend(name):
        t = taifuse.tensor(x, requires_grad=True)
        y, z = op(t, 3.0, shift=0.5)
        np.testing.assert_allclose(y.numpy(), 3.0 * x + 0.5, rtol=1e-6)
        np.testing.assert_allclose(z.numpy(), x * x, rtol=1e-6)
        (2.0 * y + z).sum().backward()
        np.testing.assert_allclose(t.grad.numpy(), 6.0 + 2.0 * x, rtol=1e-5, atol=1e-6)
        # only one output used: the other's gradient is zero
        t.grad = None
        op(t, 3.0)[1].sum().backward()
        np.testing.assert_allclose(t.grad.numpy(), 2.0 * x, rtol=1e-5, atol=1e-6)
        # arrays in, arrays out, no graph
        ya, za = op(x, 2.0)
        assert isinstance(ya, np.ndarray) and np.allclose(ya, 2.0 * x) and np.allclose(za, x * x)
    report = library.opcheck(op, (x, 3.0, 0.5), backends_to_check=["numpy", "numba"])
    assert report.passed


# ----------------------------------------------------------------------------- errors


def test_no_backward_where_a_gradient_is_needed_names_the_op():
    op = library.custom_op(_unique("nograd"), lambda x: x * 2.0)
    with backends.use_backend("numpy"):
        t = taifuse.tensor(_f32(3), requires_grad=True)
        y = op(t)  # the forward runs, as PyTorch's
        np.testing.assert_allclose(y.numpy(), 2.0 * t.numpy())
        with pytest.raises(RuntimeError, match=re.escape(op.name) + ".*register_autograd"):
            y.sum().backward()
        with taifuse.no_grad():
            assert not op(t).requires_grad


@pytest.mark.parametrize("name", ["numpy", "numba"])
def test_a_gradient_returned_for_two_inputs_is_not_shared_by_their_grads(name):
    # backward hands the incoming gradient to both inputs: their leaves must each get a copy (a
    # fresh gradient is taken as it is: CustomOp.run_backward's owns_grads), or accumulating
    # into one .grad would change the other.
    op = library.custom_op(_unique("add"), lambda a, b: a + b)
    op.register_autograd(lambda ctx, g: (g, g))
    with backends.use_backend(name):
        a = taifuse.tensor(_f32(4), requires_grad=True)
        b = taifuse.tensor(_f32(4), requires_grad=True)
        for _ in range(2):
            op(a, b).backward(np.ones(4, np.float32))
        np.testing.assert_array_equal(a.grad.numpy(), np.full(4, 2.0, np.float32))
        np.testing.assert_array_equal(b.grad.numpy(), np.full(4, 2.0, np.float32))


def test_registering_for_an_unknown_backend():
    op = library.custom_op(_unique("unknown"), lambda x: x)
    with pytest.raises(ValueError, match="cuda.*numpy.*numba.*taichi|numpy.*numba.*taichi.*cuda"):
        op.register_kernel("cuda")


def test_registering_a_wrong_signature():
    op = library.custom_op(_unique("sig"), lambda a, b: a + b)
    with pytest.raises(TypeError, match=r"arguments \('a', 'b'\).*1 output"):
        op.register_kernel("numba")(lambda a, out: None)  # b missing
    with pytest.raises(TypeError, match=r"backward should take \(ctx, \*grads\)"):
        op.register_autograd(lambda ctx: None)
    with pytest.raises(TypeError, match="setup_context should take"):
        op.register_autograd(lambda ctx, g: (g, g), setup_context=lambda ctx: None)
    with pytest.raises(TypeError, match=r"name each argument"):
        library.custom_op(_unique("varargs"), lambda *xs: xs[0])
    # a call with the wrong arguments names the op
    with pytest.raises(TypeError, match=re.escape(op.name)):
        op(np.zeros(2, np.float32))


def test_registering_twice():
    name = _unique("twice")
    op = library.custom_op(name, lambda x: x)
    with pytest.raises(ValueError, match=re.escape(name) + ".*already registered"):
        library.custom_op(name, lambda x: x)
    op.register_kernel("numba")(lambda x, out: None)
    with pytest.raises(ValueError, match="numba kernel is already registered"):
        op.register_kernel("numba")(lambda x, out: None)
    op.register_autograd(lambda ctx, g: g)
    with pytest.raises(ValueError, match="autograd formula is already registered"):
        op.register_autograd(lambda ctx, g: g)
    with pytest.raises(ValueError, match="namespace::op_name"):
        library.custom_op("no_namespace", lambda x: x)
    assert library.get_op(name) is op


def test_bad_input_is_refused_before_anything_is_written():
    calls = []

    def shapes(a, b):
        if a.shape != b.shape:
            raise ValueError(f"b should have a's shape {a.shape}, got {b.shape}")
        return a.shape, a.dtype

    op = library.custom_op(_unique("checked"), lambda a, b: a * b, outputs=shapes)

    @op.register_kernel("numba")
    def _(a, b, out):
        calls.append(1)
        np.multiply(a, b, out=out)

    with backends.use_backend("numba"):
        with pytest.raises(ValueError, match="b should have"):
            op(taifuse.tensor(_f32(3)), taifuse.tensor(_f32(4)))
        with pytest.raises(TypeError, match="a should be float16, float32 or float64"):
            op(taifuse.tensor(np.arange(3)), taifuse.tensor(_f32(3)))
        with pytest.raises(TypeError, match="Tensors"):
            op(taifuse.tensor(_f32(3)), _f32(3))
    assert calls == []


def test_a_kernel_that_returns_its_own_array_is_refused():
    op = library.custom_op(_unique("alloc"), lambda x: x + 1.0)
    op.register_kernel("numba")(lambda x, out: x + 1.0)
    with backends.use_backend("numba"), pytest.raises(TypeError, match="returns None"):
        op(taifuse.tensor(_f32(3)))


def test_reference_fallback_on_taichi_warns_once(grad_backend):
    if grad_backend.name != "taichi":
        pytest.skip("the fallback warning is the device backend's")
    op = library.custom_op(_unique("fallback"), lambda x: x * 3.0)
    x = taifuse.tensor(_f32(5))
    with pytest.warns(RuntimeWarning, match="no taichi kernel"):
        y = op(x)
    np.testing.assert_allclose(y.numpy(), 3.0 * x.numpy(), rtol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        op(x)


# ----------------------------------------------------------------------------- checkpoint and autocast


def test_inside_checkpoint(swiglu_ops):
    with backends.use_backend("numba"):
        a0, b0 = _f32(4, 8, seed=5), _f32(4, 8, seed=6)
        grads = []
        for use_checkpoint in (False, True):
            a = taifuse.tensor(a0, requires_grad=True)
            b = taifuse.tensor(b0, requires_grad=True)

            def block(a, b):
                return swiglu_ops.swiglu(a * 2.0, b) * 3.0

            out = checkpoint(block, a, b) if use_checkpoint else block(a, b)
            out.sum().backward()
            grads.append((a.grad.numpy(), b.grad.numpy(), out.numpy()))
        for plain, checked in zip(*grads):
            np.testing.assert_array_equal(plain, checked)


def test_under_autocast(swiglu_ops):
    from taifuse.amp import autocast

    with backends.use_backend("numba"):
        a = taifuse.tensor(_f32(4, 8, seed=7).astype(np.float16), requires_grad=True)
        b = taifuse.tensor(_f32(4, 8, seed=8).astype(np.float16), requires_grad=True)
        with autocast():
            out = swiglu_ops.swiglu(a, b)
        assert out.dtype == np.float32  # autocast="fp32": float16 inputs run in float32
        out.sum().backward()
        assert a.grad.dtype == np.float16 and b.grad.dtype == np.float16
        a64, b64 = a.numpy().astype(np.float64), b.numpy().astype(np.float64)
        s = 1.0 / (1.0 + np.exp(-a64))
        np.testing.assert_allclose(out.numpy(), a64 * s * b64, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(b.grad.numpy(), a64 * s, rtol=2e-3, atol=1e-4)
        # a "fp16" op casts float32 inputs down
        half = library.custom_op(_unique("half"), lambda x: x + 1.0, autocast="fp16")
        with autocast():
            assert half(taifuse.tensor(_f32(3))).dtype == np.float16
        assert half(taifuse.tensor(_f32(3))).dtype == np.float32


def test_import_taifuse_does_not_import_the_library():
    code = "import sys, taifuse; assert 'taifuse.library' not in sys.modules; taifuse.library.custom_op"
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONPATH": str(ROOT / "src")})
