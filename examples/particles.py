"""Particles migrating between the slabs of a periodic box, inside one jitted loop.

Run:  mpiexec -n 4 python examples/particles.py [--particles 4096] [--steps 200]

The unit box [0, 1)^2 is cut into one slab per rank along x; rank r owns the
particles with ``r / size <= x < (r + 1) / size``. Each particle carries a
global id, a mass and a velocity (most slow, a few fast enough to skip slabs)
and moves ballistically, with a time step that changes from step to step. After
each move a particle may belong to another rank: the step sorts the particles
by owner, counts them per destination (inside ``jit``, so the exchange pattern
is data and differs every step), and moves them with one ``jc.alltoallv``
whose receive counts jaxcomm learns (``--method ragged``: one
``jc.ragged_all_to_all``, with each block's place in its receiver's buffer
from ``jc.exscan`` of the counts).

Each rank holds its particles in arrays of a static ``capacity`` (the first
``count`` rows are particles). Before moving anything the step learns how
many particles every rank would receive (``jc.alltoall`` of the counts); if
any rank would overflow its capacity, no rank moves anything, the loop stops,
and the driver doubles the capacity (a new compilation) and goes on from the
last complete step. ``--capacity`` sets the first capacity (default: twice the
particles per rank; at least what the fullest rank starts with).

Rank 0 prints one line: whether every particle arrived exactly once (ids
unique and complete), whether every particle is on the rank owning its
position, that the totals (count, mass, momentum) are those of the start, and
the largest difference of a position from a single-process run of the same
motion on all the particles.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from jaxcomm import JaxComm

jc = JaxComm(MPI.COMM_WORLD)
size, rank = jc.size, jc.rank

# Columns of a rank's particle array: x, y, vx, vy, mass, id (its int32 bits).
X, Y, VX, VY, MASS, ID = range(6)
COLUMNS = 6


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--particles", type=int, default=4096)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--capacity", type=int, help="first capacity per rank")
    p.add_argument("--method", choices=("alltoallv", "ragged"), default="alltoallv")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def initial(n, seed):
    """Every particle, the same on every rank: positions, velocities, masses, ids."""
    rng = np.random.default_rng(seed)
    position = rng.uniform(0, 1, (n, 2)).astype(np.float32)
    velocity = rng.normal(0, 0.2, (n, 2)).astype(np.float32)
    fast = rng.uniform(0, 1, n) < 0.05
    velocity[fast] *= 15  # these cross several slabs in one step
    mass = rng.uniform(0.5, 2, n).astype(np.float32)
    return position, velocity, mass, np.arange(n, dtype=np.int32)


def owner(x):
    """The rank owning position ``x``; rounding may put x * size at size."""
    return jnp.clip(jnp.floor(x * size).astype(jnp.int32), 0, size - 1)


def time_step(k):
    return 0.02 * (1 + 0.5 * jnp.sin(0.7 * k.astype(jnp.float32)))


def move(position, velocity, k):
    """One step of the motion: the same operations in the distributed and the serial run."""
    return jnp.mod(position + time_step(k) * velocity, 1.0)


def pack(position, velocity, mass, ids):
    bits = jax.lax.bitcast_convert_type(ids, jnp.float32)
    return jnp.concatenate([position, velocity, mass[:, None], bits[:, None]], axis=1)


def migrate(particles, count, k, method):
    """Move this rank's particles one step and send each to its owner.

    Returns:
        The new particles and count, and whether some rank would have
        overflowed its capacity (then nothing moved).
    """
    capacity = particles.shape[0]
    live = jnp.arange(capacity) < count
    position = move(particles[:, X:VX], particles[:, VX:MASS], k)
    moved = particles.at[:, X:VX].set(jnp.where(live[:, None], position, particles[:, X:VX]))
    # Destinations, the empty rows last (as destination `size`).
    dest = jnp.where(live, owner(moved[:, X]), size)
    order = jnp.argsort(dest, stable=True)
    outgoing = moved[order]
    sendcounts = jnp.sum(dest[:, None] == jnp.arange(size), axis=0, dtype=jnp.int32)
    recvcounts = jc.alltoall(sendcounts)
    arriving = jnp.sum(recvcounts).astype(count.dtype)
    overflow = jc.allreduce(arriving > capacity, op=MPI.LOR)

    def exchange(_):
        if method == "ragged":
            starts = jnp.cumsum(sendcounts) - sendcounts
            # Where this rank's block lands on each receiver: after the
            # blocks of the ranks before it.
            landing = jc.exscan(sendcounts)
            received = jc.ragged_all_to_all(
                outgoing, jnp.zeros_like(outgoing), starts, sendcounts, landing, recvcounts
            )
        else:
            received = jc.alltoallv(outgoing, sendcounts, recvcounts, capacity=capacity)
        return received, arriving

    def stay(_):
        return particles, count

    new, new_count = jax.lax.cond(overflow, stay, exchange, None)
    return new, new_count, overflow


@functools.partial(jax.jit, static_argnames=("method",))
def run(particles, count, start, stop, *, method):
    """Steps ``start`` to ``stop``, or up to the first that would overflow; returns its number."""

    def going(state):
        _, _, k, overflow = state
        return (k < stop) & ~overflow

    def step(state):
        particles, count, k, _ = state
        new, new_count, overflow = migrate(particles, count, k, method)
        return new, new_count, jnp.where(overflow, k, k + 1), overflow

    particles, count, k, _ = jax.lax.while_loop(
        going, step, (particles, count, start, jnp.asarray(False))
    )
    return particles, count, k


def grown(particles, capacity):
    return jnp.zeros((capacity, COLUMNS), particles.dtype).at[: particles.shape[0]].set(particles)


def serial(position, velocity, steps):
    """The same motion, all the particles in this one process."""
    body = lambda k, p: move(p, velocity, k)  # noqa: E731
    return jax.jit(lambda p: jax.lax.fori_loop(0, steps, body, p))(jnp.asarray(position))


def main():
    args = parse()
    n = args.particles
    position, velocity, mass, ids = initial(n, args.seed)
    mine = np.asarray(owner(jnp.asarray(position[:, 0]))) == rank
    capacity = args.capacity or max(1, 2 * -(-n // size))
    count = int(mine.sum())
    # The same capacity on every rank, enough for the fullest one.
    capacity = max(capacity, int(jc.allreduce(count, op=MPI.MAX)))
    particles = grown(
        pack(*(jnp.asarray(a[mine]) for a in (position, velocity, mass, ids))), capacity
    )

    k, grew = 0, 0
    count = jnp.asarray(count, jnp.int32)
    while k < args.steps:
        particles, count, reached = run(particles, count, k, args.steps, method=args.method)
        k = int(reached)
        if k < args.steps:  # some rank would have overflowed at step k
            capacity *= 2
            grew += 1
            particles = grown(particles, capacity)

    # Checks: every rank's particles, gathered in capacity-sized blocks.
    count = int(count)
    local = np.asarray(particles[:count])
    on_owner = bool(np.all(np.asarray(owner(jnp.asarray(local[:, X]))) == rank))
    on_owner = jc.allreduce(on_owner, op=MPI.LAND)
    everyone = np.asarray(jc.allgather(particles))
    counts = np.asarray(jc.allgather(jnp.asarray(count)))
    final = np.concatenate([everyone[r, : counts[r]] for r in range(size)])
    got_ids = final[:, ID].view(np.int32)
    unique = len(got_ids) == n and np.array_equal(np.sort(got_ids), ids)
    by_id = final[np.argsort(got_ids)] if unique else None
    conserved = (
        unique
        and np.array_equal(by_id[:, MASS], mass)
        and np.array_equal(by_id[:, VX:MASS], velocity)
        and np.sum(by_id[:, MASS], dtype=np.float64) == np.sum(mass, dtype=np.float64)
    )
    want = np.asarray(serial(position, velocity, args.steps))
    error = float(np.abs(by_id[:, X:VX] - want).max()) if unique else float("inf")
    if rank == 0:
        momentum = np.sum(mass[:, None] * velocity, axis=0, dtype=np.float64)
        print(
            f"{size} ranks, {args.steps} steps, {n} particles ({args.method}, capacity "
            f"{capacity}, grown {grew} times): particles conserved: {conserved}, "
            f"ids unique: {unique}, all on owner: {on_owner}, "
            f"total momentum ({momentum[0]:.4f}, {momentum[1]:.4f}) kept: {conserved}, "
            f"max position error {error:.1e}"
        )
    if not (conserved and unique and on_owner and error == 0.0):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
