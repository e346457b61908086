"""hpc_ddp.start()'s settings (issue 53): a mistake is one UsageError line with the fix, never a traceback
from deep inside, and no number means what it does not say (-1 minutes as every step, nan as never)."""

import math

import pytest

from hpc_ddp.trainer.sessionbase import UsageError
from hpc_ddp.trainer.settings import SETTINGS, check_settings, count_setting


@pytest.mark.parametrize("settings,says", [
    ({"checkpoint_every": 5}, "did you mean checkpoint_every_steps="),
    ({"keep_last": 3}, "did you mean keep="),
    ({"colour": "red"}, "the settings are:"),
    ({"keep": 0}, "keep takes a whole number of checkpoints to keep, 2 or more"),
    ({"keep": 1}, "2 or more"),
    ({"keep": 2.0}, "2 or more"),
    ({"checkpoint_every_steps": "2"}, "a whole number of steps"),
    ({"checkpoint_every_steps": -1}, "a whole number of steps"),
    ({"checkpoint_every_steps": True}, "a whole number of steps"),
    ({"log_every": "3"}, "1 or more"),
    ({"log_every": 0}, "1 or more"),
    ({"checkpoint_every_minutes": None}, 'or "auto"'),
    ({"checkpoint_every_minutes": -1}, 'or "auto"'),
    ({"checkpoint_every_minutes": math.nan}, 'or "auto"'),
    ({"checkpoint_every_minutes": math.inf}, 'or "auto"'),
    ({"checkpoint_every_minutes": "30"}, 'or "auto"'),
    ({"stop_lead_seconds": -5}, "0 or more"),
    ({"exit_on_stop": "no"}, "True or False"),
    ({"loggers": "tensorboard"}, "a list of logger names"),
    # round 5's rerun (issue 53): an int past a float's range is no number; a fingerprint must be JSON
    ({"checkpoint_every_minutes": 10 ** 400}, 'or "auto"'),
    ({"stop_lead_seconds": 10 ** 400}, "0 or more"),
    ({"fingerprint": {"a": object()}}, "a mapping of plain values"),
    ({"fingerprint": {"lr": math.nan}}, "a mapping of plain values"),
])
def test_a_wrong_setting_is_one_line_that_names_the_fix(settings, says):
    with pytest.raises(UsageError) as caught:
        check_settings(settings)
    line = f"{caught.value.message} HINT: {caught.value.hint}"
    assert says in line and "\n" not in line


def test_the_settings_a_loop_may_pass_go_through_as_they_are():
    good = {"checkpoint_every_steps": 0, "checkpoint_every_minutes": "auto", "keep": 2, "log_every": 1,
            "stop_lead_seconds": 0.0, "exit_on_stop": False, "loggers": ["tensorboard"], "fingerprint": {"lr": 1}}
    assert check_settings(good) == good
    assert check_settings({"checkpoint_every_minutes": 0}) == {"checkpoint_every_minutes": 0}
    assert set(SETTINGS) >= set(good)
    assert count_setting("log_every", 7, 1) == 7
