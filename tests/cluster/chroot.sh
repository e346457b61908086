# The roots the newer test Slurms run from (sourced by slurm-up.sh and slurm-down.sh; bash).
#
# Debian's own builds of Slurm 24.11 (trixie) and 26.05 (sid) need their release's libc, so each runs in a
# root of that release, made once with mmdebstrap from Debian's repositories and cached under $CHROOTS
# (about 230 MB and 30-45 s each). Into it are bound, at the same paths: /proc, /sys, /dev, /run/munge (the
# host's munged serves it), /tmp and /home (where tests and users keep run dirs), the test Slurm's own
# folder, the project, and the prefix of the venv's interpreter. So the ranks run the same Python, the same
# torch and the same hpc_ddp as on the host: no second 5 GB torch for the chroot's Python 3.13 or 3.14, and
# a job step sees the paths the submitting shell saw. /etc/hosts, /etc/passwd and /etc/group are copied from
# the host (`sync_accounts`: the node names, and users such as the SSH tests' account, with the same ids).
#
# Nothing here deletes a root that has anything mounted in it: a build goes into NAME.tmp, which is
# removed only when nothing is mounted under it, then renamed into place.

CHROOTS=${HPC_DDP_SLURM_CHROOTS:-/var/cache/hpc-ddp-test-slurm}
CHROOT_MARK=.hpc-ddp-slurm-chroot
# What runs a command in the root: @ROOT@ is replaced by the root's path. PATH as a login shell's.
CHROOT_ENV=(chroot @ROOT@ /usr/bin/env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin)
# The release each version comes from, and what the root holds besides Slurm: python3 brings the shared
# libraries a bound-in CPython needs (libffi, libssl, ...); openssh-server and rsync, the SSH tests' remote side.
declare -A CHROOT_RELEASE=([24.11]=trixie [26.05]=sid)
CHROOT_PACKAGES=slurmctld,slurmd,slurm-client,slurmdbd,munge,procps,python3,openssh-server,rsync

# The root for VERSION ("" for 22.05, the host's own); exit 2 for a version there is no root for.
chroot_dir() {
    case "$1" in
        22.05) echo "" ;;
        24.11 | 26.05) echo "$CHROOTS/${CHROOT_RELEASE[$1]}" ;;
        *) echo "slurm-up: HPC_DDP_SLURM_VERSION must be 22.05, 24.11 or 26.05, not '$1'" >&2; return 2 ;;
    esac
}

_mounts_under() { findmnt -rn -o TARGET | awk -v d="$1" 'index($0, d "/") == 1 || $0 == d'; }

# Build the root for VERSION at DIR unless it is there; check that it holds that Slurm version.
build_chroot() {
    local dir=$1 version=$2 release=${CHROOT_RELEASE[$2]}
    if [ ! -e "$dir/$CHROOT_MARK" ]; then
        [ ! -e "$dir" ] || { echo "slurm-up: $dir exists but is not a test Slurm root (no $CHROOT_MARK); not touching it" >&2; return 1; }
        if [ -n "$(_mounts_under "$dir.tmp")" ]; then
            echo "slurm-up: something is mounted under $dir.tmp; not removing it" >&2; return 1
        fi
        rm -rf "$dir.tmp"
        mkdir -p "$CHROOTS"
        log "building a Debian $release root for Slurm $version in $dir (mmdebstrap, once per machine)"
        # Check-Valid-Until: sid's Release file may have expired; the packages are still checked by signature.
        mmdebstrap --variant=apt --aptopt='Acquire::Check-Valid-Until "false"' --include="$CHROOT_PACKAGES" \
            "$release" "$dir.tmp" >"$CHROOTS/$release.build.log" 2>&1 \
            || { tail -n 20 "$CHROOTS/$release.build.log" >&2; return 1; }
        touch "$dir.tmp/$CHROOT_MARK"
        mv "$dir.tmp" "$dir"
    fi
    local said
    said=$(chroot "$dir" slurmctld -V 2>&1) || true
    case "$said" in
        "slurm-wlm $version."* | "slurm $version."*) ;;
        *) echo "slurm-up: the $release root in $dir holds '$said', not Slurm $version" \
                "(Debian moved on: pick the release that has it in chroot.sh)" >&2; return 1 ;;
    esac
}

