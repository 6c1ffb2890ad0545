"""Transformer suite: fused attention's time and peak memory, and one GPT training step, against
PyTorch CPU (timed in processes of its own) and the naive softmax(QK^T)V.

Three kinds of case:

* ``attention forward+backward`` and ``attention forward`` (float32, B=8, H=8, L=S=512, E=64,
  causal): ``F.scaled_dot_product_attention`` on the active backend, on Tensors (forward, then
  backward of a fixed gradient), against PyTorch CPU's ``F.scaled_dot_product_attention`` (its
  own flash kernel on CPU) and the naive attention in NumPy (each head's (L, S) probabilities
  stored whole). The full size in quick mode too: it is the size of issue 16's goal.
* ``attention peak memory`` (a :class:`~taifuse.bench.suites.memory.MemoryCase`, one head,
  L=S=4096, E=64, no mask): the peak memory of a forward, and of a forward and backward, above
  what the process held before (the inputs), fused against naive, each variant in fresh processes
  measured as ``suites/memory.py`` measures (NOTE [ Measuring peak memory ] there).
* ``attention forward+backward`` at the GPT example's small heads (``SMALL_HEADS``: B=16, H=4,
  L=S=128, E=64 and B=16, H=8, L=S=64, E=32, causal; full runs only): where the per-block work
  is a handful of small products and the softmax rows are short.
* ``layer norm forward+backward`` (float32, the GPT example's (16, 128, 256) activations, with
  weight and bias; full runs only): ``F.layer_norm`` on Tensors then backward of a fixed gradient,
  against PyTorch's and a NumPy transcription; judged against the copy bandwidth of its cache level.
* ``gpt step``: one training step (forward, cross entropy, backward, gradient clipping, AdamW) of
  ``examples/gpt.py``'s GPT against the same model in PyTorch with the same weights and batch
  (NOTE [ The GPT example from the checkout ]).

NOTE [ Attention FLOPs ]
One head attends P (query, key) pairs: L * S without a mask, L * (L + 1) / 2 when causal with
L = S (query i sees keys 0..i). Each pair costs 2 * E flops per product. The forward has two
products (Q K^T and P V): 4 * E * P. The backward has five (the scores recomputed, dV = P^T dO,
dP = dO V^T, dQ = dS K, dK = dS^T Q): 10 * E * P, 2.5x the forward, as FlashAttention-2 counts it.
Forward and backward: 14 * E * P per head, times B * H. The softmax's exponentials are not counted.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from taifuse import _costs
from taifuse._costs import attention_flops, attention_pairs
from taifuse.bench.case import Case, Variant
from taifuse.bench.row import NO_DATA, Row, RowHeader
from taifuse.bench.suites.memory import MemoryCase, measure_memory
from taifuse.bench.suites.training import StepOutput

__all__ = ["StepOutput", "attention_flops", "attention_pairs", "cases"]

SUITE = "transformer"
# Issue 16's goal size: batch, heads, query and key length, head dim.
BATCH, HEADS, SEQ, HEAD_DIM = 8, 8, 512, 64
# The peak-memory case: one head, long sequences (the (L, S) scores are 64 MiB in float32).
MEM_SEQ = 4096

_SUITE_IMPORT = "taifuse.bench.suites.transformer as suite"
_TAIFUSE = ("numpy as np", "taifuse", "taifuse.functional as F", _SUITE_IMPORT)
_TORCH = ("numpy as np", "torch", "torch.nn.functional as TF", _SUITE_IMPORT)
_NUMPY = ("numpy as np", _SUITE_IMPORT)


# attention_pairs and attention_flops live in taifuse._costs, shared with taifuse.profiler.


# ----------------------------------------------------------------------------- attention time


def _attention_inputs(seed: int, shape: tuple[int, ...]) -> dict:
    rng = np.random.default_rng(seed)
    q, k, v, g = (rng.standard_normal(shape, dtype=np.float32) for _ in range(4))
    return {"q": q, "k": k, "v": v, "g": g}


def _attention_setup_code(shape: tuple[int, ...]) -> str:
    return (
        f"rng = np.random.default_rng(seed); q, k, v, g = (rng.standard_normal({shape}, "
        "dtype=np.float32) for _ in range(4)); g is the fixed gradient of the output"
    )


_TAIFUSE_BACKWARD_PREPARE = """
qt, kt, vt = (taifuse.tensor(a, requires_grad=True) for a in (q, k, v))
gt = taifuse.tensor(g)
out = None
step = suite.StepOutput(lambda: [out.numpy(), qt.grad.numpy(), kt.grad.numpy(), vt.grad.numpy()])
"""

_TAIFUSE_BACKWARD = """
qt.grad = kt.grad = vt.grad = None
out = F.scaled_dot_product_attention(qt, kt, vt, is_causal={causal})
out.backward(gt)
"""

_TORCH_BACKWARD_PREPARE = """
qt, kt, vt = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
gt = torch.from_numpy(g)
out = None
step = suite.StepOutput(lambda: [out.detach().numpy(), qt.grad.numpy(), kt.grad.numpy(), vt.grad.numpy()])
"""

_TORCH_BACKWARD = """
qt.grad = kt.grad = vt.grad = None
out = TF.scaled_dot_product_attention(qt, kt, vt, is_causal={causal})
out.backward(gt)
"""

# The naive attention in NumPy, as tight as NumPy allows: head by head (each product one 2-D
# sgemm, one head's (L, S) scores alive at a time), the scores become the probabilities in place
# and the backward's dP becomes dS in place. `bias` is the
# causal mask as an additive (L, S) array of 0 and -inf (0.0 without a mask).
_NUMPY_PREPARE = """
L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
q3, k3, v3, g3 = (a.reshape(-1, *a.shape[-2:]) for a in (q, k, v, g))
bias = np.where(np.triu(np.ones((L, S), bool), 1), np.float32(-np.inf), np.float32(0)) if {causal} else None
scale = np.float32(1 / np.sqrt(E))
"""

_NUMPY_FORWARD = """
o = np.empty(q.shape[:-1] + v.shape[-1:], np.float32)
o3 = o.reshape(-1, *o.shape[-2:])
{grads}for h in range(q3.shape[0]):
    s = q3[h] @ k3[h].T
    s *= scale
    if bias is not None:
        s += bias
    s -= s.max(-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(-1, keepdims=True)
    np.matmul(s, v3[h], out=o3[h])
"""

_NUMPY_GRADS = """gq, gk, gv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
gq3, gk3, gv3 = (a.reshape(-1, *a.shape[-2:]) for a in (gq, gk, gv))
"""

_NUMPY_BACKWARD = """
    np.matmul(s.T, g3[h], out=gv3[h])
    ds = g3[h] @ v3[h].T
    ds -= (g3[h] * o3[h]).sum(-1, keepdims=True)
    ds *= s
    ds *= scale
    np.matmul(ds, k3[h], out=gq3[h])
    np.matmul(ds.T, q3[h], out=gk3[h])
"""


def _taifuse_backward(label: str, causal: bool) -> Variant:
    return Variant(
        label,
        _TAIFUSE_BACKWARD.format(causal=causal),
        result="step",
        prepare=_TAIFUSE_BACKWARD_PREPARE,
        imports=_TAIFUSE,
        note="taifuse Tensors: F.scaled_dot_product_attention, then out.backward(g)",
    )


def _numpy_naive(label: str, causal: bool, backward: bool) -> Variant:
    code = _NUMPY_FORWARD.format(grads=_NUMPY_GRADS if backward else "").rstrip("\n") + "\n"
    code += _NUMPY_BACKWARD if backward else ""
    outputs = "[o, gq, gk, gv]" if backward else "[o]"
    return Variant(
        label,
        code,
        result=f"suite.StepOutput(lambda: {outputs})",
        prepare=_NUMPY_PREPARE.format(causal=causal),
        imports=_NUMPY,
        note="the naive attention in NumPy: softmax(Q K^T * scale + mask) stored whole (in place), "
        "then P V" + ("; backward from the stored probabilities" if backward else ""),
    )


def _torch_attention(causal: bool, backward: bool) -> Variant:
    if backward:
        code, prepare = _TORCH_BACKWARD.format(causal=causal), _TORCH_BACKWARD_PREPARE
        note = "PyTorch CPU F.scaled_dot_product_attention (its flash kernel on CPU), then out.backward(g)"
    else:
        code = f"out = TF.scaled_dot_product_attention(qt, kt, vt, is_causal={causal})"
        prepare = "qt, kt, vt = (torch.from_numpy(a) for a in (q, k, v))\nout = None\n"
        prepare += "step = suite.StepOutput(lambda: [out.numpy()])"
        note = "PyTorch CPU F.scaled_dot_product_attention on tensors without grad (zero-copy views)"
    return Variant(
        "torch",
        code,
        result="step",
        prepare=prepare,
        imports=_TORCH,
        note=note,
        # PyTorch's OpenMP pool beside Numba's and OpenBLAS's threads: NOTE [ Isolated baselines ].
        isolated=True,
    )


def attention_case(
    compare_torch: bool,
    *,
    backward: bool,
    shape: tuple[int, int, int, int] = (BATCH, HEADS, SEQ, HEAD_DIM),
    causal: bool = True,
) -> Case:
    """Attention forward (and backward) at ``shape`` = (B, H, L, E), L = S, float32."""
    b, h, seq, e = shape
    if backward:
        candidate = _taifuse_backward("taifuse", causal)
    else:
        candidate = Variant(
            "taifuse",
            f"out = F.scaled_dot_product_attention(qt, kt, vt, is_causal={causal})",
            result="step",
            prepare="qt, kt, vt = (taifuse.tensor(a) for a in (q, k, v))\nout = None\n"
            "step = suite.StepOutput(lambda: [out.numpy()])",
            imports=_TAIFUSE,
            note="taifuse Tensors that need no gradient: the forward kernel alone",
        )
    baselines = [_numpy_naive("numpy naive", causal, backward)]
    if compare_torch:
        baselines.append(_torch_attention(causal, backward))
    cost = _costs.attention(b, h, seq, seq, e, causal, phase="both" if backward else "forward")
    mask = "causal" if causal else "no mask"
    what = "forward+backward" if backward else "forward"
    return Case(
        suite=SUITE,
        name=f"attention {what}(B={b}, H={h}, L=S={seq}, E={e}, {mask})",
        setup=functools.partial(_attention_inputs, shape=shape),
        setup_code=_attention_setup_code(shape),
        candidate=candidate,
        baselines=tuple(baselines),
        dtype="float32",
        shape=f"q, k, v ({b}, {h}, {seq}, {e}), {mask}"
        + ("; outputs: out, then the gradients of q, k, v" if backward else ""),
        bytes_moved=cost.bytes_moved,
        bytes_written=cost.bytes_written,
        flops=cost.flops,
        # Measured against torch 2.13 with seed 0 at B=H=2: at most 5e-7 apart (outputs up to ~5).
        rtol=1e-4,
        atol=1e-5,
    )


# The GPT example's attention (examples/train_gpt.py at 4 heads of width 256) and smaller heads.
SMALL_HEADS = ((16, 4, 128, 64), (16, 8, 64, 32))


# ----------------------------------------------------------------------------- layer norm

LAYER_NORM_SHAPE = (16, 128, 256)  # the GPT example's activations at batch 16, context 128, width 256


def _layer_norm_inputs(seed: int, shape: tuple[int, ...]) -> dict:
    rng = np.random.default_rng(seed)
    x, g = (rng.standard_normal(shape, dtype=np.float32) for _ in range(2))
    w, b = (rng.standard_normal(shape[-1:], dtype=np.float32) for _ in range(2))
    return {"x": x, "w": w, "b": b, "g": g}


_LN_OUTPUTS = "[out, xt.grad, wt.grad, bt.grad]"

_TAIFUSE_LN_PREPARE = f"""
xt, wt, bt = (taifuse.tensor(a, requires_grad=True) for a in (x, w, b))
gt = taifuse.tensor(g)
out = None
step = suite.StepOutput(lambda: [t.numpy() for t in {_LN_OUTPUTS}])
"""

_TORCH_LN_PREPARE = f"""
xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
gt = torch.from_numpy(g)
out = None
step = suite.StepOutput(lambda: [t.detach().numpy() for t in {_LN_OUTPUTS}])
"""

_LN_CODE = """
xt.grad = wt.grad = bt.grad = None
out = {module}.layer_norm(xt, (xt.shape[-1],), wt, bt)
out.backward(gt)
"""

# The forward and backward in NumPy, float32 throughout, as few passes as NumPy allows.
_NUMPY_LN = """
mu = x.mean(-1, keepdims=True)
xhat = x - mu
rstd = 1 / np.sqrt((xhat * xhat).mean(-1, keepdims=True) + np.float32(1e-5))
xhat *= rstd
o = xhat * w + b
gy = g * w
gx = rstd * (gy - gy.mean(-1, keepdims=True) - xhat * (gy * xhat).mean(-1, keepdims=True))
rows = tuple(range(x.ndim - 1))
gw = (g * xhat).sum(axis=rows)
gb = g.sum(axis=rows)
"""


def layer_norm_case(compare_torch: bool, *, shape: tuple[int, ...] = LAYER_NORM_SHAPE) -> Case:
    """``F.layer_norm`` over the last dim of ``shape`` with weight and bias, then its backward of
    a fixed gradient, float32. bytes_moved: x, the gradient, weight and bias read, the output and
    the three gradients written, each once."""
    n, c = math.prod(shape), shape[-1]
    written = n + n + 2 * c  # out, grad x, grad weight and bias
    baselines = [
        Variant(
            "numpy",
            _NUMPY_LN,
            result="suite.StepOutput(lambda: [o, gx, gw, gb])",
            imports=_NUMPY,
            note="the forward and backward in NumPy ufuncs and reductions, float32",
        )
    ]
    if compare_torch:
        baselines.append(
            Variant(
                "torch",
                _LN_CODE.format(module="TF"),
                result="step",
                prepare=_TORCH_LN_PREPARE,
                imports=_TORCH,
                note="PyTorch CPU F.layer_norm, then out.backward(g)",
                isolated=True,  # NOTE [ Isolated baselines ]
            )
        )
    return Case(
        suite=SUITE,
        name=f"layer norm forward+backward{shape}",
        setup=functools.partial(_layer_norm_inputs, shape=shape),
        setup_code=(
            f"rng = np.random.default_rng(seed); x, g = standard normal {shape}, w, b = standard normal "
            f"({c},), float32"
        ),
        candidate=Variant(
            "taifuse",
            _LN_CODE.format(module="F"),
            result="step",
            prepare=_TAIFUSE_LN_PREPARE,
            imports=_TAIFUSE,
            note="taifuse Tensors: F.layer_norm, then out.backward(g)",
        ),
        baselines=tuple(baselines),
        dtype="float32",
        shape=f"x {shape}, weight and bias ({c},); outputs: out, then the gradients of x, weight, bias",
        bytes_moved=4 * (2 * n + 2 * c + written),
        bytes_written=4 * written,
        # The weight and bias gradients sum 2048 rows of float32 products: float64 sums (taifuse,
        # PyTorch) against NumPy's float32 pairwise sums differ by a few 1e-5 relative.
        rtol=1e-4,
        atol=1e-4,
    )


# ----------------------------------------------------------------------------- attention memory

_MEM_SHAPE = (1, 1, MEM_SEQ, HEAD_DIM)
_MEM_SETUP = functools.partial(_attention_inputs, shape=_MEM_SHAPE)

_TAIFUSE_MEM_FORWARD_PREPARE = "qt, kt, vt = (taifuse.tensor(a) for a in (q, k, v))"
_TAIFUSE_MEM_BACKWARD_PREPARE = (
    "qt, kt, vt = (taifuse.tensor(a, requires_grad=True) for a in (q, k, v))\ngt = taifuse.tensor(g)"
)
# The step leaves nothing behind (gradients dropped at its end), so each step starts from the
# same held memory: the inputs.
_TAIFUSE_MEM_BACKWARD = """
out = F.scaled_dot_product_attention(qt, kt, vt)
out.backward(gt)
grads = [qt.grad.numpy(), kt.grad.numpy(), vt.grad.numpy()]
qt.grad = kt.grad = vt.grad = None
"""
_TAIFUSE_NAIVE_BACKWARD = """
scores = (qt @ kt.transpose(-2, -1)) * (1 / math.sqrt(qt.shape[-1]))
out = F.softmax(scores, dim=-1) @ vt
out.backward(gt)
grads = [qt.grad.numpy(), kt.grad.numpy(), vt.grad.numpy()]
qt.grad = kt.grad = vt.grad = None
"""


def _memory_variants() -> dict[str, Variant]:
    imports = (*_TAIFUSE, "math")
    return {
        v.label: v
        for v in (
            Variant(
                "taifuse fused forward",
                "out = F.scaled_dot_product_attention(qt, kt, vt)",
                result="suite.StepOutput(lambda: [out.numpy()])",
                prepare=_TAIFUSE_MEM_FORWARD_PREPARE,
                imports=imports,
            ),
            _numpy_naive("numpy naive forward", False, False),
            Variant(
                "taifuse fused forward+backward",
                _TAIFUSE_MEM_BACKWARD,
                result="suite.StepOutput(lambda: [out.numpy(), *grads])",
                prepare=_TAIFUSE_MEM_BACKWARD_PREPARE,
                imports=imports,
            ),
            _numpy_naive("numpy naive forward+backward", False, True),
            Variant(
                "taifuse naive forward+backward",
                _TAIFUSE_NAIVE_BACKWARD,
                result="suite.StepOutput(lambda: [out.numpy(), *grads])",
                prepare=_TAIFUSE_MEM_BACKWARD_PREPARE,
                imports=imports,
                note="the naive attention in taifuse Tensor ops: q @ k^T, softmax, @ v, autograd",
            ),
        )
    }


MEMORY_VARIANTS = _memory_variants()
# (fused, naive) pairs: each pair row is naive's peak over fused's; issue 16's goal is at least 8.
MEMORY_PAIRS = (
    ("taifuse fused forward", "numpy naive forward"),
    ("taifuse fused forward+backward", "numpy naive forward+backward"),
    ("taifuse fused forward+backward", "taifuse naive forward+backward"),
)


@dataclasses.dataclass(frozen=True)
class AttentionMemoryCase(MemoryCase):
    """The memory suite's peak-memory case on attention's inputs (``setup(seed)``) instead of its MLP."""

    setup: Callable[[int], dict[str, Any]] = _MEM_SETUP

    def run_job(self, job: dict) -> dict:
        variant = self.variant(job["variant"])
        # measure_memory keeps tracemalloc's peak for taifuse's labels only, because PyTorch
        # allocates where tracemalloc cannot see; NumPy's arrays it sees, so measure them under a
        # taifuse label and give the result its own label back.
        result = measure_memory(
            dataclasses.replace(variant, label=f"taifuse ({variant.label})"), self.setup(self.seed)
        )
        result["variant"] = variant.label
        if not variant.label.startswith("taifuse"):
            result["pool_peak_bytes"] = None
        return result


def attention_memory_case() -> AttentionMemoryCase:
    """Peak memory above the inputs of fused and naive attention, one head, L = S = 4096."""
    b, h, seq, e = _MEM_SHAPE
    return AttentionMemoryCase(
        suite=SUITE,
        name=f"attention peak memory(B={b}, H={h}, L=S={seq}, E={e}, no mask)",
        variants=tuple(MEMORY_VARIANTS.values()),
        pairs=MEMORY_PAIRS,
        setup_code=_attention_setup_code(_MEM_SHAPE),
        shape=f"q, k, v ({b}, {h}, {seq}, {e}) float32 (1 MiB each), no mask; the naive (L, S) scores "
        f"are {4 * seq * seq // 2**20} MiB",
    )


# ----------------------------------------------------------------------------- GPT step

# NOTE [ The GPT example from the checkout ]
# The GPT is examples/gpt.py, which is not part of the package: the suite loads it from the
# repository checkout this module sits in (src/taifuse/bench/suites/ -> the root), under the
# module name "gpt" as examples/train_gpt.py imports it. An installed (non-editable) taifuse has no
# examples/ beside it; the case is then a single row "skipped: examples/gpt.py not found". The
# model's size, the batch and the optimizer's settings are examples/train_gpt.py's defaults, read
# from its parse_args([]) (example_settings), so the row times the step the example trains with.
GPT_PATH = Path(__file__).resolve().parents[4] / "examples" / "gpt.py"

TRAIN_GPT_PATH = GPT_PATH.with_name("train_gpt.py")


@dataclasses.dataclass(frozen=True)
class GPTSettings:
    """The model and the step the GPT case times: GPTConfig's sizes, the batch, AdamW and clipping."""

    config: dict  # GPTConfig's vocab_size, block_size, n_layer, n_head, n_embd
    batch: int
    lr: float
    weight_decay: float
    grad_clip: float
    betas: tuple[float, float] = (0.9, 0.99)  # examples/train_gpt.py's (not a flag)
    source: str = "examples/train_gpt.py's defaults"


# Used when examples/train_gpt.py's defaults cannot be read (the case's shape says why).
FALLBACK_GPT = GPTSettings(
    config={"vocab_size": 97, "block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 128},
    batch=16,
    lr=3e-3,
    weight_decay=0.1,
    grad_clip=1.0,
    source="the suite's fallback config",
)


def example_settings(path: Path = TRAIN_GPT_PATH) -> GPTSettings:
    """examples/train_gpt.py's default run (``parse_args([])`` and its ``VOCAB_SIZE``), so that the
    case times the step the example trains with; :data:`FALLBACK_GPT` (its ``source`` saying why)
    when the example is missing or its defaults cannot be read."""
    try:
        gpt_module()  # train_gpt.py imports it as "gpt"
        example = _load("train_gpt", path)
        args = example.parse_args([])
        config = {
            "vocab_size": int(example.VOCAB_SIZE),
            "block_size": int(args.block_size),
            "n_layer": int(args.n_layer),
            "n_head": int(args.n_head),
            "n_embd": int(args.n_embd),
        }
        return GPTSettings(
            config, int(args.batch_size), float(args.lr), float(args.weight_decay), float(args.grad_clip)
        )
    except (Exception, SystemExit) as exc:  # noqa: BLE001 (any failure: say so in the row)
        reason = f"{type(exc).__name__}: {exc}"
        return dataclasses.replace(
            FALLBACK_GPT, source=f"the suite's fallback config ({path.name}: {reason})"
        )


def _load(name: str, path: Path) -> ModuleType:
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", "")).resolve() == path:
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass needs its module registered while it is defined
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def gpt_module(path: Path = GPT_PATH) -> ModuleType:
    """examples/gpt.py, loaded once under the name ``gpt`` (NOTE [ The GPT example from the checkout ])."""
    return _load("gpt", path)


def gpt_parameter_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The GPT's parameters by state_dict name, in registration order (examples/gpt.py's structure)."""
    c, v, t = config["n_embd"], config["vocab_size"], config["block_size"]
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (v, c), "wpe.weight": (t, c)}
    for i in range(config["n_layer"]):
        for name, shape in (
            ("ln1.weight", (c,)),
            ("ln1.bias", (c,)),
            ("attn.c_attn.weight", (3 * c, c)),
            ("attn.c_attn.bias", (3 * c,)),
            ("attn.c_proj.weight", (c, c)),
            ("attn.c_proj.bias", (c,)),
            ("ln2.weight", (c,)),
            ("ln2.bias", (c,)),
            ("mlp.fc.weight", (4 * c, c)),
            ("mlp.fc.bias", (4 * c,)),
            ("mlp.proj.weight", (c, 4 * c)),
            ("mlp.proj.bias", (c,)),
        ):
            shapes[f"blocks.{i}.{name}"] = shape
    shapes.update({"ln_f.weight": (c,), "ln_f.bias": (c,), "lm_head.weight": (v, c)})
    return shapes


def gpt_step_flops(config: dict, batch: int) -> int:
    """Flops of one training step's products: 6 per weight per token for the Linears (forward,
    input gradient, weight gradient: 2 each) and attention's 14 * E * P per head
    (NOTE [ Attention FLOPs ]), causal over the block. Embedding lookups, norms, the softmax, the
    loss and the optimizer are not counted."""
    c, n_layer, t = config["n_embd"], config["n_layer"], config["block_size"]
    linear = 12 * c * c * n_layer + config["vocab_size"] * c  # c_attn, c_proj, fc, proj; lm_head
    heads = config["n_head"]
    attention = n_layer * attention_flops(batch, heads, t, t, c // heads, causal=True, backward=True)
    return 6 * batch * t * linear + attention


def _gpt_inputs(seed: int, config: dict, batch: int) -> dict:
    """nanoGPT's initialization (examples/gpt.py's: N(0, 0.02) matrices, the two residual
    projections N(0, 0.02 / sqrt(2 n_layer)), zero biases, unit norms) and a batch of random tokens."""
    rng = np.random.default_rng(seed)
    residual_std = 0.02 / math.sqrt(2 * config["n_layer"])
    weights = {}
    for name, shape in gpt_parameter_shapes(config).items():
        if name.endswith(("c_proj.weight", "mlp.proj.weight")):
            weights[name] = rng.normal(0.0, residual_std, shape).astype(np.float32)
        elif len(shape) >= 2:
            weights[name] = rng.normal(0.0, 0.02, shape).astype(np.float32)
        elif name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")):
            weights[name] = np.ones(shape, np.float32)
        else:
            weights[name] = np.zeros(shape, np.float32)
    tokens = (batch, config["block_size"])
    return {
        "weights": weights,
        "x": rng.integers(0, config["vocab_size"], tokens, dtype=np.int64),
        "y": rng.integers(0, config["vocab_size"], tokens, dtype=np.int64),
    }


def _gpt_setup_code(batch: int) -> str:
    return (
        "rng = np.random.default_rng(seed); per parameter in state_dict order: N(0, 0.02) for matrices, "
        "N(0, 0.02 / sqrt(2 * n_layer)) for attn.c_proj and mlp.proj weights, 0 for biases, 1 for norm "
        f"weights (nanoGPT's init), float32; x, y = rng.integers(0, vocab_size, ({batch}, block_size)) "
        "each, int64"
    )


def _taifuse_gpt(g: GPTSettings) -> Variant:
    prepare = f"""
