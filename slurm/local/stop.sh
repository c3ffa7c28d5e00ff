#!/usr/bin/env bash
# Stop the private Slurm started by slurm/local/start.sh (same RINGPIPE_SLURM_DIR,
# default /tmp/ringpipe-slurm-USER: slurm/local/names.sh), and the emulated cluster of
# `start.sh --nodes N` (RINGPIPE_CLUSTER_DIR) when RINGPIPE_SLURM_DIR is not set.
#
#   slurm/local/stop.sh            # let go of this caller's hold; stop it if no one else holds it
#   slurm/local/stop.sh --force    # stop it now: cancel every job, whoever holds it
#   RINGPIPE_SLURM_PURGE=1 slurm/local/stop.sh   # ... and delete the folder once stopped
#
# The cluster is shared and reference-counted (slurm/local/holders.sh): each start.sh
# made its caller (the shell that ran it, or RINGPIPE_SLURM_HOLDER_PID) a holder. A stop
# lets go of its own caller's hold only, and stops slurmd, slurmctld and munged only when
# no other holder is alive and the queue is empty; otherwise it says what it left running
# and why (exit 0). It never cancels a job, except with --force.
#
# Only processes named in this folder's PID files are signalled (plus job step
# daemons, slurmstepd, whose environment points at this folder's slurm.conf),
# one PID at a time: never by name. Waits until each is gone. PID 1 on these
# machines does not reap orphans, so a stopped daemon may linger as a zombie
# (state Z): that counts as stopped. Idempotent: stopping a stopped cluster
# is a no-op.
set -uo pipefail

FORCE=
case "${1:-}" in
    "") ;;
    --force) FORCE=--force ;;
    -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "stop.sh: error: unknown option '$1' (none: let go of this caller's hold; --force: stop it now)" >&2
       exit 2 ;;
esac
# Per-user default folders (RINGPIPE_SLURM_DIR, RINGPIPE_CLUSTER_DIR): names.sh.
# shellcheck source=names.sh
. "$(dirname "$0")/names.sh"
# shellcheck source=holders.sh
. "$(dirname "$0")/holders.sh"
# RP_SLURM_LOCK_HELD=1: start.sh, holding the folder's lock, clears a stale instance (no holders).
INTERNAL=${RP_SLURM_LOCK_HELD:-0}
[ "$INTERNAL" = 1 ] || CALLER=$(rp_caller_pid)
# The emulated multi-node cluster of `start.sh --nodes N`, if up, goes too, by the same rule
# (unless RINGPIPE_SLURM_DIR names one single-node cluster to stop: the tests' own).
if [ -z "${RINGPIPE_SLURM_DIR:-}" ] && [ -d "$RP_CLUSTER_DIR" ]; then
    RINGPIPE_SLURM_HOLDER_PID=$CALLER RP_SLURM_STOP_PID=$$ bash "$(dirname "$0")/cluster.sh" down $FORCE
fi
DIR=$RP_SLURM_DIR
if [ ! -e "$DIR" ] && [ ! -L "$DIR" ]; then
    echo "stop.sh: nothing to stop ($DIR does not exist)" >&2
    # Before names were per user, the folder was /tmp/ringpipe-slurm for everyone.
    if [ -z "${RINGPIPE_SLURM_DIR:-}" ] && [ -d /tmp/ringpipe-slurm ] && [ "$(stat -c %u /tmp/ringpipe-slurm)" = "$RP_UID" ]; then
        echo "stop.sh: /tmp/ringpipe-slurm (the folder of older versions) is yours: to stop a Slurm" \
             "still running there, RINGPIPE_SLURM_DIR=/tmp/ringpipe-slurm slurm/local/stop.sh" >&2
    fi
    exit 0
fi
# A folder that is not ours alone is not read (its PID files could name any process)
# nor removed: exit 2 naming it (private.sh).
PRIVATE_DIR_VAR=RINGPIPE_SLURM_DIR
# shellcheck source=private.sh
. "$(dirname "$0")/private.sh"
private_dir "Slurm state folder" "$DIR" check
DIR=$(cd "$DIR" && pwd -P)
CONF=$DIR/slurm.conf
export PATH=$PATH:/usr/sbin:/sbin

log() { echo "stop.sh: $*" >&2; }

