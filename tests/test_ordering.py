"""Program order of MPI calls: inside jit, across calls, with plain mpi4py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import backend_compiles, unmonitored
from mpi4py import MPI

import jaxcomm

ROUNDS = 25


def _ordering_program(jc, steps):
    """One jitted function of many independent MPI calls, results all returned.

    No result feeds another call, so only jaxcomm's ordering keeps them in
    program order. Bcast roots rotate (a swap pairs different roots across
    ranks), allreduce shapes differ (a swap mismatches counts), and on two or
    more ranks a relay of sends and receives with one tag runs between them
    (a swap of two receives mixes data; a receive hoisted above rank 0's send
    deadlocks).
    """
    size, rank = jc.size, jc.rank

    @jax.jit
    def program(x):
        out = []
        for step in range(steps):
            kind = step % 3
            if kind == 0:
                out.append(jc.allreduce(x[: step % 5 + 1] + step))
            elif kind == 1:
                out.append(jc.bcast(x + step, root=step % size))
            elif size > 1:
                payload = jnp.full(4, 1000.0 * step)
                if rank == 0:
                    jc.send(payload, 1)
                    out.append(jc.recv(payload, source=size - 1))
                else:
                    got = jc.recv(payload, source=rank - 1)
                    jc.send(got + 1, (rank + 1) % size)
                    out.append(got)
            else:
                out.append(jc.sendrecv(x * step, x, source=0, dest=0))
        return out

    def expected(x):
        want = []
        for step in range(steps):
            kind = step % 3
            if kind == 0:
                want.append(np.full(step % 5 + 1, sum(range(size)) + size * step))
            elif kind == 1:
                want.append(np.full_like(x, float(step % size) + step))
            elif size > 1:
                hops = size - 1 if rank == 0 else rank - 1
                want.append(np.full(4, 1000.0 * step + hops))
            else:
                want.append(x * step)
        return want

    return program, expected


@pytest.mark.mpi
def test_many_independent_calls_stay_in_program_order(jc):
    program, expected = _ordering_program(jc, steps=30)
    x = np.full(6, float(jc.rank))
    for _ in range(ROUNDS):
        got = program(jnp.asarray(x))
        for step, (g, w) in enumerate(zip(got, expected(x))):
            np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"step {step}")


@pytest.mark.mpi
def test_successive_jitted_calls_keep_order(jc):
    # Two different compiled functions, dispatched asynchronously in turn,
    # with no data flowing between them.
    right, left = (jc.rank + 1) % jc.size, (jc.rank - 1) % jc.size
    first = jax.jit(lambda v: jc.sendrecv(v, v, source=left, dest=right))
    second = jax.jit(lambda v: jc.bcast(v * 2, root=0))
    results = []
    for i in range(40):
        fn = first if i % 2 == 0 else second
        results.append(fn(jnp.full(3, float(i * 10 + jc.rank))))
    for i, r in enumerate(results):
        want = i * 10 + left if i % 2 == 0 else 2 * i * 10
        np.testing.assert_array_equal(np.asarray(r), np.full(3, float(want)))


@pytest.mark.mpi(min_size=2)
def test_dropped_results_still_communicate(jc):
    @jax.jit
    def fire_and_forget(x):
        if jc.rank == 0:
            for dest in range(1, jc.size):
                jc.send(x + dest, dest, tag=dest)
        return x * 0

    fire_and_forget(jnp.arange(3.0))
    if jc.rank != 0:
        got = jc.recv(jnp.zeros(3), source=0, tag=jc.rank)
        np.testing.assert_array_equal(got, np.arange(3.0) + jc.rank)
    jc.barrier()


@unmonitored
@pytest.mark.mpi
def test_eager_calls_reuse_compiled_code(jc):
    x = jnp.ones((4, 4))
    jc.allreduce(x)  # may compile
    jc.bcast(x, root=0)
    with backend_compiles() as compiles:
        for _ in range(20):
            jc.allreduce(x).block_until_ready()
            jc.bcast(x, root=0).block_until_ready()
    assert compiles == []
    # A new shape must compile: the listener does see compilations.
    with backend_compiles() as compiles:
        jc.allreduce(jnp.ones((5, 7, 3)))
    assert len(compiles) >= 1


@pytest.mark.mpi(min_size=2)
def test_mixing_with_plain_mpi4py_while_jitted_work_is_in_flight(jc):
    world = MPI.COMM_WORLD
    size, rank = jc.size, jc.rank

    @jax.jit
    def jaxcomm_traffic(x):
        # Same peers and tags as the mpi4py messages below, on jaxcomm's clone.
        if rank == 0:
            for dest in range(1, size):
                jc.send(x + dest, dest, tag=0)
            return jc.allreduce(x)
        got = jc.recv(x, source=0, tag=0)
        return jc.allreduce(got)

    x = jnp.arange(1000.0)
    pending = jaxcomm_traffic(x)  # dispatched, maybe still running
    if rank == 0:
        for dest in range(1, size):
            world.send(("plain", dest), dest=dest, tag=0)
    else:
        assert world.recv(source=0, tag=0) == ("plain", rank)
    assert world.allreduce(rank) == sum(range(size))
    want = size * np.arange(1000.0) + sum(range(1, size))  # x on rank 0, x + r elsewhere
    np.testing.assert_array_equal(pending, want)
    jaxcomm.sync()
    world.Barrier()


@pytest.mark.mpi
def test_sync_waits_for_dispatched_work(jc):
    @jax.jit
    def chain(x):
        for _ in range(10):
            x = jc.allreduce(x) / jc.size
        return x

    outs = [chain(jnp.full(10_000, float(i))) for i in range(5)]
    jaxcomm.sync()
    assert all(o.is_ready() for o in outs)
    jc.sync()
