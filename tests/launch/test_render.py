"""Rendered scripts: golden files (UPDATE_GOLDEN=1 rewrites them), `bash -n`, quoting and injection."""

import os
import re
import subprocess
from pathlib import Path

import pytest

from hpc_ddp.common.errors import SpecError
from hpc_ddp.launch.render import check_custom_script, directives, render_sbatch
from hpc_ddp.spec.jobspec import PROFILE_KEYS, JobSpec, Layer, Target, build_spec

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
    "chain_after.sbatch": ({"nodes": 2, "gpus": 2, "time": "4:00:00", "after": "81734:any", "chain": 3}, None),
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
    runner_line = lines[next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("srun --kill-on-bad-exit")) + 1]
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


SITE = ("#!/bin/bash\n{% for d in directives %}#SBATCH {{ d }}\n{% endfor %}module load site\n"
        "{{ spec.python | q }} -m hpc_ddp.job.attempts begin \"$RUN_DIR\" 0 || exit $?\n"
        "srun {{ runner | qjoin }}\n"
        "{{ spec.python | q }} -m hpc_ddp.job.attempts end \"$RUN_DIR\" 0 $?\n")


def test_site_template(tmp_path):
    tpl = tmp_path / "site.j2"
    tpl.write_text(SITE)
    text = render(spec_of({"template": str(tpl), "nodes": 3}))
    assert "#SBATCH --nodes=3" in text and "hpc_ddp.job.runner" in text and "module load site" in text


def test_our_template_passes_the_check_for_custom_ones():
    spec = spec_of({"nodes": 2, "gpus": 4, "sbatch_args": ["--exclusive"]}, profile={"setup": ["module load x"]})
    check_custom_script(render(spec), spec, "/scratch/ada/runs/train-1")


# A custom template that renders, but is not an hpc-ddp job script (or tries to be more than one).
_RUNNER = "srun {{ runner | qjoin }}\n"
_BEGIN = "{{ spec.python | q }} -m hpc_ddp.job.attempts begin x 0\n"
_END = "{{ spec.python | q }} -m hpc_ddp.job.attempts end x 0 0\n"
_HEAD = "#!/bin/bash\n{% for d in directives %}#SBATCH {{ d }}\n{% endfor %}"


