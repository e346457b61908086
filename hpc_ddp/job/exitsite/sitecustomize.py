"""Put on a rank's PYTHONPATH by hpc-ddp's runner: installs hpc_ddp_code (the project is imported from the
run's snapshot, not the working tree), destroys a process group left open at exit (and ignores the
time-limit warning from then on), and installs
hpc_ddp_rankguard (the rank starts on its own GPU; ranks that share one stop at start-up) and
hpc_ddp_warned (a time-limit warning that reached a handler of the program's is recorded).

A script that never calls `destroy_process_group` (Lightning's DDP strategy is one) leaves gloo's
threads joinable while the interpreter shuts down; about 1 rank in 20 then aborts in a C++ destructor
("terminate called without an active exception", SIGABRT) after its work is done, and Slurm marks the
whole job FAILED. Destroying the group in an exit handler joins those threads first.

Python imports one `sitecustomize` module; this one then runs the one it shadows (Debian's, a conda
env's, a site's), so nothing the interpreter did before changes. It stays small and imports nothing
from hpc-ddp: every Python process the rank starts imports it. HPC_DDP_EXIT_GUARD=0 turns it off.
"""

import atexit
import contextlib
import os
import sys
import threading

_LEAVE_TIMEOUT_S = 10.0


def _leave_cleanly():
    _ignore_the_warning_from_now_on()
    _destroy_open_process_group()
    _release_ddp_modules()


def _ignore_the_warning_from_now_on():
    """When Python finalizes (after the exit handlers), it gives SIG_DFL back to every signal it had a
    handler for. A time-limit warning that came then killed a rank that had finished its work (exit -12,
    so the attempt "failed", seen when a run's last steps ended right at the warning). A program that is
    leaving can no longer act on it: from here on it is ignored (SIG_IGN is kept through finalization)."""
    name = os.environ.get("HPC_DDP_WARNING_SIGNAL")
    if not name or threading.current_thread() is not threading.main_thread():
        return
    import signal

    signum = getattr(signal, f"SIG{name}", None)
    if signum is not None:
        with contextlib.suppress(Exception):
            signal.signal(signum, signal.SIG_IGN)


def _release_ddp_modules():
    """A DDP module still alive at exit keeps its reducer and process group, and with them gloo's threads,
    until the C++ static destructors, which then abort about 1 rank in 5 ("terminate called without an
    active exception"), even after the script's own destroy_process_group (measured on seed 001 with gloo,
    2 ranks: 4 of 20 runs aborted; 0 of 30 with this). Dropping those two references lets them go now."""
    parallel = sys.modules.get("torch.nn.parallel")
    ddp = getattr(parallel, "DistributedDataParallel", None)
    if ddp is None:
        return
    import gc
    import warnings

    # leaving must not fail because of this, nor print anything: isinstance() on every object touches
    # deprecated ones (torch.distributed.reduce_op warns through its ABC's instance check)
    with contextlib.suppress(Exception), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, ddp):
                for name in ("reducer", "process_group"):
                    obj.__dict__.pop(name, None)
        gc.collect()


def _destroy_open_process_group():
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return
    except Exception:  # a torch half torn down, or too old to ask: leave it as it is
        return
    # In a thread and bounded: with the peers gone, destroying can block, and a rank stuck at exit
    # keeps the whole allocation alive.
    worker = threading.Thread(target=dist.destroy_process_group, daemon=True)
    worker.start()
    worker.join(_LEAVE_TIMEOUT_S)


def _run_shadowed_sitecustomize():
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module  # `import sitecustomize` finds the one it always found
    spec.loader.exec_module(module)


def _install_rank_guard():
    """hpc_ddp_rankguard (beside this file): this rank starts on its own GPU; ranks sharing one stop.
    hpc_ddp_warned: a handler of the program's own for the warning signal records that it was warned."""
    try:
        import hpc_ddp_rankguard
        import hpc_ddp_warned
    except Exception:  # a broken install must not stop the user's program
        return
    hpc_ddp_rankguard.install()
    hpc_ddp_warned.install()


def _install_code_pin():
    """hpc_ddp_code: imports of the user's project come from the snapshot the run was submitted with. Not
    part of the exit guard (HPC_DDP_EXIT_GUARD=0 leaves it on): it is what the run runs, not a safeguard."""
    try:
        import hpc_ddp_code
    except Exception:  # a broken install must not stop the user's program
        return
    hpc_ddp_code.install()


_install_code_pin()
if os.environ.get("HPC_DDP_EXIT_GUARD") != "0":
    # Registered before the user's program runs, so it runs after the program's own exit handlers
    # (a logger's finish may still need the group).
    atexit.register(_leave_cleanly)
    _install_rank_guard()
_run_shadowed_sitecustomize()
