"""Crash-safe checkpoints (hpc_ddp.trainer.checkpoint): round trip, pruning, damage + fallback, refusal of pickled
code, SIGKILL during save, inspect, and re-saving a step."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pathlib
import pickle
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from hpc_ddp.trainer import checkpoint as ckpt
from hpc_ddp.trainer.checkpoint import CheckpointError, CheckpointManager, inspect_checkpoint, state_sha256, verify

REPO = Path(__file__).resolve().parents[2]


def serialized(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def step_name(step: int) -> str:
    return f"step-{step:09d}"


def assert_same(a, b, where: str = "payload") -> None:
    """Deep equality: same container types and keys, tensors equal bit for bit with the same dtype/shape."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and a == b, where


def bump_one_ulp(state: dict[str, torch.Tensor], key: str) -> dict[str, torch.Tensor]:
    """A copy of `state` where the first element of `key` is moved by one ulp (its bit pattern + 1)."""
    changed = {k: v.clone() for k, v in state.items()}
    as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    flat = changed[key].view(-1).view(as_int[changed[key].dtype])
    flat[0] += 1
    return changed


def small_model(fill: float | None = None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    if fill is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(fill)
    return model


def training_payloads(step: int = 7):
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss = model(torch.randn(16, 4)).pow(2).mean()
    loss.backward()
    opt.step()
    loss = loss.item()
    train_state = {
        "progress": {"step": step, "epoch": 1, "batch_in_epoch": 3, "restarts": 0},
        "rng": [torch.get_rng_state()],
        "lr": 0.1, "losses": [1.5, 0.25, loss], "scaler": None, "pair": (1, 2),
        "counts": torch.arange(5), "name": "resnet",
    }
    return model, opt, {"model.pt": model.state_dict(), "optimizer.pt": opt.state_dict(),
                        "train_state.pt": train_state}


def step_payloads(step: int) -> dict:
    """A checkpoint whose content encodes its step: every weight == step."""
    return {"model.pt": small_model(fill=float(step)).state_dict(), "train_state.pt": {"step": step}}


def weights_encode(loaded: ckpt.Loaded, step: int) -> bool:
    params = [v for k, v in loaded.payloads["model.pt"].items() if k.endswith(("weight", "bias"))]
    return bool(params) and all(bool((v == step).all()) for v in params)


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob(".tmp-*"))


# ---------------------------------------------------------------- 1. round trip

def test_round_trip_returns_equal_contents_and_manifest(tmp_path: Path) -> None:
    model, _opt, payloads = training_payloads(step=7)
    assert payloads["optimizer.pt"]["state"], "one SGD step with momentum leaves momentum buffers"
    meta = {"epoch": 1, "batch_in_epoch": 3, "reason": "periodic", "fingerprint": {"world_size": 2}}
    manager = CheckpointManager(tmp_path / "ckpt", keep=3, log=pytest.fail)
    path = manager.save(7, payloads, meta)
    assert path == tmp_path / "ckpt" / step_name(7)

    loaded = CheckpointManager(tmp_path / "ckpt", log=pytest.fail).load_latest()
    assert loaded is not None and loaded.path == path and loaded.step == 7
    assert_same(payloads, loaded.payloads)
    assert_same(model.state_dict(), loaded.payloads["model.pt"])
    manifest = loaded.manifest
    assert manifest["step"] == 7 and manifest["format"] == ckpt.FORMAT
    for key, value in meta.items():
        assert manifest[key] == value
    assert set(manifest["files"]) == set(payloads)
    for fname, entry in manifest["files"].items():
        data = (path / fname).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        # Streamed to the file, the bytes are torch.save's own: any torch.load, and older hpc-ddp, read them.
        assert data == serialized(payloads[fname])
    assert verify(path) == manifest

    # the loaded state really restores the model and the optimizer
    fresh = small_model(fill=0.0)
    fresh.load_state_dict(loaded.payloads["model.pt"])
    assert state_sha256(fresh.state_dict()) == state_sha256(model.state_dict())
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.0)
    fresh_opt.load_state_dict(loaded.payloads["optimizer.pt"])
    assert fresh_opt.param_groups[0]["momentum"] == 0.9
    assert_same(fresh_opt.state_dict()["state"], payloads["optimizer.pt"]["state"])

    # only some files unpickled, but all of them verified
    partial = manager.load_latest(files=("model.pt",))
    assert partial is not None and list(partial.payloads) == ["model.pt"]


