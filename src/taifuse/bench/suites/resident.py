"""Device-resident cases of the ``elementwise``, ``linear``, ``optim`` and ``transformer`` suites:
what ``taifuse bench --compare-torch --torch-device DEVICE`` times (:mod:`taifuse.bench.device`).

Each case moves its inputs once, before timing, to the active taifuse backend (a Taichi
``DeviceArray`` on a GPU arch; the arrays themselves on numba and numpy) and to PyTorch's device,
and every timer waits for both devices' work (``ti.sync()``, ``torch.cuda.synchronize()``: NOTE
[ Timing device work ] in taifuse.bench.timing). The rows are the GPU goals of issue 31:

* memory-bound ops at 16M elements (gelu, silu, add_relu, affine, layer_norm; float16 where the op
  takes it) against PyTorch eager and against a **device copy** of the same number of bytes
  (``dst.copy_(src)`` on PyTorch's device, reading and writing the bytes the op moves): the ratio
  of a row "taifuse vs device copy" is the fraction of the device's copy bandwidth the op reaches.
  add_relu is fused in taifuse and a pair of kernels in PyTorch eager (``add`` then ``relu_``);
* ``linear`` at (4096x1024)x(1024x1024) float32, bare and with a fused GELU (PyTorch: ``linear``
  then ``gelu``); PyTorch's float32 matmul runs without TF32 (its default), as Taichi's does;
* one AdamW step over 16M parameters against ``torch.optim.AdamW(fused=True)`` and ``foreach=True``;
* attention forward+backward (B=8, H=8, L=S=512, E=64, causal) against PyTorch's SDPA.

The rows carry no roofline column: the run's ceilings are the CPU's (their note says so); the device
copy rows are the bandwidth yardstick, and the GEMM and attention rows give their FLOP counts.
PyTorch's variants share the candidate's process on a GPU (its kernels run on the device, so no
thread pools compete); with ``--torch-device cpu`` (the dry run of benchmarks/gpu/run.sh) they are
isolated as in the host suites (NOTE [ Isolated baselines ] in taifuse.bench.harness).
"""

from __future__ import annotations

import functools

import numpy as np

from taifuse import _costs
from taifuse.bench import device
from taifuse.bench.case import Case, Variant

SUITES = ("elementwise", "linear", "optim", "transformer")
N = 16 * 2**20  # elements per array: 64 MiB of float32, past any GPU's L2
ROWS, COLS = 16 * 2**10, 1024  # the same element count as a 2-D activation map (affine, layer_norm)
LINEAR = (4096, 1024, 1024)  # batch, in, out
ADAMW_PARAMS = (4, (2048, 2048))  # 16M parameters
ATTENTION = (8, 8, 512, 64)  # B, H, L = S, E

_TAIFUSE = ("numpy as np", "taifuse", "taifuse.functional as F", "taifuse.bench.device as device")
_TORCH = ("numpy as np", "torch", "torch.nn.functional as TF")
_DEVICE_NOTE = (
    "no roofline: the run's ceilings are the CPU's; the 'device copy' row is this row's bandwidth yardstick"
)


def _count(n: int) -> str:
    return f"{n // 2**20}M" if n % 2**20 == 0 else str(n)


def _device() -> str:
    return device.torch_device() or "cpu"


def _taifuse(code: str, prepare: str, result: str = "out", note: str = "", label: str = "taifuse") -> Variant:
    return Variant(
        label, code, result=result, prepare=prepare, imports=_TAIFUSE, note=note, sync=device.TAIFUSE_SYNC
    )


def _torch(label: str, code: str, prepare: str, result: str, note: str, same_result: bool = True) -> Variant:
    dev = _device()
    return Variant(
        label,
        code,
        result=result,
        prepare=prepare.replace("DEV", repr(dev)),
        imports=_TORCH,
        same_result=same_result,
        note=f"PyTorch eager on {dev}: {note}",
        sync=device.torch_sync(dev),
        # On the CPU its OpenMP pool would compete with the candidate's threads; on a GPU nothing does.
        isolated=dev == "cpu",
    )


