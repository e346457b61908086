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
    import zipfile

    wheel = _wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("hpc_ddp/templates/sbatch.sh.j2", "hpc_ddp/templates/sweep.sh.j2",
                 "hpc_ddp/job/exitsite/sitecustomize.py"):
        assert name in names, name
    # Every package of the source tree is in the wheel (hpc_ddp.remote, the whole --ssh path, was missing).
    for init in sorted((REPO / "hpc_ddp").rglob("__init__.py")):
        name = init.relative_to(REPO).as_posix()
        assert name in names, f"{name}: add its package to pyproject.toml's packages"


def _wheel(tmp_path: Path) -> Path:
    """The wheel `make dist` builds (the same pip command), from a copy of the sources: setuptools leaves
    build/ where it builds, and a stale build/ in the checkout would ship stale files."""
    import shutil
    import subprocess

    source = tmp_path / "src"
    for name in ("hpc_ddp", "templates"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    out = tmp_path / "dist"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(out), str(source)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    (wheel,) = out.glob("hpc_ddp-*.whl")
    return wheel


def _recipe(page: str, marker: str) -> list[tuple[str, list[str]]]:
    """The console block after `marker` in docs/`page`: (command, the output lines after it). The marker must
    stand once on the page: a second block with the same marker would otherwise be read in its place."""
    text = (REPO / "docs" / page).read_text()
    assert text.count(marker) == 1, f"docs/{page}: {marker!r} stands {text.count(marker)} times, not once"
    block = text[text.index(marker):].split("```console\n", 1)[1].split("```", 1)[0]
    steps: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps:
            steps[-1][1].append(line)
    return steps


def test_the_laptop_recipe_runs_as_written_from_the_wheel_without_torch(tmp_path):
    """docs/install.md's laptop install, command by command as the page prints them (the wheel `make dist`
    builds, in the folder the commands run in; a home with no ~/.local/bin yet), in a fresh venv whose Python
    cannot import torch even if it tried. Needs PyPI for click and jinja2, as the laptop does."""
    import subprocess

    wheel = _wheel(tmp_path)
    here = wheel.parent
    assert wheel.name == "hpc_ddp-0.1.0-py3-none-any.whl"  # the name the page uses
    home = tmp_path / "home"
    home.mkdir()
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\nclass _No:\n    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'torchvision', 'numpy', 'submitit'):\n"
        "            raise ModuleNotFoundError(name)\nsys.meta_path.insert(0, _No())\n")
    base = Path(sys.base_prefix) / "bin"
    env = {"HOME": str(home), "PATH": f"{home}/.local/bin:{base}:/usr/bin:/bin", "PYTHONPATH": str(site),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "LANG": "C.UTF-8"}
    steps = _recipe("install.md", "<!-- run as written by tests/test_install.py, in a fresh venv with torch made unimportable")
    assert [c.split()[0] for c, _ in steps] == ["python3", "~/.local/share/hpc-ddp/bin/pip",
                                                "~/.local/share/hpc-ddp/bin/pip", "mkdir", "hpc-ddp"]
    for command, expected in steps:
        done = subprocess.run(["bash", "-c", command.split("   #", 1)[0]], cwd=here, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, (command, done.stdout, done.stderr)
        said = [line for line in done.stderr.splitlines() if "torch" in line]
        if "install click" in command:  # what the page says pip prints there, and nothing else of torch
            assert said == ["hpc-ddp 0.1.0 requires torch>=2.10, which is not installed.",
                            "hpc-ddp 0.1.0 requires torchvision>=0.25, which is not installed."], done.stderr
            assert "dependency resolver does not currently take into account" in done.stderr
        else:
            assert not said, (command, done.stderr)
        if expected:
            assert done.stdout.splitlines() == expected, (command, done.stdout)
    probe = subprocess.run([str(home / ".local/share/hpc-ddp/bin/python"), "-c", "import torch"], env=env,
                           capture_output=True, text=True)
    assert probe.returncode != 0   # torch is not there: what the laptop runs never needed it


def _fresh_venv_with_torch(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A fresh venv that has torch: this venv's packages (hpc-ddp's own and its .pth files left out) as a
    folder of links the new venv reads through one .pth, so torch and the rest count as installed there
    without 5.5 GB of downloads. pip never uninstalls what lies outside the venv it installs into, so
    nothing of this venv can change."""
    import site
    import subprocess

    linked = tmp_path / "linked"
    linked.mkdir()
    for entry in Path(site.getsitepackages()[0]).iterdir():
        if entry.suffix == ".pth" or entry.name.lower().startswith(("hpc_ddp", "hpc-ddp", "__editable__")):
            continue
        (linked / entry.name).symlink_to(entry)
    venv = tmp_path / "venv"
    subprocess.run([str(Path(sys.base_prefix) / "bin" / "python3"), "-m", "venv", str(venv)], check=True, timeout=120)
    (next(venv.glob("lib/python3*/site-packages")) / "site-linked.pth").write_text(f"{linked}\n")
    env = {"HOME": str(tmp_path / "home"), "PATH": f"{venv}/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    return venv, env


def _run_steps(steps, cwd: Path, env: dict[str, str]) -> None:
    import subprocess

    for command, expected in steps:
        done = subprocess.run(["bash", "-c", command.split("   #", 1)[0]], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
        changed = [line for line in done.stdout.splitlines() if line.startswith(("Successfully installed",
                                                                                  "Uninstalling", "Collecting torch"))]
        assert not [line for line in changed if "torch" in line], (command, changed)  # the environment's torch kept


def test_the_cluster_install_commands_run_as_written_and_keep_the_environments_torch(tmp_path):
    """Issue 54: the README's install line and docs/install.md's clone block, command by command, in a fresh
    venv that has torch (the training environment). `make dist` is the pip command `_wheel` runs (make's own
    target first makes the clone's .venv). Needs PyPI for the build backend, as the cluster does. It found
    that naming torch by `torch.__version__` fails with PyPI's torch (`2.14.1+cu130` there, `2.14.1` to
    pip): the commands name pip's own version now."""
    import shutil
    import subprocess

    wheel = _wheel(tmp_path)
    clone = tmp_path / "hpc-ddp"
    shutil.copytree(tmp_path / "src", clone)
    (clone / "dist").mkdir()
    shutil.copy(wheel, clone / "dist")
    venv, env = _fresh_venv_with_torch(tmp_path)
    readme = (REPO / "README.md").read_text()
    block = readme[readme.index("<!-- run as written by tests/test_install.py"):].split("```console\n", 1)[1]
    steps = [(line[2:], []) for line in block.split("```", 1)[0].splitlines() if line.startswith("$ ")]
    assert [c.split()[:2] for c, _ in steps] == [["pip", "install"]]
    _run_steps(steps, tmp_path, env)
    steps = [(c, e) for c, e in _recipe("install.md", "<!-- run as written by tests/test_install.py, in a fresh venv "
                                                      "that has torch") if not c.startswith("make dist")]
    assert [c.split("#")[0].split() for c, _ in steps] == [["pip", "install", "."], ["pip", "install", "'.[plot]'"],
                                                           ["pip", "install", "dist/hpc_ddp-0.1.0-py3-none-any.whl"]]
    _run_steps(steps[:2], clone, env)
    keeping = _recipe("install.md", "**Keeping the cluster's torch.**")   # the same line as the README's, in the clone
    assert [c.split()[:3] for c, _ in keeping] == [["pip", "install", "."]]
    _run_steps(keeping, clone, env)
    (tmp_path / "wheel").mkdir()
    other, other_env = _fresh_venv_with_torch(tmp_path / "wheel")   # the wheel, into an environment of its own
    _run_steps(steps[2:], clone, other_env)
    for where, where_env in ((venv, env), (other, other_env)):
        version = subprocess.run([str(where / "bin" / "hpc-ddp"), "--version"], env=where_env, capture_output=True,
                                 text=True)
        assert version.stdout.strip() == "hpc-ddp, version 0.1.0", version.stderr
