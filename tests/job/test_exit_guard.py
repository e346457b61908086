"""The exit guard: every rank's Python destroys a process group its program left open, before shutdown.

Without it about 1 rank in 20 of a script that never destroys its group (Lightning's DDP strategy) aborted
at exit with "terminate called without an active exception", and Slurm marked the finished job FAILED.
"""

import json
import os
import subprocess
import sys

from hpc_ddp.job.runner import EXIT_GUARD_DIR, with_exit_guard
from hpc_ddp.spec.jobspec import Layer, Target, build_spec

# A program that opens a one-rank gloo group and records each destroy_process_group call, the guard's too.
LEAVES_GROUP_OPEN = """
import atexit, sys
import torch.distributed as dist

real = dist.destroy_process_group
def recorded(*args, **kwargs):
    print("destroyed", flush=True)
    real(*args, **kwargs)
dist.destroy_process_group = recorded
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
if len(sys.argv) > 2:
    dist.destroy_process_group()
# The program's own handler runs first and may still use the group (a logger's last sync).
atexit.register(lambda: print("own handler, group open:", dist.is_initialized(), flush=True))
"""


def run_python(code, tmp_path, pythonpath, *args, **env):
    script = tmp_path / "prog.py"
    script.write_text(code)
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HPC_DDP_EXIT_GUARD")}
    return subprocess.run([sys.executable, str(script), *args], env={**environ, "PYTHONPATH": pythonpath, **env},
                          capture_output=True, text=True, timeout=120)


def test_the_guard_goes_first_and_keeps_the_rest_of_pythonpath():
    assert with_exit_guard(None, "/g") == "/g"
    assert with_exit_guard("", "/g") == "/g"
    assert with_exit_guard("/a:/b", "/g") == "/g:/a:/b"
    assert with_exit_guard("/g:/a", "/g") == "/g:/a"  # a nested launch does not add it twice
    assert with_exit_guard("/a::/b", "/g") == "/g:/a::/b"  # an empty entry means the working directory: kept


def test_a_group_left_open_is_destroyed_after_the_programs_own_exit_handlers(tmp_path):
    done = run_python(LEAVES_GROUP_OPEN, tmp_path, EXIT_GUARD_DIR, str(tmp_path / "store"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["own handler, group open: True", "destroyed"]


def test_a_group_the_program_destroyed_is_left_alone(tmp_path):
    done = run_python(LEAVES_GROUP_OPEN, tmp_path, EXIT_GUARD_DIR, str(tmp_path / "store"), "destroy")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["destroyed", "own handler, group open: False"]


def test_hpc_ddp_exit_guard_0_turns_it_off(tmp_path):
    done = run_python(LEAVES_GROUP_OPEN, tmp_path, EXIT_GUARD_DIR, str(tmp_path / "store"), HPC_DDP_EXIT_GUARD="0")
    assert done.returncode == 0, done.stderr
    assert "destroyed" not in done.stdout


def test_the_sitecustomize_it_shadows_still_runs(tmp_path):
    """A site's (or Debian's, or a conda env's) sitecustomize behind the guard runs as it always did, and is
    the module `import sitecustomize` finds."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['SITE_RAN'] = 'yes'\n")
    done = run_python("import os, sitecustomize\nprint(os.environ.get('SITE_RAN'), sitecustomize.__file__)\n",
                      tmp_path, with_exit_guard(str(site)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["yes", str(site / "sitecustomize.py")]


def test_the_runner_puts_the_guard_on_the_programs_pythonpath(tmp_path):
    """The real runner process, as a Slurm task, with a PYTHONPATH of the user's and one from the env table."""
    script = tmp_path / "show.py"
    script.write_text("import json, os, sys\nprint(json.dumps(os.environ['PYTHONPATH']))\n")
    spec = build_spec([Layer("flags", {"env": ["PYTHONPATH=/site/lib:$PYTHONPATH"]})],
                      target=Target("script", str(script)), workdir=str(tmp_path), python=sys.executable)
    (tmp_path / "spec.json").write_text(json.dumps(spec.to_dict()))
    step = {"SLURM_JOB_ID": "12", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
            "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_NODELIST": "n1",
            "SLURM_STEP_TASKS_PER_NODE": "1"}
    done = subprocess.run([sys.executable, "-m", "hpc_ddp.job.runner", str(tmp_path / "spec.json")],
                          env={**step, "PATH": "/usr/bin", "PYTHONPATH": "/mine"}, capture_output=True, text=True,
                          timeout=60)
    assert json.loads(done.stdout) == os.pathsep.join([EXIT_GUARD_DIR, "/site/lib", "/mine"]), done.stderr



KEEPS_A_DDP_MODULE = """
import importlib.util, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
model = DDP(torch.nn.Linear(2, 1))
model(torch.ones(1, 2)).sum().backward()
dist.destroy_process_group()  # as seed 001 does, with the module still alive
spec = importlib.util.spec_from_file_location("guard", sys.argv[2])
guard = importlib.util.module_from_spec(spec)
spec.loader.exec_module(guard)  # HPC_DDP_EXIT_GUARD=0: defines its functions, registers nothing
print("before:", hasattr(model, "reducer"), hasattr(model, "process_group"))
guard._leave_cleanly()
print("after:", hasattr(model, "reducer"), hasattr(model, "process_group"))
"""


def test_a_ddp_module_alive_at_exit_lets_its_process_group_go(tmp_path):
    """Seed 001 destroys its group but keeps its DDP module: the module's reducer and group held gloo's
    threads to the C++ static destructors, and about 1 rank in 5 aborted there (SIGABRT, the job FAILED).
    The guard's exit handler drops those two references."""
    done = run_python(KEEPS_A_DDP_MODULE, tmp_path, "", str(tmp_path / "store"),
                      os.path.join(EXIT_GUARD_DIR, "sitecustomize.py"), HPC_DDP_EXIT_GUARD="0")
    assert done.returncode == 0, done.stderr
    assert "before: True True" in done.stdout and "after: False False" in done.stdout


# Finishes its work with a handler for the warning installed; then, while Python finalizes (a module
# global's __del__, after the exit handlers), the warning comes.
WARNED_WHILE_LEAVING = """
import os, signal
signal.signal(signal.SIGUSR2, lambda *_: print("handled", flush=True))
class Late:
    def __del__(self, kill=os.kill, pid=os.getpid(), sig=signal.SIGUSR2):
        kill(pid, sig)
late = Late()
print("work done", flush=True)
"""


def test_a_warning_while_python_finalizes_does_not_kill_a_rank_that_finished(tmp_path):
    """Python gives SIG_DFL back to a handled signal when it finalizes; the guard leaves it ignored instead,
    so a rank whose work is done is not killed by the warning (exit -12: the attempt 'failed')."""
    guarded = run_python(WARNED_WHILE_LEAVING, tmp_path, with_exit_guard(None), HPC_DDP_WARNING_SIGNAL="USR2")
    assert (guarded.returncode, guarded.stdout) == (0, "work done\n"), guarded.stderr
    bare = run_python(WARNED_WHILE_LEAVING, tmp_path, with_exit_guard(None), HPC_DDP_WARNING_SIGNAL="USR2",
                      HPC_DDP_EXIT_GUARD="0")
    assert bare.returncode == -12  # what it guards against
