"""The step benchmark suite (issue 32's goals): its cases, the model FLOPs its MFU reads, and that
every variant of its small cases computes what PyTorch's does (no benchmark runs here)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import taifuse
from taifuse import backends
from taifuse.bench.case import check_outputs
from taifuse.bench.suites import load_cases, step, suite_names, transformer

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")


@pytest.fixture(params=["numpy", "numba"])
def host_backend(request):
    with backends.preserved_choice():
        taifuse.set_backend(request.param)
        yield request.param


def _ids(monkeypatch, compiled: bool) -> list[str]:
    # taifuse.compile is reached through the package's __getattr__ (lazily), so the suite's own
    # probe is what a test switches.
    from taifuse.bench.suites import step

    monkeypatch.setattr(step, "has_compile", lambda: compiled)
    return [c.id for c in load_cases(["step"], compare_torch=True)]


def test_registered_with_the_compiled_cases_only_when_taifuse_compile_exists(monkeypatch):
    assert "step" in suite_names()
    eager = _ids(monkeypatch, compiled=False)
    assert [i.split("(")[0] for i in eager] == [
        "step/per-op relu",
        "step/per-op linear+sum+backward",
        "step/mlp step",
        "step/gpt step",
        "step/example gpt step",
        "step/gpt step peak memory",
    ]
    compiled = _ids(monkeypatch, compiled=True)
    example = transformer.example_settings()
    assert example.source == "examples/train_gpt.py's defaults"
    sizes = ", ".join(f"{k}={v}" for k, v in example.config.items())
    assert [i for i in compiled if i not in eager] == [
        "step/mlp step compiled(2-64-64-3, gelu, batch=64, AdamW)",
        "step/gpt step compiled(vocab_size=97, block_size=128, n_layer=4, n_head=4, n_embd=256, batch=16)",
        f"step/example gpt step compiled({sizes}, batch={example.batch})",
    ]


def test_per_op_rows_time_many_calls_a_sample():
    # NOTE [ Per-op timing ]: both sides of the per-op rows at least OP_CALLS calls a sample.
    cases = {c.name.split("(")[0]: c for c in load_cases(["step"], compare_torch=True)}
    for name in ("per-op relu", "per-op linear+sum+backward"):
        assert cases[name].min_loops == step.OP_CALLS >= 1000
    assert cases["mlp step"].min_loops == 1


def test_gpt_model_flops_are_nanogpts_estimate():
    # Issue 32: 42.4 GFLOP a step at 4 layers, width 256, 4 heads, context 128, batch 16, by
    # nanoGPT's 6 N + 12 L H Q T per token (N: the parameters but the position embedding).
    config, batch = step.GPT.config, step.GPT.batch
    shapes = transformer.gpt_parameter_shapes(config)
    n = sum(int(np.prod(s)) for name, s in shapes.items() if name != "wpe.weight")
    expected = (6 * n + 12 * 4 * 4 * 64 * 128) * batch * 128
    assert step.gpt_model_flops(config, batch) == expected
    assert abs(expected / 42.4e9 - 1) < 0.01
    case = next(c for c in load_cases(["step"]) if c.name.startswith("gpt step("))
    assert case.flops == expected


@needs_torch
@pytest.mark.parametrize("name", ["per-op relu", "per-op linear+sum+backward", "mlp step"])
def test_small_cases_compute_what_torch_computes(host_backend, monkeypatch, name):
    monkeypatch.setattr(taifuse, "compile", lambda fn: fn, raising=False)  # the compiled variant runs eagerly
    for case in load_cases(["step"], compare_torch=True):
        if not case.name.startswith((name + "(", name + " compiled(")):
            continue
        inputs = case.setup(0)
        labels = [case.candidate.label] + [b.label for b in case.baselines]
        outputs = {label: case.variant(label).build(inputs)() for label in labels}
        for label in labels[1:]:
            report = check_outputs(outputs[label], outputs[labels[0]], case.rtol, case.atol)
            assert report["ok"], (case.id, label, report)


# A GPT small enough for a test, big enough that its activations outweigh Python's own objects in
# tracemalloc's count (the eager step's peak is about 6 MiB).
SMALL_GPT = transformer.GPTSettings(
    config={"vocab_size": 97, "block_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 64},
    batch=8,
    lr=3e-3,
    weight_decay=0.1,
    grad_clip=1.0,
    source="a test's size",
)


def test_the_compiled_memory_row_measures_a_replay_and_counts_its_arena(host_backend, monkeypatch):
    """NOTE [ A compiled step's memory ]: the compiled variant's measured call is a replay, not its
    second trace (an eager step that keeps every buffer it saw, with the first trace's free blocks
    still pooled), and its peak counts the arena and kept buffers it holds between calls."""
    monkeypatch.setattr(step, "has_compile", lambda: True)
    monkeypatch.setattr(step, "GPT", SMALL_GPT)
    case = step._gpt_memory_case(compiled=True)
    runs = {v.label: case.run_job({"variant": v.label, "process": 0}) for v in case.variants}
    eager, compiled = runs["taifuse eager"], runs["taifuse compiled"]
    # tracemalloc sees every NumPy array: a trace's peak is several times the eager step's; a
    # replay's is its arena (the step's live peak, at most the eager pool's) and a little more.
    assert compiled["traced_peak_bytes"] <= 1.1 * eager["traced_peak_bytes"], (compiled, eager)
    held = compiled.get("held_bytes")
    assert held is not None and 0 < held <= compiled["traced_peak_bytes"], compiled
    assert compiled["pool_peak_bytes"] <= 0.05 * held, compiled  # a replay's buffers are planned, not pooled
    assert eager.get("held_bytes") is None
