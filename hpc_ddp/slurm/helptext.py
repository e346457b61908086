"""Which long options the installed `sbatch` and `srun` accept, read off their `--help`.

A site adds options through SPANK plugins (pyxis's --container-image, Shifter's --image, ...): the tools list
them under "Options provided by plugins", with their own. `parse_help` is pure; `installed_options` is the
edge: it runs `TOOL --help` once per process for each (tool, SLURM_CONF) and returns None where the tool is
not on PATH or does not answer. Asking costs a few milliseconds, and only a spec with extra options asks.
"""

from __future__ import annotations

import os
import re

from hpc_ddp.common.errors import HpcDdpError
from hpc_ddp.common.procs import CommandRunner, SubprocessCommands

__all__ = ["parse_help", "installed_options"]

# An option's own line starts near the left margin: "  -N, --nodes=N", "      --bb=<spec>", "  -B  --extra-node-info".
# Descriptions are indented far deeper, so "--mem >= --mem-per-cpu if ..." there is not taken for an option.
_OPTION_LINE = re.compile(r"^[ \t]{0,8}(?:-[A-Za-z0-9],?[ \t]+)?--([a-z][a-z0-9_-]*)", re.MULTILINE)

_CACHE: dict[tuple[str, str], frozenset[str] | None] = {}


def parse_help(text: str) -> frozenset[str]:
    """The long option names (without `--`) that a Slurm command's --help lists."""
    return frozenset(_OPTION_LINE.findall(text))


def installed_options(tool: str, commands: CommandRunner | None = None,
                      slurm_conf: str | None = None) -> frozenset[str] | None:
    """The long options `tool` (sbatch, srun) accepts here, its plugins' included; None when it is not on
    PATH or its --help fails. Cached per path and SLURM_CONF (which names the plugin stack)."""
    commands = commands or SubprocessCommands()
    path = commands.which(tool)
    if path is None:
        return None
    conf = os.environ.get("SLURM_CONF", "") if slurm_conf is None else slurm_conf
    key = (path, conf)
    if key not in _CACHE:
        _CACHE[key] = _ask(commands, path)
    return _CACHE[key]


def _ask(commands: CommandRunner, path: str) -> frozenset[str] | None:
    try:
        done = commands.run([path, "--help"], timeout=20)
    except HpcDdpError:
        return None
    found = parse_help(done.stdout) if done.returncode == 0 else frozenset()
    return found or None  # a --help that lists nothing is no answer
