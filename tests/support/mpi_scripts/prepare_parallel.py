"""prepare() as a library under MPI, on a communicator of the caller's own (a Dup of
COMM_WORLD): every rank must return the same manifest; rank 0 prints it as JSON.

Usage: mpiexec -n N python prepare_parallel.py OUT TOKENIZER INPUT..."""
import json
import sys

from mpi4py import MPI

from ringpipe import comm
from ringpipe.engine.data.prepare import prepare

comm.install_abort_handler()          # a bug on one rank must end the job, not hang the test
out, tokenizer, inputs = sys.argv[1], sys.argv[2], sys.argv[3:]
world = MPI.COMM_WORLD.Dup()
manifest = prepare(inputs, out, tokenizer=tokenizer, world=world, progress=False, tokens_per_shard=300)
everyone = world.allgather(manifest)
assert all(m == everyone[0] for m in everyone), "the ranks returned different manifests"
if world.Get_rank() == 0:
    print(json.dumps(manifest))
world.Free()