def test_state_sha256_matches_after_load_and_sees_one_ulp(tmp_path: Path) -> None:
    model, _opt, payloads = training_payloads()
    saved_hash = state_sha256(model.state_dict())
    manager = CheckpointManager(tmp_path, log=pytest.fail)
    manager.save(1, payloads, {})
    loaded = manager.load_latest()
    assert loaded is not None
    assert state_sha256(loaded.payloads["model.pt"]) == saved_hash
    assert state_sha256(model.state_dict()) == saved_hash  # deterministic

    state = model.state_dict()
    for key in ("0.weight", "3.bias", "1.running_mean"):
        changed = bump_one_ulp(state, key)
        assert not torch.equal(changed[key], state[key])
        assert torch.allclose(changed[key], state[key], rtol=1e-6, atol=0)  # really a tiny change
        assert state_sha256(changed) != saved_hash, key
    # the int64 counter of BatchNorm counts too
    counted = dict(state)
    counted["1.num_batches_tracked"] = state["1.num_batches_tracked"] + 1
    assert state_sha256(counted) != saved_hash


def test_state_sha256_is_the_hash_of_the_raw_bytes_in_key_order() -> None:
    """The definition the manifests of existing checkpoints were written with (`inspect` compares against
    them): sha256 over each tensor's bytes, contiguous, in key order; non-tensors skipped. Hashing in
    place (no copy) must not change it, for any dtype, layout or shape."""
    state = {"w": torch.randn(6, 4).t(), "half": torch.randn(5).to(torch.bfloat16), "count": torch.tensor(7),
             "empty": torch.empty(0, 3), "note": "skipped", "ints": torch.arange(10, dtype=torch.int32)[::3]}
    expected = hashlib.sha256()
    for value in state.values():
        if isinstance(value, torch.Tensor):
            expected.update(value.contiguous().numpy(force=True).tobytes() if value.dtype != torch.bfloat16
                            else value.view(torch.int16).contiguous().numpy().tobytes())
    assert state_sha256(state) == expected.hexdigest()
    assert state_sha256(dict(reversed(list(state.items())))) != expected.hexdigest()  # the order counts


def test_bf16_round_trip_and_hash(tmp_path: Path) -> None:
    model = small_model().to(torch.bfloat16)
    state = model.state_dict()
    assert state["0.weight"].dtype == torch.bfloat16
    manager = CheckpointManager(tmp_path, log=pytest.fail)
    manager.save(3, {"model.pt": state}, {"epoch": 0})
    loaded = manager.load_latest()
    assert loaded is not None
    assert_same(state, loaded.payloads["model.pt"])
    assert state_sha256(loaded.payloads["model.pt"]) == state_sha256(state)
    assert state_sha256(bump_one_ulp(state, "0.weight")) != state_sha256(state)
    # the bf16 hash is over bf16 bytes, not over a float32 copy
    assert state_sha256(state) != state_sha256({k: v.float() for k, v in state.items()})


# ---------------------------------------------------------------- 2. keep-K pruning

def test_keep_two_keeps_the_two_newest(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=2, log=pytest.fail)
    for step in range(1, 6):
        manager.save(step, step_payloads(step), {"epoch": step})
    assert [p.name for p in manager.checkpoints()] == [step_name(4), step_name(5)]
    assert names(tmp_path) == sorted([step_name(4), step_name(5), "latest"])
    assert (tmp_path / "latest").read_text().strip() == step_name(5)
    loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 5 and weights_encode(loaded, 5)


