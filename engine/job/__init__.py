"""The job: what a cluster does to a process and what a process leaves on disk.

    lifecycle.py  signals (stop, requeue, Ctrl-C), the launcher check, the watchdog, per-rank logs
    pulse.py      the watchdog's heartbeat over UDP, outside MPI
    rundir.py     the run directory: its lock, fresh starts, completion markers (`ringpipe finished`)
    checkpoint.py the checkpoint formats and every check before one is used
    sharded.py    the sharded format: each rank's file of pieces (boxes of whole arrays), their reader
    agreement.py  every rank reaches the same verdict before work (agree, agree_on_rank0)
    runtime.py    process settings read before numpy loads (KNOWN_VARIABLES)
    files.py      reading what a user named without trusting it; writing whole or not at all
    errors.py     the errors the engine raises (ConfigError, JobFailure, Diverged)
    array_module.py  numpy or cupy: this rank's device

Import rule (tests/test_architecture.py): never model/, parallel/, train/, interop/, data/.
"""
