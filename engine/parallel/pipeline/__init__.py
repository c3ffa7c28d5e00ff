"""The pipeline axis: the rank model (stage.py), the MPI executor that steps a schedule
(executor.py), and the partitioner that splits the layers over stages (partition.py).
The schedules themselves are data, planned in engine/schedules/ (no MPI there)."""
