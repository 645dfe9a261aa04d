"""status=: recv and sendrecv fill an MPI.Status eagerly and under every transformation.

In traced code the compiled program writes the Status when its receive
runs, so each test resets the fields to values no message has before the
call and reads them once the result is ready.
"""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import backend_compiles, rank_data
from jax import lax
from mpi4py import MPI

import jaxcomm

STALE = -77


def _stale(status):
    """``status`` with fields no receive can produce, so a test sees what was written."""
    status.Set_source(STALE)
    status.Set_tag(STALE)
    status.Set_error(MPI.ERR_OTHER)
    status.Set_elements(MPI.BYTE, 3)
    return status


def _fields(status):
    return (
        status.Get_source(),
        status.Get_tag(),
        status.Get_error(),
        status.Get_count(MPI.BYTE),
        status.Get_count(MPI.FLOAT),
    )


def _ring(jc):
    return (jc.rank + 1) % jc.size, (jc.rank - 1) % jc.size


def _expected(jc, elements, tag_base=30):
    _, left = _ring(jc)
    return (left, tag_base + left, MPI.SUCCESS, 4 * elements, elements)


# Each transformation of one ring exchange f(x) of 3 float32 elements: the
# function to run, and how many elements the message that carried it had.
def _exchange_under(transform, f, x):
    if transform == "eager":
        return f(x), 3
    if transform == "jit":
        return jax.jit(f)(x), 3
    if transform == "vmap":
        # One message carries the whole batch.
        return jax.vmap(f)(jnp.stack([x, 2 * x])), 6
    if transform == "jit_vmap":
        return jax.jit(jax.vmap(f))(jnp.stack([x, 2 * x, 3 * x])), 9
    if transform == "grad":
        return jax.grad(lambda v: f(v).sum())(x), 3
    if transform == "jit_grad":
        return jax.jit(jax.grad(lambda v: (f(v) ** 2).sum()))(x), 3
    if transform == "jvp":
        return jax.jvp(f, (x,), (jnp.ones_like(x),)), 3
    if transform == "vjp":
        y, pullback = jax.vjp(f, x)
        return pullback(y), 3
    if transform == "checkpoint":
        return jax.grad(lambda v: jax.checkpoint(f)(v).sum())(x), 3
    if transform == "scan":
        return lax.scan(lambda c, _: (f(c), None), x, None, length=3)[0], 3
    if transform == "fori_loop_jit":
        return jax.jit(lambda v: lax.fori_loop(0, 4, lambda i, c: f(c) + 1, v))(x), 3
    if transform == "while_loop":

        def body(carry):
            i, c = carry
            return i + 1, f(c)

        return lax.while_loop(lambda carry: carry[0] < 3, body, (0, x))[1], 3
    if transform == "cond":
        return jax.jit(lambda v: lax.cond(v[0] > -1, f, lambda u: u, v))(x), 3
    raise AssertionError(transform)


TRANSFORMS = [
    "eager",
    "jit",
    "vmap",
    "jit_vmap",
    "grad",
    "jit_grad",
    "jvp",
    "vjp",
    "checkpoint",
    "scan",
    "fori_loop_jit",
    "while_loop",
    "cond",
]


@pytest.mark.mpi
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_sendrecv_fills_the_status_under(jc, transform):
    right, left = _ring(jc)
    status = _stale(MPI.Status())
    x = jnp.asarray(rank_data(jc.rank, (3,), np.float32))

    def f(v):
        return jc.sendrecv(v, v, source=left, dest=right, sendtag=30 + jc.rank, status=status)

    out, elements = _exchange_under(transform, f, x)
    jax.block_until_ready(out)
    assert _fields(status) == _expected(jc, elements)


@pytest.mark.mpi
@pytest.mark.parametrize("transform", ["eager", "jit", "grad", "vmap", "scan", "while_loop"])
def test_recv_fills_the_status_under(jc, transform):
    # Each rank starts sending to its right neighbour, then receives from its
    # left one, from any source with any tag (on one rank, from itself).
    right, _ = _ring(jc)
    status = _stale(MPI.Status())
    x = jnp.asarray(rank_data(jc.rank, (3,), np.float32))

    def f(v):
        sending = jc.isend(v, right, tag=30 + jc.rank)
        y = jc.recv(v, status=status)
        jc.wait(sending)
        return y

    out, elements = _exchange_under(transform, f, x)
    jax.block_until_ready(out)
    assert _fields(status) == _expected(jc, elements)


@pytest.mark.mpi
@pytest.mark.parametrize("order", [(40, 41), (41, 40)])
def test_status_is_written_in_program_order(jc, order):
    # Two messages of different sizes into one Status, both orders, three
    # loop trips each: the Status describes the last receive of the program.
    right, left = _ring(jc)
    size_of = {40: 2, 41: 4}
    status = _stale(MPI.Status())

    def body(i, total):
        sending = [jc.isend(jnp.ones(size_of[tag], jnp.float32), right, tag=tag) for tag in order]
        for tag in order:
            total = total + jc.recv(jnp.zeros(4, jnp.float32), left, tag, status=status)
        jc.waitall(sending)
        return total

    total = jax.jit(lambda: lax.fori_loop(0, 3, body, jnp.zeros(4, jnp.float32)))()
    np.testing.assert_array_equal(total, [6.0, 6.0, 3.0, 3.0])
    last = order[-1]
    assert _fields(status) == (left, last, MPI.SUCCESS, 4 * size_of[last], size_of[last])


@pytest.mark.mpi
def test_compiled_code_writes_the_status_at_each_run_without_recompiling(jc):
    right, left = _ring(jc)
    status = MPI.Status()
    step = jax.jit(
        lambda v: jc.sendrecv(v, v, source=left, dest=right, sendtag=30 + jc.rank, status=status)
    )
    inputs = [jnp.full(3, n, jnp.float32) for n in range(3)]
    step(inputs[0]).block_until_ready()
    with backend_compiles() as compiles:
        for n, x in enumerate(inputs):
            _stale(status)
            np.testing.assert_array_equal(step(x), np.full(3, n, np.float32))
            assert _fields(status) == _expected(jc, 3)
    assert compiles == []


@pytest.mark.mpi
def test_a_status_made_inside_the_traced_function_is_kept_alive(jc):
    # The Status the trace saw is gone from the program's view at once; the
    # compiled code still writes it, so jaxcomm keeps it.
    right, left = _ring(jc)

    @jax.jit
    def step(v):
        return jc.sendrecv(v, v, source=left, dest=right, status=MPI.Status())

    for n in range(3):
        step(jnp.full(2, float(n))).block_until_ready()
        gc.collect()
    jaxcomm.sync()


@pytest.mark.mpi
def test_status_with_proc_null_under_jit(jc):
    status = _stale(MPI.Status())
    y = jax.jit(lambda v: jc.recv(v, source=MPI.PROC_NULL, status=status))(jnp.ones(3))
    np.testing.assert_array_equal(y, np.zeros(3))
    assert (status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE)) == (
        MPI.PROC_NULL,
        MPI.ANY_TAG,
        0,
    )
