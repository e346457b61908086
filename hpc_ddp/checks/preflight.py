"""Preflight: can this job run on this cluster as asked? Answered before anything queues.

Owns three things:
  * the submitting shell as a plain frozen value (`Host`: environment, mounts); the cluster comes from
    `cluster` (sinfo -> `Cluster` of `Partition`s of `Node`s);
  * `check(spec, cluster, host, paths)`, pure: those values -> `Finding`s, each one line with its fix;
  * `run_preflight`, the edge that gathers the values through a `CommandRunner` and calls `check`.

Without Slurm's commands on PATH there is no cluster to check: `check_fallback(spec, machine)` says that a
job would run on this machine instead, and whether the machine can hold it (as `submit` will judge it).

`hpc-ddp doctor` prints every finding and exits 2 on an error. `hpc-ddp submit` prints warnings and
refuses on errors (exit 2, nothing queued). Only `doctor` asks `sbatch --test-only` about what sinfo
cannot show (accounts, QoS, features, site limits): at `submit`, sbatch itself refuses those moments
later the same way, with nothing queued, so asking twice would only add a round trip to the controller.
We check what a node is configured with, not what is free now: a busy cluster means waiting, not a
job that can never start.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.checks.finding import Finding
from hpc_ddp.checks.frameworks import framework_notes, lightning_size_notes
from hpc_ddp.checks.scriptcheck import is_compile_finding, is_spawn_finding, script_findings
from hpc_ddp.common.errors import HpcDdpError, UserError
from hpc_ddp.common.procs import CommandRunner, slurm_unreachable
from hpc_ddp.common.rundir import SCRIPT
from hpc_ddp.job import devicescan
from hpc_ddp.job.devicescan import exposure_of, judge, scan
from hpc_ddp.launch.executors import LOAD_SLURM, Machine, fallback_problem, site_note
from hpc_ddp.slurm.cluster import Cluster, Node, Partition, Unavailable, limit_text, mem_mb, one_line, read_cluster
from hpc_ddp.slurm.slurmtime import format_time
from hpc_ddp.spec.jobspec import JobSpec, Target

__all__ = ["Host", "Finding", "Report", "NO_TARGET", "parse_mounts", "check", "check_fallback", "job_paths",
           "run_preflight", "sbatch_test_only", "gate", "doctor_report", "read_slurm_config", "requeue_mode",
           "dependency_finding", "device_findings", "gate_devices"]

_LOCAL_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
_MEMORY_FS = {"tmpfs", "ramfs"}
_NETWORK_FS = {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "ceph", "cephfs", "cifs", "smb3", "panfs", "wekafs",
               "glusterfs", "fuse.glusterfs", "fuse.sshfs", "fuse.juicefs", "afs", "9p", "virtiofs", "vast"}
# Set in a normal login shell and harmless to the job: which cluster to talk to, how to print times.
_HARMLESS_ENV = {"SLURM_CONF", "SLURM_TIME_FORMAT"}
NO_TARGET = Target("module", "hpc_ddp_doctor")  # `doctor` without TARGET: check resources only


# ---- values ----

@dataclasses.dataclass(frozen=True)
class Host:
    """The submitting shell: its environment and its mounts as (mount point, filesystem type)."""

    environ: Mapping[str, str]
    mounts: tuple[tuple[str, str], ...] = ()
    # Runs the ranks' python to ask whether it imports hpc_ddp (interpreter_check.probe); None: not asked.
    probe_python: Callable[..., Any] | None = None

    @classmethod
    def current(cls) -> Host:
        from hpc_ddp.checks.interpreter_check import probe

        try:
            mounts = parse_mounts(Path("/proc/mounts").read_text())
        except OSError:  # not Linux: no filesystem types, the path checks still run
            mounts = ()
        return cls(dict(os.environ), mounts, probe)


def _error(message: str, hint: str | None = None) -> Finding:
    return Finding("error", message, hint)


def _warning(message: str, hint: str | None = None) -> Finding:
    return Finding("warning", message, hint)


def _ok(message: str) -> Finding:
    return Finding("ok", message)


@dataclasses.dataclass(frozen=True)
class Report:
    cluster: Cluster | None
    findings: tuple[Finding, ...]

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.level == "error")

    def to_json(self) -> dict[str, Any]:
        partitions = [dataclasses.asdict(p) for p in self.cluster.partitions] if self.cluster else None
        return {"partitions": partitions, "findings": [dataclasses.asdict(f) for f in self.findings],
                "ok": not self.errors}


def parse_mounts(text: str) -> tuple[tuple[str, str], ...]:
    """/proc/mounts -> ((mount point, fs type), ...); octal escapes (`\\040` for a space) undone."""
    out = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 3:
            out.append((re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1]), fields[2]))
    return tuple(out)


# ---- the checks (pure) ----

def check(spec: JobSpec, cluster: Cluster | None, host: Host,
          paths: Sequence[tuple[str, str]] = ()) -> list[Finding]:
    """Everything we can tell without asking Slurm to schedule: `cluster` None skips the cluster checks."""
    findings = []
    if cluster is not None and not _other_cluster(spec):
        findings = check_cluster(spec, cluster, host.environ.get("SBATCH_PARTITION"))
    return findings + check_environment(host.environ) + check_paths(paths, host)


def check_fallback(spec: JobSpec, machine: Machine) -> list[Finding]:
    """No --executor and no sbatch on PATH: jobs would run on this machine. Always a warning (a user who
    forgot `module load slurm` must hear it), and an error when the machine cannot hold `spec`, since
    `submit` refuses it then."""
    gpus = f"{machine.gpus} GPU(s) visible" if machine.gpus else "no GPU visible"
    found = [_warning(f"no sbatch on PATH: jobs would run here, on this machine ({gpus}, {machine.cpus} CPU "
                      f"core(s)), not on a Slurm cluster; {site_note(machine)}`submit` runs only what this "
                      "machine can hold", hint=f"{LOAD_SLURM}; --executor local runs a job here on purpose")]
    problem = fallback_problem(spec, machine)
    if problem:
        found.append(_error(f"this machine cannot hold the job: {problem}; `submit` would refuse it",
                            hint=f"{LOAD_SLURM}, or pass --executor local to simulate it here anyway"))
    else:
        gpus_asked = f", {spec.nodes * spec.gpus} GPU(s)" if spec.gpus else ""
        found.append(_ok(f"this machine can hold the job ({spec.nodes * spec.tasks_per_node} process(es){gpus_asked})"))
    return found


def _other_cluster(spec: JobSpec) -> bool:
    # --clusters sends the job to another cluster, whose partitions our sinfo does not show.
    return any(arg.startswith(("--clusters", "--cluster=")) for arg in spec.sbatch_args)


def check_cluster(spec: JobSpec, cluster: Cluster, env_partition: str | None = None) -> list[Finding]:
    """`env_partition`: $SBATCH_PARTITION, which sbatch uses when the script names no partition."""
    if env_partition and not spec.partition:
        spec = dataclasses.replace(spec, partition=env_partition)
    partitions, findings = _requested_partitions(spec, cluster)
    if not partitions:
        return findings
    problems = {p.name: _fit(spec, p, cluster) for p in partitions}
    fitting = [p for p in partitions if not any(f.level == "error" for f in problems[p.name])]
    for p in partitions:  # a job given several partitions runs in whichever starts it: one that fits is enough
        findings += [f for f in problems[p.name] if f.level == "warning" or not fitting]
    if fitting:
        findings.append(_ok(_fits_text(spec, fitting[0])))
    return findings


def _requested_partitions(spec: JobSpec, cluster: Cluster) -> tuple[list[Partition], list[Finding]]:
    names = ", ".join(p.name for p in cluster.partitions)
    if not spec.partition:
        default = cluster.default
        if default is None:
            return [], [_error("no --partition given and this cluster has no default partition",
                               hint=f"give --partition, one of: {names}")]
        return [default], [_ok(f"partition {default.name} (the default; no --partition given)")]
    found, findings = [], []
    for name in spec.partition.split(","):
        part = cluster.get(name)
        if part is None:
            close = difflib.get_close_matches(name, [p.name for p in cluster.partitions], n=1)
            guess = f"did you mean {close[0]}? " if close else ""
            findings.append(_error(f"partition {name!r} does not exist (or is hidden from you)",
                                   hint=f"{guess}partitions here: {names}"))
        else:
            found.append(part)
    return (found, findings) if not findings else ([], findings)


def _fit(spec: JobSpec, part: Partition, cluster: Cluster) -> list[Finding]:
    """What stops `spec` from ever starting in `part` (errors), or keeps it waiting (warnings). Nodes count
    as configured, down ones included, as Slurm counts them: a down node makes a job wait, not fail."""
    found = _state_problems(part) + _time_problems(spec, part, cluster)
    if spec.nodes > len(part.nodes):
        found.append(_error(f"--nodes {spec.nodes}: partition {part.name} has only {len(part.nodes)} node(s)",
                            hint=f"use --nodes {len(part.nodes)} or fewer, or a partition with more nodes"))
    found += _resource_problems(spec, part, cluster)
    if not any(f.level == "error" for f in found):
        found += _together_problems(spec, part)
    return found


def _together_problems(spec: JobSpec, part: Partition) -> list[Finding]:
    """Each resource fits some node; do enough nodes have all of them, and are they up?"""
    fit = [n for n in part.nodes if _node_fits(spec, n)]
    if len(fit) < spec.nodes:
        return [_error(f"only {len(fit)} node(s) of partition {part.name} have {_per_node(spec)} together; "
                       f"--nodes {spec.nodes} asked",
                       hint=f"use --nodes {len(fit)} or ask for less per node" if fit else "ask for less per node")]
    up = [n for n in fit if n.usable]
    if len(up) < spec.nodes:
        down = ", ".join(f"{n.name} ({n.state})" for n in fit if not n.usable)
        return [_warning(f"only {len(up)} of the nodes of partition {part.name} that can take the job are up "
                         f"(down or drained: {down}): it waits until {spec.nodes} are",
                         hint=f"use --nodes {len(up)}, or ask the admins (`sinfo -R` says why they are down)"
                         if up else "ask the admins (`sinfo -R` says why the nodes are down)")]
    return []


def _state_problems(part: Partition) -> list[Finding]:
    if part.state.lower() == "up":
        return []
    return [_warning(f"partition {part.name} is {part.state}: jobs queue there but do not start",
                     hint="choose another partition, or ask the admins when it comes back")]


def _time_problems(spec: JobSpec, part: Partition, cluster: Cluster) -> list[Finding]:
    if spec.time is None or part.max_time is None or spec.time <= part.max_time:
        return []
    longer = [f"{p.name} ({limit_text(p.max_time)})" for p in cluster.partitions
              if p.max_time is None or p.max_time >= spec.time]
    other = f", or a partition with a longer limit: {', '.join(longer)}" if longer else ""
    return [_error(f"time limit {format_time(spec.time)} is over partition {part.name}'s limit of "
                   f"{format_time(part.max_time)}: the job would wait in the queue forever",
                   hint=f"use --time {format_time(part.max_time)} or less{other}")]


def _resource_problems(spec: JobSpec, part: Partition, cluster: Cluster) -> list[Finding]:
    nodes, found = part.nodes, []
    max_gpus = max(n.gpus for n in nodes)
    if spec.gpus > max_gpus:
        found.append(_gpu_problem(spec, part, max_gpus, cluster))
    max_cpus, need_cpus = max(n.cpus for n in nodes), _cpus_needed(spec)
    if need_cpus > max_cpus:
        fix = (f"use --cpus-per-task {max_cpus // spec.tasks_per_node} or less"
               if spec.tasks_per_node <= max_cpus else f"use at most {max_cpus} tasks per node")
        found.append(_error(f"{spec.tasks_per_node} task(s) x {spec.cpus_per_task or 1} CPU(s) = {need_cpus} CPUs "
                            f"per node, but no node of partition {part.name} has more than {max_cpus}", hint=fix))
    max_mem, need_mem = max(n.mem_mb for n in nodes), mem_mb(spec.mem)
    if need_mem and need_mem > max_mem:
        found.append(_error(f"--mem {spec.mem}: no node of partition {part.name} has more than {max_mem}M",
                            hint=f"use --mem {max_mem}M or less, or --mem 0 for all of a node's memory"))
    return found


def _gpu_problem(spec: JobSpec, part: Partition, max_gpus: int, cluster: Cluster) -> Finding:
    if max_gpus == 0:
        with_gpus = [f"{p.name} ({max(n.gpus for n in p.nodes)} per node)" for p in cluster.partitions
                     if any(n.gpus for n in p.nodes)]
        hint = f"use a partition with GPUs: {', '.join(with_gpus)}" if with_gpus else "this cluster lists no GPUs"
        return _error(f"--gpus {spec.gpus}: partition {part.name} has no GPUs", hint=hint)
    total = spec.nodes * spec.gpus
    nodes = math.ceil(total / max_gpus)
    if nodes > len(part.nodes):  # spreading the GPUs over more nodes cannot help here
        hint = f"use --gpus {max_gpus}; partition {part.name} has {len(part.nodes) * max_gpus} GPUs at most in all"
    else:
        same = f"the same {total}" if nodes * max_gpus == total else f"{nodes * max_gpus} ({total} asked)"
        hint = f"use --gpus {max_gpus} --nodes {nodes} for {same} GPUs"
    return _error(f"--gpus {spec.gpus}: no node of partition {part.name} has more than {max_gpus} GPUs", hint=hint)


def _cpus_needed(spec: JobSpec) -> int:
    return spec.tasks_per_node * (spec.cpus_per_task or 1)


def _node_fits(spec: JobSpec, node: Node) -> bool:
    need_mem = mem_mb(spec.mem) or 0
    return node.gpus >= spec.gpus and node.cpus >= _cpus_needed(spec) and node.mem_mb >= need_mem


def _per_node(spec: JobSpec) -> str:
    parts = [_count(spec.gpus, "GPU")] if spec.gpus else []
    parts.append(_count(_cpus_needed(spec), "CPU"))
    if mem_mb(spec.mem):
        parts.append(f"{spec.mem} memory")
    return ", ".join(parts)


def _fits_text(spec: JobSpec, part: Partition) -> str:
    fit = sum(_node_fits(spec, n) for n in part.nodes)
    limit = (f"time limit {format_time(spec.time)}" if spec.time else "no --time: the partition's default") + \
        f" (max {limit_text(part.max_time)})"
    return (f"{_count(spec.nodes, 'node')} x {_per_node(spec)} fit partition {part.name} ({fit} of {len(part.nodes)} "
            f"nodes can take it); {limit}")


def _count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def check_environment(environ: Mapping[str, str]) -> list[Finding]:
    """Variables in the submitting shell that silently change the job (sbatch exports the shell to it)."""
    stray = sorted(k for k in environ if k.startswith(("SBATCH_", "SLURM_", "SRUN_")) and k not in _HARMLESS_ENV)
    sbatch = [k for k in stray if k.startswith("SBATCH_")]
    others = [k for k in stray if not k.startswith("SBATCH_")]
    found = []
    if sbatch:  # sbatch(1): input environment variables override the options in the batch script
        found.append(_warning(f"{_show(sbatch, environ)} in your shell {_verb(sbatch, 'override')} or "
                              f"{_verb(sbatch, 'add')} to the script's #SBATCH options",
                              hint=f"unset {' '.join(sbatch)}"))
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if job:
        found.append(_warning(f"this shell is inside Slurm job {job} (salloc/srun): its {len(others)} SLURM_* "
                              "variables go into the new job and change its srun steps",
                              hint="submit from a login shell outside the allocation"))
    elif others:
        found.append(_warning(f"{_show(others, environ)} in your shell {_verb(others, 'go')} into the job (sbatch "
                              f"exports your environment) and {_verb(others, 'change')} its srun steps",
                              hint=f"unset {' '.join(others)}"))
    return found or [_ok("no SBATCH_*, SLURM_* or SRUN_* variables in your shell change the job")]


def _verb(keys: Sequence[str], verb: str) -> str:
    return verb if len(keys) > 1 else verb + ("es" if verb.endswith("o") else "s")


def _show(keys: Sequence[str], environ: Mapping[str, str], most: int = 4) -> str:
    shown = [f"{k}={environ[k][:30]}" for k in keys[:most]]
    return ", ".join(shown) + (f" and {len(keys) - most} more" if len(keys) > most else "")


def job_paths(spec: JobSpec, run_dir: str) -> list[tuple[str, str]]:
    """(what, path) for every path the compute nodes must read or write."""
    if spec.target == NO_TARGET:
        return []
    what = {"script": "script", "trainer": "job file"}.get(spec.target.kind)
    first = (what, spec.target.value) if what else ("working directory (the module is imported from it)",
                                                     spec.workdir)
    return [first, ("run dir", run_dir), *((f"dataset {name!r}", src) for name, src in spec.datasets)]


def check_paths(paths: Sequence[tuple[str, str]], host: Host) -> list[Finding]:
    return [_path_finding(what, path, host) for what, path in paths]


def _path_finding(what: str, path: str, host: Host) -> Finding:
    local = _under_local_dir(path, host.environ)
    mount, fstype = _mount_of(path, host.mounts)
    # A warning, not an error: on a one-machine cluster (like the test Slurm) the nodes do see it.
    if local:
        return _warning(f"{what} {path} is under {local}, this machine's own disk: compute nodes cannot "
                        "read it unless they are this machine", hint="move it to a shared filesystem "
                        "(home or project space) that every node mounts")
    if fstype in _MEMORY_FS:
        return _warning(f"{what} {path} is on {fstype} (this machine's memory): compute nodes cannot read it",
                        hint="move it to a shared filesystem (home or project space) that every node mounts")
    kind = " (a network filesystem)" if fstype in _NETWORK_FS else ""
    return _ok(f"{what} {path} is on {fstype} mounted at {mount}{kind}" if fstype else f"{what} {path}")


def _under_local_dir(path: str, environ: Mapping[str, str]) -> str | None:
    # $TMPDIR too: sites point it at node-local scratch.
    for local in (*_LOCAL_DIRS, environ.get("TMPDIR", "").rstrip("/")):
        if local and (path == local or path.startswith(local + "/")):
            return local
    return None


def _mount_of(path: str, mounts: Sequence[tuple[str, str]]) -> tuple[str, str]:
    """The mount holding `path` (the longest mount point above it); ("", "") when mounts are unknown."""
    best = ("", "")
    for point, fstype in mounts:
        inside = point == "/" or path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            best = (point, fstype)
    return best


# ---- the edge: ask Slurm, then check ----

# sbatch's refusals -> the fix (first match wins).
_REFUSAL_HINTS = [
    ("account", ("see your accounts with `sacctmgr show assoc user=$USER format=account,partition,qos` "
                 "and pass --account")),
    ("qos", "see the QOS you may use with `sacctmgr show assoc user=$USER format=account,qos` and pass --qos"),
    ("partition", "see the partitions with `sinfo -s` and pass --partition"),
    ("node configuration is not available", ("ask for less per node, or check --constraint and --sbatch-arg "
                                             "options against `sinfo -o '%P %N %c %m %G %f'`")),
    ("time limit", "lower --time (see the limits with `sinfo -s`)"),
]


def sbatch_test_only(commands: CommandRunner, script: str) -> Finding:
    """Ask sbatch whether it would queue `script` (accounts, QoS, limits we cannot see), queueing nothing."""
    with tempfile.TemporaryDirectory(prefix="hpc-ddp-preflight-") as tmp:
        Path(tmp, SCRIPT).write_text(script)
        try:
            done = commands.run(["sbatch", "--test-only", SCRIPT], cwd=tmp, timeout=30)
        except HpcDdpError as exc:
            return _warning(f"sbatch --test-only did not run: {exc.message}")
    said = one_line(done.stderr + "\n" + done.stdout)
    if done.returncode == 0:
        return _ok(f"sbatch --test-only accepts the job ({said})")
    if slurm_unreachable(said):
        return _warning(f"sbatch --test-only could not reach Slurm: {said}", hint="check `sinfo`; try again later")
    hint = next((fix for sign, fix in _REFUSAL_HINTS if sign in said.lower()), None)
    return _error(f"sbatch --test-only refuses the job: {said}", hint=hint)


def _missing_datasets(spec: JobSpec) -> list[Finding]:
    # Here, not where the spec is built: a dataset may live on a filesystem only compute nodes mount,
    # and --no-preflight must be able to let such a job through.
    return [_error(f"dataset {name!r}: source {src} does not exist on this machine",
                   hint="give a directory or an archive (.tar, .tar.gz, .zip) the compute nodes can read; if "
                        "only they mount it, use --no-preflight")
            for name, src in spec.datasets if not os.path.exists(src)]


def _container_findings(spec: JobSpec, commands: CommandRunner) -> list[Finding]:
    """Whether the container runtime is here (a warning if not: login nodes often lack it)."""
    if spec.container is None:
        return []
    from hpc_ddp.launch.container import runtime_finding
    from hpc_ddp.slurm.helptext import installed_options

    level, message, hint = runtime_finding(spec, commands.which, lambda tool: installed_options(tool, commands))
    return [Finding(level, message, hint)]


def run_preflight(spec: JobSpec, commands: CommandRunner, host: Host, *, paths: Sequence[tuple[str, str]] = (),
                  test_script: str | None = None) -> Report:
    """Read the cluster, check `spec` against it and the shell; with `test_script`, then ask sbatch too
    (only when our own checks passed: its "Requested node configuration is not available" says less)."""
    try:
        cluster: Cluster | None = read_cluster(commands, host.environ)
        findings = []
    except Unavailable as exc:
        cluster = None
        findings = [_warning(f"could not read the cluster ({exc.message}): partition, node and time-limit "
                             "checks skipped", hint="check that `sinfo` works in this shell (SLURM_CONF?)")]
    findings += check(spec, cluster, host, paths) + _missing_datasets(spec) + _container_findings(spec, commands)
    if host.probe_python is not None:
        from hpc_ddp.checks.interpreter_check import python_findings

        findings += python_findings(spec, host.environ, run_probe=host.probe_python)
    if test_script is not None and cluster is not None and not any(f.level == "error" for f in findings):
        findings.append(sbatch_test_only(commands, test_script))
    return Report(cluster, tuple(findings))


def gate(report: Report, warn: Callable[[str], None],
         skip_hint: str | None = "skip these checks with --no-preflight") -> None:
    """Before a submission: warnings are passed to `warn` and it goes on; errors stop it before anything
    queues. The last error is the exit line, so a single problem reads as one line like any other."""
    for finding in report.findings:
        if finding.level == "warning" or finding in report.errors[:-1]:
            warn(finding.line())
    if report.errors:
        last = report.errors[-1]
        more = f" (and {len(report.errors) - 1} more above)" if len(report.errors) > 1 else ""
        hints = [h for h in (last.hint, skip_hint) if h]
        raise UserError(f"{last.message}{more}; nothing was submitted", hint="; or ".join(hints) or None)


def doctor_report(spec: JobSpec, queues: bool, commands: CommandRunner, host: Host, run_dir: str) -> Report:
    """What `hpc-ddp doctor` checks: for an executor whose jobs queue, the job against the cluster (and
    sbatch --test-only), how a job that must run again gets to (sbatch), and the job an --after names;
    otherwise only the shell, and this machine when the job would land here unasked. For a multi-node job,
    also that MASTER_ADDR does not resolve to a loopback address."""
    if not queues:
        from hpc_ddp.launch.executors import probe_machine

        here = [] if spec.executor else check_fallback(spec, probe_machine())
        return Report(None, tuple(here + check(spec, None, host) + ranks_python(spec, host)
                                  + device_findings(spec, ask_ranks=True, environ=host.environ)))
    from hpc_ddp.launch.render import render_sbatch

    script = render_sbatch(spec, run_dir, generated_at="", command_line="hpc-ddp doctor")
    report = run_preflight(spec, commands, host, paths=job_paths(spec, run_dir), test_script=script)
    extra = [requeue_mode(read_slurm_config(commands), commands.which("scontrol"))] \
        if spec.executor in (None, "sbatch") else []
    extra += [dependency_finding(spec.after, commands)] if spec.after else []
    if report.cluster is not None:  # a multi-node job's MASTER_ADDR must not be loopback (checks.hostcheck)
        from hpc_ddp.checks.hostcheck import master_addr_check

        extra += [f for f in [master_addr_check(spec, report.cluster)] if f is not None]
    return Report(report.cluster, report.findings + tuple(extra + device_findings(spec, ask_ranks=True, environ=host.environ)))


def ranks_python(spec: JobSpec, host: Host) -> list[Finding]:
    """For a job whose ranks start on this machine (the local executor): that their Python imports hpc_ddp,
    the check the sbatch path's preflight makes (a rank without it dies with "Error while finding module
    specification for 'hpc_ddp.job.runner'")."""
    if host.probe_python is None:
        return []
    from hpc_ddp.checks.interpreter_check import python_findings

    return list(python_findings(spec, host.environ, run_probe=host.probe_python))


