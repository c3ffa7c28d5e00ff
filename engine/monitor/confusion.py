"""A classifier's confusion matrix: a file of its own, OUT/val_confusion.json, not a part of
the validation's record in metrics.jsonl.

The matrix is n_classes x n_classes counts: 18 MB of JSON for 3,000 classes. Inside the
record it made that line longer than the tail `ringpipe top` reads (the view said "waiting
for the run to write metrics.jsonl" for good), and every tool read it again at each refresh.
The record keeps the small numbers (val_accuracy, val_precision, val_recall); the file holds
the newest validation's matrix and its step, replaced whole (temp file, rename) at each one.

    record_for_log = split_off(record, out_dir)   # rank 0, before the record is written
    found = read_confusion(run_dir)               # {"step": N, "val_confusion": rows} or None

Import rule: engine/monitor's (job/ only).
"""
from __future__ import annotations

import json
import os

from ringpipe.engine.job.files import UnreadableFile, read_json, write_text_atomic
from ringpipe.engine.job.rundir import RunDirError, describe_write_error
from ringpipe.engine.monitor.read import MAX_DEPTH, MAX_INT_DIGITS, ReadError

NAME = "val_confusion.json"
FORMAT = "ringpipe-val-confusion"
KEY = "val_confusion"
# The file of 10,000 classes of 7-digit counts is about 800 MB; larger is not one ringpipe wrote.
READ_LIMIT = 1 << 30


def path_of(run_dir: str) -> str:
    return os.path.join(run_dir, NAME)


def split_off(record: dict, out_dir: str) -> dict:
    """The record as metrics.jsonl keeps it: without the confusion matrix, which is written to
    OUT/val_confusion.json first (with the record's step). A record without one is returned
    as it is. Raises RunDirError, as the metrics log does, when the file cannot be written."""
    if KEY not in record:
        return record
    path = path_of(out_dir)
    text = json.dumps({"format": FORMAT, "version": 1, "step": record["step"], KEY: record[KEY]})
    try:
        write_text_atomic(path, text + "\n")
    except OSError as e:
        raise RunDirError(describe_write_error(e, out_dir, f"the confusion matrix of step {record['step']}")) from None
    return {key: value for key, value in record.items() if key != KEY}


def read_confusion(run_dir: str) -> dict | None:
    """{"step": N, "val_confusion": rows} of the run's newest validation, or None when the run
    wrote none (not a classifier, no validation yet, or an older run: its records hold the
    matrix). ReadError, naming the file, when it is damaged or not one ringpipe wrote."""
    path = path_of(run_dir)
    if not os.path.lexists(path):
        return None
    try:
        found = read_json(path, "the confusion matrix", READ_LIMIT, max_depth=MAX_DEPTH,
                          max_int_digits=MAX_INT_DIGITS)
    except UnreadableFile as e:
        raise ReadError(f"{e}; the run's next validation writes it again") from None
    if not isinstance(found, dict) or found.get("format") != FORMAT:
        raise ReadError(f"{path} is not a confusion matrix ringpipe wrote (no \"format\": \"{FORMAT}\")")
    step, rows = found.get("step"), found.get(KEY)
    if type(step) is not int or step < 0 or not isinstance(rows, list) or \
            not all(isinstance(row, list) for row in rows):
        raise ReadError(f"{path} holds no whole-number \"step\" and rows of counts under \"{KEY}\": it is damaged")
    return {"step": step, KEY: rows}
