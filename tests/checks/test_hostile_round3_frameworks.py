"""Hardening round 3 (issue 30), framework detection (checks/frameworks.py, read by checks/preflight.py through
job/devicescan.source_of): what it says of scripts that are odd, huge, binary, not UTF-8, not files, links,
syntax errors, imports hidden in strings and comments, -m targets and packages whose code must never run.
Each row: the note it must give (or none), in bounded time, with nothing imported or executed."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from hpc_ddp.checks.frameworks import framework_notes
from hpc_ddp.checks.preflight import device_findings
from hpc_ddp.spec.jobspec import Layer, Target, build_spec

LIGHTNING_OK = "import lightning as L\ntrainer = L.Trainer()\ntrainer.fit(model, ckpt_path='last')\n"
LIGHTNING_NO = "import lightning as L\ntrainer = L.Trainer()\ntrainer.fit(model)\n"

# (source, expected: None (no note), "ok" or "warning", the framework named in it)
SOURCES = {
    # what the scripts of each framework look like
    "lightning-import": (LIGHTNING_NO, "warning", "Lightning"),
    "lightning-resumes": (LIGHTNING_OK, "ok", "Lightning"),
    "pytorch-lightning-as-pl": ("import pytorch_lightning as pl\npl.Trainer().fit(m)\n", "warning", "Lightning"),
    "from-lightning-pytorch": ("from lightning.pytorch import Trainer\nTrainer().fit(m)\n", "warning", "Lightning"),
    "lightning-in-try": ("try:\n    import lightning as L\nexcept ImportError:\n    L = None\n", "warning", "Lightning"),
    "lightning-in-function": ("def main():\n    from lightning import Trainer\n    Trainer().fit(m)\n", "warning",
                              "Lightning"),
    "lightning-ckpt-path-spaced": ("import lightning as L\nL.Trainer().fit(m, ckpt_path = 'last')\n", "ok", "Lightning"),
    "lightning-ckpt-path-multiline": ("import lightning as L\nL.Trainer().fit(\n    m,\n    ckpt_path=path,\n)\n", "ok",
                                      "Lightning"),
    "hf-trainer": ("from transformers import Trainer, TrainingArguments\nTrainer(m).train()\n", "warning",
                   "Hugging Face"),
    "hf-trainer-resumes": ("from transformers import Trainer\nTrainer(m).train(resume_from_checkpoint=True)\n", "ok",
                           "Hugging Face"),
    "hf-trainer-dotted": ("import transformers\ntransformers.Trainer(m).train()\n", "warning", "Hugging Face"),
    "hf-parenthesised-import": ("from transformers import (\n    AutoModel,\n    Trainer,\n)\nTrainer(m).train()\n",
                                "warning", "Hugging Face"),
    "hf-seq2seq-only": ("from transformers import Seq2SeqTrainer\nSeq2SeqTrainer(m).train()\n", None, None),
    "accelerate": ("from accelerate import Accelerator\na = Accelerator()\n", "warning", "accelerate"),
    "accelerate-resumes": ("import accelerate\na = accelerate.Accelerator()\na.load_state('ckpt')\n", "ok",
                           "accelerate"),
    "plain-torchrun": ("import torch.distributed as dist\ndist.init_process_group('nccl')\n", None, None),
    "hpc-ddp-session": ("import hpc_ddp\nrun = hpc_ddp.start()\n", None, None),
    # imports and resumes that are not code
    "import-in-comment": ("# import lightning\nprint(1)\n", None, None),
    "import-after-code-comment": ("x = 1  # import lightning as L\n", None, None),
    "import-in-docstring": ('"""Usage:\nimport lightning as L\n"""\nprint(1)\n', None, None),
    "import-in-single-quoted-docstring": ("'''\nfrom transformers import Trainer\n'''\n", None, None),
    "import-in-string": ("s = 'import lightning'\nexec(s)\n", None, None),
    "import-in-f-string-multiline": ('x = f"""\nimport accelerate\n{1}"""\n', None, None),
    "ckpt-path-only-in-docstring": ('import lightning as L\n"""Resume with trainer.fit(model, ckpt_path="last")."""\n'
                                    "L.Trainer().fit(m)\n", "warning", "Lightning"),
    "ckpt-path-only-in-comment": ("import lightning as L\nL.Trainer().fit(m)  # TODO ckpt_path='last'\n", "warning",
                                  "Lightning"),
    "ckpt-path-compared-not-passed": ("import lightning as L\nif ckpt_path == None:\n    L.Trainer().fit(m)\n",
                                      "warning", "Lightning"),
    "resume-only-in-string": ("from transformers import Trainer\nhelp = 'resume_from_checkpoint=True'\n"
                              "Trainer(m).train()\n", "warning", "Hugging Face"),
    "load-state-only-in-comment": ("import accelerate\n# a.load_state(d)\n", "warning", "accelerate"),
    "hash-inside-string-then-import": ("s = '#'\nimport lightning\n", "warning", "Lightning"),
    "module-named-like-lightning": ("import lightningfast\nimport lightning_utils\n", None, None),
    "attribute-named-lightning": ("x.import_lightning = 1\nfrom mylib import lightning\n", None, None),
    # text that is not quite Python
    "syntax-error": ("import lightning as L\ndef broken(:\n", "warning", "Lightning"),
    "unterminated-triple-quote": ('import lightning\n"""never closed\nckpt_path=1\n', "warning", "Lightning"),
    "tabs-and-formfeeds": ("\f\timport lightning\n", "warning", "Lightning"),
    "crlf-lines": ("import lightning as L\r\nL.Trainer().fit(m, ckpt_path='last')\r\n", "ok", "Lightning"),
    "cr-only-lines": ("import lightning as L\rL.Trainer().fit(m)\r", "warning", "Lightning"),
    "nul-bytes": ("import lightning\x00\nx\x00y\n", "warning", "Lightning"),
    "replacement-chars": ("\ufffd\ufffdimport lightning\n", None, None),
    "bom": ("\ufeffimport lightning as L\n", "warning", "Lightning"),
    "line-continuation": ("import os, \\\n    lightning\n", None, None),
    "empty": ("", None, None),
    "only-newlines": ("\n" * 1000, None, None),
}


