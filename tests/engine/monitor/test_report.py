"""`ringpipe report` (engine/monitor/report.py, svg.py) on made-up runs
(tests/support/monitor_fixture.py): every plot present, the straggler table, a classifier's
confusion matrix, an empty run, an older run without monitor.json, the refusals; and the
file opened in headless Chromium (tests/support/chromium.py): a screenshot that is not
blank, every plot in the rendered DOM, no console message."""
import json
import os
import re
from html.parser import HTMLParser

import pytest

from ringpipe.engine.monitor import report, svg
from tests.support import chromium
from tests.support.monitor_fixture import write_run

STRAGGLER = 3
TEXT_PLOTS = ["loss", "loss-tokens", "bpb", "throughput", "mfu", "step-heatmap", "time-split", "memory"]
CLASSIFIER_PLOTS = ["loss", "loss-tokens", "accuracy", "confusion", "throughput", "mfu", "step-heatmap",
                    "time-split", "memory"]
RANK_PLOTS = ["step-heatmap", "time-split", "memory"]
VOID = {"meta", "br", "img", "input", "link", "hr", "col", "area", "base", "embed", "source", "track", "wbr"}


class Page(HTMLParser):
    """What a test needs of a page: figures by data-plot, the <svg>s in each with their
    <title>, src/href values, notes left where a plot is missing, tags left open."""

    def __init__(self, text: str):
        super().__init__()
        self.figures: dict[str, dict] = {}
        self.links: list[str] = []
        self.missing: list[str] = []
        self.scripts = 0
        self.stack: list[str] = []
        self.unbalanced: list[str] = []
        self._figure = None
        self._in_svg_title = False
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for key in ("src", "href"):
            if key in attrs:
                self.links.append(attrs[key])
        if tag == "script":
            self.scripts += 1
        if tag == "figure" and "data-plot" in attrs:
            self._figure = attrs["data-plot"]
            self.figures[self._figure] = {"svgs": 0, "titles": 0, "text": []}
        if tag == "svg" and self._figure:
            self.figures[self._figure]["svgs"] += 1
        if tag == "title" and self._figure and "svg" in self.stack:
            if self.stack[-1] == "svg":
                self.figures[self._figure]["titles"] += 1
        if "data-missing" in attrs:
            self.missing.append(attrs["data-missing"])
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        for key in ("src", "href"):
            if key in dict(attrs):
                self.links.append(dict(attrs)[key])

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.unbalanced.append(tag)
            return
        self.stack.pop()
        if tag == "figure":
            self._figure = None

    def handle_data(self, data):
        if self._figure and data.strip():
            self.figures[self._figure]["text"].append(data.strip())


def make_report(run, tmp_path, name="report.html", *extra) -> tuple[str, Page]:
    out = tmp_path / name
    assert report.main([str(run), "--out", str(out), *extra]) == 0
    text = out.read_text(encoding="utf-8")
    return text, Page(text)


def check_page(text: str, page: Page) -> None:
    """What every report must be: whole HTML, each plot one <svg> with a <title>, offline."""
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    assert page.stack == [] and page.unbalanced == [], (page.stack, page.unbalanced)
    assert page.scripts == 0
    for name, fig in page.figures.items():
        assert fig["svgs"] == 1 and fig["titles"] == 1, (name, fig)
    # Offline: no external URL in any src or href (in-page anchors only), none anywhere at all.
    assert all(link.startswith("#") for link in page.links), page.links
    assert "http://" not in text and "https://" not in text


# ---- the report's content ------------------------------------------------------------

