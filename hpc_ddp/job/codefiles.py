"""Source file names for code that travels by value, so a rank's traceback says where the code came from.

cloudpickle 3.1.3 and later name the file of every function it sends by value `<dynamic-code>` (it keeps
its pickles deterministic that way), so a notebook rank's traceback read `File "<dynamic-code>", line 11,
in f` instead of naming the cell's file. The launcher records the file of each function reachable from the
call (`files_of`); the rank puts those names back into the loaded code (`restore_files`). Code whose file
was kept (older cloudpickle, functions imported by name) is left alone.

A function is keyed by its qualified name and first line. Two functions with the same key but different
files (rare: two cells each defining `f` on line 1) are ambiguous: those keep `<dynamic-code>`.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

__all__ = ["DYNAMIC", "files_of", "restore_files"]

DYNAMIC = "<dynamic-code>"
_AMBIGUOUS = ""


def files_of(*roots: Any) -> dict[tuple[str, int], str]:
    """(qualified name, first line) -> source file, for each root that is a function (the call's function
    and its arguments), the functions nested in it, and the functions and classes (their methods) that its
    globals and closure refer to, and theirs."""
    files: dict[tuple[str, int], str] = {}
    for function in _functions(roots):
        for code in _codes(function.__code__):
            known = files.setdefault(_key(code), code.co_filename)
            if known != code.co_filename:
                files[_key(code)] = _AMBIGUOUS
    return {key: name for key, name in files.items() if name not in (_AMBIGUOUS, DYNAMIC)}


def restore_files(roots: tuple[Any, ...], files: dict[tuple[str, int], str]) -> None:
    """Give every function reachable from the roots whose file reads `<dynamic-code>` its recorded file back."""
    if not files:
        return
    for function in _functions(roots):
        if any(code.co_filename == DYNAMIC for code in _codes(function.__code__)):
            function.__code__ = _renamed(function.__code__, files)


def _renamed(code: types.CodeType, files: dict[tuple[str, int], str]) -> types.CodeType:
    consts = tuple(_renamed(c, files) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    name = files.get(_key(code), code.co_filename) if code.co_filename == DYNAMIC else code.co_filename
    return code.replace(co_filename=name, co_consts=consts)


def _key(code: types.CodeType) -> tuple[str, int]:
    return getattr(code, "co_qualname", code.co_name), code.co_firstlineno


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _functions(roots: tuple[Any, ...], limit: int = 10_000) -> Iterator[types.FunctionType]:
    """The functions sent by value from the roots: the roots that are functions or classes, and the
    functions and classes (their methods) of `__main__` or of a module no one can import that their
    globals, closures or attributes refer to, and theirs; each once, at most `limit`. An importable
    library's code travels by name and keeps its file."""
    seen: set[int] = set()
    todo: list[Any] = [getattr(root, "__func__", root) for root in roots]
    starts = {id(obj) for obj in todo}
    while todo and len(seen) < limit:
        obj = todo.pop()
        obj = getattr(obj, "__func__", obj)  # bound, static and class methods
        if id(obj) in seen or not (id(obj) in starts or _by_value(obj)):
            continue
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            yield obj
            todo.extend(_referred(obj))
        elif isinstance(obj, type):
            todo.extend(vars(obj).values())


def _by_value(obj: Any) -> bool:
    if not isinstance(obj, (types.FunctionType, type)):
        return False
    module = getattr(obj, "__module__", None)
    return module == "__main__" or module not in sys.modules


def _referred(function: types.FunctionType) -> Iterator[Any]:
    names = {name for code in _codes(function.__code__) for name in code.co_names}
    for name in names:
        if name in function.__globals__:
            yield function.__globals__[name]
    for cell in function.__closure__ or ():
        try:
            yield cell.cell_contents
        except ValueError:  # a cell not filled yet
            continue
