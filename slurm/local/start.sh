#!/usr/bin/env bash
# Start a real single-node Slurm (slurmctld + slurmd + a private munged) on this
# machine, for trying slurm/*.sbatch and for tests/slurm/test_slurm.py.
#
#   eval "$(slurm/local/start.sh)"      # starts (or finds running) and exports SLURM_CONF
#   eval "$(slurm/local/start.sh --nodes 3 --link 1gbit)"   # emulated nodes instead (cluster.sh)
#   sbatch --wait slurm/train.sbatch --steps 20 ...
#   slurm/local/stop.sh
#
# Everything (config, munge key and socket, spool, state, logs, PID files) lives
# in ${RINGPIPE_SLURM_DIR:-/tmp/ringpipe-slurm-$USER}; nothing under /etc is changed. The
# folder is made with mode 0700; one that exists already is used only if it is ours
# alone (owned by us, mode 0700, not a link), else exit 2 (slurm/local/private.sh).
# If slurmctld/slurmd/munged are missing and we are root, installs Debian's
# `slurm-wlm munge` with apt (about 15-30 s). Idempotent: when the daemons of this
# folder already run, it says so, and who else holds them, and prints the export line.
#
# Shared, and reference-counted (slurm/local/holders.sh): the shell (or script) that runs
# this becomes a holder of the cluster; slurm/local/stop.sh from it lets go of that hold,
# and stops the daemons only when no other holder is left alive and no job is queued.
# RINGPIPE_SLURM_HOLDER_PID names another process as the holder.
#
# stdout carries only the `export SLURM_CONF=...` line (so `eval` works);
# progress and errors go to stderr.
#
# Knobs (environment):
#   RINGPIPE_SLURM_DIR      state folder (default /tmp/ringpipe-slurm-USER; a second
#                           instance of one user needs its own)
#   RINGPIPE_SLURM_CPUS     CPUs the node advertises (default max(4, nproc)); more
#                           than the real cores is accepted (config_overrides), so
#                           4 one-CPU tasks fit on a 2-core machine
#   RINGPIPE_SLURM_PORT     slurmctld port; slurmd uses PORT+1. Default: derived from the
#                           uid (17000 + 2 x (uid mod 4000); root 17000), or the next
#                           free pair when another program listens there
#   (slurm/local/names.sh: these defaults, in one place; `bash names.sh` prints them)
#   RINGPIPE_SLURM_TIMEOUT  seconds to wait for the node to become idle (default 60)
#   RINGPIPE_SLURM_NO_INSTALL=1  never run apt-get (fail instead)
#
# Config choices (see /work/shared/notes/slurm-local.md): no cgroups or systemd
# needed (proctrack/linuxproc, task/none), EnforcePartLimits=ALL so an
# impossible request fails at submit instead of pending forever, OverSubscribe
# so several small jobs may share the node, MpiDefault=none (job scripts must
# choose --mpi themselves, as on most real clusters), KillWait=5 (SIGTERM ->
# SIGKILL grace after scancel/timeout).
set -euo pipefail

# Several emulated nodes (network namespaces, shaped links): slurm/local/cluster.sh.
#   eval "$(slurm/local/start.sh --nodes 3 --link 1gbit)"
case "${1:-}" in
    --nodes|--link) exec bash "$(dirname "$0")/cluster.sh" up "$@";;
    "") ;;
    *) echo "start.sh: unknown option '$1' (none: one node; --nodes N [--link RATE]: emulated nodes)" >&2; exit 2;;
esac

# Per-user default names (folder, port): names.sh.
# shellcheck source=names.sh
. "$(dirname "$0")/names.sh"
DIR=$RP_SLURM_DIR
# The folder holds the munge key and the PID files: made private (0700) here, or
# refused if it exists and is not ours alone (private.sh says why).
PRIVATE_DIR_VAR=RINGPIPE_SLURM_DIR
# shellcheck source=private.sh
. "$(dirname "$0")/private.sh"
# shellcheck source=conf.sh
. "$(dirname "$0")/conf.sh"
# shellcheck source=holders.sh
. "$(dirname "$0")/holders.sh"
private_dir "Slurm state folder" "$DIR"
DIR=$(cd "$DIR" && pwd -P)
CONF=$DIR/slurm.conf
TIMEOUT=${RINGPIPE_SLURM_TIMEOUT:-60}
# One start or stop of this folder at a time (a start may install Slurm and wait for the node).
# A stop that removed the folder meanwhile (RINGPIPE_SLURM_PURGE): make it again.
rp_lock "$DIR" $((TIMEOUT + 300)) || { private_dir "Slurm state folder" "$DIR" && rp_lock "$DIR" 10; } \
    || { echo "start.sh: error: $DIR was removed while waiting for its lock: run start.sh again" >&2; exit 1; }
