"""vmap: every op gives what a Python loop over the batch gives, in one MPI call.

The loop runs the same op eagerly once per batch member; the vmapped call
must match it and make the MPI calls of one unbatched call for the whole
batch (one, or a start and its wait; counted in the ``JAXCOMM_DEBUG`` log).
The ops are the rows of ``operations.py`` that support vmap.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mpi_debug, rank_data
from operations import BY_ID, VMAP, chain, params, ring, select

import jaxcomm

BATCH = 3


def _ring(jc):
    return ring(jc.rank, jc.size)


def mpi_calls(capfd, thunk):
    """``thunk()``'s result and the MPI calls it made, by name, in order."""
    capfd.readouterr()
    with mpi_debug():
        out = jax.block_until_ready(thunk())
        jaxcomm.sync()
    lines = capfd.readouterr().err.splitlines()
    return out, [line.split(" | ")[1].split()[0] for line in lines if " | MPI_" in line]


def loop(fn, xs):
    """The reference: ``fn`` eagerly on each batch member, stacked."""
    return np.stack([np.asarray(fn(x)) for x in xs])


def batch_data(jc, shape):
    return rank_data(jc.rank, (BATCH, *shape), np.float64)


@pytest.mark.mpi
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("op", params(select(VMAP)))
def test_vmap_is_the_loop_in_one_call(jc, capfd, op, axis):
    fn = partial(op.call, jc)
    xs = batch_data(jc, op.shape(jc.size, jc.rank))
    want = loop(fn, xs)
    got, calls = mpi_calls(capfd, lambda: jax.vmap(fn, in_axes=axis)(np.moveaxis(xs, 0, axis)))
    assert tuple(calls) == op.mpi
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["allgather", "scatter-tiled", "reduce_scatter", "sendrecv"])
def test_out_axes(jc, capfd, name):
    op = BY_ID[name]
    fn = partial(op.call, jc)
    xs = batch_data(jc, op.shape(jc.size, jc.rank))
    want = loop(fn, xs)
    batched = jax.vmap(fn, in_axes=1, out_axes=-1)
    got, calls = mpi_calls(capfd, lambda: batched(np.moveaxis(xs, 0, 1)))
    assert tuple(calls) == op.mpi
    np.testing.assert_array_equal(np.asarray(got), np.moveaxis(want, 0, -1))


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["allgather-tiled", "alltoall", "allreduce"])
def test_nested_vmap(jc, capfd, name):
    op = BY_ID[name]
    fn = partial(op.call, jc)
    xs = rank_data(jc.rank, (2, BATCH, *op.shape(jc.size, jc.rank)), np.float64)
    want = np.stack([loop(fn, x) for x in xs])
    nested = jax.vmap(jax.vmap(fn, in_axes=-1), in_axes=1)
    got, calls = mpi_calls(capfd, lambda: nested(np.moveaxis(xs, (0, 1), (1, -1))))
    assert tuple(calls) == op.mpi
    np.testing.assert_array_equal(np.asarray(got), want)


def _pipeline(jc, x):
    """Ops that reshape the leading axis, one after another, in a loop."""
    gathered = jc.allgather(x, tiled=True)
    exchanged = jc.alltoall(gathered, tiled=True)
    summed = jax.lax.fori_loop(0, 2, lambda i, v: jc.allreduce(v) / jc.size, exchanged)
    return jc.scatter(summed, root=0, tiled=True)


@pytest.mark.mpi
@pytest.mark.parametrize("nesting", ["jit-of-vmap", "vmap-of-jit"])
def test_vmap_and_jit_compose(jc, capfd, nesting):
    fn = partial(_pipeline, jc)
    xs = batch_data(jc, (2, 3))
    want = loop(fn, xs)
    batched = jax.jit(jax.vmap(fn)) if nesting == "jit-of-vmap" else jax.vmap(jax.jit(fn))
    got, calls = mpi_calls(capfd, lambda: batched(xs))
    assert calls == [
        "MPI_Allgather",
        "MPI_Alltoall",
        "MPI_Allreduce",
        "MPI_Allreduce",
        "MPI_Scatter",
    ]
    np.testing.assert_allclose(np.asarray(got), want)


