"""Slurm knowledge (pure where it can be): hostlists, time strings, and the cluster as sinfo describes it."""
