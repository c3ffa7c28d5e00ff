#!/usr/bin/env bash
# A multi-node Slurm on one machine: the emulated nodes of slurm/local/nodes.sh
# (network namespaces, shaped links), a slurmctld on the head node and a slurmd
# on each node, and srun/sbatch/squeue/scancel/sinfo/scontrol/sacct/salloc
# wrappers that reach it from your shell.
#
#   eval "$(slurm/local/cluster.sh up --nodes 3 --link 1gbit)"   # idempotent
#   srun -N 2 --ntasks-per-node 2 --mpi=pmi2 python -m ringpipe train --steps 20
#   sbatch -N 2 --ntasks-per-node 2 slurm/train.sbatch --steps 20; squeue; scancel JOB
#   slurm/local/nodes.sh shape 500mbit                           # change the links while up
#   slurm/local/cluster.sh down                                  # or: down --force
#
# `up` prints only shell lines (export SLURM_CONF, UCX_TLS=tcp,self, PATH with the
# wrappers first, RINGPIPE_NODES_DIR and RINGPIPE_NETNS_PREFIX of its nodes), for
# eval; progress goes to stderr. mpiexec across the same nodes:
# slurm/local/nodes.sh mpiexec -ppn 2 -n 4 CMD. Everything lives in
# ${RINGPIPE_CLUSTER_DIR:-/tmp/ringpipe-cluster-USER}, and `down` removes it all. The
# nodes are the network namespaces ${RINGPIPE_NETNS_PREFIX:-rpUID}-head, -n1, ... (rp0 for
# root); a second cluster of one user needs both variables set (names.sh). Needs
# root (namespaces; Debian's slurm-wlm and munge, installed with apt when missing);
# where namespaces are not permitted it says so and exits 3. The single-node Slurm
# of slurm/local/start.sh is independent of this one and keeps working.
#
# Shared and reference-counted like start.sh's (holders.sh): `up` makes its caller (the
# shell, or RINGPIPE_SLURM_HOLDER_PID) a holder and says who else holds a cluster it
# reuses; `down` lets go of that hold and takes the cluster down only when no other holder
# is alive and no job is queued (else it says what it left up and why); `down --force`
# takes it down now. An `up` with another node count than a cluster others hold is refused.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd -P)
# Per-user default folder and namespace prefix: names.sh.
# shellcheck source=names.sh
. "$HERE/names.sh"
rp_check_prefix
DIR=$RP_CLUSTER_DIR
NS=/run/netns/$RP_NETNS_PREFIX          # + -head, -n1, ...: nodes.sh's namespaces
# The folder (munge key, config, PID files, the wrappers on PATH) is ours alone: made
# with mode 0700, or refused with exit 2 if it exists and is not (private.sh).
PRIVATE_DIR_VAR=RINGPIPE_CLUSTER_DIR
# shellcheck source=private.sh
. "$HERE/private.sh"
# shellcheck source=conf.sh
. "$HERE/conf.sh"
# shellcheck source=holders.sh
. "$HERE/holders.sh"
export RINGPIPE_NODES_DIR=$DIR/nodes
NET=10.78.0
PORT=26817
TIMEOUT=${RINGPIPE_SLURM_TIMEOUT:-60}
export PATH=$PATH:/usr/sbin:/sbin

log() { echo "cluster.sh: $*" >&2; }
die() { echo "cluster.sh: error: $1" >&2; exit "${2:-1}"; }

# The PID in a PID file of ours, only if it is that daemon, started with this folder's
# config (or munge socket): a PID file could name any process (daemon_pid, private.sh).
our_daemon() {  # our_daemon PIDFILE
    local name
    name=$(basename -- "$1" .pid)
    name=${name%%-*}                       # slurmd-n1 -> slurmd
    case "$name" in
        munged) daemon_pid munged "$1" "$DIR/munge/munge.sock" ;;
        slurmctld|slurmd) daemon_pid "$name" "$1" "$DIR/slurm.conf" ;;
        *) return 1 ;;
    esac
}

sinfo_head() { SLURM_CONF=$DIR/slurm.conf nsenter --net="$NS-head" sinfo -h -N -o "%N %T" 2>/dev/null || true; }

eval_lines() {
    echo "export SLURM_CONF=$DIR/slurm.conf"
    echo "export UCX_TLS=tcp,self   # UCX would otherwise use shared memory between the emulated nodes"
    echo "export PATH=$DIR/bin:\$PATH"
    # So that nodes.sh (mpiexec, shape, bytes) in the same shell finds these nodes, and
    # `ip -n $RINGPIPE_NETNS_PREFIX-n2 ...` names one.
    echo "export RINGPIPE_NODES_DIR=$RINGPIPE_NODES_DIR"
    echo "export RINGPIPE_NETNS_PREFIX=$RP_NETNS_PREFIX"
}

