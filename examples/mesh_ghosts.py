"""Ghost exchange on an unstructured mesh, and its gradient, with one neighbourhood collective.

Run:  mpiexec -n 4 python examples/mesh_ghosts.py

A random mesh of nodes joined by edges (a ring plus random chords) is split
over the ranks by a random assignment of nodes. Each rank owns some nodes and
computes the terms of the energy of the edges whose first node it owns; the
second node may belong to another rank, whose value arrives as a ghost.
The ranks that send each other ghosts form a distributed graph
(``JaxComm.from_graph``), and one ``neighbor_alltoallv`` per evaluation
moves every ghost value. ``jax.grad`` of the energy sends the ghosts'
cotangents back to their owners (the transpose: one exchange on the reverse
graph) and adds them there. Rank 0 prints the largest difference of the
gradient, on every rank's owned nodes, from ``jax.grad`` of the same energy
computed by one process on the whole mesh.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from jaxcomm import JaxComm

jax.config.update("jax_enable_x64", True)

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--nodes", type=int, default=60)
parser.add_argument("--chords", type=int, default=40)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

world = MPI.COMM_WORLD
size, rank = world.Get_size(), world.Get_rank()

# The mesh and its partition, the same on every rank (seeded).
rng = np.random.default_rng(args.seed)
n = args.nodes
ring = np.stack([np.arange(n), (np.arange(n) + 1) % n], axis=1)
chords = rng.integers(0, n, (args.chords, 2))
edges = np.concatenate([ring, chords[chords[:, 0] != chords[:, 1]]])
stiffness = rng.uniform(0.5, 2.0, len(edges))
values = rng.normal(size=n)
owner = rng.integers(0, size, n)


def energy_terms(u_first, u_second, k, u_owned):
    """Edge terms and a node term: a nonlinear energy, so the gradient depends on the values."""
    return jnp.sum(k * (u_first - u_second) ** 2 + 0.1 * (u_first * u_second) ** 2) + jnp.sum(
        jnp.cos(u_owned)
    )


# This rank's part: its nodes (local index = position in `mine`), its edges,
# and the ghosts it needs, grouped by owner.
mine = np.nonzero(owner == rank)[0]
local = {int(node): i for i, node in enumerate(mine)}
my_edges = edges[owner[edges[:, 0]] == rank]
ghosts = sorted({int(b) for b in my_edges[:, 1] if owner[b] != rank}, key=lambda b: (owner[b], b))
sources = sorted({int(owner[b]) for b in ghosts})
recvcounts = [sum(1 for b in ghosts if owner[b] == s) for s in sources]
ghost_index = {b: len(mine) + i for i, b in enumerate(ghosts)}

# What each rank sends whom: the same computation for every rank, from the
# shared mesh, so both ends of every edge of the graph agree.
wanted = {}  # (owner, needer) -> sorted nodes
for r in range(size):
    r_edges = edges[owner[edges[:, 0]] == r]
    for b in sorted({int(b) for b in r_edges[:, 1] if owner[b] != r}):
        wanted.setdefault((int(owner[b]), r), []).append(b)
destinations = sorted(d for (o, d) in wanted if o == rank)
send_rows = np.array(
    [local[b] for d in destinations for b in wanted[(rank, d)]], dtype=np.int32
).reshape(-1)
sendcounts = [len(wanted[(rank, d)]) for d in destinations]

mesh = JaxComm.from_graph(sources, destinations)
first = np.array([local[int(a)] for a in my_edges[:, 0]], dtype=np.int32)
second = np.array(
    [local[int(b)] if owner[b] == rank else ghost_index[int(b)] for b in my_edges[:, 1]],
    dtype=np.int32,
)
k = stiffness[owner[edges[:, 0]] == rank]


@jax.jit
def energy(u):
    """The whole mesh's energy, from this rank's owned values ``u``."""
    ghost_values = mesh.neighbor_alltoallv(u[send_rows], sendcounts, recvcounts)
    extended = jnp.concatenate([u, ghost_values])
    part = energy_terms(extended[first], extended[second], k, u)
    return mesh.allreduce(part)


u = jnp.asarray(values[mine])
total, grad = jax.value_and_grad(energy)(u)


def serial_energy(v):
    return energy_terms(v[edges[:, 0]], v[edges[:, 1]], stiffness, v)


reference_total, reference_grad = jax.value_and_grad(serial_energy)(jnp.asarray(values))
error = max(
    float(np.abs(np.asarray(grad) - np.asarray(reference_grad)[mine]).max(initial=0.0)),
    abs(float(total) - float(reference_total)),
)
worst = world.allreduce(error, op=MPI.MAX)
ghost_count = world.allreduce(len(ghosts))
if rank == 0:
    print(
        f"{size} ranks, {n} nodes, {len(edges)} edges, {ghost_count} ghosts: "
        f"energy {float(total):.6f}, max difference from single process {worst:.1e}"
    )
mesh.free()
