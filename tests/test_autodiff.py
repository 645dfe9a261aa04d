"""Differentiation of every communicating op, checked against the whole multi-rank program.

Every rank perturbs its own input in lockstep, so central differences of the
program give each rank's JVP. Reverse mode is checked against forward mode
through inner products summed over ranks: for ops that transpose exactly,
sum_r <ct_r, J t>_r == sum_r <J^T ct, t>_r. A replicated output (allreduce,
bcast, allgather) is one value, so its cotangent is the same on every rank
and the output side counts it once (divided by ``size``): that is the
replicated-value convention, tested explicitly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI
from operations import TRANSPOSE, params, select

EPS = 1e-5


def _random(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).uniform(0.5, 1.5, shape))


def _global_sum(jc, value):
    return jc.comm.allreduce(float(value), op=MPI.SUM)


def _check_once(jc, f, x, replicated, salt):
    """Check f's JVP against central differences and its VJP against its JVP."""
    t = _random([salt, 1, jc.rank], x.shape)
    # A replicated output's cotangent is the same on every rank.
    shape = jax.eval_shape(f, x).shape
    ct = _random([salt, 2] if replicated else [salt, 2, jc.rank], shape)

    @jax.jit
    def derivatives(x, t, ct):
        numeric = (f(x + EPS * t) - f(x - EPS * t)) / (2 * EPS)
        return numeric, jax.jvp(f, (x,), (t,))[1], jax.vjp(f, x)[1](ct)[0]

    numeric, dy, g = derivatives(x, t, ct)
    np.testing.assert_allclose(dy, numeric, rtol=1e-6, atol=1e-7)
    out_side = _global_sum(jc, jnp.vdot(ct, dy)) / (jc.size if replicated else 1)
    np.testing.assert_allclose(_global_sum(jc, jnp.vdot(g, t)), out_side, rtol=1e-10)


def _check_hessian_products(jc, f, x, replicated):
    """Forward-over-reverse and reverse-over-reverse Hessian-vector products agree.

    ``g`` is the gradient of the global scalar ``<ct, f(x)**2>``, so its
    Jacobian is that scalar's Hessian, which is symmetric: ``jvp(g)(v)`` (which
    differentiates the transposes' rules) equals ``vjp(g)(v)`` (which
    transposes the transposes). Squaring puts ``f(x)`` into the cotangent that
    ``f``'s transposes see, so the second pass really transposes them.
    """
    square = lambda x: f(x) ** 2
    shape = jax.eval_shape(f, x).shape
    ct = _random([4] if replicated else [4, jc.rank], shape)
    v = _random([5, jc.rank], x.shape)

    @jax.jit
    def products(x, ct, v):
        g = lambda x: jax.vjp(square, x)[1](ct)[0]
        return jax.jvp(g, (x,), (v,))[1], jax.vjp(g, x)[1](v)[0]

    forward_over_reverse, reverse_over_reverse = products(x, ct, v)
    np.testing.assert_allclose(reverse_over_reverse, forward_over_reverse, rtol=1e-10, atol=1e-12)


def check_ad(jc, f, x, *, replicated=False, order=1):
    """Check the derivatives of ``f`` up to ``order`` (1 or 2), forward and reverse.

    The second order is checked as the first order of ``x -> jvp(f)(x, v)``,
    and by comparing Hessian-vector products taken forward-over-reverse and
    reverse-over-reverse.
    """
    _check_once(jc, f, x, replicated, 0)
    if order == 2:
        v = _random([3, jc.rank], x.shape)
        _check_once(jc, lambda x: jax.jvp(f, (x,), (v,))[1], x, replicated, 1)
        _check_hessian_products(jc, f, x, replicated)


def _data(jc, shape=(2, 3)):
    """Distinct positive values on every rank (no ties, no zeros)."""
    return _random([7, jc.rank], shape)


def _joined(*outputs):
    """Several outputs as one vector, so that one compiled check covers them all."""
    return jnp.concatenate([y.ravel() for y in outputs])


_NUMBER_OPS = (MPI.SUM, MPI.PROD, MPI.MAX, MPI.MIN)


@pytest.mark.x64
@pytest.mark.mpi
def test_replicated_reductions(jc):
    f = lambda x: _joined(*(jc.allreduce(jnp.sin(x), op=op) for op in _NUMBER_OPS))
    check_ad(jc, f, _data(jc), replicated=True, order=2)