gpt = suite.gpt_module()
model = gpt.GPT(gpt.GPTConfig(**{g.config!r}))
model.load_state_dict(weights)
params = dict(model.named_parameters())
opt = model.configure_optimizer(weight_decay={g.weight_decay!r}, lr={g.lr!r}, betas={g.betas!r})
loss = None
step = suite.StepOutput(lambda: [loss.numpy()] + [params[name].grad.numpy() for name in weights])
"""
    code = f"""
opt.zero_grad()
_, loss = model(x, y)
loss.backward()
optim.clip_grad_norm_(model.parameters(), {g.grad_clip!r})
opt.step()
"""
    return Variant(
        "taifuse",
        code,
        result="step",
        prepare=prepare,
        imports=("numpy as np", "taifuse", "taifuse.optim as optim", _SUITE_IMPORT),
        note="examples/gpt.py's GPT: forward with the loss, backward, clip_grad_norm_, AdamW step",
    )


def _torch_gpt(g: GPTSettings) -> Variant:
    # The groups of the example's configure_optimizer, on PyTorch's fused AdamW (its fastest on
    # CPU; the optim suite's yardstick).
    prepare = f"""
gpt = suite.gpt_module()
tmodel = gpt.torch_gpt(gpt.GPTConfig(**{g.config!r}))
tmodel.load_state_dict({{k: torch.from_numpy(w) for k, w in weights.items()}})
params = dict(tmodel.named_parameters())
groups = [
    {{"params": [p for p in tmodel.parameters() if p.dim() >= 2], "weight_decay": {g.weight_decay!r}}},
    {{"params": [p for p in tmodel.parameters() if p.dim() < 2], "weight_decay": 0.0}},
]
topt = torch.optim.AdamW(groups, lr={g.lr!r}, betas={g.betas!r}, fused=True)
xt, yt = torch.from_numpy(x), torch.from_numpy(y)
loss = None
step = suite.StepOutput(lambda: [loss.detach().numpy()] + [params[name].grad.numpy() for name in weights])
"""
    code = f"""