def test_a_run_with_a_straggler_has_every_plot_and_the_straggler_table(tmp_path):
    run = tmp_path / "run"
    write_run(run, ranks=8, steps=40, interval=5, straggler=STRAGGLER)
    text, page = make_report(run, tmp_path)
    check_page(text, page)
    assert list(page.figures) == TEXT_PLOTS
    assert page.missing == []
    # The straggler table: rank 3 on node n1, named for compute at 1.8x.
    table = re.search(r'<h2 id="stragglers">.*?</table>', text, re.S).group(0)
    rows = re.findall(r"<tr><td>(.*?)</td></tr>", table)
    assert len(rows) == 1
    assert rows[0].split("</td><td>")[:4] == ["3", "n1", "compute", "1.80x"]
    # The summary at the top.
    summary = re.search(r'<h2 id="summary">.*?</table>', text, re.S).group(0)
    for expected in ("gpt2", "dp 8 x pp 1 x tp 1", "8 / 2", "40 / 40", "25.0%", "20 s"):
        assert expected in summary, expected
    # The heat map's straggler row is marked and its cells name the rank.
    assert "rank 3 *" in " ".join(page.figures["step-heatmap"]["text"])
    assert "rank 3 on n1, steps 1-5: compute 540.0 ms a step" in text
    assert "mean over all 8 intervals" in text


def test_a_classifier_run_shows_accuracy_and_its_confusion_matrix(tmp_path):
    run = tmp_path / "run"
    write_run(run, ranks=4, classifier=True)
    text, page = make_report(run, tmp_path)
    check_page(text, page)
    assert list(page.figures) == CLASSIFIER_PLOTS
    assert page.missing == ["bpb"]                  # a classifier writes no bits per byte
    # The matrix's numbers, row by row, written in its cells (the fixture's: 8 on the diagonal).
    numbers = [s for s in page.figures["confusion"]["text"] if s.isdigit()]
    assert numbers[:9] == ["8", "1", "0", "0", "8", "1", "1", "0", "8"]     # then the axis labels
    assert "true 0, predicted 1: 1.0" in text
    table = text[text.index("<th>precision</th>"):]
    assert table.count("88.9%") >= 6                # precision and recall of each of the 3 classes
    assert "examples/s, median" in text


def test_an_empty_run_says_so_and_is_still_a_whole_page(tmp_path):
    run = tmp_path / "run"
    write_run(run, ranks=4, steps=40, done=0)
    assert (run / "metrics.jsonl").read_text() == ""
    text, page = make_report(run, tmp_path)
    check_page(text, page)
    assert page.figures == {}
    assert "No step record yet" in text and page.missing == ["records"]
    assert "0 / 40" in text


def test_an_older_run_without_monitor_json_is_drawn_from_metrics_alone(tmp_path):
    run = tmp_path / "run"
    write_run(run, ranks=4, steps=40, interval=5)
    os.remove(run / "monitor.json")
    # An older run's records: no per-rank sections.
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record in lines:
        for key in ("ranks", "stragglers", "interval_steps"):
            record.pop(key, None)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    text, page = make_report(run, tmp_path)
    check_page(text, page)
    assert list(page.figures) == ["loss", "loss-tokens", "bpb", "throughput", "mfu"]
    assert page.missing == ["monitor.json"] + RANK_PLOTS
    assert "no per-rank section" in text
    assert "estimated as tokens/s x step time (4.1k a step" in text
    assert "not recorded (no monitor.json)" in text


def test_a_resumed_run_is_drawn_as_it_stands_and_no_mfu_is_a_note(tmp_path):
    """A run resumed from a checkpoint writes steps again: the newer records count."""
    run = tmp_path / "run"
    write_run(run, ranks=2, steps=12, interval=4)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    replay = [dict(r, loss=9.0) for r in lines[5:]]            # steps 6..12 again, after a restart
    records = lines[:10] + replay
    for record in records:
        record.pop("mfu")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert [r["step"] for r in report.replayed_out(records)] == list(range(1, 13))
    text, page = make_report(run, tmp_path)
    check_page(text, page)
    assert "mfu" in page.missing and "mfu" not in page.figures
    assert "9.0000 (step 12)" in text


