"""``taifuse.save`` / ``taifuse.load`` (issue 29): safetensors checkpoints that cannot run code.

Round trips of every kind of value the structure holds, bit for bit for float32 (NaN payloads and
-0.0 included), float16, the bfloat16 optimizer state (uint16 bit patterns) and int64; a model's,
an AdamW's (bfloat16 state) and a GradScaler's state saved on every backend, loaded into fresh
twins, and the next step equal; files that are not safetensors, truncated, edited, or a pickle
renamed to ``.safetensors``: a ValueError naming the path, and nothing executed.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import taifuse
from taifuse import nn, optim
from taifuse.amp import GradScaler

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bits(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


def _every_float32() -> np.ndarray:
    specials = np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, -3.4e38, 1.0], np.float32)
    payload_nans = np.array([0x7FC00001, 0xFFC12345, 0x7F800001], np.uint32).view(np.float32)
    rand = (
        np.random.default_rng(0)
        .integers(0, 1 << 32, 1000, dtype=np.uint64)
        .astype(np.uint32)
        .view(np.float32)
    )
    return np.concatenate([specials, payload_nans, rand])


def test_round_trip_keeps_structure_types_and_bits(tmp_path):
    taifuse.set_backend("numpy")
    f32 = _every_float32()
    f16 = np.random.default_rng(1).integers(0, 1 << 16, 257, dtype=np.uint16).view(np.float16)
    bf16_bits = np.random.default_rng(2).integers(0, 1 << 16, (3, 5), dtype=np.uint16)
    i64 = np.array([np.iinfo(np.int64).min, -1, 0, np.iinfo(np.int64).max], np.int64)
    obj = {
        "f32": f32,
        "f16": f16,
        "bf16": bf16_bits,
        "i64": i64,
        "strided": np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2],  # not contiguous
        "big_endian": np.arange(3, dtype=">f4"),
        "empty": np.zeros((0, 4), np.float32),
        "scalars": [np.float16(1.5), np.int64(-7), np.float32(np.nan)],
        "numbers": [0, -(2**70), 1.0, 0.1, -0.0, float("inf"), float("-inf"), float("nan"), True, False],
        "text": ["", "ünïcode", '{"list": []}'],  # a string that reads like the structure's tags
        "none": None,
        "tuple": (1, (2.5, "x"), []),
        7: {0: "int key", 1.5: "float key", None: "none key", True: "bool key"},
        "tensor": taifuse.tensor(np.array([1.0, -2.0], np.float32), requires_grad=True),
        "int_tensor": taifuse.tensor(np.array([3, 4], np.int64)),
    }
    path = tmp_path / "all.safetensors"
    taifuse.save(obj, path)
    got = taifuse.load(path)

    assert list(got) == list(obj)  # order and key types (7 stays an int)
    for name in ("f32", "f16", "bf16", "i64", "empty"):
        assert got[name].dtype == obj[name].dtype and got[name].shape == obj[name].shape, name
        np.testing.assert_array_equal(_bits(got[name]), _bits(obj[name]))
    np.testing.assert_array_equal(got["strided"], obj["strided"])
    assert got["big_endian"].dtype == np.float32 and got["big_endian"].tolist() == [0.0, 1.0, 2.0]
    s16, s64, s32 = got["scalars"]
    assert (type(s16), s16) == (np.float16, np.float16(1.5)) and (type(s64), s64) == (np.int64, -7)
    assert type(s32) is np.float32 and np.isnan(s32)
    numbers = got["numbers"]
    assert numbers[:5] == [0, -(2**70), 1.0, 0.1, -0.0] and [type(n) for n in numbers[:3]] == [
        int,
        int,
        float,
    ]
    assert str(numbers[4]) == "-0.0" and numbers[5:7] == [float("inf"), float("-inf")]
    assert np.isnan(numbers[7]) and numbers[8] is True and numbers[9] is False
    assert got["text"] == obj["text"] and got["none"] is None
    assert got["tuple"] == (1, (2.5, "x"), []) and isinstance(got["tuple"][1], tuple)
    assert got[7] == obj[7] and list(got[7]) == [0, 1.5, None, True]
    t = got["tensor"]
    assert isinstance(t, taifuse.Tensor) and t.requires_grad and t.dtype == np.float32
    np.testing.assert_array_equal(t.numpy(), [1.0, -2.0])
    assert got["int_tensor"].dtype == np.int64 and not got["int_tensor"].requires_grad
    # The arrays are the caller's own: writable copies, not views of the file.
    got["f32"][0] = 5.0
    assert taifuse.load(path)["f32"][0] == 0.0


def test_the_file_is_plain_safetensors_with_the_structure_as_json(tmp_path):
    """Any safetensors reader opens the file; the arrays are named by where they sit."""
    from safetensors import safe_open

    path = tmp_path / "run.safetensors"
    taifuse.save({"model": {"w": np.ones(2, np.float32)}, "step": 3}, path)
    with safe_open(str(path), framework="np") as f:
        assert list(f.keys()) == ["model.w"]
        meta = f.metadata()
    assert meta["format"] == "taifuse"
    structure = json.loads(meta["taifuse.structure"])
    assert structure == {"dict": [["model", {"dict": [["w", {"array": "model.w"}]]}], ["step", 3]]}


def test_a_safetensors_file_from_elsewhere_loads_as_a_dict_of_arrays(tmp_path):
    from safetensors.numpy import save_file

    path = tmp_path / "other.safetensors"
    save_file({"a": np.arange(3, dtype=np.int32), "b": np.ones((2, 2), np.float16)}, str(path))
    got = taifuse.load(path)
    assert sorted(got) == ["a", "b"] and got["a"].tolist() == [0, 1, 2] and got["b"].dtype == np.float16


def _trained(backend_seed: int = 0):
    taifuse.manual_seed(backend_seed)
    model = nn.Sequential(nn.Linear(4, 8, activation="gelu"), nn.Linear(8, 3))
    opt = optim.AdamW(model.parameters(), lr=1e-2, state_dtype="bfloat16")
    return model, opt


def _step(model, opt, scaler, x):
    opt.zero_grad()
    loss = (model(taifuse.tensor(x)) ** 2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def test_model_optimizer_and_scaler_state_round_trip_and_train_on(grad_backend, tmp_path):
    """The state a training script saves (model, AdamW with bfloat16 state, GradScaler, step,
    config) comes back bit for bit on every backend, and twins loaded from it take the same step."""
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    model, opt = _trained()
    scaler = GradScaler(init_scale=2.0**10)
    for _ in range(3):
        _step(model, opt, scaler, x)
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scaler": scaler.state_dict(),
        "step": 3,
        "config": {"lr": 1e-2, "sizes": [4, 8, 3]},
    }
    path = tmp_path / "ckpt.safetensors"
    taifuse.save(state, path)
    loaded = taifuse.load(path)

    for name, t in state["model"].items():
        np.testing.assert_array_equal(_bits(loaded["model"][name].numpy()), _bits(t.numpy()))
    saved_opt, got_opt = state["optimizer"], loaded["optimizer"]
    assert got_opt["param_groups"] == saved_opt["param_groups"]  # betas stay tuples, state_dtype stays
    assert list(got_opt["state"]) == list(saved_opt["state"])  # int keys
    for i, entry in saved_opt["state"].items():
        for key, value in entry.items():
            if isinstance(value, np.ndarray):
                assert value.dtype == np.uint16 == got_opt["state"][i][key].dtype
                np.testing.assert_array_equal(got_opt["state"][i][key], value)
            else:
                assert got_opt["state"][i][key] == value
    assert loaded["scaler"] == state["scaler"] and loaded["step"] == 3 and loaded["config"] == state["config"]

    twin, twin_opt = _trained(backend_seed=1)  # other weights until loaded
    twin.load_state_dict(loaded["model"])
    twin_opt.load_state_dict(loaded["optimizer"])
    twin_scaler = GradScaler()
    twin_scaler.load_state_dict(loaded["scaler"])
    _step(model, opt, scaler, x)
    _step(twin, twin_opt, twin_scaler, x)
    for a, b in zip(model.parameters(), twin.parameters()):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


# ----------------------------------------------------------------------------- files that are not checkpoints


class _WritesAFile:
    """Unpickling this creates ``marker``: the code a pickled checkpoint can run."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def test_a_pickle_renamed_to_safetensors_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"model": _WritesAFile(marker)})
    # The payload is live: unpickling it does write the file (so the test below means something).
    pickle.loads(payload)
    assert marker.exists()
    marker.unlink()

    path = tmp_path / "model.safetensors"
    path.write_bytes(payload)
    with pytest.raises(ValueError, match=f"{path}.*not a readable safetensors file"):
        taifuse.load(path)
    assert not marker.exists()