def gate_ranks_python(spec: JobSpec, warn: Callable[[str], None], dry_run: bool = False) -> None:
    """Before a local submission (and its dry run, which runs nothing: the env's files are read instead,
    `installed_findings`): an error stops it, nothing started."""
    if dry_run:
        from hpc_ddp.checks.interpreter_check import installed_findings

        found = installed_findings(spec)
    else:
        found = ranks_python(spec, Host.current())
    gate(Report(None, tuple(f for f in found if f.level != "ok")), warn, skip_hint=None)


# ---- what the script's text says (submit and doctor) ----

def device_findings(spec: JobSpec, ask_ranks: bool = False,
                    environ: Mapping[str, str] | None = None) -> list[Finding]:
    """The script read as text (nothing imported): that it compiles and what its own mp.spawn would start
    (checks/scriptcheck.py); its way of picking its GPU against the binding its ranks
    will get (job/devicescan.py), errors where it cannot give each rank its own GPU and warnings where it may
    not; and what a framework's script needs to resume after a preemption (checks/frameworks.py).
    `ask_ranks` (not in a dry run, which runs nothing): where the ranks run another Python than this one,
    its verdict on the script's bytes is the compile check's (checks/rankcompile.py)."""
    found = devicescan.source_bytes(spec.target.kind, spec.target.value, spec.workdir, limit=MAX_COMPILED)
    if found is None:
        return []
    path, data = found
    ranks = _ranks_verdict(spec, path, data, os.environ if environ is None else environ) if ask_ranks else None
    if len(data) > devicescan.MAX_SOURCE:  # compiled, as Python would; too big to be read for the rest
        return script_findings(spec, path, data, None, ranks)
    text = data.decode("utf-8", errors="replace")
    name = os.path.basename(path)
    exposure = exposure_of(spec)
    devices = [Finding(p.level, p.message, p.hint) for p in judge(scan(text), exposure, name)] if exposure else []
    return (script_findings(spec, path, data, text, ranks) + devices
            + [Finding(*note) for note in framework_notes(text, name)]
            + [Finding(*note) for note in lightning_size_notes(text, name, _most_nodes(spec), spec.tasks_per_node)])


