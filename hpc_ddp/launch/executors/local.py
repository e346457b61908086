"""The local executor: N simulated nodes x T tasks as processes on this machine, for trying things out
and for rehearsing preemption.

Each rank gets torchrun-style variables and runs the same per-rank runner as on Slurm. It behaves like
the batch script: the first rank that fails stops the others (srun --kill-on-bad-exit); signals sent to
the executor (SIGUSR2, SIGTERM, ...) are forwarded to every rank (as Slurm signals every task); and when
the ranks exit with the "checkpointed, requeue me" code, the same requeue policy as the batch script's
(`attempts`) decides whether to start it again. SIGINT (Ctrl-C, or `hpc-ddp cancel`) cancels: every rank is
asked to checkpoint and stop (SIGTERM), no attempt starts after it, and the run ends CANCELLED; a second
SIGINT, or KILL_WAIT_S without an exit, kills the ranks; a cancel during the per-node setup stops it, and
no rank starts. Each rank and each node's setup runs under a supervisor (`procs.Supervised`), in a process
group of its own: signals reach the whole group, and whatever ends it (its own exit, a failed rank, the time
limit, a cancel, the executor's death, SIGKILL included) nothing it started outlives it, not even a process
that left the group. `local.pid` records the executor's start time and command line, so a recycled pid is
never signalled. With --time, each attempt gets the warning signal `signal_lead` seconds before its limit,
SIGTERM at the limit and SIGKILL 30 s later, as on Slurm; an attempt so stopped ends `time_limit`. A SIGTERM
from outside (a preemption's; `hpc-ddp preempt --signal TERM` rehearses it) is followed, as Slurm's is, by
SIGKILL to the ranks still running KILL_WAIT_S later, and the attempt ends `preempted` and runs again: a
framework that ignores or half-handles the signal never leaves the run hanging.
Output goes to the same per-rank log files as on Slurm and, prefixed by rank, to the terminal.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

from hpc_ddp.common import rundir, secrets
from hpc_ddp.common.durable import NotRegularFile, append, appending
from hpc_ddp.common.errors import EnvError, UserError
from hpc_ddp.common.exitcodes import REQUEUE_EXIT_CODE
from hpc_ddp.common.machine import physical_gpus
from hpc_ddp.common.procs import Supervised
from hpc_ddp.common.rundir import RANK_LOG, RunDir
from hpc_ddp.job import attempts
from hpc_ddp.job.containersrc import ensure_source
from hpc_ddp.job.distenv import port_for_job
from hpc_ddp.job.ports import first_free_port, port_in_use
from hpc_ddp.job.runner import site_environment
from hpc_ddp.launch import container
from hpc_ddp.launch.executors.base import Plan, Submission, write_run_dir
from hpc_ddp.launch.executors.foreground import CANCELLED_EXIT_CODE, ForegroundControl, last_cause
from hpc_ddp.launch.executors.foreground import say as _say
from hpc_ddp.launch.render import env_exports, node_setup_command, runner_command
from hpc_ddp.launch.shellwords import bash_word, comment_text  # noqa: F401 - srun.py and tests import them here
from hpc_ddp.launch.tracefilter import Stop, TerminalFilter
from hpc_ddp.spec.jobspec import JobSpec

_GRACE_S = 10
KILL_WAIT_S = 30  # Slurm's default KillWait: SIGTERM at the limit, SIGKILL this much later
_FORWARDED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGHUP)


def simulated_gpus(node: int, gpus: int, physical: int) -> str:
    """CUDA_VISIBLE_DEVICES for simulated node `node`: its own slice of the real GPUs where there are
    enough, else the node-local ids 0..gpus-1 (as Slurm would show a real node)."""
    if physical >= gpus:
        return ",".join(str((node * gpus + j) % physical) for j in range(gpus))
    return ",".join(str(j) for j in range(gpus))


def node_scratch(run_dir: str, node: int) -> Path:
    """A short per-node temp dir (sockets in TMPDIR must fit AF_UNIX's 108-byte path limit, which a
    run dir often would not): /tmp/hpc-ddp-local-<run dir hash>/node-<k>."""
    import hashlib
    import tempfile

    tag = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / f"hpc-ddp-local-{tag}" / f"node-{node}"


def _own_scratch(path: Path) -> None:
    """Make a simulated node's local disk (in the shared /tmp, under a name anyone can work out): the
    user's alone, and refused where someone else's folder or link is already there."""
    for folder in (path.parent, path):  # each checked before anything is made inside it
        folder.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise EnvError(f"{folder} (the local executor's node-local scratch) is not a folder of yours",
                           hint="remove it, or run with another --run-dir (its name follows from the run dir)")
        if st.st_mode & 0o077:  # made by an older hpc-ddp, readable by all
            os.chmod(folder, 0o700)


MAX_RANKS = 256  # processes the local executor starts on this one machine, at most


def refuse_too_many_ranks(spec: JobSpec) -> None:
    """Every rank of a local run is a process on this machine: a size past MAX_RANKS is refused in one line,
    before anything is planned for each of them."""
    ranks = spec.most_nodes * spec.tasks_per_node
    if ranks > MAX_RANKS:
        raise UserError(f"the local executor runs every rank as a process on this machine: {spec.nodes_text} "
                        f"node(s) x {spec.tasks_per_node} = {ranks:,} processes, more than the {MAX_RANKS} it starts",
                        hint="try it on fewer simulated nodes (--nodes 2), or submit to Slurm (--executor sbatch)")


SRUN_NOT_USED = "ignore:The `srun` command is available on your system but is not used"


def rank_envs(spec: JobSpec, job_id: str, port: int, physical_gpus: int, attempt: int = 0,
              deadline: float | None = None, run_dir: str = ".") -> list[dict[str, str]]:
    envs = []
    for node in range(spec.most_nodes):
        for local in range(spec.tasks_per_node):
            env = {
                "RANK": str(node * spec.tasks_per_node + local), "LOCAL_RANK": str(local),
                "WORLD_SIZE": str(spec.most_nodes * spec.tasks_per_node), "LOCAL_WORLD_SIZE": str(spec.tasks_per_node),
                "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": str(spec.most_nodes),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "HPC_DDP_HOSTS": ",".join(["localhost"] * spec.most_nodes), "HPC_DDP_JOB_ID": job_id,
                "HPC_DDP_RESTART_COUNT": str(attempt), "HPC_DDP_LOCAL": "1",
                # Lightning says on every rank that srun "is available on your system but is not used": here
                # it is not meant to be. Filtered by its text alone; the user's own filters come after, and win.
                "PYTHONWARNINGS": ",".join(filter(None, (SRUN_NOT_USED, os.environ.get("PYTHONWARNINGS")))),
                # Each simulated node gets a node-local disk of its own, as staging expects.
                "TMPDIR": str(node_scratch(run_dir, node)),
            }
            if spec.gpus:
                env["CUDA_VISIBLE_DEVICES"] = simulated_gpus(node, spec.gpus, physical_gpus)
            if deadline is not None:
                env["HPC_DDP_DEADLINE"] = f"{deadline:.3f}"
            envs.append(env)
    return envs


# ---- the --dry-run plan: a bash script (pure) ----

PLAN_FIRST_LINE = "# hpc-ddp local plan, a bash script:"


def plan_script(spec: JobSpec, run_dir: str, job_id: str, envs: list[dict[str, str]],
                scrubber: secrets.Scrubber) -> str:
    """What `--dry-run` prints for the local executor: a bash script that, run with bash or pasted into a
    shell, writes the run dir's spec.json and starts the same rank processes, with the same environment,
    as `submit` would. Every value is one bash word (`bash_word`) and free text in comments goes through
    `comment_text`, so no value can end a line or start a command. Where a secret would show (the program's
    arguments are in spec.json), the script is withheld: masked, it would run something else."""
    head = _plan_head(spec, scrubber)
    text = "\n".join(head + _plan_body(spec, run_dir, job_id, envs)) + "\n"
    if scrubber(text) == text:
        return text
    withheld = ["(", "echo 'hpc-ddp: this plan withholds a secret (shown as ***), so it starts nothing; "
                "run hpc-ddp submit --executor local instead' >&2", "exit 2", ")"]
    return scrubber("\n".join(head + withheld) + "\n")  # comments and fixed text only: masking is safe


def _plan_head(spec: JobSpec, scrubber: secrets.Scrubber) -> list[str]:
    n = spec.most_nodes * spec.tasks_per_node
    return [
        f"{PLAN_FIRST_LINE} run it with bash (or paste it) to start the {n} rank process(es) that "
        "`hpc-ddp submit --executor local` would start, with the same environment.",
        "# Left out: what the executor adds around the ranks (per-rank log files with secrets masked, the "
        "[rank N] prefix, the --time limit, signal forwarding, requeues); as there, a failed rank stops the others.",
        f"# {spec.most_nodes} simulated node(s){' (the most of ' + spec.nodes_text + ')' if spec.nodes_max else ''} x {spec.tasks_per_node} task(s) = {n} process(es) on this machine; "
        "MASTER_PORT is where attempt 0 starts (submit takes the next free port if it is taken).",
        f"# Each rank runs: {comment_text(scrubber(spec.program()))}",
    ]


def _plan_node_setup(spec: JobSpec, envs: list[dict[str, str]]) -> list[str]:
    """The per-node setup in the plan: the site's env, then the lines once for each simulated node."""
    if not spec.node_setup:
        return []
    script = bash_word(node_setup_command(spec)[-1])
    lines = [f"export {export}" for export in env_exports(spec)]
    return lines + [f"TMPDIR={bash_word(envs[node * spec.tasks_per_node]['TMPDIR'])} HPC_DDP_RUN_DIR=\"$RUN_DIR\" "
                    f"bash -c {script} || return" for node in range(spec.most_nodes)]


