"""The `hpc-ddp` group: its commands (one module per group of them), its -v/-q, its shell completion
(`completion`), and the one place where errors become a line and an exit code (`common.errors.report`):
a UserError exits 2, any other HpcDdpError 1 with its cause, a bug 1 with "internal error" (the codes:
`common.exitcodes`). Importing this stays fast: no torch, no submitit, no matplotlib.
"""

from __future__ import annotations

import sys

import click

from hpc_ddp import __version__
from hpc_ddp.cli import cmd_debug, cmd_manage, cmd_submit, cmd_tools, cmd_watch, completion
from hpc_ddp.common import verbosity
from hpc_ddp.common.errors import UserError, report
from hpc_ddp.common.exitcodes import CANCELLED, USAGE

__all__ = ["cli", "main"]

# An optional dependency a command imports when it needs it -> the extra of hpc-ddp that installs it.
EXTRAS = {"matplotlib": "plot"}


class Cli(click.Group):
    """A click group that turns our errors (and click's usage errors) into one line and an exit code."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(args, prog_name or "hpc-ddp", complete_var, standalone_mode=False, **extra)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            _fail(exc.format_message(), USAGE)
        except click.Abort:
            _fail("aborted", CANCELLED)
        except Exception as exc:  # noqa: BLE001 - ours: one line; a bug: one line naming it
            words = sys.argv[1:] if args is None else list(args)
            sys.exit(report(missing_extra(exc, next((w for w in words if not w.startswith("-")), None)) or exc))
        sys.exit(rv if isinstance(rv, int) else 0)


# What a laptop install without torch (docs/install.md) lacks on purpose: the commands that read checkpoints,
# make datasets or train say so, and where they work instead.
NOT_ON_A_LAPTOP = ("torch", "torchvision", "numpy", "submitit", "cloudpickle")


def missing_extra(exc: BaseException, command: str | None = None) -> UserError | None:
    """A command that needs an optional dependency which is not installed: one line naming the extra (or,
    for torch and what comes with it, the install that has it)."""
    top = (getattr(exc, "name", None) or "").partition(".")[0]
    if isinstance(exc, ModuleNotFoundError) and top in NOT_ON_A_LAPTOP:
        name = command if command and command.isidentifier() or (command or "").replace("-", "").isalpha() \
            else "COMMAND"
        return UserError(f"{top} is not installed here, and `hpc-ddp {name}` needs it (an install without torch "
                         "only submits and watches)",
                         hint=f"run it where your training environment is (on the cluster: ssh there and run "
                              f"hpc-ddp {name} ...), or install {top} here (pip install {top}; torch with its "
                              "matched torchvision, docs/install.md)")
    if not isinstance(exc, ModuleNotFoundError) or top not in EXTRAS:
        return None
    extra = EXTRAS[top]
    return UserError(f"{top} is not installed here, and this command draws with it (hpc-ddp's [{extra}] extra)",
                     hint=f"pip install 'hpc-ddp[{extra}]' (installed with pipx: pipx inject hpc-ddp {top})")


def _fail(message: str, code: int) -> None:
    from hpc_ddp.common import secrets
    from hpc_ddp.common.terminal import printable

    # A usage error may quote a value the user typed; a name it quotes may hold control characters.
    click.echo(f"hpc-ddp: error: {printable(secrets.current()(message)).replace(chr(10), ' ')}", err=True)
    sys.exit(code)


@click.group(cls=Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hpc-ddp")
@click.option("-v", "--verbose", is_flag=True,
              help="Say more on stderr: every command run (sbatch, squeue, ...) and the choices made.")
@click.option("-q", "--quiet", is_flag=True, help="Say nothing on stderr but warnings and errors.")
def cli(verbose: bool, quiet: bool) -> None:
    """Run PyTorch DDP training on Slurm: nodes x GPUs, a correct torch.distributed environment on every
    rank, and the exact batch script shown before anything queues.

    Shell completion (job ids, run dirs, profiles): see `hpc-ddp completion --help`.
    """
    if verbose and quiet:
        raise click.UsageError("give -v or -q, not both")
    verbosity.set_level(verbosity.VERBOSE if verbose else verbosity.QUIET if quiet else verbosity.NORMAL)


for _group in (cmd_submit, cmd_tools, cmd_watch, cmd_manage, cmd_debug):
    for _command in _group.COMMANDS:
        cli.add_command(_command)
cli.add_command(completion.completion_command)
completion.install(cli)


def main() -> None:
    cli()
