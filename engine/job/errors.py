"""The errors the engine raises on purpose (never SystemExit: that is the CLI's).

    ConfigError   a setting (or a combination) that cannot work; refused before any work
    JobFailure    a failure at run time that every rank has agreed on (a full disk, ...)
    Diverged      a NaN/inf loss, gradient norm or weight; stopped before the update

Both are raised alike on every rank (engine/job/agreement.py sees to that), so a
caller can stop cleanly on all of them without an MPI abort. The command line
(engine/train/cli.py) turns them into messages and exit codes: 2, 1 and 2.
"""
from __future__ import annotations

import re

# A setting's name inside a message, as <name>: the Config field ("batch_size")
# in the library, the flag ("--batch-size") on the command line.
_NAME = re.compile(r"<([a-z][a-z0-9_]*)>")


class ConfigError(ValueError):
    """A refused configuration. The message names settings as <field>; str()
    shows the field names, `render(name_of)` any other spelling."""

    def __init__(self, message: str):
        self.message = message
        super().__init__(self.render(lambda field: field))

    def render(self, name_of) -> str:
        return spell(self.message, name_of)


def spell(text: str, name_of) -> str:
    """`text` with each <field> spelled name_of(field); a <word> that name_of
    does not know (returns None for) is left as it is."""
    return _NAME.sub(lambda m: name_of(m.group(1)) or m.group(0), text)


class JobFailure(RuntimeError):
    """A failure every rank has agreed on (a checkpoint that could not be written,
    a rank that could not write its metrics): each rank raises it alike."""


class Diverged(RuntimeError):
    """A NaN or inf loss, gradient norm or weight: training stopped before the
    update, and nothing poisoned was saved. Raised alike on every rank (the
    values it is decided on are the same everywhere)."""
