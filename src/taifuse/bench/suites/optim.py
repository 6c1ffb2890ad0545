"""Optimizer suite: one ``step()`` of taifuse's fused optimizers against PyTorch CPU's fastest
variant (``fused=True``) on the same parameters and gradients.

Two models: 10 parameters of 1000x512 float32 (5.12M values, past the last-level cache) and 200
parameters of 64x64 (per-parameter overhead). Gradients are set once before timing (on taifuse in
the optimizer's gradient slots, where ``backward()`` puts them), so every timed call is one step.
``bytes_moved`` is what one step must read and write at least (parameters, gradients, state),
``bytes_written`` the parameters and state it writes: the fraction of the copy bandwidth of the
step's cache level comes from them (NOTE [ Traffic model ] in taifuse._ceilings). taifuse's default step, like torch.optim's, does
not check that the gradients are finite; the "taifuse, finite check" row shows what the optional
check (``check_finite=True``: one more read of them, NOTE [ Non-finite gradients ] in
optim/optimizer.py) costs.

The bfloat16-state case (``state_dtype="bfloat16"``: the moments stored as 16-bit patterns, NOTE
[ bfloat16 optimizer state ] in backends/reference/optim.py) times AdamW on the large model against
the same step with float32 state and against PyTorch's fused AdamW (float32 state). Its results
are checked to bfloat16's tolerance: rounding the moments moves one step by up to about
lr * 2**-8 per value.
"""

from __future__ import annotations

import functools

import numpy as np

from taifuse import _costs
from taifuse.bench.case import Case, Variant

SUITE = "optim"
_TAIFUSE = ("numpy as np", "taifuse.optim as optim", "taifuse.nn as nn")
_TORCH = ("numpy as np", "torch")

# name -> (taifuse constructor, torch class and arguments or None, state arrays per parameter)
OPTIMIZERS = {
    "SGD": (
        "optim.SGD(ps, lr=1e-3, momentum=0.9{extra})",
        "torch.optim.SGD(tps, lr=1e-3, momentum=0.9, {variant}=True)",
        1,
    ),
    "Adam": ("optim.Adam(ps, lr=1e-3{extra})", "torch.optim.Adam(tps, lr=1e-3, {variant}=True)", 2),
    "AdamW": ("optim.AdamW(ps, lr=1e-3{extra})", "torch.optim.AdamW(tps, lr=1e-3, {variant}=True)", 2),
    "Lion": ("optim.Lion(ps, lr=1e-4{extra})", None, 1),
}
MODELS = {"10x(1000, 512)": (10, (1000, 512)), "200x(64, 64)": (200, (64, 64))}


def _inputs(seed: int, count: int, shape: tuple[int, int]) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "params": [rng.standard_normal(shape, dtype=np.float32) for _ in range(count)],
        "grads": [rng.standard_normal(shape, dtype=np.float32) * np.float32(1e-2) for _ in range(count)],
    }


def _taifuse(label: str, constructor: str, check_finite: bool, note: str = "") -> Variant:
    extra = f", check_finite={check_finite}"  # explicit: the default is False (torch.optim)
    prepare = f"""
ps = [nn.Parameter(p) for p in params]
opt = {constructor.format(extra=extra)}
# d/dp sum(p * g) = g: backward() puts each gradient into its slot of the flat buffer, as in training
sum((p * g).sum() for p, g in zip(ps, grads)).backward()
"""
    return Variant(label, "opt.step()", result="ps[0].numpy()", prepare=prepare, imports=_TAIFUSE, note=note)


def _torch(label: str, constructor: str, same_result: bool, note: str) -> Variant:
    prepare = f"""
tps = [torch.tensor(p, requires_grad=True) for p in params]
for tp, g in zip(tps, grads):
    tp.grad = torch.tensor(g)
topt = {constructor}
"""
    return Variant(
        label,
        "topt.step()",
        result="tps[0].detach()",
        prepare=prepare,
        imports=_TORCH,
        same_result=same_result,
        note=note,
        isolated=True,  # its OpenMP runtime is not Numba's: NOTE [ Isolated baselines ] in bench.harness
    )


