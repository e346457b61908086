"""The `hpc-ddp` group: its commands (one module per group of them) and the one place where errors
become a line and an exit code (`common.errors.report`): a UserError exits 2, any other HpcDdpError 1
with its cause, a bug 1 with "internal error". Importing this stays fast: no torch, no submitit.
"""

from __future__ import annotations

import sys

import click

from hpc_ddp import __version__
from hpc_ddp.cli import cmd_manage, cmd_submit, cmd_tools, cmd_watch
from hpc_ddp.common.errors import report

__all__ = ["cli", "main"]


class Cli(click.Group):
    """A click group that turns our errors (and click's usage errors) into one line and an exit code."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(args, prog_name or "hpc-ddp", complete_var, standalone_mode=False, **extra)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            _fail(exc.format_message(), 2)
        except click.Abort:
            _fail("aborted", 130)
        except Exception as exc:  # noqa: BLE001 - ours: one line; a bug: one line naming it
            sys.exit(report(exc))
        sys.exit(rv if isinstance(rv, int) else 0)


def _fail(message: str, code: int) -> None:
    from hpc_ddp.common import secrets

    # A usage error may quote a value the user typed.
    click.echo(f"hpc-ddp: error: {secrets.current()(message)}", err=True)
    sys.exit(code)


@click.group(cls=Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hpc-ddp")
def cli() -> None:
    """Run PyTorch DDP training on Slurm: nodes x GPUs, a correct torch.distributed environment on every
    rank, and the exact batch script shown before anything queues."""


for _group in (cmd_submit, cmd_tools, cmd_watch, cmd_manage):
    for _command in _group.COMMANDS:
        cli.add_command(_command)


def main() -> None:
    cli()
