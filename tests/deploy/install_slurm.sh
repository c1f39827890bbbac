#!/bin/bash
# What tests/deploy/test_slurm.py needs from Debian: slurm-wlm (slurmctld, slurmd, the client
# commands) and munge; nsenter and unshare (util-linux) and ip (iproute2) are on every Debian.
# Idempotent: nothing is installed when every command is there, and `apt-get update` runs only when
# apt has no candidate for a package. On failure: one line saying what failed, status 1.
# Run by `make test-deploy` as `PY=/abs/venv/bin/python bash tests/deploy/install_slurm.sh` (as root).
set -u
export DEBIAN_FRONTEND=noninteractive
packages=(slurm-wlm munge)
commands=(slurmctld slurmd sbatch srun scontrol squeue sinfo scancel munged nsenter unshare ip)

missing=()
for c in "${commands[@]}"; do
    command -v "$c" > /dev/null 2>&1 || missing+=("$c")
done
if (( ${#missing[@]} == 0 )); then
    exit 0
fi
if [[ $(id -u) != 0 ]]; then
    echo "install_slurm.sh: ${missing[*]} missing and not root: run as root (apt-get install -y ${packages[*]})" >&2
    exit 1
fi
if ! command -v apt-get > /dev/null 2>&1; then
    echo "install_slurm.sh: ${missing[*]} missing and no apt-get here: install ${packages[*]} (Debian's names)" >&2
    exit 1
fi
log=$(mktemp /tmp/install_slurm.XXXXXX.log)
last() { grep -v '^\s*$' "$log" | tail -n 1; }
candidate() { apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ {print $2}'; }
for p in "${packages[@]}"; do
    c=$(candidate "$p")
    if [[ -z "$c" || "$c" == "(none)" ]]; then
        if ! apt-get update > "$log" 2>&1; then
            echo "install_slurm.sh: the package registry could not be reached (apt-get update failed: $(last); log $log)" >&2
            exit 1
        fi
        break
    fi
done
if ! apt-get install -y "${packages[@]}" > "$log" 2>&1; then
    echo "install_slurm.sh: apt-get install -y ${packages[*]} failed: $(last) (log $log)" >&2
    exit 1
fi
for c in "${missing[@]}"; do
    if ! command -v "$c" > /dev/null 2>&1; then
        echo "install_slurm.sh: $c is still missing after installing ${packages[*]} (nsenter, unshare: util-linux; ip: iproute2)" >&2
        exit 1
    fi
done
rm -f "$log"
