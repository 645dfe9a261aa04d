"""Heat diffusion written in mpi4jax's style, run through jaxcomm twice.

Run:  mpiexec -n 4 python examples/heat_mpi4jax_style.py [--cells 48 48] [--steps 100]

The program is an mpi4jax program: module functions that take the
communicator as ``comm=`` (here a Cartesian communicator with walls, whose
missing neighbours are ``MPI.PROC_NULL``). It imports
``jaxcomm.compat.mpi4jax as mpi4jax``, the one-line switch from mpi4jax.
The same solver then runs with ``JaxComm`` methods instead, the move that
follows the switch; only the calls differ. Rank 0 prints whether the two
runs agree bit for bit, and the largest difference from the same explicit
scheme run serially on the whole grid.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import jaxcomm.compat.mpi4jax as mpi4jax
from jaxcomm import JaxComm

ALPHA = 0.2  # diffusion number: stable for the five-point scheme below 0.25

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--cells", type=int, nargs=2, default=(48, 48), metavar=("NY", "NX"))
parser.add_argument("--steps", type=int, default=100)
args = parser.parse_args()

world = MPI.COMM_WORLD
dims = MPI.Compute_dims(world.Get_size(), 2)
cells = tuple(args.cells)
if any(n % d for n, d in zip(cells, dims)):
    raise SystemExit(
        f"--cells {cells[0]} {cells[1]} must split evenly over a {dims[0]}x{dims[1]} grid"
    )
cart = world.Create_cart(dims, periods=(False, False))
coords = cart.Get_coords(cart.Get_rank())
block = (cells[0] // dims[0], cells[1] // dims[1])
# (source, dest) of a shift by +1 and by -1 along each axis.
neighbours = [(cart.Shift(axis, 1), cart.Shift(axis, -1)) for axis in (0, 1)]


def initial(shape):
    """A hot spot off the centre of the global grid."""
    y, x = np.meshgrid(np.arange(shape[0]), np.arange(shape[1]), indexing="ij")
    return np.exp(
        -((y - 0.4 * shape[0]) ** 2 + (x - 0.6 * shape[1]) ** 2) / (0.02 * shape[0] * shape[1])
    )


def with_halos(u, sendrecv):
    """``u`` padded with its neighbours' edges (zeros at the walls: MPI.PROC_NULL)."""
    (rows_plus, rows_minus), (cols_plus, cols_minus) = neighbours
    # A shift by +1 passes each block's last row (column) to the next block
    # and brings the previous block's; a shift by -1 the first ones back.
    above = sendrecv(u[-1], source=rows_plus[0], dest=rows_plus[1])
    below = sendrecv(u[0], source=rows_minus[0], dest=rows_minus[1])
    u = jnp.concatenate([above[None], u, below[None]], axis=0)
    before = sendrecv(u[:, -1], source=cols_plus[0], dest=cols_plus[1])
    after = sendrecv(u[:, 0], source=cols_minus[0], dest=cols_minus[1])
    return jnp.concatenate([before[:, None], u, after[:, None]], axis=1)


def step(u, exchange):
    padded = exchange(u)
    centre = padded[1:-1, 1:-1]
    laplacian = (
        padded[:-2, 1:-1] + padded[2:, 1:-1] + padded[1:-1, :-2] + padded[1:-1, 2:] - 4 * centre
    )
    return centre + ALPHA * laplacian


def solve(u, exchange):
    return jax.jit(lambda u: jax.lax.fori_loop(0, args.steps, lambda i, v: step(v, exchange), u))(u)


def serial(u):
    zero_halo = lambda v: jnp.pad(v, 1)
    return jax.jit(lambda u: jax.lax.fori_loop(0, args.steps, lambda i, v: step(v, zero_halo), u))(
        u
    )


whole = initial(cells).astype(np.float32)
mine = jnp.asarray(
    whole[
        coords[0] * block[0] : (coords[0] + 1) * block[0],
        coords[1] * block[1] : (coords[1] + 1) * block[1],
    ]
)

# The mpi4jax program, through the compat module.
by_compat = solve(
    mine,
    lambda u: with_halos(
        u, lambda x, source, dest: mpi4jax.sendrecv(x, x, source, dest, comm=cart)
    ),
)
heat = float(mpi4jax.allreduce(by_compat.sum(), MPI.SUM, comm=cart))
blocks_compat = mpi4jax.gather(by_compat, 0, comm=cart)

# The same solver with JaxComm methods.
jc = JaxComm(cart)
by_methods = solve(
    mine, lambda u: with_halos(u, lambda x, source, dest: jc.sendrecv(x, x, source, dest))
)
heat_methods = float(jc.allreduce(by_methods.sum()))
blocks_methods = jc.gather(by_methods, root=0)

if cart.Get_rank() == 0:

    def assemble(blocks):
        rows = [
            np.concatenate(list(blocks[r * dims[1] : (r + 1) * dims[1]]), axis=1)
            for r in range(dims[0])
        ]
        return np.concatenate(rows, axis=0)

    # Cartesian ranks are row-major over the process grid.
    field_compat, field_methods = (
        assemble(np.asarray(blocks_compat)),
        assemble(np.asarray(blocks_methods)),
    )
    reference = np.asarray(serial(jnp.asarray(whole)))
    identical = np.array_equal(field_compat, field_methods) and heat == heat_methods
    print(
        f"{dims[0]}x{dims[1]} process grid, {cells[0]}x{cells[1]} cells, walls, {args.steps} steps: "
        f"compat and JaxComm runs identical: {identical}, "
        f"max difference from serial {np.abs(field_compat - reference).max():.1e}, "
        f"heat {whole.sum():.4f} -> {heat:.4f}"
    )
jc.free()