cmd_up() {
    local n=2 link=off
    while [ $# -gt 0 ]; do case "$1" in
        --nodes) n=${2:?--nodes N}; shift 2;;
        --link) link=${2:?--link RATE}; shift 2;;
        -h|--help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0;;
        *) die "unknown option '$1' (see --help)" 2;;
    esac; done
    [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 16 ] || die "--nodes must be 1..16, got '$n'" 2
    private_dir "cluster state folder" "$DIR"
    # One up or down of this folder at a time (an up may install Slurm and wait for the nodes).
    rp_lock "$DIR" $((TIMEOUT + 600)) || { private_dir "cluster state folder" "$DIR" && rp_lock "$DIR" 10; } \
        || die "$DIR was removed while waiting for its lock: run it again"
    local caller others count
    caller=$(rp_caller_pid)
    rp_holders_init "$DIR"
    others=$(rp_holders_but "$caller")
    count=$(cat "$DIR/nodes.count" 2>/dev/null || true)
    if our_daemon "$DIR/run/slurmctld.pid" >/dev/null; then
        if [ "$count" = "$n" ]; then
            bash "$HERE/nodes.sh" shape "$link" >&2
            rp_hold "$caller"
            log "already up in $DIR ($n nodes): reusing it, not starting another; link $link. Its queue and" \
                "jobs are shared with ${others:-no other running process (the one that brought it up has ended)}." \
                "Now held also by $(rp_describe "$caller"): \`down\` from there lets go, the last holder's takes it down"
            eval_lines
            return 0
        fi
        [ -z "$others" ] || die "already up in $DIR with ${count:-?} nodes, held by $others: ask for --nodes\
 ${count:-N} to share it, or bring up a cluster of your own (its own RINGPIPE_CLUSTER_DIR and RINGPIPE_NETNS_PREFIX:\
 slurm/local/names.sh)" 2
    fi
    # What an earlier cluster left (another node count, or one half up): taken down first.
    # Its holders, if any are alive, stay: the cluster they use comes back in the same folder.
    if [ -n "$(ls -A "$DIR" | grep -vx holders)" ]; then
        cluster_stop 2>/dev/null
        find "$DIR" -mindepth 1 -maxdepth 1 ! -name holders -exec rm -rf -- {} +
    fi
    for b in slurmctld slurmd munged; do
        command -v "$b" >/dev/null 2>&1 && continue
        [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || die "$b is missing: apt-get install -y slurm-wlm munge"
        log "installing slurm-wlm and munge with apt-get (once)"
        private_dir "cluster state folder" "$DIR"
        { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
          DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge; } >"$DIR/apt.log" 2>&1 \
            || die "apt-get install slurm-wlm munge failed (log: $DIR/apt.log)"
        break
    done
    private_dir "cluster state folder" "$DIR"
    mkdir -p "$DIR"/{run,log,state,spool,bin,munge}
    local rc=0
    bash "$HERE/nodes.sh" up --nodes "$n" --link "$link" || rc=$?
    [ $rc = 0 ] || exit $rc
    echo "$n" >"$DIR/nodes.count"

    chmod 755 "$DIR/munge"                  # munged refuses a socket folder others cannot enter
    (umask 077; dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none)
    chmod 400 "$DIR/munge/munge.key"
    local mem cpus
    mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.8 / '"$n"')}' /proc/meminfo)
    cpus=${RINGPIPE_SLURM_CPUS:-4}
    for i in $(seq 1 "$n"); do mkdir -p "$DIR/tmp/n$i"; done
    rp_write_slurm_conf "$DIR" cluster.sh ClusterName=ringpipe-emulated "SlurmctldHost=head($NET.100)" \
        "SlurmctldPort=$PORT" "SlurmdPort=$((PORT + 1))" SlurmUser=root "TmpFS=$DIR/tmp/%n" \
        "SlurmdSpoolDir=$DIR/spool/%n" "SlurmdPidFile=$DIR/run/slurmd-%n.pid" "SlurmdLogFile=$DIR/log/slurmd-%n.log" \
        < <(for i in $(seq 1 "$n"); do
                echo "NodeName=n$i NodeAddr=$NET.$i NodeHostname=n$i CPUs=$cpus RealMemory=$mem State=UNKNOWN"
            done
            echo "PartitionName=emulated Nodes=n[1-$n] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4")
    export SLURM_CONF=$DIR/slurm.conf

    log "starting munged, slurmctld on head, slurmd on n1..n$n"
    # 9<&-: the daemons must not inherit the folder's lock (holders.sh).
    munged --force -S "$DIR/munge/munge.sock" --key-file="$DIR/munge/munge.key" --pid-file="$DIR/run/munged.pid" \
        --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" </dev/null >>"$DIR/log/munged.log" 2>&1 9<&- \
        || die "munged failed to start (log: $DIR/log/munged.log)"
    # nsenter --net keeps the machine's mounts (ip netns exec would remount /sys, and
    # slurmd then finds no cgroup filesystem); unshare --uts gives the node its hostname.
    nsenter --net="$NS-head" unshare --uts sh -c "hostname head; exec slurmctld -c -f $SLURM_CONF" \
        </dev/null >>"$DIR/log/slurmctld.log" 2>&1 9<&- || die "slurmctld failed to start (log: $DIR/log/slurmctld.log)"
    for i in $(seq 1 "$n"); do
        nsenter --net="$NS-n$i" unshare --uts sh -c "hostname n$i; exec slurmd -c -N n$i -f $SLURM_CONF" \
            </dev/null >>"$DIR/log/slurmd-n$i.log" 2>&1 9<&- || die "slurmd n$i failed to start (log: $DIR/log/slurmd-n$i.log)"
    done
    for cmd in srun sbatch squeue scancel sinfo scontrol sacct salloc; do
        cat >"$DIR/bin/$cmd" <<EOF
