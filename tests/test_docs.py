"""The README is a map and docs/ the reference, and both stay true to the code (issue 22).

- Each command's flag reference (a `| flag | meaning (default) |` table under a named heading of a
  docs page) names every option its `--help` shows, and names no option the command does not
  have: a flag added to the parser without a line in the reference fails here, and so does a
  flag removed from the parser but left in the reference. The options are read from the very
  parser that answers `ringpipe COMMAND --help` (the module ringpipe/cli.py's COMMANDS names),
  in a subprocess, so the command's start-up (signal handlers, thread settings) stays out of
  this test's process.
- README.md is at most README_MAX_LINES lines.
- Every relative link of README.md and docs/*.md leads to a file that exists, and a `#anchor`
  to a heading of that file (GitHub's rule for heading anchors).
- Every file of the repository README.md and docs/*.md name (`engine/data/shards.py`,
  `tests/engine/test_abuse_*.py`, ...) is there: a move leaves no stale path behind.
- The README's commands that are not run (its five commands of your own data, its training
  launches) are ones docs/data.md and docs/training.md run.
"""
import json
import os
import re
import glob
import subprocess
import sys

import pytest

from tests.support import ROOT

README_MAX_LINES = 250
DOCS = os.path.join(ROOT, "docs")

# command -> (the docs page, the heading its flag table sits under)
REFERENCES = {
    "train": ("training.md", "Flags"),
    "prepare": ("data.md", "Flags of `ringpipe prepare`"),
    "sample": ("data.md", "Flags of `ringpipe sample`"),
    "export": ("data.md", "Flags of `ringpipe export`"),
    "pipeline": ("parallelism.md", "Flags of `ringpipe pipeline`"),
    "finished": ("slurm.md", "Flags of `ringpipe finished`"),
}

# Run in a subprocess: the parser that prints `ringpipe COMMAND --help`, caught as it is about
# to print, and its options as JSON: [[option strings], shown in --help?] per option.
HELP_PARSER = r"""
import argparse, json, sys
from importlib import import_module
from ringpipe.cli import COMMANDS

class Shown(Exception):
    pass

def shown(parser, file=None):
    raise Shown(parser)

argparse.ArgumentParser.print_help = shown
command = sys.argv[1]
try:
    import_module(COMMANDS[command][0]).main(["--help"], prog="ringpipe " + command)
except Shown as e:
    print(json.dumps([[a.option_strings, a.help != argparse.SUPPRESS] for a in e.args[0]._actions
                      if a.option_strings and not isinstance(a, argparse._HelpAction)]))
else:
    sys.exit("ringpipe " + command + " --help printed no parser's help")
"""

FLAG = re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
# a path in the repository: one of its top folders, then a name (a glob's * allowed)
REPO_PATH = re.compile(r"(?<![\w./$-])((?:engine|kernels|comm|tests|benchmarks|slurm|ringpipe|docs|\.ci)/[\w./*{},-]*)")


def parser_options(command: str) -> list:
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", HELP_PARSER, command], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"ringpipe {command} --help: no parser found:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def outside_fences(text: str) -> list:
    """The lines of a markdown text that are not inside a fenced code block."""
    kept, fence = [], None
    for line in text.splitlines():
        opening = FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            kept.append(line)
    return kept


def reference_flags(page: str, heading: str) -> set:
    """The flags named in the first column of the flag table under `heading` in docs/page."""
    return flag_table(open(os.path.join(DOCS, page), encoding="utf-8").read(), heading, f"docs/{page}")


def flag_table(text: str, heading: str, where: str) -> set:
    lines = outside_fences(text)
    start = next((i for i, ln in enumerate(lines) if re.fullmatch(rf"#+ {re.escape(heading)}", ln.strip())), None)
    assert start is not None, f"{where}: no heading '{heading}' (the flag reference of tests/test_docs.py)"
    section = []
    for ln in lines[start + 1:]:
        if ln.startswith("#"):
            break
        section.append(ln)
    rows = [ln for ln in section if ln.startswith("|")]
    assert rows and rows[0].replace(" ", "") == "|flag|meaning(default)|", \
        f"{where}, under '{heading}': no `| flag | meaning (default) |` table"
    flags = set()
    for row in rows[2:]:                  # after the header and its --- line
        first_cell = row.split("|")[1]
        for code in re.findall(r"`([^`]*)`", first_cell):
            flags.update(FLAG.findall(code))
    return flags


