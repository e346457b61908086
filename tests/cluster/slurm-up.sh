#!/usr/bin/env bash
# Start a small real Slurm on this one machine, as root: munge, slurmctld and four slurmd nodes
# (hpcn1..hpcn4) with 2 fake GPUs each declared through GRES, so --gpus-per-node is really scheduled
# and srun sets CUDA_VISIBLE_DEVICES per task; and accounting: a MariaDB of its own (data dir, socket
# and port 3316 under $ROOT, not the system's) behind slurmdbd, so sacct works.
# Idempotent: a second call restarts the Slurm daemons with an empty accounting database (slurmctld
# starts clean, so job ids start again and old records would be mistaken for new jobs); MariaDB itself
# is left running when it answers.
# The last line printed is the `export SLURM_CONF=...` line that points sbatch/srun/squeue at it.
#
# HPC_DDP_SLURM_INSTANCE=K: a second (third...) test Slurm beside the first, with a folder, ports, MariaDB and
# sshd of its own (tests/cluster/instance.sh); starting or stopping one never touches another's daemons.
#
# HPC_DDP_SLURM_VERSION picks the Slurm release: 22.05 (the default) is Debian bookworm's, on this machine;
# 24.11 (Debian trixie) and 26.05 (Debian sid) run from a root of their own release (tests/cluster/chroot.sh:
# built once with mmdebstrap from Debian's repositories, cached). Their daemons, and so every job step, run
# inside that root; the Slurm commands on the export line's PATH ($ROOT/bin) run that release's commands.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/cluster/instance.sh
. "$here/instance.sh"   # ROOT, the ports, our_daemons
# HPC_DDP_SLURM_NODES (2 to 9, default 4): nodes hpcn1...; beyond 2, a partition `wide` has them all (node
# ranges, tests/e2e/test_elastic.py), while debug, short, grace and urgent keep hpcn1 and hpcn2 (what the
# other tests expect: a job in urgent that takes both preempts whatever runs in debug).
COUNT=${HPC_DDP_SLURM_NODES:-4}
case "$COUNT" in [2-9]) ;; *) echo "slurm-up: HPC_DDP_SLURM_NODES must be 2 to 9, not $COUNT" >&2; exit 2 ;; esac
NODES=() ADDRS=()
for ((i = 1; i <= COUNT; i++)); do NODES+=("hpcn$i"); ADDRS+=("127.0.1.$((10 + i))"); done
GPUS_PER_NODE=2
CPUS_PER_NODE=4
DB_SOCK=$ROOT/mysql.sock
VERSION=${HPC_DDP_SLURM_VERSION:-22.05}
# shellcheck source=tests/cluster/chroot.sh
. "$here/chroot.sh"
CHROOT=$(chroot_dir "$VERSION") || exit 2
# Slurm's daemons and commands below run from the version's root (CHROOT; "" for the host's own Slurm).
slurm_argv() { if [ -n "$CHROOT" ]; then SLURM_ARGV=("${CHROOT_ENV[@]/#@ROOT@/$CHROOT}" "$@"); else SLURM_ARGV=("$@"); fi; }
in_slurm() { slurm_argv "$@"; "${SLURM_ARGV[@]}"; }

log() { printf 'slurm-up: %s\n' "$*" >&2; }

install_packages() {
    if command -v slurmctld >/dev/null && command -v munged >/dev/null && command -v sbatch >/dev/null \
        && command -v slurmdbd >/dev/null && command -v mariadbd >/dev/null && command -v ch-run >/dev/null \
        && { [ -z "$CHROOT" ] || command -v mmdebstrap >/dev/null; }; then
        return
    fi
    log "installing slurm-wlm, munge, slurmdbd, mariadb-server and charliecloud-runtime (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # The packages' own MariaDB service is not used: the one below has a data dir of its own.
    # charliecloud-runtime (ch-run) is the container runtime of the container tests (tests/cluster/ch-image.sh).
    # mmdebstrap: the roots of the newer releases (tests/cluster/chroot.sh).
    apt-get install -y -qq slurm-wlm munge slurmdbd mariadb-server charliecloud-runtime mmdebstrap >/dev/null
}

# Start a daemon in the background with none of our file descriptors: one it inherited would hold what
# the caller holds for as long as it runs, such as the flock(1) lock the tests take around slurm-up, or
# the pipe `make test` reads the export line from (it would never see the end of it). The forked
# subshell closes them and then becomes the daemon (exec), so no shell is left holding them either.
spawn() {
    (
        fd=
        for fd in $(ls /proc/$BASHPID/fd); do
            [ "$fd" -gt 2 ] && eval "exec $fd>&-"
        done 2>/dev/null
        exec "$@" </dev/null >/dev/null 2>&1
    ) &
}

db() { mariadb --no-defaults --socket="$DB_SOCK" -u root "$@"; }

