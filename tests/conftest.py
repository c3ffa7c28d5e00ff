import shutil
import tempfile

import pytest


@pytest.fixture
def shared_dir():
    """A temp folder every MPI rank of the test agrees on (made by rank 0, broadcast), removed afterwards."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    path = world.bcast(tempfile.mkdtemp(prefix="ringpipe-test-") if world.rank == 0 else None, root=0)
    yield path
    world.Barrier()
    if world.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
