#!/usr/bin/env bash
# Stop the test Slurm started by slurm-up.sh (slurmctld, slurmd, slurmdbd and its MariaDB; munged is
# left running, it is harmless).
set -u
ROOT=${HPC_DDP_SLURM_ROOT:-/var/tmp/hpc-ddp-slurm}
pkill -x slurmctld 2>/dev/null
pkill -x slurmd 2>/dev/null
pkill -x slurmdbd 2>/dev/null
# Our MariaDB only (its own socket under $ROOT), never the system's.
if [ -S "$ROOT/mysql.sock" ]; then
    mariadb-admin --no-defaults --socket="$ROOT/mysql.sock" -u root shutdown >/dev/null 2>&1
fi
for _ in $(seq 50); do
    pgrep -x slurmctld >/dev/null || pgrep -x slurmd >/dev/null || pgrep -x slurmdbd >/dev/null || exit 0
    sleep 0.1
done
pkill -9 -x slurmctld 2>/dev/null
pkill -9 -x slurmd 2>/dev/null
pkill -9 -x slurmdbd 2>/dev/null
exit 0
