#!/usr/bin/env bash
# Render a `ringpipe report` to a PNG with headless Chromium (for the docs, or to look at a
# report on a machine without a desktop). Nothing is fetched: the report has no URL, and the
# flags turn off Chromium's own traffic.
#
#   bash docs/images/make_report_png.sh [RUN_DIR] [OUT.png] [HEIGHT]
#
# Without RUN_DIR it draws the made-up run the tests use (tests/support/monitor_fixture.py:
# 8 ranks on 2 nodes, rank 3 a straggler) into docs/images/report.png. Needs chromium
# (apt-get install -y chromium) and the project's .venv (make train or make test builds it).
set -eu
# The paths given are the caller's; the script then works from the repository's root.
RUN=${1:+$(realpath -m "$1")}
OUT_PNG=${2:+$(realpath -m "$2")}
HEIGHT=${3:-4000}
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
OUT_PNG=${OUT_PNG:-$PWD/docs/images/report.png}
BROWSER=$(command -v chromium || command -v chromium-browser || true)
[ -n "$BROWSER" ] || { echo "make_report_png.sh: chromium is not installed: apt-get install -y chromium" >&2; exit 2; }
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ringpipe-report-png.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
if [ -z "$RUN" ]; then
    RUN=$WORK/run
    "$PY" -c "import sys; sys.path.insert(0, '.'); from tests.support.monitor_fixture import write_run; \
write_run(sys.argv[1], ranks=8, steps=200, interval=10, straggler=3)" "$RUN"
fi
"$PY" -m ringpipe.cli report "$RUN" --out "$WORK/report.html"
"$BROWSER" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
    --disable-component-update --disable-sync --user-data-dir="$WORK/profile" --hide-scrollbars \
    --screenshot="$OUT_PNG" --window-size=1280,"$HEIGHT" "file://$WORK/report.html" 2>/dev/null
echo "wrote $OUT_PNG"
