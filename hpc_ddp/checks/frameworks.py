"""What a script written for a framework must say to survive preemption, read from its text (pure).

hpc-ddp runs a preempted or timed-out job again whichever way the program left (Lightning catches SIGTERM
and exits 0; see job/attempts.stopped_cause). Whether the next attempt continues or starts over is the
script's: a framework resumes only from a checkpoint it is told to load. `framework_notes` names the one
line a script is missing, for `submit` (a warning) and `doctor`.

The text is read as code: comments and string literals (docstrings included; an unterminated one runs to the
end) are blanked first, in one linear pass that needs no valid syntax, so `import lightning` in a docstring
is no use of Lightning and `ckpt_path=` in one is no resume.
"""

from __future__ import annotations

import ast
import re
from typing import NamedTuple

from hpc_ddp.job.devicescan import code_only  # the one blanking of comments and strings, shared with the GPU scan

__all__ = ["Note", "framework_notes", "code_only", "lightning_size_notes"]

# A line's start is `^[ \t\f]*`, never `^\s*`: \s crosses newlines, so from the start of every line of a long
# run of blank lines it would scan the rest of the run (quadratic: 4 MB of newlines never finished).
_LIGHTNING = re.compile(r"^[ \t\f]*(?:import|from)[ \t]+(?:pytorch_lightning|lightning)\b", re.M)
_HF_TRAINER = re.compile(r"^[ \t\f]*from[ \t]+transformers[ \t]+import[ \t]+(?:\([^)]*|[^\n]*)\bTrainer\b"
                         r"|\btransformers\.Trainer\b", re.M)
_ACCELERATE = re.compile(r"^[ \t\f]*(?:from[ \t]+accelerate[ \t]+import|import[ \t]+accelerate)\b", re.M)


class _Both:
    """Both patterns somewhere in the code (one search each: no pattern spanning the file, which a file of many
    import lines would make quadratic)."""

    def __init__(self, *patterns: re.Pattern[str]):
        self.patterns = patterns

    def search(self, code: str) -> bool:
        return all(p.search(code) for p in self.patterns)


_FABRIC = _Both(_LIGHTNING, re.compile(r"\bFabric\s*\("))  # a Fabric loop: Lightning imported, a Fabric made


class Note(NamedTuple):
    level: str  # "ok" | "warning"
    message: str
    hint: str | None = None


# (how the script shows the framework, how it shows that it resumes, the framework's name, what a resume
# takes in words, the HINT)
PINNED = 'os.path.join(os.environ.get("HPC_DDP_RUN_DIR", "."), "lightning-checkpoints")'
_FRAMEWORKS = (
    (_FABRIC, r"\.load\s*\(", "Lightning Fabric", "it loads the state it saved (fabric.load)",
     "fabric.save(PATH, state) every N steps, and fabric.load(PATH, state) at start when PATH exists"),
    (_LIGHTNING, r"\bckpt_path\s*=(?!=)", "Lightning", "fit() resumes from Lightning's own checkpoint",
     f'ModelCheckpoint(dirpath={PINNED}, save_last=True, every_n_train_steps=N) and trainer.fit(model, '
     'ckpt_path="last")'),
    (_HF_TRAINER, r"\bresume_from_checkpoint\s*=(?!=)", "the Hugging Face Trainer",
     "train() resumes from its last checkpoint",
     "TrainingArguments(save_steps=N) and trainer.train(resume_from_checkpoint=...) the newest checkpoint-N in "
     "output_dir that holds trainer_state.json, when there is one (get_last_checkpoint may pick a save that a "
     "preemption cut short; docs/frameworks.md, \"A save that a preemption cuts short\")"),
    (_ACCELERATE, r"\.load_state\s*\(", "accelerate", "it loads the state it saved",
     "accelerator.save_state(DIR) every N steps into a new DIR, a file naming the newest whole one, and "
     "accelerator.load_state(DIR) of it at start (docs/frameworks.md, \"A save that a preemption cuts short\")"),
)


def framework_of(source: str) -> str | None:
    """The framework the script runs under (Lightning, the Hugging Face Trainer, accelerate), if any."""
    return _framework_in(code_only(source))


def _framework_in(code: str) -> str | None:
    return next((framework for uses, _, framework, _, _ in _FRAMEWORKS if uses.search(code)), None)


def framework_notes(source: str, name: str) -> list[Note]:
    code = code_only(source)
    name = name if name.isprintable() else repr(name)  # a script named with a newline: still one line
    for uses, resumes, framework, resume, hint in _FRAMEWORKS:
        if not uses.search(code):
            continue
        if re.search(resumes, code):
            return [Note("ok", f"{name} uses {framework} and resumes from its own checkpoint: a preempted or "
                               "timed-out job runs again and continues"), *_moving_checkpoints(code, name),
                    *_moving_folders(source, name)]
        return [Note("warning", f"{name} uses {framework}: a preempted or timed-out job runs again, but starts "
                                f"over unless {resume}", hint)]
    return []


_MODEL_CHECKPOINT = re.compile(r"\bModelCheckpoint\s*\(")
_TRAINER = re.compile(r"(?<![\w.])(?:(?:L|pl|lightning|pytorch_lightning)\.)?Trainer\s*\(")
SIZED = ('L.Trainer(devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), '
         'num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", 1)), ...)')


