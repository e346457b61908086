"""Containers: the setting (parsed and refused where it cannot work), each runtime's rendered job (golden
scripts, `bash -n`), the checks that look at this machine, and the run dir's copy of hpc_ddp that the ranks
import inside."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.common.errors import SpecError, UserError
from hpc_ddp.job.containersrc import ENTRY, SOURCE_DIR, ensure_source
from hpc_ddp.launch import container
from hpc_ddp.launch.render import check_custom_script, directives, runner_command, srun_options
from hpc_ddp.spec.config import spec_from_command
from hpc_ddp.spec.container import Container, parse_container
from hpc_ddp.spec.jobspec import JobSpec, Layer, Target, build_spec
from tests.launch.test_site_render import check_golden, render

GOLDEN = Path(__file__).parent / "golden"
RUN_DIR = "/scratch/ada/runs/train-1"
SIF = "/shared/images/pytorch-24.01.sif"  # not visible here (/shared does not exist): left to the nodes


def spec_of(values: dict, target: Target | None = None, workdir: str = "/home/ada/proj") -> JobSpec:
    return build_spec([Layer("command line", values, is_cli=True)],
                      target=target or Target("script", "/home/ada/proj/train.py", ("--lr", "0.1")),
                      workdir=workdir, python="/opt/venv/bin/python")


# ---- the setting ----

def test_runtime_and_image_as_a_string_or_a_table():
    assert parse_container("apptainer:" + SIF) == Container("apptainer", SIF)
    assert parse_container("pyxis:nvcr.io#nvidia/pytorch:24.01-py3") == \
        Container("pyxis", "nvcr.io#nvidia/pytorch:24.01-py3")
    table = {"runtime": "charliecloud", "image": "/img", "python": "/opt/venv/bin/python", "args": ["-b", "/data"]}
    assert parse_container(table) == Container("charliecloud", "/img", "/opt/venv/bin/python", ("-b", "/data"))
    assert parse_container("none") is None


def test_the_command_line_overrides_a_profiles_container_even_with_none():
    profile = Layer("profile 'p'", {"container": "apptainer:" + SIF})
    target = Target("script", "/t")
    spec = build_spec([profile, Layer("command line", {"container": "none"}, is_cli=True)], target=target,
                      workdir="/", python="p")
    assert spec.container is None
    assert build_spec([profile], target=target, workdir="/", python="p").container.runtime == "apptainer"
    spec = spec_of({"container": {"runtime": "podman", "image": "localhost/pt", "args": ["--shm-size=8g"]}})
    assert JobSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


@pytest.mark.parametrize("value,message", [
    ("apptainr:/x.sif", r"unknown container runtime 'apptainr' \(did you mean apptainer\?"),
    ("docker:ubuntu", "unknown container runtime 'docker'"),
    ("/x.sif", "is not RUNTIME:IMAGE"),
    ("apptainer:", "the container's image is empty"),
    ("apptainer:/x\n.sif", "control character"),
    ("shifter:docker:img#1", "an #SBATCH line cannot hold"),
    ({"runtime": "podman", "image": "x", "args": ["--env=A=$(id)"]}, "is not one plain word"),
    ({"runtime": "podman", "image": "x", "args": ["-v /a:/a"]}, "is not one plain word"),
    ({"runtime": "podman"}, "needs runtime and image"),
    ({"runtime": "podman", "image": "x", "mounts": []}, "unknown key 'mounts'"),
    (5, "expected RUNTIME:IMAGE"),
    ("podman:--privileged", "starts with '-': the runtime would read it as an option"),   # issue 30
    ("pyxis:-x", "starts with '-'"),
    ({"runtime": "podman", "image": "x", "python": "-c"}, "container's python '-c' starts with '-'"),
])
def test_bad_containers_are_refused_naming_the_flag(value, message):
    with pytest.raises(SpecError, match=message) as info:
        spec_of({"container": value})
    assert str(info.value).startswith("--container: ")


def test_an_image_path_that_surely_does_not_exist_is_refused(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "other.sif").write_text("")
    with pytest.raises(SpecError, match=r"container image .*images/pytorch.sif does not exist \(.*images has no"):
        spec_of({"container": f"apptainer:{tmp_path}/images/pytorch.sif"})
    assert spec_of({"container": "apptainer:docker://pytorch/pytorch"}).container.image == "docker://pytorch/pytorch"
    assert spec_of({"container": "podman:localhost/nothing-here"}).container.image == "localhost/nothing-here"


def test_a_relative_image_is_relative_to_the_file_or_directory_that_names_it(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "train.py").write_text("")
    (tmp_path / "sub" / "job.toml").write_text('script = "train.py"\ncontainer = "charliecloud:../img"\n')
    spec = spec_from_command(("sub/job.toml",), None, {}, cwd=tmp_path, environ={}, python="p")
    assert spec.container.image == str(tmp_path / "img")
    spec = spec_from_command(("sub/train.py",), None, {"container": "charliecloud:img"}, cwd=tmp_path, environ={},
                             python="p")
    assert spec.container.image == str(tmp_path / "img")


def test_executors_that_cannot_start_a_container_are_refused():
    with pytest.raises(SpecError, match="the submitit executor runs each rank in its own Python process"):
        spec_of({"container": "apptainer:" + SIF, "executor": "submitit"})
    with pytest.raises(SpecError, match="pyxis: that runtime starts containers through Slurm"):
        spec_of({"container": "pyxis:nvcr.io#nvidia/pytorch:24.01-py3", "executor": "local"})


# ---- each runtime's job ----

RUNTIMES = {
    "apptainer": {"container": "apptainer:" + SIF, "gpus": 4, "nodes": 2},
    "charliecloud": {"container": {"runtime": "charliecloud", "image": "/shared/images/pytorch",
                                   "python": "/opt/venv/bin/python", "args": ["-b", "/local/scratch"]}},
    "podman": {"container": "podman:localhost/pytorch:24.01", "gpus": 2},
    "pyxis": {"container": "pyxis:nvcr.io#nvidia/pytorch:24.01-py3", "gpus": 8, "nodes": 4,
              "srun_args": ["--mpi=pmix"]},
    "shifter": {"container": "shifter:docker:nersc/pytorch:ngc-23.07-v0", "gpus": 4},
}


@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
def test_golden_container_scripts(runtime):
    spec = spec_of(RUNTIMES[runtime])
    text = render(spec)
    check_golden(f"container_{runtime}.sbatch", text)
    check_custom_script(text, spec, RUN_DIR)  # our own template passes the check for custom ones


def test_every_rank_runs_the_runner_from_the_run_dirs_copy_with_the_images_python():
    inner = ["python3", f"{RUN_DIR}/{SOURCE_DIR}/{ENTRY}", f"{RUN_DIR}/spec.json"]
    words = runner_command(spec_of(RUNTIMES["apptainer"]), RUN_DIR)
    assert words == ["apptainer", "exec", "--nv", "--bind", f"/home/ada/proj,{RUN_DIR}", SIF, *inner]
    words = runner_command(spec_of(RUNTIMES["charliecloud"]), RUN_DIR)
    assert words == ["ch-run", "-b", "/home", "-b", "/scratch", "-c", "/home/ada/proj", "-b", "/local/scratch",
                     "/shared/images/pytorch", "--", "/opt/venv/bin/python", *inner[1:]]
    assert runner_command(spec_of(RUNTIMES["shifter"]), RUN_DIR) == ["shifter", *inner]
    assert runner_command(spec_of(RUNTIMES["pyxis"]), RUN_DIR) == inner
    assert "--env-host" in runner_command(spec_of(RUNTIMES["podman"]), RUN_DIR)


def test_pyxis_is_started_by_srun_and_shifter_by_an_sbatch_directive():
    spec = spec_of(RUNTIMES["pyxis"])
    assert srun_options(spec, RUN_DIR) == ["--container-image=nvcr.io#nvidia/pytorch:24.01-py3",
                                           f"--container-mounts=/home/ada/proj:/home/ada/proj,{RUN_DIR}:{RUN_DIR}",
                                           "--container-workdir=/home/ada/proj", "--mpi=pmix"]
    assert "--image=docker:nersc/pytorch:ngc-23.07-v0" in directives(spec_of(RUNTIMES["shifter"]))


def test_the_paths_shown_inside_are_the_runs_own_and_none_twice():
    spec = spec_of({"container": "apptainer:" + SIF}, target=Target("script", "/home/ada/proj/src/train.py"))
    assert container.host_paths(spec, "/home/ada/proj/runs/x") == ["/home/ada/proj"]
    spec = spec_of({"container": "apptainer:" + SIF}, target=Target("script", "/opt/code/train.py"))
    assert container.host_paths(spec, RUN_DIR) == ["/opt/code", "/home/ada/proj", RUN_DIR]


def test_the_code_snapshot_and_its_project_are_seen_inside():
    """A sweep's snapshot is beside its tasks' run dirs, and its left-out links point into the project."""
    import dataclasses

    from hpc_ddp.spec.code import Code

    spec = spec_of({"container": "apptainer:" + SIF}, target=Target("script", "/home/ada/proj/src/train.py"))
    sweep = "/scratch/ada/sweep"
    spec = dataclasses.replace(spec, code=Code("/home/ada/proj", f"{sweep}/code/abc", "abc",
                                               f"{sweep}/code/abc/src/train.py"))
    assert container.host_paths(spec, f"{sweep}/task-0") == ["/home/ada/proj", f"{sweep}/task-0", f"{sweep}/code/abc"]


def test_a_path_that_would_break_a_bind_list_is_refused():
    with pytest.raises(SpecError, match="contains ',' or ':', which apptainer's bind list cannot hold"):
        render(spec_of({"container": "apptainer:" + SIF}), run_dir="/scratch/a,b/run")


def test_a_charliecloud_image_without_the_mount_points_is_refused_before_anything_is_written(tmp_path):
    image = tmp_path / "img"
    (image / "home").mkdir(parents=True)
    spec = spec_of({"container": f"charliecloud:{image}"})
    with pytest.raises(SpecError, match=r"has no /scratch, where the run's paths are bound .*HINT: add the mount "
                                        rf"point to the image: mkdir {image}/scratch"):
        render(spec)
    (image / "scratch").mkdir()
    render(spec)


def test_a_custom_template_must_copy_hpc_ddp_for_the_container(tmp_path):
    head = "#!/bin/bash\n{% for d in directives %}#SBATCH {{ d }}\n{% endfor %}"
    body = ("{{ spec.python | q }} -m hpc_ddp.job.attempts begin x 0\nsrun {{ runner | qjoin }}\n"
            "{{ spec.python | q }} -m hpc_ddp.job.attempts end x 0 0\n")
    tpl = tmp_path / "site.j2"
    tpl.write_text(head + body)
    with pytest.raises(SpecError, match="does not run `-m hpc_ddp.job.containersrc`"):  # no line copies it
        render(spec_of({"template": str(tpl), "container": "apptainer:" + SIF}))


# ---- what this machine can tell ----

def test_a_runtime_missing_here_is_a_warning_for_queued_jobs_and_refused_for_local_ones():
    spec = spec_of(RUNTIMES["apptainer"])
    level, message, hint = container.runtime_finding(spec, lambda _: None, lambda _: None)
    assert level == "warning" and "no apptainer on PATH here (login nodes often lack it)" in message
    assert container.runtime_finding(spec, lambda c: f"/usr/bin/{c}", lambda _: None)[0] == "ok"
    with pytest.raises(UserError, match="no apptainer on PATH here, and the local executor runs the ranks"):
        container.refuse_missing_runtime(spec, lambda _: None)
    container.refuse_missing_runtime(spec, lambda c: f"/usr/bin/{c}")


def test_pyxis_is_looked_for_in_srun_help():
    spec = spec_of(RUNTIMES["pyxis"])
    assert container.runtime_finding(spec, lambda _: None, lambda _: frozenset({"container-image"}))[0] == "ok"
    level, message, _ = container.runtime_finding(spec, lambda _: None, lambda _: frozenset({"mpi"}))
    assert level == "warning" and "lists no --container-image" in message


# ---- the run dir's copy of hpc_ddp ----

def test_the_copy_is_made_once_and_replaced_when_hpc_ddp_changes(tmp_path):
    entry = ensure_source(tmp_path)
    src = tmp_path / SOURCE_DIR
    assert entry == src / ENTRY and (src / "hpc_ddp" / "job" / "runner.py").is_file()
    assert not list(src.rglob("__pycache__")) and not (src / "templates").exists()
    before = (src / ".source-sha256").stat().st_mtime_ns
    ensure_source(tmp_path)
    assert (src / ".source-sha256").stat().st_mtime_ns == before  # unchanged: kept
    (src / ".source-sha256").write_text("stale")
    ensure_source(tmp_path)
    assert (src / ".source-sha256").read_text() != "stale"
    assert sorted(p.name for p in tmp_path.iterdir()) == [SOURCE_DIR]  # nothing left beside it


def test_the_runner_needs_nothing_but_python_from_the_copy(tmp_path):
    """Started as in a container (`python RUN_DIR/hpc-ddp-src/rank.py SPEC`) with no site-packages at all: it
    sets the rank's variables and execs the program, which imports the copy too."""
    script = tmp_path / "show.py"
    script.write_text("import json, os, sys\nimport hpc_ddp\nprint(json.dumps({'rank': os.environ['RANK'], "
                      "'hpc_ddp': hpc_ddp.__file__, 'pid': os.getpid()}))\n")
    spec = build_spec([Layer("c", {"nodes": 2, "container": "podman:x"})], target=Target("script", str(script)),
                      workdir=str(tmp_path), python="py")
    (tmp_path / "spec.json").write_text(json.dumps(spec.to_dict()))
    entry = ensure_source(tmp_path)
    step = {"SLURM_JOB_ID": "12", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
            "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "n[1-2]",
            "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-S", str(entry), str(tmp_path / "spec.json")], env=step, cwd="/",
                          capture_output=True, text=True, timeout=60)
    seen = json.loads(done.stdout)
    assert seen["rank"] == "1" and seen["hpc_ddp"] == str(tmp_path / SOURCE_DIR / "hpc_ddp" / "__init__.py"), \
        done.stderr


def test_the_srun_executor_runs_the_ranks_in_the_container():
    from hpc_ddp.launch.executors.srun import allocation_from_env, srun_argv

    alloc = allocation_from_env({"SLURM_JOB_ID": "184", "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_NODELIST": "g[1-4]"})
    argv = srun_argv(spec_of(RUNTIMES["pyxis"]), RUN_DIR, "184-srun-1-2", 0, alloc)
    assert "--container-image=nvcr.io#nvidia/pytorch:24.01-py3" in argv
    assert argv[-3:] == ["python3", f"{RUN_DIR}/{SOURCE_DIR}/{ENTRY}", f"{RUN_DIR}/spec.json"]
