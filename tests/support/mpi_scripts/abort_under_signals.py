"""One rank fails and, while its abort handler waits for the launcher to read
its report, gets SIGINT after SIGINT (Python's default: KeyboardInterrupt).
The job must still end, not hang with the other ranks waiting in a Barrier.
Usage: mpiexec -n 2 python abort_under_signals.py"""
import os
import signal
import threading
import time


from mpi4py import MPI  # noqa: E402

from ringpipe import comm  # noqa: E402

world = MPI.COMM_WORLD
comm.install_abort_handler()
signal.signal(signal.SIGINT, signal.default_int_handler)   # Ctrl-C raises KeyboardInterrupt
world.Barrier()
if world.Get_rank() == world.Get_size() - 1:
    def keep_interrupting():
        for _ in range(400):                       # every 5 ms for 2 s: lands inside the abort's waits
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.005)
    threading.Thread(target=keep_interrupting, daemon=True).start()
    time.sleep(0.02)
    raise RuntimeError("boom while being interrupted")
world.Barrier()                                    # waits forever unless the job is aborted
print("unreachable: the Barrier returned", flush=True)