@pytest.mark.parametrize("body,message", [
    (_HEAD + _RUNNER + _END, "does not run the requeue policy's `-m hpc_ddp.job.attempts begin`"),
    (_HEAD + _BEGIN + _END, "does not run the per-rank runner"),
    (_HEAD + _BEGIN + _RUNNER, "does not run the requeue policy's `-m hpc_ddp.job.attempts end`"),
    (_HEAD + _BEGIN + "# " + _RUNNER + _END, "does not run the per-rank runner"),  # only in a comment
    (_HEAD + _END + _RUNNER + _BEGIN, "does not run the per-rank runner `{{ runner | qjoin }}` after"),
    (_HEAD + _BEGIN + "srun python -m hpc_ddp.job.runner /elsewhere/spec.json\n" + _END, "does not run the per-rank"),
    ("#!/bin/bash\n#SBATCH --array=0-3\n" + _HEAD[12:] + _BEGIN + _RUNNER + _END, "'#SBATCH --array=0-3', which"),
    (_HEAD + "  #sbatch --uid=0\n" + _BEGIN + _RUNNER + _END, "'#sbatch --uid=0', which hpc-ddp did not ask for"),
    ("#!/bin/bash\n{% for d in directives[:-1] %}#SBATCH {{ d }}\n{% endfor %}" + _BEGIN + _RUNNER + _END,
     "misses '#SBATCH --signal=USR2@120'"),
    (_HEAD + "#SBATCH --requeue\n" + _BEGIN + _RUNNER + _END, "repeats a directive"),
    ("#!/bin/bash\necho hi\n{% for d in directives %}#SBATCH {{ d }}\n{% endfor %}" + _BEGIN + _RUNNER + _END,
     "after the first command"),
    ("/etc/shadow contents\n", "misses '#SBATCH --job-name=train'"),
    ('{% include "other.j2" %}', "includes 'other.j2': a custom template is one file"),
    ('{% extends "sbatch.sh.j2" %}', "includes 'sbatch.sh.j2'"),
    ("{{ cycler.__init__.__globals__.os.system('touch PWNED') }}", "stopped by the sandbox"),
    ("{{ lipsum.__globals__['os'].system('touch PWNED') }}", "stopped by the sandbox"),
    ("{{ spec.__class__.__mro__ }}", "stopped by the sandbox"),
    ("{{ directives.append('--array=0-3') }}", "stopped by the sandbox"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "stopped by the sandbox"),
    ("{{ range(10**9) | list }}", "Range too big"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recurses without end"),
    ("{{ 'x' * 10**10 }}", "stopped by the sandbox"),   # issue 30: would take 10 GB
    ("{{ [0] * 2000000 }}", "stopped by the sandbox"),
    ("{{ 2 ** 100000000 }}", "stopped by the sandbox"),
    ("{{ 10 * 'x' * 200000 }}", "stopped by the sandbox"),
    ("{{ x", "failed to render"),
    ("{{ no_such_thing }}", "failed to render"),
])
def test_custom_templates_that_are_not_job_scripts_are_refused(tmp_path, monkeypatch, body, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "other.j2").write_text("#!/bin/bash\n")
    tpl = tmp_path / "site.j2"
    tpl.write_text(body)
    with pytest.raises(SpecError) as info:
        render(spec_of({"template": str(tpl)}))
    assert message in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("make,message", [
    (lambda p: os.mkfifo(p), "is not a regular file"),  # opened without blocking: no hang
    (lambda p: p.mkdir(), "is not a regular file"),
    (lambda p: p.write_bytes(b"\xff\xfe"), "is not UTF-8 text"),
    (lambda p: p.write_text("x" * (2 << 20)), "larger than 1 MiB"),
    (lambda p: None, "not found"),
])
def test_unreadable_templates_are_one_line(tmp_path, make, message):
    tpl = tmp_path / "site.j2"
    make(tpl)
    with pytest.raises(SpecError, match=message):
        render(spec_of({"template": str(tpl)}))


@pytest.mark.parametrize("value", ["/etc/shadow", "/etc/passwd", "site.sh", "x.j2.bak", "", "a\x00.j2"])
def test_a_template_is_a_j2_file(value):
    with pytest.raises(SpecError, match="template"):
        spec_of({"template": value})


@pytest.mark.parametrize("line", [
    "#SBATCH --array=0-3", "  #SBATCH --array=0-3", "\t#SBATCH --uid=0", "#sbatch --array=0-3",
    "echo hi\n#SBATCH --array=0-3", "true\r\n  #SBATCH --array=0-3", "# ok\n\x0b#SBATCH --array=1",
])
def test_setup_lines_cannot_add_directives(line):
    """Setup runs before the first command, where sbatch still reads #SBATCH lines: the --array refusal
    (and every other) must not be bypassed through a profile or a job file."""
    for layer in ({"setup": [line]}, {"setup": line}):
        with pytest.raises(SpecError, match="would add an #SBATCH directive"):
            spec_of({}, profile=layer)
        with pytest.raises(SpecError, match="would add an #SBATCH directive"):
            spec_of(layer)


def test_setup_comments_and_commands_still_work():
    text = render(spec_of({}, profile={"setup": ["# sbatch would not read this", "module load SBATCH-tools"]}))
    assert "module load SBATCH-tools" in text


def test_site_template_with_unknown_variable_fails_clearly(tmp_path):
    tpl = tmp_path / "bad.j2"
    tpl.write_text("{{ no_such_thing }}\n")
    with pytest.raises(SpecError, match="failed to render.*no_such_thing"):
        render(spec_of({"template": str(tpl)}))


def test_a_dependency_is_one_clean_directive():
    lines = directives(spec_of({"after": "81734:any", "chain": 2}))
    assert lines[-1] == "--dependency=afterany:81734"  # after ours, before any --sbatch-arg
    assert not any(d.startswith("--dependency") for d in directives(spec_of({"chain": 3})))


@pytest.mark.parametrize("after", ["afterok:1\n#SBATCH --uid=0", "afterok:1 --uid=0", "after:1", "afterok:$(id)",
                                   "singleton"])
def test_a_tampered_dependency_never_reaches_the_script(after):
    """The spec only lets after(ok|any):<digits> through; a JobSpec made another way (an edited spec.json)
    is checked again before it becomes an #SBATCH line."""
    import dataclasses

    with pytest.raises(SpecError, match="is not a dependency hpc-ddp writes"):
        render(dataclasses.replace(spec_of({}), after=after))


def test_chain_and_fallback_scripts_pass_bash_n_and_the_custom_template_check():
    spec = spec_of({"after": "5", "chain": 4, "nodes": 2})
    text = render(spec)
    bash_n(text)
    check_custom_script(text, spec, "/scratch/ada/runs/train-1")
    assert "Job 1 of a chain of 4" in text and "-m hpc_ddp.job.attempts resubmit" in text


def test_a_template_that_loops_for_ever_is_stopped(tmp_path, monkeypatch):
    """Nested loops over big ranges (issue 30: a dry run that never finished) are stopped by the time limit."""
    from hpc_ddp.launch import render as render_module

    monkeypatch.setattr(render_module, "RENDER_LIMIT_S", 0.5)
    tpl = tmp_path / "site.j2"
    tpl.write_text("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}")
    with pytest.raises(SpecError, match="ran for more than 0.5 s and was stopped"):
        render(spec_of({"template": str(tpl)}))
