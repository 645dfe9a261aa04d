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
from operations import COND, GRAD, JIT, JVP, SCAN, VMAP, params, select


def _x(jc, op, salt=0):
    rng = np.random.default_rng([salt, jc.rank])
    return jnp.asarray(rng.uniform(0.5, 1.5, op.shape(jc.size, jc.rank)))


def _loss(jc, op):
    return lambda x: jnp.sum(jnp.sin(op.call(jc, x)))


@pytest.mark.mpi
@pytest.mark.parametrize("op", params(select(JIT)))
def test_jit(jc, op):
    x = _x(jc, op)
    np.testing.assert_allclose(jax.jit(lambda x: op.call(jc, x))(x), op.call(jc, x), rtol=1e-14)


@pytest.mark.mpi
@pytest.mark.parametrize("op", params(select(JVP)))
def test_jvp(jc, op):
    x, t = _x(jc, op), _x(jc, op, salt=1)
    _, tangent = jax.jvp(lambda x: op.call(jc, x), (x,), (t,))
    if op.linear:
        np.testing.assert_allclose(tangent, op.call(jc, t), rtol=1e-14)
    else:
        _, jitted = jax.jit(lambda x, t: jax.jvp(lambda x: op.call(jc, x), (x,), (t,)))(x, t)
        np.testing.assert_allclose(tangent, jitted, rtol=1e-14)


@pytest.mark.mpi
@pytest.mark.parametrize("op", params(select(GRAD)))
def test_grad_and_checkpoint(jc, op):
    x = _x(jc, op)
    loss = _loss(jc, op)
    eager = jax.grad(loss)(x)
    np.testing.assert_allclose(jax.grad(jax.checkpoint(loss))(x), eager, rtol=1e-13)
    # Both jitted gradients from one compiled program: one compile, not two.
    jitted = jax.jit(lambda x: (jax.grad(loss)(x), jax.grad(jax.checkpoint(loss))(x)))(x)
    for got in jitted:
        np.testing.assert_allclose(got, eager, rtol=1e-13)


@pytest.mark.mpi
@pytest.mark.parametrize("op", params(select(VMAP)))
def test_vmap(jc, op):
    fn = lambda x: op.call(jc, x)  # noqa: E731
    xs = jnp.stack([_x(jc, op, salt=s) for s in range(3)])
    looped = jnp.stack([fn(x) for x in xs])
    np.testing.assert_allclose(jax.vmap(fn)(xs), looped, rtol=1e-14)
    np.testing.assert_allclose(jax.jit(jax.vmap(fn))(xs), looped, rtol=1e-14)


@pytest.mark.mpi
@pytest.mark.parametrize("op", params(select(SCAN, COND)))
def test_scan_and_cond(jc, op):
    fn = lambda x: op.call(jc, x)  # noqa: E731
    xs = jnp.stack([_x(jc, op, salt=s) for s in range(2)])
    direct = [fn(x) for x in xs]

    @jax.jit
    def scanned(xs):
        return jax.lax.scan(lambda c, x: (c, fn(x)), 0.0, xs)[1]

    np.testing.assert_allclose(scanned(xs), jnp.stack(direct), rtol=1e-14)

    out = jax.eval_shape(fn, xs[0])

    @jax.jit
    def branch(flag, x):
        return jax.lax.cond(flag, fn, lambda x: jnp.zeros(out.shape, out.dtype), x)

    np.testing.assert_allclose(branch(True, xs[0]), direct[0], rtol=1e-14)
    np.testing.assert_array_equal(branch(False, xs[0]), np.zeros(out.shape))
