"""Nonblocking operations: isend, irecv, iallreduce, ireduce, iscan, ibcast, iallgather, igather, iscatter, ialltoall, ialltoallv, wait.

Every rule of docs/nonblocking.md has a test here: program order, buffers
kept alive until the wait and read only after it, one wait per request in
the traced function that started it, vmap, derivatives, GPU
staging, the checker and the reports of requests never waited.
"""

import os
import subprocess
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    RUNTIME_ERRORS,
    environment_without_launcher,
    mpiexec,
    not_reported_again,
    rank_data,
    spawns_own_mpi,
    unchanged,
)
from mpi4py import MPI
from operations import GRAD, JVP, params, select

import jaxcomm
from jaxcomm import Request
from jaxcomm.ops import nonblocking

# The CUDA kernels' platform layer over an emulated CUDA runtime
# (tests/cuda_emulation/README.md) runs every test here as well.
EMULATED = os.environ.get("JAXCOMM_EMULATE_CUDA", "") not in ("", "0")

# Large enough that MPICH sends it by rendezvous: the data moves only once
# the receive is posted, long after the start returned.
LARGE = 1 << 18


def _ring(jc):
    return (jc.rank + 1) % jc.size, (jc.rank - 1) % jc.size


def _exchange(jc, x, tag=0):
    """Ring shift of x through irecv/isend: returns what the left neighbour sent."""
    right, left = _ring(jc)
    receiving = jc.irecv(x, source=left, tag=tag)
    sending = jc.isend(x, right, tag=tag)
    y, none = jc.waitall([receiving, sending])
    assert none is None
    return y


# Point to point ------------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize(
    "dtype",
    [
        np.dtype(bool),
        np.dtype("int16"),
        np.dtype(jnp.bfloat16),
        np.dtype("float64"),
        np.dtype("complex64"),
    ],
    ids=str,
)
def test_ring_eager(jc, dtype):
    right, left = _ring(jc)
    x = rank_data(jc.rank, (3, 4), dtype)
    original = x.copy()
    y = _exchange(jc, x, tag=3)
    np.testing.assert_array_equal(np.asarray(y), rank_data(left, (3, 4), dtype))
    unchanged(x, original)


@pytest.mark.mpi
@pytest.mark.parametrize("shape", [(), (0,), (7,), (LARGE,)], ids=str)
def test_ring_jit(jc, shape):
    right, left = _ring(jc)
    x = jnp.asarray(rank_data(jc.rank, shape, np.float32))
    y = jax.jit(lambda v: _exchange(jc, v))(x)
    np.testing.assert_array_equal(y, rank_data(left, shape, np.float32))
    unchanged(x, rank_data(jc.rank, shape, np.float32))


@pytest.mark.mpi
def test_ring_in_loops(jc):
    right, left = _ring(jc)

    @jax.jit
    def pass_around(x):
        # After `size` shifts every value is back home, having visited all.
        def body(_, state):
            value, seen = state
            value = _exchange(jc, value, tag=1)
            return value, seen + value

        return jax.lax.fori_loop(0, jc.size, body, (x, jnp.zeros_like(x)))

    value, seen = pass_around(jnp.full(2, float(jc.rank)))
    np.testing.assert_array_equal(value, np.full(2, float(jc.rank)))
    np.testing.assert_array_equal(seen, np.full(2, float(sum(range(jc.size)))))

    def step(carry, x):
        req = jc.iallreduce(x)
        shifted = _exchange(jc, x, tag=2)
        return carry + jc.wait(req), shifted

    total, ys = jax.jit(lambda xs: jax.lax.scan(step, 0, xs))(jnp.arange(5) * 10 + jc.rank)
    np.testing.assert_array_equal(ys, np.arange(5) * 10 + left)
    assert int(total) == sum(10 * i * jc.size + sum(range(jc.size)) for i in range(5))

    # Both branches start and wait; the predicate is traced, the same on every rank.
    def branch(x, scale):
        return jc.wait(jc.iallreduce(x * scale))

    pick = jax.jit(lambda x, p: jax.lax.cond(p, branch, branch, x, jnp.where(p, 1.0, 2.0)))
    for p in (True, False):
        np.testing.assert_array_equal(
            pick(jnp.full(3, float(jc.rank)), p), np.full(3, (1 if p else 2) * sum(range(jc.size)))
        )


@pytest.mark.mpi
def test_proc_null_and_short_messages(jc):
    req = jc.irecv(jnp.ones(3), source=MPI.PROC_NULL)
    assert jc.wait(jc.isend(jnp.ones(3), MPI.PROC_NULL)) is None
    np.testing.assert_array_equal(jc.wait(req), np.zeros(3))
    right, left = _ring(jc)
    # A message shorter than the receive fills its front; zeros follow.
    req = jc.irecv(jnp.full(6, 7.0), source=left, tag=5)
    jc.wait(jc.isend(jnp.arange(1.0, 4.0) + jc.rank, right, tag=5))
    np.testing.assert_array_equal(jc.wait(req), [1.0 + left, 2.0 + left, 3.0 + left, 0, 0, 0])