topt.zero_grad()
_, loss = tmodel(xt, yt)
loss.backward()
torch.nn.utils.clip_grad_norm_(tmodel.parameters(), {g.grad_clip!r})
topt.step()
"""
    return Variant(
        "torch",
        code,
        result="step",
        prepare=prepare,
        imports=("numpy as np", "torch", _SUITE_IMPORT),
        note="examples/gpt.py's torch_gpt (the same model in PyTorch CPU eager) with the same weights "
        "and batch; AdamW(fused=True) with the same groups, clip_grad_norm_",
        isolated=True,
    )


def _gpt_name(g: GPTSettings) -> str:
    config = ", ".join(f"{k}={v}" for k, v in g.config.items())
    return f"gpt step({config}, batch={g.batch})"


@dataclasses.dataclass(frozen=True)
class SkippedCase:
    """A case that cannot run here: no worker jobs, one row that says why."""

    suite: str
    name: str
    reason: str
    dtype: str = "float32"
    shape: str = ""
    setup_code: str = ""
    seed: int = 0

    @property
    def id(self) -> str:
        return f"{self.suite}/{self.name}"

    def jobs(self, processes: int) -> list[dict]:
        return []

    def run_job(self, job: dict) -> dict:  # pragma: no cover - jobs() gives none
        raise RuntimeError(f"{self.id} is skipped: {self.reason}")

    def rows(self, runs: list[dict], error: str | None = None) -> list[dict]:
        header = RowHeader.of(self, runs, bytes_moved=None, cache=NO_DATA, tolerance=None)
        row = Row(
            id=self.id,
            kind="skipped",  # not a comparison: no summary line, nothing for --baseline to read
            label=self.name,
            unit="x speedup",
            verdict=f"skipped: {self.reason}",
            header=header,
            candidate={"label": "taifuse", "code": f"# not run: {self.reason}"},
        )
        return [row.as_dict()]


def gpt_case(
    compare_torch: bool, settings: GPTSettings | None = None, path: Path = GPT_PATH
) -> Case | SkippedCase:
    """One GPT training step (forward, loss, backward, clip, AdamW) against PyTorch's, at
    ``settings`` (default: :func:`example_settings`), or the skipped row when examples/gpt.py is
    not in a checkout beside the package (NOTE [ The GPT example from the checkout ])."""
    if not path.is_file():
        g = settings or FALLBACK_GPT
        return SkippedCase(
            SUITE,
            _gpt_name(g),
            f"examples/gpt.py not found (looked for {path})",
            shape="examples/gpt.py's GPT (not built)",
            setup_code=_gpt_setup_code(g.batch),
        )
    g = settings or example_settings()
    n_params = sum(math.prod(s) for s in gpt_parameter_shapes(g.config).values())
    tokens = g.batch * g.config["block_size"]
    return Case(
        suite=SUITE,
        name=_gpt_name(g),
        setup=functools.partial(_gpt_inputs, config=g.config, batch=g.batch),
        setup_code=_gpt_setup_code(g.batch),
        candidate=_taifuse_gpt(g),
        baselines=(_torch_gpt(g),) if compare_torch else (),
        dtype="float32",
        shape=f"GPT of {n_params} parameters ({g.source}), {tokens} tokens per step; the check "
        "compares the loss and every clipped gradient of the first step",
        # At least: the batch (int64 tokens and targets), parameters read by the forward, gradients
        # written, AdamW's read of parameter, gradient and two moments and write of three.
        bytes_moved=16 * tokens + 4 * n_params * 9,
        flops=gpt_step_flops(g.config, g.batch),
        # Measured against torch 2.13 (seed 0, the example's first defaults): the loss equal, the
        # gradients at most 3e-8 apart.
        rtol=1e-3,
        atol=1e-6,
    )


# ----------------------------------------------------------------------------- GPT step memory under autocast

# NOTE [ GPT step memory under autocast ]
# Issue 17's goal: the peak activation memory of one GPT training step under taifuse.amp.autocast
# at most 60% of the float32 step's. Both variants are the gpt case's step at the same settings
# and weights, measured as the attention memory rows are (suites/memory.py's measure_memory in
# fresh processes: a warm-up step, the pool emptied, then the peak above what the process held,
# which is the parameters, their gradients, AdamW's state and the batch). The autocast step is
# examples/train_gpt.py's --amp step: the forward and the loss under autocast, then a GradScaler's
# scale, backward, unscale_, clip_grad_norm_, step and update.
GPT_MEMORY_FLOAT32 = "taifuse float32"
GPT_MEMORY_AUTOCAST = "taifuse autocast float16"
# Autocast's peak over float32's, at most (issue 17).
GPT_MEMORY_GOAL = 0.60


def _gpt_memory_variants(g: GPTSettings) -> tuple[Variant, Variant]:
    step = _taifuse_gpt(g)
    prepare = step.prepare + "scaler = amp.GradScaler()\n"
    imports = (*step.imports, "taifuse.amp as amp")
    float32 = Variant(GPT_MEMORY_FLOAT32, step.code, result="loss", prepare=prepare, imports=imports)
    autocast = Variant(
        GPT_MEMORY_AUTOCAST,
        f"""