CALLER=$(rp_caller_pid)
rp_holders_init "$DIR"
NCPU=$(nproc 2>/dev/null || echo 1)
CPUS=${RINGPIPE_SLURM_CPUS:-$(( NCPU > 4 ? NCPU : 4 ))}
HOST=$(hostname -s)

log() { echo "start.sh: $*" >&2; }
die() { echo "start.sh: error: $*" >&2; exit 1; }

# ---- 1. binaries -------------------------------------------------------------------
need_install=0
for b in slurmctld slurmd munged sbatch srun sinfo scontrol; do
    command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || need_install=1
done
if [ $need_install = 1 ]; then
    if [ "${RINGPIPE_SLURM_NO_INSTALL:-0}" = 1 ]; then
        die "slurm-wlm/munge not installed (and RINGPIPE_SLURM_NO_INSTALL=1): apt-get install -y slurm-wlm munge"
    fi
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        die "slurm-wlm/munge not installed; install them (Debian: apt-get install -y slurm-wlm munge) or run as root"
    fi
    log "installing slurm-wlm and munge with apt-get (once; ~15-30 s)"
    # Daemons must not be started by the package scripts (no init system here anyway).
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -qq && apt-get install -y -qq slurm-wlm munge; } >"$DIR/apt.log" 2>&1 \
        || { tail -20 "$DIR/apt.log" >&2; die "apt-get install slurm-wlm munge failed (log: $DIR/apt.log)"; }
fi
export PATH=$PATH:/usr/sbin:/sbin

# ---- 2. already running? -----------------------------------------------------------
# A PID file counts only if its process exists, is not a zombie (PID 1 here does
# not reap, so a dead daemon can linger as Z), is the expected daemon and was started
# with this folder's config or socket (daemon_pid, private.sh): a reused PID is not ours.
alive() {  # alive NAME PIDFILE
    local mark=$CONF
    [ "$1" = munged ] && mark=$DIR/munge/munge.sock
    daemon_pid "$1" "$2" "$mark" >/dev/null
}

node_state() { SLURM_CONF=$CONF timeout 10 sinfo -h -o %T 2>/dev/null | head -1 | tr -d ' *~#$@+-' || true; }

export_line() { echo "export SLURM_CONF=$CONF"; }

if alive munged "$DIR/run/munged.pid" && alive slurmctld "$DIR/run/slurmctld.pid" \
        && alive slurmd "$DIR/run/slurmd.pid"; then
    now_state=$(node_state)
else
    now_state=
fi
others=$(rp_holders_but "$CALLER")
if [ "$now_state" = idle ] || [ "$now_state" = mixed ] || [ "$now_state" = allocated ]; then
    rp_hold "$CALLER"
    log "already running in $DIR (node $now_state): reusing it, not starting another; its queue and jobs" \
        "are shared with ${others:-no other running process (the one that started it has ended)}." \
        "Now held also by $(rp_describe "$CALLER"): slurm/local/stop.sh from there lets go, and the" \
        "daemons stop when the last holder does"
    export_line
    exit 0