db_up() { mariadb-admin --no-defaults --socket="$DB_SOCK" -u root ping >/dev/null 2>&1; }

start_mariadb() {
    db_up && return 0
    mkdir -p "$ROOT/log"
    if [ ! -d "$ROOT/mysql/mysql" ]; then
        log "initialising the accounting database in $ROOT/mysql"
        rm -rf "$ROOT/mysql"
        mariadb-install-db --no-defaults --user=root --datadir="$ROOT/mysql" --skip-test-db \
            >"$ROOT/log/mariadb-install.log" 2>&1 || { cat "$ROOT/log/mariadb-install.log" >&2; return 1; }
    fi
    # A test database: durability traded for speed. setsid: it outlives this script.
    spawn setsid mariadbd --no-defaults --user=root --datadir="$ROOT/mysql" --socket="$DB_SOCK" \
        --pid-file="$ROOT/mysql.pid" --port="$DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve \
        --innodb-flush-log-at-trx-commit=0 --innodb-buffer-pool-size=64M --innodb-lock-wait-timeout=900 \
        --log-error="$ROOT/log/mariadb.log"
    local i
    for i in $(seq 300); do
        db_up && return 0
        sleep 0.1
    done
    log "MariaDB did not start; see $ROOT/log/mariadb.log"
    tail -n 20 "$ROOT/log/mariadb.log" >&2 || true
    return 1
}

reset_accounting_db() {
    # slurmdbd connects over TCP as `slurm` (root's account takes the socket only).
    db -e "DROP DATABASE IF EXISTS slurm_acct_db;
           CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
           GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
}

ensure_hosts() {
    local i
    for i in "${!NODES[@]}"; do
        grep -qE "^${ADDRS[$i]}[[:space:]]+${NODES[$i]}\b" /etc/hosts \
            || printf '%s %s\n' "${ADDRS[$i]}" "${NODES[$i]}" >> /etc/hosts
    done
}