# Bind SRC onto the same path in DIR, once.
_bind() {
    local dir=$1 src=$2
    [ -e "$src" ] || return 0
    if [ -d "$src" ]; then mkdir -p "$dir$src"; else mkdir -p "$(dirname "$dir$src")"; [ -e "$dir$src" ] || : > "$dir$src"; fi
    mountpoint -q "$dir$src" || mount --bind "$src" "$dir$src"
}

# mount_chroot DIR SLURM_ROOT PROJECT [PYTHON]: what the daemons and the job steps need, bound into DIR.
mount_chroot() {
    local dir=$1 root=$2 project python prefix
    project=$(cd "$3" && pwd)
    python=${4:-$project/.venv/bin/python}
    mountpoint -q "$dir/proc" || mount -t proc proc "$dir/proc"
    mountpoint -q "$dir/sys" || mount --rbind /sys "$dir/sys"
    mountpoint -q "$dir/dev" || { mount --rbind /dev "$dir/dev" && mount --make-rslave "$dir/dev"; }
    mkdir -p /run/munge
    local path
    for path in /run/munge /tmp /home "$root" "$project"; do
        _bind "$dir" "$path"
    done
    sync_accounts "$dir"
    # The interpreter's prefix (a venv's python is a link to it; its standard library lives there).
    if [ -e "$python" ]; then
        prefix=$(dirname "$(dirname "$(readlink -f "$python")")")
        case "$prefix" in /usr | /usr/local | /) ;; *) _bind "$dir" "$prefix" ;; esac
    fi
}

# The host's /etc/hosts, /etc/passwd and /etc/group in DIR, again (copies, not binds: a tool that replaces a
# file by renaming a new one over it, as useradd does, would leave a bound file showing the old one). The
# root's own accounts that the host lacks are kept (from a copy of the root's files made the first time).
sync_accounts() {
    local dir=$1 name
    for name in hosts passwd group; do
        mountpoint -q "$dir/etc/$name" && umount "$dir/etc/$name"   # bound by an earlier version of this file
        [ -e "$dir/etc/$name.hpc-ddp-own" ] || cp -p "$dir/etc/$name" "$dir/etc/$name.hpc-ddp-own"
        if [ "$name" = hosts ]; then
            cat /etc/hosts > "$dir/etc/hosts.hpc-ddp-new"
        else
            awk -F: 'NR == FNR { seen[$1] = 1; print; next } !($1 in seen)' /etc/$name "$dir/etc/$name.hpc-ddp-own" \
                > "$dir/etc/$name.hpc-ddp-new"
        fi
        chmod 644 "$dir/etc/$name.hpc-ddp-new" && mv "$dir/etc/$name.hpc-ddp-new" "$dir/etc/$name"
    done
}

# Undo mount_chroot (slurm-down): every mount under DIR, deepest first.
umount_chroot() {
    local dir=$1 target
    [ -e "$dir/$CHROOT_MARK" ] || return 0
    _mounts_under "$dir" | sort -r | while read -r target; do
        umount -l "$target" 2>/dev/null || true
    done
}

# The Slurm commands of the root, as commands of this machine in BIN: each runs its namesake in the root, in
# the same working directory. Inside the root (a job step) they run it directly.
WRAPPED="sbatch srun salloc squeue scontrol sinfo sacct sacctmgr scancel sstat sattach sbcast sprio sshare sreport sdiag strigger slurmd slurmctld slurmdbd"
write_wrappers() {
    local dir=$1 bin=$2 name
    mkdir -p "$bin"
    rm_wrappers "$bin"
    for name in $WRAPPED; do
        cat > "$bin/$name" <<WRAP
#!/bin/bash
# hpc-ddp test Slurm wrapper (tests/cluster/chroot.sh): $name of the root $dir
[ -e /$CHROOT_MARK ] && exec -a $name "\$(PATH=/usr/sbin:/usr/bin command -v $name)" "\$@"
exec chroot $dir /bin/bash -c 'cd -- "\$1" 2>/dev/null || cd /; shift; PATH=$bin:\$PATH; exec -a "\$0" "\$(PATH=/usr/sbin:/usr/bin command -v "\$0")" "\$@"' $name "\$PWD" "\$@"
WRAP
        chmod 755 "$bin/$name"
    done
}

# Remove only the wrappers write_wrappers wrote (their second line says so).
rm_wrappers() {
    local bin=$1 file
    [ -d "$bin" ] || return 0
    for file in "$bin"/*; do
        [ -f "$file" ] && sed -n 2p "$file" | grep -q '^# hpc-ddp test Slurm wrapper' && rm -f "$file"
    done
    return 0
}