def _case(name: str, model: str, compare_torch: bool) -> Case:
    constructor, torch_constructor, n_state = OPTIMIZERS[name]
    count, shape = MODELS[model]
    elements = count * shape[0] * shape[1]
    baselines = [
        _taifuse(
            "taifuse, finite check",
            constructor,
            check_finite=True,
            note="the same step with check_finite=True: one more read of every gradient before the update",
        )
    ]
    if compare_torch:
        if torch_constructor is not None:
            # fused=True is PyTorch CPU's fastest variant for these three (foreach=True measured
            # several times slower on the development machine, so it would only add time).
            baselines.append(
                _torch(
                    "torch fused",
                    torch_constructor.format(variant="fused"),
                    True,
                    f"PyTorch CPU {name}(fused=True) on copies of the same parameters and gradients",
                )
            )
        else:
            baselines.append(
                _torch(
                    "torch fused AdamW",
                    "torch.optim.AdamW(tps, lr=1e-3, fused=True)",
                    False,
                    "not the same function: PyTorch has no Lion; its fused AdamW is the issue's yardstick",
                )
            )
    # Read parameter, gradient and state; write parameter and state.
    cost = _costs.optimizer_step(4 * elements, 4 * elements, 4 * elements * n_state)
    bytes_moved, bytes_written = cost.bytes_moved, cost.bytes_written
    return Case(
        suite=SUITE,
        name=f"{name} step, {model}",
        setup=functools.partial(_inputs, count=count, shape=shape),
        setup_code=(
            f"rng = np.random.default_rng(seed); params = [rng.standard_normal({shape}, dtype=np.float32) "
            f"for _ in range({count})]; grads = [rng.standard_normal({shape}, dtype=np.float32) * 1e-2 "
            f"for _ in range({count})]"
        ),
        # The default step (check_finite=False, as torch.optim) is what users run and what the
        # goals compare with PyTorch; the checked step is a baseline, so its row shows the check's cost.
        candidate=_taifuse("taifuse", constructor, check_finite=False),
        baselines=tuple(baselines),
        dtype="float32",
        shape=f"{count} parameters of {shape}",
        bytes_moved=bytes_moved,
        bytes_written=bytes_written,
        rtol=1e-5,
        atol=1e-6,
    )


def _bf16_state_case(compare_torch: bool) -> Case:
    """AdamW with bfloat16 state on the large model, against float32 state (taifuse and PyTorch)."""
    model = "10x(1000, 512)"
    count, shape = MODELS[model]
    elements = count * shape[0] * shape[1]
    float32_case = _case("AdamW", model, compare_torch)
    state_bytes = {"bfloat16": 2 * 2 * elements, "float32": 2 * 4 * elements}  # two moments
    baselines = [
        _taifuse(
            "taifuse, float32 state",
            "optim.AdamW(ps, lr=1e-3{extra})",
            check_finite=False,
            note=f"the same AdamW step with float32 state ({state_bytes['float32'] / 1e6:.2f} MB of moments)",
        )
    ]
    baselines += [b for b in float32_case.baselines if b.label == "torch fused"]
    bf16 = _costs.optimizer_step(4 * elements, 4 * elements, state_bytes["bfloat16"])
    return Case(
        suite=SUITE,
        name=f"AdamW step, bfloat16 state, {model}",
        setup=float32_case.setup,
        setup_code=float32_case.setup_code,
        candidate=_taifuse(
            "taifuse, bfloat16 state",
            "optim.AdamW(ps, lr=1e-3{extra}, state_dtype='bfloat16')",
            check_finite=False,
            note=f"state_dtype='bfloat16': {state_bytes['bfloat16'] / 1e6:.2f} MB of moments, half of float32's",
        ),
        baselines=tuple(baselines),
        dtype="float32 parameters, bfloat16 state",
        shape=f"{count} parameters of {shape}; moments {state_bytes['bfloat16']} bytes (float32: {state_bytes['float32']})",
        # Read parameter, gradient and two 2-byte moments; write parameter and moments.
        bytes_moved=bf16.bytes_moved,
        bytes_written=bf16.bytes_written,
        # One step from zero state: the rounded moments move each value by up to ~lr * 2**-8.
        rtol=1e-5,
        atol=2e-5,
        extra={"state_bytes": state_bytes},
    )


def cases(quick: bool = False, compare_torch: bool = False) -> list[Case]:
    """Every optimizer on the large model (and AdamW with bfloat16 state); AdamW and Lion (all
    four in the full run) on the small one."""
    out = [_case(name, "10x(1000, 512)", compare_torch) for name in OPTIMIZERS]
    out.append(_bf16_state_case(compare_torch))
    small = ("AdamW", "Lion") if quick else tuple(OPTIMIZERS)
    out += [_case(name, "200x(64, 64)", compare_torch) for name in small]
    return out