opt.zero_grad()
with amp.autocast():
    _, loss = model(x, y)
scaler.scale(loss).backward()
scaler.unscale_(opt)
optim.clip_grad_norm_(model.parameters(), {g.grad_clip!r})
scaler.step(opt)
scaler.update()
""",
        result="loss",
        prepare=prepare,
        imports=imports,
        note="examples/train_gpt.py's --amp step: forward and loss under taifuse.amp.autocast(), "
        "GradScaler scale, backward, unscale_, clip_grad_norm_, step, update",
    )
    return float32, autocast


@dataclasses.dataclass(frozen=True)
class GPTMemoryCase(AttentionMemoryCase):
    """The GPT step's peak memory, float32 against autocast (NOTE [ GPT step memory under
    autocast ]): a row per variant and the pair row, which also gives autocast's peak as a
    fraction of float32's (``fraction``) and both medians in bytes (``bytes``)."""

    def rows(self, runs: list[dict], error: str | None = None) -> list[dict]:
        rows = super().rows(runs, error)
        peaks = {
            label: [r["rss_peak_bytes"] for r in runs if r["variant"] == label and r.get("rss_peak_bytes")]
            for label in (GPT_MEMORY_AUTOCAST, GPT_MEMORY_FLOAT32)
        }
        for row in rows:
            if row["kind"] != "memory_compare" or row["value"] is None:
                continue
            # The pair row's value is float32's peak over autocast's: its reciprocal is the fraction.
            fraction = {"median": 1 / row["value"], "low": 1 / row["high"], "high": 1 / row["low"]}
            row["fraction"] = fraction
            row["bytes"] = {label: float(np.median(v)) for label, v in peaks.items() if v}
            row["note"] += (
                f"; autocast's peak is {fraction['median']:.3f} of float32's "
                f"(95% interval {fraction['low']:.3f}-{fraction['high']:.3f}; issue 17's goal: at most "
                f"{GPT_MEMORY_GOAL:.2f}); medians "
                + ", ".join(f"{label} {b / 2**20:.2f} MiB" for label, b in row["bytes"].items())
            )
        return rows