def test_keep_three_default(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, log=pytest.fail)
    for step in (10, 20, 30, 40, 50):
        manager.save(step, step_payloads(step), {})
    assert [p.name for p in manager.checkpoints()] == [step_name(30), step_name(40), step_name(50)]


def test_prune_never_deletes_what_latest_names(tmp_path: Path) -> None:
    writer = CheckpointManager(tmp_path, keep=5, log=pytest.fail)
    for step in (1, 2, 3):
        writer.save(step, step_payloads(step), {})
    manager = CheckpointManager(tmp_path, keep=2, log=pytest.fail)
    (tmp_path / "latest").write_text(step_name(1) + "\n")
    manager._prune(keep_name=step_name(3))
    assert [p.name for p in manager.checkpoints()] == [step_name(1), step_name(2), step_name(3)]
    (tmp_path / "latest").write_text(step_name(3) + "\n")
    manager._prune(keep_name=step_name(3))
    assert [p.name for p in manager.checkpoints()] == [step_name(2), step_name(3)]


def test_saving_an_older_step_keeps_it_and_points_latest_at_it(tmp_path: Path) -> None:
    """A save at a lower step (a rerun from an older checkpoint) is the oldest dir but what `latest` names."""
    manager = CheckpointManager(tmp_path, keep=2, log=pytest.fail)
    for step in (9, 10):
        manager.save(step, step_payloads(step), {})
    manager.save(3, step_payloads(3), {})
    assert [p.name for p in manager.checkpoints()] == [step_name(3), step_name(9), step_name(10)]
    assert (tmp_path / "latest").read_text().strip() == step_name(3)
    loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 3 and weights_encode(loaded, 3)


@pytest.mark.parametrize("keep", [1, 0, -1])
def test_keep_below_two_is_refused(tmp_path: Path, keep: int) -> None:
    with pytest.raises(ValueError, match="at least 2"):
        CheckpointManager(tmp_path, keep=keep)


# ---------------------------------------------------------------- 3. damage and fallback

@pytest.fixture
def three(tmp_path: Path) -> Path:
    """Checkpoints at steps 1, 2, 3 (keep=3) with model, optimizer and train state; weights == step."""
    root = tmp_path / "ckpt"
    manager = CheckpointManager(root, keep=3, log=pytest.fail)
    for step in (1, 2, 3):
        model = small_model(fill=float(step))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(4, 4)).sum().backward()
        opt.step()
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        manager.save(step, {"model.pt": model.state_dict(), "optimizer.pt": opt.state_dict(),
                            "train_state.pt": {"step": step}}, {"epoch": step})
    return root


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_middle_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def damage(root: Path, how: str) -> None:
    step3 = root / step_name(3)
    if how == "truncate model.pt":
        truncate(step3 / "model.pt")
    elif how == "empty model.pt":
        (step3 / "model.pt").write_bytes(b"")
    elif how == "flip a bit in optimizer.pt":
        flip_middle_bit(step3 / "optimizer.pt")
    elif how == "delete train_state.pt":
        (step3 / "train_state.pt").unlink()
    elif how == "delete manifest.json":
        (step3 / "manifest.json").unlink()
    elif how == "manifest.json invalid JSON":
        (step3 / "manifest.json").write_text('{"format": 1, "step": 3, "files": {')
    elif how == "manifest.json not UTF-8":
        (step3 / "manifest.json").write_bytes(b"\xff\xfe{}")
    elif how == "manifest.json without files":
        (step3 / "manifest.json").write_text('{"format": 1, "step": 3}')
    elif how == "latest names a missing dir":
        (root / "latest").write_text(step_name(99) + "\n")
    elif how == "latest missing":
        (root / "latest").unlink()
    elif how == "latest empty":
        (root / "latest").write_text("")
    else:
        raise AssertionError(how)