@pytest.mark.mpi(min_size=2)
def test_wildcard_receives(jc):
    # Every other rank sends to rank 0, which takes the messages in any order.
    if jc.rank == 0:
        reqs = [jc.irecv(jnp.zeros(4, jnp.int32)) for _ in range(1, jc.size)]
        got = sorted(int(y[0]) for y in jc.waitall(reqs))
        assert got == list(range(1, jc.size))
    else:
        jc.wait(jc.isend(jnp.full(4, jc.rank, jnp.int32), 0, tag=jc.rank))
    jc.barrier()


# Collectives ---------------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_collectives(jc, mode):
    size, rank = jc.size, jc.rank
    x = jnp.asarray(rank_data(rank, (size, 3), np.float32))
    every = np.stack([rank_data(r, (size, 3), np.float32) for r in range(size)])

    def program(x):
        reqs = [
            jc.iallreduce(x),
            jc.iallreduce(x, op=MPI.MAX),
            jc.iallreduce(x.astype(jnp.bfloat16)),
            *[jc.ibcast(x, root=root) for root in range(size)],
            jc.iallgather(x),
            jc.iallgather(x, tiled=True),
            jc.ialltoall(x),
            jc.ialltoall(jnp.concatenate([x, x]), tiled=True),
        ]
        # Waited in another order than started: MPI allows it, and so does jaxcomm.
        return jc.waitall(reqs[::-1])[::-1]

    run = jax.jit(program) if mode == "jit" else program
    out = run(x)
    np.testing.assert_array_equal(out[0], every.sum(0))
    np.testing.assert_array_equal(out[1], every.max(0))
    np.testing.assert_array_equal(out[2].astype(np.float32), every.sum(0))
    for root in range(size):
        np.testing.assert_array_equal(out[3 + root], every[root])
    np.testing.assert_array_equal(out[3 + size], every)
    np.testing.assert_array_equal(out[4 + size], every.reshape(size * size, 3))
    np.testing.assert_array_equal(out[5 + size], every[:, rank])
    doubled = np.concatenate([every, every], axis=1)
    np.testing.assert_array_equal(
        out[6 + size], doubled[:, 2 * rank : 2 * rank + 2].reshape(2 * size, 3)
    )
    unchanged(x, every[rank])


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_rooted_collectives(jc, mode):
    # Every root; MPI leaves the others' results undefined, jaxcomm gives zeros.
    size, rank = jc.size, jc.rank
    x = jnp.asarray(rank_data(rank, (size, 3), np.float32))
    every = np.stack([rank_data(r, (size, 3), np.float32) for r in range(size)])

    def program(x):
        reqs = [
            *[jc.ireduce(x, root=root) for root in range(size)],
            jc.ireduce(x, op=MPI.MAX, root=size - 1),
            *[jc.igather(x, root=root) for root in range(size)],
            jc.igather(x, root=0, tiled=True),
            *[jc.iscatter(x, root=root) for root in range(size)],
            jc.iscatter(x, root=size - 1, tiled=True),
        ]
        return jc.waitall(reqs[::-1])[::-1]

    run = jax.jit(program) if mode == "jit" else program
    out = run(x)
    zeros = np.zeros_like(every[rank])
    for root in range(size):
        np.testing.assert_array_equal(out[root], every.sum(0) if rank == root else zeros)
    np.testing.assert_array_equal(out[size], every.max(0) if rank == size - 1 else zeros)
    for root in range(size):
        gathered = out[size + 1 + root]
        np.testing.assert_array_equal(gathered, every if rank == root else np.zeros_like(every))
    tiled = every.reshape(size * size, 3)
    np.testing.assert_array_equal(out[2 * size + 1], tiled if rank == 0 else np.zeros_like(tiled))
    # Only root's x is read: every rank gets its row of root's.
    for root in range(size):
        np.testing.assert_array_equal(out[2 * size + 2 + root], every[root][rank])
    np.testing.assert_array_equal(out[-1], every[size - 1][rank][None])
    unchanged(x, every[rank])


