"""Runs in the batch script and the per-rank wrapper on compute nodes: attempts and requeue policy, rank environment, staging."""
