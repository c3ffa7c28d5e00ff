"""Interop: Hugging Face folders in and out (hf.py: `ringpipe export`, --init-from hf:) and
sampling from a trained GPT (sample.py: `ringpipe sample`).

Import rule (tests/test_architecture.py): never train/ (the step loop), parallel/ or
schedules/: a checkpoint is read and written on one process.
"""
