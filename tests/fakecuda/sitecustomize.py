"""A model of CUDA for tests on machines without a GPU: put this folder on PYTHONPATH (test-only).

Scripts written for GPUs run unmodified on the CPU, while every device choice goes through the same rules
as on real CUDA (hpc_ddp.job.gpubind.cuda_devices: CUDA_VISIBLE_DEVICES read when CUDA starts, an index
past the visible GPUs is "invalid device ordinal"), and each process records the physical GPUs it used:

  FAKE_CUDA_GPUS=N      the node has N GPUs (GPU-fake-<node>-<i>); unset: this model stays off
  FAKE_CUDA_LOG=DIR     each process appends {"host", "rank", "local_rank", "index", "gpu", "visible"}
                        to DIR/<node>-<pid>.jsonl for every GPU it places something on

What is modelled: torch.cuda's is_available, device_count, set_device, current_device, is_initialized,
the lazy start (queued calls, as torch.cuda._lazy_call queues them), Tensor/Module .to()/.cuda() with any
form of CUDA device (the tensor stays on the CPU), DDP's device_ids/output_device (checked, then dropped:
DDP on CPU takes none), an "nccl" process group (gloo underneath; it starts CUDA, as a real one does at its
first collective), SyncBatchNorm (plain BatchNorm: the CPU has no SyncBN kernel), DataLoader's
pin_memory (off: page-locked memory needs a driver), and torch.accelerator, which torch's own internals ask
(none: the tensors are on the CPU). Nothing else.
hpc-ddp's own code never imports this.
"""

import json
import os
import socket
import sys


def _node():
    """Slurm's name for the node (the test Slurm's nodes share one host name), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _install():
    from hpc_ddp.job.exitsite.hpc_ddp_rankguard import _AfterImport

    if "torch" in sys.modules:
        _patch(sys.modules["torch"])
    else:
        sys.meta_path.insert(0, _AfterImport("torch", _patch))


class _Cuda:
    def __init__(self, torch, count):
        self.torch = torch
        host = _node()
        self.physical = [f"GPU-fake-{host}-{i}" for i in range(count)]
        self.started, self.current, self.shown, self.logged = False, 0, None, set()

    def visible(self):
        from hpc_ddp.job.gpubind import cuda_devices

        return self.shown if self.started else cuda_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), self.physical)

    def start(self):
        if self.started:
            return
        self.shown, self.started = self.visible(), True
        if not self.shown:
            raise RuntimeError("No CUDA GPUs are available")
        queued = list(self.torch.cuda._queued_calls)
        self.torch.cuda._queued_calls.clear()
        for call, _stack in queued:
            if not (getattr(call, "__module__", "") or "").startswith("torch"):  # torch's own: capability checks
                call()

    def index(self, device):
        """A CUDA device in any form torch takes -> its index (None: not a CUDA device)."""
        torch = self.torch
        if isinstance(device, int) and not isinstance(device, bool):
            return device
        if isinstance(device, str):
            if not device.startswith("cuda"):
                return None
            device = torch.device(device)
        if isinstance(device, torch.device):
            if device.type != "cuda":
                return None
            self.start()
            return self.current if device.index is None else device.index
        return None

    def use(self, index):
        self.start()
        if not 0 <= index < len(self.shown):
            raise RuntimeError("CUDA error: invalid device ordinal")
        gpu = self.shown[index]
        if gpu not in self.logged and os.environ.get("FAKE_CUDA_LOG"):
            self.logged.add(gpu)
            record = {"host": _node(), "rank": os.environ.get("RANK"),
                      "local_rank": os.environ.get("LOCAL_RANK"), "index": index, "gpu": gpu,
                      "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}
            path = os.path.join(os.environ["FAKE_CUDA_LOG"], f"{_node()}-{os.getpid()}.jsonl")
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return index


def _patch(torch):
    count = int(os.environ.get("FAKE_CUDA_GPUS", "0") or 0)
    if count <= 0:
        return
    cuda = _Cuda(torch, count)
    tc = torch.cuda
    tc.is_available = lambda: bool(cuda.visible())
    tc.device_count = lambda: len(cuda.visible())
    tc.is_initialized = lambda: cuda.started
    tc._lazy_init = cuda.start
    tc.current_device = lambda: (cuda.start(), cuda.current)[1]

    def set_device(device):
        index = cuda.index(device)
        if index is not None and index >= 0:
            cuda.current = cuda.use(index)
    tc.set_device = set_device
    for name in ("synchronize", "empty_cache", "manual_seed", "manual_seed_all"):
        setattr(tc, name, lambda *a, **k: None)

    def get_device_properties(device=None):
        raise RuntimeError("the fake CUDA has no device properties")  # the rank guard falls back to the list
    tc.get_device_properties = get_device_properties

    def moved(args, kwargs):
        """.to()/.cuda() arguments with any CUDA device checked, recorded and replaced by the CPU."""
        args = list(args)
        if "device" in kwargs and cuda.index(kwargs["device"]) is not None:
            cuda.use(cuda.index(kwargs["device"]))
            kwargs = {**kwargs, "device": "cpu"}
        if args and not isinstance(args[0], torch.Tensor) and not isinstance(args[0], torch.dtype):
            index = cuda.index(args[0])
            if index is not None:
                cuda.use(index)
                args[0] = "cpu"
        return args, kwargs

    def on_cpu(original):
        def to(self, *args, **kwargs):
            args, kwargs = moved(args, kwargs)
            return original(self, *args, **kwargs)
        return to
    torch.Tensor.to = on_cpu(torch.Tensor.to)
    torch.nn.Module.to = on_cpu(torch.nn.Module.to)

    def to_cuda(self, device=None, **_):
        cuda.use(cuda.current if device is None else cuda.index(device))
        return self
    torch.Tensor.cuda = to_cuda
    torch.nn.Module.cuda = to_cuda
    torch.nn.SyncBatchNorm.convert_sync_batchnorm = classmethod(lambda cls, module, process_group=None: module)

    ddp = torch.nn.parallel.DistributedDataParallel
    ddp_init = ddp.__init__

    def ddp_on_cpu(self, module, device_ids=None, output_device=None, *args, **kwargs):
        for device in [*(device_ids or []), *([output_device] if output_device is not None else [])]:
            cuda.use(cuda.index(device))
        ddp_init(self, module, None, None, *args, **kwargs)
    ddp.__init__ = ddp_on_cpu

    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:  # what torch's own internals ask (optimizers, loaders): the tensors are on the CPU
        accelerator.current_accelerator = lambda check_available=False: None
        accelerator.is_available = lambda: False
        accelerator.device_count = lambda: 0

    loader_init = torch.utils.data.DataLoader.__init__

    def loader_unpinned(self, *args, **kwargs):
        kwargs["pin_memory"] = False  # page-locked host memory needs a real driver; no device is chosen by it
        loader_init(self, *args, **kwargs)
    torch.utils.data.DataLoader.__init__ = loader_unpinned

    dist = torch.distributed
    init = dist.init_process_group

    def init_process_group(backend=None, *args, **kwargs):
        if backend is not None and "nccl" in str(backend):
            cuda.start()  # an NCCL group works on the current device: CUDA starts
            backend = "gloo"
        return init(backend, *args, **kwargs)
    dist.init_process_group = init_process_group


_install()
