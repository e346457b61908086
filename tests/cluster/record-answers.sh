#!/usr/bin/env bash
# Record what the test Slurm that is up answers, as test data for the code that reads Slurm
# (hpc_ddp/slurm/jobview.py, jobstate.py; tests/slurm/test_answers.py): into tests/slurm/answers/VERSION/.
#   eval "$(HPC_DDP_SLURM_VERSION=24.11 bash tests/cluster/slurm-up.sh | tail -n 1)"
#   bash tests/cluster/record-answers.sh
# Each file is one command's output, as the batch shell or a login node sees it:
#   version.txt            scontrol --version
#   partition-grace.txt    scontrol show partition grace -o
#   show-job-grace.txt     scontrol show job, in the batch shell, after its step ended at a preemption with
#                          GraceTime 15 (partition grace)
#   show-job-nograce.txt   the same with GraceTime 0 (partition debug)
#   sacct-grace.txt        sacct -n -X -P -D -o SACCT_FIELDS of the grace job, after it ran again and ended
#   sinfo-nodes.txt        sinfo -h -N -o '%N|%T'
# About a minute. It preempts for real, so nothing else may run on the test Slurm meanwhile.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
version=$(scontrol --version | awk '{print $2}' | cut -d. -f1,2)
out=${1:-$here/../slurm/answers/$version}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fields=$(cd "$here/../.." && ${PY:-.venv/bin/python} -c 'from hpc_ddp.slurm.jobstate import SACCT_FIELDS; print(",".join(SACCT_FIELDS))')

scontrol --version > "$out/version.txt"
scontrol show partition grace -o > "$out/partition-grace.txt"
sinfo -h -N -o '%N|%T' > "$out/sinfo-nodes.txt"

# preempted PARTITION NAME: a 2-node job whose batch shell records `scontrol show job` once its step ended
# (as `attempts end` asks), preempted by an urgent job; the second run exits 0 at once.
preempted() {
    local partition=$1 name=$2 job urgent state
    cat > "$work/$name.sh" <<JOB
#!/bin/bash
#SBATCH -N2 -p $partition --requeue -o /dev/null
if [ "\${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then exit 0; fi
trap '' TERM
srun sleep 120
scontrol show job "\$SLURM_JOB_ID" > "$work/$name.show"
JOB
    job=$(sbatch --parsable "$work/$name.sh")
    until [ "$(squeue -h -j "$job" -o %T)" = RUNNING ]; do sleep 0.5; done
    sleep 2
    urgent=$(sbatch --parsable -p urgent -N2 --exclusive -o /dev/null --wrap 'sleep 1')
    for _ in $(seq 240); do
        state=$(scontrol show job "$job" | grep -o 'JobState=[A-Z_]*' | cut -d= -f2)
        case "$state" in COMPLETED | FAILED | CANCELLED | PREEMPTED) break ;; esac
        [ "$state" = PENDING ] && { sleep 1.5; scontrol update JobId="$job" StartTime=now 2>/dev/null || true; }
        sleep 0.5
    done
    until [ -s "$work/$name.show" ]; do sleep 0.2; done
    # Paths and times of this machine are not the point; keep the fields as Slurm wrote them.
    cp "$work/$name.show" "$out/show-job-$name.txt"
    for _ in $(seq 40); do
        sacct -n -X -P -D -j "$job" -o "$fields" > "$out/sacct-$name.txt"
        [ "$(wc -l < "$out/sacct-$name.txt")" -ge 2 ] && break
        sleep 0.5
    done
    squeue -h -j "$urgent" >/dev/null 2>&1 || true
}
preempted grace grace
preempted debug nograce
echo "recorded Slurm $version's answers in $out" >&2
