"""How each container runtime starts a rank: the words around the runner, the srun options and the #SBATCH
line a runtime needs, and the host paths it must show inside. Pure, but for the checks that look at this
machine (`image_problems`, `runtime_findings`).

Every rank runs hpc-ddp's runner inside the container, from the run dir's copy of hpc_ddp
(`job.containersrc`), with the image's Python:

    apptainer exec [--nv] --bind RUN_DIR,WORKDIR,... [args] IMAGE  PYTHON RUN_DIR/hpc-ddp-src/rank.py SPEC
    ch-run -b /TOP ... -c WORKDIR [args] IMAGE -- PYTHON ...         (charliecloud: each path's top directory)
    podman run --rm --network=host --ipc=host --env-host -v P:P ... -w WORKDIR [args] IMAGE PYTHON ...
    srun ... --container-image=IMAGE --container-mounts=P:P,... --container-workdir=WORKDIR PYTHON ...   (pyxis)
    #SBATCH --image=IMAGE, then  shifter [args] PYTHON ...                                             (shifter)

So the environment, staging, signals and exit code 75 are the runner's, as without a container. Signals
reach the program: ch-run, shifter and pyxis exec it in place, apptainer's starter and podman's
--sig-proxy forward them. Each runtime passes the environment on (podman with --env-host), so the runner
sees the Slurm step's variables.

The host paths shown inside are the run dir, the working directory, the script's directory, the datasets
and the trainer's data_dir, at the same paths (spec.json names them so). charliecloud can only bind onto a
directory the image has (a read-only image cannot grow one), so it binds each path's top directory
(/home, /scratch, ...), which the image must have: checked where the image is visible here. ch-run shows
the host's $TMPDIR (node-local scratch) at /tmp and unsets TMPDIR, so staging inside uses it; a run under
/tmp binds the host's /tmp over it instead. Other scratch goes in `args`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import PurePosixPath

from hpc_ddp.common.errors import SpecError, UserError
from hpc_ddp.common.rundir import RunDir
from hpc_ddp.job.containersrc import entry_path
from hpc_ddp.spec.container import Container
from hpc_ddp.spec.jobspec import JobSpec

__all__ = ["runner_words", "srun_options", "directives", "host_paths", "image_problems", "check_image",
           "runtime_command", "runtime_finding", "refuse_missing_runtime"]


def runner_words(spec: JobSpec, run_dir: str) -> list[str]:
    """What each rank's task runs: the runner in the container (the runtime's words around it)."""
    c = spec.container
    assert c is not None
    inner = [c.python, str(entry_path(run_dir)), str(RunDir(run_dir).spec)]
    paths = host_paths(spec, run_dir)
    if c.runtime in ("apptainer", "singularity"):
        return [c.runtime, "exec", *(["--nv"] if spec.gpus else []), "--bind", _joined(paths, c, ","), *c.args,
                c.image, *inner]
    if c.runtime == "charliecloud":
        binds = [w for top in _tops(paths) for w in ("-b", top)]
        return ["ch-run", *binds, "-c", spec.workdir, *c.args, c.image, "--", *inner]
    if c.runtime == "podman":
        gpus = ["--device=nvidia.com/gpu=all"] if spec.gpus else []
        volumes = [w for p in paths for w in ("-v", f"{_one(p, c)}:{p}")]
        return ["podman", "run", "--rm", "--network=host", "--ipc=host", "--env-host", *gpus, *volumes,
                "-w", spec.workdir, *c.args, c.image, *inner]
    if c.runtime == "shifter":
        return ["shifter", *c.args, *inner]
    return inner  # pyxis: srun itself starts the container (`srun_options`)


def srun_options(spec: JobSpec, run_dir: str) -> list[str]:
    """The ranks' srun options a runtime needs (pyxis's); none for the others."""
    c = spec.container
    if c is None or c.runtime != "pyxis":
        return []
    mounts = ",".join(f"{p}:{p}" for p in (_one(p, c) for p in host_paths(spec, run_dir)))
    return [f"--container-image={c.image}", f"--container-mounts={mounts}", f"--container-workdir={spec.workdir}",
            *c.args]


def directives(spec: JobSpec) -> list[str]:
    """#SBATCH options a runtime needs (Shifter's image); none for the others."""
    c = spec.container
    return [f"--image={c.image}"] if c is not None and c.runtime == "shifter" else []


