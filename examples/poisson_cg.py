"""A distributed conjugate-gradient solve of a 2-D Poisson problem, differentiated with jax.grad.

Run:  mpiexec -n 4 python examples/poisson_cg.py [--size N] [--plot FILE.png]

The problem is ``-laplace(u) + sigma * u = f`` on the unit square with
``u = 0`` on the boundary, discretised with the five-point stencil on an
N x N grid of unknowns split into blocks over a Cartesian process grid
(``JaxComm.from_cart``, not periodic). The matrix-vector product exchanges
one-cell halos with ``shift``; beyond the boundary ``shift`` receives zeros
from ``MPI.PROC_NULL``, which is exactly the boundary condition ``u = 0``.

Why not ``jax.scipy.sparse.linalg.cg``: it computes its inner products with
``jnp.vdot`` on the local arrays and has no way to substitute another inner
product, so on each rank it would see only that rank's block: wrong step
lengths, and ranks that disagree on when to stop would deadlock. This example
writes the CG iteration itself, in a ``lax.while_loop`` whose inner products
are local dot products summed with ``allreduce``; every rank then holds the
same scalars and stops after the same iteration. Reverse-mode autodiff does
not go through ``while_loop``, so the solve is wrapped in
``lax.custom_linear_solve(matvec, f, solve=cg, symmetric=True)``: its
derivatives are further (distributed) solves with the same operator.

Everything runs in float64. Rank 0 prints the iterations and relative
residual of the solve, the largest difference from the single-process answer
(``jax.scipy.sparse.linalg.cg`` on the whole grid, to the same tolerance), and
the gradient of a loss ``0.5 * h**2 * sum((u - target)**2)`` with respect to
``sigma`` and to ``f`` (along a random direction), each against a central
finite difference of the loss. ``sigma`` is one parameter replicated on every
rank: each rank's ``jax.grad`` is the share of the derivative that comes
through its own copy, and an ``allreduce`` adds the shares (as for the weights
in ``data_parallel.py``). ``--plot FILE.png`` saves the solution ``u``
and the gradient of the loss with respect to ``f`` (needs matplotlib:
``pip install "jaxcomm[examples]"``).
"""

import argparse

import jax

jax.config.update("jax_enable_x64", True)  # noqa: E402 (before any array is made)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.scipy.sparse.linalg import cg as serial_cg  # noqa: E402
from mpi4py import MPI  # noqa: E402

from jaxcomm import JaxComm  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(
        description="Distributed CG for a 2-D Poisson problem and its gradient (see the docstring)"
    )
    parser.add_argument(
        "--size", type=int, default=64, help="unknowns per axis of the global grid (default 64)"
    )
    parser.add_argument(
        "--sigma",
        type=float,
        default=10.0,
        help="the coefficient sigma >= 0 of -laplace(u) + sigma*u (default 10)",
    )
    parser.add_argument(
        "--tol",
        type=float,
        default=1e-12,
        help="relative residual at which CG stops (default 1e-12)",
    )
    parser.add_argument(
        "--epsilon",
        type=float,
        default=1e-5,
        help="relative step of the finite differences (default 1e-5)",
    )
    parser.add_argument(
        "--plot", metavar="FILE.png", help="save the solution and the gradient with respect to f"
    )
    args = parser.parse_args()
    if args.size < 1 or args.sigma < 0 or not 0 < args.tol < 1 or args.epsilon <= 0:
        parser.error("need --size >= 1, --sigma >= 0, 0 < --tol < 1 and --epsilon > 0")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error('--plot needs matplotlib: pip install "jaxcomm[examples]"')
    return args


def conjugate_gradient(matvec, b, dot, tol, maxiter):
    """Solve ``matvec(x) = b`` from ``x = 0``; returns x, the iterations and ``|r| / |b|``.

    ``dot`` must return the same global inner product on every rank, so that
    every rank takes the same steps and the same number of them.
    """

    def keep_going(carry):
        _, _, _, rr, k = carry
        return (rr > tol**2 * bb) & (k < maxiter)

    def iteration(carry):
        x, r, p, rr, k = carry
        ap = matvec(p)
        alpha = rr / dot(p, ap)
        x = x + alpha * p
        r = r - alpha * ap
        rr_next = dot(r, r)
        return x, r, r + (rr_next / rr) * p, rr_next, k + 1

    bb = dot(b, b)
    x, _, _, rr, k = jax.lax.while_loop(keep_going, iteration, (b * 0, b, b, bb, 0))
    return x, k, jnp.sqrt(rr / bb)


