"""A click command's parsed parameters back into the words of a command line, for the same command on
the cluster: every option given (its long name), each argument, and nargs=-1 arguments after `--` (all
arguments after `--` where one begins with '-', so that it is never read as an option)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import click

__all__ = ["words_of"]


def words_of(command: click.Command, params: Mapping[str, Any], drop: Collection[str] = ()) -> list[str]:
    """The command line that gives `command` these `params` (those named in `drop` left out)."""
    options: list[str] = []
    arguments: list[str] = []
    for param in command.params:
        name = param.name
        if name in drop or name not in params:
            continue
        value = params[name]
        if isinstance(param, click.Argument):
            if param.nargs == -1:
                arguments += ["--", *value] if value else []
            elif value is not None:
                arguments.append(str(value))
            continue
        assert isinstance(param, click.Option)
        if value is None or value == () or (param.is_flag and not param.secondary_opts and value is False):
            continue
        if value == param.default and not param.multiple:
            continue
        flag = max(param.opts, key=len)
        if param.is_flag:
            if value:
                options.append(flag)
            elif param.secondary_opts:
                options.append(max(param.secondary_opts, key=len))
            continue
        for item in (value if param.multiple else (value,)):
            options.append(f"{flag}={item}" if flag.startswith("--") else flag)
            if not flag.startswith("--"):
                options.append(str(item))
    if any(a.startswith("-") for a in arguments) and "--" not in arguments:
        # an argument that looks like an option ("-rf", "--json" as a run dir) stays an argument
        return [*options, "--", *arguments]
    return options + arguments