def _saved(tmp_path) -> pathlib.Path:
    path = tmp_path / "ckpt.safetensors"
    taifuse.save({"w": np.arange(64, dtype=np.float32), "step": 12, "name": "run"}, path)
    return path


@pytest.mark.parametrize("cut", [1, 8, 100, -1], ids=["one-byte", "header-length", "in-header", "last-byte"])
def test_a_truncated_file_is_refused_naming_it(tmp_path, cut):
    path = _saved(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:cut])
    with pytest.raises(ValueError, match=str(path)):
        taifuse.load(path)


def test_a_file_that_is_not_safetensors_is_refused_naming_it(tmp_path):
    for content in (b"", b"hello, world\n" * 10, np.arange(100, dtype=np.float32).tobytes()):
        path = tmp_path / "junk.safetensors"
        path.write_bytes(content)
        with pytest.raises(ValueError, match=f"load: '{path}' is not a readable safetensors file"):
            taifuse.load(path)
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        taifuse.load(tmp_path / "missing.safetensors")


def test_an_edited_file_is_refused_naming_it(tmp_path):
    """A flipped byte in a tensor and a changed number in the structure both load as errors, not as
    other values (the digest); the header keeps its length, so safetensors' parser accepts both."""
    path = _saved(tmp_path)
    original = path.read_bytes()
    edited_tensor = bytearray(original)
    edited_tensor[-1] ^= 0x01
    edited_structure = original.replace(b'[\\"step\\",12]', b'[\\"step\\",99]')
    assert edited_structure != original and len(edited_structure) == len(original)
    for content in (bytes(edited_tensor), edited_structure):
        path.write_bytes(content)
        with pytest.raises(ValueError, match=f"load: '{path}' does not match the digest"):
            taifuse.load(path)


