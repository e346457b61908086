"""Secrets never reach what hpc-ddp writes: detection (names, shapes), masking, and every place that writes
(script, spec.json, events, registry, rank logs, status, logs, dry runs), down to one local run."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpc_ddp.cli import cli
from hpc_ddp.common import secrets
from hpc_ddp.common.errors import SpecError
from hpc_ddp.common.events import JsonLines
from hpc_ddp.common.procs import FakeCommands
from hpc_ddp.common.secrets import MASK, Scrubber, is_secret_name, scrub, secret_env, secret_values
from hpc_ddp.launch.executors.base import Plan, write_run_dir
from hpc_ddp.launch.executors.local import LocalExecutor
from hpc_ddp.launch.executors.submitit_exec import SubmititExecutor
from hpc_ddp.launch.render import render_sbatch
from hpc_ddp.spec.jobspec import PROFILE_KEYS, JobSpec, Layer, Target, build_spec
from hpc_ddp.watch.status import new_log_lines, run_status

GH = "ghp_" + "Ab1" * 12                       # a GitHub token: caught by its name and its shape
WANDB = "0123456789abcdef" * 2 + "fedcba98"    # 40 hex: caught by its name only
ARG = "ghp_" + "Zy9" * 12                      # only ever an argument: caught by its shape only
SECRET_ENV = {"GITHUB_TOKEN": GH, "WANDB_API_KEY": WANDB}


# ---- detection: names ----

@pytest.mark.parametrize("name", [
    "GITHUB_TOKEN", "HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID",
    "MLFLOW_TRACKING_PASSWORD", "AWS_SESSION_TOKEN", "OPENAI_API_KEY", "DB_PASS", "PGPASSWD", "GHTOKEN",
    "apiKey", "GOOGLE_CREDENTIALS", "NPM_AUTH", "JUPYTER_COOKIE_SECRET", "SIGNING_KEY", "my-secret",
])
def test_secret_names(name):
    assert is_secret_name(name)


@pytest.mark.parametrize("name", [
    "SLURM_JOB_ID", "SLURM_JOB_PARTITION", "SBATCH_ACCOUNT", "PATH", "HOME", "PWD", "OLDPWD", "KEYBOARD",
    "LESSKEY", "SORT_KEY", "TOKENIZERS_PARALLELISM", "XDG_SESSION_TYPE", "DESKTOP_SESSION", "PASSAGE_DIR",
    "DBUS_SESSION_BUS_ADDRESS", "MASTER_ADDR", "CUDA_VISIBLE_DEVICES",
])
def test_not_secret_names(name):
    assert not is_secret_name(name)


def test_secret_values_skip_what_masking_would_only_mangle():
    env = {**SECRET_ENV, "SLURM_JOB_ID": "123456789", "PATH": "/usr/bin:/bin", "HF_TOKEN": "hf_x",
           "PASSWORD_STORE_DIR": "/home/ada/.password-store", "DB_PASSWORD_LENGTH": "123456",
           "API_TOKEN_ENABLED": "false", "SSH_AUTH_SOCK": "/tmp/ssh-XXXX/agent.1", "DB_PASS": "  hunter22\n"}
    assert secret_values(env) == {GH, WANDB, "hunter22"}
    assert set(secret_env(env)) == {"GITHUB_TOKEN", "WANDB_API_KEY", "DB_PASS"}


# ---- detection: shapes, wherever they appear ----

SHAPED = [
    GH, "github_pat_" + "A1b2" * 10, "glpat-" + "x1Y2" * 5, "hf_" + "aBcD" * 9,
    "sk-proj-" + "Ab3De6Gh9" * 5, "sk_live_" + "a1" * 12, "AKIAIOSFODNN7EXAMPLE", "ASIA1234567890ABCDEF",
    "AIza" + "SyD-" * 8 + "abc", "xoxb-1234567890-abcdefghij",
    "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.abcdefghijKLMNOP",
]


@pytest.mark.parametrize("value", SHAPED)
def test_shapes_are_masked_in_running_text(value):
    text = f"login with {value} failed"
    assert scrub(text, ()) == f"login with {MASK} failed"
    assert Scrubber().leaks(text)


@pytest.mark.parametrize("text", [
    "/scratch/ada/runs/sk-baseline-experiments-2024-long/logs", "commit 3f2a9c1e5b7d4a6f8e0c2b4d6f8a0c2e4b6d8f0a",
    "max_tokens=512 num_token=5 pad_token=<pad> token: None", "step 1200 loss 0.4312 samples/s 9184.2",
    "export HF_TOKEN=$HF_TOKEN", "--tokenizer gpt2 --secret-file /run/secrets/x", "Tokenizer: 50257 tokens",
    "the bearer of bad news", "SLURM_JOB_NODELIST=node[01-04]",
])
def test_ordinary_text_is_left_alone(text):
    assert scrub(text, ()) == text
    assert Scrubber().leaks(text) == []


@pytest.mark.parametrize("text,expected", [
    ("password=hunter2x and token: 'abc123'", "password=*** and token: '***'"),
    ('{"api_key": "abcdef0123"}', '{"api_key": "***"}'),
    ("train.py --hf-token s3cr3t-value --lr 0.1", "train.py --hf-token *** --lr 0.1"),
    ("MLFLOW_TRACKING_PASSWORD=pa55word", "MLFLOW_TRACKING_PASSWORD=***"),
    ("Authorization: Bearer abcdefghijklmnop0123", "Authorization: Bearer ***"),
])
def test_keyed_values_mask_the_value_and_keep_the_key(text, expected):
    assert scrub(text, ()) == expected


def test_values_are_masked_longest_first_and_names_stay():
    assert scrub("seen abcdef1234!", ["abcdef12", "abcdef1234"]) == "seen ***!"
    assert scrub(f"GITHUB_TOKEN={GH}", [GH]) == "GITHUB_TOKEN=***"
    assert scrub(f"{WANDB} and {WANDB}", [WANDB]) == "*** and ***"


def test_masked_text_discloses_nothing_more():
    scrubber = Scrubber(SECRET_ENV)
    for text in [*SHAPED, f"key {WANDB}", "password=hunter2x", "--token abcdefgh"]:
        assert scrubber.leaks(scrubber(text)) == [] and scrubber(scrubber(text)) == scrubber(text)


def test_private_key_blocks_are_masked_whole():
    key = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEA\nAAAABG5vbmU=\n-----END OPENSSH PRIVATE KEY-----"
    assert scrub(f"before\n{key}\nafter", ()) == f"before\n{MASK}\nafter"
    lines = ["before\n", *[line + "\n" for line in key.splitlines()], "after\r\n"]
    assert list(Scrubber().lines(lines)) == ["before\n", *[MASK + "\n"] * 4, "after\r\n"]


def test_deep_masks_every_string_of_a_record():
    record = {"event": "gave_up", "reason": f"token {GH}", "n": 3, "ok": True, "x": None,
              "nested": [f"{WANDB}", {"p": Path(f"/x/{GH}")}]}
    assert Scrubber(SECRET_ENV).deep(record) == {"event": "gave_up", "reason": "token ***", "n": 3, "ok": True,
                                                 "x": None, "nested": ["***", {"p": "/x/***"}]}


def test_current_follows_the_environment(monkeypatch):
    monkeypatch.setenv("GITHUB_TOKEN", GH)
    assert secrets.current()(GH + " x") == "*** x"
    assert secrets.current() is secrets.current()  # cached while the secret variables stay the same
    monkeypatch.setenv("WANDB_API_KEY", WANDB)
    assert secrets.current()(WANDB) == MASK


# ---- scripts: masked in comments, refused where the line runs ----

def spec_of(values: dict, args=("--lr", "0.1"), profile: dict | None = None) -> JobSpec:
    layers = [Layer("profile 'site'", profile, frozenset(PROFILE_KEYS))] if profile else []
    layers.append(Layer("command line", values))
    return build_spec(layers, target=Target("script", "/home/ada/proj/train.py", tuple(args)),
                      workdir="/home/ada/proj", python="/opt/venv/bin/python")


def render(spec: JobSpec, command_line: str = "hpc-ddp submit train.py") -> str:
    return render_sbatch(spec, "/scratch/ada/runs/t", generated_at="now", command_line=command_line,
                         scrubber=Scrubber(SECRET_ENV))


def test_arguments_are_masked_in_the_script_comments():
    text = render(spec_of({}, args=("--token", ARG, "--key", WANDB)),
                  command_line=f"hpc-ddp submit train.py -- --token {ARG} --key {WANDB}")
    assert ARG not in text and WANDB not in text
    assert "#   hpc-ddp submit train.py -- --token *** --key ***" in text
    assert "#   /home/ada/proj/train.py --token *** --key ***" in text


def test_a_setup_line_pasting_a_secret_is_refused_by_name():
    spec = spec_of({"profile": "site"}, profile={"setup": ["module load cuda", f"export GITHUB_TOKEN={GH}"]})
    with pytest.raises(SpecError) as err:
        render(spec)
    message = str(err.value)
    assert GH not in message and "$GITHUB_TOKEN" in message and "a setup line of profile 'site'" in message
    assert "HINT: reference it as $GITHUB_TOKEN in the setup line instead of pasting its value" in message


def test_a_setup_line_referencing_a_secret_renders():
    spec = spec_of({}, profile={"setup": ["export GITHUB_TOKEN=$GITHUB_TOKEN", "export HF_TOKEN=${HF_TOKEN}"]})
    assert "export GITHUB_TOKEN=$GITHUB_TOKEN" in render(spec)


def test_shaped_secrets_in_sbatch_options_are_refused():
    with pytest.raises(SpecError, match="an sbatch option would write an AWS access key id") as err:
        render(spec_of({"sbatch_args": ["--comment=AKIAIOSFODNN7EXAMPLE"]}))
    assert "AKIAIOSFODNN7EXAMPLE" not in str(err.value)


def test_submitit_plan_refuses_setup_secrets_and_masks_arguments(monkeypatch):
    monkeypatch.setenv("GITHUB_TOKEN", GH)
    with pytest.raises(SpecError, match=r"a setup line would write the value of \$GITHUB_TOKEN"):
        SubmititExecutor().plan(spec_of({}, profile={"setup": [f"export T={GH}"]}), "/r")
    assert ARG not in SubmititExecutor().plan(spec_of({}, args=("--token", ARG)), "/r").summary


# ---- what we write to disk ----

def test_spec_json_keeps_arguments_but_is_private(tmp_path):
    spec = spec_of({}, args=("--token", ARG))
    run_dir = write_run_dir(Plan("local", spec, str(tmp_path / "run"), None, ""))
    spec_json = run_dir / "spec.json"
    assert json.loads(spec_json.read_text())["target"]["args"] == ["--token", ARG]  # the ranks need it
    assert spec_json.stat().st_mode & 0o777 == 0o600


def test_local_dry_run_masks_arguments():
    summary = LocalExecutor(job_id="local-1").plan(spec_of({}, args=("--token", ARG)), "/r").summary
    assert ARG not in summary and "--token ***" in summary


def test_events_and_registry_records_are_masked(tmp_path, monkeypatch):
    monkeypatch.setenv("GITHUB_TOKEN", GH)
    JsonLines(tmp_path / "events.jsonl").write({"event": "gave_up", "reason": f"401 for {GH}", "arg": ARG})
    line = (tmp_path / "events.jsonl").read_text()
    assert GH not in line and ARG not in line and json.loads(line)["reason"] == "401 for ***"


def test_status_and_logs_mask_what_slurm_wrote(tmp_path, monkeypatch):
    """Under sbatch the rank logs are Slurm's, unmasked; what status and logs print is masked."""
    monkeypatch.setenv("WANDB_API_KEY", WANDB)
    log = tmp_path / "logs" / "job-7" / "attempt-0" / "rank-0.log"
    log.parent.mkdir(parents=True)
    log.write_text(f"key {WANDB}\nTraceback (most recent call last):\n  File \"t.py\", line 1\n"
                   f"ValueError: bad key {WANDB} / {ARG}\n-----BEGIN RSA PRIVATE KEY-----\nMIIEow\n")
    JsonLines(tmp_path / "events.jsonl").write({"event": "attempt_end", "attempt": 0, "exit_code": 1})
    status = run_status(tmp_path, "7", "sbatch", FakeCommands({}))
    assert status["failure"] == {"kind": "user_code_exception", "detail": "ValueError: bad key *** / ***"}
    printed = "\n".join(new_log_lines(tmp_path, None, {}))
    assert WANDB not in printed and ARG not in printed and "MIIEow" not in printed
    assert "[attempt 0 rank 0] key ***" in printed


