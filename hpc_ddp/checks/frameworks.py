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

import re
from typing import NamedTuple

from hpc_ddp.job.devicescan import code_only  # the one blanking of comments and strings, shared with the GPU scan

__all__ = ["Note", "framework_notes", "code_only"]

# A line's start is `^[ \t\f]*`, never `^\s*`: \s crosses newlines, so from the start of every line of a long
# run of blank lines it would scan the rest of the run (quadratic: 4 MB of newlines never finished).
_LIGHTNING = re.compile(r"^[ \t\f]*(?:import|from)[ \t]+(?:pytorch_lightning|lightning)\b", re.M)
_HF_TRAINER = re.compile(r"^[ \t\f]*from[ \t]+transformers[ \t]+import[ \t]+(?:\([^)]*|[^\n]*)\bTrainer\b"
                         r"|\btransformers\.Trainer\b", re.M)
_ACCELERATE = re.compile(r"^[ \t\f]*(?:from[ \t]+accelerate[ \t]+import|import[ \t]+accelerate)\b", re.M)


class Note(NamedTuple):
    level: str  # "ok" | "warning"
    message: str
    hint: str | None = None


# (how the script shows the framework, how it shows that it resumes, the framework's name, what a resume
# takes in words, the HINT)
_FRAMEWORKS = (
    (_LIGHTNING, r"\bckpt_path\s*=(?!=)", "Lightning", "fit() resumes from Lightning's own checkpoint",
     'ModelCheckpoint(save_last=True, every_n_train_steps=N) and trainer.fit(model, ckpt_path="last")'),
    (_HF_TRAINER, r"\bresume_from_checkpoint\s*=(?!=)", "the Hugging Face Trainer",
     "train() resumes from its last checkpoint",
     "TrainingArguments(save_steps=N) and trainer.train(resume_from_checkpoint=get_last_checkpoint(args.output_dir)) "
     "(transformers.trainer_utils)"),
    (_ACCELERATE, r"\.load_state\s*\(", "accelerate", "it loads the state it saved",
     "accelerator.save_state(DIR) every N steps, and accelerator.load_state(DIR) at start when DIR exists"),
)


def framework_of(source: str) -> str | None:
    """The framework the script runs under (Lightning, the Hugging Face Trainer, accelerate), if any."""
    code = code_only(source)
    return next((framework for uses, _, framework, _, _ in _FRAMEWORKS if uses.search(code)), None)


def framework_notes(source: str, name: str) -> list[Note]:
    code = code_only(source)
    name = name if name.isprintable() else repr(name)  # a script named with a newline: still one line
    for uses, resumes, framework, resume, hint in _FRAMEWORKS:
        if not uses.search(code):
            continue
        if re.search(resumes, code):
            return [Note("ok", f"{name} uses {framework} and resumes from its own checkpoint: a preempted or "
                               "timed-out job runs again and continues")]
        return [Note("warning", f"{name} uses {framework}: a preempted or timed-out job runs again, but starts "
                                f"over unless {resume}", hint)]
    return []
