"""GPU: ResNet-50 on synthetic ImageNet-sized data (224 px, 1000 classes), images/s per GPU, one GPU.

Four variants, each the trainer against the plain loop with the same data pipeline (torchvision FakeData
through a DataLoader with the same workers and pinned memory) and batch size, both started by the local
executor with one GPU:
  fp32 eager | bf16 autocast | bf16 + channels_last | bf16 + channels_last + torch.compile
The trainer gets channels_last and compile through a model factory (bench/gpu_models.py), as a user's
job would. Each row also records the plain loop on one random batch kept on the GPU (no loader): the
model's ceiling on this GPU, which tells whether the loader limits both sides.

Runs only where torch sees a GPU; elsewhere its row says "skipped: no GPU visible".
BENCH_GPU_DEVICE=cpu runs the same code on the CPU with tiny sizes (a smoke test of the harness only).
"""

from __future__ import annotations

import json
import os

from .common import (
    PLAIN,
    Row,
    Workspace,
    compare,
    interleaved,
    say,
    skipped,
    trainer_job,
    trainer_rate,
)

SECTION = "gpu"
VARIANTS = (
    ("fp32 eager", "fp32", "resnet50", []),
    ("bf16 autocast", "bf16", "resnet50", []),
    ("bf16 + channels_last", "bf16", "bench.gpu_models:resnet50_channels_last", ["--channels-last"]),
    ("bf16 + channels_last + torch.compile", "bf16", "bench.gpu_models:resnet50_channels_last_compiled",
     ["--channels-last", "--compile"]),
)


class _Setup:
    def __init__(self, ws: Workspace):
        s = ws.s
        self.smoke = os.environ.get("BENCH_GPU_DEVICE") == "cpu"
        self.device = "cpu" if self.smoke else "cuda"
        self.gpus = 0 if self.smoke else 1
        self.size = 96 if self.smoke else 224    # > 64 px: the trainer keeps torchvision's ImageNet stem
        self.steps, self.warm = (8, 4) if self.smoke else (s.gpu_steps, s.gpu_warm)
        self.batch = 4 if self.smoke else s.gpu_batch
        self.workers = 1 if self.smoke else s.gpu_workers
        self.repeats = 1 if self.smoke else s.gpu_repeats


def _plain(ws: Workspace, g: _Setup, precision: str, flags: list[str], synthetic: bool = False):
    def run(n: int) -> float:
        out = ws.fresh("gpu-plain").with_suffix(".json")
        run_dir = ws.fresh("gpu-plain-run")
        loop = ["--data", "fake", "--model", "resnet50", "--image-size", str(g.size), "--num-classes", "1000",
                "--steps", str(g.steps), "--warm", str(g.warm), "--batch", str(g.batch), "--workers", str(g.workers),
                "--device", g.device, "--precision", precision, "--no-ddp", "--out", str(out), *flags,
                *(["--synthetic"] if synthetic else [])]
        argv = ws.submit_argv("--gpus", str(g.gpus), "--tasks-per-node", "1", "--run-dir", str(run_dir), str(PLAIN),
                              "--", *loop)
        ws.run(argv, "gpu-plain", cpu_only=g.smoke, timeout=1800)
        return json.loads(out.read_text())["samples_per_s"]
    return run


def _ours(ws: Workspace, g: _Setup, precision: str, model: str):
    job = trainer_job(ws.fresh("gpu-job").with_suffix(".toml"), data="fake", steps=g.steps, batch=g.batch,
                      workers=g.workers, gpus=g.gpus, log_every=g.warm, model=model,
                      extra=f'precision = "{precision}"\nimage_size = {g.size}\nnum_classes = 1000\n'
                            f'fake_size = {g.batch * (g.steps + 2)}\n')

    def run(n: int) -> float:
        run_dir = ws.fresh("gpu-ours-run")
        ws.run(ws.submit_argv("--run-dir", str(run_dir), str(job)), "gpu-ours", cpu_only=g.smoke, timeout=1800)
        return trainer_rate(run_dir, warm=g.warm, samples_per_step=g.batch)
    return run


def gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def run(ws: Workspace) -> list[Row]:
    g = _Setup(ws)
    if not g.smoke and gpu_name() is None:
        say("GPU: skipped (no GPU visible)")
        return [skipped(SECTION, "GPU: ResNet-50, images/s per GPU (4 variants)", "skipped: no GPU visible")]
    rows = []
    for label, precision, model, flags in VARIANTS:
        say(f"GPU {label}: {g.steps} steps (first {g.warm} excluded), batch {g.batch}, {g.repeats} repeats")
        runs = interleaved({"plain loop": _plain(ws, g, precision, flags), "trainer": _ours(ws, g, precision, model)},
                           g.repeats, "images/s")
        ceiling = _plain(ws, g, precision, flags, synthetic=True)(0)
        say(f"  plain loop, data on the GPU (no loader): {ceiling:,.0f} images/s")
        rows.append(compare(SECTION, f"GPU ResNet-50, {label}", "images/s", ours="hpc-ddp trainer",
                            ours_samples=runs["trainer"], baseline="plain loop", baseline_samples=runs["plain loop"],
                            extra={"plain_loop_data_on_gpu_images_per_s": ceiling, "device": gpu_name() or "cpu",
                                   "batch": g.batch, "image_size": g.size, "loader_workers": g.workers},
                            note=("SMOKE TEST ON CPU, not a GPU number; " if g.smoke else "")
                            + f"1 GPU, batch {g.batch}, {g.size} px FakeData, {g.workers} loader workers"))
        say(f"  row: {json.dumps(rows[-1].to_json())}")  # a run cut short still leaves its finished rows in the log
    return rows
