#!/usr/bin/env bash
# `make test`: the suite (or what the arguments select, e.g. -k preempt) on the test Slurm
# (tests/cluster/slurm-up.sh), in two lanes at once where a cpu cgroup can be made, bound by CPU on 2 cores
# (CONTRIBUTING.md, "Where the time goes"); HPC_DDP_TEST_LANES=serial runs one pytest. The tests marked
# `extended` (slow ones: further variants of paths that default tests run end to end, and a few slow single
# cases; pyproject.toml) are left out unless HPC_DDP_TEST_EXTENDED=1; CI sets it (.ci/run), so every test runs
# before anything lands.
#
#   slurm lane: the tests that use the test Slurm (pytest --lane slurm), one after another, as they must:
#               they share its four nodes, kill slurmds and preempt partitions. Its log is this script's output.
#   local lane: every other test (--lane local), at the same time; in HPC_DDP_TEST_LOCAL_WORKERS pytest-xdist
#               workers where that is 2 or more (default 2; 1: one pytest), a test file to a worker (--dist
#               loadfile: a module's fixtures are made once). Its log is printed when it ends.
#
# The slurm lane spends most of its time waiting on Slurm's clocks, but when its jobs start, their ranks want
# both cores, and a preempted rank has KillWait (5 s) to checkpoint and leave. So the lanes run in two cpu
# cgroups of their own: the slurm lane (and the Slurm daemons, whose job steps inherit it) with 8 times the
# local lane's weight. The local lane gets what the slurm lane leaves, and is never stopped outright (a
# liveness check in a local run looks for a heartbeat within 5 s). Without a cpu cgroup we can make (no
# cgroup v1 cpu controller, or no root), or with HPC_DDP_TEST_LANES=serial, one pytest runs everything.
#
# The suite runs on the test Slurm of this machine's Debian, 22.05. Beside it, the versions lane: the tests
# marked slurm_smoke (HPC_DDP_TEST_VERSIONS_MARK; CI gives slurm_core, the larger core set) on each other
# version the project supports (HPC_DDP_TEST_SMOKE_VERSIONS, default "24.11 26.05", "" for none), one after
# another, on a second test Slurm of that version (HPC_DDP_SLURM_INSTANCE=1, tests/cluster/instance.sh: its
# own ports, folder, job ids and sshd; tests/cluster/chroot.sh), its log printed when the slurm lane ends.
# HPC_DDP_TEST_VERSIONS_BESIDE=0 runs them after the 22.05 lane instead, in the slurm lane, while the local
# lane goes on: CI does, for the core sets, which beside starved the local lane (CONTRIBUTING.md).
# `make test-slurm-versions` runs the core set on all three, one version after another, nothing beside it.
#
# HPC_DDP_TEST_JUNIT=DIR: each pytest also writes its per-test times as JUnit XML into DIR (slurm.xml,
# local.xml, smoke-VERSION.xml; serial.xml for one lane), to see where a run's time went (CONTRIBUTING.md).
#
# Where a cpuacct controller is mounted apart from cpu (/sys/fs/cgroup/cpuacct), each lane is also counted
# there, and the end says how much CPU each lane used (the floor under make test's time on this machine).
#
# Only the cgroups this run made are removed at the end (rmdir of an empty cgroup; never a process killed
# other than the local lane, if this script is interrupted).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PYTEST=("$PY" -m pytest -q --durations=25 "$@")  # arguments go to both lanes: -k, -x, ...
# The tests marked extended only where HPC_DDP_TEST_EXTENDED=1: CI sets it (.ci/run).
EXTENDED=${HPC_DDP_TEST_EXTENDED:-0}
[ "$EXTENDED" = 1 ] || PYTEST+=(--skip-extended)
CPU=/sys/fs/cgroup/cpu
ACCT=/sys/fs/cgroup/cpuacct
SLURM_WEIGHT=${HPC_DDP_TEST_SLURM_WEIGHT:-8192}
LOCAL_WEIGHT=${HPC_DDP_TEST_LOCAL_WEIGHT:-1024}
made=() counted=()
# junit NAME: JUNIT=(the pytest option that writes NAME.xml under HPC_DDP_TEST_JUNIT), empty when it is unset.
junit() { JUNIT=(); if [ -n "${HPC_DDP_TEST_JUNIT:-}" ]; then JUNIT=("--junitxml=$HPC_DDP_TEST_JUNIT/$1.xml"); fi; }