# ----------------------------------------------------------------------------- bad input to save


@pytest.mark.parametrize(
    ("obj", "error", "match"),
    [
        ({"a": [1, {2}]}, TypeError, r"obj\['a'\]\[1\] is a builtins.set"),
        ({"a": object()}, TypeError, r"obj\['a'\] is a builtins.object"),
        ({"s": np.array(["x"])}, TypeError, r"obj\['s'\] has dtype <U1, which safetensors cannot store"),
        ({(1, 2): 3}, TypeError, r"a key of obj is a tuple"),
    ],
    ids=["set", "object", "string-array", "tuple-key"],
)
def test_save_refuses_what_it_cannot_store_before_writing(tmp_path, obj, error, match):
    path = tmp_path / "ckpt.safetensors"
    taifuse.save({"old": 1}, path)
    with pytest.raises(error, match=match):
        taifuse.save(obj, path)
    assert taifuse.load(path) == {"old": 1}  # the previous checkpoint is whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors"]


def test_save_refuses_a_structure_that_contains_itself(tmp_path):
    loop: list = [1]
    loop.append(loop)
    with pytest.raises(ValueError, match=r"obj\[1\] contains itself"):
        taifuse.save(loop, tmp_path / "loop.safetensors")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(TypeError, match="path should be a str"):
        taifuse.save({}, 3)


def test_import_taifuse_does_not_import_safetensors():
    code = textwrap.dedent(
        """
        import sys, taifuse
        before = "safetensors" in sys.modules
        save = taifuse.save
        print(before, "safetensors" in sys.modules, callable(save), "save" in dir(taifuse))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["False", "False", "True", "True"]