def _spread(size, rows):
    """Counts matrix: rank i sends rank j its rows k with k % size == (i + j) % size."""
    return [[len(range((i + j) % size, rows, size)) for j in range(size)] for i in range(size)]


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_alltoallv(jc, mode):
    # Uneven blocks, empty ones among them; MPI reads the counts and
    # displacements until the wait, after another collective in between.
    size, rank = jc.size, jc.rank
    matrix = _spread(size, 5)
    none = [0] * size
    x = jnp.asarray(rank_data(rank, (5, 2), np.float32))

    def program(x):
        sendcounts, recvcounts = matrix[rank], [row[rank] for row in matrix]
        requests = [jc.ialltoallv(x, sendcounts, recvcounts), jc.ialltoallv(x[:0], none, none)]
        jc.barrier()
        return jc.waitall(requests), jc.alltoallv(x, matrix)

    run = jax.jit(program) if mode == "jit" else program
    (received, empty), blocking = run(x)
    blocks = [
        np.split(rank_data(i, (5, 2), np.float32), np.cumsum(matrix[i])[:-1])[rank]
        for i in range(size)
    ]
    np.testing.assert_array_equal(received, np.concatenate(blocks))
    np.testing.assert_array_equal(received, blocking)
    assert empty.shape == (0, 2)
    unchanged(x, rank_data(rank, (5, 2), np.float32))


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_prefix_reductions(jc, mode):
    size, rank = jc.size, jc.rank
    x = jnp.asarray(rank_data(rank, (size, 3), np.float32))
    every = np.stack([rank_data(r, (size, 3), np.float32) for r in range(size)])

    def program(x):
        return jc.waitall([jc.iscan(x), jc.iscan(x, op=MPI.MAX), jc.iscan(x.astype(jnp.int32))])

    run = jax.jit(program) if mode == "jit" else program
    total, largest, integers = run(x)
    np.testing.assert_array_equal(total, every[: rank + 1].sum(0))
    np.testing.assert_array_equal(largest, every[: rank + 1].max(0))
    np.testing.assert_array_equal(integers, every[: rank + 1].astype(np.int32).sum(0))
    unchanged(x, every[rank])


@pytest.mark.mpi
def test_scan_is_differentiable_with_sum_only(jc):
    # As the blocking scan, refused before any MPI call, on every rank alike.
    with pytest.raises(NotImplementedError, match="iscan with MPI.PROD"):
        jax.grad(lambda v: jc.wait(jc.iscan(v, op=MPI.PROD)).sum())(jnp.ones(3))


@pytest.mark.mpi
def test_mixed_with_blocking_calls_in_program_order(jc):
    right, left = _ring(jc)

    @jax.jit
    def program(x):
        first = jc.iallreduce(x)
        blocking = jc.allreduce(x * 2)
        second = jc.irecv(x, source=left, tag=9)
        jc.barrier()
        jc.send(x * 3, right, tag=9)  # blocking, while an irecv is posted
        return jc.wait(first), blocking, jc.wait(second)

    one, two, three = program(jnp.full(3, float(jc.rank)))
    total = float(sum(range(jc.size)))
    np.testing.assert_array_equal(one, np.full(3, total))
    np.testing.assert_array_equal(two, np.full(3, 2 * total))
    np.testing.assert_array_equal(three, np.full(3, 3.0 * left))


# Buffers: alive until the wait, read only after it ---------------------------------


@pytest.mark.mpi
def test_send_buffer_is_kept_until_the_wait(jc):
    # x is dead after the isend but for the wait that keeps it. Were it
    # not kept, XLA would give the elementwise results x's buffer, and the
    # message (moved only once the peer's receive is posted) would carry them.
    right, left = _ring(jc)

    @jax.jit
    def program(seed):
        x = jnp.arange(LARGE, dtype=jnp.float32) + seed
        sending = jc.isend(x, right, tag=4)
        scribble = jnp.sin(x) * 0 - 1.0
        scribble = scribble * 2 + jnp.cos(scribble)
        receiving = jc.irecv(jnp.zeros(LARGE, jnp.float32), source=left, tag=4)
        jc.wait(sending)
        return jc.wait(receiving), scribble

    y, _ = program(float(jc.rank))
    np.testing.assert_array_equal(y, np.arange(LARGE, dtype=np.float32) + left)


@pytest.mark.mpi
def test_received_buffer_is_read_after_the_wait(jc):
    # Each iteration receives new values into a buffer whose result feeds
    # the carry; a read before the wait would see the last iteration's
    # values, zeros or garbage.
    right, left = _ring(jc)

    def body(i, total):
        receiving = jc.irecv(jnp.zeros(LARGE, jnp.float32), source=left, tag=6)
        busy = jnp.tanh(total[:16]).sum()  # work between start and wait
        sending = jc.isend(jnp.full(LARGE, 1000.0 * i + jc.rank, jnp.float32), right, tag=6)
        y = jc.wait(receiving)
        jc.wait(sending)
        return total + y + busy * 0

    total = jax.jit(lambda t: jax.lax.fori_loop(0, 4, body, t))(jnp.zeros(LARGE, jnp.float32))
    np.testing.assert_array_equal(total, np.full(LARGE, 6000.0 + 4 * left, np.float32))


@pytest.mark.mpi
def test_eager_receive_buffer_is_donated_not_copied(jc):
    right, left = _ring(jc)
    receiving = jc.irecv(jnp.zeros(LARGE, jnp.float32), source=left, tag=8)
    busy = jnp.ones(1000).sum()
    sending = jc.isend(jnp.full(LARGE, float(jc.rank), jnp.float32), right, tag=8)
    np.testing.assert_array_equal(jc.wait(receiving), np.full(LARGE, float(left)))
    assert jc.wait(sending) is None and receiving.done and float(busy) == 1000


