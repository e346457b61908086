"""Where the trainer's time per step goes (a developer tool; not part of `make bench`).

    python bench/profile_trainer.py [--ranks 2] [--steps 200]
    python bench/profile_trainer.py --startup --steps 2      # when each start-up phase ends
    PROFILE_SORT=cumulative python bench/profile_trainer.py --cprofile --steps 2

Builds the same CPU job as the throughput benchmark, starts its ranks the way the local executor does
(the per-rank runner's environment, then `hpc_ddp.trainer.train.run` in the process), and on rank 0 times each
part of every step by wrapping the trainer's own methods: waiting for the next batch, forward+backward+
optimizer (the step's flags travel with its gradients), reading the agreed flags, the metrics record.
The same split is measured for the plain loop's steps (bench/plain_ddp.py's body, timed inline). With --cprofile, rank 0 runs under
cProfile instead and the top functions by total time are printed (cProfile slows Python-heavy parts).
Also times, in this process, the per-sample work of the loader workers: torchvision's PIL pipeline (the
plain loop's) against the trainer's array pipeline, and the reseeding each needs for exact resume.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import PY, REPO, free_port, trainer_job

CHILD = r"""
import time; marks = [("process start", time.time())]
import cProfile, json, os, pstats, sys
from pathlib import Path
from hpc_ddp.job.runner import prepare
from hpc_ddp.spec.jobspec import load_spec
spec_path, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
argv, env = prepare(spec_path)
os.environ.update(env)
marks.append(("runner's prepare()", time.time()))
from hpc_ddp.trainer import session as sess
from hpc_ddp.trainer import train
marks.append(("import hpc_ddp.trainer.train (torch)", time.time()))
rank = int(os.environ["RANK"])
if mode == "startup":  # when each start-up phase ends, on rank 0
    def mark(name, fn):
        def wrapper(*a, **k):
            r = fn(*a, **k); marks.append((name, time.time())); return r
        return wrapper
    sess.Session.setup = mark("Session.setup (rendezvous, process group, health check)", sess.Session.setup)
    train.Trainer.__init__ = mark("Trainer.__init__ (data, model, DDP, ...)", train.Trainer.__init__)
    sess.Session.resume = mark("resume() (look for a checkpoint)", sess.Session.resume)
    first = train.Trainer._step
    def _step(self, batches):
        r = first(self, batches)
        if not marks[-1][0].startswith("first step"):
            marks.append(("first step (loader workers start, batch, fwd/bwd)", time.time()))
        return r
    train.Trainer._step = _step
phases = {"data": [], "compute": [], "agree": [], "record": [], "step_total": [], "starts": []}
if rank == 0 and mode == "phases":
    T = train.Trainer
    def timed(name, fn):
        def wrapper(self, *a, **k):
            t = time.perf_counter(); r = fn(self, *a, **k); phases[name].append(time.perf_counter() - t); return r
        return wrapper
    orig_step = T._step
    def _step(self, batches):
        class Timed:
            def __next__(_):
                t = time.perf_counter(); b = next(batches); phases["data"].append(time.perf_counter() - t); return b
        t = time.perf_counter(); phases["starts"].append(t)
        r = orig_step(self, Timed()); phases["step_total"].append(time.perf_counter() - t)
        return r
    T._step = _step
    sess.Session.step = timed("agree", sess.Session.step)   # agree + record + periodic save
    sess.Session._record = timed("record", sess.Session._record)
spec = load_spec(spec_path)
if rank == 0 and mode == "cprofile":
    prof = cProfile.Profile(); prof.enable()
code = train.run(spec, Path(spec_path).parent)
if rank == 0 and mode == "cprofile":
    prof.disable(); prof.dump_stats(out + ".prof")
    pstats.Stats(out + ".prof").sort_stats(os.environ.get("PROFILE_SORT", "tottime")).print_stats(40)
if rank == 0 and mode == "startup":
    json.dump(marks, open(out, "w"))
if rank == 0 and mode == "phases":
    phases["compute"] = [t - d for t, d in zip(phases["step_total"], phases["data"])]
    json.dump(phases, open(out, "w"))
sys.stdout.flush()
os._exit(code)
"""

PLAIN_CHILD = r"""
import json, os, sys, time
import torch, torch.distributed as dist
import torchvision.datasets as D, torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from hpc_ddp.trainer.models import SmallCNN
data_dir, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo"); rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
tf = T.Compose([T.RandomCrop(28, padding=3), T.ToTensor(), T.Normalize((0.5,), (0.5,))])
data = D.MNIST(data_dir, train=True, download=False, transform=tf)
sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True, num_workers=2, persistent_workers=True)
model = DDP(SmallCNN(1, 10)); opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
phases = {"data": [], "compute": [], "starts": []}
it = iter(loader)
for step in range(steps):
    t0 = time.perf_counter(); phases["starts"].append(t0); x, y = next(it); t1 = time.perf_counter()
    loss = torch.nn.functional.cross_entropy(model(x), y); opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
    t2 = time.perf_counter(); phases["data"].append(t1 - t0); phases["compute"].append(t2 - t1)
