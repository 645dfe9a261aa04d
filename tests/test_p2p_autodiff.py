"""Derivatives of send, recv and sendrecv when tags or sources are selected or wildcards.

The messages of a derivative must pair up exactly as the forward messages
did: a cotangent goes back with the tag its message came with, and a tangent
comes from the source and tag its primal actually came from.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI


def _maybe_jit(f, jit):
    return jax.jit(f) if jit else f


def _tags_out_of_order(jc, x):
    """Rank 0 sends x[0] with tag 1 and x[1] with tag 2; rank 1 receives tag 2 first."""
    if jc.rank == 0:
        jc.send(x[0], 1, tag=1)
        jc.send(x[1], 1, tag=2)
        return jnp.sum(x * 0)
    if jc.rank == 1:
        y2 = jc.recv(x[0], source=0, tag=2)
        y1 = jc.recv(x[0], source=0, tag=1)
        return 1 * y2 + 100 * y1
    return jnp.sum(x * 0)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_grad_follows_tags_not_send_order(jc, jit):
    grad = _maybe_jit(jax.grad(lambda x: _tags_out_of_order(jc, x)), jit)
    got = grad(jnp.array([3.0, 5.0]))
    want = [100.0, 1.0] if jc.rank == 0 else [0.0, 0.0]
    np.testing.assert_array_equal(got, want)
    jc.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_sendrecv_grad_follows_tags(jc, jit):
    # Ranks 0 and 1 swap two values each with sendrecv; rank 1 takes the
    # message tagged 2 first, so rank 0's sends match rank 1's receives out
    # of program order, and the cotangents must come back by tag.
    def f(x):
        if jc.rank == 0:
            a = jc.sendrecv(x[0], x[0], source=1, dest=1, sendtag=1, recvtag=3)
            b = jc.sendrecv(x[1], x[1], source=1, dest=1, sendtag=2, recvtag=4)
            return 1000 * a + 10000 * b
        if jc.rank == 1:
            a = jc.sendrecv(x[0], x[0], source=0, dest=0, sendtag=3, recvtag=2)
            b = jc.sendrecv(x[1], x[1], source=0, dest=0, sendtag=4, recvtag=1)
            return 1 * a + 100 * b
        return jnp.sum(x * 0)

    grad = _maybe_jit(jax.grad(f), jit)
    got = grad(jnp.array([3.0, 5.0]))
    want = {0: [100.0, 1.0], 1: [1000.0, 10000.0]}.get(jc.rank, [0.0, 0.0])
    np.testing.assert_array_equal(got, want)
    jc.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_grad_of_wildcard_receives(jc, jit):
    # Every rank but 0 sends its x to rank 0 with tag = its rank; rank 0
    # receives them from MPI.ANY_SOURCE with MPI.ANY_TAG and weighs each by
    # the source its status reports. Each sender's gradient is its own weight.
    def f(x):
        if jc.rank == 0:
            total = jnp.zeros(())
            for _ in range(1, jc.size):
                y, status = jc.recv(x, return_status=True)
                total = total + jnp.sum(y) * jax.lax.stop_gradient(status[0]).astype(x.dtype)
            return total
        jc.send(x, 0, tag=jc.rank)
        return jnp.sum(x * 0)

    grad = _maybe_jit(jax.grad(f), jit)
    got = grad(jnp.arange(3.0) + jc.rank)
    np.testing.assert_array_equal(got, np.full(3, float(jc.rank)))
    jc.barrier()


@pytest.mark.mpi(min_size=3)
def test_jvp_tangent_comes_from_the_primal_source(jc):
    # Ranks 1 and 2 send x (tangent 10 * x) to rank 0, which receives both
    # from MPI.ANY_SOURCE. jax.linearize runs the primal messages first and
    # the tangent messages when the linear function is called, so the
    # tangents can be made to arrive in the other order than the primals:
    # a tangent receive that matched any source would pair them wrongly.
    world = MPI.COMM_WORLD
    x = jnp.full(3, float(jc.rank))
    if jc.rank in (1, 2):

        def send(x):
            jc.send(x, 0, tag=7)
            return x

        _, tangent_of = jax.linearize(send, x)
    if jc.rank == 0:
        receive = lambda x: (jc.recv(x, tag=7), jc.recv(x, tag=7))
        primals, tangent_of = jax.linearize(receive, x)
    # Rank 0 names the sender whose primal came first; that sender's tangent
    # goes out last.
    first = world.bcast(int(primals[0][0]) if jc.rank == 0 else None, root=0)
    last = 3 - first
    if jc.rank == last:
        tangent_of(10 * x)
        jc.sync()  # the tangent's send has run before the barrier
    world.barrier()
    if jc.rank == first:
        tangent_of(10 * x)
    if jc.rank == 0:
        tangents = tangent_of(x)
        for primal, tangent in zip(primals, tangents):
            np.testing.assert_array_equal(tangent, 10 * primal)
        assert sorted(int(p[0]) for p in primals) == [1, 2]
    jc.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_jvp_of_wildcard_receives(jc, jit):
    # Every rank but 0 sends rank * ones with tangent 10 * rank; rank 0
    # receives from any source with any tag: each tangent matches its primal.
    def f(x):
        if jc.rank == 0:
            return jnp.stack([jc.recv(x) for _ in range(1, jc.size)])
        jc.send(x, 0, tag=jc.rank)
        return jnp.stack([x] * (jc.size - 1))

    jvp = _maybe_jit(lambda x, t: jax.jvp(f, (x,), (t,)), jit)
    x = jnp.full(2, float(jc.rank))
    primals, tangents = jvp(x, 10 * x)
    np.testing.assert_array_equal(tangents, 10 * primals)
    if jc.rank == 0:
        assert sorted(int(p[0]) for p in primals) == list(range(1, jc.size))
    jc.barrier()  # no rank's next message reaches a wildcard receive here


@pytest.mark.mpi(min_size=2)
def test_sendrecv_jvp_with_wildcards(jc):
    # A ring where every rank receives from MPI.ANY_SOURCE with MPI.ANY_TAG.
    right, left = (jc.rank + 1) % jc.size, (jc.rank - 1) % jc.size

    def f(x):
        return jc.sendrecv(x, x, source=MPI.ANY_SOURCE, dest=right, sendtag=jc.rank)

    x = jnp.full(2, float(jc.rank))
    y, t = jax.jit(lambda x, t: jax.jvp(f, (x,), (t,)))(x, 10 * x + 1)
    np.testing.assert_array_equal(y, np.full(2, float(left)))
    np.testing.assert_array_equal(t, 10 * y + 1)
    jc.barrier()

    # In reverse mode a cotangent comes back to this rank while its peers may
    # still run forward, so the wildcard receive selects its tag.
    def tagged(x):
        return jc.sendrecv(
            x, x, source=MPI.ANY_SOURCE, dest=right, sendtag=100 + jc.rank, recvtag=100 + left
        )

    g = jax.jit(jax.grad(lambda x: jnp.sum(tagged(x) * (jc.rank + 1))))(x)
    np.testing.assert_array_equal(g, np.full(2, float(right + 1)))
    jc.barrier()


def test_linear_transpose_of_wildcard_receive_is_refused(jc):
    x = jnp.ones(3)
    for tag, source in ((MPI.ANY_TAG, 0), (0, MPI.ANY_SOURCE)):
        recv = lambda t, tag=tag, source=source: jc.recv(t, source=source, tag=tag)
        with pytest.raises(NotImplementedError, match="explicit source and tag"):
            jax.make_jaxpr(jax.linear_transpose(recv, x))(x)
    ring = lambda v: jc.sendrecv(v, v, source=MPI.ANY_SOURCE, dest=MPI.PROC_NULL)
    with pytest.raises(NotImplementedError, match="explicit source and recvtag"):
        jax.make_jaxpr(jax.linear_transpose(ring, x))(x)


@pytest.mark.mpi
def test_jacobians_and_vmap_of_wildcard_sendrecv(jc):
    # jacfwd/jacrev batch the derivative messages while the primal and its
    # status stay unbatched; the addressed derivative messages batch alike.
    right, left = (jc.rank + 1) % jc.size, (jc.rank - 1) % jc.size

    def f(x):
        # Cotangents come back to this rank with tag 100 + rank while its
        # peers may still run forward, so the wildcard receive selects its tag.
        return jc.sendrecv(
            x, x, source=MPI.ANY_SOURCE, dest=right, sendtag=100 + jc.rank, recvtag=100 + left
        )

    x = jnp.arange(3.0) + jc.rank
    for jacobian in (jax.jacfwd(f), jax.jacrev(f), jax.jit(jax.jacrev(f))):
        np.testing.assert_array_equal(jacobian(x), np.eye(3))

    def g(x):
        return jc.sendrecv(x, x, source=MPI.ANY_SOURCE, dest=right, sendtag=5, return_status=True)

    ys, statuses = jax.jit(jax.vmap(g))(jnp.stack([x, 2 * x]))
    np.testing.assert_array_equal(ys, np.stack([x - jc.rank + left, 2 * (x - jc.rank + left)]))
    # One message carries the whole batch; vmap repeats its one status.
    assert statuses.tolist() == [[left, 5, 6]] * 2
    jc.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("loop", [False, True], ids=["plain", "in-scan"])
def test_vmap_of_grad_batches_every_transposed_message(jc, loop):
    # The transpose of a send receives into a template it makes, unbatched by
    # nature, while the cotangent its peer sends back depends on the batch:
    # under vmap both must carry the whole batch, also where vmap batches a
    # loop body that was transposed before. (A blocking send to oneself
    # could wait forever: two ranks at least.)
    right, left = (jc.rank + 1) % jc.size, (jc.rank - 1) % jc.size

    def step(v):
        jc.send(v * v, right, tag=3)
        return jc.recv(v, source=left, tag=3) * v

    def loss(v):
        if loop:
            return jax.lax.scan(lambda c, _: (step(c), None), v, None, length=1)[0].sum()
        return step(v).sum()

    data = lambda rank: jnp.stack([jnp.arange(3.0) + rank, jnp.arange(3.0) * 2 - rank])
    grads = jax.jit(jax.vmap(jax.grad(loss)))(data(jc.rank))
    # loss_r = sum(v_left**2 * v_r): d/dv_r = v_left**2 + 2 v_r v_right.
    expected = data(left) ** 2 + 2 * data(jc.rank) * data(right)
    np.testing.assert_allclose(grads, expected)
