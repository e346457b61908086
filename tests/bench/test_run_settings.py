"""bench/run.py --set: one setting changed, typed as the setting is; a wrong key or value is refused."""

import pytest

from bench.common import settings
from bench.run import overridden


def test_set_changes_the_named_settings_with_their_types():
    s = overridden(settings(False), ["gpu_repeats=2", "ckpt_model=resnet18"])
    assert (s.gpu_repeats, s.ckpt_model, s.gpu_steps) == (2, "resnet18", settings(False).gpu_steps)


@pytest.mark.parametrize("pair", ["gpu_repeats", "nope=1", "quick=1", "gpu_repeats=two"])
def test_set_refuses_what_is_not_a_setting_or_not_its_type(pair):
    with pytest.raises(ValueError, match="--set"):
        overridden(settings(False), [pair])
