# The parts ("phases") of a test run, timed, and one closing summary of them.
# Sourced by tests/run_all.sh, tests/run_mpi.sh and .ci/run.
#
# A failure used to be ~90 lines above make's "Error 1", with nothing saying which
# part failed or how to run only that part again. Each phase is recorded as a line
# of the file TEST_PHASES_FILE; the outermost script (the one that created the file)
# prints the summary: every phase with its result and measured time, and for a
# failed one the command that reruns just it. A script called by another (run_mpi.sh
# from run_all.sh, make test from .ci/run) finds the file in its environment and adds
# its phases to it, so the one summary at the very end names them all.
#
#   phases_begin
#   phase "serial tests" "python -m pytest tests" python -m pytest tests   # NAME RERUN COMMAND...
#   phases_end      # prints the summary if this script began the file; returns 1 if one of its phases failed

phases_begin() {
    if [ -n "${TEST_PHASES_FILE:-}" ] && [ -f "$TEST_PHASES_FILE" ]; then
        PHASES_OWNER=0
        PHASES_FIRST=$(($(wc -l < "$TEST_PHASES_FILE") + 1))    # this script's exit code judges its own phases
    else
        PHASES_FIRST=1
        TEST_PHASES_FILE=$(mktemp "${TMPDIR:-/tmp}/ringpipe-phases.XXXXXX")
        export TEST_PHASES_FILE
        PHASES_OWNER=1
        trap 'rm -f "$TEST_PHASES_FILE"' EXIT      # also when the run is interrupted
    fi
}

phase_seconds() {  # 83 -> 1m23s
    if [ "$1" -ge 60 ]; then printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); else printf '%ds' "$1"; fi
}

# phase NAME RERUN COMMAND...: runs COMMAND and records its result; returns its exit code.
# pytest's exit 5 ("no tests collected") is not a failure: a selection may be empty.
phase() {
    local name=$1 rerun=$2 start rc result
    shift 2
    start=$(date +%s)
    "$@"
    rc=$?
    case $rc in
        0) result=passed ;;
        5) result="passed (no tests collected)" ;;
        *) result="FAILED (exit $rc)" ;;
    esac
    printf '%s\t%s\t%s\t%s\n' "$result" "$(phase_seconds $(($(date +%s) - start)))" "$name" "$rerun" \
        >> "$TEST_PHASES_FILE"
    return $rc
}

phases_end() {
    local failed
    failed=$(tail -n +"$PHASES_FIRST" "$TEST_PHASES_FILE" | grep -c '^FAILED' || true)   # grep -c exits 1 on 0
    if [ "$PHASES_OWNER" = 1 ]; then
        echo
        echo "== summary: each phase, its result and its time (commands run from $(pwd)) =="
        while IFS=$'\t' read -r result took name rerun; do
            printf '  %-44s %7s  %s\n' "$name" "$took" "$result"
            case $result in FAILED*) echo "      rerun only this: $rerun" ;; esac
        done < "$TEST_PHASES_FILE"
        if [ "$failed" = 0 ]; then
            echo "== all $(wc -l < "$TEST_PHASES_FILE") phases passed =="
        else
            echo "== $failed of $(wc -l < "$TEST_PHASES_FILE") phases FAILED: their output above names what failed =="
        fi
        rm -f "$TEST_PHASES_FILE"
    fi
    [ "$failed" = 0 ]
}
