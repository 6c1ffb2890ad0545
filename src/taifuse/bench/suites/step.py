"""Step suite: the whole training step at the machine's limit (issue 32's goals), against PyTorch
CPU eager timed in processes of its own (NOTE [ Isolated baselines ] in taifuse.bench.harness).

* ``per-op relu`` and ``per-op linear+sum+backward``: the fixed cost of one small op, where the
  kernel is nothing and dispatch is everything: ``F.relu`` forward on an (8, 16) float32 Tensor
  that requires grad, and ``F.linear`` at (8, 16) x (16, 16) with a bias, ``.sum()`` and
  ``backward()`` (the gradients of the weight and the bias reset to None each call, as
  ``zero_grad`` does). Issue 32's goal: at most 2x PyTorch's time, i.e. a speedup of at least 0.5.
  Each timed sample is at least ``OP_CALLS`` calls (NOTE [ Per-op timing ]).
* ``mlp step``: one AdamW step of examples/train_mlp.py's model (2-64-64-3, GELU hidden layers,
  batch 64, weight decay 1e-4): zero_grad, forward, cross entropy, backward, step; eager, and
  under ``taifuse.compile`` when the package has it (the compiled case is built only then). The
  goal: compiled, at least as fast as PyTorch's eager step.
* ``gpt step``: examples/gpt.py's GPT at 4 layers, width 256, 4 heads, context 128, batch 16
  (AdamW, clipping at 1.0): the transformer suite's GPT case at this size. Its ``flops`` are
  nanoGPT's model FLOPs (NOTE [ Model FLOPs ]), so the row's roofline column is its MFU against
  the GEMM ceiling the run measures; the goal is >= 70% MFU, i.e. >= 1.9x PyTorch. Compiled too
  when ``taifuse.compile`` exists.
* ``example gpt step``: the step examples/train_gpt.py trains with by default (its GPT, batch,
  AdamW and clipping: ``transformer.example_settings``), the transformer suite's GPT case; eager,
  and compiled when ``taifuse.compile`` exists. Issue 32's goal: >= 1.5x PyTorch. Its roofline
  column is the MFU, as the GPT step's.
* ``gpt step peak memory``: the GPT step's peak memory above the parameters, gradients, AdamW
  state and batch, measured as the memory suite measures (fresh processes, tracemalloc and peak
  RSS: NOTE [ Measuring peak memory ] in suites/memory.py); eager, and compiled against eager when
  ``taifuse.compile`` exists (the goal: compiled at most eager's; NOTE [ A compiled step's memory ]).

NOTE [ A compiled step's memory ]
What a compiled step needs is what its replays hold: the plan's arena and the buffers it keeps
(docs/compile.md, "Buffers"), which it allocates once, at its trace, and holds between calls, plus
what a replay allocates (the copy of the loss it returns, the optimizer's scratch). So the
compiled variant is warmed past its traces first (two for the GPT: its positions are a host array,
NOTE [ Constants made by host code ] in taifuse/compiler.py), the measured call is a replay, and
the row counts the plan's ``arena + kept`` (``held`` in measure_memory) on top of the replay's
peak above the pre-step level, which already holds them. A trace is an eager step that keeps every
buffer it saw to its end, several times the step's live peak: it is the one-time cost of
compiling, not the step's.

NOTE [ Model FLOPs ]
nanoGPT's estimate (``estimate_mfu`` in its model.py, from the PaLM paper's appendix B): per token,
6 N for the weights (forward 2, backward 4) plus 12 * L * H * Q * T for attention (Q the head dim,
T the context), with N the parameters except the position embedding. It counts attention over
the whole T x T square, not the causal half, as nanoGPT does; the transformer suite's
``gpt_step_flops`` counts the causal pairs and leaves the embedding out, 3.5% fewer at this size.
MFU is that many FLOPs per step over the step's time, as a fraction of the GEMM rate.

NOTE [ Per-op timing ]
A per-op call takes a few microseconds (relu) to about a hundred (linear, sum and backward). The
harness's calibration alone (a sample of at least 1 ms) times a few hundred relu calls a sample,
and one scheduler tick, page fault or neighbour's burst inside a sample that short moves it
whole: a quiet quick run read relu at 0.344x torch with the interval [0.169, 0.737], although its
two medians (7.43 us and 4.36 us) stood at 0.587x. So the per-op cases set ``Case.min_loops``:
every sample of either side is at least ``OP_CALLS`` back-to-back calls (5-10 ms of relu, about
0.1 s of linear+sum+backward), which spreads such events over many calls; the rows' times are
still per call.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any

import numpy as np

import taifuse
from taifuse.bench.case import Case, Variant
from taifuse.bench.suites import training, transformer
from taifuse.bench.suites.memory import measure_memory
from taifuse.bench.suites.transformer import AttentionMemoryCase, GPTSettings, SkippedCase

SUITE = "step"
_SUITE_IMPORT = "taifuse.bench.suites.step as suite"

# The per-op rows' sizes (issue 32's), and their calls per timed sample, at least (NOTE [ Per-op timing ]).
OP_ROWS, OP_FEATURES = 8, 16
OP_CALLS = 1000
# examples/train_mlp.py's model and step: Linear(2, 64, gelu), Linear(64, 64, gelu), Linear(64, 3).
MLP_SIZES = (2, 64, 64, 3)
MLP_BATCH = 64
MLP_LR, MLP_WEIGHT_DECAY = 0.01, 1e-4
# Issue 32's GPT: examples/gpt.py at 4 layers, width 256, 4 heads, context 128, batch 16, and
# examples/train_gpt.py's optimizer settings (vocabulary 97: its character set).
GPT = GPTSettings(
    config={"vocab_size": 97, "block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 256},
    batch=16,
    lr=3e-3,
    weight_decay=0.1,
    grad_clip=1.0,
    source="issue 32's size",
)


def has_compile() -> bool:
    """Whether this taifuse has the step compiler (``taifuse.compile``): its cases are built only then."""
    return callable(getattr(taifuse, "compile", None))


# ----------------------------------------------------------------------------- per-op fixed cost


def _op_inputs(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((OP_ROWS, OP_FEATURES), dtype=np.float32),
        "w": rng.standard_normal((OP_FEATURES, OP_FEATURES), dtype=np.float32) / 4,
        "b": rng.standard_normal(OP_FEATURES, dtype=np.float32),
    }


_OP_SETUP = (
    f"rng = np.random.default_rng(seed); x = rng.standard_normal(({OP_ROWS}, {OP_FEATURES})); "
    f"w = rng.standard_normal(({OP_FEATURES}, {OP_FEATURES})) / 4; b = rng.standard_normal({OP_FEATURES}); float32"
)
_TAIFUSE_OP = ("numpy as np", "taifuse", "taifuse.functional as F", _SUITE_IMPORT)
_TORCH_OP = ("numpy as np", "torch", "torch.nn.functional as TF", _SUITE_IMPORT)


def _relu_case(compare_torch: bool) -> Case:
    candidate = Variant(
        "taifuse",
        "out = F.relu(xt)",
        result="suite.training.StepOutput(lambda: [out.numpy()])",
        prepare="xt = taifuse.tensor(x, requires_grad=True)\nout = None",
        imports=_TAIFUSE_OP,
        note="F.relu on a Tensor that requires grad: the forward and its graph node",
    )
    baselines = []
    if compare_torch:
        baselines.append(
            Variant(
                "torch",
                "out = TF.relu(xt)",
                result="suite.training.StepOutput(lambda: [out.detach().numpy()])",
                prepare="xt = torch.tensor(x, requires_grad=True)\nout = None",
                imports=_TORCH_OP,
                note="PyTorch CPU eager F.relu on a tensor that requires grad",
                isolated=True,
            )
        )
    return Case(
        suite=SUITE,
        name=f"per-op relu({OP_ROWS}x{OP_FEATURES}, requires_grad)",
        setup=_op_inputs,
        setup_code=_OP_SETUP,
        candidate=candidate,
        baselines=tuple(baselines),
        dtype="float32",
        shape=f"x ({OP_ROWS}, {OP_FEATURES}); the per-op fixed cost (issue 32's goal: at most 2x torch's time)",
        bytes_moved=0,  # the fixed cost is the point: no roofline
        min_loops=OP_CALLS,
    )


_TAIFUSE_LINEAR_PREPARE = """
xt = taifuse.tensor(x)
wt, bt = taifuse.tensor(w, requires_grad=True), taifuse.tensor(b, requires_grad=True)
loss = None
step = suite.training.StepOutput(lambda: [loss.numpy(), wt.grad.numpy(), bt.grad.numpy()])
"""
_TORCH_LINEAR_PREPARE = """
xt = torch.from_numpy(x)
wt, bt = torch.tensor(w, requires_grad=True), torch.tensor(b, requires_grad=True)
loss = None
step = suite.training.StepOutput(lambda: [loss.detach().numpy(), wt.grad.numpy(), bt.grad.numpy()])
"""
_LINEAR_CODE = """
wt.grad = bt.grad = None
loss = {F}.linear(xt, wt, bt).sum()
loss.backward()
"""


def _linear_case(compare_torch: bool) -> Case:
    candidate = Variant(
        "taifuse",
        _LINEAR_CODE.format(F="F"),
        result="step",
        prepare=_TAIFUSE_LINEAR_PREPARE,
        imports=_TAIFUSE_OP,
        note="F.linear with a bias, .sum(), backward(); the weight's and bias's gradients reset to None",
    )
    baselines = []
    if compare_torch:
        baselines.append(
            Variant(
                "torch",
                _LINEAR_CODE.format(F="TF"),
                result="step",
                prepare=_TORCH_LINEAR_PREPARE,
                imports=_TORCH_OP,
                note="PyTorch CPU eager: the same calls",
                isolated=True,
            )
        )
    return Case(
        suite=SUITE,
        name=f"per-op linear+sum+backward({OP_ROWS}x{OP_FEATURES} @ {OP_FEATURES}x{OP_FEATURES}, bias)",
        setup=_op_inputs,
        setup_code=_OP_SETUP,
        candidate=candidate,
        baselines=tuple(baselines),
        dtype="float32",
        shape=f"x ({OP_ROWS}, {OP_FEATURES}), weight ({OP_FEATURES}, {OP_FEATURES}), bias ({OP_FEATURES},); "
        "outputs: the loss, then the gradients of the weight and the bias (issue 32's goal: at most 2x torch's time)",
        bytes_moved=0,
        min_loops=OP_CALLS,
    )


# ----------------------------------------------------------------------------- the MLP example's step

_MLP_TAIFUSE_PREPARE = (
    training.mlp_model_code(MLP_SIZES)
    + f"""opt = optim.AdamW(params, lr={MLP_LR!r}, weight_decay={MLP_WEIGHT_DECAY!r})