# (damage, the step load_latest must return, fragments the log must contain (relative to the root))
DAMAGE_CASES = [
    ("truncate model.pt", 2, [f"{step_name(3)}/model.pt", "damaged"]),
    ("empty model.pt", 2, [f"{step_name(3)}/model.pt", "damaged"]),
    ("flip a bit in optimizer.pt", 2, [f"{step_name(3)}/optimizer.pt", "sha256"]),
    ("delete train_state.pt", 2, [f"{step_name(3)}/train_state.pt", "is missing (the manifest lists it)"]),
    ("delete manifest.json", 2, [step_name(3), "manifest.json"]),
    ("manifest.json invalid JSON", 2, [step_name(3), "manifest.json", "unreadable"]),
    ("manifest.json not UTF-8", 2, [step_name(3), "manifest.json", "unreadable"]),
    ("manifest.json without files", 2, [step_name(3), "manifest.json", "malformed"]),
    # Nothing is damaged here: the newest valid checkpoint is found without `latest` (nothing is logged
    # today; see the report about a dangling `latest`).
    ("latest names a missing dir", 3, None),
    ("latest missing", 3, None),
    ("latest empty", 3, None),
]


@pytest.mark.parametrize("how,expected,fragments", DAMAGE_CASES, ids=[c[0] for c in DAMAGE_CASES])
def test_damage_falls_back_and_names_the_file(three: Path, how: str, expected: int, fragments) -> None:
    damage(three, how)
    logs: list[str] = []
    loaded = CheckpointManager(three, log=logs.append).load_latest()
    assert loaded is not None
    assert loaded.step == expected and loaded.path == three / step_name(expected)
    assert weights_encode(loaded, expected)
    assert loaded.payloads["train_state.pt"] == {"step": expected}
    assert loaded.manifest["epoch"] == expected
    assert set(loaded.payloads) == {"model.pt", "optimizer.pt", "train_state.pt"}
    if fragments is not None:
        assert len(logs) == 1, logs
        for fragment in fragments:
            assert (str(three / fragment) if "/" in fragment or fragment.startswith("step-") else fragment) in logs[0]
        assert "previous checkpoint" in logs[0]


def test_damage_in_a_file_not_unpickled_still_falls_back(three: Path) -> None:
    flip_middle_bit(three / step_name(3) / "optimizer.pt")
    logs: list[str] = []
    loaded = CheckpointManager(three, log=logs.append).load_latest(files=("model.pt",))
    assert loaded is not None and loaded.step == 2 and list(loaded.payloads) == ["model.pt"]
    assert len(logs) == 1 and str(three / step_name(3) / "optimizer.pt") in logs[0]


def test_two_damaged_fall_back_two_levels(three: Path) -> None:
    truncate(three / step_name(3) / "model.pt")
    (three / step_name(2) / "manifest.json").unlink()
    logs: list[str] = []
    loaded = CheckpointManager(three, log=logs.append).load_latest()
    assert loaded is not None and loaded.step == 1 and weights_encode(loaded, 1)
    assert len(logs) == 2
    assert str(three / step_name(3) / "model.pt") in logs[0]
    assert str(three / step_name(2)) in logs[1] and "manifest.json" in logs[1]


def test_latest_is_tried_first_even_if_not_newest(three: Path) -> None:
    (three / "latest").write_text(step_name(2) + "\n")
    loaded = CheckpointManager(three, log=pytest.fail).load_latest()
    assert loaded is not None and loaded.step == 2


def test_all_damaged_returns_none_and_says_scratch(three: Path) -> None:
    truncate(three / step_name(3) / "model.pt")
    flip_middle_bit(three / step_name(2) / "optimizer.pt")
    (three / step_name(1) / "manifest.json").write_text("not json")
    logs: list[str] = []
    assert CheckpointManager(three, log=logs.append).load_latest() is None
    assert len(logs) == 4
    assert str(three / step_name(3) / "model.pt") in logs[0]
    assert str(three / step_name(2) / "optimizer.pt") in logs[1]
    assert str(three / step_name(1)) in logs[2]
    assert "scratch" in logs[3] and "3" in logs[3] and str(three) in logs[3]


