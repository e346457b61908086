"""The rank side of a Python call (job/calls.py), in this process: what a call, a failure and a result become
on disk, and what a rank makes of them."""

from __future__ import annotations

import sys

import pytest

from hpc_ddp.job import calls


def cell_function(source: str, name: str):
    """A function as a notebook cell defines it: in __main__, so plain pickle could only send its name."""
    namespace = {"__name__": "__main__"}
    exec(compile(source, "<cell>", "exec"), namespace)
    return namespace[name]


def test_a_function_from_a_cell_travels_by_value_with_the_launchers_sys_path(tmp_path, monkeypatch):
    fn = cell_function("class Box:\n    def __init__(self, v): self.v = v\n"
                       "def f(x, y=1):\n    return Box(x * y)\n", "f")
    monkeypatch.setattr(sys, "path", [*sys.path, "/somewhere/the/notebook/added"])
    calls.write_call(tmp_path, fn, (6,), {"y": 7})
    assert (tmp_path / calls.CALL).stat().st_mode & 0o077 == 0
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != "/somewhere/the/notebook/added"])
    loaded, args, kwargs = calls.load_call(tmp_path)
    assert loaded(*args, **kwargs).v == 42
    assert sys.path[-1] == "/somewhere/the/notebook/added"


def test_invoke_records_the_exception_with_the_users_frames_only(tmp_path):
    fn = cell_function("def f():\n    raise ValueError('boom at step 3')\n", "f")
    with pytest.raises(calls.Failure):
        calls.invoke(fn, (), {}, 1, tmp_path)
    [record] = calls.read_failures(tmp_path)
    assert (record["rank"], record["type"], record["message"]) == (1, "ValueError", "boom at step 3")
    assert 'File "<cell>", line 2, in f' in record["traceback"]
    assert "invoke" not in record["traceback"]


@pytest.mark.parametrize("code, fails", [(None, False), (0, False), (3, True), ("bye", True)])
def test_sys_exit_is_a_failure_unless_it_says_success(tmp_path, code, fails):
    def fn():
        sys.exit(code)
    if not fails:
        assert calls.invoke(fn, (), {}, 0, tmp_path) is None
        return
    with pytest.raises(calls.Failure):
        calls.invoke(fn, (), {}, 0, tmp_path)
    assert calls.read_failures(tmp_path)[0]["message"] == f"sys.exit({code!r})"


def test_failures_come_first_in_time_and_a_torn_record_is_skipped(tmp_path):
    for rank, t in ((0, 20.0), (2, 10.0)):
        calls.write_failure(tmp_path, {"rank": rank, "type": "E", "message": "", "traceback": "", "time": t})
    (tmp_path / "error-1.json").write_text('{"rank": 1, "ty')
    assert [r["rank"] for r in calls.read_failures(tmp_path)] == [2, 0]


class _FromAModuleTheRankLacks:
    def __reduce__(self):
        import importlib

        return importlib.import_module, ("a_module_only_the_notebook_has",)


def test_a_call_the_rank_cannot_load_is_its_failure(tmp_path):
    calls.write_call(tmp_path, print, (_FromAModuleTheRankLacks(),), {})
    assert calls.run_rank(tmp_path, 1) == 1
    [record] = calls.read_failures(tmp_path)
    assert record["message"].startswith("could not load the function on rank 1")
    assert record["type"] == "ModuleNotFoundError" and "a_module_only_the_notebook_has" in record["message"]


def test_rank_0_alone_writes_its_value_and_one_that_cannot_travel_is_a_failure(tmp_path):
    calls.write_call(tmp_path, cell_function("def f(): return {'loss': 0.5}\n", "f"), (), {})
    assert calls.run_rank(tmp_path, 1) == 0 and not (tmp_path / calls.RESULT).exists()
    assert calls.run_rank(tmp_path, 0) == 0 and calls.read_result(tmp_path) == {"loss": 0.5}
    calls.write_call(tmp_path, cell_function("import threading\ndef f(): return threading.Lock()\n", "f"), (), {})
    assert calls.run_rank(tmp_path, 0) == 1
    assert "return value cannot be pickled" in calls.read_failures(tmp_path)[0]["message"]


def test_the_module_entry_needs_a_rank(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match="usage"):
        calls.main([str(tmp_path)])