xt = taifuse.tensor(x)
loss = None
step = suite.training.StepOutput(lambda: [loss.numpy()] + [p.grad.numpy() for p in params])
"""
)
_MLP_TAIFUSE_STEP = """
opt.zero_grad()
loss = F.cross_entropy(model(xt), y)
loss.backward()
opt.step()
"""
# A classifier's step (model, opt, F in the prepare's namespace) as a function under
# taifuse.compile (traced on the first call, replayed after); the cnn suite's compiled row too.
COMPILED_CLASSIFIER_STEP = """
def train_step(xb, yb):
    opt.zero_grad()
    out = F.cross_entropy(model(xb), yb)
    out.backward()
    opt.step()
    return out

compiled_step = taifuse.compile(train_step)
"""
_MLP_COMPILED_PREPARE = _MLP_TAIFUSE_PREPARE + COMPILED_CLASSIFIER_STEP
_MLP_TORCH_PREPARE = f"""
l1, l2, l3 = (torch.nn.Linear(n_in, n_out) for n_in, n_out in {list(itertools.pairwise(MLP_SIZES))})
with torch.no_grad():
    for layer, w, b in ((l1, w1, b1), (l2, w2, b2), (l3, w3, b3)):
        layer.weight.copy_(torch.from_numpy(w))
        layer.bias.copy_(torch.from_numpy(b))
