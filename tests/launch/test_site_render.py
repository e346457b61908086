"""Site settings in the rendered job: extra srun options (golden scripts, `bash -n`, quoting), and the same
settings through the other executors (srun inside an allocation, submitit)."""

import shlex
import subprocess
from pathlib import Path

import pytest

from hpc_ddp.common.errors import SpecError
from hpc_ddp.launch.executors.srun import allocation_from_env, srun_argv
from hpc_ddp.launch.executors.submitit_exec import submitit_parameters
from hpc_ddp.launch.render import check_custom_script, render_sbatch
from hpc_ddp.spec.jobspec import PROFILE_KEYS, JobSpec, Layer, Target, build_spec
from tests.launch.test_render import bash_n, check_golden

GOLDEN = Path(__file__).parent / "golden"
RUN_DIR = "/scratch/ada/runs/train-1"


def spec_of(values: dict, profile: dict | None = None, target: Target | None = None) -> JobSpec:
    layers = [Layer("profile 'site'", profile, frozenset(PROFILE_KEYS))] if profile else []
    layers.append(Layer("command line", values))
    return build_spec(layers, target=target or Target("script", "/home/ada/proj/train.py", ("--lr", "0.1")),
                      workdir="/home/ada/proj", python="/opt/venv/bin/python")


def render(spec: JobSpec, run_dir: str = RUN_DIR) -> str:
    """The rendered job script, checked by `bash -n`."""
    text = render_sbatch(spec, run_dir, generated_at="2026-01-02T03:04:05", command_line="hpc-ddp submit ...")
    bash_n(text)
    return text


def srun_line(text: str) -> list[str]:
    """The ranks' srun command, as bash splits it."""
    lines = text.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("srun --kill-on-bad-exit"))
    words = shlex.split(lines[i].rstrip("\\") + " " + lines[i + 1].rstrip(" &"))
    return [w for w in words if w != '${on_nodes[@]+${on_nodes[@]}}']  # a restart's nodes (none at first)


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


# ---- per-node setup ----

def bash_words(command: str) -> list[str]:
    """The words of `command` as bash splits them (`$'...'` included), with `words` standing for the command."""
    done = subprocess.run(["bash", "-c", "words() { printf '%s\\0' \"$@\"; }; " + command], capture_output=True,
                          text=True, env={"RUN_DIR": RUN_DIR})
    return done.stdout.split("\0")[:-1]


NODE_SETUP = ["module load python/3.11", 'cp -a ~/venvs/ddp "$SLURM_TMPDIR/venv"  # once per node, not per rank',
              "echo \"it's $(hostname)\""]


def test_golden_node_setup():
    check_golden("site_node_setup.sbatch", render(spec_of({"nodes": 2, "gpus": 2, "node_setup": NODE_SETUP},
                                                          profile={"env": {"HF_HOME": "$SLURM_TMPDIR/hf"}})))


def test_the_node_setup_step_runs_the_lines_as_written_once_per_node():
    text = render(spec_of({"nodes": 3, "node_setup": NODE_SETUP}))
    line = next(ln for ln in text.splitlines() if ln.startswith('HPC_DDP_RUN_DIR="$RUN_DIR" srun'))
    words = bash_words(line.split(" || ")[0].replace(" srun ", " words srun ", 1))
    assert words[:7] == ["srun", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--label",
                         "bash"]
    assert words[7:] == ["-c", "\n".join(["set -eo pipefail", *NODE_SETUP])]
    # Before the ranks' step, which runs only when the setup succeeded.
    lines = text.splitlines()
    setup_at = lines.index(line)
    ranks_at = next(i for i, ln in enumerate(lines) if "srun --kill-on-bad-exit=1 --output" in ln)
    assert setup_at < ranks_at and '    if [ "$setup_rc" != 0 ]; then' in lines[setup_at:ranks_at]