@pytest.mark.parametrize("case", sorted(SOURCES))
def test_framework_notes_read_the_code_not_its_strings_and_comments(case):
    source, level, framework = SOURCES[case]
    notes = framework_notes(source, "train.py")
    if level is None:
        assert notes == [], notes
    else:
        assert [n.level for n in notes] == [level] and framework in notes[0].message, notes
        assert "\n" not in notes[0].message


# text that must be read in bounded time: (source maker, seconds allowed)
HUGE = {
    "4MB-of-newlines": lambda: "\n" * (4 * 2**20),
    "4MB-of-spaces-one-line": lambda: " " * (4 * 2**20),
    "4MB-of-blank-lines-with-spaces": lambda: " \n" * (2 * 2**20),
    "4MB-of-tabs-and-newlines": lambda: "\t\n\n" * (2**20),
    "many-from-transformers-lines": lambda: "from transformers import AutoModel, " + "X, " * 10 + "\n" * 1
                                            * 1 + ("from transformers import " + "A, " * 20 + "\n") * 50_000,
    "one-import-then-4MB-of-names": lambda: "from transformers import " + "A, " * (2**20),
    "quotes-unbalanced": lambda: "'" * (2 * 2**20),
    "many-hashes": lambda: "#" * (4 * 2**20),
    "import-lightning-repeated": lambda: "import lightning\n" * 200_000,
    "ckpt-path-repeated": lambda: "import lightning\n" + "ckpt_path\t\t\t" * 200_000,
    "newlines-then-import": lambda: "\n" * (2 * 2**20) + "import lightning\n",
    "spaces-newlines-mixed": lambda: " \t\f\v\n" * (2**20),
}


@pytest.mark.parametrize("case", sorted(HUGE))
def test_huge_and_pathological_scripts_are_read_in_bounded_time(case):
    source = HUGE[case]()

    def too_slow(*_):
        raise TimeoutError("framework detection did not finish in 60 s")

    old = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(60)   # a hang bound, in wall time; the bound the test is about is in CPU time, below
    started = time.process_time()
    try:
        framework_notes(source, "train.py")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    # CPU time, not wall time: 3 s of wall ran out once on a machine starved of CPU by make test's other lanes
    assert time.process_time() - started < 3.0


# ------------------------------------------------------------------------ the script as a file on disk

MARK = "FRAMEWORK-SCAN-RAN"


def _spec(tmp_path: Path, kind: str, value: str):
    return build_spec([Layer("t", {"gpus": 0})], target=Target(kind, value), workdir=str(tmp_path), python=sys.executable)