def _plan_body(spec: JobSpec, run_dir: str, job_id: str, envs: list[dict[str, str]]) -> list[str]:
    """The script's commands, in a function: run as a script, its trap stops the ranks when the script is
    stopped; pasted (an interactive shell), it runs in a subshell, so its `set`, trap and variables stay
    there and no `exit` closes the shell it is pasted into."""
    q = bash_word
    python, runner = q(spec.python), " ".join(q(a) for a in runner_command(spec, run_dir))
    attempt_env = f"HPC_DDP_JOB_ID={q(job_id)}"
    spec_json = json.dumps(spec.to_dict())  # ASCII only: json escapes every control character
    body = ["set -uo pipefail", f"RUN_DIR={q(run_dir)}", f"cd -- {q(spec.workdir)} || return",
            "# spec.json: what every rank loads (the runner builds the program's argv from it); yours alone.",
            f"(umask 077 && mkdir -p -- \"$RUN_DIR/{rundir.LOGS}\" && printf '%s\\n' {q(spec_json)} > \"$RUN_DIR/{rundir.SPEC}\" "
            f"&& chmod 600 -- \"$RUN_DIR/{rundir.SPEC}\") || return",
            f"{attempt_env} {python} -m hpc_ddp.job.attempts begin \"$RUN_DIR\" 0 || return",
            "mkdir -p -- " + " ".join(q(d) for d in dict.fromkeys(env["TMPDIR"] for env in envs)) + " || return",
            *_plan_node_setup(spec, envs), "pids=() stopping=0",
            # Started with &, the ranks ignore Ctrl-C: pass it on as SIGTERM, so none is left running. Set
            # before the first rank starts: a stop while they start stops those started, and those after.
            "trap 'stopping=1; kill -TERM \"${pids[@]}\" 2>/dev/null' INT TERM HUP"]
    for env in envs:
        body += [" ".join(f"{k}={q(v)}" for k, v in env.items()) + f" {runner} &", 'pids+=("$!")']
    body += [
        '[ "$stopping" = 0 ] || kill -TERM "${pids[@]}" 2>/dev/null',
        # Polled, not `wait -n`: bash drops a rank that exits early from the job table `wait -n` reads.
        "failed=0 requeue=0",
        'while [ "${#pids[@]}" -gt 0 ]; do',
        '    for rank in "${!pids[@]}"; do',
        '        kill -0 "${pids[rank]}" 2>/dev/null && continue',
        '        wait "${pids[rank]}"; code=$?',
        "        unset 'pids[rank]'",
        f'        if [ "$code" = {REQUEUE_EXIT_CODE} ]; then requeue={REQUEUE_EXIT_CODE}',
        '        elif [ "$code" != 0 ] && [ "$failed" = 0 ]; then',
        "            failed=$code",
        '            echo "hpc-ddp: rank $rank exited with code $code; stopping the other ranks" >&2',
        '            kill -TERM "${pids[@]}" 2>/dev/null',
        "        fi",
        "    done",
        '    [ "${#pids[@]}" = 0 ] || sleep 0.2',
        "done",
        "rc=$((failed ? failed : requeue))",
        f"{attempt_env} {python} -m hpc_ddp.job.attempts end \"$RUN_DIR\" 0 \"$rc\" >/dev/null",
        'return "$rc"',
    ]
    return (["hpc_ddp_local_plan() {"] + [f"    {line}" for line in body] + ["}",
            'if [[ $- == *i* ]]; then (hpc_ddp_local_plan); else hpc_ddp_local_plan; fi'])


