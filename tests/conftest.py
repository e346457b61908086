"""Shared fixtures. Paths with spaces, quotes and `;` catch quoting bugs (as submitit's tests do)."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def pytest_configure(config):
    """Ctrl-C as a user's terminal gives it. make test starts its local and versions lanes as background
    commands of a script (tests/run-lanes.sh), and bash starts those with SIGINT ignored; every process they
    start inherits that, so a rank's bash could not trap it and a notebook's Ctrl-C never arrived: the tests
    of what Ctrl-C does failed there, and only in a fresh xdist worker (a test before them in one pytest had
    put a handler back). SIG_IGN is undone here, in each worker too, so what tests start gets SIGINT's
    default again."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def weird_dir(tmp_path: Path) -> Path:
    path = tmp_path / "it's a \"weird\" dir; $(echo no) `x`"
    path.mkdir()
    return path


@pytest.fixture(scope="session")
def slurm_conf() -> str:
    """The test Slurm (make slurm-up). `make test` always brings it up, so there these never skip.
    Session-scoped, so a module's fixture may submit a job that its tests share."""
    conf = os.environ.get("SLURM_CONF")
    if not conf or not Path(conf).exists() or not shutil.which("sbatch"):
        pytest.skip("the test Slurm is not up here (run `make slurm-up` or `make test`)")
    return conf


def write_script(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text)
    return path


@pytest.fixture(autouse=True, scope="session")
def _private_registry(tmp_path_factory):
    """Tests (and the hpc-ddp processes they start) record their runs in a registry of their own, never
    in the user's. Session-scoped and set in os.environ, so module-scoped fixtures see it too."""
    previous = os.environ.get("HPC_DDP_REGISTRY")
    os.environ["HPC_DDP_REGISTRY"] = str(tmp_path_factory.getbasetemp() / "registry.jsonl")
    yield
    if previous is None:
        os.environ.pop("HPC_DDP_REGISTRY", None)
    else:
        os.environ["HPC_DDP_REGISTRY"] = previous


# `make test` runs the suite in two lanes at once (tests/run-lanes.sh, unless HPC_DDP_TEST_LANES=serial): `--lane
# slurm`, the tests that use the test Slurm, one after another as they must (they share four nodes, kill
# slurmds, preempt partitions); and `--lane local`, everything else. Without --lane a run takes every test.
def pytest_addoption(parser):
    parser.addoption("--lane", choices=("all", "slurm", "local"), default="all",
                     help="run only the tests that use the test Slurm (slurm), only the others (local), or all")
    # make test passes --skip-extended unless HPC_DDP_TEST_EXTENDED=1 (tests/run-lanes.sh; CI runs them all).
    parser.addoption("--skip-extended", action="store_true",
                     help="leave out the tests marked extended (slow ones that CI runs; pyproject.toml says which)")


def uses_test_slurm(item: pytest.Item) -> bool:
    """Marked `slurm`, or asking for `slurm_conf` directly or through another fixture (fixturenames is the
    closure)."""
    return item.get_closest_marker("slurm") is not None or "slurm_conf" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config, items):
    lane = config.getoption("lane")
    extended = not config.getoption("skip_extended")
    if lane == "all" and extended:
        return
    keep = [item for item in items if (lane == "all" or uses_test_slurm(item) == (lane == "slurm"))
            and (extended or item.get_closest_marker("extended") is None)]
    if len(keep) != len(items):
        kept = set(map(id, keep))
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
        items[:] = keep


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call" and report.failed:
        item.stash[_FAILED] = True
    return report


_FAILED = pytest.StashKey[bool]()


def _queued_jobs() -> set[str]:
    import subprocess

    done = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True)
    return set(done.stdout.split()) if done.returncode == 0 else set()


@pytest.fixture(autouse=True)
def _cancel_what_a_failed_test_left(request):
    """A Slurm test that fails part-way leaves its jobs running on the four shared nodes, and the next test's
    jobs then wait behind them or are preempted with them (one CI failure became two this way). After a
    failed test, the jobs that entered the queue during it are cancelled; a module fixture's shared job,
    submitted before this snapshot, is left alone."""
    if not uses_test_slurm(request.node) or not shutil.which("squeue") or not os.environ.get("SLURM_CONF"):
        yield
        return
    before = _queued_jobs()
    yield
    if request.node.stash.get(_FAILED, False):
        import subprocess

        left = sorted(_queued_jobs() - before)
        if left:
            subprocess.run(["scancel", *left], capture_output=True)
