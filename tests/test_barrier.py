"""barrier: eager, jitted and ordered with other calls."""

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mpi_debug
from mpi4py import MPI

import jaxcomm


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


B, A = "MPI_Barrier", "MPI_Allreduce"


def _fenced_sum(jc, x):
    jc.barrier()
    y = jc.allreduce(x)
    jc.barrier()
    return y


PROGRAMS = (
    "eager",
    "jit",
    "jit-barrier-only",
    "jit-barriers-without-data",
    "jit-interleaved",
    "vmap",
    "fori_loop",
    "fori_loop-barrier-only",
    "while_loop-barrier-only",
    "scan",
    "cond-true",
    "cond-false",
)


def _programs(jc):
    """name -> (function of x, times to call it, the MPI calls each call must
    log in order, its result as a multiple of x).

    Several barriers' results feed nothing, so only their effect keeps them
    in the program and in order.
    """
    size = jc.size

    def barrier_only(x):
        jc.barrier()
        return x

    def interleaved(x):
        # Independent calls: XLA may run unordered ones in any order, or at once.
        sums = []
        for i in range(8):
            jc.barrier()
            sums.append(jc.allreduce(x + i))
        return sums[0]

    def fori(x):
        def body(i, y):
            jc.barrier()
            return jc.allreduce(y) / size

        return jax.lax.fori_loop(0, 3, body, x)

    def fori_barrier_only(x):
        return jax.lax.fori_loop(0, 3, lambda i, y: (jc.barrier(), y + 1)[1], x)

    def while_barrier_only(x):
        def body(carry):
            jc.barrier()
            return carry[0] + 1, carry[1]

        return jax.lax.while_loop(lambda c: c[0] < 2, body, (0, x))[1]

    def scan(x):
        def body(c, y):
            jc.barrier()
            return c, jc.allreduce(y)

        return jax.lax.scan(body, 0, jnp.stack([x, x]))[1][1]

    def cond(flag):
        def branch(flag):
            def barrier_and_sum(x):
                jc.barrier()
                return jc.allreduce(x)

            return lambda x: jax.lax.cond(flag, barrier_and_sum, jc.allreduce, x)

        def barrier_or_not(x):
            return jax.lax.cond(flag, barrier_only, lambda x: x, x)

        return lambda x: (branch(flag)(x), barrier_or_not(x))[0]

    return {
        "eager": (lambda x: _fenced_sum(jc, x), 1, [B, A, B], size),
        "jit": (jax.jit(lambda x: _fenced_sum(jc, x)), 3, [B, A, B], size),
        "jit-barrier-only": (jax.jit(barrier_only), 3, [B], 1),
        "jit-barriers-without-data": (
            jax.jit(lambda x: (jc.barrier(), jc.barrier(), x)[2]),
            2,
            [B, B],
            1,
        ),
        "jit-interleaved": (jax.jit(interleaved), 3, [B, A] * 8, size),
        "vmap": (jax.jit(jax.vmap(lambda x: _fenced_sum(jc, x))), 2, [B, A, B], size),
        "fori_loop": (jax.jit(fori), 2, [B, A] * 3, 1),
        "fori_loop-barrier-only": (jax.jit(fori_barrier_only), 2, [B] * 3, 4),
        "while_loop-barrier-only": (jax.jit(while_barrier_only), 2, [B] * 2, 1),
        "scan": (jax.jit(scan), 2, [B, A] * 2, size),
        "cond-true": (jax.jit(cond(True)), 2, [B, A, B], size),
        "cond-false": (jax.jit(cond(False)), 2, [A], size),
    }


def _logged_calls(err):
    """The MPI calls in the kernels' debug log, in order: ``['MPI_Barrier', ...]``."""
    calls = []
    for line in err.splitlines():
        match = re.fullmatch(r"r\d+ \| (MPI_\w+).*", line)
        if match:
            calls.append(match.group(1))
    return calls


@pytest.mark.mpi
@pytest.mark.parametrize("name", PROGRAMS)
def test_barriers_are_kept_and_ordered(jc, capfd, name):
    fn, calls, want, factor = _programs(jc)[name]
    x = jnp.ones(2)
    capfd.readouterr()
    with mpi_debug():
        for _ in range(calls):
            out = jax.block_until_ready(fn(x))
        jaxcomm.sync()
    assert _logged_calls(capfd.readouterr().err) == want * calls
    np.testing.assert_array_equal(out, np.full(2, factor))


@pytest.mark.mpi
def test_barrier_returns_none(jc):
    assert jc.barrier() is None
