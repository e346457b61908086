"""The CUDA device-mapping oracle (issue 28): every common way a script picks its GPU, under both ways Slurm
exposes GPUs, at 1, 2, 4 and 8 GPUs per node, with index, offset ("2,3" on a shared node) and UUID lists.

Each row goes through hpc-ddp's real code: the spec (defaults), `submit`'s check of the script's text,
the runner's rank environment and start-up check for every local rank, and the rank guard's start device.
Then a model of CUDA (gpubind.cuda_devices) maps the device indices the pattern uses to physical GPUs.
A row passes when every rank of the node gets existing GPUs that no other rank uses, or when the job is
refused with the documented line (at submit, or at start-up by the runner). Which of the two each pattern
gets is written down below, so a change of outcome is a failure, not a silent pass.
"""

from pathlib import Path

import pytest

from hpc_ddp.common.errors import EnvError
from hpc_ddp.job.devicescan import exposure_of, judge, scan
from hpc_ddp.job.distenv import from_environ
from hpc_ddp.job.gpubind import bind_gpus, cuda_devices, own_device, physical_gpu
from hpc_ddp.job.runner import _check_device_pick, rank_environment
from hpc_ddp.spec.jobspec import Layer, Target, build_spec

# pattern -> (the lines a script has, the device indices a rank uses given its environment)
PATTERNS = {
    "set_device(LOCAL_RANK)": ("import os, torch\nlocal_rank = int(os.environ['LOCAL_RANK'])\n"
                               "torch.cuda.set_device(local_rank)\nmodel.cuda()\n",
                               lambda env, n: [int(env["LOCAL_RANK"])]),
    "cuda:LOCAL_RANK": ("device = torch.device(f'cuda:{local_rank}')\nmodel.to(device)\n",
                        lambda env, n: [int(env["LOCAL_RANK"])]),
    "device_ids=[local_rank]": ("model = DDP(model.to(local_rank), device_ids=[local_rank])\n",
                                lambda env, n: [int(env["LOCAL_RANK"])]),
    "--local_rank (seed 003)": ("parser.add_argument('--local_rank', type=int)\n"
                                "device = torch.device('cuda:{}'.format(local_rank))\n",
                                lambda env, n: [int(env["LOCAL_RANK"])]),
    # torch.device("cuda") is the current device: the rank guard's start device (hpc_ddp_rankguard)
    "plain cuda (seed 001)": ("torch.distributed.init_process_group(backend='nccl')\n"
                              "device = torch.device('cuda')\n",
                              lambda env, n: [own_device(env, n)]),
    "Lightning devices=N": ("import lightning as L\ntrainer = L.Trainer(accelerator='gpu', devices=2)\n",
                            lambda env, n: [int(env["SLURM_LOCALID"])]),
    "accelerate": ("from accelerate import Accelerator\naccelerator = Accelerator()\n",
                   lambda env, n: [int(env["LOCAL_RANK"])]),
    "hpc_ddp run.device": ("import hpc_ddp\nrun = hpc_ddp.start()\nmodel.to(run.device)\n",
                           lambda env, n: [own_device(env, n)]),
    # model parallel inside a rank: its first two GPUs (only rows with 2 GPUs per task)
    "model parallel cuda:0,cuda:1": ("dev0, dev1 = torch.device('cuda:0'), torch.device('cuda:1')\n",
                                     lambda env, n: [0, 1]),
}
ONE_GPU_PATTERNS = [p for p in PATTERNS if p != "model parallel cuda:0,cuda:1"]
LOCAL_RANK_PATTERNS = {"set_device(LOCAL_RANK)", "cuda:LOCAL_RANK", "device_ids=[local_rank]",
                       "--local_rank (seed 003)", "Lightning devices=N", "accelerate"}


def node_gpus(n: int, style: str) -> tuple[list[str], list[str]]:
    """(the node's physical GPUs as UUIDs, the entries naming the job's n of them) in one list style."""
    if style == "offset":  # a shared node: the job got the upper half of a 2n-GPU node
        physical = [f"GPU-{i:02d}aa" for i in range(2 * n)]
        return physical, [str(n + i) for i in range(n)]
    physical = [f"GPU-{i:02d}aa" for i in range(n)]
    return physical, ([str(i) for i in range(n)] if style == "index" else [uuid[:6] for uuid in physical])