def _calls(pattern: re.Pattern[str], code: str):
    """(line, argument text) of each call `pattern` opens in `code` (comments and strings blanked)."""
    for match in pattern.finditer(code):
        depth, end = 1, match.end()
        while end < len(code) and depth:
            depth += {"(": 1, ")": -1}.get(code[end], 0)
            end += 1
        yield code.count("\n", 0, match.start()) + 1, code[match.end():end]


def lightning_size_notes(source: str, name: str, nodes: int, tasks_per_node: int) -> list[Note]:
    """A Lightning `Trainer(...)` that does not say how many processes the job has: hpc-ddp starts one per
    task, and a Trainer left at num_nodes=1 (devices="auto": one on a CPU) on 2 nodes makes each rank a
    trainer of its own, all writing one checkpoint folder (measured with Lightning 2.6 on the test Slurm:
    both ranks "rank 0", each through the whole dataset, resumed at different steps). Not for a call that
    passes `**kwargs` (its sizes may be in them) or a job of one task."""
    if nodes * tasks_per_node <= 1:
        return []
    code = code_only(source)
    if _framework_in(code) != "Lightning":
        return []
    name = name if name.isprintable() else repr(name)
    notes = []
    for line, args in _calls(_TRAINER, code):
        if "**" in args:
            continue
        missing = [word for word, needed in (("num_nodes", nodes > 1), ("devices", tasks_per_node > 1))
                   if needed and not re.search(rf"\b{word}\s*=", args)]
        if missing:
            notes.append(Note("warning", f"{name}:{line}: Trainer(...) sets no {' or '.join(missing)}, so on "
                                         f"{nodes} node(s) x {tasks_per_node} task(s) Lightning does not join the "
                                         "ranks into one DDP job: each trains alone", SIZED))
    return notes


def _moving_checkpoints(code: str, name: str) -> list[Note]:
    """A `ModelCheckpoint(...)` without `dirpath`: Lightning saves under its logger's version_N folder, a new
    one at each attempt, so `ckpt_path="last"` finds nothing there and the job starts over (issue 54)."""
    notes = []
    for line, args in _calls(_MODEL_CHECKPOINT, code):
        if not re.search(r"\bdirpath\s*=", args):
            notes.append(Note("warning", f"{name}:{line}: ModelCheckpoint(...) has no dirpath, so Lightning saves "
                                         "under its logger's lightning_logs/version_N, a new folder at each attempt: "
                                         'ckpt_path="last" finds nothing there and the job starts over',
                              f"ModelCheckpoint(dirpath={PINNED}, ...)"))
    return notes


# The checkpoint folder argument of each framework, and the folder under the run dir that pins it.
_FOLDER_ARGS = {"TrainingArguments": ("output_dir", "hf-checkpoints"),
                "Seq2SeqTrainingArguments": ("output_dir", "hf-checkpoints"),
                "ModelCheckpoint": ("dirpath", "lightning-checkpoints"),
                "ProjectConfiguration": ("project_dir", "accelerate")}
# What makes a folder name differ at each attempt: the clock, a random or unique name, the process, and the
# Slurm numbers that change at a requeue (SLURM_RESTART_COUNT) or in a chain's next job (SLURM_JOB_ID).
_CLOCK = {"now", "today", "utcnow", "time", "time_ns", "strftime", "ctime", "asctime", "localtime", "gmtime"}
_UNIQUE = {"uuid1", "uuid4", "token_hex", "token_urlsafe", "mkdtemp", "random", "randint", "getpid"}
_MOVING_VARIABLES = {"SLURM_RESTART_COUNT": "a requeue", "SLURM_JOB_ID": "a chain's next job",
                     "SLURM_JOBID": "a chain's next job", "TORCHELASTIC_RESTART_COUNT": "a restart"}


def _moving_folders(source: str, name: str) -> list[Note]:
    """A checkpoint folder whose name changes at each attempt (a timestamp, a uuid, the restart count), read
    from the syntax tree, one assignment deep: the next attempt looks for checkpoints in a new folder and
    starts over, without a word (issue 54). A script that does not parse is left to the compile check."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    assigned: dict[str, list[ast.expr]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            assigned.setdefault(node.targets[0].id, []).append(node.value)
    notes = []
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        callee = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", None)
        if callee not in _FOLDER_ARGS:
            continue
        argument, folder = _FOLDER_ARGS[callee]
        for keyword in call.keywords:
            why = _varies(keyword.value, assigned, 3) if keyword.arg == argument else None
            if why:
                notes.append(Note("warning", f"{name}:{keyword.value.lineno}: {callee}({argument}=...) is a new "
                                             f"folder at each attempt ({why}): the next attempt looks for its "
                                             "checkpoints there, finds none, and starts over",
                                  f'{argument}=os.path.join(os.environ.get("HPC_DDP_RUN_DIR", "."), "{folder}")'))
    return notes


def _varies(node: ast.expr, assigned: dict[str, list[ast.expr]], depth: int) -> str | None:
    """Why the value of `node` differs at each attempt, or None."""
    for part in ast.walk(node):
        if isinstance(part, ast.Call):
            func = part.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if called in _CLOCK or called in _UNIQUE:
                return f"it holds {_short(part)}"
        if isinstance(part, ast.Constant) and isinstance(part.value, str) and part.value in _MOVING_VARIABLES:
            return f"it holds ${part.value}, which changes at {_MOVING_VARIABLES[part.value]}"
        if isinstance(part, ast.Name) and depth > 0 and part.id in assigned:
            for value in assigned[part.id]:
                why = _varies(value, assigned, depth - 1)
                if why:
                    return why
    return None


def _short(node: ast.expr) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 40 else text[:37] + "..."
