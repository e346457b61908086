"""Rendered scripts: golden files (UPDATE_GOLDEN=1 rewrites them), `bash -n`, quoting and injection."""

import os
import re
import subprocess
from pathlib import Path

import pytest

from hpc_ddp.errors import SpecError
from hpc_ddp.render import directives, render_sbatch
from hpc_ddp.spec import PROFILE_KEYS, JobSpec, Layer, Target, build_spec

GOLDEN = Path(__file__).parent / "golden"


def spec_of(values: dict, target: Target | None = None, workdir: str = "/home/ada/proj",
            profile: dict | None = None) -> JobSpec:
    layers = [Layer("profile 'site'", profile, frozenset(PROFILE_KEYS))] if profile else []
    layers.append(Layer("command line", values))
    return build_spec(layers, target=target or Target("script", "/home/ada/proj/train.py", ("--lr", "0.1")),
                      workdir=workdir, python="/opt/venv/bin/python")


def render(spec: JobSpec, run_dir: str = "/scratch/ada/runs/train-1") -> str:
    return render_sbatch(spec, run_dir, generated_at="2026-01-02T03:04:05", command_line="hpc-ddp submit ...")


def bash_n(text: str) -> None:
    done = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert done.returncode == 0, done.stderr


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; rerun with UPDATE_GOLDEN=1 if intended"


CASES = {
    "minimal.sbatch": ({}, None),
    "four_by_eight.sbatch": ({"nodes": 4, "gpus": 8, "time": "2-00:00:00", "cpus_per_task": 6, "mem": "480G",
                              "partition": "gpu", "account": "lab", "qos": "normal", "constraint": "a100&ib",
                              "job_name": "big run", "sbatch_args": ["--exclusive", "--mail-type=END"]}, None),
    "gres_profile.sbatch": ({"nodes": 2, "gpus": 4}, {"gpu_request": "gres", "setup": [
        "module load cuda/12.4", "source ~/venvs/ddp/bin/activate"], "partition": "a100", "time": "45"}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name):
    values, profile = CASES[name]
    text = render(spec_of(values, profile=profile))
    bash_n(text)
    check_golden(name, text)


def test_four_nodes_eight_gpus_asks_for_what_it_should():
    lines = directives(spec_of({"nodes": 4, "gpus": 8}))
    assert {"--nodes=4", "--ntasks-per-node=8", "--gpus-per-node=8", "--requeue", "--open-mode=append",
            "--signal=USR2@120"} <= set(lines)


def test_gres_request():
    assert "--gres=gpu:4" in directives(spec_of({"gpus": 4}, profile={"gpu_request": "gres"}))


def test_awkward_paths_are_quoted(weird_dir):
    script = weird_dir / "train it.py"
    run_dir = str(weird_dir / "run")
    spec = spec_of({"nodes": 2}, target=Target("script", str(script), ("a b", "$(rm -rf ~)", "'q'")),
                   workdir=str(weird_dir))
    text = render(spec, run_dir=run_dir)
    bash_n(text)
    lines = text.splitlines()
    # Evaluate the lines bash would run and check each value comes back as the literal string.
    assignment = next(ln for ln in lines if ln.startswith("RUN_DIR="))
    assert _bash(f'{assignment}; printf %s "$RUN_DIR"') == run_dir
    cd_line = next(ln for ln in lines if ln.startswith("cd "))
    assert _bash(f"{cd_line.replace('cd ', 'printf %s ', 1)}") == str(weird_dir)
    runner_line = lines[next(i for i, ln in enumerate(lines) if ln.startswith("srun ")) + 1]
    words = _bash(f"printf '%s\\n' {runner_line.rstrip(' &')}").splitlines()
    assert words[-1] == f"{run_dir}/spec.json"


def _bash(code: str) -> str:
    done = subprocess.run(["bash", "-c", code], capture_output=True, text=True, check=True)
    return done.stdout


def test_comment_lines_cannot_be_escaped():
    spec = spec_of({}, target=Target("script", "/x/t.py", ("ok\nrm -rf /tmp/x", "#SBATCH --uid=0")))
    text = render(spec)
    for line in text.splitlines():
        assert not line.startswith("rm -rf")
    sbatch_lines = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
    assert all("--uid" not in ln for ln in sbatch_lines)
    bash_n(text)


@pytest.mark.parametrize("key,value", [
    ("job_name", "x\n#SBATCH --uid=0"), ("job_name", "x\rrm"), ("job_name", "a\x00b"), ("job_name", "a#b"),
    ("partition", "gpu\n--wrap=id"), ("sbatch_args", ["--comment=x\n#SBATCH --uid=0"]),
    ("sbatch_args", ["--comment=#x"]), ("constraint", "a100#"), ("qos", "q'x"),
])
def test_injection_attempts_are_refused(key, value):
    with pytest.raises(SpecError):
        spec_of({key: value})


def test_sbatch_directive_block_is_unbroken():
    """sbatch stops reading directives at the first non-comment line: every #SBATCH must come before it."""
    text = render(spec_of({"nodes": 2, "gpus": 2, "sbatch_args": ["--exclusive"]}))
    lines = text.splitlines()
    first_code = next(i for i, ln in enumerate(lines) if ln and not ln.startswith("#"))
    assert all(i < first_code for i, ln in enumerate(lines) if ln.startswith("#SBATCH"))
    assert len([ln for ln in lines if re.match(r"#SBATCH ", ln)]) == len(directives(spec_of(
        {"nodes": 2, "gpus": 2, "sbatch_args": ["--exclusive"]})))


def test_site_template(tmp_path):
    tpl = tmp_path / "site.j2"
    tpl.write_text("#!/bin/bash\n{% for d in directives %}#SBATCH {{ d }}\n{% endfor %}srun {{ runner | qjoin }}\n")
    text = render(spec_of({"template": str(tpl), "nodes": 3}))
    assert "#SBATCH --nodes=3" in text and "hpc_ddp.runner" in text


def test_site_template_with_unknown_variable_fails_clearly(tmp_path):
    tpl = tmp_path / "bad.j2"
    tpl.write_text("{{ no_such_thing }}\n")
    with pytest.raises(SpecError, match="failed to render.*no_such_thing"):
        render(spec_of({"template": str(tpl)}))
