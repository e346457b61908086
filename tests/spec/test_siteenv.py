"""The site environment table: names, values, hpc-ddp's own variables refused, and one expansion grammar in
Python (the runner) and bash (the batch script) that agree, checked by running bash."""

import subprocess

import pytest

from hpc_ddp.common.errors import SpecError
from hpc_ddp.spec.jobspec import PROFILE_KEYS, JobSpec, Layer, Target, build_spec
from hpc_ddp.spec.siteenv import bash_value, expand, managed_problem, parse_env


def build(*layers: Layer) -> JobSpec:
    return build_spec(list(layers), target=Target("script", "/t.py"), workdir="/", python="p")


def test_a_table_and_name_value_pairs_give_the_same_env():
    table = parse_env({"NCCL_SOCKET_IFNAME": "ib0", "OMP_NUM_THREADS": 8, "HF_HOME": "$SLURM_TMPDIR/hf"})
    pairs = parse_env(["NCCL_SOCKET_IFNAME=ib0", "OMP_NUM_THREADS=8", "HF_HOME=$SLURM_TMPDIR/hf"])
    assert table == pairs == (("NCCL_SOCKET_IFNAME", "ib0"), ("OMP_NUM_THREADS", "8"),
                              ("HF_HOME", "$SLURM_TMPDIR/hf"))
    assert parse_env(["EMPTY=", "EQ=a=b"]) == (("EMPTY", ""), ("EQ", "a=b"))


def test_layers_merge_variable_by_variable_the_higher_one_winning():
    profile = Layer("profile 'site'", {"env": {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0"}},
                    frozenset(PROFILE_KEYS))
    job = Layer("job file", {"env": {"HF_HOME": "/scratch/hf"}})
    flags = Layer("command line", {"env": ["GLOO_SOCKET_IFNAME=eth0"]}, is_cli=True)
    spec = build(profile, job, flags)
    assert dict(spec.env) == {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "eth0", "HF_HOME": "/scratch/hf"}
    assert JobSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize("value,message", [
    (["1BAD=x"], "'1BAD' is not a variable name"),
    (["BAD-NAME=x"], "is not a variable name"),
    (["A B=x"], "is not a variable name"),
    (["$(id)=x"], "is not a variable name"),
    (["NOEQUALS"], "'NOEQUALS' is not NAME=VALUE"),
    (["X=a\nexport Y=1"], "X: the value contains a control character"),
    (["X=a\x00"], "control character"),
    (["RANK=0"], "RANK cannot be set through env: hpc-ddp sets it on every rank"),
    (["MASTER_ADDR=localhost"], "MASTER_ADDR cannot be set through env"),
    (["MASTER_PORT=1234"], "use --master-port"),
    (["CUDA_VISIBLE_DEVICES=0"], "use --gpu-bind"),
    (["SLURM_CPUS_PER_TASK=4"], "give the option as --sbatch-arg or --srun-arg"),
    (["SBATCH_TIMELIMIT=5"], "--sbatch-arg"),
    (["HPC_DDP_RUN_DIR=/x"], "hpc-ddp's own variables"),
    (["TORCHELASTIC_RUN_ID=x"], "torchrun"),
    ("A=1", "expected a table"),
])
def test_bad_env_entries_are_refused_naming_the_flag(value, message):
    with pytest.raises(SpecError, match=message) as info:
        build(Layer("command line", {"env": value}, is_cli=True))
    assert str(info.value).startswith("--env: ") and "\n" not in str(info.value)


def test_bad_table_values_name_the_file_and_variable():
    with pytest.raises(SpecError, match=r"^job file 'j.toml': env: X: True is not a string"):
        build(Layer("job file 'j.toml'", {"env": {"X": True}}))
    with pytest.raises(SpecError, match=r"X: .* is not a string"):
        build(Layer("job file 'j.toml'", {"env": {"X": [1]}}))


def test_the_knobs_hpc_ddp_reads_stay_yours():
    assert managed_problem("HPC_DDP_BACKEND") is None and managed_problem("HPC_DDP_RUN_ID") is None
    assert managed_problem("OMP_NUM_THREADS") is None and managed_problem("NCCL_DEBUG") is None


CASES = ["plain", "$HOME/x", "${HOME}x", "a$", "$$HOME", "$1", "${UNSET_VAR_XYZ}/y", "it's \"q\" `id` \\ $(id)",
         "$HOME$HOME", "${HOME", "tab\there", "~/x", "*", "a b  c"]


@pytest.mark.parametrize("value", CASES)
def test_bash_and_python_expand_a_value_alike(value):
    env = {"HOME": "/home/ada", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(["bash", "-c", f"set -u; export X={bash_value(value)}; printf %s \"$X\""], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout == expand(value, env)


def test_expansion_is_only_of_references():
    env = {"SLURM_TMPDIR": "/tmp/job7", "RANK": "3"}
    assert expand("$SLURM_TMPDIR/hf-$RANK", env) == "/tmp/job7/hf-3"
    assert expand("$(reboot) `id` $$5", env) == "$(reboot) `id` $5"


# ---- issue 30: names the batch script's own bash depends on (it exports env before its srun) ----

@pytest.mark.parametrize("value, message, hint", [
    ("PATH=/opt/tools/bin", "PATH cannot be set through env: the batch script would no longer find srun",
     "PATH=/your/bin:$PATH"),
    ("PATH=$$PATH:/x", "PATH cannot be set", "keeping the rest"),   # a literal $PATH, not the PATH it extends
    ("PATH=$PATHS", "PATH cannot be set", "keeping the rest"),
    ("IFS=,", "IFS cannot be set through env", "inside your program"),
    ("BASH_ENV=/home/ada/rc", "BASH_ENV cannot be set through env", "setup or node_setup"),
    ("SHELLOPTS=xtrace", "SHELLOPTS cannot be set through env: bash's own read-only variable", "remove it"),
    ("UID=0", "UID cannot be set through env: bash's own read-only variable", "remove it"),
])
def test_a_variable_the_batch_script_needs_is_refused_with_the_fix(value, message, hint):
    with pytest.raises(SpecError, match=message) as info:
        build(Layer("command line", {"env": [value]}, is_cli=True))
    assert str(info.value).startswith("--env: ") and hint in (info.value.hint or "")
    name, _, raw = value.partition("=")
    for layer in (Layer("profile 'site'", {"env": {name: raw}}, frozenset(PROFILE_KEYS)),
                  Layer("job file 'j.toml'", {"env": {name: raw}})):
        with pytest.raises(SpecError, match=f"^{layer.origin}: env: {message}"):
            build(layer)


@pytest.mark.parametrize("value", ["/opt/tools/bin:$PATH", "${PATH}:/opt/tools/bin", "$$x:$PATH"])
def test_a_path_that_keeps_the_path_it_extends_is_fine_and_srun_is_still_found(value, tmp_path):
    spec = build(Layer("command line", {"env": [f"PATH={value}"]}, is_cli=True))
    script = f"export PATH={bash_value(dict(spec.env)['PATH'])}\ncommand -v env\n"
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and done.stdout.strip().endswith("/env"), done
