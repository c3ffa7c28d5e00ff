"""A dedicated parameter server that raises in the middle of training: the trainer's
own main (`ringpipe train`), with the server's control-message read wrapped so that,
once the file TRIGGER exists, the next STEP it receives raises inside serve()'s loop.
The abort handler must then end the whole job, naming the server's rank.
Usage: mpiexec -n 3 python ps_server_fails.py TRIGGER <ringpipe train flags, --sync ps --ps-servers 1 ...>"""
import os
import sys

from ringpipe.engine.parallel import ps
from ringpipe.engine.train.cli import main

trigger = sys.argv[1]
receive = ps.ServerLink.receive


def receive_then_fail(link):
    kind, a, b = receive(link)
    if link.is_server and kind == ps.STEP and os.path.exists(trigger):
        raise RuntimeError(f"deliberate failure of the parameter server at update {a} "
                           f"(tests/support/mpi_scripts/ps_server_fails.py)")
    return kind, a, b


ps.ServerLink.receive = receive_then_fail
main(sys.argv[2:])