@pytest.mark.parametrize("command", sorted(REFERENCES))
def test_the_flag_reference_names_every_flag_of_help_and_no_other(command):
    page, heading = REFERENCES[command]
    options = parser_options(command)
    in_help = {flag for strings, shown in options if shown for flag in strings}
    exists = {flag for strings, _ in options for flag in strings}
    named = reference_flags(page, heading)
    missing = sorted(in_help - named)
    assert not missing, (f"ringpipe {command} --help has {missing}, which docs/{page} ('{heading}') "
                         "does not name: add a row to its flag table")
    lingering = sorted(named - exists)
    assert not lingering, (f"docs/{page} ('{heading}') names {lingering}, which ringpipe {command} "
                           "does not have (removed or renamed?): take it out of the flag table")


def test_the_flag_table_parser_reads_a_row_as_written():
    """The first column's flags, a value list's dashes and the meaning column left out."""
    table = ("## Flags of `x`\n\n| flag | meaning (default) |\n| --- | --- |\n"
             "| `--data {stdlib,fashion-mnist} --data-path` | `--not-this` |\n"
             "| `--keep-best` / `--no-keep-best`, `-s` | x |\n## Next\n\n| flag | meaning (default) |\n"
             "| --- | --- |\n| `--other` | x |\n")
    assert flag_table(table, "Flags of `x`", "x.md") == {"--data", "--data-path", "--keep-best", "--no-keep-best", "-s"}


def test_the_readme_is_a_map():
    lines = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, over {README_MAX_LINES}: it is a map (what ringpipe is, "
        "the quick start, the folders, the headline figures, links); move the reference to docs/")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, punctuation removed
    (letters, digits, `_` and `-` kept), each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: str) -> set:
    seen, found = {}, set()
    for line in outside_fences(open(path, encoding="utf-8").read()):
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = github_anchor(heading.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def test_github_anchors_as_github_writes_them():
    assert github_anchor("Your data, your model: prepare → train → sample → export") == \
        "your-data-your-model-prepare--train--sample--export"
    assert github_anchor("`make train`, measured") == "make-train-measured"
    assert github_anchor("Using your cluster's MPI") == "using-your-clusters-mpi"


def markdown_pages() -> list:
    return [os.path.join(ROOT, "README.md")] + sorted(
        os.path.join(DOCS, n) for n in os.listdir(DOCS) if n.endswith(".md"))


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda p: os.path.relpath(p, ROOT))
def test_every_relative_link_leads_somewhere(page):
    broken = []
    for line in outside_fences(open(page, encoding="utf-8").read()):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"[a-z][\w+.-]*:", target):          # https:, mailto:: not ours to check
                continue
            path, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(dest):
                broken.append(f"{target} (no file {os.path.relpath(dest, ROOT)})")
            elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                broken.append(f"{target} (no heading of {os.path.relpath(dest, ROOT)} has the anchor #{anchor})")
    assert not broken, f"{os.path.relpath(page, ROOT)}: links that lead nowhere: {broken}"


def test_the_readmes_commands_are_the_ones_the_docs_run():
    """A README block marked `skip (docs/PAGE.md runs these same commands ...)` is not run: each
    of its commands must be one that docs/PAGE.md runs (its five commands of your own data,
    its training launches)."""
    from tests.test_examples import fenced_blocks
    shown_by = {}
    for block in fenced_blocks(os.path.join(ROOT, "README.md")):
        page = re.match(r"skip \(docs/([\w.-]+\.md) runs these same commands", block.marker or "")
        if page:
            shown_by.setdefault(page.group(1), []).append(block)
    assert {"data.md", "training.md"} <= set(shown_by), sorted(shown_by)
    for page, blocks in shown_by.items():
        runs = {c for b in fenced_blocks(os.path.join(DOCS, page)) if b.language in ("bash", "console")
                and not (b.marker or "").startswith("skip") for c in b.commands()}
        ours = [c for b in blocks for c in b.commands() if c.startswith(("ringpipe", "mpiexec"))]
        differ = [c for c in ours if c not in runs]
        assert not differ, f"README.md shows {differ}, which docs/{page} does not run (the README's block is not run)"


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda p: os.path.relpath(p, ROOT))
def test_every_repository_path_named_exists(page):
    gone = []
    for path in REPO_PATH.findall(open(page, encoding="utf-8").read()):
        path = path.rstrip(".,:")
        if "{" not in path and not glob.glob(os.path.join(ROOT, path)):      # tests/{kernels,comm}: a list
            gone.append(path)
    assert not gone, (f"{os.path.relpath(page, ROOT)} names {sorted(set(gone))}, which the repository does "
                      "not hold (moved or renamed?): name where it is now")
