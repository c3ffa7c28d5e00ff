# Sourced by start.sh, stop.sh, cluster.sh and nodes.sh: their state folder must be
# private, and a PID they read from it must be the daemon they started before they
# signal it.
#
# Why: the folders have predictable default names under /tmp (/tmp/ringpipe-slurm-USER,
# ...: names.sh), and
# these scripts run as root. Another user could create the folder first, with a munge
# key of their own (then their credentials are valid on our cluster), a config, a shim
# that mpiexec runs, symbolic links where we write, or PID files naming any process,
# which `down` used to SIGKILL unchecked. So a folder we did not create is used only if
# it is a real folder (not a link), owned by us, with no permission for anyone else
# (mode 0700, what `mktemp -d` and `mkdir -m 700` make): then only we (and root) can have
# put anything in it. Otherwise the script stops with exit 2 and says what to do.

# private_dir WHAT DIR [check]: make DIR (mode 0700) if it does not exist (with
# `check`: leave it missing), else check it as above; exit 2 naming it when it cannot
# be ours.
private_dir() {
    local what=$1 dir=$2 owner mode
    if [ ! -e "$dir" ] && [ ! -L "$dir" ]; then
        [ "${3:-}" = check ] && return 0
        mkdir -p -- "$(dirname -- "$dir")"
        # -m 700 on the last component only; if someone makes it in between, mkdir fails.
        if mkdir -m 700 -- "$dir" 2>/dev/null; then
            return 0
        fi
    fi
    if [ -L "$dir" ] || [ ! -d "$dir" ]; then
        private_refuse "$what" "$dir" "is not a folder (a symbolic link or a file)"
    fi
    owner=$(stat -c %u -- "$dir") mode=$(stat -c %a -- "$dir")
    if [ "$owner" != "$(id -u)" ]; then
        private_refuse "$what" "$dir" "belongs to uid $owner, not to us (uid $(id -u))"
    fi
    if [ "$mode" != 700 ]; then
        private_refuse "$what" "$dir" "has mode $mode, not 700 (others may have written in it)" \
            "If it is yours and you trust what it holds: chmod 700 $dir. "
    fi
}

private_refuse() {  # WHAT DIR WHY [HINT]
    echo "$(basename -- "$0"): error: the $1 $2 $3: it could hold another user's files (a munge key, a config," \
         "PID files). ${4:-}Remove it, or point the script at a folder of your own" \
         "(${PRIVATE_DIR_VAR:-the state folder variable}=DIR, a new or mode-700 folder)." >&2
    exit 2
}

# daemon_pid NAME PIDFILE MARK: the PID in PIDFILE if that process is running (not a
# zombie), is NAME (slurmctld, slurmd, munged; Debian's *-wlm names too) and has MARK,
# our config or socket path, as one of its arguments; else nothing (status 1). A PID
# file could name any process: a stale one whose number was reused, or one planted.
daemon_pid() {
    local name=$1 file=$2 mark=$3 pid state exe arg found=0
    [ -f "$file" ] && [ ! -L "$file" ] && [ -s "$file" ] || return 1
    pid=$(head -c 32 -- "$file" | tr -dc 0-9)
    [ -n "$pid" ] && [ "${#pid}" -le 9 ] && [ "$pid" -gt 1 ] || return 1
    [ -r "/proc/$pid/cmdline" ] || return 1
    state=$(sed 's/^.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1)
    [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ] || return 1
    exe=
    while IFS= read -r -d '' arg; do
        if [ -z "$exe" ]; then
            exe=${arg##*/}
            case "$exe" in "$name"|"$name"-wlm) ;; *) return 1 ;; esac
        elif [ "$arg" = "$mark" ]; then
            found=1
        fi
    done <"/proc/$pid/cmdline"
    [ $found = 1 ] || return 1
    echo "$pid"
}
