"""The `hpc-ddp` command (runs on the login node): thin command groups over the modules that own the logic.

    app.py          the group, and errors turned into one line and an exit code
    options.py      the job options submit, render and doctor share, and the spec they build
    cmd_submit.py   submit, render, doctor: plan a job and hand it to an executor
    cmd_watch.py    status, logs, list, timeline, plot: what a run is doing and did
    cmd_manage.py   cancel, preempt: act on a run through its executor
    cmd_tools.py    train, env, stage, inspect, make-dataset: things done on this machine
    cmd_debug.py    rerun: replay a failed attempt of a run here
    completion.py   shell completion (job ids, run dirs, profiles)
"""

from hpc_ddp.cli.app import cli, main

__all__ = ["cli", "main"]
