"""Failure classification, pure: log text -> (kind, the line that shows it)."""

from hpc_ddp.watch.classify import classify_failure


def test_a_plain_traceback_names_the_exception_line():
    text = 'Traceback (most recent call last):\n  File "t.py", line 3, in <module>\nValueError: bad lr\n'
    assert classify_failure([text]) == ("user_code_exception", "ValueError: bad lr")


def test_torch_rank_prefixes_are_read_through():
    text = ("[rank0]: Traceback (most recent call last):\n"
            '[rank0]:   File "/w/crash_at_step.py", line 33, in <module>\n'
            "[rank0]:     raise RuntimeError('crash at step 12')\n"
            "[rank0]: RuntimeError: crash at step 12\n")
    assert classify_failure([text]) == ("user_code_exception", "RuntimeError: crash at step 12")


def test_specific_causes_come_before_a_traceback():
    text = "Traceback (most recent call last):\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\n"
    assert classify_failure([text])[0] == "out_of_memory"
    assert classify_failure(["all fine"]) is None


def test_a_traceback_cut_short_by_a_kill_does_not_hide_the_complete_one():
    """Rank 1 killed mid-traceback (srun --kill-on-bad-exit after rank 0's crash): rank 0's says what happened."""
    cut = "Traceback (most recent call last):\n  File \"/run/code/x/crash.py\", line 1, in <module>\n"
    whole = "Traceback (most recent call last):\n  File \"crash.py\", line 1, in <module>\nRuntimeError: bad config\n"
    assert classify_failure([cut, whole]) == ("user_code_exception", "RuntimeError: bad config")
    assert classify_failure([cut]) == ("user_code_exception", "Traceback (most recent call last):")
