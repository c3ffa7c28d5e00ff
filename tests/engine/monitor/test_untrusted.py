"""The monitoring tools read files they cannot trust (engine/monitor/read.py, confusion.py,
engine/job/files.py), and write only where they may (top --screenshot, report --out, the
Prometheus text file in sinks.py):

  - an integer of thousands of digits, a value nested hundreds deep, numbers no run writes
    (1.7e308, 1e-320) and fields of the wrong type in metrics.jsonl, monitor.json or a
    completion marker: a damaged record said or left out, never a traceback;
  - --screenshot and --out into a missing folder, a folder, a place that takes no file, or
    over someone else's file: exit 2 before any work, nothing of theirs touched;
  - --metrics-textfile over another exporter's file (or another run's): refused, left alone;
    a run of the same run directory replaces its own;
  - a newest record longer than the live view's tail is read back to, and a classifier's
    confusion matrix is a file of its own, not a part of its records.

Every run directory here is written by hand (tests/support/monitor_fixture.py); nothing trains.
"""
import json
import os
import threading

import pytest

from ringpipe.engine.job import files, rundir
from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.monitor import confusion, read, report, sinks, svg, top
from tests.support.monitor_fixture import write_run

BIG = "9" * 5000                         # past Python's int() limit (4,300 digits): a ValueError of its own
LONG = "9" * 400                         # an int float() cannot take (OverflowError)
DEEP = "[" * 100_000 + "]" * 100_000      # past the parser's recursion
SHALLOWER = "[" * 900 + "]" * 900         # parses, and still too deep to print safely


def run_with(tmp_path, *, line=None, header=None, ranks=2, steps=10):
    """A sound run of `steps` steps; `line` appended to its metrics.jsonl, `header` (raw JSON
    text per key) put into its monitor.json."""
    run = tmp_path / "run"
    write_run(run, ranks=ranks, steps=steps)
    if line is not None:
        with open(run / "metrics.jsonl", "a") as fh:
            fh.write(line + "\n")
    if header:
        text = (run / "monitor.json").read_text().rstrip()[:-1]
        (run / "monitor.json").write_text(text + "".join(f', "{k}": {v}' for k, v in header.items()) + "}")
    return run


# ---- JSON no run writes --------------------------------------------------------------------