def slurm_env(local_rank: int, tasks: int, visible: str) -> dict[str, str]:
    """What Slurm gives task `local_rank` of node 0 of a 2-node step."""
    return {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(local_rank),
            "SLURM_LOCALID": str(local_rank), "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": str(2 * tasks),
            "SLURM_STEP_NODELIST": "n[1-2]",
            "SLURM_STEP_TASKS_PER_NODE": f"{tasks}(x2)", "CUDA_VISIBLE_DEVICES": visible}


def outcome(pattern: str, gpus: int, per_task: int, exposure: str, style: str, tmp_path) -> str:
    """'distinct' | 'refused at submit' | 'refused at start-up', or a failure's description."""
    source, uses = PATTERNS[pattern]
    script = tmp_path / "train.py"
    script.write_text(source)
    tasks = gpus // per_task
    extra = ["--gpus-per-task=%d" % per_task] if exposure == "per task" else []
    spec = build_spec([Layer("flags", {"nodes": 2, "gpus": gpus, "tasks_per_node": tasks,
                                       "sbatch_args": tuple(extra)})],
                      target=Target("script", str(script), ()), workdir=str(tmp_path), python="py")
    assert spec.gpu_bind == "auto"
    errors = [p for p in judge(scan(source), exposure_of(spec), "train.py") if p.level == "error"]
    if errors:
        assert "HINT" not in errors[0].message and errors[0].hint
        assert "would find no cuda:" in errors[0].message or "lets each rank see only" in errors[0].message
        return "refused at submit"
    physical, listed = node_gpus(gpus, style)
    used: dict[str, int] = {}
    for local in range(tasks):
        given = listed if exposure == "node" else listed[local * per_task:(local + 1) * per_task]
        base = slurm_env(local, tasks, ",".join(given))
        dist = from_environ(base)
        env = {**base, **rank_environment(spec, dist, base, "/runs/r", nvidia_driver=True)}
        try:
            _check_device_pick(spec, dist, env)
        except EnvError as exc:
            assert "would find no cuda:" in str(exc) and exc.hint
            return "refused at start-up"
        shown = cuda_devices(env.get("CUDA_VISIBLE_DEVICES"), physical)
        for index in uses(env, len(shown)):
            gpu = physical_gpu(env.get("CUDA_VISIBLE_DEVICES"), index, physical)
            if gpu is None:
                shown = env["CUDA_VISIBLE_DEVICES"]
                return f"local rank {local}: cuda:{index} is no device (CUDA_VISIBLE_DEVICES={shown})"
            if gpu in used:
                return f"local ranks {used[gpu]} and {local} share {gpu}"
            used[gpu] = local
    return "distinct"


ROWS = [(pattern, gpus, 1, exposure, style)
        for pattern in ONE_GPU_PATTERNS for gpus in (1, 2, 4, 8)
        for exposure in ("node", "per task") for style in ("index", "offset", "uuid")]
ROWS += [("model parallel cuda:0,cuda:1", gpus, 2, exposure, style)
         for gpus in (2, 4, 8) for exposure in ("node", "per task") for style in ("index", "offset", "uuid")]
ROWS += [(pattern, gpus, 2, exposure, "index") for pattern in ("plain cuda (seed 001)", "hpc_ddp run.device")
         for gpus in (2, 4, 8) for exposure in ("node", "per task")]


def expected(pattern: str, gpus: int, per_task: int, exposure: str) -> str:
    tasks = gpus // per_task
    if pattern in LOCAL_RANK_PATTERNS and exposure == "per task" and tasks > per_task:
        return "refused at submit"  # Slurm shows each task only its own GPU: cuda:LOCAL_RANK cannot exist
    return "distinct"


@pytest.mark.parametrize("pattern,gpus,per_task,exposure,style", ROWS)
def test_each_rank_gets_its_own_existing_gpu_or_the_job_is_refused(pattern, gpus, per_task, exposure, style, tmp_path):
    assert outcome(pattern, gpus, per_task, exposure, style, tmp_path) == expected(pattern, gpus, per_task, exposure)


