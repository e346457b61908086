"""Preflight: sinfo parsing and each check on canned clusters (pure), then `doctor` and `submit` through
the CLI with fake sinfo/sbatch on PATH."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from hpc_ddp.checks.preflight import Host, check, job_paths, parse_mounts, run_preflight, sbatch_test_only
from hpc_ddp.cli import cli
from hpc_ddp.common.procs import Completed, FakeCommands
from hpc_ddp.slurm.cluster import Cluster, Node, Partition, gres_gpus, mem_mb, parse_sinfo
from hpc_ddp.spec.jobspec import Layer, Target, build_spec

# Like the test Slurm (tests/cluster/slurm-up.sh), with a third partition: a GPU node with a typed gres,
# a drained one, a CPU-only node and a node that is not responding.
SINFO = """\
debug*|up|infinite|hpcn1|idle|4|4000|gpu:2
short|up|10:00|hpcn1|idle|4|4000|gpu:2
debug*|up|infinite|hpcn2|mix|4|4000|gpu:2
short|up|10:00|hpcn2|mix|4|4000|gpu:2
gpu|up|2-00:00:00|g001|alloc|64|515000|gpu:a100:4(S:0-1),shard:8
gpu|up|2-00:00:00|g002|drain|64|515000|gpu:a100:4(S:0-1)
gpu|up|2-00:00:00|g003|idle*|64|515000|gpu:a100:2,gpu:v100:2
cpu|down|UNLIMITED|c1|idle|128|256000|(null)
"""
CLUSTER = parse_sinfo(SINFO)
QUIET = Host({}, (("/", "nfs4"),))


def spec(**values):
    target = values.pop("target", Target("script", "/home/ada/train.py"))
    return build_spec([Layer("test", values)], target=target, workdir="/home/ada", python="python")


def levels(findings, level="error"):
    return [f.message for f in findings if f.level == level]


def hints(findings):
    return [f.hint for f in findings if f.level == "error"]


# ---- parsing ----

def test_parse_sinfo_partitions_nodes_and_limits():
    assert [p.name for p in CLUSTER.partitions] == ["debug", "cpu", "gpu", "short"]  # the default first
    debug, short, gpu, cpu = (CLUSTER.get(n) for n in ("debug", "short", "gpu", "cpu"))
    assert CLUSTER.default == debug and debug.max_time is None and cpu.max_time is None
    assert short.max_time == 600 and gpu.max_time == 2 * 86400 and not short.default
    assert [n.name for n in debug.nodes] == ["hpcn1", "hpcn2"]
    assert debug.nodes[0] == Node("hpcn1", "idle", 4, 4000, 2, "gpu:2")
    assert [n.usable for n in gpu.nodes] == [True, False, False] and cpu.state == "down"
    assert [n.gpus for n in gpu.nodes] == [4, 4, 4] and cpu.nodes[0].gpus == 0


@pytest.mark.parametrize("gres,gpus", [
    ("gpu:2", 2), ("gpu:a100:4(S:0-1)", 4), ("gpu:a100:4(S:0,2),shard:8", 4), ("gpu:a:2,gpu:b:1", 3),
    ("(null)", 0), ("", 0), ("mps:100", 0), ("gpu", 1), ("gpu:1g.10gb:7(S:0)", 7), ("shard:gpu:2", 0),
])
def test_gres_gpus(gres, gpus):
    assert gres_gpus(gres) == gpus


def test_parse_sinfo_rejects_other_formats():
    with pytest.raises(ValueError, match="8 \\|-separated fields"):
        parse_sinfo("PARTITION AVAIL  TIMELIMIT  NODES  STATE NODELIST\n")


def test_mem_and_mounts():
    assert [mem_mb(m) for m in ("64G", "4000M", "4000", "1T", "512K", "0", None)] == \
        [65536, 4000, 4000, 1024 ** 2, 1, None, None]
    text = "/dev/vda / ext4 rw 0 0\nhome:/x /home/my\\040files nfs4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n"
    assert parse_mounts(text) == (("/", "ext4"), ("/home/my files", "nfs4"), ("/dev/shm", "tmpfs"))


# ---- the checks ----

def test_a_job_that_fits_is_ok_everywhere():
    found = check(spec(nodes=2, gpus=2, time="1:00:00"), CLUSTER, QUIET, job_paths(spec(), "/home/ada/runs/x"))
    assert levels(found) == [] and levels(found, "warning") == []
    assert "partition debug (the default; no --partition given)" in levels(found, "ok")
    assert any("2 nodes x 2 GPUs, 2 CPUs fit partition debug (2 of 2 nodes" in m for m in levels(found, "ok"))


@pytest.mark.parametrize("values,error,hint", [
    ({"partition": "shrot"}, "partition 'shrot' does not exist", "did you mean short?"),
    ({"nodes": 3}, "--nodes 3: partition debug has only 2 node(s)", "use --nodes 2 or fewer"),
    ({"gpus": 4}, "--gpus 4: no node of partition debug has more than 2 GPUs", "use --gpus 2 --nodes 2 for the "
     "same 4 GPUs"),
    ({"gpus": 3}, "--gpus 3: no node of partition debug", "use --gpus 2 --nodes 2 for 4 (3 asked) GPUs"),
    ({"gpus": 4, "nodes": 2}, "--gpus 4: no node", "use --gpus 2; partition debug has 4 GPUs at most in all"),
    ({"partition": "short", "time": "20"}, "time limit 0-00:20:00 is over partition short's limit of 0-00:10:00",
     "a partition with a longer limit: debug (infinite), cpu (infinite), gpu (2-00:00:00)"),
    ({"cpus_per_task": 3, "gpus": 2}, "2 task(s) x 3 CPU(s) = 6 CPUs per node, but no node of partition debug has "
     "more than 4", "use --cpus-per-task 2 or less"),
    ({"tasks_per_node": 8}, "8 task(s) x 1 CPU(s)", "use at most 4 tasks per node"),
    ({"mem": "8G"}, "--mem 8G: no node of partition debug has more than 4000M", "--mem 0 for all of a node's"),
    ({"partition": "cpu", "gpus": 1}, "--gpus 1: partition cpu has no GPUs", "use a partition with GPUs: debug (2 "),
])
def test_requests_that_cannot_fit(values, error, hint):
    found = check(spec(**values), CLUSTER, QUIET)
    assert any(error in m for m in levels(found)), found
    assert any(hint in (h or "") for h in hints(found)), found


def test_each_resource_fits_some_node_but_not_together():
    mixed = parse_sinfo("p*|up|1:00:00|a1|idle|8|64000|gpu:4\np*|up|1:00:00|b1|idle|8|512000|gpu:1\n")
    found = check(spec(gpus=4, mem="256G"), mixed, QUIET)
    assert levels(found) == ["only 0 node(s) of partition p have 4 GPUs, 4 CPUs, 256G memory together; --nodes 1 "
                             "asked"]
    assert levels(check(spec(gpus=4, mem="32G"), mixed, QUIET)) == []


def test_down_nodes_and_partitions_make_the_job_wait_not_fail():
    found = check(spec(partition="gpu", nodes=2, gpus=2), CLUSTER, QUIET)
    assert levels(found) == []
    assert any("only 1 of the nodes of partition gpu that can take the job are up (down or drained: g002 (drain), "
               "g003 (idle*))" in m for m in levels(found, "warning")), found
    assert any("partition cpu is down" in m for m in levels(check(spec(partition="cpu"), CLUSTER, QUIET), "warning"))


def test_several_partitions_fit_if_one_does():
    assert levels(check(spec(partition="short,debug", time="30"), CLUSTER, QUIET)) == []
    found = check(spec(partition="short,debug", time="30", nodes=3), CLUSTER, QUIET)
    assert len(levels(found)) == 3  # short: time and nodes; debug: nodes


def test_no_default_partition_asks_for_one():
    cluster = Cluster(tuple(Partition(p.name, p.nodes, p.max_time) for p in CLUSTER.partitions))
    assert "no --partition given and this cluster has no default partition" in levels(check(spec(), cluster, QUIET))


@pytest.mark.parametrize("environ,warning,hint", [
    ({"SBATCH_PARTITION": "gpu"}, "SBATCH_PARTITION=gpu in your shell overrides or adds to the script's #SBATCH options",
     "unset SBATCH_PARTITION"),
    ({"SLURM_CPU_BIND": "none", "SRUN_CPUS_PER_TASK": "2"},
     "SLURM_CPU_BIND=none, SRUN_CPUS_PER_TASK=2 in your shell go into the job", "unset SLURM_CPU_BIND SRUN_CPUS"),
    ({"SLURM_JOB_ID": "77", "SLURM_NNODES": "2"}, "inside Slurm job 77 (salloc/srun): its 2 SLURM_* variables",
     "outside the allocation"),
])
def test_stray_slurm_variables_are_shown_with_the_fix(environ, warning, hint):
    found = [f for f in check(spec(), None, Host({**environ, "SLURM_CONF": "/etc/slurm.conf", "HOME": "/h"}))
             if f.level == "warning"]
    assert len(found) == 1 and warning in found[0].message and hint in found[0].hint, found
    assert "SLURM_CONF" not in found[0].message


def test_paths_the_nodes_cannot_read_are_warned_about():
    mounts = (("/", "ext4"), ("/home", "nfs4"), ("/dev/shm", "tmpfs"), ("/scratch", "tmpfs"))
    host = Host({"TMPDIR": "/local/job1"}, mounts)
    found = check(spec(), None, host, [("script", "/tmp/x/train.py"), ("run dir", "/home/ada/runs/a"),
                                       ("run dir", "/scratch/r"), ("script", "/local/job1/t.py"),
                                       ("script", "/var/tmpfoo/t.py")])
    warned = levels(found, "warning")
    assert warned[0].startswith("script /tmp/x/train.py is under /tmp, this machine's own disk")
    assert warned[1].startswith("run dir /scratch/r is on tmpfs")
    assert warned[2].startswith("script /local/job1/t.py is under /local/job1") and len(warned) == 3
    assert "run dir /home/ada/runs/a is on nfs4 mounted at /home (a network filesystem)" in levels(found, "ok")
    assert "script /var/tmpfoo/t.py is on ext4 mounted at /" in levels(found, "ok")


def test_job_paths_by_target():
    assert job_paths(spec(), "/r") == [("script", "/home/ada/train.py"), ("run dir", "/r")]
    module = spec(target=Target("module", "pkg.train"))
    assert job_paths(module, "/r")[0] == ("working directory (the module is imported from it)", "/home/ada")


# ---- the edge, with fake commands ----

def fake(sinfo=SINFO, sinfo_rc=0, test_only=(0, "sbatch: Job 5 to start at now on hpcn1"), installed=None):
    handlers = {"sinfo": lambda argv: Completed(tuple(argv), sinfo_rc, sinfo, "" if not sinfo_rc else "sinfo: boom"),
                "sbatch": lambda argv: Completed(tuple(argv), test_only[0], "", test_only[1])}
    return FakeCommands(handlers, **({"installed": installed} if installed is not None else {}))


def test_run_preflight_asks_sinfo_then_sbatch_test_only():
    commands = fake()
    report = run_preflight(spec(gpus=2), commands, QUIET, test_script="#!/bin/bash\n")
    assert report.errors == () and report.cluster == CLUSTER
    assert [c[0][:2] for c in commands.calls] == [("sinfo", "--all"), ("sbatch", "--test-only")]
    assert report.findings[-1].message.startswith("sbatch --test-only accepts the job (sbatch: Job 5")


def test_sbatch_test_only_is_skipped_after_our_own_errors():
    commands = fake()
    report = run_preflight(spec(nodes=3), commands, QUIET, test_script="#!/bin/bash\n")
    assert len(report.errors) == 1 and [c[0][0] for c in commands.calls] == ["sinfo"]


@pytest.mark.parametrize("said,hint", [
    ("sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified",
     "sacctmgr show assoc"),
    ("sbatch: error: Batch job submission failed: Invalid qos specification", "pass --qos"),
    ("allocation failure: Requested node configuration is not available", "check --constraint"),
])
def test_sbatch_test_only_refusals_name_the_fix(said, hint):
    finding = sbatch_test_only(fake(test_only=(1, said)), "#!/bin/bash\n")
    assert finding.level == "error" and finding.message == f"sbatch --test-only refuses the job: {said}"
    assert hint in finding.hint


def test_an_unreadable_cluster_is_a_warning_not_a_block():
    for commands in (fake(sinfo_rc=1), fake(installed=("sbatch",)), fake(sinfo="garbage\n")):
        report = run_preflight(spec(nodes=50), commands, QUIET, test_script="#!/bin/bash\n")
        assert report.errors == () and report.cluster is None
        assert report.findings[0].message.startswith("could not read the cluster (")


# ---- the CLI: doctor, and submit's automatic preflight ----

@pytest.fixture
def project(tmp_path, monkeypatch):
    """train.py, and fake sinfo (the canned cluster above) and sbatch (records its calls) on PATH."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "sinfo.txt").write_text(SINFO)
    calls = tmp_path / "sbatch-calls"
    (bin_dir / "sinfo").write_text(f"#!/bin/bash\ncat {tmp_path / 'sinfo.txt'}\n")
    (bin_dir / "sbatch").write_text(
        f"#!/bin/bash\necho \"$*\" >> {calls}\n"
        "if [ \"$1\" = --test-only ]; then echo 'sbatch: Job 9 to start at now on hpcn1' >&2; exit 0; fi\n"
        "echo '4711;cluster'\n")
    for tool in ("sinfo", "sbatch"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("HPC_DDP_PROFILES", str(tmp_path / "profiles.toml"))
    for key in ("HPC_DDP_PROFILE", "SLURM_JOB_ID", "SLURM_JOBID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_doctor_reports_the_cluster(project):
    result = invoke("doctor")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[1].split() == ["PARTITION", "STATE", "NODES", "CPUS", "MEMORY", "GPUS", "TIME", "LIMIT", "NODELIST"]
    assert lines[2].split() == ["debug*", "up", "2", "4", "4000M", "2", "infinite", "hpcn[1-2]"]
    assert lines[4].split() == ["gpu", "up", "1/3", "64", "515000M", "4", "2-00:00:00", "g[001-003]"]
    assert "ok: sbatch --test-only accepts the job" in result.output
    assert (project / "sbatch-calls").read_text().split() == ["--test-only", "job.sbatch"]
    assert not (project / "runs").exists()


def test_doctor_flags_a_request_that_cannot_fit(project):
    result = invoke("doctor", "--gpus", "4", "train.py")
    assert result.exit_code == 2
    assert "error: --gpus 4: no node of partition debug has more than 2 GPUs HINT: use --gpus 2 --nodes 2" \
        in result.output
    assert not (project / "sbatch-calls").exists()


def test_doctor_json(project):
    result = invoke("doctor", "--json", "--partition", "short", "--time", "20")
    assert result.exit_code == 2
    out = json.loads(result.output)
    assert out["ok"] is False and out["executor"] == "sbatch"
    assert {p["name"]: p["max_time"] for p in out["partitions"]}["short"] == 600
    assert [f["level"] for f in out["findings"]].count("error") == 1


def test_submit_is_stopped_by_an_error_and_nothing_is_queued(project):
    result = invoke("submit", "--nodes", "3", "train.py")
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("hpc-ddp: error:")]
    assert errors == ["hpc-ddp: error: --nodes 3: partition debug has only 2 node(s); nothing was submitted HINT: "
                      "use --nodes 2 or fewer, or a partition with more nodes; or skip these checks with --no-preflight"]
    assert not (project / "sbatch-calls").exists() and not (project / "runs").exists()


def test_several_errors_are_all_shown_and_the_last_ends_the_command(project):
    result = invoke("submit", "--nodes", "3", "--gpus", "4", "--tasks-per-node", "1", "train.py")
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("hpc-ddp: error:")]
    assert len(errors) == 2 and "(and 1 more above); nothing was submitted" in errors[-1]
    assert not (project / "sbatch-calls").exists() and not (project / "runs").exists()


