"""One rank fails while the others block in MPI; the abort handler must end
the whole job. Usage: mpiexec -n 2 python crash.py main|thread|context|exit"""
import sys
import threading
import time


from mpi4py import MPI  # noqa: E402

from ringpipe import comm  # noqa: E402

mode = sys.argv[1] if len(sys.argv) > 1 else "main"
world = MPI.COMM_WORLD


def fail():
    if mode == "exit":
        raise SystemExit(f"error: deliberate exit on rank {world.Get_rank()}")
    raise ValueError(f"boom from rank {world.Get_rank()}")


def main():
    world.Barrier()
    if world.Get_rank() == world.Get_size() - 1:
        if mode == "thread":
            threading.Thread(target=fail, name="worker").start()
            time.sleep(60)  # the thread's failure must take us down, not this sleep ending
        else:
            fail()
    # Everyone else waits for a message that never comes: without the abort
    # handler the job hangs here forever.
    world.Barrier()


if mode in ("context", "exit"):
    with comm.abort_on_error():
        main()
else:
    comm.install_abort_handler()
    comm.install_abort_handler()  # idempotent
    main()
