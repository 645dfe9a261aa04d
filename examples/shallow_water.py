"""The 2-D shallow-water equations on a domain split over a Cartesian process grid.

Run:  mpiexec -n 4 python examples/shallow_water.py [--boundary walls] [--benchmark]
                                                   [--plot FILE.png]

A hump of water in a square basin of still water collapses into waves. The
state is the height ``h`` and the momenta ``h*u`` and ``h*v``; each rank owns
one block of cells of the global grid, laid out by ``JaxComm.from_cart``.
Every time step first exchanges one-cell halos with the four neighbours (one
``shift`` per side, which is an ``MPI_Sendrecv``) and then applies a
finite-volume update with Rusanov (local Lax-Friedrichs) fluxes and a forward
Euler step, stable at the fixed CFL number used here. The whole time loop is
one jitted ``lax.fori_loop``.

The update is written as an interior part, the cells whose neighbours are all
on this rank, and an edge part, the cells next to a halo. With ``--overlap``
each step starts its halo exchange with nonblocking ``irecv``/``isend``,
updates the interior while the messages travel (``JaxComm.during`` keeps that
computation between the starts and the waits), then waits and updates the
edges: the same field as the blocking version, bit for bit. With
``--overlap --benchmark`` both versions are timed. Whether the messages
really travel during the interior update depends on MPI's progress (for
MPICH, ``MPICH_ASYNC_PROGRESS=1`` and a spare core per rank; see
docs/nonblocking.md).

Boundaries are periodic (default) or solid walls (``--boundary walls``). With
walls the grid is not periodic, and ``shift`` receives zeros from beyond the
wall (``MPI.PROC_NULL``); the ghost cell there mirrors the edge cell with its
momentum into the wall reversed, so no water crosses the wall.

Rank 0 gathers the final field and prints the largest difference from the same
scheme run serially on the whole grid in one process (float32, so 0 or a few
1e-7), the relative change of the total mass (float32 rounding only: the
fluxes conserve it) and the range of the final height. ``--benchmark`` also
prints the time per step, steps per second and cells updated per second (the
slowest rank's time, compilation excluded); ``--plot FILE.png`` saves the
final height (needs matplotlib: ``pip install "jaxcomm[examples]"``).
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from jaxcomm import JaxComm

GRAVITY = 9.81
CFL = 0.2  # of the fastest initial wave, per axis: margin for the waves' own speed-up


def parse_args():
    parser = argparse.ArgumentParser(
        description="2-D shallow-water equations on a Cartesian process grid (see the docstring)."
    )
    parser.add_argument(
        "--cells",
        type=int,
        nargs=2,
        default=[128, 128],
        metavar=("NY", "NX"),
        help="global grid size (default 128 128)",
    )
    parser.add_argument("--steps", type=int, default=400, help="time steps (default 400)")
    parser.add_argument(
        "--boundary",
        choices=["periodic", "walls"],
        default="periodic",
        help="periodic domain or solid walls around the basin (default periodic)",
    )
    parser.add_argument(
        "--benchmark",
        action="store_true",
        help="print time per step, steps per second and cells per second",
    )
    parser.add_argument("--plot", metavar="FILE.png", help="save the final height field")
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="nonblocking halo exchange overlapped with the interior update",
    )
    args = parser.parse_args()
    if min(args.cells) < 2 or args.steps < 0:
        parser.error("--cells needs at least 2 cells per axis and --steps must be >= 0")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error('--plot needs matplotlib: pip install "jaxcomm[examples]"')
    return args


def initial_state(cells):
    """Still water of depth 1 with a Gaussian hump off the centre; zero momenta."""
    y, x = np.meshgrid(*[(np.arange(n) + 0.5) / n for n in cells], indexing="ij")
    h = 1 + 0.5 * np.exp(-((y - 0.6) ** 2 + (x - 0.35) ** 2) / (2 * 0.08**2))
    return np.stack([h, np.zeros_like(h), np.zeros_like(h)]).astype(np.float32)


def flux(state, axis):
    """Flux along ``axis`` of (h, h*u0, h*u1); u0, u1 are the velocities along axes 0, 1."""
    h = state[0]
    velocity = state[1 + axis] / h
    return (state * velocity).at[1 + axis].add(0.5 * GRAVITY * h**2)


def wave_speed(state, axis):
    return jnp.abs(state[1 + axis] / state[0]) + jnp.sqrt(GRAVITY * state[0])


def face_flux(left, right, axis):
    """Rusanov flux between neighbouring cells: the mean flux plus upwinding diffusion."""
    speed = jnp.maximum(wave_speed(left, axis), wave_speed(right, axis))
    return 0.5 * (flux(left, axis) + flux(right, axis)) - 0.5 * speed * (right - left)


def tendency(padded, spacing):
    """d(state)/dt of the cells inside ``padded``, which has one ring of neighbours around them.

    The corners of the ring are never read.
    """
    rows = padded[:, :, 1:-1]
    columns = padded[:, 1:-1, :]
    f0 = face_flux(rows[:, :-1], rows[:, 1:], axis=0)
    f1 = face_flux(columns[:, :, :-1], columns[:, :, 1:], axis=1)
    return -(f0[:, 1:] - f0[:, :-1]) / spacing[0] - (f1[:, :, 1:] - f1[:, :, :-1]) / spacing[1]


def reflect(edge, axis):
    """The ghost cells behind a wall along ``axis``: the edge cells with that momentum reversed."""
    return edge.at[1 + axis].multiply(-1)


def make_stepper(grid, spacing, dt, overlap=False):
    """The distributed time step: exchange halos, then update the interior and the edges.

    With ``overlap`` the exchange is started first, the interior is updated
    while it travels, and the edges once it has arrived.
    """
    wall_behind = [grid.cart_shift(axis)[0] == MPI.PROC_NULL for axis in (0, 1)]
    wall_ahead = [grid.cart_shift(axis)[1] == MPI.PROC_NULL for axis in (0, 1)]

    def exchange_halos(state):
        """Ghost rows above and below, ghost columns left and right: (3, nx) and (3, ny) each."""
        halos = []
        for axis in (0, 1):
            first = jnp.take(state, 0, axis=1 + axis)
            last = jnp.take(state, -1, axis=1 + axis)
            # Each rank sends its last row ahead and its first row behind; at a
            # wall the call still sends (the neighbour needs it) but receives zeros.
            behind = grid.shift(last, direction=axis, disp=1)
            ahead = grid.shift(first, direction=axis, disp=-1)
            if wall_behind[axis]:
                behind = reflect(first, axis)
            if wall_ahead[axis]:
                ahead = reflect(last, axis)
            halos += [behind, ahead]
        return halos

    def start_halo_exchange(state):
        """The nonblocking form of exchange_halos: four receives and four sends, started.

        Tags tell the two messages between a pair of ranks apart (on a grid
        two ranks wide the rank behind is also the rank ahead).
        """
        receives, sends = [], []
        for axis in (0, 1):
            first = jnp.take(state, 0, axis=1 + axis)
            last = jnp.take(state, -1, axis=1 + axis)
            source, dest = grid.cart_shift(axis)  # behind, ahead; PROC_NULL at a wall
            receives += [
                grid.irecv(last, source=source, tag=2 * axis),
                grid.irecv(first, source=dest, tag=2 * axis + 1),
            ]
            sends += [
                grid.isend(last, dest=dest, tag=2 * axis),
                grid.isend(first, dest=source, tag=2 * axis + 1),
            ]
        return receives, sends

    def finish_halo_exchange(state, receives, sends):
        halos = grid.waitall(receives)
        grid.waitall(sends)
        for axis in (0, 1):
            if wall_behind[axis]:
                halos[2 * axis] = reflect(jnp.take(state, 0, axis=1 + axis), axis)
            if wall_ahead[axis]:
                halos[2 * axis + 1] = reflect(jnp.take(state, -1, axis=1 + axis), axis)
        return halos

    def interior_tendency(state):
        """Cells [1:-1, 1:-1]: their neighbours are all on this rank, no halo needed."""
        return tendency(state, spacing)

    def edge_tendencies(state, halos):
        """The first and last rows (full width) and columns (without the corners)."""
        above, below, left, right = halos
        padded = jnp.concatenate([above[:, None], state, below[:, None]], axis=1)
        padded = jnp.pad(padded, ((0, 0), (0, 0), (1, 1)))
        padded = padded.at[:, 1:-1, 0].set(left).at[:, 1:-1, -1].set(right)
        return (
            tendency(padded[:, :3], spacing),
            tendency(padded[:, -3:], spacing),
            tendency(padded[:, 1:-1, :3], spacing),
            tendency(padded[:, 1:-1, -3:], spacing),
        )

    def update(state, interior, halos):
        top, bottom, left, right = edge_tendencies(state, halos)
        middle = jnp.concatenate([left, interior, right], axis=2)
        return state + dt * jnp.concatenate([top, middle, bottom], axis=1)

    def step(state):
        halos = exchange_halos(state)
        return update(state, interior_tendency(state), halos)

    def overlapped_step(state):
        receives, sends = start_halo_exchange(state)
        interior = grid.during(receives + sends, interior_tendency, state)
        return update(state, interior, finish_halo_exchange(state, receives, sends))

    return overlapped_step if overlap else step


def serial_step(state, spacing, dt, walls):
    """The reference: one update of the whole grid in one process, no halos."""
    padding = ((0, 0), (1, 1), (1, 1))
    if not walls:
        return state + dt * tendency(jnp.pad(state, padding, mode="wrap"), spacing)
    padded = jnp.pad(state, padding, mode="edge")
    padded = padded.at[1, [0, -1], :].multiply(-1).at[2, :, [0, -1]].multiply(-1)
    return state + dt * tendency(padded, spacing)


def main():
    args = parse_args()
    dims = MPI.Compute_dims(MPI.COMM_WORLD.size, 2)
    if any(n % p for n, p in zip(args.cells, dims)):
        raise SystemExit(
            f"--cells {args.cells[0]} {args.cells[1]} must divide into the "
            f"{dims[0]}x{dims[1]} process grid"
        )
    block = [n // p for n, p in zip(args.cells, dims)]
    if min(block) < 2:
        raise SystemExit(f"each rank needs at least 2x2 cells, got {block[0]}x{block[1]}")
    walls = args.boundary == "walls"
    grid = JaxComm.from_cart(dims, periods=[not walls] * 2)
    coords = grid.coords
    spacing = tuple(1.0 / n for n in args.cells)
    full = initial_state(args.cells)
    dt = CFL * min(spacing) / float(np.sqrt(GRAVITY * full[0].max()))
    mine = tuple(slice(c * b, (c + 1) * b) for c, b in zip(coords, block))
    start = jnp.asarray(full[:, mine[0], mine[1]])

    def evolver(overlap):
        step = make_stepper(grid, spacing, dt, overlap)
        return jax.jit(
            lambda state, steps: jax.lax.fori_loop(0, steps, lambda _, s: step(s), state)
        )

    def timed(evolve):
        """The final state and the slowest rank's seconds, compilation excluded."""
        evolve(start, 1).block_until_ready()
        grid.barrier()
        began = time.perf_counter()
        final = evolve(start, args.steps).block_until_ready()
        return final, float(grid.allreduce(time.perf_counter() - began, op=MPI.MAX))

    evolve = evolver(args.overlap)
    if args.benchmark:
        final, elapsed = timed(evolve)
        if args.overlap:
            blocking, blocking_elapsed = timed(evolver(False))
            if not np.array_equal(np.asarray(blocking), np.asarray(final)):
                raise SystemExit("the overlapped and the blocking step gave different fields")
    else:
        final = evolve(start, args.steps).block_until_ready()

    blocks = np.asarray(grid.gather(final, root=0))
    if grid.rank == 0:
        field = np.empty_like(full)
        for rank, piece in enumerate(blocks):
            rows, columns = (
                slice(c * b, (c + 1) * b) for c, b in zip(grid.comm.Get_coords(rank), block)
            )
            field[:, rows, columns] = piece
        serial = jax.jit(
            lambda s, n: jax.lax.fori_loop(0, n, lambda _, s: serial_step(s, spacing, dt, walls), s)
        )(full, args.steps)
        difference = float(np.abs(field - np.asarray(serial)).max())
        # Summed in float64, so that the sum's own rounding does not hide the scheme's.
        mass_before, mass_after = (float(np.sum(h, dtype=np.float64)) for h in (full[0], field[0]))
        print(
            f"{dims[0]}x{dims[1]} process grid, {args.cells[0]}x{args.cells[1]} cells, "
            f"{args.boundary}{', overlapped' if args.overlap else ''}, {args.steps} steps: "
            f"max difference from serial {difference:.1e}, "
            f"mass change {abs(mass_after - mass_before) / mass_before:.1e}, "
            f"final height {field[0].min():.3f} to {field[0].max():.3f}"
        )
        if args.benchmark:
            runs = [("overlapped" if args.overlap else "benchmark", elapsed)]
            if args.overlap:
                runs.append(("blocking", blocking_elapsed))
            for name, seconds in runs:
                per_step = seconds / max(args.steps, 1)
                print(
                    f"{name}: {per_step * 1e3:.3f} ms per step, {1 / per_step:.0f} steps/s, "
                    f"{args.cells[0] * args.cells[1] / per_step:.3e} cells/s"
                )
        if args.plot:
            plot(field[0], dt * args.steps, args.boundary, args.plot)
    grid.free()


def plot(height, t, boundary, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4.2))
    image = ax.imshow(height, origin="lower", extent=(0, 1, 0, 1), cmap="viridis")
    fig.colorbar(image, ax=ax, label="height")
    ax.set(title=f"Shallow water, {boundary}, t = {t:.3f}", xlabel="x", ylabel="y")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
