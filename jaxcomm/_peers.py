"""The peer watch: the job ends when another rank's process ends or falls silent.

MPI does not tell a rank that a peer's process died: under a launcher that
does not end the job when one of its processes fails (``srun`` without
``--kill-on-bad-exit``, ``mpiexec`` of MPICH once the process manager is cut
off), the other ranks wait for it forever. So, with the first ``JaxComm``
over all of ``MPI_COMM_WORLD``'s processes, each rank opens a TCP connection
to its right neighbour in the ring of world ranks (and takes its left
neighbour's), over the host's own interface addresses; a thread of the
kernels library (``kernels/peers.cc``) then sends a byte a second on each
and reads what comes back. The kernel closes a dead process's sockets at
once, so a survivor learns of it within milliseconds; a process that exits
says goodbye first, with its exit status (not 0: the job ends); a host cut
off from the network is noticed as silence longer than ``JAXCOMM_TIMEOUT``
(60 s when unset). Nothing is added to any MPI call.

``JAXCOMM_PEER_WATCH=0`` in the environment turns it off.
"""

import os
import socket
import struct
import sys

from mpi4py import MPI

from . import _abort

ENVIRONMENT_VARIABLE = "JAXCOMM_PEER_WATCH"
# Seconds of silence from a peer before it counts as cut off, when the
# watchdog's JAXCOMM_TIMEOUT does not say.
DEFAULT_SILENCE_S = 60.0
# Seconds one connection attempt or handshake may take at start-up.
_CONNECT_S = 5.0
# The greeting each side of a connection sends: the job's key and its world rank.
_HELLO = struct.Struct("!8si")

_started = False


def enabled() -> bool:
    """Whether the peer watch is switched on (``JAXCOMM_PEER_WATCH``, default on)."""
    return _abort.switched_on(ENVIRONMENT_VARIABLE)


def _receive_exactly(sock, count):
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ConnectionError("the connection closed during the handshake")
        data += chunk
    return data


def _connect(addresses, port, hello):
    """A connection to the first of ``addresses`` that takes one on ``port``, greeted; or None."""
    for address in addresses:
        try:
            sock = socket.create_connection((address, port), timeout=_CONNECT_S)
        except OSError:
            continue
        try:
            sock.sendall(hello)
        except OSError:
            sock.close()
            continue
        return sock
    return None


def _candidates(mine, theirs):
    """The addresses to try for a peer: its loopback first when it shares this host's name."""
    host, addresses = theirs
    if host == mine:
        return [a for a in addresses if a.startswith("127.")] + [
            a for a in addresses if not a.startswith("127.")
        ]
    return [a for a in addresses if not a.startswith("127.")]


def _warn(text):
    sys.stderr.write(f"jaxcomm: peer watch: {text} ({ENVIRONMENT_VARIABLE}=0 turns it off)\n")
    sys.stderr.flush()


def start(comm: MPI.Intracomm, kernels) -> None:
    """Connect this rank to its ring neighbours and watch them (collective on ``comm``).

    Once per process, for a ``comm`` whose processes are all of
    ``MPI_COMM_WORLD``'s (a private one: the start-up messages must not meet
    the program's); nothing on one rank.
    """
    global _started
    if _started or not enabled():
        return
    world = MPI.COMM_WORLD
    size = comm.Get_size()
    if size == 1 or size != world.Get_size():
        return
    groups = comm.Get_group(), world.Get_group()
    same_processes = MPI.Group.Compare(*groups) != MPI.UNEQUAL
    for group in groups:
        group.Free()
    if not same_processes:
        return
    _started = True
    rank = comm.Get_rank()
    host = socket.gethostname()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("0.0.0.0", 0))
    listener.listen(8)
    listener.settimeout(_CONNECT_S)
    key = comm.bcast(os.urandom(8) if rank == 0 else None, root=0)
    table = comm.allgather(
        (world.Get_rank(), host, kernels.interface_addresses(), listener.getsockname()[1])
    )
    my_world_rank = table[rank][0]
    hello = _HELLO.pack(key, my_world_rank)
    right, left = table[(rank + 1) % size], table[(rank - 1) % size]
    # Connections complete in the listener's backlog before it accepts them,
    # so every rank connects first, then accepts, then reads the answer.
    outgoing = _connect(_candidates(host, (right[1], right[2])), right[3], hello)
    if outgoing is None:
        _warn(f"rank {my_world_rank} on host {host} cannot reach rank {right[0]} on {right[1]}")
    reached = comm.allgather(outgoing is not None)
    fds, ranks, hosts = [], [], []
    if reached[(rank - 1) % size]:
        incoming = _accept(listener, key, left[0])
        if incoming is None:
            _warn(f"rank {my_world_rank} on host {host} got no connection from rank {left[0]}")
        else:
            fds.append(incoming.detach())
            ranks.append(left[0])
            hosts.append(left[1])
    listener.close()
    if outgoing is not None:
        try:
            outgoing.settimeout(_CONNECT_S)
            answer = _HELLO.unpack(_receive_exactly(outgoing, _HELLO.size))
        except (OSError, ConnectionError):
            answer = None
        if answer != (key, right[0]):
            _warn(f"rank {my_world_rank} on host {host}: no answer from rank {right[0]}")
            outgoing.close()
        else:
            fds.append(outgoing.detach())
            ranks.append(right[0])
            hosts.append(right[1])
    if fds:
        kernels.watch_peers(fds, ranks, hosts, f"rank {my_world_rank} on host {host}")


def _accept(listener, key, expected):
    """The connection of world rank ``expected`` with this job's key, answered; or None."""
    while True:
        try:
            sock, _ = listener.accept()
        except OSError:
            return None
        try:
            sock.settimeout(_CONNECT_S)
            greeting = _HELLO.unpack(_receive_exactly(sock, _HELLO.size))
            if greeting != (key, expected):
                sock.close()
                continue
            sock.sendall(_HELLO.pack(key, MPI.COMM_WORLD.Get_rank()))
            return sock
        except (OSError, ConnectionError):
            sock.close()
