"""Loggers: one run id across attempts exported to every rank, TensorBoard from the session's metrics
(and redone steps purged on resume), W&B's init, and a logger that is not installed."""

import builtins
import sys
import types

import pytest

from hpc_ddp.job.distenv import from_environ
from hpc_ddp.job.runner import rank_environment, run_id_for
from hpc_ddp.spec.jobspec import Layer, Target, build_spec
from hpc_ddp.spec.trainconfig import parse_train
from hpc_ddp.trainer.loggers import Loggers, numeric

STEP = {"SLURM_JOB_ID": "12", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NODELIST": "n[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}


def env_for(environ, run_dir="/runs/my run: 1"):
    spec = build_spec([Layer("flags", {"nodes": 2})], target=Target("script", "/p/t.py", ()), workdir="/p",
                      python="py")
    return rank_environment(spec, from_environ(environ), environ, run_dir, nvidia_driver=False)


def test_one_run_id_for_every_rank_and_attempt():
    first = env_for(STEP)
    requeued = env_for({**STEP, "SLURM_PROCID": "0", "SLURM_RESTART_COUNT": "2", "SLURM_JOB_ID": "12"})
    assert first["HPC_DDP_RUN_ID"] == requeued["HPC_DDP_RUN_ID"] == first["WANDB_RUN_ID"]
    assert first["HPC_DDP_RUN_ID"].startswith("my-run-1-") and len(first["HPC_DDP_RUN_ID"]) == len("my-run-1-") + 12
    assert (first["WANDB_RESUME"], first["WANDB_MODE"]) == ("allow", "offline")
    assert run_id_for("/a/run") != run_id_for("/b/run")  # same name, another place: another run


def test_what_the_user_set_is_inherited_not_overwritten():
    mine = env_for({**STEP, "WANDB_RUN_ID": "abc", "WANDB_MODE": "online", "WANDB_RESUME": "must"})
    assert not {"WANDB_RUN_ID", "WANDB_MODE", "WANDB_RESUME"} & set(mine)
    assert mine["HPC_DDP_RUN_ID"].startswith("my-run-1-")
    theirs = env_for({**STEP, "HPC_DDP_RUN_ID": "exp-7"})
    assert "HPC_DDP_RUN_ID" not in theirs and theirs["WANDB_RUN_ID"] == "exp-7"


def test_train_table_takes_loggers():
    assert parse_train({"loggers": ["tensorboard", "wandb", "tensorboard"]}).loggers == ("tensorboard", "wandb")
    assert parse_train({}).loggers == ()
    with pytest.raises(ValueError, match="loggers: .* is not a list of loggers"):
        parse_train({"loggers": ["mlflow"]})
    with pytest.raises(ValueError, match="not a list"):
        parse_train({"loggers": "tensorboard"})


def test_numeric_keeps_the_curves():
    assert numeric({"step": 3, "epoch": 0, "time": 1.0, "loss": 0.5, "ok": True, "name": "x", "samples_per_s": 9}) \
        == {"loss": 0.5, "samples_per_s": 9.0}


def test_tensorboard_gets_the_metrics_and_a_resume_purges_the_redone_steps(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = Loggers(["tensorboard"], tmp_path, log=print)
    for step in (10, 20, 30):
        first.write({"step": step, "epoch": 0, "loss": 1.0 / step, "samples_per_s": 100.0})
    first.close()
    resumed = Loggers(["tensorboard"], tmp_path, log=print)  # the next attempt, resumed from step 15
    for step in (20, 30, 40):
        resumed.write({"step": step, "epoch": 0, "loss": 2.0, "samples_per_s": 50.0})
    resumed.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {"loss", "samples_per_s"} <= set(acc.Tags()["scalars"])
    loss = {e.step: e.value for e in acc.Scalars("loss")}
    assert loss == {10: pytest.approx(0.1), 20: 2.0, 30: 2.0, 40: 2.0}  # the first attempt's 20 and 30 purged


def test_a_logger_not_installed_is_said_once_and_skipped(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    said = []
    loggers = Loggers(["tensorboard"], tmp_path, log=said.append)
    loggers.write({"step": 1, "loss": 1.0})
    loggers.write({"step": 2, "loss": 1.0})
    loggers.close()
    assert said == ["hpc-ddp: tensorboard is not installed (pip install 'hpc-ddp[tensorboard]'); "
                    "not logging to TensorBoard"]
    assert not (tmp_path / "tensorboard").exists()


def test_wandb_continues_the_run_of_the_run_id(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, values, step):
            calls.append(("log", values, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_RUN_ID", "r-123")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    loggers = Loggers(["wandb"], tmp_path, log=print)
    loggers.write({"step": 5, "epoch": 0, "loss": 0.25})
    loggers.close()
    init = calls[0][1]
    assert (init["id"], init["resume"], init["mode"], init["dir"]) == ("r-123", "allow", "offline", str(tmp_path))
    assert calls[1:] == [("log", {"loss": 0.25}, 5), ("finish",)]


def test_unknown_logger_is_refused_in_one_line_with_the_known_ones():
    from hpc_ddp.trainer.sessionbase import UsageError

    for names, said in ((["mlflow"], r"unknown logger\(s\) 'mlflow'"), ("wandb", "takes a list of names"),
                        (None, "takes a list of names")):
        with pytest.raises(UsageError, match=said) as err:
            Loggers(names, "/tmp", log=print)
        assert "tensorboard, wandb" in err.value.hint
