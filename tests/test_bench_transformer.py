"""The transformer benchmark suite: its cases, the FLOP count of attention, and that every variant
of a case computes the same thing (on small inputs: no benchmark runs here)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

import taifuse
from taifuse import backends
from taifuse.bench.case import check_outputs
from taifuse.bench.suites import load_cases, suite_names, transformer

SMALL = (2, 3, 37, 8)  # B, H, L = S (cuts the numba kernel's query blocks), E
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")


@pytest.fixture(params=["numpy", "numba"])
def host_backend(request):
    with backends.preserved_choice():
        taifuse.set_backend(request.param)
        yield request.param


def _outputs(case, labels, inputs):
    return {label: case.variant(label).build(inputs)().numpy() for label in labels}


def test_registered():
    assert "transformer" in suite_names()
    for quick in (False, True):
        ids = [c.id for c in load_cases(["transformer"], quick=quick, compare_torch=False)]
        # The goal's size in quick mode too.
        assert ids[:2] == [
            "transformer/attention forward+backward(B=8, H=8, L=S=512, E=64, causal)",
            "transformer/attention forward(B=8, H=8, L=S=512, E=64, causal)",
        ]
        assert ids[2] == "transformer/attention peak memory(B=1, H=1, L=S=4096, E=64, no mask)"
        # The GPT example's small heads and layer norm: full runs only.
        small = [
            "transformer/attention forward+backward(B=16, H=4, L=S=128, E=64, causal)",
            "transformer/attention forward+backward(B=16, H=8, L=S=64, E=32, causal)",
            "transformer/layer norm forward+backward(16, 128, 256)",
        ]
        assert ids[-4:-1] == small if not quick else not set(small) & set(ids)


def test_torch_baselines_only_with_compare_torch_and_isolated():
    for backward in (True, False):
        plain = transformer.attention_case(False, backward=backward)
        assert [b.label for b in plain.baselines] == ["numpy naive"]
        with_torch = transformer.attention_case(True, backward=backward)
        torch_variant = with_torch.variant("torch")
        assert torch_variant.isolated and torch_variant.peer
        assert not with_torch.variant("numpy naive").isolated


@pytest.mark.parametrize(("L", "S"), [(1, 1), (7, 7), (7, 3), (3, 7), (64, 64)])
def test_attention_pairs_count_the_mask(L, S):
    causal = np.tril(np.ones((L, S), bool))  # top-left aligned, as is_causal
    assert transformer.attention_pairs(L, S, causal=True) == causal.sum()
    assert transformer.attention_pairs(L, S, causal=False) == L * S
    if L == S:
        assert transformer.attention_pairs(L, S, causal=True) == L * (L + 1) // 2


def test_attention_flops():
    b, h, L, e = 2, 3, 5, 4
    pairs = L * (L + 1) // 2
    # Forward: Q K^T and P V. Backward: the scores again, dV, dP, dQ, dK.
    assert (
        transformer.attention_flops(b, h, L, L, e, causal=True, backward=False) == b * h * 2 * 2 * e * pairs
    )
    assert transformer.attention_flops(b, h, L, L, e, causal=True, backward=True) == b * h * 7 * 2 * e * pairs
    case = transformer.attention_case(False, backward=True)
    assert case.flops == transformer.attention_flops(8, 8, 512, 512, 64, causal=True, backward=True)


@pytest.mark.parametrize("backward", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_variants_agree(backend, backward, causal):
    backend.activate()
    case = transformer.attention_case(False, backward=backward, shape=SMALL, causal=causal)
    inputs = case.setup(0)
    out = _outputs(case, ["taifuse", "numpy naive"], inputs)
    check = check_outputs(out["taifuse"], out["numpy naive"], case.rtol, case.atol)
    assert check["ok"], check
    b, h, L, e = SMALL
    assert out["taifuse"].shape == ((4 if backward else 1) * b * h * L * e,)


def test_numpy_naive_matches_the_reference_gradients(host_backend):
    # The naive baseline is not checked against itself: its gradients against float64 finite
    # differences of the reference forward, on one entry of each input.
    case = transformer.attention_case(False, backward=True, shape=(1, 1, 5, 3))
    inputs = {k: v.astype(np.float64).astype(np.float32) for k, v in case.setup(3).items()}
    out = case.variant("numpy naive").build(inputs)().numpy().reshape(4, 5, 3)

    def loss(q, k, v):
        s = q[0, 0] @ k[0, 0].T / np.sqrt(3) + np.where(np.triu(np.ones((5, 5)), 1) > 0, -np.inf, 0)
        p = np.exp(s - s.max(-1, keepdims=True))
        return ((p / p.sum(-1, keepdims=True)) @ v[0, 0] * inputs["g"][0, 0]).sum()

    x64 = {k: inputs[k].astype(np.float64) for k in "qkv"}
    for i, name in enumerate("qkv", start=1):
        bumped = {k: a.copy() for k, a in x64.items()}
        bumped[name][0, 0, 2, 1] += 1e-6
        lowered = {k: a.copy() for k, a in x64.items()}
        lowered[name][0, 0, 2, 1] -= 1e-6
        numeric = (loss(**bumped) - loss(**lowered)) / 2e-6
        assert out[i, 2, 1] == pytest.approx(numeric, rel=1e-3, abs=1e-5)


@needs_torch
@pytest.mark.parametrize("backward", [True, False])
def test_torch_variant_agrees(backward):
    with backends.preserved_choice():
        taifuse.set_backend("numba")
        case = transformer.attention_case(True, backward=backward, shape=SMALL)
        out = _outputs(case, ["taifuse", "torch"], case.setup(0))
    check = check_outputs(out["taifuse"], out["torch"], case.rtol, case.atol)
    assert check["ok"], check


@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 33)])
def test_layer_norm_variants_agree(backend, shape):
    backend.activate()
    case = transformer.layer_norm_case(False, shape=shape)
    out = _outputs(case, ["taifuse", "numpy"], case.setup(0))
    check = check_outputs(out["taifuse"], out["numpy"], case.rtol, case.atol)
    assert check["ok"], check
    n, c = np.prod(shape), shape[-1]
    assert out["taifuse"].shape == (2 * n + 2 * c,)
    assert case.bytes_moved == 4 * (4 * n + 4 * c) and case.bytes_written == 4 * (2 * n + 2 * c)


@needs_torch
def test_layer_norm_torch_variant_agrees():
    with backends.preserved_choice():
        taifuse.set_backend("numba")
        case = transformer.layer_norm_case(True, shape=(3, 5, 7))
        assert case.variant("torch").isolated
        out = _outputs(case, ["taifuse", "torch"], case.setup(0))
    check = check_outputs(out["taifuse"], out["torch"], case.rtol, case.atol)
    assert check["ok"], check


# ----------------------------------------------------------------------------- memory


def _small_memory_case():
    return dataclasses.replace(
        transformer.attention_memory_case(),
        setup=functools.partial(transformer._attention_inputs, shape=(1, 1, 70, 8)),
    )


def test_memory_variants_agree(backend):
    backend.activate()
    case = _small_memory_case()
    inputs = case.setup(0)
    out = {v.label: v.build(inputs)().numpy() for v in case.variants}
    fused, naive = out["taifuse fused forward"], out["numpy naive forward"]
    assert check_outputs(fused, naive, 1e-4, 1e-5)["ok"]
    for label in ("numpy naive forward+backward", "taifuse naive forward+backward"):
        check = check_outputs(out["taifuse fused forward+backward"], out[label], 1e-4, 1e-5)
        assert check["ok"], (label, check)


def test_memory_pairs_are_fused_against_naive():
    case = transformer.attention_memory_case()
    labels = {v.label for v in case.variants}
    for fused, naive in case.pairs:
        assert fused in labels and naive in labels
        assert "fused" in fused and "naive" in naive


def test_memory_step_leaves_no_gradients(host_backend):
    # Each measured step starts from the inputs alone: the fused and naive backward steps drop
    # the gradients they made, so a warm-up step's gradients are not held under the measured one.
    case = _small_memory_case()
    inputs = case.setup(0)
    for label in ("taifuse fused forward+backward", "taifuse naive forward+backward"):
        call = case.variant(label).build(inputs)
        call()
        namespace = call.__globals__
        assert all(namespace[name].grad is None for name in ("qt", "kt", "vt"))


def test_memory_job_measures_each_variant(host_backend):
    case = _small_memory_case()
    for label in ("taifuse fused forward", "numpy naive forward"):
        result = case.run_job({"variant": label, "process": 0})
        assert result["variant"] == label
        # tracemalloc sees NumPy's arrays as well as taifuse's
        assert result["traced_peak_bytes"] is not None and result["traced_peak_bytes"] > 0
        assert (result["pool_peak_bytes"] is None) == label.startswith("numpy")


def test_memory_pair_row_is_naive_over_fused():
    case = transformer.attention_memory_case()
    fused, naive = case.pairs[1]
    mib = 2**20
    runs = []
    for i in range(3):
        runs.append(
            {"variant": fused, "rss_peak_bytes": (7 + i) * mib, "traced_peak_bytes": None, "step_ns": 1}
        )
        runs.append({"variant": naive, "rss_peak_bytes": 132 * mib, "traced_peak_bytes": None, "step_ns": 1})
    rows = {r["id"]: r for r in case.rows(runs)}
    row = rows[f"{case.id}/{fused} vs {naive}"]
    assert row["unit"] == "x less memory"
    assert row["value"] == pytest.approx(132 / 8)


# ----------------------------------------------------------------------------- GPT step

TINY_GPT = {"vocab_size": 13, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 16}
TINY = transformer.GPTSettings(TINY_GPT, batch=3, lr=1e-3, weight_decay=0.1, grad_clip=1.0)


def test_gpt_case_is_registered_with_the_examples_defaults():
    assert transformer.GPT_PATH.is_file()  # the tests run from the checkout
    settings = transformer.example_settings()
    case = load_cases(["transformer"], compare_torch=True)[-1]
    assert case.id.startswith("transformer/gpt step(") and f"batch={settings.batch}" in case.id
    for key, value in settings.config.items():
        assert f"{key}={value}" in case.name
    assert case.variant("torch").isolated and case.variant("torch").peer
    assert load_cases(["transformer"], compare_torch=False)[-1].baselines == ()


def test_example_settings_are_train_gpts_defaults(monkeypatch):
    transformer.gpt_module()  # registered as "gpt", which train_gpt.py imports
    spec = importlib.util.spec_from_file_location("train_gpt_for_bench_test", transformer.TRAIN_GPT_PATH)
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, example)  # its dataclasses look their module up
    spec.loader.exec_module(example)
    args = example.parse_args([])
    settings = transformer.example_settings()
    assert settings.source == "examples/train_gpt.py's defaults"
    assert settings.config == {
        "vocab_size": example.VOCAB_SIZE,
        "block_size": args.block_size,
        "n_layer": args.n_layer,
        "n_head": args.n_head,
        "n_embd": args.n_embd,
    }
    assert (settings.batch, settings.lr, settings.weight_decay, settings.grad_clip) == (
        args.batch_size,
        args.lr,
        args.weight_decay,
        args.grad_clip,
    )


def test_example_settings_fall_back_and_say_so(tmp_path):
    settings = transformer.example_settings(tmp_path / "train_gpt.py")
    assert settings.config == transformer.FALLBACK_GPT.config
    assert settings.source.startswith("the suite's fallback config (train_gpt.py: ")
    case = transformer.gpt_case(False, settings)
    assert settings.source in case.shape


def test_gpt_parameter_shapes_are_the_models():
    gpt = transformer.gpt_module()
    with backends.preserved_choice():
        taifuse.set_backend("numpy")
        model = gpt.GPT(gpt.GPTConfig(**TINY_GPT))
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    shapes = transformer.gpt_parameter_shapes(TINY_GPT)
    assert list(shapes) == list(expected) and shapes == expected


def test_gpt_step_flops():
    c, L, T, V, B, H = 16, 2, 8, 13, 3, 2
    linear = 6 * B * T * (L * (3 * c * c + c * c + 4 * c * c + 4 * c * c) + V * c)
    attention = L * B * H * 14 * (c // H) * (T * (T + 1) // 2)
    assert transformer.gpt_step_flops(TINY_GPT, B) == linear + attention


def test_gpt_case_without_the_example_is_one_skipped_row(tmp_path):
    case = transformer.gpt_case(True, path=tmp_path / "gpt.py")
    assert case.jobs(5) == []
    (row,) = case.rows([], None)
    assert row["verdict"].startswith("skipped: examples/gpt.py not found")
    assert row["kind"] == "skipped" and row["suite"] == "transformer" and row["value"] is None


def test_gpt_inputs_load_strictly(host_backend):
    case = transformer.gpt_case(False, TINY)
    inputs = case.setup(0)
    assert inputs["x"].shape == inputs["y"].shape == (3, TINY_GPT["block_size"])
    call = case.candidate.build(inputs)  # load_state_dict is strict
    first = call().numpy()
    second = call().numpy()  # the step changed the weights: another loss and other gradients
    assert np.isfinite(first).all() and first.shape == second.shape and first[0] != second[0]
    n_params = sum(int(np.prod(s)) for s in transformer.gpt_parameter_shapes(TINY_GPT).values())
    assert first.shape == (1 + n_params,)


@needs_torch
def test_gpt_step_matches_torch():
    with backends.preserved_choice():
        taifuse.set_backend("numba")
        case = transformer.gpt_case(True, TINY)
        inputs = case.setup(0)
        out = _outputs(case, ["taifuse", "torch"], inputs)
    check = check_outputs(out["taifuse"], out["torch"], case.rtol, case.atol)
    assert check["ok"], check


# ----------------------------------------------------------------------------- goal script


def _goal_script():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_transformer.py"
    spec = importlib.util.spec_from_file_location("bench_transformer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(row_id, low, high):
    return {"id": row_id, "value": (low + high) / 2, "low": low, "high": high, "verdict": "faster"}


def test_goals_are_judged_on_the_interval():
    script = _goal_script()
    attention = transformer.attention_case(True, backward=True).id
    memory = transformer.attention_memory_case()
    gpt = transformer.gpt_case(True).id
    (fwd, fwd_naive), (bwd, bwd_naive) = memory.pairs[:2]
    rows = [
        _row(f"{attention}/torch", 1.4, 1.7),  # straddles 1.5
        _row(f"{memory.id}/{fwd} vs {fwd_naive}", 15.0, 20.0),
        _row(f"{memory.id}/{bwd} vs {bwd_naive}", 5.0, 7.9),
        _row(f"{gpt}/torch", 0.97, 1.2),  # at or above 1 / 1.05
    ]
    statuses = [g["status"] for g in script.goals({"rows": rows})]
    assert statuses == ["undecided", "met", "not met", "met"]
    # A run made at another config of the example: its GPT row is still the one judged.
    rows[-1] = _row("transformer/gpt step(vocab_size=5, batch=2)/torch", 0.5, 0.6)
    assert script.goals({"rows": rows})[-1]["status"] == "not met"
    assert script.goals({"rows": rows})[-1]["value"] == pytest.approx(0.55)
    skipped = transformer.gpt_case(True, path=Path("/nonexistent/gpt.py")).rows([], None)
    goal = script.goals({"rows": rows[:-1] + skipped})[-1]
    assert goal["status"] == "not met" and goal["detail"].startswith("skipped: examples/gpt.py not found")
    # No rows: every goal is not met, none is skipped silently.
    assert [g["status"] for g in script.goals({"rows": []})] == ["not met"] * 4


# ----------------------------------------------------------------------------- GPT step memory under autocast

SMALL_GPT = transformer.GPTSettings(
    {"vocab_size": 13, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32},
    batch=4,
    lr=1e-3,
    weight_decay=0.1,
    grad_clip=1.0,
)


def test_gpt_memory_case_is_registered_at_the_examples_defaults():
    settings = transformer.example_settings()
    for quick in (False, True):
        (case,) = [c for c in load_cases(["transformer"], quick=quick) if "autocast" in c.name]
        assert case.name.startswith("GPT step peak activation memory, autocast float16 vs float32(")
        assert f"batch={settings.batch}" in case.name
        for key, value in settings.config.items():
            assert f"{key}={value}" in case.name
    assert case.pairs == ((transformer.GPT_MEMORY_AUTOCAST, transformer.GPT_MEMORY_FLOAT32),)
    # The float32 variant is the gpt case's step; the autocast one runs the same model and batch.
    assert case.variant(transformer.GPT_MEMORY_FLOAT32).code == transformer.gpt_case(False).candidate.code
    assert "amp.autocast()" in case.variant(transformer.GPT_MEMORY_AUTOCAST).code


def test_gpt_memory_variants_step_the_same_model(host_backend):
    case = transformer.gpt_memory_case(SMALL_GPT)
    losses = {}
    for v in case.variants:
        call = v.build(case.setup(0))
        losses[v.label] = [float(call().numpy()) for _ in range(2)]
        if v.label == transformer.GPT_MEMORY_AUTOCAST:
            # No step was skipped for an overflow: AdamW's state exists after the warm-up step, so
            # the measured step does not allocate it.
            assert call.__globals__["scaler"].get_scale() == 2.0**16
        assert call.__globals__["opt"].state  # the optimizer stepped
    f32, f16 = losses[transformer.GPT_MEMORY_FLOAT32], losses[transformer.GPT_MEMORY_AUTOCAST]
    np.testing.assert_allclose(f16, f32, rtol=1e-2)


def test_gpt_memory_job_measures_both_variants(host_backend):
    case = transformer.gpt_memory_case(SMALL_GPT)
    for v in case.variants:
        result = case.run_job({"variant": v.label, "process": 0})
        assert result["variant"] == v.label
        assert result["traced_peak_bytes"] > 0 and result["pool_peak_bytes"] > 0


def test_gpt_memory_pair_row_gives_autocasts_fraction_of_float32():
    case = transformer.gpt_memory_case(SMALL_GPT)
    mib = 2**20
    runs = []
    for i, amp in enumerate((55, 60, 58)):
        runs.append(
            {"variant": transformer.GPT_MEMORY_FLOAT32, "rss_peak_bytes": (100 + i) * mib, "step_ns": 1}
        )
        runs.append({"variant": transformer.GPT_MEMORY_AUTOCAST, "rss_peak_bytes": amp * mib, "step_ns": 1})
    rows = {r["id"]: r for r in case.rows(runs)}
    assert set(rows) == {
        f"{case.id}/{transformer.GPT_MEMORY_FLOAT32}",
        f"{case.id}/{transformer.GPT_MEMORY_AUTOCAST}",
        f"{case.id}/{transformer.GPT_MEMORY_AUTOCAST} vs {transformer.GPT_MEMORY_FLOAT32}",
    }
    pair = rows[f"{case.id}/{transformer.GPT_MEMORY_AUTOCAST} vs {transformer.GPT_MEMORY_FLOAT32}"]
    assert pair["unit"] == "x less memory" and pair["kind"] == "memory_compare"
    ratios = [101 / 60, 100 / 55, 102 / 58]  # float32's peak over autocast's, process by process
    assert pair["value"] == pytest.approx(sorted(ratios)[1])
    fraction = pair["fraction"]
    assert fraction["median"] == pytest.approx(1 / pair["value"])
    assert fraction["low"] <= fraction["median"] <= fraction["high"]
    assert pair["bytes"] == {
        transformer.GPT_MEMORY_AUTOCAST: 58 * mib,
        transformer.GPT_MEMORY_FLOAT32: 101 * mib,
    }
    assert "goal: at most 0.60" in pair["note"]


def test_gpt_memory_case_without_the_example_is_one_skipped_row(tmp_path):
    case = transformer.gpt_memory_case(path=tmp_path / "gpt.py")
    assert case.jobs(3) == []
    (row,) = case.rows([], None)
    assert row["kind"] == "skipped" and row["verdict"].startswith("skipped: examples/gpt.py not found")