@pytest.mark.parametrize("pattern", sorted(LOCAL_RANK_PATTERNS))
def test_a_site_that_binds_per_task_unasked_is_caught_at_start_up(pattern, tmp_path):
    """A site's job_submit may bind GPUs per task though the job asked per node: submit cannot see it, the
    runner can (each task's CUDA_VISIBLE_DEVICES lists one GPU), and stops before the program starts."""
    source, _ = PATTERNS[pattern]
    script = tmp_path / "train.py"
    script.write_text(source)
    spec = build_spec([Layer("flags", {"nodes": 2, "gpus": 4})], target=Target("script", str(script), ()),
                      workdir=str(tmp_path), python="py")
    assert not judge(scan(source), exposure_of(spec), "train.py")
    base = slurm_env(2, 4, "2")
    dist = from_environ(base)
    env = {**base, **rank_environment(spec, dist, base, "/runs/r", nvidia_driver=True)}
    with pytest.raises(EnvError, match=r"Slurm \(this task's CUDA_VISIBLE_DEVICES=2.*would find no cuda:1"):
        _check_device_pick(spec, dist, env)


def test_the_old_default_is_what_broke_and_is_now_refused_before_the_queue(tmp_path):
    """--gpu-bind rank (the default before 0.2): set_device(LOCAL_RANK) on local rank 1 named no GPU."""
    source, uses = PATTERNS["set_device(LOCAL_RANK)"]
    binding = bind_gpus("0,1", 1, 2, 1, "rank")
    assert physical_gpu(binding.visible, uses({"LOCAL_RANK": "1"}, 1)[0], ["GPU-a", "GPU-b"]) is None
    script = tmp_path / "train.py"
    script.write_text(source)
    spec = build_spec([Layer("flags", {"nodes": 2, "gpus": 2, "gpu_bind": "rank"})],
                      target=Target("script", str(script), ()), workdir=str(tmp_path), python="py")
    [problem] = judge(scan(source), exposure_of(spec), "train.py")
    assert problem.level == "error" and "local rank 1 would find no cuda:1" in problem.message
    assert "drop --gpu-bind rank" in problem.hint


@pytest.mark.parametrize("visible,physical,shown", [
    (None, ["A", "B"], ["A", "B"]),
    ("1,0", ["A", "B"], ["B", "A"]),
    ("0,7,1", ["A", "B"], ["A"]),               # enumeration stops at the first entry that names no GPU
    ("-1", ["A", "B"], []),
    ("", ["A", "B"], []),
    ("0,0", ["A", "B"], ["A"]),                 # a GPU listed twice: the second ends the list
    ("GPU-1b", ["GPU-0a", "GPU-1b"], ["GPU-1b"]),  # a UUID prefix
    ("GPU-", ["GPU-0a", "GPU-1b"], []),          # ambiguous prefix
    ("MIG-9", ["GPU-0a", "MIG-9x"], ["MIG-9x"]),
])
def test_the_cuda_model(visible, physical, shown):
    assert cuda_devices(visible, physical) == shown


PAGE = Path(__file__).resolve().parents[2] / "docs" / "gpus.md"
PAGE_MARKER = "<!-- checked against the oracle by tests/job/test_gpu_oracle.py (4 GPUs per node) -->"
PAGE_ROWS = {  # the PAGE's row -> the patterns it stands for
    "`torch.cuda.set_device(LOCAL_RANK)`": ["set_device(LOCAL_RANK)"],
    "`cuda:{LOCAL_RANK}`, `device_ids=[local_rank]`, `--local_rank`":
        ["cuda:LOCAL_RANK", "device_ids=[local_rank]", "--local_rank (seed 003)"],
    "plain `torch.device(\"cuda\")` (no `set_device`)": ["plain cuda (seed 001)"],
    "Lightning (`devices=N`, SLURM_LOCALID), accelerate (LOCAL_RANK)": ["Lightning devices=N", "accelerate"],
    "`hpc_ddp.start()`'s `run.device`": ["hpc_ddp run.device"],
    "a model over `cuda:0` and `cuda:1`, 2 GPUs per rank": ["model parallel cuda:0,cuda:1"],
}
CELL = {"distinct": ("own GPU", "own GPUs"), "refused at submit": ("refused at submit",)}


def test_the_readme_table_says_what_the_oracle_finds(tmp_path):
    text = PAGE.read_text()
    assert PAGE_MARKER in text
    table = text.split(PAGE_MARKER, 1)[1].strip().split("\n\n", 1)[0].splitlines()[2:]
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split(" | ")] for line in table)}
    assert set(rows) == set(PAGE_ROWS)
    for row, patterns in PAGE_ROWS.items():
        per_task = 2 if "2 GPUs per rank" in row else 1
        for pattern in patterns:
            for exposure, cell in zip(("node", "per task"), rows[row]):
                found = outcome(pattern, 4, per_task, exposure, "index", tmp_path)
                assert cell in CELL[found], (row, pattern, exposure, found, cell)