class LocalExecutor(ForegroundControl):
    name = "local"
    pid_name = rundir.LOCAL_PID
    ranks_here = True  # the ranks start on this machine, with spec.python: submit checks it imports hpc_ddp

    def __init__(self, *, echo: bool = True, job_id: str | None = None, **_ignored):
        self.echo = echo
        self.job_id = job_id or f"local-{os.getpid()}-{int(time.time())}"
        self.ctrl_c = _Cancel()  # SIGINTs to this process, counted while it runs the ranks

    def plan(self, spec: JobSpec, run_dir: str) -> Plan:
        refuse_too_many_ranks(spec)  # before a plan per rank is built: 100,000 of them took minutes and GBs
        # The port attempt 0 starts from (submit moves on to the next free one if it is taken).
        port = spec.master_port or port_for_job(f"{self.job_id}-0")
        envs = rank_envs(spec, self.job_id, port, physical_gpus(), run_dir=run_dir)
        container.check_image(spec, run_dir)
        return Plan("local", spec, run_dir, None,
                    summary=plan_script(spec, run_dir, self.job_id, envs, secrets.current()))

    def check(self, plan: Plan) -> None:
        """Refusals before anything is written (the snapshot included)."""
        container.refuse_missing_runtime(plan.spec, shutil.which)  # the ranks run here: so must the runtime
        refuse_missing_python(plan.spec)
        refuse_taken_debug_port(plan.spec)
        refuse_pdb_without_terminal(plan.spec, sys.stdin)

    def submit(self, plan: Plan, on_job_id=None) -> Submission:
        self.check(plan)
        if on_job_id is not None:  # before it runs: it may run for hours
            on_job_id(self.job_id)
        run_dir = write_run_dir(plan)
        spec = plan.spec
        if spec.container is not None:
            ensure_source(run_dir)
        scratch = node_scratch(str(run_dir), 0).parent
        ours = not os.path.lexists(scratch)
        try:
            return self.run_here(run_dir, lambda: self._attempts(spec, run_dir))
        finally:
            if ours:  # the simulated nodes' local disks end with the job, as a real node's job dir does
                shutil.rmtree(scratch, ignore_errors=True)

    def _attempts(self, spec: JobSpec, run_dir: Path) -> int:
        argv = runner_command(spec, str(run_dir))
        attempt = 0
        while True:
            if self.ctrl_c.requested:  # during the gap between two attempts: start no other
                return self._cancelled(run_dir, attempt, None)
            ok, reason = attempts.begin(run_dir, attempt, env={"HPC_DDP_JOB_ID": self.job_id})
            if not ok:
                _say(f"not starting attempt {attempt}: {reason}")
                return attempts.NOT_ADMITTED_EXIT_CODE
            if self.ctrl_c.requested:
                return self._cancelled(run_dir, attempt, CANCELLED_EXIT_CODE, began=True)
            log_dir = RunDir(run_dir).attempt_logs(self.job_id, attempt)
            log_dir.mkdir(parents=True, exist_ok=True)
            # A port the user chose is used as given, so a taken one fails fast as it would on Slurm.
            port = spec.master_port or first_free_port(port_for_job(f"{self.job_id}-{attempt}"))
            deadline = time.time() + spec.time if spec.time else None
            envs = rank_envs(spec, self.job_id, port, physical_gpus(), attempt, deadline, str(run_dir))
            if spec.container is not None:
                envs = [{**env, **container.runtime_environment(os.environ)} for env in envs]
            for env in envs:
                _own_scratch(Path(env["TMPDIR"]))
            received: list[str] = []
            live: list[Supervised] = []  # what runs now (a node's setup, the ranks): forwarded signals go there
            with _forwarding(live, received):
                rc = node_setup(spec, str(run_dir), envs, echo=self.echo, cancel=self.ctrl_c, live=live)
                if rc == 0 and (self.ctrl_c.requested or "SIGTERM" in received):  # stopped before any rank started
                    rc = CANCELLED_EXIT_CODE if self.ctrl_c.requested else -signal.SIGTERM
                elif rc == 0:
                    rc = _run_ranks(argv, envs, log_dir, echo=self.echo, cwd=spec.workdir, live=live,
                                    timeline=_timeline(spec, deadline), cancel=self.ctrl_c, received=received,
                                    terminal_rank=spec.debug_rank if spec.debugger == "pdb" else None)
            # A cancel is a cancel whatever the exit code (a program may catch the SIGTERM and exit 0), unless
            # the run recorded its finish: one that completed all the same completed.
            if self.ctrl_c.requested and (rc != 0 or not attempts.finished_in_last_attempt(run_dir)):
                return self._cancelled(run_dir, attempt, rc, began=True)
            # A SIGTERM from outside (what Slurm sends at preemption) or at the emulated time limit is not
            # the program's failure, and an exit 0 after it is no completion, as on Slurm.
            outside = "TERM" if "SIGTERM" in received else ""
            policy_env = {"HPC_DDP_JOB_ID": self.job_id, "HPC_DDP_SHELL_SIGNAL": outside}
            if deadline is not None:
                policy_env["HPC_DDP_DEADLINE"] = f"{deadline:.3f}"
            requeue, reason = attempts.end(run_dir, attempt, rc, env=policy_env)
            if not requeue:
                if rc == REQUEUE_EXIT_CODE:
                    _say(f"checkpointed, not restarting: {reason}")
                elif rc != 0 and last_cause(run_dir) == "time_limit":
                    _say(f"stopped at the time limit, not restarting: {reason}")
                return rc
            attempt += 1
            _say(f"checkpointed at a stop request; restarting ({reason})" if rc == REQUEUE_EXIT_CODE else
                 f"attempt {attempt - 1} ended with exit code {rc} after SIG{outside}; restarting ({reason})"
                 if outside else f"restarting ({reason})")