def test_empty_or_missing_root_returns_none_silently(tmp_path: Path) -> None:
    assert CheckpointManager(tmp_path / "nope", log=pytest.fail).load_latest() is None
    assert CheckpointManager(tmp_path, log=pytest.fail).load_latest() is None
    assert not (tmp_path / "nope").exists()


def test_latest_with_garbage_bytes_is_ignored(three: Path) -> None:
    (three / "latest").write_bytes(b"\xff\xfe\x00garbage")
    loaded = CheckpointManager(three, log=lambda _m: None).load_latest()
    assert loaded is not None and loaded.step == 3


def test_manifest_with_malformed_file_entry_falls_back(three: Path) -> None:
    manifest_path = three / step_name(3) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["model.pt"] = 12345
    manifest_path.write_text(json.dumps(manifest))
    logs: list[str] = []
    loaded = CheckpointManager(three, log=logs.append).load_latest()
    assert loaded is not None and loaded.step == 2
    assert logs and str(three / step_name(3)) in logs[0]


# ---------------------------------------------------------------- 4. leftover temp dirs

def test_leftover_temp_dirs_are_ignored_and_removed_by_next_save(tmp_path: Path) -> None:
    logged: list[str] = []
    manager = CheckpointManager(tmp_path, keep=3, log=logged.append)
    manager.save(1, step_payloads(1), {})
    manager.save(2, step_payloads(2), {})
    # a killed save of step 9 that got as far as a complete-looking directory, a half-written one,
    # a killed `latest` replacement, and a killed same-step replacement
    full = tmp_path / ".tmp-step-000000009-deadbeef"
    shutil.copytree(tmp_path / step_name(2), full)
    manifest = json.loads((full / "manifest.json").read_text())
    manifest["step"] = 9
    (full / "manifest.json").write_text(json.dumps(manifest))
    half = tmp_path / ".tmp-step-000000010-cafebabe"
    half.mkdir()
    (half / "model.pt").write_bytes(b"PK\x03\x04 half")
    (tmp_path / ".tmp-latest-0123abcd").write_text(".tmp-step-000000009-deadbeef\n")
    (tmp_path / ".tmp-old-step-000000001-00000000").mkdir()

    assert [p.name for p in manager.checkpoints()] == [step_name(1), step_name(2)]
    loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 2 and weights_encode(loaded, 2)
    # even a `latest` naming a temp dir is not followed
    (tmp_path / "latest").write_text(full.name + "\n")
    loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 2
    assert len(logged) == 1 and "does not name a checkpoint" in logged[0] and full.name in logged[0]
    assert len(leftovers(tmp_path)) == 4  # loading never deletes anything

    manager.save(3, step_payloads(3), {})
    assert leftovers(tmp_path) == []
    assert names(tmp_path) == sorted([step_name(1), step_name(2), step_name(3), "latest"])
    loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 3


# ---------------------------------------------------------------- 5. pickled code is refused

