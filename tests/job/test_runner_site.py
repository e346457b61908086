"""The runner and the site's settings: the env table on every rank, expanded there."""

import json
import subprocess
import sys

from hpc_ddp.job.distenv import from_environ
from hpc_ddp.job.runner import rank_environment, site_environment
from hpc_ddp.spec.jobspec import Layer, Target, build_spec

STEP = {"SLURM_JOB_ID": "12", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NODELIST": "n[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_TMPDIR": "/tmp/job12"}


def spec_of(values, target=None, workdir="/p"):
    return build_spec([Layer("flags", values)], target=target or Target("script", "/p/train.py"), workdir=workdir,
                      python="py")


def test_site_variables_expand_against_this_ranks_environment():
    spec = spec_of({"env": {"NCCL_SOCKET_IFNAME": "ib0", "HF_HOME": "$SLURM_TMPDIR/hf", "TAG": "r$RANK-$$"}})
    env = {**STEP, **rank_environment(spec, from_environ(STEP), STEP, "/runs/r", nvidia_driver=False)}
    assert site_environment(spec, env) == {"NCCL_SOCKET_IFNAME": "ib0", "HF_HOME": "/tmp/job12/hf", "TAG": "r3-$"}


def test_a_site_omp_num_threads_wins_over_the_default():
    spec = spec_of({"env": {"OMP_NUM_THREADS": "8"}})
    env = {**STEP, **rank_environment(spec, from_environ(STEP), STEP, "/r", nvidia_driver=False)}
    assert env["OMP_NUM_THREADS"] == "1" and site_environment(spec, env)["OMP_NUM_THREADS"] == "8"


def test_the_program_gets_the_site_environment(tmp_path):
    """The real runner process, as a Slurm task: the exec'd program sees the table's values."""
    script = tmp_path / "show.py"
    script.write_text("import json, os\nprint(json.dumps({k: os.environ.get(k) for k in "
                      "('NCCL_SOCKET_IFNAME', 'HF_HOME', 'RANK')}))\n")
    spec = build_spec([Layer("flags", {"nodes": 2, "env": ["NCCL_SOCKET_IFNAME=lo", "HF_HOME=$SLURM_TMPDIR/hf"]})],
                      target=Target("script", str(script)), workdir=str(tmp_path), python=sys.executable)
    (tmp_path / "spec.json").write_text(json.dumps(spec.to_dict()))
    done = subprocess.run([sys.executable, "-m", "hpc_ddp.job.runner", str(tmp_path / "spec.json")],
                          env={**STEP, "PATH": "/usr/bin"}, capture_output=True, text=True, timeout=60)
    assert json.loads(done.stdout) == {"NCCL_SOCKET_IFNAME": "lo", "HF_HOME": "/tmp/job12/hf", "RANK": "3"}, \
        done.stderr