def test_submit_warns_and_goes_on(project, monkeypatch):
    monkeypatch.setenv("SBATCH_TIMELIMIT", "5")
    result = invoke("submit", "--nodes", "2", "train.py")
    assert result.exit_code == 0, result.output
    assert "hpc-ddp: warning: SBATCH_TIMELIMIT=5 in your shell overrides" in result.output
    assert "ok:" not in result.output  # submit only speaks up about problems
    assert (project / "sbatch-calls").read_text().split() == ["--parsable", "job.sbatch"]  # no --test-only


def test_no_preflight_skips_the_checks(project):
    (project / "bin" / "sinfo").write_text("#!/bin/bash\necho called >> sinfo-called\n")
    result = invoke("submit", "--no-preflight", "--nodes", "3", "train.py")
    assert result.exit_code == 0, result.output
    assert not (project / "sinfo-called").exists() and "4711" in result.output


def test_dry_run_does_not_ask_the_cluster(project):
    (project / "bin" / "sinfo").write_text("#!/bin/bash\necho called >> sinfo-called\n")
    assert invoke("submit", "--dry-run", "--nodes", "3", "train.py").exit_code == 0
    assert not (project / "sinfo-called").exists()


def test_doctor_does_not_import_torch(project):
    code = ("import sys\nfrom click.testing import CliRunner\nfrom hpc_ddp.cli import cli\n"
            "res = CliRunner().invoke(cli, ['doctor', 'train.py'])\nassert res.exit_code == 0, res.output\n"
            "print(','.join(m for m in ('torch', 'submitit') if m in sys.modules) or 'clean')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=project, timeout=60)
    assert done.stdout.strip() == "clean", done.stdout + done.stderr


def test_doctor_for_the_local_executor_checks_only_the_shell_and_the_ranks_python(project):
    result = invoke("doctor", "--executor", "local", "--nodes", "9", "train.py")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[:2] == ["executor local (as requested)",
                         "ok: no SBATCH_*, SLURM_* or SRUN_* variables in your shell change the job"]
    assert len(lines) == 3 and lines[2].startswith("ok: python ") and "imports hpc_ddp" in lines[2], lines


def test_sbatch_partition_in_the_shell_is_the_partition_checked():
    found = check(spec(gpus=2), CLUSTER, Host({"SBATCH_PARTITION": "short"}, (("/", "nfs4"),)))
    assert any(f.level == "ok" and "fit partition short" in f.message for f in found), found


def test_another_cluster_skips_the_cluster_checks():
    found = check(spec(nodes=9, sbatch_args=["--clusters=other"]), CLUSTER, QUIET)
    assert not [f for f in found if f.level == "error"]


def test_a_dataset_missing_here_is_an_error_that_no_preflight_can_skip(tmp_path):
    # A top-level directory missing here may be a mount only compute nodes have: the spec lets it through
    # (a missing path whose filesystem is visible here is refused when the spec is built, see test_staging_hostile).
    absent = "/nonexistent-hpc-ddp-mount/imgs"
    report = run_preflight(spec(datasets={"imgs": absent}), fake(), QUIET)
    assert [f.message for f in report.errors] == [f"dataset 'imgs': source {absent} does not exist on "
                                                  "this machine"]
    assert "--no-preflight" in report.errors[0].hint
