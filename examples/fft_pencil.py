"""A distributed 3-D (or 2-D) FFT on pencils, whose transposes are alltoall calls.

Run:  mpiexec -n 4 python examples/fft_pencil.py [--shape 64 64 64] [--benchmark]

A d-dimensional complex array is split over a (d-1)-dimensional process grid
(``JaxComm.from_cart``): at the start every rank holds a pencil, all of the
last axis and one block of each other axis. The forward transform takes 1-D
FFTs along the axis that is whole on every rank, then a global transpose makes
the next axis whole (and splits the one just done), and so on down to axis 0.
Each transpose is one ``alltoall`` within a row of the process grid (a
sub-communicator from ``split``): a 3-D transform on a P1 x P2 grid makes
two, within groups of P2 and of P1 ranks. In 2-D the grid is a line and this
is the slab decomposition: one ``alltoall`` over all ranks. The result is
left distributed as pencils along axis 0; the inverse runs the same steps
backwards and returns the original layout.

Rank 0 prints the process grid, the largest difference from ``jnp.fft.fftn``
of the whole array on one process (relative to the largest coefficient: 0 or
a few roundings in complex64, where a wrong transpose gives about 1) and the
largest difference of the inverse transform from the input (about 1e-6).
``--benchmark`` also prints the time of a forward and of an inverse transform
(the slowest rank's, mean of ``--repeat`` runs, compilation excluded) and of
``jnp.fft.fftn`` on the whole array on rank 0 alone.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from jaxcomm import JaxComm


def parse_args():
    parser = argparse.ArgumentParser(
        description="Distributed pencil FFT with alltoall transposes (see the docstring)."
    )
    parser.add_argument(
        "--shape",
        type=int,
        nargs="+",
        default=[64, 64, 64],
        help="global array shape, 2 or 3 axes (default 64 64 64)",
    )
    parser.add_argument(
        "--benchmark", action="store_true", help="time the forward and inverse transforms"
    )
    parser.add_argument(
        "--repeat", type=int, default=10, help="timed runs with --benchmark (default 10)"
    )
    args = parser.parse_args()
    if len(args.shape) not in (2, 3) or min(args.shape) < 1 or args.repeat < 1:
        parser.error("--shape takes 2 or 3 positive sizes and --repeat must be >= 1")
    return args


def transpose(x, comm, gather_axis, split_axis):
    """Make ``gather_axis`` whole and split ``split_axis`` into ``comm.size`` blocks.

    Before, rank r of ``comm`` holds block r of ``gather_axis``; after, block r
    of ``split_axis``. Block s of our ``split_axis`` goes to rank s, which
    stacks what it receives in rank order: that is its block of
    ``split_axis``, with every rank's block of ``gather_axis`` in turn.
    """
    blocks = jnp.stack(jnp.split(x, comm.size, axis=split_axis))
    received = comm.alltoall(blocks)
    shape = list(x.shape)
    shape[gather_axis] *= comm.size
    shape[split_axis] //= comm.size
    return jnp.moveaxis(received, 0, gather_axis).reshape(shape)


def make_transforms(lines):
    """Forward and inverse FFT of pencils; ``lines[k]`` is the communicator along grid axis k."""
    last = len(lines)

    def forward(x):
        x = jnp.fft.fft(x, axis=last)
        for k in reversed(range(last)):
            x = transpose(x, lines[k], gather_axis=k, split_axis=k + 1)
            x = jnp.fft.fft(x, axis=k)
        return x

    def inverse(x):
        for k in range(last):
            x = jnp.fft.ifft(x, axis=k)
            x = transpose(x, lines[k], gather_axis=k + 1, split_axis=k)
        return jnp.fft.ifft(x, axis=last)

    return jax.jit(forward), jax.jit(inverse)


def timed(function, x, repeat, grid=None):
    """The mean time of ``function(x)``, compilation excluded; the slowest rank's with ``grid``."""
    function(x).block_until_ready()
    if grid is not None:
        grid.barrier()
    began = time.perf_counter()
    for _ in range(repeat):
        y = function(x)
    y.block_until_ready()
    elapsed = (time.perf_counter() - began) / repeat
    return elapsed if grid is None else float(grid.allreduce(elapsed, op=MPI.MAX))


def main():
    args = parse_args()
    shape = tuple(args.shape)
    dims = MPI.Compute_dims(MPI.COMM_WORLD.size, len(shape) - 1)
    # Axis k starts split over grid axis k and axis k + 1 ends split over it.
    for k, p in enumerate(dims):
        if shape[k] % p or shape[k + 1] % p:
            raise SystemExit(
                f"--shape {' '.join(map(str, shape))}: axes {k} and {k + 1} must "
                f"divide by {p}, the processes along axis {k} of the "
                f"{'x'.join(map(str, dims))} process grid"
            )
    grid = JaxComm.from_cart(dims)
    coords = grid.coords

    # The ranks that differ only in coordinate k, numbered by it.
    lines = []
    for k in range(len(dims)):
        others = [c for i, c in enumerate(coords) if i != k]
        other_dims = [d for i, d in enumerate(dims) if i != k]
        color = int(np.ravel_multi_index(others, other_dims)) if others else 0
        lines.append(grid.split(color, key=coords[k]))
    forward, inverse = make_transforms(lines)

    def block(axis, along):
        """This rank's slice of ``axis`` when it is split over grid axis ``along``."""
        n = shape[axis] // dims[along]
        return slice(coords[along] * n, (coords[along] + 1) * n)

    pencil_in = tuple(block(k, k) for k in range(len(dims))) + (slice(None),)
    pencil_out = (slice(None),) + tuple(block(k + 1, k) for k in range(len(dims)))

    rng = np.random.default_rng(0)
    whole = (rng.normal(size=shape) + 1j * rng.normal(size=shape)).astype(np.complex64)
    x = jnp.asarray(whole[pencil_in])
    spectrum = forward(x)
    back = inverse(spectrum)

    reference = jnp.fft.fftn(jnp.asarray(whole))
    scale = float(jnp.max(jnp.abs(reference)))
    error = grid.allreduce(jnp.max(jnp.abs(spectrum - reference[pencil_out])), op=MPI.MAX)
    roundtrip = grid.allreduce(jnp.max(jnp.abs(back - x)), op=MPI.MAX)
    if args.benchmark:
        times = [timed(forward, x, args.repeat, grid), timed(inverse, spectrum, args.repeat, grid)]
        # The baseline: one process transforming the whole array, as without MPI.
        if grid.rank == 0:
            serial = timed(jax.jit(jnp.fft.fftn), jnp.asarray(whole), args.repeat)
        grid.barrier()
    if grid.rank == 0:
        layout = (
            f"slabs over {grid.size} ranks"
            if len(dims) == 1
            else f"pencils over a {dims[0]}x{dims[1]} process grid"
        )
        print(
            f"{'x'.join(map(str, shape))} complex64, {layout}: max difference from "
            f"jnp.fft.fftn {float(error) / scale:.1e} (relative), "
            f"inverse round trip {float(roundtrip):.1e}"
        )
        if args.benchmark:
            print(
                f"benchmark: forward {times[0] * 1e3:.3f} ms, inverse {times[1] * 1e3:.3f} ms, "
                f"jnp.fft.fftn on one process {serial * 1e3:.3f} ms"
            )
    for line in lines:
        line.free()
    grid.free()


if __name__ == "__main__":
    main()
