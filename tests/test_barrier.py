"""barrier: eager, jitted and ordered with other calls."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI


@pytest.mark.mpi(min_size=2)
def test_barrier_eager_waits_for_every_rank(jc):
    # Every rank starts together; the last one arrives late, and nobody may
    # leave the barrier before it. Only local clocks are compared.
    delay = 0.5
    MPI.COMM_WORLD.Barrier()
    start = time.monotonic()
    if jc.rank == jc.size - 1:
        time.sleep(delay)
    jc.barrier()
    waited = time.monotonic() - start
    assert waited >= delay / 2


@pytest.mark.mpi
def test_barrier_under_jit_is_kept_and_ordered(jc):
    @jax.jit
    def f(x):
        jc.barrier()
        y = jc.allreduce(x)
        jc.barrier()
        return y

    for _ in range(3):
        np.testing.assert_array_equal(f(jnp.ones(2)), np.full(2, jc.size))


@pytest.mark.mpi
def test_barrier_returns_none(jc):
    assert jc.barrier() is None
