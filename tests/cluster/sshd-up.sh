#!/usr/bin/env bash
# A "cluster login node" for the SSH tests: Debian's sshd on 127.0.0.1:$PORT, a second Unix user
# ($REMOTE_USER) as the cluster account with key auth, and an ssh_config for this ("laptop") account.
# Idempotent; installs openssh-server with apt-get where it is missing. Prints, as its last line, the
# variables the tests read: eval "$(bash tests/cluster/sshd-up.sh | tail -n 1)".
set -euo pipefail
ROOT=${HPC_DDP_SSHD_ROOT:-/var/tmp/hpc-ddp-sshd}
PORT=${HPC_DDP_SSHD_PORT:-2222}
REMOTE_USER=${HPC_DDP_REMOTE_USER:-hpcremote}
SLURM_CONF_FILE=${SLURM_CONF:-/var/tmp/hpc-ddp-slurm/slurm.conf}
log() { echo "sshd-up: $*" >&2; }
# On a test Slurm of a newer release (HPC_DDP_SLURM_VERSION 24.11 or 26.05, tests/cluster/chroot.sh) the sshd
# runs in that release's root, so the cluster account's sessions run that release's Slurm commands, as on a
# login node of such a cluster. slurm-up.sh builds the root and binds what it needs into it.
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/cluster/chroot.sh
. "$here/chroot.sh"
CHROOT=$(chroot_dir "${HPC_DDP_SLURM_VERSION:-22.05}") || exit 2
if [ -n "$CHROOT" ] && [ ! -x "$CHROOT/usr/sbin/sshd" ]; then
    log "no sshd in $CHROOT: bring the Slurm ${HPC_DDP_SLURM_VERSION} test Slurm up first (slurm-up.sh builds its root)"
    exit 1
fi

if [ ! -x /usr/sbin/sshd ]; then
    log "installing openssh-server (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq openssh-server >/dev/null 2>&1 || { apt-get update -qq; apt-get install -y -qq openssh-server >/dev/null; }
fi
command -v rsync >/dev/null || { export DEBIAN_FRONTEND=noninteractive; apt-get install -y -qq rsync >/dev/null 2>&1 || { apt-get update -qq; apt-get install -y -qq rsync >/dev/null; }; }
id "$REMOTE_USER" >/dev/null 2>&1 || useradd -m -s /bin/bash "$REMOTE_USER"
usermod -p "*" "$REMOTE_USER"   # no password, but not locked: sshd (without PAM) refuses a locked account
REMOTE_HOME=$(getent passwd "$REMOTE_USER" | cut -d: -f6)

# The cluster account runs this checkout's hpc-ddp (remote_hpc_ddp in the tests' profile). Its Python may
# sit in a folder of this account's that others cannot enter (pyenv under /root): let that one user pass
# through (an ACL entry of x only: it lists nothing), folder by folder, where it cannot already.
if [ -n "${HPC_DDP_REMOTE_PYTHON:-}" ]; then
    target=$(readlink -f "$HPC_DDP_REMOTE_PYTHON")
    dir=$(dirname "$target")
    while [ "$dir" != / ]; do
        if ! su -s /bin/sh "$REMOTE_USER" -c "test -x '$dir'" 2>/dev/null; then
            command -v setfacl >/dev/null || { export DEBIAN_FRONTEND=noninteractive; apt-get install -y -qq acl >/dev/null 2>&1 || { apt-get update -qq; apt-get install -y -qq acl >/dev/null; }; }
            setfacl -m "u:$REMOTE_USER:x" "$dir"
            log "let $REMOTE_USER pass through $dir (setfacl u:$REMOTE_USER:x)"
        fi
        # The same folder in the root the sshd runs in, where it is the root's own (not a bound one).
        if [ -n "$CHROOT" ] && [ -d "$CHROOT$dir" ] && [ "$(stat -c %d:%i "$CHROOT$dir")" != "$(stat -c %d:%i "$dir")" ]; then
            command -v setfacl >/dev/null && setfacl -m "u:$REMOTE_USER:x" "$CHROOT$dir"
        fi
        dir=$(dirname "$dir")
    done
fi

mkdir -p "$ROOT" && chmod 755 "$ROOT"
[ -f "$ROOT/host_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -f "$ROOT/host_ed25519"
[ -f "$ROOT/laptop_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -f "$ROOT/laptop_ed25519"
install -d -m 700 -o "$REMOTE_USER" "$REMOTE_HOME/.ssh"
install -m 600 -o "$REMOTE_USER" "$ROOT/laptop_ed25519.pub" "$REMOTE_HOME/.ssh/authorized_keys"
mkdir -p /run/sshd && chmod 755 /run/sshd

cat > "$ROOT/sshd_config" <<CONF
Port $PORT
ListenAddress 127.0.0.1
HostKey $ROOT/host_ed25519
PidFile $ROOT/sshd.pid
AuthenticationMethods publickey
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin no
AllowUsers $REMOTE_USER
UsePAM no
LogLevel VERBOSE
MaxStartups 50:30:100
MaxSessions 50
SetEnv SLURM_CONF=$SLURM_CONF_FILE
Subsystem sftp internal-sftp
CONF

echo "[127.0.0.1]:$PORT $(cut -d' ' -f1,2 "$ROOT/host_ed25519.pub")" > "$ROOT/known_hosts"
cat > "$ROOT/ssh_config" <<CONF
Host cluster
    HostName 127.0.0.1
    Port $PORT
    User $REMOTE_USER
    IdentityFile $ROOT/laptop_ed25519
    IdentitiesOnly yes
    UserKnownHostsFile $ROOT/known_hosts
    StrictHostKeyChecking yes
    BatchMode yes
    ConnectTimeout 10
Host *
    UserKnownHostsFile $ROOT/known_hosts
    StrictHostKeyChecking yes
    BatchMode yes
    ConnectTimeout 5
CONF

if [ -f "$ROOT/sshd.pid" ] && kill -0 "$(cat "$ROOT/sshd.pid")" 2>/dev/null; then
    kill "$(cat "$ROOT/sshd.pid")" && sleep 0.5
fi
SSHD=(/usr/sbin/sshd)
if [ -n "$CHROOT" ]; then
    _bind "$CHROOT" "$ROOT"
    sync_accounts "$CHROOT"   # the account made above, and sshd's own user
    mkdir -p "$CHROOT/run/sshd" && chmod 755 "$CHROOT/run/sshd"
    SSHD=(chroot "$CHROOT" /usr/sbin/sshd)
fi
"${SSHD[@]}" -t -f "$ROOT/sshd_config"
"${SSHD[@]}" -f "$ROOT/sshd_config" -E "$ROOT/sshd.log"
for _ in $(seq 50); do
    ssh -F "$ROOT/ssh_config" -o ControlMaster=no cluster true 2>/dev/null && break
    sleep 0.2
done
ssh -F "$ROOT/ssh_config" -o ControlMaster=no cluster true
echo "export HPC_DDP_SSHD_ROOT=$ROOT HPC_DDP_SSHD_PORT=$PORT HPC_DDP_REMOTE_USER=$REMOTE_USER HPC_DDP_SSH_CONFIG=$ROOT/ssh_config"