def _most_nodes(spec: JobSpec) -> int:
    """The most nodes the job runs on: a range's MAX, else its node count."""
    return max(spec.nodes, getattr(spec, "nodes_max", None) or 0)


def _other_ranks_python(spec: JobSpec) -> bool:
    from hpc_ddp.checks.rankcompile import ranks_python_path

    return ranks_python_path(spec, os.environ) is not None


def _ranks_verdict(spec: JobSpec, path: str, data: bytes, environ: Mapping[str, str]):
    from hpc_ddp.checks import rankcompile

    python = rankcompile.ranks_python_path(spec, environ)
    return None if python is None else rankcompile.ask(python, os.path.basename(path), data, spec.workdir, environ)


MAX_COMPILED = 64 << 20  # a script bigger than this is not compiled before the queue (generated code, data)


def gate_devices(spec: JobSpec, warn: Callable[[str], None], no_preflight: bool = False,
                 dry_run: bool = False) -> None:
    """Before a submission (and its dry run, which runs nothing: the compile check is this Python's there):
    warnings go to `warn`; an error stops it, nothing queued. `no_preflight`: a refused mp.spawn is only a
    warning (its processes may not be ranks at all)."""
    found = [f for f in device_findings(spec, ask_ranks=not dry_run) if f.level != "ok"]
    if dry_run and _other_ranks_python(spec):  # this Python's verdict only; the submission asks theirs
        found = [Finding("warning", f"{f.message} (with this python; the ranks' {spec.python} is asked when it is "
                                    "submitted)", f.hint) if f.level == "error" and is_compile_finding(f) else f
                 for f in found]
    if no_preflight:
        found = [Finding("warning", f.message, f.hint) if is_spawn_finding(f) else f for f in found]
    gate(Report(None, tuple(found)), warn, skip_hint=None)