fi
# Something half-up (or stale PID files): stop what is left, then start clean. It cannot
# run jobs as it is, so the holders (kept: the same folder and config) lose nothing more.
if ls "$DIR"/run/*.pid >/dev/null 2>&1; then
    log "stale or partial instance in $DIR${others:+ (held by $others)}: stopping it first"
    RP_SLURM_LOCK_HELD=1 RINGPIPE_SLURM_DIR=$DIR "$(dirname "$0")/stop.sh" >&2 || true
fi

# ---- 3. port, folders, munge key, config -------------------------------------------
# Checked free here rather than left to slurmctld, whose failure to bind says less.
if [ -n "${RINGPIPE_SLURM_PORT:-}" ]; then
    PORT=$RINGPIPE_SLURM_PORT
    if ! [[ "$PORT" =~ ^[0-9]+$ ]] || [ "$PORT" -lt 1024 ] || [ "$PORT" -gt 65534 ]; then
        echo "start.sh: error: RINGPIPE_SLURM_PORT='$PORT' is not a port number 1024..65534" >&2; exit 2
    fi
    if rp_port_listening "$PORT" || rp_port_listening $((PORT + 1)); then
        echo "start.sh: error: port $PORT or $((PORT + 1)) (RINGPIPE_SLURM_PORT) is in use by another" \
             "program: choose another, or leave RINGPIPE_SLURM_PORT unset for a free one" >&2; exit 2
    fi
else
    PORT=$(rp_free_port_pair "$RP_SLURM_PORT") \
        || die "no free port pair near $RP_SLURM_PORT (the default for uid $RP_UID): set RINGPIPE_SLURM_PORT"
fi
mkdir -p "$DIR"/{run,log,state,spool,munge}
chmod 700 "$DIR/munge"
# A fresh key for every start (nothing runs that knows the old one): a key found in
# the folder is never trusted, whoever left it.
rm -f "$DIR/munge/munge.key"
(umask 077; dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none)
chmod 400 "$DIR/munge/munge.key"
MEM_MB=$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)
USER_NAME=$(id -un)

rp_write_slurm_conf "$DIR" start.sh ClusterName=ringpipe-local "SlurmctldHost=$HOST" "SlurmctldPort=$PORT" \
    "SlurmdPort=$((PORT + 1))" "SlurmUser=$USER_NAME" "SlurmdSpoolDir=$DIR/spool/slurmd-%n" \
    "SlurmdPidFile=$DIR/run/slurmd.pid" "SlurmdLogFile=$DIR/log/slurmd.log" SlurmctldDebug=info SlurmdDebug=info \
    MessageTimeout=30 InactiveLimit=0 SlurmdTimeout=60 SchedulerType=sched/backfill <<EOF
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF

# ---- 4. daemons --------------------------------------------------------------------
export SLURM_CONF=$CONF
wait_pidfile() {  # wait_pidfile NAME PIDFILE LOG
    for _ in $(seq 1 100); do
        alive "$1" "$2" && return 0
        sleep 0.1
    done
    tail -20 "$3" >&2 2>/dev/null || true
    die "$1 did not start (log: $3)"
}

log "starting munged, slurmctld, slurmd in $DIR"
munged --force -S "$DIR/munge/munge.sock" --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" \
    --seed-file="$DIR/munge/munged.seed" </dev/null >>"$DIR/log/munged.log" 2>&1 9<&- \
    || { tail -20 "$DIR/log/munged.log" >&2; die "munged failed to start"; }
wait_pidfile munged "$DIR/run/munged.pid" "$DIR/log/munged.log"

# -c: ignore saved state (a node drained by an earlier run, old jobs).
# 9<&-: the daemons must not inherit the folder's lock (holders.sh).
slurmctld -c -f "$CONF" </dev/null >>"$DIR/log/slurmctld.log" 2>&1 9<&- \
    || { tail -20 "$DIR/log/slurmctld.log" >&2; die "slurmctld failed to start"; }
wait_pidfile slurmctld "$DIR/run/slurmctld.pid" "$DIR/log/slurmctld.log"
slurmd -c -f "$CONF" </dev/null >>"$DIR/log/slurmd.log" 2>&1 9<&- \
    || { tail -20 "$DIR/log/slurmd.log" >&2; die "slurmd failed to start"; }
wait_pidfile slurmd "$DIR/run/slurmd.pid" "$DIR/log/slurmd.log"

# ---- 5. wait for the node ----------------------------------------------------------
deadline=$(( $(date +%s) + TIMEOUT ))
state=
while [ "$(date +%s)" -lt $deadline ]; do
    state=$(node_state)
    [ "$state" = idle ] && break
    case "$state" in
        drain*|down*|fail*)  # ReturnToService=2 should prevent this; try once to resume
            SLURM_CONF=$CONF scontrol update NodeName="$HOST" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    sleep 0.3
done
if [ "$state" != idle ]; then
    SLURM_CONF=$CONF sinfo -R >&2 2>/dev/null || true
    tail -15 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 2>/dev/null || true
    die "node $HOST not idle after ${TIMEOUT}s (state: '${state:-no answer}'); logs in $DIR/log"
fi
rp_hold "$CALLER"
log "node $HOST idle ($CPUS CPUs, partition debug, slurmctld port $PORT); logs in $DIR/log"
log "held by $(rp_describe "$CALLER")${others:+ and $others}: slurm/local/stop.sh from there stops it" \
    "unless another caller holds it then"
export_line
