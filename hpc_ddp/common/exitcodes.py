"""Exit codes shared by the trainer, the runner and the batch script."""

# "Checkpointed, requeue me": the ranks saved a checkpoint at a step boundary because a stop was asked
# for (warning signal, SIGTERM). 75 is EX_TEMPFAIL from sysexits.h: a temporary failure, try again.
REQUEUE_EXIT_CODE = 75