def _hostile_package(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    for name in ("__init__.py", "__main__.py", "train.py"):
        body = f"open({str(tmp_path / MARK)!r}, 'w').write('ran')\n"
        (pkg / name).write_text(body + ("import lightning\n" if name != "__init__.py" else ""))


FILES = {
    # name: (make(tmp) -> (kind, value), the expected level of the framework note: None where none)
    "script": (lambda t: (t / "train.py").write_text(LIGHTNING_NO) and ("script", "train.py"), "warning"),
    "script-absolute": (lambda t: (t / "train.py").write_text(LIGHTNING_OK) and ("script", str(t / "train.py")), "ok"),
    "script-latin1": (lambda t: (t / "train.py").write_bytes(b"# caf\xe9\nimport lightning\n") and ("script", "train.py"),
                      "warning"),
    "script-utf16": (lambda t: (t / "train.py").write_bytes("import lightning\n".encode("utf-16")) and
                     ("script", "train.py"), None),
    "script-binary": (lambda t: (t / "train.py").write_bytes(bytes(range(256)) * 1000) and ("script", "train.py"), None),
    "script-elf-like": (lambda t: (t / "train").write_bytes(b"\x7fELF" + b"\0" * 4000 + b"import lightning\n") and
                        ("script", "train"), None),
    "script-over-4MB": (lambda t: (t / "train.py").write_text("import lightning\n" + "#" * (5 * 2**20)) and
                        ("script", "train.py"), None),
    "script-fifo": (lambda t: os.mkfifo(t / "train.py") or ("script", "train.py"), None),
    "script-link-to-dev-zero": (lambda t: os.symlink("/dev/zero", t / "train.py") or ("script", "train.py"), None),
    "script-link-to-dev-urandom": (lambda t: os.symlink("/dev/urandom", t / "train.py") or ("script", "train.py"), None),
    "script-link-to-fifo": (lambda t: (os.mkfifo(t / "p"), os.symlink(t / "p", t / "train.py")) and
                            ("script", "train.py"), None),
    "script-link-loop": (lambda t: (os.symlink("b.py", t / "train.py"), os.symlink("train.py", t / "b.py")) and
                         ("script", "train.py"), None),
    "script-dangling-link": (lambda t: os.symlink("nowhere.py", t / "train.py") or ("script", "train.py"), None),
    "script-link-to-real": (lambda t: ((t / "real.py").write_text(LIGHTNING_NO), os.symlink("real.py", t / "train.py"))
                            and ("script", "train.py"), "warning"),
    "script-is-a-folder": (lambda t: (t / "train.py").mkdir() or ("script", "train.py"), None),
    "script-missing": (lambda t: ("script", "nope.py"), None),
    "script-name-with-newline": (lambda t: (t / "a\nb.py").write_text(LIGHTNING_NO) and ("script", "a\nb.py"),
                                 "warning"),
    "script-named-like-a-flag": (lambda t: (t / "-rf.py").write_text(LIGHTNING_NO) and ("script", "-rf.py"), "warning"),
    "script-empty": (lambda t: (t / "train.py").write_text("") or ("script", "train.py"), None),
    "module-file": (lambda t: (t / "trainmod.py").write_text(LIGHTNING_NO) and ("module", "trainmod"), "warning"),
    "module-package-main": (lambda t: ((t / "app").mkdir(), (t / "app" / "__main__.py").write_text(LIGHTNING_NO))
                            and ("module", "app"), "warning"),
    "module-dotted": (lambda t: ((t / "app" / "sub").mkdir(parents=True),
                                 (t / "app" / "sub" / "train.py").write_text(LIGHTNING_OK)) and ("module", "app.sub.train"),
                      "ok"),
    "module-missing": (lambda t: ("module", "no_such_module_anywhere"), None),
    "module-installed-elsewhere": (lambda t: ("module", "json.tool"), None),
    "module-file-is-fifo": (lambda t: os.mkfifo(t / "fifomod.py") or ("module", "fifomod"), None),
    "module-file-links-out": (lambda t: os.symlink("/dev/zero", t / "zmod.py") or ("module", "zmod"), None),
    "module-hostile-package": (lambda t: _hostile_package(t) or ("module", "pkg.train"), "warning"),
    "module-hostile-package-main": (lambda t: _hostile_package(t) or ("module", "pkg"), "warning"),
    "script-hostile-sibling-init": (lambda t: (_hostile_package(t), (t / "pkg" / "run.py").write_text(
        "from . import x\nimport lightning\n")) and ("script", "pkg/run.py"), "warning"),
}


@pytest.mark.parametrize("case", sorted(FILES))
def test_the_script_on_disk_is_read_as_text_only_bounded_never_imported(tmp_path, monkeypatch, case):
    make, level = FILES[case]
    monkeypatch.chdir(tmp_path)
    kind, value = make(tmp_path)
    modules = set(sys.modules)
    started = time.monotonic()
    try:
        findings = device_findings(_spec(tmp_path, kind, value))
    except Exception as exc:  # noqa: BLE001 - the row fails on any exception: detection must never raise
        pytest.fail(f"{type(exc).__name__}: {exc}")
    assert time.monotonic() - started < 3
    assert not (tmp_path / MARK).exists(), "the user's package was executed"
    assert not {m for m in set(sys.modules) - modules if m.startswith(("pkg", "app", "trainmod", "lightning"))}
    notes = [f for f in findings if f.message and ("uses" in f.message)]
    assert [n.level for n in notes] == ([level] if level else []), findings
    assert all("\n" not in f.message for f in findings)


def test_the_gpu_scan_of_a_long_line_of_calls_finishes_in_bounded_time():
    from hpc_ddp.job.devicescan import scan

    def too_slow(*_):
        raise TimeoutError("the GPU scan did not finish in 2 s")

    old = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(2)
    try:
        scan(".to(" * 8000)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


MODULE_NAMES = ["../../etc/passwd", "x./tmp/evil", ".hidden", "a..b", "-rf", "a b", "\x1b[2J", "pkg/train",
                "pkg.", "1abc"]


@pytest.mark.parametrize("name", MODULE_NAMES, ids=[ascii(n) for n in MODULE_NAMES])
def test_a_module_name_that_is_a_path_or_not_python_is_refused_before_any_file_is_read(tmp_path, name):
    from hpc_ddp.common.errors import UserError
    from hpc_ddp.spec.config import resolve_target

    with pytest.raises(UserError) as err:
        resolve_target(None, name, (), tmp_path)
    assert "\n" not in str(err.value) and str(err.value).isprintable()
