"""The refusal every part of `ringpipe prepare` raises: a ValueError, so the command
prints it on rank 0 and exits 2 (engine/data/prepare.py main), and a library caller
catches it as bad input."""


class PrepareError(ValueError):
    """Bad input or settings: the message names the file and says what to do."""