class Gadget:
    """Unpickling this runs Path.touch(marker): stands in for arbitrary code in a malicious checkpoint."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def hand_made_checkpoint(directory: Path, step: int, files: dict[str, bytes]) -> None:
    directory.mkdir()
    entries = {}
    for fname, data in files.items():
        (directory / fname).write_bytes(data)
        entries[fname] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (directory / "manifest.json").write_text(json.dumps({"format": 1, "step": step, "created": time.time(),
                                                         "files": entries, "epoch": step}))


@pytest.mark.parametrize("kind", ["torch.save", "plain pickle"])
def test_pickled_code_is_refused_without_running(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "ckpt"
    marker = tmp_path / "MARKER"
    manager = CheckpointManager(root, keep=3, log=pytest.fail)
    manager.save(1, step_payloads(1), {"epoch": 1})
    if kind == "torch.save":
        buffer = io.BytesIO()
        torch.save({"0.weight": torch.ones(2), "evil": Gadget(marker)}, buffer)
        data = buffer.getvalue()
    else:
        data = pickle.dumps(Gadget(marker), protocol=2)
    evil = root / step_name(2)
    hand_made_checkpoint(evil, 2, {"model.pt": data, "train_state.pt": serialized({"step": 2})})
    (root / "latest").write_text(step_name(2) + "\n")
    assert verify(evil)["step"] == 2  # sizes and hashes match: only the weights-only loader stands in the way

    logs: list[str] = []
    loaded = CheckpointManager(root, log=logs.append).load_latest()
    assert not marker.exists(), "the pickled code ran"
    assert loaded is not None and loaded.step == 1 and weights_encode(loaded, 1)
    assert len(logs) == 1
    assert "refused" in logs[0] and str(evil / "model.pt") in logs[0]

    with pytest.raises(CheckpointError, match="refused") as info:
        ckpt.load(evil)
    assert str(evil / "model.pt") in str(info.value)
    assert not marker.exists()
    with pytest.raises(CheckpointError):
        inspect_checkpoint(evil)
    assert not marker.exists()

    # the gadget is live: a full unpickle of the same bytes runs it (so the checks above mean something)
    if kind == "torch.save":
        torch.load(io.BytesIO(data), weights_only=False)
    else:
        pickle.loads(data)
    assert marker.exists()


# ---------------------------------------------------------------- 6. SIGKILL during save

HELPER = textwrap.dedent("""
    import os, sys
    import torch
    from hpc_ddp.trainer.checkpoint import CheckpointManager

    torch.set_num_threads(1)  # no thread pool in the parent: fork() below stays safe
    root, record = sys.argv[1], sys.argv[2]
    # about 4 MB of float32 weights, so a save takes a while and kills land mid-write
    net = torch.nn.Sequential(torch.nn.Linear(1024, 512), torch.nn.Linear(512, 1024))
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, arg = line.split()
        if cmd == "go":  # fork a child that saves steps arg, arg+1, ... until it is killed
            pid = os.fork()
            if pid == 0:
                try:
                    fd = os.open(record, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC)
                    manager = CheckpointManager(root, keep=3, log=lambda _m: None)
                    step = int(arg)
                    while True:
                        with torch.no_grad():
                            for p in net.parameters():
                                p.fill_(float(step))
                        manager.save(step, {"model.pt": net.state_dict(), "train_state.pt": {"step": step}},
                                     {"epoch": step})
                        os.write(fd, b"%d\\n" % step)  # one write: complete or absent after a kill
                        step += 1
                finally:
                    os._exit(3)
            print(pid, flush=True)
        elif cmd == "reap":
            print(os.waitpid(int(arg), 0)[1], flush=True)
