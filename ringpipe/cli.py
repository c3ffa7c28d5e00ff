"""The `ringpipe` command: one entry point, a subcommand per job.

    ringpipe prepare ...     tokenize text (txt, jsonl, parquet) into token shards for training
    ringpipe train ...       train a model (= python -m ringpipe.train; ringpipe-train)
    ringpipe sample ...      generate text from a trained GPT or Llama
    ringpipe export ...      write a trained GPT or Llama as a Hugging Face model folder
    ringpipe pipeline ...    print, validate and simulate a pipeline schedule (= python -m ringpipe.pipeline)
    ringpipe finished RUN    did every rank finish? exit 0 yes, 1 no, 2 cannot tell (batch scripts: not the launcher's code)
    ringpipe top RUN         a live view of a running job, every rank a row (from a login node)
    ringpipe report RUN --out FILE.html   one self-contained HTML report of a run
"""
from __future__ import annotations

import os
import sys

COMMANDS = {
    "prepare": ("ringpipe.engine.data.prepare", "tokenize text files (txt, jsonl, parquet) into token shards"),
    "train": ("ringpipe.engine.train.cli", "train a GPT, Llama-family model or MLP on one or many MPI ranks"),
    "sample": ("ringpipe.engine.interop.sample", "generate text from a trained GPT or Llama (a run directory or checkpoint)"),
    "export": ("ringpipe.engine.interop.hf", "write a trained GPT or Llama as a Hugging Face folder (transformers loads it)"),
    "pipeline": ("ringpipe.engine.schedules.__main__", "print, validate and simulate a pipeline schedule"),
    "finished": ("ringpipe.engine.job.rundir", "did every rank of a run finish? (check it, not the launcher's exit code)"),
    "top": ("ringpipe.engine.monitor.top", "a live view of a running job: every rank's step time, time split, memory"),
    "report": ("ringpipe.engine.monitor.report", "one self-contained HTML report of a run: loss, speed, every rank"),
}

COLLECTIVE_TOOLS = {"prepare"}       # train handles its own signals (a stop is a checkpoint)


def usage() -> str:
    lines = ["usage: ringpipe COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {about}" for name, (_, about) in COMMANDS.items()]
    lines += ["", "`ringpipe COMMAND --help` explains each one."]
    return "\n".join(lines)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        try:
            print(usage(), flush=True)
        except BrokenPipeError:          # `ringpipe --help | head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"ringpipe: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        sys.exit(2)
    if name in COLLECTIVE_TOOLS:
        # Its ranks meet in collectives: a signal during start-up is held until the tool can
        # end the whole job on it (engine/job/lifecycle.py, hold_signals).
        from ringpipe.engine.job.lifecycle import hold_signals
        hold_signals()
    from importlib import import_module
    sys.exit(import_module(COMMANDS[name][0]).main(rest, prog=f"ringpipe {name}") or 0)


if __name__ == "__main__":
    main()