@pytest.mark.x64
@pytest.mark.mpi
def test_reductions_that_transpose_exactly(jc):
    root = jc.size - 1

    def f(x):
        y = jnp.sin(x)
        return _joined(
            *(jc.reduce(y, op=op, root=root) for op in _NUMBER_OPS),
            jc.scan(y),
            jc.exscan(y),
            jc.reduce_scatter(y, tiled=True),
            jc.reduce_scatter(y[: jc.size]),
        )

    check_ad(jc, f, _data(jc, (2 * jc.size, 3)), order=2)


@pytest.mark.x64
@pytest.mark.mpi
def test_replicated_gathers(jc):
    counts = [r % 3 + 1 for r in range(jc.size)]
    root = jc.size - 1

    def f(x):
        y = x**2
        return _joined(
            jc.bcast(y, root=root),
            jc.allgather(y),
            jc.allgather(y, tiled=True),
            jc.allgatherv(y[: counts[jc.rank]], counts),
        )

    check_ad(jc, f, _data(jc, (3, 2)), replicated=True, order=2)


@pytest.mark.x64
@pytest.mark.mpi
def test_gathers_that_transpose_exactly(jc):
    counts = [r % 3 + 1 for r in range(jc.size)]
    matrix = [[(i + 2 * j) % 3 for j in range(jc.size)] for i in range(jc.size)]
    root = jc.size - 1

    def f(x):
        y = x**2
        return _joined(
            jc.gather(y[:2], root=root),
            jc.gather(y, root=root, tiled=True),
            jc.scatter(y[: 2 * jc.size], root=root, tiled=True),
            jc.scatter(y[: jc.size], root=root),
            jc.alltoall(y[: 2 * jc.size], tiled=True),
            jc.gatherv(y[: counts[jc.rank]], counts, root=root),
            jc.scatterv(y[: sum(counts)], counts, root=root),
            jc.alltoallv(y[: sum(matrix[jc.rank])], matrix),
        )

    rows = max(2 * jc.size, sum(counts))
    check_ad(jc, f, _data(jc, (rows, 2)), order=2)


@pytest.mark.x64
@pytest.mark.mpi
@pytest.mark.parametrize("row", params(select(TRANSPOSE)))
def test_transposition_is_an_involution(jc, row):
    op = lambda x: row.call(jc, x)  # noqa: E731
    x = _data(jc, row.shape(jc.size, jc.rank))
    out = jax.eval_shape(op, x)
    transpose = jax.linear_transpose(op, x)
    twice = jax.linear_transpose(lambda ct: transpose(ct)[0], jnp.zeros(out.shape, out.dtype))
    for run in (lambda x: twice(x)[0], jax.jit(lambda x: twice(x)[0])):
        np.testing.assert_allclose(run(x), op(x), rtol=1e-12)


@pytest.mark.x64
@pytest.mark.mpi
def test_sendrecv_ring_in_fori_loop(jc):
    left, right = (jc.rank - 1) % jc.size, (jc.rank + 1) % jc.size

    def f(x):
        step = lambda i, y: jnp.sin(jc.sendrecv(y, y, source=left, dest=right)) * x
        return jax.lax.fori_loop(0, 3, step, x)

    check_ad(jc, f, _data(jc))


@pytest.mark.x64
@pytest.mark.mpi(min_size=2)
def test_send_recv_both_modes(jc):
    # The template x carries a tangent, so the receive takes part in AD.
    def f(x):
        if jc.rank == 0:
            jc.send(x**2, dest=1)
            return x
        if jc.rank == 1:
            return jc.recv(x, source=0, tag=0) * x
        return x

    x = _data(jc)
    t = _random([1, jc.rank], x.shape)
    dy = jax.jit(lambda x, t: jax.jvp(f, (x,), (t,))[1])(x, t)
    numeric = (f(x + EPS * t) - f(x - EPS * t)) / (2 * EPS)
    np.testing.assert_allclose(dy, numeric, rtol=1e-6, atol=1e-7)

    # Reverse mode: rank 1's cotangent of what it received (its own x) goes
    # back to rank 0, whose send of x**2 turns it into 2 * x0 * x1.
    x0, x1 = _random([7, 0], x.shape), _random([7, 1], x.shape)
    want = {0: 1 + 2 * x0 * x1, 1: x0**2}.get(jc.rank, jnp.ones_like(x))
    for grad in (jax.grad(lambda x: jnp.sum(f(x))), jax.jit(jax.grad(lambda x: jnp.sum(f(x))))):
        np.testing.assert_allclose(grad(x), want, rtol=1e-12)


