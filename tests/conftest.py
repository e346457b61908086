"""Shared fixtures. Paths with spaces, quotes and `;` catch quoting bugs (as submitit's tests do)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


@pytest.fixture
def weird_dir(tmp_path: Path) -> Path:
    path = tmp_path / "it's a \"weird\" dir; $(echo no) `x`"
    path.mkdir()
    return path


@pytest.fixture
def slurm_conf() -> str:
    """The test Slurm (make slurm-up). `make test` always brings it up, so there these never skip."""
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



# `make test` runs the suite on pytest-xdist workers (`-n 3`). Every test that uses the test Slurm (marked
# `slurm`, or asking for the `slurm_conf` fixture, directly or through another fixture) runs on ONE worker,
# one after another as without xdist: they share four nodes, and some kill a slurmd, preempt partitions or
# expect idle nodes. The rest is spread over the other workers. xdist's own `--dist loadgroup` cannot be
# trusted for this: with pytest 9.2 its xdist_group mark is silently ignored (it renames item._nodeid, which
# pytest no longer reads), so the grouping is done here: each worker writes the node ids of its Slurm tests
# to a folder the controller made, and the controller's scheduler (LoadScopeScheduling, whose one "scope"
# holding all of them goes first: it is the largest) reads them.
SLURM_GROUP = "test-slurm"
_GROUPS_ENV = "HPC_DDP_TEST_XDIST_GROUPS"


def uses_test_slurm(item: pytest.Item) -> bool:
    return item.get_closest_marker("slurm") is not None or "slurm_conf" in getattr(item, "fixturenames", ())


def pytest_configure(config):
    if getattr(config, "workerinput", None) is None and getattr(config.option, "numprocesses", None):
        import tempfile

        os.environ[_GROUPS_ENV] = tempfile.mkdtemp(prefix="pytest-xdist-slurm-tests-")
        config.pluginmanager.register(_SlurmTestsOnOneWorker(), "hpc-ddp-slurm-tests-on-one-worker")


def pytest_unconfigure(config):
    if getattr(config, "workerinput", None) is None and os.environ.get(_GROUPS_ENV):
        shutil.rmtree(os.environ.pop(_GROUPS_ENV), ignore_errors=True)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return
    folder = Path(os.environ[_GROUPS_ENV])
    folder.mkdir(parents=True, exist_ok=True)   # a worker restarted after a crash may find it cleaned away
    target = folder / f"{workerinput['workerid']}.txt"
    partial = target.with_suffix(".partial")
    partial.write_text("".join(f"{item.nodeid}\n" for item in items if uses_test_slurm(item)))
    partial.replace(target)   # whole or absent: the controller reads it once the worker has collected


# The Slurm tests' worker is the one that sets the pace (its tests cannot share the nodes), and its jobs run
# at nice 0 under slurmd; the other workers, and the local runs they start, run each non-Slurm test at nice
# 10, so that on a 2-core machine they take the CPU the Slurm jobs leave rather than slowing them: a
# preempted rank still checkpoints within KillWait, as it does when the suite runs in one process.
_OTHER_TESTS_NICE = 10


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if getattr(item.config, "workerinput", None) is None:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0 if uses_test_slurm(item) else _OTHER_TESTS_NICE)
    except OSError:   # lowering it again needs root (the test Slurm needs root anyway)
        pass


class _SlurmTestsOnOneWorker:
    """Registered on xdist's controller only (pytest would refuse the hook where xdist is not loaded)."""

    @staticmethod
    def pytest_xdist_make_scheduler(config, log):
        if config.getoption("dist") == "each":
            return None
        from xdist.scheduler import LoadScopeScheduling

        class Scheduling(LoadScopeScheduling):
            _slurm_ids: frozenset[str] | None = None

            def _split_scope(self, nodeid: str) -> str:
                if self._slurm_ids is None:
                    lists = sorted(Path(os.environ[_GROUPS_ENV]).glob("*.txt"))
                    if not lists:
                        raise RuntimeError("no xdist worker said which tests use the test Slurm (tests/conftest.py)")
                    self._slurm_ids = frozenset(line for f in lists for line in f.read_text().splitlines())
                return SLURM_GROUP if nodeid in self._slurm_ids else nodeid

            def remove_node(self, node):
                """A worker that crashed: its test is reported failed ("worker 'gw1' crashed while running
                ...") and the rest of its Slurm tests go to a new worker. LoadScopeScheduling would hand the
                new worker the test that crashed again, first, until no restarts are left."""
                crashitem = super().remove_node(node)
                for work_unit in self.workqueue.values():
                    if crashitem in work_unit:
                        work_unit[crashitem] = True
                for scope in [scope for scope, unit in self.workqueue.items() if all(unit.values())]:
                    del self.workqueue[scope]
                return crashitem

        return Scheduling(config, log)