@pytest.mark.mpi
def test_unbatched_operands(jc, capfd):
    # An operand that is the same for every batch member still travels once
    # per member, as in the loop.
    def fn(x, y):
        left, right = _ring(jc)
        return jc.allreduce(x) + jc.allgather(y).sum(0) + jc.sendrecv(y, x, left, right)

    xs, y = batch_data(jc, (4,)), rank_data(jc.rank, (4,), np.float64) + 1
    want = loop(lambda x: fn(x, y), xs)
    got, calls = mpi_calls(capfd, lambda: jax.vmap(fn, in_axes=(0, None))(xs, y))
    assert calls == ["MPI_Allreduce", "MPI_Allgather", "MPI_Sendrecv"]
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.mpi
def test_sendrecv_batched_on_one_side(jc, capfd):
    fn = partial(jc.sendrecv, source=_ring(jc)[0], dest=_ring(jc)[1])
    xs, templates = batch_data(jc, (2,)), np.zeros((BATCH, 2))
    cases = [
        ((0, None), (xs, templates[0]), loop(lambda x: fn(x, templates[0]), xs)),
        ((None, 0), (xs[1], templates), loop(lambda t: fn(xs[1], t), templates)),
    ]
    for in_axes, args, want in cases:
        got, calls = mpi_calls(capfd, lambda: jax.vmap(fn, in_axes=in_axes)(*args))
        assert calls == ["MPI_Sendrecv"]
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.mpi
def test_ranks_batching_alike_with_placeholders(jc, capfd):
    # Only root's data depends on the batch; the other ranks pass batched
    # placeholders (x * 0) and batched templates, so the messages match.
    root = jc.size - 1
    source, dest = _chain(jc)
    xs = batch_data(jc, (jc.size, 2))

    def fn(x):
        data = x if jc.rank == root else x * 0
        jc.send(x, dest)
        return jc.bcast(data, root=root), jc.scatter(data, root=root), jc.recv(x, source)

    got, calls = mpi_calls(capfd, lambda: jax.vmap(fn)(xs))
    assert calls == ["MPI_Send", "MPI_Bcast", "MPI_Scatter", "MPI_Recv"]
    sent = rank_data(root, xs.shape, np.float64)
    np.testing.assert_array_equal(np.asarray(got[0]), sent)
    np.testing.assert_array_equal(np.asarray(got[1]), sent[:, jc.rank])
    received = rank_data(source, xs.shape, np.float64) if jc.rank > 0 else np.zeros(xs.shape)
    np.testing.assert_array_equal(np.asarray(got[2]), received)


@pytest.mark.mpi
def test_unbatched_ops_inside_vmap_stay_unbatched(jc, capfd):
    # A collective on data that does not depend on the batch runs once, on
    # one member's data, and its result is not batched.
    y = jnp.arange(3.0) + jc.rank

    def fn(x):
        return x + jc.allreduce(y)

    xs = batch_data(jc, (3,))
    got, calls = mpi_calls(capfd, lambda: jax.vmap(fn)(xs))
    assert calls == ["MPI_Allreduce"]
    np.testing.assert_array_equal(np.asarray(got), xs + np.asarray(jc.allreduce(y)))
    _, calls = mpi_calls(capfd, lambda: jax.vmap(lambda x: jc.allreduce(y), out_axes=None)(xs))
    assert calls == ["MPI_Allreduce"]


def _chain(jc):
    """Each rank sends right and receives from the left, no wrap-around."""
    return chain(jc.rank, jc.size)


@pytest.mark.mpi
def test_send_recv_batched(jc, capfd):
    source, dest = _chain(jc)
    xs = batch_data(jc, (2, 3))

    def fn(x):
        jc.send(x + 1, dest)
        return jc.recv(x, source)

    got, calls = mpi_calls(capfd, lambda: jax.vmap(fn, in_axes=-1)(np.moveaxis(xs, 0, -1)))
    assert calls == ["MPI_Send", "MPI_Recv"]
    want = rank_data(source, xs.shape, np.float64) + 1 if jc.rank > 0 else np.zeros(xs.shape)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.mpi
def test_batched_message_is_the_stacked_batch(jc, capfd):
    # Whatever axis the sender batched along, the message holds the batch
    # members one after another: an unbatched receiver of the stacked shape
    # gets them.
    source, dest = _chain(jc)
    xs = batch_data(jc, (2, 3))
    send = jax.jit(jax.vmap(lambda x: jc.send(x, dest), in_axes=1))

    def run():
        send(np.moveaxis(xs, 0, 1))
        return jc.recv(np.zeros_like(xs), source)

    got, calls = mpi_calls(capfd, run)
    assert calls == ["MPI_Send", "MPI_Recv"]
    want = rank_data(source, xs.shape, np.float64) if jc.rank > 0 else np.zeros(xs.shape)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.mpi
def test_barrier_under_vmap(jc, capfd):
    def fn(x):
        jc.barrier()
        return x + 1

    xs = batch_data(jc, (2,))
    for batched in (jax.vmap(fn), jax.jit(jax.vmap(fn))):
        got, calls = mpi_calls(capfd, lambda: batched(xs))
        assert calls == ["MPI_Barrier"]
        np.testing.assert_array_equal(np.asarray(got), xs + 1)


@pytest.mark.mpi
def test_pytree_under_vmap(jc, capfd):
    ints = batch_data(jc, ()).astype(np.int32)
    tree = {"a": batch_data(jc, (2,)), "b": [ints, batch_data(jc, (3,))]}
    got, calls = mpi_calls(capfd, lambda: jax.vmap(jc.allreduce)(tree))
    assert calls == ["MPI_Allreduce", "MPI_Allreduce"]  # float64 and int32
    for leaf, out in zip(jax.tree.leaves(tree), jax.tree.leaves(got)):
        want = sum(rank_data(r, leaf.shape, np.float64) for r in range(jc.size)).astype(leaf.dtype)
        np.testing.assert_array_equal(np.asarray(out), want)
