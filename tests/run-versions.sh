#!/usr/bin/env bash
# `make test-slurm-versions`: the core Slurm tests (marked slurm_core) on each test Slurm version in turn,
# 22.05 on this machine and 24.11 and 26.05 from their Debian roots (tests/cluster/chroot.sh), one test Slurm
# at a time; the versions to run are the arguments (default: all three). Extra pytest arguments follow `--`:
#   bash tests/run-versions.sh 24.11 -- -k grace
# Prints one line per version at the end; exits non-zero if any version failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
versions=() extra=()
while [ $# -gt 0 ]; do
    if [ "$1" = -- ]; then shift; extra=("$@"); break; fi
    versions+=("$1"); shift
done
[ ${#versions[@]} -gt 0 ] || versions=(22.05 24.11 26.05)
trap 'bash tests/cluster/slurm-down.sh' EXIT
trap 'exit 130' INT TERM
summary=() failed=0
saved_path=$PATH
for version in "${versions[@]}"; do
    start=$SECONDS
    PATH=$saved_path
    if ! line=$(HPC_DDP_SLURM_VERSION=$version bash tests/cluster/slurm-up.sh | tail -n 1) || [ -z "$line" ]; then
        summary+=("Slurm $version: the test Slurm did not start"); failed=1; continue
    fi
    eval "$line"
    echo "== Slurm $version: the core tests (-m slurm_core)"
    "$PY" -m pytest -q --durations=15 --lane slurm -m slurm_core "${extra[@]}" tests
    rc=$?
    [ "$rc" = 0 ] || failed=1
    summary+=("Slurm $version ($(sinfo -V)): pytest rc $rc in $((SECONDS - start)) s")
done
echo "== make test-slurm-versions"
printf '%s\n' "${summary[@]}"
exit "$failed"
