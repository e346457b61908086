"""In a rank's Python, before the user's code runs: start torch on this rank's own GPU, and stop a job
whose ranks share a GPU at start-up, with one line instead of an NCCL error from deep inside torch.

hpc-ddp's runner sets HPC_DDP_CUDA_DEVICE (job/gpubind.py): the index of this rank's own GPU among those it
sees. `install()` waits for `import torch` (a meta-path hook: nothing is imported early, so a script that
sets CUDA_VISIBLE_DEVICES itself before importing torch still can), then
  * queues `torch.cuda.set_device(index)` for CUDA's own lazy start (`torch.cuda._lazy_call`): plain
    `torch.device("cuda")` is then this rank's GPU, and a script's own set_device still wins. CUDA is not
    started by it, and it is skipped where the script changed CUDA_VISIBLE_DEVICES or the index does not exist;
  * wraps `torch.distributed.init_process_group`: once the group is up (and it uses NCCL, or CUDA is already
    started), each rank writes "rank, device, physical GPU" for its node into the group's store and reads its
    node's other ranks' entries (LOCAL_WORLD_SIZE reads, not WORLD_SIZE: it scales). Two ranks on one GPU:
    the line naming both and the fix, and exit 2 (Slurm's --kill-on-bad-exit ends the others). The store,
    not a collective: NCCL itself fails on a shared GPU before it could say which ranks.

Imports nothing from hpc-ddp (every Python process of a rank imports it through sitecustomize, whatever
its interpreter); never lets its own failure reach the user's program. HPC_DDP_EXIT_GUARD=0 turns it off
with the exit guard.
"""

import contextlib
import os
import socket
import sys

DEVICE_VARIABLE = "HPC_DDP_CUDA_DEVICE"
BINDING_VARIABLE = "HPC_DDP_GPU_BINDING"
_WAIT_S = 300.0  # for the node's other ranks' entries; HPC_DDP_RENDEZVOUS_TIMEOUT where set
EXIT_SHARED_GPU = 2


def shared_gpu_line(entries, host, visible=None):
    """`entries`: (rank, device index, physical GPU) of one node's ranks -> the one line for the first GPU
    that two ranks use, or None. Pure."""
    seen = {}
    for rank, index, gpu in sorted(entries):
        if gpu in seen:
            first, first_index = seen[gpu]
            where = f"cuda:{first_index}" if first_index == index else f"cuda:{first_index} and cuda:{index}"
            shown = f" of CUDA_VISIBLE_DEVICES={visible}" if visible else ""
            return (f"hpc-ddp: ranks {first} and {rank} on node {host} both use GPU {gpu} ({where}{shown}): "
                    "each rank needs a GPU of its own. HINT: pick the device by local rank "
                    "(torch.cuda.set_device(int(os.environ['LOCAL_RANK']))) or plain torch.device('cuda'), "
                    "not a fixed index; or submit with --gpu-bind rank, so that each rank sees only its own "
                    "GPU, as cuda:0")
        seen[gpu] = (rank, index)
    return None


def install(environ=os.environ):
    """Hook `import torch` in this process (idempotent; a no-op where the runner bound no GPU)."""
    if environ.get(DEVICE_VARIABLE) is None or any(getattr(f, "_hpc_ddp_rankguard", False) for f in sys.meta_path):
        return
    guard = _Guard(environ)
    if "torch" in sys.modules:
        guard.torch_imported(sys.modules["torch"])
    else:
        sys.meta_path.insert(0, _AfterImport("torch", guard.torch_imported))