# ---- requeue and dependencies (doctor) ----

def read_slurm_config(commands: CommandRunner) -> dict[str, str] | None:
    """`scontrol show config` as {key: value}; None where scontrol is missing or does not answer."""
    if not commands.which("scontrol"):
        return None
    try:
        done = commands.run(["scontrol", "show", "config"], timeout=20)
    except HpcDdpError:
        return None
    if done.returncode != 0:
        return None
    config = {}
    for line in done.stdout.splitlines():
        key, eq, value = line.partition("=")
        if eq and key.strip() and " " not in key.strip():
            config[key.strip()] = value.strip()
    return config


def requeue_mode(config: Mapping[str, str] | None, scontrol_here: str | None) -> Finding:
    """How a job that must run again (time limit, preemption) gets to, as far as this machine can tell.

    The batch script runs `scontrol requeue` (same job id) and, where that fails (a site that refuses
    it, no scontrol on the compute node), queues the next attempt as a new job that starts when the old
    one ends. The compute nodes are not asked: that would take a job (`srun -N1 which scontrol` waits in
    the queue); the batch script finds out itself when a job must run again."""
    fallback = ("where it fails on a compute node (the site refuses, or no scontrol there), the next attempt "
                "becomes a new job that starts when the old one ends (sbatch --dependency=afterany), same run dir "
                "and caps; the nodes are not checked from here (that takes a job)")
    if not scontrol_here:
        return _warning("requeue mode: a new job per attempt (sbatch --dependency=afterany): no scontrol on PATH "
                        "here, so likely none on the compute nodes either",
                        hint="this needs sbatch on the compute nodes; if Slurm's commands are a module there, "
                             "load it in the profile's setup lines")
    requeue = (config or {}).get("JobRequeue")
    if requeue is None:
        said = "JobRequeue unknown: `scontrol show config` did not answer"
    elif requeue == "0":
        said = "JobRequeue=0: jobs requeue only when they ask, and hpc-ddp's script asks with --requeue"
    else:
        said = f"JobRequeue={requeue}: batch jobs may be requeued"
    plugins = (config or {}).get("JobSubmitPlugins", "(null)")
    if plugins not in ("(null)", ""):
        said += f"; the site's job_submit plugin ({plugins}) may still refuse it"
    return _ok(f"requeue mode: scontrol requeue ({said}; scontrol is {scontrol_here} here); {fallback}")


def dependency_finding(after: str, commands: CommandRunner) -> Finding:
    """The job an --after names: it must exist, and be able to satisfy the dependency."""
    from hpc_ddp.launch.executors.sbatch import UNKNOWN, dependency_problem, job_state

    job = after.partition(":")[2]
    state = job_state(job, commands)
    if state == UNKNOWN:
        return _warning(f"--after {job}: could not ask Slurm about the job", hint="check it with `squeue -j`")
    problem = dependency_problem(after, state)
    if problem:
        return _error(*problem)
    return _ok(f"--after {job}: job {job} is {state}; this job starts after it ({after.partition(':')[0]})")
