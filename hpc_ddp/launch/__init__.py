"""Runs on the login node: plan and submit a run. The executors, the batch script's rendering, containers,
sweeps, run dirs, and a notebook's ranks started on this machine."""