def main():
    args = parse_args()
    dims = MPI.Compute_dims(MPI.COMM_WORLD.size, 2)
    if args.size % dims[0] or args.size % dims[1]:
        raise SystemExit(
            f"--size {args.size} must divide into the {dims[0]}x{dims[1]} process grid"
        )
    grid = JaxComm.from_cart(dims, periods=[False, False])
    coords = grid.coords
    block = (args.size // dims[0], args.size // dims[1])
    mine = tuple(slice(c * b, (c + 1) * b) for c, b in zip(coords, block))
    h = 1.0 / (args.size + 1)
    maxiter = args.size**2  # in exact arithmetic CG needs at most one iteration per unknown

    y, x = np.meshgrid(*[np.arange(1, args.size + 1) * h] * 2, indexing="ij")
    source = 100 * np.exp(-((x - 0.3) ** 2 + (y - 0.6) ** 2) / 0.02) + 20 * x
    target = np.sin(np.pi * x) * np.sin(2 * np.pi * y)
    direction = np.random.default_rng(0).normal(size=source.shape)

    def stencil(padded, sigma):
        centre = padded[1:-1, 1:-1]
        neighbours = padded[:-2, 1:-1] + padded[2:, 1:-1] + padded[1:-1, :-2] + padded[1:-1, 2:]
        return (4 * centre - neighbours) / h**2 + sigma * centre

    def matvec(u, sigma):
        """-laplace(u) + sigma*u on this rank's block, halos from the four neighbours."""
        above = grid.shift(u[-1], direction=0, disp=1)
        below = grid.shift(u[0], direction=0, disp=-1)
        u = jnp.concatenate([above[None], u, below[None]], axis=0)
        left = grid.shift(u[:, -1], direction=1, disp=1)
        right = grid.shift(u[:, 0], direction=1, disp=-1)
        return stencil(jnp.concatenate([left[:, None], u, right[:, None]], axis=1), sigma)

    def dot(a, b):
        return grid.allreduce(jnp.vdot(a, b))

    def cg(operator, b):
        return conjugate_gradient(operator, b, dot, args.tol, maxiter)

    def solve(f, sigma):
        return jax.lax.custom_linear_solve(
            lambda u: matvec(u, sigma), f, solve=lambda op, b: cg(op, b)[0], symmetric=True
        )

    def loss(f, sigma):
        return 0.5 * h**2 * grid.allreduce(jnp.sum((solve(f, sigma) - target[mine]) ** 2))

    @jax.jit
    def solve_and_check(f):
        u, iterations, _ = cg(lambda u: matvec(u, args.sigma), f)
        r = f - matvec(u, args.sigma)
        return u, iterations, jnp.sqrt(dot(r, r) / dot(f, f))

    f = jnp.asarray(source[mine])
    u, iterations, residual = solve_and_check(f)
    largest = grid.allreduce(jnp.max(jnp.abs(u)), op=MPI.MAX)

    # Every rank solves the whole problem alone, to compare its own block.
    serial_matvec = jax.jit(lambda u: stencil(jnp.pad(u, 1), args.sigma))
    serial_u, _ = jax.jit(lambda b: serial_cg(serial_matvec, b, tol=args.tol, maxiter=maxiter))(
        jnp.asarray(source)
    )
    difference = grid.allreduce(jnp.max(jnp.abs(u - serial_u[mine])), op=MPI.MAX)

    # Each rank's sigma is its own copy, and jax.grad gives that copy's share
    # of the derivative: the shares add up to the derivative for one common sigma.
    grad_f, grad_sigma = jax.jit(jax.grad(loss, argnums=(0, 1)))(f, args.sigma)
    jitted_loss = jax.jit(loss)

    def finite_difference(df, dsigma):
        plus = jitted_loss(f + df, args.sigma + dsigma)
        minus = jitted_loss(f - df, args.sigma - dsigma)
        return float(plus - minus) / 2

    step_sigma = args.epsilon * max(args.sigma, 1.0)
    step_f = args.epsilon * float(np.abs(source).max())
    checks = {
        "sigma": (
            float(grid.allreduce(grad_sigma)),
            finite_difference(f * 0, step_sigma) / step_sigma,
        ),
        "f along a random direction": (
            float(grid.allreduce(jnp.vdot(grad_f, direction[mine]))),
            finite_difference(step_f * jnp.asarray(direction[mine]), 0.0) / step_f,
        ),
    }
    if grid.rank == 0:
        print(
            f"{dims[0]}x{dims[1]} process grid, {args.size}x{args.size} unknowns: "
            f"CG took {int(iterations)} iterations, relative residual |f - A u| / |f| "
            f"{float(residual):.1e}"
        )
        print(
            f"max difference from single-process jax.scipy.sparse.linalg.cg "
            f"{float(difference):.1e} (max |u| {float(largest):.3f})"
        )
        for name, (exact, estimate) in checks.items():
            print(
                f"d loss / d {name}: jax.grad {exact:.10e}, finite difference {estimate:.10e}, "
                f"relative difference {abs(exact - estimate) / abs(exact):.1e}"
            )
    if args.plot:
        fields = [whole(grid, piece, block) for piece in (u, grad_f)]
        if grid.rank == 0:
            plot(*fields, args.plot)
    grid.free()


def whole(grid, piece, block):
    """The global array on rank 0 (zeros elsewhere), from every rank's block of it."""
    pieces = np.asarray(grid.gather(piece, root=0))
    result = np.zeros((block[0] * grid.dims[0], block[1] * grid.dims[1]), pieces.dtype)
    for rank, piece in enumerate(pieces):
        rows, columns = (
            slice(c * b, (c + 1) * b) for c, b in zip(grid.comm.Get_coords(rank), block)
        )
        result[rows, columns] = piece
    return result


def plot(u, grad_f, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for ax, field, title in zip(axes, (u, grad_f), ("solution u", "d loss / d f")):
        image = ax.imshow(field, origin="lower", extent=(0, 1, 0, 1), cmap="viridis")
        fig.colorbar(image, ax=ax)
        ax.set(title=title, xlabel="x", ylabel="y")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
