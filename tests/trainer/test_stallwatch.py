"""The stall limit (issue 32): derived from the observed step time, armed only after a few steps, paused
while a save or an evaluation runs, capped by the collective timeout."""

from __future__ import annotations

import pytest

from hpc_ddp.trainer.stallwatch import ARM_AFTER, FACTOR, limit_for, stalled_for


def test_the_limit_is_a_multiple_of_the_step_at_least_the_floor_and_at_most_the_cap():
    assert limit_for(None) is None
    assert limit_for(0.1, min_s=5) == 5
    assert limit_for(2.0, min_s=5) == FACTOR * 2.0
    assert limit_for(100.0, min_s=5, cap_s=600) == 600


@pytest.mark.parametrize("now, steps, step_s, paused, stalled", [
    (100.0, ARM_AFTER, 0.5, False, 50.0),    # 50 s quiet, limit max(10, 20 x 0.5) = 10
    (100.0, ARM_AFTER - 1, 0.5, False, None),  # not armed: start-up and compilation are not steps
    (100.0, ARM_AFTER, 0.5, True, None),     # a save or an evaluation
    (55.0, ARM_AFTER, 0.5, False, None),     # 5 s quiet: within the limit
    (100.0, ARM_AFTER, None, False, None),   # no step time yet
])
def test_stalled_for(now, steps, step_s, paused, stalled):
    assert stalled_for(now, 50.0, steps, step_s, paused, min_s=10) == stalled
