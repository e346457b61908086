"""Every exit code hpc-ddp's processes give, what each means, and the README's table of them.

The README's table is `markdown_table()`'s text, and a test compares the two, and these values with the
constants the code exits with, so none can drift. To print it:

    python -c 'from hpc_ddp.common.exitcodes import markdown_table; print(markdown_table(), end="")'

"""

from __future__ import annotations

import dataclasses

__all__ = ["OK", "FAILED", "USAGE", "NOT_ADMITTED", "RUN_COMPLETE", "REQUEUE_EXIT_CODE", "CANCELLED",
           "STOPPED_AT_RENDEZVOUS", "ExitCode", "TABLE", "markdown_table"]

OK = 0
FAILED = 1
USAGE = 2
NOT_ADMITTED = 3
RUN_COMPLETE = 4
# "Checkpointed, requeue me": the ranks saved a checkpoint at a step boundary because a stop was asked
# for (warning signal, SIGTERM). 75 is EX_TEMPFAIL from sysexits.h: a temporary failure, try again.
REQUEUE_EXIT_CODE = 75
CANCELLED = 130               # 128 + SIGINT, as a shell reports a program stopped by Ctrl-C
STOPPED_AT_RENDEZVOUS = 143   # 128 + SIGTERM, as if the signal had ended the process


@dataclasses.dataclass(frozen=True)
class ExitCode:
    code: int
    who: str       # which process exits with it
    meaning: str


TABLE = (
    ExitCode(OK, "all", "success; `doctor`: the job can run as asked"),
    ExitCode(FAILED, "all", "a failure that is not the input's: Slurm refused or is unreachable, a file could not be "
                            "written, a rank or a foreground run failed, a bug (`internal error`; "
                            "`HPC_DDP_DEBUG=1` shows the traceback)"),
    ExitCode(USAGE, "`hpc-ddp`, a rank", "a mistake in the command, job file, profile or setup (a missing extra, a "
                                         "Python without hpc_ddp): one line with a `HINT:`, nothing submitted; "
                                         "`doctor`: the job cannot run as asked"),
    ExitCode(NOT_ADMITTED, "batch script", "the requeue policy did not start this attempt (a cap reached, no "
                                           "progress, a crash at start-up); the reason is in `events.jsonl`"),
    ExitCode(RUN_COMPLETE, "`hpc_ddp.job.attempts begin`", "a job whose run already completed, in an earlier job "
                                                          "of its chain or before Slurm started it once more: "
                                                          "nothing to do (its batch script exits 0)"),
    ExitCode(REQUEUE_EXIT_CODE, "a rank", "checkpointed at a stop request: requeue me (`REQUEUE_EXIT_CODE`)"),
    ExitCode(CANCELLED, "`hpc-ddp`, a local or srun run", "interrupted by Ctrl-C; for a local or srun run, the code "
                                                          "`status` shows once it was cancelled (Ctrl-C or "
                                                          "`hpc-ddp cancel`), and `submit`'s exit code then"),
    ExitCode(STOPPED_AT_RENDEZVOUS, "a rank", "stopped by a signal while the ranks were still meeting: nothing "
                                              "trained, nothing to requeue"),
)


def markdown_table() -> str:
    rows = ["| code | who | meaning |", "|---|---|---|"]
    rows += [f"| {e.code} | {e.who} | {e.meaning} |" for e in TABLE]
    return "\n".join(rows) + "\n"
