#!/usr/bin/env bash
# A charliecloud image for the container tests, built from what this machine has: no registry, nothing
# downloaded. The image is a directory holding a minimal root, the directories ch-run mounts onto and a
# marker file (/hpc-ddp-test-image, so a rank can tell it runs inside). This machine's /usr and the given
# Python (its venv and the interpreter the venv was made from) are bound in at run time, at the same paths;
# the arguments that do that are printed, one per line, for a container table's `args`. hpc_ddp is not in
# the image (the venv's editable install points at a source tree the image does not show): the ranks
# import hpc-ddp's own copy from the run dir.
#   usage: ch-image.sh IMAGE_DIR PYTHON
# ch-run comes from Debian's charliecloud-runtime package (slurm-up.sh installs it); exit 3 without it.
set -euo pipefail

image=$1
python=$2
command -v ch-run >/dev/null || { echo "ch-image: no ch-run here (apt-get install charliecloud-runtime)" >&2; exit 3; }

mkdir -p "$image"/{usr,etc,dev,proc,sys,tmp,home,root,run,var,mnt,opt}
touch "$image"/etc/{hosts,resolv.conf,passwd,group} "$image/hpc-ddp-test-image"   # ch-run binds the first four
binds=(/usr)
for d in bin sbin lib lib32 lib64 libx32; do
    if [ -L "/$d" ]; then                       # merged /usr (Debian 12): the same link in the image
        [ -e "$image/$d" ] || [ -L "$image/$d" ] || ln -s "$(readlink "/$d")" "$image/$d"
    elif [ -d "/$d" ]; then
        mkdir -p "$image/$d"
        binds+=("/$d")
    fi
done
# The venv, and the installation its interpreter links to, bound where they are on the host.
while read -r dir; do
    case "$dir" in /usr|/usr/*|/tmp|/tmp/*) continue ;; esac
    mkdir -p "$image$dir"
    binds+=("$dir")
done < <("$python" -c 'import os, sys; print(sys.prefix); print(sys.base_prefix); print(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))' | sort -u)
for b in "${binds[@]}"; do
    printf -- '-b\n%s\n' "$b"
done