def device_copy(nbytes: int) -> Variant:
    """A copy on PyTorch's device that reads and writes ``nbytes`` in all (the bandwidth yardstick)."""
    half = max(nbytes // 2, 1)
    return _torch(
        "device copy",
        "dst.copy_(src)",
        f"src = torch.empty({half}, dtype=torch.uint8, device=DEV)\ndst = torch.empty_like(src)",
        "dst",
        f"not the same function: a copy of {half} bytes (as many bytes read and written as the op moves)",
        same_result=False,
    )


def _host_arrays(seed: int, shapes: dict[str, tuple[int, ...]], dtype: str) -> dict:
    rng = np.random.default_rng(seed)
    return {
        name: rng.standard_normal(shape, dtype=np.float32).astype(dtype) for name, shape in shapes.items()
    }


def _setup_code(shapes: dict[str, tuple[int, ...]], dtype: str) -> str:
    draws = "; ".join(
        f"{n} = rng.standard_normal({s}, dtype=np.float32).astype(np.{dtype})" for n, s in shapes.items()
    )
    return f"rng = np.random.default_rng(seed); {draws}"


def _tolerance(dtype: str) -> dict:
    # float16: one rounding of either side's float32 result (2**-10) and a little more for two
    # libraries' tanh/erf; float32: the host suites' elementwise tolerance.
    return {"rtol": 2.0**-9, "atol": 2.0**-14} if dtype == "float16" else {"rtol": 1e-5, "atol": 1e-5}


def _memory_case(
    suite: str,
    name: str,
    shapes: dict[str, tuple[int, ...]],
    dtype: str,
    taifuse_code: str,
    torch_code: str,
    torch_note: str,
    compare_torch: bool,
    out_like: str = "x",
) -> Case:
    """A memory-bound op on arrays ``shapes`` (the output shaped as ``out_like``)."""
    names = tuple(shapes)
    itemsize = np.dtype(dtype).itemsize
    out_elements = int(np.prod(shapes[out_like]))
    moved = itemsize * (sum(int(np.prod(s)) for s in shapes.values()) + out_elements)
    prepare = (
        "\n".join(f"{n}d = device.to_backend({n})" for n in names) + f"\nout = device.empty_like({out_like}d)"
    )
    baselines = []
    if compare_torch:
        tprep = (
            "\n".join(f"{n}t = torch.from_numpy({n}).to(DEV)" for n in names)
            + f"\not = torch.empty_like({out_like}t)"
        )
        baselines += [_torch("torch", torch_code, tprep, "ot", torch_note), device_copy(moved)]
    shape_text = " , ".join(f"{n} {s}" for n, s in shapes.items())
    return Case(
        suite=suite,
        name=f"{name}, {dtype}, {_count(out_elements)} elements, on the device",
        setup=functools.partial(_host_arrays, shapes=shapes, dtype=dtype),
        setup_code=_setup_code(shapes, dtype),
        candidate=_taifuse(taifuse_code, prepare, note=_DEVICE_NOTE),
        baselines=tuple(baselines),
        dtype=dtype,
        shape=shape_text,
        bytes_moved=moved,
        bytes_written=itemsize * out_elements,
        extra={"device": True},
        **_tolerance(dtype),
    )


def elementwise_cases(compare_torch: bool, n: int = N, rows: int = ROWS, cols: int = COLS) -> list[Case]:
    flat = {"x": (n,)}
    pair = {"a": (n,), "b": (n,)}
    grid = {"x": (rows, cols), "w": (cols,), "b": (cols,)}
    s = "elementwise"
    cases = []
    for dtype in ("float32", "float16"):
        cases.append(
            _memory_case(
                s,
                "gelu(approximate='tanh')",
                flat,
                dtype,
                "F.gelu(xd, approximate='tanh', out=out)",
                "torch._C._nn.gelu(xt, approximate='tanh', out=ot)",
                "gelu(out=)",
                compare_torch,
            )
        )
        cases.append(
            _memory_case(
                s,
                "add_relu",
                pair,
                dtype,
                "F.add_relu(ad, bd, out=out)",
                "torch.add(at, bt, out=ot)\not.relu_()",
                "the unfused pair add(out=), relu_()",
                compare_torch,
                out_like="a",
            )
        )
    cases += [
        _memory_case(
            s,
            "gelu(approximate='none')",
            flat,
            "float32",
            "F.gelu(xd, out=out)",
            "torch._C._nn.gelu(xt, out=ot)",
            "gelu(out=)",
            compare_torch,
        ),
        _memory_case(
            s,
            "silu",
            flat,
            "float32",
            "F.silu(xd, out=out)",
            "torch._C._nn.silu(xt, out=ot)",
            "silu(out=)",
            compare_torch,
        ),
        _memory_case(
            s,
            "affine",
            grid,
            "float32",
            "F.affine(xd, wd, bd, out=out)",
            "torch.addcmul(bt, xt, wt, out=ot)",
            "addcmul(out=), one kernel",
            compare_torch,
        ),
        _memory_case(
            s,
            "layer_norm",
            grid,
            "float32",
            f"F.layer_norm(xd, ({cols},), wd, bd, out=out)",
            f"ot = TF.layer_norm(xt, ({cols},), wt, bt)",
            "layer_norm (allocates its output)",
            compare_torch,
        ),
    ]
    return cases


def _linear_inputs(seed: int, shape: tuple[int, int, int]) -> dict:
    batch, fin, fout = shape
    rng = np.random.default_rng(seed)
    scale = np.float32(1.0 / np.sqrt(fin))
    return {
        "x": rng.standard_normal((batch, fin), dtype=np.float32),
        "w": rng.standard_normal((fout, fin), dtype=np.float32) * scale,
        "b": rng.standard_normal(fout, dtype=np.float32) * scale,
    }


def linear_cases(compare_torch: bool, shape: tuple[int, int, int] = LINEAR) -> list[Case]:
    batch, fin, fout = shape
    cases = []
    for activation in (None, "gelu"):
        act = "" if activation is None else f", activation={activation!r}"
        taifuse_code = f"F.linear(xd, wd, bd{act}, out=out)"
        prepare = "xd, wd, bd = (device.to_backend(a) for a in (x, w, b))\n"
        prepare += f"out = device.empty_like(np.empty(({batch}, {fout}), np.float32))"
        baselines = []
        if compare_torch:
            tprep = "xt, wt, bt = (torch.from_numpy(a).to(DEV) for a in (x, w, b))\n"
            tprep += "ot = torch.empty((xt.shape[0], wt.shape[0]), device=DEV)"
            if activation is None:
                code, note = (
                    "torch.addmm(bt, xt, wt.t(), out=ot)",
                    "addmm(out=) (cuBLAS on CUDA, float32 without TF32)",
                )
            else:
                code, note = (
                    "ot = TF.gelu(TF.linear(xt, wt, bt))",
                    "linear then gelu, two kernels (cuBLAS on CUDA)",
                )
            baselines.append(_torch("torch", code, tprep, "ot", note))
        flops = 2 * batch * fin * fout
        cases.append(
            Case(
                suite="linear",
                name=f"linear{'' if activation is None else '+' + activation}({batch}x{fin})x({fin}x{fout}), on the device",
                setup=functools.partial(_linear_inputs, shape=shape),
                setup_code=(
                    f"rng = np.random.default_rng(seed); s = 1/sqrt({fin}); x = rng.standard_normal(({batch}, {fin})); "
                    f"w = rng.standard_normal(({fout}, {fin})) * s; b = rng.standard_normal({fout}) * s  (float32)"
                ),
                candidate=_taifuse(
                    taifuse_code, prepare, note=f"{flops / 1e9:.1f} GFLOP a call; {_DEVICE_NOTE}"
                ),
                baselines=tuple(baselines),
                dtype="float32",
                shape=f"x ({batch}, {fin}), weight ({fout}, {fin}), bias ({fout},)",
                bytes_moved=4 * (batch * fin + fout * fin + fout + batch * fout),
                bytes_written=4 * batch * fout,
                flops=flops,
                extra={"device": True},
                rtol=1e-4,
                atol=1e-4,
            )
        )
    return cases


def _adamw_inputs(seed: int, count: int, shape: tuple[int, int]) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "params": [rng.standard_normal(shape, dtype=np.float32) for _ in range(count)],
        "grads": [rng.standard_normal(shape, dtype=np.float32) * np.float32(1e-2) for _ in range(count)],
    }


