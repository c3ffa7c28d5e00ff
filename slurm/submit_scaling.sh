#!/usr/bin/env bash
# Submit a strong/weak scaling sweep (and/or an all-reduce sweep): one job per
# rank count, run one at a time so they do not disturb each other
# (--dependency=singleton on one job name), then a small job that merges the
# results (slurm/collect.py merge: markdown table, JSON, PNG). Never half a sweep:
# every job is first checked with `sbatch --test-only`, and if the cluster cannot run
# one (more ranks or CPUs than it has) nothing is submitted (exit 2); if a submission
# fails midway (or the script is interrupted), the jobs it had submitted are cancelled
# (exit 1).
#
#   slurm/submit_scaling.sh --ranks "1 2 4 8" --mode both --steps 40 --batch 32 \
#       --results runs/scaling -- --layers 4 --d-model 128
#   slurm/submit_scaling.sh --kind allreduce --ranks "2 4 8 16" --tasks-per-node 4 \
#       --allreduce-args "--max-bytes 64M"
#
# Options:
#   --kind train|allreduce|both   what to sweep (default train)
#   --mode strong|weak|both       train: fixed global batch, or fixed batch per rank (default strong)
#   --ranks "1 2 4"               rank counts (default "1 2 4")
#   --tasks-per-node N            ranks per node; nodes = ceil(ranks / N) (default 4)
#   --cpus-per-task C             (default 1)
#   --batch B                     strong: global batch; weak: batch per rank (default 32)
#   --steps S --warmup W          train steps, and how many to leave out of the median (default 30, 5)
#   --time T                      sbatch --time per job (default 00:30:00)
#   --results DIR                 where results go (default runs/scaling-<date>)
#   --job-name NAME               singleton name (default ringpipe-scaling): sweeps with the
#                                 same name never overlap
#   --sbatch "ARGS"               more sbatch options for every job (e.g. "-p gpu -A proj")
#   --allreduce-args "ARGS"       arguments for benchmarks/allreduce.py (e.g. "--quick" or
#                                 "--max-bytes 64M --algorithms ring,mpi")
#   --wait                        wait for the merge job, print the table; exit 1 if it failed
#   -- ARGS                       passed to ringpipe train (the training sweep only)
# The all-reduce sweep skips 1 rank (no communication). Run from the repo root.
set -euo pipefail
cd "$(dirname "$0")/.."

KIND=train MODE=strong RANKS="1 2 4" TPN=4 CPT=1 BATCH=32 STEPS=30 WARMUP=5 TIME=00:30:00
RESULTS=runs/scaling-$(date +%Y%m%d-%H%M%S) NAME=ringpipe-scaling EXTRA_SBATCH='' WAIT=0 AR_ARGS=''
while [ $# -gt 0 ]; do
    case "$1" in
        --kind) KIND=$2; shift 2 ;;
        --mode) MODE=$2; shift 2 ;;
        --ranks) RANKS=$2; shift 2 ;;
        --tasks-per-node) TPN=$2; shift 2 ;;
        --cpus-per-task) CPT=$2; shift 2 ;;
        --batch) BATCH=$2; shift 2 ;;
        --steps) STEPS=$2; shift 2 ;;
        --warmup) WARMUP=$2; shift 2 ;;
        --time) TIME=$2; shift 2 ;;
        --results) RESULTS=$2; shift 2 ;;
        --job-name) NAME=$2; shift 2 ;;
        --sbatch) EXTRA_SBATCH=$2; shift 2 ;;
        --allreduce-args) AR_ARGS=$2; shift 2 ;;
        --wait) WAIT=1; shift ;;
        -h|--help) sed -n '2,33p' "$0"; exit 0 ;;
        --) shift; break ;;
        *) echo "submit_scaling.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$KIND" in train) KINDS=train ;; allreduce) KINDS=allreduce ;; both) KINDS="train allreduce" ;;
    *) echo "submit_scaling.sh: --kind train|allreduce|both" >&2; exit 2 ;; esac
