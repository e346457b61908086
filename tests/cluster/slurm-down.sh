#!/usr/bin/env bash
# Stop the test Slurm started by slurm-up.sh (slurmctld, slurmd, slurmdbd and its MariaDB, and the SSH tests'
# sshd for it; munged is left running, it is harmless), and unmount what slurm-up bound into a newer
# release's root (chroot.sh).
# HPC_DDP_SLURM_INSTANCE=K: that test Slurm (tests/cluster/instance.sh); another instance's daemons, MariaDB
# and roots are left alone.
set -u
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/cluster/instance.sh
. "$here/instance.sh"
# shellcheck source=tests/cluster/chroot.sh
. "$here/chroot.sh"
# The roots this instance mounted (slurm-up.sh lists them in $ROOT/chroots), each only if it is one of ours.
unmount_roots() {
    local dir release
    if [ -f "$ROOT/chroots" ]; then
        while read -r dir; do
            for release in "${CHROOT_RELEASE[@]}"; do
                [ "$dir" = "$CHROOTS/$release" ] && umount_chroot "$dir"
            done
        done < "$ROOT/chroots"
        rm -f "$ROOT/chroots"
    fi
    rm_wrappers "$ROOT/bin"
}
stop_our_daemons
stop_our_sshd
# Our MariaDB only (its own socket under $ROOT), never the system's.
if [ -S "$ROOT/mysql.sock" ]; then
    mariadb-admin --no-defaults --socket="$ROOT/mysql.sock" -u root shutdown >/dev/null 2>&1
fi
unmount_roots
exit 0