params = [p for layer in (l1, l2, l3) for p in (layer.weight, layer.bias)]
topt = torch.optim.AdamW(params, lr={MLP_LR!r}, weight_decay={MLP_WEIGHT_DECAY!r})
xt, yt = torch.from_numpy(x), torch.from_numpy(y)
loss = None
step = suite.training.StepOutput(lambda: [loss.detach().numpy()] + [p.grad.numpy() for p in params])
"""
_MLP_TORCH_STEP = """
topt.zero_grad()
h = TF.gelu(l1(xt))
h = TF.gelu(l2(h))
loss = TF.cross_entropy(l3(h), yt)
loss.backward()
topt.step()
"""
_TAIFUSE_MLP_IMPORTS = (
    "numpy as np", "taifuse", "taifuse.nn as nn", "taifuse.optim as optim", "taifuse.functional as F", _SUITE_IMPORT,
)  # fmt: skip


def _mlp_variants() -> dict[str, Variant]:
    return {
        "taifuse": Variant(
            "taifuse",
            _MLP_TAIFUSE_STEP,
            result="step",
            prepare=_MLP_TAIFUSE_PREPARE,
            imports=_TAIFUSE_MLP_IMPORTS,
            note="eager: zero_grad, forward, cross_entropy, backward, AdamW step",
        ),
        "taifuse compiled": Variant(
            "taifuse compiled",
            "loss = compiled_step(xt, y)",
            result="step",
            prepare=_MLP_COMPILED_PREPARE,
            imports=_TAIFUSE_MLP_IMPORTS,
            note="the same step as a function under taifuse.compile (traced on the first call)",
        ),
        "torch": Variant(
            "torch",
            _MLP_TORCH_STEP,
            result="step",
            prepare=_MLP_TORCH_PREPARE,
            imports=("numpy as np", "torch", "torch.nn.functional as TF", _SUITE_IMPORT),
            note="PyTorch CPU eager: the same model, weights and batch; torch.optim.AdamW (its default "
            "foreach implementation), the same settings",
            isolated=True,
        ),
    }


def _mlp_case(compare_torch: bool, compiled: bool) -> Case:
    variants = _mlp_variants()
    shape = "-".join(str(n) for n in MLP_SIZES)
    if compiled:
        candidate = variants["taifuse compiled"]
        baselines = [dataclasses.replace(variants["taifuse"], label="taifuse eager")]
        name = f"mlp step compiled({shape}, gelu, batch={MLP_BATCH}, AdamW)"
    else:
        candidate, baselines = variants["taifuse"], []
        name = f"mlp step({shape}, gelu, batch={MLP_BATCH}, AdamW)"
    if compare_torch:
        baselines.append(variants["torch"])
    n_params = sum(a * b + b for a, b in itertools.pairwise(MLP_SIZES))
    return Case(
        suite=SUITE,
        name=name,
        setup=functools.partial(training.mlp_inputs, batch=MLP_BATCH, sizes=MLP_SIZES),
        setup_code=training.mlp_setup_code(MLP_BATCH, MLP_SIZES),
        candidate=candidate,
        baselines=tuple(baselines),
        dtype="float32",
        shape=f"examples/train_mlp.py's MLP {shape}, batch {MLP_BATCH}, AdamW(lr={MLP_LR}, weight_decay="
        f"{MLP_WEIGHT_DECAY}); the check compares the loss and every gradient of the first step",
        # At least: the batch, the parameters read and written, their gradients, AdamW's two moments.
        bytes_moved=4 * (MLP_BATCH * MLP_SIZES[0] + 7 * n_params) + 8 * MLP_BATCH,
        rtol=1e-4,
        atol=1e-6,
    )


# ----------------------------------------------------------------------------- the GPT step


def gpt_model_flops(config: dict, batch: int) -> int:
    """nanoGPT's model FLOPs of one training step (NOTE [ Model FLOPs ])."""
    shapes = transformer.gpt_parameter_shapes(config)
    n = sum(math.prod(s) for name, s in shapes.items() if name != "wpe.weight")
    layers, heads, t = config["n_layer"], config["n_head"], config["block_size"]
    per_token = 6 * n + 12 * layers * heads * (config["n_embd"] // heads) * t
    return per_token * batch * t


_GPT_COMPILED_PREPARE = """
def train_step(xb, yb):
    opt.zero_grad()
    _, out = model(xb, yb)
    out.backward()
    optim.clip_grad_norm_(model.parameters(), {clip!r})
    opt.step()
    return out

compiled_step = taifuse.compile(train_step)
"""


def _gpt_compiled(eager: Variant, g: GPTSettings) -> Variant:
    return Variant(
        "taifuse compiled",
        "loss = compiled_step(x, y)",
        result="step",
        prepare=eager.prepare + _GPT_COMPILED_PREPARE.format(clip=g.grad_clip),
        imports=eager.imports,
        note="the same step as a function under taifuse.compile (traced on the first call)",
    )


def _gpt_case(
    compare_torch: bool, compiled: bool, g: GPTSettings | None = None, prefix: str = "gpt step"
) -> Case | SkippedCase:
    """The GPT step at ``g`` (default :data:`GPT`; the example's defaults for ``example gpt step``)."""
    g = g or GPT
    base = transformer.gpt_case(compare_torch, g)
    name = base.name.replace("gpt step(", f"{prefix} compiled(" if compiled else f"{prefix}(", 1)
    if isinstance(base, SkippedCase):
        return dataclasses.replace(base, suite=SUITE, name=name)
    candidate, baselines = base.candidate, list(base.baselines)
    if compiled:
        candidate = _gpt_compiled(base.candidate, g)
        baselines.insert(0, dataclasses.replace(base.candidate, label="taifuse eager"))
    goal = ">= 70%" if g is GPT else ">= 1.5x torch"
    return dataclasses.replace(
        base,
        suite=SUITE,
        name=name,
        candidate=candidate,
        baselines=tuple(baselines),
        flops=gpt_model_flops(g.config, g.batch),
        shape=base.shape + "; the roofline column is the step's MFU (nanoGPT's model FLOPs over the GEMM "
        f"ceiling; issue 32's goal: {goal})",
    )


def _example_gpt_case(compare_torch: bool, compiled: bool) -> Case | SkippedCase:
    """examples/train_gpt.py's default step (``transformer.example_settings``)."""
    return _gpt_case(compare_torch, compiled, transformer.example_settings(), prefix="example gpt step")


# NOTE [ A compiled step's memory ]: past its traces before measure_memory's warm-up call.
_WARM_PAST_TRACES = """
while compiled_step.replays == 0:  # the traces, then one replay: every later call is a replay
    loss = compiled_step(x, y)
"""
# What the compiled step holds between calls (NOTE [ A compiled step's memory ]).
_COMPILED_HELD = "compiled_step.plan(x, y).arena + compiled_step.plan(x, y).kept"


@dataclasses.dataclass(frozen=True)
class StepMemoryCase(AttentionMemoryCase):
    """The GPT step's peak memory, eager and compiled: ``held`` names, per variant label, the
    bytes the variant holds between calls that its peak counts (NOTE [ A compiled step's memory ])."""

    held: tuple[tuple[str, str], ...] = ()

    def run_job(self, job: dict) -> dict:
        variant = self.variant(job["variant"])
        result = measure_memory(
            dataclasses.replace(variant, label=f"taifuse ({variant.label})"),
            self.setup(self.seed),
            held=dict(self.held).get(variant.label),
        )
        result["variant"] = variant.label
        return result


def _gpt_memory_case(compiled: bool, g: GPTSettings | None = None) -> StepMemoryCase | SkippedCase:
    g = g or GPT
    base = transformer.gpt_case(False, g)
    config = ", ".join(f"{k}={v}" for k, v in g.config.items())
    name = f"gpt step peak memory({config}, batch={g.batch})"
    if isinstance(base, SkippedCase):
        return dataclasses.replace(base, suite=SUITE, name=name)
    eager = dataclasses.replace(base.candidate, label="taifuse eager", result="loss")
    variants: list[Variant] = [eager]
    pairs: tuple[tuple[str, str], ...] = ()
    held: tuple[tuple[str, str], ...] = ()
    if compiled:
        timed = _gpt_compiled(base.candidate, g)
        variants.append(
            dataclasses.replace(
                timed,
                result="loss",
                prepare=timed.prepare + _WARM_PAST_TRACES,
                note="the same step under taifuse.compile, warmed past its traces: the measured call is "
                "a replay, and its peak counts the plan's arena and kept buffers, which it holds between calls",
            )
        )
        pairs = (("taifuse compiled", "taifuse eager"),)
        held = (("taifuse compiled", _COMPILED_HELD),)
    return StepMemoryCase(
        suite=SUITE,
        name=name,
        variants=tuple(variants),
        pairs=pairs,
        setup_code=base.setup_code,
        shape=f"examples/gpt.py's GPT ({g.source}); the peak above the parameters, gradients, AdamW state "
        "and batch; compiled: a replay's, with the arena and kept buffers it holds (issue 32's goals: eager "
        "not above today's; compiled at most eager's)",
        setup=base.setup,
        held=held,
    )


# ----------------------------------------------------------------------------- suite


def cases(quick: bool = False, compare_torch: bool = False) -> list[Any]:
    """The per-op rows, the MLP step, the GPT step (MFU), the example's default GPT step and the GPT
    step's peak memory; each also compiled when ``taifuse.compile`` exists. The same in quick mode
    (the sizes are the goals')."""
    compiled = has_compile()
    out: list[Any] = [
        _relu_case(compare_torch),
        _linear_case(compare_torch),
        _mlp_case(compare_torch, compiled=False),
    ]
    if compiled:
        out.append(_mlp_case(compare_torch, compiled=True))
    out.append(_gpt_case(compare_torch, compiled=False))
    if compiled:
        out.append(_gpt_case(compare_torch, compiled=True))
    out.append(_example_gpt_case(compare_torch, compiled=False))
    if compiled:
        out.append(_example_gpt_case(compare_torch, compiled=True))
    out.append(_gpt_memory_case(compiled))
    return out
