"""What each Slurm version answered (tests/slurm/answers/VERSION, recorded on the test Slurms by
tests/cluster/record-answers.sh), read by the code that reads Slurm: the same reading on every version, and
the one difference that decides who requeues a job preempted with a GraceTime."""

import subprocess
from pathlib import Path

import pytest

from hpc_ddp.slurm import jobview
from hpc_ddp.slurm.jobstate import parse_sacct

ANSWERS = Path(__file__).parent / "answers"
VERSIONS = sorted(p.name for p in ANSWERS.iterdir() if p.is_dir())


def _read(version: str, name: str) -> str:
    return (ANSWERS / version / name).read_text()


def _as(text: str):
    return lambda argv, **_: subprocess.CompletedProcess(argv, 0, text, "")


def test_every_version_the_project_supports_is_recorded():
    assert VERSIONS == ["22.05", "24.11", "26.05"]


@pytest.mark.parametrize("version", VERSIONS)
def test_the_version_line_reads_as_the_version(version):
    major, minor = (int(x) for x in version.split("."))
    assert jobview.parse_version(_read(version, "version.txt")) == (major, minor)
    assert jobview.slurm_version(run=_as(_read(version, "version.txt"))) == (major, minor)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_preemption_reads_the_same_from_the_batch_shell(version):
    grace = jobview.parse_show_job(_read(version, "show-job-grace.txt"))
    assert jobview.outside_cause(grace, 0, None) == ("preempted", False)
    assert jobview.grace_preempted(grace, 0)
    nograce = jobview.parse_show_job(_read(version, "show-job-nograce.txt"))
    assert jobview.outside_cause(nograce, 0, "TERM") == ("preempted", True)  # Slurm requeued it already
    assert not jobview.grace_preempted(nograce, 0)
    assert jobview.preempt_mode("grace", run=_as(_read(version, "partition-grace.txt"))) == "REQUEUE"


@pytest.mark.parametrize("version", VERSIONS)
def test_who_requeues_after_a_grace_time_is_what_the_version_did(version):
    """The recorded grace job's batch script requeued nothing: its accounting shows whether Slurm did."""
    grace = jobview.parse_show_job(_read(version, "show-job-grace.txt"))
    mode = jobview.preempt_mode("grace", run=_as(_read(version, "partition-grace.txt")))
    runs = next(iter(parse_sacct(_read(version, "sacct-grace.txt")).values()))
    slurm_requeued = [r["state"] for r in runs] == ["PREEMPTED", "COMPLETED"]
    assert slurm_requeued or [r["state"] for r in runs] == ["COMPLETED"], runs
    assert jobview.requeues_after_grace(grace, 0, jobview.parse_version(_read(version, "version.txt")), mode) \
        == slurm_requeued


def test_no_slurm_requeue_assumed_where_anything_is_unknown():
    grace = jobview.parse_show_job(_read("24.11", "show-job-grace.txt"))
    assert not jobview.requeues_after_grace(grace, 0, None, "REQUEUE")
    assert not jobview.requeues_after_grace(grace, 0, (24, 11), None)
    assert not jobview.requeues_after_grace(grace, 0, (24, 11), "CANCEL")
    assert not jobview.requeues_after_grace({**grace, "Requeue": "0"}, 0, (24, 11), "REQUEUE")
    assert not jobview.requeues_after_grace(grace, 0, (23, 11), "REQUEUE")
    assert jobview.requeues_after_grace(grace, 0, (24, 5), "GANG,REQUEUE")
    assert jobview.preempt_mode("a;b", run=_as("PreemptMode=REQUEUE")) is None  # never a name we did not check
    assert jobview.preempt_mode(None) is None


@pytest.mark.parametrize("text", ["", "slurm", "slurm 9.1", "slurm 24.11.5\nslurm 22.05.8", "bash 5.2"])
def test_a_version_line_of_another_shape_is_unknown(text):
    assert jobview.parse_version(text) is None


@pytest.mark.parametrize("version", VERSIONS)
def test_accounting_and_node_states_read_the_same(version):
    for name in ("sacct-grace.txt", "sacct-nograce.txt"):
        jobs = parse_sacct(_read(version, name))
        assert len(jobs) == 1 and all(r["state"] in ("PREEMPTED", "COMPLETED") for r in next(iter(jobs.values())))
    nodes = [line.split("|") for line in _read(version, "sinfo-nodes.txt").splitlines()]
    assert nodes and all(not jobview.lost_state(state) for _, state in nodes)


def test_the_docs_version_table_names_the_recorded_builds():
    """docs/site.md's table of proven versions: one row per recorded version, with the build that answered."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "site.md").read_text()
    table = page[page.index("<!-- the version rows are checked by tests/slurm/test_answers.py"):]
    rows = [line.split("|")[1:-1] for line in table.splitlines()[3:] if line.startswith("| ")]
    rows = [[cell.strip() for cell in row] for row in rows[:len(VERSIONS) + 1] if row[0].strip()[:2].isdigit()]
    assert [row[0] for row in rows] == VERSIONS
    for version, build, proven, _ in rows:
        assert build.endswith(_read(version, "version.txt").split()[-1]), (version, build)
        assert proven[:4] == "2026", proven