def gpt_memory_case(
    settings: GPTSettings | None = None, path: Path = GPT_PATH
) -> GPTMemoryCase | SkippedCase:
    """Peak activation memory of the GPT step (``settings``, default :func:`example_settings`),
    autocast float16 against float32, or the skipped row without examples/gpt.py."""
    g = settings or (example_settings() if path.is_file() else FALLBACK_GPT)
    config = ", ".join(f"{k}={v}" for k, v in g.config.items())
    name = f"GPT step peak activation memory, autocast float16 vs float32({config}, batch={g.batch})"
    if not path.is_file():
        return SkippedCase(
            SUITE,
            name,
            f"examples/gpt.py not found (looked for {path})",
            shape="examples/gpt.py's GPT (not built)",
            setup_code=_gpt_setup_code(g.batch),
        )
    variants = _gpt_memory_variants(g)
    tokens = g.batch * g.config["block_size"]
    return GPTMemoryCase(
        suite=SUITE,
        name=name,
        variants=variants,
        pairs=((GPT_MEMORY_AUTOCAST, GPT_MEMORY_FLOAT32),),
        setup_code=_gpt_setup_code(g.batch),
        shape=f"examples/gpt.py's GPT ({g.source}), {tokens} tokens per step; the peak above the "
        "parameters, gradients, AdamW state and batch",
        setup=functools.partial(_gpt_inputs, config=g.config, batch=g.batch),
    )


# ----------------------------------------------------------------------------- suite


def cases(quick: bool = False, compare_torch: bool = False) -> list:
    """Attention forward+backward and forward at issue 16's size (quick mode too), the attention
    peak-memory case, the GPT step's peak memory under autocast against float32, (full runs only)
    attention at the GPT example's small heads and its layer norm forward+backward, and the GPT
    training step."""
    return [
        attention_case(compare_torch, backward=True),
        attention_case(compare_torch, backward=False),
        attention_memory_case(),
        gpt_memory_case(),
        # The small heads and the layer norm of the GPT example: full runs only.
        *(
            []
            if quick
            else [
                *(attention_case(compare_torch, backward=True, shape=s) for s in SMALL_HEADS),
                layer_norm_case(compare_torch),
            ]
        ),
        gpt_case(compare_torch),
    ]
