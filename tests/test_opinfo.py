"""PyTorch's own OpInfo samples, run through taifuse on every backend, forward and backward.

``torch.testing._internal.common_methods_invocations.op_db`` is the list of sample inputs PyTorch
tests its own ops with (shapes from 0-d to 5-d, empty tensors, broadcasting, every keyword an op
takes). ``TABLE`` maps each taifuse op (``taifuse.functional.__all__``, the Tensor methods and
operators, ``taifuse.cat``/``stack``) to its OpInfo entries; every sample PyTorch generates in
float32, and in float16 where the taifuse op takes float16 storage, becomes one test that runs the
taifuse op and compares with PyTorch computing the same op in float64 on the same values:

* the result's shape, dtype and values (``helpers.assert_close``, the float32/float16 entry of the
  tolerance table, or twice PyTorch's own worst error on the sample in the same dtype where that
  is larger);
* every input's gradient for one random upstream gradient.

Dropout (``F.dropout``, attention's ``dropout_p``) draws taifuse's documented counter-hash mask;
the PyTorch reference is given that mask (NOTE [ OpInfo dropout ] below).

A sample taifuse does not support by design (a keyword it refuses, a feature the docs say is
refused) must be refused with a ``ValueError``/``TypeError`` (asserted), and is then reported as
skipped with the reason; one that taifuse has no way to spell at all (``alpha=`` of ``+``, a device
argument) is skipped with that reason. Nothing passes without being compared. Known defects are
strict xfails with the reason, so fixing one makes its test fail until the mark goes.

Covering an op added later is one row of ``TABLE``; ``test_table_covers_every_op`` fails until
it has one (or an entry in ``NO_OPINFO`` saying why there is none). Skipped when torch or
expecttest (which ``common_methods_invocations`` imports) is absent.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from helpers import CANNOT_EXPRESS, F16, F32, REFUSED_BY_DESIGN, TOLERANCES, Tol, assert_close

import taifuse
import taifuse.functional as F
from taifuse import Tensor

torch = pytest.importorskip("torch")
pytest.importorskip("expecttest")
from torch.testing._internal.common_methods_invocations import op_db

OPINFOS = {(op.name, op.variant_test_name): op for op in op_db}
TORCH_DTYPES = {F32: torch.float32, F16: torch.float16}


class NoSpelling(Exception):
    """The sample uses something taifuse has no way to write (the reason is the message)."""


# ----------------------------------------------------------------------------- the samples' values


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _to_numpy_dtype(dtype: Any) -> np.dtype:
    return np.dtype(str(dtype).removeprefix("torch."))


def _to_taifuse(value: Any, leaves: list) -> Any:
    """A sample's argument as taifuse takes it: a float tensor as a Tensor (a leaf that requires
    grad where PyTorch's does), an integer or boolean tensor (indices, masks) as a NumPy array, a
    torch dtype as the NumPy dtype; lists and tuples element by element."""
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            raise NoSpelling("complex tensors")
        array = value.detach().numpy().copy()
        if not value.is_floating_point():
            return array
        t = taifuse.tensor(array, requires_grad=value.requires_grad)
        leaves.append((value, t))
        return t
    if isinstance(value, (list, tuple)):
        return type(value)(_to_taifuse(v, leaves) for v in value)
    if isinstance(value, torch.dtype):
        return _to_numpy_dtype(value)
    if value is torch.preserve_format:
        return None  # the default of every memory_format argument: nothing to ask of taifuse
    if isinstance(value, (torch.device, torch.memory_format)):
        raise NoSpelling(f"{type(value).__name__} arguments (taifuse has no devices or memory formats)")
    return value


def _leaves_in(dtype: Any) -> Callable:
    """A converter of the sample's arguments for PyTorch: float tensors as leaves in ``dtype``
    (None: the sample's own), which require grad where the sample's do."""

    def convert(value: Any, leaves: list) -> Any:
        if _is_float(value):
            t = value.detach().to(dtype or value.dtype).requires_grad_(value.requires_grad)
            leaves.append((value, t))
            return t
        if isinstance(value, torch.Tensor):
            return value.detach()
        if isinstance(value, (list, tuple)):
            return type(value)(convert(v, leaves) for v in value)
        return value

    return convert


def _outputs(result: Any) -> list:
    """The op's results as a flat list (split, chunk and max with a dim return several)."""
    if isinstance(result, (list, tuple)):
        return [r for item in result for r in _outputs(item)]
    return [result]


def _numpy(value: Any) -> np.ndarray:
    if isinstance(value, Tensor):
        return value.numpy()
    if isinstance(value, torch.Tensor):
        return value.detach().numpy()
    return np.asarray(value)


# ----------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Row:
    """One taifuse op and the OpInfo entries whose samples it runs.

    ``call(input, *args, **kwargs)`` runs taifuse on a sample converted by ``_to_taifuse``;
    ``reference(input, *args, **kwargs)`` is what PyTorch computes (default: the OpInfo's op).
    ``refused(sample)`` is None or why taifuse refuses the sample by design (it must raise);
    ``no_spelling(sample)`` None or why taifuse cannot be asked it. ``xfail(case, backend)`` is
    None or a known defect (a strict xfail). ``magnitude``: the op sums products, so its float32 error grows with
    the magnitudes summed: the bound is scaled by the op (and its gradient) run on |inputs|, as
    ``helpers.check_op``'s scale; ``tensor_scale``: by the largest of those over the tensor.
    ``inplace``: the op updates its input and has no backward.
    """

    name: str
    opinfos: tuple[str, ...]
    call: Callable
    reference: Callable | None = None
    refused: Callable[[Any], str | None] = lambda s: None
    no_spelling: Callable[[Any], str | None] = lambda s: None
    xfail: Callable[[Any, str], str | None] = lambda case, backend: None
    f16: bool = True
    magnitude: bool = False
    inplace: bool = False
    mask_shape: Callable[[Any], tuple[int, ...] | None] | None = None
    no_grad: Callable[[Any], str | None] = lambda s: None
    float64_result: bool = False
    tensor_scale: bool = False
    int32_indices_on_taichi: bool = False
    tol: dict = field(default_factory=dict)
    # Run every sample_stride-th sample only: for an OpInfo that enumerates a product of options
    # (max_pool2d: 1,440 samples), a stride prime to its cycles keeps each option in the run.
    sample_stride: int = 1


def _functional(name: str) -> Callable:
    return lambda *args, **kwargs: getattr(F, name)(*args, **kwargs)


def _method(name: str) -> Callable:
    return lambda self, *args, **kwargs: getattr(self, name)(*args, **kwargs)


def _binary(op: Callable) -> Callable:
    """An operator (``a + b``); keywords it cannot take are ``no_spelling`` in its row."""
    return lambda a, b, **kwargs: op(a, b)


def _kwarg(*names: str, why: str) -> Callable[[Any], str | None]:
    def check(sample: Any) -> str | None:
        used = [n for n in names if n in sample.kwargs]
        return f"{', '.join(used)}= ({why})" if used else None

    return check


def _either(*checks: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    def check(sample: Any) -> str | None:
        return next((r for r in (c(sample) for c in checks) if r is not None), None)

    return check


NO_ALPHA = _kwarg("alpha", why="taifuse's operators take no alpha; write a + alpha * b")


def _tensor_other(sample: Any) -> str | None:
    other = sample.args[0] if sample.args else None
    if isinstance(other, torch.Tensor):
        return "a tensor exponent (taifuse's ** takes a real number)"
    return None


# NOTE [ OpInfo dropout ]
# Dropout's mask is random, and taifuse's is a counter hash of the element index and a seed drawn
# from taifuse's generator (taifuse/_random.py), not PyTorch's. The random rows take it from
# F.dropout on ones of the mask's shape under the seed the op itself then draws, and hand it to
# the PyTorch reference as ``mask`` (kept elements 1 / (1 - p), dropped ones 0).
def _dropout_reference(
    x: Any, p: float = 0.5, training: bool = True, inplace: bool = False, *, mask: Any
) -> Any:
    return x * mask if training else x


def _dropout_mask_shape(sample: Any) -> tuple[int, ...] | None:
    p, training = sample.kwargs.get("p", 0.5), sample.kwargs.get("training", True)
    return tuple(sample.input.shape) if training and p > 0 else None


def _sdpa_reference(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *, mask: Any) -> Any:
    """PyTorch's math of scaled_dot_product_attention with the dropout mask given."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    if is_causal:
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, -math.inf)
    if attn_mask is not None:
        scores = (
            scores.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else scores + attn_mask
        )
    return (torch.softmax(scores, dim=-1) * mask) @ v


# The backward's terms are g * rstd before they cancel, and a constant row (one feature, as one of
# the samples) has rstd = 1 / sqrt(eps) ~ 316: 1e-5 per unit is float32 rounding of terms that large.
LAYER_NORM_F32 = Tol(rtol=TOLERANCES[F32].rtol, atol=1e-5, floor=TOLERANCES[F32].floor)

# tests/test_attention.py's tolerances: attention sums S products of probabilities and values, so
# a float32 kernel's error grows like eps * sqrt(S) times the largest term (the op's magnitude here).
SDPA_TOL = {
    F32: Tol(rtol=3e-5, atol=3e-5, floor=TOLERANCES[F32].floor),
    F16: Tol(rtol=4e-3, atol=4e-3, floor=TOLERANCES[F16].floor),
}


def _sdpa_mask_no_grad(sample: Any) -> str | None:
    mask = sample.kwargs.get("attn_mask")
    if isinstance(mask, torch.Tensor) and mask.requires_grad:
        return "attn_mask gets no gradient (documented in F.scaled_dot_product_attention)"
    return None


def _sdpa_mask_shape(sample: Any) -> tuple[int, ...] | None:
    q, k = sample.input, sample.args[0]
    if sample.kwargs.get("dropout_p", 0.0) == 0:
        return None
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    return (*batch, q.shape[-2], k.shape[-2])


def _affine_shapes(sample: Any) -> str | None:
    bias, x, scale = sample.input, *sample.args
    c = x.shape[-1] if x.ndim else None
    if c is None:
        return "a 0-d x (affine scales the last axis)"
    if any(t.shape != (c,) for t in (scale, bias)):
        return f"scale/bias of shapes {tuple(scale.shape)}/{tuple(bias.shape)} (affine takes ({c},), per feature)"
    return None


def _negative_eps(sample: Any) -> str | None:
    eps = sample.kwargs.get("eps", sample.args[3] if len(sample.args) > 3 else None)
    return f"eps={eps} (taifuse requires eps >= 0)" if eps is not None and eps < 0 else None


def _cross_entropy_target(sample: Any) -> str | None:
    logits, target = sample.input, sample.args[0]
    if target.is_floating_point():
        return "class-probability targets (taifuse's target holds class indices)"
    if logits.ndim > 2:
        return f"{logits.ndim}-d logits (taifuse's cross_entropy takes (N, C) or (C,))"
    return None


def _broadcasts_input(sample: Any) -> str | None:
    if sample.broadcasts_input:
        return "the result's shape is not the updated tensor's (PyTorch refuses it too)"
    return None


def _tensor_value(sample: Any) -> str | None:
    if isinstance(sample.args[1], torch.Tensor):
        return "a tensor value (taifuse's masked_fill takes a number)"
    return None


def _tensor_other_max(sample: Any) -> str | None:
    if sample.args and isinstance(sample.args[0], torch.Tensor):
        return "max(other), the elementwise maximum (taifuse's max reduces over dim)"
    return None


def _advanced_index(sample: Any) -> str | None:
    index = sample.args[0]
    items = index if isinstance(index, tuple) else (index,)
    arrays = [i for i in items if isinstance(i, (list, torch.Tensor))]
    if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in arrays):
        return "a boolean index (taifuse indexes with integers; masked_fill takes masks)"
    if len(arrays) > 1:
        return "more than one integer-array index (taifuse's indexing takes one)"
    return None


def _tensor_to(t: Tensor, *args: Any, memory_format: None = None) -> Tensor:
    """PyTorch's ``to(device, dtype, non_blocking, copy)``, ``to(dtype, ...)`` or ``to(other, ...)``
    as taifuse's ``to(dtype)``; non_blocking and copy change nothing here (a new dtype is a copy)."""
    target = args[0]
    if isinstance(target, str):
        raise NoSpelling("a device argument (taifuse has no devices)")
    return t.to(target.dtype if isinstance(target, Tensor) else target)


def _unbatched_conv(sample: Any) -> str | None:
    """conv1d/conv2d take batched input only (the issue's bad-input rule; PyTorch also takes one
    unbatched sample)."""
    spatial = 1 if sample.input.ndim <= 3 and sample.args and sample.args[0].ndim == 3 else 2
    if sample.input.ndim == spatial + 1:
        return "unbatched input to a convolution (taifuse takes (N, C, ...) only; add the batch dim)"
    return None


TABLE: tuple[Row, ...] = (
    # ---- taifuse.functional
    Row("F.gelu", ("nn.functional.gelu",), _functional("gelu")),
    Row("F.relu", ("nn.functional.relu",), _functional("relu")),
    Row(
        "F.leaky_relu",
        ("nn.functional.leaky_relu",),
        _functional("leaky_relu"),
        refused=_kwarg("inplace", why="taifuse's functional ops write in place through out="),
    ),
    Row(
        "F.silu",
        ("nn.functional.silu",),
        _functional("silu"),
        refused=_kwarg("inplace", why="taifuse's functional ops write in place through out="),
    ),
    Row("F.sigmoid", ("sigmoid",), _functional("sigmoid")),
    Row("F.tanh", ("tanh",), _functional("tanh")),
    Row(
        "F.add_relu",
        ("add",),
        _functional("add_relu"),
        reference=lambda a, b, **kw: torch.relu(torch.add(a, b, **kw)),
        refused=_kwarg("alpha", why="add_relu is relu(a + b)"),
    ),
    Row(
        "F.mul_relu",
        ("mul",),
        _functional("mul_relu"),
        reference=lambda a, b, **kw: torch.relu(torch.mul(a, b, **kw)),
    ),
    # affine(x, scale, bias) = x * scale + bias = addcmul(bias, x, scale)
    Row(
        "F.affine",
        ("addcmul",),
        lambda bias, x, scale, **kw: F.affine(x, scale, bias, **kw),
        refused=_either(_kwarg("value", why="affine is x * scale + bias"), _affine_shapes),
    ),
    Row("F.linear", ("nn.functional.linear",), _functional("linear"), magnitude=True),
    Row(
        "F.softmax",
        ("softmax", "softmax.with_dtype"),
        _functional("softmax"),
        magnitude=True,
        refused=_kwarg("dtype", why="taifuse computes in the input's dtype; cast with .to()"),
    ),
    Row(
        "F.log_softmax",
        ("log_softmax", "log_softmax.with_dtype"),
        _functional("log_softmax"),
        magnitude=True,
        refused=_kwarg("dtype", why="taifuse computes in the input's dtype; cast with .to()"),
    ),
    Row(
        "F.layer_norm",
        ("nn.functional.layer_norm",),
        _functional("layer_norm"),
        magnitude=True,
        refused=_negative_eps,
        tol={F32: LAYER_NORM_F32},
    ),
    Row(
        "F.batch_norm",
        ("nn.functional.batch_norm",),
        _functional("batch_norm"),
        refused=lambda s: "a 1-d input (taifuse's batch_norm takes (N, C, *))" if s.input.ndim < 2 else None,
    ),
    Row(
        "F.rms_norm",
        ("nn.functional.rms_norm",),
        _functional("rms_norm"),
        magnitude=True,
        refused=_negative_eps,
    ),
    # OpInfo's embedding takes (weight, indices)
    Row(
        "F.embedding", ("nn.functional.embedding",), lambda weight, idx, **kw: F.embedding(idx, weight, **kw)
    ),
    Row(
        "F.dropout",
        ("nn.functional.dropout",),
        _functional("dropout"),
        reference=_dropout_reference,
        mask_shape=_dropout_mask_shape,
        refused=_kwarg("inplace", why="taifuse's functional ops write in place through out="),
    ),
    Row(
        "F.scaled_dot_product_attention",
        ("nn.functional.scaled_dot_product_attention",),
        _functional("scaled_dot_product_attention"),
        magnitude=True,
        reference=_sdpa_reference,
        mask_shape=_sdpa_mask_shape,
        tol=SDPA_TOL,
        no_grad=_sdpa_mask_no_grad,
        tensor_scale=True,
        refused=_kwarg("enable_gqa", why="taifuse's attention has no grouped-query mode"),
    ),
    Row(
        "F.conv2d", ("nn.functional.conv2d",), _functional("conv2d"), magnitude=True, refused=_unbatched_conv
    ),
    Row(
        "F.conv1d", ("nn.functional.conv1d",), _functional("conv1d"), magnitude=True, refused=_unbatched_conv
    ),
    Row(
        "F.max_pool2d",
        ("nn.functional.max_pool2d",),
        _functional("max_pool2d"),
        int32_indices_on_taichi=True,
        sample_stride=23,  # 63 of the 1,440 samples: CI's time (tests/test_pool2d.py covers the rest)
    ),
    Row("F.avg_pool2d", ("nn.functional.avg_pool2d",), _functional("avg_pool2d"), magnitude=True),
    Row(
        "F.adaptive_avg_pool2d",
        ("nn.functional.adaptive_avg_pool2d",),
        _functional("adaptive_avg_pool2d"),
        magnitude=True,
    ),
    Row("F.mse_loss", ("nn.functional.mse_loss",), _functional("mse_loss"), magnitude=True),
    Row(
        "F.cross_entropy",
        ("nn.functional.cross_entropy",),
        _functional("cross_entropy"),
        magnitude=True,
        refused=_either(
            _kwarg(
                "weight",
                "ignore_index",
                "label_smoothing",
                why="taifuse's cross_entropy takes only reduction",
            ),
            _cross_entropy_target,
        ),
    ),
    # ---- Tensor operators and methods
    Row("Tensor.__add__", ("add",), _binary(operator.add), no_spelling=NO_ALPHA),
    Row("Tensor.__radd__", ("__radd__",), _method("__radd__")),
    Row("Tensor.__sub__", ("sub",), _binary(operator.sub), no_spelling=NO_ALPHA),
    Row("Tensor.__rsub__", ("__rsub__",), _method("__rsub__")),
    Row("Tensor.__mul__", ("mul",), _binary(operator.mul)),
    Row("Tensor.__rmul__", ("__rmul__",), _method("__rmul__")),
    Row(
        "Tensor.__truediv__",
        ("div.no_rounding_mode", "true_divide"),
        _binary(operator.truediv),
        no_spelling=_kwarg("rounding_mode", why="taifuse's / is true division"),
    ),
    Row("Tensor.__rtruediv__", ("__rdiv__",), _method("__rtruediv__")),
    Row("Tensor.__matmul__", ("matmul",), _binary(operator.matmul), magnitude=True),
    Row("Tensor.__rmatmul__", ("__rmatmul__",), _method("__rmatmul__"), magnitude=True),
    Row("Tensor.__neg__", ("neg",), operator.neg),
    Row("Tensor.__pos__", ("positive",), operator.pos),
    Row("Tensor.__pow__", ("pow",), _binary(operator.pow), refused=_tensor_other),
    Row(
        "Tensor.__iadd__",
        ("add",),
        _binary(operator.iadd),
        inplace=True,
        no_spelling=NO_ALPHA,
        refused=_broadcasts_input,
    ),
    Row(
        "Tensor.__isub__",
        ("sub",),
        _binary(operator.isub),
        inplace=True,
        no_spelling=NO_ALPHA,
        refused=_broadcasts_input,
    ),
    Row("Tensor.__imul__", ("mul",), _binary(operator.imul), inplace=True, refused=_broadcasts_input),
    Row("Tensor.zero_", ("zero_",), _method("zero_"), inplace=True),
    Row("Tensor.sum", ("sum",), _method("sum"), magnitude=True),
    Row("Tensor.mean", ("mean",), _method("mean"), magnitude=True),
    Row("Tensor.reshape", ("reshape",), _method("reshape")),
    Row("Tensor.flatten", ("flatten",), _method("flatten")),
    Row("Tensor.view", ("view",), _method("view")),
    Row("Tensor.transpose", ("transpose",), _method("transpose")),
    Row("Tensor.T", ("T",), lambda t: t.T),
    Row("Tensor.permute", ("permute",), _method("permute")),
    Row("Tensor.unsqueeze", ("unsqueeze",), _method("unsqueeze")),
    Row("Tensor.squeeze", ("squeeze", "squeeze.multiple"), _method("squeeze")),
    Row("Tensor.expand", ("expand",), _method("expand")),
    Row("Tensor.split", ("split", "split.list_args", "split_with_sizes"), _method("split")),
    Row("Tensor.chunk", ("chunk",), _method("chunk")),
    Row("Tensor.__getitem__", ("__getitem__",), _method("__getitem__"), refused=_advanced_index),
    Row("Tensor.exp", ("exp",), _method("exp")),
    Row("Tensor.log", ("log",), _method("log")),
    Row("Tensor.sqrt", ("sqrt",), _method("sqrt")),
    Row(
        "Tensor.masked_fill",
        ("masked_fill",),
        _method("masked_fill"),
        refused=_tensor_value,
    ),
    Row("Tensor.amax", ("amax",), _method("amax")),
    Row(
        "Tensor.max",
        ("max.reduction_with_dim", "max.reduction_no_dim", "max.binary"),
        _method("max"),
        refused=_tensor_other_max,
        int32_indices_on_taichi=True,
    ),
    Row("Tensor.to", ("to",), _tensor_to),
    Row("Tensor.half", ("half",), _method("half")),
    Row("Tensor.float", ("float",), _method("float")),
    Row("Tensor.double", ("double",), _method("double"), float64_result=True),
    Row("Tensor.item", ("item",), _method("item")),
    Row("taifuse.cat", ("cat",), lambda tensors, *a, **kw: taifuse.cat(tensors, *a, **kw)),
    Row("taifuse.stack", ("stack",), lambda tensors, *a, **kw: taifuse.stack(tensors, *a, **kw)),
)

# What the coverage test counts as an op, and the ops that have no OpInfo entry to run.
NO_OPINFO = {
    "Tensor.copy_": "PyTorch has no OpInfo for copy_ (tests/test_tensor.py covers it)",
    "Tensor.detach": "not an op: a view outside the graph",
    "Tensor.numpy": "not an op: the host copy",
    "Tensor.backward": "not an op: runs the graph",
    "Tensor.register_post_accumulate_grad_hook": "not an op: a hook on the graph (tests/test_distributed.py)",
    "Tensor.__iter__": "iteration, covered through __getitem__",
    "Tensor.__len__": "not an op",
    "F.conv2d_batch_norm": "a taifuse block with no PyTorch op (tests/test_conv_bn.py compares it with "
    "torch's conv2d -> batch_norm -> relu)",
    # Issue 32's views (added with their own tests against PyTorch; rows here are still to come):
    "Tensor.__setitem__": "in-place index assignment: tests/test_views_share.py compares it with PyTorch (values, gradients, version errors)",
    "Tensor.add_": "in-place: tests/test_views_share.py compares it with PyTorch (through views and bases)",
    "Tensor.sub_": "in-place: tests/test_views_share.py compares it with PyTorch",
    "Tensor.mul_": "in-place: tests/test_views_share.py compares it with PyTorch",
    "Tensor.t": "a view: tests/test_views_share.py compares it with PyTorch (storage, strides, gradients)",
    "Tensor.unbind": "views: tests/test_views_share.py compares it with PyTorch",
    "Tensor.contiguous": "not an op: a copy of a strided view (tests/test_views_share.py compares it with PyTorch)",
    "Tensor.is_contiguous": "not an op: a layout query",
    "Tensor.stride": "not an op: a layout query",
    "Tensor.data_ptr": "not an op: an address",
}


def taifuse_ops() -> set[str]:
    """Every op taifuse offers: the functional API, the Tensor's public methods and operators, and
    the tensor-joining functions of the top-level package."""
    ops = {f"F.{name}" for name in F.__all__}
    for name, value in vars(Tensor).items():
        public = not name.startswith("_") or (name.startswith("__") and name not in vars(object))
        if public and (inspect.isfunction(value) or isinstance(value, property)) and name != "__init__":
            if isinstance(value, property) and name != "T":
                continue  # attributes (shape, dtype, grad, ...), not ops
            ops.add(f"Tensor.{name}")
    ops |= {f"taifuse.{name}" for name in ("cat", "stack")}
    return ops


# ----------------------------------------------------------------------------- the samples


@dataclass(frozen=True)
class Case:
    row: Row
    opinfo: Any
    dtype: np.dtype
    index: int
    sample: Any

    @property
    def id(self) -> str:
        variant = f".{self.opinfo.variant_test_name}" if self.opinfo.variant_test_name else ""
        return f"{self.row.name}-{self.opinfo.name}{variant}-{self.dtype}-{self.index}"


def _opinfo(name: str) -> Any:
    """The OpInfo named ``name`` or ``name.variant`` (``'div.no_rounding_mode'``)."""
    if (name, "") in OPINFOS:
        return OPINFOS[(name, "")]
    base, _, variant = name.rpartition(".")
    return OPINFOS[(base, variant)]


# NOTE [ OpInfo sample cost ]
# ``sample_inputs`` looks for the unittest.TestCase calling it (to seed from the test's name and
# track inputs): ``extract_test_fn`` walks ``inspect.stack()``, which reads the source line of every
# frame, twice per call. Under pytest there is no TestCase on the stack, so it finds None, and those
# walks were ~3/4 of this module's collection (41 s of CPU against 10 s without them, loaded
# machine), which every pytest-xdist worker pays. While the samples are made, the lookup returns
# what it was checked to find here (None), so the samples are the same (checked by hashing every
# sample's values both ways).
@contextlib.contextmanager
def _no_test_fn_lookup():
    try:
        from torch.testing._internal import common_utils
        from torch.testing._internal.opinfo import core
    except ImportError:  # another torch layout: make the samples the slow way
        yield
        return
    users = [m for m in (common_utils, core) if callable(getattr(m, "extract_test_fn", None))]
    if not users or common_utils.extract_test_fn() is not None:
        yield
        return
    saved = [m.extract_test_fn for m in users]
    for m in users:
        m.extract_test_fn = lambda: None
    try:
        yield
    finally:
        for m, fn in zip(users, saved):
            m.extract_test_fn = fn


def cases() -> list[Case]:
    found = []
    with _no_test_fn_lookup():
        for row in TABLE:
            for name in row.opinfos:
                op = _opinfo(name)
                for dtype in (F32, F16) if row.f16 else (F32,):
                    torch.manual_seed(0)  # the samples' values come from torch's generator
                    samples = op.sample_inputs("cpu", TORCH_DTYPES[dtype], requires_grad=not row.inplace)
                    kept = (item for item in enumerate(samples) if item[0] % row.sample_stride == 0)
                    found += [Case(row, op, dtype, i, s) for i, s in kept]
    return found


def _param(case: Case) -> Any:
    return pytest.param(case, id=case.id)


def _tolerance(row: Row, dtype: np.dtype) -> Tol:
    return row.tol.get(dtype, TOLERANCES[dtype])


SEED = 1234


def _uses_float64(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.float64
    if isinstance(value, (list, tuple)):
        return any(_uses_float64(v) for v in value)
    if isinstance(value, dict):
        return any(_uses_float64(v) for v in value.values())
    return value is torch.float64


def _mask(case: Case) -> Any:
    """The dropout mask the op will draw (NOTE above), as float64 (None when nothing is dropped)."""
    shape = case.row.mask_shape(case.sample) if case.row.mask_shape else None
    if shape is None:
        return None if case.row.mask_shape is None else torch.tensor(1.0, dtype=torch.float64)
    p = case.sample.kwargs.get("p", case.sample.kwargs.get("dropout_p", 0.5))
    taifuse.manual_seed(SEED)
    return torch.from_numpy(F.dropout(np.ones(shape, np.float32), p).astype(np.float64))


def _torch(case: Case, convert: Callable, mask: Any, abs_values: bool = False) -> tuple[Any, list]:
    """PyTorch on the sample's values: (result, [(sample tensor, converted leaf)])."""
    row, s = case.row, case.sample
    fn = case.opinfo.inplace_variant if row.inplace else (row.reference or case.opinfo.op)
    leaves: list = []
    args = convert((s.input, *s.args), leaves)
    kwargs = {k: convert(v, leaves) for k, v in s.kwargs.items()}
    if abs_values:
        with torch.no_grad():
            for _, leaf in leaves:
                leaf.abs_()
    if row.inplace:
        args = (args[0].clone(), *args[1:])
    if mask is not None:
        kwargs["mask"] = mask
    return fn(*args, **kwargs), leaves


def _bound_scale(ref: np.ndarray, magnitude: Any) -> np.ndarray:
    scale = np.maximum(1.0, np.abs(ref))
    if magnitude is not None:
        scale = np.maximum(scale, np.abs(magnitude))
    return scale


def _check_values(
    got: np.ndarray, ref: np.ndarray, own: Any, magnitude: Any, tol: Tol, what: str, whole: bool = False
) -> None:
    """``got`` against the float64 reference within the tolerance table, or within twice PyTorch's
    own error in the same dtype (``own``) where that is larger: a float16 sigmoid's backward works
    from the rounded output, in PyTorch as in taifuse, and is off by more than an ulp of the result."""
    scale = _bound_scale(ref, magnitude)
    if whole and ref.size:  # the tensor's largest magnitude, as tests/test_attention.py's bound
        finite = scale[np.isfinite(scale)]
        scale = np.full_like(scale, finite.max(initial=1.0))
    if own is not None and ref.size:
        # PyTorch's worst error on this sample relative to the magnitude, as an atol: bound =
        # floor + atol * scale + rtol * |ref| with atol at least twice that.
        with np.errstate(invalid="ignore", over="ignore"):
            own_err = np.abs(np.asarray(own, np.float64) - ref) / scale
        own_err = own_err[np.isfinite(own_err)]
        if own_err.size and 2 * own_err.max() > tol.atol:
            tol = Tol(rtol=tol.rtol, atol=2 * float(own_err.max()), floor=tol.floor)
    assert_close(got, ref, scale, tol, what)


def _grads(outs: list, leaves: list, upstream: list, pairs: list) -> list:
    wanted = [leaf for _, leaf in leaves if leaf.requires_grad]
    targets = [outs[i] for i, _, _ in pairs]
    grads = torch.autograd.grad(
        targets, wanted, [u.to(t.dtype) for u, t in zip(upstream, targets)], allow_unused=True
    )
    return [None if g is None else g.detach().to(torch.float64).numpy() for g in grads]


@pytest.mark.parametrize("case", [_param(c) for c in cases()])
def test_sample(backend, case: Case, request: pytest.FixtureRequest) -> None:
    backend.activate()
    row, s = case.row, case.sample
    defect = row.xfail(case, backend.param)
    if defect is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=defect))
    why = row.no_spelling(s)
    if why is not None:
        pytest.skip(CANNOT_EXPRESS + str(why))
    leaves: list = []

    def convert() -> tuple[tuple, dict]:
        leaves.clear()
        args = _to_taifuse((s.input, *s.args), leaves)
        return args, {k: _to_taifuse(v, leaves) for k, v in s.kwargs.items()}

    refused = row.refused(s)
    if (
        refused is None
        and not backend.supports_f64
        and (row.float64_result or _uses_float64((s.input, s.args, s.kwargs)))
    ):
        refused = f"float64 on {backend.param} (docs/backends.md: the Taichi backend refuses float64)"
    try:
        args, kwargs = convert()
    except NoSpelling as exc:
        pytest.skip(CANNOT_EXPRESS + str(exc))
    except (ValueError, TypeError):
        if refused is None:
            raise
        pytest.skip(REFUSED_BY_DESIGN + refused)  # a float64 tensor argument, refused on arrival
    if refused is not None:
        try:
            with pytest.raises((ValueError, TypeError)):
                row.call(*args, **kwargs)
        except NoSpelling as exc:
            pytest.skip(CANNOT_EXPRESS + str(exc))
        pytest.skip(REFUSED_BY_DESIGN + refused)

    mask = _mask(case)
    if mask is not None:
        taifuse.manual_seed(SEED)
    with np.errstate(all="ignore"):
        try:
            got = row.call(*args, **kwargs)
        except NoSpelling as exc:
            pytest.skip(CANNOT_EXPRESS + str(exc))
    if row.inplace:
        assert got is args[0], f"{row.name} should return the tensor it updated"
    own, own_leaves = _torch(
        case, _leaves_in(None), None if mask is None else mask.to(TORCH_DTYPES[case.dtype])
    )
    ref, ref_leaves = _torch(case, _leaves_in(torch.float64), mask)
    ref_abs = abs_leaves = None
    if row.magnitude:
        ref_abs, abs_leaves = _torch(case, _leaves_in(torch.float64), mask, abs_values=True)

    got_outs, ref_outs, own_outs = _outputs(got), _outputs(ref), _outputs(own)
    abs_outs = _outputs(ref_abs) if row.magnitude else [None] * len(ref_outs)
    assert len(got_outs) == len(ref_outs), f"{len(got_outs)} results, PyTorch gives {len(ref_outs)}"
    for i, (g, r, e, m) in enumerate(zip(got_outs, ref_outs, own_outs, abs_outs)):
        what = f"{case.id} on {backend.param}: result {i}"
        if not isinstance(e, torch.Tensor):
            assert type(g) is type(e), f"{what}: {type(g).__name__}, PyTorch gives {type(e).__name__}"
            assert_close(np.asarray(g), np.asarray(r), 1.0, _tolerance(row, case.dtype), what)
            continue
        assert isinstance(g, Tensor), f"{what}: {type(g).__name__}, expected a Tensor"
        g_np, r_np = g.numpy(), _numpy(r)
        assert g_np.shape == tuple(e.shape), f"{what}: shape {g_np.shape}, PyTorch gives {tuple(e.shape)}"
        want = _to_numpy_dtype(e.dtype)
        if row.int32_indices_on_taichi and backend.name == "taichi" and want == np.int64:
            want = np.dtype(np.int32)  # documented (NOTE [ Class indices on the device ])
        assert g_np.dtype == want, f"{what}: dtype {g_np.dtype}, PyTorch gives {e.dtype}"
        if not e.is_floating_point():
            np.testing.assert_array_equal(g_np, r_np.astype(g_np.dtype), err_msg=what, strict=True)
            continue
        _check_values(
            g_np,
            r_np,
            _numpy(e),
            None if m is None else _numpy(m),
            _tolerance(row, g_np.dtype),
            what,
            row.tensor_scale,
        )

    # Backward: one random upstream gradient for every float result that has a graph.
    if row.inplace:
        return
    pairs = [
        (i, g, r)
        for i, (g, r) in enumerate(zip(got_outs, ref_outs))
        if isinstance(r, torch.Tensor) and r.requires_grad
    ]
    grad_leaves = [t for (_, t), (_, leaf) in zip(leaves, ref_leaves) if leaf.requires_grad]
    if not pairs or not grad_leaves:
        return
    rng = np.random.default_rng(case.index)
    upstream = [rng.standard_normal(r.shape).astype(g.dtype) for _, g, r in pairs]
    for (_, g, _), u in zip(pairs, upstream):
        assert isinstance(g, Tensor) and g.requires_grad, (
            f"{case.id} on {backend.param}: the result has no graph"
        )
        with np.errstate(all="ignore"):  # float16 gradients may overflow to inf, as PyTorch's
            g.backward(u, retain_graph=True)
    up64 = [torch.from_numpy(u.astype(np.float64)) for u in upstream]
    ref_grads = _grads(ref_outs, ref_leaves, up64, pairs)
    own_grads = _grads(own_outs, own_leaves, up64, pairs)
    abs_grads = (
        _grads(_outputs(ref_abs), abs_leaves, [u.abs() for u in up64], pairs) if row.magnitude else None
    )
    no_grad = row.no_grad(s)
    for j, t in enumerate(grad_leaves):
        what = f"{case.id} on {backend.param}: gradient of input {j}"
        if no_grad is not None and j == len(grad_leaves) - 1:  # the mask, the sample's last tensor
            assert t.grad is None, f"{what}: {no_grad}, but it got one"
            continue
        rg = np.zeros(t.shape) if ref_grads[j] is None else ref_grads[j]
        assert t.grad is not None or not rg.any(), f"{what}: None, PyTorch's is nonzero"
        got_grad = np.zeros(t.shape, t.dtype) if t.grad is None else t.grad.numpy()
        assert got_grad.shape == rg.shape, f"{what}: shape {got_grad.shape}, PyTorch gives {rg.shape}"
        assert got_grad.dtype == t.dtype, f"{what}: dtype {got_grad.dtype}, the input's is {t.dtype}"
        ag = None if abs_grads is None else abs_grads[j]
        _check_values(got_grad, rg, own_grads[j], ag, _tolerance(row, t.dtype), what, row.tensor_scale)


def test_table_covers_every_op() -> None:
    """Every taifuse op has a row (or says in NO_OPINFO why not), and every row's OpInfo exists."""
    rows = {row.name for row in TABLE}
    missing = taifuse_ops() - rows - set(NO_OPINFO)
    assert not missing, f"ops with no row in TABLE and no entry in NO_OPINFO: {sorted(missing)}"
    stale = (rows | set(NO_OPINFO)) - taifuse_ops()
    assert not stale, f"rows for names taifuse does not have: {sorted(stale)}"
    for row in TABLE:
        for name in row.opinfos:
            assert _opinfo(name) is not None, f"{row.name}: no OpInfo {name!r} in this PyTorch"