def optim_cases(compare_torch: bool, params: tuple[int, tuple[int, int]] = ADAMW_PARAMS) -> list[Case]:
    count, shape = params
    elements = count * shape[0] * shape[1]
    prepare = """
ps = [nn.Parameter(p) for p in params]
opt = optim.AdamW(ps, lr=1e-3)
# d/dp sum(p * g) = g: backward() puts each gradient into its slot, on the device, as in training
sum((p * taifuse.tensor(g)).sum() for p, g in zip(ps, grads)).backward()
"""
    candidate = Variant(
        "taifuse",
        "opt.step()",
        result="ps[0].numpy()",
        prepare=prepare,
        imports=(*_TAIFUSE, "taifuse.optim as optim", "taifuse.nn as nn"),
        note=_DEVICE_NOTE,
        sync=device.TAIFUSE_SYNC,
    )
    baselines = []
    cost = _costs.optimizer_step(4 * elements, 4 * elements, 4 * elements * 2)
    if compare_torch:
        tprep = """
tps = [torch.tensor(p, device=DEV, requires_grad=True) for p in params]
for tp, g in zip(tps, grads):
    tp.grad = torch.tensor(g, device=DEV)
topt = torch.optim.AdamW(tps, lr=1e-3, {variant}=True)
"""
        for variant in ("fused", "foreach"):
            baselines.append(
                _torch(
                    f"torch {variant}",
                    "topt.step()",
                    tprep.format(variant=variant),
                    "tps[0].detach()",
                    f"AdamW({variant}=True) on copies of the same parameters and gradients",
                )
            )
        baselines.append(device_copy(cost.bytes_moved))
    return [
        Case(
            suite="optim",
            name=f"AdamW step, {count}x{shape}, on the device",
            setup=functools.partial(_adamw_inputs, count=count, shape=shape),
            setup_code=(
                f"rng = np.random.default_rng(seed); params = [rng.standard_normal({shape}) for _ in range({count})]; "
                f"grads = [rng.standard_normal({shape}) * 1e-2 for _ in range({count})]  (float32)"
            ),
            candidate=candidate,
            baselines=tuple(baselines),
            dtype="float32",
            shape=f"{count} parameters of {shape}",
            bytes_moved=cost.bytes_moved,
            bytes_written=cost.bytes_written,
            extra={"device": True},
            rtol=1e-5,
            atol=1e-6,
        )
    ]