running() {  # running PID: exists and is not a zombie
    local state
    [ -r "/proc/$1/stat" ] || return 1
    state=$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)
    [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

pid_of() {  # pid_of NAME PIDFILE -> the PID if that file names a live NAME started with this folder
    local mark=$CONF pid
    [ "$1" = munged ] && mark=$DIR/munge/munge.sock
    daemon_pid "$1" "$2" "$mark" && return 0
    pid=$(head -c 32 -- "$2" 2>/dev/null | tr -dc 0-9)
    if [ -n "$pid" ] && running "$pid"; then
        log "not signalling pid $pid of $2: it is not the $1 of $DIR ($(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | head -c 120))"
    fi
    return 1
}

# let_go: release this caller's hold; status 1 (after saying what is left running and why)
# when the cluster must keep running: another live holder, or jobs in its queue, and no --force.
let_go() {
    rp_let_go "$DIR" "$CALLER" $$
    # Nothing of it runs (it died): nothing to leave running for anyone; what it left is cleared.
    [ -n "$ctld$slurmd_pid$munge" ] || return 0
    rp_may_stop "$DIR" "$FORCE" "$jobs" stop.sh "left running"
}

stop_pids() {  # stop_pids LABEL PID...: TERM all, wait (STOP_WAIT tenths, default 100), KILL the rest, wait
    local label=$1 pid left n=${STOP_WAIT:-100}
    shift
    [ $# -gt 0 ] || return 0
    for pid in "$@"; do kill -TERM "$pid" 2>/dev/null; done
    for _ in $(seq 1 "$n"); do
        left=
        for pid in "$@"; do running "$pid" && left="$left $pid"; done
        [ -z "$left" ] && return 0
        sleep 0.1
    done
    log "$label (pid$left) ignored SIGTERM for $((n / 10)) s: SIGKILL"
    for pid in $left; do kill -KILL "$pid" 2>/dev/null; done
    for _ in $(seq 1 50); do
        left=
        for pid in "$@"; do running "$pid" && left="$left $pid"; done
        [ -z "$left" ] && return 0
        sleep 0.1
    done
    log "warning: $label (pid$left) still present"
}

# One start or stop of this folder at a time; a stop that removed it meanwhile did this one's work.
if [ "$INTERNAL" != 1 ] && ! rp_lock "$DIR" 300; then
    log "nothing to stop ($DIR was removed meanwhile)"
    exit 0
fi

ctld=$(pid_of slurmctld "$DIR/run/slurmctld.pid" || true)
slurmd_pid=$(pid_of slurmd "$DIR/run/slurmd.pid" || true)
munge=$(pid_of munged "$DIR/run/munged.pid" || true)
did=0
jobs=
if [ -n "$ctld" ] && [ -f "$CONF" ]; then
    # Not the ones completing: they are gone in a moment, on their own.
    jobs=$(SLURM_CONF=$CONF timeout 10 squeue -h -o "%A %T" 2>/dev/null \
        | awk '$2 != "COMPLETING" {printf "%s%s", sep, $1; sep = " "}')
fi
if [ "$INTERNAL" != 1 ] && ! let_go; then
    exit 0
fi

# 1. Cancel this cluster's jobs while the controller still answers, so their
#    processes are cleaned up by Slurm itself (--force, or a stale instance of start.sh's).
if [ -n "$ctld" ] && [ -f "$CONF" ]; then
    if [ -n "${jobs// /}" ]; then
        log "cancelling jobs: $jobs"
        # shellcheck disable=SC2086
        SLURM_CONF=$CONF timeout 10 scancel $jobs 2>/dev/null || true
        for _ in $(seq 1 50); do
            [ -z "$(SLURM_CONF=$CONF timeout 5 squeue -h -t R,CG -o %A 2>/dev/null)" ] && break
            sleep 0.2
        done
    fi
fi

# 2. Daemons, compute side first.
for spec in "slurmd:$slurmd_pid" "slurmctld:$ctld" "munged:$munge"; do
    name=${spec%%:*}; pid=${spec#*:}
    [ -n "$pid" ] || continue
    stop_pids "$name" "$pid"
    did=1
done

# 3. Job step daemons (slurmstepd) of this cluster left behind (e.g. by a
#    slurmd killed mid-job), and the job processes under them: slurmstepd
#    processes are recognised by this folder's SLURM_CONF in their environment,
#    their descendants by parent PID. Signalled by PID, never our ancestors.
ancestors=" $$ "
p=$$
while [ "${p:-1}" -gt 1 ] 2>/dev/null; do
    p=$(awk '{print $4}' "/proc/$p/stat" 2>/dev/null || echo 1)
    ancestors="$ancestors$p "
done
stepds=()
for d in /proc/[0-9]*; do
    pid=${d#/proc/}
    [ "$(cat "$d/comm" 2>/dev/null)" = slurmstepd ] || continue
    case "$ancestors" in *" $pid "*) continue ;; esac
    running "$pid" || continue
    tr '\0' '\n' <"$d/environ" 2>/dev/null | grep -qx "SLURM_CONF=$CONF" && stepds+=("$pid")
done
if [ ${#stepds[@]} -gt 0 ]; then
    # Their descendants (batch script, srun, tasks), from the parent links.
    kids=$(for st in /proc/[0-9]*/stat; do sed 's/^\([0-9]*\) (.*) [A-Z] \([0-9]*\) .*/\1 \2/' "$st" 2>/dev/null; done \
        | awk -v roots="${stepds[*]}" '
            { parent[$1] = $2 }
            END { n = split(roots, r, " "); for (i = 1; i <= n; i++) keep[r[i]] = 1
                  changed = 1
                  while (changed) { changed = 0
                      for (p in parent) if (!(p in keep) && (parent[p] in keep)) { keep[p] = 1; changed = 1 } }
                  for (i = 1; i <= n; i++) delete keep[r[i]]
                  for (p in keep) print p }')
    jobprocs=()
    for pid in $kids; do
        case "$ancestors" in *" $pid "*) continue ;; esac
        running "$pid" && jobprocs+=("$pid")
    done
    STOP_WAIT=30 stop_pids "job process" "${jobprocs[@]}"
    STOP_WAIT=30 stop_pids slurmstepd "${stepds[@]}"    # it ignores SIGTERM
    did=1
fi

rm -f "$DIR"/run/*.pid "$DIR/munge/munge.sock" "$DIR/munge/munge.sock.lock" 2>/dev/null
# Stopped: no one holds it any more (a stale instance's holders stay: start.sh starts it again for them).
[ "$INTERNAL" = 1 ] || rm -rf "$DIR/holders"
if [ "${RINGPIPE_SLURM_PURGE:-0}" = 1 ]; then
    rm -rf "$DIR"
    log "removed $DIR"
fi
if [ $did = 1 ]; then log "stopped Slurm in $DIR"; else log "not running ($DIR)"; fi
exit 0