@pytest.mark.mpi
def test_numpy_send_buffer_may_change_before_the_wait(jc):
    # A JAX array made from NumPy may share its memory; isend sends a copy.
    right, left = _ring(jc)
    x = np.full(LARGE, float(jc.rank), np.float32)
    receiving = jc.irecv(np.zeros(LARGE, np.float32), source=left, tag=10)
    sending = jc.isend(x, right, tag=10)
    x[:] = -1
    np.testing.assert_array_equal(jc.wait(receiving), np.full(LARGE, float(left)))
    jc.wait(sending)


@pytest.mark.mpi
def test_wait_refuses_buffers_the_start_was_not_given(jc):
    # The guard behind the rules above: a wait handed another buffer than the
    # one MPI sends from (as a copy by XLA would be) fails instead of letting
    # MPI use memory XLA no longer owns.
    @jax.jit
    def program(x):
        (handle,) = nonblocking.isend_p.bind(x, dest=MPI.PROC_NULL, tag=0, handle=jc._handle)
        nonblocking.wait_send_p.bind(handle, x + 1, handle=jc._handle)
        return x

    with pytest.raises(RUNTIME_ERRORS, match="not the one the start was given"):
        program(jnp.ones(8)).block_until_ready()
    not_reported_again()


# One wait per request, in the function that started it ----------------------------


@pytest.mark.mpi
def test_request_rules_are_enforced_before_any_mpi_call(jc):
    x = jnp.ones(3)
    null = dict(source=MPI.PROC_NULL)
    req = jc.irecv(x, **null)
    jc.wait(req)
    with pytest.raises(RuntimeError, match="waited already"):
        jc.wait(req)
    with pytest.raises(TypeError, match="cannot be returned from or passed into"):
        jax.jit(lambda v: jc.irecv(v, **null))(x)
    with pytest.raises(TypeError, match="carried through a loop"):
        jax.jit(lambda v: jax.lax.fori_loop(0, 2, lambda i, c: c, (v, jc.irecv(v, **null))))(x)
    with pytest.raises(RuntimeError, match="never waited"):
        jax.jit(lambda v: (jc.irecv(v, **null), v)[1])(x)

    def outside_loop(v):
        r = jc.irecv(v, **null)
        return jax.lax.fori_loop(0, 2, lambda i, c: c + jc.wait(r), v)

    with pytest.raises(RuntimeError, match="(waited in another traced function|passed to)"):
        jax.jit(outside_loop)(x)

    def twice(v):
        r = jc.irecv(v, **null)
        return jc.wait(r), jc.wait(r)

    with pytest.raises(RuntimeError, match="waited already"):
        jax.jit(twice)(x)
    eager = jc.irecv(x, **null)
    with pytest.raises(RuntimeError, match="started eagerly"):
        jax.jit(lambda v: jc.wait(eager) + v)(x)
    jc.wait(eager)
    leaked = []
    jax.make_jaxpr(lambda v: (leaked.append(jc.irecv(v, **null)), v)[1])(x)
    # jaxcomm names it where the trace was invalidated, JAX otherwise.
    with pytest.raises(
        (RuntimeError, jax.errors.UnexpectedTracerError), match="(has finished|leaked)"
    ):
        jc.wait(leaked[0])
    with pytest.raises(TypeError, match="jaxcomm Request"):
        jc.wait(x)
    with pytest.raises(TypeError, match="jaxcomm Requests"):
        jc.waitall([x])
    jaxcomm.sync()


@pytest.mark.mpi
def test_dropped_requests_are_reported_once(jc):
    req = jc.isend(jnp.ones(2), MPI.PROC_NULL)
    jaxcomm.sync()  # alive: it may still be waited
    del req
    with pytest.raises(RuntimeError, match=r"1 nonblocking request.*isend to MPI.PROC_NULL"):
        jaxcomm.sync()
    jaxcomm.sync()