def refuse_taken_debug_port(spec: JobSpec) -> None:
    """--debug-port N under the local executor: the rank will listen here, so a taken port is known now."""
    if spec.debug_rank is not None and spec.debugger == "debugpy" and spec.debug_port is not None \
            and port_in_use(spec.debug_port, "127.0.0.1"):
        raise UserError(f"--debug-port {spec.debug_port} is already in use on this machine",
                        hint="choose another --debug-port, or leave it out to take the first free one from 5678")


def refuse_missing_python(spec: JobSpec) -> None:
    """The ranks start `spec.python` here (outside a container): one that is not there, or cannot be run, is
    the user's to fix, said now instead of as a crash once the run dir is made."""
    if spec.container is not None:
        return
    python = spec.python
    path = os.path.join(spec.workdir, python) if os.sep in python else shutil.which(python)
    hint = "give the path of a Python that has hpc_ddp installed (e.g. --python .venv/bin/python), or leave " \
           "--python out to use the one running hpc-ddp"
    if path is None or not os.path.isfile(path):
        raise UserError(f"--python {python}: no such program" + ("" if os.sep in python else " on PATH"), hint=hint)
    if not os.access(path, os.X_OK):
        raise UserError(f"--python {python} is not executable", hint=hint)


def refuse_pdb_without_terminal(spec: JobSpec, stdin) -> None:
    """--pdb gives the rank this terminal: with none (stdin a file, a pipe, /dev/null) pdb reads end-of-file
    at its first prompt and quits, and the program never runs."""
    if spec.debug_rank is not None and spec.debugger == "pdb" and not (stdin is not None and stdin.isatty()):
        raise UserError("--pdb needs a terminal, and stdin is not one: pdb would quit at its first prompt and the "
                        "program would never run",
                        hint="run it from an interactive terminal, or leave --pdb out to attach an editor's "
                             "debugger to --debug-rank (debugpy)")


