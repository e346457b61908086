"""The environment recorded per attempt (job.provenance): what identifies it, and what changed since the
attempt before, written to events.jsonl and shown by status."""

import json

from hpc_ddp.common.events import read_jsonl
from hpc_ddp.job import provenance
from hpc_ddp.watch.status import environment_line

BEFORE = ["numpy==2.1.0", "torch==2.14.0", "tqdm==4.66.0"]
AFTER = ["numpy==2.1.0", "rich==13.0.0", "torch==2.14.1"]


def _fp(packages, torch):
    return provenance.fingerprint(packages, python="3.11.7", executable="/env/bin/python",
                                  versions={"torch": torch, "cuda": "12.4", "nccl": "2.21.5"})


def test_the_fingerprint_names_python_torch_cuda_nccl_and_hashes_the_packages():
    fp = _fp(BEFORE, "2.14.0")
    assert fp["python"] == "3.11.7" and fp["torch"] == "2.14.0" and fp["package_count"] == 3
    assert fp["packages"] == _fp(list(BEFORE), "2.14.0")["packages"] != _fp(AFTER, "2.14.0")["packages"]


def test_differences_name_each_package_that_moved():
    changed = provenance.differences(_fp(BEFORE, "2.14.0"), _fp(AFTER, "2.14.1"), BEFORE, AFTER)
    assert changed == ["torch 2.14.0 -> 2.14.1", "rich 13.0.0 added", "tqdm 4.66.0 removed"]
    assert provenance.differences(_fp(BEFORE, "x"), _fp(BEFORE, "x"), BEFORE, BEFORE) == []
    # the list of the attempt before is gone: the hashes still say that something changed
    assert "installed packages changed" in provenance.differences(_fp(BEFORE, "x"), _fp(AFTER, "x"), None, AFTER)[0]


def test_installed_packages_normalises_names_and_skips_broken_ones():
    class Dist:
        def __init__(self, name, version):
            self.metadata, self.version = {"Name": name}, version

    class Broken:
        @property
        def metadata(self):
            raise ValueError("no METADATA")

    assert provenance.installed_packages([Dist("Foo_Bar", "1"), Broken(), Dist("foo-bar", "2"), Dist("a", "0")]) == \
        ["a==0", "foo-bar==1"]


def test_record_writes_the_list_once_and_notes_a_change_between_attempts(tmp_path, monkeypatch):
    events = tmp_path / "events.jsonl"
    monkeypatch.setattr(provenance, "current", lambda: (_fp(BEFORE, "2.14.0"), BEFORE))
    first = provenance.record(tmp_path, events, job_id="7", attempt=0, node="n1")
    assert "changed" not in first
    listing = tmp_path / "environments" / f"{first['packages']}.txt"
    assert listing.read_text().splitlines() == BEFORE
    monkeypatch.setattr(provenance, "current", lambda: (_fp(AFTER, "2.14.1"), AFTER))
    second = provenance.record(tmp_path, events, job_id="7", attempt=1, node="n2")
    assert second["changed"][0] == "torch 2.14.0 -> 2.14.1" and second["since"] == {"job_id": "7", "attempt": 0}
    assert [e["attempt"] for e in read_jsonl(events) if e["event"] == "environment"] == [0, 1]
    assert json.dumps(second)  # one JSON line
    assert environment_line(second).startswith("python 3.11.7, torch 2.14.1, cuda 12.4, nccl 2.21.5, packages ")


def test_the_real_environment_is_read_without_importing_torch():
    import subprocess
    import sys

    code = ("import sys; from hpc_ddp.job import provenance; fp, pk = provenance.current(); "
            "assert 'torch' not in sys.modules; print(fp['torch'], len(pk) > 5)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[1] == "True" and out[0] != "None"