# ---- end to end: one local run with secrets in its environment and its arguments ----

LEAKY = """\
import hashlib, os, sys
token, key = os.environ["GITHUB_TOKEN"], os.environ["WANDB_API_KEY"]
print(f"GITHUB_TOKEN={token} WANDB_API_KEY={key}", flush=True)
print("argv ok" if hashlib.sha256(sys.argv[2].encode()).hexdigest() == "%s" else "argv WRONG", flush=True)
raise RuntimeError(f"could not log in with {token} and {sys.argv[2]}")
"""


@pytest.mark.e2e
def test_a_local_run_leaks_no_secret(tmp_path, monkeypatch):
    for name, value in SECRET_ENV.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "leaky.py").write_text(LEAKY % hashlib.sha256(ARG.encode()).hexdigest())
    done = subprocess.run([sys.executable, "-m", "hpc_ddp", "submit", "--executor", "local", "--nodes", "1",
                           "--tasks-per-node", "2", "--run-dir", "run", "leaky.py", "--", "--token", ARG],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=dict(os.environ), check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "GITHUB_TOKEN=*** WANDB_API_KEY=***" in output and "argv ok" in output  # the real argv arrived
    status = CliRunner().invoke(cli, ["status", str(tmp_path / "run")])
    assert "RuntimeError: could not log in with *** and ***" in status.output
    for secret in (GH, WANDB, ARG):
        assert secret not in output and secret not in status.output
    run_dir = tmp_path / "run"
    for path in (p for p in run_dir.rglob("*") if p.is_file()):
        data = path.read_bytes()
        assert GH.encode() not in data and WANDB.encode() not in data, path
        assert ARG.encode() not in data or path.name == "spec.json", path
    assert (run_dir / "spec.json").stat().st_mode & 0o077 == 0


def test_following_a_log_never_prints_half_a_token(tmp_path, monkeypatch):
    from hpc_ddp.watch.status import new_log_lines

    monkeypatch.setenv("HF_TOKEN", "hf_" + "q" * 34)
    log = tmp_path / "logs" / "job-7" / "attempt-0" / "rank-0.log"
    log.parent.mkdir(parents=True)
    log.write_text("step 1\nlogin with hf_qqqqq")  # the rank is in the middle of writing the token
    offsets: dict = {}
    assert list(new_log_lines(tmp_path, None, offsets, whole_lines=True)) == ["[attempt 0 rank 0] step 1"]
    with open(log, "a") as fh:
        fh.write("q" * 29 + " ok\n")
    assert list(new_log_lines(tmp_path, None, offsets, whole_lines=True)) == ["[attempt 0 rank 0] login with *** ok"]
