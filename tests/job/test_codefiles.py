"""Source file names of code sent by value (hpc_ddp.job.codefiles): recorded by the launcher, put back on the
rank when cloudpickle renamed them `<dynamic-code>`. The whole trip through cloudpickle and a fresh rank is
tests/launch/test_notebook.py::test_a_ranks_exception_names_it_with_its_traceback_and_stops_the_others."""

import json
import types

from hpc_ddp.job.codefiles import DYNAMIC, files_of, restore_files

CELL = """
import json
def helper(x):
    return [y * 2 for y in x]
class Model:
    def forward(self, x):
        return helper(x)
    @staticmethod
    def make():
        return Model()
def outer():
    scale = 3
    def inner(x):
        return x * scale
    return inner
def f():
    return Model.make().forward([1]), outer()(2), json.dumps({})
"""


def cell(source: str, filename: str) -> dict:
    namespace = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace


def dynamic(code: types.CodeType) -> types.CodeType:
    """What cloudpickle >= 3.1.3 sends: the same code, every file named <dynamic-code>."""
    consts = tuple(dynamic(c) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=DYNAMIC, co_consts=consts)


def all_files(code: types.CodeType) -> set[str]:
    return {code.co_filename}.union(*(all_files(c) for c in code.co_consts if isinstance(c, types.CodeType)))


def test_every_function_reachable_from_the_call_gets_its_file_back():
    ns = cell(CELL, "/tmp/ipykernel_1/cell5.py")
    files = files_of(ns["f"])
    functions = [ns["f"], ns["helper"], ns["outer"], ns["Model"].forward, ns["Model"].__dict__["make"].__func__]
    for function in functions:
        function.__code__ = dynamic(function.__code__)
    restore_files((ns["f"],), files)
    for function in functions:  # nested code (inner, the list comprehension) included
        assert all_files(function.__code__) == {"/tmp/ipykernel_1/cell5.py"}, function.__qualname__
    assert ns["f"]() == ([2], 6, "{}")  # the code still runs


def test_library_code_is_neither_followed_nor_renamed():
    ns = cell(CELL, "<cell>")
    files = files_of(ns["f"])
    assert all(name == "<cell>" for name in files.values())
    assert json.dumps.__code__.co_filename != DYNAMIC
    assert ("dumps", json.dumps.__code__.co_firstlineno) not in files


def test_functions_passed_as_arguments_are_roots_too():
    ns = cell("def make():\n    return 1\n", "<cell 2>")
    files = files_of(print, ns["make"], 3)
    ns["make"].__code__ = dynamic(ns["make"].__code__)
    restore_files((print, ns["make"], 3), files)
    assert ns["make"].__code__.co_filename == "<cell 2>"


def test_two_functions_with_one_name_and_line_but_two_files_stay_dynamic():
    first, second = cell("def f():\n    return 1\n", "<cell 1>"), cell("def f():\n    return 2\n", "<cell 2>")
    root = cell("def root():\n    return f(), g()\n", "<cell 3>")["root"]
    root.__globals__.update(f=first["f"], g=second["f"])
    files = files_of(root)
    assert ("f", 1) not in files and files[("root", 1)] == "<cell 3>"
    assert files_of(first["f"]) == {("f", 1): "<cell 1>"}  # alone, it is not ambiguous
    first["f"].__code__ = dynamic(first["f"].__code__)
    restore_files((root,), files)
    assert first["f"].__code__.co_filename == DYNAMIC  # ambiguous: not guessed


def test_code_that_kept_its_file_is_left_alone():
    ns = cell(CELL, "<cell>")
    before = ns["f"].__code__
    restore_files((ns["f"],), {("f", before.co_firstlineno): "/elsewhere.py"})
    assert ns["f"].__code__ is before
