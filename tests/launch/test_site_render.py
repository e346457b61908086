"""Site settings in the rendered job: extra srun options (golden scripts, `bash -n`, quoting), and the same
settings through the other executors (srun inside an allocation, submitit)."""

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from hpc_ddp.common.errors import SpecError
from hpc_ddp.launch.executors.srun import allocation_from_env, srun_argv
from hpc_ddp.launch.executors.submitit_exec import submitit_parameters
from hpc_ddp.launch.render import check_custom_script, render_sbatch
from hpc_ddp.spec.jobspec import PROFILE_KEYS, JobSpec, Layer, Target, build_spec

GOLDEN = Path(__file__).parent / "golden"
RUN_DIR = "/scratch/ada/runs/train-1"


def spec_of(values: dict, profile: dict | None = None, target: Target | None = None) -> JobSpec:
    layers = [Layer("profile 'site'", profile, frozenset(PROFILE_KEYS))] if profile else []
    layers.append(Layer("command line", values))
    return build_spec(layers, target=target or Target("script", "/home/ada/proj/train.py", ("--lr", "0.1")),
                      workdir="/home/ada/proj", python="/opt/venv/bin/python")


def render(spec: JobSpec, run_dir: str = RUN_DIR) -> str:
    text = render_sbatch(spec, run_dir, generated_at="2026-01-02T03:04:05", command_line="hpc-ddp submit ...")
    done = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert done.returncode == 0, done.stderr
    return text


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; rerun with UPDATE_GOLDEN=1 if intended"


def srun_line(text: str) -> list[str]:
    """The ranks' srun command, as bash splits it."""
    lines = text.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("srun --kill-on-bad-exit"))
    return shlex.split(lines[i].rstrip("\\") + " " + lines[i + 1].rstrip(" &"))


# ---- srun options ----

SRUN_ARGS = ["--cpu-bind=cores", "--mpi=pmix", "--network=sn_all"]


def test_golden_srun_options():
    check_golden("site_srun_args.sbatch", render(spec_of({"nodes": 2, "gpus": 4, "srun_args": SRUN_ARGS},
                                                          profile={"srun_args": ["--exact"]})))


def test_srun_options_reach_the_ranks_srun_as_words():
    words = srun_line(render(spec_of({"srun_args": [*SRUN_ARGS, "--export=ALL,NCCL_DEBUG=INFO"]})))
    assert words[:3] == ["srun", "--kill-on-bad-exit=1", '--output=$LOG_DIR/rank-%t.log']
    assert words[3:7] == [*SRUN_ARGS, "--export=ALL,NCCL_DEBUG=INFO"]
    assert words[7:9] == ["/opt/venv/bin/python", "-m"]


def test_srun_options_of_the_command_line_replace_the_profiles():
    spec = spec_of({"srun_args": ["--mpi=pmix"]}, profile={"srun_args": ["--exact"]})
    assert spec.srun_args == ("--mpi=pmix",)
    assert spec_of({}, profile={"srun_args": ["--exact"]}).srun_args == ("--exact",)


def test_a_hash_in_an_srun_value_is_a_word_not_a_comment():
    image = "--container-image=nvcr.io#nvidia/pytorch:24.01-py3"
    spec = JobSpec(**{**spec_of({}).__dict__, "srun_args": (image,)})  # a plugin's option (test Slurm lacks it)
    assert image in srun_line(render(spec))


@pytest.mark.parametrize("value,message", [
    ("--mpi=pmix;id", "contains ';'"),
    ("--mpi=pmix\nid", "control character"),
    ("--cpu-bind=$(id)", r"contains '\$'"),
    ("--nodes=2", "set by hpc-ddp; use --nodes"),
    ("--output=/tmp/x", "use --run-dir"),
    ("--mpx=pmix", "not an srun option"),
])
def test_bad_srun_options_are_refused_when_the_spec_is_built(value, message):
    with pytest.raises(SpecError, match=message) as info:
        build_spec([Layer("command line", {"srun_args": [value]}, is_cli=True)], target=Target("script", "/t.py"),
                   workdir="/", python="p", options=lambda tool: frozenset({"mpi", "cpu-bind"}))
    assert str(info.value).startswith("--srun-arg: ")


def test_a_custom_template_must_pass_the_srun_options(tmp_path):
    head = "#!/bin/bash\n{% for d in directives %}#SBATCH {{ d }}\n{% endfor %}"
    begin = "{{ spec.python | q }} -m hpc_ddp.job.attempts begin x 0\n"
    end = "{{ spec.python | q }} -m hpc_ddp.job.attempts end x 0 0\n"
    tpl = tmp_path / "site.j2"
    tpl.write_text(head + begin + "srun {{ runner | qjoin }}\n" + end)
    with pytest.raises(SpecError, match="does not run the srun options"):
        render(spec_of({"template": str(tpl), "srun_args": ["--mpi=pmix"]}))
    tpl.write_text(head + begin + "srun {{ srun_options | qjoin }} {{ runner | qjoin }}\n" + end)
    spec = spec_of({"template": str(tpl), "srun_args": ["--mpi=pmix"]})
    check_custom_script(render(spec), spec, RUN_DIR)


def test_the_srun_executor_and_submitit_pass_the_srun_options():
    spec = spec_of({"nodes": 2, "srun_args": SRUN_ARGS})
    alloc = allocation_from_env({"SLURM_JOB_ID": "184", "SLURM_JOB_NUM_NODES": "2",
                                 "SLURM_JOB_NODELIST": "hpcn[1-2]"})
    argv = srun_argv(spec, RUN_DIR, "184-srun-1-2", 0, alloc)
    runner = argv.index("/opt/venv/bin/python")
    assert argv[runner - 3:runner] == SRUN_ARGS
    assert submitit_parameters(spec)["srun_args"] == SRUN_ARGS


# ---- the site environment ----

SITE_ENV = {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0", "HF_HOME": "$SLURM_TMPDIR/hf",
            "NOTE": "it's \"quoted\" `id` $(id) $$"}


def test_golden_site_env():
    check_golden("site_env.sbatch", render(spec_of({"nodes": 2, "gpus": 2, "env": ["HF_HOME=/scratch/hf"]},
                                                   profile={"env": SITE_ENV, "setup": ["module load nccl"]})))


def test_the_batch_shell_exports_each_value_as_written_with_only_references_expanded():
    text = render(spec_of({"env": SITE_ENV}))
    exports = "\n".join(ln for ln in text.splitlines() if ln.startswith("export "))
    done = subprocess.run(["bash", "-c", exports + '\nprintf "%s|" "$NCCL_SOCKET_IFNAME" "$HF_HOME" "$NOTE"'],
                          env={"SLURM_TMPDIR": "/tmp/job9", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert done.stdout == "ib0|/tmp/job9/hf|it's \"quoted\" `id` $(id) $|", done.stderr
    # Exported before the site's setup lines, so they can use them.
    lines = text.splitlines()
    assert lines.index("export NCCL_SOCKET_IFNAME=\"ib0\"") < next(i for i, ln in enumerate(lines) if "set -uo" in ln)


def test_a_secret_pasted_into_env_is_refused_naming_the_variable():
    with pytest.raises(SpecError, match=r"env WANDB_API_KEY would write .* HINT: export WANDB_API_KEY in your shell"):
        render(spec_of({"env": ["WANDB_API_KEY=ghp_" + "a1B2" * 9]}))
