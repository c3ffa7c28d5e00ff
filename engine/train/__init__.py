"""The training program: the command line, Config, assembling a run, the step loop,
reporting and traces. It sits on top: it may import every other engine folder.

    cli.py       flags to Config, errors to messages and exit codes
    config.py    Config (what a run needs, as data), its checks, the memory lower bound
    assemble.py  everything before the first step, in order
    run.py       run(config, world): the step loop, evaluation, checkpoints, the end of a run
    agreement.py what the ranks of a training run must agree on: one config, a usable batch
    evaluation.py validation: loss, bits per byte, a classifier's accuracy, precision, recall
    reporting.py start-up lines, progress, metrics.jsonl
    trace.py     Perfetto traces
"""
