"""`python -m ringpipe.pipeline ...`: the same as `ringpipe pipeline ...`."""
if __name__ == "__main__":
    import sys

    from ringpipe.engine.schedules.__main__ import main

    sys.exit(main(prog="python -m ringpipe.pipeline"))
