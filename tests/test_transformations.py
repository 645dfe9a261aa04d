"""Every op under every transformation: the README's table, one test per cell.

Each cell checks the transformed op against a reference computed without that
transformation: jit against eager, jvp against the op applied to the tangent
(all ops here are linear but MAX, MIN and PROD, whose jitted jvp is compared
with the eager one), grad under jit and under checkpoint against the eager grad,
vmap against a loop, and scan/cond against direct calls. That derivatives are
right in the first place is tested in test_autodiff.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

N = 2  # rows per rank


def _counts(size):
    return tuple(r % 2 + 1 for r in range(size))


def _chain(jc):
    dest = jc.rank + 1 if jc.rank + 1 < jc.size else MPI.PROC_NULL
    source = jc.rank - 1 if jc.rank > 0 else MPI.PROC_NULL
    return source, dest


def _send_recv(jc, x):
    source, dest = _chain(jc)
    jc.send(x, dest)
    return jc.recv(x, source)


# name -> (op applied to x of shape (N * size, 3), linear?)
OPS = {
    "allreduce": (lambda jc, x: jc.allreduce(x), True),
    "allreduce MAX": (lambda jc, x: jc.allreduce(x, op=MPI.MAX), False),
    "allreduce MIN": (lambda jc, x: jc.allreduce(x, op=MPI.MIN), False),
    "allreduce PROD": (lambda jc, x: jc.allreduce(x, op=MPI.PROD), False),
    "reduce": (lambda jc, x: jc.reduce(x, root=jc.size - 1), True),
    "scan": (lambda jc, x: jc.scan(x), True),
    "exscan": (lambda jc, x: jc.exscan(x), True),
    "reduce_scatter": (lambda jc, x: jc.reduce_scatter(x, tiled=True), True),
    "bcast": (lambda jc, x: jc.bcast(x, root=0), True),
    "allgather": (lambda jc, x: jc.allgather(x[:N], tiled=True), True),
    "gather": (lambda jc, x: jc.gather(x[:N], root=0, tiled=True), True),
    "scatter": (lambda jc, x: jc.scatter(x, root=0, tiled=True), True),
    "alltoall": (lambda jc, x: jc.alltoall(x, tiled=True), True),
    "allgatherv": (
        lambda jc, x: jc.allgatherv(x[: _counts(jc.size)[jc.rank]], _counts(jc.size)),
        True,
    ),
    "gatherv": (
        lambda jc, x: jc.gatherv(x[: _counts(jc.size)[jc.rank]], _counts(jc.size), root=0),
        True,
    ),
    "scatterv": (
        lambda jc, x: jc.scatterv(x[: sum(_counts(jc.size))], _counts(jc.size), root=0),
        True,
    ),
    "alltoallv": (
        lambda jc, x: jc.alltoallv(x[: jc.size], [[1] * jc.size] * jc.size),
        True,
    ),
    "sendrecv": (
        lambda jc, x: jc.sendrecv(
            x, x, source=(jc.rank - 1) % jc.size, dest=(jc.rank + 1) % jc.size
        ),
        True,
    ),
    "send/recv": (_send_recv, True),
}


def _x(jc, salt=0):
    rng = np.random.default_rng([salt, jc.rank])
    return jnp.asarray(rng.uniform(0.5, 1.5, (N * jc.size, 3)))


def _loss(jc, op):
    return lambda x: jnp.sum(jnp.sin(op(jc, x)))


@pytest.fixture(params=list(OPS), ids=lambda name: name.replace(" ", "-").replace("/", "-"))
def case(request, jc):
    op, linear = OPS[request.param]
    return request.param, op, linear


@pytest.mark.mpi
def test_jit(jc, case):
    _, op, _ = case
    x = _x(jc)
    np.testing.assert_allclose(jax.jit(lambda x: op(jc, x))(x), op(jc, x), rtol=1e-14)


@pytest.mark.mpi
def test_jvp(jc, case):
    _, op, linear = case
    x, t = _x(jc), _x(jc, salt=1)
    _, tangent = jax.jvp(lambda x: op(jc, x), (x,), (t,))
    if linear:
        np.testing.assert_allclose(tangent, op(jc, t), rtol=1e-14)
    else:
        _, jitted = jax.jit(lambda x, t: jax.jvp(lambda x: op(jc, x), (x,), (t,)))(x, t)
        np.testing.assert_allclose(tangent, jitted, rtol=1e-14)


@pytest.mark.mpi
def test_grad_and_checkpoint(jc, case):
    _, op, _ = case
    x = _x(jc)
    loss = _loss(jc, op)
    eager = jax.grad(loss)(x)
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(x), eager, rtol=1e-13)
    np.testing.assert_allclose(jax.grad(jax.checkpoint(loss))(x), eager, rtol=1e-13)
    np.testing.assert_allclose(jax.jit(jax.grad(jax.checkpoint(loss)))(x), eager, rtol=1e-13)


@pytest.mark.mpi
def test_vmap(jc, case):
    _, op, _ = case
    xs = jnp.stack([_x(jc, salt=s) for s in range(3)])
    looped = jnp.stack([op(jc, x) for x in xs])
    np.testing.assert_allclose(jax.vmap(lambda x: op(jc, x))(xs), looped, rtol=1e-14)
    np.testing.assert_allclose(jax.jit(jax.vmap(lambda x: op(jc, x)))(xs), looped, rtol=1e-14)


@pytest.mark.mpi
def test_scan_and_cond(jc, case):
    _, op, _ = case
    xs = jnp.stack([_x(jc, salt=s) for s in range(2)])
    direct = [op(jc, x) for x in xs]

    @jax.jit
    def scanned(xs):
        return jax.lax.scan(lambda c, x: (c, op(jc, x)), 0.0, xs)[1]

    np.testing.assert_allclose(scanned(xs), jnp.stack(direct), rtol=1e-14)

    out = jax.eval_shape(lambda x: op(jc, x), xs[0])

    @jax.jit
    def branch(flag, x):
        return jax.lax.cond(flag, lambda x: op(jc, x), lambda x: jnp.zeros(out.shape, out.dtype), x)

    np.testing.assert_allclose(branch(True, xs[0]), direct[0], rtol=1e-14)
    np.testing.assert_array_equal(branch(False, xs[0]), np.zeros(out.shape))
