#!/usr/bin/env bash
# The names the local Slurm (start.sh, stop.sh) and the emulated nodes (nodes.sh,
# cluster.sh) use, in one place: sourced by those scripts, read by the tests.
#
#   bash slurm/local/names.sh        # prints them, NAME=VALUE one a line
#
# Why per user: with fixed names (/tmp/ringpipe-slurm, port 16817, namespaces rp-*)
# two users of one machine met in one another's folders, ports and namespaces. Each
# is now derived from who runs the script (root's are stable: CI runs as root), and
# each can be set, which is also how one user runs a second instance:
#
#   RINGPIPE_SLURM_DIR     single-node Slurm's folder     (default /tmp/ringpipe-slurm-USER)
#   RINGPIPE_SLURM_PORT    its slurmctld port; slurmd PORT+1
#                          (default 17000 + 2 x (uid mod 4000), or the next free pair after it)
#   RINGPIPE_CLUSTER_DIR   emulated Slurm cluster's folder (default /tmp/ringpipe-cluster-USER)
#   RINGPIPE_NODES_DIR     emulated nodes' folder          (default /tmp/ringpipe-nodes-USER;
#                          cluster.sh uses CLUSTER_DIR/nodes)
#   RINGPIPE_NETNS_PREFIX  network namespaces PREFIX-sw, PREFIX-head, PREFIX-n1...
#                          (default rpUID, e.g. rp0 for root: 1 to 12 letters, digits or _)
#
# USER is `id -un` with anything but letters, digits, '.', '_' and '-' made '_' (the
# uid when there is no name). The emulated cluster's ports need no deriving: its
# daemons listen inside its own namespaces.

RP_UID=$(id -u)
RP_USER=$(id -un 2>/dev/null | tr -c 'A-Za-z0-9._\n-' _)
RP_USER=${RP_USER:-$RP_UID}
RP_SLURM_DIR=${RINGPIPE_SLURM_DIR:-/tmp/ringpipe-slurm-$RP_USER}
RP_CLUSTER_DIR=${RINGPIPE_CLUSTER_DIR:-/tmp/ringpipe-cluster-$RP_USER}
RP_NODES_DIR=${RINGPIPE_NODES_DIR:-/tmp/ringpipe-nodes-$RP_USER}
RP_NETNS_PREFIX=${RINGPIPE_NETNS_PREFIX:-rp$RP_UID}
# Ports 17000..24999, two per user: uids 4000 apart share a pair, hence the check
# that it is free (rp_free_port_pair) before a start uses it.
RP_PORT_LOW=17000 RP_PORT_PAIRS=4000
RP_SLURM_PORT=${RINGPIPE_SLURM_PORT:-$(( RP_PORT_LOW + 2 * (RP_UID % RP_PORT_PAIRS) ))}

# rp_check_prefix: exit 2 unless RP_NETNS_PREFIX is a short plain word. It ends up in
# file names under /run/netns, in the ssh shim and in `grep "^PREFIX-"`.
rp_check_prefix() {
    if ! [[ "$RP_NETNS_PREFIX" =~ ^[A-Za-z0-9_]{1,12}$ ]]; then
        echo "$(basename -- "$0"): error: RINGPIPE_NETNS_PREFIX='$RP_NETNS_PREFIX' is not 1 to 12" \
             "letters, digits or _ (it names the network namespaces PREFIX-sw, PREFIX-n1, ...)" >&2
        exit 2
    fi
}

# rp_port_listening PORT: some TCP socket of this network namespace listens on PORT.
# Read from /proc (state 0A = LISTEN), so no ss or netstat is needed.
rp_port_listening() {
    local hex
    hex=$(printf '%04X' "$1")
    awk -v p=":$hex" '$4 == "0A" && substr($2, length($2) - 4) == p { found = 1 } END { exit !found }' \
        /proc/net/tcp /proc/net/tcp6 2>/dev/null
}

# rp_free_port_pair FIRST: FIRST if FIRST and FIRST+1 are free, else the next free
# pair (in steps of 2, up to 50 tries, wrapping inside 17000..24999); status 1 if none.
rp_free_port_pair() {
    local port=$1 high=$(( RP_PORT_LOW + 2 * RP_PORT_PAIRS ))
    for _ in $(seq 1 50); do
        if ! rp_port_listening "$port" && ! rp_port_listening $(( port + 1 )); then
            echo "$port"
            return 0
        fi
        port=$(( port + 2 ))
        [ "$port" -lt "$high" ] || port=$RP_PORT_LOW
    done
    return 1
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then     # run, not sourced: print them
    echo "RINGPIPE_SLURM_DIR=$RP_SLURM_DIR"
    echo "RINGPIPE_SLURM_PORT=$RP_SLURM_PORT"
    echo "RINGPIPE_CLUSTER_DIR=$RP_CLUSTER_DIR"
    echo "RINGPIPE_NODES_DIR=$RP_NODES_DIR"
    echo "RINGPIPE_NETNS_PREFIX=$RP_NETNS_PREFIX"
fi