@pytest.mark.parametrize("line, says", [
    ('{"step": 11, "loss": %s}' % BIG, "line 11 holds an integer of 5,000 digits"),
    ('{"step": %s, "loss": 1.0}' % BIG, "line 11 holds an integer of 5,000 digits"),
    ('{"step": 11, "loss": %s, "time": %s}' % (LONG, LONG), "line 11 holds an integer of 400 digits"),
    ('{"step": 11, "loss": %s}' % DEEP, "line 11 is not valid JSON: it is nested too deeply"),
    ('{"step": 11, "ranks": [{"rank": 0, "node": %s}]}' % SHALLOWER, "line 11 nests lists or objects more than"),
], ids=["int-5000-digits", "step-5000-digits", "int-400-digits", "nested-100000", "nested-900"])
def test_a_hostile_record_is_a_damaged_line_not_a_traceback(tmp_path, capsys, line, says):
    run = run_with(tmp_path, line=line)
    # top: the good records around it still show; the damage is said (exit 2 with --once).
    assert top.main([str(run), "--once"]) == 2
    captured = capsys.readouterr()
    assert "step 10/10" in captured.out and "1 damaged line(s)" in captured.err
    # report reads every line: it refuses the log, naming the line and why.
    assert report.main([str(run), "--out", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert says in err and "metrics.jsonl" in err and "Traceback" not in err
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("key, value, says", [
    ("x", BIG, "holds an integer of 5,000 digits"),
    ("steps", LONG, "holds an integer of 400 digits"),
    ("model", DEEP, "nested too deeply"),
    ("model", SHALLOWER, "nests lists or objects more than"),
], ids=["int-5000-digits", "steps-400-digits", "nested-100000", "nested-900"])
def test_a_hostile_monitor_json_is_refused_naming_it(tmp_path, capsys, key, value, says):
    run = run_with(tmp_path, header={key: value})
    for main, args in ((top.main, ["--once"]), (report.main, ["--out", str(tmp_path / "r.html")])):
        assert main([str(run), *args]) == 2
        err = capsys.readouterr().err
        assert says in err and "monitor.json" in err, err


def test_a_completion_marker_of_5000_digits_is_named_not_a_traceback(tmp_path):
    run = run_with(tmp_path)
    os.makedirs(run / "finished")
    (run / "finished" / "rank0.json").write_text('{"rank": 0, "ranks": 2, "step": %s}' % BIG)
    with pytest.raises(rundir.FinishedError, match="rank0.json holds an integer longer than Python converts"):
        rundir.finished(str(run))
    assert "completion markers unreadable" in top.load_view(str(run)).state


def test_parse_json_bounds_are_refusals_naming_the_file():
    with pytest.raises(files.UnreadableFile, match="^the thing holds an integer longer than Python converts"):
        files.parse_json('{"a": %s}' % BIG, "the thing")
    with pytest.raises(files.UnreadableFile, match="^the thing holds an integer of 20 digits, more than the 19"):
        files.parse_json('[1, -%s]' % ("9" * 20), "the thing", max_int_digits=19)
    assert files.parse_json('[-%s]' % ("9" * 19), "the thing", max_int_digits=19) == [-int("9" * 19)]
    with pytest.raises(files.UnreadableFile, match="^the thing nests lists or objects more than 3 deep"):
        files.parse_json('{"a": [{"b": [1]}]}', "the thing", max_depth=3)
    assert files.parse_json('{"a": [{"b": 1}], "c": "[[[[[[[["}', "the thing", max_depth=3)["c"] == "[" * 8


def test_numbers_and_types_no_run_writes_are_left_out_not_fatal(tmp_path, capsys):
    """Finite but absurd numbers (their spans, products and powers of ten overflow a float),
    subnormal ones (a log axis's ticks underflow), and fields of the wrong type: the view and
    the report are drawn without them."""
    run = tmp_path / "run"
    write_run(run, ranks=3, steps=12, interval=3, straggler=1)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for i, record in enumerate(lines):
        record.update(time=1.7e308 * (-1) ** i, step_ms=1.7e308, loss=1e-320 if i % 2 else 1.0,
                      tokens_per_s=-1.7e308, mfu=9999999999999999999, stragglers=5 if i % 2 else "x")
        for row in record.get("ranks", []):
            row.update(node=[1], compute_ms=1.7e308, rss_bytes=-1.7e308)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    header = json.loads((run / "monitor.json").read_text())
    header.update(ranks=[{"node": [1]}, {"node": {"a": 1}}, 5], steps=9999999999999999999, items_per_step=1.7e308)
    (run / "monitor.json").write_text(json.dumps(header))
    assert top.main([str(run), "--once"]) == 0
    assert "step 12/" in capsys.readouterr().out
    assert report.main([str(run), "--out", str(tmp_path / "r.html")]) == 0
    assert "<svg" in (tmp_path / "r.html").read_text()


def test_the_axes_of_extreme_and_tiny_numbers_are_drawn():
    assert svg.nice_ticks(-1e30, 1e30)[2][0] <= -1e30
    assert svg.nice_ticks(1e-20, 2e-20)[2] == pytest.approx([1e-20, 1.2e-20, 1.4e-20, 1.6e-20, 1.8e-20, 2e-20])
    assert svg.log_ticks(1.0, 1.0)[:2] == (1.0, 2.0)          # one value on a tick: up to the next
    assert not svg.finite(1.7e308) and not svg.finite(10 ** 400) and svg.finite(-1e30)
    assert "no data" in svg.line_chart([svg.Series("a", [1, 2], [1e-320, 0.0])], "x", "y", "t", log_y=True)


# ---- where the tools write -----------------------------------------------------------------

def _screenshot_refused(tmp_path, capsys, path, says):
    run = run_with(tmp_path)
    assert top.main([str(run), "--screenshot", str(path)]) == 2
    err = capsys.readouterr().err
    assert says in err and str(path) in err and "Traceback" not in err, err


def test_a_screenshot_into_a_missing_folder_is_refused(tmp_path, capsys):
    missing = tmp_path / "missing" / "x.svg"
    _screenshot_refused(tmp_path, capsys, missing, f"mkdir -p {tmp_path / 'missing'}")
    assert not missing.parent.exists()


def test_a_screenshot_into_a_folder_or_where_no_file_can_be_made_is_refused(tmp_path, capsys):
    os.makedirs(tmp_path / "pictures.svg")
    _screenshot_refused(tmp_path, capsys, tmp_path / "pictures.svg", "is a folder")
    _screenshot_refused(tmp_path, capsys, "/proc/self/x.svg", "no file can be written in /proc/self")


def test_a_screenshot_over_someone_elses_file_leaves_it_alone(tmp_path, capsys):
    theirs = tmp_path / "theirs.svg"
    theirs.write_text("<svg>my diagram</svg>")
    _screenshot_refused(tmp_path, capsys, theirs, "not a screenshot ringpipe top wrote")
    assert theirs.read_text() == "<svg>my diagram</svg>"


def test_a_screenshot_replaces_its_own(tmp_path, capsys):
    pytest.importorskip("textual")
    run, shot = run_with(tmp_path), tmp_path / "top.svg"
    for _ in range(2):                                       # the second replaces the first
        assert top.main([str(run), "--screenshot", str(shot), "--size", "100x12"]) == 0
    text = shot.read_text()
    assert text.startswith(top.SCREENSHOT_MARK + "\n<svg") and "</svg>" in text
    assert [p for p in os.listdir(tmp_path) if ".tmp-" in p] == []


def test_a_report_where_no_file_can_be_made_is_refused_before_it_is_drawn(tmp_path, capsys, monkeypatch):
    run = run_with(tmp_path)
    monkeypatch.setattr(report, "render", lambda *a, **k: pytest.fail("drawn before --out was checked"))
    assert report.main([str(run), "--out", "/proc/self/x.html"]) == 2
    assert "no file can be written in /proc/self" in capsys.readouterr().err


# ---- the Prometheus text file ----------------------------------------------------------------

def test_another_exporters_text_file_is_refused_and_left_alone(tmp_path):
    prom = tmp_path / "node.prom"
    prom.write_text("# HELP node_thing x\nnode_thing 1\n")
    with pytest.raises(ConfigError, match="node.prom exists and is not a file ringpipe wrote"):
        sinks.check_textfile(str(prom), str(tmp_path / "run"))
    assert prom.read_text() == "# HELP node_thing x\nnode_thing 1\n"


def test_another_runs_text_file_is_refused_and_its_own_is_replaced(tmp_path):
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families
    prom, mine, other = tmp_path / "x.prom", str(tmp_path / "mine"), str(tmp_path / "other")
    sinks.check_textfile(str(prom), mine)                        # none yet: may be written
    sink = sinks.PrometheusSink("job", str(prom), None, "127.0.0.1", mine)
    sink.write({"step": 3, "loss": 2.5, "ranks": [{"rank": 0, "node": "n1", "step_ms": 10.0}]})
    text = prom.read_text()
    assert text.startswith(sinks.textfile_header(mine)) and json.dumps(os.path.realpath(mine)) in text
    found = {f.name: f for f in text_string_to_metric_families(text)}     # the first line is a comment
    assert found["ringpipe_step"].samples[0].value == 3
    sinks.check_textfile(str(prom), mine)                        # a resumed run of the same directory
    with pytest.raises(ConfigError, match="holds the metrics of another ringpipe run"):
        sinks.check_textfile(str(prom), other)
    assert prom.read_text() == text


def test_a_text_file_put_there_during_the_run_stops_the_sink_not_the_run(tmp_path):
    pytest.importorskip("prometheus_client")
    prom = tmp_path / "x.prom"
    sink = sinks.PrometheusSink("job", str(prom), None, "127.0.0.1", str(tmp_path))
    prom.write_text("theirs\n")
    with pytest.raises(ConfigError, match="not a file ringpipe wrote"):
        sink.write({"step": 1, "ranks": [{"rank": 0, "node": "n1"}]})
    assert prom.read_text() == "theirs\n"


def test_a_link_or_a_fifo_as_the_text_file_is_refused_at_once(tmp_path):
    target = tmp_path / "target.prom"
    target.write_text("theirs\n")
    os.symlink(target, tmp_path / "link.prom")
    with pytest.raises(ConfigError, match="is a symbolic link"):
        sinks.check_textfile(str(tmp_path / "link.prom"), str(tmp_path))
    os.mkfifo(tmp_path / "fifo.prom")
    result = []
    checker = threading.Thread(target=lambda: result.append(_refusal(tmp_path / "fifo.prom", tmp_path)), daemon=True)
    checker.start()
    checker.join(timeout=30)
    assert result and "named pipe" in result[0]


def _refusal(path, out_dir) -> str:
    try:
        sinks.check_textfile(str(path), str(out_dir))
    except ConfigError as e:
        return str(e)
    return ""


# ---- a record longer than the live view's tail; the confusion matrix's own file ---------------

def test_a_newest_record_longer_than_the_tail_is_read_back_to(tmp_path):
    run = run_with(tmp_path, line=json.dumps({"step": 11, "loss": 0.5, "junk": "x" * (3 * read.TAIL_BYTES)}))
    view = top.load_view(str(run))
    assert not view.error and "waiting" not in view.note and "step 11/10" in view.facts, view


def test_a_newest_record_past_the_bound_is_said_not_waited_for(tmp_path, monkeypatch):
    monkeypatch.setattr(read, "TAIL_LIMIT", 2 * read.TAIL_BYTES)
    run = run_with(tmp_path, line=json.dumps({"step": 11, "junk": "x" * (3 * read.TAIL_BYTES)}))
    view = top.load_view(str(run))
    assert "newest record is longer than" in view.error and "waiting" not in view.note


def _classifier_run(tmp_path):
    """A classifier's run as ringpipe writes it now: the matrix in OUT/val_confusion.json."""
    run = tmp_path / "run"
    write_run(run, ranks=2, steps=20, classifier=True)
    kept = [confusion.split_off(json.loads(line), str(run)) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    return run, kept


def test_the_confusion_matrix_is_a_file_of_its_own_and_the_report_reads_it(tmp_path):
    run, kept = _classifier_run(tmp_path)
    assert not any(confusion.KEY in r for r in kept) and any("val_accuracy" in r for r in kept)
    found = confusion.read_confusion(str(run))
    assert found["step"] == 20 and len(found[confusion.KEY]) == 3
    assert report.main([str(run), "--out", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert 'data-plot="confusion"' in page and "Confusion matrix at step 20" in page


def test_a_damaged_confusion_file_is_a_note_the_report_is_still_written(tmp_path):
    run, _ = _classifier_run(tmp_path)
    (run / confusion.NAME).write_text('{"format": "ringpipe-val-confusion", "step": 20, "val_confusion": %s}' % BIG)
    assert report.main([str(run), "--out", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert 'data-missing="confusion"' in page and "val_confusion.json holds an integer of 5,000 digits" in page


def test_tensorboards_confusion_table_is_bounded():
    assert sinks.confusion_table([[1, 0], [0, 1]]).count("\n") == 4
    big = sinks.confusion_table([[0] * 3000 for _ in range(3000)])
    assert len(big) < 300 and "3000 classes" in big and confusion.NAME in big