def test_a_long_run_stays_small(tmp_path):
    """20 000 steps, 8 ranks: series thinned to MAX_POINTS, the heat map to MAX_COLUMNS columns."""
    run = tmp_path / "run"
    write_run(run, ranks=8, steps=20000, interval=10, straggler=STRAGGLER, val_every=500)
    text, page = make_report(run, tmp_path)
    check_page(text, page)
    assert list(page.figures) == TEXT_PLOTS
    loss_svg = re.search(r'data-plot="loss".*?</svg>', text, re.S).group(0)
    points = re.search(r'<polyline[^>]*points="([^"]*)"', loss_svg).group(1).split()
    assert len(points) <= svg.MAX_POINTS
    heat = re.search(r'data-plot="step-heatmap".*?</svg>', text, re.S).group(0)
    assert heat.count("<rect") <= 8 * report.MAX_COLUMNS + 20      # the cells and the colour scale's bands
    assert len(text) < 3_000_000


def test_text_from_the_run_is_escaped(tmp_path):
    run = tmp_path / "run"
    write_run(run, ranks=2, steps=10, interval=5, straggler=1)
    header = json.loads((run / "monitor.json").read_text())
    header["model"] = '<script>alert("x")</script>'
    (run / "monitor.json").write_text(json.dumps(header))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        for row in record.get("ranks", []) + record.get("stragglers", []):
            row["node"] = '"><img src=x onerror=alert(1)>'
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text, page = make_report(run, tmp_path)
    check_page(text, page)
    assert "&lt;script&gt;" in text and "<img" not in text


def test_damaged_numbers_are_left_out_not_fatal(tmp_path):
    run = tmp_path / "run"
    write_run(run, ranks=2, steps=10, interval=5)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    records[2]["loss"] = "NaN"
    records[3]["loss"] = None
    records[4]["ranks"] = ["not a rank", {"rank": 0, "compute_ms": "slow"}, {"rank": 1}]
    records[4]["stragglers"] = [{"rank": "three"}, 7]
    records[9]["val_confusion"] = [[1, 2], "row"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text, page = make_report(run, tmp_path)
    check_page(text, page)
    assert "loss" in page.figures and "confusion" in page.missing


def test_svg_primitives():
    assert svg.thin(list(range(10)), list(range(10)), limit=4) == ([0, 3, 6, 9], [0, 3, 6, 9])
    xs, _ = svg.thin(list(range(10001)), list(range(10001)))
    assert len(xs) <= svg.MAX_POINTS and xs[-1] == 10000
    assert svg.nice_ticks(0.13, 0.91) == (0.0, 1.0, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    lo, hi, ticks = svg.log_ticks(0.5, 300)
    assert lo <= 0.5 and hi >= 300 and 1 in ticks and 100 in ticks
    assert svg.fmt(8192) == "8.19k" and svg.fmt(0.25) == "0.25" and svg.fmt_bytes(1.5 * (1 << 30)) == "1.5 GiB"
    assert svg.colour(0) == "#440154" and svg.colour(1) == "#fde725"
    chart = svg.line_chart([svg.Series("a<b", [1, 2, 3], [1.0, None, 3.0])], "step", "loss", "t & u")
    assert chart.count("<polyline") == 2 and "a&lt;b" in chart and "<title>t &amp; u</title>" in chart
    assert "no data" in svg.line_chart([svg.Series("a", [], [])], "step", "loss", "empty")


# ---- what is refused ---------------------------------------------------------------------

def test_help_and_refusals(tmp_path, capsys):
    assert report.main(["--help"]) == 0
    assert "--out FILE.html" in capsys.readouterr().out
    # Not a run directory.
    (tmp_path / "empty").mkdir()
    assert report.main([str(tmp_path / "empty"), "--out", str(tmp_path / "r.html")]) == 2
    assert "not a run directory" in capsys.readouterr().err
    assert report.main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "r.html")]) == 2
    assert "does not exist" in capsys.readouterr().err
    run = tmp_path / "run"
    write_run(run, ranks=2, steps=10, interval=5)
    # --out a folder, or in a folder that does not exist.
    assert report.main([str(run), "--out", str(tmp_path)]) == 2
    assert "is a folder: name the HTML file" in capsys.readouterr().err
    assert report.main([str(run), "--out", str(tmp_path / "no" / "r.html")]) == 2
    assert "create it first" in capsys.readouterr().err
    # Someone's file is left alone, unless --force.
    theirs = tmp_path / "notes.html"
    theirs.write_text("<html>my notes</html>")
    assert report.main([str(run), "--out", str(theirs)]) == 2
    err = capsys.readouterr().err
    assert "not a report ringpipe wrote" in err and "add --force" in err
    assert theirs.read_text() == "<html>my notes</html>"
    assert report.main([str(run), "--out", str(theirs), "--force"]) == 0
    assert report.GENERATOR in theirs.read_text()
    # A report it wrote is replaced without asking; the default --out is RUN_DIR/report.html.
    assert report.main([str(run), "--out", str(theirs)]) == 0
    assert report.main([str(run)]) == 0 and (run / "report.html").exists()
    assert [p for p in os.listdir(tmp_path) if ".tmp-" in p] == []
    # A damaged metrics.jsonl names the file.
    (run / "metrics.jsonl").write_text("not json\n")
    assert report.main([str(run), "--out", str(theirs)]) == 2
    assert "metrics.jsonl line 1 is not valid JSON" in capsys.readouterr().err