@pytest.mark.mpi
def test_replicated_convention_for_grad(jc):
    """The gradient of a loss of a replicated value is not summed over ranks."""
    x = _data(jc)
    loss = lambda x: jnp.sum(jc.allreduce(x) ** 2)
    total = jc.allreduce(x)
    for grad in (jax.grad(loss), jax.jit(jax.grad(loss))):
        np.testing.assert_allclose(grad(x), 2 * total, rtol=1e-12)
    bcast_loss = lambda x: jnp.sum(jc.bcast(x, root=0) ** 3)
    root_x = jc.bcast(x, root=0)
    want = 3 * root_x**2 if jc.rank == 0 else jnp.zeros_like(x)
    np.testing.assert_allclose(jax.grad(bcast_loss)(x), want, rtol=1e-12)
    # Rows of the Jacobian by VJPs follow the convention; columns by JVPs move
    # every rank's input at once. (jacrev/jacfwd need vmap rules.)
    f = lambda x: jc.allreduce(x)
    v = jnp.arange(3.0)
    _, pull = jax.vjp(f, v)
    rows = [pull(e)[0] for e in jnp.eye(3)]
    columns = [jax.jit(jax.jvp, static_argnums=0)(f, (v,), (e,))[1] for e in jnp.eye(3)]
    np.testing.assert_allclose(np.stack(rows), np.eye(3))
    np.testing.assert_allclose(np.stack(columns, axis=1), jc.size * np.eye(3))
    np.testing.assert_allclose(jax.linear_transpose(f, v)(v)[0], v)


@pytest.mark.x64
@pytest.mark.mpi
@pytest.mark.parametrize("op", ["MAX", "MIN"])
def test_extremum_ties_split_evenly(jc, op):
    x = jnp.array([1.0, 2.0, 3.0]) if jc.rank % 2 == 0 else jnp.array([1.0, 5.0, -1.0])
    holders = np.zeros((jc.size, 3))
    for r in range(jc.size):
        holders[r] = [1.0, 2.0, 3.0] if r % 2 == 0 else [1.0, 5.0, -1.0]
    best = holders.max(0) if op == "MAX" else holders.min(0)
    hit = holders == best
    want = hit[jc.rank] / hit.sum(0)
    grad = jax.grad(lambda x: jnp.sum(jc.allreduce(x, op=getattr(MPI, op))))(x)
    np.testing.assert_allclose(grad, want, rtol=1e-12)


@pytest.mark.mpi
def test_prod_with_zeros(jc):
    # Rank 0 holds a zero in the first element, every rank in the second.
    x = jnp.array([0.0 if jc.rank == 0 else 2.0, 0.0, 3.0])
    values = np.array([[0.0 if r == 0 else 2.0, 0.0, 3.0] for r in range(jc.size)])
    others = np.array([np.prod(np.delete(values, jc.rank, axis=0), axis=0)])[0]
    grad = jax.jit(jax.grad(lambda x: jnp.sum(jc.allreduce(x, op=MPI.PROD))))(x)
    np.testing.assert_allclose(grad, others, rtol=1e-12)
    assert np.all(np.isfinite(grad))


@pytest.mark.mpi
def test_checkpoint_gives_the_same_gradient(jc):
    x = _data(jc, (2 * jc.size,))

    def f(x):
        chunk = jnp.sin(jc.scatter(x, root=0, tiled=True))
        return jnp.sum(jc.allreduce(chunk * jc.alltoall(x, tiled=True)[:2]) ** 2)

    plain = jax.grad(f)(x)
    nothing_saved = jax.checkpoint_policies.nothing_saveable
    for remat in (jax.checkpoint(f), jax.checkpoint(f, policy=nothing_saved)):
        np.testing.assert_allclose(jax.jit(jax.grad(remat))(x), plain, rtol=1e-12)


@pytest.mark.mpi
def test_integer_inputs_need_no_rule(jc):
    n = jnp.arange(3) + jc.rank

    def f(x, n):
        return jnp.sum(x * jc.allreduce(n) + jc.allgather(n).sum(0) * jc.bcast(x, root=0))

    x = jnp.ones(3)
    grad_x, grad_n = jax.jit(jax.grad(f, argnums=(0, 1), allow_int=True))(x, n)
    assert grad_n.dtype == jax.dtypes.float0
    assert np.all(np.isfinite(grad_x))


@pytest.mark.mpi
def test_unsupported_derivatives_raise(jc):
    x = jnp.ones(jc.size)
    with pytest.raises(NotImplementedError, match="scan with MPI.MAX"):
        jax.make_jaxpr(lambda x: jax.jvp(lambda x: jc.scan(x, op=MPI.MAX), (x,), (x,)))(x)
    with pytest.raises(NotImplementedError, match="reduce_scatter with MPI.PROD"):
        jax.make_jaxpr(jax.grad(lambda x: jc.reduce_scatter(x, op=MPI.PROD).sum()))(x)
    ring = lambda x: jc.sendrecv(x, x, source=MPI.ANY_SOURCE, dest=MPI.PROC_NULL)
    with pytest.raises(NotImplementedError, match="ANY_SOURCE"):
        jax.make_jaxpr(jax.linear_transpose(ring, x))(x)


