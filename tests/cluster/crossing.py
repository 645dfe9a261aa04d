"""A jitted ring of sendrecvs across the cluster's hosts (tests/cluster/cluster.sh).

Run on every rank by a launcher; ranks are placed in blocks (ranks of a host
are consecutive), so the ring's edge from rank r to r + 1 stays on a host or
crosses to the next one. Rank 0 prints one line ``crossing: {json}`` with
the hosts, the edges that cross between hosts and the bytes sent over them,
for check_network.py to compare with the interfaces' byte counters.

Usage: crossing.py MIB STEPS [PROGRESS_FILE]. STEPS is a count, or seconds
with an ``s`` (rank 0 decides when to stop). With a progress file, rank 0
appends ``step T`` (the time) after each step, so a caller can see that the
steps stop while a host's link is down.
"""

import json
import socket
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from jaxcomm import JaxComm

mib, steps = int(sys.argv[1]), sys.argv[2]
progress = open(sys.argv[3], "a") if len(sys.argv) > 3 else None  # noqa: SIM115 - open for the run
jc = JaxComm(MPI.COMM_WORLD)
rank, size = jc.rank, jc.size
hosts = jc.comm.allgather(socket.gethostname())
x = jnp.full(mib << 18, float(rank), jnp.float32)  # mib MiB of float32
ring = jax.jit(lambda x: jc.sendrecv(x, x, source=(rank - 1) % size, dest=(rank + 1) % size))
expected = np.full(x.shape, (rank - 1) % size, np.float32)
deadline = time.time() + float(steps[:-1]) if steps.endswith("s") else None
right, done = True, 0
while jc.comm.bcast(time.time() < deadline if deadline else done < int(steps)):
    right &= bool(np.array_equal(np.asarray(ring(x)), expected))
    done += 1
    if progress:
        print(f"step {time.time():.3f}", file=progress, flush=True)
right = jc.comm.allreduce(right, op=MPI.LAND)
if rank == 0:
    crossing = [r for r in range(size) if size > 1 and hosts[r] != hosts[(r + 1) % size]]
    report = {
        "hosts": hosts,
        "crossing_edges": crossing,
        "local_edges": size - len(crossing) if size > 1 else 0,
        "steps": done,
        "bytes_per_edge": x.nbytes * done,
        "right": right,
    }
    print("crossing: " + json.dumps(report), flush=True)