class _Guard:
    def __init__(self, environ):
        self.environ = environ
        self.visible = environ.get("CUDA_VISIBLE_DEVICES")  # as the runner set it
        self.generation = 0

    def torch_imported(self, torch):
        with contextlib.suppress(Exception):  # a torch without these hooks runs as it would without hpc-ddp
            self._default_device(torch)
            self._wrap_init(torch)

    def _default_device(self, torch):
        index = int(self.environ.get(DEVICE_VARIABLE, "0"))
        lazy_call = getattr(torch.cuda, "_lazy_call", None)
        if index <= 0 or lazy_call is None:
            return

        def start_on_own_gpu():
            with contextlib.suppress(Exception):  # a queued call that raises would fail the first CUDA call
                if os.environ.get("CUDA_VISIBLE_DEVICES") == self.visible and index < torch.cuda.device_count():
                    torch.cuda.set_device(index)
        lazy_call(start_on_own_gpu)

    def _wrap_init(self, torch):
        dist = getattr(torch, "distributed", None)
        if dist is None or not dist.is_available() or hasattr(dist.init_process_group, "_hpc_ddp_original"):
            return
        original = dist.init_process_group

        def init_process_group(*args, **kwargs):
            result = original(*args, **kwargs)
            self.check(torch, dist)
            return result
        init_process_group.__doc__, init_process_group.__wrapped__ = original.__doc__, original
        init_process_group._hpc_ddp_original = original
        dist.init_process_group = init_process_group

    def check(self, torch, dist):
        """After the group is up: stop the job if two ranks of this node use one GPU."""
        self.generation += 1
        try:
            entries = self._node_entries(torch, dist)
        except Exception:  # noqa: BLE001 - a check that cannot run leaves the job as it is
            return
        line = shared_gpu_line(entries, _node_name(self.environ), self.visible) if entries else None
        if line:
            print(line, file=sys.stderr, flush=True)
            sys.stdout.flush()
            self._until_all_have_read(dist)
            os._exit(EXIT_SHARED_GPU)
        self._have_read(dist)

    def _have_read(self, dist):
        try:
            return dist.distributed_c10d._get_default_store().add(f"hpc_ddp/gpu/{self.generation}/read", 1)
        except Exception:  # noqa: BLE001
            return None

    def _until_all_have_read(self, dist, timeout_s=30.0):
        """The store lives in global rank 0's process: a rank that stops waits (bounded) until every rank
        has read its node's entries, so each node's ranks learn of their own clash, not of a lost store."""
        import time

        world, deadline = dist.get_world_size(), time.monotonic() + timeout_s
        count = self._have_read(dist)
        while count is not None and count < world and time.monotonic() < deadline:
            time.sleep(0.05)
            try:
                count = dist.distributed_c10d._get_default_store().add(f"hpc_ddp/gpu/{self.generation}/read", 0)
            except Exception:  # noqa: BLE001
                return

    def _node_entries(self, torch, dist):
        if dist.get_world_size() < 2 or not torch.cuda.is_available():
            return None
        if str(dist.get_world_size()) != self.environ.get("WORLD_SIZE"):
            return None  # a group of the program's own making, not the job's ranks: who is on which node is unknown
        if "nccl" not in str(dist.get_backend()).lower() and not torch.cuda.is_initialized():
            return None  # a CPU job: no GPU to share, and CUDA is not started for the check
        local_world = int(self.environ.get("LOCAL_WORLD_SIZE", "1"))
        if local_world < 2:
            return None
        index = torch.cuda.current_device()
        store = dist.distributed_c10d._get_default_store()
        node = self.environ.get("NODE_RANK") or _node_name(self.environ)
        prefix = f"hpc_ddp/gpu/{self.generation}/{node}/"
        store.set(prefix + self.environ.get("LOCAL_RANK", "0"), f"{dist.get_rank()} {index} {_physical(torch, index)}")
        keys = [prefix + str(i) for i in range(local_world)]
        from datetime import timedelta

        store.wait(keys, timedelta(seconds=float(self.environ.get("HPC_DDP_RENDEZVOUS_TIMEOUT", _WAIT_S))))
        out = []
        for key in keys:
            rank, device, gpu = store.get(key).decode().split(" ", 2)
            out.append((int(rank), int(device), gpu))
        return out


def _node_name(environ):
    return environ.get("SLURMD_NODENAME") or socket.gethostname()


def _physical(torch, index):
    """The GPU cuda:index is: its UUID where the driver says, else CUDA_VISIBLE_DEVICES's entry (CUDA's map)."""
    with contextlib.suppress(Exception):
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        if uuid:
            return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        listed = [x.strip() for x in visible.split(",")]
        if index < len(listed):
            return listed[index]
    return str(index)


class _AfterImport:
    """A meta-path finder that lets the other finders load `name`, then calls `after(module)`."""

    _hpc_ddp_rankguard = True

    def __init__(self, name, after):
        self.name, self.after, self.busy = name, after, False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self.busy:
            return None
        self.busy = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self.busy = False
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _ChainedLoader(spec.loader, self)
        return spec


class _ChainedLoader:
    def __init__(self, loader, hook):
        self.loader, self.hook = loader, hook

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        # The module sees its own loader, as without the hook.
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        if self.hook in sys.meta_path:
            sys.meta_path.remove(self.hook)
        self.hook.after(module)
