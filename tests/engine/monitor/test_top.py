"""`ringpipe top` (engine/monitor/top.py) on a made-up run (tests/support/monitor_fixture.py):
the plain-text table, the live view in a real terminal (tmux: keys sent, the screen
captured), and the refusals."""
import asyncio
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from ringpipe.engine.monitor import top
from tests.support import ROOT
from tests.support.monitor_fixture import write_run

STRAGGLER = 3
RANKS = 8


def _rank_lines(text: str) -> dict[int, str]:
    """rank -> its row in a plain or captured table (a row starts with the rank, then a node)."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\s*(\d+)\s+n\d+\s", line)
        if m:
            rows[int(m.group(1))] = line
    return rows


def test_once_shows_every_rank_the_straggler_and_the_eta(tmp_path, capsys):
    write_run(tmp_path / "run", ranks=RANKS, steps=40, done=20, straggler=STRAGGLER)
    assert top.main([str(tmp_path / "run"), "--once"]) == 0
    out = capsys.readouterr().out
    rows = _rank_lines(out)
    assert sorted(rows) == list(range(RANKS)), out
    assert "straggler: compute 1.8x" in rows[STRAGGLER]
    assert all("straggler" not in rows[r] for r in rows if r != STRAGGLER)
    assert re.search(r"ETA \d+ s \(0\.50 s/step\)", out), out     # the fixture's steps are 0.5 s apart
    assert "step 20/40" in out and "8 ranks on 2 nodes" in out and "running" in out
    assert "stragglers: rank 3 (compute 1.8x)" in out


def test_a_folder_that_is_no_run_exits_2(tmp_path):
    # Through the front door, as a user types it: the message names the folder and what to give.
    proc = subprocess.run([sys.executable, "-m", "ringpipe", "top", str(tmp_path)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert "is not a run directory" in proc.stderr and str(tmp_path) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_run_not_written_yet_waits_and_a_damaged_log_is_shown(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run, ranks=4, steps=40, done=0)
    assert top.main([str(run), "--once"]) == 0
    assert "waiting for the run to write metrics.jsonl" in capsys.readouterr().out
    (run / "metrics.jsonl").write_text('{"step": 1, "time": 1.0, "loss": 3.0}\nnot json\n'
                                       '{"step": 2, "time": 2.0, "loss": 2.5}\n')
    view = top.load_view(str(run))                     # the live view shows it, it does not crash
    assert "1 damaged line(s)" in view.error
    assert top.main([str(run), "--once"]) == 2         # the file is damaged: said, with the good records
    out = capsys.readouterr().out
    assert "step 2/40" in out and "loss 2.5000" in out, out


def test_finished_when_every_rank_left_its_marker(tmp_path, capsys):
    from ringpipe.engine.job.rundir import mark_finished
    run = str(tmp_path / "run")
    write_run(run, ranks=2, steps=10)
    for rank in range(2):
        mark_finished(run, rank, 2, 10)
    assert top.load_view(run).state == "finished"


def test_no_new_record_for_long_is_said(tmp_path):
    run = str(tmp_path / "run")
    write_run(run, ranks=2, steps=40, done=10)
    later = time.time() + 3 * 3600
    assert top.load_view(run, now=later).state == "no progress for 3 h 00 min (stalled?)"


def _headless(run_dir, drive, size=(160, 40)):
    """Run the live view without a terminal; `drive(app, pilot)` after its first reading."""
    app = top.make_app(str(run_dir))

    async def go():
        async with app.run_test(size=size) as pilot:
            await top.first_reading(app, pilot)
            await drive(app, pilot)
    asyncio.run(go())


def test_the_sort_key_puts_the_slowest_compute_first(tmp_path):
    write_run(tmp_path / "run", ranks=RANKS, steps=40, done=20, straggler=STRAGGLER)
    seen = {}

    async def drive(app, pilot):
        await pilot.press("s", "s")           # rank -> step time -> compute
        seen["sort"] = app.sort
        seen["first"] = app.query_one("#ranks").get_row_at(0)[0].plain.strip()
    _headless(tmp_path / "run", drive)
    assert seen == {"sort": "compute", "first": str(STRAGGLER)}


def test_512_ranks_refresh_quickly_and_keep_the_scroll(tmp_path):
    # A refresh updates the rows in place: a table rebuilt (or every column measured again)
    # loses the user's place, and took 85 s at 512 ranks when cells were remeasured.
    run = tmp_path / "run"
    write_run(run, ranks=512, steps=1000, done=300, interval=10, straggler=300, nodes=64)
    seen = {}

    async def drive(app, pilot):
        table = app.query_one("#ranks")
        seen["rows"] = table.row_count
        await pilot.press("pagedown", "pagedown")
        await pilot.pause(0.1)
        seen["scrolled"] = table.scroll_y
        write_run(run, ranks=512, steps=1000, done=310, interval=10, straggler=300, nodes=64)
        started = time.monotonic()
        app.show(top.load_view(str(run)))
        await pilot.pause(0.1)
        seen["seconds"] = time.monotonic() - started
        seen["after"] = table.scroll_y
        seen["step"] = table.get_row_at(0)[2].plain.strip()
    _headless(run, drive)
    assert seen["rows"] == 512 and seen["scrolled"] > 0
    assert seen["after"] == seen["scrolled"] and seen["step"] == "310"
    assert seen["seconds"] < 20, seen


# ---- the live view in a real terminal -----------------------------------------------------

def _plain(line: str) -> str:
    return re.sub(r"\x1b\[[\d;]*m", "", line)


def _reversed(line: str) -> str:
    """The text of a captured line (tmux capture-pane -e) drawn in reverse video."""
    out, reverse = [], False
    for params, text in re.findall(r"\x1b\[([\d;]*)m([^\x1b]*)", "\x1b[m" + line):
        codes = [int(p) if p else 0 for p in params.split(";")]
        i = 0
        while i < len(codes):
            if codes[i] in (38, 48):           # a colour: 38;5;N or 38;2;R;G;B, not attributes
                i += 3 if i + 1 < len(codes) and codes[i + 1] == 5 else 5
                continue
            reverse = {0: False, 7: True, 27: False}.get(codes[i], reverse)
            i += 1
        if reverse:
            out.append(text)
    return "".join(out)


def _wait_for(tmux, predicate, what: str, timeout: float = 60.0, escapes: bool = False) -> str:
    deadline = time.monotonic() + timeout
    screen = ""
    while time.monotonic() < deadline:
        screen = subprocess.run(tmux + ["capture-pane", "-p"] + (["-e"] if escapes else []) + ["-t", "top"],
                                capture_output=True, text=True, timeout=30).stdout
        if predicate(screen):
            return screen
        time.sleep(0.3)
    pytest.fail(f"the screen never showed {what} in {timeout:.0f} s; it showed:\n{screen}")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (tests/run_all.sh installs it)")
def test_live_view_in_tmux(tmp_path):
    run = tmp_path / "run"
    write_run(run, ranks=RANKS, steps=40, done=20, straggler=STRAGGLER)
    # A server of our own (-L): nothing else on the machine is touched, and killing it ends all.
    name = f"ringpipe-top-{uuid.uuid4().hex[:12]}"
    tmux = ["tmux", "-L", name]
    command = (f"{shlex.quote(sys.executable)} -m ringpipe top {shlex.quote(str(run))} --interval 0.5; "
               "echo EXIT=$?; sleep 60")
    # A pytest process's C-level environment holds COLUMNS=80 and LINES=24 (set below Python:
    # os.environ lacks them), which a child inherits and Textual would believe over the pane's
    # size: the server gets os.environ, without them, explicitly.
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    try:
        subprocess.run(tmux + ["new-session", "-d", "-s", "top", "-x", "160", "-y", "50", "-c", ROOT, command],
                       check=True, timeout=30, env=env)
        screen = _wait_for(tmux, lambda s: sorted(_rank_lines(s)) == list(range(RANKS)), "a row for every rank")
        rows = _rank_lines(screen)
        assert "straggler: compute 1.8x" in rows[STRAGGLER], screen
        assert "step 20/40" in screen and "ETA" in screen, screen

        # The straggler's row is drawn in reverse video (SGR 7), the others' are not.
        screen = _wait_for(tmux, lambda s: "straggler:" in s, "the straggler", escapes=True)
        colored = {rank: line for line in screen.splitlines() for rank in _rank_lines(_plain(line))}
        assert sorted(colored) == list(range(RANKS)), screen
        assert "3 n1" in _reversed(colored[STRAGGLER]) and "straggler: compute 1.8x" in _reversed(colored[STRAGGLER])
        assert all(_reversed(colored[r]).strip() == "" for r in colored if r != STRAGGLER), screen

        # The run goes on: five more steps appended to the log are on screen at the next reading.
        later = tmp_path / "later"
        write_run(later, ranks=RANKS, steps=40, done=25, straggler=STRAGGLER)
        new = [line for line in (later / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] > 20]
        assert len(new) == 5
        with open(run / "metrics.jsonl", "a") as fh:
            fh.write("\n".join(new) + "\n")
        screen = _wait_for(tmux, lambda s: "step 25/40" in s and all(" 25 " in line for line in
                                                                     _rank_lines(s).values()), "step 25")
        assert sorted(_rank_lines(screen)) == list(range(RANKS))

        subprocess.run(tmux + ["send-keys", "-t", "top", "q"], check=True, timeout=30)
        _wait_for(tmux, lambda s: "EXIT=" in s, "the program's end", timeout=30)
        screen = _wait_for(tmux, lambda s: "EXIT=" in s, "the exit code", timeout=5)
        assert "EXIT=0" in screen, screen
    finally:
        subprocess.run(tmux + ["kill-server"], capture_output=True, timeout=30)
        socket = os.path.join(os.environ.get("TMUX_TMPDIR", "/tmp"), f"tmux-{os.getuid()}", name)
        if os.path.exists(socket):        # kill-server leaves the socket file behind
            os.remove(socket)


def test_help_explains_the_keys(capsys):
    assert top.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--interval" in out and "--once" in out and "q quit" in out


def test_the_gradient_sync_and_the_parameter_servers_are_named():
    """A run's header says how it synced; dedicated servers count among the job's ranks
    (their completion markers too) and ssp/async are said to change the math."""
    from ringpipe.engine.monitor.read import job_ranks, sync_text
    servers = [{"rank": 2, "node": "n3", "pid": 1}, {"rank": 3, "node": "n4", "pid": 2}]
    header = {"world": 2, "sync": "ps", "ps_mode": "ssp:2", "exact": False, "parameter_servers": servers}
    assert sync_text(header) == "parameter server, 2 dedicated server rank(s), mode ssp:2 (not sync's math)"
    assert job_ranks(header) == 4
    assert sync_text({"sync": "ps", "ps_mode": "sync", "exact": True}) == \
        "parameter server, colocated servers, mode sync"
    assert sync_text({"sync": "allreduce"}) == "all-reduce" and sync_text({}) is None
    assert job_ranks({"world": 3}) == 3 and job_ranks({}) is None
