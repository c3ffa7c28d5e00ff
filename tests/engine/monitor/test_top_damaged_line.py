"""Issue 34: `ringpipe top` skips a damaged line of metrics.jsonl (the good records around it
still show) and says why, the first one's reason as `ringpipe report` says it: the file, which
line, and the fault. Before, it said only "N damaged line(s) in the log's tail skipped (not
step records)": not which file, which line, nor what was wrong with it."""
import pytest

from ringpipe.engine.monitor import read, top
from tests.support.monitor_fixture import write_run

GOOD = '{"step": %d, "time": %d.0, "loss": 3.0}\n'


def test_top_says_why_it_skipped_a_line_as_report_does(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run, ranks=2, steps=40, done=0)
    (run / "metrics.jsonl").write_text(GOOD % (1, 1) + '{"step": 2, "loss": NaN, \n' + GOOD % (3, 3)
                                       + '{"loss": 1.0}\n' + GOOD % (4, 4))
    view = top.load_view(str(run))
    path = str(run / "metrics.jsonl")
    assert view.error.startswith("2 damaged line(s) in the log's tail skipped"), view.error
    # The first reason, word for word what report refuses the log with.
    assert f"the first: {path} line 2 is not valid JSON" in view.error, view.error
    with pytest.raises(read.ReadError) as refused:
        read.read_records(str(run))
    assert str(refused.value) in view.error, (str(refused.value), view.error)
    assert top.main([str(run), "--once"]) == 2
    captured = capsys.readouterr()
    assert "step 4/40" in captured.out and f"{path} line 2" in captured.err


def test_a_line_in_a_tail_read_is_named_by_its_byte(tmp_path):
    """A live view reads the file's tail, cut after a line's end: the lines' numbers are not
    known there, so a damaged one is named by the byte it starts at, which is exact."""
    run = tmp_path / "run"
    run.mkdir()
    head = "".join(GOOD % (step, step) for step in range(1, 200))
    text = head + '{"step": -1}\n' + GOOD % (200, 200)
    (run / "metrics.jsonl").write_text(text)
    skipped = []
    records = read.tail_records(str(run), max_bytes=200, skipped=skipped)
    assert records[-1]["step"] == 200
    byte = len(head.encode())
    assert skipped == [f"{run / 'metrics.jsonl'}: the line at byte {byte:,} is not a step record (no whole number "
                       '"step" >= 0)'], skipped
    assert text.encode()[byte:].startswith(b'{"step": -1}')
