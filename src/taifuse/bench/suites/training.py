"""Training step: forward, loss and backward of a 784-1024-1024-10 GELU MLP at batch 256, float32,
taifuse (``nn.Linear`` with the GELU fused, ``cross_entropy``, ``Tensor.backward``) on the active
backend against PyTorch CPU (``torch.nn.Linear``, ``F.gelu``, ``F.cross_entropy``) with the same
weights, data and thread counts.

The output checked before timing is the loss followed by every parameter's gradient
(:class:`StepOutput`), so a step that computes the wrong gradients is a failed row.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from taifuse.bench.case import Case, Variant

SUITE = "training"
BATCH = 256
SIZES = (784, 1024, 1024, 10)  # input, two GELU hidden layers, classes
_LAYERS = tuple(itertools.pairwise(SIZES))


class StepOutput:
    """What a step variant returns: the loss and the gradients, read only when asked for.

    The timed calls return this object without copying anything; the correctness check (once,
    before timing) calls :meth:`numpy`, which flattens the loss and each gradient, in parameter
    order, into one float32 vector.
    """

    def __init__(self, read: Callable[[], Sequence[Any]]) -> None:
        self._read = read

    def numpy(self) -> np.ndarray:
        """The loss, then every gradient flattened, as one float32 vector."""
        return np.concatenate([np.asarray(a, dtype=np.float32).reshape(-1) for a in self._read()])


def mlp_inputs(seed: int, batch: int = BATCH, sizes: Sequence[int] = SIZES) -> dict:
    """An MLP step's batch (``x``, ``y``) and its layers' ``w{i}``, ``b{i}`` from ``seed``."""
    rng = np.random.default_rng(seed)
    inputs = {
        "x": rng.standard_normal((batch, sizes[0]), dtype=np.float32),
        "y": rng.integers(0, sizes[-1], size=batch, dtype=np.int64),
    }
    # torch.nn.Linear's initialization: weight and bias ~ U(-1/sqrt(in), 1/sqrt(in)).
    for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes), start=1):
        bound = 1.0 / math.sqrt(n_in)
        inputs[f"w{i}"] = rng.uniform(-bound, bound, size=(n_out, n_in)).astype(np.float32)
        inputs[f"b{i}"] = rng.uniform(-bound, bound, size=n_out).astype(np.float32)
    return inputs


def mlp_setup_code(batch: int = BATCH, sizes: Sequence[int] = SIZES) -> str:
    """What :func:`mlp_inputs` makes, in words, for the report's inputs line."""
    return (
        f"rng = np.random.default_rng(seed); x = rng.standard_normal(({batch}, {sizes[0]}), dtype=np.float32); "
        f"y = rng.integers(0, {sizes[-1]}, size={batch}, dtype=np.int64); then per layer (in, out) in "
        f"{list(itertools.pairwise(sizes))}: w = rng.uniform(-1/sqrt(in), 1/sqrt(in), (out, in)), "
        "b = rng.uniform(same, out), as float32"
    )


def mlp_model_code(sizes: Sequence[int] = SIZES) -> str:
    """The taifuse model of an MLP step's variants: Linear layers (GELU but the last) loaded with
    :func:`mlp_inputs`'s ``w{i}``, ``b{i}``, and ``params``."""
    layers = len(sizes) - 1
    gelu = ", activation='gelu'"
    lines = [
        f"    nn.Linear({n_in}, {n_out}{gelu if i < layers else ''}),"
        for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes), start=1)
    ]
    pairs = ", ".join(f"(w{i}, b{i})" for i in range(1, layers + 1)) + ("," if layers == 1 else "")
    return (
        "\nmodel = nn.Sequential(\n" + "\n".join(lines) + "\n)\n"
        f"model.load_state_dict({{f'{{i}}.{{k}}': v for i, (w, b) in enumerate(({pairs}))\n"
        "                       for k, v in (('weight', w), ('bias', b))})\n"
        "params = list(model.parameters())\n"
    )


_SETUP = mlp_setup_code()

_TAIFUSE_PREPARE = (
    mlp_model_code()
    + """xt = taifuse.tensor(x)
loss = None
step = suite.StepOutput(lambda: [loss.numpy()] + [p.grad.numpy() for p in params])
"""
)

_TAIFUSE_STEP = """
model.zero_grad()
loss = F.cross_entropy(model(xt), y)
loss.backward()
"""

_TORCH_PREPARE = f"""
l1, l2, l3 = (torch.nn.Linear(n_in, n_out) for n_in, n_out in {list(_LAYERS)})
with torch.no_grad():
    for layer, w, b in ((l1, w1, b1), (l2, w2, b2), (l3, w3, b3)):
        layer.weight.copy_(torch.from_numpy(w))
        layer.bias.copy_(torch.from_numpy(b))
params = [p for layer in (l1, l2, l3) for p in (layer.weight, layer.bias)]
xt, yt = torch.from_numpy(x), torch.from_numpy(y)
loss = None
step = suite.StepOutput(lambda: [loss.detach().numpy()] + [p.grad.numpy() for p in params])
"""