cleanup() {
    if [ -n "${local_pid:-}" ] && kill -0 "$local_pid" 2>/dev/null; then
        kill -TERM -- "-$local_pid" 2>/dev/null || kill -TERM "$local_pid" 2>/dev/null
    fi
    if [ -n "${versions_pid:-}" ] && kill -0 "$versions_pid" 2>/dev/null; then
        kill -TERM -- "-$versions_pid" 2>/dev/null || kill -TERM "$versions_pid" 2>/dev/null
    fi
    bash tests/cluster/slurm-down.sh
    [ -z "${versions_pid+x}" ] || HPC_DDP_SLURM_INSTANCE=1 bash tests/cluster/slurm-down.sh
    # Out of the cgroups this run made, back into their parent: this shell and what it started that is
    # still running (munged, which slurm-down.sh leaves up); then remove them.
    local group pid
    for group in "${made[@]}" "${counted[@]}"; do
        while read -r pid; do echo "$pid" > "$(dirname "$group")/cgroup.procs" 2>/dev/null; done < "$group/cgroup.procs"
        rmdir "$group" 2>/dev/null
    done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

lanes=parallel
if [ "${HPC_DDP_TEST_LANES:-parallel}" = serial ] || [ ! -w "$CPU/cgroup.procs" ]; then
    lanes=serial
else
    for lane in slurm local; do
        group="$CPU/hpc-ddp-test-$lane-$$"
        if mkdir "$group" 2>/dev/null; then
            made+=("$group")
        else
            lanes=serial
        fi
    done
    if [ "$lanes" = parallel ]; then
        echo "$SLURM_WEIGHT" > "${made[0]}/cpu.shares" && echo "$LOCAL_WEIGHT" > "${made[1]}/cpu.shares" \
            && echo $$ > "${made[0]}/cgroup.procs" || lanes=serial
    fi
    # CPU accounting, only where cpuacct is a hierarchy of its own (else the cpu groups above may hold it).
    if [ "$lanes" = parallel ] && [ -w "$ACCT/cgroup.procs" ] && [ "$(readlink -f "$ACCT")" != "$(readlink -f "$CPU")" ]; then
        for lane in slurm local; do
            mkdir "$ACCT/hpc-ddp-test-$lane-$$" 2>/dev/null && counted+=("$ACCT/hpc-ddp-test-$lane-$$")
        done
        [ "${#counted[@]}" = 2 ] && echo $$ > "${counted[0]}/cgroup.procs" 2>/dev/null
    fi
fi
# cpu_minutes LANE: the CPU that lane's processes used so far, in minutes ("?" where it was not counted).
cpu_minutes() {
    local file="$ACCT/hpc-ddp-test-$1-$$/cpuacct.usage"
    if [ "${#counted[@]}" = 2 ] && [ -r "$file" ]; then awk '{ printf "%.1f", $1 / 6e10 }' "$file"; else echo "?"; fi
}

# The Slurm daemons start from this shell, so in the slurm lane's cgroup when there is one.
eval "$(HPC_DDP_SLURM_VERSION=22.05 bash tests/cluster/slurm-up.sh | tail -n 1)"
SAVED_PATH=$PATH

# The version smoke (on the test Slurm HPC_DDP_SLURM_INSTANCE names): 0 when every version passed.
smoke_versions() {
    local version line rc=0 mark=${HPC_DDP_TEST_VERSIONS_MARK:-slurm_smoke} began
    for version in ${HPC_DDP_TEST_SMOKE_VERSIONS-24.11 26.05}; do
        PATH=$SAVED_PATH
        began=$SECONDS
        echo "make test: the version smoke on Slurm $version (-m $mark)"
        if ! line=$(HPC_DDP_SLURM_VERSION=$version bash tests/cluster/slurm-up.sh | tail -n 1) || [ -z "$line" ]; then
            echo "make test: the Slurm $version test Slurm did not start"; rc=1; continue
        fi
        eval "$line"
        junit "smoke-$version"
        "${PYTEST[@]}" "${JUNIT[@]}" --lane slurm -m "$mark" tests || rc=1
        echo "make test: Slurm $version ($(sinfo -V)), -m $mark, done after $((SECONDS - began)) s"
    done
    return $rc
}

[ "$EXTENDED" = 1 ] || echo "make test: the tests marked extended are left out (HPC_DDP_TEST_EXTENDED=1 runs them; CI does)"
if [ "$lanes" = serial ]; then
    echo "make test: one lane (two where a cpu cgroup can be made, unless HPC_DDP_TEST_LANES=serial)"
    junit serial
    "${PYTEST[@]}" "${JUNIT[@]}" tests
    rc=$?
    smoke_versions || rc=1
    exit $rc
fi

local_log=$(mktemp "${TMPDIR:-/tmp}/hpc-ddp-local-lane.XXXXXX")
echo "make test: two lanes; the local lane's log ($local_log) follows the slurm lane's"
junit local
# Two workers by default: a test that waits on a timeout or a collective leaves a core the other worker uses.
# Without the extended tests, make test took 23.9 min with two and 36.2 with one (2026-12-05, CONTRIBUTING.md).
# CI runs every test in one (HPC_DDP_TEST_LOCAL_WORKERS=1, .ci/run): with the extended ones and the version
# core sets, two once cost a Slurm test its KillWait (a preempted batch shell killed before it recorded its
# requeue), and that much work is CPU-bound either way.
WORKERS=${HPC_DDP_TEST_LOCAL_WORKERS:-2} XDIST=()
case "$WORKERS" in [2-9]) XDIST=(-n "$WORKERS" --dist loadfile) ;; esac
# setsid: the local lane is its own process group, so an interrupted run stops all of it and nothing else.
setsid bash -c 'echo $$ > "$1/cgroup.procs" && shift && { [ -z "$1" ] || echo $$ > "$1/cgroup.procs" 2>/dev/null || true; } && shift && exec "$@"' \
    lane "${made[1]}" "${counted[1]:-}" \
    "${PYTEST[@]}" "${JUNIT[@]}" "${XDIST[@]}" --lane local tests >"$local_log" 2>&1 &
