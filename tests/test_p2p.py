"""send, recv, sendrecv: dtypes, shapes, status, jit, control flow, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    ALL_DTYPES,
    SHAPES,
    backend_compiles,
    not_reported_again,
    rank_data,
    unchanged,
    unmonitored,
)
from mpi4py import MPI


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_send_recv_eager_with_status(jc, dtype):
    # Rank 0 sends to every other rank with tag = destination.
    shape = (2, 5)
    if jc.rank == 0:
        x = rank_data(0, shape, dtype)
        original = x.copy()
        for dest in range(1, jc.size):
            assert jc.send(x, dest, tag=dest) is None
        unchanged(x, original)
    else:
        template = jnp.zeros(shape, dtype)
        status = MPI.Status()
        y = jc.recv(template, source=0, status=status)
        np.testing.assert_array_equal(np.asarray(y), rank_data(0, shape, dtype))
        assert (status.source, status.tag) == (0, jc.rank)
        assert status.Get_count(MPI.BYTE) == y.nbytes
        unchanged(template, np.zeros(shape, dtype))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_send_recv_jit_any_source_status(jc, shape):
    send = jax.jit(lambda v: jc.send(v, 0, tag=7))
    recv = jax.jit(lambda t: jc.recv(t, return_status=True))
    if jc.rank == 0:
        sources = set()
        for _ in range(1, jc.size):
            y, (source, tag, count) = recv(jnp.zeros(shape, jnp.int32))
            sources.add(int(source))
            assert (tag, count) == (7, int(np.prod(shape)))
            np.testing.assert_array_equal(y, rank_data(int(source), shape, np.int32))
        assert sources == set(range(1, jc.size))
    else:
        send(jnp.asarray(rank_data(jc.rank, shape, np.int32)))
    jc.barrier()


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_sendrecv_ring(jc, dtype):
    right, left = (jc.rank + 1) % jc.size, (jc.rank - 1) % jc.size
    x = rank_data(jc.rank, (4, 3), dtype)
    original = x.copy()
    status = MPI.Status()
    y = jc.sendrecv(x, x, source=left, dest=right, sendtag=jc.rank, status=status)
    np.testing.assert_array_equal(np.asarray(y), rank_data(left, (4, 3), dtype))
    assert (status.source, status.tag) == (left, left)
    unchanged(x, original)
    y = jax.jit(lambda v: jc.sendrecv(v, v, source=right, dest=left))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(y), rank_data(right, (4, 3), dtype))


@pytest.mark.mpi
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_sendrecv_shapes_and_proc_null(jc, shape):
    x = jnp.asarray(rank_data(jc.rank, shape, np.float64))
    left = (jc.rank - 1) % jc.size
    y = jax.jit(lambda v: jc.sendrecv(v, v, source=left, dest=(jc.rank + 1) % jc.size))(x)
    np.testing.assert_array_equal(y, rank_data(left, shape, np.float64))
    # A non-periodic shift: the ends talk to MPI.PROC_NULL and keep zeros.
    dest = jc.rank + 1 if jc.rank + 1 < jc.size else MPI.PROC_NULL
    source = jc.rank - 1 if jc.rank > 0 else MPI.PROC_NULL
    z = jc.sendrecv(x + 1, x, source=source, dest=dest)
    want = rank_data(jc.rank - 1, shape, np.float64) + 1 if jc.rank > 0 else np.zeros(shape)
    np.testing.assert_array_equal(z, want)
    np.testing.assert_array_equal(jc.recv(x, source=MPI.PROC_NULL), np.zeros(shape))


@pytest.mark.mpi
def test_p2p_in_fori_loop_and_scan(jc):
    right, left = (jc.rank + 1) % jc.size, (jc.rank - 1) % jc.size

    @jax.jit
    def pass_around(x):
        # After `size` shifts every value is back home, having visited all.
        def body(_, state):
            value, seen = state
            value = jc.sendrecv(value, value, source=left, dest=right)
            return value, seen + value

        return jax.lax.fori_loop(0, jc.size, body, (x, jnp.zeros_like(x)))

    value, seen = pass_around(jnp.full(2, float(jc.rank)))
    np.testing.assert_array_equal(value, np.full(2, float(jc.rank)))
    np.testing.assert_array_equal(seen, np.full(2, float(sum(range(jc.size)))))

    def step(carry, x):
        return carry, jc.sendrecv(x, x, source=left, dest=right, sendtag=3, recvtag=3)

    _, ys = jax.jit(lambda xs: jax.lax.scan(step, 0, xs))(jnp.arange(5) * 10 + jc.rank)
    np.testing.assert_array_equal(ys, np.arange(5) * 10 + left)


@pytest.mark.mpi(min_size=2)
def test_send_recv_chain_in_cond(jc):
    # Rank 0 starts a relay; everybody else forwards. Roles come from a
    # traced predicate, so both cond branches hold MPI calls.
    size = jc.size

    def relay(x, rank):
        def first(v):
            jc.send(v, 1)
            return jc.recv(v, source=size - 1)

        def middle(v):
            got = jc.recv(v, source=(jc.rank - 1) % size)
            jc.send(got + 1, (jc.rank + 1) % size)
            return got

        return jax.lax.cond(rank == 0, first, middle, x)

    out = jax.jit(relay)(jnp.arange(3), jc.rank)
    want = np.arange(3) + (size - 1 if jc.rank == 0 else jc.rank - 1)
    np.testing.assert_array_equal(out, want)


def test_p2p_rejects_bad_arguments(jc):
    x = jnp.zeros(3)
    with pytest.raises(ValueError, match=f"dest={jc.size}"):
        jc.send(x, jc.size)
    with pytest.raises(ValueError, match="dest=-5"):
        jc.send(x, -5)
    with pytest.raises(ValueError, match="tag=-1"):
        jc.send(x, 0, tag=-1)
    with pytest.raises(ValueError, match="tag="):
        jc.send(x, 0, tag=jc.comm.Get_attr(MPI.TAG_UB) + 1)
    with pytest.raises(TypeError, match="dest must be a static Python int"):
        jax.jit(lambda d: jc.send(x, d))(0)
    with pytest.raises(TypeError, match="tag must be an int"):
        jc.send(x, 0, tag="a")
    with pytest.raises(ValueError, match=f"source={jc.size}"):
        jc.recv(x, source=jc.size)
    with pytest.raises(TypeError, match="status must be an MPI.Status"):
        jc.recv(x, source=0, status=object())
    with pytest.raises(ValueError, match="same shape and dtype"):
        jc.sendrecv(x, jnp.zeros(4), source=0, dest=0)
    with pytest.raises(ValueError, match="same shape and dtype"):
        jc.sendrecv(x, jnp.zeros(3, jnp.int32), source=0, dest=0)
    with pytest.raises(ValueError, match="dest="):
        jc.sendrecv(x, x, source=0, dest=MPI.ANY_SOURCE)
    with pytest.raises(TypeError, match="sendbuf must be an array"):
        jc.sendrecv(None, x, source=0, dest=0)


@unmonitored
@pytest.mark.mpi(min_size=2)
def test_mpi_failure_is_a_python_exception(jc):
    # Rank 1 receives 10 elements into room for 5: MPI_ERR_TRUNCATE there.
    @jax.jit
    def truncated(x):
        if jc.rank == 0:
            jc.send(x, 1, tag=11)
            return x[:5]
        if jc.rank == 1:
            return jc.recv(x[:5], source=0, tag=11)
        return x[:5]

    if jc.rank == 1:
        # MPICH's standard ABI library words every error "Other MPI error"
        # (its MPI_Error_string reads the standard's codes as its own): the
        # reason is in the error stack's lines below.
        with pytest.raises(RuntimeError, match=r"(?s)MPI_Recv failed on rank 1: .*[Tt]runcat"):
            truncated(jnp.arange(10.0)).block_until_ready()
    else:
        truncated(jnp.arange(10.0)).block_until_ready()
    # The failure is contained: later calls on every rank still work.
    np.testing.assert_array_equal(jc.allreduce(jnp.ones(2)), np.full(2, jc.size))
    if jc.rank == 1:
        not_reported_again()


def _container_sizes(module):
    return {
        name: len(value)
        for name, value in vars(module).items()
        if isinstance(value, (dict, list, set))
    }


@unmonitored
@pytest.mark.mpi
def test_fresh_statuses_compile_once_and_are_not_kept(jc):
    import jaxcomm.comm

    right, left = (jc.rank + 1) % jc.size, (jc.rank - 1) % jc.size
    x = jnp.asarray(rank_data(jc.rank, (4,), np.float32))

    def exchange(status):
        return jc.sendrecv(x, x, source=left, dest=right, sendtag=jc.rank, status=status)

    exchange(MPI.Status())
    before = _container_sizes(jaxcomm.comm)
    with backend_compiles() as compiles:
        for _ in range(50):
            status = MPI.Status()
            y = exchange(status)
            np.testing.assert_array_equal(y, rank_data(left, (4,), np.float32))
            assert (status.source, status.tag, status.Get_count(MPI.FLOAT)) == (left, left, 4)
            assert status.Get_count(MPI.BYTE) == 16
    assert compiles == []
    assert _container_sizes(jaxcomm.comm) == before


@pytest.mark.mpi
def test_returned_statuses_compile_once(jc):
    right, left = (jc.rank + 1) % jc.size, (jc.rank - 1) % jc.size
    x = jnp.asarray(rank_data(jc.rank, (4,), np.float32))
    exchange = jax.jit(
        lambda v: jc.sendrecv(v, v, source=left, dest=right, sendtag=jc.rank, return_status=True)
    )
    exchange(x)
    with backend_compiles() as compiles:
        for _ in range(50):
            y, envelope = exchange(x)
            np.testing.assert_array_equal(y, rank_data(left, (4,), np.float32))
            assert envelope.tolist() == [left, left, 4]
    assert compiles == []


@pytest.mark.mpi(min_size=2)
def test_status_inside_jit_is_returned(jc):
    # Under jit, source and tag of a wildcard receive come back as an array.
    @jax.jit
    def collect(x):
        if jc.rank != 0:
            jc.send(x * jc.rank, 0, tag=10 + jc.rank)
            return x, jnp.zeros((jc.size - 1, 3), jnp.int32)
        received = [jc.recv(x, return_status=True) for _ in range(1, jc.size)]
        total = sum(y for y, _ in received)
        return total, jnp.stack([s for _, s in received]).astype(jnp.int32)

    total, envelopes = collect(jnp.ones(5, jnp.int16))
    if jc.rank == 0:
        np.testing.assert_array_equal(total, np.full(5, sum(range(jc.size))))
        assert sorted(envelopes.tolist()) == [[r, 10 + r, 5] for r in range(1, jc.size)]
    jc.barrier()


@pytest.mark.mpi(min_size=2)
def test_short_message_count_and_zero_tail(jc):
    # MPI lets a message be shorter than the receive buffer: the status says
    # how many elements came, and the rest of the result is zeros.
    if jc.rank == 0:
        jc.send(jnp.arange(1.0, 4.0), 1, tag=5)
    if jc.rank == 1:
        y = jax.jit(lambda t: jc.recv(t, source=0, tag=5, return_status=True))(jnp.full(6, 7.0))
        np.testing.assert_array_equal(y[0], [1.0, 2.0, 3.0, 0.0, 0.0, 0.0])
        assert y[1].tolist() == [0, 5, 3]
    jc.barrier()


@pytest.mark.mpi
def test_proc_null_status(jc):
    status = MPI.Status()
    y = jc.recv(jnp.ones(3), source=MPI.PROC_NULL, status=status)
    np.testing.assert_array_equal(y, np.zeros(3))
    assert (status.source, status.tag, status.Get_count(MPI.DOUBLE)) == (
        MPI.PROC_NULL,
        MPI.ANY_TAG,
        0,
    )
    y, envelope = jc.sendrecv(
        jnp.ones(3), jnp.ones(3), source=MPI.PROC_NULL, dest=MPI.PROC_NULL, return_status=True
    )
    np.testing.assert_array_equal(y, np.zeros(3))
    assert envelope.tolist() == [MPI.PROC_NULL, MPI.ANY_TAG, 0]
