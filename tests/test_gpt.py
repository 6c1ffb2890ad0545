"""examples/gpt.py: the GPT built from taifuse's modules against the same model in PyTorch
(``torch_gpt``) loaded from taifuse's ``state_dict``: the keys, the logits, and the per-step losses
of a dozen AdamW steps with weight decay and gradient clipping, on every backend; then the
optimizer's groups, sampling and bad input."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from helpers import load_gpt_example

import taifuse
from taifuse import backends
from taifuse.optim import clip_grad_norm_

gpt = load_gpt_example()

# Small enough that a dozen steps take a second or two on every backend, with more than one head,
# more than one block, and a batch whose sequences differ.
CONFIG = gpt.GPTConfig(vocab_size=11, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0, bias=True)
BATCH = 4
STEPS = 12
LR, BETAS, WEIGHT_DECAY, MAX_NORM = 1e-2, (0.9, 0.95), 0.1, 0.5

# Two float32 programs that sum in different orders: measured here, the per-step losses of every
# backend (taichi-vulkan on lavapipe included) stay within 2.5e-6 (relative) of PyTorch's over the
# 12 steps, the logits of one forward within 1.5e-7 absolute. 1e-4 per step and 1e-5 absolute
# leave ~40x and ~60x for other machines' BLAS and GPUs.
LOSS_RTOL = 1e-4
LOGITS_ATOL = 1e-5

BLOCK_KEYS = [
    "ln1.weight",
    "ln1.bias",
    "attn.c_attn.weight",
    "attn.c_attn.bias",
    "attn.c_proj.weight",
    "attn.c_proj.bias",
    "ln2.weight",
    "ln2.bias",
    "mlp.fc.weight",
    "mlp.fc.bias",
    "mlp.proj.weight",
    "mlp.proj.bias",
]
KEYS = (
    ["wte.weight", "wpe.weight"]
    + [f"blocks.{i}.{key}" for i in range(CONFIG.n_layer) for key in BLOCK_KEYS]
    + ["ln_f.weight", "ln_f.bias", "lm_head.weight"]
)


def _batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """A learnable fixed sequence: each row counts up by 3 modulo the vocabulary from its own start."""
    start = np.random.default_rng([7, step]).integers(0, CONFIG.vocab_size, (BATCH, 1))
    seq = (start + 3 * np.arange(CONFIG.block_size + 1)) % CONFIG.vocab_size
    return seq[:, :-1], seq[:, 1:]


def _twins(torch):
    taifuse.manual_seed(0)
    model = gpt.GPT(CONFIG)
    twin = gpt.torch_gpt(CONFIG)
    twin.load_state_dict({k: torch.from_numpy(v.numpy().copy()) for k, v in model.state_dict().items()})
    return model, twin


def test_state_dict_loads_strictly_into_the_torch_twin_with_the_same_logits(backend):
    torch = pytest.importorskip("torch")
    backend.activate()
    model, twin = _twins(torch)
    assert list(model.state_dict()) == KEYS
    assert list(twin.state_dict()) == KEYS
    for (name, p), (_, tp) in zip(model.named_parameters(), twin.named_parameters()):
        assert p.shape == tuple(tp.shape), name
    idx, targets = _batch(0)
    logits, loss = model(idx, targets)
    with torch.no_grad():
        ref, ref_loss = twin(torch.from_numpy(idx), torch.from_numpy(targets))
    assert logits.shape == (BATCH, CONFIG.block_size, CONFIG.vocab_size)
    np.testing.assert_allclose(logits.numpy(), ref.numpy(), rtol=0, atol=LOGITS_ATOL)
    np.testing.assert_allclose(loss.item(), ref_loss.item(), rtol=LOSS_RTOL)
    # Without targets, only the last position, as nanoGPT at inference.
    last, none = model(idx)
    assert none is None and last.shape == (BATCH, 1, CONFIG.vocab_size)
    np.testing.assert_allclose(last.numpy(), ref.numpy()[:, -1:], rtol=0, atol=LOGITS_ATOL)


def test_training_losses_match_torch_step_by_step(backend):
    torch = pytest.importorskip("torch")
    backend.activate()
    model, twin = _twins(torch)
    opt = model.configure_optimizer(WEIGHT_DECAY, LR, BETAS)
    topt = twin.configure_optimizer(WEIGHT_DECAY, LR, BETAS)
    losses, ref_losses, norms = [], [], []
    for step in range(STEPS):
        idx, targets = _batch(step)
        _, loss = model(idx, targets)
        opt.zero_grad()
        loss.backward()
        norms.append(clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        losses.append(loss.item())

        _, ref_loss = twin(torch.from_numpy(idx), torch.from_numpy(targets))
        topt.zero_grad()
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), MAX_NORM)
        topt.step()
        ref_losses.append(ref_loss.item())
    np.testing.assert_allclose(
        losses, ref_losses, rtol=LOSS_RTOL, err_msg=f"per-step losses on {backend.param}"
    )
    # The run is a real test of the update: the model learns, and clipping acted.
    assert losses[-1] < 0.5 * losses[0], losses
    assert max(norms) > MAX_NORM, norms
    for (name, p), (_, tp) in zip(model.named_parameters(), twin.named_parameters()):
        np.testing.assert_allclose(
            p.numpy(), tp.detach().numpy(), rtol=0, atol=1e-4, err_msg=f"{name} after {STEPS} steps"
        )


def test_configure_optimizer_decays_matrices_and_embeddings_only():
    with backends.preserved_choice():
        taifuse.set_backend("numpy")
        model = gpt.GPT(CONFIG)
        opt = model.configure_optimizer(0.1, 1e-3, (0.9, 0.95))
    names = {id(p): name for name, p in model.named_parameters()}
    decay, no_decay = ({names[id(p)] for p in group["params"]} for group in opt.param_groups)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert {"wte.weight", "wpe.weight", "lm_head.weight", "blocks.1.attn.c_attn.weight"} <= decay
    assert all(model.state_dict()[n].ndim >= 2 for n in decay)
    assert all(n.endswith(("bias", "ln1.weight", "ln2.weight", "ln_f.weight")) for n in no_decay)
    assert decay | no_decay == set(KEYS)


def test_generate_is_seeded_crops_the_context_and_greedy_is_the_argmax():
    with backends.preserved_choice():
        taifuse.set_backend("numpy")
        taifuse.manual_seed(0)
        model = gpt.GPT(CONFIG)
        model.eval()
        prompt = np.array([[1, 4, 7], [2, 5, 8]])
        long = model.generate(prompt, CONFIG.block_size + 5, temperature=0.9, top_k=4, seed=3)
        assert long.shape == (2, 3 + CONFIG.block_size + 5) and long.dtype == np.int64
        np.testing.assert_array_equal(long[:, :3], prompt)
        np.testing.assert_array_equal(long, model.generate(prompt, CONFIG.block_size + 5, 0.9, 4, seed=3))
        taifuse.manual_seed(5)
        a = model.generate(prompt, 6)
        taifuse.manual_seed(5)
        np.testing.assert_array_equal(a, model.generate(prompt, 6))
        greedy = model.generate(prompt, 1, top_k=1, seed=0)
        last, _ = model(prompt)
        np.testing.assert_array_equal(greedy[:, -1], last.numpy()[:, -1].argmax(-1))


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda m: m(np.zeros((1, CONFIG.block_size + 1), np.int64)), ValueError, "block_size"),
        (lambda m: m(np.zeros((1, 4), np.float32)), TypeError, "idx"),
        (lambda m: m(np.zeros(4, np.int64)), ValueError, "idx"),
        (lambda m: m(np.zeros((1, 4), np.int64), np.zeros((1, 3), np.int64)), ValueError, "targets"),
        (lambda m: m.generate(np.zeros((1, 2), np.int64), 2, temperature=0.0), ValueError, "temperature"),
        (lambda m: m.generate(np.zeros((1, 2), np.int64), 2, top_k=0), ValueError, "top_k"),
        (lambda m: m.generate(np.zeros((1, 2), np.int64), -1), ValueError, "max_new_tokens"),
        (lambda m: gpt.GPT(gpt.GPTConfig(n_embd=30, n_head=4)), ValueError, "n_head"),
        (lambda m: gpt.GPT(gpt.GPTConfig(n_layer=0)), ValueError, "n_layer"),
    ],
)
def test_bad_input_names_the_argument(call, exc, match):
    with backends.preserved_choice():
        taifuse.set_backend("numpy")
        model = gpt.GPT(CONFIG)
        with pytest.raises(exc, match=match):
            call(model)


def test_docstring_example_runs():
    with backends.preserved_choice():
        result = doctest.testmod(
            gpt, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, report=True
        )
    assert result.attempted > 0 and result.failed == 0
