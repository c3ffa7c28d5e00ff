"""Watching a job: what each rank measures, what rank 0 writes, and the tools that read it.

    clock.py      StepClock: a rank's step time split into compute, exposed communication,
                  pipeline bubble and data wait (the layers' and the loop's timed spans)
    probes.py     this process's and node's resources: resident and peak memory, CPU time,
                  network bytes (/proc), the GPU's utilisation and memory (NVML, when present)
    ranks.py      RankMonitor: every N steps one small gather brings every rank's numbers to
                  rank 0; stragglers named; the per-rank section of metrics.jsonl
    sinks.py      where rank 0 sends the numbers besides metrics.jsonl: TensorBoard event
                  files, a Prometheus text file (node_exporter) or port
    jobstats.py   the job summary at the end of a run (per node CPU, memory, time split,
                  efficiency) and Slurm's accounting of the job (sacct), where it exists
    read.py       reading a run directory's monitor.json and metrics.jsonl (for the tools)
    confusion.py  a classifier's confusion matrix: OUT/val_confusion.json, not a part of the record
    top.py        `ringpipe top RUN_DIR`: a live terminal view of a running job
    report.py     `ringpipe report RUN_DIR --out FILE.html`: one self-contained HTML report
    svg.py        the report's plots, drawn as inline SVG (no plotting library, no script)

The file formats are in docs/monitoring.md.

Import rule (tests/test_architecture.py): job/ and comm only; never model/, parallel/,
schedules/, data/, train/, interop/. The trainer (train/) hands the monitor plain numbers
and timed spans; the tools read files only, so they run on a login node without MPI.
"""