def _laplacian_matvec(jc):
    """1-D Dirichlet Laplacian, rows split across ranks, halos by sendrecv."""
    left = jc.rank - 1 if jc.rank > 0 else MPI.PROC_NULL
    right = jc.rank + 1 if jc.rank < jc.size - 1 else MPI.PROC_NULL

    def matvec(x):
        # Explicit tags: lax.custom_linear_solve transposes the matvec directly.
        from_left = jc.sendrecv(x[-1], x[-1], source=left, dest=right, recvtag=0)
        from_right = jc.sendrecv(x[0], x[0], source=right, dest=left, recvtag=0)
        halo = jnp.zeros_like(x).at[0].add(from_left).at[-1].add(from_right)
        return 2 * x - jnp.roll(x, 1).at[0].set(0) - jnp.roll(x, -1).at[-1].set(0) - halo

    return matvec


def _distributed_cg(jc, matvec, b, iterations):
    dot = lambda u, v: jc.allreduce(jnp.vdot(u, v))

    def step(_, state):
        x, r, p, rr = state
        ap = matvec(p)
        alpha = rr / dot(p, ap)
        x, r = x + alpha * p, r - alpha * ap
        new_rr = dot(r, r)
        return x, r, r + (new_rr / rr) * p, new_rr

    state = (jnp.zeros_like(b), b, b, dot(b, b))
    return jax.lax.fori_loop(0, iterations, step, state)[0]


@pytest.mark.x64
@pytest.mark.mpi
def test_custom_linear_solve_with_distributed_cg(jc):
    rows = 4
    n = rows * jc.size
    matvec = _laplacian_matvec(jc)
    dense = 2 * np.eye(n) - np.eye(n, k=1) - np.eye(n, k=-1)
    mine = slice(rows * jc.rank, rows * (jc.rank + 1))
    b_all = np.random.default_rng(5).uniform(size=n)
    w_all = np.random.default_rng(6).uniform(size=n)
    b, w = jnp.asarray(b_all[mine]), jnp.asarray(w_all[mine])
    # CG is exact in n steps in exact arithmetic.
    solve = lambda mv, b: _distributed_cg(jc, mv, b, n)

    def loss(b):
        # transpose_solve makes JAX transpose the distributed matvec too.
        x = jax.lax.custom_linear_solve(matvec, b, solve, transpose_solve=solve)
        return jnp.vdot(w, x)

    x = jax.jit(lambda b: jax.lax.custom_linear_solve(matvec, b, solve, symmetric=True))(b)
    np.testing.assert_allclose(x, np.linalg.solve(dense, b_all)[mine], rtol=1e-9)
    # Each rank's share of the global loss; the gradient is A^-T w, split the same way.
    grad = jax.jit(jax.grad(loss))(b)
    np.testing.assert_allclose(grad, np.linalg.solve(dense.T, w_all)[mine], rtol=1e-9)
    check_ad(jc, matvec, b)


@pytest.mark.x64
@pytest.mark.mpi
def test_vmap_of_grad_and_jacobians(jc):
    # Transformations compose: per-example gradients through a collective,
    # and full Jacobians by forward and reverse mode (which batch the rules).
    def loss(x):
        return jnp.sum(jnp.sin(jc.allreduce(x)) * x)

    xs = jnp.stack([jnp.arange(3.0) / 7 + b + jc.rank for b in range(4)])
    per_example = jax.vmap(jax.grad(loss))(xs)
    looped = jnp.stack([jax.grad(loss)(x) for x in xs])
    np.testing.assert_allclose(per_example, looped, rtol=1e-12)

    def f(x):
        return jnp.cos(jc.allreduce(x, op=MPI.SUM)) * x

    x = jnp.arange(3.0) / 5 + jc.rank
    forward, reverse = jax.jacfwd(f)(x), jax.jacrev(f)(x)
    s, x = np.asarray(jc.allreduce(x)), np.asarray(x)
    # Forward mode moves every rank's input along the same basis vector, so
    # the sum moves size times as fast; reverse mode takes the replicated sum's
    # cotangent once (docs/autodiff.md).
    np.testing.assert_allclose(forward, np.diag(np.cos(s) - jc.size * x * np.sin(s)), rtol=1e-12)
    np.testing.assert_allclose(reverse, np.diag(np.cos(s) - x * np.sin(s)), rtol=1e-12)
