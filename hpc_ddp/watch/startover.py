"""Attempts that trained again from step 0 after an earlier attempt (or srun step) had got further: a start
over, which `status` and `timeline` say in a line of its own instead of leaving it to a loss curve. Pure: the
callers read the records and the logs.

What hpc-ddp can observe:
- the Session API and the built-in trainer: a `start` record (no checkpoint found) in an attempt after an
  earlier one had recorded steps (the timeline's redone steps, which goodput counts as lost);
- Lightning: the line its Trainer prints when `fit(ckpt_path="last")` finds no checkpoint, in a later
  attempt's log;
- the Hugging Face Trainer (its info-level log): a later attempt's training banner without the line that says
  it resumed ("Resuming training from checkpoint" in transformers 5, "Continuing training from checkpoint"
  before).
What it cannot: accelerate and Fabric loops and plain scripts print nothing of their own when they start
from scratch; `status` cannot tell their start over from a resume.

The other way round, `framework_resumes` reads where a framework says it did resume (Lightning's "Restoring
states from the checkpoint path at ...", the Hugging Face Trainer's line), since a framework's run records
no checkpoint step of hpc-ddp's for `status` to show.
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Mapping

from hpc_ddp.watch.timeline import Timeline

__all__ = ["StartOver", "start_overs", "start_over_lines", "framework_resumes", "LIGHTNING_NONE", "LIGHTNING_RESTORED",
           "HF_BANNER", "HF_RESUMED"]

LIGHTNING_NONE = "there is no last checkpoint available"
LIGHTNING_RESTORED = "Restoring states from the checkpoint path at "
HF_BANNER = "***** Running training *****"
HF_RESUMED = ("Resuming training from checkpoint", "Continuing training from checkpoint")
_LIGHTNING_HINT = ('give ModelCheckpoint a dirpath that stays the same across attempts, e.g. dirpath=os.path.join('
                   'os.environ.get("HPC_DDP_RUN_DIR", "."), "lightning-checkpoints"), with save_last=True, and '
                   'fit(ckpt_path="last")')
_HF_HINT = ("trainer.train(resume_from_checkpoint=...) the newest checkpoint-N in output_dir that holds "
            "trainer_state.json, when there is one (docs/frameworks.md, \"A save that a preemption cuts short\")")
_SESSION_HINT = ("call run.resume() before the loop on every attempt, with the same run dir (a different "
                 "--run-dir, or checkpoints removed, starts afresh)")


@dataclasses.dataclass(frozen=True)
class StartOver:
    attempt: int              # the attempt that started over
    redone: int | None        # steps trained again (None: not known, the framework reports no steps here)
    why: str
    hint: str

    def line(self) -> str:
        redone = f", {self.redone} steps trained again" if self.redone else ""
        return f"! attempt {self.attempt} started over from step 0{redone}: {self.why} HINT: {self.hint}"


def start_overs(timeline: Timeline, logs: Mapping[int, str]) -> list[StartOver]:
    """From the timeline's records and each attempt's rank-0 log text (attempt -> text)."""
    found: dict[int, StartOver] = {}
    for i, span in enumerate(timeline.spans):
        if i and span.resume_step == 0 and span.redone_steps:
            found[span.attempt] = StartOver(span.attempt, span.redone_steps, "no checkpoint was resumed, though an "
                                            "earlier attempt had trained", _SESSION_HINT)
    for attempt, text in sorted(logs.items()):
        if attempt <= 0 or attempt in found:
            continue
        if LIGHTNING_NONE in text:
            found[attempt] = StartOver(attempt, None, f'Lightning found no checkpoint to resume ("{LIGHTNING_NONE}")',
                                       _LIGHTNING_HINT)
        elif HF_BANNER in text and not any(said in text for said in HF_RESUMED):
            found[attempt] = StartOver(attempt, None, "the Hugging Face Trainer began without resuming from a "
                                       "checkpoint", _HF_HINT)
    return [found[a] for a in sorted(found)]


def start_over_lines(overs: list[StartOver]) -> list[str]:
    return [o.line() for o in overs]


def framework_resumes(logs: Mapping[int, str]) -> dict[int, str]:
    """attempt -> what its framework's log says it resumed from, for the attempts after the first whose rank-0
    log head says so: "Lightning restored last.ckpt", "the Hugging Face Trainer resumed from its checkpoint"."""
    found: dict[int, str] = {}
    for attempt, text in sorted(logs.items()):
        if attempt <= 0:
            continue
        at = text.find(LIGHTNING_RESTORED)
        if at >= 0:
            path = text[at + len(LIGHTNING_RESTORED):].split("\n", 1)[0].strip().rstrip(".")
            name = posixpath.basename(path)[:80]
            found[attempt] = f"Lightning restored {name if name.isprintable() and name else 'its checkpoint'}"
        elif any(said in text for said in HF_RESUMED):
            found[attempt] = "the Hugging Face Trainer resumed from its checkpoint"
    return found