local_pid=$!
start=$SECONDS
# The versions lane (unless HPC_DDP_TEST_VERSIONS_BESIDE=0): its own process group (setsid), on the second
# test Slurm, in this shell's cgroups.
beside=${HPC_DDP_TEST_VERSIONS_BESIDE:-1}
if [ "$beside" = 1 ] && [ -n "${HPC_DDP_TEST_SMOKE_VERSIONS-24.11 26.05}" ]; then
    versions_pid=
    versions_log=$(mktemp "${TMPDIR:-/tmp}/hpc-ddp-versions-lane.XXXXXX")
    export -f smoke_versions junit
    export SAVED_PATH PY
    PYTEST_LINE=$(printf '%q ' "${PYTEST[@]}")
    HPC_DDP_SLURM_INSTANCE=1 PYTEST_LINE=$PYTEST_LINE setsid bash -c \
        'eval "PYTEST=($PYTEST_LINE)"; smoke_versions' >"$versions_log" 2>&1 &
    versions_pid=$!
fi
junit slurm
"${PYTEST[@]}" "${JUNIT[@]}" --lane slurm tests
slurm_rc=$?
echo "make test: slurm lane done after $((SECONDS - start)) s (rc $slurm_rc)"
if [ -n "${versions_pid:-}" ]; then
    wait "$versions_pid" || slurm_rc=1
    versions_pid=
    echo "================================ versions lane ================================"
    cat "$versions_log"
    rm -f "$versions_log"
elif [ "$beside" != 1 ]; then
    smoke_versions || slurm_rc=1
fi
echo "make test: version smoke done after $((SECONDS - start)) s; waiting for the local lane"
wait "$local_pid"
local_rc=$?
local_pid=
echo "================================ local lane ================================"
cat "$local_log"
echo "make test: both lanes done after $((SECONDS - start)) s (slurm rc $slurm_rc, local rc $local_rc);" \
    "CPU used: slurm lane $(cpu_minutes slurm) min, local lane $(cpu_minutes local) min"
rm -f "$local_log"
[ "$slurm_rc" -eq 0 ] && [ "$local_rc" -eq 0 ]
