# Sourced by start.sh, stop.sh and cluster.sh: who is using a local Slurm, so that one
# caller's stop never stops it, nor cancels a job in it, while another caller uses it.
#
# Why: the local Slurm is one per user (names.sh), so two shells of one user, or every
# root job on a shared login node, meet in the same one. start.sh used to reuse it without
# a word and stop.sh to cancel every job in it and stop it under the others. Now it is
# reference-counted:
#
#   - each start records its caller as a holder, the file DIR/holders/PID (the caller's
#     start time in it, so a PID the kernel gives to another process later is not taken
#     for the caller), and says who else holds it when it reuses a running one;
#   - a stop lets go of its own caller's hold only; the daemons stop when no holder is
#     left alive and the queue is empty. Otherwise it says what it left running and why.
#     A job is never cancelled, unless `--force` (which stops it under everyone);
#   - a holder whose process has ended (a closed shell, a finished script) no longer
#     counts: its file is removed (pruned) by the next start or stop.
#
# Both under an flock on DIR itself, so two starts, or a start and a stop, take turns.
#
# The caller is the process that runs the script: the shell of
# `eval "$(slurm/local/start.sh)"` (bash and dash run a command substitution's one command
# in place, so its parent is that shell), a script, a test runner; launchers that end
# with the script (timeout, sudo, env, nice, ...) are passed over. RINGPIPE_SLURM_HOLDER_PID
# names another process: one that lives as long as the cluster is needed.

# Launchers that end when the script ends: never the caller.
RP_PASS_OVER=" timeout sudo doas su env nice nohup setsid stdbuf flock time "

# rp_alive_since PID: the start time of PID (clock ticks since boot, /proc/PID/stat field 22)
# if it runs and is not a zombie (PID 1 here does not reap: an ended process may linger as Z);
# nothing (status 1) otherwise.
rp_alive_since() {
    local fields
    [[ "$1" =~ ^[0-9]{1,9}$ ]] || return 1
    # After "PID (COMM) " the fields start at the third: state first, start time twentieth.
    fields=$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | awk '{print $1, $20}') || return 1
    case "$fields" in ""|Z\ *|X\ *) return 1 ;; esac
    echo "${fields#* }"
}

# rp_caller_pid: the process this start or stop is for (above); exit 2 when
# RINGPIPE_SLURM_HOLDER_PID names no running process.
rp_caller_pid() {
    local pid=${RINGPIPE_SLURM_HOLDER_PID:-} comm
    if [ -n "$pid" ]; then
        if ! rp_alive_since "$pid" >/dev/null; then
            echo "$(basename -- "$0"): error: RINGPIPE_SLURM_HOLDER_PID='$pid' is not a running process: set it" \
                 "to the pid of the process that uses the cluster, or unset it (the caller of this script)" >&2
            exit 2
        fi
        echo "$pid"
        return 0
    fi
    pid=$PPID
    while [ "$pid" -gt 1 ]; do
        comm=$(cat "/proc/$pid/comm" 2>/dev/null) || break
        case "$RP_PASS_OVER" in *" $comm "*) ;; *) break ;; esac
        pid=$(sed 's/^.*) //' "/proc/$pid/stat" 2>/dev/null | awk '{print $2}')
        [ -n "$pid" ] || pid=1
    done
    echo "$pid"
}

# rp_lock DIR SECONDS: hold the lock of DIR (an flock on the folder itself, fd 9) until the
# script ends, waiting up to SECONDS for the start or stop that holds it; status 1 if DIR
# was removed meanwhile (a stop took it away). Children that outlive the script (the
# daemons) must be started with 9<&- or they would keep the lock held.
rp_lock() {
    local dir=$1 wait=$2
    for _ in 1 2 3; do
        exec 9<"$dir" || return 1
        if ! flock -w "$wait" 9; then
            echo "$(basename -- "$0"): error: another start or stop of $dir held its lock for over $wait s:" \
                 "try again when it is done" >&2
            exit 1
        fi
        # The folder locked must still be the folder named (not one a stop removed and a start made anew).
        [ "/proc/$$/fd/9" -ef "$dir" ] && return 0
        exec 9<&-
        [ -d "$dir" ] || return 1
    done
    return 1
}

