"""Resume at another world size, sample-exact (issue 32), on the local executor: a run on 4 ranks stopped at
step 5 resumes on 2 (a node range, keeping the global batch by accumulation) and trains exactly the
(epoch, index) multiset of an uninterrupted 4-rank run; a fixed-size run refuses another size, naming the
range option."""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path

import pytest

from .helpers import hpc_ddp

pytestmark = pytest.mark.e2e
SCRIPT = Path(__file__).with_name("elastic_keys.py")


def _trained(folder: Path) -> collections.Counter:
    found = collections.Counter()
    for path in folder.glob("keys-*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            found.update((record["epoch"], k) for k in record["keys"])
    return found


def _submit(tmp_path, run_dir, keys, *options, env=None):
    keys.mkdir(exist_ok=True)
    return hpc_ddp("submit", "--executor", "local", *options, "--run-dir", run_dir, "elastic_keys.py", "--",
                   str(keys), cwd=tmp_path, env=env)


def test_a_run_resumed_on_half_its_ranks_trains_the_uninterrupted_samples(tmp_path):
    shutil.copy(SCRIPT, tmp_path)
    done = _submit(tmp_path, "whole", tmp_path / "whole-keys", "--nodes", "4")
    assert done.returncode == 0, done.stderr
    stopped = _submit(tmp_path, "run", tmp_path / "keys", "--nodes", "4", "--max-preemptions", "0",
                      env={"HPC_DDP_FAULT_STOP_AT": "5"})
    assert stopped.returncode != 0 and "checkpointed" in stopped.stderr, stopped.stderr
    resumed = _submit(tmp_path, "run", tmp_path / "keys", "--nodes", "1-2")   # locally a range runs on its most
    assert resumed.returncode == 0, resumed.stderr
    out = resumed.stdout + resumed.stderr
    assert "resumed on 2 ranks (saved by 4): global batch kept at 16 with gradient accumulation 1 -> 2" in out
    whole, parts = _trained(tmp_path / "whole-keys"), _trained(tmp_path / "keys")
    assert parts == whole and max(parts.values()) == 1 and sum(whole.values()) == 2 * (200 // 16 * 16)
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [(e["from_world_size"], e["world_size"], e["grad_accum"]) for e in events if e["event"] == "resized"] \
        == [(4, 2, 2)]


def test_a_fixed_size_run_refuses_another_size_and_names_the_range(tmp_path):
    shutil.copy(SCRIPT, tmp_path)
    stopped = _submit(tmp_path, "run", tmp_path / "keys", "--nodes", "4", "--max-preemptions", "0",
                      env={"HPC_DDP_FAULT_STOP_AT": "3"})
    assert "checkpointed" in stopped.stderr, stopped.stderr
    again = _submit(tmp_path, "run", tmp_path / "keys", "--nodes", "2")
    out = again.stdout + again.stderr
    assert again.returncode != 0 and "saved by 4 ranks, this run has 2" in out and "--nodes MIN-MAX" in out
