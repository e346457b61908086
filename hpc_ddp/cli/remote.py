"""`over_ssh`: a command on a run (status, logs, cancel, preempt, timeline) whose registry record says it
was submitted over ssh goes to that cluster (hpc_ddp.remote.forward) instead of looking here."""

from __future__ import annotations

import functools
import sys

import click

__all__ = ["over_ssh"]


def over_ssh(job_param: str = "job", how: str = "plain"):
    """`how`: see remote.forward.forward."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **params):
            from hpc_ddp.remote.forward import forward, remote_run

            record = remote_run(params.get(job_param))
            if record is None:
                return fn(*args, **params)
            sys.exit(forward(click.get_current_context().command, params, record, job_param, how))
        return inner
    return wrap
