"""The rank guard (job/exitsite/hpc_ddp_rankguard.py): each rank starts on its own GPU, and ranks that share
one stop at init_process_group with one line. Two real processes under the test's model of CUDA
(tests/fakecuda), with the environment hpc-ddp's runner gives two ranks of one node."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.job.exitsite.hpc_ddp_rankguard import shared_gpu_line
from hpc_ddp.job.runner import EXIT_GUARD_DIR

FAKE_CUDA = Path(__file__).resolve().parents[1] / "fakecuda"
SEED_001 = Path(__file__).resolve().parents[3] / "shared" / "seeds" / "linear_regression.py"


def test_shared_gpu_line_names_both_ranks_and_the_fix():
    assert shared_gpu_line([(0, 0, "0"), (1, 1, "1")], "n1") is None
    line = shared_gpu_line([(1, 0, "0"), (0, 0, "0")], "n1", "0,1")
    assert line.startswith("hpc-ddp: ranks 0 and 1 on node n1 both use GPU 0 (cuda:0 of CUDA_VISIBLE_DEVICES=0,1)")
    assert "HINT:" in line and "--gpu-bind rank" in line and "\n" not in line
    assert "cuda:0 and cuda:1" in shared_gpu_line([(4, 0, "GPU-a"), (5, 1, "GPU-a")], "n2")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(script: Path, tmp_path: Path, **extra: str | None) -> tuple[list, list[dict]]:
    """Two ranks of one node run `script`; their CompletedProcess and the GPUs the model of CUDA saw used."""
    log = tmp_path / "cuda-log"
    log.mkdir()
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "CUDA_VISIBLE_DEVICES": "0,1",
               "HPC_DDP_CUDA_DEVICE": str(rank), "HPC_DDP_GPU_BINDING": "node", "HPC_DDP_RENDEZVOUS_TIMEOUT": "60",
               "FAKE_CUDA_GPUS": "2", "FAKE_CUDA_LOG": str(log),
               "PYTHONPATH": os.pathsep.join([EXIT_GUARD_DIR, str(FAKE_CUDA)]), **extra}
        env = {k: v for k, v in env.items() if v is not None}
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, cwd=tmp_path, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    done = [subprocess.CompletedProcess(p.args, p.wait(timeout=120), *p.communicate()) for p in procs]
    used = [json.loads(line) for f in sorted(log.glob("*.jsonl")) for line in f.read_text().splitlines()]
    return done, used


def _gpus_by_rank(used: list[dict]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for record in used:
        out.setdefault(record["rank"], set()).add(record["gpu"].rsplit("-", 1)[-1])
    return out


@pytest.mark.skipif(not SEED_001.exists(), reason="needs ../shared/seeds")
def test_seed_001_unmodified_puts_each_rank_on_its_own_gpu(tmp_path):
    """torch.device('cuda') without set_device: under torchrun every rank of a node lands on GPU 0."""
    done, used = _two_ranks(SEED_001, tmp_path)
    assert [d.returncode for d in done] == [0, 0], [d.stderr[-2000:] for d in done]
    assert _gpus_by_rank(used) == {"0": {"0"}, "1": {"1"}}


@pytest.mark.skipif(not SEED_001.exists(), reason="needs ../shared/seeds")
def test_without_a_start_device_the_model_shows_torchruns_clash(tmp_path):
    """The same run without the runner's start device, as torchrun runs it: the model of CUDA reproduces
    what torchrun users see (the guard lets it be: without hpc-ddp's binding there is nothing to check)."""
    done, used = _two_ranks(SEED_001, tmp_path, HPC_DDP_CUDA_DEVICE=None)
    assert [d.returncode for d in done] == [0, 0]
    assert _gpus_by_rank(used) == {"0": {"0"}, "1": {"0"}}


def test_ranks_that_pick_one_gpu_stop_at_init_with_one_line(tmp_path):
    script = tmp_path / "fixed.py"
    script.write_text("import torch, torch.distributed as dist\n"
                      "torch.cuda.set_device(0)\n"
                      "dist.init_process_group('nccl')\n"
                      "print('trained')\n")
    done, _ = _two_ranks(script, tmp_path)
    assert [d.returncode for d in done] == [2, 2]
    for d in done:
        assert "trained" not in d.stdout
        [line] = [x for x in d.stderr.splitlines() if x.startswith("hpc-ddp:")]
        node = socket.gethostname()
        assert f"ranks 0 and 1 on node {node} both use GPU 0 (cuda:0 of CUDA_VISIBLE_DEVICES=0,1)" in line


def test_a_script_that_narrows_cuda_visible_devices_itself_keeps_its_choice(tmp_path):
    """os.environ['CUDA_VISIBLE_DEVICES'] = LOCAL_RANK before torch starts CUDA: cuda:0 is then its own GPU,
    and the guard's start device (meant for the runner's list) is not applied to the new one."""
    script = tmp_path / "narrow.py"
    script.write_text("import os\nos.environ['CUDA_VISIBLE_DEVICES'] = os.environ['LOCAL_RANK']\n"
                      "import torch, torch.distributed as dist\n"
                      "dist.init_process_group('nccl')\n"
                      "torch.zeros(1).to('cuda')\n")
    done, used = _two_ranks(script, tmp_path)
    assert [d.returncode for d in done] == [0, 0], [d.stderr[-2000:] for d in done]
    assert _gpus_by_rank(used) == {"0": {"0"}, "1": {"1"}}


def test_cpu_jobs_are_left_alone(tmp_path):
    """gloo and no CUDA in use: no device is chosen and nothing is checked (CUDA is not started)."""
    script = tmp_path / "cpu.py"
    script.write_text("import torch, torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "assert not torch.cuda.is_initialized()\n"
                      "t = torch.ones(1); dist.all_reduce(t); assert t.item() == 2\n")
    done, used = _two_ranks(script, tmp_path)
    assert [d.returncode for d in done] == [0, 0], [d.stderr[-2000:] for d in done]
    assert used == []
