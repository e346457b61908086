"""GPU data path (issue 34): ResNet-50 on an ImageFolder of 224 px JPEGs made by `make-dataset`, one GPU.

Rows, images/s (steps after the warm-up):
  - the trainer with its GPU defaults (data_path, precision, channels_last, compile all "auto": JPEGs decoded
    by nvjpeg and augmented on the GPU, bf16, NHWC, torch.compile with its cache in the run dir);
  - the same trainer with data_path = "cpu" (PIL decoding in the loader workers);
  - the model fed from GPU memory (the plain loop on one batch kept on the GPU, bf16 + channels_last +
    compile): the ceiling the data path is held to (target: trainer >= 0.95 x this);
  - the seeds' loop: plain fp32 eager DDP with torchvision's PIL pipeline on the same JPEGs (target:
    trainer >= 2.5 x this).

One short visit to a GPU machine is enough: `make bench-gpu-data` (or
`python bench/run.py --only gpu_data --update`). Runs only where torch sees a GPU; BENCH_GPU_DEVICE=cpu
runs the harness on the CPU with tiny sizes (a smoke test, not a number).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .common import PLAIN, REPO, Row, Target, Workspace, absolute, say, skipped, trainer_rate
from .gpu_bench import gpu_name

SECTION = "gpu_data"


def _dataset(ws: Workspace, size: int, per_class: int) -> str:
    root = ws.fresh("jpegs")
    subprocess.run([sys.executable, "-m", "hpc_ddp", "make-dataset", "imagefolder", str(root), "--jpeg",
                    "--size", str(size), "--train", str(per_class), "--test", "2"], check=True, cwd=REPO,
                   capture_output=True)
    return str(root)


def _trainer(ws: Workspace, data: str, *, size: int, batch: int, steps: int, warm: int, workers: int, gpus: int,
             data_path: str, smoke: bool) -> float:
    job = ws.fresh("gpu-data-job").with_suffix(".toml")
    job.write_text(f"""nodes = 1
tasks_per_node = 1
gpus = {gpus}
[train]
dataset = "imagefolder"
data_dir = "{data}"
model = "resnet50"
image_size = {size}
epochs = 1000
max_steps = {steps}
batch_size = {batch}
lr = 0.05
num_workers = {workers}
log_every = {warm}
eval_every_epoch = false
data_path = "{data_path}"
""")
    run_dir = ws.fresh("gpu-data-run")
    ws.run(ws.submit_argv("--run-dir", str(run_dir), str(job)), "gpu-data-trainer", cpu_only=smoke, timeout=1800)
    return trainer_rate(run_dir, warm=warm, samples_per_step=batch)


def _plain(ws: Workspace, data: str, *, size: int, batch: int, steps: int, warm: int, workers: int, gpus: int,
           device: str, smoke: bool, fast: bool, synthetic: bool) -> float:
    out = ws.fresh("gpu-data-plain").with_suffix(".json")
    loop = ["--data", f"imagefolder:{data}" if not synthetic else "fake", "--model", "resnet50", "--image-size",
            str(size), "--num-classes", "1000", "--steps", str(steps), "--warm", str(warm), "--batch", str(batch),
            "--workers", str(workers), "--device", device, "--no-ddp", "--out", str(out),
            *(["--precision", "bf16", "--channels-last", "--compile"] if fast and not smoke else []),
            *(["--synthetic"] if synthetic else [])]
    argv = ws.submit_argv("--gpus", str(gpus), "--tasks-per-node", "1", "--run-dir", str(ws.fresh("gpu-data-prun")),
                          str(PLAIN), "--", *loop)
    ws.run(argv, "gpu-data-plain", cpu_only=smoke, timeout=1800)
    return json.loads(out.read_text())["samples_per_s"]


def run(ws: Workspace) -> list[Row]:
    smoke = os.environ.get("BENCH_GPU_DEVICE") == "cpu"
    if not smoke and gpu_name() is None:
        say("GPU data path: skipped (no GPU visible)")
        return [skipped(SECTION, "GPU data path: ResNet-50 on 224 px JPEGs, images/s", "skipped: no GPU visible")]
    s = ws.s
    size, batch = (64, 4) if smoke else (224, s.gpu_batch)
    steps, warm = (6, 3) if smoke else (s.gpu_steps, s.gpu_warm)
    workers, gpus, device = (1, 0, "cpu") if smoke else (s.gpu_workers, 1, "cuda")
    data = _dataset(ws, size, per_class=max(batch * (steps + 2) // 10 + 1, 2))
    common = dict(size=size, batch=batch, steps=steps, warm=warm, workers=workers, gpus=gpus)
    say(f"GPU data path: {steps} steps (first {warm} excluded), batch {batch}, {size} px JPEGs")
    ours = _trainer(ws, data, data_path="device", smoke=smoke, **common)  # opt-in until proven (issue 40)
    cpu_path = _trainer(ws, data, data_path="cpu", smoke=smoke, **common)
    ceiling = _plain(ws, data, device=device, smoke=smoke, fast=True, synthetic=True, **common)
    seeds = _plain(ws, data, device=device, smoke=smoke, fast=False, synthetic=False, **common)
    say(f"  trainer {ours:,.0f}, trainer on the CPU path {cpu_path:,.0f}, data in GPU memory {ceiling:,.0f}, "
        f"seeds' fp32 eager loop {seeds:,.0f} images/s")
    note = ("SMOKE TEST ON CPU, not a GPU number; " if smoke else "") + \
        f"1 GPU ({gpu_name() or 'cpu'}), batch {batch}, {size} px JPEGs (make-dataset --jpeg), {workers} workers"
    extra = {"device": gpu_name() or "cpu", "trainer_cpu_data_path": cpu_path, "data_in_gpu_memory": ceiling,
             "seeds_fp32_eager": seeds, "batch": batch, "image_size": size}
    rows = [absolute(SECTION, "GPU data path: trainer / model fed from GPU memory", "ratio", ours="hpc-ddp trainer",
                     samples=[ours / ceiling], target=Target(">=", 0.95), extra=extra, note=note),
            absolute(SECTION, "GPU data path: trainer / the seeds' fp32 eager loop", "ratio", ours="hpc-ddp trainer",
                     samples=[ours / seeds], target=Target(">=", 2.5), extra=extra, note=note)]
    for row in rows:
        say(f"  row: {json.dumps(row.to_json())}")
    return rows
