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


def test_where_a_framework_says_it_resumed_status_says_so_instead_of_step_none(tmp_path):
    """Issue 54's newcomer: a Lightning run that resumed showed "started at checkpoint step None", and only
    the rank logs said otherwise. Lightning 2.6's line, as its log prints it on attempt 1."""
    from hpc_ddp.watch.startover import LIGHTNING_RESTORED, framework_resumes

    logs = {0: f"{LIGHTNING_RESTORED}/r/ckpt/last.ckpt", 1: f"x\n{LIGHTNING_RESTORED}/r/run/ckpt/last.ckpt\nmore",
            2: f"{HF_BANNER}\n  {HF_RESUMED[0]} with epoch 0 and global step 20", 3: "epoch 3 loss 0.2\n",
            4: f"{LIGHTNING_RESTORED}/r/\x1b[2J.ckpt\n"}
    assert framework_resumes(logs) == {1: "Lightning restored last.ckpt",
                                       2: "the Hugging Face Trainer resumed from its checkpoint",
                                       4: "Lightning restored its checkpoint"}   # a name no terminal should obey


def test_status_names_the_frameworks_resume_on_its_attempt_line(tmp_path):
    import json

    from click.testing import CliRunner

    from hpc_ddp.cli.app import cli
    from hpc_ddp.spec.jobspec import Layer, Target, build_spec
    from hpc_ddp.watch.startover import LIGHTNING_RESTORED

    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    spec = build_spec([Layer("c", {"executor": "local"})], target=Target("script", "/t.py"), workdir="/", python="p")
    (run / "spec.json").write_text(json.dumps(spec.to_dict()))
    events = [{"time": 1_790_000_000, "event": "attempt_start", "attempt": 0, "job_id": "local-1"},
              {"time": 1_790_000_020, "event": "attempt_end", "attempt": 0, "cause": "preempted", "exit_code": 0},
              {"time": 1_790_000_030, "event": "attempt_start", "attempt": 1, "job_id": "local-1"},
              {"time": 1_790_000_050, "event": "attempt_end", "attempt": 1, "cause": "completed", "exit_code": 0}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "submissions.jsonl").write_text(json.dumps({"job_id": "local-1", "executor": "local",
                                                       "time": 1_790_000_000}) + "\n")
    from hpc_ddp.common.rundir import RANK_LOG

    for attempt, text in ((0, "training from step 0\n"), (1, f"{LIGHTNING_RESTORED}{run}/ck/last.ckpt\n")):
        folder = run / "logs" / "job-local-1" / f"attempt-{attempt}"
        folder.mkdir(parents=True)
        (folder / RANK_LOG.format(rank=0)).write_text(text)
    done = CliRunner().invoke(cli, ["status", str(run)])
    assert done.exit_code == 0, done.output
    assert "attempt 1: started as its log says: Lightning restored last.ckpt, ended: completed" in done.output
    assert "attempt 0: started at checkpoint step None" in done.output