case "$MODE" in strong|weak) MODES=$MODE ;; both) MODES="strong weak" ;;
    *) echo "submit_scaling.sh: --mode strong|weak|both" >&2; exit 2 ;; esac
if [ "$KIND" = allreduce ] && [ $# -gt 0 ]; then
    echo "submit_scaling.sh: arguments after -- go to ringpipe train, and --kind allreduce trains nothing;" \
        "pass all-reduce options as --allreduce-args \"$*\"" >&2
    exit 2
fi
# Absolute (job logs are written from elsewhere), made only once the cluster said yes.
RESULTS=$(realpath -m -- "$RESULTS")
TRAIN_ARGS=("$@")
PY=python3
[ -x .venv/bin/python ] && PY=$(pwd -P)/.venv/bin/python
PY=${RINGPIPE_PYTHON:-$PY}
MERGE="$PY slurm/collect.py merge $RESULTS"
command -v sbatch >/dev/null || { echo "submit_scaling.sh: no sbatch on PATH: run it where Slurm's commands are" >&2; exit 2; }

# ---- the sweep, planned: one "RANKS KIND MODE" per job ------------------------------
PLAN=()
for kind in $KINDS; do
    for p in $RANKS; do
        [[ "$p" =~ ^[1-9][0-9]*$ ]] || { echo "submit_scaling.sh: --ranks: '$p' is not a rank count >= 1" >&2; exit 2; }
        if [ "$kind" = allreduce ]; then
            [ "$p" -lt 2 ] && { echo "skipping all-reduce at 1 rank" >&2; continue; }
            PLAN+=("$p allreduce strong")
        else
            for mode in $MODES; do PLAN+=("$p train $mode"); done
        fi
    done
done
[ ${#PLAN[@]} -gt 0 ] || { echo "submit_scaling.sh: nothing to run (--ranks \"$RANKS\", --kind $KIND)" >&2; exit 2; }

job_command() {  # job_command RANKS KIND MODE: JOB=(its sbatch arguments), WHAT=(its description)
    local p=$1 kind=$2 mode=$3 nodes tpn extra
    nodes=$(( (p + TPN - 1) / TPN ))
    tpn=$(( p < TPN ? p : TPN ))
    extra=("${TRAIN_ARGS[@]}")
    [ "$kind" = allreduce ] && read -ra extra <<<"$AR_ARGS"
    WHAT="$kind $mode, $p ranks on $nodes node(s) x $tpn x $CPT CPU(s)"
    # shellcheck disable=SC2206
    JOB=(--job-name="$NAME" --dependency=singleton -N "$nodes" -n "$p" --ntasks-per-node="$tpn" -c "$CPT"
        --time="$TIME" -o "$RESULTS/logs/$kind-$mode-n$p-%j.out" $EXTRA_SBATCH slurm/scaling.sbatch
        --kind "$kind" --mode "$mode" --batch "$BATCH" --steps "$STEPS" --warmup "$WARMUP"
        --results "$RESULTS" -- "${extra[@]}")
}

merge_command() {  # JOB=(the merge job's sbatch arguments)
    # It leaves merge-JOBID.ok behind when it succeeded: its state may be gone from
    # Slurm (MinJobAge) by the time anyone looks.
    WHAT="merge"
    # shellcheck disable=SC2206
    JOB=(--job-name="$NAME" --dependency=singleton -N 1 -n 1 -c 1 --time=00:10:00
        -o "$RESULTS/logs/merge-%j.out" $EXTRA_SBATCH
        --wrap "$MERGE && touch $RESULTS/logs/merge-\$SLURM_JOB_ID.ok")
}

# ---- 1. can the cluster run every job? (sbatch --test-only submits nothing) ---------
# Checked for all before submitting any: a sweep refused at 8 ranks used to leave the
# smaller jobs queued, with no merge job, for the user to find and cancel.
refused=0
for point in "${PLAN[@]}" merge; do
    # shellcheck disable=SC2086
    if [ "$point" = merge ]; then merge_command; else job_command $point; fi
    if ! out=$(sbatch --test-only "${JOB[@]}" 2>&1); then
        echo "submit_scaling.sh: the cluster refuses $WHAT: $(echo "$out" | grep -v '^$' | tail -n 3 | tr '\n' ' ')" >&2
        refused=1
    fi
done
if [ $refused = 1 ]; then
    echo "submit_scaling.sh: nothing was submitted. Leave those rank counts out of --ranks, or ask for" \
        "what the cluster has (--tasks-per-node, --cpus-per-task, --sbatch \"-p PARTITION\"; sinfo shows nodes and CPUs)" >&2
    exit 2
fi

# ---- 2. submit; on any failure cancel what was submitted: never half a sweep --------
mkdir -p "$RESULTS/logs"
ids=()
errf=$(mktemp)
cancel_submitted() {  # cancel_submitted WHY
    rm -f "$errf"
    [ ${#ids[@]} -gt 0 ] || { echo "submit_scaling.sh: $1; nothing had been submitted" >&2; return 0; }
    if scancel "${ids[@]}"; then
        echo "submit_scaling.sh: $1; cancelled the ${#ids[@]} job(s) this sweep had submitted: ${ids[*]}" >&2
    else
        echo "submit_scaling.sh: $1; could not cancel this sweep's jobs (scancel failed): scancel ${ids[*]}" >&2
    fi
}
trap 'cancel_submitted "interrupted"; exit 130' INT TERM HUP
submit() {  # submit: JOB and WHAT from job_command or merge_command
    local id
    id=$(sbatch --parsable "${JOB[@]}" 2>"$errf") || id=
    id=${id%%;*}
    if ! [[ "$id" =~ ^[0-9]+$ ]]; then
        cancel_submitted "submitting $WHAT failed ($(tr '\n' ' ' <"$errf"))"
        exit 1
    fi
    ids+=("$id")
    echo "submitted $WHAT: job $id" >&2
}
for point in "${PLAN[@]}"; do
    # shellcheck disable=SC2086
    job_command $point
    submit
done
merge_command
submit
mid=${ids[-1]}
trap - INT TERM HUP
rm -f "$errf"
unset 'ids[-1]'
echo "merge job $mid runs after ${ids[*]}" >&2

job_state() {  # JOBID -> its state, or nothing once Slurm has forgotten it (and has no accounting)
    local s
    # squeue fails for a job it has forgotten, or on a busy controller: not fatal here.
    s=$(squeue -h -j "$1" -t all -o %T 2>/dev/null | head -n 1) || s=""
    [ -n "$s" ] || s=$(sacct -n -X -P -j "$1" -o State 2>/dev/null | head -n 1 | cut -d' ' -f1) || s=""
    echo "$s"
}

if [ $WAIT = 1 ]; then
    # Poll once a second (sbatch --wait backs off to long sleeps).
    while :; do
        state=$(job_state "$mid")
        case "$state" in
            COMPLETED|FAILED|CANCELLED*|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE|PREEMPTED) break ;;
            "") scontrol show job "$mid" >/dev/null 2>&1 || break ;;   # forgotten: ended a while ago
        esac
        sleep 1
    done
    [ -z "$state" ] && [ -e "$RESULTS/logs/merge-$mid.ok" ] && state=COMPLETED
    cat "$RESULTS/logs/merge-$mid.out" 2>/dev/null || echo "submit_scaling.sh: no merge log at $RESULTS/logs/merge-$mid.out" >&2
    for id in "${ids[@]}"; do
        st=$(job_state "$id")
        # Forgotten jobs (no state) are not reported: the merged table shows any missing point.
        if [ -n "$st" ] && [ "$st" != COMPLETED ]; then
            echo "submit_scaling.sh: warning: job $id ended $st: see $RESULTS/logs/*-$id.out" >&2
        fi
    done
    if [ "$state" != COMPLETED ]; then
        echo "submit_scaling.sh: the merge job ended ${state:-?}; log: $RESULTS/logs/merge-$mid.out" >&2
        exit 1
    fi
else
    echo "results: $RESULTS (scaling.md / scaling.png, allreduce.md / allreduce.png when done)" >&2
    echo "re-merge by hand: $MERGE" >&2
fi
echo "$RESULTS"