#!/bin/sh
# $cmd on the emulated cluster of slurm/local/cluster.sh: run from its head node.
export SLURM_CONF=$DIR/slurm.conf
exec nsenter --net=$NS-head $(command -v "$cmd") "\$@"
EOF
        chmod +x "$DIR/bin/$cmd"
    done
    local deadline=$(( $(date +%s) + TIMEOUT )) idle=0
    while [ "$(date +%s)" -lt $deadline ]; do
        idle=$(sinfo_head | grep -c " idle$" || true)
        [ "$idle" = "$n" ] && break
        sleep 0.5
    done
    if [ "$idle" != "$n" ]; then
        sinfo_head >&2
        die "only $idle of $n nodes became idle within ${TIMEOUT}s (logs: $DIR/log)"
    fi
    rp_hold "$caller"
    log "$n node(s) idle (n1..n$n), link $link; slurmctld on head ($NET.100:$PORT)"
    log "held by $(rp_describe "$caller")${others:+ and $others}: \`down\` from there takes it down unless" \
        "another caller holds it then"
    eval_lines
}

# The jobs in the cluster's queue (not those completing: gone in a moment), if its slurmctld runs.
queued_jobs() {
    our_daemon "$DIR/run/slurmctld.pid" >/dev/null || return 0
    SLURM_CONF=$DIR/slurm.conf timeout 10 nsenter --net="$NS-head" squeue -h -o "%A %T" 2>/dev/null \
        | awk '$2 != "COMPLETING" {printf "%s%s", sep, $1; sep = " "}' || true
}

cmd_down() {
    local force=${1:-} caller
    case "$force" in ""|--force) ;; *) die "unknown option '$force' for down (none, or --force)" 2;; esac
    # Not ours alone: nothing in it is read, signalled or removed (exit 2).
    private_dir "cluster state folder" "$DIR" check
    if [ ! -d "$DIR" ] || ! rp_lock "$DIR" 300; then
        log "nothing to take down ($DIR does not exist)"
        return 0
    fi
    caller=$(rp_caller_pid)
    # Also the hold of the stop.sh that runs this (RP_SLURM_STOP_PID): rp_release says why.
    rp_let_go "$DIR" "$caller" $$ ${RP_SLURM_STOP_PID:-}
    rp_may_stop "$DIR" "$force" "$(queued_jobs)" "\`down\`" "left up" || return 0
    cluster_stop
    rm -rf "$DIR"
    log "down"
}

# cluster_stop: the daemons of DIR stopped (by PID, checked: our_daemon) and the nodes taken down.
cluster_stop() {
    local f pid
    for f in "$DIR"/run/slurmd-*.pid "$DIR/run/slurmctld.pid" "$DIR/run/munged.pid"; do
        [ -s "$f" ] || continue
        if ! pid=$(our_daemon "$f"); then
            pid=$(head -c 32 -- "$f" | tr -dc 0-9)
            [ -n "$pid" ] && [ -d "/proc/$pid" ] && log "not signalling pid $pid of $f: it is not the" \
                "$(basename -- "$f" .pid) of $DIR ($(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | head -c 120))"
            continue
        fi
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 1 50); do our_daemon "$f" >/dev/null || break; sleep 0.1; done
        # Checked again: the PID is signalled only while it is still our daemon.
        if pid=$(our_daemon "$f"); then kill -KILL "$pid" 2>/dev/null || true; fi
    done
    bash "$HERE/nodes.sh" down 2>/dev/null || true
}

case "${1:-}" in
    up) shift; cmd_up "$@";;
    down) shift; cmd_down "$@";;
    status) sinfo_head;;
    -h|--help|"") sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//';;
    *) die "unknown command '$1': up, down or status" 2;;
esac
