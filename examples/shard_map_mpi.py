"""A multi-process shard_map program, with JAX's collectives and jaxcomm's side by side.

Run:  mpiexec -n 4 python examples/shard_map_mpi.py [--cells-per-process 16] [--steps 50]
      [--benchmark]

One JAX process per MPI rank, joined into one JAX job by jax.distributed
(jaxcomm.initialize_jax_distributed), each with one CPU device of a global
mesh with the axis "x". The program diffuses heat on a periodic 1-D grid
sharded over "x": every step exchanges one-cell halos with both neighbours
and sums the heat over the whole grid. It is written twice, once with JAX's
collectives (jax.lax.ppermute and psum, over gloo) and once with jaxcomm's
(sendrecv and allreduce on JaxComm.for_mesh(mesh, "x"), whose ranks are the
positions along "x"), and differentiated with jax.grad. Rank 0 prints the
largest differences between the two (states, heat totals, energies and
gradients: rounding only, as MPI and gloo add in different orders) and from a
serial float64 run; --benchmark times both programs.
"""

import argparse
import time

import jaxcomm

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--cells-per-process", type=int, default=16)
parser.add_argument("--steps", type=int, default=50)
parser.add_argument("--benchmark", action="store_true", help="time both programs")
args = parser.parse_args()

# Before anything starts JAX's backends: one JAX process per MPI rank.
jaxcomm.initialize_jax_distributed()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from mpi4py import MPI  # noqa: E402

from jaxcomm import JaxComm  # noqa: E402

ALPHA = 0.2
mesh = Mesh(np.array(jax.devices()), ("x",))
jx = JaxComm.for_mesh(mesh, "x")  # rank = position along "x", as jax.lax.axis_index("x")
n, r = jx.size, jx.rank
cells = n * args.cells_per_process


def halos_jax(u):
    from_left = jax.lax.ppermute(u[-1:], "x", [(i, (i + 1) % n) for i in range(n)])
    from_right = jax.lax.ppermute(u[:1], "x", [(i, (i - 1) % n) for i in range(n)])
    return from_left, from_right


def halos_jaxcomm(u):
    from_left = jx.sendrecv(u[-1:], u[-1:], source=(r - 1) % n, dest=(r + 1) % n)
    from_right = jx.sendrecv(u[:1], u[:1], source=(r + 1) % n, dest=(r - 1) % n)
    return from_left, from_right


def program(halos, total):
    """The jitted program over the global grid: final state, heat after each step, energy."""

    def local(u):  # this process's block
        def step(u, _):
            from_left, from_right = halos(u)
            padded = jnp.concatenate([from_left, u, from_right])
            u = u + ALPHA * (padded[2:] - 2 * u + padded[:-2])
            return u, total(jnp.sum(u))

        u, heat = jax.lax.scan(step, u, None, length=args.steps)
        return u, heat, total(jnp.sum(u * u))

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P(), P())))


with_jax = program(halos_jax, lambda v: jax.lax.psum(v, "x"))
with_jaxcomm = program(halos_jaxcomm, jx.allreduce)

u0 = np.sin(2 * np.pi * np.arange(cells) / cells) + 0.1 * np.cos(7.0 * np.arange(cells))
u0_global = jax.make_array_from_callback(
    (cells,), NamedSharding(mesh, P("x")), lambda index: u0[index].astype(np.float32)
)


def local(array):
    """This process's block of a global array (all of it when replicated)."""
    return np.asarray(array.addressable_shards[0].data, np.float64)


def energy_gradient(run):
    return jax.jit(jax.grad(lambda u: run(u)[2]))(u0_global)


results = {name: run(u0_global) for name, run in (("jax", with_jax), ("jaxcomm", with_jaxcomm))}
gradients = {
    name: energy_gradient(run) for name, run in (("jax", with_jax), ("jaxcomm", with_jaxcomm))
}


def largest(a, b):
    return float(np.abs(local(a) - local(b)).max())


differences = [largest(results["jax"][i], results["jaxcomm"][i]) for i in range(3)]
differences.append(largest(gradients["jax"], gradients["jaxcomm"]))

serial = u0.copy()
for _ in range(args.steps):
    serial = serial + ALPHA * (np.roll(serial, 1) - 2 * serial + np.roll(serial, -1))
shard = results["jaxcomm"][0].addressable_shards[0]
from_serial = float(np.abs(local(shard.data) - serial[shard.index]).max())
heat = local(results["jaxcomm"][1])
worst = np.empty(5)
MPI.COMM_WORLD.Allreduce(np.array([*differences, from_serial]), worst, op=MPI.MAX)

if args.benchmark:
    timings = {}
    for name, run in (("jax", with_jax), ("jaxcomm", with_jaxcomm)):
        jax.block_until_ready(run(u0_global))
        start, repeats = time.perf_counter(), 20
        for _ in range(repeats):
            jax.block_until_ready(run(u0_global))
        timings[name] = (time.perf_counter() - start) / repeats / args.steps
if MPI.COMM_WORLD.rank == 0:
    state, totals, energy, gradient = worst[:4]
    print(
        f"{n} processes, {cells} cells, {args.steps} steps: JAX collectives and jaxcomm differ "
        f"by {state:.1e} (state), {totals:.1e} (heat), {energy:.1e} (energy), "
        f"{gradient:.1e} (energy gradient); max difference from serial {worst[4]:.1e}, "
        f"heat change {abs(heat[-1] - u0.sum()):.1e}"
    )
    if args.benchmark:
        print(
            "benchmark: per step (halo exchange and global sum), "
            + ", ".join(f"{name} {t * 1e6:.1f} us" for name, t in timings.items())
            + f", jax/jaxcomm {timings['jax'] / timings['jaxcomm']:.1f}x"
        )