""")


def big_payloads(step: int) -> dict:
    net = nn.Sequential(nn.Linear(1024, 512), nn.Linear(512, 1024))
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(float(step))
    return {"model.pt": net.state_dict(), "train_state.pt": {"step": step}}


@pytest.mark.timeout(90)
def test_sigkill_during_save_leaves_a_valid_checkpoint(tmp_path: Path) -> None:
    root, record = tmp_path / "ckpt", tmp_path / "saved.txt"
    script = tmp_path / "helper.py"
    script.write_text(HELPER)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    helper = subprocess.Popen([sys.executable, str(script), str(root), str(record)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)

    def ask(line: str) -> str:
        assert helper.stdin is not None and helper.stdout is not None
        helper.stdin.write(line + "\n")
        helper.stdin.flush()
        answer = helper.stdout.readline()
        assert answer, "the helper died"
        return answer.strip()

    rng = random.Random(20240611)
    next_step, baseline = 1, None  # baseline: the newest step this test process saved itself
    kills_mid_save = 0
    mine = CheckpointManager(root, keep=3, log=pytest.fail)
    try:
        assert helper.stdout is not None and helper.stdout.readline().strip() == "ready"
        for _ in range(15):
            pid = int(ask(f"go {next_step}"))
            time.sleep(rng.uniform(0.05, 0.6))
            os.kill(pid, signal.SIGKILL)
            status = int(ask(f"reap {pid}"))
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"saver ended early: {status}"
            kills_mid_save += bool(leftovers(root)) if root.exists() else 0
            recorded = [int(x) for x in record.read_text().split()]
            assert recorded == list(range(next_step, next_step + len(recorded)))

            # a kill damages at most the oldest dir (one being pruned): the newest `keep` all verify
            for path in CheckpointManager(root).checkpoints()[-3:]:
                verify(path)
            logs: list[str] = []
            loaded = CheckpointManager(root, keep=3, log=logs.append).load_latest()
            newest_known = max(recorded, default=baseline)
            if loaded is None:
                assert newest_known is None, "a completed save was lost"
            else:
                assert logs == [], "a kill left `latest` naming a bad checkpoint"
                assert verify(loaded.path) == loaded.manifest
                assert weights_encode(loaded, loaded.step)
                assert loaded.payloads["train_state.pt"] == {"step": loaded.step}
                assert loaded.manifest["epoch"] == loaded.step
                # the last save that returned, or the one after it that was killed after its rename
                low = newest_known if newest_known is not None else next_step - 1
                assert loaded.step in (low, low + 1)

            # the next run saves and finds its own new checkpoint; the killed save's leftovers go
            top = max([int(p.name[5:]) for p in mine.checkpoints()], default=0) + 1
            mine.save(top, big_payloads(top), {"epoch": top})
            again = CheckpointManager(root, keep=3, log=pytest.fail).load_latest()
            assert again is not None and again.step == top and weights_encode(again, top)
            assert leftovers(root) == []
            baseline, next_step = top, top + 1
        assert next_step > 16, "no save in the helper ever completed"
        assert kills_mid_save >= 1, "no kill landed in the middle of a save"
    finally:
        if helper.poll() is None:
            helper.stdin.close()  # type: ignore[union-attr]
            try:
                helper.wait(timeout=10)
            except subprocess.TimeoutExpired:
                helper.kill()
                helper.wait()


# ---------------------------------------------------------------- 7. inspect_checkpoint

def test_inspect_run_dir_checkpoints_dir_and_step_dir(tmp_path: Path) -> None:
    run = tmp_path / "run"
    root = run / "checkpoints"
    manager = CheckpointManager(root, keep=3, log=pytest.fail)
    states = {}
    for step, epoch in ((100, 1), (200, 2)):
        model = small_model(fill=float(step))
        states[step] = model.state_dict()
        manager.save(step, {"model.pt": states[step], "train_state.pt": {}},
                     {"epoch": epoch, "batch_in_epoch": 5, "fingerprint": {"model": "mlp"}})
    for target in (run, root, root / step_name(200)):
        info = inspect_checkpoint(target)
        assert info["step"] == 200 and info["epoch"] == 2 and info["batch_in_epoch"] == 5
        assert info["model_sha256"] == state_sha256(states[200])
        assert info["model_sha256"] != state_sha256(states[100])
        assert info["verified"] is True
        assert info["path"] == str(root / step_name(200))
        assert info["fingerprint"] == {"model": "mlp"}
        assert set(info["files"]) == {"model.pt", "train_state.pt"}
    older = inspect_checkpoint(root / step_name(100))
    assert older["step"] == 100 and older["epoch"] == 1 and older["model_sha256"] == state_sha256(states[100])

    # a damaged newest: the run dir and the checkpoints dir resolve to the older one, the step dir is refused
    truncate(root / step_name(200) / "train_state.pt")
    assert inspect_checkpoint(run)["step"] == 100
    assert inspect_checkpoint(root)["step"] == 100
    with pytest.raises(CheckpointError, match="train_state.pt"):
        inspect_checkpoint(root / step_name(200))


def test_inspect_without_a_valid_checkpoint_raises(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        inspect_checkpoint(empty)
    with pytest.raises(CheckpointError):
        inspect_checkpoint(tmp_path / "missing")
    root = tmp_path / "run" / "checkpoints"
    CheckpointManager(root, log=pytest.fail).save(1, step_payloads(1), {"epoch": 0})
    flip_middle_bit(root / step_name(1) / "model.pt")
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        inspect_checkpoint(tmp_path / "run")
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        inspect_checkpoint(root)
    with pytest.raises(CheckpointError, match="model.pt"):
        inspect_checkpoint(root / step_name(1))


# ---------------------------------------------------------------- 8. saving the same step again

def test_saving_the_same_step_twice_adds_a_revision(tmp_path: Path) -> None:
    """The complete older copy is never moved or deleted before the new one is in place."""
    manager = CheckpointManager(tmp_path, keep=3, log=pytest.fail)
    manager.save(4, step_payloads(4), {"epoch": 4})
    manager.save(5, step_payloads(5), {"epoch": 0, "reason": "periodic"})
    first = json.loads((tmp_path / step_name(5) / "manifest.json").read_text())
    path = manager.save(5, step_payloads(55), {"epoch": 1, "reason": "final"})
    assert path == tmp_path / f"{step_name(5)}-r1"
    assert names(tmp_path) == sorted([step_name(4), step_name(5), f"{step_name(5)}-r1", "latest"])
    loaded = CheckpointManager(tmp_path, log=pytest.fail).load_latest()
    assert loaded is not None and loaded.step == 5 and loaded.path == path
    assert weights_encode(loaded, 55) and loaded.payloads["train_state.pt"] == {"step": 55}
    assert loaded.manifest["epoch"] == 1 and loaded.manifest["reason"] == "final"
    assert loaded.manifest["created"] >= first["created"]
    assert verify(path) == loaded.manifest
    # the untouched older checkpoints are still there and intact
    assert weights_encode(ckpt.load(tmp_path / step_name(4)), 4)
    assert weights_encode(ckpt.load(tmp_path / step_name(5)), 5)
    # and keep-K counts revisions like any other checkpoint
    manager.save(6, step_payloads(6), {})
    assert names(tmp_path) == sorted([step_name(5), f"{step_name(5)}-r1", step_name(6), "latest"])


class Killed(BaseException):
    """Stands in for SIGKILL at one exact point of a save."""


def test_kill_while_replacing_the_same_step_keeps_old_or_new(tmp_path: Path, monkeypatch) -> None:
    manager = CheckpointManager(tmp_path, keep=3, log=lambda _m: None)
    manager.save(4, step_payloads(4), {})
    manager.save(5, step_payloads(5), {})
    real_rename = os.rename

    def rename(src, dst):
        if Path(src).name.startswith(".tmp-step-"):  # the new dir moving into place: die just before
            raise Killed
        real_rename(src, dst)

    monkeypatch.setattr(ckpt.os, "rename", rename)
    with pytest.raises(Killed):
        manager.save(5, step_payloads(55), {})
    monkeypatch.setattr(ckpt.os, "rename", real_rename)
    loaded = CheckpointManager(tmp_path, log=lambda _m: None).load_latest()
    assert loaded is not None and loaded.step == 5  # the old step 5 or the new one, never step 4


# ---- a directory other users can write to could hold a planted checkpoint ----

def test_loading_from_a_directory_others_can_write_warns(three: Path) -> None:
    os.chmod(three, 0o777)
    said: list[str] = []
    assert CheckpointManager(three, log=said.append).load_latest().step == 3
    assert len(said) == 1 and f"{three} is writable by every user" in said[0] and "chmod go-w" in said[0]


def test_loading_from_a_private_directory_says_nothing(three: Path) -> None:
    os.chmod(three, 0o700)
    os.chmod(three.parent, 0o700)
    assert CheckpointManager(three, log=pytest.fail).load_latest().step == 3


@pytest.mark.parametrize("uid,mode,reason", [
    (1000, 0o40700, None), (1000, 0o40755, None), (1000, 0o40775, "is writable by its group"),
    (1000, 0o41777, "is writable by every user"), (0, 0o40700, "belongs to another user (uid 0)"),
])
def test_others_can_write(uid: int, mode: int, reason: str | None) -> None:
    st = os.stat_result((mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))
    assert ckpt.others_can_write(st, 1000) == reason