def test_a_failed_node_setup_skips_the_ranks_and_reaches_the_policy(tmp_path):
    """Run the script's own lines with stand-ins for srun and the policy: the ranks never start, and the
    policy hears the setup's exit code."""
    text = render(spec_of({"nodes": 2, "node_setup": ["exit 7"]}), run_dir=str(tmp_path / "run"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\necho "srun ${*//$\'\\n\'/ }" >> "$CALLS"\n'
                                  'case "$*" in *--label*) exit 7;; esac\n')
    (bin_dir / "srun").chmod(0o755)
    (bin_dir / "python").write_text('#!/bin/bash\necho "policy $*" >> "$CALLS"\n')
    (bin_dir / "python").chmod(0o755)
    script = text.replace("/opt/venv/bin/python", str(bin_dir / "python"))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "CALLS": str(tmp_path / "calls"), "SLURM_JOB_ID": "5",
           "SLURM_JOB_NODELIST": "n[1-2]"}
    subprocess.run(["bash", "-c", script.replace("cd /home/ada/proj", "cd /")], env=env, capture_output=True, text=True)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["policy", "srun", "policy"]
    assert "--label" in calls[1] and calls[2].endswith(" 0 7")


def test_a_custom_template_must_run_the_node_setup(tmp_path):
    head = "#!/bin/bash\n{% for d in directives %}#SBATCH {{ d }}\n{% endfor %}"
    begin = "{{ spec.python | q }} -m hpc_ddp.job.attempts begin x 0\n"
    end = "{{ spec.python | q }} -m hpc_ddp.job.attempts end x 0 0\n"
    tpl = tmp_path / "site.j2"
    tpl.write_text(head + begin + "srun {{ runner | qjoin }}\n" + end)
    with pytest.raises(SpecError, match="does not run the per-node setup"):
        render(spec_of({"template": str(tpl), "node_setup": ["true"]}))
    tpl.write_text(head + begin + "{{ node_setup | qline }} || exit 1\nsrun {{ runner | qjoin }}\n" + end)
    spec = spec_of({"template": str(tpl), "node_setup": ["true"]})
    check_custom_script(render(spec), spec, RUN_DIR)


def test_a_secret_in_a_node_setup_line_is_refused_naming_it():
    with pytest.raises(SpecError, match=r"a node_setup line would write .* in the node_setup line"):
        render(spec_of({"node_setup": ["curl -H 'Authorization: token ghp_" + "a1B2" * 9 + "' x"]}))


def test_the_srun_executor_and_submitit_run_the_node_setup_first():
    from hpc_ddp.common import secrets
    from hpc_ddp.launch.executors.srun import plan_text

    spec = spec_of({"nodes": 2, "node_setup": ["true"], "env": ["NCCL_SOCKET_IFNAME=ib0"]})
    alloc = allocation_from_env({"SLURM_JOB_ID": "184", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[1-2]",
                                 "SLURM_STEP_ID": "0"})
    text = plan_text(spec, RUN_DIR, "184-srun-1-2", alloc, secrets.Scrubber({}))
    lines = text.splitlines()
    setup = next(i for i, ln in enumerate(lines) if "--label" in ln)
    assert "--overlap" in lines[setup] and lines[setup].endswith(" &&") and "--kill-on-bad-exit=1 --output" in \
        lines[setup + 1]
    assert 'export NCCL_SOCKET_IFNAME="ib0"' in lines
    setup_lines = submitit_parameters(spec, RUN_DIR)["setup"]
    assert setup_lines[0] == 'export NCCL_SOCKET_IFNAME="ib0"'
    assert setup_lines[-1].startswith(f"HPC_DDP_RUN_DIR={RUN_DIR} srun --nodes=2 --ntasks=2")
    assert setup_lines[-1].endswith(" || exit $?")


def test_the_local_executor_runs_the_setup_once_per_simulated_node(tmp_path, capsys):
    from hpc_ddp.launch.executors.local import node_setup, rank_envs

    spec = spec_of({"nodes": 2, "tasks_per_node": 2, "node_setup": ['echo "$HPC_DDP_RUN_DIR $TMPDIR $HF_HOME"'],
                    "env": ["HF_HOME=$TMPDIR/hf"]})
    envs = rank_envs(spec, "local-1", 20000, 0, run_dir=str(tmp_path))
    spec = JobSpec(**{**spec.__dict__, "workdir": str(tmp_path)})
    assert node_setup(spec, str(tmp_path), envs) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].startswith("[node 0] ") and out[1].startswith("[node 1] ")
    assert out[1].split()[3:] == [envs[2]["TMPDIR"], envs[2]["TMPDIR"] + "/hf"]
    failing = JobSpec(**{**spec.__dict__, "node_setup": ("exit 9",)})
    assert node_setup(failing, str(tmp_path), envs) == 9
