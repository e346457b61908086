"""make test leaves out the tests marked `extended` unless HPC_DDP_TEST_EXTENDED=1, and CI sets it, so every
test still runs before anything lands (tests/run-lanes.sh, .ci/run, CONTRIBUTING.md "Where the time goes")."""
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _collected(*args: str) -> set[str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *args, "tests/e2e/test_resume.py"],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode in (0, 5), done.stdout[-2000:] + done.stderr[-2000:]   # 5: none collected
    return {line for line in done.stdout.splitlines() if "::" in line}


def test_skip_extended_leaves_out_exactly_the_marked_cases():
    every, default = _collected(), _collected("--skip-extended")
    assert default < every
    assert {re.sub(r".*\[|\]$", "", t) for t in every - default} == \
        {"right_before_a_checkpoint-9", "right_after_a_checkpoint-11"}
    assert _collected("--skip-extended", "-m", "extended") == set()


def test_make_test_skips_them_by_default_and_ci_runs_them():
    lanes = (REPO / "tests" / "run-lanes.sh").read_text()
    assert 'EXTENDED=${HPC_DDP_TEST_EXTENDED:-0}' in lanes
    assert '[ "$EXTENDED" = 1 ] || PYTEST+=(--skip-extended)' in lanes
    # every pytest of make test (both lanes, the versions lane) is started from PYTEST, so the flag reaches all
    assert lanes.count("-m pytest") == 1 and lanes.count('"${PYTEST[@]}"') >= 3
    ci = re.sub(r"\\\n\s*", "", (REPO / ".ci" / "run").read_text())   # continued lines joined
    assert re.search(r"^HPC_DDP_TEST_EXTENDED=1 .*make test$", ci, re.MULTILINE), ci