def test_the_command_line_routes_to_it(tmp_path, capsys):
    from ringpipe.cli import main as ringpipe
    run = tmp_path / "run"
    write_run(run, ranks=2, steps=10, interval=5)
    with pytest.raises(SystemExit) as stop:
        ringpipe(["report", str(run), "--out", str(tmp_path / "r.html")])
    assert stop.value.code == 0
    assert "wrote" in capsys.readouterr().out


# ---- in a real browser ---------------------------------------------------------------------

def browser_check(browser, html, png) -> set:
    """Open `html` as a reader would: a screenshot that is not blank, no console message;
    the data-plot names in the rendered DOM."""
    from PIL import Image
    shot = chromium.screenshot(browser, html, png)
    assert shot.console == [], shot.console
    assert os.path.getsize(png) > 20_000
    with Image.open(png) as image:
        grey = image.convert("L")
        assert grey.size == (1280, 4000)
        # Not blank: a good share of the pixels are drawn (text, lines, bars), not background.
        drawn = sum(count for value, count in enumerate(grey.histogram()) if value < 200)
        assert drawn > 0.01 * grey.size[0] * grey.size[1], drawn
    dom = chromium.dump_dom(browser, html)
    assert dom.console == [], dom.console
    return set(re.findall(r'<figure data-plot="([a-z-]+)"', dom.stdout))


@pytest.mark.slow
def test_in_headless_chromium(tmp_path):
    browser = chromium.find_chromium()
    run = tmp_path / "run"
    write_run(run, ranks=8, steps=40, interval=5, straggler=STRAGGLER)
    make_report(run, tmp_path, "text.html")
    assert browser_check(browser, tmp_path / "text.html", tmp_path / "text.png") == set(TEXT_PLOTS)
    run = tmp_path / "classifier"
    write_run(run, ranks=4, classifier=True)
    make_report(run, tmp_path, "classifier.html")
    assert browser_check(browser, tmp_path / "classifier.html", tmp_path / "classifier.png") == set(CLASSIFIER_PLOTS)


@pytest.mark.slow
def test_the_browser_check_catches_a_console_error(tmp_path):
    """The check above would see a script error: a broken page put through it fails."""
    browser = chromium.find_chromium()
    page = tmp_path / "broken.html"
    page.write_text("<!DOCTYPE html><html><body><p>x</p><script>undefined_function()</script></body></html>")
    shot = chromium.screenshot(browser, page, tmp_path / "broken.png", height=600)
    assert any("undefined_function is not defined" in line for line in shot.console), shot.console
    with pytest.raises(AssertionError):
        browser_check(browser, page, tmp_path / "broken2.png")
