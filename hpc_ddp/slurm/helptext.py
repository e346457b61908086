"""Which long options the installed `sbatch` and `srun` accept, read off their `--help`.

A site adds options through SPANK plugins (pyxis's --container-image, Shifter's --image, ...): the tools list
them under "Options provided by plugins", with their own. `parse_help` is pure; `installed_options` is the
edge: it runs `TOOL --help` once per process for each (tool, SLURM_CONF) and returns None where the tool is
not on PATH. A tool that is there but whose --help fails is a broken Slurm client: that is said in one line
(exit 2), before anything is written or submitted. Asking costs a few milliseconds, and only a spec with
extra options asks.
"""

from __future__ import annotations

import os
import re

from hpc_ddp.common.errors import HpcDdpError, UserError
from hpc_ddp.common.procs import CommandRunner, SubprocessCommands

__all__ = ["parse_help", "installed_options", "BrokenTool"]


class BrokenTool(UserError):
    """sbatch or srun is on PATH, but its --help fails: it would fail the submission too."""

# An option's own line starts near the left margin: "  -N, --nodes=N", "      --bb=<spec>", "  -B  --extra-node-info".
# Descriptions are indented far deeper, so "--mem >= --mem-per-cpu if ..." there is not taken for an option.
_OPTION_LINE = re.compile(r"^[ \t]{0,8}(?:-[A-Za-z0-9],?[ \t]+)?--([a-z][a-z0-9_-]*)", re.MULTILINE)

_CACHE: dict[tuple[str, str], frozenset[str] | BrokenTool] = {}


def parse_help(text: str) -> frozenset[str]:
    """The long option names (without `--`) that a Slurm command's --help lists."""
    return frozenset(_OPTION_LINE.findall(text))


def installed_options(tool: str, commands: CommandRunner | None = None,
                      slurm_conf: str | None = None) -> frozenset[str] | None:
    """The long options `tool` (sbatch, srun) accepts here, its plugins' included; None when it is not on
    PATH. Raises BrokenTool when its --help fails. Cached per path and SLURM_CONF (which names the plugin
    stack)."""
    commands = commands or SubprocessCommands()
    path = commands.which(tool)
    if path is None:
        return None
    conf = os.environ.get("SLURM_CONF", "") if slurm_conf is None else slurm_conf
    key = (path, conf)
    if key not in _CACHE:
        _CACHE[key] = _ask(commands, tool, path)
    found = _CACHE[key]
    if isinstance(found, BrokenTool):
        raise found
    return found


def _ask(commands: CommandRunner, tool: str, path: str) -> frozenset[str] | BrokenTool:
    try:
        done = commands.run([path, "--help"], timeout=20)
    except HpcDdpError as exc:
        said = exc.message
    else:
        found = parse_help(done.stdout) if done.returncode == 0 else frozenset()
        if found:
            return found
        first = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[0][:200]
        said = f"exit code {done.returncode}: {first}" if done.returncode else f"it lists no options: {first}"
    return BrokenTool(f"{tool} is on PATH ({path}) but `{tool} --help` fails ({said}): this Slurm client would fail "
                      "the job too; nothing was submitted",
                      hint=f"check that `{tool} --version` works here (the Slurm module, SLURM_CONF), then submit again")
