"""`python -m ringpipe.train ...`: the same as `ringpipe train ...`."""
if __name__ == "__main__":
    from ringpipe.engine.job import runtime

    runtime.catch_stop_signals_early()   # imports and MPI_Init take seconds: keep signals meanwhile
    from ringpipe.engine.train.cli import main

    main()