def host_paths(spec: JobSpec, run_dir: str) -> list[str]:
    """The host directories the ranks read or write, each once, none inside another."""
    wanted = [run_dir, spec.workdir]
    if spec.target.kind in ("script", "trainer"):
        wanted.append(str(PurePosixPath(spec.target.value).parent))
    if spec.code is not None:  # the snapshot the ranks run (a sweep's is beside its tasks' run dirs), and
        wanted += [spec.code.dir, spec.code.project]  # the project its left-out links point into
    wanted += [src for _, src in spec.datasets]
    if spec.train is not None and spec.train.data_dir:
        wanted.append(spec.train.data_dir)
    out: list[str] = []
    for path in sorted({os.path.normpath(p) for p in wanted}, key=len):
        if not any(path == kept or path.startswith(kept.rstrip("/") + "/") for kept in out):
            out.append(path)
    return out


def _tops(paths: list[str]) -> list[str]:
    """charliecloud's bind points: each path's top directory. /tmp too where a path is under it: ch-run shows
    the host's $TMPDIR there (and unsets TMPDIR), so a per-job TMPDIR would hide the host's /tmp."""
    return sorted({"/" + PurePosixPath(p).parts[1] for p in paths if len(PurePosixPath(p).parts) > 1})


def _one(path: str, c: Container) -> str:
    """A path as one item of a runtime's bind list, whose syntax (SRC[:DST][,...]) it must not break."""
    if "," in path or ":" in path:
        raise SpecError(f"{path!r} contains ',' or ':', which {c.runtime}'s bind list cannot hold",
                        hint="use a run dir and working directory without them")
    return path


def _joined(paths: list[str], c: Container, sep: str) -> str:
    return sep.join(_one(p, c) for p in paths)


# ---- checks that look at this machine ----

def image_problems(spec: JobSpec, run_dir: str) -> str | None:
    """What stops the image from running this job, where this machine can tell: a charliecloud image
    directory without the top directories the run's paths are bound on."""
    c = spec.container
    if c is None or c.runtime != "charliecloud" or not os.path.isdir(c.image):
        return None
    missing = [top for top in _tops(host_paths(spec, run_dir)) if not os.path.isdir(c.image + top)]
    if missing:
        return (f"charliecloud image {c.image} has no {', '.join(missing)}, where the run's paths are bound "
                f"(ch-run binds only onto a directory the image has): mkdir {' '.join(c.image + m for m in missing)}")
    return None


def check_image(spec: JobSpec, run_dir: str) -> None:
    """Raise a SpecError (exit 2, nothing written) for `image_problems`."""
    problem = image_problems(spec, run_dir)
    if problem:
        message, _, fix = problem.partition(": mkdir ")
        raise SpecError(message, hint=f"add the mount point{'s' if ' ' in fix else ''} to the image: mkdir {fix}")


def runtime_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """What a runtime needs in its environment that a shell may lack: ch-run refuses to start without USER
    (a batch job has it only if the submitting shell exported it)."""
    if environ.get("USER"):
        return {}
    import pwd

    return {"USER": pwd.getpwuid(os.getuid()).pw_name}


def runtime_command(c: Container) -> str | None:
    """The executable that starts `c` on a node (None for pyxis, which is srun's plugin)."""
    return {"charliecloud": "ch-run"}.get(c.runtime, None if c.runtime == "pyxis" else c.runtime)


def runtime_finding(spec: JobSpec, which: Callable[[str], str | None],
                    known: Callable[[str], frozenset[str] | None]) -> tuple[str, str, str | None] | None:
    """(level, message, hint) on whether the runtime is here: a warning, never an error, since login nodes
    often lack the runtime that the compute nodes have; where the ranks run here (the local executor),
    `refuse_missing_runtime` refuses instead."""
    c = spec.container
    if c is None:
        return None
    command = runtime_command(c)
    if command is not None:
        path = which(command)
        if path:
            return "ok", f"container runtime {c.runtime}: {command} is {path} here", None
        return ("warning", f"container runtime {c.runtime}: no {command} on PATH here (login nodes often lack it); "
                "the compute nodes must have it", f"check a node: srun -N1 which {command}")
    options = known("srun")
    if options is not None and "container-image" not in options:
        return ("warning", "container runtime pyxis: `srun --help` here lists no --container-image (no pyxis "
                "plugin on this machine); the compute nodes' srun must have it", "check a node: srun -N1 --help")
    return "ok", "container runtime pyxis: srun --container-image", None


def refuse_missing_runtime(spec: JobSpec, which: Callable[[str], str | None]) -> None:
    """Where the ranks run on this machine, its runtime must be here: a UserError (exit 2) otherwise."""
    c = spec.container
    command = runtime_command(c) if c is not None else None
    if c is not None and command is not None and which(command) is None:
        raise UserError(f"--container {c.runtime}: no {command} on PATH here, and the local executor runs the ranks "
                        "on this machine", hint=f"install {c.runtime} here (Debian: apt-get install "
                        f"{'charliecloud-runtime' if c.runtime == 'charliecloud' else c.runtime}), or submit with "
                        "--executor sbatch")
