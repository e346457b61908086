"""Extra sbatch/srun options: accepted as the installed tool's --help lists them (the test Slurm's is the oracle),
its plugins' included; injection and managed options refused whatever the tool says."""

import shutil
from pathlib import Path

import pytest

from hpc_ddp.common.procs import Completed, FakeCommands
from hpc_ddp.slurm import helptext
from hpc_ddp.slurm.helptext import installed_options, parse_help
from hpc_ddp.spec.jobspec import _MANAGED
from hpc_ddp.spec.slurmargs import SBATCH, SBATCH_OPTIONS, SRUN, SRUN_MANAGED, SRUN_OPTIONS, check_option, unlisted

HELP = Path(__file__).parent / "helptext"
SBATCH_HELP = (HELP / "sbatch-22.05.txt").read_text()
SRUN_HELP = (HELP / "srun-22.05.txt").read_text()
# What a site with pyxis and Shifter adds to the help (the plugins' own help strings).
PLUGINS = """
Options provided by plugins:
      --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH
                              [pyxis] the image to use for the container
                              filesystem. Can be either a docker image given as
                              an enroot URI, or a path to a squashfs file on the
                              remote host filesystem.
      --container-mounts=SRC:DST[:FLAGS][,SRC:DST...]
                              [pyxis] bind mount[s] inside the container. Mount
                              flags are separated with "+", e.g. "ro+rbind".
      --image=image           shifter image to use
"""


def check(value, tool=SBATCH, known=None):
    return check_option(value, tool, _MANAGED if tool == SBATCH else SRUN_MANAGED, known)


def test_the_help_of_the_test_slurm_lists_its_options_and_not_its_prose():
    sbatch = parse_help(SBATCH_HELP)
    assert {"nodes", "array", "container", "gres-flags", "bb", "wrap", "extra-node-info", "exclusive"} <= sbatch
    assert "mem-per-cpu" in sbatch and "mem" in sbatch
    # Words inside descriptions are not options ("--mem >= --mem-per-cpu if --mem is specified.").
    assert not {o for o in sbatch if not o[0].isalpha()}
    srun = parse_help(SRUN_HELP)
    assert {"mpi", "overlap", "kill-on-bad-exit", "container", "exact", "label"} <= srun
    assert "cpu-bind" not in srun  # hidden without task/affinity: hence the fixed list too


def test_plugin_options_are_read_off_the_help():
    known = parse_help(SBATCH_HELP + PLUGINS)
    assert {"container-image", "container-mounts", "image"} <= known
    assert "pyxis" not in known and "ro" not in known


def test_an_option_the_installed_sbatch_lists_is_accepted():
    known = parse_help(SBATCH_HELP + PLUGINS)
    assert check("--image=docker:nersc/pytorch:ngc-23.07", known=known) == "--image=docker:nersc/pytorch:ngc-23.07"
    assert check("--gres-flags=enforce-binding", known=parse_help(SBATCH_HELP)) == "--gres-flags=enforce-binding"


def test_an_option_the_installed_sbatch_does_not_list_is_refused_with_a_guess():
    known = parse_help(SBATCH_HELP)
    with pytest.raises(ValueError, match=r"--image is not an sbatch option \(`sbatch --help` here lists no --image\)"):
        check("--image=x", known=known)
    with pytest.raises(ValueError, match=r"did you mean --exclusive\?"):
        check("--exclusiv", known=known)
    with pytest.raises(ValueError, match=r"did you mean --container-image\?"):
        check("--container-imag=x", known=parse_help(SBATCH_HELP + PLUGINS))


def test_help_text_that_hides_an_option_does_not_refuse_it():
    assert check("--cpu-bind=cores", SRUN, known=parse_help(SRUN_HELP)) == "--cpu-bind=cores"


def test_without_the_tool_the_fixed_list_names_what_is_unchecked():
    assert check("--image=x", known=None) == "--image=x"  # nothing here can submit it; the CLI warns
    assert unlisted(["--exclusive", "--image=x", "--container-image=y"], SBATCH) == ["--image=x",
                                                                                     "--container-image=y"]
    assert unlisted(["--mpi=pmix", "--container-image=y"], SRUN) == ["--container-image=y"]


@pytest.mark.parametrize("value,message", [
    ("--nodes=3", "set by hpc-ddp; use --nodes"),
    ("--parsable", "changes how sbatch itself behaves"),
    ("--wait", "changes how sbatch itself behaves"),
    ("--help", "changes how sbatch itself behaves"),
    ("--comment=a\n#SBATCH --uid=0", "control character"),
    ("--comment=x#y", "starts a comment"),
    ("--comment=a b", "whitespace"),
    ("--comment='x'", "quote"),
    ("-N 2", "long form"),
    ("--Nodes=2", "long form"),
])
def test_sbatch_refusals_hold_whatever_the_tool_lists(value, message):
    everything = parse_help(SBATCH_HELP + PLUGINS) | {"nodes", "parsable", "help", "Nodes"}
    with pytest.raises(ValueError, match=message):
        check(value, known=everything)


