"""Fused linear + activation: taifuse ``linear(x, w, b, activation)`` against the bare BLAS product
(a lower bound), NumPy's product followed by separate bias and activation passes, and PyTorch."""

from __future__ import annotations

import math

import numpy as np

from taifuse import _costs
from taifuse.bench.case import Case, Variant
from taifuse.bench.suites.elementwise import numpy_gelu_erf, numpy_gelu_tanh

SUITE = "linear"
BATCH, IN_FEATURES, OUT_FEATURES = 4096, 1024, 768
_TAIFUSE = ("numpy as np", "taifuse.functional as F")
_TORCH = ("numpy as np", "torch", "torch.nn.functional as TF")
_OUT = f"out = np.empty(({BATCH}, {OUT_FEATURES}), dtype=np.float32)"

# NumPy epilogues applied in place to the biased product `y`, written into `out`.
_NUMPY_EPILOGUE = {
    "gelu": numpy_gelu_erf("y"),
    "gelu_tanh": numpy_gelu_tanh("y"),
    "relu": "np.maximum(y, 0.0, out=out)",
}
_TORCH_ACT = {
    "gelu": "TF.gelu({})",
    "gelu_tanh": "TF.gelu({}, approximate='tanh')",
    "relu": "TF.relu({})",
}


def _inputs(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    # Weights scaled like torch.nn.Linear's init so activations land where GELU is not trivial.
    scale = np.float32(1.0 / math.sqrt(IN_FEATURES))
    return {
        "x": rng.standard_normal((BATCH, IN_FEATURES), dtype=np.float32),
        "w": rng.standard_normal((OUT_FEATURES, IN_FEATURES), dtype=np.float32) * scale,
        "b": rng.standard_normal(OUT_FEATURES, dtype=np.float32) * scale,
    }


_SETUP = (
    "rng = np.random.default_rng(seed); scale = np.float32(1 / math.sqrt(IN_FEATURES)); "
    f"x = rng.standard_normal(({BATCH}, {IN_FEATURES}), dtype=np.float32); "
    f"w = rng.standard_normal(({OUT_FEATURES}, {IN_FEATURES}), dtype=np.float32) * scale; "
    f"b = rng.standard_normal({OUT_FEATURES}, dtype=np.float32) * scale  # IN_FEATURES = {IN_FEATURES}"
)


def _numpy_separate(activation: str) -> Variant:
    code = f"np.matmul(x, w.T, out=y)\ny += b\n{_NUMPY_EPILOGUE[activation].strip()}"
    prepare = f"{_OUT}\ny = np.empty_like(out)\nt = np.empty_like(out)\nu = np.empty_like(out)"
    return Variant(
        "numpy separate",
        code,
        prepare=prepare,
        note="np.matmul into a buffer, then bias and activation as separate in-place NumPy passes",
    )


def _case(activation: str, compare_torch: bool) -> Case:
    baselines = [
        Variant(
            "bare matmul",
            "np.matmul(x, w.T, out=out)",
            prepare=_OUT,
            same_result=False,
            note="not the same function: the BLAS product alone, the lower bound of any fused linear",
        ),
        _numpy_separate(activation),
    ]
    if compare_torch:
        baselines.append(
            Variant(
                "torch",
                "y = " + _TORCH_ACT[activation].format("TF.linear(xt, wt, bt)"),
                result="y",
                prepare="xt, wt, bt = (torch.from_numpy(v) for v in (x, w, b))",
                imports=_TORCH,
                note="PyTorch CPU gelu(linear(x)) on zero-copy views of the same inputs",
                # PyTorch's OpenMP pool and NumPy's OpenBLAS threads slow each other when called
                # back to back: NOTE [ Isolated baselines ] in taifuse.bench.harness.
                isolated=True,
            )
        )
        baselines.append(
            Variant(
                "torch bare matmul",
                "y = torch.mm(xt, wt.T)",
                result="y",
                prepare="xt, wt = (torch.from_numpy(v) for v in (x, w))",
                imports=_TORCH,
                same_result=False,
                note="not the same function: PyTorch's product alone (MKL), against NumPy's in the bare "
                "matmul row; timed in processes of its own",
                isolated=True,
            )
        )
    cost = _costs.linear(BATCH, IN_FEATURES, OUT_FEATURES)
    return Case(
        suite=SUITE,
        name=f"linear(activation='{activation}')",
        setup=_inputs,
        setup_code=_SETUP,
        candidate=Variant(
            "taifuse",
            f"F.linear(x, w, b, activation='{activation}', out=out)",
            prepare=_OUT,
            imports=_TAIFUSE,
        ),
        baselines=tuple(baselines),
        dtype="float32",
        shape=f"x ({BATCH}, {IN_FEATURES}) @ w ({OUT_FEATURES}, {IN_FEATURES}).T + b ({OUT_FEATURES},)",
        bytes_moved=cost.bytes_moved,
        flops=cost.flops,
        rtol=1e-4,
        atol=1e-4,
    )


# The backward case: (N, K) -> (N, M) with N x M = 4M, where the epilogue runs parallel
# (NOTE [ Serial epilogue between BLAS calls ] in backends/numba/_jit.py).
BWD_BATCH, BWD_IN, BWD_OUT = 4096, 768, 1024


def _backward_inputs(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    scale = np.float32(1.0 / math.sqrt(BWD_IN))
    return {
        "x": rng.standard_normal((BWD_BATCH, BWD_IN), dtype=np.float32),
        "w": rng.standard_normal((BWD_OUT, BWD_IN), dtype=np.float32) * scale,
        "pre": rng.standard_normal((BWD_BATCH, BWD_OUT), dtype=np.float32),
        "g": rng.standard_normal((BWD_BATCH, BWD_OUT), dtype=np.float32) / BWD_BATCH,
    }


_BWD_SETUP = (
    f"rng = np.random.default_rng(seed); x = rng.standard_normal(({BWD_BATCH}, {BWD_IN})); "
    f"w = rng.standard_normal(({BWD_OUT}, {BWD_IN})) / sqrt({BWD_IN}); "
    f"pre = rng.standard_normal(({BWD_BATCH}, {BWD_OUT})); "
    f"g = rng.standard_normal(({BWD_BATCH}, {BWD_OUT})) / {BWD_BATCH}; all float32"
)

_BWD_BUFFERS = "gp = np.empty_like(g)\ngx = np.empty_like(x)\ngw = np.empty_like(w)\ngb = np.empty(w.shape[0], np.float32)"


def _backward_case(compare_torch: bool) -> Case:
    baselines = [
        Variant(
            "bare products",
            "np.matmul(g, w, out=gx)\nnp.matmul(g.T, x, out=gw)",
            result="gw",
            prepare=_BWD_BUFFERS,
            same_result=False,
            note="not the same function: the backward's two BLAS products alone, its lower bound",
        )
    ]
    if compare_torch:
        baselines.append(
            Variant(
                "torch",
                "gp = torch.ops.aten.gelu_backward(gt, pret)\ngx = gp @ wt\ngw = gp.T @ xt\ngb = gp.sum(0)",
                result="gw",
                prepare="xt, wt, pret, gt = (torch.from_numpy(v) for v in (x, w, pre, g))",
                imports=_TORCH,
                note="what PyTorch's autograd runs for gelu(linear(x)): aten gelu_backward, two "
                "products and the bias sum",
                isolated=True,
            )
        )
    bwd = _costs.linear(BWD_BATCH, BWD_IN, BWD_OUT, backward=True, activation=True)
    return Case(
        suite=SUITE,
        name="linear backward(activation='gelu')",
        setup=_backward_inputs,
        setup_code=_BWD_SETUP,
        candidate=Variant(
            "taifuse",
            "kernels.linear_act_backward(x, w, pre, g, 'gelu', gp, gx, gw, gb)",
            result="gw",
            prepare="kernels = backends.active()\n" + _BWD_BUFFERS,
            imports=("numpy as np", "taifuse.backends as backends"),
            note="the active backend's fused backward kernel, as autograd's Linear calls it",
        ),
        baselines=tuple(baselines),
        dtype="float32",
        shape=f"x ({BWD_BATCH}, {BWD_IN}), w ({BWD_OUT}, {BWD_IN}), grad_out ({BWD_BATCH}, {BWD_OUT})",
        bytes_moved=bwd.bytes_moved,
        flops=bwd.flops,
        rtol=1e-4,
        atol=1e-5,
    )


def cases(quick: bool = False, compare_torch: bool = False) -> list[Case]:
    """GELU (exact) forward and backward in quick mode; GELU-tanh and ReLU forward epilogues as
    well in the full run."""
    activations = ("gelu",) if quick else ("gelu", "gelu_tanh", "relu")
    return [_case(a, compare_torch) for a in activations] + [_backward_case(compare_torch)]
