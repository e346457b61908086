"""What `pip install hpc-ddp` asks for: torch and torchvision as ranges (an environment's own torch build is
kept), matplotlib only in the [plot] extra, and `make install` installing what make demo and make test use."""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _requirements(items):
    return {re.split(r"[\s<>=!~;\[]", item, maxsplit=1)[0].lower(): item for item in items}


def test_torch_and_torchvision_are_lower_bounds_never_pins():
    core = _requirements(PROJECT["dependencies"])
    for name in ("torch", "torchvision"):
        spec = core[name].removeprefix(name)
        assert re.fullmatch(r">=[\d.]+", spec), f"{name}: {core[name]!r} is not a plain lower bound"


def test_the_core_has_no_plotting_library_and_the_plot_extra_has_it():
    assert "matplotlib" not in _requirements(PROJECT["dependencies"])
    assert "matplotlib" in _requirements(PROJECT["optional-dependencies"]["plot"])
    for name in ("torch", "torchvision", "submitit", "click", "jinja2"):
        assert name in _requirements(PROJECT["dependencies"]), name


def test_make_install_installs_what_make_demo_and_make_test_need():
    makefile = (REPO / "Makefile").read_text()
    assert "-e '.[plot,test]'" in makefile
    assert "import torch, torchvision, submitit, click, jinja2, matplotlib" in makefile


def test_the_wheel_ships_the_templates_and_the_exit_guard(tmp_path):
    """The sbatch templates and the runner's exitsite/sitecustomize.py are files, not modules anyone imports:
    a packages list that forgets them builds a wheel whose jobs cannot render (or lose the exit guard)."""
    import shutil
    import subprocess
    import zipfile

    # From a copy: setuptools leaves build/ where it builds, and a stale build/ in the checkout ships stale files.
    source = tmp_path / "src"
    for name in ("hpc_ddp", "templates"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(source)], capture_output=True, text=True, timeout=300,
                           cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("hpc_ddp-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("hpc_ddp/templates/sbatch.sh.j2", "hpc_ddp/templates/sweep.sh.j2",
                 "hpc_ddp/job/exitsite/sitecustomize.py"):
        assert name in names, name
    # Every package of the source tree is in the wheel (hpc_ddp.remote, the whole --ssh path, was missing).
    for init in sorted((REPO / "hpc_ddp").rglob("__init__.py")):
        name = init.relative_to(REPO).as_posix()
        assert name in names, f"{name}: add its package to pyproject.toml's packages"
