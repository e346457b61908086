"""watch.startover: an attempt that trained again from step 0 is named, from the Session's records or what
Lightning and the Hugging Face Trainer print; a resume, a first attempt, or a framework that says nothing
are not."""

from __future__ import annotations

from hpc_ddp.watch.startover import HF_BANNER, HF_RESUMED, LIGHTNING_NONE, start_overs
from hpc_ddp.watch.timeline import build_timeline


def _records(second: str, step: int = 0):
    events = [{"time": 0, "event": "attempt_start", "attempt": 0, "job_id": "7"},
              {"time": 1, "event": "start", "step": 0},
              {"time": 20, "event": "attempt_end", "attempt": 0, "cause": "preempted", "exit_code": 0},
              {"time": 30, "event": "attempt_start", "attempt": 1, "job_id": "7"},
              {"time": 31, "event": second, "step": step}]
    metrics = [{"time": 2 + i, "step": i + 1, "loss": 1.0} for i in range(15)]
    metrics += [{"time": 32 + i, "step": step + i + 1, "loss": 1.0} for i in range(5)]
    return build_timeline(events, metrics)


def test_a_session_that_found_no_checkpoint_after_15_steps_started_over_and_a_resume_did_not():
    (over,) = start_overs(_records("start"), {})
    assert (over.attempt, over.redone) == (1, 15)
    assert over.line().startswith("! attempt 1 started over from step 0, 15 steps trained again: no checkpoint was "
                                  "resumed") and "HINT: call run.resume()" in over.line()
    assert start_overs(_records("resume", 15), {}) == []
    assert start_overs(_records("resume", 10), {}) == []  # 5 steps redone since the checkpoint: no start over


def test_what_the_frameworks_print_in_a_later_attempt():
    timeline = build_timeline([], [])
    lightning = start_overs(timeline, {0: LIGHTNING_NONE, 1: f"... {LIGHTNING_NONE}. No checkpoint will be loaded."})
    assert [(o.attempt, o.redone) for o in lightning] == [(1, None)] and "dirpath" in lightning[0].hint
    logs = {1: f"{HF_BANNER}\n", 2: f"{HF_BANNER}\n  {HF_RESUMED[0]} with epoch 0 and global step 20",  # transformers 5
            3: f"{HF_BANNER}\n{HF_RESUMED[1]}, will skip to saved global_step"}  # transformers 4
    assert [o.attempt for o in start_overs(timeline, logs)] == [1]
    assert start_overs(timeline, {1: "epoch 3 loss 0.2\n"}) == []  # a plain script: nothing to go by
