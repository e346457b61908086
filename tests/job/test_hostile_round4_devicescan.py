"""Hardening round 4 (issue 43), the GPU scan (job/devicescan.py): a pick counts where it begins in code
(the one blanking of comments and strings that checks/frameworks.py uses too), and its line is the line
Python counts (a form feed or U+2028 in a comment is no line break)."""

from __future__ import annotations

import time

import pytest

from hpc_ddp.checks.frameworks import code_only as frameworks_code_only
from hpc_ddp.job.devicescan import code_only, python_lines, scan

NOT_PICKS = {
    "docstring": 'def f():\n    """Call torch.cuda.set_device(local_rank) first."""\n    return 1\n',
    "multi-line docstring": '"""\nUsage:\n    torch.cuda.set_device(local_rank)\n    model.to("cuda:0")\n"""\n',
    "string literal": 'print("torch.cuda.set_device(local_rank)")\n',
    "single-quoted": "HELP = 'use .cuda(1) or set_device(LOCAL_RANK)'\n",
    "comment": "x = 1  # set_device(local_rank)\n",
    "unterminated triple": 'x = """\nset_device(local_rank)\n',
}


@pytest.mark.parametrize("case", sorted(NOT_PICKS))
def test_a_device_call_in_a_string_or_comment_is_no_pick(case):
    assert scan(NOT_PICKS[case]) == ()


PICKS = {
    "code after a docstring": ('"""doc\nmore"""\ntorch.cuda.set_device(local_rank)\n', "local_rank", 3),
    "f-string": ("device = f'cuda:{local_rank}'\n", "local_rank", 1),
    "fixed in quotes": ('model.to("cuda:1")\n', "fixed", 1),
    "environ lookup": ('torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))\n', "local_rank", 1),
    "form feed in a comment": ("import torch\n# a\x0cb\n\x0c\ntorch.cuda.set_device(local_rank)\n", "local_rank", 4),
    "U+2028 in a comment": ("import torch\n# a\u2028b\u2029c\x1cd\x85e\ntorch.cuda.set_device(1)\n", "fixed", 3),
    "U+2028 in a string": ('s = "a\u2028b"\n\ntorch.cuda.set_device(0)\n', "fixed", 3),
    "CRLF": ("import torch\r\n\r\ntorch.cuda.set_device(local_rank)\r\n", "local_rank", 3),
    "lone CR": ("import torch\r\rtorch.cuda.set_device(local_rank)\r", "local_rank", 3),
}


@pytest.mark.parametrize("case", sorted(PICKS))
def test_picks_in_code_are_found_on_the_line_python_counts(case):
    source, kind, line = PICKS[case]
    picks = scan(source)
    assert [(p.kind, p.line) for p in picks] == [(kind, line)]
    compile(source, "t.py", "exec")  # Python reads it, and numbers its lines as the scan does
    assert code_only(source).count("\n") == len(python_lines(source)) - 1  # blanking keeps every line


def test_the_scan_and_the_framework_check_blank_the_same_way():
    assert frameworks_code_only is code_only


def test_the_scan_stays_linear_on_many_strings_and_comments():
    source = ('x = "set_device(local_rank)"  # .cuda(1)\n' * 50_000) + '"""' + "a\n" * 50_000
    started = time.monotonic()
    assert scan(source) == ()
    assert time.monotonic() - started < 20
