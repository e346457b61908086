"""Checks before anything queues (login node): the preflight (can this job run on this cluster as asked), the
ranks' Python, MASTER_ADDR, what a framework's script needs to resume. Each answer is a `Finding`."""