# rp_describe PID: "pid PID (COMMAND, since HH:MM)", as the messages name a holder.
rp_describe() {
    local cmd since
    cmd=$(tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | head -c 60 | sed 's/ *$//')
    since=$(stat -c %Y "$RP_HOLDERS/$1" 2>/dev/null || true)
    echo "pid $1 (${cmd:-?}${since:+, since $(date -d "@$since" +%H:%M)})"
}

# rp_holders_init DIR: the holders' folder of DIR (RP_HOLDERS), made if missing, and the
# holders of ended processes removed, each named on stderr.
rp_holders_init() {
    local file pid since
    RP_HOLDERS=$1/holders
    mkdir -p -m 700 -- "$RP_HOLDERS"
    for file in "$RP_HOLDERS"/*; do
        [ -f "$file" ] || continue
        pid=${file##*/} since=$(rp_alive_since "${file##*/}" || true)
        [ -n "$since" ] && [ "$since" = "$(head -c 32 -- "$file")" ] && continue
        rm -f -- "$file"
        echo "$(basename -- "$0"): pid $pid, which held $1, has ended: no longer counted" >&2
    done
}

# rp_hold PID: record PID as a holder (again: a second start from one caller is one hold).
rp_hold() {
    rp_alive_since "$1" >"$RP_HOLDERS/$1.tmp" && mv -f -- "$RP_HOLDERS/$1.tmp" "$RP_HOLDERS/$1"
}

# rp_release PID...: drop the holds of these PIDs; status 1 if none held one. A stop passes
# its caller and its own PID ($$): a shell runs the last command of `bash -c '...; stop.sh'`
# in place (exec), so the shell that held the cluster may be the stop itself.
rp_release() {
    local pid found=1
    for pid in "$@"; do
        [[ "$pid" =~ ^[0-9]+$ ]] && [ -f "$RP_HOLDERS/$pid" ] || continue
        rm -f -- "$RP_HOLDERS/$pid"
        found=0
    done
    return $found
}

# rp_holders_but PID...: the live holders other than these PIDs, described, comma-separated.
rp_holders_but() {
    local file pid out=
    for file in "$RP_HOLDERS"/*; do
        [ -f "$file" ] || continue
        pid=${file##*/}
        case " $* " in *" $pid "*) continue ;; esac
        out="${out:+$out, }$(rp_describe "$pid")"
    done
    echo "$out"
}

# rp_let_go DIR CALLER PID...: CALLER's hold on DIR let go (and these PIDs'), said with log;
# RP_OTHERS: the live holders left, described.
rp_let_go() {
    local dir=$1 caller=$2 me
    shift 2
    rp_holders_init "$dir"
    me=$(rp_describe "$caller")
    if rp_release "$caller" "$@"; then
        log "$me lets go of its hold on $dir"
    else
        log "$me had no hold on $dir to let go (it was started from another process)"
    fi
    RP_OTHERS=$(rp_holders_but "$caller" "$@")
}

# rp_may_stop DIR FORCE JOBS CMD LEFT: status 0 when the cluster of DIR may stop now (no
# other live holder, RP_OTHERS, and an empty queue, JOBS; or FORCE), else 1 after saying what
# is left and why. CMD names the stop command in the messages (stop.sh, `down`), LEFT what
# it leaves ("left running"). A job is cancelled only with FORCE.
rp_may_stop() {
    local dir=$1 force=$2 jobs=$3 cmd=$4 left=$5
    if [ -n "$force" ]; then
        [ -z "$RP_OTHERS${jobs// /}" ] ||
            log "--force: stopping it${RP_OTHERS:+ although $RP_OTHERS still hold it}${jobs:+, cancelling jobs $jobs}"
        return 0
    fi
    if [ -n "$RP_OTHERS" ]; then
        log "$left: $dir is still held by $RP_OTHERS; nothing cancelled. Each holder's own $cmd lets go," \
            "the last one stops it ($cmd --force stops it now, cancelling every job)"
        return 1
    fi
    if [ -n "${jobs// /}" ]; then
        log "$left: no one else holds $dir, but jobs $jobs are in its queue (squeue); nothing cancelled." \
            "Let them finish or scancel them, then $cmd again ($cmd --force cancels them and stops it)"
        return 1
    fi
    return 0
}
