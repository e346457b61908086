"""One table of exit codes: docs/cli.md's is generated from `common.exitcodes`, and the constants the
code exits with are the table's, so neither can drift."""

from __future__ import annotations

from pathlib import Path

from hpc_ddp.common import exitcodes
from hpc_ddp.common.errors import EnvError, HpcDdpError, SpecError, SubmitError, UserError

PAGE = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
MARKER = "<!-- generated from hpc_ddp/common/exitcodes.py (markdown_table); tests/common/test_exitcodes.py compares -->"


def test_the_readme_table_is_the_codes_table():
    text = PAGE.read_text()
    assert MARKER in text, f"docs/cli.md has no exit code table under the line {MARKER}"
    after = text[text.index(MARKER) + len(MARKER):].lstrip("\n")
    table = after[:after.index("\n\n") + 1] if "\n\n" in after else after
    assert table == exitcodes.markdown_table()


def test_every_code_is_listed_once():
    codes = [e.code for e in exitcodes.TABLE]
    assert len(codes) == len(set(codes)) and codes == sorted(codes)


def test_the_code_exits_with_the_tables_codes():
    from hpc_ddp.job import attempts
    from hpc_ddp.launch.executors import foreground

    assert HpcDdpError.exit_code == SubmitError.exit_code == exitcodes.FAILED
    assert UserError.exit_code == SpecError.exit_code == EnvError.exit_code == exitcodes.USAGE
    assert attempts.NOT_ADMITTED_EXIT_CODE == exitcodes.NOT_ADMITTED
    assert attempts.RUN_COMPLETE_EXIT_CODE == exitcodes.RUN_COMPLETE
    assert foreground.CANCELLED_EXIT_CODE == exitcodes.CANCELLED
    import hpc_ddp

    assert hpc_ddp.REQUEUE_EXIT_CODE == exitcodes.REQUEUE_EXIT_CODE == 75


def test_a_rank_stopped_while_meeting_exits_with_the_tables_code():
    import signal

    # rendezvous.py imports torch; the value it uses is 128 + SIGTERM, read here from its source's rule.
    source = (Path(__file__).resolve().parents[2] / "hpc_ddp" / "trainer" / "rendezvous.py").read_text()
    assert "exit_code = 128 + signal.SIGTERM" in source and 128 + signal.SIGTERM == exitcodes.STOPPED_AT_RENDEZVOUS
