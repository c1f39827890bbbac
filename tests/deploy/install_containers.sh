#!/bin/bash
# What tests/deploy/test_containers.py needs (run by `make test-deploy` as
#   PY=/abs/venv/bin/python bash tests/deploy/install_containers.sh):
#   podman, runc and mmdebstrap from Debian; podman-compose 1.6 from PyPI into the project venv
#   (Debian's podman-compose 1.0.3 ignores --scale); a containers.conf drop-in that runs
#   containers with runc and ulimits this host allows (crun fails here: "setrlimit RLIMIT_NOFILE:
#   Operation not permitted", "cgroups in hybrid mode not supported").
# Idempotent: a second run changes nothing. A failure prints one line and exits 1.
set -u

fail() { echo "install_containers.sh: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || fail "needs root (podman builds and runs the image as root here)"
: "${PY:?PY must be the project venv python, e.g. PY=\$PWD/.venv/bin/python}"
[ -x "$PY" ] || fail "PY=$PY is not an executable python (run make setup first)"

need=()
for pkg in podman runc mmdebstrap; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
    log=$(mktemp)
    if ! { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            "${need[@]}" uidmap; } >"$log" 2>&1; then
        fail "apt-get install ${need[*]} failed (Debian's archive unreachable?): $(tail -n 1 "$log")"
    fi
    rm -f "$log"
fi

# Containers on one podman network find each other by name (the tests start a worker with
# --server tcp://SERVER-CONTAINER:5555, as deploy/README.md does). Under the CNI backend that takes
# the dnsname plugin, a recommendation --no-install-recommends leaves out (netavark brings
# aardvark-dns itself): without it every such worker fails "Name or service not known".
if [ "$(podman info --format '{{.Host.NetworkBackend}}' 2>/dev/null)" = cni ] && \
        ! dpkg-query -W -f='${Status}' golang-github-containernetworking-plugin-dnsname 2>/dev/null | grep -q "install ok installed"; then
    log=$(mktemp)
    if ! { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            golang-github-containernetworking-plugin-dnsname; } >"$log" 2>&1; then
        fail "apt-get install golang-github-containernetworking-plugin-dnsname failed: $(tail -n 1 "$log")"
    fi
    rm -f "$log"
fi

if ! "$PY" -c 'import importlib.metadata as m, sys; sys.exit(not m.version("podman-compose").startswith("1.6."))' \
        2>/dev/null; then
    log=$(mktemp)
    if ! "$PY" -m pip install -q "podman-compose==1.6.*" >"$log" 2>&1; then
        fail "pip install podman-compose==1.6.* failed (PyPI unreachable?): $(grep -m1 -E 'ERROR|Error' "$log")"
    fi
    rm -f "$log"
fi

conf=/etc/containers/containers.conf.d/50-latecomer-runc.conf
want='# written by tests/deploy/install_containers.sh (latecomer): crun cannot set rlimits or use
# hybrid cgroups on this host; runc can, with ulimits the host allows.
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]

[engine]
runtime = "runc"'
if [ "$(cat "$conf" 2>/dev/null)" != "$want" ]; then
    mkdir -p "$(dirname "$conf")" && printf '%s\n' "$want" >"$conf" || fail "cannot write $conf"
fi

podman run --help >/dev/null 2>&1 || fail "podman does not run"
net="latecomer-dns-check-$$"
if podman network create "$net" >/dev/null 2>&1; then
    dns=$(podman network inspect "$net" --format '{{.DNSEnabled}}' 2>/dev/null)
    podman network rm -f "$net" >/dev/null 2>&1
    [ "$dns" = true ] || fail "a new podman network has no DNS (containers cannot reach each other by name)"
fi
exit 0
