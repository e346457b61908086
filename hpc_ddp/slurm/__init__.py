"""Slurm knowledge (pure where it can be): hostlists, time strings, the cluster as sinfo describes it, a job as
squeue, sacct and scontrol describe it, and sbatch."""
