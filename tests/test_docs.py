"""The user docs (README.md, docs/, CONTRIBUTING.md, bench/README.md) cannot drift from the code:

- every relative link and anchor resolves;
- every `$ hpc-ddp ...` line of a console block parses against the real CLI (its options exist, its choices
  are valid);
- every console block marked `<!-- run by tests/test_docs.py -->` is run, here, in a project like the one the
  docs show, and its shown output must be what the command prints: line by line, in order, with paths,
  numbers and ids made alike on both sides ("..." in the docs stands for lines left out);
- the README stays a short start, and the user docs show placeholder hosts and paths, not this machine's.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

from hpc_ddp.cli import cli

REPO = Path(__file__).resolve().parents[1]
USER_DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ALL_DOCS = [*USER_DOCS, REPO / "CONTRIBUTING.md", REPO / "bench" / "README.md"]
RUN_MARKER = "<!-- run by tests/test_docs.py -->"
PLACEHOLDER_PROJECT = "/home/ada/proj"


def _blocks(text: str) -> list[tuple[str, str, str]]:
    """(language, body, the line before the opening fence) of every fenced block."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            lang, start = lines[i][3:].strip(), i
            i += 1
            body = []
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            out.append((lang, "\n".join(body), before))
        i += 1
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("doc", ALL_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(doc):
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        where = (doc.parent / path).resolve() if path else doc
        if not where.exists():
            broken.append(f"{target}: no such file")
        elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
            broken.append(f"{target}: no heading with that anchor")
    assert broken == []


def _commands(doc: Path) -> list[list[str]]:
    found = []
    for lang, body, _ in _blocks(doc.read_text()):
        if lang != "console":
            continue
        for line in body.splitlines():
            if line.startswith("$ hpc-ddp ") or line == "$ hpc-ddp":
                words = shlex.split(line[2:], comments=True)
                cut = next((i for i, w in enumerate(words) if w in (">", ">>", "<", "|", "&", "&&", ";", "2>")),
                           len(words))
                found.append(words[1:cut])
    return found


def _parse(args: list[str]) -> None:
    """Parse a command line the way click would run it, without running it."""
    ctx = cli.make_context("hpc-ddp", list(args), resilient_parsing=False)
    rest = [*ctx._protected_args, *ctx.args]  # noqa: SLF001 - the words left for the subcommand
    if not rest:
        return
    name, command, words = cli.resolve_command(ctx, rest)
    while isinstance(command, click.Group) and words:
        sub = command.make_context(name, words, parent=ctx)
        ctx, (name, command, words) = sub, command.resolve_command(sub, [*sub._protected_args, *sub.args])  # noqa: SLF001
    command.make_context(name, words, parent=ctx)


@pytest.mark.parametrize("doc", ALL_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_documented_command_line_parses(doc):
    bad = []
    for args in _commands(doc):
        try:
            _parse(args)
        except click.exceptions.Exit:
            continue
        except click.BadParameter as exc:
            if "does not exist" not in exc.format_message():  # a path of the reader's, not here
                bad.append(f"hpc-ddp {shlex.join(args)}: {exc.format_message()}")
        except click.ClickException as exc:
            bad.append(f"hpc-ddp {shlex.join(args)}: {exc.format_message()}")
    assert bad == []


def test_the_readme_is_a_short_start_in_the_promised_order():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 220
    order = ["## Install", "## Your first job", "## Make your own script survive preemption", "## Watch and manage",
             "## Set up your cluster once", "## Rehearse here", "## Reference", "## Try it, develop it"]
    places = [text.index(heading) for heading in order]
    assert places == sorted(places)


@pytest.mark.parametrize("page", ["README.md", "docs/session-api.md"])
def test_the_session_api_script_shown_is_the_example_file_whole(page):
    """The script shown runs as shown: it is examples/preemptible.py (tests/e2e/test_examples.py runs it)."""
    text = (REPO / page).read_text()
    shown = next(body for lang, body, _ in _blocks(text) if lang == "python")
    example = (REPO / "examples" / "preemptible.py").read_text()
    code = "\n".join(line for line in example.splitlines() if not line.startswith("#")).strip()
    assert shown.strip() == code


def test_the_fsdp_diff_shown_is_the_two_example_files():
    """docs/session-api.md's "Sharded models" diff is examples/preemptible.py -> fsdp_preemptible.py, as they
    are (tests/e2e/test_user_scripts.py stops and resumes the FSDP one bitwise)."""
    import difflib

    def code(name: str) -> list[str]:
        return [line for line in (REPO / "examples" / name).read_text().splitlines() if not line.startswith("#")]

    shown = next(body for lang, body, _ in _blocks((REPO / "docs" / "session-api.md").read_text()) if lang == "diff")
    made = difflib.unified_diff(code("preemptible.py"), code("fsdp_preemptible.py"), "examples/preemptible.py",
                                "examples/fsdp_preemptible.py", n=1, lineterm="")
    assert shown.strip() == "\n".join(made).strip()


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_user_docs_show_placeholders_not_this_machine(doc):
    text = doc.read_text()
    for mine in ("/work/main", "pytest-of-", "hpcn1", "hpcn[", "/root/", "../shared/"):
        assert mine not in text, mine


# ---- blocks that run without a cluster: run them and compare ----

def _normalised(line: str, project: Path) -> str:
    line = line.replace(str(project), PLACEHOLDER_PROJECT)
    line = re.sub(r"\b[0-9a-f]{12,40}\b", "<id>", line)
    line = re.sub(r"\d{8}-\d{6}", "<time>", line)
    line = re.sub(r"local-\d+-\d+", "<job>", line)
    return re.sub(r"\d[\d,.]*", "0", line).rstrip()


def _run_blocks() -> list[tuple[str, str]]:
    out = []
    for doc in USER_DOCS:
        for lang, body, before in _blocks(doc.read_text()):
            if lang == "console" and before.strip() == RUN_MARKER:
                out.append((f"{doc.relative_to(REPO)}:{body.splitlines()[0][:60]}", body))
    return out


@pytest.fixture
def docs_project(tmp_path, monkeypatch):
    """The project the docs show: train.py (the README's example) and the repo's jobs/; Slurm's sbatch and
    srun answer --help as the test Slurm's do (what hpc-ddp reads to check extra options), and queue nothing."""
    project = tmp_path / "proj"
    project.mkdir()
    shutil.copy(REPO / "examples" / "preemptible.py", project / "train.py")
    shutil.copytree(REPO / "jobs", project / "jobs")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    helptext = REPO / "tests" / "spec" / "helptext"
    for tool in ("sbatch", "srun"):
        fake = bin_dir / tool
        fake.write_text(f"#!/bin/bash\nif [ \"$1\" = --help ]; then cat {helptext / f'{tool}-22.05.txt'}; exit 0; fi\n"
                        "echo '81734;cluster'\n")
        fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin")
    monkeypatch.setenv("HPC_DDP_PROFILES", str(tmp_path / "profiles.toml"))
    for name in ("SLURM_CONF", "SLURM_JOB_ID", "VIRTUAL_ENV", "CONDA_PREFIX"):
        monkeypatch.delenv(name, raising=False)
    return project


@pytest.mark.parametrize("name,body", _run_blocks(), ids=[n for n, _ in _run_blocks()])
def test_documented_output_is_what_the_command_prints(name, body, docs_project):
    chunks: list[tuple[str, list[str]]] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            chunks.append((line[2:], []))
        elif chunks:
            chunks[-1][1].append(line)
    assert chunks, name
    for command, shown in chunks:
        assert command.startswith("hpc-ddp "), command
        done = subprocess.run(["bash", "-c", command], cwd=docs_project, capture_output=True, text=True, timeout=120)
        printed = [_normalised(x, docs_project) for x in (done.stdout + done.stderr).splitlines()]
        want = [_normalised(x, docs_project) for x in shown]
        position = 0
        for line in want:
            if line == "...":
                continue
            assert line in printed[position:], (command, line, printed)
            position = printed.index(line, position) + 1


def test_the_script_shown_is_the_script_submit_renders(docs_project):
    """docs/cli.md's sbatch script: what `submit --dry-run` prints for the command above it, line by line
    ("..." for lines left out), the Python and paths made alike."""
    text = (REPO / "docs" / "cli.md").read_text()
    marker = "<!-- checked by tests/test_docs.py (the script submit renders) -->"
    shown = text.split(marker, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    command = re.search(r"`(hpc-ddp submit --dry-run [^`]*)`:\n\n" + re.escape(marker), text).group(1)
    done = subprocess.run(["bash", "-c", command], cwd=docs_project, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr

    def alike(line: str) -> str:
        return _normalised(line.replace(sys.executable, "/home/ada/proj/.venv/bin/python"), docs_project)

    printed = [alike(line) for line in done.stdout.splitlines()]
    position = 0
    for line in (alike(x) for x in shown):
        if line == "...":
            continue
        assert line in printed[position:], (line, printed)
        position = printed.index(line, position) + 1


# ---- every `hpc-ddp ...` in the docs names only options its command has ----

_INLINE = re.compile(r"`(hpc-ddp(?: [^`]*)?)`")


def _mentions(doc: Path) -> list[tuple[str, str]]:
    """(the command line, text whose --options are that command's) of every `hpc-ddp ...` in `doc`: console
    lines (their comment too: "# follow rank 0 (--rank N)"), lines of other blocks that start with hpc-ddp,
    and inline code in the prose."""
    found, text = [], doc.read_text()
    for lang, body, _ in _blocks(text):
        for line in body.splitlines():
            line = line.strip()
            if lang == "console" and line.startswith("$ hpc-ddp"):
                found.append((line[2:], line[2:]))
            elif lang in ("", "text", "console", "bash", "sh") and re.match(r"hpc-ddp( |$)", line):
                found.append((line, line))
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    found += [(m.group(1), m.group(1)) for m in _INLINE.finditer(prose)]
    return found


def _unknown_options(line: str) -> list[str]:
    """The --options of `line` (an hpc-ddp command line, maybe with a comment or placeholders) that its
    command does not have; [] where the command itself is not one (checked by the parse test)."""
    code, _, comment = line.partition(" #")
    try:  # a quoted value is one word, whatever it holds
        words = [w.strip("[]|(),") for w in shlex.split(code)][1:]
    except ValueError:
        words = re.findall(r"[^\s\[\]|(),]+", code)[1:]
    command: click.Command = cli
    allowed = {o for p in cli.params for o in [*p.opts, *p.secondary_opts]}
    options, positional = [], False
    for word in words:
        if word == "--":
            break
        if word.startswith("-"):
            if not positional or getattr(command, "allow_interspersed_args", True):
                options.append(word.split("=", 1)[0])
            continue
        if isinstance(command, click.Group) and word in command.commands:
            command = command.commands[word]
            allowed |= {o for p in command.params for o in [*p.opts, *p.secondary_opts]}
            continue
        if not isinstance(command, click.Group) and not re.fullmatch(r"[A-Z_]+|N|\.\.\.", word):
            positional = not getattr(command, "allow_interspersed_args", True) and bool(
                [p for p in command.params if isinstance(p, click.Argument)])
    options += re.findall(r"(?<![\w-])--?[a-z][\w-]*", comment)
    if command is cli:
        return []
    return [o for o in options if o not in allowed and o.startswith("--")]


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_hpc_ddp_line_names_only_options_its_command_has(doc):
    """Issue 42: the README's `logs -f  # follow rank 0 (--rank N, --all)` named an --all that logs does not
    have. Every console line (comment included), block line and inline `hpc-ddp ...` is checked against
    click's own command objects."""
    bad = []
    for line, _ in _mentions(doc):
        unknown = _unknown_options(line)
        if unknown:
            bad.append(f"{line}: {', '.join(unknown)}")
    assert bad == []