def node_setup(spec: JobSpec, run_dir: str, envs: list[dict[str, str]], echo: bool = True,
               cancel: "_Cancel | None" = None, live: list[Supervised] | None = None) -> int:
    """The per-node setup, once for each simulated node (with that node's TMPDIR), before its ranks start;
    its lines echoed as `[node k]`. The first failure ends it: its exit code (0: all ran, or none to run).
    Each node's setup is a supervised group (in `live` while it runs): what it starts in the background ends
    with it, as with the step that runs it on Slurm. A cancel stops it, and no other node's starts."""
    if not spec.node_setup:
        return 0
    script = node_setup_command(spec)[-1]  # the lines as one bash script, as the Slurm step runs them
    cancel = cancel or _Cancel()
    live = live if live is not None else []
    for node in range(spec.most_nodes):
        if cancel.requested:
            return CANCELLED_EXIT_CODE
        env = {**os.environ, "TMPDIR": envs[node * spec.tasks_per_node]["TMPDIR"], "HPC_DDP_RUN_DIR": run_dir}
        env.update(site_environment(spec, env))  # $TMPDIR in a value is this node's
        proc = Supervised(["bash", "-c", script], grace=_GRACE_S, env=env, cwd=spec.workdir,
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        live[:] = [proc]
        echoing = threading.Thread(target=_echo_setup, args=(proc, node, echo, secrets.current()), daemon=True)
        echoing.start()
        rc = _wait_setup(proc, cancel)
        echoing.join(timeout=5)
        live.clear()
        if rc:
            _say(f"the per-node setup {'was stopped' if cancel.requested else 'failed'} on simulated node {node} "
                 f"(exit code {rc}); the ranks were not started")
            return rc
    return 0


def _echo_setup(proc: subprocess.Popen, node: int, echo: bool, scrubber: secrets.Scrubber) -> None:
    """One node's setup output, secrets masked, each line as `[node k] LINE`."""
    raw = (line.decode("utf-8", "replace") for line in iter(proc.stdout.readline, b""))
    for line in scrubber.lines(raw):
        if echo:
            sys.stdout.write(f"[node {node}] {line}")
            sys.stdout.flush()


def _wait_setup(proc: Supervised, cancel: "_Cancel") -> int:
    """Wait for one node's setup. A cancel stops it: SIGTERM to its group, then SIGKILL to all it started at a
    second cancel or KILL_WAIT_S later."""
    acted, killed = 0, False
    while proc.poll() is None:
        if cancel.count != acted:
            acted = cancel.count
            _say("cancelling: stopping the per-node setup" if acted == 1 else "cancelling: killing the per-node setup")
            _signal_group(proc, signal.SIGTERM if acted == 1 else signal.SIGKILL)
        if cancel.at is not None and not killed and time.monotonic() > cancel.at + KILL_WAIT_S:
            killed = True
            _say(f"cancelling: the per-node setup still runs {KILL_WAIT_S} s after the cancel; killing it")
            _signal_group(proc, signal.SIGKILL)
        time.sleep(0.05)
    return proc.returncode


class _Cancel:
    """SIGINT (Ctrl-C, `hpc-ddp cancel`) counted by a handler that only counts: the wait loop acts on it
    (a handler that signals or prints could interrupt the main thread in the middle of the same work)."""

    def __init__(self):
        self.count = 0
        self.at: float | None = None

    @property
    def requested(self) -> bool:
        return self.count > 0

    def __call__(self, _signum=None, _frame=None) -> None:
        self.count += 1
        self.at = self.at or time.monotonic()

    def install(self):
        """The previous SIGINT handler, or None where handlers cannot be set (not the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        return signal.signal(signal.SIGINT, self)


def _timeline(spec: JobSpec, deadline: float | None) -> list[tuple[float, int]]:
    """(when, signal) pairs that emulate Slurm's time limit for one attempt."""
    if deadline is None:
        return []
    warning = getattr(signal, f"SIG{spec.signal}")
    return [(deadline - spec.signal_lead, warning), (deadline, signal.SIGTERM), (deadline + KILL_WAIT_S, signal.SIGKILL)]




def _check_logs(log_dir: Path, ranks: int) -> None:
    """Each rank's log can be appended to: a regular file or none yet, never a link planted there (its
    target is not written), a FIFO or a folder; refused before any rank starts."""
    for rank in range(ranks):
        path = log_dir / RANK_LOG.format(rank=rank)
        try:
            with appending(path):
                pass
        except NotRegularFile as exc:
            raise UserError(f"{path} {exc.strerror}", hint="remove it: hpc-ddp writes the rank logs itself") from None


def _run_ranks(argv: list[str], envs: list[dict[str, str]], log_dir: Path, *, echo: bool, cwd: str,
               timeline: list[tuple[float, int]] | None = None, cancel: _Cancel | None = None,
               received: list[str] | None = None, terminal_rank: int | None = None,
               live: list[Supervised] | None = None) -> int:
    """Start every rank and wait for them. `terminal_rank` (--pdb) gets this terminal (stdin and output,
    unprefixed, so pdb's prompt shows) instead of a pump; its log file says where its output went. The ranks
    are in `live` while they run."""
    procs: list[Supervised] = []
    scrubber = secrets.current()  # built once: the pumps call it for every line
    _check_logs(log_dir, len(envs))
    try:
        for rank, extra in enumerate(envs):
            # In a session of its own, the terminal rank has no controlling terminal: it reads this one without
            # being stopped (SIGTTIN), and Ctrl-C still reaches the executor (a cancel), not pdb.
            piped = {} if rank == terminal_rank else {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
            procs.append(Supervised(argv, grace=_GRACE_S, env={**os.environ, **extra}, cwd=cwd, **piped))
    except BaseException:
        _stop(procs)  # a rank that could not start: the ones already started must not run on
        raise
    if live is not None:
        live[:] = procs
    if terminal_rank is not None:
        append(log_dir / RANK_LOG.format(rank=terminal_rank),
               f"hpc-ddp: rank {terminal_rank} ran under pdb; its output went to the terminal, not here\n")
    stop = Stop()  # a stop line on any rank: the library traces after it stay in the rank logs
    pumps = [threading.Thread(target=_pump, daemon=True,
                              args=(proc, log_dir / RANK_LOG.format(rank=rank), f"[rank {rank}] ", echo, scrubber, stop))
             for rank, proc in enumerate(procs) if rank != terminal_rank]
    for pump in pumps:
        pump.start()
    rc = _wait_all(procs, list(timeline or []), cancel or _Cancel(), received)
    for pump in pumps:
        pump.join(timeout=5)
    if live is not None:
        live.clear()
    return rc


@contextlib.contextmanager
def _forwarding(live: list[Supervised], received: list[str]):
    """Meanwhile, stop signals to the executor are passed on to the groups in `live` (a node's setup, or
    every rank, as Slurm signals every task of the step), and their names noted in `received`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum, _frame):
        received.append(signal.Signals(signum).name)
        for p in list(live):
            _signal_group(p, signum)
    previous = {signum: signal.signal(signum, forward) for signum in _FORWARDED}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _pump(proc: subprocess.Popen, log_path: Path, prefix: str, echo: bool, scrubber: secrets.Scrubber,
          stop: Stop | None = None) -> None:
    """Copy a rank's output to its log file and the terminal, secrets masked. surrogateescape keeps bytes
    that are not UTF-8 as they were in the log file."""
    raw = (line.decode("utf-8", "surrogateescape") for line in iter(proc.stdout.readline, b""))
    with contextlib.ExitStack() as stack:
        try:  # checked before the ranks started; swapped for a link since: the output is still drained
            fd: int | None = stack.enter_context(appending(log_path))
        except OSError:
            fd = None
        shown = TerminalFilter(str(log_path), stop)  # a library's trace after a stop line: the log only
        for text in scrubber.lines(raw):
            line = text.encode("utf-8", "surrogateescape")
            if fd is not None:
                os.write(fd, line)
            if echo:
                for out in shown.feed(line.decode(errors="replace")):
                    sys.stdout.write(prefix + out)
                sys.stdout.flush()
        for out in shown.close() if echo else ():
            sys.stdout.write(prefix + out)
            sys.stdout.flush()


def _wait_all(procs: list[subprocess.Popen], timeline: list[tuple[float, int]], cancel: _Cancel | None = None,
              received: list[str] | None = None) -> int:
    """Wait for every rank; when one fails, stop the rest (SIGTERM, then SIGKILL after a grace period).
    Ranks that exit with the requeue code are not failures: the others reach the same decision.
    `timeline` signals are sent to every rank when their time comes (the --time emulation); a cancel
    sends SIGTERM (checkpoint and stop), and SIGKILL at a second one or KILL_WAIT_S later."""
    cancel = cancel or _Cancel()
    first_failure, acted, killed = 0, 0, False
    outside = len(received or [])  # SIGTERMs forwarded from outside (a preemption's, `preempt --signal TERM`)
    term_at: float | None = None
    try:
        while True:
            if term_at is None and received is not None and "SIGTERM" in received[outside:]:
                term_at = time.monotonic()  # as Slurm: the stop signal, KillWait, then SIGKILL and a requeue
            if term_at is not None and not killed and time.monotonic() > term_at + KILL_WAIT_S:
                killed = True
                _say(f"ranks still running {KILL_WAIT_S} s after SIGTERM; killing them, as Slurm does after "
                     "its KillWait")
                _signal_live(procs, signal.SIGKILL)
            if cancel.count != acted:
                acted = cancel.count
                _say("cancelling: asking every rank to checkpoint and stop (Ctrl-C again to stop them at once)"
                     if acted == 1 else "cancelling: killing every rank now")
                _signal_live(procs, signal.SIGTERM if acted == 1 else signal.SIGKILL)
            if cancel.at is not None and not killed and time.monotonic() > cancel.at + KILL_WAIT_S:
                killed = True
                _say(f"cancelling: ranks still running {KILL_WAIT_S} s after the cancel; killing them")
                _signal_live(procs, signal.SIGKILL)
            while timeline and time.time() >= timeline[0][0]:
                _, signum = timeline.pop(0)
                _say(f"time limit: sending {signal.Signals(signum).name} to every rank")
                if received is not None and signum == signal.SIGTERM:
                    received.append("SIGTERM")  # the limit's stop, as Slurm's reaches the batch shell
                    outside = len(received)  # its SIGKILL is on the timeline already
                for p in procs:
                    if p.poll() is None:
                        _signal_group(p, signum)
            codes = [p.poll() for p in procs]  # poll every rank: any() would stop at the first live one
            if all(code is not None for code in codes):
                break
            failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0, REQUEUE_EXIT_CODE)]
            if failed and not first_failure:
                rank, first_failure = failed[0]
                _say(f"rank {rank} exited with code {first_failure}; stopping the other ranks")
                _stop(procs, cancel)
            time.sleep(0.05)
    except KeyboardInterrupt:  # no handler of ours (not the main thread): stop as before, counted as a cancel
        cancel()
        _stop(procs, cancel)
        return CANCELLED_EXIT_CODE
    if first_failure:
        return first_failure
    return next((c for c in codes if c not in (0, REQUEUE_EXIT_CODE)), None) or \
        (REQUEUE_EXIT_CODE if REQUEUE_EXIT_CODE in codes else 0)


def _signal_live(procs: list[subprocess.Popen], sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            _signal_group(p, sig)


def _stop(procs: list[subprocess.Popen], cancel: _Cancel | None = None) -> None:
    _signal_live(procs, signal.SIGTERM)
    deadline, asked = time.monotonic() + _GRACE_S, cancel.count if cancel else 0
    # A second cancel during the grace period ends it: the user asked for the ranks to stop at once.
    while time.monotonic() < deadline and any(p.poll() is None for p in procs) and \
            (cancel is None or cancel.count <= max(asked, 1)):
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _signal_group(proc: Supervised, sig: int) -> None:
    """`sig` to a rank's (or a setup's) group; SIGKILL to everything it started, what left the group too."""
    if sig == signal.SIGKILL:
        proc.kill_group()
    else:
        proc.signal_group(sig)
