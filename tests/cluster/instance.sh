# Which test Slurm this is (sourced by slurm-up.sh and slurm-down.sh; bash). Several can run on this machine at
# once, each with its own folder, ports, MariaDB and sshd: make test runs the version smoke on a
# second one beside the 22.05 lane (tests/run-lanes.sh; HPC_DDP_TEST_VERSIONS_BESIDE=0, as in CI, runs it after).
#
# HPC_DDP_SLURM_INSTANCE=K (0 to 4, default 0): folder /var/tmp/hpc-ddp-slurm (K=0) or /var/tmp/hpc-ddp-slurm-K
# (HPC_DDP_SLURM_ROOT overrides it); slurmctld on 6817+100K, slurmdbd on 6819+100K, the slurmds on 6830+100K
# and up, MariaDB on 3316+K. The node names (hpcn1...) and their loopback addresses are the same in each: a
# slurmd is told apart by its SLURM_CONF, never by its name (our_daemons below; bench/goodput_bench.py's
# slurmd_pids, which the tests use).

INSTANCE=${HPC_DDP_SLURM_INSTANCE:-0}
case "$INSTANCE" in [0-4]) ;; *) echo "slurm: HPC_DDP_SLURM_INSTANCE must be 0 to 4, not '$INSTANCE'" >&2; exit 2 ;; esac
if [ "$INSTANCE" = 0 ]; then ROOT=${HPC_DDP_SLURM_ROOT:-/var/tmp/hpc-ddp-slurm}; else ROOT=${HPC_DDP_SLURM_ROOT:-/var/tmp/hpc-ddp-slurm-$INSTANCE}; fi
CTLD_PORT=$((6817 + 100 * INSTANCE))
DBD_PORT=$((6819 + 100 * INSTANCE))
SLURMD_PORT=$((6830 + 100 * INSTANCE))
DB_PORT=$((3316 + INSTANCE))
# Job ids apart as well: two test Slurms share this machine's loopback and /tmp, where hpc-ddp's ports and
# scratch names come from the job id (on a real cluster the job id is the cluster's own).
FIRST_JOB_ID=$((1 + 100000 * INSTANCE))
# The SSH tests' sshd for this test Slurm (tests/cluster/sshd-up.sh reads these): its own port, folder and
# cluster account, so one instance's test that ends its account's sessions leaves the other's alone.
if [ "$INSTANCE" = 0 ]; then
    SSHD_ENV="" SSHD_ROOT=${HPC_DDP_SSHD_ROOT:-/var/tmp/hpc-ddp-sshd}
else
    SSHD_ROOT=/var/tmp/hpc-ddp-sshd-$INSTANCE
    SSHD_ENV="HPC_DDP_SSHD_PORT=$((2222 + 100 * INSTANCE)) HPC_DDP_SSHD_ROOT=$SSHD_ROOT HPC_DDP_REMOTE_USER=hpcremote$INSTANCE"
fi

# Stop the sshd that sshd-up.sh started for this test Slurm (its pid file), if that pid is still an sshd.
stop_our_sshd() {
    local pid
    pid=$(cat "$SSHD_ROOT/sshd.pid" 2>/dev/null) || return 0
    case "$pid" in '' | *[!0-9]*) return 0 ;; esac
    if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = sshd ]; then kill "$pid" 2>/dev/null || true; fi
    rm -f "$SSHD_ROOT/sshd.pid"
    return 0
}

# The pids of this test Slurm's daemons: a slurmctld, slurmd or slurmdbd started with SLURM_CONF=$ROOT/slurm.conf
# (slurm-up.sh exports it to each), so another instance's, or a site's own Slurm, is never one of them. One that
# has exited (a zombie, its environment gone) is not.
our_daemons() {
    local entry name environ
    for entry in /proc/[0-9]*; do
        read -r name 2>/dev/null < "$entry/comm" || continue   # a builtin: no process per entry
        case "$name" in slurmctld | slurmd | slurmdbd) ;; *) continue ;; esac
        environ=$(tr '\0' '\n' 2>/dev/null < "$entry/environ") || continue
        grep -qxF "SLURM_CONF=$ROOT/slurm.conf" <<< "$environ" && echo "${entry#/proc/}"
    done
    return 0
}

# Stop this test Slurm's daemons: SIGTERM, then SIGKILL to those still there 5 s later.
stop_our_daemons() {
    local pids
    pids=$(our_daemons)
    [ -n "$pids" ] || return 0
    # shellcheck disable=SC2086
    kill $pids 2>/dev/null || true   # one may have ended since: slurm-up runs with set -e
    for _ in $(seq 50); do
        [ -n "$(our_daemons)" ] || return 0
        sleep 0.1
    done
    pids=$(our_daemons)
    # shellcheck disable=SC2086
    [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
    sleep 0.2
    return 0
}