if rank == 0: json.dump(phases, open(out, "w"))
dist.destroy_process_group(); os._exit(0)
"""


def _ranks(argv_for_rank, envs) -> None:
    procs = [subprocess.Popen(argv_for_rank(r), env={**os.environ, **env, "OMP_NUM_THREADS": "1",
                                                       "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)})
             for r, env in enumerate(envs)]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit("a rank failed")


def _summary(name: str, phases: dict[str, list[float]], skip: int) -> None:
    starts = phases.pop("starts")
    wall = (starts[-1] - starts[skip]) / (len(starts) - 1 - skip)
    print(f"{name}: ms per step (mean over steps {skip}..): wall {wall * 1e3:.2f}")
    for k, v in phases.items():
        if k != "step_total" and v[skip:]:
            mean, median = statistics.mean(v[skip:]) * 1e3, statistics.median(v[skip:]) * 1e3
            print(f"  {k:10s} mean {mean:7.3f}  median {median:7.3f}")


def seeding_cost(data_dir: Path) -> None:
    """Per sample, in this process: what the plain loop's loader workers do (torchvision's MNIST with the
    PIL transforms) against the trainer's (the same samples made from the arrays, `hpc_ddp.data.arrays`),
    each with the reseeding the trainer adds for exact resume."""
    import torchvision.datasets as D

    from hpc_ddp.data.loaders import SeededSamples, _datasets, _seed_all, _transforms
    from hpc_ddp.spec.trainconfig import TrainConfig

    pil = D.MNIST(str(data_dir), train=True, download=False, transform=_transforms(1, 28, True, True))
    (arrays, _), *_ = _datasets(TrainConfig(dataset="mnist", data_dir=str(data_dir)))
    seeded = SeededSamples(arrays, seed=0)
    n = 2000

    def per_sample(fn) -> float:
        started = time.perf_counter()
        for i in range(n):
            fn(i)
        return (time.perf_counter() - started) / n * 1e6

    load_pil = per_sample(lambda i: pil[i % len(pil)])
    load_arrays = per_sample(lambda i: arrays[i % len(arrays)])
    seed_all = per_sample(_seed_all)
    seed_ours = per_sample(seeded._seed)
    print(f"loader worker, per sample: torchvision's PIL pipeline {load_pil:.1f} us (+ {seed_all:.1f} us to reseed "
          f"python, numpy and torch); the trainer's arrays {load_arrays:.1f} us (+ {seed_ours:.1f} us to reseed torch)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--cprofile", action="store_true")
    p.add_argument("--startup", action="store_true", help="when each start-up phase ends (rank 0), 3 runs")
    a = p.parse_args()
    from hpc_ddp.data.datagen import write_mnist
    from hpc_ddp.launch.executors.local import rank_envs
    from hpc_ddp.spec.jobspec import load_spec

    with tempfile.TemporaryDirectory(prefix="hpc-ddp-profile-") as tmp:
        work = Path(tmp)
        data = write_mnist(work / "mnist", train=a.steps * 32 * a.ranks + 512, test=64)
        job = trainer_job(work / "job.toml", data=str(data), steps=a.steps, batch=32, workers=2, tasks=a.ranks)
        run_dir = work / "run"
        subprocess.run([PY, "-m", "hpc_ddp", "render", "--run-dir", str(run_dir), str(job)], check=True, cwd=work,
                       stdout=subprocess.DEVNULL, env={**os.environ, "HPC_DDP_REGISTRY": str(work / "reg.jsonl")})
        spec_path = str(run_dir / "spec.json")
        envs = rank_envs(load_spec(spec_path), "profile", free_port(), 0, run_dir=str(run_dir))
        out = str(work / "phases.json")
        mode = "cprofile" if a.cprofile else "startup" if a.startup else "phases"
        for _ in range(3 if a.startup else 1):
            started = time.time()
            _ranks(lambda r: [PY, "-c", CHILD, spec_path, out, mode], envs)
            if a.startup:
                print("start-up of rank 0, s since the ranks were spawned:")
                for name, at in json.loads(Path(out).read_text()):
                    print(f"  {at - started:6.2f}  {name}")
                shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        if mode != "phases":
            return
        ours = json.loads(Path(out).read_text())
        plain_out = str(work / "plain.json")
        port = str(free_port())
        _ranks(lambda r: [PY, "-c", PLAIN_CHILD, str(data), str(a.steps), plain_out],
               [{**e, "MASTER_PORT": port} for e in envs])
        _summary("trainer", ours, 10)
        _summary("plain loop", json.loads(Path(plain_out).read_text()), 10)
        seeding_cost(data)


if __name__ == "__main__":
    main()
