"""A heartbeat over the network, outside MPI: which ranks can this rank still hear?

A cut link is a silent hang in every MPI stack (shared/notes: a minute and more,
up to the kernel's TCP retransmission limit): every rank waits in the same
collective and nothing says why. The watchdog (engine/job/lifecycle.py) sees the
stall; this says where it is. Every rank's watchdog thread sends a small UDP
datagram to every other rank each interval and notes when it last heard each
one, so when the job stalls, rank 0 can name the ranks (and nodes) it no longer
hears: unreachable, rather than slow.

    pulse = Pulse(comm)             # collective: the ranks exchange their addresses
    pulse.tick()                    # from the watchdog thread, every interval
    pulse.silent(10.0)              # ranks not heard from for 10 s

Datagrams go to every IPv4 address a rank has besides loopback (and loopback
for ranks on the same host), carry a job token (rank 0's random number) so two
jobs on one node never confuse each other, and cost p-1 datagrams of ~20 bytes
per rank per interval: for large jobs each rank pulses its 16 ring neighbours
on either side instead of everyone.
"""
from __future__ import annotations

import fcntl
import os
import socket
import struct
import time

MAX_PEERS_ALL = 64          # above this many ranks, pulse ring neighbours only
NEIGHBOURS = 16
_SIOCGIFADDR = 0x8915


def local_addresses() -> list[str]:
    """This host's IPv4 addresses (no loopback), from its interfaces."""
    found = []
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        names = []
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for name in names:
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue                     # no IPv4 address on this interface
            address = socket.inet_ntoa(packed[20:24])
            if not address.startswith("127.") and address not in found:
                found.append(address)
    finally:
        probe.close()
    return found


class Pulse:
    def __init__(self, comm):
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.setblocking(False)
        host = socket.gethostname()
        mine = (host, local_addresses(), self.sock.getsockname()[1])
        token = int.from_bytes(os.urandom(4), "little") if self.rank == 0 else None
        table = comm.allgather((mine, token))
        self.token = table[0][1]
        self.hosts = [entry[0][0] for entry in table]
        self.targets: dict[int, list[tuple[str, int]]] = {}
        for r in self._peers():
            other_host, addresses, port = table[r][0]
            via = list(addresses) + (["127.0.0.1"] if other_host == host else [])
            self.targets[r] = [(a, port) for a in via]
        now = time.time()
        self.heard = {r: now for r in self.targets}     # counted from the start: silence since then
        self._message = struct.pack("<4sIi", b"rppl", self.token, self.rank)

    def _peers(self) -> list[int]:
        if self.size <= MAX_PEERS_ALL:
            return [r for r in range(self.size) if r != self.rank]
        near = {(self.rank + d) % self.size for d in range(-NEIGHBOURS, NEIGHBOURS + 1)}
        return sorted(near - {self.rank})

    def tick(self) -> None:
        """Send this interval's datagrams and take in what arrived. Never raises:
        a send that fails (no route: the link is down) is what silence means."""
        for targets in self.targets.values():
            for target in targets:
                try:
                    self.sock.sendto(self._message, target)
                except OSError:
                    pass
        now = time.time()
        while True:
            try:
                data = self.sock.recv(64)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            if len(data) == 12:
                magic, token, sender = struct.unpack("<4sIi", data)
                if magic == b"rppl" and token == self.token and sender in self.heard:
                    self.heard[sender] = now

    def silent(self, older_than: float) -> list[int]:
        now = time.time()
        return sorted(r for r, t in self.heard.items() if now - t > older_than)

    def describe_silent(self, older_than: float) -> str | None:
        """'ranks 2, 3 (on n2)' not heard for older_than seconds, or None."""
        quiet = self.silent(older_than)
        if not quiet:
            return None
        by_host: dict = {}
        for r in quiet:
            by_host.setdefault(self.hosts[r], []).append(r)
        whole = [h for h, rs in by_host.items() if len(rs) == self.hosts.count(h)]
        parts = [f"{', '.join(map(str, rs))} on {h}" for h, rs in by_host.items()]
        text = f"rank(s) {'; '.join(parts)}"
        if whole:
            text += f" (every rank of node(s) {', '.join(whole)}: the link to it is down, or the node is gone)"
        return text

    def close(self) -> None:
        self.sock.close()