start_munge() {
    mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
    [ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chown -R munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge
    chmod 0700 /etc/munge /var/log/munge /var/lib/munge
    chmod 0400 /etc/munge/munge.key
    chmod 0755 /run/munge
    if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        runuser -u munge -- munged --force
        sleep 0.5
    fi
}

make_fake_gpus() {
    local n g dev
    for n in "${NODES[@]}"; do
        for ((g = 0; g < GPUS_PER_NODE; g++)); do
            dev=/dev/hpcddp_${n}_gpu$g
            [ -c "$dev" ] || mknod -m 666 "$dev" c 1 3   # same major/minor as /dev/null
        done
    done
}

write_config() {
    mkdir -p "$ROOT"/{state,log,spool}
    local gpu_range="[0-$((GPUS_PER_NODE - 1))]"
    {
        cat "$here/slurm.conf.in"
        local i
        for i in "${!NODES[@]}"; do
            printf 'NodeName=%s NodeAddr=%s Port=%d CPUs=%d RealMemory=4000 Gres=gpu:%d State=UNKNOWN\n' \
                "${NODES[$i]}" "${ADDRS[$i]}" $((SLURMD_PORT + i)) "$CPUS_PER_NODE" "$GPUS_PER_NODE"
        done
        # Real preemption (PreemptType=partition_prio in slurm.conf.in): a job in `urgent` (higher
        # PriorityTier) preempts jobs in the others. debug and short: SIGTERM, then SIGKILL after KillWait
        # and Slurm requeues the job itself. grace: SIGTERM, then GraceTime seconds before the kill; a job
        # that ends before that is not requeued by Slurm (hpc-ddp must requeue it).
        local first=ALL
        [ "$COUNT" -gt 2 ] && first=hpcn[1-2]
        printf 'PartitionName=debug Nodes=%s Default=YES MaxTime=INFINITE State=UP PriorityTier=1\n' "$first"
        printf 'PartitionName=short Nodes=%s MaxTime=00:10:00 State=UP PriorityTier=1\n' "$first"
        printf 'PartitionName=grace Nodes=%s MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=15\n' "$first"
        printf 'PartitionName=urgent Nodes=%s MaxTime=INFINITE State=UP PriorityTier=100\n' "$first"
        [ "$COUNT" -gt 2 ] && printf 'PartitionName=wide Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=1\n'
        true
    } | sed -e "s|@ROOT@|$ROOT|g" -e "s|@CTLD_PORT@|$CTLD_PORT|g" -e "s|@DBD_PORT@|$DBD_PORT|g" \
        -e "s|@FIRST_JOB_ID@|$FIRST_JOB_ID|g" > "$ROOT/slurm.conf"
    : > "$ROOT/gres.conf"
    for n in "${NODES[@]}"; do
        printf 'NodeName=%s Name=gpu File=/dev/hpcddp_%s_gpu%s\n' "$n" "$n" "$gpu_range" >> "$ROOT/gres.conf"
    done
    printf 'AutoDetect=off\n' | cat - "$ROOT/gres.conf" > "$ROOT/gres.conf.tmp" && mv "$ROOT/gres.conf.tmp" "$ROOT/gres.conf"
    printf 'ConstrainDevices=no\n' > "$ROOT/cgroup.conf"
    # slurmdbd reads slurmdbd.conf next to $SLURM_CONF; it holds a password, so 0600 (slurmdbd insists).
    (umask 077; cat > "$ROOT/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$ROOT/log/slurmdbd.log
PidFile=$ROOT/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
    )
}

# This test Slurm's daemons only (instance.sh: by their SLURM_CONF), never another instance's.
stop_daemons() {
    [ -n "$CHROOT" ] || rm_wrappers "$ROOT/bin"
    stop_our_daemons
}

start_slurmdbd() {
    export SLURM_CONF=$ROOT/slurm.conf
    slurm_argv slurmdbd
    spawn "${SLURM_ARGV[@]}"
    # Once slurmdbd answers (it creates its tables first): the cluster, an account, and root in it.
    local i
    for i in $(seq 300); do
        in_slurm sacctmgr -n -P show cluster >/dev/null 2>&1 && break
        sleep 0.1
    done
    if ! in_slurm sacctmgr -n -P show cluster >/dev/null 2>&1; then
        log "slurmdbd did not start; see $ROOT/log/slurmdbd.log"
        return 1
    fi
    in_slurm sacctmgr -i add cluster hpcddp >/dev/null
    in_slurm sacctmgr -i add account hpcddp Cluster=hpcddp Description=hpc-ddp-tests Organization=hpc-ddp >/dev/null
    in_slurm sacctmgr -i add user root Account=hpcddp Cluster=hpcddp DefaultAccount=hpcddp >/dev/null
}

start_daemons() {
    export SLURM_CONF=$ROOT/slurm.conf
    # The state of an earlier test Slurm (another version's, whose cluster id the emptied database no longer
    # knows: slurmctld 24.11 and later refuse to start on it, "CLUSTER ID MISMATCH"); -c starts clean anyway.
    rm -rf "$ROOT/state" && mkdir -p "$ROOT/state"
    in_slurm slurmctld -c -L "$ROOT/log/slurmctld.log"   # -c: clean start, no jobs left from an earlier run
    local n
    # Each slurmd's spool emptied too: it keeps the job credentials Slurm revoked (cred_state), by job id, and
    # the ids start again at FirstJobId after the clean start, so a new job 32 was refused "Job credential
    # revoked" on a node whose slurmd remembered an earlier test Slurm's job 32 (2026-12-05).
    for n in "${NODES[@]}"; do
        rm -rf "${ROOT:?}/spool/$n" && mkdir -p "$ROOT/spool/$n"
        in_slurm slurmd -N "$n" -L "$ROOT/log/slurmd-$n.log"
    done
}

wait_until_idle() {
    local i
    for i in $(seq 100); do
        if [ "$(in_slurm sinfo -h -N -t idle -o '%N' 2>/dev/null | sort -u | wc -l)" = "${#NODES[@]}" ]; then
            return 0
        fi
        # Nodes may come up DOWN/"unexpectedly rebooted" after a restart; resume them.
        in_slurm scontrol update NodeName="$(IFS=,; echo "${NODES[*]}")" State=RESUME >/dev/null 2>&1 || true
        sleep 0.3
    done
    log "nodes did not become idle; see $ROOT/log"
    in_slurm sinfo >&2 || true
    return 1
}

install_packages
ensure_hosts
start_munge
make_fake_gpus
stop_daemons
write_config
if [ -n "$CHROOT" ]; then
    build_chroot "$CHROOT" "$VERSION"
    mount_chroot "$CHROOT" "$ROOT" "$here/../.." ${PY:+"$PY"}
    # What slurm-down.sh unmounts for this instance (and no other's).
    grep -qxF "$CHROOT" "$ROOT/chroots" 2>/dev/null || echo "$CHROOT" >> "$ROOT/chroots"
    write_wrappers "$CHROOT" "$ROOT/bin"
fi
start_mariadb
reset_accounting_db
start_slurmdbd
start_daemons
wait_until_idle
in_slurm sinfo -o '%P %a %l %D %t %N %G' >&2
log "Slurm $(in_slurm sinfo -V)${CHROOT:+ (from $CHROOT)}"
if [ -n "$CHROOT" ]; then
    echo "export SLURM_CONF=$ROOT/slurm.conf HPC_DDP_SLURM_VERSION=$VERSION ${SSHD_ENV:+$SSHD_ENV }PATH=$ROOT/bin:\$PATH"
else
    echo "export SLURM_CONF=$ROOT/slurm.conf HPC_DDP_SLURM_VERSION=$VERSION${SSHD_ENV:+ $SSHD_ENV}"
fi