def _attention_inputs(seed: int, shape: tuple[int, int, int, int]) -> dict:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape, dtype=np.float32) for name in ("q", "k", "v", "g")}


class Outputs:
    """Outputs read only when the correctness check asks (``numpy()``), never in a timed call."""

    def __init__(self, read) -> None:
        self._read = read

    def numpy(self) -> np.ndarray:
        return np.concatenate([np.asarray(a, dtype=np.float32).ravel() for a in self._read()])


def transformer_cases(compare_torch: bool, shape: tuple[int, int, int, int] = ATTENTION) -> list[Case]:
    b, h, seq, e = shape
    prepare = """
qt, kt, vt = (taifuse.tensor(device.to_backend(a), requires_grad=True) for a in (q, k, v))
gt = taifuse.tensor(device.to_backend(g))
out = None
step = suite.Outputs(lambda: [out.numpy(), qt.grad.numpy(), kt.grad.numpy(), vt.grad.numpy()])
"""
    code = """
qt.grad = kt.grad = vt.grad = None
out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
out.backward(gt)
"""
    candidate = Variant(
        "taifuse",
        code,
        result="step",
        prepare=prepare,
        imports=(*_TAIFUSE, "taifuse.bench.suites.resident as suite"),
        note=f"taifuse Tensors on the device: F.scaled_dot_product_attention, then out.backward(g); {_DEVICE_NOTE}",
        sync=device.TAIFUSE_SYNC,
    )
    baselines = []
    if compare_torch:
        tprep = """
qt, kt, vt = (torch.tensor(a, device=DEV, requires_grad=True) for a in (q, k, v))
gt = torch.tensor(g, device=DEV)
out = None
step = suite.Outputs(lambda: [out.detach().cpu(), qt.grad.cpu(), kt.grad.cpu(), vt.grad.cpu()])
"""
        dev = _device()
        baselines.append(
            Variant(
                "torch",
                code.replace("F.scaled", "TF.scaled"),
                result="step",
                prepare=tprep.replace("DEV", repr(dev)),
                imports=(*_TORCH, "taifuse.bench.suites.resident as suite"),
                note=f"PyTorch eager on {dev}: F.scaled_dot_product_attention (its fused SDPA kernels), then backward",
                sync=device.torch_sync(dev),
                isolated=dev == "cpu",
            )
        )
    cost = _costs.attention(b, h, seq, seq, e, True, phase="both")
    return [
        Case(
            suite="transformer",
            name=f"attention forward+backward(B={b}, H={h}, L=S={seq}, E={e}, causal), on the device",
            setup=functools.partial(_attention_inputs, shape=shape),
            setup_code=f"rng = np.random.default_rng(seed); q, k, v, g = (rng.standard_normal({shape}) for _ in range(4))  (float32)",
            candidate=candidate,
            baselines=tuple(baselines),
            dtype="float32",
            shape=f"q, k, v ({b}, {h}, {seq}, {e}), causal; outputs: out, then the gradients of q, k, v",
            bytes_moved=cost.bytes_moved,
            bytes_written=cost.bytes_written,
            flops=cost.flops,
            extra={"device": True},
            rtol=1e-4,
            atol=1e-4,
        )
    ]


_BUILDERS = {
    "elementwise": elementwise_cases,
    "linear": linear_cases,
    "optim": optim_cases,
    "transformer": transformer_cases,
}


def cases(suite: str, compare_torch: bool) -> list[Case]:
    """The device-resident cases of ``suite`` (one of :data:`SUITES`)."""
    return _BUILDERS[suite](compare_torch)
