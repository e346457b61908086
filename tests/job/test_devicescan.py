"""devicescan: how a script picks its GPU, read from its text, and the judgement against each binding."""

from pathlib import Path

import pytest

from hpc_ddp.job.devicescan import Exposure, exposure_of, judge, scan, slurm_binds_per_task, source_of
from hpc_ddp.spec.jobspec import Layer, Target, build_spec

SEEDS = Path(__file__).resolve().parents[3] / "shared" / "seeds"


@pytest.mark.parametrize("line,kind", [
    ("torch.cuda.set_device(int(os.environ['LOCAL_RANK']))", "local_rank"),
    ("torch.cuda.set_device(args.local_rank)", "local_rank"),
    ("device = torch.device(f'cuda:{local_rank}')", "local_rank"),
    ("device = f\"cuda:{args.local_rank}\"", "local_rank"),
    ("device = torch.device('cuda:{}'.format(local_rank))", "local_rank"),
    ("device = torch.device('cuda', local_rank)", "local_rank"),
    ("model = DDP(model, device_ids=[local_rank], output_device=local_rank)", "local_rank"),
    ("x = x.to(LOCAL_RANK)", "local_rank"),
    ("torch.cuda.set_device(int(os.environ['SLURM_LOCALID']))", "local_rank"),
    ("parser.add_argument('--local_rank', type=int, default=0)", "local_rank"),
    ("parser.add_argument(\"--local-rank\", type=int)", "local_rank"),
    ("import lightning as L", "framework"),
    ("from pytorch_lightning import Trainer", "framework"),
    ("from accelerate import Accelerator", "framework"),
    ("from transformers import AutoModel, Trainer, TrainingArguments", "framework"),
    ("run = hpc_ddp.start()", "hpc_ddp"),
    ("device = torch.device('cuda:0')", "fixed"),
    ("torch.cuda.set_device(0)", "fixed"),
    ("model.cuda(1)", "fixed"),
    ("DDP(model, device_ids=[0])", "fixed"),
    ("state = torch.load(path, map_location='cuda:0')", "fixed"),
    ("device = torch.device('cuda', 0)", "fixed"),
    ("model = DDP(model.to(rank), device_ids=[rank])", "rank"),
    ("device = f'cuda:{rank}'", "rank"),
    ("device = torch.device('cuda')", "plain"),
    ("model.cuda()", "plain"),
    ("x = x.to('cuda')", "plain"),
])
def test_scan_finds_the_common_ways(line, kind):
    [pick] = scan(f"import torch\n{line}\n")
    assert (pick.kind, pick.line) == (kind, 2)


@pytest.mark.parametrize("source", [
    "# torch.cuda.set_device(local_rank)  (a comment)\n",
    "device = torch.device('cpu:{}'.format(local_rank))\n",   # seed 003's gloo branch: no GPU picked
    "print('use cuda:0 for tests')  # cuda:0\n",              # text in a string that is no device: not a pick
    "local_rank = int(os.environ['LOCAL_RANK'])\n",
])
def test_scan_ignores_what_picks_no_gpu(source):
    assert scan(source) == ()


def test_spawn_scripts_index_by_their_spawn_rank():
    """mp.spawn(fn) passes each process its index on the node: `.to(rank)` there is a local rank."""
    assert [p.kind for p in scan("def fn(rank):\n    model.to(rank)\nmp.spawn(fn, nprocs=2)\n")] == ["local_rank"]


@pytest.mark.skipif(not SEEDS.is_dir(), reason="needs ../shared/seeds")
def test_the_seeds_are_read_as_they_pick():
    kinds = {name: {p.kind for p in scan((SEEDS / name).read_text())} for name in
             ("linear_regression.py", "managed_platform_mnist.py", "spawn_mnist.py", "dataparallel.py")}
    assert kinds == {"linear_regression.py": {"plain"}, "managed_platform_mnist.py": {"local_rank"},
                     "spawn_mnist.py": {"local_rank"}, "dataparallel.py": {"fixed"}}


def spec_of(tmp_path, values, source="torch.cuda.set_device(local_rank)\n", kind="script"):
    (tmp_path / "train.py").write_text(source)
    return build_spec([Layer("flags", values)], target=Target(kind, "train.py" if kind == "script" else "train", ()),
                      workdir=str(tmp_path), python="py")


def test_exposure_of_the_spec(tmp_path):
    assert exposure_of(spec_of(tmp_path, {"nodes": 2})) is None  # CPU job
    e = exposure_of(spec_of(tmp_path, {"nodes": 2, "gpus": 4}))
    assert (e.how, e.visible, e.per_rank, e.local_world_size, e.nodes) == ("node", 4, 1, 4, 2)
    e = exposure_of(spec_of(tmp_path, {"gpus": 4, "tasks_per_node": 2}))
    assert (e.how, e.visible, e.per_rank) == ("rank", 2, 2)  # auto with 2 GPUs per rank
    e = exposure_of(spec_of(tmp_path, {"gpus": 4, "srun_args": ("--gpu-bind=single:1",)}))
    assert (e.how, e.visible, e.bound_by) == ("slurm", 1, "Slurm (--gpu-bind=single:1)")
    assert slurm_binds_per_task(["--exclusive", "--gpu-bind=none"]) is None


def test_judge_errors_only_where_the_pick_cannot_work():
    picks = scan("torch.cuda.set_device(local_rank)\n")
    node = Exposure("node", 4, 1, 4)
    assert judge(picks, node) == []
    [error] = judge(picks, Exposure("rank", 1, 1, 4, bound_by="--gpu-bind rank"))
    assert error.level == "error" and error.message == (
        "the script:1 picks its GPU by local rank (torch.cuda.set_device(local_rank)), but --gpu-bind rank lets "
        "each rank see only its own GPU, as cuda:0: local rank 1 would find no cuda:1")
    assert judge(picks, Exposure("rank", 2, 2, 2)) == []  # local ranks 0, 1 < 2 GPUs each: both exist
    assert judge(scan("model.to('cuda')\n"), Exposure("rank", 1, 1, 8)) == []
    [warning] = judge(scan("x.to('cuda:0')\n"), node)
    assert warning.level == "warning" and "--gpu-bind rank" in warning.hint
    assert judge(scan("x.to('cuda:0')\n"), Exposure("rank", 1, 1, 4)) == []
    [error] = judge(scan("x.to('cuda:1')\n"), Exposure("rank", 1, 1, 4))
    assert error.level == "error" and "cuda:1" in error.message
    [warning] = judge(scan("DDP(m, device_ids=[rank])\n"), Exposure("node", 2, 1, 2, nodes=2))
    assert warning.level == "warning" and "LOCAL_RANK" in warning.hint


def test_source_of_reads_without_importing(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("raise SystemExit('imported!')\n")
    (tmp_path / "pkg" / "train.py").write_text("x = 1\n")
    assert source_of("module", "pkg.train", str(tmp_path)) == (str(tmp_path / "pkg" / "train.py"), "x = 1\n")
    assert source_of("module", "elsewhere.mod", str(tmp_path)) is None
    assert source_of("trainer", "job.toml", str(tmp_path)) is None
    assert source_of("script", "missing.py", str(tmp_path)) is None