# zero_grad(set_to_none=True), PyTorch's default and what taifuse's zero_grad() does.
_TORCH_STEP = """
for p in params:
    p.grad = None
h = TF.gelu(l1(xt))
h = TF.gelu(l2(h))
loss = TF.cross_entropy(l3(h), yt)
loss.backward()
"""

_SUITE_IMPORT = "taifuse.bench.suites.training as suite"

# The step's matrix products alone, in its order (forward 1-3; then per layer from the top, the
# input gradient and the weight gradient; the data needs no gradient), on gradients of the
# right shapes: how much of a step is BLAS, and what PyTorch's step is against our products.
_PRODUCTS_PREPARE = """
h1, h2, g1, g2 = (np.empty((x.shape[0], w1.shape[0]), np.float32) for _ in range(4))
z = np.empty((x.shape[0], w3.shape[0]), np.float32)
g3 = np.random.default_rng(1).standard_normal(z.shape, dtype=np.float32) / z.size
gw1, gw2, gw3 = (np.empty_like(w) for w in (w1, w2, w3))
"""

_PRODUCTS = """
np.matmul(x, w1.T, out=h1)
np.matmul(h1, w2.T, out=h2)
np.matmul(h2, w3.T, out=z)
np.matmul(g3, w3, out=g2)
np.matmul(g3.T, h2, out=gw3)
np.matmul(g2, w2, out=g1)
np.matmul(g2.T, h1, out=gw2)
np.matmul(g1.T, x, out=gw1)
"""


def step_flops() -> int:
    """Floating-point operations of the step's matrix products (the elementwise work is not counted).

    Forward: 2*B*in*out per layer. Backward: the weight gradient of every layer and the input
    gradient of every layer but the first (the data needs none), each as many as the forward.
    """
    per_layer = [2 * BATCH * n_in * n_out for n_in, n_out in _LAYERS]
    return 2 * sum(per_layer) + sum(per_layer[1:])


def _case(compare_torch: bool) -> Case:
    n_params = sum(n_in * n_out + n_out for n_in, n_out in _LAYERS)
    baselines = [
        Variant(
            "products alone",
            _PRODUCTS,
            result="gw1",
            prepare=_PRODUCTS_PREPARE,
            same_result=False,
            note="not the same function: the step's 8 matrix products alone in NumPy (OpenBLAS), "
            "no epilogues, no autograd; timed in processes of its own, as PyTorch is",
            isolated=True,
        )
    ]
    if compare_torch:
        baselines.append(
            Variant(
                "torch",
                _TORCH_STEP,
                result="step",
                prepare=_TORCH_PREPARE,
                imports=("numpy as np", "torch", "torch.nn.functional as TF", _SUITE_IMPORT),
                note="PyTorch CPU eager: torch.nn.Linear, F.gelu, F.cross_entropy, loss.backward(); "
                "the same weights and data (zero-copy views), its default thread count",
                # Timed in processes of its own: NOTE [ Isolated baselines ] in taifuse.bench.harness.
                isolated=True,
            )
        )
    shape = "-".join(str(n) for n in SIZES)
    return Case(
        suite=SUITE,
        name=f"mlp_step({shape}, gelu, batch={BATCH})",
        setup=mlp_inputs,
        setup_code=_SETUP,
        candidate=Variant(
            "taifuse",
            _TAIFUSE_STEP,
            result="step",
            prepare=_TAIFUSE_PREPARE,
            imports=("numpy as np", "taifuse", "taifuse.nn as nn", "taifuse.functional as F", _SUITE_IMPORT),
        ),
        baselines=tuple(baselines),
        dtype="float32",
        shape=f"MLP {shape} (GELU hidden layers), batch {BATCH}, cross entropy over {SIZES[-1]} classes",
        # At least: read the data and the parameters, write one gradient per parameter.
        bytes_moved=4 * (BATCH * SIZES[0] + 2 * n_params) + 8 * BATCH,
        flops=step_flops(),
        # Loss (~2.3) and gradients (|g| up to ~0.04) in one vector. Measured against torch with
        # seed 0: loss differs by 2.4e-7 (one float32 ulp), gradients by at most ~6e-9.
        rtol=1e-4,
        atol=1e-6,
    )


def cases(quick: bool = False, compare_torch: bool = False) -> list[Case]:
    """One case, the same in quick mode (the size is the point of the comparison)."""
    return [_case(compare_torch)]
