#!/usr/bin/env bash
# Stop the test Slurm started by slurm-up.sh (slurmctld, slurmd, slurmdbd and its MariaDB; munged is
# left running, it is harmless), and unmount what slurm-up bound into a newer release's root (chroot.sh).
set -u
ROOT=${HPC_DDP_SLURM_ROOT:-/var/tmp/hpc-ddp-slurm}
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/cluster/chroot.sh
. "$here/chroot.sh"
unmount_roots() {
    local release
    for release in "${CHROOT_RELEASE[@]}"; do umount_chroot "$CHROOTS/$release"; done
    rm_wrappers "$ROOT/bin"
}
pkill -x slurmctld 2>/dev/null
pkill -x slurmd 2>/dev/null
pkill -x slurmdbd 2>/dev/null
# Our MariaDB only (its own socket under $ROOT), never the system's.
if [ -S "$ROOT/mysql.sock" ]; then
    mariadb-admin --no-defaults --socket="$ROOT/mysql.sock" -u root shutdown >/dev/null 2>&1
fi
for _ in $(seq 50); do
    pgrep -x slurmctld >/dev/null || pgrep -x slurmd >/dev/null || pgrep -x slurmdbd >/dev/null || { unmount_roots; exit 0; }
    sleep 0.1
done
pkill -9 -x slurmctld 2>/dev/null
pkill -9 -x slurmd 2>/dev/null
pkill -9 -x slurmdbd 2>/dev/null
sleep 0.2
unmount_roots
exit 0
