"""Which Python the ranks run when the user names none, and the line that says why (pure)."""

from __future__ import annotations

import dataclasses

import pytest

from hpc_ddp.spec.interpreter import NAMED, Interpreter, choose, explain

PIPX = "/home/ada/.local/pipx/venvs/hpc-ddp/bin/python"


@pytest.mark.parametrize("environ,expected", [
    ({"VIRTUAL_ENV": "/home/ada/proj/.venv"}, Interpreter("/home/ada/proj/.venv/bin/python",
                                                          "the active venv, $VIRTUAL_ENV")),
    ({"CONDA_PREFIX": "/opt/conda/envs/ddp"}, Interpreter("/opt/conda/envs/ddp/bin/python",
                                                          "the active conda env, $CONDA_PREFIX")),
    # A venv made inside a conda env is the more specific choice.
    ({"VIRTUAL_ENV": "/v", "CONDA_PREFIX": "/c"}, Interpreter("/v/bin/python", "the active venv, $VIRTUAL_ENV")),
    ({}, Interpreter(PIPX, "the Python running hpc-ddp: no venv or conda env is active")),
    ({"VIRTUAL_ENV": "", "CONDA_PREFIX": "  "}, Interpreter(PIPX, "the Python running hpc-ddp: no venv or conda env "
                                                                  "is active")),
    ({"VIRTUAL_ENV": "/a\0b"}, Interpreter(PIPX, "the Python running hpc-ddp: no venv or conda env is active")),
])
def test_the_active_environment_beats_the_python_running_hpc_ddp(environ, expected):
    assert choose(environ, PIPX) == expected


def test_a_venv_python_is_never_resolved_to_the_interpreter_it_links_to():
    # bin/python of a venv is a symlink to the base Python; resolving it would lose the venv's packages.
    assert choose({"VIRTUAL_ENV": "/home/ada/proj/.venv"}, PIPX).path == "/home/ada/proj/.venv/bin/python"


def test_without_any_known_python_the_nodes_path_decides():
    assert choose({}, "").path == "python3" and choose({}, None).path == "python3"


@dataclasses.dataclass(frozen=True)
class _Spec:
    python: str
    profile: str | None = None


def test_explain_says_which_and_why():
    env = {"VIRTUAL_ENV": "/v"}
    assert explain(_Spec("/v/bin/python"), env, PIPX) == "python /v/bin/python (the active venv, $VIRTUAL_ENV)"
    assert explain(_Spec("/opt/py/bin/python3"), env, PIPX) == f"python /opt/py/bin/python3 ({NAMED})"
    assert explain(_Spec(PIPX), {}, PIPX) == \
        f"python {PIPX} (the Python running hpc-ddp: no venv or conda env is active)"


def test_explain_names_the_container_when_the_spec_has_one():
    @dataclasses.dataclass(frozen=True)
    class InContainer(_Spec):
        container: str = "img.sif"

    assert explain(InContainer("python3"), {}, PIPX) == "python python3 (run inside the container, at that path there)"
