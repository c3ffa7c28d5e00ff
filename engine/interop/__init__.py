"""Interop: Hugging Face folders in and out (hf.py: `ringpipe export`, --init-from hf:; the
Llama family's names and config.json in hf_llama.py; what both share, the folder's files read
and written, in hf_folder.py, which imports neither; config.json's value rules in
hf_values.py) and sampling from a trained model (sample.py: `ringpipe sample`).

Import rule (tests/test_architecture.py): never train/ (the step loop), parallel/ or
schedules/: a checkpoint is read and written on one process.
"""
