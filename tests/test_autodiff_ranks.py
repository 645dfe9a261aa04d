"""Differentiation where an op's operand depends on the differentiated input on some ranks only.

``y = x if rank == 0 else c`` is everyday MPI code. JAX skips a primitive's
rules when all its tangents are symbolic zeros, which here happens on some
ranks only; jaxcomm must make every rank run the same rules anyway, or the
ranks' derivative messages pair up wrongly or never. Each program is compared
with its twin whose other ranks use ``c + 0 * x``: a numerically zero but
non-symbolic tangent, for which JAX runs every rule on every rank.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from mpi4py import MPI
from operations import GRAD, select

from jaxcomm import JaxComm
from jaxcomm._runtime import mpi_comm
from jaxcomm.ops._base import derivative_comm

# Derivatives are compared to 1e-12.
pytestmark = pytest.mark.x64


def _mine(jc, x, symbolic):
    """x on rank 0; elsewhere a constant, symbolically or only numerically free of x."""
    if jc.rank == 0:
        return x
    c = 0.5 + 0.1 * jnp.arange(x.size, dtype=x.dtype).reshape(x.shape) + jc.rank
    return c if symbolic else c + 0 * x


def _derivatives(f, x, t, ct):
    """jvp, vjp and a forward-over-reverse Hessian-vector product of ``f`` at ``x``."""
    y, dy = jax.jvp(f, (x,), (t,))
    g = lambda x: jax.vjp(f, x)[1](ct)[0]
    return y, dy, g(x), jax.jvp(g, (x,), (t,))[1], jax.vjp(g, x)[1](t)[0]


def _compare(jc, program, x):
    """``program(x, symbolic)``: both twins give the same derivatives, also under jit."""
    t = jnp.asarray(np.random.default_rng([1, jc.rank]).uniform(0.5, 1.5, x.shape))
    ct_shape = jax.eval_shape(lambda x: program(x, False), x).shape
    ct = jnp.asarray(np.random.default_rng(2).uniform(0.5, 1.5, ct_shape))
    run = lambda symbolic: _derivatives(lambda x: program(x, symbolic), x, t, ct)
    # Both twins in one compiled program, one compile instead of two: each
    # twin's messages still pair only among themselves, in the same order.
    want, jitted = jax.jit(lambda x: (run(False), run(True)))(x)
    for got in (run(True), jitted):
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


# name: (op on this rank's y, shape of y from (size, rank)), every
# differentiable operation of the table, nonblocking ones included (for
# ireduce with MPI.MAX the wait's rule makes the tangent with blocking
# collectives, on every rank alike).
_OPS = {op.id: (op.call, op.shape) for op in select(GRAD)}
_OPS["pytree"] = (
    lambda jc, y: jc.allreduce({"a": y, "b": [2 * y[0]]})["b"][0],
    lambda size, rank: (2, 3),
)


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(_OPS), ids=lambda name: name.replace("/", "-"))
def test_operand_independent_of_x_on_other_ranks(jc, name):
    call, shape = _OPS[name]

    def program(x, symbolic):
        y = call(jc, _mine(jc, x, symbolic))
        # A second collective: a derivative call paired with the wrong message
        # would show here.
        return jnp.sin(y) * jc.allreduce(jnp.sum(x**2))

    shape = shape(jc.size, jc.rank)
    _compare(jc, program, jnp.linspace(0.5, 1.5, int(np.prod(shape))).reshape(shape))


_CONTEXTS = {
    "direct": lambda f, y: f(y),
    "inner_jit": lambda f, y: jax.jit(f)(y),
    "fori_loop": lambda f, y: lax.fori_loop(0, 2, lambda i, c: f(c) / 4, y),
    "scan": lambda f, y: lax.scan(lambda c, _: (f(c) / 4, None), y, length=2)[0],
    "cond": lambda f, y: lax.cond(jnp.all(y > -100), f, lambda y: 2 * y, y),
    "checkpoint": lambda f, y: jax.checkpoint(f)(y),
    "vmap": lambda f, y: jax.vmap(f)(jnp.stack([y, 2 * y])).sum(0),
}


@pytest.mark.mpi
@pytest.mark.parametrize("context", sorted(_CONTEXTS))
@pytest.mark.parametrize("op", ["allreduce", "reduce", "sendrecv"])
def test_inside_transformations_and_control_flow(jc, context, op):
    def program(x, symbolic):
        y = _CONTEXTS[context](lambda y: _OPS[op][0](jc, jnp.sin(y)), _mine(jc, x, symbolic))
        return y * jc.allreduce(jnp.sum(x))

    _compare(jc, program, jnp.linspace(0.5, 1.5, 6).reshape(2, 3))


@pytest.mark.mpi
def test_nested_derivatives(jc):
    # Second derivatives by every combination of modes, the inner derivative
    # taken with the operand constant on other ranks.
    def program(x, symbolic):
        inner = lambda x: jnp.sum(jnp.sin(jc.allreduce(_mine(jc, x, symbolic))) * x)
        return jax.grad(inner)(x) + jax.jvp(inner, (x,), (jnp.ones_like(x),))[1]

    _compare(jc, program, jnp.linspace(0.5, 1.5, 3))


@pytest.mark.mpi
def test_operand_free_of_x_on_every_rank_but_one_matches_the_formula(jc):
    # grad of <w, allreduce(y)> with y = x on rank 0 only: w on rank 0 (the
    # replicated value's cotangent), zeros elsewhere.
    w = jnp.arange(3.0)
    loss = lambda x: jnp.vdot(w, jc.allreduce(_mine(jc, x, True)))
    x = jnp.ones(3)
    want = w if jc.rank == 0 else jnp.zeros(3)
    for grad in (jax.grad(loss), jax.jit(jax.grad(loss))):
        np.testing.assert_allclose(grad(x), want)
    dy = jax.jvp(lambda x: jc.allreduce(_mine(jc, x, True)), (x,), (jnp.ones(3),))[1]
    np.testing.assert_allclose(dy, np.ones(3))


@pytest.mark.mpi
def test_derivative_traffic_never_meets_the_programs_messages():
    # Each JaxComm sends its derivative messages on a communicator of its own.
    with JaxComm(MPI.COMM_WORLD) as jc:
        handle = derivative_comm(jc._handle)
        assert handle != jc._handle and derivative_comm(handle) == handle
        assert MPI.Comm.Compare(mpi_comm(handle), jc.comm) == MPI.CONGRUENT


@pytest.mark.mpi
def test_while_loop_in_forward_mode(jc):
    # JAX has no reverse mode for while_loop; forward mode must line up.
    def program(x, symbolic):
        body = lambda c: (c[0] + 1, jnp.sin(jc.allreduce(c[1])))
        y = lax.while_loop(lambda c: c[0] < 2, body, (0, _mine(jc, x, symbolic)))[1]
        return y * jc.allreduce(jnp.sum(x))

    x, t = jnp.linspace(0.5, 1.5, 3), jnp.full(3, 0.25 + jc.rank)
    want = jax.jit(lambda x, t: jax.jvp(lambda x: program(x, False), (x,), (t,)))(x, t)
    for jvp in (jax.jvp, jax.jit(jax.jvp, static_argnums=0)):
        got = jvp(lambda x: program(x, True), (x,), (t,))
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-12)


@pytest.mark.mpi(min_size=2)
def test_receive_into_a_shape_only_template(jc):
    # The template carries no tangent on the receiver; the sender's tangent
    # and cotangent messages must still pair with the receiver's rules.
    def program(x, symbolic):
        template = jax.ShapeDtypeStruct(x.shape, x.dtype)
        if jc.rank == 0:
            jc.send(jnp.sin(x), dest=1, tag=3)
            return x
        if jc.rank == 1:
            got = jc.recv(template if symbolic else x * 0, source=0, tag=3)
            return got * x
        return x

    _compare(jc, program, jnp.linspace(0.5, 1.5, 3))
