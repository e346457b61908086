#!/usr/bin/env bash
# Stop the test Slurm started by slurm-up.sh (slurmctld and slurmd; munged is left running, it is harmless).
set -u
pkill -x slurmctld 2>/dev/null
pkill -x slurmd 2>/dev/null
for _ in $(seq 50); do
    pgrep -x slurmctld >/dev/null || pgrep -x slurmd >/dev/null || exit 0
    sleep 0.1
done
pkill -9 -x slurmctld 2>/dev/null
pkill -9 -x slurmd 2>/dev/null
exit 0