@pytest.mark.parametrize("value,message", [
    ("--mpi=pmix;reboot", r"--mpi: the value contains .;.: srun gets it as written, no shell reads it"),
    ("--mpi=pmix\nsrun id", "control character"),
    ("--container-mounts=$HOME:/h", r"\$NAME is not expanded"),
    ("--export=ALL,A=`id`", "contains '`'"),
    ("--cpu-bind=a|b", r"contains '\|'"),
    ("--cpu-bind=a b", "whitespace"),
    ("--ntasks=4", "set by hpc-ddp; use --nodes and --tasks-per-node"),
    ("--output=x", "use --run-dir"),
    ("--kill-on-bad-exit=0", "a dead rank always ends the step"),
    ("--pty", "changes how srun itself behaves"),
    ("--jobid=5", "set by hpc-ddp"),
])
def test_srun_refusals(value, message):
    with pytest.raises(ValueError, match=message):
        check(value, SRUN, known=parse_help(SRUN_HELP + PLUGINS))


def test_srun_values_may_hold_a_pyxis_registry_hash():
    known = parse_help(SRUN_HELP + PLUGINS)
    assert check("--container-image=nvcr.io#nvidia/pytorch:24.01-py3", SRUN, known) == \
        "--container-image=nvcr.io#nvidia/pytorch:24.01-py3"


def test_the_fixed_lists_hold_no_managed_option():
    assert not SBATCH_OPTIONS & set(_MANAGED) - {"array"}
    assert not SRUN_OPTIONS & set(SRUN_MANAGED)


def test_installed_options_asks_once_and_says_none_without_the_tool(monkeypatch):
    monkeypatch.setattr(helptext, "_CACHE", {})
    fake = FakeCommands({"/x/sbatch": lambda argv: Completed(tuple(argv), 0, SBATCH_HELP + PLUGINS)})
    fake.which = lambda name: "/x/sbatch" if name == "sbatch" else None
    assert "container-image" in installed_options("sbatch", fake, slurm_conf="/c")
    assert "image" in installed_options("sbatch", fake, slurm_conf="/c")
    assert len(fake.calls) == 1 and fake.calls[0][0] == ("/x/sbatch", "--help")
    assert installed_options("srun", fake, slurm_conf="/c") is None


def test_a_help_that_fails_or_lists_nothing_is_a_broken_tool(monkeypatch):
    """A failing --help is a failing sbatch: one line saying so, not "no sbatch on PATH" and a submission."""
    monkeypatch.setattr(helptext, "_CACHE", {})
    fake = FakeCommands({"/x/sbatch": lambda argv: Completed(tuple(argv), 1, "", "boom"),
                         "/x/srun": lambda argv: Completed(tuple(argv), 0, "4711;cluster\n")})
    fake.which = lambda name: f"/x/{name}"
    with pytest.raises(helptext.BrokenTool, match=r"sbatch is on PATH \(/x/sbatch\) but `sbatch --help` fails "
                                                  r"\(exit code 1: boom\)") as err:
        installed_options("sbatch", fake, slurm_conf="")
    assert err.value.exit_code == 2 and "sbatch --version" in err.value.hint
    with pytest.raises(helptext.BrokenTool, match="it lists no options: 4711;cluster"):
        installed_options("srun", fake, slurm_conf="")
    fake.which = lambda name: None
    assert installed_options("sbatch", fake, slurm_conf="") is None  # not there at all: nothing to ask


def test_submit_with_a_broken_sbatch_says_so_and_writes_nothing(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from hpc_ddp.cli import cli

    monkeypatch.setattr(helptext, "_CACHE", {})
    (tmp_path / "bin").mkdir()
    calls = tmp_path / "calls"
    fake = tmp_path / "bin" / "sbatch"
    fake.write_text(f"#!/bin/bash\necho \"$*\" >> {calls}\n[ \"$1\" = --help ] && {{ echo 'sbatch: error: "
                    f"resolve_ctls_from_dns_srv: res_nsearch error' >&2; exit 1; }}\necho 1\n")
    fake.chmod(0o755)
    (tmp_path / "train.py").write_text("print(1)\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["submit", "--sbatch-arg=--exclusiv", "train.py"])
    assert result.exit_code == 2
    errors = [line for line in result.output.splitlines() if "error" in line]
    assert len(errors) == 1 and "`sbatch --help` fails" in errors[0] and "no sbatch on PATH" not in result.output
    assert calls.read_text().split() == ["--help"] and not (tmp_path / "runs").exists()


def test_the_real_test_slurm_is_the_oracle(slurm_conf, monkeypatch):
    """The installed sbatch and srun, as hpc-ddp asks them: what the recorded help says."""
    monkeypatch.setattr(helptext, "_CACHE", {})
    assert shutil.which("sbatch")
    assert installed_options("sbatch") == parse_help(SBATCH_HELP)
    assert installed_options("srun") == parse_help(SRUN_HELP)
