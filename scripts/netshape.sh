#!/usr/bin/env bash
# Run a command inside a private network namespace whose loopback is rate-limited, so that two
# ranks on one machine talk as over a slow link (see docs/benchmarks.md and
# ../shared/docs/environment-facts.md: tbf works here, netem does not; burst must exceed the
# 64 KiB loopback MTU).
#
#   scripts/netshape.sh RATE -- COMMAND...      e.g. scripts/netshape.sh 1gbit -- mpirun ...
#   RATE "none" runs the command unshaped.
#
# The namespace is deleted on every exit path (success, failure, Ctrl-C).  Without the privilege
# to create it (not root, no CAP_NET_ADMIN, no `ip`/`tc`), the command runs unshaped and a clear
# message says so on stderr; DCREDIT_NETSHAPE_REQUIRED=1 turns that fallback into an error.
set -uo pipefail

rate=${1:?usage: netshape.sh RATE -- COMMAND...}
shift
[ "${1:-}" = "--" ] && shift
[ $# -gt 0 ] || { echo "netshape.sh: no command given" >&2; exit 2; }

unshaped() {
    echo "[netshape] WARNING: $1; running UNSHAPED (shared memory / loopback at full speed)." >&2
    [ "${DCREDIT_NETSHAPE_REQUIRED:-0}" = 1 ] && { echo "[netshape] DCREDIT_NETSHAPE_REQUIRED=1: giving up" >&2; exit 3; }
    exec "$@"
}

[ "$rate" = none ] && exec "$@"
command -v ip >/dev/null && command -v tc >/dev/null || unshaped "ip/tc not installed (apt-get install iproute2)" "$@"

ns="dcnet$$"
cleanup() { ip netns del "$ns" 2>/dev/null || true; }
trap cleanup EXIT
trap 'cleanup; exit 130' INT TERM

if ! ip netns add "$ns" 2>/dev/null; then
    trap - EXIT
    unshaped "cannot create a network namespace (needs root or CAP_NET_ADMIN)" "$@"
fi
ip netns exec "$ns" ip link set lo up
if ! ip netns exec "$ns" tc qdisc replace dev lo root tbf rate "$rate" burst 1mb latency 20ms 2>/dev/null; then
    cleanup; trap - EXIT
    unshaped "cannot shape loopback to $rate with tc tbf" "$@"
fi
echo "[netshape] loopback shaped to $rate (tbf) in namespace $ns" >&2
# Open MPI and Gloo inside the namespace must use its loopback.
export OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo HOROVOD_GLOO_IFACE=lo
ip netns exec "$ns" "$@"
status=$?
exit $status
