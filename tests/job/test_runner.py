import json
import subprocess
import sys

import pytest

from hpc_ddp.common.errors import EnvError
from hpc_ddp.job.distenv import from_environ
from hpc_ddp.job.gpubind import bind_gpus
from hpc_ddp.job.runner import gpu_visible, program_argv, rank_environment
from hpc_ddp.spec.jobspec import Layer, Target, build_spec

STEP = {"SLURM_JOB_ID": "12", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NODELIST": "n[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "CUDA_VISIBLE_DEVICES": "4,5"}


def spec_of(values=None, target=None):
    return build_spec([Layer("flags", values or {})],
                      target=target or Target("script", "/p/train.py", ("--x", "1")), workdir="/p", python="py")


@pytest.mark.parametrize("visible,local,world,per,bind,expected", [
    ("0,1,2,3", 2, 4, 1, "rank", "2"),          # Slurm exposed the whole node
    ("4,5", 1, 2, 1, "rank", "5"),
    ("3", 1, 4, 1, "rank", "3"),                 # Slurm bound one GPU to this task already
    ("0,1,2,3", 1, 2, 2, "rank", "2,3"),         # two GPUs per task
    ("0,1,2,3", 2, 4, 1, "node", "0,1,2,3"),     # torchrun semantics
    (None, 0, 2, 1, "rank", None),
    ("NoDevFiles", 0, 2, 1, "rank", "NoDevFiles"),
    ("GPU-aaa,GPU-bbb", 1, 2, 1, "rank", "GPU-bbb"),  # UUIDs work too
    ("0,1,2,3", 2, 4, 1, "auto", "0,1,2,3"),     # auto, one GPU per rank: as node
    ("0,1,2,3", 1, 2, 2, "auto", "2,3"),         # auto, two GPUs per rank: as rank
    ("3", 1, 4, 1, "auto", "3"),                 # Slurm bound it: as it is
])
def test_bind_gpus_visible(visible, local, world, per, bind, expected):
    assert bind_gpus(visible, local, world, per, bind).visible == expected


def test_too_few_gpus_is_an_error_naming_the_fix():
    with pytest.raises(EnvError, match="too few.*HINT"):
        bind_gpus("0,1", 2, 4, 1, "rank")


def test_backend_needs_a_real_driver():
    assert gpu_visible("0", nvidia_driver=True) and not gpu_visible("0", nvidia_driver=False)
    assert not gpu_visible("", nvidia_driver=True)


def test_rank_environment_is_torchrun_compatible():
    spec = spec_of({"nodes": 2, "gpus": 2, "epochs": 3, "lr": 0.5, "batch_size": 64})
    dist = from_environ(STEP)
    env = rank_environment(spec, dist, STEP, "/runs/r", nvidia_driver=False)
    assert env["RANK"] == "3" and env["LOCAL_RANK"] == "1" and env["WORLD_SIZE"] == "4"
    assert env["LOCAL_WORLD_SIZE"] == "2" and env["NODE_RANK"] == env["GROUP_RANK"] == "1"
    assert env["MASTER_ADDR"] == "n1" and env["MASTER_PORT"] == str(dist.master_port)
    # auto: the node's GPUs stay visible (cuda:LOCAL_RANK exists), and the rank starts on its own one
    assert (env["CUDA_VISIBLE_DEVICES"], env["HPC_DDP_CUDA_DEVICE"], env["HPC_DDP_GPU_BINDING"]) == ("4,5", "1", "node")
    ranked_spec = spec_of({"nodes": 2, "gpus": 2, "gpu_bind": "rank"})
    ranked = rank_environment(ranked_spec, dist, STEP, "/r", nvidia_driver=False)
    assert (ranked["CUDA_VISIBLE_DEVICES"], ranked["HPC_DDP_CUDA_DEVICE"]) == ("5", "0")
    assert env["BACKEND"] == "gloo"  # fake GPUs: no NVIDIA driver
    assert (env["WORKSPACE"], env["WORKER_PER_NODE"]) == ("/runs/r", "2")
    assert (env["EPOCHS"], env["LR"], env["BATCH_SIZE"]) == ("3", "0.5", "64")
    assert rank_environment(spec, dist, STEP, "/r", nvidia_driver=True)["BACKEND"] == "nccl"


def test_backend_override():
    spec = spec_of({"nodes": 2, "gpus": 2})
    env = rank_environment(spec, from_environ(STEP), {**STEP, "HPC_DDP_BACKEND": "mpi"}, "/r", nvidia_driver=True)
    assert env["BACKEND"] == "mpi"


def test_program_argv():
    dist = from_environ(STEP)
    assert program_argv(spec_of(), dist, "py") == ["py", "/p/train.py", "--x", "1"]
    assert program_argv(spec_of(target=Target("module", "pkg.train", ("-v",))), dist, "py") == \
        ["py", "-m", "pkg.train", "-v"]
    assert program_argv(spec_of({"pass_local_rank": True}), dist, "py")[-1] == "--local_rank=1"


def test_runner_execs_the_program_with_the_environment(tmp_path):
    """The real runner process: loads spec.json, sets the variables, and execs (same pid)."""
    script = tmp_path / "show.py"
    script.write_text("import json, os, sys\nprint(json.dumps({'pid': os.getpid(), 'argv': sys.argv[1:], "
                      "'rank': os.environ['RANK'], 'cvd': os.environ.get('CUDA_VISIBLE_DEVICES'), "
                      "'own': os.environ.get('HPC_DDP_CUDA_DEVICE')}))\n")
    spec = build_spec([Layer("flags", {"nodes": 2, "gpus": 2})], target=Target("script", str(script), ("a b",)),
                      workdir=str(tmp_path), python=sys.executable)
    (tmp_path / "spec.json").write_text(json.dumps(spec.to_dict()))
    code = ("import os, subprocess, sys, json\n"
            "p = subprocess.run([sys.executable, '-m', 'hpc_ddp.job.runner', sys.argv[1]], capture_output=True, text=True)\n"
            "print(p.stdout or p.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "spec.json")], env={**STEP, "PATH": "/usr/bin"},
                          capture_output=True, text=True, timeout=60)
    seen = json.loads(done.stdout)
    assert seen["argv"] == ["a b"] and seen["rank"] == "3" and (seen["cvd"], seen["own"]) == ("4,5", "1")


def test_runner_in_batch_shell_says_use_srun(tmp_path):
    spec = spec_of({"nodes": 2})
    (tmp_path / "spec.json").write_text(json.dumps(spec.to_dict()))
    done = subprocess.run([sys.executable, "-m", "hpc_ddp.job.runner", str(tmp_path / "spec.json")],
                          env={"SLURM_JOB_ID": "5", "SLURM_NTASKS": "4", "PATH": "/usr/bin"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "srun" in done.stderr and "Traceback" not in done.stderr


def test_stale_torchrun_variables_in_a_slurm_step_are_ignored():
    from hpc_ddp.job.runner import clean_environ

    stale = {**STEP, "RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "localhost", "MASTER_PORT": "29999"}
    dist = from_environ(clean_environ(stale))
    assert (dist.source, dist.rank, dist.master_addr, dist.master_port) == ("slurm", 3, "n1", 29999)
    under_torchrun = {**stale, "TORCHELASTIC_RUN_ID": "x"}
    assert from_environ(clean_environ(under_torchrun)).source == "torchrun"


def test_a_plain_script_survives_the_warning_signal(tmp_path):
    """Scripts written for torchrun have no SIGUSR2 handler; the runner makes the warning harmless."""
    script = tmp_path / "plain.py"
    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGUSR2)\nprint('alive')\n")
    spec = build_spec([Layer("flags", {})], target=Target("script", str(script)), workdir=str(tmp_path),
                      python=sys.executable)
    (tmp_path / "spec.json").write_text(json.dumps(spec.to_dict()))
    done = subprocess.run([sys.executable, "-m", "hpc_ddp.job.runner", str(tmp_path / "spec.json")],
                          env={"PATH": "/usr/bin"}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "alive", done.stderr


def test_the_warning_is_ignored_before_the_runner_prepares_the_rank(tmp_path, monkeypatch):
    """A warning that comes while the runner still prepares (a loaded node, or a restart in place late in
    the allocation) must not kill the rank: the signal is ignored before any of that work begins."""
    import signal

    from hpc_ddp.job import runner

    spec = build_spec([Layer("flags", {})], target=Target("script", "t.py"), workdir=str(tmp_path),
                      python=sys.executable)
    (tmp_path / "spec.json").write_text(json.dumps(spec.to_dict()))
    seen = []

    def prepare(_path):
        seen.append(signal.getsignal(signal.SIGUSR2))
        raise EnvError("stop here")
    previous = signal.getsignal(signal.SIGUSR2)
    monkeypatch.setattr(runner, "prepare", prepare)
    try:
        with pytest.raises(SystemExit):
            runner.main([str(tmp_path / "spec.json")])
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert seen == [signal.SIG_IGN]