@spawns_own_mpi
def test_exit_reports_requests_never_waited(tmp_path):
    script = tmp_path / "unwaited.py"
    script.write_text(
        "import jax.numpy as jnp\n"
        "from mpi4py import MPI\n"
        "from jaxcomm import JaxComm\n"
        "jc = JaxComm(MPI.COMM_WORLD)\n"
        "kept = jc.irecv(jnp.ones(2), source=MPI.PROC_NULL)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        env=environment_without_launcher(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stderr
    assert "never completed" in done.stderr and "irecv from MPI.PROC_NULL" in done.stderr


# JaxComm.during -------------------------------------------------------------------


def _work(a, steps=8):
    return jax.lax.fori_loop(0, steps, lambda i, m: jnp.tanh(m @ m) * 0.5, a)


@pytest.mark.mpi
def test_during_runs_the_computation_between_starts_and_waits(jc):
    right, left = _ring(jc)
    x = jnp.asarray(rank_data(jc.rank, (LARGE,), np.float32))
    a = jnp.full((32, 32), 0.01, jnp.float32)

    def program(x, a):
        requests = [jc.irecv(x, source=left), jc.isend(x, right)]
        c = jc.during(requests, _work, a)
        return jc.waitall(requests)[0], c

    for run in (program, jax.jit(program), jax.vmap(program, in_axes=(None, 0))):
        batched = run is not program and not hasattr(run, "lower")
        y, c = run(x, a[None] if batched else a)
        np.testing.assert_array_equal(y[0] if batched else y, rank_data(left, (LARGE,), np.float32))
        np.testing.assert_allclose(c[0] if batched else c, _work(a), rtol=1e-6)
    # In the compiled program, as XLA schedules it: both starts, the loop, the waits.
    text = jax.jit(program).lower(x, a).compile().as_text()
    order = [text.index(f'"jaxcomm_{name}"') for name in ("irecv", "isend")]
    order += [text.index(" while("), text.index('"jaxcomm_wait_recv"')]
    assert order == sorted(order), order
    with pytest.raises(TypeError, match="during takes jaxcomm Requests"):
        jc.during([x], _work, a)


# Transformations -------------------------------------------------------------------


@pytest.mark.mpi
def test_vmap(jc):
    right, left = _ring(jc)
    xs = jnp.asarray(rank_data(jc.rank, (3, 4), np.float32))

    def exchange_and_reduce(x):
        return _exchange(jc, x), jc.wait(jc.iallreduce(x))

    # in_axes=1: the send buffer is moved into place, and the wait keeps the moved one.
    for in_axes in (0, 1):
        batch = xs if in_axes == 0 else xs.T
        shifted, total = jax.jit(jax.vmap(exchange_and_reduce, in_axes=in_axes))(batch)
        # Either way the members are the rows of xs, and the results stack them.
        np.testing.assert_array_equal(shifted, rank_data(left, (3, 4), np.float32))
        every = sum(rank_data(r, (3, 4), np.float32) for r in range(jc.size))
        np.testing.assert_array_equal(total, every)
    gathered = jax.vmap(lambda x: jc.wait(jc.iallgather(x)))(xs)
    assert gathered.shape == (3, jc.size, 4)
    np.testing.assert_array_equal(gathered[:, jc.rank], xs)


def _unaligned(a):
    """A copy of NumPy array ``a`` at an address no device buffer may share.

    JAX then copies it to a new device buffer every time it is passed in,
    on every rank alike (an aligned array may be shared instead, or not).
    """
    raw = np.zeros(a.nbytes + a.itemsize, np.uint8)
    out = np.frombuffer(raw.data, a.dtype, count=a.size, offset=a.itemsize).reshape(a.shape)
    out[...] = a
    return out


@pytest.mark.mpi
def test_eager_vmap_of_numpy_input(jc):
    # The batch is the NumPy array itself: the start and the wait must see one
    # copy of it, not one each (the wait refused the second as a copy XLA made).
    right, left = _ring(jc)
    xs = rank_data(jc.rank, (3, 4), np.float32)
    every = [rank_data(r, (3, 4), np.float32) for r in range(jc.size)]
    cases = {
        "iallreduce": (lambda x: jc.wait(jc.iallreduce(x)), sum(every)),
        "iallgather": (lambda x: jc.wait(jc.iallgather(x)), np.stack(every, axis=1)),
        "isend/irecv": (partial(_exchange, jc), every[left]),
    }
    failures = []
    for name, (fn, want) in cases.items():
        # Every rank makes every call, whatever fails where: a rank that raised
        # would leave the others waiting in the next collective.
        try:
            got = jax.vmap(fn)(_unaligned(xs))
            np.testing.assert_array_equal(got, want)
        except Exception as error:
            failures.append(f"{name}: {error}")
    everywhere = MPI.COMM_WORLD.allgather(failures)
    assert everywhere == [[]] * jc.size
    unchanged(xs, every[jc.rank])


@pytest.fixture(scope="module")
def grid(jc):
    """A periodic one-axis Cartesian JaxComm over the ranks, for the rows that need one."""
    comm = jaxcomm.JaxComm.from_cart([jc.size], periods=[True])
    yield comm
    comm.free()


@pytest.mark.mpi
@pytest.mark.parametrize("row", params(select(JVP, kind="nonblocking", grid=None)))
def test_eager_derivatives_of_numpy_input(jc, grid, row):
    # Eager jvp and vjp hand the start's and the wait's rules the primal,
    # tangent and cotangent as given: NumPy arrays, which each eager call
    # would copy to a device buffer of its own (the wait refused the second
    # as a copy XLA made, after MPI had read from the first, since freed).
    comm = grid if row.grid else jc
    shape = row.shape(comm.size, comm.rank)
    x = rank_data(comm.rank, shape, np.float64)
    t = rank_data(comm.rank + 1, shape, np.float64) - 2.0
    f = lambda v: row.call(comm, v)  # noqa: E731
    y, y_t = jax.jvp(f, (x,), (t,))
    want, want_t = jax.jit(lambda a, b: jax.jvp(f, (a,), (b,)))(x, t)
    np.testing.assert_allclose(y, want)
    np.testing.assert_allclose(y_t, want_t)
    if GRAD in row.transforms:
        ct = rank_data(comm.rank + 2, np.shape(want), np.float64) - 1.0
        (back,) = jax.vjp(f, x)[1](ct)
        (want_back,) = jax.jit(lambda a, c: jax.vjp(f, a)[1](c))(x, ct)
        np.testing.assert_allclose(back, want_back)
    unchanged(x, rank_data(comm.rank, shape, np.float64))


# Derivatives ---------------------------------------------------------------------
#
# Each nonblocking program against its blocking twin: the same values, tangents
# and gradients, eagerly and under jit. The scale makes every rank's cotangent
# differ, so a cotangent sent to the wrong rank, or not at all, shows.


def _pairs(jc):
    right, left = _ring(jc)
    size = jc.size
    last = size - 1
    tile = lambda v: jnp.tile(v, (size, 1))
    spread = _spread(size, 4)
    return {
        "ring": (
            lambda v: _exchange(jc, v * v, tag=4),
            lambda v: jc.sendrecv(v * v, v, source=left, dest=right, sendtag=4, recvtag=4),
        ),
        "allreduce": (
            lambda v: jc.wait(jc.iallreduce(jnp.sin(v))),
            lambda v: jc.allreduce(jnp.sin(v)),
        ),
        "allreduce-max": (
            lambda v: jc.wait(jc.iallreduce(jnp.sin(v), op=MPI.MAX)),
            lambda v: jc.allreduce(jnp.sin(v), op=MPI.MAX),
        ),
        "allreduce-prod": (
            lambda v: jc.wait(jc.iallreduce(v * v, op=MPI.PROD)),
            lambda v: jc.allreduce(v * v, op=MPI.PROD),
        ),
        "reduce": (
            lambda v: jc.wait(jc.ireduce(jnp.sin(v), root=last)),
            lambda v: jc.reduce(jnp.sin(v), root=last),
        ),
        "reduce-max": (
            lambda v: jc.wait(jc.ireduce(jnp.sin(v), op=MPI.MAX, root=0)),
            lambda v: jc.reduce(jnp.sin(v), op=MPI.MAX, root=0),
        ),
        "scan": (
            lambda v: jc.wait(jc.iscan(jnp.sin(v))),
            lambda v: jc.scan(jnp.sin(v)),
        ),
        "bcast": (
            lambda v: jc.wait(jc.ibcast(v * v, root=last)),
            lambda v: jc.bcast(v * v, root=last),
        ),
        "allgather": (
            lambda v: jc.wait(jc.iallgather(v * v)),
            lambda v: jc.allgather(v * v),
        ),
        "gather": (
            lambda v: jc.wait(jc.igather(v * v, root=last)),
            lambda v: jc.gather(v * v, root=last),
        ),
        "scatter": (
            lambda v: jc.wait(jc.iscatter(tile(v * v), root=last)),
            lambda v: jc.scatter(tile(v * v), root=last),
        ),
        "alltoall": (
            lambda v: jc.wait(jc.ialltoall(tile(v * v))),
            lambda v: jc.alltoall(tile(v * v)),
        ),
        "alltoallv": (
            lambda v: jc.wait(jc.ialltoallv(v * v, spread[jc.rank], [r[jc.rank] for r in spread])),
            lambda v: jc.alltoallv(v * v, spread),
        ),
    }


PAIRS = [
    "ring",
    "allreduce",
    "allreduce-max",
    "allreduce-prod",
    "reduce",
    "reduce-max",
    "scan",
    "bcast",
    "allgather",
    "gather",
    "scatter",
    "alltoall",
    "alltoallv",
]


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("name", PAIRS)
def test_derivatives_match_the_blocking_ops(jc, name, mode):
    nonblocking_op, blocking_op = _pairs(jc)[name]
    x = jnp.arange(1.0, 5.0) * (0.3 + 0.1 * jc.rank)
    t = jnp.linspace(-1.0, 1.0, 4) + jc.rank
    scale = 1.0 + jc.rank

    def loss(op):
        return lambda v: (scale * op(v) ** 2).sum()

    transforms = (
        lambda op, a, b: jax.jvp(op, (a,), (b,)),
        lambda op, a, b: jax.grad(loss(op))(a),
        lambda op, a, b: jax.linearize(op, a)[1](b),
    )

    def both(a, b):
        return [(f(nonblocking_op, a, b), f(blocking_op, a, b)) for f in transforms]

    # Jitted, every transform of both ops is one compiled program: one
    # compile where each transform of each op took one.
    for got, expected in (jax.jit(both) if mode == "jit" else both)(x, t):
        for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
            np.testing.assert_allclose(g, e, rtol=1e-6)


@pytest.mark.mpi
def test_reverse_mode_of_a_symmetric_exchange_does_not_deadlock(jc):
    # Every rank sends a rendezvous-sized message before it receives: blocking
    # sends in the transposed program would wait for each other forever.
    right, left = _ring(jc)
    x = jnp.linspace(0.0, 1.0, LARGE) + jc.rank

    def step(v):
        sending = jc.isend(v * v, right, tag=6)
        receiving = jc.irecv(v, source=left, tag=6)
        y, _ = jc.waitall([receiving, sending])
        return (y * (1.0 + jc.rank)).sum()

    grad = jax.jit(jax.grad(step))(x)
    # d/dv of (v_right^2 * (1 + right)) summed on the right neighbour.
    np.testing.assert_allclose(grad, 2 * x * (1.0 + right), rtol=1e-6)


@pytest.mark.mpi
def test_derivatives_in_loops_under_vmap_and_during(jc):
    right, left = _ring(jc)

    def body(i, v):
        receiving = jc.irecv(v, source=left, tag=8)
        sending = jc.isend(v, right, tag=8)
        total = jc.iallreduce(v)
        inside = jc.during([receiving, sending, total], jnp.sin, v)
        y, _, s = jc.waitall([receiving, sending, total])
        return y * inside + s

    def blocking_body(i, v):
        y = jc.sendrecv(v, v, source=left, dest=right, sendtag=8, recvtag=8)
        return y * jnp.sin(v) + jc.allreduce(v)

    def loss(b):
        return lambda v: (jax.lax.fori_loop(0, 3, b, v) ** 2).sum() * (1.0 + jc.rank)

    data = lambda rank: jnp.linspace(0.1, 0.5, 6) + 0.1 * rank
    x = data(jc.rank)
    np.testing.assert_allclose(
        jax.jit(jax.grad(loss(body)))(x), jax.jit(jax.grad(loss(blocking_body)))(x), rtol=1e-5
    )
    xs = jnp.stack([x, 2 * x, -x])
    np.testing.assert_allclose(
        jax.jit(jax.vmap(jax.grad(loss(body))))(xs),
        jax.jit(jax.vmap(jax.grad(loss(blocking_body))))(xs),
        rtol=1e-5,
    )
    # Second order: forward over reverse.
    hvp = lambda b: jax.jit(lambda v, w: jax.jvp(jax.grad(loss(b)), (v,), (w,))[1])
    np.testing.assert_allclose(hvp(body)(x, x), hvp(blocking_body)(x, x), rtol=1e-5)
    # jax.checkpoint recomputes the forward pass, requests included.
    remat = lambda b: jax.jit(jax.grad(lambda v: (jax.checkpoint(partial(b, 0))(v) ** 2).sum()))
    np.testing.assert_allclose(remat(body)(x), remat(blocking_body)(x), rtol=1e-5)
    # The transpose of the linear ring itself sends every value back.
    (back,) = jax.jit(jax.linear_transpose(partial(_exchange, jc, tag=8), x))(x * (1 + jc.rank))
    np.testing.assert_array_equal(back, data(right) * (1 + right))


@pytest.mark.mpi
def test_integers_ride_along_and_wildcards_are_refused(jc):
    right, left = _ring(jc)

    def mixed(v):
        counts = jc.irecv(jnp.zeros(2, jnp.int32), source=left, tag=9)
        jc.wait(jc.isend(jnp.arange(2, dtype=jnp.int32) + jc.rank, right, tag=9))
        return v * jc.wait(counts).sum()

    grad = jax.jit(jax.grad(lambda v: mixed(v).sum()))(jnp.ones(3))
    np.testing.assert_array_equal(grad, np.full(3, 1 + 2 * left))

    # A wildcard receive: the tangent could match another rank's. Refused on
    # every rank while tracing (every rank receives), before any MPI call.
    def wildcard(v):
        receiving = jc.irecv(v, source=left)
        jc.wait(jc.isend(v, right))
        return jc.wait(receiving).sum()

    for differentiate in (jax.grad, lambda f: jax.jit(jax.grad(f))):
        with pytest.raises(NotImplementedError, match="irecv from MPI.ANY_SOURCE"):
            differentiate(wildcard)(jnp.ones(3))
    np.testing.assert_array_equal(jc.allreduce(jnp.ones(2)), np.full(2, jc.size))


@pytest.mark.mpi
@pytest.mark.skipif(not EMULATED, reason="needs the CUDA kernels (JAXCOMM_EMULATE_CUDA=1)")
def test_gpu_staging_is_held_from_the_start_to_the_wait(jc):
    # On the staging path MPI works on pinned host copies of the device
    # buffers; a request keeps its own until its wait, which copies what
    # arrived to the device. The emulated runtime fills fresh pinned memory
    # with a byte pattern, so a result read from anywhere else fails.
    kernels = jaxcomm._runtime.cuda_kernels
    right, left = _ring(jc)
    x = jnp.asarray(rank_data(jc.rank, (LARGE,), np.float32))
    expected = rank_data(left, (LARGE,), np.float32)
    total = sum(rank_data(r, (LARGE,), np.float32) for r in range(jc.size))
    saved = jaxcomm._gpu._override
    try:
        jaxcomm.set_cuda_aware(False)
        for attempt in range(2):
            held = kernels.staging_held()
            allocations = kernels.host_allocations()
            receiving = jc.irecv(x, source=left, tag=21)
            sending = jc.isend(x, right, tag=21)
            reducing = jc.iallreduce(x)
            jax.block_until_ready([r._id for r in (receiving, sending, reducing)])
            # One block for the receive, one for the send, two for the reduction.
            assert kernels.staging_held() == held + 4
            y, none, reduced = jc.waitall([receiving, sending, reducing])
            assert none is None
            np.testing.assert_array_equal(y, expected)
            np.testing.assert_array_equal(reduced, total)
            assert kernels.staging_held() == held
            if attempt == 1:
                # The blocks given back are reused.
                assert kernels.host_allocations() == allocations
        # A block whose copy to the device a wait queued is reused only once
        # that copy ran: while the runtime says it has not, the two blocks
        # that received (irecv's, iallreduce's result) are passed over and
        # the two that only sent are reused.
        kernels.hold_events(True)
        try:
            allocations = kernels.host_allocations()
            requests = [
                jc.irecv(x, source=left, tag=24),
                jc.isend(x, right, tag=24),
                jc.iallreduce(x),
            ]
            y, _, reduced = jc.waitall(requests)
            assert kernels.host_allocations() == allocations + 2
        finally:
            kernels.hold_events(False)
        np.testing.assert_array_equal(y, expected)
        np.testing.assert_array_equal(reduced, total)
        # Inside a jitted loop, with a receive shorter than its buffer: the
        # tail must come back as zeros, not as the staging block's bytes.
        short = jnp.asarray(rank_data(jc.rank, (5,), np.float32))

        def body(_, carry):
            receiving = jc.irecv(carry, source=left, tag=22)
            sending = jc.isend(short, right, tag=22)
            y, _ = jc.waitall([receiving, sending])
            return y

        out = jax.jit(lambda c: jax.lax.fori_loop(0, 3, body, c))(jnp.full(8, 7.0, jnp.float32))
        np.testing.assert_array_equal(
            out, np.concatenate([rank_data(left, (5,), np.float32), np.zeros(3, np.float32)])
        )
        assert kernels.staging_held() == held
        # The direct path (CUDA-aware MPI) holds nothing: MPI uses the buffers.
        jaxcomm.set_cuda_aware(True)
        requests = [jc.irecv(x, source=left, tag=23), jc.isend(x, right, tag=23)]
        jax.block_until_ready([r._id for r in requests])
        assert kernels.staging_held() == held
        np.testing.assert_array_equal(jc.waitall(requests)[0], expected)
    finally:
        jaxcomm._gpu.apply_data_path(*(saved or (None, "")))


# The checker and the watchdog --------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_checker_passes_good_programs_and_names_bad_messages(jc):
    was_checking = jaxcomm._runtime.checking()
    jaxcomm.set_check(True)
    try:
        right, left = _ring(jc)
        x = jnp.asarray(rank_data(jc.rank, (5,), np.float32))
        np.testing.assert_array_equal(_exchange(jc, x, tag=12), rank_data(left, (5,), np.float32))
        np.testing.assert_array_equal(
            jc.wait(jc.iallreduce(x)), sum(rank_data(r, (5,), np.float32) for r in range(jc.size))
        )
        # Wildcard receives are checked once the message told its sender.
        if jc.rank == 0:
            reqs = [jc.irecv(jnp.zeros(2, jnp.int32)) for _ in range(1, jc.size)]
            assert sorted(int(y[0]) for y in jc.waitall(reqs)) == list(range(1, jc.size))
        else:
            jc.wait(jc.isend(jnp.full(2, jc.rank, jnp.int32), 0, tag=3))
        # Rank 1 expects 3 elements and gets 5: named as a mismatch there.
        if jc.rank == 0:
            jc.wait(jc.isend(jnp.ones(5, jnp.float32), 1, tag=13))
        if jc.rank == 1:
            with pytest.raises(RUNTIME_ERRORS, match="point-to-point mismatch on rank 1"):
                jc.wait(jc.irecv(jnp.zeros(3, jnp.float32), source=0, tag=13)).block_until_ready()
            not_reported_again()
        jc.barrier()
    finally:
        jaxcomm.set_check(was_checking)


@spawns_own_mpi
def test_watchdog_names_the_wait(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(
        "import jax.numpy as jnp\n"
        "from mpi4py import MPI\n"
        "import jaxcomm\n"
        "jc = jaxcomm.JaxComm(MPI.COMM_WORLD)\n"
        "jaxcomm.set_timeout(1.0)\n"
        "if jc.rank == 1:\n"
        "    jc.wait(jc.irecv(jnp.ones(2), source=0, tag=77)).block_until_ready()\n"
        "jc.barrier()\n"
    )
    done = subprocess.run(
        [*mpiexec(2), sys.executable, str(script)],
        env=environment_without_launcher(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode != 0
    assert "wait for irecv from rank 0 (tag 77" in done.stderr, done.stderr


def test_request_repr_and_properties():
    request = Request("isend", None, None, None, None, None, 0)
    assert repr(request) == "<jaxcomm Request isend under way>"
    assert request.op == "isend" and not request.done
